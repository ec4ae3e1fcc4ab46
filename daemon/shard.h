/*
 * shard.h: expert parallelism. One MoE layer's experts spread over several
 * devices: each device holds only its own experts' weights. A batch is
 * routed once on the home device (device 0); its routed token slots go to
 * the devices holding their experts; each device runs the same fused kernel
 * on its share (as a layer of its local experts with one routed expert per
 * slot, the routing weight applied in its down projection); the results
 * come back and are summed per token in fp32, in slot order, on the home
 * device.
 *
 * The transport between devices is a copy through the home device's memory,
 * which on the CPU backend's virtual devices (moed --virtual-devices N) is a
 * memcpy; the same plan and dispatch serve GPUs, where the copies become
 * NCCL or peer transfers.
 */
#ifndef MOED_SHARD_H
#define MOED_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/backend.h"

struct shard {
    int device;          /* index into the server's backends */
    int n_experts;
    int32_t *experts;    /* global ids of the local experts, ascending */
    void *weights;       /* the device backend's handle (E_local experts, top-1) */
    uint64_t bytes;      /* weight bytes on this device */
};

struct shard_set {
    int n;               /* devices that hold experts */
    struct shard *shards;
    int experts;         /* E */
    int32_t *expert_shard; /* [E] index into shards */
    int32_t *expert_local; /* [E] id within its shard */
};

/*
 * Plan a placement of E experts on the listed devices (n_devices of them,
 * each < n_backends): explicit when map ([E] device per expert) is given,
 * else experts split evenly in contiguous ranges. Every listed device must
 * hold at least one expert. 0 or -EINVAL with err.
 */
int shard_plan(int experts, const uint32_t *devices, int n_devices, const uint32_t *map,
               int n_map, int n_backends, struct shard_set *out, char *err, size_t errlen);

/* Upload each shard's experts (w1/w3 [E, I, H], w2 [E, H, I] host memory)
 * to its device. On error nothing stays loaded; err names the device. */
int shard_upload(struct shard_set *set, struct backend **backends, const moek_moe_shape *shape,
                 moek_dtype dt, const void *w1, const void *w3, const void *w2, char *err,
                 size_t errlen);

/* Forward a batch; io as for backend_ops.moe_run on the whole layer. */
int shard_run(struct shard_set *set, struct backend **backends, const moek_moe_shape *shape,
              moek_dtype dt, moek_scoring scoring, bool renormalize,
              const struct backend_moe_io *io);

/* Free the weights on every device and the plan. Accepts an empty set. */
void shard_done(struct shard_set *set, struct backend **backends);

#endif
