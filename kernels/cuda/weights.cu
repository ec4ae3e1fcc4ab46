/*
 * weights.cu: weights resident on the device, laid out once at load time for
 * the GEMM epilogues and the pipeline's loads.
 *
 * Layouts (row = one output feature of a K-major weight matrix; a GEMM tile
 * thread holds rows R and R + 8 of a 16-row block, see moek_epi_pair):
 *   w13  [E][2I][H]   block b of 16 rows = gate rows 8b..8b+7, then up rows
 *                     8b..8b+7, so a thread holds gate and up of the same
 *                     intermediate feature and applies SiLU(gate)*up itself;
 *   w2p  [E][H16][I]  row 16b + r = feature 16b + 2r, row 16b + 8 + r =
 *                     feature 16b + 2r + 1, so a thread holds two adjacent
 *                     output features (moek_epi_pair: one 8-byte atomic on
 *                     sm_90; the wgmma kernel pairs lanes for 16-byte
 *                     atomics of four, moek_combine4);
 *                     H16 = H rounded up to 16, the pad rows are zero;
 *   b    [G][N16][K]  the grouped GEMM's B, paired like w2p.
 * Rows and columns are then stored in tiles (moek_wt_index, cuda_common.cuh):
 * each 128-row x 64-column block contiguous and already swizzled, so the GEMM
 * loads a pipeline stage's weights with one bulk copy of 16 KB of contiguous
 * memory. Measured against the row-major layout read through a TMA map
 * (RESULTS.md): mixtral T=64 700 -> 669 us, deepseek T=64 4574 -> 4390 us;
 * MOEK_CUDA_ROW_MAJOR=1 keeps the row-major layout, for measuring.
 * The relayout kernel copies 16-byte vectors, one block per destination row.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <algorithm>
#include <new>

#include "cuda_common.cuh"

namespace {

enum { RELAYOUT_GATE_UP = 0, RELAYOUT_PAIRS = 1 };

/* tiles > 0: the destination is tiled (moek_wt_index) with `tiles` row
 * tiles per group, else row-major [groups][rows_dst][K]. */
__global__ void relayout_kernel(uint16_t *dst, const uint16_t *a,
                                const uint16_t *b, int mode, int rows_dst,
                                int rows_src, int K, int tiles)
{
    const int R = blockIdx.x, g = blockIdx.y;
    const int blk = R >> 4, r = R & 15;
    const uint16_t *src = nullptr;
    if (mode == RELAYOUT_GATE_UP) {
        src = (r < 8 ? a : b) +
              ((size_t)g * rows_src + blk * 8 + (r & 7)) * (size_t)K;
    } else {
        const int f = blk * 16 + (r < 8 ? 2 * r : 2 * (r - 8) + 1);
        if (f < rows_src)
            src = a + ((size_t)g * rows_src + f) * (size_t)K;
    }
    const uint4 *s = reinterpret_cast<const uint4 *>(src);
    const int kblocks = (K + MOEK_KTILE - 1) / MOEK_KTILE;
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
        const size_t at = tiles > 0
                              ? moek_wt_index(g, R, 8 * i, tiles, kblocks)
                              : ((size_t)g * rows_dst + R) * (size_t)K + 8 * i;
        *reinterpret_cast<uint4 *>(dst + at) =
            s ? s[i] : make_uint4(0, 0, 0, 0);
    }
}

/* Elements of a weight set of `groups` x `rows` x K in the chosen layout. */
size_t weight_elems(bool tiled, int groups, int rows, int K)
{
    if (!tiled)
        return (size_t)groups * rows * K;
    const size_t tiles = (rows + MOEK_WTILE - 1) / MOEK_WTILE,
                 kblocks = (K + MOEK_KTILE - 1) / MOEK_KTILE;
    return (size_t)groups * tiles * kblocks * MOEK_WTILE * MOEK_KTILE;
}

/* Device memory for a weight set in the chosen layout. Tiles that overhang
 * the matrix (rows not a multiple of 128, K not of 64) are read whole, so
 * such a set starts zeroed; one without overhang needs no memset. */
cudaError_t weight_alloc(void **p, bool tiled, int groups, int rows, int K)
{
    const size_t n = weight_elems(tiled, groups, rows, K);
    cudaError_t e = cudaMalloc(p, n * 2);
    if (e == cudaSuccess && n != (size_t)groups * rows * K)
        e = cudaMemset(*p, 0, n * 2);
    return e;
}

/* Group g of the source becomes group g0 + g of dst (groups of rows_dst
 * rows). Tiled: the pad rows and columns must be zero already. */
int relayout(void *dst, bool tiled, int g0, const void *a, const void *b,
             int mode, int groups, int rows_dst, int rows_src, int K)
{
    const int tiles = tiled ? (rows_dst + MOEK_WTILE - 1) / MOEK_WTILE : 0;
    uint16_t *d = (uint16_t *)dst + (size_t)g0 * weight_elems(tiled, 1, rows_dst, K);
    relayout_kernel<<<dim3(rows_dst, groups), 128>>>(
        d, (const uint16_t *)a, (const uint16_t *)b, mode, rows_dst, rows_src,
        K, tiles);
    MOEK_CU(cudaGetLastError());
    return 0;
}

int device_setup(int device, int *sms, int *cc)
{
    int r = moek_cuda_device_info(device, cc, sms, nullptr);
    if (r)
        return r;
    MOEK_CU(cudaSetDevice(device));
    return 0;
}

/* Switches for measuring (RESULTS.md): MOEK_CUDA_NO_PDL=1 launches every
 * kernel plainly, MOEK_CUDA_NO_EARLY=1 keeps GEMM 2's weight loads behind
 * GEMM 1, MOEK_CUDA_NO_DEP=1 makes GEMM 2 wait for the whole of GEMM 1
 * where layer.cu's rule would start it per group, MOEK_CUDA_NO_BOTH=1
 * runs the two GEMMs there as two kernels, not one (layer.cu),
 * MOEK_CUDA_NO_TINY=1 routes decode batches through the general
 * small-batch kernel, MOEK_CUDA_ROW_MAJOR=1 keeps the weights row-major
 * (read through TMA maps), MOEK_CUDA_NO_L2_HINT=1 drops the weight loads'
 * L2 evict-first hint, MOEK_CUDA_NO_CLUSTER=1 keeps prefill tiles off
 * cluster mode (layer.cu), MOEK_CUDA_CLUSTER_MIN_I=N moves its bound on
 * I, MOEK_CUDA_NO_SLOT_ROWS=1 keeps them off slot mode (layer.cu),
 * MOEK_CUDA_SLOT_MIN_KB=N moves its bound on the accumulator,
 * MOEK_CUDA_NO_STREAM_K=1 gives decode GEMM 2 a K split instead of
 * stream-K (layer.cu), MOEK_CUDA_ROUTE_CLUSTER=N caps the one-launch
 * routing kernel's cluster at N CTAs (route.cu; larger batches take the
 * multi-block path; 8 unless set, and 16 lets a device that runs clusters
 * of 16 route up to 512 tokens a warp each in that launch, within noise
 * of the default on the H200: RESULTS.md, run 35),
 * MOEK_CUDA_NO_PREFETCH=1 drops GEMM 1's L2 prefetches,
 * MOEK_CUDA_PREFETCH_KB=N sets the guessed one's K blocks (16 unless set;
 * layer.cu), MOEK_CUDA_NO_PREFETCH_EVERY=1 drops the one of every
 * expert's first blocks (fewer rows a group; layer.cu) and
 * MOEK_CUDA_UPLOAD_KB=N bounds the staging buffer that grouped GEMM
 * weights go up through (64 MiB unless set; one group at least),
 * MOEK_CUDA_MID144=0 keeps groups of 80-128 rows off the 144-row tile and
 * =1 lets them take it (where moe_tile's split rule allows), whatever the
 * card's DRAM rate (layer.cu, pick_tile; --tile 144 forces it),
 * MOEK_CUDA_FAST_DRAM=0 or 1 measures a card as one whose DRAM reads
 * under or over 4 TB/s (the rate that decides mid144 unless set, and
 * moek_dep's bound on short GEMM 2 items: layer.cu, moe_dep),
 * MOEK_CUDA_NO_SIG_WARP=1 has the consumers of both GEMMs' one launch make
 * GEMM 1's moek_dep counts themselves, and MOEK_CUDA_SIG_WARP_MODE1=1 has
 * the counting warp make them where GEMM 1 runs alone too (gemm_wgmma.cu,
 * sig_counts; layer.cu).
 * Read once, when a layer or weight set is made. env_bool: set and not
 * starting with '0' is on; def when unset or empty. */
bool env_bool(const char *name, bool def)
{
    const char *e = getenv(name);
    return e && *e ? *e != '0' : def;
}

/* A switch that is off unless set. */
bool env_off(const char *name)
{
    return env_bool(name, false);
}

bool pdl_default(void) { return !env_off("MOEK_CUDA_NO_PDL"); }

/* A positive integer setting from the environment, def when unset or not
 * one in [1, max]. */
int env_int(const char *name, int def, int max)
{
    const char *e = getenv(name);
    if (!e || !*e)
        return def;
    char *end;
    long v = strtol(e, &end, 10);
    return *end || v < 1 || v > max ? def : (int)v;
}

/* The device's peak DRAM rate in GB/s from its memory clock and bus
 * width (double data rate), 0 when it does not say: 3352 on an H100 SXM
 * (2619 MHz, 5120 bits), 4917 on an H200 (3201 MHz, 6144 bits). */
static double dram_gbs(int device)
{
    int khz = 0, bits = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth,
                               device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return 2.0 * khz * 1e3 * (bits / 8) / 1e9;
}

/* MOEK_CUDA_SPLIT_MIN_KB=N: the K blocks an item of a split GEMM keeps at
 * least (default 8; 4 was the former rule). */
int split_min_kb_default(void)
{
    return env_int("MOEK_CUDA_SPLIT_MIN_KB", 8, 1024);
}

int check_dtype(moek_dtype dt)
{
    if (dt != MOEK_DTYPE_BF16 && dt != MOEK_DTYPE_FP16)
        return moek_cuda_refuse(-ENOTSUP,
                                "dtype %d: the CUDA kernels take bf16 or fp16",
                                (int)dt);
    return 0;
}

int check_moe_shape(const moek_moe_shape *s)
{
    if (!s || s->experts <= 0 || s->topk <= 0 || s->hidden <= 0 ||
        s->intermediate <= 0)
        return moek_cuda_refuse(-EINVAL, "bad MoE shape");
    /* top-k above E is a shard of a spread layer (slots of experts held
     * elsewhere are empty); routing from logits refuses it. */
    if (s->experts > MOEK_MAX_EXPERTS)
        return moek_cuda_refuse(-ENOTSUP, "%d experts: at most %d on CUDA",
                                s->experts, MOEK_MAX_EXPERTS);
    if (s->topk > MOEK_MAX_TOPK)
        return moek_cuda_refuse(-ENOTSUP, "top-%d: at most top-%d on CUDA",
                                s->topk, MOEK_MAX_TOPK);
    if (s->hidden % 8 || s->intermediate % 8)
        return moek_cuda_refuse(-ENOTSUP,
                                "hidden %d / intermediate %d: both must be "
                                "multiples of 8 on CUDA",
                                s->hidden, s->intermediate);
    if ((long long)s->experts * 2 * s->intermediate >= (1LL << 31) ||
        (long long)s->experts * (s->hidden + 16) >= (1LL << 31))
        return moek_cuda_refuse(-ENOTSUP, "MoE layer too large");
    return 0;
}

int layer_new(const moek_moe_shape *shape, moek_dtype dt, const void *w1,
              const void *w3, const void *w2, bool on_device, int device,
              moek_cuda_moe_layer **out)
{
    if (!out)
        return -EINVAL;
    *out = nullptr;
    int r;
    if ((r = check_moe_shape(shape)) || (r = check_dtype(dt)))
        return r;
    if (!w1 || !w3 || !w2)
        return moek_cuda_refuse(-EINVAL, "NULL weight tensor");
    moek_cuda_moe_layer *L = new (std::nothrow) moek_cuda_moe_layer();
    if (!L)
        return -ENOMEM;
    L->shape = *shape;
    L->dt = dt;
    L->device = device;
    L->pdl = pdl_default();
    L->early = !env_off("MOEK_CUDA_NO_EARLY");
    L->dep = !env_off("MOEK_CUDA_NO_DEP");
    L->both = !env_off("MOEK_CUDA_NO_BOTH");
    L->sig = !env_off("MOEK_CUDA_NO_SIG_WARP");
    L->sig1 = env_off("MOEK_CUDA_SIG_WARP_MODE1");
    L->tiny = !env_off("MOEK_CUDA_NO_TINY");
    L->tiled = !env_off("MOEK_CUDA_ROW_MAJOR");
    L->l2_hint = !env_off("MOEK_CUDA_NO_L2_HINT");
    L->slots = !env_off("MOEK_CUDA_NO_SLOT_ROWS");
    L->stream_k = !env_off("MOEK_CUDA_NO_STREAM_K");
    L->split_min_kb = split_min_kb_default();
    L->pf_every = !env_off("MOEK_CUDA_NO_PREFETCH_EVERY");
    L->pf1_kb = env_off("MOEK_CUDA_NO_PREFETCH")
                    ? 0
                    : env_int("MOEK_CUDA_PREFETCH_KB", 16, 1 << 16);
    if ((r = device_setup(device, &L->sms, &L->cc))) {
        delete L;
        return r;
    }
    /* The routing cluster: as large as the device runs, at most the
     * switch's power of two. */
    L->route_cl = moek_route_cluster_cap(
        shape->experts, L->cc, env_int("MOEK_CUDA_ROUTE_CLUSTER", 8, 16));
    /* MOEK_CUDA_MID144=0 or 1 decides mid144 for measuring (not
     * fast_dram, moek_dep's bound); MOEK_CUDA_FAST_DRAM=0 or 1 decides
     * fast_dram (both rules), also for measuring. */
    L->fast_dram = env_bool("MOEK_CUDA_FAST_DRAM", dram_gbs(device) >= 4000);
    L->mid144 = env_bool("MOEK_CUDA_MID144", L->fast_dram);
    L->split_tiles = env_bool("MOEK_CUDA_SPLIT_TILES", false);
    int l2 = 0;
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) !=
        cudaSuccess) {
        cudaGetLastError();
        l2 = 0;
    }
    L->slot_min_acc =
        (size_t)env_int("MOEK_CUDA_SLOT_MIN_KB", l2 / 4096, 1 << 30) * 1024;
    const int E = shape->experts, H = shape->hidden, I = shape->intermediate;
    L->h16 = (H + 15) / 16 * 16;
    const bool tl = L->tiled;
    /* Cluster mode pairs adjacent weight tiles and reads token rows through
     * TMA maps (16-byte row pitch). GEMM 1's token rows then come from a
     * copy of x, which costs H per slot; its gain grows with I: on the H200
     * it paid for mixtral (I = 14336) and deepseek (2048, T=4096 5.5%
     * faster) and lost 1% for qwen3 (768). GEMM 2's token rows, GEMM 1's
     * output, are in slot order already: where GEMM 1 does not pair (I
     * below the bound, or a shape it cannot pair), GEMM 2 alone runs in
     * pairs (qwen3 T=4096 1.2% faster) (kernels/bench/RESULTS.md, run 16).
     * MOEK_CUDA_CLUSTER_MIN_I=N moves the bound, for measuring. */
    L->pairs = MOEK_CLUSTER_NONE;
    if (tl && !env_off("MOEK_CUDA_NO_CLUSTER") && I >= MOEK_KTILE &&
        I % 8 == 0 && (L->h16 + MOEK_WTILE - 1) / MOEK_WTILE % 2 == 0)
        L->pairs = I >= env_int("MOEK_CUDA_CLUSTER_MIN_I", 2048, 1 << 30) &&
                           H >= MOEK_KTILE && H % 8 == 0 &&
                           (2 * I + MOEK_WTILE - 1) / MOEK_WTILE % 2 == 0
                       ? MOEK_CLUSTER_BOTH
                       : MOEK_CLUSTER_GEMM2;
    void *tmp = nullptr;
    cudaError_t e = weight_alloc(&L->w13, tl, E, 2 * I, H);
    if (e == cudaSuccess)
        e = weight_alloc(&L->w2p, tl, E, L->h16, I);
    if (e == cudaSuccess && !on_device)
        e = cudaMalloc(&tmp, (size_t)2 * I * H * 2);
    if (e != cudaSuccess) {
        r = moek_cuda_fail(e, "cudaMalloc(layer weights)");
        goto fail;
    }
    if (on_device) {
        if ((r = relayout(L->w13, tl, 0, w1, w3, RELAYOUT_GATE_UP, E, 2 * I, I,
                          H)) ||
            (r = relayout(L->w2p, tl, 0, w2, nullptr, RELAYOUT_PAIRS, E, L->h16,
                          H, I)))
            goto fail;
    } else {
        /* One expert at a time through a staging buffer. */
        const size_t ih = (size_t)I * H;
        uint16_t *t1 = (uint16_t *)tmp, *t3 = t1 + ih;
        for (int x = 0; x < E; x++) {
            e = cudaMemcpy(t1, (const uint16_t *)w1 + x * ih, ih * 2,
                           cudaMemcpyHostToDevice);
            if (e == cudaSuccess)
                e = cudaMemcpy(t3, (const uint16_t *)w3 + x * ih, ih * 2,
                               cudaMemcpyHostToDevice);
            if (e != cudaSuccess) {
                r = moek_cuda_fail(e, "cudaMemcpy(w1/w3)");
                goto fail;
            }
            if ((r = relayout(L->w13, tl, x, t1, t3, RELAYOUT_GATE_UP, 1,
                              2 * I, I, H)))
                goto fail;
            e = cudaMemcpy(t1, (const uint16_t *)w2 + x * ih, ih * 2,
                           cudaMemcpyHostToDevice);
            if (e != cudaSuccess) {
                r = moek_cuda_fail(e, "cudaMemcpy(w2)");
                goto fail;
            }
            if ((r = relayout(L->w2p, tl, x, t1, nullptr, RELAYOUT_PAIRS, 1,
                              L->h16, H, I)))
                goto fail;
            /* t1 is overwritten by the next expert's copy only after this
             * relayout ran: cudaMemcpy from pageable memory waits for it. */
        }
    }
    /* The upload's own stream, not the device: a device-wide wait would
     * also wait for (and, while the compute thread captures a graph,
     * disturb) the batches running meanwhile. */
    e = cudaStreamSynchronize(0);
    if (e != cudaSuccess) {
        r = moek_cuda_fail(e, "relayout");
        goto fail;
    }
    if (!tl && ((r = moek_make_tmap(&L->tm13, L->w13, dt, (uint64_t)E * 2 * I, H,
                                    MOEK_WTILE)) ||
                (r = moek_make_tmap(&L->tm2, L->w2p, dt, (uint64_t)E * L->h16, I,
                                    MOEK_WTILE))))
        goto fail;
    if (L->cc == 90) {
        e = moek_gemm_wgmma_prepare(dt);
        if (e != cudaSuccess) {
            r = moek_cuda_fail(e, "cudaFuncSetAttribute");
            goto fail;
        }
    }
    cudaFree(tmp);
    *out = L;
    return 0;
fail:
    cudaFree(tmp);
    moek_cuda_moe_layer_free(L);
    return r;
}

int gemm_weights_new(moek_dtype dt, int groups, int n, int k, const void *b,
                     bool on_device, int device, moek_cuda_gemm_weights **out)
{
    if (!out)
        return -EINVAL;
    *out = nullptr;
    int r;
    if ((r = check_dtype(dt)))
        return r;
    if (!b || groups <= 0 || n <= 0 || k <= 0)
        return moek_cuda_refuse(-EINVAL, "bad grouped GEMM weights");
    if (groups > MOEK_MAX_GROUPS)
        return moek_cuda_refuse(-ENOTSUP, "%d groups: at most %d on CUDA",
                                groups, MOEK_MAX_GROUPS);
    if (n % 8 || k % 8)
        return moek_cuda_refuse(-ENOTSUP,
                                "N %d / K %d: both must be multiples of 8 on "
                                "CUDA",
                                n, k);
    if ((long long)groups * (n + 16) >= (1LL << 31))
        return moek_cuda_refuse(-ENOTSUP, "grouped GEMM weights too large");
    moek_cuda_gemm_weights *W = new (std::nothrow) moek_cuda_gemm_weights();
    if (!W)
        return -ENOMEM;
    W->dt = dt;
    W->groups = groups;
    W->n = n;
    W->k = k;
    W->n16 = (n + 15) / 16 * 16;
    W->device = device;
    W->pdl = pdl_default();
    W->split_min_kb = split_min_kb_default();
    W->tiled = !env_off("MOEK_CUDA_ROW_MAJOR");
    if ((r = device_setup(device, &W->sms, &W->cc))) {
        delete W;
        return r;
    }
    void *tmp = nullptr;
    const size_t gb = (size_t)n * k * 2; /* bytes of one group */
    /* Host weights go up through a staging buffer of at most `per` groups
     * (one at least), so a load needs little more device memory than the
     * weights themselves. */
    const size_t stage = (size_t)env_int("MOEK_CUDA_UPLOAD_KB", 64 << 10, 1 << 22) * 1024;
    const int per = (int)std::min<size_t>(groups, std::max<size_t>(1, stage / gb));
    cudaError_t e = weight_alloc(&W->b, W->tiled, groups, W->n16, k);
    if (e == cudaSuccess && !on_device)
        e = cudaMalloc(&tmp, (size_t)per * gb);
    if (e != cudaSuccess) {
        r = moek_cuda_fail(e, "cudaMalloc(gemm weights)");
        goto fail;
    }
    if (on_device) {
        if ((r = relayout(W->b, W->tiled, 0, b, nullptr, RELAYOUT_PAIRS, groups,
                          W->n16, n, k)))
            goto fail;
    } else {
        for (int g0 = 0; g0 < groups; g0 += per) {
            const int cnt = std::min(per, groups - g0);
            /* tmp is written again only after the relayout before read it:
             * copy and kernel are ordered on the one stream. */
            e = cudaMemcpy(tmp, (const uint8_t *)b + g0 * gb, cnt * gb,
                           cudaMemcpyHostToDevice);
            if (e != cudaSuccess) {
                r = moek_cuda_fail(e, "cudaMemcpy(b)");
                goto fail;
            }
            if ((r = relayout(W->b, W->tiled, g0, tmp, nullptr, RELAYOUT_PAIRS,
                              cnt, W->n16, n, k)))
                goto fail;
        }
    }
    e = cudaStreamSynchronize(0); /* the upload's stream, as in layer_new */
    if (e != cudaSuccess) {
        r = moek_cuda_fail(e, "relayout");
        goto fail;
    }
    if (!W->tiled &&
        (r = moek_make_tmap(&W->tm, W->b, dt, (uint64_t)groups * W->n16, k,
                            MOEK_WTILE)))
        goto fail;
    if (W->cc == 90) {
        e = moek_gemm_wgmma_prepare(dt);
        if (e != cudaSuccess) {
            r = moek_cuda_fail(e, "cudaFuncSetAttribute");
            goto fail;
        }
    }
    cudaFree(tmp);
    *out = W;
    return 0;
fail:
    cudaFree(tmp);
    moek_cuda_gemm_weights_free(W);
    return r;
}

/* A 2-D map of [rows, cols] elements, rows ld elements apart. */
int make_map(CUtensorMap *m, void *base, moek_dtype dt, uint64_t rows,
             uint64_t cols, uint64_t ld, uint32_t box_cols, uint32_t box_rows,
             CUtensorMapSwizzle swizzle)
{
    /* Looked up once, by whichever thread comes first (a function-local
     * static is initialised exactly once): forwards make maps too. */
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        cudaDriverEntryPointQueryResult q;
        void *fn = nullptr;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn,
                                             12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            fn = nullptr;
        return (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }();
    if (!encode)
        return moek_cuda_refuse(-ENOTSUP,
                                "the driver has no cuTensorMapEncodeTiled");
    cuuint64_t dims[2] = {cols, rows};
    cuuint64_t strides[1] = {ld * 2};
    cuuint32_t box[2] = {box_cols, box_rows};
    cuuint32_t estr[2] = {1, 1};
    CUresult r = encode(m,
                        dt == MOEK_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                              : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        2, base, dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return moek_cuda_refuse(-EIO, "cuTensorMapEncodeTiled failed (%d)",
                                (int)r);
    return 0;
}

} // namespace

int moek_make_tmap(CUtensorMap *m, void *base, moek_dtype dt, uint64_t rows,
                   uint64_t K, uint32_t box_rows)
{
    return make_map(m, base, dt, rows, K, K, MOEK_KTILE, box_rows,
                    CU_TENSOR_MAP_SWIZZLE_128B);
}

int moek_make_out_tmap(CUtensorMap *m, void *base, moek_dtype dt,
                       uint64_t rows, uint64_t cols, uint64_t ld)
{
    return make_map(m, base, dt, rows, cols, ld, 32, 8,
                    CU_TENSOR_MAP_SWIZZLE_64B);
}

int moek_make_tmaps(moek_tmaps *t, void *base, moek_dtype dt, uint64_t rows,
                    uint64_t K, int bn)
{
    t->bn = bn;
    for (int c = 0; c < MOEK_CLASSES; c++) {
        const int r = moek_make_tmap(&t->m[c], base, dt, rows, K,
                                     moek_class_width(bn, c) / 2);
        if (r)
            return r;
    }
    return 0;
}

int moek_cuda_moe_layer_new(const moek_moe_shape *shape, moek_dtype dt,
                            const void *w1, const void *w3, const void *w2,
                            int device, moek_cuda_moe_layer **out)
{
    return layer_new(shape, dt, w1, w3, w2, false, device, out);
}

int moek_cuda_moe_layer_new_from_device(const moek_moe_shape *shape,
                                        moek_dtype dt, const void *w1_dev,
                                        const void *w3_dev, const void *w2_dev,
                                        int device, moek_cuda_moe_layer **out)
{
    return layer_new(shape, dt, w1_dev, w3_dev, w2_dev, true, device, out);
}

void moek_cuda_moe_layer_free(moek_cuda_moe_layer *layer)
{
    if (!layer)
        return;
    cudaFree(layer->w13);
    cudaFree(layer->w2p);
    delete layer;
}

int moek_cuda_gemm_weights_new(moek_dtype dt, int groups, int n, int k,
                               const void *b_host, int device,
                               moek_cuda_gemm_weights **out)
{
    return gemm_weights_new(dt, groups, n, k, b_host, false, device, out);
}

int moek_cuda_gemm_weights_new_from_device(moek_dtype dt, int groups, int n,
                                           int k, const void *b_dev, int device,
                                           moek_cuda_gemm_weights **out)
{
    return gemm_weights_new(dt, groups, n, k, b_dev, true, device, out);
}

void moek_cuda_gemm_weights_free(moek_cuda_gemm_weights *w)
{
    if (!w)
        return;
    cudaFree(w->b);
    delete w;
}
