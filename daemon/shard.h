/*
 * shard.h: expert parallelism. One MoE layer's experts spread over several
 * devices: each device holds only its own experts' weights. A batch goes
 * from the home device (the layer's first device) to every device of the
 * layer; each device routes every token over all E experts (routing is
 * deterministic, so all pick the same top-k), keeps the slots of its own
 * experts through a remap table (backend_moe_io.remap: the others
 * contribute nothing there) and runs the same fused kernel as one device on
 * them, with the routing weights in its down projection; the partial
 * outputs come back and are summed per token in fp32, in device order, on
 * the home device.
 *
 * The data sizes of every transfer are known before routing, so the devices
 * need no host synchronisation: a backend with moe_run_sharded (CUDA: NCCL
 * send/recv or peer copies) does the whole forward on its devices. Without
 * it (the CPU backend's virtual devices, moed --virtual-devices N) the same
 * plan, remap tables and sum run through host memory.
 */
#ifndef MOED_SHARD_H
#define MOED_SHARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/backend.h"

#define SHARD_MAX 16 /* devices of one layer */

struct shard {
    int device;          /* index into the server's backends */
    int n_experts;
    int32_t *experts;    /* global ids of the local experts, ascending */
    void *weights;       /* the device backend's handle (E_local experts, top-k) */
    int32_t *remap;      /* [E] local id of each of the layer's experts, -1 elsewhere */
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
                 moek_dtype dt, moek_scoring scoring, bool renormalize, const void *w1,
                 const void *w3, const void *w2, char *err, size_t errlen);

/* Forward a batch; io as for backend_ops.moe_run on the whole layer. */
int shard_run(struct shard_set *set, struct backend **backends, const moek_moe_shape *shape,
              moek_dtype dt, const struct backend_moe_io *io);

/* Free the weights on every device and the plan. Accepts an empty set. */
void shard_done(struct shard_set *set, struct backend **backends);

#endif
