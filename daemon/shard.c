/*
 * shard.c: see shard.h.
 */
#include "daemon/shard.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return rc;
}

void shard_done(struct shard_set *set, struct backend **backends)
{
    for (int i = 0; set->shards && i < set->n; i++) {
        struct shard *sh = &set->shards[i];
        if (sh->weights)
            backends[sh->device]->ops->weights_free(backends[sh->device], sh->weights);
        free(sh->experts);
    }
    free(set->shards);
    free(set->expert_shard);
    free(set->expert_local);
    memset(set, 0, sizeof(*set));
}

int shard_plan(int experts, const uint32_t *devices, int n_devices, const uint32_t *map,
               int n_map, int n_backends, struct shard_set *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (n_devices < 1 || n_devices > experts)
        return fail(err, errlen, -EINVAL, "%d devices for %d experts: each device needs an expert",
                    n_devices, experts);
    for (int i = 0; i < n_devices; i++) {
        if ((int)devices[i] >= n_backends)
            return fail(err, errlen, -EINVAL, "device %u does not exist (this daemon has %d)",
                        devices[i], n_backends);
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i])
                return fail(err, errlen, -EINVAL, "device %u is listed twice", devices[i]);
    }
    if (map && n_map != experts)
        return fail(err, errlen, -EINVAL, "the expert placement names %d experts; the layer has %d",
                    n_map, experts);
    out->experts = experts;
    out->n = n_devices;
    out->shards = calloc((size_t)n_devices, sizeof(*out->shards));
    out->expert_shard = calloc((size_t)experts, sizeof(int32_t));
    out->expert_local = calloc((size_t)experts, sizeof(int32_t));
    if (!out->shards || !out->expert_shard || !out->expert_local) {
        shard_done(out, NULL);
        return -ENOMEM;
    }
    for (int e = 0; e < experts; e++) {
        int s;
        if (map) {
            for (s = 0; s < n_devices && devices[s] != map[e]; s++)
                ;
            if (s == n_devices) {
                shard_done(out, NULL);
                return fail(err, errlen, -EINVAL, "expert %d is placed on device %u, which is not "
                            "among the layer's devices", e, map[e]);
            }
        } else {
            s = (int)((int64_t)e * n_devices / experts); /* contiguous, even */
        }
        out->expert_shard[e] = s;
        out->expert_local[e] = out->shards[s].n_experts++;
    }
    for (int s = 0; s < n_devices; s++) {
        struct shard *sh = &out->shards[s];
        sh->device = (int)devices[s];
        if (sh->n_experts == 0) {
            shard_done(out, NULL);
            return fail(err, errlen, -EINVAL, "device %u would hold no expert", devices[s]);
        }
        sh->experts = calloc((size_t)sh->n_experts, sizeof(int32_t));
        if (!sh->experts) {
            shard_done(out, NULL);
            return -ENOMEM;
        }
    }
    for (int e = 0; e < experts; e++)
        out->shards[out->expert_shard[e]].experts[out->expert_local[e]] = e;
    return 0;
}

int shard_upload(struct shard_set *set, struct backend **backends, const moek_moe_shape *shape,
                 moek_dtype dt, const void *w1, const void *w3, const void *w2, char *err,
                 size_t errlen)
{
    size_t per = (size_t)shape->hidden * (size_t)shape->intermediate * moek_dtype_size(dt);
    for (int s = 0; s < set->n; s++) {
        struct shard *sh = &set->shards[s];
        size_t n = (size_t)sh->n_experts;
        uint8_t *a = malloc(n * per), *b = malloc(n * per), *c = malloc(n * per);
        int rc = (!a || !b || !c) ? -ENOMEM : 0;
        for (size_t i = 0; !rc && i < n; i++) {
            size_t e = (size_t)sh->experts[i];
            memcpy(a + i * per, (const uint8_t *)w1 + e * per, per);
            memcpy(b + i * per, (const uint8_t *)w3 + e * per, per);
            memcpy(c + i * per, (const uint8_t *)w2 + e * per, per);
        }
        /* Each slot routes to one expert with its own weight: top-1, given. */
        moek_moe_shape local = {(int)n, 1, shape->hidden, shape->intermediate};
        struct backend *be = backends[sh->device];
        if (!rc)
            rc = be->ops->moe_new(be, &local, dt, MOEK_SCORING_SOFTMAX, false, a, b, c, &sh->weights);
        free(a);
        free(b);
        free(c);
        if (rc) {
            sh->weights = NULL;
            for (int t = 0; t < s; t++) {
                struct backend *bt = backends[set->shards[t].device];
                bt->ops->weights_free(bt, set->shards[t].weights);
                set->shards[t].weights = NULL;
            }
            return fail(err, errlen, rc, "device %d (%s) cannot hold its %zu experts: %s",
                        sh->device, be->name, n, rc == -ENOMEM ? "out of memory" : strerror(-rc));
        }
        sh->bytes = 3 * n * per;
    }
    return 0;
}

int shard_run(struct shard_set *set, struct backend **backends, const moek_moe_shape *shape,
              moek_dtype dt, moek_scoring scoring, bool renormalize,
              const struct backend_moe_io *io)
{
    size_t T = (size_t)io->tokens, k = (size_t)shape->topk, H = (size_t)shape->hidden;
    size_t es = moek_dtype_size(dt), slots = T * k, row = H * es;
    int32_t *ids = malloc(slots * sizeof(int32_t));
    float *w = malloc(slots * sizeof(float));
    int32_t *slot_pos = malloc(slots * sizeof(int32_t));   /* row within its shard */
    size_t *count = calloc((size_t)set->n, sizeof(size_t));
    float *acc = calloc(T * H, sizeof(float)), *tmp = malloc(H * sizeof(float));
    uint8_t **xs = calloc((size_t)set->n, sizeof(*xs)), **outs = calloc((size_t)set->n, sizeof(*outs));
    int32_t **lids = calloc((size_t)set->n, sizeof(*lids));
    float **lws = calloc((size_t)set->n, sizeof(*lws));
    int rc = (!ids || !w || !slot_pos || !count || !acc || !tmp || !xs || !outs || !lids || !lws)
                 ? -ENOMEM : 0;
    /* Route once, on the home device (here: the host). */
    if (!rc && io->logits)
        moek_ref_route(io->logits, (int)T, shape->experts, (int)k, scoring, renormalize, ids, w);
    else if (!rc) {
        memcpy(ids, io->ids, slots * sizeof(int32_t));
        memcpy(w, io->weights, slots * sizeof(float));
    }
    for (size_t i = 0; !rc && i < slots; i++)
        slot_pos[i] = (int32_t)count[set->expert_shard[ids[i]]]++;
    /* Dispatch: each device receives the rows, local ids and weights of the
     * slots routed to its experts. */
    for (int s = 0; !rc && s < set->n; s++) {
        size_t n = count[s] ? count[s] : 1;
        xs[s] = malloc(n * row);
        outs[s] = malloc(n * row);
        lids[s] = malloc(n * sizeof(int32_t));
        lws[s] = malloc(n * sizeof(float));
        if (!xs[s] || !outs[s] || !lids[s] || !lws[s])
            rc = -ENOMEM;
    }
    for (size_t i = 0; !rc && i < slots; i++) {
        int s = set->expert_shard[ids[i]];
        size_t p = (size_t)slot_pos[i];
        memcpy(xs[s] + p * row, (const uint8_t *)io->x + (i / k) * row, row);
        lids[s][p] = set->expert_local[ids[i]];
        lws[s][p] = w[i];
    }
    for (int s = 0; !rc && s < set->n; s++) {
        if (!count[s])
            continue;
        struct shard *sh = &set->shards[s];
        struct backend_moe_io sub = {.x = xs[s], .ids = lids[s], .weights = lws[s],
                                     .tokens = (int)count[s], .out = outs[s]};
        rc = backends[sh->device]->ops->moe_run(backends[sh->device], sh->weights, &sub);
    }
    /* Combine on the home device, in slot order, in fp32. */
    for (size_t i = 0; !rc && i < slots; i++) {
        int s = set->expert_shard[ids[i]];
        moek_to_f32(dt, outs[s] + (size_t)slot_pos[i] * row, tmp, H);
        float *a = acc + (i / k) * H;
        for (size_t h = 0; h < H; h++)
            a[h] += tmp[h];
    }
    if (!rc)
        moek_from_f32(dt, acc, io->out, T * H);
    for (int s = 0; s < set->n && xs; s++) {
        free(xs[s]);
        free(outs ? outs[s] : NULL);
        free(lids ? lids[s] : NULL);
        free(lws ? lws[s] : NULL);
    }
    free(xs);
    free(outs);
    free(lids);
    free(lws);
    free(ids);
    free(w);
    free(slot_pos);
    free(count);
    free(acc);
    free(tmp);
    return rc;
}
