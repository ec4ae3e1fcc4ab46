/*
 * worker.h: a thread that runs jobs off the loop thread, in order, and hands
 * each finished job back to the loop thread.
 *
 * job->run executes on the worker thread; job->done then executes on the
 * loop thread (woken through an eventfd), where it may free the job. The
 * daemon has two: "compute" for batches, whose device time must be serial,
 * and "loader" for weight loads, so a large checkpoint never stalls serving.
 */
#ifndef MOED_WORKER_H
#define MOED_WORKER_H

#include <stdbool.h>
#include <stdint.h>
#include <time.h>

struct loop;
struct worker;

struct job {
    void (*run)(struct job *job);
    void (*done)(struct job *job);
    /* Optional: runs on the worker thread right after run(), before the
     * job is handed back: done() runs after it has returned. Meanwhile
     * worker_poll() no longer spins for the job, so the loop thread goes
     * back to its other events. */
    void (*after)(struct job *job);
    struct job *next; /* owned by the worker while queued */
};

/* Caller owns the worker; worker_free() finishes queued jobs first. */
int worker_new(struct loop *loop, const char *name, struct worker **out);
void worker_free(struct worker **w);

/* Queue a job; the worker owns it until job->done is called. */
void worker_submit(struct worker *w, struct job *job);

/* Spin up to us microseconds for the next job before sleeping (0: never).
 * For backends whose jobs are short and frequent (a GPU's decode batches),
 * where a sleeping thread's wake-up costs more than the spin. */
void worker_set_spin(struct worker *w, unsigned us);

/* Loop thread: spin up to spin_us for a job to finish; if one did, run its
 * done() now and return true (the eventfd's later wake-up finds nothing).
 * Returns false at once once the running job is in its after(). */
bool worker_poll(struct worker *w, unsigned spin_us);

/* Jobs submitted whose done() has not yet run. Loop thread only. */
unsigned worker_pending(const struct worker *w);

/* Seconds since the running job started, 0 when idle; any thread. Lets the
 * watchdog notice a job that never ends. */
double worker_busy_seconds(struct worker *w);

/* The CPU-time clock of the worker's thread (pthread_getcpuclockid): 0 or
 * -errno. */
int worker_cpu_clock(struct worker *w, clockid_t *out);

#endif
