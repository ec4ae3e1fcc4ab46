/*
 * notify.c: see notify.h.
 */
#include "daemon/notify.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "daemon/log.h"
#include "daemon/reload.h"
#include "daemon/safetensors.h"
#include "daemon/server.h"
#include "daemon/util.h"

#define STATUS_EVERY_US 2000000ull
/* Loading: each extension gives this long from now; progress is checked
 * this often. */
#define LOAD_EXTEND_US 30000000ull
#define LOAD_CHECK_US 5000000ull

/*
 * sd_notify(3) without waiting on the service manager: a datagram to
 * $NOTIFY_SOCKET sent with MSG_DONTWAIT. sd_notify() blocks when the
 * receiver lags (a unix datagram socket queues at most
 * net.unix.max_dgram_qlen messages, 10 by default), and the serving loop
 * must not stop for that. WATCHDOG=1 and STATUS= that cannot go now are
 * dropped (for the watchdog, what a manager too stuck to read would see
 * anyway); a state change (must) waits up to a second for room.
 */
static void notify_send(bool must, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void notify_send(bool must, const char *fmt, ...)
{
    const char *e = getenv("NOTIFY_SOCKET");
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char msg[1024];
    size_t len = e ? strlen(e) : 0;
    if (!len || (e[0] != '/' && e[0] != '@') || len >= sizeof(sa.sun_path))
        return;
    memcpy(sa.sun_path, e, len);
    if (sa.sun_path[0] == '@')
        sa.sun_path[0] = '\0'; /* an abstract socket */
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    size_t mlen = (size_t)n < sizeof(msg) ? (size_t)n : sizeof(msg) - 1;
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    /* Connected, so that POLLOUT says whether the receiver has room. */
    if (connect(fd, (struct sockaddr *)&sa,
                (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) == 0 &&
        send(fd, msg, mlen, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == EAGAIN && must) {
        struct pollfd p = {fd, POLLOUT, 0};
        if (poll(&p, 1, 1000) == 1)
            (void)!send(fd, msg, mlen, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    close(fd);
}

static uint64_t watchdog_us;
static bool watchdog_read;
static uint64_t status_requests, status_us;

static uint64_t watchdog_interval(void)
{
    if (!watchdog_read) {
        uint64_t wd = 0;
        watchdog_us = sd_watchdog_enabled(0, &wd) > 0 ? wd : 0;
        watchdog_read = true;
    }
    return watchdog_us;
}

/* ---- socket activation --------------------------------------------------- */

static void check_path(int fd, const char *runtime_dir, const char *file, const char *what)
{
    char want[sizeof(((struct sockaddr_un *)0)->sun_path)];
    if (snprintf(want, sizeof(want), "%s/%s", runtime_dir, file) >= (int)sizeof(want))
        return;
    if (sd_is_socket_unix(fd, 0, 1, want, 0) <= 0)
        log_warn("socket activation: the %s socket is not bound to %s, where clients look for it",
                 what, want);
}

int notify_listen_fds(const char *runtime_dir, int *session_fd, int *zmq_fd, char *err,
                      size_t errlen)
{
    char **names = NULL;
    int rc = 0;
    *session_fd = *zmq_fd = -1;
    int n = sd_listen_fds_with_names(1, &names);
    if (n <= 0)
        return 0;
    for (int i = 0; i < n; i++) {
        int fd = SD_LISTEN_FDS_START + i;
        const char *nm = names && names[i] ? names[i] : "unknown";
        bool seq = sd_is_socket_unix(fd, SOCK_SEQPACKET, 1, NULL, 0) > 0;
        bool stream = sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) > 0;
        int *slot = NULL;
        if (!strcmp(nm, "session") || !strcmp(nm, "zmq")) {
            bool is_session = nm[0] == 's';
            slot = is_session ? session_fd : zmq_fd;
            if (!rc && (is_session ? !seq : !stream)) {
                snprintf(err, errlen, "passed socket '%s' (fd %d) is not a listening AF_UNIX %s "
                         "socket", nm, fd, is_session ? "SOCK_SEQPACKET" : "SOCK_STREAM");
                rc = -EINVAL;
            } else if (!rc && *slot >= 0) {
                snprintf(err, errlen, "two sockets named '%s' were passed", nm);
                rc = -EINVAL;
            }
        } else if (seq && *session_fd < 0) {
            slot = session_fd;
        } else if (stream && *zmq_fd < 0) {
            slot = zmq_fd;
        }
        if (slot && !rc && *slot < 0) {
            *slot = fd;
        } else {
            if (!rc)
                log_warn("socket activation: ignoring passed socket '%s' (fd %d)", nm, fd);
            close(fd);
        }
    }
    if (names) {
        for (int i = 0; i < n; i++)
            free(names[i]);
        free(names);
    }
    if (rc) {
        close_fd(session_fd);
        close_fd(zmq_fd);
        return rc;
    }
    if (*session_fd >= 0)
        check_path(*session_fd, runtime_dir, "moed.sock", "session");
    if (*zmq_fd >= 0)
        check_path(*zmq_fd, runtime_dir, "moed.zmq", "ZeroMQ");
    log_info("socket activation: session socket %s, ZeroMQ socket %s",
             *session_fd >= 0 ? "passed" : "bound here", *zmq_fd >= 0 ? "passed" : "bound here");
    return 0;
}

/* ---- state ------------------------------------------------------------- */

static unsigned layers_ready(const struct server *s)
{
    unsigned n = 0;
    for (const struct layer *l = s->layers; l; l = l->next)
        n += l->state == LAYER_READY;
    return n;
}

static void status_line(struct server *s, char *buf, size_t len)
{
    uint64_t now = now_us();
    double dt = (double)(now - status_us) / 1e6;
    double rps = status_us && dt > 0 ? (double)(s->stats.requests - status_requests) / dt : 0;
    status_requests = s->stats.requests;
    status_us = now;
    snprintf(buf, len, "%s%u layers, %u sessions, queue %u, %.0f req/s",
             s->draining ? "draining: " : "", layers_ready(s), s->n_sessions, s->queued_total, rps);
}

void notify_ready(struct server *s)
{
    char st[200];
    watchdog_interval();
    status_line(s, st, sizeof(st));
    notify_send(true, "READY=1\nSTATUS=%s", st);
}

void notify_stopping(struct server *s)
{
    notify_send(true, "STOPPING=1\nSTATUS=draining %u pending requests", server_pending(s));
}

uint64_t notify_tick_interval_us(void)
{
    uint64_t wd = watchdog_interval(), iv = STATUS_EVERY_US;
    if (wd && wd / 2 < iv)
        iv = wd / 2;
    return iv ? iv : 1000;
}

void notify_tick(struct server *s)
{
    char st[200];
    uint64_t wd = watchdog_interval();
    /* The loop reached this tick, so it is not stuck; a batch, or a
     * region's pin, that has run longer than the whole watchdog interval
     * means the device (or its driver) is. */
    double stuck = worker_busy_seconds(s->compute);
    double pin = s->pinner ? worker_busy_seconds(s->pinner) : 0;
    if (pin > stuck)
        stuck = pin;
    bool alive = wd && stuck * 1e6 < (double)wd;
    /* Timer jitter must not make every other tick just miss the refresh. */
    bool status = now_us() - status_us + notify_tick_interval_us() / 2 >= STATUS_EVERY_US;
    if (status)
        status_line(s, st, sizeof(st));
    if (alive && status)
        notify_send(false, "WATCHDOG=1\nSTATUS=%s", st);
    else if (alive)
        notify_send(false, "WATCHDOG=1");
    else if (status)
        notify_send(false, "STATUS=%s", st);
}

/* ---- reload ------------------------------------------------------------ */

static void reload_finished(void *data, unsigned failed)
{
    struct server *s = data;
    char st[200];
    if (s->draining)
        return; /* STOPPING=1 was sent; READY=1 would contradict it */
    status_line(s, st, sizeof(st));
    notify_send(true, "READY=1\nSTATUS=%s%s", failed ? "reloaded with errors (see the log): " : "", st);
}

void notify_reload(struct server *s, struct reload *r)
{
    if (s->draining)
        return;
    if (!reload_running(r)) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        notify_send(true, "RELOADING=1\nMONOTONIC_USEC=%llu\nSTATUS=reloading the configuration",
                   (unsigned long long)ts.tv_sec * 1000000ull +
                       (unsigned long long)ts.tv_nsec / 1000);
    }
    reload_start(r, reload_finished, s);
}

/* ---- loading: EXTEND_TIMEOUT_USEC while progress is made ---------------- */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool running, stop;
    unsigned layers_begun;
    clockid_t cpu_clock; /* the loading thread's */
    uint64_t check_us;
} keeper = {.mu = PTHREAD_MUTEX_INITIALIZER, .check_us = LOAD_CHECK_US};

void notify_set_loading_check_us(uint64_t us)
{
    keeper.check_us = us ? us : LOAD_CHECK_US;
}

static uint64_t cpu_us(void)
{
    struct timespec ts;
    if (clock_gettime(keeper.cpu_clock, &ts) < 0)
        return 0;
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void *keeper_main(void *arg)
{
    uint64_t rd = st_bytes_read(), cpu = cpu_us();
    unsigned layers = 0;
    bool stalled = false;
    pthread_mutex_lock(&keeper.mu);
    while (!keeper.stop) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + keeper.check_us % 1000000 * 1000;
        ts.tv_sec += (time_t)(keeper.check_us / 1000000 + ns / 1000000000);
        ts.tv_nsec = (long)(ns % 1000000000);
        while (!keeper.stop && pthread_cond_timedwait(&keeper.cv, &keeper.mu, &ts) != ETIMEDOUT)
            ;
        if (keeper.stop)
            break;
        uint64_t rd2 = st_bytes_read(), cpu2 = cpu_us();
        /* Reading, or computing (converting, packing, uploading) for at
         * least a tenth of the time, or a new layer begun: progress. */
        bool progress = rd2 != rd || cpu2 - cpu >= keeper.check_us / 10 ||
                        keeper.layers_begun != layers;
        rd = rd2;
        cpu = cpu2;
        layers = keeper.layers_begun;
        if (progress) {
            notify_send(false, "EXTEND_TIMEOUT_USEC=%llu", (unsigned long long)LOAD_EXTEND_US);
            stalled = false;
        } else if (!stalled) {
            log_warn("loading weights: no progress in %.1f s; no longer extending the start-up "
                     "timeout", (double)keeper.check_us / 1e6);
            stalled = true;
        }
    }
    pthread_mutex_unlock(&keeper.mu);
    return arg;
}

void notify_loading_begin(clockid_t cpu_clock)
{
    const char *ns = getenv("NOTIFY_SOCKET");
    if (!ns || !ns[0] || keeper.running)
        return;
    keeper.cpu_clock = cpu_clock;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&keeper.cv, &ca);
    pthread_condattr_destroy(&ca);
    keeper.stop = false;
    if (pthread_create(&keeper.thread, NULL, keeper_main, NULL) == 0)
        keeper.running = true;
    else
        pthread_cond_destroy(&keeper.cv);
}

void notify_loading_layer(const char *name, unsigned index, unsigned count)
{
    pthread_mutex_lock(&keeper.mu);
    keeper.layers_begun++;
    pthread_mutex_unlock(&keeper.mu);
    notify_send(true, "EXTEND_TIMEOUT_USEC=%llu\nSTATUS=loading layer '%s' (%u of %u)",
               (unsigned long long)LOAD_EXTEND_US, name, index, count);
}

void notify_loading_end(void)
{
    if (!keeper.running)
        return;
    pthread_mutex_lock(&keeper.mu);
    keeper.stop = true;
    pthread_cond_signal(&keeper.cv);
    pthread_mutex_unlock(&keeper.mu);
    pthread_join(keeper.thread, NULL);
    pthread_cond_destroy(&keeper.cv);
    keeper.running = false;
}
