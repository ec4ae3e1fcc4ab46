/*
 * backend_cpu.c: the CPU backend, the reference that lets the whole service
 * run without a GPU. Routing uses the reference router (per token, cheap);
 * the GEMMs use the multithreaded fast path in kernels/cpu, whose result for
 * a token does not depend on the rest of the batch.
 */
#include "daemon/backend.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct cpu_backend {
    struct backend base;
    moek_cpu_pool *pool;
    /* Routing scratch, reused across batches; compute thread only. */
    int32_t *ids;
    float *weights;
    size_t route_cap;
};

/* A layer's weights: exactly one of moe / gemm is set. */
struct cpu_weights {
    moek_moe_shape shape;
    moek_scoring scoring;
    bool renormalize;
    moek_cpu_moe_weights *moe;
    moek_cpu_gemm_weights *gemm;
};

static int cpu_moe_new(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                       moek_scoring scoring, bool renormalize, const void *w1,
                       const void *w3, const void *w2, void **handle)
{
    struct cpu_weights *m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->shape = *shape;
    m->scoring = scoring;
    m->renormalize = renormalize;
    int rc = moek_cpu_moe_weights_new(shape, dt, w1, w3, w2, &m->moe);
    if (rc) {
        free(m);
        return rc;
    }
    *handle = m;
    return 0;
}

static int cpu_gemm_new(struct backend *b, moek_dtype dt, int groups, int n, int k,
                        const void *w, void **handle)
{
    struct cpu_weights *m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    int rc = moek_cpu_gemm_weights_new(dt, groups, n, k, w, &m->gemm);
    if (rc) {
        free(m);
        return rc;
    }
    *handle = m;
    return 0;
}

static void cpu_weights_free(struct backend *b, void *handle)
{
    struct cpu_weights *m = handle;
    if (!m)
        return;
    moek_cpu_gemm_weights_free(m->gemm);
    moek_cpu_moe_weights_free(m->moe);
    free(m);
}

static int cpu_moe_run(struct backend *b, void *handle, const struct backend_moe_io *io)
{
    struct cpu_backend *cb = (struct cpu_backend *)b;
    struct cpu_weights *m = handle;
    const int32_t *ids = io->ids;
    const float *weights = io->weights;
    size_t slots = (size_t)io->tokens * (size_t)m->shape.topk;
    if (io->logits && m->shape.topk > (io->remap ? io->route_experts : m->shape.experts))
        return -EINVAL; /* top-k of fewer experts */
    if (io->logits || io->remap) {
        size_t need = slots;
        if (need > cb->route_cap) {
            int32_t *ni = realloc(cb->ids, need * sizeof(*ni));
            if (ni)
                cb->ids = ni;
            float *nw = realloc(cb->weights, need * sizeof(*nw));
            if (nw)
                cb->weights = nw;
            if (!ni || !nw)
                return -ENOMEM;
            cb->route_cap = need;
        }
    }
    if (io->logits) {
        moek_ref_route(io->logits, io->tokens, io->remap ? io->route_experts : m->shape.experts,
                       m->shape.topk, m->scoring, m->renormalize, cb->ids, cb->weights);
        ids = cb->ids;
        weights = cb->weights;
    } else if (io->remap) {
        memcpy(cb->ids, io->ids, slots * sizeof(*cb->ids));
        ids = cb->ids;
    }
    if (io->remap) /* a shard: keep the slots of this device's experts */
        for (size_t s = 0; s < slots; s++)
            cb->ids[s] = cb->ids[s] >= 0 && cb->ids[s] < io->route_experts
                             ? io->remap[cb->ids[s]] : -1;
    return moek_cpu_fused_moe(cb->pool, m->moe, io->x, ids, weights, io->tokens, io->out);
}

static int cpu_gemm_run(struct backend *b, void *handle, const void *a,
                        const int64_t *m_sizes, int64_t m, void *c)
{
    struct cpu_backend *cb = (struct cpu_backend *)b;
    struct cpu_weights *h = handle;
    return moek_cpu_grouped_gemm(cb->pool, h->gemm, a, m_sizes, c);
}

static void *cpu_host_alloc(struct backend *b, size_t size)
{
    void *p = NULL;
    return posix_memalign(&p, 64, size ? size : 64) == 0 ? p : NULL;
}

static void cpu_host_free(struct backend *b, void *p, size_t size)
{
    free(p);
}

static int cpu_devices(struct backend *b, struct backend_device *out, int max)
{
    struct cpu_backend *cb = (struct cpu_backend *)b;
    if (max < 1)
        return 0;
    memset(out, 0, sizeof(*out));
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    snprintf(out->name, sizeof(out->name), "CPU (%d threads)",
             moek_cpu_pool_threads(cb->pool));
    out->memory_bytes = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
    out->compute_units = (uint32_t)moek_cpu_pool_threads(cb->pool);
    return 1;
}

static void cpu_destroy(struct backend *b)
{
    struct cpu_backend *cb = (struct cpu_backend *)b;
    moek_cpu_pool_free(cb->pool);
    free(cb->ids);
    free(cb->weights);
    free(cb);
}

static const struct backend_ops cpu_ops = {
    .moe_new = cpu_moe_new,
    .gemm_new = cpu_gemm_new,
    .weights_free = cpu_weights_free,
    .moe_run = cpu_moe_run,
    .gemm_run = cpu_gemm_run,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .devices = cpu_devices,
    .destroy = cpu_destroy,
};

int backend_cpu_new(int threads, struct backend **out)
{
    struct cpu_backend *cb = calloc(1, sizeof(*cb));
    if (!cb)
        return -ENOMEM;
    cb->pool = moek_cpu_pool_new(threads);
    if (!cb->pool) {
        free(cb);
        return -ENOMEM;
    }
    cb->base.ops = &cpu_ops;
    cb->base.name = "cpu";
    *out = &cb->base;
    return 0;
}
