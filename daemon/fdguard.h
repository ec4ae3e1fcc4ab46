/*
 * fdguard.h: out of descriptors, a connection is closed, not the daemon.
 *
 * libzmq's ipc listener asserts that accept failed for one of a short list
 * of reasons, and EMFILE is not among them (libzmq 4.3, ipc_listener.cpp):
 * a local client that connects to moed.zmq until the daemon runs out of
 * descriptors would abort it, and every client's work with it. moed
 * therefore defines accept and accept4 (fdguard.c); the dynamic linker
 * binds libzmq's calls to these. Out of descriptors (or of the system's
 * file table), they let go of a descriptor held in reserve, take the
 * pending connection, close it, take the reserve back, and fail with
 * ECONNABORTED, which libzmq takes for "no connection this time". The peer
 * sees its connection closed; a libzmq peer connects again after its
 * reconnect interval. Where no connection is pending, or out of memory
 * (the connection cannot be taken to be closed), they fail with
 * ECONNABORTED after a pause of 10 ms, so that a caller does not spin.
 */
#ifndef MOED_FDGUARD_H
#define MOED_FDGUARD_H

#include <stdint.h>

/* Open the reserve descriptor (once per process); 0 or -errno. */
int fdguard_init(void);

/* Connections closed so since the last call, and why (EMFILE: out of
 * descriptors; ENFILE: the system out of files); the status tick logs
 * them. */
uint64_t fdguard_closed(int *err);

/* accept4 without the guard, for a listener that would rather wait for
 * descriptors than close connections (the session socket). */
int fdguard_accept_unguarded(int lfd, int flags);

#endif
