/*
 * shard.c: see shard.h.
 */
#include "daemon/shard.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/util.h"

void shard_done(struct shard_set *set, struct backend **backends)
{
    for (int i = 0; set->shards && i < set->n; i++) {
        struct shard *sh = &set->shards[i];
        if (sh->weights)
            backends[sh->device]->ops->weights_free(backends[sh->device], sh->weights);
        free(sh->experts);
        free(sh->remap);
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
        return errf(err, errlen, -EINVAL, "%d devices for %d experts: each device needs an expert",
                    n_devices, experts);
    for (int i = 0; i < n_devices; i++) {
        if (n_backends < 0 || devices[i] >= (uint32_t)n_backends)
            return errf(err, errlen, -EINVAL, "device %u does not exist (this daemon has %d)",
                        devices[i], n_backends);
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i])
                return errf(err, errlen, -EINVAL, "device %u is listed twice", devices[i]);
    }
    if (map && n_map != experts)
        return errf(err, errlen, -EINVAL, "the expert placement names %d experts; the layer has %d",
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
                return errf(err, errlen, -EINVAL, "expert %d is placed on device %u, which is not "
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
            return errf(err, errlen, -EINVAL, "device %u would hold no expert", devices[s]);
        }
        sh->experts = calloc((size_t)sh->n_experts, sizeof(int32_t));
        sh->remap = malloc((size_t)experts * sizeof(int32_t));
        if (!sh->experts || !sh->remap) {
            shard_done(out, NULL);
            return -ENOMEM;
        }
    }
    for (int e = 0; e < experts; e++) {
        out->shards[out->expert_shard[e]].experts[out->expert_local[e]] = e;
        for (int t = 0; t < n_devices; t++)
            out->shards[t].remap[e] = t == out->expert_shard[e] ? out->expert_local[e] : -1;
    }
    return 0;
}

int shard_upload(struct shard_set *set, struct backend **backends, const moek_moe_shape *shape,
                 moek_dtype dt, moek_scoring scoring, bool renormalize, const void *w1,
                 const void *w3, const void *w2, char *err, size_t errlen)
{
    size_t per = (size_t)shape->hidden * (size_t)shape->intermediate * moek_dtype_size(dt);
    for (int s = 0; s < set->n; s++) {
        struct backend *be = backends[set->shards[s].device];
        if (be->max_experts && shape->experts > be->max_experts)
            return errf(err, errlen, -ENOTSUP,
                        "device %d (%s) routes at most %d experts; this layer has %d",
                        set->shards[s].device, be->name, be->max_experts, shape->experts);
    }
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
        /* The local experts, routed as the layer (top-k over all E, then
         * remapped: backend_moe_io.remap). */
        moek_moe_shape local = {(int)n, shape->topk, shape->hidden, shape->intermediate};
        struct backend *be = backends[sh->device];
        char why[160] = ""; /* the backend's own note (the kernels' reason) */
        if (!rc && (rc = be->ops->moe_new(be, &local, dt, scoring, renormalize, a, b, c,
                                          &sh->weights)))
            backend_error_note(be, why, sizeof(why));
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
            return errf(err, errlen, rc, "device %d (%s) cannot hold its %zu experts: %s%s",
                        sh->device, be->name, n, rc == -ENOMEM ? "out of memory" : strerror(-rc),
                        why);
        }
        sh->bytes = 3 * n * per;
    }
    return 0;
}

int shard_run(struct shard_set *set, struct backend **backends, const moek_moe_shape *shape,
              moek_dtype dt, const struct backend_moe_io *io)
{
    struct backend_shard sh[SHARD_MAX];
    const struct backend_ops *ops = backends[set->shards[0].device]->ops;
    bool same = set->n <= SHARD_MAX;
    for (int s = 0; same && s < set->n; s++) {
        sh[s] = (struct backend_shard){backends[set->shards[s].device], set->shards[s].weights,
                                       set->shards[s].remap};
        same = sh[s].b->ops == ops;
    }
    if (same && ops->moe_run_sharded)
        return ops->moe_run_sharded(sh, set->n, set->experts, io);

    /* Through the host: each device computes its experts' slots of the
     * whole batch; the partials are summed in fp32, in device order. */
    size_t T = (size_t)io->tokens, H = (size_t)shape->hidden, es = moek_dtype_size(dt);
    uint8_t *part = malloc(T * H * es);
    float *acc = calloc(T * H, sizeof(float)), *tmp = malloc(H * sizeof(float));
    int rc = !part || !acc || !tmp ? -ENOMEM : 0;
    for (int s = 0; !rc && s < set->n; s++) {
        struct backend *be = backends[set->shards[s].device];
        struct backend_moe_io sub = *io;
        sub.remap = set->shards[s].remap;
        sub.route_experts = set->experts;
        sub.out = part;
        rc = be->ops->moe_run(be, set->shards[s].weights, &sub);
        for (size_t t = 0; !rc && t < T; t++) {
            moek_to_f32(dt, part + t * H * es, tmp, H);
            for (size_t h = 0; h < H; h++)
                acc[t * H + h] += tmp[h];
        }
    }
    if (!rc)
        moek_from_f32(dt, acc, io->out, T * H);
    free(part);
    free(acc);
    free(tmp);
    return rc;
}
