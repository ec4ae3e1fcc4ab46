/*
 * bench_moe.c: the BENCH.md grid through the functions the daemon calls.
 *
 *   build: make -C kernels/bench BUILD=<abs build dir>   (or device.sh)
 *   run:   bench_moe [--peers FILE] [--csv FILE] [--sweep] [--only MODEL]
 *                    [--tokens T]   (T: 1..4096, in the grid or not)
 *                    [--tile N]     (every case on token tile N, as a
 *                                    tuning's forced tile)
 *                    [--tile2 N]    (with --tile: GEMM 2 on tile N, the
 *                                    tuning's token_tile2)
 *                    [--seed S]     (another draw of the weights and
 *                                    inputs; the same S, the same draw;
 *                                    0 or none: the default draw)
 *          bench_moe --streams      (streaming rates at decode GEMM sizes
 *                                    and L2's rate for the same copies,
 *                                    ceilings.cu, then exit)
 *
 * For each model shape (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3) and token
 * count (1, 8, 64, 512, 4096): a bf16 layer made on the device
 * (moek_cuda_fill_uniform, weights N-ish(0, 1/fan_in) as uniform), four
 * rotating input sets (x and router logits: softmax, top-k, renormalise), a
 * correctness check of set 0 against moek_ref_fused_moe on a few tokens
 * (only their experts are rebuilt on the host), then one CUDA graph per
 * input set, each holding one moek_cuda_fused_moe call exactly as the daemon
 * issues it (routing and alignment included), replayed round robin and timed
 * per replay with events; the median is reported.
 *
 * The floor is max(bytes / read bandwidth, flops / matmul rate) with both
 * ceilings measured at the start of the same run (ceilings.cu); bytes are the
 * distinct experts the four input sets hit (mean) times 3 H I 2, plus x, out
 * and the logits. Columns: us | % of floor (floor / time) | TFLOP/s | GB/s |
 * the peers (peers.py, same card, same run, read from --peers) | best peer
 * time over ours (> 1: we are faster). --sweep also times every token tile.
 *
 * Built with EXTRA_NVCCFLAGS=-DMOEK_TRACE (kernels/cuda/trace.cuh) and run
 * with MOEK_TRACE_OUT=PREFIX, each case also writes the kernels' events of
 * one more replay of set 0 to PREFIX-MODEL-T.csv (ns from the first).
 */
#include "moe_kernels.h"
#include "cuda/moe_cuda.h"
#include "cuda/trace.h"
#include "bench_check.h"
#include "ceilings.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct model {
    const char *name;
    moek_moe_shape s;
} model;

static const model MODELS[] = {
    {"mixtral-8x7b", {8, 2, 4096, 14336}},
    {"qwen3-30b-a3b", {128, 8, 2048, 768}},
    {"deepseek-v3", {256, 8, 7168, 2048}},
};
static const int TOKENS[] = {1, 8, 64, 512, 4096};
/* the CUDA kernels' token tiles (--sweep, --tile) */
static const int TILES[] = MOEK_CUDA_TOKEN_TILES;
#define NTILES ((int)(sizeof TILES / sizeof TILES[0]))
#define NSETS 4

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static void *dmalloc(size_t n)
{
    void *p = NULL;
    CK(moek_cuda_malloc(n, &p));
    return p;
}

/* Host copy of elements [first, first + n) of a tensor filled on the
 * device with moek_cuda_fill_uniform(seed, scale). */
static void host_fill(void *dst, moek_dtype dt, uint64_t seed, size_t first,
                      size_t n, float scale)
{
    CK(moek_cuda_uniform_host(dst, dt, seed, first, n, scale));
}

/* ---- timing ------------------------------------------------------------- */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* Median microseconds of one graph replay, graphs[i % n] in turn. */
static double time_graphs(void **graphs, int n, void *stream, double budget_ms)
{
    cudaStream_t st = stream;
    for (int i = 0; i < 3 * n; i++)
        CK(moek_cuda_graph_launch(graphs[i % n], stream));
    cudaEvent_t e0, e1;
    CR(cudaEventCreate(&e0));
    CR(cudaEventCreate(&e1));
    CR(cudaEventRecord(e0, st));
    for (int i = 0; i < n; i++)
        CK(moek_cuda_graph_launch(graphs[i], stream));
    CR(cudaEventRecord(e1, st));
    CR(cudaEventSynchronize(e1));
    float ms = 0;
    CR(cudaEventElapsedTime(&ms, e0, e1));
    int iters = (int)(budget_ms / (ms / n));
    iters = iters < 16 ? 16 : iters > 1000 ? 1000 : iters;
    cudaEvent_t *ev = xmalloc(sizeof(cudaEvent_t) * 2 * iters);
    for (int i = 0; i < 2 * iters; i++)
        CR(cudaEventCreate(&ev[i]));
    for (int i = 0; i < iters; i++) {
        CR(cudaEventRecord(ev[2 * i], st));
        CK(moek_cuda_graph_launch(graphs[i % n], stream));
        CR(cudaEventRecord(ev[2 * i + 1], st));
    }
    CR(cudaStreamSynchronize(st));
    float *t = xmalloc(sizeof(float) * iters);
    for (int i = 0; i < iters; i++) {
        CR(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
        t[i] *= 1000.0f;
    }
    qsort(t, iters, sizeof(float), cmp_float);
    double med = t[iters / 2];
    for (int i = 0; i < 2 * iters; i++)
        cudaEventDestroy(ev[i]);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    free(ev);
    free(t);
    return med;
}

/* ---- peers ---------------------------------------------------------------- */

typedef struct peer_row {
    char model[32];
    int tokens;
    double triton_us, grouped_us;
} peer_row;

static peer_row peers[64];
static int npeers;

static void read_peers(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "note: no peer figures (%s: %s)\n", path,
                strerror(errno));
        return;
    }
    char line[256];
    while (fgets(line, sizeof line, f) && npeers < 64) {
        peer_row r;
        if (line[0] == '#')
            continue;
        if (sscanf(line, "%31s %d %lf %lf", r.model, &r.tokens, &r.triton_us,
                   &r.grouped_us) == 4)
            peers[npeers++] = r;
    }
    fclose(f);
}

static const peer_row *find_peer(const char *m, int t)
{
    for (int i = 0; i < npeers; i++)
        if (!strcmp(peers[i].model, m) && peers[i].tokens == t)
            return &peers[i];
    return NULL;
}

/* ---- one case ------------------------------------------------------------- */

typedef struct inputs {
    void *x[NSETS], *logits[NSETS], *out;
    uint64_t seed[NSETS];
} inputs;

/* Compare set 0's output with the reference on `nt` tokens; returns the
 * relative error. */
static double check_case(const model *m, moek_cuda_moe_layer *layer,
                         moek_cuda_workspace *ws, inputs *in, uint64_t wseed,
                         int T, int nt, void *stream)
{
    const moek_moe_shape *s = &m->s;
    const int E = s->experts, k = s->topk, H = s->hidden, I = s->intermediate;
    const size_t ih = (size_t)I * H;
    const moek_dtype dt = MOEK_DTYPE_BF16;
    CK(moek_cuda_memset(in->out, 0xff, (size_t)T * H * 2));
    moek_cuda_routing rt = {MOEK_CUDA_ROUTE_LOGITS, in->logits[0],
                            MOEK_SCORING_SOFTMAX, true, NULL, NULL, NULL, 0};
    CK(moek_cuda_fused_moe(layer, ws, in->x[0], &rt, T, in->out, stream));
    int32_t *ids = xmalloc(sizeof(int32_t) * T * k);
    float *wts = xmalloc(sizeof(float) * T * k);
    CK(moek_cuda_moe_read_routing(layer, ws, T, ids, wts, stream));
    uint16_t *got = xmalloc((size_t)T * H * 2);
    CK(moek_cuda_copy_to_host(got, in->out, (size_t)T * H * 2));
    float *gf = xmalloc(sizeof(float) * T * H);
    moek_to_f32(dt, got, gf, (size_t)T * H);
    for (size_t i = 0; i < (size_t)T * H; i++)
        if (!isfinite(gf[i]))
            return INFINITY;
    if (nt > T)
        nt = T;
    int *map = xmalloc(sizeof(int) * E), ne = 0;
    for (int e = 0; e < E; e++)
        map[e] = -1;
    int32_t *cid = xmalloc(sizeof(int32_t) * nt * k);
    float *cw = xmalloc(sizeof(float) * nt * k);
    int *tok = xmalloc(sizeof(int) * nt);
    for (int i = 0; i < nt; i++) {
        tok[i] = (int)((long long)i * T / nt);
        for (int j = 0; j < k; j++) {
            int e = ids[(size_t)tok[i] * k + j];
            if (map[e] < 0)
                map[e] = ne++;
            cid[i * k + j] = map[e];
            cw[i * k + j] = wts[(size_t)tok[i] * k + j];
        }
    }
    uint16_t *c1 = xmalloc(ne * ih * 2), *c3 = xmalloc(ne * ih * 2),
             *c2 = xmalloc(ne * ih * 2);
    for (int e = 0; e < E; e++) {
        if (map[e] < 0)
            continue;
        size_t at = (size_t)map[e] * ih;
        host_fill(c1 + at, dt, wseed + 1, e * ih, ih, 1.0f / sqrtf((float)H));
        host_fill(c3 + at, dt, wseed + 2, e * ih, ih, 1.0f / sqrtf((float)H));
        host_fill(c2 + at, dt, wseed + 3, e * ih, ih, 1.0f / sqrtf((float)I));
    }
    uint16_t *cx = xmalloc((size_t)nt * H * 2), *cref = xmalloc((size_t)nt * H * 2);
    for (int i = 0; i < nt; i++)
        host_fill(cx + (size_t)i * H, dt, in->seed[0], (size_t)tok[i] * H, H,
                  1.0f);
    moek_moe_shape cs = *s;
    cs.experts = ne;
    double err = INFINITY;
    if (moek_ref_fused_moe(&cs, dt, cx, cid, cw, c1, c3, c2, nt, cref) == 0) {
        float *want = xmalloc(sizeof(float) * nt * H),
              *have = xmalloc(sizeof(float) * nt * H);
        moek_to_f32(dt, cref, want, (size_t)nt * H);
        for (int i = 0; i < nt; i++)
            memcpy(have + (size_t)i * H, gf + (size_t)tok[i] * H,
                   sizeof(float) * H);
        err = moek_rel_error(have, want, (size_t)nt * H);
        free(want);
        free(have);
    }
    free(ids); free(wts); free(got); free(gf); free(map); free(cid); free(cw);
    free(tok); free(c1); free(c2); free(c3); free(cx); free(cref);
    return err;
}

/* Mean number of distinct experts the input sets route to. */
static double experts_hit(const model *m, moek_cuda_moe_layer *layer,
                          moek_cuda_workspace *ws, inputs *in, int T,
                          void *stream)
{
    const int E = m->s.experts, k = m->s.topk;
    int32_t *ids = xmalloc(sizeof(int32_t) * T * k);
    float *wts = xmalloc(sizeof(float) * T * k);
    char *seen = xmalloc(E);
    double sum = 0;
    for (int r = 0; r < NSETS; r++) {
        moek_cuda_routing rt = {MOEK_CUDA_ROUTE_LOGITS, in->logits[r],
                                MOEK_SCORING_SOFTMAX, true, NULL, NULL, NULL, 0};
        CK(moek_cuda_fused_moe(layer, ws, in->x[r], &rt, T, in->out, stream));
        CK(moek_cuda_moe_read_routing(layer, ws, T, ids, wts, stream));
        memset(seen, 0, E);
        int n = 0;
        for (int i = 0; i < T * k; i++)
            if (ids[i] >= 0 && ids[i] < E && !seen[ids[i]]) {
                seen[ids[i]] = 1;
                n++;
            }
        sum += n;
    }
    free(ids);
    free(wts);
    free(seen);
    return sum / NSETS;
}

/* trace.cuh's switches, one per translation unit: present only in a
 * build with -DMOEK_TRACE. */
extern int moek_trace_set_gemm(void *buf) __attribute__((weak));
extern int moek_trace_set_route(void *buf) __attribute__((weak));
extern int moek_trace_set_layer(void *buf) __attribute__((weak));
static int trace_set(void *buf)
{
    return moek_trace_set_gemm(buf) || moek_trace_set_route(buf) ||
           moek_trace_set_layer(buf);
}

/* One replay of graph with the events on, written to PREFIX-NAME-T.csv. */
static void trace_replay(void *graph, void *stream, const char *name, int T)
{
    const char *prefix = getenv("MOEK_TRACE_OUT");
    if (!prefix || !*prefix)
        return;
    if (!moek_trace_set_gemm || !moek_trace_set_route ||
        !moek_trace_set_layer) {
        fprintf(stderr, "MOEK_TRACE_OUT: this build has no trace "
                        "(EXTRA_NVCCFLAGS=-DMOEK_TRACE)\n");
        return;
    }
    const size_t bytes = sizeof(moek_trace_ev) * MOEK_TRACE_EVENTS;
    moek_trace_ev *dev = dmalloc(bytes);
    CR(cudaMemset(dev, 0, bytes));
    if (trace_set(dev)) {
        fprintf(stderr, "trace: cannot set the buffer\n");
        exit(1);
    }
    CK(moek_cuda_graph_launch(graph, stream));
    CR(cudaStreamSynchronize((cudaStream_t)stream));
    CK(trace_set(NULL) ? -EIO : 0);
    moek_trace_ev *ev = xmalloc(bytes);
    CR(cudaMemcpy(ev, dev, bytes, cudaMemcpyDeviceToHost));
    unsigned long long t0 = ~0ULL;
    for (size_t i = 0; i < MOEK_TRACE_EVENTS; i++)
        if (ev[i].t && ev[i].t < t0)
            t0 = ev[i].t;
    char path[512];
    snprintf(path, sizeof path, "%s-%s-%d.csv", prefix, name, T);
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(1);
    }
    fprintf(f, "ns,kind,sm,cta,a,b\n");
    for (size_t i = 0; i < MOEK_TRACE_EVENTS; i++)
        if (ev[i].t)
            fprintf(f, "%llu,%d,%d,%d,%d,%d\n", ev[i].t - t0, ev[i].kind,
                    ev[i].sm, ev[i].cta, ev[i].a, ev[i].b);
    fclose(f);
    free(ev);
    moek_cuda_free(dev);
}

static double time_case(moek_cuda_moe_layer *layer, moek_cuda_workspace *ws,
                        inputs *in, int T, void *stream, double budget_ms,
                        const char *name)
{
    void *graphs[NSETS];
    for (int r = 0; r < NSETS; r++) {
        moek_cuda_routing rt = {MOEK_CUDA_ROUTE_LOGITS, in->logits[r],
                                MOEK_SCORING_SOFTMAX, true, NULL, NULL, NULL, 0};
        CK(moek_cuda_graph_begin(stream));
        CK(moek_cuda_fused_moe(layer, ws, in->x[r], &rt, T, in->out, stream));
        CK(moek_cuda_graph_end(stream, &graphs[r]));
    }
    double us = time_graphs(graphs, NSETS, stream, budget_ms);
    if (name)
        trace_replay(graphs[0], stream, name, T);
    for (int r = 0; r < NSETS; r++)
        moek_cuda_graph_free(graphs[r]);
    return us;
}

int main(int argc, char **argv)
{
    const char *peers_path = NULL, *only = NULL, *csv_path = NULL;
    bool sweep = false, streams = false;
    int only_t = 0, tile = 0, tile2 = 0;
    uint64_t seed = 0x5eed;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--peers") && i + 1 < argc)
            peers_path = argv[++i];
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc)
            csv_path = argv[++i];
        else if (!strcmp(argv[i], "--sweep"))
            sweep = true;
        else if (!strcmp(argv[i], "--streams"))
            streams = true;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            only_t = atoi(argv[++i]);
            if (only_t < 1 || only_t > 4096) {
                fprintf(stderr, "--tokens: 1 to 4096\n");
                return 2;
            }
        } else if ((!strcmp(argv[i], "--tile") ||
                    !strcmp(argv[i], "--tile2")) && i + 1 < argc) {
            const bool second = !strcmp(argv[i], "--tile2");
            const int t = atoi(argv[++i]);
            if (second)
                tile2 = t;
            else
                tile = t;
            bool ok = false;
            for (int j = 0; j < NTILES; j++)
                ok = ok || TILES[j] == t;
            if (!ok) {
                fprintf(stderr, "%s: one of", second ? "--tile2" : "--tile");
                for (int j = 0; j < NTILES; j++)
                    fprintf(stderr, " %d", TILES[j]);
                fputc('\n', stderr);
                return 2;
            }
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            char *end;
            seed = strtoull(argv[++i], &end, 0);
            if (*end || !*argv[i]) {
                fprintf(stderr, "--seed: an integer\n");
                return 2;
            }
            /* far from the 16 that each model and input set adds */
            seed = 0x5eed + (seed << 20);
        } else {
            fprintf(stderr,
                    "usage: %s [--peers FILE] [--csv FILE] [--sweep] [--only MODEL] "
                    "[--tokens T] [--tile N] [--tile2 N] [--seed S]\n"
                    "       %s --streams\n",
                    argv[0], argv[0]);
            return 2;
        }
    }
    if (moek_cuda_device_count() <= 0) {
        fprintf(stderr, "no CUDA device: nothing to benchmark\n");
        return 77;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (streams) {
        bench_streams();
        return 0;
    }
    char name[128];
    int cc = 0, sms = 0;
    CK(moek_cuda_device_name(0, name, sizeof name));
    CK(moek_cuda_device_info(0, &cc, &sms, NULL));
    CK(moek_cuda_set_device(0));
    if (peers_path)
        read_peers(peers_path);

    bench_ceil ce;
    bench_ceilings(&ce);
    printf("# device: %s, sm_%d, %d SMs\n", name, cc, sms);
    printf("# ceilings: streaming read %.0f GB/s, d2d copy %.0f GB/s (read + "
           "write), cuBLAS bf16 8192^3 %.0f TFLOP/s sustained (%.0f in "
           "bursts)\n",
           ce.read_gbs, ce.copy_gbs, ce.mm_tflops, ce.mm_burst_tflops);
    printf("# floor = max(bytes / %.0f GB/s, flops / %.0f TFLOP/s); ratio = "
           "best peer us / our us (> 1: faster)\n",
           ce.read_gbs, ce.mm_tflops);
    printf("| model | T | tile | us | floor us | %% of floor | TFLOP/s | GB/s "
           "| Triton us | grouped_mm us | ratio | experts hit | rel err |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");

    FILE *csv = csv_path ? fopen(csv_path, "w") : NULL;
    if (csv)
        fprintf(csv, "# read_gbs %.1f copy_gbs %.1f mm_tflops %.1f "
                     "mm_burst_tflops %.1f device %s\n"
                     "# model T tile us floor_us hit rel_err\n",
                ce.read_gbs, ce.copy_gbs, ce.mm_tflops, ce.mm_burst_tflops,
                name);
    void *stream = NULL;
    CK(moek_cuda_stream_new(&stream));
    for (size_t mi = 0; mi < sizeof MODELS / sizeof MODELS[0]; mi++) {
        const model *m = &MODELS[mi];
        if (only && strcmp(only, m->name))
            continue;
        const moek_moe_shape *s = &m->s;
        const int E = s->experts, H = s->hidden, I = s->intermediate;
        const size_t n = (size_t)E * H * I;
        const uint64_t wseed = seed += 16;
        void *w1 = dmalloc(n * 2), *w3 = dmalloc(n * 2), *w2 = dmalloc(n * 2);
        CK(moek_cuda_fill_uniform(w1, MOEK_DTYPE_BF16, n, wseed + 1,
                                  1.0f / sqrtf((float)H), NULL));
        CK(moek_cuda_fill_uniform(w3, MOEK_DTYPE_BF16, n, wseed + 2,
                                  1.0f / sqrtf((float)H), NULL));
        CK(moek_cuda_fill_uniform(w2, MOEK_DTYPE_BF16, n, wseed + 3,
                                  1.0f / sqrtf((float)I), NULL));
        moek_cuda_moe_layer *layer = NULL;
        CK(moek_cuda_moe_layer_new_from_device(s, MOEK_DTYPE_BF16, w1, w3, w2,
                                               0, &layer));
        const moek_cuda_tuning forced = {tile, false, tile2};
        CK(moek_cuda_moe_layer_tune(layer, &forced));
        moek_cuda_free(w1);
        moek_cuda_free(w2);
        moek_cuda_free(w3);
        moek_cuda_workspace *ws = NULL;
        CK(moek_cuda_workspace_new(0, moek_cuda_moe_workspace_size(layer, 4096),
                                   &ws));
        /* --tokens T: that count alone, in the grid or not (peers and the
         * floor's table cover the grid only). */
        const size_t n_t = only_t ? 1 : sizeof TOKENS / sizeof TOKENS[0];
        for (size_t ti = 0; ti < n_t; ti++) {
            const int T = only_t ? only_t : TOKENS[ti];
            inputs in;
            for (int r = 0; r < NSETS; r++) {
                in.seed[r] = seed += 16;
                in.x[r] = dmalloc((size_t)T * H * 2);
                in.logits[r] = dmalloc(sizeof(float) * T * E);
                CK(moek_cuda_fill_uniform(in.x[r], MOEK_DTYPE_BF16,
                                          (size_t)T * H, in.seed[r], 1.0f,
                                          NULL));
                CK(moek_cuda_fill_uniform(in.logits[r], MOEK_DTYPE_FP32,
                                          (size_t)T * E, in.seed[r] + 1, 1.0f,
                                          NULL));
            }
            in.out = dmalloc((size_t)T * H * 2);
            double err = check_case(m, layer, ws, &in, wseed, T,
                                    E >= 128 && H >= 4096 ? 1 : 2, stream);
            double hit = experts_hit(m, layer, ws, &in, T, stream);
            double us = time_case(layer, ws, &in, T, stream, 400.0, m->name);
            double bytes = hit * 3.0 * H * I * 2 + (double)T * H * 4 +
                           (double)T * E * 4;
            double flops = 6.0 * T * s->topk * (double)H * I;
            double floor_us = fmax(bytes / (ce.read_gbs * 1e3),
                                   flops / (ce.mm_tflops * 1e6));
            const peer_row *p = find_peer(m->name, T);
            double best = -1;
            if (p) {
                if (p->triton_us > 0)
                    best = p->triton_us;
                if (p->grouped_us > 0 && (best < 0 || p->grouped_us < best))
                    best = p->grouped_us;
            }
            char ratio[32] = "-", tri[32] = "-", gro[32] = "-";
            if (best > 0)
                snprintf(ratio, sizeof ratio, "%.2f", best / us);
            if (p && p->triton_us > 0)
                snprintf(tri, sizeof tri, "%.1f", p->triton_us);
            if (p && p->grouped_us > 0)
                snprintf(gro, sizeof gro, "%.1f", p->grouped_us);
            /* the token tile, GEMM 1's/GEMM 2's where they differ */
            char tl[32];
            const int bn1 = moek_cuda_moe_layer_token_tile(layer, T),
                      bn2 = moek_cuda_moe_layer_token_tile2(layer, T);
            if (bn1 == bn2)
                snprintf(tl, sizeof tl, "%d", bn1);
            else
                snprintf(tl, sizeof tl, "%d/%d", bn1, bn2);
            printf("| %s | %d | %s | %.1f | %.1f | %.1f | %.1f | %.0f | %s | "
                   "%s | %s | %.1f | %.1e |\n",
                   m->name, T, tl, us,
                   floor_us, 100.0 * floor_us / us, flops / us / 1e6,
                   bytes / us / 1e3, tri, gro, ratio, hit, err);
            if (csv) {
                fprintf(csv, "%s %d %s %.2f %.2f %.2f %.2e\n", m->name, T,
                        tl, us, floor_us,
                        hit, err);
                fflush(csv);
            }
            if (sweep) {
                printf("#   sweep %s T=%d:", m->name, T);
                for (int i = 0; i < NTILES; i++) {
                    moek_cuda_tuning tu = {TILES[i], false, 0};
                    CK(moek_cuda_moe_layer_tune(layer, &tu));
                    printf(" %d:%.1f", TILES[i],
                           time_case(layer, ws, &in, T, stream, 100.0, NULL));
                }
                CK(moek_cuda_moe_layer_tune(layer, &forced));
                printf("\n");
            }
            for (int r = 0; r < NSETS; r++) {
                moek_cuda_free(in.x[r]);
                moek_cuda_free(in.logits[r]);
            }
            moek_cuda_free(in.out);
        }
        moek_cuda_workspace_free(ws);
        moek_cuda_moe_layer_free(layer);
    }
    moek_cuda_stream_free(stream);
    if (csv)
        fclose(csv);
    return 0;
}
