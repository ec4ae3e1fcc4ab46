/*
 * util.h: small helpers every daemon module uses: clocks, overflow-checked
 * arithmetic, the cleanup of file descriptors, and reading a small text
 * file whole.
 */
#ifndef MOED_UTIL_H
#define MOED_UTIL_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

static inline uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* A hint inside spin loops. */
static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* a * b into *out; false on overflow. */
static inline bool mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

static inline bool add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

/* Close *fd if open and set it to -1; keeps errno. */
static inline void close_fd(int *fd)
{
    if (fd && *fd >= 0) {
        int e = errno;
        close(*fd);
        *fd = -1;
        errno = e;
    }
}

/* Of n cache slots, the one to fill: the first free one (in_use[i] false),
 * else the least recently used (smallest used[i]; the first of equals). */
static inline int slot_to_fill(const bool *in_use, const uint64_t *used, int n)
{
    int lru = 0;
    for (int i = 0; i < n; i++) {
        if (!in_use[i])
            return i;
        if (used[i] < used[lru])
            lru = i;
    }
    return lru;
}

/* Fill buf with n random bytes from the kernel's CSPRNG. 0 or -errno. */
int random_bytes(void *buf, size_t n);

/* True when name is 1..64 characters of [A-Za-z0-9._-]. */
bool name_valid(const char *name);

/* Write a message into err (errlen bytes) and return rc: for functions that
 * report why they failed in a caller's buffer. */
int errf(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The directory a file named path would be in, into dir (len bytes): "."
 * for a name without '/', "/" for one right under the root. 0 or
 * -ENAMETOOLONG. */
int path_dir(const char *path, char *dir, size_t len);

/* Read the text file at path, of at most 1 MiB, into *text (malloc'd,
 * NUL-terminated; the caller frees it). A directory, a larger file, a NUL
 * byte (named by its line) and a read error are refused with a message in
 * err that begins with path. 0 or -errno. */
#define TEXT_FILE_MAX_BYTES (1u << 20)
int read_text_file(const char *path, char **text, char *err, size_t errlen);

#endif
