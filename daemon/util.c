/*
 * util.c: see util.h.
 */
#include "daemon/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/random.h>
#include <sys/stat.h>

int random_bytes(void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = getrandom(p, n, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

bool name_valid(const char *name)
{
    size_t n = name ? strlen(name) : 0;
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
            return false;
    }
    return true;
}

int errf(char *err, size_t errlen, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return rc;
}

int path_dir(const char *path, char *dir, size_t len)
{
    const char *slash = strrchr(path, '/');
    int n = !slash ? snprintf(dir, len, ".")
            : slash == path ? snprintf(dir, len, "/")
                            : snprintf(dir, len, "%.*s", (int)(slash - path), path);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

int read_text_file(const char *path, char **text, char *err, size_t errlen)
{
    *text = NULL;
    FILE *fp = fopen(path, "re");
    if (!fp) {
        int e = errno;
        return errf(err, errlen, -e, "cannot open %s: %s", path, strerror(e));
    }
    /* fopen opens a directory; reading one fails with EISDIR, which
     * ferror() reports as no more than "read error". */
    struct stat st;
    if (fstat(fileno(fp), &st) == 0 && S_ISDIR(st.st_mode)) {
        fclose(fp);
        return errf(err, errlen, -EISDIR, "%s: %s", path, strerror(EISDIR));
    }
    char *buf = malloc(TEXT_FILE_MAX_BYTES + 1);
    errno = 0;
    size_t n = buf ? fread(buf, 1, TEXT_FILE_MAX_BYTES + 1, fp) : 0;
    int bad = ferror(fp) ? (errno ? errno : EIO) : 0;
    fclose(fp);
    if (!buf)
        return errf(err, errlen, -ENOMEM, "%s: out of memory", path);
    int rc = 0;
    const char *nul = memchr(buf, '\0', n);
    if (bad) {
        rc = errf(err, errlen, -bad, "%s: %s", path, strerror(bad));
    } else if (n > TEXT_FILE_MAX_BYTES) {
        rc = errf(err, errlen, -EINVAL, "%s: larger than 1 MiB", path);
    } else if (nul) {
        int line = 1;
        for (const char *q = buf; q < nul; q++)
            line += *q == '\n';
        rc = errf(err, errlen, -EINVAL, "%s: line %d: a NUL byte (not a text file)", path, line);
    }
    if (rc) {
        free(buf);
        return rc;
    }
    buf[n] = '\0';
    *text = buf;
    return 0;
}
