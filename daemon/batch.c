/*
 * batch.c: the batcher. Each layer has a FIFO of validated requests. When
 * the compute worker is idle, batch_kick() takes the layer whose oldest
 * request has waited longest and hands rows of its queued requests, in
 * order, to one batch of at most max_batch_tokens rows: one gather into
 * staging memory, one backend launch, one scatter back into each client's
 * region. A backend that moves rows by DMA (moe_rows: CUDA) takes the
 * activations and the outputs straight from and to the clients' pinned
 * regions instead; only the routing goes through staging.
 *
 * A request that arrives while the device is idle therefore runs at once;
 * requests that arrive while a batch runs are merged into the next one. A
 * MoE request adds at most max_slice_tokens rows to a batch, so a long
 * prefill runs over several batches and decode requests behind it join each
 * of them instead of waiting for the whole prefill. Rows are computed
 * independently, so a client's result does not depend on its batch.
 *
 * Clients that send their next request as soon as the last one returns
 * (decode loops) fall into groups that alternate on the device: while one
 * group's batch runs, the others queue. After a batch of several clients,
 * the batcher therefore waits (at most return_wait_us) until every session
 * it just served has a request queued again, so the groups merge into one
 * batch that reads the weights once. A lone client never waits: its own
 * next request is the one awaited.
 *
 * Copying the routing out of shared memory before the launch is also what
 * makes a client's concurrent writes harmless: ids are range-checked in the
 * daemon's own copy. (A row of x that its client rewrites during a DMA
 * changes only that client's own output row.)
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/loop.h"
#include "daemon/region.h"
#include "daemon/server.h"
#include "daemon/util.h"
#include "moe.pb-c.h"
#include "proto/status.h"

/* Rows [row0, row0 + rows) of a request in one batch. skip: the compute
 * thread left them out (the request failed), so the gather and the scatter
 * agree on which staging rows belong to which request. */
struct batch_item {
    struct request *req;
    int row0, rows;
    uint64_t session_id;
    bool skip;
    /* Its session's reply socket, for a request whole in this batch. */
    struct reply_chan *chan;
    bool replied;             /* its Reply went out as the batch ended */
};

struct batch_job {
    struct job job;
    struct server *s;
    struct layer *layer;      /* reference */
    struct batch_item *items;
    uint32_t n_items, cap_items;
    uint64_t tokens;
    uint64_t compute_us;
    /* The cycle's phases (stats.h): submitted by the loop; started, ended
     * and answered (batch_after) on the compute thread. */
    uint64_t t_submit, t_start, t_end, t_replied;
    int rc;                   /* a failure of the whole batch */
    char err[192];
};

void request_free(struct request *req)
{
    if (!req)
        return;
    tensor_ref_done(&req->x);
    tensor_ref_done(&req->logits);
    tensor_ref_done(&req->ids);
    tensor_ref_done(&req->weights);
    tensor_ref_done(&req->out);
    tensor_ref_done(&req->a);
    tensor_ref_done(&req->c);
    free(req->m_sizes);
    free(req);
}

/* A request's Reply: its status and timings, with the compute time and
 * the largest batch it ran in given. */
static void reply_fill(const struct request *req, uint64_t compute_us, uint32_t batch_requests,
                       uint32_t batch_tokens, Moe__Reply *rep, Moe__Timings *tm)
{
    moe__reply__init(rep);
    moe__timings__init(tm);
    rep->id = req->id;
    rep->status = status_from_errno(req->status);
    rep->message = req->status ? (char *)req->message : (char *)"";
    tm->queue_us = req->start_us > req->arrival_us ? req->start_us - req->arrival_us : 0;
    tm->compute_us = compute_us;
    tm->batch_requests = batch_requests;
    tm->batch_tokens = batch_tokens;
    rep->timings = tm;
}

/* Count an answered request and free it; loop thread. */
static void request_settle(struct server *s, struct request *req)
{
    if (req->status) {
        s->stats.errors++;
        if (req->status == -ETIME)
            s->stats.expired++;
    } else {
        s->stats.requests++;
        s->stats.tokens += (uint64_t)req->tokens;
        req->layer->requests++;
        req->layer->tokens += (uint64_t)req->tokens;
        ring_add(&s->stats.queue_wait_us, req->start_us - req->arrival_us);
    }
    layer_unref(s, &req->layer);
    request_free(req);
}

/* Reply to a request and free it; loop thread. */
static void request_finish(struct server *s, struct request *req)
{
    Moe__Reply rep;
    Moe__Timings tm;
    reply_fill(req, req->compute_us, req->batch_requests, req->batch_tokens, &rep, &tm);
    server_reply_session(s, req->session_id, req->route_id, req->route_len, &rep);
    request_settle(s, req);
}

static void request_fail(struct server *s, struct request *req, int err, const char *why)
{
    req->status = err;
    snprintf(req->message, sizeof(req->message), "%s", why);
    request_finish(s, req);
}

/* Account for rows leaving the queue (handed to a batch or cancelled). */
static void queue_account(struct server *s, struct request *req, int rows)
{
    struct layer *l = req->layer;
    l->queued_tokens -= (uint64_t)rows;
    struct session *se = session_by_id(s, req->session_id);
    if (se)
        se->queued_tokens -= (uint64_t)rows;
}

/* Unlink the queued request after prev (or the head) of layer l. */
static void queue_unlink(struct server *s, struct layer *l, struct request *prev,
                         struct request *req)
{
    if (prev)
        prev->next = req->next;
    else
        l->queue_head = req->next;
    if (l->queue_tail == req)
        l->queue_tail = prev;
    req->next = NULL;
    req->queued = false;
    l->queued--;
    s->queued_total--;
    if (req->deadline_us)
        s->queued_deadlines--;
    struct session *se = session_by_id(s, req->session_id);
    if (se)
        se->queued_requests--;
}

void batch_enqueue(struct server *s, struct request *req)
{
    struct session *se = session_by_id(s, req->session_id);
    struct layer *l = req->layer;
    if (s->draining) {
        request_fail(s, req, -ECANCELED, "daemon is shutting down");
        return;
    }
    if (req->tokens == 0) {
        /* A grouped GEMM whose groups are all empty: nothing to compute. In
         * the queue it would never be taken (a batch takes rows) and would
         * stall its layer for everyone. */
        req->start_us = req->arrival_us;
        request_finish(s, req);
        return;
    }
    if ((uint64_t)req->tokens > s->cfg->max_queued_tokens) {
        /* BUSY would say "try again", and it would never fit. */
        char why[128];
        snprintf(why, sizeof(why), "request of %d tokens is larger than a session's queue "
                 "(max_queued_tokens %u)", req->tokens, s->cfg->max_queued_tokens);
        request_fail(s, req, -EDQUOT, why);
        return;
    }
    if (se && (se->queued_requests >= s->cfg->max_queued_requests ||
               se->queued_tokens + (uint64_t)req->tokens > s->cfg->max_queued_tokens)) {
        char why[160];
        snprintf(why, sizeof(why), "session queue full (%u requests, %llu tokens queued)",
                 se->queued_requests, (unsigned long long)se->queued_tokens);
        s->stats.busy++;
        request_fail(s, req, -EBUSY, why);
        return;
    }
    if (s->queued_total >= s->cfg->max_queued_total) {
        char why[96];
        snprintf(why, sizeof(why), "daemon queue full (%u requests queued, the limit)",
                 s->queued_total);
        s->stats.busy++;
        request_fail(s, req, -EBUSY, why);
        return;
    }
    req->next = NULL;
    req->queued = true;
    if (l->queue_tail)
        l->queue_tail->next = req;
    else
        l->queue_head = req;
    l->queue_tail = req;
    l->queued++;
    l->queued_tokens += (uint64_t)req->tokens;
    s->queued_total++;
    if (req->deadline_us)
        s->queued_deadlines++;
    if (se) {
        se->queued_requests++;
        se->queued_tokens += (uint64_t)req->tokens;
    }
    /* Requests read in one drain of the socket start one batch together,
     * at its end, rather than the first alone and the rest after it. */
    if (!s->in_drain)
        batch_kick(s);
}

/* Cancel queued requests that match. One whose earlier slices are in the
 * running batch only leaves the queue; batch_done answers it. */
static void cancel_where(struct server *s, struct layer *l, uint64_t session_id, bool all,
                         int err, const char *why)
{
    struct request *prev = NULL, *req = l->queue_head;
    while (req) {
        struct request *next = req->next;
        if (all || req->session_id == session_id) {
            queue_account(s, req, req->tokens - req->next_row);
            queue_unlink(s, l, prev, req);
            if (req->next_row > req->rows_done) {
                /* The compute thread owns status while the batch runs. */
                req->cancel_err = err;
                snprintf(req->cancel_why, sizeof(req->cancel_why), "%s", why);
            } else {
                request_fail(s, req, err, why);
            }
        } else {
            prev = req;
        }
        req = next;
    }
}

void batch_cancel_session(struct server *s, uint64_t session_id)
{
    for (struct layer *l = s->layers; l; l = l->next)
        cancel_where(s, l, session_id, false, -ECANCELED, "session closed");
}

void batch_cancel_layer(struct server *s, struct layer *l, int err, const char *why)
{
    cancel_where(s, l, 0, true, err, why);
}

/* Requests whose deadline passed before any of their rows started are
 * failed; returns the earliest deadline of those left that have not
 * started, or 0 for none. */
static uint64_t expire_queued(struct server *s, uint64_t now)
{
    if (!s->queued_deadlines)
        return 0; /* the usual case: no walk over every queue at each kick */
    uint64_t first = 0;
    for (struct layer *l = s->layers; l; l = l->next) {
        struct request *prev = NULL, *req = l->queue_head;
        while (req) {
            struct request *next = req->next;
            bool waiting = req->deadline_us && req->next_row == 0;
            if (waiting && now >= req->deadline_us) {
                queue_account(s, req, req->tokens);
                queue_unlink(s, l, prev, req);
                request_fail(s, req, -ETIME, "deadline passed while the request was queued");
            } else {
                if (waiting && (!first || req->deadline_us < first))
                    first = req->deadline_us;
                prev = req;
            }
            req = next;
        }
    }
    return first;
}

/* ---- compute thread ------------------------------------------------------ */

static int staging_reserve(struct batch_job *bj, size_t need)
{
    struct server *s = bj->s;
    if (need <= s->staging_size)
        return 0;
    size_t size = need + need / 4;
    void *p = s->backend->ops->host_alloc(s->backend, size);
    if (!p)
        return -ENOMEM;
    if (s->staging)
        s->backend->ops->host_free(s->backend, s->staging, s->staging_size);
    s->staging = p;
    s->staging_size = size;
    return 0;
}

/* Copy rows [row0, row0 + rows) of a request's routing into staging,
 * checking ids in the copy. */
static int gather_routing(struct layer *l, struct batch_item *it, int32_t *ids, float *w,
                          float *logits)
{
    struct request *req = it->req;
    size_t E = (size_t)l->shape.experts, k = (size_t)l->shape.topk;
    size_t first = (size_t)it->row0, rows = (size_t)it->rows, tk = rows * k;
    if (req->logits.region) {
        size_t n = rows * E;
        if (req->logits.dtype == MOE__DTYPE__DTYPE_FP32)
            memcpy(logits, (const float *)req->logits.ptr + first * E, n * sizeof(float));
        else
            moek_to_f32(l->dt, (const uint8_t *)req->logits.ptr + first * E * moek_dtype_size(l->dt),
                        logits, n);
        return 0;
    }
    if (req->ids.dtype == MOE__DTYPE__DTYPE_INT64) {
        const int64_t *src = (const int64_t *)req->ids.ptr + first * k;
        for (size_t i = 0; i < tk; i++) {
            int64_t v = src[i]; /* read once: the client may be writing */
            if (v < 0 || v >= (int64_t)E) {
                snprintf(req->message, sizeof(req->message),
                         "topk_ids[%zu][%zu] = %lld is outside [0, %zu)", first + i / k, i % k,
                         (long long)v, E);
                return -EINVAL;
            }
            ids[i] = (int32_t)v;
        }
    } else {
        memcpy(ids, (const int32_t *)req->ids.ptr + first * k, tk * sizeof(int32_t));
        for (size_t i = 0; i < tk; i++)
            if (ids[i] < 0 || ids[i] >= (int32_t)E) {
                snprintf(req->message, sizeof(req->message),
                         "topk_ids[%zu][%zu] = %d is outside [0, %zu)", first + i / k, i % k,
                         ids[i], E);
                return -EINVAL;
            }
    }
    memcpy(w, (const float *)req->weights.ptr + first * k, tk * sizeof(float));
    return 0;
}

/* The message of a failed backend call, for every request of the batch:
 * the errno's text and the backend's own (the CUDA error, say). Called on
 * the compute thread right after the call, where that text lives. */
static void batch_backend_failed(struct batch_job *bj)
{
    struct backend *b = bj->s->backend;
    char why[sizeof(bj->err)];
    snprintf(bj->err, sizeof(bj->err), "%s backend failed: %s%s", b->name, strerror(-bj->rc),
             backend_error_note(b, why, sizeof(why)));
}

static void run_moe(struct batch_job *bj)
{
    struct layer *l = bj->layer;
    size_t es = moek_dtype_size(l->dt);
    size_t H = (size_t)l->shape.hidden, E = (size_t)l->shape.experts, k = (size_t)l->shape.topk;
    size_t T = bj->tokens, row_bytes = H * es;
    bool given = l->routing == MOE__ROUTING__ROUTING_GIVEN;
    size_t x_bytes = T * row_bytes, r_bytes = given ? T * k * 8 : T * E * 4;
    size_t r_off = (x_bytes + 63) & ~(size_t)63;
    size_t o_off = r_off + ((r_bytes + 63) & ~(size_t)63);
    if ((bj->rc = staging_reserve(bj, o_off + x_bytes + 64))) {
        snprintf(bj->err, sizeof(bj->err), "cannot allocate %zu bytes of staging memory",
                 o_off + x_bytes);
        return;
    }
    uint8_t *base = bj->s->staging;
    uint8_t *x = base, *out = base + o_off;
    float *logits = (float *)(base + r_off);
    int32_t *ids = (int32_t *)(base + r_off);
    float *w = (float *)(base + r_off + T * k * 4);
    /* Rows by DMA straight from and to the regions, where the backend can. */
    struct backend_rows *segs = NULL;
    int n_segs = 0;
    if (!l->shards.n && bj->s->backend->ops->moe_rows)
        segs = malloc(bj->n_items * sizeof(*segs)); /* NULL: through staging */
    const bool direct = segs != NULL;
    size_t row = 0;
    for (uint32_t i = 0; i < bj->n_items; i++) {
        struct batch_item *it = &bj->items[i];
        if (it->req->status == 0) /* else it failed in an earlier slice */
            it->req->status = gather_routing(l, it, ids + row * k, w + row * k, logits + row * E);
        it->skip = it->req->status != 0;
        if (it->skip)
            continue; /* its rows are skipped: the next item reuses them */
        size_t at = (size_t)it->row0 * row_bytes;
        if (segs)
            segs[n_segs++] = (struct backend_rows){
                (const uint8_t *)it->req->x.ptr + at, (uint8_t *)it->req->out.ptr + at, it->rows,
                it->req->x.region->pin_cookie && it->req->out.region->pin_cookie};
        else
            memcpy(x + row * row_bytes, (const uint8_t *)it->req->x.ptr + at,
                   (size_t)it->rows * row_bytes);
        row += (size_t)it->rows;
    }
    if (row == 0) {
        free(segs);
        return;
    }
    struct backend_moe_io io = {
        .x = direct ? NULL : x, .logits = given ? NULL : logits, .ids = given ? ids : NULL,
        .weights = given ? w : NULL, .tokens = (int)row, .out = direct ? NULL : out,
        .segs = segs, .n_segs = n_segs,
    };
    if (l->shards.n)
        bj->rc = shard_run(&l->shards, bj->s->backends, &l->shape, l->dt, &io);
    else
        bj->rc = bj->s->backend->ops->moe_run(bj->s->backend, l->weights, &io);
    free(segs);
    if (bj->rc) {
        batch_backend_failed(bj);
        return;
    }
    if (direct)
        return; /* the outputs are in the regions already */
    row = 0;
    for (uint32_t i = 0; i < bj->n_items; i++) {
        struct batch_item *it = &bj->items[i];
        if (it->skip)
            continue;
        memcpy((uint8_t *)it->req->out.ptr + (size_t)it->row0 * row_bytes, out + row * row_bytes,
               (size_t)it->rows * row_bytes);
        row += (size_t)it->rows;
    }
}

/* Grouped GEMM requests are never sliced: rows of group g from every
 * request, in request order, form the batch's group g. */
static void run_gemm(struct batch_job *bj)
{
    struct layer *l = bj->layer;
    size_t es = moek_dtype_size(l->dt);
    size_t G = l->groups, N = l->n, K = l->k, M = bj->tokens;
    size_t a_bytes = M * K * es, c_off = (a_bytes + 63) & ~(size_t)63;
    size_t ms_off = c_off + ((M * N * es + 63) & ~(size_t)63);
    if ((bj->rc = staging_reserve(bj, ms_off + G * sizeof(int64_t) + 64))) {
        snprintf(bj->err, sizeof(bj->err), "cannot allocate staging memory");
        return;
    }
    uint8_t *a = bj->s->staging, *c = a + c_off;
    int64_t *m_sizes = (int64_t *)(a + ms_off);
    size_t *first = calloc(bj->n_items, sizeof(*first));
    if (!first) {
        bj->rc = -ENOMEM;
        snprintf(bj->err, sizeof(bj->err), "out of memory");
        return;
    }
    size_t row = 0;
    for (size_t g = 0; g < G; g++) {
        m_sizes[g] = 0;
        for (uint32_t i = 0; i < bj->n_items; i++) {
            struct request *req = bj->items[i].req;
            size_t m = (size_t)req->m_sizes[g];
            memcpy(a + row * K * es, (uint8_t *)req->a.ptr + first[i] * K * es, m * K * es);
            first[i] += m;
            row += m;
            m_sizes[g] += (int64_t)m;
        }
    }
    if (M > 0)
        bj->rc = bj->s->backend->ops->gemm_run(bj->s->backend, l->weights, a, m_sizes,
                                               (int64_t)M, c);
    if (bj->rc) {
        batch_backend_failed(bj);
    } else {
        memset(first, 0, bj->n_items * sizeof(*first));
        row = 0;
        for (size_t g = 0; g < G; g++)
            for (uint32_t i = 0; i < bj->n_items; i++) {
                struct request *req = bj->items[i].req;
                size_t m = (size_t)req->m_sizes[g];
                memcpy((uint8_t *)req->c.ptr + first[i] * N * es, c + row * N * es, m * N * es);
                first[i] += m;
                row += m;
            }
    }
    free(first);
}

/*
 * Replies as the batch ends. Sending one costs a few microseconds, mostly
 * the wake-up of its client, and the clients' next requests come back
 * while the rest are sent. So the compute thread, awake anyway, sends them
 * from the moment the device is done (the worker's after(), before the job
 * is handed back), while the loop thread reads and queues the requests
 * that come back meanwhile: before, the loop thread sent half the replies
 * and read the first requests back only once the last reply had gone.
 * Only the replies that need nothing of the loop thread go this way: a
 * request whole in this batch (cancels and expiries touch queued requests
 * only) that succeeded, to its session's reply socket (held through chan,
 * so the socket outlives a session that ends meanwhile) while the loop
 * thread holds no replies for that socket (chan->direct), sent if the
 * socket has room at once. Everything else, and whatever did not go,
 * batch_done answers.
 */
static bool item_reply_now(struct batch_job *bj, struct batch_item *it)
{
    struct request *req = it->req;
    if (!it->chan || bj->rc || req->status ||
        !atomic_load_explicit(&it->chan->direct, memory_order_acquire))
        return false;
    /* As batch_done will have it: this batch is its only one. */
    Moe__Reply rep;
    Moe__Timings tm;
    reply_fill(req, bj->compute_us, bj->n_items, (uint32_t)bj->tokens, &rep, &tm);
    return reply_chan_send(it->chan, &rep) == 0;
}

/* Compute thread, after batch_run and before batch_done (worker.h). */
static void batch_after(struct job *job)
{
    struct batch_job *bj = (struct batch_job *)job;
    for (uint32_t i = 0; i < bj->n_items; i++)
        bj->items[i].replied = item_reply_now(bj, &bj->items[i]);
    bj->t_replied = now_us();
}

static void batch_run(struct job *job)
{
    struct batch_job *bj = (struct batch_job *)job;
    uint64_t t0 = now_us();
    bj->t_start = t0;
    if (bj->layer->kind == MOE__LAYER_KIND__LAYER_MOE)
        run_moe(bj);
    else
        run_gemm(bj);
    bj->t_end = now_us();
    bj->compute_us = bj->t_end - t0;
    for (uint32_t i = 0; i < bj->n_items; i++) {
        struct request *req = bj->items[i].req;
        if (bj->rc && !req->status) {
            req->status = bj->rc;
            snprintf(req->message, sizeof(req->message), "%s", bj->err);
        }
    }
}

/* ---- loop thread ---------------------------------------------------------- */

static void batch_done(struct job *job)
{
    struct batch_job *bj = (struct batch_job *)job;
    struct server *s = bj->s;
    struct stats *st = &s->stats;
    uint64_t t_seen = now_us();
    st->batches++;
    hist_add(&st->batch_requests, bj->n_items);
    hist_add(&st->batch_tokens, bj->tokens);
    st->compute_us_total += bj->compute_us;
    ring_add(&st->compute_us, bj->compute_us);
    if (bj->rc) /* the daemon's own failure, not a client's bad input */
        log_warn("layer '%s': a batch of %u requests failed: %s", bj->layer->name, bj->n_items,
                 bj->err);
    for (uint32_t i = 0; i < bj->n_items; i++) {
        struct batch_item *it = &bj->items[i];
        struct request *req = it->req;
        req->rows_done += it->rows;
        req->compute_us += bj->compute_us;
        if (bj->n_items > req->batch_requests)
            req->batch_requests = bj->n_items;
        if (bj->tokens > req->batch_tokens)
            req->batch_tokens = (uint32_t)bj->tokens;
        if (req->cancel_err && !req->status) {
            req->status = req->cancel_err;
            snprintf(req->message, sizeof(req->message), "%s", req->cancel_why);
        }
        if (req->status && req->queued) {
            /* A slice failed: the rest of the request is not run. */
            struct request *prev = NULL;
            for (struct request *q = req->layer->queue_head; q != req; q = q->next)
                prev = q;
            queue_account(s, req, req->tokens - req->next_row);
            queue_unlink(s, req->layer, prev, req);
        }
        if (it->replied) /* whole, done, and answered already */
            request_settle(s, req);
        else if (!req->queued && req->rows_done == req->next_row)
            request_finish(s, req);
    }
    /* Remember who was served, to wait for them (see the top); the items
     * hold their sessions' ids, as the requests may be freed above. */
    s->n_awaited = 0;
    s->awaited_back = 0;
    if (bj->n_items >= 2 && s->cfg->return_wait_us && s->cfg->batching) {
        for (uint32_t i = 0; i < bj->n_items && s->n_awaited < ARRAY_SIZE(s->awaited); i++) {
            uint64_t sid = bj->items[i].session_id;
            bool dup = false;
            for (uint32_t j = 0; j < s->n_awaited && !dup; j++)
                dup = s->awaited[j] == sid;
            if (!dup)
                s->awaited[s->n_awaited++] = sid;
        }
        if (s->n_awaited < 2)
            s->n_awaited = 0;
        s->awaited_until_us = now_us() + s->cfg->return_wait_us;
    }
    /* Where the device's time between two batches goes, counted while the
     * device is kept busy (gaps under 10 ms). */
    uint64_t t_loop_done = now_us(); /* and the loop's replies with it */
    if (st->prev_end_us && bj->t_start > st->prev_end_us &&
        bj->t_start - st->prev_end_us < 10000) {
        ring_add(&st->idle_us, bj->t_start - st->prev_end_us);
        ring_add(&st->return_us, bj->t_submit > st->prev_replied_us
                                     ? bj->t_submit - st->prev_replied_us : 0);
    }
    /* The compute thread's replies, then the loop's (batch_after). */
    ring_add(&st->notice_us, t_seen - bj->t_replied);
    ring_add(&st->reply_us, (bj->t_replied - bj->t_end) + (t_loop_done - t_seen));
    ring_add(&st->launch_us, bj->t_start - bj->t_submit);
    st->prev_end_us = bj->t_end;
    st->prev_replied_us = t_loop_done;
    for (uint32_t i = 0; i < bj->n_items; i++)
        reply_chan_unref(&bj->items[i].chan);
    layer_unref(s, &bj->layer);
    free(bj->items);
    free(bj);
    s->batch_running = false;
    if (server_check_devices(s))
        return;
    batch_kick(s);
}

/* The ready layer whose head request arrived first. */
static struct layer *batch_pick_layer(struct server *s)
{
    struct layer *best = NULL;
    for (struct layer *l = s->layers; l; l = l->next)
        if (l->queue_head && l->state == LAYER_READY &&
            (!best || l->queue_head->arrival_us < best->queue_head->arrival_us))
            best = l;
    return best;
}

static int batch_add(struct batch_job *bj, struct request *req, int rows)
{
    if (bj->n_items == bj->cap_items) {
        uint32_t cap = bj->cap_items ? 2 * bj->cap_items : 16;
        struct batch_item *n = realloc(bj->items, cap * sizeof(*n));
        if (!n)
            return -ENOMEM;
        bj->items = n;
        bj->cap_items = cap;
    }
    struct batch_item *it = &bj->items[bj->n_items++];
    *it = (struct batch_item){req, req->next_row, rows, req->session_id, false, NULL, false};
    const bool whole = req->next_row == 0 && rows == req->tokens;
    struct session *se = whole ? session_by_id(bj->s, req->session_id) : NULL;
    if (se && se->chan)
        it->chan = reply_chan_ref(se->chan);
    req->next_row += rows;
    bj->tokens += (uint64_t)rows;
    return 0;
}


/* With max_delay_us, a batch that is not yet full waits until its oldest
 * request has waited that long. True if the caller should wait. */
/* Arm the delay timer to fire at `due`; false if it cannot be armed. While
 * the batcher waits, every request that arrives kicks it again with the same
 * due time: a timer already set to fire by then is left alone (one
 * timerfd_settime per wait, not one per request). */
static bool delay_until(struct server *s, uint64_t due, uint64_t now)
{
    if (s->delay_due_us && s->delay_due_us <= due)
        return true;
    if (!s->delay_timer || loop_timer_set(s->delay_timer, due - now, 0) < 0)
        return false;
    s->delay_due_us = due;
    return true;
}

/* True while a session served by the last batch has not come back.
 * deadline: the earliest of the queued requests' (0: none); the batcher
 * never waits past it, for a request to expire that it chose not to start. */
static bool batch_awaiting_returns(struct server *s, struct layer *l, uint64_t now,
                                   uint64_t deadline)
{
    if (!s->n_awaited)
        return false;
    if (now >= s->awaited_until_us || s->draining ||
        l->queued_tokens >= s->cfg->max_batch_tokens ||
        (deadline && deadline <= s->awaited_until_us)) {
        s->n_awaited = 0;
        return false;
    }
    for (; s->awaited_back < s->n_awaited; s->awaited_back++) {
        struct session *se = session_by_id(s, s->awaited[s->awaited_back]);
        if (se && se->queued_requests == 0)
            return delay_until(s, s->awaited_until_us, now);
    }
    s->n_awaited = 0;
    return false;
}

static bool batch_should_wait(struct server *s, struct layer *l, uint64_t now,
                              uint64_t deadline)
{
    if (batch_awaiting_returns(s, l, now, deadline))
        return true;
    uint64_t delay = s->cfg->max_delay_us;
    if (!delay || !s->cfg->batching || s->draining ||
        l->queued_tokens >= s->cfg->max_batch_tokens)
        return false;
    uint64_t due = l->queue_head->arrival_us + delay;
    if (now >= due || (deadline && deadline <= due))
        return false;
    return delay_until(s, due, now); /* cannot wait: run now rather than never */
}

static void batch_on_delay_timer(void *data)
{
    struct server *s = data;
    s->delay_due_us = 0;
    batch_kick(s);
}

int batch_init(struct server *s)
{
    /* Made once, at start, so the daemon's descriptors do not change with
     * its load (tests compare them before and after). */
    s->delay_timer = loop_timer(s->loop, 0, batch_on_delay_timer, s);
    return s->delay_timer ? 0 : -errno;
}

void batch_kick(struct server *s)
{
    if (s->batch_running || s->queued_total == 0 || !s->compute)
        return;
    uint64_t now = now_us();
    uint64_t deadline = expire_queued(s, now);
    struct layer *l = batch_pick_layer(s);
    if (!l || batch_should_wait(s, l, now, deadline))
        return;
    struct batch_job *bj = calloc(1, sizeof(*bj));
    if (!bj)
        return; /* retried at the next kick */
    bj->s = s;
    bj->layer = layer_ref(l);
    uint64_t cap = s->cfg->max_batch_tokens;
    bool alone = !s->cfg->batching;
    struct request *prev = NULL, *req = l->queue_head;
    while (req && bj->tokens < cap) {
        struct request *next = req->next;
        bool first = bj->n_items == 0;
        if (!first && (alone || req->no_batch || bj->items[0].req->no_batch))
            break;
        int left = req->tokens - req->next_row;
        int rows = left;
        if (req->kind == REQ_FUSED_MOE) {
            /* Slices keep the device shared: requests that arrive while a
             * long one runs join its next slice instead of waiting for all
             * of it. */
            uint64_t room = cap - bj->tokens, slice = s->cfg->max_slice_tokens;
            room = room < slice ? room : slice;
            if ((uint64_t)rows > room)
                rows = (int)room;
        } else if (!first && bj->tokens + (uint64_t)rows > cap) {
            break; /* a GEMM request goes whole, into a batch with room */
        }
        if (rows <= 0 || batch_add(bj, req, rows) < 0)
            break;
        if (req->start_us == 0)
            req->start_us = now;
        queue_account(s, req, rows);
        if (req->next_row == req->tokens)
            queue_unlink(s, l, prev, req);
        else
            prev = req;
        req = next;
    }
    if (bj->n_items == 0) {
        layer_unref(s, &bj->layer);
        free(bj);
        return;
    }
    bj->job.run = batch_run;
    bj->job.done = batch_done;
    bj->job.after = batch_after;
    s->batch_running = true;
    bj->t_submit = now_us();
    worker_submit(s->compute, &bj->job);
}
