/*
 * backend_cuda.c: the CUDA backend. Weights live on the device in the
 * kernels' own layout (kernels/cuda/moe_cuda.h). A fused MoE batch's rows
 * move by DMA straight between the clients' pinned regions and device
 * buffers (moe_rows: one batched copy in, one out), its routing from the
 * daemon's pinned staging memory; everything runs on one stream with one
 * synchronisation at the end. Client regions are pinned once, when they are
 * registered (cuda_pin). Measured on the H200, one mixtral-shaped request,
 * before (rows copied by the CPU through staging) -> after: 64 rows 808 ->
 * 707 us of daemon compute, 4096 rows 15.6 -> 8.5 ms round trip
 * (tests/gpu/RESULTS.md).
 *
 * Small batches (up to GRAPH_MAX_TOKENS rows) run as CUDA graph replays:
 * the routing copy, the routing, both GEMMs (and, for callers that pass
 * staging buffers, the row copies) are captured once per (layer, token
 * count) and replayed, so launch overhead does not dominate decode. The
 * graphs name fixed device and staging buffers; when a buffer must grow,
 * every graph is dropped and recaptured on demand.
 *
 * A sticky CUDA error (a kernel fault poisons the context) makes the backend
 * unhealthy; the daemon then exits non-zero and systemd restarts it.
 *
 * Token tiles: a MoE layer takes, when it is made, the rules of the tile
 * table's entry for this card, its dtype and shape (set_tiles, tiles.h),
 * else keeps the kernels' heuristic; moe_tune measures the rules for
 * `moed --tune` on a layer of random weights made for the purpose.
 *
 * Built only with MOE_HAVE_CUDA (nvcc found at build time); otherwise
 * backend_cuda_new() reports -ENODEV and the CPU backend serves.
 */
#include "daemon/backend.h"

#include <errno.h>
#include <stddef.h>

#ifndef MOE_HAVE_CUDA

int backend_cuda_new(int device, struct backend **out)
{
    *out = NULL;
    return -ENODEV;
}

int backend_cuda_count(void)
{
    return 0;
}

void backend_cuda_transport(const char *name)
{
}

#else

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/util.h"
#include "kernels/cuda/moe_cuda.h"

#define GRAPH_MAX_TOKENS 64

/* A device buffer that only grows. */
struct dbuf {
    void *p;
    size_t size;
};

struct cuda_weights {
    bool gemm;
    moek_moe_shape shape;
    moek_dtype dt;
    moek_scoring scoring;
    bool renormalize;
    moek_cuda_moe_layer *moe;
    moek_cuda_gemm_weights *g;
    int groups, n, k;
    /* Graphs by token count; each replays only with the device buffers
     * (generation) and staging pointers it was captured with. */
    void *graph[GRAPH_MAX_TOKENS + 1];
    unsigned graph_gen[GRAPH_MAX_TOKENS + 1];
    struct backend_moe_io graph_io[GRAPH_MAX_TOKENS + 1];
    /* A shard of a spread layer: its remap table on the device. */
    int32_t *remap_dev;
    /* Where the MoE layer's token tiles come from. */
    enum { TILE_SRC_NONE, TILE_SRC_NO_ENTRY, TILE_SRC_TABLE, TILE_SRC_REFUSED } tiles_from;
    int n_rules;
};

/* Groups of devices that serve spread layers, by device list. */
#define EP_GROUPS 8
struct ep_group {
    int n;
    int devices[16];
    moek_cuda_ep *ep;
    uint64_t used; /* the home's ep_clock when last used */
};

static moek_cuda_ep_transport g_transport = MOEK_CUDA_EP_AUTO;

struct cuda_backend {
    struct backend base;
    int device;
    void *stream;
    moek_cuda_workspace *ws;
    struct dbuf x, route, weights, out;
    /* The batched copy's lists for io->segs (moe_rows): cp_cap destinations,
     * then as many sources and sizes, in one block grown as needed. */
    void *cp;
    size_t cp_cap;
    unsigned gen;       /* bumped whenever a buffer above moves */
    atomic_bool broken; /* a sticky error: the context is unusable (set by the loader or
                         * compute thread, read by the loop) */
    char name[96];
    char model[TILES_DEVICE_MAX]; /* the card's name, the tile table's key */
    int sms;            /* the card's multiprocessors and memory, read once at open */
    size_t mem_bytes;
    bool rows_kernel;   /* small batches' rows by kernel (cuda_copy_rows) */
    struct ep_group eps[EP_GROUPS]; /* as the home device of spread layers */
    uint64_t ep_clock;              /* counts cuda_ep_get's calls */
    /* The tile table's entries for this card (set_tiles from the loop
     * thread, read by cuda_moe_new on the loader thread). */
    pthread_mutex_t tiles_lock;
    struct tile_table tiles;
    bool have_table;
};

static int cuda_check(struct cuda_backend *cb, int rc)
{
    if (rc == -EIO && !moek_cuda_context_ok())
        cb->broken = true;
    return rc;
}

/* A run's end: on failure, what it enqueued may still read the staging
 * buffer or the clients' regions, which the caller may reuse or release
 * once it returns, so the stream is waited for first. A wait that fails
 * found a fault in that work, whatever the run's own error: the context
 * is checked for it too. */
static int cuda_failed(struct cuda_backend *cb, int rc)
{
    if (rc && moek_cuda_stream_sync(cb->stream) == -EIO)
        cuda_check(cb, -EIO);
    return cuda_check(cb, rc);
}

/* The device buffers grow with the batches, with a quarter's headroom so
 * that slowly growing batches do not move them each time. Their contents
 * need not survive, so the old buffer goes before the new one is made: at
 * no moment are both held. Where the headroom does not fit, the exact size
 * is tried, so a batch that fits the device is not refused for it. */
static int dbuf_reserve(struct cuda_backend *cb, struct dbuf *b, size_t need)
{
    if (need <= b->size)
        return 0;
    int rc = moek_cuda_stream_sync(cb->stream);
    if (rc)
        return cuda_check(cb, rc);
    moek_cuda_free(b->p);
    b->p = NULL;
    b->size = 0;
    cb->gen++;
    size_t size = need + need / 4;
    rc = moek_cuda_malloc(size, &b->p);
    if (rc == -ENOMEM) {
        moek_cuda_clear_error(); /* the retry's text, if any, is the one */
        rc = moek_cuda_malloc(size = need, &b->p);
    }
    if (rc)
        return cuda_check(cb, rc);
    b->size = size;
    return 0;
}

static int cuda_ws_reserve(struct cuda_backend *cb, size_t need)
{
    if (cb->ws && moek_cuda_workspace_bytes(cb->ws) >= need)
        return 0;
    int rc = moek_cuda_stream_sync(cb->stream);
    if (rc)
        return cuda_check(cb, rc);
    moek_cuda_workspace_free(cb->ws);
    cb->ws = NULL;
    cb->gen++;
    rc = moek_cuda_workspace_new(cb->device, need + need / 4, &cb->ws);
    if (rc == -ENOMEM) {
        moek_cuda_clear_error();
        rc = moek_cuda_workspace_new(cb->device, need, &cb->ws);
    }
    return cuda_check(cb, rc);
}

/* Give a new MoE layer the table's rules for its card, dtype and shape. A
 * table the kernels refuse (the parser checks what they check, so this
 * should not happen) leaves the heuristic; the log says so. */
static void cuda_apply_tiles(struct cuda_backend *cb, struct cuda_weights *w)
{
    pthread_mutex_lock(&cb->tiles_lock);
    const struct tile_entry *e = tiles_find(&cb->tiles, cb->model, w->dt, &w->shape);
    w->tiles_from = !cb->have_table ? TILE_SRC_NONE : e ? TILE_SRC_TABLE : TILE_SRC_NO_ENTRY;
    if (e) {
        moek_cuda_tile_rule rules[TILES_MAX_RULES];
        for (int i = 0; i < e->n_rules; i++)
            rules[i] = (moek_cuda_tile_rule){e->rules[i].min_tokens, e->rules[i].tile};
        w->n_rules = e->n_rules;
        if (moek_cuda_moe_layer_set_tiles(w->moe, rules, e->n_rules) != 0)
            w->tiles_from = TILE_SRC_REFUSED;
    }
    pthread_mutex_unlock(&cb->tiles_lock);
}

static int cuda_moe_new(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                        moek_scoring scoring, bool renormalize, const void *w1, const void *w3,
                        const void *w2, void **handle)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    moek_cuda_clear_error();
    struct cuda_weights *w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    w->shape = *shape;
    w->dt = dt;
    w->scoring = scoring;
    w->renormalize = renormalize;
    int rc = moek_cuda_set_device(cb->device);
    if (!rc)
        rc = moek_cuda_moe_layer_new(shape, dt, w1, w3, w2, cb->device, &w->moe);
    if (rc) {
        free(w);
        return cuda_check(cb, rc);
    }
    cuda_apply_tiles(cb, w);
    *handle = w;
    return 0;
}

static int cuda_gemm_new(struct backend *b, moek_dtype dt, int groups, int n, int k,
                         const void *bw, void **handle)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    moek_cuda_clear_error();
    struct cuda_weights *w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    w->gemm = true;
    w->dt = dt;
    w->groups = groups;
    w->n = n;
    w->k = k;
    int rc = moek_cuda_set_device(cb->device);
    if (!rc)
        rc = moek_cuda_gemm_weights_new(dt, groups, n, k, bw, cb->device, &w->g);
    if (rc) {
        free(w);
        return cuda_check(cb, rc);
    }
    *handle = w;
    return 0;
}

static void cuda_weights_free(struct backend *b, void *handle)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    struct cuda_weights *w = handle;
    if (!w)
        return;
    moek_cuda_set_device(cb->device);
    for (int t = 0; t <= GRAPH_MAX_TOKENS; t++)
        moek_cuda_graph_free(w->graph[t]);
    moek_cuda_moe_layer_free(w->moe);
    moek_cuda_gemm_weights_free(w->g);
    moek_cuda_free(w->remap_dev);
    free(w);
}

/* A batch of many small segments (decode requests of many clients) moves
 * its rows with one kernel that reads and writes the pinned regions over
 * the bus: one DMA per segment costs a few microseconds each, more than
 * its few kilobytes. Large batches keep the copy engines.
 * MOEK_CUDA_ROWS_DMA=1 keeps DMA always (for measuring). */
#define ROWS_KERNEL_MIN_SEGS 4
#define ROWS_KERNEL_MAX_BYTES ((size_t)4 << 20)

/* The rows of io->segs between the clients' regions and the device buffer
 * (in: x rows to cb->x, else cb->out to the output rows), in stream order:
 * one batch of DMA copies, or the row kernel (see above). */
static int cuda_copy_rows(struct cuda_backend *cb, const struct backend_moe_io *io,
                          size_t row_bytes, bool in)
{
    size_t n = (size_t)io->n_segs;
    if (n > cb->cp_cap) {
        size_t cap = n + n / 2 + 16;
        void *p = realloc(cb->cp, cap * (2 * sizeof(void *) + sizeof(size_t) + sizeof(int)));
        if (!p)
            return -ENOMEM;
        cb->cp = p;
        cb->cp_cap = cap;
    }
    void **dst = cb->cp;
    const void **src = (const void **)(dst + cb->cp_cap);
    size_t *size = (size_t *)(src + cb->cp_cap);
    int *rows = (int *)(size + cb->cp_cap);
    size_t row = 0;
    bool pinned = true;
    for (size_t i = 0; i < n; i++) {
        const struct backend_rows *g = &io->segs[i];
        uint8_t *dev = (uint8_t *)(in ? cb->x.p : cb->out.p) + row * row_bytes;
        dst[i] = in ? (void *)dev : g->dst;
        src[i] = in ? g->src : dev;
        size[i] = (size_t)g->rows * row_bytes;
        rows[i] = g->rows;
        pinned = pinned && g->pinned;
        row += (size_t)g->rows;
    }
    if (row != (size_t)io->tokens)
        return -EINVAL;
    if (cb->rows_kernel && pinned && n >= ROWS_KERNEL_MIN_SEGS &&
        row * row_bytes <= ROWS_KERNEL_MAX_BYTES) {
        /* The region side of each segment: src going in, dst coming out. */
        void **host = in ? (void **)src : dst;
        int rc = moek_cuda_copy_rows_mapped(in ? cb->x.p : cb->out.p, host, rows, (int)n,
                                            row_bytes, !in, cb->stream);
        if (rc != -ENOTSUP)
            return rc;
        cb->rows_kernel = false; /* this device cannot: DMA from now on */
        moek_cuda_clear_error();
    }
    return moek_cuda_copy_batch_async(dst, src, size, n, cb->stream);
}

/* Enqueue one forward on the stream: copies in, kernels, copy out (x and out
 * NULL: the caller moves the rows). */
static int cuda_moe_enqueue(struct cuda_backend *cb, struct cuda_weights *w,
                            const struct backend_moe_io *io)
{
    size_t T = (size_t)io->tokens, H = (size_t)w->shape.hidden, E = (size_t)w->shape.experts,
           k = (size_t)w->shape.topk, es = moek_dtype_size(w->dt);
    moek_cuda_routing r = {0};
    int rc = io->x ? moek_cuda_copy_async(cb->x.p, io->x, T * H * es, 0, cb->stream) : 0;
    if (!rc && io->logits) {
        r.kind = MOEK_CUDA_ROUTE_LOGITS;
        r.logits_dev = cb->route.p;
        r.scoring = w->scoring;
        r.renormalize = w->renormalize;
        rc = moek_cuda_copy_async(cb->route.p, io->logits, T * E * 4, 0, cb->stream);
    } else if (!rc) {
        r.kind = MOEK_CUDA_ROUTE_GIVEN;
        r.ids_dev = cb->route.p;
        r.weights_dev = cb->weights.p;
        rc = moek_cuda_copy_async(cb->route.p, io->ids, T * k * 4, 0, cb->stream);
        if (!rc)
            rc = moek_cuda_copy_async(cb->weights.p, io->weights, T * k * 4, 0, cb->stream);
    }
    if (!rc)
        rc = moek_cuda_fused_moe(w->moe, cb->ws, cb->x.p, &r, io->tokens, cb->out.p, cb->stream);
    if (!rc && io->out)
        rc = moek_cuda_copy_async(io->out, cb->out.p, T * H * es, 1, cb->stream);
    return rc;
}

/* A graph captured for a's buffers replays for b's: field by field, as a
 * struct's padding may differ between two calls' copies. */
static bool graph_io_same(const struct backend_moe_io *a, const struct backend_moe_io *b)
{
    return a->x == b->x && a->logits == b->logits && a->ids == b->ids &&
           a->weights == b->weights && a->tokens == b->tokens && a->out == b->out &&
           a->remap == b->remap && a->route_experts == b->route_experts;
}

static int cuda_moe_run(struct backend *b, void *handle, const struct backend_moe_io *io)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    struct cuda_weights *w = handle;
    moek_cuda_clear_error();
    if (cb->broken)
        return -EIO;
    if (io->remap)
        return -ENOTSUP; /* spread layers run through moe_run_sharded */
    size_t T = (size_t)io->tokens, H = (size_t)w->shape.hidden, E = (size_t)w->shape.experts,
           k = (size_t)w->shape.topk, es = moek_dtype_size(w->dt);
    /* Buffers sized for at least a graph's worth, so small batches never
     * move them. */
    size_t Tb = T > GRAPH_MAX_TOKENS ? T : GRAPH_MAX_TOKENS;
    int rc = moek_cuda_set_device(cb->device);
    if (!rc)
        rc = dbuf_reserve(cb, &cb->x, Tb * H * es);
    if (!rc)
        rc = dbuf_reserve(cb, &cb->out, Tb * H * es);
    if (!rc)
        rc = dbuf_reserve(cb, &cb->route, Tb * (E > k ? E : k) * 4);
    if (!rc)
        rc = dbuf_reserve(cb, &cb->weights, Tb * k * 4);
    if (!rc)
        rc = cuda_ws_reserve(cb, moek_cuda_moe_workspace_size(w->moe, (int)Tb));
    if (rc)
        return cuda_check(cb, rc);
    /* Rows by DMA from the regions: the graph holds the kernels and the
     * routing copy only, and is keyed without the per-batch row lists. */
    struct backend_moe_io key = *io;
    key.segs = NULL;
    key.n_segs = 0;
    if (io->segs && (io->x || io->out))
        return -EINVAL;
    const struct backend_moe_io *rows = io->segs ? io : NULL;
    if (rows && (rc = cuda_copy_rows(cb, rows, H * es, true)))
        return cuda_failed(cb, rc);
    io = &key;
    if (T <= GRAPH_MAX_TOKENS) {
        void **g = &w->graph[T];
        if (*g && (w->graph_gen[T] != cb->gen || !graph_io_same(&w->graph_io[T], io))) {
            moek_cuda_graph_free(*g);
            *g = NULL;
        }
        if (!*g) {
            rc = moek_cuda_graph_begin(cb->stream);
            if (!rc) {
                int rc2 = cuda_moe_enqueue(cb, w, io);
                rc = moek_cuda_graph_end(cb->stream, g);
                if (rc2)
                    rc = rc2;
            }
            if (rc) {
                moek_cuda_graph_free(*g);
                *g = NULL;
            } else {
                w->graph_gen[T] = cb->gen;
                w->graph_io[T] = *io;
            }
        }
        if (!rc)
            rc = moek_cuda_graph_launch(*g, cb->stream);
    } else {
        rc = cuda_moe_enqueue(cb, w, io);
    }
    if (!rc && rows)
        rc = cuda_copy_rows(cb, rows, H * es, false);
    if (!rc)
        rc = moek_cuda_stream_sync(cb->stream);
    return cuda_failed(cb, rc);
}

/* The group of these devices, made on first use (NCCL set-up is slow). */
static int cuda_ep_get(struct cuda_backend *home, const int *devices, int n, moek_cuda_ep **out)
{
    uint64_t now = ++home->ep_clock, used[EP_GROUPS];
    bool in_use[EP_GROUPS];
    for (int i = 0; i < EP_GROUPS; i++) {
        struct ep_group *g = &home->eps[i];
        if (g->ep && g->n == n && !memcmp(g->devices, devices, (size_t)n * sizeof(int))) {
            g->used = now;
            *out = g->ep;
            return 0;
        }
        in_use[i] = g->ep != NULL;
        used[i] = g->used;
    }
    /* More device sets than slots: the least recently used goes. */
    struct ep_group *free_slot = &home->eps[slot_to_fill(in_use, used, EP_GROUPS)];
    if (free_slot->ep) {
        moek_cuda_ep_free(free_slot->ep);
        free_slot->ep = NULL;
    }
    int rc = moek_cuda_ep_new(devices, n, g_transport, &free_slot->ep);
    if (rc)
        return rc;
    free_slot->n = n;
    free_slot->used = now;
    memcpy(free_slot->devices, devices, (size_t)n * sizeof(int));
    *out = free_slot->ep;
    return 0;
}

/* A group whose forward failed is not reused: the next forward makes another. */
static void cuda_ep_drop(struct cuda_backend *home, moek_cuda_ep *ep)
{
    for (int i = 0; i < EP_GROUPS; i++)
        if (home->eps[i].ep == ep) {
            moek_cuda_ep_free(ep);
            home->eps[i].ep = NULL;
        }
}

static int cuda_moe_run_sharded(const struct backend_shard *sh, int n, int experts,
                                const struct backend_moe_io *io)
{
    struct cuda_backend *home = (struct cuda_backend *)sh[0].b;
    moek_cuda_clear_error();
    int devices[16];
    moek_cuda_moe_layer *layers[16];
    const int32_t *remaps[16];
    if (n < 1 || n > 16)
        return -EINVAL;
    for (int i = 0; i < n; i++) {
        struct cuda_backend *cb = (struct cuda_backend *)sh[i].b;
        struct cuda_weights *w = sh[i].weights;
        if (cb->broken)
            return -EIO;
        if (!w->remap_dev) {
            int rc = moek_cuda_set_device(cb->device);
            if (!rc)
                rc = moek_cuda_malloc((size_t)experts * sizeof(int32_t), (void **)&w->remap_dev);
            if (!rc)
                rc = moek_cuda_copy_to_device(w->remap_dev, sh[i].remap,
                                              (size_t)experts * sizeof(int32_t));
            if (rc) {
                moek_cuda_free(w->remap_dev);
                w->remap_dev = NULL;
                return cuda_check(cb, rc);
            }
        }
        devices[i] = cb->device;
        layers[i] = w->moe;
        remaps[i] = w->remap_dev;
    }
    moek_cuda_ep *ep;
    int rc = cuda_ep_get(home, devices, n, &ep);
    if (rc)
        return rc == -EIO ? cuda_check(home, rc) : rc;
    const struct cuda_weights *w0 = sh[0].weights;
    moek_cuda_routing r = {
        .kind = io->logits ? MOEK_CUDA_ROUTE_LOGITS : MOEK_CUDA_ROUTE_GIVEN,
        .logits_dev = io->logits, .scoring = w0->scoring, .renormalize = w0->renormalize,
        .ids_dev = io->ids, .weights_dev = io->weights,
    };
    rc = moek_cuda_ep_forward(ep, layers, remaps, experts, io->x, &r, io->tokens, io->out);
    if (moek_cuda_ep_failed(ep))
        cuda_ep_drop(home, ep);
    if (rc == -EIO)
        for (int i = 0; i < n; i++) {
            struct cuda_backend *cb = (struct cuda_backend *)sh[i].b;
            if (moek_cuda_set_device(cb->device) == 0)
                cuda_check(cb, rc);
        }
    return rc;
}

static int cuda_gemm_run(struct backend *b, void *handle, const void *a, const int64_t *m_sizes,
                         int64_t m, void *c)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    struct cuda_weights *w = handle;
    moek_cuda_clear_error();
    if (cb->broken)
        return -EIO;
    size_t es = moek_dtype_size(w->dt), M = (size_t)m;
    int rc = moek_cuda_set_device(cb->device);
    if (!rc)
        rc = dbuf_reserve(cb, &cb->x, M * (size_t)w->k * es);
    if (!rc)
        rc = dbuf_reserve(cb, &cb->out, M * (size_t)w->n * es);
    if (!rc)
        rc = dbuf_reserve(cb, &cb->route, (size_t)w->groups * sizeof(int64_t));
    if (!rc)
        rc = cuda_ws_reserve(cb, moek_cuda_gemm_workspace_size(w->g, m));
    if (!rc)
        rc = moek_cuda_copy_async(cb->x.p, a, M * (size_t)w->k * es, 0, cb->stream);
    if (!rc)
        rc = moek_cuda_copy_async(cb->route.p, m_sizes, (size_t)w->groups * sizeof(int64_t), 0,
                                  cb->stream);
    if (!rc)
        rc = moek_cuda_grouped_gemm(w->g, cb->ws, cb->x.p, cb->route.p, m, cb->out.p, cb->stream);
    if (!rc)
        rc = moek_cuda_copy_async(c, cb->out.p, M * (size_t)w->n * es, 1, cb->stream);
    if (!rc)
        rc = moek_cuda_stream_sync(cb->stream);
    return cuda_failed(cb, rc);
}

/* A client region, pinned once when it is registered, so its rows move by
 * DMA (moe_rows). A region that cannot be pinned still works, at pageable
 * copy speed. */
static int cuda_pin(struct backend *b, void *base, size_t size, void **cookie)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    *cookie = NULL;
    int rc = moek_cuda_set_device(cb->device);
    if (!rc)
        rc = moek_cuda_host_register(base, size);
    if (!rc)
        *cookie = base;
    return rc;
}

static void cuda_unpin(struct backend *b, void *base, size_t size, void *cookie)
{
    (void)b;
    (void)size;
    if (cookie)
        moek_cuda_host_unregister(base);
}

/* Staging memory is pinned the same way, so its copies are DMA. */
static void *cuda_host_alloc(struct backend *b, size_t size)
{
    void *p = NULL, *cookie;
    size = size ? size : 4096;
    if (posix_memalign(&p, 4096, size) != 0)
        return NULL;
    if (cuda_pin(b, p, size, &cookie) != 0) {
        free(p);
        return NULL;
    }
    return p;
}

static void cuda_host_free(struct backend *b, void *p, size_t size)
{
    if (!p)
        return;
    cuda_unpin(b, p, size, p);
    free(p);
}

static int cuda_set_tiles(struct backend *b, const struct tile_table *t)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    struct tile_table mine;
    int rc = 0;
    tiles_init(&mine);
    for (size_t i = 0; t && i < t->n && !rc; i++) {
        char why[200];
        if (!strcmp(t->entries[i].device, cb->model))
            rc = tiles_put(&mine, &t->entries[i], why, sizeof(why));
    }
    if (rc) {
        tiles_done(&mine);
        return rc;
    }
    pthread_mutex_lock(&cb->tiles_lock);
    tiles_done(&cb->tiles);
    cb->tiles = mine;
    cb->have_table = t != NULL;
    pthread_mutex_unlock(&cb->tiles_lock);
    return 0;
}

static void cuda_moe_tiles(struct backend *b, void *handle, char *buf, size_t len)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    const struct cuda_weights *w = handle;
    const moek_moe_shape *s = &w->shape;
    char key[200];
    if (w->gemm) {
        snprintf(buf, len, "%s", "");
        return;
    }
    snprintf(key, sizeof(key), "%s, %s, E=%d k=%d H=%d I=%d", cb->model,
             tiles_dtype_name(w->dt) ? tiles_dtype_name(w->dt) : "?", s->experts, s->topk,
             s->hidden, s->intermediate);
    switch (w->tiles_from) {
    case TILE_SRC_TABLE:
        snprintf(buf, len, "the tile table (%d rules for %s)", w->n_rules, key);
        break;
    case TILE_SRC_NO_ENTRY:
        snprintf(buf, len, "the default heuristic (the tile table has no entry for %s)", key);
        break;
    case TILE_SRC_REFUSED:
        snprintf(buf, len, "the default heuristic (the kernels refused the tile table's entry "
                 "for %s)", key);
        break;
    default:
        snprintf(buf, len, "the default heuristic (no tile table; %s)", key);
        break;
    }
}

/* Time every token tile on a layer of random weights (w1, w3 and w2 share
 * one tensor: values do not change the time). */
static int cuda_moe_tune(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                         const int *tokens, int n, struct backend_tune *out, char *err,
                         size_t errlen)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    uint64_t elems, bytes;
    if (cb->broken) {
        snprintf(err, errlen, "the device is unusable after an earlier error");
        return -EIO;
    }
    if (shape->experts < 1 || shape->hidden < 1 || shape->intermediate < 1 ||
        !mul_u64((uint64_t)shape->experts * (uint64_t)shape->hidden,
                 (uint64_t)shape->intermediate, &elems) ||
        !mul_u64(elems, moek_dtype_size(dt), &bytes)) {
        snprintf(err, errlen, "bad shape");
        return -EINVAL;
    }
    moek_cuda_moe_layer *layer = NULL;
    void *w = NULL;
    int rc = moek_cuda_set_device(cb->device);
    if (!rc)
        rc = moek_cuda_malloc(bytes, &w);
    if (!rc)
        rc = moek_cuda_fill_uniform(w, dt, elems, (uint64_t)time(NULL),
                                    1.0f / sqrtf((float)shape->hidden), NULL);
    if (!rc)
        rc = moek_cuda_moe_layer_new_from_device(shape, dt, w, w, w, cb->device, &layer);
    moek_cuda_free(w);
    if (!rc) {
        for (int i = 0; i < n; i++)
            out->heuristic[i] = moek_cuda_moe_layer_token_tile(layer, tokens[i]);
        /* out->us's columns are the kernels' tiles in their order (tiles.h) */
        rc = moek_cuda_moe_layer_autotune(layer, tokens, n, out->best, &out->us[0][0]);
    }
    if (rc) {
        snprintf(err, errlen, "%s", rc == -ENOMEM ? "out of device memory"
                                                  : moek_cuda_last_error());
        moek_cuda_moe_layer_free(layer);
        return cuda_check(cb, rc);
    }
    moek_cuda_moe_layer_free(layer);
    snprintf(out->device, sizeof(out->device), "%s", cb->model);
    out->n = n;
    memcpy(out->tokens, tokens, sizeof(int) * (size_t)n);
    return 0;
}

static int cuda_devices(struct backend *b, struct backend_device *out, int max)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    if (max < 1)
        return 0;
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s", cb->name);
    out->memory_bytes = cb->mem_bytes;
    out->compute_units = (uint32_t)cb->sms;
    return 1;
}

static const char *cuda_last_error(struct backend *b)
{
    (void)b;
    const char *e = moek_cuda_last_error();
    return strcmp(e, "no error") ? e : NULL;
}

static bool cuda_healthy(struct backend *b)
{
    return !((struct cuda_backend *)b)->broken;
}

static void cuda_destroy(struct backend *b)
{
    struct cuda_backend *cb = (struct cuda_backend *)b;
    for (int i = 0; i < EP_GROUPS; i++)
        moek_cuda_ep_free(cb->eps[i].ep);
    moek_cuda_set_device(cb->device);
    moek_cuda_stream_sync(cb->stream);
    moek_cuda_free(cb->x.p);
    moek_cuda_free(cb->route.p);
    moek_cuda_free(cb->weights.p);
    moek_cuda_free(cb->out.p);
    moek_cuda_workspace_free(cb->ws);
    moek_cuda_stream_free(cb->stream);
    free(cb->cp);
    tiles_done(&cb->tiles);
    pthread_mutex_destroy(&cb->tiles_lock);
    free(cb);
}

static const struct backend_ops cuda_ops = {
    .moe_new = cuda_moe_new,
    .gemm_new = cuda_gemm_new,
    .weights_free = cuda_weights_free,
    .moe_run = cuda_moe_run,
    .moe_rows = true,
    .pin = cuda_pin,
    .unpin = cuda_unpin,
    .moe_run_sharded = cuda_moe_run_sharded,
    .gemm_run = cuda_gemm_run,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .set_tiles = cuda_set_tiles,
    .moe_tiles = cuda_moe_tiles,
    .moe_tune = cuda_moe_tune,
    .devices = cuda_devices,
    .healthy = cuda_healthy,
    .last_error = cuda_last_error,
    .destroy = cuda_destroy,
};

int backend_cuda_count(void)
{
    return moek_cuda_device_count();
}

void backend_cuda_transport(const char *name)
{
    g_transport = !strcmp(name, "nccl")   ? MOEK_CUDA_EP_NCCL
                  : !strcmp(name, "peer") ? MOEK_CUDA_EP_PEER
                                          : MOEK_CUDA_EP_AUTO;
}

int backend_cuda_new(int device, struct backend **out)
{
    *out = NULL;
    if (device < 0 || device >= moek_cuda_device_count())
        return -ENODEV;
    struct cuda_backend *cb = calloc(1, sizeof(*cb));
    if (!cb)
        return -ENOMEM;
    cb->device = device;
    int rc = moek_cuda_set_device(device);
    if (!rc)
        rc = moek_cuda_device_info(device, NULL, &cb->sms, &cb->mem_bytes);
    if (!rc)
        rc = moek_cuda_stream_new(&cb->stream);
    if (rc) {
        free(cb);
        return rc == -EIO ? -ENODEV : rc;
    }
    moek_cuda_device_name(device, cb->model, sizeof(cb->model));
    snprintf(cb->name, sizeof(cb->name), "%.72s (device %d)", cb->model, device);
    pthread_mutex_init(&cb->tiles_lock, NULL);
    tiles_init(&cb->tiles);
    const char *dma = getenv("MOEK_CUDA_ROWS_DMA");
    cb->rows_kernel = !(dma && *dma && *dma != '0');
    cb->base.ops = &cuda_ops;
    cb->base.name = "cuda";
    cb->base.max_experts = MOEK_CUDA_MAX_EXPERTS;
    *out = &cb->base;
    return 0;
}

#endif
