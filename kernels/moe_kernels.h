/*
 * moe_kernels.h: the C ABI between moed's backends and its compute kernels.
 *
 * Everything here is plain C11 and free of CUDA types, so the daemon, the
 * client library (for its --check reference) and the tests can include it.
 * Three families live behind it:
 *
 *   moek_ref_*   portable reference code: fp32 accumulation, obvious loops,
 *                the definition of what every fast path must compute;
 *   moek_cpu_*   the CPU backend's fast path: multithreaded, packed panels,
 *                bit-identical per token whatever else is in the batch;
 *   moek_cuda_*  the CUDA kernels (kernels/cuda/moe_cuda.h, only when built
 *                with nvcc).
 *
 * Conventions shared by every family:
 *   - Matrices are row-major. A weight matrix is stored as PyTorch's Linear
 *     stores it: [out_features, in_features], so y = W x reads W by rows.
 *   - A MoE layer has E experts; expert e owns gate W1[e] [I, H], up W3[e]
 *     [I, H] and down W2[e] [H, I]. The stacked tensors are [E, I, H],
 *     [E, I, H] and [E, H, I].
 *   - The MoE forward for token t with routed experts ids[t][j] and weights
 *     w[t][j], j < k:  out[t] = sum_j w[t][j] * W2[e] (silu(W1[e] x) * (W3[e] x))
 *     with silu(v) = v / (1 + exp(-v)); every sum in fp32. The activation
 *     silu(W1[e] x) * (W3[e] x) is rounded to the layer's dtype, as the
 *     GEMMs it passes between store it (so in fp16 it overflows to inf past
 *     65504, on every backend); out is rounded once. The CUDA backend may
 *     also round each slot's weighted row to the dtype before the top-k sum.
 *   - Routing picks the k largest scores; ties go to the lower expert index and
 *     a NaN score ranks below every number. Softmax weights are the softmax
 *     over all E logits; sigmoid weights are sigmoid(logit). With renormalise
 *     the k chosen weights are divided by their sum.
 *   - Grouped GEMM: B is [G, N, K]; A is [M, K] with rows grouped by
 *     m_sizes[G] (group g owns the next m_sizes[g] rows); C[rows of g] =
 *     A[rows of g] . B[g]^T, so C is [M, N].
 *   - Functions return 0 or a negative errno; they never log and never exit.
 */
#ifndef MOE_KERNELS_H
#define MOE_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moek_dtype {
    MOEK_DTYPE_BF16 = 0,
    MOEK_DTYPE_FP16 = 1,
    MOEK_DTYPE_FP32 = 2,
} moek_dtype;

typedef enum moek_scoring {
    MOEK_SCORING_SOFTMAX = 0,
    MOEK_SCORING_SIGMOID = 1,
} moek_scoring;

/* Bytes per element of a dtype; 0 for an unknown value. */
size_t moek_dtype_size(moek_dtype dt);

/* Scalar conversions, round-to-nearest-even; NaN stays NaN. */
float moek_bf16_to_f32(uint16_t v);
uint16_t moek_f32_to_bf16(float f);
float moek_fp16_to_f32(uint16_t v);
uint16_t moek_f32_to_fp16(float f);

/* f rounded to dtype dt (as stored, then read back). */
float moek_round(moek_dtype dt, float f);

/* Convert n elements of src (dtype dt) to fp32, or fp32 to dtype dt. */
void moek_to_f32(moek_dtype dt, const void *src, float *dst, size_t n);
void moek_from_f32(moek_dtype dt, const float *src, void *dst, size_t n);

/* Shape of a MoE layer. */
typedef struct moek_moe_shape {
    int experts;      /* E */
    int topk;         /* k >= 1; k <= E when routed from logits (a shard of a
                         spread layer may have k > E) */
    int hidden;       /* H */
    int intermediate; /* I */
} moek_moe_shape;

/* ---- reference ---------------------------------------------------------- */

/*
 * Route T tokens: logits [T, E] fp32 -> ids [T, k] and weights [T, k], the
 * j-th pick of a token in descending score order.
 */
void moek_ref_route(const float *logits, int tokens, int experts, int topk,
                    moek_scoring scoring, bool renormalize, int32_t *ids,
                    float *weights);

/*
 * Reference MoE forward over T tokens. x [T, H], w1/w3 [E, I, H], w2 [E, H, I]
 * and out [T, H] are all of dtype dt; ids/weights [T, k] come from routing.
 * Every id must be in [0, E), or -1 for an empty slot that contributes
 * nothing (a shard of a layer spread over devices holds some of the routed
 * experts); anything else is refused with -EINVAL, out untouched.
 */
int moek_ref_fused_moe(const moek_moe_shape *shape, moek_dtype dt,
                       const void *x, const int32_t *ids, const float *weights,
                       const void *w1, const void *w3, const void *w2,
                       int tokens, void *out);

/*
 * Reference grouped GEMM: A [M, K], B [G, N, K], C [M, N] of dtype dt,
 * M = sum of m_sizes. -EINVAL on a negative group size.
 */
int moek_ref_grouped_gemm(moek_dtype dt, int groups, int n, int k,
                          const void *a, const int64_t *m_sizes, const void *b,
                          void *c);

/* Relative Frobenius error ||got - want|| / ||want|| over n fp32 values;
 * +inf if got holds a NaN or infinity where want does not. */
double moek_rel_error(const float *got, const float *want, size_t n);

/* ---- CPU fast path ------------------------------------------------------ */

/* A fixed pool of worker threads. Caller owns the pool; free with
 * moek_cpu_pool_free(), which accepts NULL. threads <= 0 means one per CPU. */
typedef struct moek_cpu_pool moek_cpu_pool;
moek_cpu_pool *moek_cpu_pool_new(int threads);
void moek_cpu_pool_free(moek_cpu_pool *pool);
int moek_cpu_pool_threads(const moek_cpu_pool *pool);

/*
 * Parallel for: calls fn(ctx, item) once for each item in [0, n_items), spread
 * over the pool's threads, the calling thread included, and returns when all
 * calls have returned. Which thread runs an item is unspecified. One thread
 * at a time may call it on a given pool. A NULL pool runs every item in the
 * calling thread.
 */
void moek_cpu_pool_run(moek_cpu_pool *pool, int n_items,
                       void (*fn)(void *ctx, int item), void *ctx);

/*
 * Weights prepared once at load time for the CPU fast path. Caller owns the
 * result; free with moek_cpu_moe_weights_free(). The source tensors are only
 * read during the call.
 */
typedef struct moek_cpu_moe_weights moek_cpu_moe_weights;
int moek_cpu_moe_weights_new(const moek_moe_shape *shape, moek_dtype dt,
                             const void *w1, const void *w3, const void *w2,
                             moek_cpu_moe_weights **out);
void moek_cpu_moe_weights_free(moek_cpu_moe_weights *w);

/*
 * CPU MoE forward with the same contract as moek_ref_fused_moe. The result
 * for a token depends only on that token's x, ids and weights, never on the
 * other tokens of the call or the number of threads (bit for bit).
 */
int moek_cpu_fused_moe(moek_cpu_pool *pool, const moek_cpu_moe_weights *w,
                       const void *x, const int32_t *ids, const float *weights,
                       int tokens, void *out);

typedef struct moek_cpu_gemm_weights moek_cpu_gemm_weights;
int moek_cpu_gemm_weights_new(moek_dtype dt, int groups, int n, int k,
                              const void *b, moek_cpu_gemm_weights **out);
void moek_cpu_gemm_weights_free(moek_cpu_gemm_weights *w);

/* CPU grouped GEMM, same contract as moek_ref_grouped_gemm; empty groups
 * cost nothing. Row results are independent of the other rows. */
int moek_cpu_grouped_gemm(moek_cpu_pool *pool, const moek_cpu_gemm_weights *w,
                          const void *a, const int64_t *m_sizes, void *c);

#ifdef __cplusplus
}
#endif

#endif
