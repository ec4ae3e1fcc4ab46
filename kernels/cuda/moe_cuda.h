/*
 * moe_cuda.h: the C ABI of moed's CUDA kernels (the .cu files beside it).
 *
 * Plain C11, free of CUDA types: streams, graphs and device pointers are
 * `void *`, so the daemon's CUDA backend, the tests and the benchmarks compile
 * as C and link the objects nvcc made from those .cu files (with
 * -lcudart_static). Semantics (layouts, routing tie rules, the MoE formula)
 * are those of kernels/moe_kernels.h; this file adds only what the GPU needs:
 * weights re-laid out once at load time, a workspace, and streams.
 *
 * A forward pass is a short fixed sequence of kernels on one stream with no
 * host synchronisation inside (routing, counts and tile lists stay on the
 * device), so a call can be captured in a CUDA graph once per token count and
 * replayed. Empty experts and empty groups cost nothing: the GEMMs walk a
 * compact list of (expert, token tile) pairs built on the device.
 *
 * Errors: every function returns 0 or a negative errno and never logs:
 *   -EINVAL   a bad argument (NULL pointer, negative size, misaligned
 *             pointer, ...);
 *   -ENOTSUP  a shape or dtype these kernels do not compute (fp32 weights,
 *             H, I, N or K not a multiple of 8, E above 512, k above 32, no
 *             usable GPU); never computed wrong, always refused;
 *   -ENOMEM   device memory exhausted;
 *   -ENOSPC   the workspace is smaller than the call needs;
 *   -ENODEV   no CUDA device, or the device number is out of range;
 *   -EIO      any other CUDA error; moek_cuda_last_error() says which.
 * After -EIO the CUDA context may be poisoned (a sticky error such as an
 * illegal address); moek_cuda_context_ok() tells, and the daemon's design
 * says such an error is fatal.
 *
 * Threads: objects are not locked. A layer, weight set or workspace may be
 * used by one stream at a time; the error string is per thread.
 */
#ifndef MOE_CUDA_H
#define MOE_CUDA_H

/* The most experts one layer routes over (routing keeps E/32 logits per
 * lane); a layer spread over devices routes over all of them at home. */
#define MOEK_CUDA_MAX_EXPERTS 512

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices, errors, memory ------------------------------------------- */

/* Number of CUDA devices (0 when there is no driver or no GPU; never < 0). */
int moek_cuda_device_count(void);

/* Name of device `device` into buf (NUL-terminated, truncated to size). */
int moek_cuda_device_name(int device, char *buf, size_t size);

/* Compute capability (e.g. 90), multiprocessor count and global memory in
 * bytes of a device; any out pointer may be NULL. */
int moek_cuda_device_info(int device, int *cc, int *sms, size_t *mem_bytes);

/* Make `device` current for the calling thread. */
int moek_cuda_set_device(int device);

/* The last CUDA error seen by this thread inside moek_cuda_* ("no error" if
 * none). Borrowed; valid until the next moek_cuda_* call on this thread. */
const char *moek_cuda_last_error(void);
/* Forget it: moek_cuda_last_error() says "no error" until the next error,
 * so a caller can tell a failure's own text from an older one. */
void moek_cuda_clear_error(void);

/* false when the current context holds a sticky error (a kernel fault). */
bool moek_cuda_context_ok(void);

/* Device memory on the current device. Caller owns *out; release with
 * moek_cuda_free(), which accepts NULL. */
int moek_cuda_malloc(size_t bytes, void **out);
void moek_cuda_free(void *p);

/* Synchronous copies and fill (they wait for the device). */
int moek_cuda_copy_to_device(void *dst_dev, const void *src_host, size_t bytes);
int moek_cuda_copy_to_host(void *dst_host, const void *src_dev, size_t bytes);
int moek_cuda_memset(void *dst_dev, int byte, size_t bytes);

/* Asynchronous copy on a stream (host memory should be pinned). kind: 0 host
 * to device, 1 device to host, 2 device to device. */
int moek_cuda_copy_async(void *dst, const void *src, size_t bytes, int kind,
                         void *stream);
/* n copies in one call (cudaMemcpyBatchAsync; directions from the pointers),
 * in stream order on a created stream (not the legacy default stream). */
int moek_cuda_copy_batch_async(void *const *dsts, const void *const *srcs,
                               const size_t *sizes, size_t n, void *stream);
/* Rows between pinned host memory and one device buffer, moved by a kernel
 * whose threads read or write the host memory over the bus (one launch per
 * 64 segments) instead of one DMA per segment: for a batch of many small
 * segments. Segment i is rows[i] rows of row_bytes at host[i]; they are
 * the device buffer's rows in order. to_host: device to host, else host to
 * device. The host memory must be registered (moek_cuda_host_register) and
 * stay so until the stream passes the copy. -ENOTSUP where the device cannot
 * use registered memory through host pointers. */
int moek_cuda_copy_rows_mapped(void *dev, void *const *host, const int *rows, int n,
                               size_t row_bytes, int to_host, void *stream);

/*
 * Test and benchmark data without host traffic: element i of dst_dev (n
 * elements of dtype dt, fp32 allowed) becomes moek_cuda_uniform_value(seed,
 * i, scale) rounded to dt (round to nearest even). The generator is
 * counter-based (splitmix64 of seed + (i + 1) * golden ratio, top 24 bits u,
 * value scale * (u * 2^-23 - 1), so uniform in [-scale, scale)), so a host
 * reference can rebuild any slice of a tensor bit for bit.
 */
int moek_cuda_fill_uniform(void *dst_dev, moek_dtype dt, size_t n,
                           uint64_t seed, float scale, void *stream);
float moek_cuda_uniform_value(uint64_t seed, uint64_t i, float scale);
/* The host's copy of elements [first, first + n) of such a tensor, in dst
 * (n elements of dt), on up to 16 threads: the references of tests and
 * benchmarks. 0, or -EINVAL. */
int moek_cuda_uniform_host(void *dst, moek_dtype dt, uint64_t seed,
                           size_t first, size_t n, float scale);

/* Pin / unpin host memory already mapped (e.g. a client region). */
int moek_cuda_host_register(void *p, size_t bytes);
int moek_cuda_host_unregister(void *p);

/* Streams. Caller owns *out; moek_cuda_stream_free accepts NULL. */
int moek_cuda_stream_new(void **out);
void moek_cuda_stream_free(void *stream);
int moek_cuda_stream_sync(void *stream);

/* CUDA graphs of a stream's work: begin capture, run the moek_cuda_* calls
 * on that stream, end capture; then launch the graph as often as wanted.
 * Caller owns *out; moek_cuda_graph_free accepts NULL. A graph replays with
 * the pointers and token count it was captured with. */
int moek_cuda_graph_begin(void *stream);
int moek_cuda_graph_end(void *stream, void **out);
int moek_cuda_graph_launch(void *graph, void *stream);
void moek_cuda_graph_free(void *graph);

/* ---- workspace ---------------------------------------------------------- */

/*
 * Scratch device memory for the calls below (routing, tile lists, the
 * intermediate activations, the fp32 output accumulator, and T k H
 * elements in the dtype where cluster mode copies x or slot mode stores
 * GEMM 2's rows per slot). Size it with
 * moek_cuda_moe_workspace_size() / moek_cuda_gemm_workspace_size() for the
 * largest call it will serve; one workspace serves any number of layers, one
 * call at a time. Caller owns *out; free with moek_cuda_workspace_free(),
 * which accepts NULL.
 */
typedef struct moek_cuda_workspace moek_cuda_workspace;
int moek_cuda_workspace_new(int device, size_t bytes, moek_cuda_workspace **out);
void moek_cuda_workspace_free(moek_cuda_workspace *ws);
size_t moek_cuda_workspace_bytes(const moek_cuda_workspace *ws);

/* ---- fused MoE layer ---------------------------------------------------- */

/*
 * A MoE layer's weights resident on a device, re-laid out for the kernels:
 * gate and up rows interleaved in blocks of 8 (so SiLU(gate)·up happens in the
 * first GEMM's epilogue), down rows paired for vector accumulation. dt is
 * MOEK_DTYPE_BF16 or MOEK_DTYPE_FP16 (-ENOTSUP otherwise). w1, w3 [E, I, H]
 * and w2 [E, H, I] are host memory, only read during the call. Caller owns
 * *out; free with moek_cuda_moe_layer_free(), which accepts NULL.
 */
typedef struct moek_cuda_moe_layer moek_cuda_moe_layer;
int moek_cuda_moe_layer_new(const moek_moe_shape *shape, moek_dtype dt,
                            const void *w1, const void *w3, const void *w2,
                            int device, moek_cuda_moe_layer **out);
/* Same, from tensors already on `device` (only read during the call; they
 * may be freed afterwards). */
int moek_cuda_moe_layer_new_from_device(const moek_moe_shape *shape,
                                        moek_dtype dt, const void *w1_dev,
                                        const void *w3_dev, const void *w2_dev,
                                        int device, moek_cuda_moe_layer **out);
void moek_cuda_moe_layer_free(moek_cuda_moe_layer *layer);

/* Bytes of workspace a forward of up to max_tokens tokens needs. */
size_t moek_cuda_moe_workspace_size(const moek_cuda_moe_layer *layer,
                                    int max_tokens);

/* How the tokens are routed. */
typedef enum moek_cuda_routing_kind {
    MOEK_CUDA_ROUTE_LOGITS = 0, /* top-k over router logits, on the device */
    MOEK_CUDA_ROUTE_GIVEN = 1,  /* top-k ids and weights given */
} moek_cuda_routing_kind;

typedef struct moek_cuda_routing {
    moek_cuda_routing_kind kind;
    /* MOEK_CUDA_ROUTE_LOGITS: logits_dev fp32 [T, E]. */
    const float *logits_dev;
    moek_scoring scoring;
    bool renormalize;
    /* MOEK_CUDA_ROUTE_GIVEN: ids_dev int32 [T, k], weights_dev fp32 [T, k].
     * An id outside [0, E) contributes nothing (validate on the host; the
     * device cannot report it without a synchronisation). */
    const int32_t *ids_dev;
    const float *weights_dev;
    /* A shard of a layer spread over devices (expert parallelism): when
     * remap_dev is set, the routing above is over route_experts experts
     * (logits [T, route_experts], ids in [0, route_experts)) and remap_dev
     * int32 [route_experts] on the layer's device names the layer's own
     * expert for each, or -1 for one held elsewhere, which contributes
     * nothing here. Renormalisation is over the whole top-k. NULL: the
     * routing is over the layer's experts. */
    const int32_t *remap_dev;
    int route_experts;
} moek_cuda_routing;

/*
 * out[t] = sum_j w[t][j] * W2[e] (silu(W1[e] x[t]) * (W3[e] x[t])) for
 * T = tokens tokens; x_dev and out_dev [T, H] of the layer's dtype, on the
 * layer's device, 16-byte aligned (-EINVAL otherwise). Asynchronous on
 * `stream` (NULL: the legacy default stream), no host synchronisation
 * inside, capturable in a CUDA graph. Ordered after earlier work on the
 * stream; the workspace is busy until the stream passes this call.
 * tokens == 0 does nothing.
 */
int moek_cuda_fused_moe(moek_cuda_moe_layer *layer, moek_cuda_workspace *ws,
                        const void *x_dev, const moek_cuda_routing *routing,
                        int tokens, void *out_dev, void *stream);

/*
 * The routing the last forward computed, copied out of the workspace
 * (ids [T, k], weights [T, k] on the host); synchronises the stream. For
 * tests and the daemon's --check mode. Computed when routed from logits,
 * or given with remap_dev (the ids are then the layer's own experts, -1
 * for the others); with given ids and no remap the workspace holds none.
 */
int moek_cuda_moe_read_routing(const moek_cuda_moe_layer *layer,
                               const moek_cuda_workspace *ws, int tokens,
                               int32_t *ids, float *weights, void *stream);

/* ---- grouped GEMM ------------------------------------------------------- */

/*
 * A stacked weight tensor B [G, N, K] resident on a device for grouped GEMMs
 * (dt bf16 or fp16; N and K multiples of 8, else -ENOTSUP). b_host is only
 * read during the call; it goes up a few groups at a time through a
 * staging buffer of at most 64 MiB (one group at least), so the call needs
 * little more device memory than the weights. Caller owns *out; free with
 * moek_cuda_gemm_weights_free(), which accepts NULL.
 */
typedef struct moek_cuda_gemm_weights moek_cuda_gemm_weights;
int moek_cuda_gemm_weights_new(moek_dtype dt, int groups, int n, int k,
                               const void *b_host, int device,
                               moek_cuda_gemm_weights **out);
int moek_cuda_gemm_weights_new_from_device(moek_dtype dt, int groups, int n,
                                           int k, const void *b_dev, int device,
                                           moek_cuda_gemm_weights **out);
void moek_cuda_gemm_weights_free(moek_cuda_gemm_weights *w);

size_t moek_cuda_gemm_workspace_size(const moek_cuda_gemm_weights *w,
                                     int64_t max_m);

/*
 * C[rows of g] = A[rows of g] . B[g]^T: a_dev [total_m, K], c_dev
 * [total_m, N] (the weights' dtype), m_sizes_dev int64 [G] on the device.
 * total_m must equal the sum of m_sizes (the host knows it: it sized A);
 * group sizes are clamped so no row past total_m is touched, and negative
 * sizes count as 0. Groups of size 0 cost nothing. a_dev and c_dev are
 * 16-byte aligned (-EINVAL otherwise). Asynchronous, no host
 * synchronisation inside, capturable.
 */
int moek_cuda_grouped_gemm(moek_cuda_gemm_weights *w, moek_cuda_workspace *ws,
                           const void *a_dev, const int64_t *m_sizes_dev,
                           int64_t total_m, void *c_dev, void *stream);

/* ---- expert parallelism: one layer over several GPUs --------------------- */

/*
 * A group of devices of this process that serve layers whose experts are
 * spread over them; devices[0] is the home device, where batches arrive
 * and results are summed. Transports: NCCL send/recv (libnccl.so.2, opened
 * at run time; -ENOTSUP when it is missing), peer copies (over NVLink where
 * the devices have it, else staged by the driver), or AUTO (NCCL where it
 * loads and starts, else peer copies). NVLink multicast is never used. Caller owns
 * *out; free with moek_cuda_ep_free(), which accepts NULL. A group serves
 * one forward at a time.
 */
typedef enum moek_cuda_ep_transport {
    MOEK_CUDA_EP_AUTO = 0,
    MOEK_CUDA_EP_NCCL = 1,
    MOEK_CUDA_EP_PEER = 2,
} moek_cuda_ep_transport;
typedef struct moek_cuda_ep moek_cuda_ep;
int moek_cuda_ep_new(const int *devices, int n, moek_cuda_ep_transport transport,
                     moek_cuda_ep **out);
void moek_cuda_ep_free(moek_cuda_ep *ep);
/* A forward of the group failed part way: free it, it serves no more. */
bool moek_cuda_ep_failed(const moek_cuda_ep *ep);
/* "NCCL 2.27.7", "peer copies", ... (borrowed). */
const char *moek_cuda_ep_transport_name(const moek_cuda_ep *ep);

/*
 * One forward of a spread layer: layers[i] holds device i's experts and
 * remap_dev[i] int32 [route_experts] (on that device) maps each of the
 * layer's experts to layers[i]'s or -1 (moek_cuda_routing.remap_dev).
 * x_host [T, H] and out_host [T, H] (layer dtype) and the routing's
 * pointers (logits [T, route_experts], or ids and weights [T, k]) are host
 * memory, pinned for speed. The batch goes to every device, each computes
 * its experts' slots, the partial outputs are summed in fp32 on the home
 * device. Returns when out_host holds the result. Every device's work is
 * enqueued before the host waits once. Shards or routing that do not match
 * the group are refused with -EINVAL before any work. A forward that fails
 * after that leaves the group unusable (moek_cuda_ep_failed): later
 * forwards return -EIO, and moek_cuda_ep_free aborts its NCCL
 * communicators rather than wait on them.
 */
int moek_cuda_ep_forward(moek_cuda_ep *ep, moek_cuda_moe_layer *const *layers,
                         const int32_t *const *remap_dev, int route_experts,
                         const void *x_host,
                         const moek_cuda_routing *routing_host, int tokens,
                         void *out_host);

/* ---- tuning knobs (benchmarks and tests) -------------------------------- */

/*
 * Kernel choices for later calls on this layer / weight set. token_tile: the
 * tokens per GEMM tile (16, 32, 64, 128, 144, 192 or 256; 0 = pick from the
 * token count: the layer's tile table, else the heuristic; 144 runs as 128
 * where the weight-tile counts do not suit it: kernels/cuda/layer.cu,
 * fit_tile). generic: true forces the portable SIMT kernels that run on any
 * GPU (what a non-Hopper device gets); false uses wgmma+TMA on sm_90.
 */
typedef struct moek_cuda_tuning {
    int token_tile;
    bool generic;
    /* A MoE layer's GEMM 2 (down) on a token tile of its own, with
     * token_tile for GEMM 1 (gate/up): both 128 rows or wider where they
     * differ; 0: GEMM 1's. A grouped GEMM refuses it (-EINVAL). */
    int token_tile2;
} moek_cuda_tuning;
int moek_cuda_moe_layer_tune(moek_cuda_moe_layer *layer,
                             const moek_cuda_tuning *t);
int moek_cuda_gemm_weights_tune(moek_cuda_gemm_weights *w,
                                const moek_cuda_tuning *t);

/* The token tile a call of `tokens` tokens would use (for reports; GEMM
 * 1's where the two differ): 16 on the portable SIMT path; else the forced
 * tile, else the layer's tile table, else the heuristic. */
int moek_cuda_moe_layer_token_tile(const moek_cuda_moe_layer *layer,
                                   int tokens);
/* GEMM 2's token tile of such a call: the same but where the tuning's
 * token_tile2 or the layer's split tiles (MOEK_CUDA_SPLIT_TILES=1 at layer
 * creation: GEMM 1 on the 144-row tile where GEMM 2 keeps a wider one;
 * kernels/cuda/layer.cu, moe_tiles) give it one of its own. */
int moek_cuda_moe_layer_token_tile2(const moek_cuda_moe_layer *layer,
                                    int tokens);

/* How a call of `tokens` tokens, in a workspace of at least
 * moek_cuda_moe_workspace_size(layer, tokens), runs its GEMMs: in cluster
 * mode, CTA pairs sharing each token tile through TMA multicast (prefill
 * tiles of 128 rows and wider, at least a tile's worth of slots, on sm_90
 * with tiled weights and even weight-tile counts). MOEK_CLUSTER_BOTH: both
 * GEMMs (layers with I >= 2048, where GEMM 1's copy of x pays);
 * MOEK_CLUSTER_GEMM2: GEMM 2 alone (smaller I, or a shape GEMM 1 cannot
 * pair); MOEK_CLUSTER_NONE: no pairs. */
enum moek_cluster_mode {
    MOEK_CLUSTER_NONE = 0,
    MOEK_CLUSTER_BOTH = 1,
    MOEK_CLUSTER_GEMM2 = 2,
};
int moek_cuda_moe_layer_uses_cluster(const moek_cuda_moe_layer *layer,
                                     int tokens);

/* Whether such a call runs GEMM 2 in stream-K, each CTA an even share of
 * its K blocks (sm_90, decode tiles, where the plan of any routing of the
 * call would split K). MOEK_CUDA_NO_STREAM_K=1 at layer creation keeps a
 * layer off it. */
bool moek_cuda_moe_layer_uses_stream_k(const moek_cuda_moe_layer *layer,
                                       int tokens);

/* Whether such a call on a stream of its own (PDL) starts GEMM 2 per group
 * (layer.cu, moe_dep: sm_90, one-class tiles, where GEMM 1 fills every SM
 * and GEMM 2 does not run stream-K, T = 1 aside; on a card whose DRAM
 * reads 4 TB/s or more, not where GEMM 2 has fewer than 32 K blocks and
 * experts more than 4 slots each; not on a layer made with MOEK_CUDA_NO_DEP=1 or MOEK_CUDA_NO_EARLY=1, nor,
 * though this does not look at it, MOEK_CUDA_NO_PDL=1). */
bool moek_cuda_moe_layer_uses_dep(const moek_cuda_moe_layer *layer,
                                  int tokens);

/* Whether such a call runs in slot mode (sm_90, tiles of 128 rows and
 * wider, an fp32 accumulator of T x hidden floats of at least a quarter of
 * L2): GEMM 2 stores each slot's weighted row in the dtype and the
 * finalize sums each token's k rows, where other calls add into the fp32
 * accumulator with atomics. At layer creation MOEK_CUDA_NO_SLOT_ROWS=1
 * keeps a layer off it, MOEK_CUDA_SLOT_MIN_KB=N sets the accumulator bound
 * to N KB. */
bool moek_cuda_moe_layer_uses_slots(const moek_cuda_moe_layer *layer,
                                    int tokens);

/* ---- token-tile table and autotuning ------------------------------------ */

/*
 * The GEMM token tile of a MoE layer is picked per call from its token count
 * T by a heuristic (layer.cu, pick_tile) that the sweeps in
 * kernels/bench/RESULTS.md show right in most cases, not all. A layer can
 * carry a table measured on the card at hand instead (moed --tune measures
 * with moek_cuda_moe_layer_autotune and keeps it in a file): a call of T
 * tokens uses the rule with the largest min_tokens <= T. Below the first
 * rule the heuristic still picks; on the portable SIMT path (generic, or a
 * device that is not sm_90) the table is ignored, since those kernels have
 * one tile; a token_tile forced with moek_cuda_moe_layer_tune wins over the
 * table.
 */
#define MOEK_CUDA_MAX_TILE_RULES 32
/* The token tiles offered, ascending: the columns of autotune's us[]. */
#define MOEK_CUDA_TILE_CANDIDATES 7
#define MOEK_CUDA_TOKEN_TILES {16, 32, 64, 128, 144, 192, 256}

typedef struct moek_cuda_tile_rule {
    int min_tokens; /* applies from this many tokens (>= 1) */
    int token_tile; /* one of MOEK_CUDA_TOKEN_TILES */
} moek_cuda_tile_rule;

/*
 * Copy n rules (0 to MOEK_CUDA_MAX_TILE_RULES, min_tokens >= 1 and strictly
 * ascending, every tile offered) into the layer; n = 0 clears the table.
 * A refused table (-EINVAL, moek_cuda_last_error() says which rule) leaves
 * the layer's table as it was. Like moek_cuda_moe_layer_tune, not to be
 * called while a forward of the layer runs; a CUDA graph keeps the tile it
 * was captured with.
 */
int moek_cuda_moe_layer_set_tiles(moek_cuda_moe_layer *layer,
                                  const moek_cuda_tile_rule *rules, int n);

/*
 * Measure which token tile is fastest for each of n token counts (1 to 64
 * counts, each 1 to 65536): for every count, fresh random inputs (x of the
 * layer's dtype, router logits; softmax top-k on the device, as a request
 * with logits is routed) in four rotating sets, then for every offered tile
 * forced in turn, one CUDA graph per set holding one moek_cuda_fused_moe
 * call, two warm-up replays and the median of 9 to 51 timed replays (CUDA
 * events; more for short calls), after 300 ms of warm-up replays.
 * best_tile[i] gets the fastest tile for tokens[i], unless the layer's
 * present choice (moek_cuda_moe_layer_token_tile) is within 2% of it: then
 * that one; us, when not NULL, n * MOEK_CUDA_TILE_CANDIDATES medians in
 * microseconds, us[i * MOEK_CUDA_TILE_CANDIDATES + j] for tile j of
 * MOEK_CUDA_TOKEN_TILES (a tile the layer runs as another, 144 as 128
 * where its weight tiles do not suit it, gets that one's time and is never
 * the pick). Synchronous; allocates (and frees) its own stream, workspace
 * and buffers on the layer's device, so nothing else may use the
 * layer meanwhile; the layer's tuning and tile table are as before
 * afterwards, also on error. -ENOTSUP where tiles are not chosen (the SIMT
 * path), -ENOMEM when the buffers do not fit.
 */
int moek_cuda_moe_layer_autotune(moek_cuda_moe_layer *layer, const int *tokens,
                                 int n, int *best_tile, float *us);

#ifdef __cplusplus
}
#endif

#endif
