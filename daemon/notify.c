/*
 * notify.c: see notify.h.
 */
#include "daemon/notify.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <time.h>

#include "daemon/log.h"
#include "daemon/server.h"
#include "daemon/util.h"

static uint64_t watchdog_us;
static uint64_t last_requests, last_tick_us;

void notify_listen_fds(int *session_fd, int *zmq_fd)
{
    char **names = NULL;
    *session_fd = *zmq_fd = -1;
    int n = sd_listen_fds_with_names(1, &names);
    for (int i = 0; i < n; i++) {
        int fd = SD_LISTEN_FDS_START + i;
        const char *nm = names && names[i] ? names[i] : "";
        if (!strcmp(nm, "zmq") || (n == 2 && i == 1 && strcmp(nm, "session")))
            *zmq_fd = fd;
        else if (!strcmp(nm, "session") || (n <= 2 && i == 0))
            *session_fd = fd;
        else
            log_warn("ignoring passed socket '%s'", nm);
    }
    if (names) {
        for (int i = 0; i < n; i++)
            free(names[i]);
        free(names);
    }
    if (n > 0)
        log_info("socket activation: session fd %d, zmq fd %d", *session_fd, *zmq_fd);
}

void notify_ready(struct server *s)
{
    uint64_t wd = 0;
    if (sd_watchdog_enabled(0, &wd) > 0)
        watchdog_us = wd;
    sd_notifyf(0, "READY=1\nSTATUS=serving %u layers", 0u);
    last_tick_us = now_us();
}

void notify_stopping(void)
{
    sd_notify(0, "STOPPING=1\nSTATUS=draining");
}

void notify_extend_timeout(uint64_t usec)
{
    sd_notifyf(0, "EXTEND_TIMEOUT_USEC=%llu", (unsigned long long)usec);
}

uint64_t notify_tick_interval_us(void)
{
    uint64_t wd = 0, iv = 2000000;
    if (sd_watchdog_enabled(0, &wd) > 0 && wd / 2 < iv)
        iv = wd / 2;
    return iv ? iv : 1000;
}

void notify_tick(struct server *s)
{
    uint64_t now = now_us();
    unsigned layers = 0;
    for (struct layer *l = s->layers; l; l = l->next)
        layers += l->state == LAYER_READY;
    double dt = (double)(now - last_tick_us) / 1e6;
    double rps = dt > 0 ? (double)(s->stats.requests - last_requests) / dt : 0;
    last_requests = s->stats.requests;
    last_tick_us = now;
    sd_notifyf(0, "STATUS=%s%u layers, %u sessions, queue %u, %.0f req/s",
               s->draining ? "draining: " : "", layers, s->n_sessions, s->queued_total, rps);
    /* The loop reached this tick, so it is not stuck; a batch that has run
     * longer than the whole watchdog interval means the device is. */
    if (watchdog_us && worker_busy_seconds(s->compute) * 1e6 < (double)watchdog_us)
        sd_notify(0, "WATCHDOG=1");
}

void notify_reload(struct server *s, const char *config_path)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%llu",
               (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000);
    if (config_path) {
        struct config c;
        char err[512] = "";
        int rc = config_init(&c);
        if (!rc)
            rc = config_load(&c, config_path, err, sizeof(err));
        if (rc) {
            log_err("reload: %s: %s; keeping the running configuration", config_path, err);
        } else {
            s->cfg->max_batch_tokens = c.max_batch_tokens;
            s->cfg->max_delay_us = c.max_delay_us;
            s->cfg->max_request_tokens = c.max_request_tokens;
            s->cfg->max_queued_requests = c.max_queued_requests;
            s->cfg->max_queued_tokens = c.max_queued_tokens;
            s->cfg->log_level = c.log_level;
            log_set_level((enum log_level)c.log_level);
            log_info("reload: configuration re-read from %s", config_path);
        }
        config_done(&c);
    }
    sd_notify(0, "READY=1");
}
