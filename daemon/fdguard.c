/*
 * fdguard.c: see fdguard.h. Built without _GNU_SOURCE, under which glibc
 * declares accept's address as a transparent union and accept4 at all;
 * these definitions take the plain prototypes.
 */
#undef _GNU_SOURCE
#define _DEFAULT_SOURCE

#include "daemon/fdguard.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int accept4(int lfd, struct sockaddr *restrict addr, socklen_t *restrict len, int flags);

static pthread_mutex_t guard_mu = PTHREAD_MUTEX_INITIALIZER;
static int reserve_fd = -1;
static uint64_t shed_count;
static int shed_err;

static int reserve_open(void)
{
    if (reserve_fd < 0)
        reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return reserve_fd < 0 ? -errno : 0;
}

int fdguard_init(void)
{
    pthread_mutex_lock(&guard_mu);
    int rc = reserve_open();
    pthread_mutex_unlock(&guard_mu);
    return rc;
}

int fdguard_accept_unguarded(int lfd, int flags)
{
    return (int)syscall(SYS_accept4, lfd, NULL, NULL, flags);
}

static void pause_10ms(void)
{
    struct timespec t = {0, 10 * 1000 * 1000};
    nanosleep(&t, NULL);
}

/* Out of descriptors: close the pending connection with the reserve's slot.
 * Under the lock, one connection at a time; a caller that finds the slot
 * taken by another thread in between simply fails again, after a pause,
 * as without a reserve (another thread took its slot back). */
static void shed(int lfd, int err)
{
    bool closed = false;
    pthread_mutex_lock(&guard_mu);
    bool had = reserve_open() == 0;
    /* Only with a connection pending: libzmq's listener blocks (it accepts
     * when epoll says it may), and the kernel fails with EMFILE before it
     * looks for a connection, so an accept with none would wait, under the
     * lock, for the next. */
    struct pollfd p = {lfd, POLLIN, 0};
    if (had && poll(&p, 1, 0) == 1 && (p.revents & POLLIN)) {
        close(reserve_fd);
        reserve_fd = -1;
        int fd = (int)syscall(SYS_accept4, lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) {
            close(fd);
            shed_count++;
            shed_err = err;
            closed = true;
        }
        reserve_open();
    }
    pthread_mutex_unlock(&guard_mu);
    if (!closed) /* a caller that tries again at once does not spin */
        pause_10ms();
}

uint64_t fdguard_closed(int *err)
{
    pthread_mutex_lock(&guard_mu);
    uint64_t n = shed_count;
    *err = shed_err;
    shed_count = 0;
    pthread_mutex_unlock(&guard_mu);
    return n;
}

int accept4(int lfd, struct sockaddr *restrict addr, socklen_t *restrict len, int flags)
{
    int fd = (int)syscall(SYS_accept4, lfd, addr, len, flags);
    if (fd >= 0)
        return fd;
    int e = errno;
    if (e == EMFILE || e == ENFILE) {
        shed(lfd, e);
    } else if (e == ENOMEM || e == ENOBUFS) {
        pause_10ms();
    } else {
        return -1;
    }
    errno = ECONNABORTED;
    return -1;
}

int accept(int lfd, struct sockaddr *restrict addr, socklen_t *restrict len)
{
    return accept4(lfd, addr, len, 0);
}
