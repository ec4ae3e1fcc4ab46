/*
 * rundir.c: see rundir.h.
 */
#include "proto/rundir.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static bool trusted_uid(uid_t uid)
{
    return uid == 0 || uid == geteuid();
}

/* The directory that holds path's last component (path as given, or
 * resolved), into out. */
static int parent_of(const char *path, char *out, size_t len)
{
    size_t n = strlen(path);
    if (n >= len)
        return -ENAMETOOLONG;
    memcpy(out, path, n + 1);
    while (n > 1 && out[n - 1] == '/')
        out[--n] = '\0';
    char *slash = strrchr(out, '/');
    if (!slash)
        snprintf(out, len, ".");
    else
        slash[slash == out ? 1 : 0] = '\0';
    return 0;
}

int rundir_check(const char *dir, char *err, size_t errlen)
{
    struct stat entry, st, up;
    char parent[PATH_MAX];
    if (lstat(dir, &entry) < 0 || stat(dir, &st) < 0) {
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
    if (parent_of(dir, parent, sizeof(parent)) < 0) {
        snprintf(err, errlen, "runtime directory path too long");
        return -ENAMETOOLONG;
    }
    /* Where others may make and remove entries, the entry (the directory,
     * or a link to it) must be one they cannot replace: a sticky
     * directory's entry of root's or this user's. */
    if (stat(parent, &up) < 0 ||
        ((up.st_mode & (S_IWGRP | S_IWOTH)) &&
         !((up.st_mode & S_ISVTX) && trusted_uid(entry.st_uid)))) {
        snprintf(err, errlen,
                 "runtime directory %s is %s of uid %u in %s, which others may write: "
                 "anyone could have made it or may replace it",
                 dir, S_ISLNK(entry.st_mode) ? "a link" : "an entry", (unsigned)entry.st_uid,
                 parent);
        return -EACCES;
    }
    if (trusted_uid(st.st_uid))
        return 0;
    /* Another user's directory (the daemon's, under /run): trusted where
     * only root could have made it, in a directory of root's that no one
     * else may write. */
    char *real = realpath(dir, NULL);
    int rc = real ? parent_of(real, parent, sizeof(parent)) : -errno;
    free(real);
    if (rc < 0 || stat(parent, &up) < 0 || up.st_uid != 0 || (up.st_mode & (S_IWGRP | S_IWOTH))) {
        snprintf(err, errlen,
                 "runtime directory %s belongs to uid %u, neither root nor this user (%u), "
                 "and lies in a directory root does not alone control (%s)",
                 dir, (unsigned)st.st_uid, (unsigned)geteuid(), parent);
        return -EACCES;
    }
    return 0;
}
