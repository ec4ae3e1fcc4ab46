/*
 * tune.cu: a MoE layer's token-tile table and the autotuner that measures
 * one (moek_cuda_moe_layer_set_tiles, moek_cuda_moe_layer_autotune; the
 * table is read by moe_tile() in layer.cu).
 *
 * The autotuner times a forward exactly as the daemon issues it and as
 * kernels/bench/bench_moe.c --sweep does: routing and alignment included,
 * each call a CUDA graph replay on a created stream (so PDL is on), over
 * rotating input sets so that the experts hit vary as in service. Only the
 * tile differs between the candidates of one token count, and every
 * candidate sees the same inputs. The number of timed replays adapts to the
 * call's length: at least 9 (a stable median), up to 51 while they fit in
 * 40 ms; the whole deepseek-v3 shape (E=256 k=8 H=7168 I=2048) over T = 1,
 * 2, 4, ..., 4096 takes about 5 s on an H200. The device is first kept
 * busy for 300 ms (its clocks ramp up), and a tile replaces the layer's
 * present choice (its forced tile, else its table's, else the heuristic's)
 * only when it is more
 * than 2% faster, so ties within the noise keep the heuristic.
 */
#include <errno.h>
#include <stdint.h>
#include <time.h>

#include <algorithm>

#include "cuda_common.cuh"

namespace {

const int kTiles[MOEK_CUDA_TILE_CANDIDATES] = MOEK_CUDA_TOKEN_TILES;
constexpr int kSets = 4;       /* rotating input sets */
constexpr int kWarm = 2;       /* warm-up replays per tile */
constexpr int kMinRuns = 9;    /* timed replays per tile, at least */
constexpr int kMaxRuns = 51;   /* and at most */
constexpr float kBudgetMs = 40.0f;
constexpr int kMaxCounts = 64;
constexpr float kWarmDeviceMs = 300.0f; /* replays before the first timing */
/* Another tile replaces the layer's present choice only when it is faster
 * by more than this: ties within the noise keep the heuristic. */
constexpr float kMargin = 0.02f;
constexpr int kMaxTokens = 65536;

/* Everything one autotune call holds; released (and the layer's tuning
 * restored) on every way out. */
struct tune_run {
    moek_cuda_moe_layer *L = nullptr;
    moek_cuda_tuning saved = {};
    cudaStream_t st = nullptr;
    moek_cuda_workspace *ws = nullptr;
    void *x[kSets] = {};
    float *logits[kSets] = {};
    void *out = nullptr;
    void *graph[kSets] = {};
    cudaEvent_t ev[2 * kMaxRuns] = {};
    cudaEvent_t warm[2] = {};

    void drop_graphs()
    {
        for (void *&g : graph) {
            moek_cuda_graph_free(g);
            g = nullptr;
        }
    }
    ~tune_run()
    {
        if (st)
            cudaStreamSynchronize(st);
        drop_graphs();
        for (cudaEvent_t e : ev)
            if (e)
                cudaEventDestroy(e);
        for (cudaEvent_t e : warm)
            if (e)
                cudaEventDestroy(e);
        for (int s = 0; s < kSets; s++) {
            cudaFree(x[s]);
            cudaFree(logits[s]);
        }
        cudaFree(out);
        moek_cuda_workspace_free(ws);
        if (st)
            cudaStreamDestroy(st);
        if (L)
            L->tune = saved;
    }
};

/* Capture one graph per input set of a forward of T tokens with the tile
 * now forced on the layer. A failed capture is ended, so the stream stays
 * usable. */
int capture(tune_run &r, int T)
{
    for (int s = 0; s < kSets; s++) {
        moek_cuda_routing rt = {};
        rt.kind = MOEK_CUDA_ROUTE_LOGITS;
        rt.logits_dev = r.logits[s];
        rt.scoring = MOEK_SCORING_SOFTMAX;
        rt.renormalize = true;
        int rc = moek_cuda_graph_begin(r.st);
        if (rc)
            return rc;
        rc = moek_cuda_fused_moe(r.L, r.ws, r.x[s], &rt, T, r.out, r.st);
        if (rc) {
            cudaGraph_t g = nullptr;
            cudaStreamEndCapture(r.st, &g);
            if (g)
                cudaGraphDestroy(g);
            (void)cudaGetLastError();
            return rc;
        }
        rc = moek_cuda_graph_end(r.st, &r.graph[s]);
        if (rc)
            return rc;
    }
    return 0;
}

/* Median microseconds of one replay of the captured graphs. */
int time_graphs(tune_run &r, float *us)
{
    for (int i = 0; i < kWarm; i++) {
        if (i == kWarm - 1)
            MOEK_CU(cudaEventRecord(r.warm[0], r.st));
        int rc = moek_cuda_graph_launch(r.graph[i % kSets], r.st);
        if (rc)
            return rc;
    }
    MOEK_CU(cudaEventRecord(r.warm[1], r.st));
    MOEK_CU(cudaEventSynchronize(r.warm[1]));
    float ms = 0;
    MOEK_CU(cudaEventElapsedTime(&ms, r.warm[0], r.warm[1]));
    /* The last warm-up replay's time sizes the run (the first may carry
     * the graph's upload). */
    int runs = ms > 0 ? (int)(kBudgetMs / ms) : kMaxRuns;
    runs = std::min(std::max(runs, kMinRuns), kMaxRuns);
    for (int i = 0; i < runs; i++) {
        MOEK_CU(cudaEventRecord(r.ev[2 * i], r.st));
        int rc = moek_cuda_graph_launch(r.graph[i % kSets], r.st);
        if (rc)
            return rc;
        MOEK_CU(cudaEventRecord(r.ev[2 * i + 1], r.st));
    }
    MOEK_CU(cudaStreamSynchronize(r.st));
    float t[kMaxRuns];
    for (int i = 0; i < runs; i++) {
        MOEK_CU(cudaEventElapsedTime(&t[i], r.ev[2 * i], r.ev[2 * i + 1]));
        t[i] *= 1000.0f;
    }
    std::sort(t, t + runs);
    *us = t[runs / 2];
    return 0;
}

/* Bring the device to its working clocks before anything is timed: the
 * first tile measured would otherwise pay for the ramp (20 us of 180 at
 * T=1, seen on an H200). Replays forwards of T tokens for kWarmDeviceMs. */
int warm_device(tune_run &r, int T)
{
    int rc = capture(r, T);
    for (float spent = 0; !rc && spent < kWarmDeviceMs;) {
        float us = 0;
        MOEK_CU(cudaEventRecord(r.warm[0], r.st));
        for (int i = 0; i < 16 && !rc; i++)
            rc = moek_cuda_graph_launch(r.graph[i % kSets], r.st);
        MOEK_CU(cudaEventRecord(r.warm[1], r.st));
        MOEK_CU(cudaEventSynchronize(r.warm[1]));
        MOEK_CU(cudaEventElapsedTime(&us, r.warm[0], r.warm[1]));
        spent += us;
    }
    r.drop_graphs();
    return rc;
}

uint64_t fresh_seed()
{
    static uint64_t counter;
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec ^
           (++counter * 0x9e3779b97f4a7c15ull);
}

} // namespace

int moek_cuda_moe_layer_set_tiles(moek_cuda_moe_layer *L,
                                  const moek_cuda_tile_rule *rules, int n)
{
    if (!L)
        return moek_cuda_refuse(-EINVAL, "set_tiles: NULL layer");
    if (n < 0 || n > MOEK_CUDA_MAX_TILE_RULES)
        return moek_cuda_refuse(-EINVAL, "set_tiles: %d rules (0 to %d)", n,
                                MOEK_CUDA_MAX_TILE_RULES);
    if (n > 0 && !rules)
        return moek_cuda_refuse(-EINVAL, "set_tiles: NULL rules");
    for (int i = 0; i < n; i++) {
        const moek_cuda_tile_rule &r = rules[i];
        if (r.min_tokens < 1)
            return moek_cuda_refuse(-EINVAL,
                                    "set_tiles: rule %d: min_tokens %d is "
                                    "below 1",
                                    i, r.min_tokens);
        if (i > 0 && r.min_tokens <= rules[i - 1].min_tokens)
            return moek_cuda_refuse(-EINVAL,
                                    "set_tiles: rule %d: min_tokens %d does "
                                    "not ascend (rule %d has %d)",
                                    i, r.min_tokens, i - 1,
                                    rules[i - 1].min_tokens);
        if (!moek_wgmma_tile_ok(r.token_tile))
            return moek_cuda_refuse(-EINVAL,
                                    "set_tiles: rule %d: token tile %d is not "
                                    "offered (16, 32, 64, 128, 144, 192 or 256)",
                                    i, r.token_tile);
    }
    for (int i = 0; i < n; i++)
        L->rules[i] = rules[i];
    L->n_rules = n;
    return 0;
}

int moek_cuda_moe_layer_autotune(moek_cuda_moe_layer *L, const int *tokens,
                                 int n, int *best_tile, float *us)
{
    if (!L || !tokens || !best_tile)
        return moek_cuda_refuse(-EINVAL, "autotune: NULL argument");
    if (n < 1 || n > kMaxCounts)
        return moek_cuda_refuse(-EINVAL, "autotune: %d token counts (1 to %d)",
                                n, kMaxCounts);
    int max_t = 0;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 1 || tokens[i] > kMaxTokens)
            return moek_cuda_refuse(-EINVAL,
                                    "autotune: %d tokens (1 to %d)", tokens[i],
                                    kMaxTokens);
        max_t = std::max(max_t, tokens[i]);
    }
    if (L->tune.generic || L->cc != 90)
        return moek_cuda_refuse(-ENOTSUP,
                                "autotune: the portable SIMT kernels (%s) "
                                "have one token tile; only the sm_90 wgmma "
                                "kernels choose",
                                L->tune.generic ? "forced on this layer"
                                                : "this device is not sm_90");
    if (L->shape.topk > L->shape.experts)
        return moek_cuda_refuse(-EINVAL,
                                "autotune: top-%d of %d experts cannot be "
                                "routed from logits",
                                L->shape.topk, L->shape.experts);
    MOEK_CU(cudaSetDevice(L->device));

    tune_run r;
    r.L = L;
    r.saved = L->tune;
    const moek_moe_shape &s = L->shape;
    const size_t es = moek_dtype_size(L->dt);
    MOEK_CU(cudaStreamCreateWithFlags(&r.st, cudaStreamNonBlocking));
    int rc = moek_cuda_workspace_new(
        L->device, moek_cuda_moe_workspace_size(L, max_t), &r.ws);
    if (rc)
        return rc;
    for (int i = 0; i < kSets; i++) {
        MOEK_CU(cudaMalloc(&r.x[i], (size_t)max_t * s.hidden * es));
        MOEK_CU(cudaMalloc(&r.logits[i],
                           (size_t)max_t * s.experts * sizeof(float)));
    }
    MOEK_CU(cudaMalloc(&r.out, (size_t)max_t * s.hidden * es));
    for (cudaEvent_t &e : r.ev)
        MOEK_CU(cudaEventCreate(&e));
    for (cudaEvent_t &e : r.warm)
        MOEK_CU(cudaEventCreate(&e));

    for (int i = 0; i < n; i++) {
        const int T = tokens[i];
        /* Fresh inputs for this count, the same for every tile. */
        for (int q = 0; q < kSets; q++) {
            const uint64_t seed = fresh_seed();
            if ((rc = moek_cuda_fill_uniform(r.x[q], L->dt,
                                             (size_t)T * s.hidden, seed, 1.0f,
                                             r.st)) ||
                (rc = moek_cuda_fill_uniform(r.logits[q], MOEK_DTYPE_FP32,
                                             (size_t)T * s.experts, seed + 1,
                                             1.0f, r.st)))
                return rc;
        }
        if (i == 0 && (rc = warm_device(r, T)))
            return rc;
        /* The layer's present choice for T (forced, its table or the
         * heuristic). */
        L->tune = r.saved;
        const int now_tile = moek_cuda_moe_layer_token_tile(L, T);
        int best = 0, now = -1;
        float best_us = 0, t_j[MOEK_CUDA_TILE_CANDIDATES];
        for (int j = 0; j < MOEK_CUDA_TILE_CANDIDATES; j++) {
            L->tune = r.saved;
            L->tune.token_tile = kTiles[j];
            L->tune.token_tile2 = 0;
            float t = 0;
            /* A tile this layer runs as another (144 as 128: layer.cu,
             * fit_tile) is that tile, timed before it; never the pick. */
            const int as = moek_cuda_moe_layer_token_tile(L, T);
            if (as != kTiles[j]) {
                for (int q = 0; q < j; q++)
                    if (kTiles[q] == as)
                        t = t_j[q];
                if (us)
                    us[i * MOEK_CUDA_TILE_CANDIDATES + j] = t;
                t_j[j] = t;
                continue;
            }
            rc = capture(r, T);
            if (!rc)
                rc = time_graphs(r, &t);
            r.drop_graphs();
            if (rc)
                return rc;
            if (us)
                us[i * MOEK_CUDA_TILE_CANDIDATES + j] = t;
            t_j[j] = t;
            if (kTiles[j] == now_tile)
                now = j;
            if (j == 0 || t < best_us) {
                best = j;
                best_us = t;
            }
        }
        if (now >= 0 && best_us >= t_j[now] * (1.0f - kMargin))
            best = now;
        best_tile[i] = kTiles[best];
    }
    return 0;
}
