/*
 * notify.h: moed under systemd: sd_notify messages (READY, STATUS, WATCHDOG,
 * RELOADING, STOPPING, EXTEND_TIMEOUT_USEC) and socket activation. Every
 * function is a no-op when systemd is absent (no NOTIFY_SOCKET, no
 * LISTEN_FDS).
 */
#ifndef MOED_NOTIFY_H
#define MOED_NOTIFY_H

#include <stdint.h>

struct server;

/* Descriptors passed by systemd, named "session" and "zmq" through
 * FileDescriptorName=; -1 where none. */
void notify_listen_fds(int *session_fd, int *zmq_fd);

void notify_ready(struct server *s);
void notify_stopping(void);
void notify_extend_timeout(uint64_t usec);

/* How often notify_tick() should run: half the watchdog interval, at most
 * every two seconds (STATUS= refresh). */
uint64_t notify_tick_interval_us(void);
/* Refresh STATUS=; ping the watchdog if the daemon makes progress. */
void notify_tick(struct server *s);

/* SIGHUP: RELOADING=1, re-read config_path (if any) and apply it, READY=1. */
void notify_reload(struct server *s, const char *config_path);

#endif
