/*
 * pool.c: the CPU backend's fixed thread pool and its parallel-for.
 *
 * A pool of N threads starts N - 1 workers; the thread that calls
 * moek_cpu_pool_run() is the N-th and takes items like the others. Items are
 * handed out one at a time from an atomic counter, so the split between
 * threads varies from run to run; callers make each item write its own part
 * of the output, which keeps results independent of that split. Idle workers
 * sleep on a condition variable, so an idle pool costs no CPU.
 *
 * One thread at a time may call moek_cpu_pool_run() on a pool: the pool holds
 * a single job slot. Callers that share a pool between threads serialise the
 * calls themselves.
 *
 * Workers start with every signal blocked, so a daemon that takes its signals
 * through signalfd (or any one thread) never sees them land on a worker.
 */
#include "moe_kernels.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

/* The cap keeps a bad configuration value from asking for absurd numbers of
 * threads; it is far above any CPU count moed is meant for. */
#define POOL_MAX_THREADS 1024

struct moek_cpu_pool {
    int threads; /* workers + the calling thread */
    int workers;
    pthread_t *tids;

    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* workers wait here for a new generation */
    pthread_cond_t done_cv; /* the caller waits here for busy == 0 */
    unsigned long generation;
    int busy; /* workers that have not finished the current generation */
    bool stop;

    /* The current job; written under mu before generation is bumped. */
    void (*fn)(void *ctx, int item);
    void *ctx;
    int n_items;
    atomic_int next;
};

/* Takes items until none are left. */
static void pool_drain_items(moek_cpu_pool *p, void (*fn)(void *, int),
                             void *ctx, int n_items)
{
    for (;;) {
        int item = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (item >= n_items)
            return;
        fn(ctx, item);
    }
}

static void *pool_worker_main(void *arg)
{
    moek_cpu_pool *p = arg;
    unsigned long seen = 0;

    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->generation == seen && !p->stop)
            pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        void (*fn)(void *, int) = p->fn;
        void *ctx = p->ctx;
        int n_items = p->n_items;
        pthread_mutex_unlock(&p->mu);

        pool_drain_items(p, fn, ctx, n_items);

        pthread_mutex_lock(&p->mu);
        /* The caller may only reuse the job slot once every worker has
         * stopped looking at the counter of this generation. */
        if (--p->busy == 0)
            pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

moek_cpu_pool *moek_cpu_pool_new(int threads)
{
    if (threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (int)(n < POOL_MAX_THREADS ? n : POOL_MAX_THREADS) : 1;
    }
    if (threads > POOL_MAX_THREADS)
        threads = POOL_MAX_THREADS;

    moek_cpu_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->threads = threads;
    p->tids = calloc((size_t)threads, sizeof *p->tids);
    if (!p->tids) {
        free(p);
        return NULL;
    }
    atomic_init(&p->next, 0);
    if (pthread_mutex_init(&p->mu, NULL) != 0)
        goto fail_mu;
    if (pthread_cond_init(&p->work_cv, NULL) != 0)
        goto fail_work;
    if (pthread_cond_init(&p->done_cv, NULL) != 0)
        goto fail_done;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 0; i < threads - 1; i++) {
        if (pthread_create(&p->tids[i], NULL, pool_worker_main, p) != 0)
            break;
        p->workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (p->workers == threads - 1)
        return p;
    /* Fewer threads than asked: stop the ones that started and fail, rather
     * than hand back a pool smaller than the caller sized its work for. */
    moek_cpu_pool_free(p);
    return NULL;

fail_done:
    pthread_cond_destroy(&p->work_cv);
fail_work:
    pthread_mutex_destroy(&p->mu);
fail_mu:
    free(p->tids);
    free(p);
    return NULL;
}

void moek_cpu_pool_free(moek_cpu_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = true;
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->workers; i++)
        pthread_join(pool->tids[i], NULL);
    pthread_cond_destroy(&pool->done_cv);
    pthread_cond_destroy(&pool->work_cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool->tids);
    free(pool);
}

int moek_cpu_pool_threads(const moek_cpu_pool *pool)
{
    return pool ? pool->threads : 1;
}

void moek_cpu_pool_run(moek_cpu_pool *pool, int n_items,
                       void (*fn)(void *ctx, int item), void *ctx)
{
    if (n_items <= 0)
        return;
    /* Waking workers costs more than a single item is likely to. */
    if (!pool || pool->workers == 0 || n_items == 1) {
        for (int i = 0; i < n_items; i++)
            fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_items = n_items;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    pool->busy = pool->workers;
    pool->generation++;
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);

    pool_drain_items(pool, fn, ctx, n_items);

    pthread_mutex_lock(&pool->mu);
    while (pool->busy > 0)
        pthread_cond_wait(&pool->done_cv, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
}
