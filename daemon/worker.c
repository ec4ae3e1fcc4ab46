/*
 * worker.c: see worker.h.
 */
#include "daemon/worker.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "daemon/loop.h"
#include "daemon/util.h"

struct worker {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct job *queue, *queue_tail;  /* waiting to run */
    struct job *finished, *finished_tail; /* run, waiting for done() */
    bool stop;
    uint64_t busy_since_us; /* 0 when idle */
    unsigned pending;       /* loop thread only */
    /* Spinning (worker_set_spin): jobs queued and finished, readable
     * without the lock, so either side can poll instead of sleeping. */
    atomic_uint queued_n, finished_n;
    /* The loop thread is spinning in worker_poll(): a finished job needs no
     * eventfd write, whose wake-up would find nothing (see worker_poll). */
    atomic_bool polling;
    atomic_bool in_after;   /* the running job is in its after() */
    atomic_uint spin_us;    /* set after the thread starts (worker_set_spin) */
    int efd;
    struct loop *loop;
    struct loop_watch *watch;
    char name[16];
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    pthread_setname_np(pthread_self(), w->name);
    pthread_mutex_lock(&w->mu);
    for (;;) {
        unsigned spin = atomic_load_explicit(&w->spin_us, memory_order_relaxed);
        if (!w->queue && !w->stop && spin) {
            /* The next job often follows at once: a futex wake-up costs
             * more than a short spin, on a virtual machine tens of us. */
            pthread_mutex_unlock(&w->mu);
            uint64_t until = now_us() + spin;
            while (!atomic_load_explicit(&w->queued_n, memory_order_acquire) && now_us() < until)
                cpu_relax();
            pthread_mutex_lock(&w->mu);
        }
        while (!w->queue && !w->stop)
            pthread_cond_wait(&w->cv, &w->mu);
        if (!w->queue && w->stop)
            break;
        struct job *j = w->queue;
        w->queue = j->next;
        if (!w->queue)
            w->queue_tail = NULL;
        atomic_fetch_sub_explicit(&w->queued_n, 1, memory_order_release);
        w->busy_since_us = now_us();
        pthread_mutex_unlock(&w->mu);

        j->run(j);
        if (j->after) {
            atomic_store(&w->in_after, true);
            j->after(j);
            atomic_store(&w->in_after, false);
        }

        pthread_mutex_lock(&w->mu);
        w->busy_since_us = 0;
        j->next = NULL;
        if (w->finished_tail)
            w->finished_tail->next = j;
        else
            w->finished = j;
        w->finished_tail = j;
        atomic_fetch_add(&w->finished_n, 1);
        pthread_mutex_unlock(&w->mu);
        if (!atomic_load(&w->polling)) {
            /* Outside the lock: the loop thread woken here takes it next. */
            uint64_t one = 1;
            ssize_t r = write(w->efd, &one, sizeof(one));
            (void)r;
        }
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static void worker_drain_finished(struct worker *w)
{
    pthread_mutex_lock(&w->mu);
    struct job *j = w->finished;
    w->finished = w->finished_tail = NULL;
    atomic_store_explicit(&w->finished_n, 0, memory_order_relaxed);
    pthread_mutex_unlock(&w->mu);
    while (j) {
        struct job *next = j->next;
        w->pending--;
        j->done(j);
        j = next;
    }
}

static void worker_on_event(void *data, int fd, uint32_t events)
{
    struct worker *w = data;
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof(v));
    (void)r;
    worker_drain_finished(w);
}

int worker_new(struct loop *loop, const char *name, struct worker **out)
{
    struct worker *w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    snprintf(w->name, sizeof(w->name), "%s", name);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->loop = loop;
    w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->efd < 0) {
        int e = -errno;
        free(w);
        return e;
    }
    w->watch = loop_watch(loop, w->efd, EPOLLIN, worker_on_event, w);
    if (!w->watch) {
        int e = -errno;
        close_fd(&w->efd);
        free(w);
        return e;
    }
    int e = pthread_create(&w->thread, NULL, worker_main, w);
    if (e) {
        loop_unwatch(loop, &w->watch);
        close_fd(&w->efd);
        free(w);
        return -e;
    }
    *out = w;
    return 0;
}

void worker_free(struct worker **wp)
{
    struct worker *w = *wp;
    *wp = NULL;
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    worker_drain_finished(w);
    loop_unwatch(w->loop, &w->watch);
    close_fd(&w->efd);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

void worker_submit(struct worker *w, struct job *job)
{
    job->next = NULL;
    w->pending++;
    pthread_mutex_lock(&w->mu);
    if (w->queue_tail)
        w->queue_tail->next = job;
    else
        w->queue = job;
    w->queue_tail = job;
    atomic_fetch_add_explicit(&w->queued_n, 1, memory_order_release);
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void worker_set_spin(struct worker *w, unsigned us)
{
    atomic_store_explicit(&w->spin_us, us, memory_order_relaxed);
}

/*
 * While the loop thread spins here the worker does not write the eventfd.
 * Both sides use sequentially consistent operations: the worker publishes
 * finished_n, then reads polling; this side clears polling, then reads
 * finished_n. So either the worker sees polling cleared and writes, or this
 * side sees the finished job; never neither.
 */
bool worker_poll(struct worker *w, unsigned spin_us)
{
    uint64_t until = now_us() + spin_us;
    atomic_store(&w->polling, true);
    while (!atomic_load_explicit(&w->finished_n, memory_order_acquire) &&
           !atomic_load_explicit(&w->in_after, memory_order_relaxed) && now_us() < until)
        cpu_relax();
    atomic_store(&w->polling, false);
    if (!atomic_load(&w->finished_n))
        return false;
    worker_drain_finished(w);
    return true;
}

unsigned worker_pending(const struct worker *w)
{
    return w->pending;
}

double worker_busy_seconds(struct worker *w)
{
    pthread_mutex_lock(&w->mu);
    uint64_t since = w->busy_since_us;
    pthread_mutex_unlock(&w->mu);
    return since ? (double)(now_us() - since) / 1e6 : 0.0;
}

int worker_cpu_clock(struct worker *w, clockid_t *out)
{
    return -pthread_getcpuclockid(w->thread, out);
}
