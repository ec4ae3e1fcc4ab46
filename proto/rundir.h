/*
 * rundir.h: the runtime directory as a rendezvous both ends can trust.
 * Whoever can write the directory can replace moed.sock with a socket of
 * their own, and pose as the daemon to clients (receiving the memfds of
 * their regions) or as nothing at all. Compiled into both the daemon,
 * which refuses to serve from such a directory, and libmoe, which refuses
 * to connect through one.
 */
#ifndef MOE_PROTO_RUNDIR_H
#define MOE_PROTO_RUNDIR_H

#include <stddef.h>

/* 0 when dir is a directory that no one but its owner may write; whose
 * entry (the directory, or a link to it) no one else can have made or can
 * replace (in a directory others may write, only a sticky one's entry of
 * root's or this user's); and whose owner is root, this process's user,
 * or another (the daemon's) where its parent is root's and no one else's
 * to write, as /run is. Else -errno (-ENOENT, -ENOTDIR, -EACCES...) with
 * why in err. */
int rundir_check(const char *dir, char *err, size_t errlen);

#endif
