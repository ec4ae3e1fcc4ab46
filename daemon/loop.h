/*
 * loop.h: the daemon's event loop (epoll). Callbacks for readable fds and
 * periodic timers, and a before-sleep hook that runs before every wait: the
 * request socket is drained and batches are started there, so the loop never
 * sleeps with work it could do.
 *
 * Single-threaded: every function here is called from the loop thread,
 * except loop_stop(), which is safe from any thread and from a signal
 * context (it only marks the loop: the loop notices when it next wakes).
 */
#ifndef MOED_LOOP_H
#define MOED_LOOP_H

#include <stdint.h>

struct loop;
struct loop_watch;

typedef void (*loop_fd_fn)(void *data, int fd, uint32_t events);
typedef void (*loop_hook_fn)(void *data);

/* Caller owns the loop; free with loop_free(). */
int loop_new(struct loop **out);
void loop_free(struct loop **l);

/* Watch fd for events (EPOLLIN, ...); the loop does not own fd. Returns a
 * handle for loop_unwatch(), or NULL with errno set. */
struct loop_watch *loop_watch(struct loop *l, int fd, uint32_t events,
                              loop_fd_fn fn, void *data);
/* Stop watching; safe inside a callback, even the watch's own. *w = NULL. */
/* Change the epoll events a watch waits for; 0 or -errno. */
int loop_watch_events(struct loop *l, struct loop_watch *w, uint32_t events);
void loop_unwatch(struct loop *l, struct loop_watch **w);

/* A periodic timer (first fire after interval_us). Same handle rules. */
struct loop_watch *loop_timer(struct loop *l, uint64_t interval_us,
                              loop_hook_fn fn, void *data);
/* Re-arm a timer: one shot after delay_us when periodic is 0. */
int loop_timer_set(struct loop_watch *w, uint64_t delay_us, uint64_t interval_us);

void loop_set_before_sleep(struct loop *l, loop_hook_fn fn, void *data);

/* Run until loop_stop(); 0, or -errno of a failed wait. */
int loop_run(struct loop *l);
/* One turn: the before-sleep hook, one wait of at most timeout_ms (-1:
 * forever), the callbacks of what became ready. The number of events, or
 * -errno of a failed wait. For tests that drive a loop step by step. */
int loop_run_once(struct loop *l, int timeout_ms);
void loop_stop(struct loop *l);

#endif
