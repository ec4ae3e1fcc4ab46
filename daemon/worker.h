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

struct loop;
struct worker;

struct job {
    void (*run)(struct job *job);
    void (*done)(struct job *job);
    struct job *next; /* owned by the worker while queued */
};

/* Caller owns the worker; worker_free() finishes queued jobs first. */
int worker_new(struct loop *loop, const char *name, struct worker **out);
void worker_free(struct worker **w);

/* Queue a job; the worker owns it until job->done is called. */
void worker_submit(struct worker *w, struct job *job);

/* Jobs submitted whose done() has not yet run. Loop thread only. */
unsigned worker_pending(const struct worker *w);

/* Seconds since the running job started, 0 when idle; any thread. Lets the
 * watchdog notice a job that never ends. */
double worker_busy_seconds(struct worker *w);

#endif
