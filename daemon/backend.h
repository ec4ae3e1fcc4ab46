/*
 * backend.h: the seam between the daemon and the hardware that computes.
 *
 * A backend holds layer weights in whatever form its kernels want and runs
 * one batched FusedMoe or GroupedGemm at a time on host staging buffers that
 * it allocated itself (pinned memory for the CUDA backend). The daemon calls
 * run functions from its compute worker thread only, one call at a time;
 * weights are created from the loader thread and freed from the loader
 * (a spread layer that failed half-way) or the loop thread; pin/unpin from
 * the pinner thread (the loop thread when that is gone or memory short);
 * info from the loop thread. Implementations: backend_cpu.c,
 * backend_cuda.c.
 */
#ifndef MOED_BACKEND_H
#define MOED_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/tiles.h"
#include "kernels/moe_kernels.h"

struct backend;

/* Rows of a batch that stay in a client's region: the backend reads x rows
 * from src and writes the output rows to dst itself (by DMA). pinned: both
 * lie in pinned regions, which the device may also reach directly. */
struct backend_rows {
    const void *src;
    void *dst;
    int rows;
    bool pinned;
};

/* One batched MoE forward. Exactly one of logits / (ids, weights) is set. */
struct backend_moe_io {
    const void *x;          /* [T, H], layer dtype */
    const float *logits;    /* [T, E] or NULL */
    const int32_t *ids;     /* [T, k], every id already checked in range */
    const float *weights;   /* [T, k] */
    int tokens;
    void *out;              /* [T, H], layer dtype */
    /* A shard of a layer spread over devices: the routing above is over
     * route_experts experts and remap [route_experts] names this device's
     * expert for each, or -1 for one held elsewhere (it contributes
     * nothing here). NULL: the routing is over the weights' experts. */
    const int32_t *remap;
    int route_experts;
    /* Backends with moe_rows: instead of x and out (both NULL), the batch's
     * rows in order as n_segs runs in the clients' regions. */
    const struct backend_rows *segs;
    int n_segs;
};

/* One device's part of a layer spread over devices (shard.h). */
struct backend_shard {
    struct backend *b;
    void *weights;          /* its experts, top-k as the layer */
    const int32_t *remap;   /* [E] its expert for each of the layer's, or -1 */
};

struct backend_device {
    char name[96];
    uint64_t memory_bytes;
    uint32_t compute_units;
};

/* What moe_tune measured: for each token count, the time of every offered
 * token tile (tiles_offered[], tiles.h), the fastest, and the tile the
 * kernels' heuristic picks. */
#define BACKEND_TUNE_MAX TILES_MAX_RULES
struct backend_tune {
    char device[TILES_DEVICE_MAX]; /* the card's name: the tile table's key */
    int n;
    int tokens[BACKEND_TUNE_MAX];
    int best[BACKEND_TUNE_MAX];
    int heuristic[BACKEND_TUNE_MAX];
    float us[BACKEND_TUNE_MAX][TILES_N_OFFERED]; /* median microseconds */
};

struct backend_ops {
    /* Weights: w1/w3 [E, I, H] and w2 [E, H, I] (host memory, read only
     * during the call). The handle is the caller's; free with weights_free. */
    int (*moe_new)(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                   moek_scoring scoring, bool renormalize, const void *w1,
                   const void *w3, const void *w2, void **handle);
    /* B [G, N, K]. */
    int (*gemm_new)(struct backend *b, moek_dtype dt, int groups, int n, int k,
                    const void *w, void **handle);
    void (*weights_free)(struct backend *b, void *handle);

    int (*moe_run)(struct backend *b, void *handle, const struct backend_moe_io *io);
    /* moe_run takes io->segs: the rows move between the clients' (pinned)
     * regions and the device by DMA, with no copy through staging. */
    bool moe_rows;
    /* Optional: a forward of a layer spread over n devices of this backend
     * (shards[0] is the home device), done by the devices themselves: the
     * batch goes to every device, each computes the slots of its experts,
     * the partial outputs are summed in fp32 on the home device. io as for
     * moe_run over all `experts` of the layer (io->remap unset). NULL:
     * shard.c calls moe_run on each device and sums on the host. */
    int (*moe_run_sharded)(const struct backend_shard *shards, int n, int experts,
                           const struct backend_moe_io *io);
    /* A [M, K] grouped by m_sizes [G] -> C [M, N]. */
    int (*gemm_run)(struct backend *b, void *handle, const void *a,
                    const int64_t *m_sizes, int64_t m, void *c);

    /* Staging memory for batches; NULL on failure. */
    void *(*host_alloc)(struct backend *b, size_t size);
    void (*host_free)(struct backend *b, void *p, size_t size);

    /* Optional (NULL): pin a client region once so copies are DMA. */
    int (*pin)(struct backend *b, void *base, size_t size, void **cookie);
    void (*unpin)(struct backend *b, void *base, size_t size, void *cookie);

    /* Optional (NULL: tiles are not chosen, as on the CPU): the token-tile
     * table for MoE layers made from now on. Each takes the rules of the
     * entry of its card, dtype and shape, else keeps the kernels'
     * heuristic; layers already made keep their tiles. t is copied (the
     * entries of this backend's card); NULL clears. Called from the loop
     * thread while the loader thread may make layers. */
    int (*set_tiles)(struct backend *b, const struct tile_table *t);
    /* Optional: where a MoE layer's token tiles come from, for the log
     * ("the tile table (...)" or "the default heuristic (...)"). */
    void (*moe_tiles)(struct backend *b, void *handle, char *buf, size_t len);
    /* Optional: time every offered token tile of a MoE layer of this shape
     * and dtype, made with random weights for the purpose and freed
     * after, for n token counts (1 to BACKEND_TUNE_MAX); fills *out. Call
     * it before serving (it holds the device for seconds). 0 or -errno with
     * err; callers go through backend_moe_tune(). */
    int (*moe_tune)(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                    const int *tokens, int n, struct backend_tune *out, char *err,
                    size_t errlen);

    /* Fill up to max devices; returns the count or -errno. */
    int (*devices)(struct backend *b, struct backend_device *out, int max);
    /* Optional: false once the device is unusable (a CUDA error that
     * poisons the context); the daemon then exits so it can be restarted. */
    bool (*healthy)(struct backend *b);
    /* Optional: what the last failed weights or run call made on the
     * calling thread says beyond its errno (the CUDA error, the kernels'
     * reason for refusing a shape), or NULL; borrowed until this thread's
     * next call. Callers go through backend_last_error(). */
    const char *(*last_error)(struct backend *b);
    void (*destroy)(struct backend *b);
};

struct backend {
    const struct backend_ops *ops;
    const char *name; /* "cpu", "cuda" */
    /* The most experts a layer may route over here (0: no limit): a layer
     * spread over devices routes over all its experts, though each device
     * holds only some, so moe_new of a shard cannot tell. */
    int max_experts;
};

/* threads <= 0: one per CPU. Caller owns *out; free with backend_free(). */
int backend_cpu_new(int threads, struct backend **out);
/* -ENODEV when no usable GPU (or not built with CUDA). */
int backend_cuda_new(int device, struct backend **out);
/* Visible CUDA devices (0 without CUDA). */
int backend_cuda_count(void);
/* How CUDA devices exchange a spread layer's batches: "auto" (NCCL when
 * libnccl.so.2 loads, else peer copies), "nccl" or "peer". Set before the
 * first forward. */
void backend_cuda_transport(const char *name);

/* A device that failed at start: it keeps its number, reports `why` as its
 * name, and refuses every load with -ENODEV, so layers placed on it are
 * refused whole while the other devices serve. */
int backend_unavailable_new(const char *why, struct backend **out);

/* Pick by name: "cpu", "cuda", or "auto" (CUDA device `device` when it
 * exists, else the CPU). */
int backend_open(const char *which, int device, int cpu_threads, struct backend **out);
void backend_free(struct backend **b);

/* b->ops->last_error's text, or "" where it has none: for a failure's
 * message, right after the failed call on the same thread. */
const char *backend_last_error(struct backend *b);
/* The same as a note to end a message with: " (text)", or "" where there
 * is no text; written to buf, which is returned. */
const char *backend_error_note(struct backend *b, char *buf, size_t len);

/* b->ops->moe_tune, or -ENOTSUP (with err saying so) for a backend that
 * does not choose token tiles. */
int backend_moe_tune(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                     const int *tokens, int n, struct backend_tune *out, char *err,
                     size_t errlen);

#endif
