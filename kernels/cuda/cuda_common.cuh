/*
 * cuda_common.cuh: what the .cu files of kernels/cuda share and nothing
 * outside them sees: limits, the device-side tile list every GEMM walks, the
 * GEMM argument block, dtype helpers and the error plumbing of the C ABI.
 *
 * The tile list. Routing (route.cu) counts the rows of each group (expert,
 * or GEMM group), keeps only the non-empty ones ("compact groups", cg) and,
 * for each GEMM that will run, the number of work items before each compact
 * group. An item is (compact group, token tile of up to BN rows, weight
 * tile of 128 rows, K split). A persistent GEMM grid walks items i = blockIdx.x,
 * blockIdx.x + gridDim.x, ... (or, stream-K, a contiguous run of them per
 * CTA: gemm_wgmma.cu); moek_decode_item() maps i to the tile (in two
 * steps, moek_fetch_item() and moek_item_from(), for a caller that
 * fetches one item ahead). Items of one
 * group are ordered chunk of weight tiles -> token tile -> weight tile ->
 * split, so the CTAs running at one time share weight tiles (read from DRAM
 * once, then from L2) and reuse each token tile over a chunk of weight tiles.
 */
#ifndef MOEK_CUDA_COMMON_CUH
#define MOEK_CUDA_COMMON_CUH

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <utility>

#include "moe_cuda.h"

#define MOEK_MAX_EXPERTS MOEK_CUDA_MAX_EXPERTS
#define MOEK_MAX_TOPK 32     /* one pick per lane */
#define MOEK_MAX_GROUPS 2048 /* the align kernel holds 2 per thread */
#define MOEK_ALIGN_THREADS 1024
#define MOEK_WTILE 128 /* weight rows per GEMM tile (two warpgroups of 64) */
#define MOEK_KTILE 64  /* K per pipeline stage: one 128-byte swizzle row */

/* Epilogues. SLOT (the wgmma kernel's, epi_slot_staged): COMBINE's product,
 * the routing weight times the output, stored in the dtype as the row of
 * the slot's sorted position, for a finalize that sums each token's k rows
 * (layer.cu, slot mode). */
enum {
    MOEK_EPI_SWIGLU = 0,
    MOEK_EPI_COMBINE = 1,
    MOEK_EPI_STORE = 2,
    MOEK_EPI_SLOT = 3,
};

/*
 * Token tiles of a group of cnt rows, for a GEMM instance of tile bn: the
 * fewest tiles of at most bn rows, np = ceil(cnt / bn), all of one width,
 * the narrowest of the instance's "classes" (moek_class_width; tiles of
 * 128 rows and wider; one class, bn, below) that holds ceil(cnt / np)
 * rows. The wgmma's N follows the tile's width, so a group pays for about
 * the rows it has: with ~128 rows per group (deepseek-v3, T = 4096) a
 * 192-row tile alone leaves a third of every MMA empty. A group's tiles
 * stay next to each other in the item order, so the weight tiles they
 * share are read from DRAM once (narrow tiles for the rest of a group, run
 * after every whole tile, would read them again).
 * A GEMM instance runs its classes one after another, each a loop with one
 * wgmma shape (gemm_wgmma.cu), so the align kernels order the compact
 * groups by class, then by group index.
 */
#define MOEK_CLASSES 4 /* tile widths of one instance, at most */
/* Tiles of this many rows and wider stage SWIGLU's and SLOT's output in
 * shared memory and store it by TMA (gemm_wgmma.cu, epi_swiglu_staged,
 * epi_slot_staged); SLOT runs on those alone. */
#define MOEK_STAGED_MIN_TILE 128
__host__ __device__ __forceinline__ constexpr int moek_classes(int bn)
{
    return bn >= 128 ? MOEK_CLASSES : 1;
}
/*
 * Width of class c of instance bn, widest first: multiples of 16 (a wgmma
 * N: its time is proportional to N, measured on the H200), halves of
 * whole 8-row swizzle atoms (cluster mode's TMA boxes). Chosen for the
 * groups each instance meets (simulated over the bench's routing, MMA
 * columns per routed row): 256 (about 256 or 1024 rows a group: qwen3 and
 * mixtral at T = 4096) has 144 for groups just over 256 rows (two tiles),
 * 208 and 224 for those just over 1024 (five); 192 (about 128 rows:
 * deepseek T = 4096, mixtral T = 512) has 128, 144 and 160. Against
 * widths 32 apart that is 1.8% (mixtral), 4.3% (qwen3), 4.4% (deepseek)
 * and 4.7% (mixtral T = 512) fewer columns. 144 (two weight tiles a CTA,
 * moek_wtiles; its accumulators bound it at 144) has 128, 96 and 64: a
 * group of 256 rows takes two tiles of 128, one just over 144 two of 96.
 */
__host__ __device__ __forceinline__ constexpr int moek_class_width(int bn,
                                                                   int c)
{
    return bn == 256   ? (c == 0 ? 256 : c == 1 ? 224 : c == 2 ? 208 : 144)
           : bn == 192 ? (c == 0 ? 192 : c == 1 ? 160 : c == 2 ? 144 : 128)
           : bn == 144 ? (c == 0 ? 144 : c == 1 ? 128 : c == 2 ? 96 : 64)
           : bn == 128 ? 128 - 32 * c
                       : bn;
}
/*
 * Weight tiles a CTA of instance bn multiplies against each token tile at
 * once. The 144-row instance takes two (256 weight rows: each consumer
 * warpgroup one whole 128-row tile, in two accumulators), so a token
 * tile's rows are read once per 256 weight rows instead of once per 128,
 * and each stage holds twice the MMA work. Its items go in pairs, nt and
 * nt + 1 of one token tile, so the layer needs weight-tile counts and
 * raster chunks that are multiples of two (four in cluster mode) and GEMMs
 * that do not split K (layer.cu, fit_tile). Where groups split into whole
 * tiles of about 128 rows (256 to 512 rows a group) it beat the 256-row
 * instance on an H100; for groups of about 128 or 192 rows it lost to the
 * 192- and 256-row ones (kernels/bench/RESULTS.md, run 43; layer.cu,
 * pick_tile).
 */
__host__ __device__ __forceinline__ constexpr int moek_wtiles(int bn)
{
    return bn == 144 ? 2 : 1;
}
/* Items of one token tile that a CTA of instance bn, or in cluster mode a
 * pair of CTAs, takes as one run: its weight tiles, twice that in a pair.
 * A GEMM's weight-tile count and raster chunk are multiples of it, so a
 * run never reaches into the next token tile (moek_launch_gemm_wgmma
 * refuses them otherwise). */
__host__ __device__ __forceinline__ constexpr int moek_run_items(int bn,
                                                                 bool cluster)
{
    return moek_wtiles(bn) * (cluster ? 2 : 1);
}
__host__ __device__ __forceinline__ int moek_token_tiles(int cnt, int bn)
{
    return cnt / bn + (cnt % bn != 0); /* cnt may be near INT_MAX */
}
/* np: moek_token_tiles(cnt, bn), which every caller has at hand. */
__host__ __device__ __forceinline__ int moek_tile_class(int cnt, int np,
                                                        int bn)
{
    const int rows = np > 0 ? cnt / np + (cnt % np != 0) : bn;
    int c = moek_classes(bn) - 1;
    while (c > 0 && moek_class_width(bn, c) < rows)
        c--;
    return c;
}

/* plan[] written by the align kernels, read by the GEMMs. ENDS: the item
 * index where each tile class's items end (MOEK_CLASSES ints; classes an
 * instance does not have end where the one before does), the last the
 * GEMM's item count. */
enum {
    MOEK_PLAN_NCG = 0,    /* compact groups */
    MOEK_PLAN_SPLIT0 = 1, /* K splits of GEMM 0 */
    MOEK_PLAN_ENDS0 = 2,
    MOEK_PLAN_SPLIT1 = MOEK_PLAN_ENDS0 + MOEK_CLASSES,
    MOEK_PLAN_ENDS1 = MOEK_PLAN_SPLIT1 + 1,
    MOEK_PLAN_INTS = 16,
};
static_assert(MOEK_PLAN_ENDS1 + MOEK_CLASSES <= MOEK_PLAN_INTS, "plan");

/* Per-GEMM shape description the align kernel needs to count items. */
struct moek_gemm_dims {
    int n_tiles;   /* weight tiles per group: ceil(rows / 128) */
    int kblocks;   /* ceil(K / 64) */
    int can_split; /* epilogue accumulates in fp32 atomics */
};

/* Everything a GEMM launch reads. Device pointers point into the workspace,
 * the weights or the caller's tensors. */
struct moek_gemm_args {
    /* tile list */
    const int *plan;
    const int *cg_group, *cg_start, *cg_count;
    const int *cg_before; /* items before each compact group */
    /* groups the list was built for (cg_before holds groups + 1 entries),
     * so the GEMM may read them before it knows how many are in use; 0:
     * unknown */
    int groups;
    int which;            /* 0 or 1: which plan split/items */
    int bn;               /* token rows of the widest tile */
    int chunk;            /* weight tiles per raster chunk */
    /* weights [groups * rows_pad, K], K-major */
    const void *w;
    int rows_pad;  /* rows per group in w (multiple of 16) */
    int n_valid;   /* output features (I for SWIGLU, H, or N) */
    int n_tiles;
    int k, kblocks;
    /* token operand: row r of the tile is row b_rows[pos] (or pos) of b */
    const void *b;
    int ldb;
    const int *b_rows;
    /* epilogue */
    int epi;
    void *out;
    int ldo;
    const int *pos_token;    /* COMBINE: sorted position -> token */
    const float *pos_weight; /* COMBINE, SLOT: position -> routing weight */
    /* The weights may be loaded before the previous kernel finishes: only
     * the token rows depend on it (GEMM 2 of a MoE forward). */
    int early_a;
    /* w is in tiles (moek_wt_index), not row-major behind a TMA map */
    int w_tiled;
    /* the tiles of groups with one token tile (weights read once) are
     * loaded with an L2 evict-first hint */
    int l2_hint;
    /* The wgmma kernel splits the K blocks of a one-class instance evenly
     * over its CTAs (stream-K, gemm_wgmma.cu's cta_span): COMBINE only, and
     * a plan without a K split (can_split 0). */
    int stream_k;
    /* GEMM 1 of a MoE forward zeroes GEMM 2's fp32 accumulator as it
     * starts (moek_zero_acc): zero_n4 float4s at zero, or none. */
    float4 *zero;
    size_t zero_n4;
    /* GEMM 2 starting per group (moek_dep, layer.cu; dep laid out as
     * MOEK_DEP_*): dep_mode 1, GEMM 1 counts the consumer warpgroups done
     * with each group's items (two per item) and its CTAs done zeroing acc;
     * dep_mode 2, GEMM 2 waits for a group's count (twice its token tiles
     * times dep_tiles, GEMM 1's weight tiles) before it reads the group's
     * rows, and for dep_ctas zeroed slices before its first add; its CTAs
     * take their work from the ticket (gemm_wgmma.cu, unit_span). Mode
     * 3 (GEMM 1's args of moek_launch_gemm_wgmma_both): both in one
     * launch, GEMM 1 as in mode 1, then, in the same CTAs, GEMM 2 as in
     * mode 2. 0: none. Each mode is its own kernel instance
     * (gemm_wgmma.cu), so mode 0 runs the code it ran before. */
    int dep_mode;
    int *dep;
    int dep_tiles, dep_ctas;
    /* In modes 1 and 3, non-zero: GEMM 1's counts go out from the CTA's
     * counting warp (gemm_wgmma.cu, sig_counts); 0: each consumer
     * warpgroup makes its own (layer.cu chooses). */
    int sig;
    /* GEMM 1 of a MoE forward, tiled weights: before waiting for the
     * routing, each CTA sends the first pf_kb K blocks of the item it would
     * run first to L2, on the guess that every group has pf_cnt rows (so
     * all are in use); pf_cnt 0: the first pf_kb blocks of every group's
     * tiles, spread over the CTAs. pf_kb 0: none (gemm_wgmma.cu,
     * prefetch_guess). */
    int pf_kb, pf_cnt;
};
/* moek_dep's counts (layer.cu's workspace, zeroed by the routing kernel):
 * GEMM 1's CTAs done zeroing acc, GEMM 2's ticket, then one per group. */
enum { MOEK_DEP_ZEROED = 0, MOEK_DEP_TICKET = 1, MOEK_DEP_GROUP = 2 };

/* Tiled weights: every 128-row x 64-column block of a group's weights is
 * one contiguous 16 KB block in the exact shared-memory image a 128-byte
 * swizzled TMA load would make (row r at r * 128 bytes, 16-byte chunk c at
 * chunk c ^ (r & 7)), blocks ordered group -> row tile -> K block, rows and
 * columns past the matrix zero. A pipeline stage is then one bulk copy of
 * contiguous memory, and a CTA streams its item's weights sequentially.
 * Element (g, R, k) of a group with `tiles` row tiles and `kblocks` K
 * blocks: */
__host__ __device__ __forceinline__ size_t moek_wt_index(int g, int R, int k,
                                                         int tiles,
                                                         int kblocks)
{
    const size_t tile =
        ((size_t)g * tiles + (R >> 7)) * (size_t)kblocks + (k >> 6);
    const int r = R & 127, kk = k & 63;
    return tile * (MOEK_WTILE * MOEK_KTILE) + r * MOEK_KTILE +
           ((((kk >> 3) ^ (r & 7)) << 3) | (kk & 7));
}

struct moek_item {
    int g;    /* group (expert) */
    int pos;  /* first sorted row of the token tile */
    int mlen; /* valid rows in the token tile, 1..its width */
    int nt;   /* weight tile */
    int kb0, kb1;
    bool once; /* the group has one token tile: its weights are read once */
};

/* What a work item's decode reads: its place l among its compact group's
 * items (a binary search of cg_before), and the group's row count, expert
 * and first sorted row (three global loads). */
struct moek_item_src {
    int l, cnt, g, start;
};

/* Work item `idx`'s reads (see the top). sbefore: a shared-memory copy of
 * cg_before, or NULL. The loads are issued here and waited for where the
 * fields are first used (moek_item_from), so a caller that fetches the
 * next item before streaming the current one does not wait for them. */
__device__ __forceinline__ moek_item_src moek_fetch_item(const moek_gemm_args &a,
                                                         int ncg, int idx,
                                                         const int *sbefore = nullptr)
{
    /* A generic pointer: shared memory or the global list. */
    const int *before = sbefore ? sbefore : a.cg_before;
    int lo = 0, hi = ncg;
    while (hi - lo > 1) {
        int mid = (lo + hi) >> 1;
        if (before[mid] <= idx)
            lo = mid;
        else
            hi = mid;
    }
    moek_item_src f;
    f.l = idx - before[lo];
    f.cnt = __ldg(a.cg_count + lo);
    f.g = __ldg(a.cg_group + lo);
    f.start = __ldg(a.cg_start + lo);
    return f;
}

/* The tile of a fetched work item: arithmetic only. */
__device__ __forceinline__ moek_item moek_item_from(const moek_gemm_args &a,
                                                    int split,
                                                    const moek_item_src &f)
{
    const int cnt = f.cnt, l = f.l;
    const int np = moek_token_tiles(cnt, a.bn);
    const int bn = moek_class_width(a.bn, moek_tile_class(cnt, np, a.bn));
    int per_chunk = np * a.chunk * split;
    int ch = l / per_chunk;
    int r = l - ch * per_chunk;
    int cw = min(a.chunk, a.n_tiles - ch * a.chunk);
    moek_item it;
    int p;
    if (split == 1) { /* no K split (the common case): four divisions fewer */
        p = r / cw;
        it.nt = ch * a.chunk + r - p * cw;
        it.kb0 = 0;
        it.kb1 = a.kblocks;
    } else {
        p = r / (cw * split);
        const int r2 = r - p * cw * split, s = r2 % split;
        it.nt = ch * a.chunk + r2 / split;
        it.kb0 = (int)((long long)s * a.kblocks / split);
        it.kb1 = (int)((long long)(s + 1) * a.kblocks / split);
    }
    it.g = f.g;
    it.pos = f.start + p * bn;
    it.mlen = min(bn, cnt - p * bn);
    it.once = np <= 1;
    return it;
}

/* Map work item `idx` to its tile in one step. */
__device__ __forceinline__ moek_item moek_decode_item(const moek_gemm_args &a,
                                                      int ncg, int split,
                                                      int idx,
                                                      const int *sbefore = nullptr)
{
    return moek_item_from(a, split, moek_fetch_item(a, ncg, idx, sbefore));
}

/* dtype helpers */
template <typename T> struct moek_dt;
template <> struct moek_dt<__nv_bfloat16> {
    static __device__ __forceinline__ float to_f(__nv_bfloat16 v)
    {
        return __bfloat162float(v);
    }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float v)
    {
        return __float2bfloat16_rn(v);
    }
    static __device__ __forceinline__ uint32_t pack2(float a, float b)
    {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ float2 unpack2(uint32_t u)
    {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 *>(&u));
    }
};
template <> struct moek_dt<__half> {
    static __device__ __forceinline__ float to_f(__half v)
    {
        return __half2float(v);
    }
    static __device__ __forceinline__ __half from_f(float v)
    {
        return __float2half_rn(v);
    }
    static __device__ __forceinline__ uint32_t pack2(float a, float b)
    {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ float2 unpack2(uint32_t u)
    {
        return __half22float2(*reinterpret_cast<__half2 *>(&u));
    }
};

/* The fast division: 1 + e^-v >= 1, and for v below about -88 e^-v is
 * inf and the quotient 0, the limit. An IEEE division here cost GEMM 1's
 * epilogue 4% of qwen3 T=4096 (RESULTS.md, run 11). */
__device__ __forceinline__ float moek_silu(float v)
{
    return __fdividef(v, 1.0f + __expf(-v));
}

/*
 * The epilogue of one pair of accumulators: a thread of either GEMM kernel
 * holds, for token column c of the tile, the values of weight rows R_lo and
 * R_lo + 8 of its group (R_lo % 16 < 8). The weight layouts (weights.cu) make
 * that pair either (gate, up) of one intermediate feature (SWIGLU) or two
 * adjacent output features (COMBINE, STORE), so no data crosses threads.
 */
template <typename T>
__device__ __forceinline__ void moek_epi_pair(const moek_gemm_args &a,
                                              const moek_item &it, int R_lo,
                                              int c, float lo, float hi)
{
    if (c >= it.mlen)
        return;
    const int pos = it.pos + c;
    const int b = R_lo >> 4, r = R_lo & 7;
    if (a.epi == MOEK_EPI_SWIGLU) {
        const int f = b * 8 + r;
        if (f >= a.n_valid)
            return;
        reinterpret_cast<T *>(a.out)[(size_t)pos * a.ldo + f] =
            moek_dt<T>::from_f(moek_silu(lo) * hi);
        return;
    }
    const int f = b * 16 + 2 * r;
    if (f >= a.n_valid)
        return;
    if (a.epi == MOEK_EPI_COMBINE) {
        const int tok = a.pos_token[pos];
        const float w = a.pos_weight[pos];
        float *dst = reinterpret_cast<float *>(a.out) + (size_t)tok * a.ldo + f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2 *>(dst), make_float2(w * lo, w * hi));
#else
        atomicAdd(dst, w * lo);
        atomicAdd(dst + 1, w * hi);
#endif
    } else {
        *reinterpret_cast<uint32_t *>(reinterpret_cast<T *>(a.out) +
                                      (size_t)pos * a.ldo + f) =
            moek_dt<T>::pack2(lo, hi);
    }
}

/* COMBINE, four adjacent output features f .. f + 3 of token column c: one
 * 16-byte fp32 atomic add of w * v into the token's row (sm_90; H is a
 * multiple of 8, so the four are valid together). stg: the tile's (token,
 * routing weight) pairs, staged in shared memory by column. (SLOT goes
 * through shared memory and TMA: gemm_wgmma.cu, epi_slot_staged.) */
template <typename T>
__device__ __forceinline__ void moek_combine4(const moek_gemm_args &a,
                                              const moek_item &it, int f,
                                              int c, float4 v, const int2 *stg)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (c >= it.mlen || f >= a.n_valid)
        return;
    const float w = __int_as_float(stg[c].y);
    float *dst = reinterpret_cast<float *>(a.out) + (size_t)stg[c].x * a.ldo + f;
    atomicAdd(reinterpret_cast<float4 *>(dst),
              make_float4(w * v.x, w * v.y, w * v.z, w * v.w));
#elif defined(__CUDA_ARCH__)
    __trap(); /* only the sm_90 kernel calls this */
#endif
}

/* GEMM 1's share of zeroing GEMM 2's accumulator (a.zero): thread t of nt
 * per CTA, after the wait for the previous kernel (whose predecessors may
 * still read acc: the last forward's finalize). The stores go out while
 * the first stages load. At small T they are a few KB per CTA, where one
 * routing block took 7 us for 512 KB; at mixtral T=4096 (64 MB, about
 * 20 us of stores before the first MMA) the forward read the same within
 * noise (kernels/bench/RESULTS.md, run 14). */
__device__ __forceinline__ void moek_zero_acc(const moek_gemm_args &a, int t,
                                              int nt)
{
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    const size_t step = (size_t)gridDim.x * nt;
    for (size_t i = (size_t)blockIdx.x * nt + t; i < a.zero_n4; i += step)
        a.zero[i] = z;
}

/* Programmatic dependent launch: wait for the previous kernel in the stream
 * (a no-op when the launch had no programmatic dependency), and let the next
 * one start its prologue. */
__device__ __forceinline__ void moek_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void moek_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* ---- host side ---------------------------------------------------------- */

/* Record a CUDA error for moek_cuda_last_error() and map it to an errno. */
int moek_cuda_fail(cudaError_t e, const char *what);
/* Set the error string to a message of our own and return err. */
int moek_cuda_refuse(int err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define MOEK_CU(call)                                                         \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess)                                                \
            return moek_cuda_fail(e_, #call);                                 \
    } while (0)

/* A launch attribute: clusters of n CTAs along x. */
static inline cudaLaunchAttribute moek_cluster_attr(int n)
{
    cudaLaunchAttribute at = {};
    at.id = cudaLaunchAttributeClusterDimension;
    at.val.clusterDim.x = (unsigned)n;
    at.val.clusterDim.y = 1;
    at.val.clusterDim.z = 1;
    return at;
}

/* Launch with the programmatic-dependency attribute when pdl is set, in
 * clusters of `cluster` CTAs along x when it is above 1, cooperatively
 * (every CTA resident at once, or the launch fails) when it is -1. */
template <typename... KArgs, typename... Args>
static inline cudaError_t moek_launch_cl(void (*kernel)(KArgs...), dim3 grid,
                                         dim3 block, size_t smem,
                                         cudaStream_t stream, bool pdl,
                                         int cluster, Args &&...args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        n++;
    }
    if (cluster > 1)
        attr[n++] = moek_cluster_attr(cluster);
    if (cluster < 0) { /* cooperative: every CTA resident at once */
        attr[n].id = cudaLaunchAttributeCooperative;
        attr[n++].val.cooperative = 1;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
template <typename... KArgs, typename... Args>
static inline cudaError_t moek_launch(void (*kernel)(KArgs...), dim3 grid,
                                      dim3 block, size_t smem,
                                      cudaStream_t stream, bool pdl,
                                      Args &&...args)
{
    return moek_launch_cl(kernel, grid, block, smem, stream, pdl, 1,
                          std::forward<Args>(args)...);
}

/* The objects of the C ABI (weights.cu creates the layer and weight set,
 * layer.cu the workspace; layer.cu runs them). */
struct moek_cuda_moe_layer {
    CUtensorMap tm13; /* w13 [E * 2I, H] */
    CUtensorMap tm2;  /* w2p [E * H16, I] */
    moek_moe_shape shape;
    moek_dtype dt;
    int device, sms, cc;
    int h16;    /* H rounded up to 16: rows per expert of w2p */
    void *w13;  /* gate/up interleaved by 8 rows: [E][2I][H] */
    void *w2p;  /* down, rows paired: [E][H16][I] */
    moek_cuda_tuning tune;
    bool pdl;
    bool early; /* GEMM 2 loads weights before GEMM 1 ends (early_a) */
    bool dep;   /* and may start per group (moek_dep; layer.cu) */
    bool both;  /* and run both GEMMs in one launch there (mode 3) */
    /* GEMM 1's moek_dep counts from a warp of their own (sig_counts):
     * in mode 3, and in mode 1 */
    bool sig, sig1;
    bool tiny;  /* decode batches take route_align_tiny */
    int route_cl; /* aa.route_cl of its calls */
    bool tiled; /* w13 and w2p in tiles (moek_wt_index) */
    bool l2_hint; /* their loads evict first from L2 */
    int pairs; /* moek_cluster_mode its prefill tiles may take (layer.cu) */
    bool slots; /* its prefill tiles may take slot mode (layer.cu) */
    bool stream_k; /* GEMM 2 of decode tiles runs stream-K (layer.cu) */
    size_t slot_min_acc; /* from this fp32 accumulator size (layer.cu) */
    int split_min_kb;
    int pf1_kb;     /* moek_gemm_args.pf_kb of GEMM 1, where it applies */
    bool pf_every;  /* GEMM 1's prefetch of every expert's first blocks */
    /* DRAM that reads 4 TB/s or more (weights.cu, dram_gbs: the H200,
     * not an H100 SXM): moek_dep keeps off GEMM 2 items of fewer than 32 K
     * blocks where experts get more than 4 slots (layer.cu, moe_dep). */
    bool fast_dram;
    /* Groups of 80-128 rows may take the 144-row tile (pick_tile): such a
     * card, unless MOEK_CUDA_MID144 says otherwise. */
    bool mid144;
    /* GEMM 1 may take the 144-row tile where GEMM 2 keeps a wider one
     * (layer.cu, moe_tiles): MOEK_CUDA_SPLIT_TILES=1. */
    bool split_tiles;
    /* The token-tile table (moek_cuda_moe_layer_set_tiles): n_rules rules,
     * min_tokens ascending. */
    int n_rules;
    moek_cuda_tile_rule rules[MOEK_CUDA_MAX_TILE_RULES];
};
struct moek_cuda_gemm_weights {
    CUtensorMap tm; /* b [G * N16, K] */
    moek_dtype dt;
    int groups, n, k, n16;
    int device, sms, cc;
    void *b; /* rows paired: [G][N16][K] */
    moek_cuda_tuning tune;
    bool pdl;
    bool tiled;
    int split_min_kb;
};
struct moek_cuda_workspace {
    int device;
    size_t bytes;
    void *base;
};

/* route.cu */
struct moek_route_args {
    const float *logits; /* [T, E] or NULL for given routing */
    int scoring, renorm;
    const int *ids_in;   /* given: [T, k] */
    const float *w_in;
    int tokens, experts, topk; /* experts: of the routing (E) */
    const int *remap;    /* [E] the layer's expert of each routed expert, -1
                            for none (a shard of a layer), or NULL */
    int *ids;     /* computed or remapped: [T, k], the layer's experts */
    float *wts;
    int *rank;    /* [T, k] rank of the slot inside its expert (the
                     multi-block path; the one-block kernels keep it in
                     shared memory) */
    int *counts;  /* [E][MOEK_COUNT_STRIDE] (multi-block path; zeroed
                     before) */
};
/* The multi-block path's count of expert e is counts[e * MOEK_COUNT_STRIDE]:
 * a 128-byte line each, so the slots' atomic adds spread over the L2 slices
 * instead of queueing at the few that hold E packed counters. */
#define MOEK_COUNT_STRIDE 32
struct moek_align_args {
    const int *counts;      /* per group (strided: MOEK_COUNT_STRIDE), or
                               NULL when m_sizes is used */
    const int64_t *m_sizes; /* grouped GEMM */
    int64_t total_m;
    int groups;
    int bn;
    int sms;
    int split_min_kb; /* K blocks an item of a split GEMM keeps at least */
    bool tiny;        /* the one-warp plan for T k <= 32 may be used */
    int route_cl;     /* most CTAs of route_align_small's cluster (1, 2, 4,
                         8 or 16: moek_route_cluster_cap, then
                         moek_route_cluster_use for the route's experts) */
    moek_gemm_dims d[2];
    int ngemm;
    /* outputs */
    int *plan;
    int *cg_group, *cg_start, *cg_count;
    int *cg_before; /* [2 GEMMs][groups + 1] */
    /* slot scatter (MoE only) */
    const int *ids;
    const float *wts;
    const int *rank;
    int slots, topk;
    int *pos_token;
    float *pos_weight;
    int *slot_pos; /* slot -> its sorted position, -1 routed nowhere; or NULL */
    int *dep; /* moek_gemm_args.dep, MOEK_DEP_GROUP + groups, zeroed
                 here; or NULL */
    /* moek_launch_relist only: GEMM 2's own compact groups */
    int *cg2_group, *cg2_start, *cg2_count;
};
cudaError_t moek_launch_route(const moek_route_args &ra,
                              const moek_align_args &aa, int *counts_dev,
                              cudaStream_t stream, bool pdl);
cudaError_t moek_launch_align_groups(const moek_align_args &aa,
                                     cudaStream_t stream, bool pdl);
/* GEMM 2's tile list where its token tile differs from GEMM 1's (layer.cu,
 * moe_tiles): after the align kernels, the compact groups of aa.cg_* (GEMM
 * 1's, in order of its tile classes) into aa.cg2_* in order of the classes
 * of tile aa.bn, with GEMM 2's items before each (aa.cg_before's second
 * half) and its plan tail (K split, class ends) from aa.d[1]. */
cudaError_t moek_launch_relist(const moek_align_args &aa, cudaStream_t stream,
                               bool pdl);
/* The most CTAs (16, 8, 4, 2 or 1, and at most cap) of a routing cluster
 * that the current device can run for a layer of `experts` experts, cc its
 * compute capability (10 x major + minor). Only a cap of 16 probes the
 * non-portable size. */
int moek_route_cluster_cap(int experts, int cc, int cap);
/* The cluster cap for a route over route_experts of a layer whose cap
 * (moek_route_cluster_cap) was found for cap_experts: a shard's layer
 * routes over the whole layer's experts. */
int moek_route_cluster_use(int cap, int cap_experts, int route_experts);

/* gemm_wgmma.cu / gemm_simt.cu */
cudaError_t moek_gemm_wgmma_prepare(moek_dtype dt);
/* Cluster mode's maps of the token rows: one per tile class c of the
 * instance bn, boxes of MOEK_KTILE x (class width / 2) rows, so each CTA of
 * a pair loads its half of a stage's token tile with one TMA (boxes of 16
 * rows, up to eight loads a stage from one thread, kept mixtral 2-6%
 * slower: kernels/bench/RESULTS.md, run 16). */
struct moek_tmaps {
    CUtensorMap m[MOEK_CLASSES];
    int bn; /* the instance they were made for */
};
/* The maps of [rows, K] token rows at base for the classes of instance bn
 * (moek_wgmma_cluster_ok). */
int moek_make_tmaps(moek_tmaps *t, void *base, moek_dtype dt, uint64_t rows,
                    uint64_t K, int bn);
/* tmaps_b set: cluster mode, pairs of CTAs sharing each token tile by TMA
 * multicast; the token rows a.b are then contiguous (a.b_rows unused)
 * behind tmaps_b (made for a.bn: another instance's boxes would never
 * deliver the bytes a stage waits for, so it is refused) and the grid is
 * even; tiles moek_wgmma_cluster_ok only. In cluster mode, and where a CTA
 * takes two weight tiles (moek_wtiles), the plan has no K split. a.chunk
 * and a.n_tiles are multiples of moek_run_items (refused otherwise).
 * tmap_o: the output's map, which SWIGLU (moek_make_out_tmap) and SLOT
 * (moek_make_tmap, 8-row boxes) store through with tiles of
 * MOEK_STAGED_MIN_TILE rows and wider (refused without it; SLOT is refused
 * below those tiles); NULL otherwise. */
cudaError_t moek_launch_gemm_wgmma(moek_dtype dt, const void *tmap,
                                   const moek_tmaps *tmaps_b,
                                   const CUtensorMap *tmap_o,
                                   const moek_gemm_args &a, int grid,
                                   cudaStream_t stream, bool pdl);
bool moek_wgmma_cluster_ok(int bn);
/* Both GEMMs of a MoE forward in one cooperative launch (moek_dep mode 3:
 * g1.dep_mode 3, g2.dep_mode 2; gemm_wgmma.cu): tiled weights, one decode
 * tile (16, 32 or 64) for both, at most 256 groups, SWIGLU then COMBINE;
 * grid at most one CTA per SM. g1.dep_ctas and g2.dep_ctas are unused (the
 * grid's CTAs zero acc). */
bool moek_wgmma_both_ok(const moek_gemm_args &g1, const moek_gemm_args &g2);
cudaError_t moek_launch_gemm_wgmma_both(moek_dtype dt, const moek_gemm_args &g1,
                                        const moek_gemm_args &g2, int grid,
                                        cudaStream_t stream, bool pdl);
/* weights.cu: a 2-D map of [rows, K] elements, 128-byte swizzle, boxes of
 * MOEK_KTILE x box_rows. */
int moek_make_tmap(CUtensorMap *m, void *base, moek_dtype dt, uint64_t rows,
                   uint64_t K, uint32_t box_rows);
/* The map a SWIGLU epilogue stores through: [rows, cols] elements, rows
 * ld elements apart, 64-byte swizzle, boxes of 32 x 8 (gemm_wgmma.cu,
 * epi_swiglu_staged). */
int moek_make_out_tmap(CUtensorMap *m, void *base, moek_dtype dt,
                       uint64_t rows, uint64_t cols, uint64_t ld);
cudaError_t moek_launch_gemm_simt(moek_dtype dt, const moek_gemm_args &a,
                                  int grid, cudaStream_t stream, bool pdl);
bool moek_wgmma_tile_ok(int bn);

#endif
