/*
 * route.cu: routing and alignment, everything between the router logits and
 * the first GEMM, with no host synchronisation.
 *
 *   route_pick      one warp routes one token (each lane holding VPL of
 *                   the E logits, VPL the power of two that covers E / 32):
 *                   scores (softmax over E, or
 *                   sigmoid), top-k by a warp arg-max on 64-bit keys (score
 *                   bits, then the inverted expert index, so ties go to the
 *                   lower index and NaN ranks below every number), optional
 *                   renormalisation; or it takes the given ids and weights.
 *   route_one       route_pick, then each slot counted into its expert in
 *                   global memory (the returned atomic value is the slot's
 *                   rank inside the expert): route_kernel's.
 *   align_block     one block turns the per-group sizes into the tile list
 *                   of cuda_common.cuh: prefix sums, the compact list of
 *                   non-empty groups (in order of token-tile class), the K
 *                   split of each GEMM, the items before each group and
 *                   where each class's items end, and
 *                   (MoE) the slot -> sorted position
 *                   scatter (token index and routing weight per position,
 *                   and in slot mode each slot's position).
 *   align_warps     the same tile list from MoE counts, by a warp per 32
 *                   groups (or per several, when the block has fewer
 *                   warps) with warp scans and one barrier.
 *
 * Kernels (variants by token count, picked in moek_launch_route; a grouped
 * GEMM's list in moek_launch_align_groups):
 *   route_align_tiny   T k <= 32: a warp per token routes, then one warp
 *                      builds the tile list with a lane per slot (ballots
 *                      and shuffles, no block scans): a decode step's whole
 *                      bookkeeping in one launch and one barrier.
 *   route_align_small  T <= 256 (512 where routing a token is short) and
 *                      T k <= 4096: one launch does both, on one block up
 *                      to 32 tokens, else a cluster of 2, 4 or 8 (a warp
 *                      routes one token, two past 256; 16 with
 *                      MOEK_CUDA_ROUTE_CLUSTER=16, a warp a token up to
 *                      512), each CTA's slots
 *                      in its shared memory, the tile list by a warp per
 *                      32 groups of CTA 0 (align_warps). A batch that
 *                      needs more CTAs than the layer's cap (what the
 *                      device can run together) takes the next path.
 *   route_kernel + align_kernel
 *                      larger T: a warp per token over many blocks (counts in
 *                      global memory, a 128-byte line each, zeroed by a
 *                      memset node before), then block 0 builds the tile
 *                      list (align_warps, or align_block past counts_fit)
 *                      and, past 2048 slots, further blocks scatter the
 *                      slots, one a thread (else block 0 scatters them
 *                      too).
 *   align_kernel alone builds a grouped GEMM's tile list from m_sizes
 *                      (align_block).
 *
 * What these cost on the H200 and why they are built so: RESULTS.md,
 * runs 14, 24, 35 and 39.
 */
#include <cooperative_groups.h>
#include <math.h>

#include <type_traits>

#include "cuda_common.cuh"
#include "trace.cuh"

#define FULL 0xffffffffu
/* route_align_small's bounds: every slot's expert, rank and weight sit in
 * its CTA's shared memory (8 bytes each; sized for all slots in one CTA). */
#define SMALL_T 512
#define SMALL_SLOTS 4096

/* Ordered 64-bit key of (score, expert): larger is better. */
__device__ __forceinline__ unsigned long long route_key(float s, int e)
{
    unsigned int u;
    if (isnan(s)) {
        u = 0;
    } else {
        unsigned int b = __float_as_uint(s + 0.0f); /* -0 -> +0 */
        u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    }
    return ((unsigned long long)u << 32) | (unsigned int)~(unsigned int)e;
}

/* The score whose key has high word u (route_key; +0 for -0, and NaN for
 * the NaN scores, which all have u = 0). */
__device__ __forceinline__ float route_score(unsigned int u)
{
    if (u == 0)
        return __uint_as_float(0x7fffffffu);
    return __uint_as_float((u & 0x80000000u) ? u & 0x7fffffffu : ~u);
}

/* Route token t: lane j < k returns the j-th pick (layer's expert id, or
 * -1 for none) in *id and its weight in *w; the picks are stored in a.ids /
 * a.wts when computed or remapped. */
template <int VPL>
__device__ void route_pick(const moek_route_args &a, int t, int lane, int *id,
                           float *w)
{
    const int k = a.topk, E = a.experts;
    int my_id = -1;
    float my_w = 0.f;
    if (a.logits == nullptr) {
        if (lane < k) {
            my_id = a.ids_in[(size_t)t * k + lane];
            my_w = a.w_in[(size_t)t * k + lane];
            if (my_id < 0 || my_id >= E)
                my_id = -1;
        }
    } else {
        const float *row = a.logits + (size_t)t * E;
        float v[VPL];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < VPL; i++) {
            int e = lane + 32 * i;
            v[i] = e < E ? row[e] : -INFINITY;
            mx = fmaxf(mx, v[i]); /* fmaxf ignores NaN */
        }
        if (a.scoring == MOEK_SCORING_SOFTMAX) {
#pragma unroll
            for (int o = 16; o; o >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
            /* NaN logits stay out of the max and the sum and keep a NaN
             * score (ranked last), as in moek_ref_route. */
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < VPL; i++) {
                int e = lane + 32 * i;
                bool ok = e < E && !isnan(v[i]);
                float x = ok ? expf(v[i] - mx) : 0.f;
                sum += x;
                v[i] = isnan(v[i]) ? v[i] : x;
            }
#pragma unroll
            for (int o = 16; o; o >>= 1)
                sum += __shfl_xor_sync(FULL, sum, o);
#pragma unroll
            for (int i = 0; i < VPL; i++)
                v[i] = v[i] / sum;
        } else {
#pragma unroll
            for (int i = 0; i < VPL; i++)
                v[i] = 1.0f / (1.0f + expf(-v[i]));
        }
        unsigned long long key[VPL];
#pragma unroll
        for (int i = 0; i < VPL; i++) {
            int e = lane + 32 * i;
            key[i] = e < E ? route_key(v[i], e) : 0ull;
        }
        /* Pick j is the largest key below pick j-1: keys are distinct (the
         * expert is in the low word), so nothing is struck out, and the
         * keys stay in registers. A warp's largest 64-bit key is two 32-bit
         * reductions: of the high words, then of the low words of the
         * lanes that hold that high word. */
        unsigned long long last = ~0ull;
        for (int j = 0; j < k; j++) {
            unsigned long long best = 0;
#pragma unroll
            for (int i = 0; i < VPL; i++)
                best = key[i] < last && key[i] > best ? key[i] : best;
            const unsigned hi = (unsigned)(best >> 32);
            const unsigned top = __reduce_max_sync(FULL, hi);
            const unsigned lo =
                __reduce_max_sync(FULL, hi == top ? (unsigned)best : 0u);
            last = (unsigned long long)top << 32 | lo;
            if (lane == j) {
                my_id = (int)~lo;
                my_w = route_score(top);
            }
        }
        if (a.renorm) {
            float s = lane < k ? my_w : 0.f;
#pragma unroll
            for (int o = 16; o; o >>= 1)
                s += __shfl_xor_sync(FULL, s, o);
            if (s != 0.f)
                my_w = my_w / s;
        }
    }
    /* A shard holds some of the routed experts: the others contribute
     * nothing here (another device computes them). */
    if (a.remap && my_id >= 0)
        my_id = a.remap[my_id];
    if (lane < k && (a.logits != nullptr || a.remap != nullptr)) {
        a.ids[(size_t)t * k + lane] = my_id;
        a.wts[(size_t)t * k + lane] = my_w;
    }
    *id = my_id;
    *w = my_w;
}

/* Route token t and count its slots into their experts (the returned atomic
 * value is the slot's rank inside the expert). */
template <int VPL>
__device__ void route_one(const moek_route_args &a, int t, int lane,
                          int *counts)
{
    int id;
    float w;
    route_pick<VPL>(a, t, lane, &id, &w);
    if (lane < a.topk) {
        int r = id >= 0 ? atomicAdd(&counts[id * MOEK_COUNT_STRIDE], 1) : -1;
        a.rank[(size_t)t * a.topk + lane] = r;
    }
}

/* In-place exclusive scan of n <= 2 * blockDim.x values in shared memory by
 * the whole block; returns the total. blockDim.x is MOEK_ALIGN_THREADS. */
template <typename V>
__device__ V block_exclusive_scan(V *data, int n, V *warp_sums)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = blockDim.x >> 5;
    const int b = tid * 2, e = min(b + 2, n);
    V local = 0;
    for (int i = b; i < e; i++)
        local += data[i];
    V x = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        V y = __shfl_up_sync(FULL, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        V w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            V y = __shfl_up_sync(FULL, w, o);
            if (lane >= o)
                w += y;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    V excl = x - local + (warp ? warp_sums[warp - 1] : 0);
    V total = warp_sums[nwarps - 1];
    for (int i = b; i < e; i++) {
        V c = data[i];
        data[i] = excl;
        excl += c;
    }
    __syncthreads();
    return total;
}

/* K splits of a GEMM whose epilogue accumulates in fp32 (can_split) over
 * `pairs` token tiles: enough items for four per SM, each item keeping at
 * least min_kb K blocks. Measured on the H200 (RESULTS.md): a floor of 8 K
 * blocks keeps qwen3's T=1 down GEMM whole (37.7 against 40.0 us with 4);
 * a split chosen to balance the SMs' loads exactly (fewer, longer items) was
 * slower for mixtral (194.0 against 189.2 us). */
__device__ int pick_split(const moek_gemm_dims &dm, long long pairs, int sms,
                          int min_kb)
{
    if (!dm.can_split || pairs <= 0)
        return 1;
    const int cap = dm.kblocks / min_kb > 1 ? dm.kblocks / min_kb : 1;
    const long long tiles = pairs * dm.n_tiles;
    const long long want = (4LL * sms + tiles - 1) / tiles;
    const int split = (int)(want < cap ? want : cap);
    return split < 1 ? 1 : split;
}

/* Slot s's sorted position pos (-1: routed nowhere) and weight w. */
__device__ __forceinline__ void put_slot(const moek_align_args &a, int s,
                                         int pos, float w)
{
    if (a.slot_pos)
        a.slot_pos[s] = pos;
    if (pos < 0)
        return;
    a.pos_token[pos] = s / a.topk;
    a.pos_weight[pos] = w;
}

/* MoE: slots [s0, s1) to their sorted positions (token index and routing
 * weight per position, and with slot_pos each slot's position or -1), from
 * each slot's expert, rank inside it and weight (ids, rank, wts: int in
 * global or 16-bit in shared memory), start[g] the first position of group
 * g. Whole block. */
template <typename I>
__device__ void scatter_slots(const moek_align_args &a, const int *start,
                              const I *ids, const I *rank, const float *wts,
                              int s0, int s1)
{
    for (int s = s0 + threadIdx.x; s < s1; s += blockDim.x) {
        const int r = rank[s];
        put_slot(a, s, r < 0 ? -1 : start[ids[s]] + r, wts[s]);
    }
}

/* The tile list from per-group counts (counts, or m_sizes clamped to
 * total_m). Whole block, MOEK_ALIGN_THREADS threads, groups <= 2048. */
__device__ void align_block(const moek_align_args &a, const int *counts,
                            bool scatter)
{
    __shared__ int s_cnt[MOEK_MAX_GROUPS];
    __shared__ int s_start[MOEK_MAX_GROUPS];
    __shared__ long long s_scan[MOEK_MAX_GROUPS];
    __shared__ long long s_warp[32];
    const int tid = threadIdx.x, G = a.groups;

    for (int g = tid; g < G; g += blockDim.x) {
        long long c;
        if (counts) {
            c = counts[g * MOEK_COUNT_STRIDE];
        } else {
            c = a.m_sizes[g];
            c = c < 0 ? 0 : (c > a.total_m ? a.total_m : c);
        }
        s_scan[g] = c;
    }
    __syncthreads();
    /* Counts are re-read from s_scan before the scan overwrites them. */
    long long mine[2] = {0, 0};
    for (int j = 0; j < 2; j++)
        if (tid * 2 + j < G)
            mine[j] = s_scan[tid * 2 + j];
    long long total = block_exclusive_scan<long long>(s_scan, G, s_warp);
    long long limit = counts ? total : a.total_m;
    for (int j = 0; j < 2; j++) {
        int g = tid * 2 + j;
        if (g < G) {
            long long st = s_scan[g] < limit ? s_scan[g] : limit;
            long long en = s_scan[g] + mine[j];
            en = en < limit ? en : limit;
            s_start[g] = (int)st;
            s_cnt[g] = (int)(en - st);
        }
    }
    __syncthreads();
    /* Compact groups in order of tile class, then group: each non-empty
     * group counts 1 in its class's 16-bit field (groups <= 2048). */
    int np[2] = {0, 0}, cls[2] = {0, 0};
    for (int j = 0; j < 2; j++) {
        int g = tid * 2 + j;
        if (g < G && s_cnt[g] > 0) {
            np[j] = moek_token_tiles(s_cnt[g], a.bn);
            cls[j] = moek_tile_class(s_cnt[g], np[j], a.bn);
        }
        if (g < G)
            s_scan[g] = s_cnt[g] > 0 ? 1LL << (16 * cls[j]) : 0;
    }
    __syncthreads();
    const long long per_class =
        block_exclusive_scan<long long>(s_scan, G, s_warp);
    int cfirst[MOEK_CLASSES + 1]; /* first compact index of each class */
    cfirst[0] = 0;
    for (int c = 0; c < MOEK_CLASSES; c++)
        cfirst[c + 1] = cfirst[c] + (int)((per_class >> (16 * c)) & 0xffff);
    const int ncg = cfirst[MOEK_CLASSES];
    /* Write the compact groups. */
    int cidx[2] = {-1, -1};
    long long pairs_local = 0;
    for (int j = 0; j < 2; j++) {
        int g = tid * 2 + j;
        if (g < G && s_cnt[g] > 0) {
            const int c = cfirst[cls[j]] +
                          (int)((s_scan[g] >> (16 * cls[j])) & 0xffff);
            cidx[j] = c;
            pairs_local += np[j];
            a.cg_group[c] = g;
            a.cg_start[c] = s_start[g];
            a.cg_count[c] = s_cnt[g];
        }
    }
    __syncthreads();
    /* Total token tiles, for the split choice. */
    long long pairs = pairs_local;
#pragma unroll
    for (int o = 16; o; o >>= 1)
        pairs += __shfl_xor_sync(FULL, pairs, o);
    if ((tid & 31) == 0)
        s_warp[tid >> 5] = pairs;
    __syncthreads();
    if (tid < 32) {
        long long p = tid < (int)(blockDim.x >> 5) ? s_warp[tid] : 0;
#pragma unroll
        for (int o = 16; o; o >>= 1)
            p += __shfl_xor_sync(FULL, p, o);
        if (tid == 0)
            s_warp[0] = p;
    }
    __syncthreads();
    pairs = s_warp[0];
    __syncthreads();

    if (tid == 0)
        a.plan[MOEK_PLAN_NCG] = ncg;
    for (int d = 0; d < a.ngemm; d++) {
        const moek_gemm_dims dm = a.d[d];
        const int split = pick_split(dm, pairs, a.sms, a.split_min_kb);
        for (int j = 0; j < 2; j++)
            if (cidx[j] >= 0)
                s_scan[cidx[j]] = (long long)np[j] * dm.n_tiles * split;
        __syncthreads();
        long long items = block_exclusive_scan<long long>(s_scan, ncg, s_warp);
        int *before = a.cg_before + d * (G + 1);
        for (int c = tid; c < ncg; c += blockDim.x)
            before[c] = (int)s_scan[c];
        if (tid == 0) {
            before[ncg] = (int)items;
            a.plan[d ? MOEK_PLAN_SPLIT1 : MOEK_PLAN_SPLIT0] = split;
            int *ends = a.plan + (d ? MOEK_PLAN_ENDS1 : MOEK_PLAN_ENDS0);
            for (int c = 0; c < MOEK_CLASSES; c++)
                ends[c] = cfirst[c + 1] < ncg ? (int)s_scan[cfirst[c + 1]]
                                              : (int)items;
        }
        __syncthreads();
    }
    if (a.ids && scatter)
        scatter_slots(a, s_start, a.ids, a.rank, a.wts, 0, a.slots);
}

/* MoE, many slots: block `part`'s slots of the slot -> sorted position
 * scatter, one a thread, with the groups' starts scanned again from the
 * counts by this block (a few hundred groups cost less than one more
 * launch). A thread reads its slot together with the counts, so the two
 * round trips overlap. */
__device__ void scatter_part(const moek_align_args &a, const int *counts,
                             int part)
{
    __shared__ int s_st[MOEK_MAX_GROUPS];
    __shared__ int s_w[32];
    const int s = part * (int)blockDim.x + (int)threadIdx.x;
    int r = -1, id = 0;
    float w = 0.f;
    if (s < a.slots) {
        r = a.rank[s];
        id = a.ids[s];
        w = a.wts[s];
    }
    for (int g = threadIdx.x; g < a.groups; g += blockDim.x)
        s_st[g] = counts[g * MOEK_COUNT_STRIDE];
    __syncthreads();
    block_exclusive_scan<int>(s_st, a.groups, s_w);
    if (s < a.slots)
        put_slot(a, s, r < 0 ? -1 : s_st[id] + r, w);
}

/* Field c (16 bits) of packed per-class sums. */
__device__ __forceinline__ int class_field(unsigned long long v, int c)
{
    return (int)((v >> (16 * c)) & 0xffff);
}

/* Warp sum of packed 16-bit fields, as two 32-bit reductions (no field
 * overflows: align_warps' callers keep every class's sum below 2^16). */
__device__ __forceinline__ unsigned long long warp_sum_packed(
    unsigned long long v)
{
    const unsigned lo = __reduce_add_sync(FULL, (unsigned)v);
    const unsigned hi = __reduce_add_sync(FULL, (unsigned)(v >> 32));
    return (unsigned long long)hi << 32 | lo;
}

/* Inclusive warp scan. */
template <typename V> __device__ __forceinline__ V warp_scan(V x, int lane)
{
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const V y = __shfl_up_sync(FULL, x, o);
        if (lane >= o)
            x += y;
    }
    return x;
}

/* The plan's tail for GEMM d, written by one thread: its K split, its item
 * count (past the last compact group's items before) and, per tile class
 * c, where the class's items end: class_end[c] token tiles (those of
 * classes 0..c) times per_tile items each. */
__device__ __forceinline__ void plan_tail(const moek_align_args &a, int d,
                                          int ncg, int split, int per_tile,
                                          int pairs, const int *class_end)
{
    a.cg_before[d * (a.groups + 1) + ncg] = pairs * per_tile;
    a.plan[d ? MOEK_PLAN_SPLIT1 : MOEK_PLAN_SPLIT0] = split;
    int *ends = a.plan + (d ? MOEK_PLAN_ENDS1 : MOEK_PLAN_ENDS0);
#pragma unroll
    for (int c = 0; c < MOEK_CLASSES; c++)
        ends[c] = class_end[c] * per_tile;
}

/* One chunk of 32 groups (g = g0 + lane) as align_warps sees it: count,
 * inclusive scan of counts, and the packed (16 bits per class) group and
 * token-tile counts of this lane's group. */
struct align_chunk {
    int c, incl, cls;
    unsigned long long kg, kt;
};
__device__ __forceinline__ align_chunk chunk_of(const moek_align_args &a,
                                                const int *counts, int g0,
                                                int lane)
{
    align_chunk q;
    const int g = g0 + lane;
    q.c = g < a.groups ? counts[g] : 0;
    q.incl = warp_scan(q.c, lane);
    const int np = q.c > 0 ? moek_token_tiles(q.c, a.bn) : 0;
    q.cls = q.c > 0 ? moek_tile_class(q.c, np, a.bn) : 0;
    q.kg = q.c > 0 ? 1ull << (16 * q.cls) : 0;
    q.kt = (unsigned long long)np << (16 * q.cls);
    return q;
}

/* align_block's tile list for MoE counts, built by warps 0 .. W - 1 of the
 * block (W: one per chunk of 32 groups, at most the block's warps; the
 * others return at once) with warp scans over the chunks (warp w takes
 * chunks w, w + W, ...):
 * each chunk's sums go to shared memory (s_run, s_sum: at most
 * MOEK_MAX_EXPERTS / 32 chunks), one barrier of the W warps (named barrier
 * 1), then each group's compact index from the chunks before it. Each
 * warp's chain of scans is ceil(chunks / W) chunks long, where one warp
 * over all of qwen3's 128 groups was about 5 of a T=8 forward's 9 us of
 * routing. start[g] gets each group's first sorted position, for the
 * scatter. Groups are ordered
 * by (tile class, group) through sums packed 16 bits per class: the caller
 * has fewer than 2^16 token tiles in all (at most slots / bn + groups;
 * route_align_small: SMALL_SLOTS + MOEK_MAX_EXPERTS). */
__device__ void align_warps(const moek_align_args &a, const int *counts,
                            int *start, int *s_run, unsigned long long *s_sum)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, G = a.groups;
    const int nq = (G + 31) / 32, nw = (int)(blockDim.x >> 5);
    const int W = nq < nw ? nq : nw;
    if (w >= W)
        return;
    /* Pass 1: each chunk's rows, groups and token tiles. */
    for (int q = w; q < nq; q += W) {
        const align_chunk k = chunk_of(a, counts, 32 * q, lane);
        const unsigned long long ng = warp_sum_packed(k.kg);
        const unsigned long long nt = warp_sum_packed(k.kt);
        if (lane == 31) {
            s_run[q] = k.incl;
            s_sum[2 * q] = ng;
            s_sum[2 * q + 1] = nt;
        }
    }
    asm volatile("bar.sync 1, %0;" ::"r"(32 * W) : "memory");
    /* In all: per class the groups and token tiles (lane q < nq holds
     * chunk q's), so the first compact index and tile of each class. */
    const unsigned long long lg = lane < nq ? s_sum[2 * lane] : 0;
    const unsigned long long lt = lane < nq ? s_sum[2 * lane + 1] : 0;
    const int lr = lane < nq ? s_run[lane] : 0;
    const unsigned long long ng = warp_sum_packed(lg), nt = warp_sum_packed(lt);
    int cfirst[MOEK_CLASSES + 1], tfirst[MOEK_CLASSES + 1];
    cfirst[0] = tfirst[0] = 0;
#pragma unroll
    for (int c = 0; c < MOEK_CLASSES; c++) {
        cfirst[c + 1] = cfirst[c] + class_field(ng, c);
        tfirst[c + 1] = tfirst[c] + class_field(nt, c);
    }
    const int ncg = cfirst[MOEK_CLASSES], pairs = tfirst[MOEK_CLASSES];
    int split[2], per_tile[2];
#pragma unroll
    for (int d = 0; d < 2; d++) {
        split[d] = d < a.ngemm ? pick_split(a.d[d], pairs, a.sms,
                                            a.split_min_kb)
                               : 0;
        per_tile[d] = d < a.ngemm ? a.d[d].n_tiles * split[d] : 0;
    }
    /* Pass 2: each non-empty group's start, compact index and items
     * before it. */
    for (int q = w; q < nq; q += W) {
        const align_chunk k = chunk_of(a, counts, 32 * q, lane);
        const bool before = lane < q;
        const int run = __reduce_add_sync(FULL, before ? lr : 0);
        const unsigned long long pg = warp_sum_packed(before ? lg : 0);
        const unsigned long long pt = warp_sum_packed(before ? lt : 0);
        const int g = 32 * q + lane, first = run + k.incl - k.c;
        if (g < G)
            start[g] = first;
        const unsigned long long eg = pg + warp_scan(k.kg, lane) - k.kg;
        const unsigned long long et = pt + warp_scan(k.kt, lane) - k.kt;
        if (k.c > 0) {
            int cf = 0, tf = 0;
#pragma unroll
            for (int c = 0; c < MOEK_CLASSES; c++) {
                cf = c == k.cls ? cfirst[c] : cf;
                tf = c == k.cls ? tfirst[c] : tf;
            }
            const int ci = cf + class_field(eg, k.cls);
            const int tiles_before = tf + class_field(et, k.cls);
            a.cg_group[ci] = g;
            a.cg_start[ci] = first;
            a.cg_count[ci] = k.c;
#pragma unroll
            for (int d = 0; d < 2; d++)
                if (d < a.ngemm)
                    a.cg_before[d * (G + 1) + ci] = tiles_before * per_tile[d];
        }
    }
    if (w == 0) {
        if (lane == 0) {
            a.plan[MOEK_PLAN_NCG] = ncg;
#pragma unroll
            for (int d = 0; d < 2; d++)
                if (d < a.ngemm)
                    plan_tail(a, d, ncg, split[d], per_tile[d], pairs,
                              tfirst + 1);
        }
    }
}

/* Block 0 of the align kernel, MoE counts (strided, in global memory):
 * align_warps' tile list, then (scatter: the only block) the slots. The
 * general align_block, with its block-wide scans, took 6.6-11 us of the
 * align kernel at qwen3 T = 512-4096 (RESULTS.md, run 39). */
__device__ void align_counts(const moek_align_args &a, bool scatter)
{
    __shared__ int s_cnt[MOEK_MAX_EXPERTS];
    __shared__ int s_start[MOEK_MAX_EXPERTS];
    __shared__ int s_run[MOEK_MAX_EXPERTS / 32];
    __shared__ unsigned long long s_sum[2 * (MOEK_MAX_EXPERTS / 32)];
    const int G = a.groups;
    for (int g = threadIdx.x; g < G; g += blockDim.x)
        s_cnt[g] = a.counts[g * MOEK_COUNT_STRIDE];
    __syncthreads();
    align_warps(a, s_cnt, s_start, s_run, s_sum);
    if (scatter) {
        __syncthreads();
        scatter_slots(a, s_start, a.ids, a.rank, a.wts, 0, a.slots);
    }
}

/* align_counts' bounds: align_warps' chunk sums for MOEK_MAX_EXPERTS
 * groups, and its token tiles counted in 16 bits. */
__device__ __forceinline__ bool counts_fit(const moek_align_args &a)
{
    return a.counts && a.groups <= MOEK_MAX_EXPERTS &&
           (long long)a.slots / a.bn + a.groups < 65536;
}

/* A CTA of the call zeroes the counts of moek_dep and GEMM 2's ticket for
 * the GEMMs that follow (they run after this kernel). */
__device__ __forceinline__ void zero_dep(const moek_align_args &aa)
{
    if (aa.dep)
        for (int e = threadIdx.x; e < MOEK_DEP_GROUP + aa.groups;
             e += blockDim.x)
            aa.dep[e] = 0;
}

/* A barrier of the CTA, or (NC > 1) of every CTA of its cluster. */
template <int NC> __device__ __forceinline__ void cta_or_cluster_sync()
{
    if constexpr (NC > 1)
        cooperative_groups::this_cluster().sync();
    else
        __syncthreads();
}

/* T <= SMALL_T and T k <= SMALL_SLOTS: one block, or a cluster of NC (2,
 * 4, 8, or 16 where allowed: moek_launch_route) so that a warp routes one
 * token (two past 256 on 8). Each CTA routes
 * its tokens into its own shared memory: per expert its count, per slot
 * the expert, its rank among this CTA's slots of that expert, and the
 * weight. Past one barrier of the cluster, each CTA reads the others'
 * counts (coalesced: a few requests a warp) for the slots of the CTAs
 * before it, and CTA 0 the totals; CTA 0's first warps build the tile list
 * (align_warps) and each group's first position; past a second barrier,
 * each CTA adds its offsets to those positions and scatters its own slots.
 * Only counts and positions cross CTAs: with every slot's stores and
 * atomics sent into CTA 0's shared memory, T=512 took 22-27 us in this
 * kernel against 13-14 us for route_kernel + align_kernel (RESULTS.md,
 * run 24). One launch in place of a memset and two kernels: qwen3 T=65 to
 * 256 forwards 3-5 us faster. */
template <int VPL, int NC>
__global__ void __launch_bounds__(MOEK_ALIGN_THREADS)
    route_align_small(moek_route_args ra, moek_align_args aa)
{
    static_assert(MOEK_MAX_EXPERTS <= 32768 && SMALL_SLOTS <= 32768,
                  "experts and ranks fit 16 bits");
    __shared__ int s_counts[MOEK_MAX_EXPERTS];
    /* each group's first position: CTA 0's from align_warps, the others'
     * that plus their offset */
    __shared__ int s_start[MOEK_MAX_EXPERTS];
    /* NC > 1: CTA 0 the totals over the cluster, the others their offsets
     * (the slots of the CTAs before them) */
    __shared__ int s_aux[NC > 1 ? MOEK_MAX_EXPERTS : 1];
    __shared__ short s_id[SMALL_SLOTS];
    __shared__ short s_rank[SMALL_SLOTS];
    __shared__ float s_w[SMALL_SLOTS];
    __shared__ int s_run[MOEK_MAX_EXPERTS / 32];
    __shared__ unsigned long long s_sum[2 * (MOEK_MAX_EXPERTS / 32)];
    namespace cg = cooperative_groups;
    int rank = 0;
    if constexpr (NC > 1)
        rank = (int)cg::this_cluster().block_rank();
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_ROUTE, 0);
    if (rank == 0)
        zero_dep(aa);
    const int G = aa.groups;
    for (int e = threadIdx.x; e < G; e += blockDim.x)
        s_counts[e] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k = ra.topk, nw = blockDim.x >> 5;
    /* CTA r routes tokens r nw .. r nw + nw - 1, then NC nw further on */
    for (int t = rank * nw + warp; t < ra.tokens; t += NC * nw) {
        int id;
        float w;
        route_pick<VPL>(ra, t, lane, &id, &w);
        if (lane < k) {
            s_id[t * k + lane] = (short)id;
            s_rank[t * k + lane] =
                (short)(id >= 0 ? atomicAdd(&s_counts[id], 1) : -1);
            s_w[t * k + lane] = w;
        }
    }
    cta_or_cluster_sync<NC>(); /* every count is final */
    const int *counts = s_counts;
    if constexpr (NC > 1) {
        /* CTA 0 sums every CTA's counts, CTA r those of CTAs 0 .. r - 1 */
        cg::cluster_group cl = cg::this_cluster();
        const int upto = rank == 0 ? NC : rank;
        for (int e = threadIdx.x; e < G; e += blockDim.x) {
            /* unrolled over NC, so the remote reads go out together (a
             * loop to upto read them one after another: qwen3 T=256 2 us
             * slower) */
            int n = 0;
#pragma unroll
            for (int c = 0; c < NC; c++)
                if (c < upto)
                    n += cl.map_shared_rank(s_counts, c)[e];
            s_aux[e] = n;
        }
        __syncthreads();
        counts = s_aux;
    }
    if (rank == 0)
        align_warps(aa, counts, s_start, s_run, s_sum);
    cta_or_cluster_sync<NC>(); /* CTA 0's s_start is written */
    if constexpr (NC > 1) {
        if (rank != 0) {
            const int *st0 = cg::this_cluster().map_shared_rank(s_start, 0);
            for (int e = threadIdx.x; e < G; e += blockDim.x)
                s_start[e] = st0[e] + s_aux[e];
        }
        /* done with the other CTAs' shared memory: CTA 0 may leave once
         * every CTA has arrived (the wait below) */
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
        __syncthreads();
    }
    for (int t0 = rank * nw; t0 < ra.tokens; t0 += NC * nw) {
        const int t1 = t0 + nw < ra.tokens ? t0 + nw : ra.tokens;
        scatter_slots(aa, s_start, s_id, s_rank, s_w, t0 * k, t1 * k);
    }
    if constexpr (NC > 1)
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* T k <= 32 (decode): a warp per token routes into shared memory, then one
 * warp builds the whole tile list with a lane per slot, from ballots and
 * shuffles: no atomics and one block barrier, where the general path runs
 * a chain of block scans. A slot's position inside its expert is its order
 * among the slots of that expert. */
template <int VPL>
__global__ void __launch_bounds__(MOEK_ALIGN_THREADS)
    route_align_tiny(moek_route_args ra, moek_align_args aa)
{
    __shared__ int s_id[32];
    __shared__ float s_w[32];
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_ROUTE, 0);
    zero_dep(aa);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k = ra.topk, n = ra.tokens * k;
    if (warp < ra.tokens) {
        int id;
        float w;
        route_pick<VPL>(ra, warp, lane, &id, &w);
        if (lane < k) {
            s_id[warp * k + lane] = id;
            s_w[warp * k + lane] = w;
        }
    }
    __syncthreads();
    if (warp)
        return;
    const int e = lane < n ? s_id[lane] : -1;
    int cnt = 0, rank = 0, start = 0;
    for (int j = 0; j < n; j++) {
        const int o = s_id[j];
        if (e < 0 || o < 0)
            continue;
        cnt += o == e;
        rank += o == e && j < lane;
        start += o < e;
    }
    const bool first = e >= 0 && rank == 0; /* the expert's first slot */
    /* Compact groups in order of (tile class, expert), as align_block
     * orders them. A group here has at most 32 rows, so with several
     * widths (tiles of 128 rows and more) every group takes the narrowest,
     * the last class: the order is the experts'. A group's items are its
     * token tiles times a factor every group of the GEMM shares (weight
     * tiles x K splits), so the tile list needs only the token tiles before
     * each group and per class. key -1: no group. */
    const int key = first ? e : -1;
    const int np = first ? moek_token_tiles(cnt, aa.bn) : 0;
    const int ncg = __popc(__ballot_sync(FULL, first));
    int ci = 0, tiles_before = 0;
    for (int j = 0; j < n; j++) {
        const int kj = __shfl_sync(FULL, key, j);
        const int nj = __shfl_sync(FULL, np, j);
        const bool below = kj >= 0 && kj < key;
        ci += below;
        tiles_before += below ? nj : 0;
    }
    if (e >= 0) {
        aa.pos_token[start + rank] = lane / k;
        aa.pos_weight[start + rank] = s_w[lane];
    }
    if (aa.slot_pos && lane < n)
        aa.slot_pos[lane] = e >= 0 ? start + rank : -1;
    if (first) {
        aa.cg_group[ci] = e;
        aa.cg_start[ci] = start;
        aa.cg_count[ci] = cnt;
    }
    int pairs = np;
#pragma unroll
    for (int o = 16; o; o >>= 1)
        pairs += __shfl_xor_sync(FULL, pairs, o);
    /* Token tiles of the classes up to c: all in the last one. */
    int ends[MOEK_CLASSES];
    for (int c = 0; c < MOEK_CLASSES; c++)
        ends[c] = c < moek_classes(aa.bn) - 1 ? 0 : pairs;
    if (lane == 0)
        aa.plan[MOEK_PLAN_NCG] = ncg;
    for (int d = 0; d < aa.ngemm; d++) {
        const moek_gemm_dims dm = aa.d[d];
        const int split = pick_split(dm, pairs, aa.sms, aa.split_min_kb);
        const int per_tile = dm.n_tiles * split;
        int *out = aa.cg_before + d * (aa.groups + 1);
        if (first)
            out[ci] = tiles_before * per_tile;
        if (lane == 0)
            plan_tail(aa, d, ncg, split, per_tile, pairs, ends);
    }
}

template <int VPL>
__global__ void __launch_bounds__(256) route_kernel(moek_route_args ra)
{
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_ROUTE, 0);
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t < ra.tokens)
        route_one<VPL>(ra, t, lane, ra.counts);
}

__global__ void __launch_bounds__(MOEK_ALIGN_THREADS)
    align_kernel(moek_align_args aa)
{
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_ALIGN, 2);
    if (blockIdx.x == 0)
        zero_dep(aa);
    /* One block: the whole list. More: block 0 the tile list, the others
     * the slot scatter, a part each. */
    if (blockIdx.x == 0) {
        if (counts_fit(aa))
            align_counts(aa, gridDim.x == 1);
        else
            align_block(aa, aa.counts, gridDim.x == 1);
    } else {
        scatter_part(aa, aa.counts, blockIdx.x - 1);
    }
}

/* moek_launch_relist's kernel, one block: each compact group's place in
 * GEMM 2's order (tile class of aa.bn, then group) and its token tiles
 * before that place, by comparing its key with every other group's (ncg
 * <= MOEK_MAX_EXPERTS, so at most 512 compares a thread, from shared
 * memory); per class the token tiles in all, for the K split and the
 * class ends. */
__global__ void __launch_bounds__(MOEK_ALIGN_THREADS)
    relist_kernel(moek_align_args aa)
{
    __shared__ int s_key[MOEK_MAX_EXPERTS]; /* class << 16 | group */
    __shared__ int s_np[MOEK_MAX_EXPERTS];
    __shared__ int s_class[MOEK_CLASSES];
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_RELIST, 0);
    const int tid = threadIdx.x;
    const int ncg = aa.plan[MOEK_PLAN_NCG];
    if (tid < MOEK_CLASSES)
        s_class[tid] = 0;
    __syncthreads();
    for (int c = tid; c < ncg; c += blockDim.x) {
        const int cnt = aa.cg_count[c];
        const int np = moek_token_tiles(cnt, aa.bn);
        const int cls = moek_tile_class(cnt, np, aa.bn);
        s_key[c] = cls << 16 | aa.cg_group[c];
        s_np[c] = np;
        atomicAdd(&s_class[cls], np);
    }
    __syncthreads();
    int class_end[MOEK_CLASSES], pairs = 0;
#pragma unroll
    for (int c = 0; c < MOEK_CLASSES; c++) {
        pairs += s_class[c];
        class_end[c] = pairs;
    }
    const int split = pick_split(aa.d[1], pairs, aa.sms, aa.split_min_kb);
    const int per_tile = aa.d[1].n_tiles * split;
    int *before = aa.cg_before + (aa.groups + 1);
    for (int c = tid; c < ncg; c += blockDim.x) {
        const int key = s_key[c];
        int at = 0, tiles = 0;
        for (int j = 0; j < ncg; j++) {
            const bool below = s_key[j] < key;
            at += below;
            tiles += below ? s_np[j] : 0;
        }
        aa.cg2_group[at] = key & 0xffff;
        aa.cg2_start[at] = aa.cg_start[c];
        aa.cg2_count[at] = aa.cg_count[c];
        before[at] = tiles * per_tile;
    }
    if (tid == 0)
        plan_tail(aa, 1, ncg, split, per_tile, pairs, class_end);
}

cudaError_t moek_launch_relist(const moek_align_args &aa, cudaStream_t stream,
                               bool pdl)
{
    return moek_launch(relist_kernel, dim3(1), dim3(MOEK_ALIGN_THREADS), 0,
                       stream, pdl, aa);
}

/* The instance of a routing kernel for vpl router logits per lane:
 * pick(v), v the power of two vpl is as a std::integral_constant. */
template <typename F> static auto by_vpl(int vpl, F pick)
{
    using std::integral_constant;
    return vpl == 1   ? pick(integral_constant<int, 1>())
           : vpl == 2 ? pick(integral_constant<int, 2>())
           : vpl == 4 ? pick(integral_constant<int, 4>())
           : vpl == 8 ? pick(integral_constant<int, 8>())
                      : pick(integral_constant<int, 16>());
}

/* Router logits per lane: the smallest power of two that covers E (the
 * top-k loops are unrolled over them). */
static int logits_per_lane(int experts)
{
    static_assert(MOEK_MAX_EXPERTS == 16 * 32, "VPL covers MOEK_MAX_EXPERTS");
    return experts <= 32    ? 1
           : experts <= 64  ? 2
           : experts <= 128 ? 4
           : experts <= 256 ? 8
                            : 16;
}

/* route_align_small's instance for vpl logits per lane on nc CTAs. */
static void (*small_kernel(int vpl, int nc))(moek_route_args, moek_align_args)
{
    return by_vpl(vpl, [nc](auto v) {
        constexpr int V = decltype(v)::value;
        void (*k)(moek_route_args, moek_align_args) =
            nc == 16  ? route_align_small<V, 16>
            : nc == 8 ? route_align_small<V, 8>
            : nc == 4 ? route_align_small<V, 4>
            : nc == 2 ? route_align_small<V, 2>
                      : route_align_small<V, 1>;
        return k;
    });
}

int moek_route_cluster_cap(int experts, int cc, int cap)
{
    if (cc < 90) /* thread-block clusters begin with sm_90 */
        return 1;
    const int vpl = logits_per_lane(experts);
    int nc = 16;
    while (nc > cap)
        nc /= 2;
    for (; nc > 1; nc /= 2) {
        if (nc > 8 &&
            cudaFuncSetAttribute(
                (const void *)small_kernel(vpl, nc),
                cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
                cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(nc);
        cfg.blockDim = dim3(MOEK_ALIGN_THREADS);
        cudaLaunchAttribute at = moek_cluster_attr(nc);
        cfg.attrs = &at;
        cfg.numAttrs = 1;
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(
                &n, (const void *)small_kernel(vpl, nc), &cfg) != cudaSuccess) {
            cudaGetLastError();
            n = 0;
        }
        if (n >= 1)
            return nc;
    }
    return 1;
}

int moek_route_cluster_use(int cap, int cap_experts, int route_experts)
{
    /* Only the cap's kernel was allowed the non-portable 16; a shard's
     * route over all E experts may take another (logits per lane). */
    return cap > 8 && logits_per_lane(cap_experts) != logits_per_lane(route_experts)
               ? 8
               : cap;
}

cudaError_t moek_launch_route(const moek_route_args &ra,
                              const moek_align_args &aa, int *counts_dev,
                              cudaStream_t stream, bool pdl)
{
    const int vpl = logits_per_lane(ra.experts);
    if (aa.tiny && ra.tokens * ra.topk <= 32) {
        void (*k)(moek_route_args, moek_align_args) = by_vpl(
            vpl, [](auto v) { return route_align_tiny<decltype(v)::value>; });
        return moek_launch(k, dim3(1), dim3(32 * ra.tokens), 0, stream, pdl,
                           ra, aa);
    }
    /* A warp per token on CTAs of 32 warps at most. Past 256 tokens on 8
     * CTAs a warp routes two, which pays only where a token's routing is
     * short (top-k times logits per lane at most 16): mixtral T=512 went
     * 845 -> 837 us, while qwen3 (32) lost 1 us and deepseek (64) 11 us
     * (RESULTS.md, run 24). */
    constexpr int WARPS = MOEK_ALIGN_THREADS / 32;
    static_assert(SMALL_T <= 2 * 8 * WARPS, "8 CTAs route SMALL_T");
    const int T = ra.tokens;
    /* The fewest CTAs that give each token a warp, up to 8; up to 16 where
     * the layer's cap allows that non-portable size
     * (MOEK_CUDA_ROUTE_CLUSTER=16: a warp per token up to SMALL_T, in place
     * of two tokens a warp or the multi-block path; on the H200 qwen3
     * T=300 0.8% faster, T=512 and mixtral T=512 within noise, RESULTS.md,
     * run 35, so the default cap stays 8). */
    const int most = aa.route_cl >= 16 ? 16 : 8;
    int nc = 1;
    while (nc < most && T > nc * WARPS)
        nc *= 2;
    /* Past the layer's cluster cap (moek_route_cluster_cap: a device that
     * cannot run that many CTAs together, or MOEK_CUDA_ROUTE_CLUSTER), the
     * multi-block path. */
    if (T * ra.topk <= SMALL_SLOTS && nc <= aa.route_cl &&
        (T <= nc * WARPS || (T <= SMALL_T && ra.topk * vpl <= 16))) {
        const int per = (T + nc - 1) / nc;
        const int threads = 32 * (per < WARPS ? per : WARPS);
        return moek_launch_cl(small_kernel(vpl, nc), dim3(nc), dim3(threads),
                              0, stream, pdl, nc, ra, aa);
    }
    cudaError_t e = cudaMemsetAsync(
        counts_dev, 0, sizeof(int) * MOEK_COUNT_STRIDE * (size_t)aa.groups,
        stream);
    if (e != cudaSuccess)
        return e;
    moek_route_args r2 = ra;
    r2.counts = counts_dev;
    void (*rk)(moek_route_args) = by_vpl(
        vpl, [](auto v) { return route_kernel<decltype(v)::value>; });
    e = moek_launch(rk, dim3((ra.tokens + 7) / 8), dim3(256), 0,
                    stream, pdl, r2);
    if (e != cudaSuccess)
        return e;
    moek_align_args a2 = aa;
    a2.counts = counts_dev;
    /* The scatter of many slots spreads over blocks of a slot a thread
     * (one block walking 32768 slots took 75 us of a 1.1 ms forward). */
    const int parts = aa.slots > 2048 ? (aa.slots + MOEK_ALIGN_THREADS - 1) /
                                            MOEK_ALIGN_THREADS
                                      : 0;
    return moek_launch(align_kernel, dim3(1 + parts), dim3(MOEK_ALIGN_THREADS),
                       0, stream, pdl, a2);
}

cudaError_t moek_launch_align_groups(const moek_align_args &aa,
                                     cudaStream_t stream, bool pdl)
{
    return moek_launch(align_kernel, dim3(1), dim3(MOEK_ALIGN_THREADS), 0,
                       stream, pdl, aa);
}

MOEK_TRACE_UNIT(route)
