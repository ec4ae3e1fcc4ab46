/*
 * gemm_wgmma.cu: the Hopper (sm_90a) GEMM behind every MoE and grouped-GEMM
 * call: persistent, warp-specialised, TMA + wgmma, "swap AB".
 *
 * Swap AB: the weights sit on wgmma's M side (a tile is 128 weight rows, two
 * consumer warpgroups of 64) and the tokens on the narrow N side (BN = 16 ..
 * 256 token rows), so a decode step with one token per expert still streams
 * whole weight tiles at full width, and the same kernel grows into a
 * 128 x 256 prefill tile.
 *
 * Per CTA (384 threads, one per SM; 416 where GEMM 1 counts for moek_dep,
 * below):
 *   warpgroup 0, producer: for each work item (cuda_common.cuh) and each
 *     64-wide K block, waits for a free stage, bulk-copies the 128 x 64
 *     weight tile (16 KB, stored pre-swizzled and contiguous: weights.cu;
 *     or a 128-byte swizzled TMA load from row-major weights; an L2
 *     evict-first hint when the weights serve one token tile), and gathers
 *     the item's N <= BN token rows with cp.async
 *     into the same swizzled layout (rows of x picked through the sorted
 *     slot -> token map, so the activations are never copied to a sorted
 *     buffer); both complete on the stage's "full" mbarrier (1 expect-tx
 *     arrival + 128 cp.async no-increment arrivals).
 *   warpgroups 1, 2, consumers: wait "full", issue 4 wgmma m64nNk16, keep
 *     one wgmma group in flight and release the previous stage on its
 *     "empty" mbarrier; after the item's last K block, the epilogue
 *     fuses SiLU(gate)*up (epi_swiglu_staged, or moek_epi_pair for narrow
 *     tiles), the routing weight with 16-byte fp32 atomic adds
 *     (moek_combine4) or into each slot's row (epi_slot_staged), or a
 *     plain store (moek_epi_pair); the staged epilogues (tiles of 128
 *     rows and wider) go through shared memory and out by TMA. The
 *     producer runs ahead into the next item meanwhile. With tiles of 64
 *     rows and wider outside cluster mode (handoff), in cluster mode where
 *     items are short (HAND), and in ticketed GEMM 2 at any width
 *     (ring), the consumers take each item as the producer decoded it
 *     instead of decoding it again.
 * Inside one instance:
 *   - token tiles of up to four widths (BN 128 and wider; cuda_common.cuh,
 *     moek_class_width, moek_tile_class), so a group pays
 *     for about the rows it has. Each width is its own loop with one wgmma
 *     shape, run one after the other: a wgmma chosen by a branch inside
 *     the K loop makes ptxas serialise every wgmma (C7520), measured
 *     30-40% slower;
 *   - early_a (GEMM 2): the producer issues the first stages' weight tiles
 *     before waiting for the previous kernel (programmatic dependent
 *     launch), so GEMM 2 streams weights while GEMM 1 drains;
 *   - cluster mode (CL = 2, prefill tiles of 128 rows and wider): CTAs 2c
 *     and 2c + 1 run weight tiles nt and nt + 1 of the same token tile; one
 *     producer warp per CTA loads its weight tile and half of the token rows
 *     (one TMA box: a map per tile width), multicast into both CTAs, so each
 *     token tile is read from L2 once per pair. The token rows must then
 *     be contiguous: GEMM 1 reads a copy of x in slot order (layer.cu),
 *     GEMM 2 its input as GEMM 1 wrote it. A stage is free when the
 *     consumers of both CTAs have released it.
 * Stages: as many as fit in 227 KB (12 for BN = 16, 4 for BN = 256), so
 * 130-200 KB of weights are in flight per SM on the memory-bound path.
 * GEMM 2 starting per group (moek_dep, layer.cu; tiles below 128 rows) is
 * three more instances of each such width, by the template's DEP: 1 for
 * GEMM 1, which counts each group's finished items, 2 for GEMM 2, whose
 * producer waits for its item's group and takes its work from a counter
 * (unit_span), and 3 for both in one cooperative launch
 * (moek_launch_gemm_wgmma_both, layer.cu's default there): each CTA runs
 * its GEMM 1 items as 1 does, then GEMM 2's as 2 does, through one
 * pipeline, so its producer goes on into GEMM 2's weights while its
 * consumers finish GEMM 1 (two kernels left each SM without loads for
 * about 4.5 us between them); both groups' cg_before sit in shared memory
 * (up to SB3_GROUPS groups), and GEMM 2 adds into acc once every CTA has
 * zeroed its slice, which only a launch that keeps every CTA resident may
 * wait for. Modes 1 and 3 have a thirteenth warp, which makes GEMM 1's
 * counts where a.sig says so (sig_counts), so the consumers do not wait
 * for the count's fence.
 * DEP 0, every other call, compiles as it did before them.
 *
 * Variants are template instances by token tile BN; moek_launch_gemm_wgmma
 * picks one. The kernel body exists only in the sm_90a pass
 * (__CUDA_ARCH_FEAT_SM90_ALL); the compute_90 PTX gets an empty body, and the
 * host never picks this kernel on a device that is not sm_90.
 */
#include <cuda.h>

#include <type_traits>

#include "cuda_common.cuh"
#include "mbarrier.cuh"
#include "trace.cuh"
#include "wgmma_ops.cuh"

namespace {

constexpr int SMEM_MAX = 232448; /* 227 KB: the opt-in limit on sm_90 */
constexpr int A_BYTES = MOEK_WTILE * MOEK_KTILE * 2;
/* cg_before in shared memory, for up to SB_GROUPS compact groups: every
 * item's binary search then reads shared memory instead of a chain of
 * dependent global loads. */
constexpr int SB_GROUPS = 511;
constexpr int SB_BYTES = (SB_GROUPS + 1) * 4;
constexpr int EPI_ROWS = 128; /* token rows per pass of the staged epilogue */
/* Tiles of 64 token rows and wider (CL = 1) hand the producer's decoded
 * items to the consumers through a ring of INFO_ITEMS entries in shared
 * memory, more than a pipeline has stages, so an entry is read before the
 * producer comes round to it again (every item has a stage). Their items
 * can be short (qwen3 T=512's down GEMM: 12 K blocks), and there the
 * consumers' own decode between two items took a third of their time, by
 * ncu's samples. Decode tiles of 16 rows, whose items are long, measured
 * slower with it (mixtral T=1, deepseek T=8: RESULTS.md, run 22). */
constexpr int INFO_ITEMS = 16;
constexpr int INFO_BYTES = INFO_ITEMS * (int)sizeof(moek_item);
__host__ __device__ constexpr bool handoff(int bn, int cl)
{
    return cl == 1 && bn >= 64;
}
/* Cluster mode hands its items over the same way where they are short (K
 * blocks up to CL_RING_MAX_KB: qwen3's down GEMM, 12), in instances of
 * their own (HAND: launch_cl). For all items it made qwen3 T=4096 1.0%
 * faster on the H200 but mixtral T=512 (64 and 224 K blocks) 1.6% slower
 * (RESULTS.md, run 56); chosen at run time in one instance it cost
 * 0.2-0.5% where it did not apply. In instances of their own: qwen3
 * T=4096 0.9% and T=2048 0.6% faster on an H100, mixtral T=512 and
 * deepseek T=4096 even (run 57). */
constexpr int CL_RING_MAX_KB = 16;
/* Whether the producer hands each item it decodes to the consumers:
 * handoff(), or a HAND instance (cluster mode's: the kernel asserts it). */
__host__ __device__ constexpr bool hands(int bn, int cl, bool hand)
{
    return handoff(bn, cl) || hand;
}
/* Whether the consumers take their items from the ring: hands(), or
 * ticketed GEMM 2 (moek_dep mode 2, and mode 3's second half), whose
 * items only the producer knows. */
__host__ __device__ constexpr bool ring(int bn, int cl, int dep,
                                        bool hand = false)
{
    return hands(bn, cl, hand) || dep == 2 || dep == 3;
}
/* Mode 3 keeps both GEMMs' cg_before in shared memory, for up to
 * SB3_GROUPS groups each. */
constexpr int SB3_GROUPS = 256;
constexpr int SB3_INTS = 260; /* SB3_GROUPS + 1, in 16-byte steps */

/*
 * moek_dep's counts (modes 1 and 3, GEMM 1) go out from a warp of their
 * own, a thirteenth after the three warpgroups: the count's release fence
 * waits until the SM's stores are performed, 6.4 us an item in qwen3
 * T=8's GEMM 1 on an H100 (its epilogue 6.72 us with the count, 0.35
 * without: kernels/bench/RESULTS.md, run 51), all of which the consumers
 * stood idle for when they made the count themselves. Now each consumer
 * warpgroup, its stores behind its barrier, posts the item's group in a
 * ring of SIG_SLOTS slots (full: both warpgroups' arrivals, a release;
 * empty: the counting warp's), and that warp makes one count of two
 * for both; a group of -1 ends it. Where a.sig is 0 (layer.cu chooses by
 * mode) the consumers count as before and the warp does nothing.
 */
constexpr int SIG_SLOTS = 4;
struct sig_ring {
    uint64_t full[SIG_SLOTS], empty[SIG_SLOTS];
    int g[SIG_SLOTS];
};
__host__ __device__ constexpr bool counts(int dep)
{
    return dep == 1 || dep == 3;
}
__host__ __device__ constexpr int cta_threads(int dep)
{
    return counts(dep) ? 416 : 384;
}

/* DEP: the kernel's moek_dep mode (moek_gemm_args.dep_mode); ticketed
 * GEMM 2 (modes 2 and 3) has the item ring at every width, and its
 * ticket. */
template <int BN, int DEP = 0> struct tile_cfg {
    static constexpr int B_BYTES = BN * MOEK_KTILE * 2;
    /* the weight tiles of a stage (moek_wtiles), then its token rows */
    static constexpr int A_ALL = moek_wtiles(BN) * A_BYTES;
    static constexpr int STAGE = A_ALL + B_BYTES;
    /* COMBINE's and SLOT's (token, weight) per token row: 2 consumers x 2
     * items. */
    static constexpr int STG_BYTES = 2 * 2 * BN * 8;
    /* SWIGLU's and SLOT's output staging (tiles of 128 rows and wider,
     * where it costs no stage): per consumer, 128 token rows of its 32
     * features, or 64 of its 64. */
    static constexpr int EPI_BYTES =
        BN >= MOEK_STAGED_MIN_TILE ? 2 * EPI_ROWS * 64 : 0;
    /* the item ring (ring()), then mode 2's ticket */
    static constexpr int INFO = (ring(BN, 1, DEP) ? INFO_BYTES : 0) +
                                (DEP == 2 || DEP == 3 ? 16 : 0);
    /* cg_before in shared memory: one list, or mode 3's two */
    static constexpr int SBB = DEP == 3 ? 2 * SB3_INTS * 4 : SB_BYTES;
    /* the counts' ring after INFO, rounded up to 8 bytes (room for it) */
    static constexpr int SIG = counts(DEP) ? (int)sizeof(sig_ring) + 8 : 0;
    static constexpr int FIT =
        (SMEM_MAX - 2048 - STG_BYTES - SBB - EPI_BYTES - INFO - SIG) / STAGE;
    static constexpr int STAGES = FIT > 12 ? 12 : FIT;
    static constexpr int SMEM = STAGES * STAGE + 1024 + 2 * STAGES * 8 +
                                STG_BYTES + SBB + EPI_BYTES + INFO + SIG;
    static_assert(STAGE % 1024 == 0 && EPI_BYTES % 1024 == 0,
                  "stages and the staging buffer keep 1024-byte alignment");
    static_assert(SMEM <= SMEM_MAX, "shared memory");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map,
                                            int c0, int c1, uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::"
                 "complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
                     moek_smem_u32(dst)),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1),
                 "r"(moek_smem_u32(bar))
                 : "memory");
}

/* A TMA box into the same offset of every CTA in mask, completing on each
 * one's barrier at bar's offset (cluster mode, see the top). */
__device__ __forceinline__ void tma_load_2d_mc(void *dst, const CUtensorMap *map,
                                               int c0, int c1, uint64_t *bar,
                                               uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::"
                 "complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], "
                 "[%4], %5;" ::"r"(moek_smem_u32(dst)),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1),
                 "r"(moek_smem_u32(bar)), "h"(mask)
                 : "memory");
}

/* A TMA store of the box at src (shared memory, in the map's swizzle) to
 * coordinates (c0, c1), in this thread's open bulk group. */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map,
                                             const void *src, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group "
                 "[%0, {%1, %2}], [%3];" ::"l"(reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1), "r"(moek_smem_u32(src))
                 : "memory");
}

/* Add expected bytes to the current phase without arriving. */
__device__ __forceinline__ void mbar_expect_tx_only(uint64_t *bar,
                                                    uint32_t bytes)
{
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::
                     "r"(moek_smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

/* Arrive on the barrier at the same offset in CTA `peer` of the cluster,
 * with the default CTA-scope release: a cluster-scope release on every
 * stage made GEMM 1 of mixtral T=4096 43% slower (4.40 against 3.07 ms). */
__device__ __forceinline__ void mbar_arrive_peer(uint64_t *bar, uint32_t peer)
{
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(moek_smem_u32(bar)), "r"(peer));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote)
                 : "memory");
}

__device__ __forceinline__ void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::
                     : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank()
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Item it's weight tile, K block kb, into stage memory sA. Weights that
 * serve one token tile leave L2 first; those that serve several (prefill:
 * a raster chunk's token tiles) stay (measured: mixtral T=4096 5552 us
 * without the hint, 5693 with it on every load). */
__device__ __forceinline__ void load_w(const moek_gemm_args &a,
                                       const CUtensorMap *tmap, void *sA,
                                       const moek_item &it, int kb,
                                       uint64_t *bar)
{
    if (a.w_tiled) {
        const size_t at = moek_wt_index(it.g, it.nt * MOEK_WTILE,
                                        kb * MOEK_KTILE, a.n_tiles, a.kblocks);
        moek_bulk_load(sA, reinterpret_cast<const uint16_t *>(a.w) + at,
                       A_BYTES, bar, a.l2_hint && it.once);
    } else {
        tma_load_2d(sA, tmap, kb * MOEK_KTILE,
                    it.g * a.rows_pad + it.nt * MOEK_WTILE, bar);
    }
}

__device__ __forceinline__ void cp_async_16(void *dst, const void *src,
                                            uint32_t bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                     moek_smem_u32(dst)),
                 "l"(src), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t *bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(
                     moek_smem_u32(bar))
                 : "memory");
}

/* K-major operand in shared memory, 128-byte swizzle: rows of 128 bytes,
 * 8-row groups 1024 bytes apart (SBO), leading offset unused. */
__device__ __forceinline__ uint64_t smem_desc(const void *p)
{
    uint64_t d = (uint64_t)((moek_smem_u32(p) & 0x3ffff) >> 4);
    d |= (uint64_t)1 << 16;            /* LBO (ignored for this layout) */
    d |= (uint64_t)(1024 >> 4) << 32;  /* SBO */
    d |= (uint64_t)1 << 62;            /* 128-byte swizzle */
    return d;
}

__device__ __forceinline__ void wgmma_fence()
{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/*
 * GEMM 1's first weights, sent to L2 before the wait for the routing
 * (moek_gemm_args.pf_kb; while the routing runs, except in mode 3, whose
 * cooperative launch starts once it has ended): DRAM is otherwise idle
 * from the forward's start to GEMM 1's first load. The CTA's first item
 * is item blockIdx.x; before the tile list exists it is decoded from a
 * guessed one, every group in use with pf_cnt rows. That decode holds
 * because layer.cu sets pf_kb only for tiled weights and one token-tile
 * class, and GEMM 1 never splits K. Where the routing made another list,
 * the blocks sent are read later or not at all; the loads are the same
 * either way. With pf_cnt 0 (too few rows a group for a guess; layer.cu),
 * the first pf_kb blocks of every group's weight tiles instead, a share
 * per CTA: every item that runs starts with one of them.
 */
__device__ __forceinline__ void prefetch_guess(const moek_gemm_args &a)
{
    if (!a.w_tiled)
        return;
    const int kb = a.pf_kb < a.kblocks ? a.pf_kb : a.kblocks;
    const auto send = [&](int g, int nt) {
        const size_t at = moek_wt_index(g, nt * MOEK_WTILE, 0, a.n_tiles,
                                        a.kblocks);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                         reinterpret_cast<const uint16_t *>(a.w) + at),
                     "r"(kb * A_BYTES)
                     : "memory");
    };
    if (a.pf_cnt == 0) {
        /* Fewer rows a group than the guess needs: the first blocks of
         * every group's weight tiles, tile t by CTA t mod gridDim.x. */
        for (int t = blockIdx.x; t < a.groups * a.n_tiles; t += gridDim.x)
            send(t / a.n_tiles, t % a.n_tiles);
        return;
    }
    const int per = moek_token_tiles(a.pf_cnt, a.bn) * a.n_tiles;
    moek_item_src f;
    f.g = (int)blockIdx.x / per;
    f.l = (int)blockIdx.x - f.g * per;
    f.cnt = a.pf_cnt;
    f.start = 0;
    if (f.g >= a.groups)
        return;
    const moek_item it = moek_item_from(a, 1, f);
    send(it.g, it.nt);
}

/* The first item of this CTA's sequence at or after `start`, items taken
 * W at a time (moek_wtiles; start a multiple of W): every gridDim.x-th run
 * of W from the CTA's own. */
__device__ __forceinline__ int class_first(int start, int W)
{
    const int g = (int)gridDim.x, s = start / W;
    const int r = ((int)blockIdx.x - s) % g;
    return start + W * (r < 0 ? r + g : r);
}

/*
 * A CTA's share of one tile class's items [c0, c1): items first, first +
 * step, ... < end. Grid-strided: every gridDim.x-th item from the CTA's
 * own. Stream-K (moek_gemm_args.stream_k: GEMM 2 of a decode call, one
 * class, no K split): the CTA takes the K blocks [lo, hi) of the class's
 * (item, K block) sequence, an even share of them, so the items between
 * come whole and the first and last may be parts (clip), which COMBINE's
 * atomic adds sum like a K split.
 */
struct cta_span {
    int first, end, step, c0;
    long long lo, hi; /* stream-K's K blocks, or lo = -1 */
    __device__ __forceinline__ void clip(moek_item &it, int idx,
                                         int kblocks) const
    {
        if (lo < 0)
            return;
        const long long base = (long long)(idx - c0) * kblocks;
        if (lo - base > it.kb0)
            it.kb0 = (int)(lo - base);
        if (hi - base < it.kb1)
            it.kb1 = (int)(hi - base);
    }
    /* Walking the span one item ahead: fetch_first() gives the first
     * item's reads (moek_fetch_item), take(idx, nx) item idx from nx, which
     * it refills with the next item's reads. Those go out as item idx
     * starts and land while it streams; waited for at each item's start
     * they took 11% of the warp samples of qwen3 T=8's down GEMM (items
     * of 12 K blocks), though a full queue hid most of it there, and the
     * consumers' wait cost the prefill tiles 1-2% (RESULTS.md, run 23). */
    __device__ __forceinline__ moek_item_src
    fetch_first(const moek_gemm_args &a, int ncg, const int *sb) const
    {
        moek_item_src f = {};
        if (first < end)
            f = moek_fetch_item(a, ncg, first, sb);
        return f;
    }
    __device__ __forceinline__ moek_item take(const moek_gemm_args &a,
                                              int ncg, int split, int idx,
                                              const int *sb,
                                              moek_item_src &nx) const
    {
        const moek_item it = item(a, split, idx, nx);
        fetch_next(a, ncg, idx, sb, nx);
        return it;
    }
    /* take() in its two steps, for a caller that sends the next item's
     * reads later (produce(), 16-row tiles) */
    __device__ __forceinline__ moek_item item(const moek_gemm_args &a,
                                              int split, int idx,
                                              const moek_item_src &nx) const
    {
        moek_item it = moek_item_from(a, split, nx);
        clip(it, idx, a.kblocks);
        return it;
    }
    __device__ __forceinline__ void fetch_next(const moek_gemm_args &a,
                                               int ncg, int idx,
                                               const int *sb,
                                               moek_item_src &nx) const
    {
        if (idx + step < end)
            nx = moek_fetch_item(a, ncg, idx + step, sb);
    }
};

/* Share u of n of the class's (item, K block) sequence [c0, c1) x kblocks:
 * the K blocks [u, u + 1) x total / n, over the items they touch. */
__device__ __forceinline__ cta_span k_share(int c0, int c1, int kblocks,
                                           unsigned u, unsigned n)
{
    cta_span s;
    s.c0 = c0;
    const long long total = (long long)(c1 - c0) * kblocks;
    s.lo = total * u / n;
    s.hi = total * (u + 1) / n;
    s.first = c0 + (int)(s.lo / kblocks);
    s.end = s.lo < s.hi ? c0 + (int)((s.hi + kblocks - 1) / kblocks) : s.first;
    s.step = 1;
    return s;
}

/* Whole items first, first + step, ... < end of a class starting at c0. */
__device__ __forceinline__ cta_span item_span(int c0, int first, int end,
                                              int step)
{
    cta_span s;
    s.c0 = c0;
    s.first = first;
    s.end = end;
    s.step = step;
    s.lo = -1;
    s.hi = 0;
    return s;
}

__device__ __forceinline__ cta_span class_span(int c0, int c1, bool sk,
                                               int kblocks, int W)
{
    if (!sk)
        return item_span(c0, class_first(c0, W), c1, W * (int)gridDim.x);
    return k_share(c0, c1, kblocks, blockIdx.x, gridDim.x);
}

/* Item it's weight tiles for stage memory sA (moek_wtiles: nt, nt + 1 of
 * one token tile), on one barrier. */
template <int BN>
__device__ __forceinline__ void load_ws(const moek_gemm_args &a,
                                        const CUtensorMap *tmap, uint8_t *sA,
                                        const moek_item &it, int kb,
                                        uint64_t *bar)
{
#pragma unroll
    for (int w = 0; w < moek_wtiles(BN); w++) {
        moek_item iw = it;
        iw.nt += w;
        load_w(a, tmap, sA + w * A_BYTES, iw, kb, bar);
    }
}

/*
 * Ticketed GEMM 2 (moek_dep mode 2; one class, no pairs): the CTAs take
 * units of the class's work from a counter as they come free, instead of
 * a share fixed by blockIdx.x, so those that start early in GEMM 1's last
 * round do more of it. Unit u of n: item c0 + u, or (stream-K) the K
 * blocks [u, u + 1) x total / n of the class's sequence, STREAM_K_UNITS
 * units per CTA.
 */
constexpr int STREAM_K_UNITS = 4;
__device__ __forceinline__ int unit_count(int c0, int c1, bool sk)
{
    return sk ? STREAM_K_UNITS * (int)gridDim.x : c1 - c0;
}
__device__ __forceinline__ cta_span unit_span(int c0, int c1, bool sk,
                                              int kblocks, int u, int n)
{
    if (sk)
        return k_share(c0, c1, kblocks, (unsigned)u, (unsigned)n);
    return item_span(c0, c0 + u, c0 + u + 1, 1);
}

/* Pipeline position shared by the tile classes of one role. */
struct pipe_pos {
    int stage, used;
    uint32_t phase;
    int items; /* items consumed: picks the staging buffer */
    __device__ __forceinline__ void advance(int stages)
    {
        used++;
        if (++stage == stages) {
            stage = 0;
            phase ^= 1;
        }
    }
};

/* early_a: issue the weight tiles of the first stages (in the order the
 * producer will use them) before waiting for the previous kernel. */
template <int BN, int CL, bool HAND>
__device__ __forceinline__ int preissue(const moek_gemm_args &a,
                                        const CUtensorMap *tmap, uint8_t *smem,
                                        uint64_t *full, int ncg, int split,
                                        const cta_span &sp, int pre,
                                        const int *sb, moek_item *info,
                                        int &items)
{
    using C = tile_cfg<BN>;
    for (int idx = sp.first; idx < sp.end && pre < C::STAGES;
         idx += sp.step, items++) {
        moek_item it = moek_decode_item(a, ncg, split, idx, sb);
        sp.clip(it, idx, a.kblocks);
        if (hands(BN, CL, HAND) && threadIdx.x == 0)
            info[items % INFO_ITEMS] = it;
        for (int kb = it.kb0; kb < it.kb1 && pre < C::STAGES; kb++, pre++) {
            if (threadIdx.x == 0) {
                if (pre == 0)
                    moek_trace_gemm(a.which, MOEK_TR_FIRST, 1);
                if (kb == it.kb0) /* issued before any wait: a, b 0 */
                    moek_trace_item(a.which, MOEK_TR_ISSUE, items);
                /* CL = 2: the stage's one arrival comes with its token rows
                 * (produce_mc), which the peer's multicast also fills. */
                if (CL == 2)
                    mbar_expect_tx_only(&full[pre], C::A_ALL);
                else
                    moek_mbar_expect_tx(&full[pre], C::A_ALL);
                load_ws<BN>(a, tmap, smem + pre * C::STAGE, it, kb,
                            &full[pre]);
            }
        }
    }
    return pre;
}

/* Producer, one tile class: the CTA's items (sp), token tiles of N rows;
 * or (DEP 2: ticketed GEMM 2) the units it takes of the class's items
 * [c0, c1), each item once its group's rows are written (moek_dep), then
 * an end mark in the item ring. L: the kernel's mode, whose shared
 * memory layout (tile_cfg) this runs in (mode 3 runs GEMM 1 as mode 1,
 * then GEMM 2 as mode 2, in one pipeline).
 * Thread t copies 16-byte chunk (t & 7) of token rows (t >> 3) + 16 i. */
template <typename T, int BN, int N, int DEP, int L = DEP>
__device__ __forceinline__ void produce(const moek_gemm_args &a,
                                        const CUtensorMap *tmap, uint8_t *smem,
                                        uint64_t *full, uint64_t *empty,
                                        int ncg, int split, const cta_span &sp,
                                        int pre, pipe_pos &pp, const int *sb,
                                        moek_item *info, int c0, int c1,
                                        bool sk, int ticket0)
{
    using C = tile_cfg<BN, L>;
    constexpr int RN = N / 16; /* token rows per thread */
    const T *b = reinterpret_cast<const T *>(a.b);
    const int tid = threadIdx.x, c8 = tid & 7, r0 = tid >> 3;
    /* Item it's token rows for this thread (through b_rows), or -1 past
     * its mlen. */
    const auto rows_of = [&](const moek_item &it, int (&rows)[RN]) {
#pragma unroll
        for (int i = 0; i < RN; i++) {
            const int r = r0 + 16 * i;
            rows[i] = -1;
            if (r < it.mlen) {
                const int p = it.pos + r;
                rows[i] = a.b_rows ? a.b_rows[p] : p;
            }
        }
    };
    /* One item (DEP 2: once dep[it.g] reaches need). Decode tiles (one
     * class) read the item's token-row indices here, after its first
     * weight load has gone out, so that load does not wait for their round
     * trip; prefill tiles read them one item ahead (take, below). */
    constexpr bool LATE_ROWS = moek_classes(BN) == 1;
    static_assert(DEP != 2 || LATE_ROWS, "ticketed GEMM 2 is one class");
    /* The next item's reads (cta_span::take). 16-row tiles send them once
     * the item's first weight load has gone out (one()'s `late`, the
     * item's index), so that load does not wait for the code that sends
     * them: qwen3 T=1 0.5-0.8 us (1.5-2.5%), qwen3 T=64 0.5-0.6% and
     * deepseek T=8 0.2-1.2% faster; at 32-row tiles mixtral T=64 0.3% and
     * at 64-row ones qwen3 T=512 2.2% slower (RESULTS.md, run 37). */
    constexpr bool LATE_FETCH = N == 16;
    moek_item_src nx = {};
    /* the time of this producer's last load (traced builds) */
    unsigned long long t_last = moek_trace_clock();
    (void)t_last;
    const auto one = [&](const moek_item &it, int (&rows)[RN], int need,
                         int late) {
        long long off[RN];
        const auto offsets = [&] {
#pragma unroll
            for (int i = 0; i < RN; i++)
                off[i] = rows[i] < 0 ? -1 : (long long)rows[i] * a.ldb;
        };
        if constexpr (!LATE_ROWS)
            offsets();
        for (int kb = it.kb0; kb < it.kb1; kb++, pp.advance(C::STAGES)) {
            uint8_t *sA = smem + pp.stage * C::STAGE;
            uint8_t *sB = sA + C::A_ALL;
            if (pp.used >= pre) {
                const unsigned long long t0 =
                    kb == it.kb0 ? moek_trace_clock() : 0;
                moek_mbar_wait(&empty[pp.stage], pp.phase ^ 1);
                (void)t0;
                if (tid == 0) {
                    /* The item's first stage: its entry goes before the
                     * arrival (a release) the consumers wait on. Pre-issued
                     * stages had theirs written by preissue. */
                    if (ring(BN, 1, DEP) && kb == it.kb0)
                        info[pp.items % INFO_ITEMS] = it;
                    if (pp.used == 0)
                        moek_trace_gemm(a.which, MOEK_TR_FIRST, 1);
                    if (kb == it.kb0)
                        moek_trace_item(a.which, MOEK_TR_ISSUE, pp.items,
                                        (int)(t0 - t_last),
                                        (int)(moek_trace_clock() - t0));
                    moek_mbar_expect_tx(&full[pp.stage], C::A_ALL);
                    load_ws<BN>(a, tmap, sA, it, kb, &full[pp.stage]);
                    t_last = moek_trace_clock();
                }
            }
            if constexpr (LATE_FETCH)
                if (late >= 0 && kb == it.kb0)
                    sp.fetch_next(a, ncg, late, sb, nx);
            if constexpr (LATE_ROWS) {
                if (kb == it.kb0) {
                    rows_of(it, rows);
                    offsets();
                }
            }
            if constexpr (DEP == 2) {
                /* the item's rows are GEMM 1's output for its group: one
                 * thread polls, the barrier passes its acquire on */
                if (kb == it.kb0) {
                    if (tid == 0)
                        moek_dep_wait(a.dep + MOEK_DEP_GROUP + it.g, need);
                    asm volatile("bar.sync 4, 128;" ::: "memory");
                }
            }
            const int kcol = kb * MOEK_KTILE + c8 * 8;
            const bool kok = kcol < a.k;
#pragma unroll
            for (int i = 0; i < N / 16; i++) {
                const int r = r0 + 16 * i;
                const bool ok = kok && off[i] >= 0;
                const T *src = ok ? b + off[i] + kcol : b;
                cp_async_16(sB + r * 128 + ((c8 ^ (r & 7)) << 4), src,
                            ok ? 16 : 0);
            }
            cp_async_arrive_noinc(&full[pp.stage]);
        }
        if constexpr (LATE_FETCH)
            if (late >= 0 && it.kb0 >= it.kb1)
                sp.fetch_next(a, ncg, late, sb, nx);
    };
    if constexpr (DEP != 2) {
        nx = sp.fetch_first(a, ncg, sb);
        /* item idx (from nx, which it refills) and its rows */
        const auto take = [&](int idx, moek_item &it, int (&rows)[RN]) {
            it = sp.take(a, ncg, split, idx, sb, nx);
            rows_of(it, rows);
        };
        if constexpr (moek_classes(BN) > 1) {
            /* Prefill tiles read the next item's rows as an item starts.
             * Read as the item itself starts, they can wait behind the
             * cp.async of the stages in flight: the item's first stage
             * went out 4 us after the item before's last MMA (qwen3
             * T=4096), and reading ahead made qwen3 T=1024 and T=4096
             * 1.2-1.5% faster (RESULTS.md, run 29). Decode tiles, whose
             * first item would wait for the second's reads, measured 1-2
             * us slower so. */
            moek_item it = {};
            int rows[RN];
            if (sp.first < sp.end)
                take(sp.first, it, rows);
            for (int idx = sp.first; idx < sp.end;
                 idx += sp.step, pp.items++) {
                moek_item next = {};
                int next_rows[RN];
                if (idx + sp.step < sp.end)
                    take(idx + sp.step, next, next_rows);
                one(it, rows, 0, -1);
                it = next;
#pragma unroll
                for (int i = 0; i < RN; i++)
                    rows[i] = next_rows[i];
            }
        } else {
            for (int idx = sp.first; idx < sp.end;
                 idx += sp.step, pp.items++) {
                int rows[RN]; /* LATE_ROWS: one() reads them */
                if constexpr (LATE_FETCH)
                    one(sp.item(a, split, idx, nx), rows, 0, idx);
                else
                    one(sp.take(a, ncg, split, idx, sb, nx), rows, 0, -1);
            }
        }
    } else {
        /* Thread 0 takes the units for the warpgroup and passes each on
         * through shared memory (the second barrier keeps the next from
         * overwriting it before all have read it). It takes the next unit
         * as this one starts, so the add's round trip passes meanwhile;
         * the first (ticket0) it took in the kernel's prologue, or (-1)
         * takes here. */
        int *ticket = reinterpret_cast<int *>(info + INFO_ITEMS);
        int *counter = a.dep + MOEK_DEP_TICKET;
        const int n = unit_count(c0, c1, sk);
        if (tid == 0)
            *ticket = ticket0 >= 0 ? ticket0 : atomicAdd(counter, 1);
        for (;;) {
            asm volatile("bar.sync 4, 128;" ::: "memory");
            const int u = *ticket;
            asm volatile("bar.sync 4, 128;" ::: "memory");
            if (u >= n)
                break;
            int next = 0;
            if (tid == 0)
                next = atomicAdd(counter, 1);
            const cta_span us = unit_span(c0, c1, sk, a.kblocks, u, n);
            for (int idx = us.first; idx < us.end; idx++, pp.items++) {
                const moek_item_src f = moek_fetch_item(a, ncg, idx, sb);
                moek_item it = moek_item_from(a, split, f);
                us.clip(it, idx, a.kblocks);
                int rows[RN]; /* LATE_ROWS: one() reads them */
                /* GEMM 1's two consumer warpgroups count each of the
                 * group's items: its token tiles (the same tile as here)
                 * times GEMM 1's weight tiles (GEMM 1 never splits K) */
                one(it, rows, 2 * moek_token_tiles(f.cnt, a.bn) * a.dep_tiles,
                    -1);
            }
            if (tid == 0)
                *ticket = next;
        }
        /* The end mark: an entry with no K blocks, on a stage's full
         * barrier that every producer thread arrives on without data. */
        if (pp.used >= pre)
            moek_mbar_wait(&empty[pp.stage], pp.phase ^ 1);
        if (tid == 0) {
            moek_item e = {};
            e.kb0 = e.kb1 = 0;
            info[pp.items % INFO_ITEMS] = e;
        }
        moek_mbar_arrive(&full[pp.stage]);
        if (tid == 0)
            moek_mbar_arrive(&full[pp.stage]);
    }
}

/* Producer of cluster mode, one tile class (the CTA's items sp), run by
 * warp 0 (lane 0 issues): the weight tiles as in produce(), and this CTA's
 * half of the N token rows (contiguous rows of a.b from it.pos: the caller
 * permuted them) as one box of N / 2 rows (tmap_b, the class's map),
 * multicast to both CTAs. Rows past the item's mlen belong to another
 * group or lie past the tensor (zero): the epilogue skips those columns. */
template <int BN, int N, bool HAND>
__device__ __forceinline__ void produce_mc(const moek_gemm_args &a,
                                           const CUtensorMap *tmap,
                                           const CUtensorMap *tmap_b,
                                           uint8_t *smem, uint64_t *full,
                                           uint64_t *empty, int ncg,
                                           const cta_span &sp, int pre,
                                           pipe_pos &pp, const int *sb,
                                           moek_item *info, uint32_t rank)
{
    using C = tile_cfg<BN>;
    constexpr int HALF = N / 2;
    static_assert(HALF % 8 == 0, "token tile halves of whole swizzle atoms");
    /* pp.items numbers the items for the trace alone; t_last: the time
     * of this producer's last load (traced builds) */
    unsigned long long t_last = moek_trace_clock();
    (void)t_last;
    for (int idx = sp.first; idx < sp.end; idx += sp.step, pp.items++) {
        const moek_item it = moek_decode_item(a, ncg, 1, idx, sb);
        for (int kb = it.kb0; kb < it.kb1; kb++, pp.advance(C::STAGES)) {
            uint8_t *sA = smem + pp.stage * C::STAGE;
            uint8_t *sB = sA + C::A_ALL;
            const unsigned long long t0 =
                kb == it.kb0 ? moek_trace_clock() : 0;
            (void)t0;
            if (pp.used >= pre)
                moek_mbar_wait(&empty[pp.stage], pp.phase ^ 1);
            if (threadIdx.x == 0) {
                if (pp.used >= pre) {
                    /* the item's entry before the arrival (a release) the
                     * consumers wait on; pre-issued items' by preissue */
                    if (HAND && kb == it.kb0)
                        info[pp.items % INFO_ITEMS] = it;
                    if (kb == it.kb0)
                        moek_trace_item(a.which, MOEK_TR_ISSUE, pp.items,
                                        (int)(t0 - t_last),
                                        (int)(moek_trace_clock() - t0));
                    moek_mbar_expect_tx(&full[pp.stage], C::A_ALL + N * 128);
                    load_ws<BN>(a, tmap, sA, it, kb, &full[pp.stage]);
                } else {
                    moek_mbar_expect_tx(&full[pp.stage], N * 128);
                }
                const int r = (int)rank * HALF;
                tma_load_2d_mc(sB + r * 128, tmap_b, kb * MOEK_KTILE,
                               it.pos + r, &full[pp.stage], 3);
                t_last = moek_trace_clock();
            }
            __syncwarp();
        }
    }
}

/* Four 8x8 b16 matrices from the mma fragment layout (thread l: row l / 4,
 * columns 2 (l % 4) + {0, 1}), stored transposed: lanes 8m .. 8m + 7 give
 * the addresses of rows 0..7 of matrix m's transpose. */
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0,
                                                  uint32_t r1, uint32_t r2,
                                                  uint32_t r3)
{
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], "
                 "{%1, %2, %3, %4};" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

/* SiLU(gate) * up of the accumulators' 8-column group j (fragment rows r
 * and r + 8: a feature's gate and up), packed as two T. */
template <typename T>
__device__ __forceinline__ uint32_t swiglu_pack(const float *d, int j)
{
    return moek_dt<T>::pack2(moek_silu(d[j * 4 + 0]) * d[j * 4 + 2],
                             moek_silu(d[j * 4 + 1]) * d[j * 4 + 3]);
}

/* stmatrix_x4_trans's two-matrix form: lanes 8m .. 8m + 7 (m < 2) give
 * the row addresses. */
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0,
                                                  uint32_t r1)
{
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], "
                 "{%1, %2};" ::"r"(addr),
                 "r"(r0), "r"(r1)
                 : "memory");
}

/* A pass of a staged epilogue (consumer warpgroup cw) opens once the
 * previous pass's stores have read the buffer, and closes by storing its
 * whole 8-row groups through TMA (omap; buffer rows of ROW_BYTES, features
 * from f0, output rows from row0), one box per thread, while the threads
 * store the last rows % 8 themselves: stage_store returns where those
 * start. The buffer was written through the generic proxy, which TMA
 * reads through the async one: hence the fence. */
__device__ __forceinline__ void stage_open(int cw)
{
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
}

template <int ROW_BYTES>
__device__ __forceinline__ int stage_store(const CUtensorMap *omap,
                                           uint8_t *buf, int cw, int f0,
                                           int row0, int rows)
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
    const int tid = threadIdx.x & 127;
    const int boxes = rows > 0 ? rows >> 3 : 0;
    if (tid < boxes) {
        tma_store_2d(omap, buf + tid * 8 * ROW_BYTES, f0, row0 + tid * 8);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    return boxes * 8;
}

/*
 * SWIGLU epilogue through shared memory (consumer warpgroup cw, tiles of 128
 * rows and wider; h: which 64-row half of weight tile it.nt the
 * accumulators d hold, cw itself but where a warpgroup has a whole tile,
 * moek_wtiles). Warp w holds SiLU(gate) * up of features f0 + 8 w .. + 7
 * for every token column; written directly that is one 2-byte store per
 * value, 64 per thread, and the stores kept the tensor pipe idle for 12% of
 * mixtral T=4096 (RESULTS.md, run 11). Here each pass of up to 128 token
 * columns goes to a [token][32 features] buffer with stmatrix (the
 * transpose, 64-byte rows, 16-byte chunks swizzled by (row / 2) % 4 so the
 * eight rows of a matrix fall in distinct banks: TMA's 64-byte swizzle,
 * the buffer being 1024-byte aligned), and TMA stores it in boxes of 8
 * token rows (omap: the output's map, clipped at n_valid and at its last
 * row), issued by one thread each, so the consumers go back to their K
 * loop while the bytes leave, and the stores do not queue behind the
 * producer's cp.async in the load/store unit. A box must not reach past
 * the item's mlen (those rows are the next group's): the last mlen % 8
 * rows go by plain 16-byte stores, one token row per thread. n_valid (I)
 * and ldo (I) are multiples of 8 on CUDA (check_moe_shape), so a 16-byte
 * chunk of features is either all valid or all past the end. The buffer is
 * written again only after its stores have read it (wait_group.read at
 * the next pass); the consumers wait for the stores themselves as they
 * finish (consume).
 */
template <typename T, int N>
__device__ __forceinline__ void epi_swiglu_staged(const moek_gemm_args &a,
                                                  const CUtensorMap *omap,
                                                  const moek_item &it,
                                                  const float *d, int cw,
                                                  int h, uint8_t *buf)
{
    static_assert(N % 16 == 0, "token tiles of whole 16-column steps");
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const int f0 = it.nt * (MOEK_WTILE / 2) + h * 32;
    const uint32_t base = moek_smem_u32(buf);
#pragma unroll
    for (int p0 = 0; p0 < N; p0 += EPI_ROWS) {
        const int pr = N - p0 < EPI_ROWS ? N - p0 : EPI_ROWS;
        stage_open(cw);
#pragma unroll
        for (int g = 0; g < pr / 32; g++) {
            uint32_t r[4];
#pragma unroll
            for (int m = 0; m < 4; m++)
                r[m] = swiglu_pack<T>(d, (p0 + g * 32) / 8 + m);
            const int row = (g * 4 + (lane >> 3)) * 8 + (lane & 7);
            stmatrix_x4_trans(base + row * 64 + ((warp ^ ((row >> 1) & 3)) << 4),
                              r[0], r[1], r[2], r[3]);
        }
        if constexpr (N % 32 != 0) {
            /* The last pass's last 16 token columns (N an odd multiple of
             * 16): two matrices, whose rows lanes 0..15 give. */
            if (p0 + pr == N) {
                const int j = (N - 16) / 8;
                const int row = (pr - 16) + (lane & 15);
                stmatrix_x2_trans(base + row * 64 +
                                      ((warp ^ ((row >> 1) & 3)) << 4),
                                  swiglu_pack<T>(d, j),
                                  swiglu_pack<T>(d, j + 1));
            }
        }
        const int rows = it.mlen - p0 < pr ? it.mlen - p0 : pr;
        const int boxed = stage_store<64>(omap, buf, cw, f0, it.pos + p0, rows);
        if (tid >= boxed && tid < rows) {
            T *dst = reinterpret_cast<T *>(a.out) +
                     (size_t)(it.pos + p0 + tid) * a.ldo + f0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if (f0 + k * 8 >= a.n_valid)
                    break;
                const uint4 v = *reinterpret_cast<const uint4 *>(
                    buf + tid * 64 + ((k ^ ((tid >> 1) & 3)) << 4));
                *reinterpret_cast<uint4 *>(dst + k * 8) = v;
            }
        }
    }
}

/*
 * SLOT epilogue through shared memory (consumer warpgroup cw, half h of
 * weight tile it.nt, tiles of 128 rows and wider), as epi_swiglu_staged:
 * the weighted rows of up to 64 token columns per pass go to a [token][64
 * features] buffer (128-byte rows, 16-byte chunks swizzled by row % 8:
 * TMA's 128-byte swizzle), then
 * out by TMA in boxes of 8 token rows (omap), the last mlen % 8 rows by
 * plain stores, one 16-byte chunk per thread. A thread holds, for token
 * columns c and c + 1, output features 2i and 2i + 1 of its warp's 16 (i =
 * lane / 4: the weight layout pairs adjacent features, moek_epi_pair), so
 * it writes one 32-bit word per column; with the swizzle the 32 lanes of a
 * store hit 32 banks. stg: the item's (token, weight) pairs by column.
 */
template <typename T, int N>
__device__ __forceinline__ void epi_slot_staged(const moek_gemm_args &a,
                                                const CUtensorMap *omap,
                                                const moek_item &it,
                                                const float *d, int cw,
                                                int h, uint8_t *buf,
                                                const int2 *stg)
{
    constexpr int PR = EPI_ROWS * 64 / 128; /* token rows per pass */
    static_assert(N % 8 == 0, "token tiles of whole 8-column steps");
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const int f0 = it.nt * MOEK_WTILE + h * 64;
    const int i = lane >> 2, q = lane & 3;
    const int chunk = 2 * warp + (i >> 2), word = (i & 3) * 4;
#pragma unroll
    for (int p0 = 0; p0 < N; p0 += PR) {
        const int pr = N - p0 < PR ? N - p0 : PR;
        /* the stores of the pass before have read the buffer; the pairs
         * of this item are in stg */
        stage_open(cw);
#pragma unroll
        for (int jj = 0; jj < PR / 8; jj++) {
            const int j = p0 / 8 + jj;
            if (j >= N / 8)
                break;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int c = j * 8 + 2 * q + e, r = c - p0;
                const float w = __int_as_float(stg[c].y);
                *reinterpret_cast<uint32_t *>(
                    buf + r * 128 + ((chunk ^ (r & 7)) << 4) + word) =
                    moek_dt<T>::pack2(w * d[j * 4 + e], w * d[j * 4 + 2 + e]);
            }
        }
        const int rows = it.mlen - p0 < pr ? it.mlen - p0 : pr;
        const int boxed =
            stage_store<128>(omap, buf, cw, f0, it.pos + p0, rows);
        const int r = boxed + (tid >> 3), k = tid & 7;
        if (r < rows && f0 + k * 8 < a.n_valid)
            *reinterpret_cast<uint4 *>(reinterpret_cast<T *>(a.out) +
                                       (size_t)(it.pos + p0 + r) * a.ldo +
                                       f0 + k * 8) =
                *reinterpret_cast<const uint4 *>(buf + r * 128 +
                                                 ((k ^ (r & 7)) << 4));
    }
}

/* A consumer warp is done with stage s: in cluster mode the peer's producer
 * may refill it (its multicast writes here) only once both CTAs released it.
 * Lane 0 arrives for the warp: a plain shared-memory read by the other
 * lanes that the producer may overwrite after this release needs a warp
 * sync before it (the item ring's, in consume). A sync in here, per stage,
 * made qwen3 and mixtral T=4096 0.5-0.7% slower (RESULTS.md, run 38). */
template <int CL>
__device__ __forceinline__ void release(uint64_t *empty, int s)
{
    moek_mbar_arrive(&empty[s]);
    if (CL == 2)
        mbar_arrive_peer(&empty[s], cluster_rank() ^ 1);
}

/* Post item n's group g (-1: the end) to the counting warp; one thread
 * of each consumer warpgroup, after the warpgroup's barrier. */
__device__ __forceinline__ void sig_post(sig_ring *r, int n, int cw, int g)
{
    const int j = n % SIG_SLOTS;
    moek_mbar_wait(&r->empty[j], ((n / SIG_SLOTS) & 1) ^ 1);
    if (cw == 0)
        r->g[j] = g;
    moek_mbar_arrive(&r->full[j]);
}

/* The counting warp: each posted item's count, for both warpgroups. */
__device__ __forceinline__ void sig_counts(const moek_gemm_args &a,
                                           sig_ring *r)
{
    const int lane = threadIdx.x & 31;
    for (int n = 0;; n++) {
        const int j = n % SIG_SLOTS;
        moek_mbar_wait(&r->full[j], (n / SIG_SLOTS) & 1);
        /* lane 0 reads the slot before its release frees it; the others
         * take the group from lane 0 */
        int g = 0;
        if (lane == 0)
            g = r->g[j];
        g = __shfl_sync(0xffffffffu, g, 0);
        if (g < 0)
            return;
        if (lane == 0) {
            moek_dep_add(a.dep + MOEK_DEP_GROUP + g, 2);
            moek_mbar_arrive(&r->empty[j]);
        }
        __syncwarp();
    }
}

/* Consumer warpgroup cw, one tile class: weight rows 64 cw .. 64 cw + 63 of
 * each tile against its N token rows, then the epilogue; where a CTA takes
 * two weight tiles (moek_wtiles), all 128 rows of tile nt + cw, as two
 * 64-row halves in accumulators d and d1, each with its own epilogue.
 * COMBINE and SLOT: the item's (token, routing weight) pairs (SLOT needs
 * only the weight) are loaded before its K loop and put in shared memory
 * after it, so the epilogue's atomics do not each wait on two
 * dependent global loads (measured: qwen3 T=4096 down GEMM 473 -> 348 us
 * without those loads); two buffers by item parity, one warpgroup barrier
 * per item. */
template <typename T, int BN, int N, int CL, int DEP, int L = DEP,
          bool HAND = false>
__device__ __forceinline__ void consume(const moek_gemm_args &a, uint8_t *smem,
                                        uint64_t *full, uint64_t *empty,
                                        int ncg, int split, const cta_span &sp,
                                        pipe_pos &pp, const int *sb,
                                        uint8_t *epi_buf, const moek_item *info,
                                        const CUtensorMap *omap, sig_ring *sig)
{
    using C = tile_cfg<BN, L>;
    constexpr bool RING = ring(BN, CL, DEP, HAND);
    constexpr int W = moek_wtiles(BN);
    static_assert(W == 1 || DEP == 0, "two weight tiles: no moek_dep");
    const int tid = threadIdx.x, cw = (tid >> 7) - 1;
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    float d[N / 2], d1[W == 2 ? N / 2 : 1];
    int nsig = 0; /* DEP 1: items thread 0 of cw posted to the counting warp */
    /* COMBINE and SLOT: the routing weight, staged with the token */
    const bool comb = a.epi == MOEK_EPI_COMBINE || a.epi == MOEK_EPI_SLOT;
    int2 *stg_base = reinterpret_cast<int2 *>(empty + C::STAGES) + cw * 2 * BN;
    moek_item_src nx = {};
    if constexpr (!RING)
        nx = sp.fetch_first(a, ncg, sb);
    for (int idx = sp.first; DEP == 2 || idx < sp.end;
         idx += sp.step, pp.items++) {
        if (tid == 128 && pp.items > 0) /* the item before's epilogue */
            moek_trace_item(a.which, MOEK_TR_EPI_END, pp.items - 1);
        moek_item it;
        if constexpr (RING) {
            /* The producer wrote the item's entry before its first stage's
             * arrival: no decode here (it cost the consumers a third of
             * qwen3 T=512's down GEMM, by ncu's samples). Ticketed, its end
             * mark has no K blocks. */
            moek_mbar_wait(&full[pp.stage], pp.phase);
            it = info[pp.items % INFO_ITEMS];
            /* Every lane's read of the entry before lane 0 next releases
             * a stage: the producer rewrites it INFO_ITEMS items on
             * (release(); racecheck reports the ring with and without
             * this sync: RESULTS.md, run 38). */
            __syncwarp();
            if constexpr (DEP == 2)
                if (it.kb0 >= it.kb1)
                    break;
        } else {
            it = sp.take(a, ncg, split, idx, sb, nx); /* one item ahead */
        }
        int2 *stg = stg_base + (pp.items & 1) * BN;
        constexpr int PC = (N + 127) / 128;
        int2 pair[PC];
        if (comb) {
#pragma unroll
            for (int u = 0; u < PC; u++) {
                const int c = (tid & 127) + 128 * u;
                if (c < it.mlen)
                    pair[u] = make_int2(
                        a.epi == MOEK_EPI_SLOT ? 0
                                               : __ldg(a.pos_token + it.pos + c),
                        __float_as_int(__ldg(a.pos_weight + it.pos + c)));
            }
        }
#pragma unroll
        for (int i = 0; i < N / 2; i++)
            d[i] = 0.f;
        if constexpr (W == 2) {
#pragma unroll
            for (int i = 0; i < N / 2; i++)
                d1[i] = 0.f;
        }
        int prev = -1;
        for (int kb = it.kb0; kb < it.kb1; kb++, pp.advance(C::STAGES)) {
            moek_mbar_wait(&full[pp.stage], pp.phase);
            if (tid == 128 && kb == it.kb0)
                moek_trace_item(a.which, MOEK_TR_ITEM, pp.items, it.g,
                                it.kb1 - it.kb0);
            /* The token rows were written by cp.async (generic proxy);
             * wgmma reads through the async proxy. */
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            uint8_t *sA = smem + pp.stage * C::STAGE +
                          cw * (W == 2 ? A_BYTES : A_BYTES / 2);
            uint8_t *sB = smem + pp.stage * C::STAGE + C::A_ALL;
            const uint64_t da = smem_desc(sA), db = smem_desc(sB);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < MOEK_KTILE / 16; kk++)
                moek_wgmma<T, N>::mma(d, da + 2 * kk, db + 2 * kk);
            if constexpr (W == 2) {
                const uint64_t da1 = smem_desc(sA + A_BYTES / 2);
#pragma unroll
                for (int kk = 0; kk < MOEK_KTILE / 16; kk++)
                    moek_wgmma<T, N>::mma(d1, da1 + 2 * kk, db + 2 * kk);
            }
            wgmma_commit();
            wgmma_wait<1>();
            if (prev >= 0 && lane == 0)
                release<CL>(empty, prev);
            prev = pp.stage;
        }
        wgmma_wait<0>();
        if (tid == 128)
            moek_trace_item(a.which, MOEK_TR_ITEM_END, pp.items, it.g);
        if (tid == 256)
            moek_trace_item(a.which, MOEK_TR_ITEM_END1, pp.items, it.g);
        if (prev >= 0 && lane == 0)
            release<CL>(empty, prev);
        if (comb) {
#pragma unroll
            for (int u = 0; u < PC; u++) {
                const int c = (tid & 127) + 128 * u;
                if (c < it.mlen)
                    stg[c] = pair[u];
            }
        }
        /* The accumulators dd of half h of weight tile iw.nt. */
        const auto epilogue = [&](const float *dd, int h,
                                  const moek_item &iw) {
            if constexpr (C::EPI_BYTES > 0) {
                /* moek_dep's count would need the TMA stores complete */
                static_assert(DEP != 1, "moek_dep counts plain stores only");
                if (a.epi == MOEK_EPI_SWIGLU) {
                    epi_swiglu_staged<T, N>(a, omap, iw, dd, cw, h,
                                            epi_buf + cw * EPI_ROWS * 64);
                    return;
                }
                if (a.epi == MOEK_EPI_SLOT) {
                    epi_slot_staged<T, N>(a, omap, iw, dd, cw, h,
                                          epi_buf + cw * EPI_ROWS * 64, stg);
                    return;
                }
            }
            const int R_lo =
                iw.nt * MOEK_WTILE + h * 64 + warp * 16 + (lane >> 2);
            const int c0 = 2 * (lane & 3);
            if (comb) {
                /* This warpgroup's staged pairs are all written. Lanes l
                 * and l ^ 4 hold features 2r, 2r + 1 and 2r + 2, 2r + 3 (r
                 * = l / 4 even) of token columns c0 and c0 + 1: they swap a
                 * column's pair, so each adds four adjacent features of
                 * one token. */
                asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
                const bool odd = (lane >> 2) & 1;
                const int f = (R_lo >> 4) * 16 + 2 * ((lane >> 2) & 6);
#pragma unroll
                for (int j = 0; j < N / 8; j++) {
                    /* By value: a pointer into d would put the accumulators
                     * in local memory, where the asynchronous wgmma cannot
                     * write. */
                    const float q0 = dd[j * 4], q1 = dd[j * 4 + 1],
                                q2 = dd[j * 4 + 2], q3 = dd[j * 4 + 3];
                    const float sx =
                        __shfl_xor_sync(0xffffffffu, odd ? q0 : q1, 4);
                    const float sy =
                        __shfl_xor_sync(0xffffffffu, odd ? q2 : q3, 4);
                    moek_combine4<T>(a, iw, f, j * 8 + c0 + odd,
                                     odd ? make_float4(sx, sy, q1, q3)
                                         : make_float4(q0, q2, sx, sy),
                                     stg);
                }
                return;
            }
#pragma unroll
            for (int j = 0; j < N / 8; j++) {
                moek_epi_pair<T>(a, iw, R_lo, j * 8 + c0, dd[j * 4 + 0],
                                 dd[j * 4 + 2]);
                moek_epi_pair<T>(a, iw, R_lo, j * 8 + c0 + 1, dd[j * 4 + 1],
                                 dd[j * 4 + 3]);
            }
        };
        moek_item iw = it;
        iw.nt += W == 2 ? cw : 0;
        epilogue(d, W == 2 ? 0 : cw, iw);
        if constexpr (W == 2)
            epilogue(d1, 1, iw);
        if constexpr (DEP == 1) { /* every thread's stores before the count */
            asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
            if ((tid & 127) == 0) {
                if (a.sig)
                    sig_post(sig, nsig++, cw, it.g);
                else
                    moek_dep_add(a.dep + MOEK_DEP_GROUP + it.g, 1);
            }
        }
    }
    if constexpr (DEP == 1)
        if ((tid & 127) == 0 && a.sig)
            sig_post(sig, nsig, cw, -1);
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* f(class) for each token-tile class of instance BN, the class a
 * compile-time constant (std::integral_constant) so each gets its own
 * wgmma shape. */
template <int BN, typename F> __device__ __forceinline__ void each_class(F &&f)
{
    static_assert(MOEK_CLASSES == 4, "each_class spells out four classes");
    f(std::integral_constant<int, 0>());
    if constexpr (moek_classes(BN) > 1) {
        f(std::integral_constant<int, 1>());
        f(std::integral_constant<int, 2>());
        f(std::integral_constant<int, 3>());
    }
}
#endif

/* Cluster mode's token-row maps, one per class (moek_tmaps); a single
 * unused map otherwise, so decode launches carry no more than they use. */
template <int CL>
using tmaps_b_t = std::conditional_t<CL == 2, moek_tmaps, CUtensorMap>;

/* The output map of SWIGLU and SLOT (epi_swiglu_staged, epi_slot_staged)
 * for the instances that stage them (tiles of 128 rows and wider); nothing
 * for the others. */
struct no_map {};
template <int BN>
using omap_t =
    std::conditional_t<(BN >= MOEK_STAGED_MIN_TILE), CUtensorMap, no_map>;
[[maybe_unused]] __device__ __forceinline__ const CUtensorMap *
omap_ptr(const CUtensorMap &m)
{
    return &m;
}
[[maybe_unused]] __device__ __forceinline__ const CUtensorMap *
omap_ptr(const no_map &)
{
    return nullptr;
}

/* Mode 3's args: GEMM 1's (dep_mode 3) and GEMM 2's (dep_mode 2). */
struct gemm_pair {
    moek_gemm_args g1, g2;
};
template <int DEP>
using kargs_t = std::conditional_t<DEP == 3, gemm_pair, moek_gemm_args>;
__host__ __device__ __forceinline__ const moek_gemm_args &
first_args(const moek_gemm_args &a)
{
    return a;
}
__host__ __device__ __forceinline__ const moek_gemm_args &
first_args(const gemm_pair &p)
{
    return p.g1;
}
/* mode 3's GEMM 2 args (the one GEMM's, unused, otherwise) */
[[maybe_unused]] __host__ __device__ __forceinline__ const moek_gemm_args &
second_args(const moek_gemm_args &a)
{
    return a;
}
[[maybe_unused]] __host__ __device__ __forceinline__ const moek_gemm_args &
second_args(const gemm_pair &p)
{
    return p.g2;
}

template <typename T, int BN, int CL, int DEP, bool HAND>
__global__ void __launch_bounds__(cta_threads(DEP), 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tmap,
                      const __grid_constant__ tmaps_b_t<CL> tmaps_b,
                      const __grid_constant__ omap_t<BN> tmap_o,
                      const __grid_constant__ kargs_t<DEP> ka)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    /* moek_dep's modes: 1 counts (GEMM 1), 2 waits and takes tickets (GEMM
     * 2), 3 runs both (GEMM 1 as in 1, then GEMM 2 as in 2);
     * one class and no pairs (launch_t) */
    static_assert(DEP == 0 || (CL == 1 && moek_classes(BN) == 1), "moek_dep");
    const moek_gemm_args &a = first_args(ka), &a2 = second_args(ka);
    if constexpr (DEP == 1 || DEP == 3) /* its count follows SWIGLU's stores */
        if (a.epi != MOEK_EPI_SWIGLU)
            __trap();
    using C = tile_cfg<BN, DEP>;
    /* HAND: cluster mode's, whose tiles (128 rows and wider) have the ring */
    static_assert(!HAND || (CL == 2 && C::INFO >= INFO_BYTES), "HAND");
    if constexpr (C::EPI_BYTES == 0) /* SLOT goes through the staging */
        if (a.epi == MOEK_EPI_SLOT)
            __trap();
    constexpr int NC = moek_classes(BN);
    /* Items in runs of W (moek_wtiles): nt, nt + 1 of one token tile, as
     * the host lays them out (even weight-tile counts and chunks, no K
     * split; a K split traps below). */
    constexpr int W = moek_wtiles(BN);
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = reinterpret_cast<uint8_t *>(
        (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~(uintptr_t)1023);
    /* stages, the staging buffer of SWIGLU and SLOT (1024-byte aligned, as
     * TMA's swizzle wants), barriers, COMBINE's and SLOT's pairs,
     * cg_before, the item ring and mode 2's ticket, the counts' ring */
    uint8_t *epi_buf = smem + C::STAGES * C::STAGE;
    uint64_t *full = reinterpret_cast<uint64_t *>(epi_buf + C::EPI_BYTES);
    uint64_t *empty = full + C::STAGES;
    int *sb_mem = reinterpret_cast<int *>(
        reinterpret_cast<uint8_t *>(empty + C::STAGES) + C::STG_BYTES);
    moek_item *info = reinterpret_cast<moek_item *>(
        reinterpret_cast<uint8_t *>(sb_mem) + C::SBB);
    sig_ring *sig = nullptr;
    if constexpr (counts(DEP))
        sig = reinterpret_cast<sig_ring *>(
            (reinterpret_cast<uintptr_t>(info) + C::INFO + 7) & ~(uintptr_t)7);
    const int tid = threadIdx.x, wg = tid >> 7;

    if (tid == 0) {
        if constexpr (counts(DEP))
            for (int j = 0; j < SIG_SLOTS; j++) {
                moek_mbar_init(&sig->full[j], 2);
                moek_mbar_init(&sig->empty[j], 1);
            }
        for (int s = 0; s < C::STAGES; s++) {
            /* full: the producer's expect-tx arrival, plus (CL = 1) one
             * no-increment arrival per producer thread's cp.async;
             * empty: each consumer warp of the CTA (CL = 2: of both). */
            moek_mbar_init(&full[s], CL == 2 ? 1 : 1 + 128);
            moek_mbar_init(&empty[s], 8 * CL);
        }
        moek_mbar_init_fence();
        if (!a.w_tiled)
            asm volatile("prefetch.tensormap [%0];" ::"l"(
                             reinterpret_cast<uint64_t>(&tmap))
                         : "memory");
        if constexpr (CL == 2)
            for (int c = 0; c < NC; c++)
                asm volatile("prefetch.tensormap [%0];" ::"l"(
                                 reinterpret_cast<uint64_t>(&tmaps_b.m[c]))
                             : "memory");
    }
    __syncthreads();
    if (tid == 0) /* trace.cuh */
        moek_trace_gemm(a.which, MOEK_TR_ENTRY, 0);
    /* The peer multicasts into this CTA's stages and arrives on its
     * barriers: both must be initialised first. */
    if (CL == 2)
        cluster_sync();
    /* The tile list comes from the align kernel. With early_a it finished
     * before the previous kernel (which waited for it) let this one launch,
     * so only what GEMM 1 touches needs the waits below: the producer's
     * token rows, the accumulator the consumers add into, and slot mode's
     * rows, which the consumers store over the copy of x GEMM 1 reads
     * (layer.cu). */
    if (a.pf_kb > 0 && tid == 0)
        prefetch_guess(a);
    if constexpr (DEP != 2) /* mode 2 waits per item instead */
        if (!a.early_a) {
            moek_pdl_wait();
            if (tid == 0)
                moek_trace_gemm(a.which, MOEK_TR_WAITED, 3);
        }
    moek_pdl_trigger();

    /* What the first weight load waits for, read at once rather than one
     * after another: mode 2's first ticket, the plan, and every entry of
     * cg_before the list can have (a.groups + 1, within SB_GROUPS + 1),
     * before the plan says how many are in use (RESULTS.md, run 34). */
    int ticket0 = 0;
    if constexpr (DEP == 2)
        if (tid == 0)
            ticket0 = atomicAdd(a.dep + MOEK_DEP_TICKET, 1);
    /* mode 3: both GEMMs' lists, up to SB3_GROUPS groups */
    constexpr int SB_MAX = DEP == 3 ? SB3_GROUPS : SB_GROUPS;
    constexpr int SB_PER = (SB_MAX + 1 + 383) / 384;
    const int nsb = a.groups > 0 && a.groups <= SB_MAX ? a.groups + 1 : 0;
    int sbv[SB_PER], sbv2[DEP == 3 ? SB_PER : 1];
#pragma unroll
    for (int j = 0; j < SB_PER; j++) {
        /* the three warpgroups (not the counting warp) */
        const int i = tid < 384 ? tid + 384 * j : nsb;
        sbv[j] = i < nsb ? __ldg(a.cg_before + i) : 0;
        if constexpr (DEP == 3)
            sbv2[j] = i < nsb ? __ldg(a2.cg_before + i) : 0;
    }
    const int ncg = a.plan[MOEK_PLAN_NCG];
    const int split = a.plan[a.which ? MOEK_PLAN_SPLIT1 : MOEK_PLAN_SPLIT0];
    /* Class c's items are [cb[c], cb[c + 1]); the CTA's share of them is
     * its cta_span: grid-strided (blockIdx.x, blockIdx.x + gridDim.x, ...
     * running on through the classes) or stream-K. */
    const int *ends = a.plan + (a.which ? MOEK_PLAN_ENDS1 : MOEK_PLAN_ENDS0);
    int cb[NC + 1];
    cb[0] = 0;
#pragma unroll
    for (int c = 0; c < NC; c++)
        cb[c + 1] = ends[c];

    /* cg_before in shared memory for the items' binary search. Read in
     * the plan's round trip (above), it serves any count of groups; read
     * after it, a few groups (decode) searched global memory in three
     * steps or less instead (measured: qwen3 T=1 33.5 us without the copy,
     * 35.0 with it, when the copy was a round trip of its own). */
    const int *sb =
        ncg < nsb || (DEP != 3 && ncg > 8 && ncg <= SB_GROUPS) ? sb_mem
                                                               : nullptr;
    if (sb) {
        if (ncg < nsb) {
#pragma unroll
            for (int j = 0; j < SB_PER; j++)
                if (tid < 384 && tid + 384 * j <= ncg) {
                    sb_mem[tid + 384 * j] = sbv[j];
                    if constexpr (DEP == 3)
                        sb_mem[SB3_INTS + tid + 384 * j] = sbv2[j];
                }
        } else {
            for (int i = tid; i <= ncg; i += blockDim.x)
                sb_mem[i] = __ldg(a.cg_before + i);
        }
        __syncthreads();
    }
    if (tid == 0)
        moek_trace_gemm(a.which, MOEK_TR_LISTED, 4);

    /* Cluster mode pairs CTAs 2c and 2c + 1 on items 2i and 2i + 1 of an
     * even grid: with one K split and an even count of weight tiles per
     * chunk, those are weight tiles nt and nt + 1 of one token tile
     * (moek_decode_item), and both CTAs walk equally many items (with two
     * weight tiles a CTA, items 4i .. 4i + 3, counts and chunks multiples
     * of four). The host launches it only so (layer.cu); a plan with a K
     * split traps. */
    if ((CL == 2 || W > 1) && split != 1)
        __trap();
    /* Stream-K where its parts are summed: COMBINE's atomic adds (any
     * other epilogue would keep one part of each split item), one class,
     * no pairs, no K split; else whole items, grid-strided. */
    const auto stream_k = [](const moek_gemm_args &g, int s) {
        return g.stream_k && g.epi == MOEK_EPI_COMBINE && s == 1;
    };
    const bool sk = NC == 1 && CL == 1 && stream_k(a, split);
    const auto span = [&](int c) {
        return class_span(cb[c], cb[c + 1], sk, a.kblocks, W);
    };
    pipe_pos pp = {0, 0, 0, 0};
    /* mode 3's GEMM 2: its split, item count (one class) and list (global
     * when the groups did not fit shared memory) */
    int split2 = 1, items2 = 0;
    const int *sb2 = nullptr;
    bool sk2 = false;
    if constexpr (DEP == 3) {
        split2 = a.plan[MOEK_PLAN_SPLIT1];
        items2 = a.plan[MOEK_PLAN_ENDS1];
        sb2 = sb ? sb_mem + SB3_INTS : nullptr;
        sk2 = stream_k(a2, split2);
    }
    /* Two weight tiles a CTA hold twice the accumulators: the consumers
     * take registers from the producer (88 + 2 x 208 = 3 x 168, what 384
     * threads have; set at the top of each role's branch, so ptxas bounds
     * each role's code by its own count: set before the branch, it kept
     * 168 for both, spilled 1.6 KB and serialised every wgmma, C7512).
     * ptxas spills nothing at 88 / 208; at 72 / 216 the producer spills. */
    if (wg == 0) {
        if constexpr (W == 2)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 88;" ::: "memory");
        int pre = 0;
        /* ticketed, a CTA streams its own units at once */
        if (DEP != 2 && a.early_a) {
            int items = 0;
            for (int c = 0; c < NC; c++)
                pre = preissue<BN, CL, HAND>(a, &tmap, smem, full, ncg,
                                             split, span(c), pre, sb, info,
                                             items);
            moek_pdl_wait();
            if (tid == 0)
                moek_trace_gemm(a.which, MOEK_TR_WAITED, 3);
        }
        if constexpr (CL == 2) {
            /* Warp 0 walks the items, lane 0 issues; warps 1-3 wait at the
             * closing cluster barrier. */
            if (tid < 32) {
                const uint32_t rank = cluster_rank();
                each_class<BN>([&](auto c) {
                    constexpr int J = decltype(c)::value;
                    produce_mc<BN, moek_class_width(BN, J), HAND>(
                        a, &tmap, &tmaps_b.m[J], smem, full, empty, ncg,
                        span(J), pre, pp, sb, info, rank);
                });
            }
        } else if constexpr (DEP == 3) {
            /* GEMM 1's items strided by CTA as in mode 1, then GEMM 2's
             * units from its ticket, in one pipeline */
            produce<T, BN, BN, 1, 3>(a, &tmap, smem, full, empty, ncg, split,
                                     span(0), 0, pp, sb, info, cb[0], cb[1],
                                     false, 0);
            produce<T, BN, BN, 2, 3>(a2, &tmap, smem, full, empty, ncg,
                                     split2, span(0), 0, pp, sb2, info, 0,
                                     items2, sk2, -1);
        } else {
            each_class<BN>([&](auto c) {
                constexpr int J = decltype(c)::value;
                produce<T, BN, moek_class_width(BN, J), DEP>(
                    a, &tmap, smem, full, empty, ncg, split, span(J), pre, pp,
                    sb, info, cb[J], cb[J + 1], sk, ticket0);
            });
        }
    } else if (counts(DEP) && wg == 3) {
        if (a.sig)
            sig_counts(a, sig);
    } else {
        if constexpr (W == 2)
            asm volatile("setmaxnreg.inc.sync.aligned.u32 208;" ::: "memory");
        /* GEMM 2's consumers, whose COMBINE adds into the accumulator GEMM 1
         * zeroes (and whose SLOT stores go where GEMM 1 may read its copy
         * of x), wait for GEMM 1 themselves, not only through the
         * producer's token loads; GEMM 1 (never early_a) waited above. */
        if constexpr (DEP == 2) { /* one thread polls, as in produce() */
            if (tid == 128)
                moek_dep_wait(a.dep + MOEK_DEP_ZEROED, a.dep_ctas);
            asm volatile("bar.sync 3, 256;" ::: "memory");
        } else if (a.early_a) {
            moek_pdl_wait();
        }
        moek_zero_acc(a, tid - 128, 256);
        if constexpr (DEP == 1 || DEP == 3) { /* this CTA's slice is zero */
            asm volatile("bar.sync 3, 256;" ::: "memory");
            if (tid == 128)
                moek_dep_add(a.dep + MOEK_DEP_ZEROED, 1);
        }
        if constexpr (DEP == 3) {
            consume<T, BN, BN, 1, 1, 3>(a, smem, full, empty, ncg, split,
                                        span(0), pp, sb, epi_buf, info,
                                        nullptr, sig);
            /* GEMM 2 adds into acc once every CTA's slice is zero (all
             * resident: a cooperative launch) */
            if (tid == 128)
                moek_dep_wait(a.dep + MOEK_DEP_ZEROED, (int)gridDim.x);
            asm volatile("bar.sync 3, 256;" ::: "memory");
            consume<T, BN, BN, 1, 2, 3>(a2, smem, full, empty, ncg,
                                        split2, span(0), pp, sb2, epi_buf,
                                        info, nullptr, nullptr);
        } else {
            each_class<BN>([&](auto c) {
                constexpr int J = decltype(c)::value;
                consume<T, BN, moek_class_width(BN, J), CL, DEP, DEP, HAND>(
                    a, smem, full, empty, ncg, split, span(J), pp, sb,
                    epi_buf, info, omap_ptr(tmap_o), sig);
            });
        }
        /* the staged epilogues' TMA stores done before the CTA (and its
         * buffer) goes */
        if constexpr (C::EPI_BYTES > 0)
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        if (tid == 128)
            moek_trace_gemm(a.which, MOEK_TR_EXIT, 2);
    }
    /* The peer's last releases arrive on this CTA's barriers: stay until
     * both are done. */
    if (CL == 2)
        cluster_sync();
    /* Mode 2 ends after GEMM 1, as the kernels after it (which wait for
     * this one) expect. */
    if constexpr (DEP == 2)
        moek_pdl_wait();
#endif
}

/* tmap_o: the output's map, which SWIGLU from instances of 128 rows and
 * wider stores through (epi_swiglu_staged), and SLOT, which only those
 * instances run (epi_slot_staged); unused otherwise. */
template <typename T, int BN, int CL, int DEP = 0, bool HAND = false>
cudaError_t launch_bn(const void *tmap, const tmaps_b_t<CL> &tmaps_b,
                      const CUtensorMap *tmap_o, const kargs_t<DEP> &ka,
                      int grid, cudaStream_t stream, bool pdl)
{
    const moek_gemm_args &a = first_args(ka);
    omap_t<BN> o = {};
    if constexpr (BN >= MOEK_STAGED_MIN_TILE) {
        if (a.epi == MOEK_EPI_SWIGLU || a.epi == MOEK_EPI_SLOT) {
            if (!tmap_o)
                return cudaErrorInvalidValue;
            o = *tmap_o;
        }
    } else if (a.epi == MOEK_EPI_SLOT) {
        return cudaErrorInvalidValue;
    }
    return moek_launch_cl(gemm_wgmma_kernel<T, BN, CL, DEP, HAND>, dim3(grid),
                          dim3(cta_threads(DEP)),
                          (size_t)tile_cfg<BN, DEP>::SMEM, stream,
                          pdl, DEP == 3 ? -1 : CL,
                          *reinterpret_cast<const CUtensorMap *>(tmap),
                          tmaps_b, o, ka);
}

/* Cluster mode's instances: those that hand short items over (HAND) or the
 * others. */
template <typename T, int BN>
cudaError_t launch_cl(const void *tmap, const tmaps_b_t<2> &tb,
                      const CUtensorMap *to, const moek_gemm_args &a,
                      int grid, cudaStream_t stream, bool pdl)
{
    return a.kblocks <= CL_RING_MAX_KB
               ? launch_bn<T, BN, 2, 0, true>(tmap, tb, to, a, grid, stream, pdl)
               : launch_bn<T, BN, 2>(tmap, tb, to, a, grid, stream, pdl);
}

/* moek_dep's instances: tiles of one class, no pairs. */
template <typename T, int DEP>
cudaError_t launch_dep(const CUtensorMap &m, const kargs_t<DEP> &ka,
                       int grid, cudaStream_t stream, bool pdl)
{
    switch (first_args(ka).bn) {
    case 16: return launch_bn<T, 16, 1, DEP>(&m, m, nullptr, ka, grid, stream, pdl);
    case 32: return launch_bn<T, 32, 1, DEP>(&m, m, nullptr, ka, grid, stream, pdl);
    case 64: return launch_bn<T, 64, 1, DEP>(&m, m, nullptr, ka, grid, stream, pdl);
    default: return cudaErrorInvalidValue;
    }
}

template <typename T>
cudaError_t launch_t(const void *tmap, const moek_tmaps *tb,
                     const CUtensorMap *to, const moek_gemm_args &a, int grid,
                     cudaStream_t stream, bool pdl)
{
    /* A run must be the weight tiles of one token tile (layer.cu,
     * fit_tile and run_gemm): else it would take a tile of the next token
     * tile or group. */
    const int run = moek_run_items(a.bn, tb != nullptr);
    if (a.n_tiles % run != 0 || a.chunk % run != 0)
        return cudaErrorInvalidValue;
    if (tb) {
        if (tb->bn != a.bn)
            return cudaErrorInvalidValue;
        switch (a.bn) {
        case 128: return launch_cl<T, 128>(tmap, *tb, to, a, grid, stream, pdl);
        case 144: return launch_cl<T, 144>(tmap, *tb, to, a, grid, stream, pdl);
        case 192: return launch_cl<T, 192>(tmap, *tb, to, a, grid, stream, pdl);
        case 256: return launch_cl<T, 256>(tmap, *tb, to, a, grid, stream, pdl);
        default: return cudaErrorInvalidValue;
        }
    }
    const CUtensorMap &m = *reinterpret_cast<const CUtensorMap *>(tmap);
    if (a.dep_mode == 3) /* moek_launch_gemm_wgmma_both's */
        return cudaErrorInvalidValue;
    if (a.dep_mode == 1)
        return launch_dep<T, 1>(m, a, grid, stream, pdl);
    if (a.dep_mode == 2)
        return launch_dep<T, 2>(m, a, grid, stream, pdl);
    switch (a.bn) {
    case 16: return launch_bn<T, 16, 1>(tmap, m, to, a, grid, stream, pdl);
    case 32: return launch_bn<T, 32, 1>(tmap, m, to, a, grid, stream, pdl);
    case 64: return launch_bn<T, 64, 1>(tmap, m, to, a, grid, stream, pdl);
    case 128: return launch_bn<T, 128, 1>(tmap, m, to, a, grid, stream, pdl);
    case 144: return launch_bn<T, 144, 1>(tmap, m, to, a, grid, stream, pdl);
    case 192: return launch_bn<T, 192, 1>(tmap, m, to, a, grid, stream, pdl);
    case 256: return launch_bn<T, 256, 1>(tmap, m, to, a, grid, stream, pdl);
    default: return cudaErrorInvalidValue;
    }
}

template <typename T, int BN, int CL, int DEP = 0, bool HAND = false>
cudaError_t prepare_bn()
{
    return cudaFuncSetAttribute(gemm_wgmma_kernel<T, BN, CL, DEP, HAND>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                tile_cfg<BN, DEP>::SMEM);
}

/* launch_cl's two instances */
template <typename T, int BN> cudaError_t prepare_cl()
{
    const cudaError_t e = prepare_bn<T, BN, 2>();
    return e != cudaSuccess ? e : prepare_bn<T, BN, 2, 0, true>();
}

template <typename T, int DEP> cudaError_t prepare_dep()
{
    cudaError_t e;
    if ((e = prepare_bn<T, 16, 1, DEP>()) != cudaSuccess ||
        (e = prepare_bn<T, 32, 1, DEP>()) != cudaSuccess)
        return e;
    return prepare_bn<T, 64, 1, DEP>();
}

template <typename T> cudaError_t prepare_t()
{
    cudaError_t e;
    if ((e = prepare_bn<T, 16, 1>()) != cudaSuccess ||
        (e = prepare_bn<T, 32, 1>()) != cudaSuccess ||
        (e = prepare_bn<T, 64, 1>()) != cudaSuccess ||
        (e = prepare_bn<T, 128, 1>()) != cudaSuccess ||
        (e = prepare_bn<T, 144, 1>()) != cudaSuccess ||
        (e = prepare_bn<T, 192, 1>()) != cudaSuccess ||
        (e = prepare_bn<T, 256, 1>()) != cudaSuccess ||
        (e = prepare_cl<T, 128>()) != cudaSuccess ||
        (e = prepare_cl<T, 144>()) != cudaSuccess ||
        (e = prepare_cl<T, 192>()) != cudaSuccess ||
        (e = prepare_cl<T, 256>()) != cudaSuccess ||
        (e = prepare_dep<T, 1>()) != cudaSuccess ||
        (e = prepare_dep<T, 2>()) != cudaSuccess ||
        (e = prepare_dep<T, 3>()) != cudaSuccess)
        return e;
    return cudaSuccess;
}

} // namespace

bool moek_wgmma_tile_ok(int bn)
{
    static const int tiles[] = MOEK_CUDA_TOKEN_TILES;
    for (int t : tiles)
        if (t == bn)
            return true;
    return false;
}

cudaError_t moek_gemm_wgmma_prepare(moek_dtype dt)
{
    return dt == MOEK_DTYPE_BF16 ? prepare_t<__nv_bfloat16>()
                                 : prepare_t<__half>();
}

bool moek_wgmma_cluster_ok(int bn)
{
    return bn == 128 || bn == 144 || bn == 192 || bn == 256;
}

cudaError_t moek_launch_gemm_wgmma(moek_dtype dt, const void *tmap,
                                   const moek_tmaps *tmaps_b,
                                   const CUtensorMap *tmap_o,
                                   const moek_gemm_args &a, int grid,
                                   cudaStream_t stream, bool pdl)
{
    return dt == MOEK_DTYPE_BF16
               ? launch_t<__nv_bfloat16>(tmap, tmaps_b, tmap_o, a, grid,
                                         stream, pdl)
               : launch_t<__half>(tmap, tmaps_b, tmap_o, a, grid, stream, pdl);
}

bool moek_wgmma_both_ok(const moek_gemm_args &g1, const moek_gemm_args &g2)
{
    return g1.w_tiled && g2.w_tiled && g1.bn == g2.bn &&
           (g1.bn == 16 || g1.bn == 32 || g1.bn == 64) && g1.groups > 0 &&
           g1.groups <= SB3_GROUPS && g1.epi == MOEK_EPI_SWIGLU &&
           g2.epi == MOEK_EPI_COMBINE && g1.plan == g2.plan;
}

cudaError_t moek_launch_gemm_wgmma_both(moek_dtype dt, const moek_gemm_args &g1,
                                        const moek_gemm_args &g2, int grid,
                                        cudaStream_t stream, bool pdl)
{
    if (!moek_wgmma_both_ok(g1, g2) || g1.dep_mode != 3 || g2.dep_mode != 2)
        return cudaErrorInvalidValue;
    const gemm_pair p = {g1, g2};
    const CUtensorMap m = {}; /* tiled weights: no map */
    return dt == MOEK_DTYPE_BF16
               ? launch_dep<__nv_bfloat16, 3>(m, p, grid, stream, pdl)
               : launch_dep<__half, 3>(m, p, grid, stream, pdl);
}

MOEK_TRACE_UNIT(gemm)
