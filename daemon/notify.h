/*
 * notify.h: moed under systemd: sd_notify messages (READY, STATUS, WATCHDOG,
 * RELOADING, STOPPING, EXTEND_TIMEOUT_USEC) and socket activation. Every
 * function is a no-op when systemd is absent (no NOTIFY_SOCKET, no
 * LISTEN_FDS), so the daemon runs the same by hand.
 *
 * The order systemd sees: EXTEND_TIMEOUT_USEC while configured layers load,
 * READY=1 once they are loaded and both endpoints listen, then WATCHDOG=1 and
 * STATUS= from the loop's tick; RELOADING=1 ... READY=1 around a SIGHUP
 * reload; STOPPING=1 when SIGTERM starts the drain.
 */
#ifndef MOED_NOTIFY_H
#define MOED_NOTIFY_H

#include <time.h>

#include <stddef.h>
#include <stdint.h>

struct reload;
struct server;

/*
 * The sockets systemd passed (socket activation). Each is matched by its
 * FileDescriptorName= ("session" or "zmq") and checked by type: the session
 * socket is a listening AF_UNIX SOCK_SEQPACKET socket, the ZeroMQ one a
 * listening AF_UNIX SOCK_STREAM socket. Unnamed sockets are matched by type
 * alone. -1 where none was passed. A socket bound elsewhere than
 * runtime_dir/moed.sock or moed.zmq is used but warned about: clients look
 * for it there. Returns 0, or -EINVAL with err saying which socket is wrong;
 * sockets not used are closed.
 */
int notify_listen_fds(const char *runtime_dir, int *session_fd, int *zmq_fd, char *err,
                      size_t errlen);

/* READY=1 with a first STATUS=; reads WATCHDOG_USEC. */
void notify_ready(struct server *s);
/* STOPPING=1: the drain begins. */
void notify_stopping(struct server *s);

/*
 * Start-up and reload loads. While loading is on, a helper thread sends
 * EXTEND_TIMEOUT_USEC= every few seconds for as long as the process makes
 * progress (bytes read from weight files, or CPU time spent by the loading
 * thread: cpu_clock, the clock of the thread that loads, or
 * CLOCK_PROCESS_CPUTIME_ID where nothing else runs), so a large checkpoint
 * can take as long as it needs while a stuck read still runs into
 * TimeoutStartSec=. notify_loading_layer() also extends at once and says in
 * STATUS= which layer is loading.
 */
void notify_loading_begin(clockid_t cpu_clock);
/* How often the helper looks for progress (5 s; tests make it shorter);
 * CPU time counts where it is a tenth of that or more. */
void notify_set_loading_check_us(uint64_t us);
void notify_loading_layer(const char *name, unsigned index, unsigned count);
void notify_loading_end(void);

/* How often notify_tick() should run: half the watchdog interval, at most
 * every two seconds. */
uint64_t notify_tick_interval_us(void);
/*
 * From the loop's timer: WATCHDOG=1 unless the compute worker has been inside
 * one batch for longer than the whole watchdog interval (a hung device); a
 * stuck loop never gets here. STATUS= (layers, sessions, queue depth,
 * requests/s) at most every two seconds.
 */
void notify_tick(struct server *s);

/* SIGHUP: RELOADING=1, then reload_start(); READY=1 when it has finished
 * (not if the daemon began to stop meanwhile). */
void notify_reload(struct server *s, struct reload *r);

#endif
