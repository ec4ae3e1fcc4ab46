/*
 * layer.cu: the drivers behind moek_cuda_fused_moe and moek_cuda_grouped_gemm
 * (the kernel sequence of one call), the workspace, and the token-tile
 * choice (the table itself and its autotuner are in tune.cu).
 *
 * A fused MoE forward of T tokens is, on one stream, with no host sync:
 *   1. routing + alignment (route.cu): one kernel up to 256 tokens (512
 *      where routing a token is short, or on 16 CTAs where allowed) and
 *      4096 slots, on a cluster of up to 8 CTAs (16 with
 *      MOEK_CUDA_ROUTE_CLUSTER=16; a one-warp plan when T k <= 32), else a
 *      memset of the expert counts, a routing kernel and an align kernel;
 *   2. GEMM 1 (x . w13^T, SiLU(gate)*up in the epilogue) -> inter [T*k, I];
 *      as it starts, its CTAs zero GEMM 2's accumulator acc (the routing
 *      kernel, one block at small T, did that more slowly);
 *   3. GEMM 2 (inter . w2^T, times the routing weight, fp32 atomic adds into
 *      acc [T, H]; with few tiles split over K, or stream-K where every
 *      routing of the call would split: moe_stream_k); where GEMM 1 fills
 *      every SM its weight loads start before GEMM 1 ends (early_a), and it
 *      may start each group as soon as GEMM 1 has written that group's
 *      rows, not when the whole of GEMM 1 is done (moek_dep, below), with
 *      tiled weights and at most 256 experts as one kernel with GEMM 1;
 *   4. finalize: out = acc rounded to the dtype.
 * Slot mode (prefill tiles, moe_slots) replaces the accumulator: GEMM 2
 * stores each slot's row, times its routing weight, in the dtype at the
 * slot's sorted position (never split), and the finalize sums each token's
 * k rows; nothing is zeroed and no atomics run.
 * Every kernel on a stream of the caller's is launched with programmatic
 * dependent launch (PDL) so its launch and prologue overlap the previous
 * kernel's tail (the legacy default stream gets plain launches);
 * MOEK_CUDA_NO_PDL=1 in the environment turns that off, MOEK_CUDA_NO_EARLY=1
 * only GEMM 2's early weight loads. A grouped GEMM is an align kernel and
 * one GEMM with the plain store epilogue.
 */
#include <errno.h>
#include <math.h>
#include <new>

#include "cuda_common.cuh"
#include "trace.cuh"

namespace {

/* Pick the token tile for `avg` expected rows per non-empty group. Up to
 * ~95 rows: the tile of 16, 32, 64 or 128 with the fewest
 * column-equivalents, counting 32 columns of fixed cost per tile and sizing
 * for avg + 1.5 sigma (counts are roughly Poisson). Around 100-190 rows:
 * tiles of up to 192 rows; more: up to 256 (each group's tiles as narrow as
 * its rows allow, cuda_common.cuh), but from 240 to 767 rows the 144-row
 * tile with two weight tiles a CTA where the layer allows it (`two`:
 * fit_tile), whose groups then split into whole tiles of about 128 rows.
 * On an H100 (kernels/bench/RESULTS.md, run 43) it was 4.5% faster at
 * qwen3 T=4096 and 3.3%, 2.0% and 1.5% at mixtral T=1024, 1536 and 2048
 * (256, 384 and 512 rows), but 2.4% slower at mixtral T=4096 (1024 rows)
 * and 8-11% at 192 rows, where its groups split into two tiles of 96. The
 * sweeps in RESULTS.md are the evidence; the tuner's sweeps at 64 rows per
 * group (mixtral T=256, qwen3 T=1024, deepseek T=2048) put 128 first, 30%
 * ahead of the 32 that a choice among 16, 32 and 64 made. From 80 to 128
 * rows the 144-row tile too where the card's DRAM is fast (`mid`: 4 TB/s
 * or more, L->mid144): on the H200 mixtral T=320, 384 and 512 (80, 96 and
 * 128 rows; T=512 at run 50's seed 1) 1.8%, 4.8-5.2% and 4.2% faster,
 * deepseek T=3072 and 4096 (96
 * and 128) 6.7% and 2.2-2.4%, but mixtral T=576 (144) 16% slower; on an
 * H100, DRAM-bound there, even at mixtral T=320-512 and 1.0-5.2% slower
 * at deepseek T=3072-4096 (RESULTS.md, runs 49-50). But a group over 144
 * rows splits in two, and where GEMM 2 has few runs (mixtral: 128 for 132
 * SMs) the extra ones add a round: on the H200 at mixtral T=512's default
 * inputs 144 was 2.7% slower than 192, where deepseek T=4096 gained 1.5%
 * and qwen3 T=1536 and 2048 6.4% and 2.8% (run 52). So the caller passes
 * `mid` only where no group is likely to split (avg + 3 sigma <= 144) or
 * GEMM 2 has four rounds of runs or more (moe_tile). A card's tile table
 * (tune.cu) overrides this. */
int pick_tile(double avg, bool two, bool mid)
{
    if (two && avg >= 240 && avg < 768)
        return 144;
    if (two && mid && avg >= 80 && avg <= 128)
        return 144;
    if (avg >= 192)
        return 256;
    if (avg >= 96)
        return 192;
    static const int tiles[] = {16, 32, 64, 128};
    const double want = avg + 1.5 * sqrt(avg > 0 ? avg : 0);
    int best = 16;
    double best_cost = 1e300;
    for (int bn : tiles) {
        const double cost = ceil(want / bn) * (bn + 32);
        if (cost < best_cost) {
            best_cost = cost;
            best = bn;
        }
    }
    return best;
}

/* The experts a call of T tokens is expected to hit: each of E is missed by
 * all T tokens' top-k with probability (1 - k / E)^T. */
double moe_hit(const moek_moe_shape &s, int T)
{
    const double E = s.experts, k = s.topk;
    return E * (1.0 - pow(1.0 - k / E, (double)T));
}

/* Whether the layer's calls run the wgmma kernel (sm_90, not tuned to the
 * portable SIMT path), which the prefill modes and stream-K need. */
bool moe_wgmma(const moek_cuda_moe_layer *L)
{
    return L->cc == 90 && !L->tune.generic;
}

/* GEMM 1's weight tiles per expert (gate and up rows together). */
int moe_tiles1(const moek_cuda_moe_layer *L)
{
    return (2 * L->shape.intermediate + MOEK_WTILE - 1) / MOEK_WTILE;
}

/* GEMM 2's weight tiles and K blocks per expert. */
int moe_tiles2(const moek_cuda_moe_layer *L)
{
    return (L->h16 + MOEK_WTILE - 1) / MOEK_WTILE;
}
int moe_kblocks2(const moek_cuda_moe_layer *L)
{
    return (L->shape.intermediate + MOEK_KTILE - 1) / MOEK_KTILE;
}

/* The most token tiles a call of T tokens with tile bn can have: one
 * partial tile per hit expert plus the whole ones (ceil(rows / bn) per
 * group). */
long long moe_pairs_max(const moek_moe_shape &s, int bn, int T)
{
    const long long slots = (long long)T * s.topk;
    return (slots < s.experts ? slots : s.experts) + slots / bn;
}

/* GEMM 1's items at most: moe_pairs_max token tiles times its weight
 * tiles. Its grid: a CTA for each (each run of moek_wtiles items), or
 * every SM. */
long long moe_items1(const moek_cuda_moe_layer *L, int bn, int T)
{
    return moe_pairs_max(L->shape, bn, T) * moe_tiles1(L);
}
int moe_grid1(const moek_cuda_moe_layer *L, int bn, int T)
{
    const long long runs = moe_items1(L, bn, T) / moek_wtiles(bn);
    return (int)(runs < L->sms ? runs : L->sms);
}

/* Tile bn for GEMMs of t1 and t2 weight tiles a group (t2 = t1 for one
 * GEMM; cluster: CTA pairs may run them): the 144-row tile multiplies two
 * weight tiles at once (moek_wtiles), its items in runs of one token tile,
 * which needs counts of weight tiles that are multiples of moek_run_items;
 * where they are not, the 128-row tile. */
int fit_tile(int bn, int t1, int t2, bool cluster)
{
    const int run = moek_run_items(bn, cluster);
    return moek_wtiles(bn) > 1 && (t1 % run != 0 || t2 % run != 0) ? 128
                                                                     : bn;
}

/* The tiles of a forward of T tokens: GEMM 1's, returned, and GEMM 2's in
 * *bn2 (may be NULL). One tile on the SIMT path; else the forced tiles,
 * the table's rule for T, or the heuristic, each run as fit_tile has it.
 * The heuristic gives both GEMMs one tile, except on a layer with
 * split_tiles: there GEMM 1 takes the 144-row tile at 80-128 rows a group
 * whether or not a group is likely to split, since a split group costs
 * GEMM 1 (many short items) little, where GEMM 2's long ones may add a
 * round (pick_tile); GEMM 2 keeps the tile pick_tile gives it. Two tiles
 * differ only where both are prefill tiles (128 rows or wider); a tile
 * that differs from the other GEMM's fits its own GEMM alone. */
int moe_tiles(const moek_cuda_moe_layer *L, int T, int *bn2)
{
    int b1 = 16, b2 = 16;
    if (moe_wgmma(L)) {
        const int t1 = moe_tiles1(L), t2 = moe_tiles2(L);
        b1 = b2 = 0;
        if (L->tune.token_tile) {
            b1 = L->tune.token_tile;
            b2 = L->tune.token_tile2 ? L->tune.token_tile2 : b1;
        }
        for (int i = L->n_rules - 1; i >= 0 && !b1; i--)
            if (L->rules[i].min_tokens <= T)
                b1 = b2 = L->rules[i].token_tile;
        if (!b1) {
            const double hit = fmax(moe_hit(L->shape, T), 1.0);
            const double avg = (double)T * L->shape.topk / hit;
            /* pick_tile's 80-128 rows: no split likely, or splits spread
             * over many rounds of GEMM 2's runs (two weight tiles each) */
            const bool mid = L->mid144 && (avg + 3 * sqrt(avg) <= 144 ||
                                           hit * t2 / 2 >= 4.0 * L->sms);
            b1 = b2 = pick_tile(avg, fit_tile(144, t1, t2, true) == 144, mid);
            if (L->split_tiles) {
                b1 = pick_tile(avg, fit_tile(144, t1, t1, true) == 144, true);
                if (b1 < 128 || b2 < 128)
                    b1 = b2;
            }
        }
        if (b1 == b2) {
            b1 = b2 = fit_tile(b1, t1, t2, true);
        } else {
            b1 = fit_tile(b1, t1, t1, true);
            b2 = fit_tile(b2, t2, t2, true);
        }
    }
    if (bn2)
        *bn2 = b2;
    return b1;
}
int moe_tile(const moek_cuda_moe_layer *L, int T)
{
    return moe_tiles(L, T, nullptr);
}

/* The workspace carved for one call. */
struct moe_ws {
    int *counts, *ids, *rank, *plan, *cg_group, *cg_start, *cg_count,
        *cg_before, *pos_token;
    int *cg2_group, *cg2_start, *cg2_count; /* GEMM 2's, moe_tiles' two */
    int *slot_pos;
    int *dep; /* moek_dep's counts (MOEK_DEP_*) */
    float *wts, *pos_weight, *acc;
    void *inter;
    /* [T k, H] in the dtype, or NULL: cluster mode's copy of x in slot
     * order (GEMM 1's input), then slot mode's rows (GEMM 2's output,
     * written once GEMM 1 is done with the copy: its consumers wait for it
     * before their first store) */
    void *rows;
};

struct carver {
    char *base;
    size_t off;
    template <typename P> P *take(size_t bytes)
    {
        off = (off + 255) & ~(size_t)255;
        P *p = reinterpret_cast<P *>(base + off);
        off += bytes;
        return p;
    }
};

size_t carve_moe(const moek_moe_shape &s, moek_dtype dt, int T, bool rows,
                 char *base, moe_ws *w)
{
    carver c = {base, 0};
    const size_t slots = (size_t)T * s.topk;
    moe_ws x;
    x.counts = c.take<int>(sizeof(int) * MOEK_COUNT_STRIDE * s.experts);
    x.ids = c.take<int>(sizeof(int) * slots);
    x.wts = c.take<float>(sizeof(float) * slots);
    x.rank = c.take<int>(sizeof(int) * slots);
    x.plan = c.take<int>(sizeof(int) * MOEK_PLAN_INTS);
    x.cg_group = c.take<int>(sizeof(int) * s.experts);
    x.cg_start = c.take<int>(sizeof(int) * s.experts);
    x.cg_count = c.take<int>(sizeof(int) * s.experts);
    x.cg_before = c.take<int>(sizeof(int) * 2 * (s.experts + 1));
    x.cg2_group = c.take<int>(sizeof(int) * s.experts);
    x.cg2_start = c.take<int>(sizeof(int) * s.experts);
    x.cg2_count = c.take<int>(sizeof(int) * s.experts);
    x.dep = c.take<int>(sizeof(int) * (MOEK_DEP_GROUP + s.experts));
    x.pos_token = c.take<int>(sizeof(int) * slots);
    x.pos_weight = c.take<float>(sizeof(float) * slots);
    x.slot_pos = c.take<int>(sizeof(int) * slots);
    x.acc = c.take<float>(sizeof(float) * (size_t)T * s.hidden);
    x.inter = c.take<char>((size_t)2 * slots * s.intermediate);
    x.rows = rows ? c.take<char>((size_t)2 * slots * s.hidden) : nullptr;
    if (w)
        *w = x;
    return c.off + 256;
}

struct gemm_ws {
    int *plan, *cg_group, *cg_start, *cg_count, *cg_before;
};

size_t carve_gemm(int groups, char *base, gemm_ws *w)
{
    carver c = {base, 0};
    gemm_ws x;
    x.plan = c.take<int>(sizeof(int) * MOEK_PLAN_INTS);
    x.cg_group = c.take<int>(sizeof(int) * groups);
    x.cg_start = c.take<int>(sizeof(int) * groups);
    x.cg_count = c.take<int>(sizeof(int) * groups);
    x.cg_before = c.take<int>(sizeof(int) * (groups + 1));
    if (w)
        *w = x;
    return c.off + 256;
}

/* Weight tiles per raster chunk: about 24 MB of weights, so a chunk's tiles
 * stay in L2 while every token tile of the group passes over them. */
int raster_chunk(int K, int n_tiles)
{
    long long bytes = (long long)MOEK_WTILE * K * 2;
    int c = (int)((24LL << 20) / (bytes > 0 ? bytes : 1));
    c = c < 1 ? 1 : c;
    return c < n_tiles ? c : n_tiles;
}

/* out = acc rounded to T. Each thread has four loads in flight before it
 * stores (one at a time, mixtral T=4096's 96 MB moved at 3.1 TB/s). acc
 * is not __restrict__: GEMM 2 writes it while this kernel, launched early
 * (PDL), waits, so its loads must not be non-coherent ones. */
template <typename T>
__global__ void finalize_kernel(const float4 *acc, uint2 *out, size_t n4)
{
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_FINAL, 0);
    const auto store = [out](size_t j, float4 v) {
        out[j] = make_uint2(moek_dt<T>::pack2(v.x, v.y),
                            moek_dt<T>::pack2(v.z, v.w));
    };
    const size_t step = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * step < n4; i += 4 * step) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            v[u] = acc[i + u * step];
#pragma unroll
        for (int u = 0; u < 4; u++)
            store(i + u * step, v[u]);
    }
    for (; i < n4; i += step)
        store(i, acc[i]);
}

/* Slot mode's finalize: row t of out = the sum of token t's k slot rows
 * (each already times its routing weight; slot_pos -1: routed nowhere,
 * adds nothing) in fp32, rounded to T. A block per token, a thread per 8
 * features, up to eight 16-byte loads in flight. rows is not __restrict__,
 * as acc in finalize_kernel. */
template <typename T>
__global__ void finalize_slots_kernel(const uint4 *rows, const int *slot_pos,
                                      uint4 *out, int tokens, int k, int h8)
{
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_FINAL, 0);
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        const int *sp = slot_pos + (size_t)t * k;
        for (int c = threadIdx.x; c < h8; c += blockDim.x) {
            float sum[8] = {};
            for (int j0 = 0; j0 < k; j0 += 8) {
                uint4 v[8];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int p = j0 + u < k ? sp[j0 + u] : -1;
                    v[u] = p >= 0 ? rows[(size_t)p * h8 + c]
                                  : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const float2 f = moek_dt<T>::unpack2(w[q]);
                        sum[2 * q] += f.x;
                        sum[2 * q + 1] += f.y;
                    }
                }
            }
            out[(size_t)t * h8 + c] = make_uint4(
                moek_dt<T>::pack2(sum[0], sum[1]),
                moek_dt<T>::pack2(sum[2], sum[3]),
                moek_dt<T>::pack2(sum[4], sum[5]),
                moek_dt<T>::pack2(sum[6], sum[7]));
        }
    }
}

/* Cluster mode's token operand of GEMM 1: row pos of xs is row t of x for
 * each slot (t, j) whose sorted position slot_pos[t k + j] is pos (-1:
 * routed nowhere, no row). One warp per PERMUTE_SEG 16-byte chunks of a
 * token's row (row16 chunks), four loads in flight per lane: each row of
 * x is read once and written k times, and a small batch still has warps
 * for every SM. (A warp per row of xs, by position, read x in expert
 * order, so once x outgrew L2 each row came from DRAM k times: deepseek
 * T=4096, 58.7 MB of x, took 207-212 us; this way 145 us, RESULTS.md run
 * 32.) */
constexpr int PERMUTE_SEG = 4 * 32;
__host__ __device__ constexpr int permute_segs(int row16)
{
    return (row16 + PERMUTE_SEG - 1) / PERMUTE_SEG;
}
__global__ void permute_rows_kernel(const uint4 *__restrict__ x,
                                    uint4 *__restrict__ xs,
                                    const int *slot_pos, int tokens, int k,
                                    int row16)
{
    moek_pdl_wait();
    moek_pdl_trigger();
    MOEK_TRACE_SCOPE(MOEK_TR_PERMUTE, 0);
    const int lane = threadIdx.x & 31;
    const int nw = (int)(gridDim.x * blockDim.x) >> 5;
    const int segs = permute_segs(row16);
    const long long units = (long long)tokens * segs;
    for (long long u = (long long)(blockIdx.x * blockDim.x + threadIdx.x) >> 5;
         u < units; u += nw) {
        const int t = (int)(u / segs);
        const int c0 = (int)(u % segs) * PERMUTE_SEG + lane;
        /* lane j holds slot j's position; the loop below is the same for
         * every lane, so each shuffle has the whole warp */
        const int mine = lane < k ? __ldg(slot_pos + (size_t)t * k + lane) : -1;
        const uint4 *src = x + (size_t)t * row16;
        uint4 v[4];
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (c0 + 32 * q < row16)
                v[q] = __ldg(src + c0 + 32 * q);
        for (int j = 0; j < k; j++) {
            const int p = __shfl_sync(0xffffffffu, mine, j);
            if (p < 0)
                continue;
            uint4 *dst = xs + (size_t)p * row16;
#pragma unroll
            for (int q = 0; q < 4; q++)
                if (c0 + 32 * q < row16)
                    dst[c0 + 32 * q] = v[q];
        }
    }
}

/* n rounded down to an even count, at least 2. */
int even2(int n)
{
    return n < 2 ? 2 : n & ~1;
}

/* tm_b set: cluster mode, which pairs CTAs 2c, 2c + 1 on weight tiles nt,
 * nt + 1 of one raster chunk, so the grid and the chunk are even (the
 * chunk a multiple of four where a CTA takes two weight tiles:
 * moek_wtiles, fit_tile). tm_o: the output's map of a staged epilogue
 * (moek_launch_gemm_wgmma). */
cudaError_t run_gemm(moek_dtype dt, bool wgmma, const CUtensorMap *tm,
                     moek_gemm_args a, int grid, cudaStream_t st, bool pdl,
                     const moek_tmaps *tm_b = nullptr,
                     const CUtensorMap *tm_o = nullptr)
{
    if (grid < 1)
        grid = 1;
    if (tm_b)
        grid = even2(grid);
    const int run = moek_run_items(a.bn, tm_b != nullptr);
    if (a.chunk % run != 0)
        a.chunk = a.chunk < run ? run : a.chunk / run * run;
    return wgmma ? moek_launch_gemm_wgmma(dt, tm, tm_b, tm_o, a, grid, st, pdl)
                 : moek_launch_gemm_simt(dt, a, grid, st, pdl);
}

/*
 * Cluster mode (prefill tiles): CTA pairs share each token tile through TMA
 * multicast, which halves the token rows read from L2 per weight tile, and
 * GEMM 1 reads them from a copy of x in slot order (TMA cannot gather).
 * The layer qualifies at load (moek_cuda_moe_layer.pairs: tiled weights,
 * even weight-tile counts; both GEMMs where I is large enough to pay for
 * the copy, else GEMM 2 alone, whose token rows are GEMM 1's output in
 * slot order); a call takes it with a 128-row tile or wider. moe_pairs:
 * the layer's mode on this device and tuning.
 */
int moe_pairs(const moek_cuda_moe_layer *L)
{
    return moe_wgmma(L) ? L->pairs : MOEK_CLUSTER_NONE;
}
/* The mode of a call of T tokens with GEMM 1 on tile bn and GEMM 2 on
 * bn2 (moek_cluster_mode): both tiles cluster mode's, and at least the
 * wider tile's worth of slots (a TMA box, half a tile's rows, must fit in
 * the token rows' tensor; and a pair needs at least two tiles' worth of
 * work to pay for the copy of x). */
int moe_cluster(const moek_cuda_moe_layer *L, int bn, int bn2, int T)
{
    const int wide = bn > bn2 ? bn : bn2;
    return moek_wgmma_cluster_ok(bn) && moek_wgmma_cluster_ok(bn2) &&
                   (long long)T * L->shape.topk >= wide
               ? moe_pairs(L)
               : MOEK_CLUSTER_NONE;
}

/*
 * Slot mode (see the top) on this device and tuning: tiles of 128 rows and
 * wider, and an fp32 accumulator of T H floats of at least slot_min_acc
 * bytes (a quarter of L2; MOEK_CUDA_SLOT_MIN_KB moves it). The atomics
 * cost by their bytes once the accumulator does not stay in L2: with
 * top-k 8 they were a fifth of GEMM 2 at T=4096 (RESULTS.md, run 18).
 * Slot mode stores half those bytes, zeroes nothing, and its finalize
 * reads k rows of 2 bytes a feature instead of one of 4: on the H200
 * qwen3 T=4096 3% faster, deepseek and mixtral 1%; at qwen3 T=1024 (an
 * 8 MB accumulator) 1% slower (RESULTS.md, run 19). Decode tiles keep the
 * accumulator: their GEMM 2 may split over K or run stream-K.
 */
constexpr int SLOT_MIN_TILE = MOEK_STAGED_MIN_TILE; /* its epilogue's */
bool moe_slots(const moek_cuda_moe_layer *L, int bn, int T)
{
    return moe_wgmma(L) && L->slots && bn >= SLOT_MIN_TILE &&
           (size_t)T * L->shape.hidden * 4 >= L->slot_min_acc;
}

/*
 * Stream-K for GEMM 2 (gemm_wgmma.cu, cta_span: each CTA an even share of
 * the K blocks) where its plan would split K: a decode tile (one class, so
 * never slot or cluster mode) with fewer items than four per SM even at
 * the most token tiles the call can have (pick_split's bound), and K
 * blocks for a split of two or more. There the split's items came in
 * rounds the SMs did not fill evenly: mixtral T=1 174 against 177.5 us on
 * the H200. Where the plan keeps whole items it was as fast or slower
 * (qwen3 T=8 130.0 against 128.9; RESULTS.md, run 20).
 */
bool moe_stream_k(const moek_cuda_moe_layer *L, int bn, int T)
{
    return moe_wgmma(L) && L->stream_k && moek_classes(bn) == 1 &&
           moe_pairs_max(L->shape, bn, T) * moe_tiles2(L) < 4LL * L->sms &&
           moe_kblocks2(L) / L->split_min_kb >= 2;
}

/*
 * GEMM 2 starting per group (moek_dep), for a call with PDL. With PDL,
 * GEMM 2's CTAs take each SM that GEMM 1 leaves, but a CTA's first stages
 * were all it could load before GEMM 1 ended (griddepcontrol.wait waits for the
 * whole grid), so in GEMM 1's last round, part of the card idled.
 * Here GEMM 1 counts each group's items as their rows are stored and
 * its CTAs as their slices of acc are zero (the routing kernel zeroed
 * the counts), and GEMM 2 waits for those counts instead: for its
 * item's group before it reads the group's rows, for every slice
 * before its first add. GEMM 2's CTAs then take their items (or, in
 * stream-K, parts of a CTA's share) from a counter, so those that
 * start early do more of them (gemm_wgmma.cu, unit_span). No
 * deadlock: GEMM 2 launches only once every GEMM 1 CTA has started
 * (each triggers right after its wait for the routing kernel), and
 * GEMM 1 waits for nothing of GEMM 2. That order is also what lets
 * GEMM 2 read the plan and take tickets from the counter the routing
 * kernel zeroed, before any wait of its own (as early_a's loads do).
 * Tiles of one class only (below 128 rows, so never in cluster or slot
 * mode, whose GEMM 2 rows come through TMA or overwrite what GEMM 1
 * reads), nor without early weight loads (MOEK_CUDA_NO_DEP=1 turns it
 * off). Measured on the H200 against the same build with it off
 * (kernels/bench/RESULTS.md, run 26): GEMM 2 in whole items gains
 * (deepseek T=3 to 512 0.9-2.4%, qwen3 T=8 to 64 0.7-1.9%). Run 26 found
 * it even or slower where GEMM 2's items are short and experts get more
 * than 4 rows (qwen3 T=100 even, T=512 0.4% lost), and the mode stayed off
 * there until run 51 measured it again on an H100: qwen3 T=80, 100, 128,
 * 256, 384, 512 and 640 2.1-3.6% faster with it, GEMM 2's first items no
 * longer waiting for GEMM 1's last CTA (at T=512 they had started 3 us
 * after it, 85 us after the first one left). On the H200 the same build
 * was 0.4% (T=128) and 2.3% (T=512) slower with it (1.0% at T=512 with
 * GEMM 1's counting warp), so the bound stays on cards whose DRAM reads 4
 * TB/s or more (L->fast_dram). In stream-K it
 * loses (mixtral T=8 and 64 1.2% and 1.3%, deepseek T=1 2%) but for one
 * token whose GEMM 1 item count is known and whose last round of GEMM 1
 * leaves a third of the SMs idle (mixtral T=1's 448 items on 132 SMs leave
 * 80: 1.0% gained; deepseek T=1's 256 leave 8).
 */
constexpr int DEP_MIN_KB = 32, DEP_SHORT_SLOTS = 4;
bool moe_dep(const moek_cuda_moe_layer *L, int bn, int bn2, int T)
{
    /* GEMM 2 waits for a count of GEMM 1's token tiles, which it reckons
     * with its own tile: one tile for both */
    const long long items1 = moe_items1(L, bn, T);
    if (!moe_wgmma(L) || !L->dep || !L->early || items1 < L->sms ||
        moek_classes(bn) != 1 || bn2 != bn)
        return false;
    const long long slots = (long long)T * L->shape.topk;
    if (L->fast_dram && moe_kblocks2(L) < DEP_MIN_KB &&
        slots > DEP_SHORT_SLOTS * (long long)L->shape.experts)
        return false;
    /* GEMM 1 runs on every SM: its last round's items */
    const long long last1 = items1 % L->sms;
    return !moe_stream_k(L, bn, T) ||
           (T == 1 && last1 != 0 && 3 * last1 <= 2LL * L->sms);
}

} // namespace

int moek_cuda_workspace_new(int device, size_t bytes, moek_cuda_workspace **out)
{
    if (!out)
        return -EINVAL;
    *out = nullptr;
    int r = moek_cuda_set_device(device);
    if (r)
        return r;
    moek_cuda_workspace *w = new (std::nothrow) moek_cuda_workspace();
    if (!w)
        return -ENOMEM;
    w->device = device;
    w->bytes = bytes;
    cudaError_t e = cudaMalloc(&w->base, bytes ? bytes : 256);
    if (e != cudaSuccess) {
        delete w;
        return moek_cuda_fail(e, "cudaMalloc(workspace)");
    }
#ifdef MOEK_WATCHDOG
    /* Debug builds (the unit test's) poison a new workspace, so a kernel
     * that uses what no kernel of the call wrote reads huge indices and
     * fails instead of passing on zeros. */
    e = cudaMemset(w->base, 0x7f, bytes ? bytes : 256);
    if (e == cudaSuccess)
        e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        cudaFree(w->base);
        delete w;
        return moek_cuda_fail(e, "cudaMemset(workspace)");
    }
#endif
    *out = w;
    return 0;
}

void moek_cuda_workspace_free(moek_cuda_workspace *ws)
{
    if (!ws)
        return;
    cudaFree(ws->base);
    delete ws;
}

size_t moek_cuda_workspace_bytes(const moek_cuda_workspace *ws)
{
    return ws ? ws->bytes : 0;
}

size_t moek_cuda_moe_workspace_size(const moek_cuda_moe_layer *layer,
                                    int max_tokens)
{
    if (!layer || max_tokens < 0)
        return 0;
    /* Room for cluster mode's copy of x and slot mode's rows whenever a
     * call of up to max_tokens may take either with some tile, so a call of
     * fewer tokens with a wide tile (a tile table's or a forced one) runs
     * as it would in any other workspace. */
    return carve_moe(layer->shape, layer->dt, max_tokens,
                     moe_pairs(layer) == MOEK_CLUSTER_BOTH ||
                         moe_slots(layer, SLOT_MIN_TILE, max_tokens),
                     nullptr, nullptr);
}

size_t moek_cuda_gemm_workspace_size(const moek_cuda_gemm_weights *w,
                                     int64_t max_m)
{
    (void)max_m; /* the grouped GEMM keeps only per-group lists */
    return w ? carve_gemm(w->groups, nullptr, nullptr) : 0;
}

int moek_cuda_moe_layer_tune(moek_cuda_moe_layer *layer,
                             const moek_cuda_tuning *t)
{
    if (!layer || !t)
        return -EINVAL;
    if (t->token_tile && !moek_wgmma_tile_ok(t->token_tile))
        return moek_cuda_refuse(-EINVAL, "token tile %d is not offered",
                                t->token_tile);
    if (t->token_tile2 && !moek_wgmma_tile_ok(t->token_tile2))
        return moek_cuda_refuse(-EINVAL, "GEMM 2's token tile %d is not offered",
                                t->token_tile2);
    if (t->token_tile2 && !t->token_tile)
        return moek_cuda_refuse(-EINVAL,
                                "GEMM 2's token tile needs GEMM 1's forced");
    if (t->token_tile2 && t->token_tile2 != t->token_tile &&
        (t->token_tile < 128 || t->token_tile2 < 128))
        return moek_cuda_refuse(-EINVAL,
                                "GEMM 2's token tile %d differs from GEMM 1's "
                                "(%d): both must be 128 rows or wider",
                                t->token_tile2, t->token_tile);
    layer->tune = *t;
    return 0;
}

int moek_cuda_gemm_weights_tune(moek_cuda_gemm_weights *w,
                                const moek_cuda_tuning *t)
{
    if (!w || !t)
        return -EINVAL;
    if (t->token_tile && !moek_wgmma_tile_ok(t->token_tile))
        return moek_cuda_refuse(-EINVAL, "token tile %d is not offered",
                                t->token_tile);
    if (t->token_tile2)
        return moek_cuda_refuse(-EINVAL, "a grouped GEMM has one token tile");
    w->tune = *t;
    return 0;
}

int moek_cuda_moe_layer_token_tile(const moek_cuda_moe_layer *layer, int tokens)
{
    return layer ? moe_tile(layer, tokens) : -EINVAL;
}

int moek_cuda_moe_layer_token_tile2(const moek_cuda_moe_layer *layer,
                                    int tokens)
{
    int bn2 = -EINVAL;
    if (layer)
        moe_tiles(layer, tokens, &bn2);
    return bn2;
}

namespace {
/* The uses_* reports: a call's two tiles (moe_tiles), or false where there
 * is no layer or no token. */
bool call_tiles(const moek_cuda_moe_layer *L, int T, int *bn, int *bn2)
{
    if (!L || T <= 0)
        return false;
    *bn = moe_tiles(L, T, bn2);
    return true;
}
} // namespace

int moek_cuda_moe_layer_uses_cluster(const moek_cuda_moe_layer *layer,
                                     int tokens)
{
    int bn, bn2;
    return call_tiles(layer, tokens, &bn, &bn2)
               ? moe_cluster(layer, bn, bn2, tokens)
               : MOEK_CLUSTER_NONE;
}

bool moek_cuda_moe_layer_uses_stream_k(const moek_cuda_moe_layer *layer,
                                       int tokens)
{
    int bn, bn2;
    return call_tiles(layer, tokens, &bn, &bn2) &&
           moe_stream_k(layer, bn2, tokens);
}

bool moek_cuda_moe_layer_uses_dep(const moek_cuda_moe_layer *layer,
                                   int tokens)
{
    int bn, bn2;
    return call_tiles(layer, tokens, &bn, &bn2) &&
           moe_dep(layer, bn, bn2, tokens);
}

bool moek_cuda_moe_layer_uses_slots(const moek_cuda_moe_layer *layer,
                                    int tokens)
{
    int bn, bn2;
    return call_tiles(layer, tokens, &bn, &bn2) &&
           moe_slots(layer, bn2, tokens); /* GEMM 2's epilogue */
}

int moek_cuda_fused_moe(moek_cuda_moe_layer *L, moek_cuda_workspace *ws,
                        const void *x, const moek_cuda_routing *routing,
                        int T, void *out, void *stream)
{
    if (!L || !ws || !routing || T < 0)
        return moek_cuda_refuse(-EINVAL, "fused_moe: bad argument");
    if (T == 0)
        return 0;
    if (!x || !out)
        return moek_cuda_refuse(-EINVAL, "fused_moe: NULL x or out");
    /* 16-byte loads of x's rows; 8-byte stores of out's (slot mode: 16). */
    if (((uintptr_t)x & 15) || ((uintptr_t)out & 15))
        return moek_cuda_refuse(-EINVAL,
                                "fused_moe: x and out must be 16-byte aligned");
    if (ws->device != L->device)
        return moek_cuda_refuse(-EINVAL,
                                "fused_moe: workspace on device %d, layer on %d",
                                ws->device, L->device);
    const bool logits = routing->kind == MOEK_CUDA_ROUTE_LOGITS;
    if (logits ? (!routing->logits_dev ||
                  (routing->scoring != MOEK_SCORING_SOFTMAX &&
                   routing->scoring != MOEK_SCORING_SIGMOID))
               : (routing->kind != MOEK_CUDA_ROUTE_GIVEN || !routing->ids_dev ||
                  !routing->weights_dev))
        return moek_cuda_refuse(-EINVAL, "fused_moe: bad routing");
    const bool remap = routing->remap_dev != nullptr;
    if (logits && L->shape.topk > (remap ? routing->route_experts
                                         : L->shape.experts))
        return moek_cuda_refuse(-EINVAL, "fused_moe: top-%d of fewer experts",
                                L->shape.topk);
    if (remap && (routing->route_experts < 1 ||
                  routing->route_experts > MOEK_MAX_EXPERTS))
        return moek_cuda_refuse(-EINVAL, "fused_moe: %d routed experts",
                                routing->route_experts);
    if ((long long)T * L->shape.topk >= (1LL << 31) / 2)
        return moek_cuda_refuse(-ENOTSUP, "fused_moe: %d tokens is too many",
                                T);
    int bn2;
    const int bn = moe_tiles(L, T, &bn2);
    /* GEMM 2 on a tile of its own: its tile list from GEMM 1's (relist) */
    const bool relist = bn2 != bn;
    /* Cluster mode's copy of x and slot mode's rows need room; a workspace
     * sized by moek_cuda_moe_workspace_size has it, else both are off. */
    const int mode = moe_cluster(L, bn, bn2, T);
    bool cl = mode == MOEK_CLUSTER_BOTH, slots = moe_slots(L, bn2, T);
    size_t need = carve_moe(L->shape, L->dt, T, cl || slots, nullptr, nullptr);
    if ((cl || slots) && need > ws->bytes) {
        cl = slots = false;
        need = carve_moe(L->shape, L->dt, T, false, nullptr, nullptr);
    }
    if (need > ws->bytes)
        return moek_cuda_refuse(-ENOSPC,
                                "fused_moe: %d tokens need %zu bytes of "
                                "workspace, it has %zu",
                                T, need, ws->bytes);
    MOEK_CU(cudaSetDevice(L->device));
    moe_ws w;
    carve_moe(L->shape, L->dt, T, cl || slots, (char *)ws->base, &w);
    const moek_moe_shape &s = L->shape;
    const int E = s.experts, k = s.topk, H = s.hidden, I = s.intermediate;
    const bool wgmma = moe_wgmma(L);
    cudaStream_t st = (cudaStream_t)stream;
    /* PDL needs a real stream; the legacy default stream gets plain launches. */
    const bool pdl = L->pdl && st != nullptr;

    moek_gemm_args g1 = {};
    g1.bn = bn;
    g1.w = L->w13;
    g1.rows_pad = 2 * I;
    g1.n_valid = I;
    g1.n_tiles = moe_tiles1(L);
    g1.k = H;
    g1.kblocks = (H + MOEK_KTILE - 1) / MOEK_KTILE;
    g1.chunk = raster_chunk(H, g1.n_tiles);
    g1.b = x;
    g1.ldb = H;
    g1.b_rows = w.pos_token;
    g1.epi = MOEK_EPI_SWIGLU;
    g1.out = w.inter;
    g1.ldo = I;
    g1.which = 0;
    moek_tmaps tb1, tb2;
    /* SwiGLU's output goes out by TMA from prefill tiles (gemm_wgmma.cu,
     * epi_swiglu_staged) */
    CUtensorMap to1;
    const CUtensorMap *o1 = nullptr;
    if (wgmma && bn >= MOEK_STAGED_MIN_TILE) {
        const int r = moek_make_out_tmap(&to1, w.inter, L->dt,
                                         (uint64_t)T * k, I, I);
        if (r)
            return r;
        o1 = &to1;
    }
    if (cl) {
        const int r1 = moek_make_tmaps(&tb1, w.rows, L->dt, (uint64_t)T * k,
                                       H, bn);
        if (r1)
            return r1;
        g1.b = w.rows;
        g1.b_rows = nullptr;
    }
    /* GEMM 2 stays in pairs when the copy of x does not fit. */
    const bool cl2 = mode != MOEK_CLUSTER_NONE;
    moek_gemm_args g2 = g1;
    g2.bn = bn2;
    if (!slots) { /* GEMM 1 only */
        g1.zero = (float4 *)w.acc;
        g1.zero_n4 = (size_t)T * H / 4;
    }
    g2.early_a = L->early;
    g2.w = L->w2p;
    g2.rows_pad = L->h16;
    g2.n_valid = H;
    g2.n_tiles = moe_tiles2(L);
    g2.k = I;
    g2.kblocks = moe_kblocks2(L);
    g2.chunk = raster_chunk(I, g2.n_tiles);
    g2.b = w.inter;
    g2.ldb = I;
    g2.b_rows = nullptr;
    g2.epi = slots ? MOEK_EPI_SLOT : MOEK_EPI_COMBINE;
    g2.stream_k = moe_stream_k(L, bn2, T);
    g2.out = slots ? w.rows : (void *)w.acc;
    g2.ldo = H;
    g2.pos_token = w.pos_token;
    g2.pos_weight = w.pos_weight;
    g2.which = 1;
    if (cl2) {
        const int r2 = moek_make_tmaps(&tb2, w.inter, L->dt, (uint64_t)T * k,
                                       I, bn2);
        if (r2)
            return r2;
    }
    /* slot rows go out by TMA too (gemm_wgmma.cu, epi_slot_staged): boxes
     * of 8 rows by 64 features, as the token-row maps' */
    CUtensorMap to2;
    const CUtensorMap *o2 = nullptr;
    if (slots) {
        const int r = moek_make_tmap(&to2, w.rows, L->dt, (uint64_t)T * k, H,
                                     8);
        if (r)
            return r;
        o2 = &to2;
    }
    g1.w_tiled = g2.w_tiled = L->tiled;
    g1.l2_hint = g2.l2_hint = L->tiled && L->l2_hint;
    for (moek_gemm_args *g : {&g1, &g2}) {
        g->plan = w.plan;
        g->cg_group = w.cg_group;
        g->cg_start = w.cg_start;
        g->cg_count = w.cg_count;
    }
    g1.cg_before = w.cg_before;
    g2.cg_before = w.cg_before + (E + 1);
    if (relist) {
        g2.cg_group = w.cg2_group;
        g2.cg_start = w.cg2_start;
        g2.cg_count = w.cg2_count;
    }
    g1.groups = g2.groups = E;

    /* GEMM 1's first weights to L2 before its wait for the routing
     * (prefetch_guess in gemm_wgmma.cu): where every expert is all but
     * sure to get rows (8 or more a group on average) and one token-tile
     * class orders the groups by index alone, so the guessed list is
     * likely the one routing makes.
     * On the H200, 16 K blocks an item: mixtral T=32 1.1%, T=64 0.8-1.1%,
     * T=128 0.5%, qwen3 T=128 1.0%, T=256 0.6% faster; qwen3 T=512 and
     * deepseek T=256-1024 even; 8 and 32 blocks no better
     * (kernels/bench/RESULTS.md, run 36). With fewer rows a group, no
     * list can be guessed: there, where a third of the experts or more
     * are likely hit and one K block of every expert's weight tiles fits
     * in about half of L2 (24 MB), each CTA sends a share of those
     * blocks, all of which the items that run read first. On an H100:
     * qwen3 T=8 1.1%, T=16 1.5%, T=32 1.3%, T=64 1.2% faster; at T=5, a
     * quarter of the experts hit, 0.3% slower (RESULTS.md, run 46; both
     * GEMMs in one launch, which since run 47 does not run with this
     * prefetch: see moek_dep below). */
    const int avg = (int)(((long long)T * k + E - 1) / E);
    const bool pf = wgmma && L->pf1_kb > 0 && L->tiled && moek_classes(bn) == 1;
    const long long every =
        (long long)E * g1.n_tiles * MOEK_WTILE * MOEK_KTILE * 2;
    if (pf && !remap && avg >= 8) {
        g1.pf_kb = L->pf1_kb;
        g1.pf_cnt = avg;
    } else if (pf && L->pf_every && 3 * moe_hit(s, T) >= E &&
               every <= (24LL << 20)) {
        g1.pf_kb = 1;
        g1.pf_cnt = 0;
    }

    /* GEMM 2 may split, so it takes every SM. */
    const int grid1 = moe_grid1(L, bn, T);
    /* GEMM 2's early weight loads pay when GEMM 1 fills every SM; when it
     * leaves SMs idle (qwen3 T=1: 96 items) they cost about 3 us
     * (RESULTS.md, run 6). */
    if (grid1 < L->sms)
        g2.early_a = 0;
    if (pdl && moe_dep(L, bn, bn2, T)) {
        g2.dep_mode = 2;
        g1.dep = g2.dep = w.dep;
        g2.dep_tiles = g1.n_tiles;
        g2.dep_ctas = grid1;
        /* Both GEMMs in one cooperative launch (moek_dep mode 3,
         * gemm_wgmma.cu): each CTA's producer goes on from its last GEMM 1
         * item into GEMM 2's weights while its consumers finish, where two
         * kernels left each SM without loads for about 4.5 us between
         * them. On the H200: mixtral T=1 0.9-1.6%, qwen3 T=8 and T=16
         * 0.7-1.3% faster, qwen3 T=64 and deepseek T=64 even, deepseek T=8
         * even to 0.9% slower (kernels/bench/RESULTS.md, run 34).
         * Not where GEMM 1 sends weights to L2 before its wait: a
         * cooperative grid of every SM starts only once the routing kernel
         * has ended, so that prefetch would go out after the routing, not
         * under it. There two kernels were faster: with every expert's
         * first blocks on an H100 qwen3 T=8 0.8%, T=16 0.4%, T=32 0.3%,
         * T=64 0.5% (run 47), on the H200 qwen3 T=8 1.7%, T=16 0.6%, T=64
         * 0.5%; with the guessed tiles on the H200 deepseek T=256 0.4%,
         * T=512 0.2% (run 48), on an H100 mixtral T=32 to 128 and qwen3
         * T=128 to 512 even (runs 47, 49; not yet measured there on the
         * H200). Where no prefetch runs, the one launch
         * was 2.2% faster at qwen3 T=3 and even at mixtral T=3 and 8 and
         * deepseek T=1 to 64 (run 47). MOEK_CUDA_NO_BOTH=1 keeps two
         * kernels everywhere. */
        g1.dep_mode = L->both && g1.pf_kb == 0 && moek_wgmma_both_ok(g1, g2) ? 3 : 1;
        /* GEMM 1's counts from the CTA's counting warp (gemm_wgmma.cu,
         * sig_counts), not by the consumers, who waited 6.4 us an item for
         * the count's fence (qwen3 T=8's GEMM 1 on an H100). On H100s,
         * where the one launch runs, mixtral T=1 0.5-1.4% faster, deepseek
         * T=8 and qwen3 T=3 even; where GEMM 1 runs alone (mode 1), qwen3
         * T=8 0.7-1.0% slower, T=16, T=64 and T=128-512 even, so there the
         * consumers count unless MOEK_CUDA_SIG_WARP_MODE1=1 (RESULTS.md,
         * run 51). */
        g1.sig = g1.dep_mode == 3 ? L->sig : L->sig1;
    }

    moek_route_args ra = {};
    ra.logits = logits ? routing->logits_dev : nullptr;
    ra.scoring = routing->scoring;
    ra.renorm = routing->renormalize;
    ra.ids_in = logits ? nullptr : routing->ids_dev;
    ra.w_in = logits ? nullptr : routing->weights_dev;
    ra.tokens = T;
    ra.experts = remap ? routing->route_experts : E;
    ra.remap = routing->remap_dev;
    ra.topk = k;
    ra.ids = w.ids;
    ra.wts = w.wts;
    ra.rank = w.rank;
    ra.counts = w.counts;
    moek_align_args aa = {};
    aa.counts = w.counts;
    aa.groups = E;
    aa.bn = bn;
    aa.sms = L->sms;
    aa.split_min_kb = L->split_min_kb;
    aa.tiny = L->tiny;
    aa.route_cl = moek_route_cluster_use(L->route_cl, E, ra.experts);
    aa.d[0] = {g1.n_tiles, g1.kblocks, 0};
    aa.d[1] = {g2.n_tiles, g2.kblocks,
               cl2 || slots || g2.stream_k || moek_wtiles(bn2) > 1 ? 0 : 1};
    aa.ngemm = relist ? 1 : 2; /* GEMM 2's from the relist */
    aa.plan = w.plan;
    aa.cg_group = w.cg_group;
    aa.cg_start = w.cg_start;
    aa.cg_count = w.cg_count;
    aa.cg_before = w.cg_before;
    aa.ids = logits || remap ? w.ids : routing->ids_dev;
    aa.wts = logits || remap ? w.wts : routing->weights_dev;
    aa.rank = w.rank;
    aa.slots = T * k;
    aa.topk = k;
    aa.pos_token = w.pos_token;
    aa.pos_weight = w.pos_weight;
    /* slot mode's finalize and cluster mode's copy of x read it */
    aa.slot_pos = slots || cl ? w.slot_pos : nullptr;
    aa.dep = g2.dep_mode ? w.dep : nullptr; /* zeroed by the routing kernel */
    MOEK_CU(moek_launch_route(ra, aa, w.counts, st, pdl));
    if (relist) {
        moek_align_args a2 = aa;
        a2.bn = bn2;
        a2.cg2_group = w.cg2_group;
        a2.cg2_start = w.cg2_start;
        a2.cg2_count = w.cg2_count;
        MOEK_CU(moek_launch_relist(a2, st, pdl));
    }
    if (cl) { /* a warp per row segment (8 per block), 4 blocks per SM */
        const int row16 = H * 2 / 16;
        const long long blocks = ((long long)T * permute_segs(row16) + 7) / 8;
        const int grid0 = (int)(blocks < 4 * L->sms ? blocks : 4 * L->sms);
        MOEK_CU(moek_launch(permute_rows_kernel, dim3(grid0), dim3(256), 0, st,
                            pdl, (const uint4 *)x, (uint4 *)w.rows,
                            (const int *)w.slot_pos, T, k, row16));
    }

    if (g1.dep_mode == 3) {
        MOEK_CU(moek_launch_gemm_wgmma_both(L->dt, g1, g2, grid1, st, pdl));
    } else {
        MOEK_CU(run_gemm(L->dt, wgmma, &L->tm13, g1, grid1, st, pdl,
                         cl ? &tb1 : nullptr, o1));
        MOEK_CU(run_gemm(L->dt, wgmma, &L->tm2, g2, L->sms, st, pdl,
                         cl2 ? &tb2 : nullptr, o2));
    }

    const bool bf16 = L->dt == MOEK_DTYPE_BF16;
    if (slots) {
        const int grid3 = T < 8 * L->sms ? T : 8 * L->sms;
        MOEK_CU(moek_launch(bf16 ? finalize_slots_kernel<__nv_bfloat16>
                                 : finalize_slots_kernel<__half>,
                            dim3(grid3), dim3(256), 0, st, pdl,
                            (const uint4 *)w.rows, (const int *)w.slot_pos,
                            (uint4 *)out, T, k, H / 8));
        return 0;
    }
    const size_t n4 = (size_t)T * H / 4;
    long long blocks = (long long)((n4 + 255) / 256);
    int grid3 = (int)(blocks < 4LL * L->sms ? blocks : 4LL * L->sms);
    MOEK_CU(moek_launch(bf16 ? finalize_kernel<__nv_bfloat16>
                             : finalize_kernel<__half>,
                        dim3(grid3), dim3(256), 0, st, pdl,
                        (const float4 *)w.acc, (uint2 *)out, n4));
    return 0;
}

int moek_cuda_moe_read_routing(const moek_cuda_moe_layer *L,
                               const moek_cuda_workspace *ws, int T,
                               int32_t *ids, float *weights, void *stream)
{
    if (!L || !ws || T < 0 || !ids || !weights)
        return -EINVAL;
    if (carve_moe(L->shape, L->dt, T, false, nullptr, nullptr) > ws->bytes)
        return -ENOSPC;
    moe_ws w;
    carve_moe(L->shape, L->dt, T, false, (char *)ws->base, &w);
    MOEK_CU(cudaStreamSynchronize((cudaStream_t)stream));
    const size_t n = (size_t)T * L->shape.topk;
    MOEK_CU(cudaMemcpy(ids, w.ids, n * sizeof(int32_t), cudaMemcpyDeviceToHost));
    MOEK_CU(cudaMemcpy(weights, w.wts, n * sizeof(float),
                       cudaMemcpyDeviceToHost));
    return 0;
}

int moek_cuda_grouped_gemm(moek_cuda_gemm_weights *W, moek_cuda_workspace *ws,
                           const void *a, const int64_t *m_sizes,
                           int64_t total_m, void *c, void *stream)
{
    if (!W || !ws || total_m < 0 || !m_sizes)
        return moek_cuda_refuse(-EINVAL, "grouped_gemm: bad argument");
    if (total_m == 0)
        return 0;
    if (!a || !c)
        return moek_cuda_refuse(-EINVAL, "grouped_gemm: NULL a or c");
    /* 16-byte loads of a's rows (cp.async); 4-byte stores of c's pairs. */
    if (((uintptr_t)a & 15) || ((uintptr_t)c & 15))
        return moek_cuda_refuse(-EINVAL,
                                "grouped_gemm: a and c must be 16-byte aligned");
    if (total_m >= (1LL << 31))
        return moek_cuda_refuse(-ENOTSUP, "grouped_gemm: %lld rows is too many",
                                (long long)total_m);
    if (ws->device != W->device)
        return moek_cuda_refuse(-EINVAL, "grouped_gemm: workspace on device "
                                         "%d, weights on %d",
                                ws->device, W->device);
    const size_t need = carve_gemm(W->groups, nullptr, nullptr);
    if (need > ws->bytes)
        return moek_cuda_refuse(-ENOSPC,
                                "grouped_gemm: needs %zu bytes of workspace, "
                                "it has %zu",
                                need, ws->bytes);
    MOEK_CU(cudaSetDevice(W->device));
    gemm_ws w;
    carve_gemm(W->groups, (char *)ws->base, &w);
    const bool wgmma = W->cc == 90 && !W->tune.generic;
    int bn = 16;
    const int n_tiles = (W->n16 + MOEK_WTILE - 1) / MOEK_WTILE;
    if (wgmma) {
        if (W->tune.token_tile) {
            bn = W->tune.token_tile;
        } else {
            const double g = (double)(total_m < W->groups ? total_m : W->groups);
            /* the 144-row tile was measured on MoE forwards alone */
            bn = pick_tile((double)total_m / g, false, false);
        }
        bn = fit_tile(bn, n_tiles, n_tiles, false);
    }
    moek_gemm_args g = {};
    g.plan = w.plan;
    g.cg_group = w.cg_group;
    g.cg_start = w.cg_start;
    g.cg_count = w.cg_count;
    g.cg_before = w.cg_before;
    g.groups = W->groups;
    g.which = 0;
    g.bn = bn;
    g.w = W->b;
    g.rows_pad = W->n16;
    g.n_valid = W->n;
    g.n_tiles = n_tiles;
    g.k = W->k;
    g.kblocks = (W->k + MOEK_KTILE - 1) / MOEK_KTILE;
    g.chunk = raster_chunk(W->k, g.n_tiles);
    g.b = a;
    g.ldb = W->k;
    g.b_rows = nullptr;
    g.epi = MOEK_EPI_STORE;
    g.out = c;
    g.ldo = W->n;
    g.w_tiled = W->tiled;

    moek_align_args aa = {};
    aa.m_sizes = m_sizes;
    aa.total_m = total_m;
    aa.groups = W->groups;
    aa.bn = bn;
    aa.sms = W->sms;
    aa.split_min_kb = W->split_min_kb;
    aa.d[0] = {g.n_tiles, g.kblocks, 0};
    aa.ngemm = 1;
    aa.plan = w.plan;
    aa.cg_group = w.cg_group;
    aa.cg_start = w.cg_start;
    aa.cg_count = w.cg_count;
    aa.cg_before = w.cg_before;
    cudaStream_t st = (cudaStream_t)stream;
    const bool pdl = W->pdl && st != nullptr;
    MOEK_CU(moek_launch_align_groups(aa, st, pdl));
    long long pairs = (long long)(total_m < W->groups ? total_m : W->groups) +
                      total_m / bn;
    long long runs = pairs * g.n_tiles / moek_wtiles(bn);
    int grid = (int)(runs < W->sms ? runs : W->sms);
    MOEK_CU(run_gemm(W->dt, wgmma, &W->tm, g, grid, st, pdl));
    return 0;
}

MOEK_TRACE_UNIT(layer)
