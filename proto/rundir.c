/*
 * rundir.c: see rundir.h.
 */
#include "proto/rundir.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int rundir_check(const char *dir, char *err, size_t errlen)
{
    struct stat st, up;
    if (stat(dir, &st) < 0) {
        int e = errno;
        snprintf(err, errlen, "runtime directory %s: %s", dir, strerror(e));
        return -e;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "runtime directory %s is not a directory", dir);
        return -ENOTDIR;
    }
    if (st.st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(err, errlen,
                 "runtime directory %s is writable by %s (mode %04o): they could replace "
                 "moed's sockets; make it 0750 (chmod go-w)",
                 dir, st.st_mode & S_IWOTH ? "anyone" : "its group", (unsigned)(st.st_mode & 07777));
        return -EACCES;
    }
    if (st.st_uid == 0 || st.st_uid == geteuid())
        return 0;
    /* Another user's directory: trusted where only trusted users could have
     * made it, that is where its parent is not open to others. */
    char parent[PATH_MAX];
    size_t n = strlen(dir);
    if (n >= sizeof(parent)) {
        snprintf(err, errlen, "runtime directory path too long");
        return -ENAMETOOLONG;
    }
    memcpy(parent, dir, n + 1);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = '\0';
    char *slash = strrchr(parent, '/');
    if (!slash)
        snprintf(parent, sizeof(parent), ".");
    else
        slash[slash == parent ? 1 : 0] = '\0';
    if (stat(parent, &up) < 0 || (up.st_mode & (S_IWGRP | S_IWOTH))) {
        snprintf(err, errlen,
                 "runtime directory %s belongs to uid %u, neither root nor this user (%u), "
                 "in a directory others may write: anyone could have made it",
                 dir, (unsigned)st.st_uid, (unsigned)geteuid());
        return -EACCES;
    }
    return 0;
}
