/*
 * bench_ep.c: one MoE layer spread over several GPUs (expert parallelism)
 * against the same layer on one GPU.
 *
 *   build: make -C kernels/bench BUILD=<abs build dir> ep
 *   run:   bench_ep [--gpus N] [--only MODEL] [--tokens T] [--reps R]
 *
 * For each BENCH.md shape (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3) the
 * full bf16 layer is generated on device 0 (moek_cuda_fill_uniform, so no
 * host traffic) and, for every device count n (2 up to --gpus), the same
 * tensors are generated on each device and device i keeps the contiguous
 * i-th n-th of the experts, as moed's even placement does. For T = 1, 64,
 * 512, 4096 tokens with fresh random inputs (x, router logits: softmax,
 * top-k, renormalised):
 *
 *   1 GPU:  copies in from pinned host memory, moek_cuda_fused_moe, copy
 *           out (what moed's compute thread does, without a CUDA graph);
 *   n GPUs: moek_cuda_ep_forward, through each transport (NCCL, peer
 *           copies): copies in, the batch to every device, each device's
 *           experts, the partials back and summed on device 0, copy out.
 *
 * The n-GPU output must match the one-GPU output within bf16 tolerance
 * (the partials are rounded to bf16 before the fp32 sum): max |diff| over
 * max |out| <= 2e-2. Timing: wall clock per forward, host to host, median
 * of --reps after warm-ups. Efficiency = t1 / (n * tn).
 */
#include "moe_kernels.h"
#include "cuda/moe_cuda.h"
#include "bench_check.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAXG 8

static const struct {
    const char *name;
    moek_moe_shape s;
} models[] = {
    {"mixtral-8x7b", {8, 2, 4096, 14336}},
    {"qwen3-30b-a3b", {128, 8, 2048, 768}},
    {"deepseek-v3", {256, 8, 7168, 2048}},
};
static const int token_counts[] = {1, 64, 512, 4096};

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}

/* The layer's tensors on `device`, generated from fixed seeds. */
typedef struct full_tensors {
    void *w1, *w3, *w2;
} full_tensors;

static void make_full(int device, const moek_moe_shape *s, full_tensors *t)
{
    size_t n = (size_t)s->experts * s->intermediate * s->hidden;
    CK(moek_cuda_set_device(device));
    CK(moek_cuda_malloc(n * 2, &t->w1));
    CK(moek_cuda_malloc(n * 2, &t->w3));
    CK(moek_cuda_malloc(n * 2, &t->w2));
    CK(moek_cuda_fill_uniform(t->w1, MOEK_DTYPE_BF16, n, 11, 1.0f / sqrtf((float)s->hidden), NULL));
    CK(moek_cuda_fill_uniform(t->w3, MOEK_DTYPE_BF16, n, 12, 1.0f / sqrtf((float)s->hidden), NULL));
    CK(moek_cuda_fill_uniform(t->w2, MOEK_DTYPE_BF16, n, 13,
                              1.0f / sqrtf((float)s->intermediate), NULL));
    CR(cudaDeviceSynchronize());
}

static void free_full(full_tensors *t)
{
    moek_cuda_free(t->w1);
    moek_cuda_free(t->w2);
    moek_cuda_free(t->w3);
}

/* Device i of n: experts [e0, e1), its layer and remap table. */
typedef struct shard {
    int e0, e1;
    moek_cuda_moe_layer *layer;
    int32_t *remap_dev;
} shard;

static void make_shard(int device, int i, int n, const moek_moe_shape *s, shard *sh)
{
    const int E = s->experts;
    sh->e0 = (int)((long long)i * E / n);
    sh->e1 = (int)((long long)(i + 1) * E / n);
    full_tensors t;
    make_full(device, s, &t);
    const size_t per = (size_t)s->intermediate * s->hidden * 2, off = (size_t)sh->e0 * per;
    moek_moe_shape local = *s;
    local.experts = sh->e1 - sh->e0;
    CK(moek_cuda_moe_layer_new_from_device(&local, MOEK_DTYPE_BF16, (char *)t.w1 + off,
                                           (char *)t.w3 + off, (char *)t.w2 + off, device,
                                           &sh->layer));
    CR(cudaDeviceSynchronize());
    free_full(&t);
    int32_t *remap = malloc((size_t)E * sizeof(int32_t));
    for (int e = 0; e < E; e++)
        remap[e] = e >= sh->e0 && e < sh->e1 ? e - sh->e0 : -1;
    CK(moek_cuda_malloc((size_t)E * sizeof(int32_t), (void **)&sh->remap_dev));
    CK(moek_cuda_copy_to_device(sh->remap_dev, remap, (size_t)E * sizeof(int32_t)));
    free(remap);
}

/* max |a - b| / max |a| over n bf16 values; NaN anywhere fails. */
static double rel_diff(const uint16_t *a, const uint16_t *b, size_t n)
{
    double mx = 0, md = 0;
    for (size_t i = 0; i < n; i++) {
        double x = moek_bf16_to_f32(a[i]), y = moek_bf16_to_f32(b[i]);
        if (isnan(x) || isnan(y))
            return INFINITY;
        mx = fmax(mx, fabs(x));
        md = fmax(md, fabs(x - y));
    }
    return mx > 0 ? md / mx : INFINITY;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float rnd(float scale)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return scale * ((float)(rng_state >> 40) * (1.0f / 8388608.0f) - 1.0f);
}

int main(int argc, char **argv)
{
    int max_g = 0, reps = 20, only_t = 0;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--gpus") && i + 1 < argc)
            max_g = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            only_t = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_ep [--gpus N] [--only MODEL] [--tokens T] [--reps R]\n");
            return 2;
        }
    }
    int have = moek_cuda_device_count();
    if (max_g <= 0 || max_g > have)
        max_g = have;
    if (max_g > MAXG)
        max_g = MAXG;
    if (max_g < 2) {
        printf("SKIP bench_ep: %d CUDA device(s); needs 2 or more\n", have);
        return 0;
    }
    if (reps < 3)
        reps = 3;
    char name[96];
    moek_cuda_device_name(0, name, sizeof name);
    printf("# bench_ep: %d x %s\n", max_g, name);
    for (int i = 0; i < max_g; i++)
        for (int j = 0; j < max_g; j++) {
            int can = 0;
            if (i != j && cudaDeviceCanAccessPeer(&can, i, j) == cudaSuccess)
                printf("# peer access %d -> %d: %s\n", i, j, can ? "yes" : "no");
        }

    /* Groups: for n = 2..max_g, NCCL and peer copies. */
    moek_cuda_ep *ep[MAXG + 1][2] = {{0}};
    const char *tname[2] = {"nccl", "peer"};
    int devs[MAXG];
    for (int i = 0; i < MAXG; i++)
        devs[i] = i;
    for (int n = 2; n <= max_g; n++)
        for (int t = 0; t < 2; t++) {
            int rc = moek_cuda_ep_new(devs, n, t == 0 ? MOEK_CUDA_EP_NCCL : MOEK_CUDA_EP_PEER,
                                      &ep[n][t]);
            printf("# %d GPUs, %s: %s\n", n, tname[t],
                   rc ? moek_cuda_last_error() : moek_cuda_ep_transport_name(ep[n][t]));
        }

    int failures = 0;
    printf("\n| model | T | GPUs | transport | us | 1-GPU us | speed-up | efficiency | rel diff |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        if (only && strcmp(only, models[m].name))
            continue;
        const moek_moe_shape *s = &models[m].s;
        const int E = s->experts, H = s->hidden, Tmax = 4096;
        /* One GPU: the whole layer on device 0. */
        full_tensors ft;
        make_full(0, s, &ft);
        moek_cuda_moe_layer *one;
        CK(moek_cuda_moe_layer_new_from_device(s, MOEK_DTYPE_BF16, ft.w1, ft.w3, ft.w2, 0, &one));
        CR(cudaDeviceSynchronize());
        free_full(&ft);
        moek_cuda_workspace *ws;
        CK(moek_cuda_workspace_new(0, moek_cuda_moe_workspace_size(one, Tmax), &ws));
        void *st, *xd, *ld, *od;
        CK(moek_cuda_stream_new(&st));
        CK(moek_cuda_malloc((size_t)Tmax * H * 2, &xd));
        CK(moek_cuda_malloc((size_t)Tmax * E * 4, &ld));
        CK(moek_cuda_malloc((size_t)Tmax * H * 2, &od));
        /* Shards for every n. */
        shard sh[MAXG + 1][MAXG];
        memset(sh, 0, sizeof sh);
        for (int n = 2; n <= max_g; n++)
            for (int i = 0; i < n; i++)
                make_shard(i, i, n, s, &sh[n][i]);
        uint16_t *x, *out1, *outn;
        float *logits;
        CR(cudaMallocHost((void **)&x, (size_t)Tmax * H * 2));
        CR(cudaMallocHost((void **)&out1, (size_t)Tmax * H * 2));
        CR(cudaMallocHost((void **)&outn, (size_t)Tmax * H * 2));
        CR(cudaMallocHost((void **)&logits, (size_t)Tmax * E * 4));
        double *tv = malloc((size_t)reps * sizeof(double));

        for (size_t ti = 0; ti < sizeof(token_counts) / sizeof(token_counts[0]); ti++) {
            const int T = token_counts[ti];
            if (only_t && T != only_t)
                continue;
            for (size_t i = 0; i < (size_t)T * H; i++)
                x[i] = moek_f32_to_bf16(rnd(1.0f));
            for (size_t i = 0; i < (size_t)T * E; i++)
                logits[i] = rnd(2.0f);
            moek_cuda_routing r = {.kind = MOEK_CUDA_ROUTE_LOGITS, .logits_dev = ld,
                                   .scoring = MOEK_SCORING_SOFTMAX, .renormalize = true};
            memset(out1, 0xff, (size_t)T * H * 2); /* poison: NaN in bf16 */
            for (int it = 0; it < reps + 3; it++) {
                double t0 = now_us();
                CK(moek_cuda_set_device(0));
                CK(moek_cuda_copy_async(xd, x, (size_t)T * H * 2, 0, st));
                CK(moek_cuda_copy_async(ld, logits, (size_t)T * E * 4, 0, st));
                CK(moek_cuda_fused_moe(one, ws, xd, &r, T, od, st));
                CK(moek_cuda_copy_async(out1, od, (size_t)T * H * 2, 1, st));
                CK(moek_cuda_stream_sync(st));
                if (it >= 3)
                    tv[it - 3] = now_us() - t0;
            }
            const double t1 = median(tv, reps);
            printf("| %s | %d | 1 | - | %.1f | %.1f | 1.00 | 1.00 | - |\n", models[m].name, T, t1, t1);
            for (int n = 2; n <= max_g; n++)
                for (int t = 0; t < 2; t++) {
                    if (!ep[n][t])
                        continue;
                    moek_cuda_moe_layer *layers[MAXG];
                    const int32_t *remaps[MAXG];
                    for (int i = 0; i < n; i++) {
                        layers[i] = sh[n][i].layer;
                        remaps[i] = sh[n][i].remap_dev;
                    }
                    moek_cuda_routing rh = {.kind = MOEK_CUDA_ROUTE_LOGITS, .logits_dev = logits,
                                            .scoring = MOEK_SCORING_SOFTMAX, .renormalize = true};
                    memset(outn, 0xff, (size_t)T * H * 2);
                    for (int it = 0; it < reps + 3; it++) {
                        double t0 = now_us();
                        CK(moek_cuda_ep_forward(ep[n][t], layers, remaps, E, x, &rh, T, outn));
                        if (it >= 3)
                            tv[it - 3] = now_us() - t0;
                    }
                    const double tn = median(tv, reps);
                    const double d = rel_diff(out1, outn, (size_t)T * H);
                    const bool ok = d <= 2e-2;
                    failures += !ok;
                    printf("| %s | %d | %d | %s | %.1f | %.1f | %.2f | %.2f | %.1e%s |\n",
                           models[m].name, T, n, tname[t], tn, t1, t1 / tn, t1 / (n * tn), d,
                           ok ? "" : " FAIL");
                    fflush(stdout);
                }
        }
        free(tv);
        cudaFreeHost(x);
        cudaFreeHost(out1);
        cudaFreeHost(outn);
        cudaFreeHost(logits);
        for (int n = 2; n <= max_g; n++)
            for (int i = 0; i < n; i++) {
                moek_cuda_set_device(i);
                moek_cuda_moe_layer_free(sh[n][i].layer);
                moek_cuda_free(sh[n][i].remap_dev);
            }
        moek_cuda_set_device(0);
        moek_cuda_moe_layer_free(one);
        moek_cuda_workspace_free(ws);
        moek_cuda_free(xd);
        moek_cuda_free(ld);
        moek_cuda_free(od);
        moek_cuda_stream_free(st);
    }
    for (int n = 2; n <= max_g; n++)
        for (int t = 0; t < 2; t++)
            moek_cuda_ep_free(ep[n][t]);
    printf("\n%s: %d case(s) outside tolerance\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
