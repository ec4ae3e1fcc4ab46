/*
 * loop.c: see loop.h. A watch removed during dispatch is only marked dead
 * and freed after the current batch of events, because later events of the
 * same epoll_wait may still point at it.
 */
#include "daemon/loop.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "daemon/util.h"

struct loop_watch {
    int fd;
    bool own_fd;  /* timers own their timerfd */
    bool dead;
    loop_fd_fn fd_fn;
    loop_hook_fn timer_fn;
    void *data;
    struct loop_watch *next_dead;
};

struct loop {
    int epfd;
    atomic_bool stop; /* loop_stop: any thread, or a signal handler */
    loop_hook_fn before_sleep;
    void *before_sleep_data;
    struct loop_watch *dead;
};

int loop_new(struct loop **out)
{
    struct loop *l = calloc(1, sizeof(*l));
    if (!l)
        return -ENOMEM;
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (l->epfd < 0) {
        int e = -errno;
        free(l);
        return e;
    }
    *out = l;
    return 0;
}

static void loop_reap(struct loop *l)
{
    while (l->dead) {
        struct loop_watch *w = l->dead;
        l->dead = w->next_dead;
        if (w->own_fd)
            close_fd(&w->fd);
        free(w);
    }
}

void loop_free(struct loop **lp)
{
    struct loop *l = *lp;
    *lp = NULL;
    if (!l)
        return;
    loop_reap(l);
    close_fd(&l->epfd);
    free(l);
}

static struct loop_watch *loop_add(struct loop *l, struct loop_watch *w,
                                   uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = w};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, w->fd, &ev) < 0) {
        int e = errno;
        if (w->own_fd)
            close_fd(&w->fd);
        free(w);
        errno = e;
        return NULL;
    }
    return w;
}

struct loop_watch *loop_watch(struct loop *l, int fd, uint32_t events,
                              loop_fd_fn fn, void *data)
{
    struct loop_watch *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->fd = fd;
    w->fd_fn = fn;
    w->data = data;
    return loop_add(l, w, events);
}

struct loop_watch *loop_timer(struct loop *l, uint64_t interval_us,
                              loop_hook_fn fn, void *data)
{
    struct loop_watch *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (w->fd < 0) {
        free(w);
        return NULL;
    }
    w->own_fd = true;
    w->timer_fn = fn;
    w->data = data;
    if (interval_us && loop_timer_set(w, interval_us, interval_us) < 0) {
        close_fd(&w->fd);
        free(w);
        return NULL;
    }
    return loop_add(l, w, EPOLLIN);
}

int loop_timer_set(struct loop_watch *w, uint64_t delay_us, uint64_t interval_us)
{
    struct itimerspec its = {
        .it_value = {(time_t)(delay_us / 1000000u), (long)(delay_us % 1000000u) * 1000},
        .it_interval = {(time_t)(interval_us / 1000000u), (long)(interval_us % 1000000u) * 1000},
    };
    /* A zero it_value disarms; a requested delay of 0 means "now". */
    if (delay_us == 0)
        its.it_value.tv_nsec = 1;
    return timerfd_settime(w->fd, 0, &its, NULL) < 0 ? -errno : 0;
}

int loop_watch_events(struct loop *l, struct loop_watch *w, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = w};
    return epoll_ctl(l->epfd, EPOLL_CTL_MOD, w->fd, &ev) < 0 ? -errno : 0;
}

void loop_unwatch(struct loop *l, struct loop_watch **wp)
{
    struct loop_watch *w = *wp;
    *wp = NULL;
    if (!w || w->dead)
        return;
    epoll_ctl(l->epfd, EPOLL_CTL_DEL, w->fd, NULL);
    w->dead = true;
    w->next_dead = l->dead;
    l->dead = w;
}

void loop_set_before_sleep(struct loop *l, loop_hook_fn fn, void *data)
{
    l->before_sleep = fn;
    l->before_sleep_data = data;
}

void loop_stop(struct loop *l)
{
    atomic_store(&l->stop, true);
}

int loop_run_once(struct loop *l, int timeout_ms)
{
    struct epoll_event evs[64];
    if (l->before_sleep)
        l->before_sleep(l->before_sleep_data);
    if (atomic_load(&l->stop))
        return 0;
    int n = epoll_wait(l->epfd, evs, (int)ARRAY_SIZE(evs), timeout_ms);
    if (n < 0)
        return errno == EINTR ? 0 : -errno;
    for (int i = 0; i < n; i++) {
        struct loop_watch *w = evs[i].data.ptr;
        if (w->dead)
            continue;
        if (w->timer_fn) {
            uint64_t ticks;
            if (read(w->fd, &ticks, sizeof(ticks)) == sizeof(ticks))
                w->timer_fn(w->data);
        } else {
            w->fd_fn(w->data, w->fd, evs[i].events);
        }
    }
    loop_reap(l);
    return n;
}

int loop_run(struct loop *l)
{
    while (!atomic_load(&l->stop)) {
        int rc = loop_run_once(l, -1);
        if (rc < 0)
            return rc;
    }
    return 0;
}
