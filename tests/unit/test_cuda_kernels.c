/*
 * test_cuda_kernels.c: the CUDA kernels (kernels/cuda/moe_cuda.h) against the
 * reference kernels (moek_ref_*), on the GPU; every case skips (exit 77) with
 * a clear line on a machine without one.
 *
 * Inputs are fresh random values each run (MOE_TEST_SEED replays a run),
 * made on the device by moek_cuda_fill_uniform and rebuilt bit for bit on the
 * host with moek_cuda_uniform_value for the reference, so even the 22 GB
 * deepseek layer costs no host-to-device traffic: the reference rebuilds only
 * the experts that the checked tokens use. Outputs are filled with NaN bytes
 * before every call; an unwritten element fails the NaN scan.
 *
 * Covered: the three BENCH.md layer shapes (small T for the big two), T = 1,
 * 3, 8, 64, 100, 512, 4096, top-k 1, 2, 8, E = 8, 128, 256 with most experts
 * empty (and 200, 512: the small-batch tile list over chunks of experts),
 * routing given or computed (softmax / sigmoid, renormalised or not,
 * and the NaN rule), bf16 and fp16, every token tile and the portable SIMT
 * path and GEMM 2 on a tile of its own, slot mode (GEMM 2's rows per slot,
 * summed by the finalize) and the
 * fp32 accumulator it replaces, decode GEMM 2 in stream-K and in K splits,
 * GEMM 2 starting per group or (MOEK_CUDA_NO_DEP=1) after the whole of
 * GEMM 1, the routing cluster capped, a CUDA graph replayed on new data,
 * the grouped GEMM with empty groups, the token-tile table (refusals, the
 * tile it picks, forwards through it) and the autotuner, the row copy by
 * kernel between pinned host segments and the device, and the refusals
 * (-ENOTSUP, -EINVAL, -ENOSPC, -ENODEV).
 */
#include "tests/harness.h"
#include "moe_kernels.h"
#include "cuda/moe_cuda.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CK(call)                                                              \
    do {                                                                      \
        int r_ = (call);                                                      \
        if (r_)                                                               \
            FAIL_AT("%s = %d (%s)", #call, r_, moek_cuda_last_error());       \
    } while (0)

static void need_gpu(void)
{
    if (moek_cuda_device_count() <= 0)
        TEST_SKIP("no CUDA device on this machine (moek_cuda_device_count() "
                  "is 0): the CUDA kernels are not checked here");
}

/* Compute capability of device 0 (90 on Hopper, where tiles are chosen). */
static int device_cc(void)
{
    int cc = 0;
    CK(moek_cuda_device_info(0, &cc, NULL, NULL));
    return cc;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

static void *dmalloc(size_t n)
{
    void *p = NULL;
    CK(moek_cuda_malloc(n, &p));
    return p;
}

/* Host copy of elements [first, first + n) of a tensor filled on the device
 * with moek_cuda_fill_uniform(seed, scale), in dtype dt. */
static void host_fill(void *dst, moek_dtype dt, uint64_t seed, size_t first,
                      size_t n, float scale)
{
    CK(moek_cuda_uniform_host(dst, dt, seed, first, n, scale));
}

static double tolerance(moek_dtype dt)
{
    return dt == MOEK_DTYPE_BF16 ? 1.5e-2 : 4e-3;
}

static const char *dt_name(moek_dtype dt)
{
    return dt == MOEK_DTYPE_BF16 ? "bf16" : "fp16";
}

/* ---- fused MoE ---------------------------------------------------------- */

enum { ROUTE_GIVEN, ROUTE_SOFTMAX, ROUTE_SIGMOID };

typedef struct moe_case {
    moek_moe_shape s;
    moek_dtype dt;
    int tokens;
    int route;
    bool renorm;
    int used_experts; /* given routing draws from this many experts (0: all) */
    int check_tokens; /* check at most this many tokens (0: all) */
    moek_cuda_tuning tune;
    bool nan_logit;   /* put a NaN into token 0's logits */
    bool holes;       /* given routing: every third slot -1 (none) */
    const int *expert_rows; /* given routing: expert e gets expert_rows[e]
                               of the T k slots (summing to T k), shuffled */
} moe_case;

/* A token-tile table for the layer of a case (none: n_rules 0), the tile a
 * call of the case's token count must use on sm_90 (0: any), which cluster
 * mode it takes, and a workspace short of the sized one. */
typedef struct tile_opts {
    const moek_cuda_tile_rule *rules;
    int n_rules;
    int expect_tile;
    int expect_cluster; /* EXPECT_MODE(m): moek_cuda_moe_layer_uses_cluster
                           must be m for the call; 0: any */
    size_t ws_short;    /* bytes less than moek_cuda_moe_workspace_size */
    int expect_slots;   /* EXPECT_MODE(b): moek_cuda_moe_layer_uses_slots
                           must be b; 0: any */
    int *dep_calls;     /* or NULL: counts the calls that start GEMM 2 per
                           group (moek_cuda_moe_layer_uses_dep) */
    int expect_tile2;   /* GEMM 2's tile on sm_90 (0: any) */
} tile_opts;
#define EXPECT_MODE(m) ((m) + 1)

/* Given routing: expert e for rows[e] of the n slots, in random order. */
static void given_rows(const int *rows, int E, int n, int32_t *ids, float *wts,
                       uint64_t *rng)
{
    int q = 0;
    for (int e = 0; e < E; e++)
        for (int r = 0; r < rows[e] && q < n; r++)
            ids[q++] = e;
    CHECK_EQ_INT(q, n);
    for (int i = n - 1; i > 0; i--) {
        const int j = (int)(test_rand(rng) % (uint64_t)(i + 1));
        const int32_t v = ids[i];
        ids[i] = ids[j];
        ids[j] = v;
    }
    for (int i = 0; i < n; i++)
        wts[i] = (test_randf(rng) + 1.0f) * 0.5f;
}

/* Given routing: k experts per token from the case's used experts,
 * distinct when there are k of them, every third slot -1 with holes. */
static void given_random(const moe_case *c, int32_t *ids, float *wts,
                         uint64_t *rng)
{
    const int E = c->s.experts, k = c->s.topk;
    const int used = c->used_experts ? c->used_experts : E;
    for (int t = 0; t < c->tokens; t++) {
        for (int j = 0; j < k; j++) {
            int e;
            bool again;
            do { /* distinct per token when there are enough experts */
                e = (int)(test_rand(rng) % (uint64_t)used);
                if (used < E)
                    e = (int)((uint64_t)e * 7919 % (uint64_t)E);
                again = false;
                for (int q = 0; q < j && used >= k; q++)
                    again |= ids[t * k + q] == e;
            } while (again);
            ids[t * k + j] = c->holes && (t * k + j) % 3 == 1 ? -1 : e;
            wts[t * k + j] = (test_randf(rng) + 1.0f) * 0.5f;
        }
    }
}

/* A mode the layer reports for case c's call (got) against an
 * EXPECT_MODE expectation (0: any). */
static void check_mode(const char *what, int expect, int got,
                       const moe_case *c)
{
    if (expect)
        CHECK_MSG(EXPECT_MODE(got) == expect, "tile %d, T=%d: %s %d on cc %d",
                  c->tune.token_tile, c->tokens, what, got, device_cc());
}

/* Run one fused MoE on the GPU and compare it with moek_ref_fused_moe. */
static void run_moe_tiles(const moe_case *c, const tile_opts *to, uint64_t *rng)
{
    const moek_moe_shape *s = &c->s;
    const int E = s->experts, k = s->topk, H = s->hidden, I = s->intermediate;
    const int T = c->tokens;
    const moek_dtype dt = c->dt;
    const size_t es = moek_dtype_size(dt), ih = (size_t)I * H;
    const uint64_t seed = test_rand(rng);
    const float sc13 = 1.0f / sqrtf((float)H), sc2 = 1.0f / sqrtf((float)I);

    /* Weights: stacked tensors filled on the device, then the layer. */
    void *w1 = dmalloc(E * ih * es), *w3 = dmalloc(E * ih * es),
         *w2 = dmalloc(E * ih * es);
    CK(moek_cuda_fill_uniform(w1, dt, E * ih, seed + 1, sc13, NULL));
    CK(moek_cuda_fill_uniform(w3, dt, E * ih, seed + 2, sc13, NULL));
    CK(moek_cuda_fill_uniform(w2, dt, E * ih, seed + 3, sc2, NULL));
    moek_cuda_moe_layer *layer = NULL;
    CK(moek_cuda_moe_layer_new_from_device(s, dt, w1, w3, w2, 0, &layer));
    moek_cuda_free(w1);
    moek_cuda_free(w2);
    moek_cuda_free(w3);
    CK(moek_cuda_moe_layer_tune(layer, &c->tune));
    if (to) {
        CK(moek_cuda_moe_layer_set_tiles(layer, to->rules, to->n_rules));
        if (to->expect_tile && device_cc() == 90)
            CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(layer, T), to->expect_tile);
        if (to->expect_tile2 && device_cc() == 90)
            CHECK_EQ_INT(moek_cuda_moe_layer_token_tile2(layer, T),
                         to->expect_tile2);
        check_mode("cluster mode", to->expect_cluster,
                   moek_cuda_moe_layer_uses_cluster(layer, T), c);
        check_mode("slot mode", to->expect_slots,
                   moek_cuda_moe_layer_uses_slots(layer, T), c);
        if (to->dep_calls)
            *to->dep_calls += moek_cuda_moe_layer_uses_dep(layer, T);
    }

    void *x = dmalloc((size_t)T * H * es), *out = dmalloc((size_t)T * H * es);
    CK(moek_cuda_fill_uniform(x, dt, (size_t)T * H, seed + 4, 1.0f, NULL));
    CK(moek_cuda_memset(out, 0xff, (size_t)T * H * es));

    int32_t *ids = xmalloc(sizeof(int32_t) * T * k);
    float *wts = xmalloc(sizeof(float) * T * k);
    moek_cuda_routing rt = {0};
    float *logits = NULL;
    void *d_logits = NULL, *d_ids = NULL, *d_wts = NULL;
    if (c->route == ROUTE_GIVEN) {
        if (c->expert_rows)
            given_rows(c->expert_rows, E, T * k, ids, wts, rng);
        else
            given_random(c, ids, wts, rng);
        d_ids = dmalloc(sizeof(int32_t) * T * k);
        d_wts = dmalloc(sizeof(float) * T * k);
        CK(moek_cuda_copy_to_device(d_ids, ids, sizeof(int32_t) * T * k));
        CK(moek_cuda_copy_to_device(d_wts, wts, sizeof(float) * T * k));
        rt.kind = MOEK_CUDA_ROUTE_GIVEN;
        rt.ids_dev = d_ids;
        rt.weights_dev = d_wts;
    } else {
        d_logits = dmalloc(sizeof(float) * T * E);
        CK(moek_cuda_fill_uniform(d_logits, MOEK_DTYPE_FP32, (size_t)T * E,
                                  seed + 5, 4.0f, NULL));
        logits = xmalloc(sizeof(float) * T * E);
        host_fill(logits, MOEK_DTYPE_FP32, seed + 5, 0, (size_t)T * E, 4.0f);
        if (c->nan_logit) {
            logits[E / 2] = NAN;
            CK(moek_cuda_copy_to_device(d_logits, logits, sizeof(float) * E));
        }
        rt.kind = MOEK_CUDA_ROUTE_LOGITS;
        rt.logits_dev = d_logits;
        rt.scoring = c->route == ROUTE_SOFTMAX ? MOEK_SCORING_SOFTMAX
                                               : MOEK_SCORING_SIGMOID;
        rt.renormalize = c->renorm;
    }

    moek_cuda_workspace *ws = NULL;
    CK(moek_cuda_workspace_new(0,
                               moek_cuda_moe_workspace_size(layer, T) -
                                   (to ? to->ws_short : 0),
                               &ws));
    void *stream = NULL;
    CK(moek_cuda_stream_new(&stream));
    CK(moek_cuda_fused_moe(layer, ws, x, &rt, T, out, stream));
    CK(moek_cuda_stream_sync(stream));

    if (c->route != ROUTE_GIVEN) {
        /* The GPU's routing against the reference's; a different pick is
         * allowed only on a near tie of the two scores. The output check
         * below then uses the GPU's picks. */
        int32_t *rid = xmalloc(sizeof(int32_t) * T * k);
        float *rw = xmalloc(sizeof(float) * T * k);
        moek_ref_route(logits, T, E, k, rt.scoring, c->renorm, rid, rw);
        CK(moek_cuda_moe_read_routing(layer, ws, T, ids, wts, stream));
        int differ = 0;
        for (int t = 0; t < T; t++) {
            for (int j = 0; j < k; j++) {
                size_t q = (size_t)t * k + j;
                if (ids[q] != rid[q]) {
                    float a = logits[(size_t)t * E + ids[q]];
                    float b = logits[(size_t)t * E + rid[q]];
                    CHECK_MSG(fabsf(a - b) <= 1e-5f * fabsf(a) + 1e-6f,
                              "token %d pick %d: GPU expert %d (logit %g), "
                              "reference %d (logit %g)",
                              t, j, ids[q], a, rid[q], b);
                    differ++;
                    break;
                }
                bool both_nan = isnan(wts[q]) && isnan(rw[q]);
                CHECK_MSG(both_nan || fabsf(wts[q] - rw[q]) <=
                                          2e-5f * fabsf(rw[q]) + 1e-7f,
                          "token %d pick %d: weight %g, reference %g", t, j,
                          wts[q], rw[q]);
            }
        }
        CHECK_MSG(differ <= T / 100 + 1, "%d of %d tokens routed differently",
                  differ, T);
        free(rid);
        free(rw);
    }

    /* Output: every element written (no poison left: a NaN logit only
     * ranks last);
     * then the checked tokens against the reference. */
    uint16_t *got = xmalloc((size_t)T * H * es);
    CK(moek_cuda_copy_to_host(got, out, (size_t)T * H * es));
    float *gotf = xmalloc(sizeof(float) * T * H);
    moek_to_f32(dt, got, gotf, (size_t)T * H);
    for (size_t i = 0; i < (size_t)T * H; i++)
        CHECK_MSG(isfinite(gotf[i]), "out[%zu][%zu] = %g (unwritten?)", i / H,
                  i % H, gotf[i]);

    int nt = c->check_tokens && c->check_tokens < T ? c->check_tokens : T;
    int *tok = xmalloc(sizeof(int) * nt);
    for (int i = 0; i < nt; i++)
        tok[i] = (int)((long long)i * T / nt);
    /* Compact the experts the checked tokens use. */
    int *map = xmalloc(sizeof(int) * E), ne = 0;
    for (int e = 0; e < E; e++)
        map[e] = -1;
    int32_t *cid = xmalloc(sizeof(int32_t) * nt * k);
    float *cw = xmalloc(sizeof(float) * nt * k);
    for (int i = 0; i < nt; i++)
        for (int j = 0; j < k; j++) {
            int e = ids[(size_t)tok[i] * k + j];
            CHECK(e >= (c->holes ? -1 : 0) && e < E);
            if (e >= 0 && map[e] < 0)
                map[e] = ne++;
            cid[i * k + j] = e < 0 ? -1 : map[e];
            cw[i * k + j] = wts[(size_t)tok[i] * k + j];
        }
    /* The reference wants k <= E: pad with unused zero experts. */
    const int ce = ne < k ? k : ne;
    char *c1 = calloc(ce, ih * es), *c3 = calloc(ce, ih * es),
         *c2 = calloc(ce, ih * es);
    CHECK(c1 && c2 && c3);
    for (int e = 0; e < E; e++) {
        if (map[e] < 0)
            continue;
        size_t at = (size_t)map[e] * ih * es;
        host_fill(c1 + at, dt, seed + 1, e * ih, ih, sc13);
        host_fill(c3 + at, dt, seed + 2, e * ih, ih, sc13);
        host_fill(c2 + at, dt, seed + 3, e * ih, ih, sc2);
    }
    char *cx = xmalloc((size_t)nt * H * es), *cref = xmalloc((size_t)nt * H * es);
    for (int i = 0; i < nt; i++)
        host_fill(cx + (size_t)i * H * es, dt, seed + 4, (size_t)tok[i] * H, H,
                  1.0f);
    moek_moe_shape cs = *s;
    cs.experts = ce;
    CHECK_EQ_INT(moek_ref_fused_moe(&cs, dt, cx, cid, cw, c1, c3, c2, nt, cref),
                 0);
    float *want = xmalloc(sizeof(float) * nt * H), *have = xmalloc(sizeof(float) * nt * H);
    moek_to_f32(dt, cref, want, (size_t)nt * H);
    for (int i = 0; i < nt; i++)
        memcpy(have + (size_t)i * H, gotf + (size_t)tok[i] * H, sizeof(float) * H);
    double err = moek_rel_error(have, want, (size_t)nt * H);
    fprintf(stderr,
            "  E=%d k=%d H=%d I=%d T=%d %s route=%d renorm=%d tile=%d%s: "
            "rel err %.2e over %d tokens\n",
            E, k, H, I, T, dt_name(dt), c->route, c->renorm,
            moek_cuda_moe_layer_token_tile(layer, T),
            c->tune.generic ? " simt" : "", err, nt);
    CHECK_MSG(err < tolerance(dt), "rel err %g >= %g", err, tolerance(dt));

    free(want);
    free(have);
    free(cx);
    free(cref);
    free(c1);
    free(c2);
    free(c3);
    free(cid);
    free(cw);
    free(map);
    free(tok);
    free(got);
    free(gotf);
    free(ids);
    free(wts);
    free(logits);
    moek_cuda_free(d_logits);
    moek_cuda_free(d_ids);
    moek_cuda_free(d_wts);
    moek_cuda_free(x);
    moek_cuda_free(out);
    moek_cuda_stream_free(stream);
    moek_cuda_workspace_free(ws);
    moek_cuda_moe_layer_free(layer);
}

static void run_moe(const moe_case *c, uint64_t *rng)
{
    run_moe_tiles(c, NULL, rng);
}

/* The host's copy of a device-filled tensor (no GPU needed): every slice,
 * on however many threads, is the generator's values rounded to the dtype. */
TEST(uniform_host_matches_the_generator)
{
    static const moek_dtype dts[] = {MOEK_DTYPE_FP32, MOEK_DTYPE_BF16,
                                     MOEK_DTYPE_FP16};
    static const size_t ns[] = {0, 1, 17, 100003};
    for (size_t d = 0; d < ARRAY_LEN(dts); d++) {
        for (size_t j = 0; j < ARRAY_LEN(ns); j++) {
            const size_t n = ns[j], first = 12345 * j;
            const size_t es = moek_dtype_size(dts[d]);
            char *got = xmalloc(n * es + 1), *want = xmalloc(n * es + 1);
            float *f = xmalloc(sizeof(float) * (n + 1));
            CK(moek_cuda_uniform_host(got, dts[d], 77 + j, first, n, 0.5f));
            for (size_t i = 0; i < n; i++)
                f[i] = moek_cuda_uniform_value(77 + j, first + i, 0.5f);
            moek_from_f32(dts[d], f, want, n);
            CHECK_MSG(memcmp(got, want, n * es) == 0, "dtype %d, n %zu",
                      (int)dts[d], n);
            free(got);
            free(want);
            free(f);
        }
    }
    CHECK_EQ_INT(moek_cuda_uniform_host(NULL, MOEK_DTYPE_BF16, 1, 0, 4, 1.0f),
                 -EINVAL);
}

TEST(cuda_device)
{
    need_gpu();
    char name[128];
    int cc = 0, sms = 0;
    size_t mem = 0;
    CK(moek_cuda_device_name(0, name, sizeof name));
    CK(moek_cuda_device_info(0, &cc, &sms, &mem));
    fprintf(stderr, "  device 0: %s, sm_%d, %d SMs, %.1f GiB\n", name, cc, sms,
            mem / 1073741824.0);
    CHECK(sms > 0 && mem > 0);
    CHECK(moek_cuda_context_ok());
}

/* E x k x T over small layers; dtype and routing rotate through the runs. */
TEST(moe_sweep)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const moek_moe_shape shapes[] = {
        {8, 0, 256, 192}, {128, 0, 136, 96}, {256, 0, 512, 64}};
    static const int topks[] = {1, 2, 8};
    static const int tokens[] = {1, 3, 8, 64, 100, 512};
    int run = 0;
    for (int si = 0; si < 3; si++)
        for (int ki = 0; ki < 3; ki++)
            for (int ti = 0; ti < 6; ti++, run++) {
                moe_case c = {0};
                c.s = shapes[si];
                c.s.topk = topks[ki];
                c.dt = run % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16;
                c.tokens = tokens[ti];
                switch (run % 6) {
                case 0: c.route = ROUTE_GIVEN; break;
                case 1: c.route = ROUTE_GIVEN; c.used_experts = 3; break;
                case 2: c.route = ROUTE_SOFTMAX; c.renorm = true; break;
                case 3: c.route = ROUTE_SOFTMAX; break;
                case 4: c.route = ROUTE_SIGMOID; c.renorm = true; break;
                default: c.route = ROUTE_SIGMOID; break;
                }
                c.check_tokens = 128;
                run_moe(&c, &rng);
            }
}

/* Decode batches (the one-warp plan for T k <= 32, and past it): given
 * routing with empty slots (-1) and with one expert picked twice by a
 * token. */
TEST(moe_decode_slots)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int tokens[] = {1, 2, 3, 4, 5, 16, 17};
    for (int i = 0; i < 7; i++) {
        moe_case c = {{8, 8, 256, 192}, i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16,
                      tokens[i], ROUTE_GIVEN, false, 0, 0, {0, false, 0}, false,
                      true, NULL};
        c.s.topk = tokens[i] > 4 ? 2 : 8;
        run_moe(&c, &rng);
        c.holes = false;
        c.used_experts = 3; /* k = 8 of 3 experts: repeats in every token */
        run_moe(&c, &rng);
    }
}

/* The small-batch routing kernel's tile list over chunks of 32 experts,
 * a warp per chunk: fewer warps than chunks (some warps take two: E = 256
 * at T = 5, E = 512 at T = 9), a partial last chunk (E = 200), a two-CTA
 * cluster (T = 40, and T = 33 with one warp of CTA 0 left over), each
 * routing rule once; then fewer warps than chunks with two tile classes
 * (a forced 128-row tile: one expert of 33 rows takes the 64-wide class,
 * seven of one row the 32-wide one, spread over the chunks). */
TEST(moe_align_chunks)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const struct {
        int E, k, T;
    } cs[] = {{256, 8, 5}, {512, 4, 9}, {200, 8, 7}, {200, 8, 40},
              {512, 8, 33}};
    for (int i = 0; i < 5; i++) {
        moe_case c = {{cs[i].E, cs[i].k, 128, 64},
                      i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16,
                      cs[i].T,
                      i % 3 == 0   ? ROUTE_GIVEN
                      : i % 3 == 1 ? ROUTE_SOFTMAX
                                   : ROUTE_SIGMOID,
                      true,
                      0,
                      0,
                      {0, false, 0},
                      false,
                      i == 3,
                      NULL};
        run_moe(&c, &rng);
    }
    static const int rows[256] = {[7] = 33,   [40] = 1,  [80] = 1,
                                  [120] = 1,  [160] = 1, [200] = 1,
                                  [240] = 1,  [255] = 1};
    moe_case w = {{256, 8, 128, 64}, MOEK_DTYPE_BF16, 5, ROUTE_GIVEN, false,
                  0, 0, {128, false, 0}, false, false, rows};
    run_moe(&w, &rng);
}

/* Set environment variable name to value (NULL: unset); returns its former
 * value (allocated, or NULL) for env_restore. */
static char *env_set(const char *name, const char *value)
{
    const char *was = getenv(name);
    char *keep = was ? strdup(was) : NULL;
    CHECK(!was || keep);
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
    return keep;
}

static void env_restore(const char *name, char *keep)
{
    if (keep)
        setenv(name, keep, 1);
    else
        unsetenv(name);
    free(keep);
}

/* The one-launch routing of mid-size batches at its bounds: clusters of 4
 * (T = 65, given routing with holes, so some slots go nowhere) and 8 CTAs
 * (T = 129; T = 256 at top-16, 4096 slots, the most it holds), top-32 at
 * T = 128, two tokens a warp where routing is short (T = 512 at top-2 of
 * 8 experts; T = 400 at top-8 of 32; T = 512 at top-8 of 64, 4096 slots),
 * and the multi-block path past 256 tokens where routing a token is long
 * (T = 257 at top-8 and at top-16 of 128 experts, T = 300 of 512), past
 * 512 tokens (T = 513 at top-1) and past 4096 slots alone (T = 257 at
 * top-16 of 32 experts, T = 129 at top-32 of 64). Then layers made with
 * MOEK_CUDA_ROUTE_CLUSTER=1 and =2: T = 100 needs 4 CTAs, so it takes the
 * multi-block path; T = 32 still one CTA, T = 64 two under the cap of 2. */
TEST(moe_mid_batches)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const struct {
        int E, k, T, route;
        bool holes;
        const char *cap;
    } cs[] = {{128, 8, 65, ROUTE_GIVEN, true, NULL},
              {256, 8, 129, ROUTE_SOFTMAX, false, NULL},
              {128, 16, 256, ROUTE_SIGMOID, false, NULL},
              {64, 32, 128, ROUTE_SOFTMAX, false, NULL},
              {8, 2, 512, ROUTE_GIVEN, true, NULL},
              {32, 8, 400, ROUTE_SOFTMAX, false, NULL},
              {128, 8, 257, ROUTE_GIVEN, true, NULL},
              {512, 8, 300, ROUTE_SIGMOID, false, NULL},
              {8, 1, 513, ROUTE_SIGMOID, false, NULL},
              {128, 16, 257, ROUTE_SOFTMAX, false, NULL},
              {64, 8, 512, ROUTE_SIGMOID, false, NULL},
              {32, 16, 257, ROUTE_GIVEN, true, NULL},
              {64, 32, 129, ROUTE_SOFTMAX, false, NULL},
              {128, 8, 100, ROUTE_SOFTMAX, false, "1"},
              {32, 8, 100, ROUTE_GIVEN, true, "2"},
              {128, 8, 32, ROUTE_SIGMOID, false, "1"},
              {128, 8, 64, ROUTE_SOFTMAX, false, "2"}};
    for (size_t i = 0; i < ARRAY_LEN(cs); i++) {
        char *keep = env_set("MOEK_CUDA_ROUTE_CLUSTER", cs[i].cap);
        moe_case c = {{cs[i].E, cs[i].k, 128, 64},
                      i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16,
                      cs[i].T,
                      cs[i].route,
                      i % 3 != 0,
                      0,
                      0,
                      {0, false, 0},
                      false,
                      cs[i].holes,
                      NULL};
        run_moe(&c, &rng);
        env_restore("MOEK_CUDA_ROUTE_CLUSTER", keep);
    }
}

/* T = 4096 (the multi-block routing path) and the NaN routing rule. */
TEST(moe_many_tokens_and_nan)
{
    need_gpu();
    uint64_t rng = test_seed();
    moe_case c = {{256, 8, 512, 64}, MOEK_DTYPE_BF16, 4096, ROUTE_SOFTMAX,
                  true, 0, 256, {0, false, 0}, false, false, NULL};
    run_moe(&c, &rng);
    c.route = ROUTE_SIGMOID;
    c.dt = MOEK_DTYPE_FP16;
    run_moe(&c, &rng);
    moe_case n = {{64, 4, 128, 64}, MOEK_DTYPE_BF16, 8, ROUTE_SOFTMAX, true,
                  0, 0, {0, false, 0}, true, false, NULL};
    run_moe(&n, &rng);
    n.route = ROUTE_SIGMOID;
    run_moe(&n, &rng);
}

/* Every token tile of the wgmma kernel and the portable SIMT kernel (144
 * on this shape, whose weight-tile counts are odd, runs as 128:
 * moe_two_weight_tiles). */
TEST(moe_every_tile)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int tiles[] = MOEK_CUDA_TOKEN_TILES;
    for (int i = 0; i < MOEK_CUDA_TILE_CANDIDATES + 2; i++) {
        moe_case c = {{16, 4, 384, 320}, i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16,
                      300, ROUTE_SOFTMAX, true, 0, 64, {0, false, 0}, false, false, NULL};
        if (i < MOEK_CUDA_TILE_CANDIDATES)
            c.tune.token_tile = tiles[i];
        else
            c.tune.generic = true;
        run_moe(&c, &rng);
    }
}

/* Whether switch `name` (MOEK_CUDA_NO_...) is set, by weights.cu's rule:
 * non-empty and not starting with '0'. */
static bool switch_set(const char *name)
{
    const char *e = getenv(name);
    return e && *e && *e != '0';
}

/* Whether a call that qualifies for slot mode by its tile and accumulator
 * takes it: on sm_90, unless MOEK_CUDA_NO_SLOT_ROWS keeps layers off it. */
static bool slot_rows_on(void)
{
    return device_cc() == 90 && !switch_set("MOEK_CUDA_NO_SLOT_ROWS");
}

/* The cluster mode (moek_cluster_mode) a call of `slots` slots with tile
 * bn takes on a layer of shape H, I: on sm_90, tiles of 128 rows and wider
 * and at least a tile's worth of slots; GEMM 2 pairs when its weight
 * tiles, ceil(H16 / 128), are even (H16: H rounded up to 16) and I is at
 * least 64; GEMM 1 too when I is at least the bound (2048, or
 * MOEK_CUDA_CLUSTER_MIN_I), ceil(2 I / 128) is even and H at least 64;
 * none with a switch that keeps layers off it (weights.cu). */
static int cluster_mode(int H, int I, int bn, long long slots)
{
    const char *mi = getenv("MOEK_CUDA_CLUSTER_MIN_I");
    const bool switched_off =
        switch_set("MOEK_CUDA_NO_CLUSTER") || switch_set("MOEK_CUDA_ROW_MAJOR");
    long bound = 2048;
    if (mi && *mi) {
        char *end;
        long v = strtol(mi, &end, 10);
        if (!*end && v >= 1 && v <= (1L << 30))
            bound = v;
    }
    const int h16 = (H + 15) / 16 * 16;
    if (device_cc() != 90 || switched_off || bn < 128 || slots < bn ||
        (h16 + 127) / 128 % 2 != 0 || I < 64)
        return MOEK_CLUSTER_NONE;
    return I >= bound && (2 * I + 127) / 128 % 2 == 0 && H >= 64
               ? MOEK_CLUSTER_BOTH
               : MOEK_CLUSTER_GEMM2;
}

/* Options for a call of case c under its forced tiles: those tiles (when
 * check_tile; GEMM 2's where the tuning gives it one; run_moe_tiles checks
 * them on sm_90) and the cluster mode cluster_mode gives for the wider. */
static tile_opts forced_tile_opts(const moe_case *c, bool check_tile)
{
    const int bn = c->tune.token_tile, bn2 = c->tune.token_tile2;
    const tile_opts to = {
        NULL, 0, check_tile ? bn : 0,
        EXPECT_MODE(cluster_mode(c->s.hidden, c->s.intermediate,
                                 bn > bn2 ? bn : bn2,
                                 (long long)c->tokens * c->s.topk)),
        0, 0, NULL, check_tile ? bn2 : 0};
    return to;
}

/* Token tiles of every width of the 128-, 192- and 256-row instances
 * (moek_class_width, moek_tile_class: a group's tiles are as narrow as its
 * rows allow), with groups of one to five tiles and an empty one, every
 * token checked, on a shape whose GEMM 2 alone runs in CTA pairs (I = 328),
 * on one whose GEMMs both do (I >= 2048) and on one with an odd count of
 * GEMM 2 weight tiles, which neither does (H = 376; cluster_mode). Each of the
 * three instances gets a group of each of its four widths from these
 * counts: 128: 32 (1 row), 64 (33), 96 (70, 165 in two tiles, 257 in
 * three), 128 (100, 215 in two, 520 in five); 192: 128 (1, 100, 215 in
 * two), 144 (129, 257 in two), 160 (150, 300 in two), 192 (165, 520 in
 * three); 256: 144 (1, 129, 257 in two), 208 (150, 165, 300 in two, 520
 * in three), 224 (215), 256 (230). */
TEST(moe_tile_classes)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int rows[16] = {0,   1,   32,  33,  40,  60,  70,  100,
                                 129, 150, 165, 215, 230, 257, 300, 520};
    static const int tiles[] = {128, 192, 256};
    for (int i = 0; i < 9; i++) {
        moe_case c = {{16, 2, i < 6 ? 456 : 376, i >= 3 && i < 6 ? 4168 : 328},
                      i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16, 1151,
                      ROUTE_GIVEN, false, 0, 0,
                      {tiles[i % 3], false, 0}, false, false, rows};
        const tile_opts to = forced_tile_opts(&c, true);
        run_moe_tiles(&c, &to, &rng);
    }
    /* A batch of 64 tokens (a cluster of two CTAs routes and aligns:
     * route_align_small) on each instance: on the 128-row one,
     * groups of three widths (1 row: 32, 40: 64, 87: 96). */
    static const int small_rows[16] = {0, 1, 0, 40, 0, 87};
    for (int i = 0; i < 3; i++) {
        moe_case c = {{16, 2, 456, 328}, MOEK_DTYPE_BF16, 64, ROUTE_GIVEN,
                      false, 0, 0, {tiles[i], false, 0}, false, false,
                      small_rows};
        const tile_opts to = forced_tile_opts(&c, true);
        run_moe_tiles(&c, &to, &rng);
    }
    /* 64 tokens over 64 experts (two of align_warps' 32-group chunks) in all
     * four widths of the 128-row tile: 1 row (32), 33 (64), 65 (96), 97
     * (128), and 60. */
    static const int wide_rows[64] = {[3] = 1,   [10] = 60, [20] = 33,
                                      [40] = 65, [60] = 97};
    moe_case w = {{64, 4, 456, 328}, MOEK_DTYPE_BF16, 64, ROUTE_GIVEN, false,
                  0, 0, {128, false, 0}, false, false, wide_rows};
    const tile_opts tw = forced_tile_opts(&w, true);
    run_moe_tiles(&w, &tw, &rng);
}

/* The 144-row tile, whose CTAs take two weight tiles at once (nt and nt + 1
 * of one token tile: moek_wtiles), on layers whose weight-tile counts are
 * multiples of four: GEMM 2 alone in CTA pairs (I = 512), both GEMMs in
 * pairs (I = 2048), and neither (MOEK_CUDA_NO_CLUSTER), with
 * moe_tile_classes' group sizes, which give each of its four widths: 64 (1
 * to 60 rows), 96 (70; 150 and 165 in two tiles), 128 (100; 215, 230 in
 * two; 300 in three) and 144 (129; 257 in two; 520 in four); and in slot
 * mode; and 7 tokens. On a layer whose GEMM 2 has three weight tiles (H =
 * 376) a forced 144 runs as 128 (layer.cu, fit_tile). */
TEST(moe_two_weight_tiles)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int rows[16] = {0,   1,   32,  33,  40,  60,  70,  100,
                                 129, 150, 165, 215, 230, 257, 300, 520};
    for (int i = 0; i < 6; i++) {
        moe_case c = {{16, 2, 456, i < 2 ? 512 : 2048},
                      i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16, 1151,
                      ROUTE_GIVEN, false, 0, 0, {144, false, 0}, false, false,
                      rows};
        char *keep = env_set("MOEK_CUDA_NO_CLUSTER", i >= 4 ? "1" : NULL);
        const tile_opts to = forced_tile_opts(&c, true);
        run_moe_tiles(&c, &to, &rng);
        env_restore("MOEK_CUDA_NO_CLUSTER", keep);
    }
    char *min_kb = env_set("MOEK_CUDA_SLOT_MIN_KB", "1");
    for (int i = 0; i < 2; i++) {
        moe_case c = {{16, 2, 456, i ? 2048 : 512}, MOEK_DTYPE_BF16, 1151,
                      ROUTE_GIVEN, false, 0, 0, {144, false, 0}, false, i == 1,
                      i ? NULL : rows};
        tile_opts to = forced_tile_opts(&c, true);
        to.expect_slots = EXPECT_MODE(slot_rows_on());
        run_moe_tiles(&c, &to, &rng);
    }
    env_restore("MOEK_CUDA_SLOT_MIN_KB", min_kb);
    /* 7 tokens: fewer runs of two items than SMs, no pairs (14 slots) */
    moe_case few = {{16, 2, 456, 512}, MOEK_DTYPE_FP16, 7, ROUTE_SOFTMAX,
                    true, 0, 0, {144, false, 0}, false, false, NULL};
    const tile_opts tf = forced_tile_opts(&few, true);
    run_moe_tiles(&few, &tf, &rng);
    moe_case odd = {{16, 2, 376, 512}, MOEK_DTYPE_BF16, 1151, ROUTE_GIVEN,
                    false, 0, 0, {128, false, 0}, false, false, rows};
    tile_opts to = forced_tile_opts(&odd, true);
    odd.tune.token_tile = 144;
    run_moe_tiles(&odd, &to, &rng);
}

/* ---- token-tile table and autotuning ------------------------------------ */

/* A small layer with weights filled on the device. */
static moek_cuda_moe_layer *small_layer(const moek_moe_shape *s, moek_dtype dt,
                                        uint64_t seed)
{
    const size_t n = (size_t)s->experts * s->hidden * s->intermediate;
    void *w = dmalloc(n * moek_dtype_size(dt));
    CK(moek_cuda_fill_uniform(w, dt, n, seed, 0.05f, NULL));
    moek_cuda_moe_layer *l = NULL;
    CK(moek_cuda_moe_layer_new_from_device(s, dt, w, w, w, 0, &l));
    moek_cuda_free(w);
    return l;
}

/* GEMM 2 on a token tile of its own (moek_cuda_tuning.token_tile2; GEMM
 * 2's tile list rebuilt from GEMM 1's in the order of its own tile
 * classes: route.cu, relist_kernel): pairs of prefill tiles in both
 * orders, with moe_tile_classes' group sizes (each tile's four widths; a
 * group's class differs between the two tiles), on layers whose GEMMs both
 * run in CTA pairs (I = 2048), GEMM 2 alone (I = 512) and neither
 * (MOEK_CUDA_NO_CLUSTER), in slot mode, with routing and alignment in
 * one launch (64 tokens: route_align_small; 7: route_align_tiny); a tile that does not fit its own GEMM (144 where
 * GEMM 2 has three weight tiles, H = 376) runs as 128 there alone; the
 * heuristic's split (MOEK_CUDA_SPLIT_TILES=1: 144 for GEMM 1, 192 for GEMM
 * 2 at 128 rows a group); and the refusals. */
TEST(moe_split_tiles)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int rows[16] = {0,   1,   32,  33,  40,  60,  70,  100,
                                 129, 150, 165, 215, 230, 257, 300, 520};
    static const int small_rows[16] = {0, 1, 0, 40, 0, 87};
    static const int pair[][2] = {{144, 192}, {192, 144}, {144, 256},
                                  {256, 128}, {128, 192}, {192, 256}};
    const int np = (int)(sizeof pair / sizeof pair[0]);
    for (int i = 0; i < 2 * np; i++) {
        const int *p = pair[i % np];
        const bool off = i >= np && i % 2; /* neither GEMM in pairs */
        moe_case c = {{16, 2, 456, i < np ? 2048 : 512},
                      i % 3 ? MOEK_DTYPE_BF16 : MOEK_DTYPE_FP16,
                      i % 4 == 3 ? 64 : 1151, ROUTE_GIVEN, false, 0, 0,
                      {p[0], false, p[1]}, false, false,
                      i % 4 == 3 ? small_rows : rows};
        char *keep = env_set("MOEK_CUDA_NO_CLUSTER", off ? "1" : NULL);
        const tile_opts to = forced_tile_opts(&c, true);
        run_moe_tiles(&c, &to, &rng);
        env_restore("MOEK_CUDA_NO_CLUSTER", keep);
    }
    char *min_kb = env_set("MOEK_CUDA_SLOT_MIN_KB", "1");
    for (int i = 0; i < 2; i++) {
        moe_case c = {{16, 2, 456, i ? 2048 : 512}, MOEK_DTYPE_BF16, 1151,
                      ROUTE_SOFTMAX, true, 0, 0,
                      {pair[i][0], false, pair[i][1]}, false, false, NULL};
        tile_opts to = forced_tile_opts(&c, true);
        to.expect_cluster = 0;
        to.expect_slots = EXPECT_MODE(slot_rows_on());
        run_moe_tiles(&c, &to, &rng);
    }
    env_restore("MOEK_CUDA_SLOT_MIN_KB", min_kb);
    moe_case few = {{16, 2, 456, 2048}, MOEK_DTYPE_FP16, 7, ROUTE_SOFTMAX,
                    true, 0, 0, {144, false, 192}, false, false, NULL};
    /* 14 slots, fewer than either tile's: no pairs (cluster_mode) */
    const tile_opts tf = forced_tile_opts(&few, true);
    run_moe_tiles(&few, &tf, &rng);
    /* GEMM 2 with three weight tiles: 144 there runs as 128, GEMM 1 keeps
     * its own 144 */
    for (int i = 0; i < 2; i++) {
        moe_case c = {{16, 2, 376, 512}, MOEK_DTYPE_BF16, 1151, ROUTE_GIVEN,
                      false, 0, 0, {i ? 144 : 192, false, i ? 192 : 144},
                      false, false, rows};
        tile_opts to = forced_tile_opts(&c, true);
        to.expect_cluster = 0;
        if (!i)
            to.expect_tile2 = 128;
        run_moe_tiles(&c, &to, &rng);
    }
    /* The heuristic's split: 1024 tokens top-2 over 16 experts, 128 rows
     * a group on average, more than 144 likely somewhere (avg + 3 sigma),
     * and few runs of GEMM 2: 144 for GEMM 1 alone. */
    char *split = env_set("MOEK_CUDA_SPLIT_TILES", "1");
    char *mid = env_set("MOEK_CUDA_MID144", "0");
    for (int i = 0; i < 2; i++) {
        moe_case c = {{16, 2, 456, i ? 2048 : 512}, MOEK_DTYPE_BF16, 1024,
                      ROUTE_SOFTMAX, true, 0, 0, {0, false, 0}, false, false,
                      NULL};
        tile_opts to = {NULL, 0, 144, 0, 0, 0, NULL, 192};
        run_moe_tiles(&c, &to, &rng);
    }
    env_restore("MOEK_CUDA_MID144", mid);
    env_restore("MOEK_CUDA_SPLIT_TILES", split);

    /* Refusals: a second tile below 128 rows where they differ, one
     * without GEMM 1's forced, one the kernels do not offer, and a grouped
     * GEMM's. */
    moek_moe_shape sh = {16, 2, 456, 512};
    moek_cuda_moe_layer *layer = small_layer(&sh, MOEK_DTYPE_BF16,
                                             test_rand(&rng));
    const moek_cuda_tuning bad[] = {{64, false, 144},
                                    {144, false, 64},
                                    {0, false, 192},
                                    {144, false, 100}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_EQ_INT(moek_cuda_moe_layer_tune(layer, &bad[i]), -EINVAL);
    const moek_cuda_tuning twice = {192, false, 192}; /* the same tile */
    CK(moek_cuda_moe_layer_tune(layer, &twice));
    if (device_cc() == 90)
        CHECK_EQ_INT(moek_cuda_moe_layer_token_tile2(layer, 1000), 192);
    moek_cuda_moe_layer_free(layer);
    void *b = dmalloc((size_t)4 * 64 * 64 * 2);
    CK(moek_cuda_memset(b, 0, (size_t)4 * 64 * 64 * 2));
    moek_cuda_gemm_weights *gw = NULL;
    CK(moek_cuda_gemm_weights_new_from_device(MOEK_DTYPE_BF16, 4, 64, 64, b, 0,
                                              &gw));
    const moek_cuda_tuning g2 = {128, false, 192};
    CHECK_EQ_INT(moek_cuda_gemm_weights_tune(gw, &g2), -EINVAL);
    moek_cuda_gemm_weights_free(gw);
    moek_cuda_free(b);
}

/* Cluster mode (CTA pairs sharing token tiles by multicast) on each tile
 * that takes it, over a shape that qualifies (I >= 2048, even weight-tile
 * counts) with partial K blocks in both GEMMs (H = 7 * 64 + 8,
 * I = 65 * 64 + 8): 75 rows per expert (one narrow tile each) and 300
 * (several tiles), and given routing with slots routed nowhere; 20
 * slots under the widest tile take the plain path. Off Hopper (or with the
 * switches that turn it off) no call takes it; with I below 2048, GEMM 2
 * alone does (moe_tile_classes runs those layers). */
TEST(moe_cluster_tiles)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int tiles[] = {128, 192, 256};
    const moek_moe_shape s = {16, 4, 456, 4168};
    const moek_moe_shape narrow = {16, 4, 456, 328};
    moek_cuda_moe_layer *n = small_layer(&narrow, MOEK_DTYPE_BF16,
                                         test_rand(&rng));
    const moek_cuda_tuning t256 = {256, false, 0};
    CK(moek_cuda_moe_layer_tune(n, &t256));
    CHECK_EQ_INT(moek_cuda_moe_layer_uses_cluster(n, 1200),
                 cluster_mode(narrow.hidden, narrow.intermediate, 256,
                              1200 * 4));
    CHECK_EQ_INT(moek_cuda_moe_layer_uses_cluster(n, 50),
                 MOEK_CLUSTER_NONE);
    moek_cuda_moe_layer_free(n);
    for (int i = 0; i < 6; i++) {
        moe_case c = {s, i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16,
                      (i / 2 + i) % 2 ? 1200 : 300, ROUTE_SOFTMAX, true, 0, 32,
                      {tiles[i / 2], false, 0}, false, false, NULL};
        const tile_opts to = forced_tile_opts(&c, false);
        run_moe_tiles(&c, &to, &rng);
    }
    /* 20 slots under a forced 256-row tile: fewer than a tile's worth, so
     * no cluster mode (layer.cu, moe_cluster), and correct. */
    const tile_opts none = {NULL, 0, 0, EXPECT_MODE(MOEK_CLUSTER_NONE), 0,
                            0, NULL, 0};
    moe_case few = {s, MOEK_DTYPE_BF16, 5, ROUTE_SOFTMAX, true, 0, 0,
                    {256, false, 0}, false, false, NULL};
    run_moe_tiles(&few, &none, &rng);
    /* Given routing with a third of the slots routed nowhere: those slots
     * have no sorted position (slot_pos -1), so the copy of x writes no row
     * for them and GEMM 1 reads only the routed ones (the debug build's
     * workspace is poisoned past them). */
    moe_case h = {s, MOEK_DTYPE_BF16, 1200, ROUTE_GIVEN, false, 0, 32,
                  {256, false, 0}, false, true, NULL};
    run_moe(&h, &rng);
    /* The same at 64 tokens, whose sorted positions (slot_pos, which the
     * copy of x follows) come from the one-block kernel. */
    moe_case h64 = {s, MOEK_DTYPE_BF16, 64, ROUTE_GIVEN, false, 0, 0,
                    {128, false, 0}, false, true, NULL};
    const tile_opts t64 = forced_tile_opts(&h64, false);
    run_moe_tiles(&h64, &t64, &rng);
    /* A workspace without room for the copy of x (nor for slot mode's
     * rows, which share it): GEMM 1 runs unpaired, GEMM 2 still in pairs
     * (layer.cu), and correct. */
    moe_case tight = {s, MOEK_DTYPE_BF16, 300, ROUTE_SOFTMAX, true, 0, 32,
                      {256, false, 0}, false, false, NULL};
    const tile_opts ts = {NULL, 0, 0, 0,
                          (size_t)2 * 300 * s.topk * s.hidden, 0, NULL, 0};
    run_moe_tiles(&tight, &ts, &rng);
}

/* Slot mode (GEMM 2 stores each slot's weighted row, the finalize sums a
 * token's k rows). The default bound (an fp32 accumulator of a quarter of
 * L2) keeps this shape off it at 300 tokens and takes it at a million, on
 * sm_90 and 128-row tiles. Then, with the bound at 1 KB, top-k 8 on each
 * routing path of this shape that writes the slots' positions: the
 * one-launch kernel over eight CTAs (300 tokens, 2400 slots, two tokens a
 * warp), four (100), two (64) and one (20), and the one-warp plan (3
 * tokens, 24 slots); given routing with a third of the slots routed
 * nowhere, which the finalize must skip; both dtypes. Then the multi-block
 * kernels, on a layer whose routing cluster MOEK_CUDA_ROUTE_CLUSTER=1 caps
 * at one CTA: 100 tokens (the align block scatters every slot) and 300
 * (2400 slots: two scatter parts beside it). A shape
 * with both GEMMs in CTA pairs, whose rows take the room of GEMM 1's copy
 * of x. Then a layer made with MOEK_CUDA_NO_SLOT_ROWS=1, and a workspace
 * without room for the rows: both keep the fp32 accumulator, and correct. */
TEST(moe_slot_rows)
{
    need_gpu();
    uint64_t rng = test_seed();
    const moek_moe_shape s = {32, 8, 264, 320};
    const bool on = slot_rows_on();
    char *min_kb = env_set("MOEK_CUDA_SLOT_MIN_KB", NULL);
    moek_cuda_moe_layer *l = small_layer(&s, MOEK_DTYPE_BF16, test_rand(&rng));
    moek_cuda_tuning tune = {128, false, 0};
    CK(moek_cuda_moe_layer_tune(l, &tune));
    CHECK(!moek_cuda_moe_layer_uses_slots(l, 300));
    CHECK_EQ_INT(moek_cuda_moe_layer_uses_slots(l, 1 << 20), on);
    tune.token_tile = 64;
    CK(moek_cuda_moe_layer_tune(l, &tune));
    CHECK(!moek_cuda_moe_layer_uses_slots(l, 1 << 20));
    moek_cuda_moe_layer_free(l);

    setenv("MOEK_CUDA_SLOT_MIN_KB", "1", 1);
    static const int tokens[] = {300, 100, 64, 20, 3};
    for (int i = 0; i < 10; i++) {
        moe_case c = {s, i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16,
                      tokens[i % 5], i < 5 ? ROUTE_SOFTMAX : ROUTE_GIVEN, true,
                      0, 64, {i < 5 ? 128 : 256, false, 0}, false, i >= 5, NULL};
        tile_opts to = forced_tile_opts(&c, true);
        to.expect_slots = EXPECT_MODE(on);
        run_moe_tiles(&c, &to, &rng);
    }
    char *cap = env_set("MOEK_CUDA_ROUTE_CLUSTER", "1");
    for (int i = 0; i < 2; i++) {
        moe_case c = {s, i ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16,
                      i ? 300 : 100, i ? ROUTE_GIVEN : ROUTE_SOFTMAX, true,
                      0, 64, {128, false, 0}, false, i == 1, NULL};
        tile_opts to = forced_tile_opts(&c, true);
        to.expect_slots = EXPECT_MODE(on);
        run_moe_tiles(&c, &to, &rng);
    }
    env_restore("MOEK_CUDA_ROUTE_CLUSTER", cap);
    moe_case both = {{16, 4, 456, 4168}, MOEK_DTYPE_BF16, 300, ROUTE_GIVEN,
                     false, 0, 32, {256, false, 0}, false, true, NULL};
    tile_opts tb = forced_tile_opts(&both, true);
    tb.expect_slots = EXPECT_MODE(on);
    run_moe_tiles(&both, &tb, &rng);
    char *keep = env_set("MOEK_CUDA_NO_SLOT_ROWS", "1");
    moe_case off = {s, MOEK_DTYPE_BF16, 300, ROUTE_GIVEN, false, 0, 64,
                    {128, false, 0}, false, true, NULL};
    tile_opts to_off = forced_tile_opts(&off, true);
    to_off.expect_slots = EXPECT_MODE(false);
    run_moe_tiles(&off, &to_off, &rng);
    env_restore("MOEK_CUDA_NO_SLOT_ROWS", keep);
    moe_case tight = {s, MOEK_DTYPE_BF16, 300, ROUTE_SOFTMAX, true, 0, 64,
                      {128, false, 0}, false, false, NULL};
    const tile_opts ts = {NULL, 0, 0, 0,
                          on ? (size_t)2 * 300 * s.topk * s.hidden : 0, 0,
                          NULL, 0};
    run_moe_tiles(&tight, &ts, &rng);
    env_restore("MOEK_CUDA_SLOT_MIN_KB", min_kb);
}

/* Decode GEMM 2 in stream-K (each CTA an even share of the K blocks, the
 * items at its ends in parts, summed by COMBINE's atomics) where the plan
 * would split K, and with MOEK_CUDA_NO_STREAM_K=1 in K splits: one token
 * over two experts whose 32 K blocks a tile spread over many CTAs (a few
 * K blocks each), 8 tokens top-8 of 128 experts, 64 tokens with given
 * routing and slots routed nowhere, and one token top-1 whose one item of
 * 16 K blocks leaves most CTAs an empty share (MOEK_CUDA_SPLIT_MIN_KB=1
 * for that layer: its K splits of one K block); every token checked, both
 * dtypes. A call of 2000 tokens does not take it (its tiles have several
 * widths). MOEK_CUDA_SPLIT_MIN_KB is otherwise unset for the rule's
 * default bound. */
TEST(moe_stream_k)
{
    need_gpu();
    uint64_t rng = test_seed();
    const moe_case cases[] = {
        {{8, 2, 512, 2048}, MOEK_DTYPE_BF16, 1, ROUTE_SOFTMAX, true, 0, 0,
         {0, false, 0}, false, false, NULL},
        {{128, 8, 256, 1024}, MOEK_DTYPE_FP16, 8, ROUTE_SOFTMAX, true, 0, 0,
         {0, false, 0}, false, false, NULL},
        {{64, 4, 384, 1024}, MOEK_DTYPE_BF16, 64, ROUTE_GIVEN, false, 0, 0,
         {0, false, 0}, false, true, NULL},
        {{8, 1, 128, 1024}, MOEK_DTYPE_BF16, 1, ROUTE_SOFTMAX, false, 0, 0,
         {0, false, 0}, false, false, NULL},
    };
    const size_t empty_shares = 3; /* the case run with one-block splits */
    const bool on = device_cc() == 90 && !switch_set("MOEK_CUDA_NO_STREAM_K");
    char *min_kb = env_set("MOEK_CUDA_SPLIT_MIN_KB", NULL);
    for (int off = 0; off < 2; off++) {
        /* The second pass sets the switch (the first leaves it as it is) */
        char *keep = off ? env_set("MOEK_CUDA_NO_STREAM_K", "1") : NULL;
        for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
            const moe_case *c = &cases[i];
            if (i == empty_shares)
                setenv("MOEK_CUDA_SPLIT_MIN_KB", "1", 1);
            moek_cuda_moe_layer *l =
                small_layer(&c->s, c->dt, test_rand(&rng));
            CHECK_EQ_INT(moek_cuda_moe_layer_uses_stream_k(l, c->tokens),
                         on && !off);
            CHECK(!moek_cuda_moe_layer_uses_stream_k(l, 2000));
            moek_cuda_moe_layer_free(l);
            run_moe(c, &rng);
            unsetenv("MOEK_CUDA_SPLIT_MIN_KB");
        }
        if (off)
            env_restore("MOEK_CUDA_NO_STREAM_K", keep);
    }
    env_restore("MOEK_CUDA_SPLIT_MIN_KB", min_kb);
}

/* GEMM 2 starting per group (moek_dep, layer.cu: where GEMM 1 fills the
 * card, each GEMM 2 item waits for its group's GEMM 1 items, not for the
 * whole of GEMM 1, and GEMM 2's CTAs take their work from a counter), then
 * the same cases with MOEK_CUDA_NO_DEP=1, and the mode's other forms
 * (both GEMMs in one launch or two kernels, GEMM 1's counts made by the
 * consumers or by the counting warp: see the loop): 8 tokens over 64
 * experts in
 * 16-row tiles (2176 GEMM 1 items, whole GEMM 2 items); one token whose
 * 192 GEMM 1 items leave SMs idle in their last round (GEMM 2 in stream-K,
 * top-4); 64 tokens in forced 64-row tiles with whole GEMM 2 items (the
 * consumers take each from the producer), given routing and slots routed
 * nowhere; both dtypes. Without the switch, on sm_90, at least one case
 * takes the mode (which ones depends on the SM count); with it, none. The
 * unit test's debug build poisons the workspace, so a GEMM 2 that read a
 * group's rows before GEMM 1 wrote them would fail the check. The real
 * shapes' cases (moe_qwen3 and the others) take it by default too, qwen3's
 * short GEMM 2 items at T = 8 and 64 among them. */
TEST(moe_dep_groups)
{
    need_gpu();
    uint64_t rng = test_seed();
    const moe_case cases[] = {
        {{64, 8, 1024, 2048}, MOEK_DTYPE_BF16, 8, ROUTE_SOFTMAX, true, 0, 0,
         {0, false, 0}, false, false, NULL},
        {{16, 4, 256, 3072}, MOEK_DTYPE_FP16, 1, ROUTE_SIGMOID, true, 0, 0,
         {0, false, 0}, false, false, NULL},
        {{128, 8, 512, 2048}, MOEK_DTYPE_BF16, 64, ROUTE_GIVEN, false, 0, 32,
         {64, false, 0}, false, true, NULL},
    };
    /* These cases prefetch nothing, so they take both GEMMs in one launch
     * (mode 3) unless MOEK_CUDA_NO_BOTH=1 makes it two (mode 1). 0: the
     * mode as it runs by default (one launch, the counting warp); 1: no
     * mode; 2: one launch, the consumers counting; 3: two kernels, the
     * consumers counting (mode 1's default); 4: two kernels, the counting
     * warp. */
    for (int v = 0; v < 5; v++) {
        char *keep = env_set("MOEK_CUDA_NO_DEP", v == 1 ? "1" : NULL);
        char *keep_sig = env_set("MOEK_CUDA_NO_SIG_WARP", v == 2 ? "1" : NULL);
        char *keep_both = env_set("MOEK_CUDA_NO_BOTH", v >= 3 ? "1" : NULL);
        char *keep_sig1 =
            env_set("MOEK_CUDA_SIG_WARP_MODE1", v == 4 ? "1" : NULL);
        int taken = 0;
        const tile_opts to = {.dep_calls = &taken};
        for (size_t i = 0; i < ARRAY_LEN(cases); i++)
            run_moe_tiles(&cases[i], &to, &rng);
        CHECK(v == 1 ? taken == 0 : taken > 0 || device_cc() != 90);
        env_restore("MOEK_CUDA_SIG_WARP_MODE1", keep_sig1);
        env_restore("MOEK_CUDA_NO_BOTH", keep_both);
        env_restore("MOEK_CUDA_NO_SIG_WARP", keep_sig);
        env_restore("MOEK_CUDA_NO_DEP", keep);
    }
}

/* set_tiles refuses bad tables (and keeps the old one), n = 0 clears, the
 * tile of a call follows the rule with the largest min_tokens <= T, a
 * forced tile wins; forwards with a table match the reference. */
TEST(moe_tile_table)
{
    need_gpu();
    uint64_t rng = test_seed();
    const moek_moe_shape s = {16, 4, 384, 320};
    moek_cuda_moe_layer *l = small_layer(&s, MOEK_DTYPE_BF16, test_rand(&rng));
    const bool hopper = device_cc() == 90;
    int heur[6];
    static const int ts[6] = {1, 4, 7, 8, 100, 5000};
    for (int i = 0; i < 6; i++)
        heur[i] = moek_cuda_moe_layer_token_tile(l, ts[i]);

    const moek_cuda_tile_rule good[] = {{1, 16}, {8, 64}, {100, 192}};
    CK(moek_cuda_moe_layer_set_tiles(l, good, 3));
    static const int want[6] = {16, 16, 16, 64, 192, 192};
    for (int i = 0; i < 6; i++)
        CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, ts[i]),
                     hopper ? want[i] : 16);

    /* Refusals name the rule and leave the table as it was. */
    const moek_cuda_tile_rule bad_tile[] = {{1, 16}, {4, 100}};
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(l, bad_tile, 2), -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "rule 1: token tile 100");
    const moek_cuda_tile_rule same[] = {{1, 16}, {8, 32}, {8, 64}};
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(l, same, 3), -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "does not ascend");
    const moek_cuda_tile_rule down[] = {{64, 16}, {8, 32}};
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(l, down, 2), -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "does not ascend");
    const moek_cuda_tile_rule zero[] = {{0, 16}};
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(l, zero, 1), -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "below 1");
    moek_cuda_tile_rule many[MOEK_CUDA_MAX_TILE_RULES + 1];
    for (int i = 0; i < MOEK_CUDA_MAX_TILE_RULES + 1; i++)
        many[i] = (moek_cuda_tile_rule){i + 1, 32};
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(l, many,
                                               MOEK_CUDA_MAX_TILE_RULES + 1),
                 -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "33 rules");
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(l, NULL, 1), -EINVAL);
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(l, good, -1), -EINVAL);
    CHECK_EQ_INT(moek_cuda_moe_layer_set_tiles(NULL, good, 1), -EINVAL);
    for (int i = 0; i < 6; i++)
        CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, ts[i]),
                     hopper ? want[i] : 16);
    /* The most rules there may be. */
    CK(moek_cuda_moe_layer_set_tiles(l, many, MOEK_CUDA_MAX_TILE_RULES));
    CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 5000), hopper ? 32 : 16);

    /* Below the first rule: the heuristic. */
    const moek_cuda_tile_rule late[] = {{8, 256}};
    CK(moek_cuda_moe_layer_set_tiles(l, late, 1));
    CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 4), heur[1]);
    CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 7), heur[2]);
    CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 8), hopper ? 256 : 16);

    /* A forced tile wins over the table; the SIMT path has one tile. */
    moek_cuda_tuning forced = {32, false, 0}, none = {0, false, 0}, simt = {0, true, 0};
    CK(moek_cuda_moe_layer_tune(l, &forced));
    CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 100), hopper ? 32 : 16);
    CK(moek_cuda_moe_layer_tune(l, &simt));
    CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 100), 16);
    CK(moek_cuda_moe_layer_tune(l, &none));
    CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 100), hopper ? 256 : 16);

    /* n = 0 clears. */
    CK(moek_cuda_moe_layer_set_tiles(l, NULL, 0));
    for (int i = 0; i < 6; i++)
        CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, ts[i]), heur[i]);
    moek_cuda_moe_layer_free(l);

    /* Forwards through tables that pick what the heuristic would not:
     * fresh random inputs, poisoned outputs, the reference. */
    const moek_cuda_tile_rule t1[] = {{1, 256}, {64, 16}, {200, 192}};
    const moek_cuda_tile_rule t2[] = {{1, 128}, {32, 32}};
    const struct {
        int tokens, expect;
        const moek_cuda_tile_rule *rules;
        int n;
        moek_dtype dt;
    } runs[] = {
        {5, 256, t1, 3, MOEK_DTYPE_BF16},   {100, 16, t1, 3, MOEK_DTYPE_FP16},
        {300, 192, t1, 3, MOEK_DTYPE_BF16}, {3, 128, t2, 2, MOEK_DTYPE_FP16},
        {300, 32, t2, 2, MOEK_DTYPE_BF16},
    };
    for (size_t i = 0; i < ARRAY_LEN(runs); i++) {
        moe_case c = {{16, 4, 384, 320}, runs[i].dt, runs[i].tokens,
                      ROUTE_SOFTMAX, true, 0, 64, {0, false, 0}, false, false, NULL};
        tile_opts to = {runs[i].rules, runs[i].n, runs[i].expect, 0, 0, 0,
                        NULL, 0};
        run_moe_tiles(&c, &to, &rng);
    }
}

/* The autotuner returns an offered tile per token count, the fastest of its
 * own timings unless the layer's present tile is within 2% of it, and
 * leaves the layer's tuning and table as they were. */
TEST(moe_autotune)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int offered[] = MOEK_CUDA_TOKEN_TILES;
    static const int tokens[] = {1, 7, 64, 300, 1024};
    const int n = (int)ARRAY_LEN(tokens);
    for (int d = 0; d < 2; d++) {
        const moek_moe_shape s = d ? (moek_moe_shape){8, 2, 256, 512}
                                   : (moek_moe_shape){64, 6, 512, 256};
        const moek_dtype dt = d ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16;
        moek_cuda_moe_layer *l = small_layer(&s, dt, test_rand(&rng));
        if (device_cc() != 90) {
            int best[5];
            CHECK_EQ_INT(moek_cuda_moe_layer_autotune(l, tokens, n, best, NULL),
                         -ENOTSUP);
            moek_cuda_moe_layer_free(l);
            TEST_SKIP("device 0 is not sm_90: no token tiles to tune");
        }
        const moek_cuda_tile_rule table[] = {{1, 32}, {100, 128}};
        CK(moek_cuda_moe_layer_set_tiles(l, table, 2));
        int best[5] = {0};
        float us[5 * MOEK_CUDA_TILE_CANDIDATES];
        for (size_t i = 0; i < ARRAY_LEN(us); i++)
            us[i] = -1.0f;
        CK(moek_cuda_moe_layer_autotune(l, tokens, n, best, us));
        for (int i = 0; i < n; i++) {
            float lo = 1e30f;
            fprintf(stderr, "  E=%d k=%d H=%d I=%d %s T=%d: best %d;",
                    s.experts, s.topk, s.hidden, s.intermediate, dt_name(dt),
                    tokens[i], best[i]);
            for (int j = 0; j < MOEK_CUDA_TILE_CANDIDATES; j++) {
                float t = us[i * MOEK_CUDA_TILE_CANDIDATES + j];
                fprintf(stderr, " %d:%.1f", offered[j], t);
                CHECK_MSG(isfinite(t) && t > 0.5f && t < 1e6f,
                          "T=%d tile %d: %g us", tokens[i], offered[j], t);
                if (t < lo)
                    lo = t;
            }
            fputc('\n', stderr);
            /* The fastest, unless the table's own tile is within 2%. */
            const int present = moek_cuda_moe_layer_token_tile(l, tokens[i]);
            float t_present = -1.0f;
            for (int j = 0; j < MOEK_CUDA_TILE_CANDIDATES; j++)
                if (offered[j] == present)
                    t_present = us[i * MOEK_CUDA_TILE_CANDIDATES + j];
            CHECK(t_present > 0);
            bool ok = false;
            for (int j = 0; j < MOEK_CUDA_TILE_CANDIDATES; j++)
                if (best[i] == offered[j]) {
                    ok = true;
                    if (lo < t_present * 0.98f)
                        CHECK_MSG(us[i * MOEK_CUDA_TILE_CANDIDATES + j] == lo,
                                  "T=%d: best tile %d is not the fastest timed",
                                  tokens[i], best[i]);
                    else
                        CHECK_MSG(best[i] == present,
                                  "T=%d: tile %d replaced the table's %d, "
                                  "which is within 2%% of the fastest",
                                  tokens[i], best[i], present);
                }
            CHECK_MSG(ok, "T=%d: tile %d is not offered", tokens[i], best[i]);
        }
        /* The table is still the layer's, and nothing is forced. */
        CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 5), 32);
        CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 300), 128);
        /* A forced tile survives an autotune too; us may be NULL. */
        moek_cuda_tuning forced = {64, false, 0};
        CK(moek_cuda_moe_layer_tune(l, &forced));
        const int one = 16;
        CK(moek_cuda_moe_layer_autotune(l, &one, 1, best, NULL));
        CHECK(best[0] >= 16 && best[0] <= 256);
        CHECK_EQ_INT(moek_cuda_moe_layer_token_tile(l, 300), 64);
        /* Refusals. */
        CHECK_EQ_INT(moek_cuda_moe_layer_autotune(l, tokens, 0, best, NULL),
                     -EINVAL);
        const int zero = 0, huge = 1 << 20;
        CHECK_EQ_INT(moek_cuda_moe_layer_autotune(l, &zero, 1, best, NULL),
                     -EINVAL);
        CHECK_EQ_INT(moek_cuda_moe_layer_autotune(l, &huge, 1, best, NULL),
                     -EINVAL);
        CHECK_EQ_INT(moek_cuda_moe_layer_autotune(l, tokens, n, NULL, NULL),
                     -EINVAL);
        moek_cuda_tuning simt = {0, true, 0};
        CK(moek_cuda_moe_layer_tune(l, &simt));
        CHECK_EQ_INT(moek_cuda_moe_layer_autotune(l, tokens, n, best, NULL),
                     -ENOTSUP);
        CHECK_STR_CONTAINS(moek_cuda_last_error(), "SIMT");
        CHECK(moek_cuda_context_ok());
        moek_cuda_moe_layer_free(l);
    }
}

/* The BENCH.md shapes. */
TEST(moe_qwen3)
{
    need_gpu();
    uint64_t rng = test_seed();
    static const int tokens[] = {1, 8, 64, 512, 4096};
    for (int i = 0; i < 5; i++) {
        moe_case c = {{128, 8, 2048, 768}, MOEK_DTYPE_BF16, tokens[i],
                      ROUTE_SOFTMAX, true, 0, 8, {0, false, 0}, false, false, NULL};
        run_moe(&c, &rng);
    }
    moe_case f = {{128, 8, 2048, 768}, MOEK_DTYPE_FP16, 100, ROUTE_GIVEN,
                  false, 0, 8, {0, false, 0}, false, false, NULL};
    run_moe(&f, &rng);
}

TEST(moe_mixtral)
{
    need_gpu();
    uint64_t rng = test_seed();
    moe_case c = {{8, 2, 4096, 14336}, MOEK_DTYPE_BF16, 1, ROUTE_SOFTMAX,
                  true, 0, 0, {0, false, 0}, false, false, NULL};
    run_moe(&c, &rng);
    c.tokens = 3;
    run_moe(&c, &rng);
}

TEST(moe_deepseek)
{
    need_gpu();
    uint64_t rng = test_seed();
    moe_case c = {{256, 8, 7168, 2048}, MOEK_DTYPE_BF16, 1, ROUTE_SIGMOID,
                  true, 0, 0, {0, false, 0}, false, false, NULL};
    run_moe(&c, &rng);
    c.tokens = 3;
    c.route = ROUTE_SOFTMAX;
    run_moe(&c, &rng);
}

/*
 * A layer spread over devices: each shard (its experts' weights and a remap
 * table) computes its slots of every token, the partials summed in fp32
 * equal the whole layer's output. Shards on device 0 run through
 * moek_cuda_fused_moe with the remap; with two or more GPUs the same split
 * runs through moek_cuda_ep_forward with each transport.
 */
static void run_shards(moek_cuda_routing_kind kind, uint64_t *rng)
{
    const moek_moe_shape s = {16, 4, 256, 512};
    const int E = s.experts, k = s.topk, H = s.hidden, I = s.intermediate, T = 100;
    const size_t ih = (size_t)I * H;
    const uint64_t seed = test_rand(rng);
    void *w1 = dmalloc(E * ih * 2), *w3 = dmalloc(E * ih * 2), *w2 = dmalloc(E * ih * 2);
    CK(moek_cuda_fill_uniform(w1, MOEK_DTYPE_BF16, E * ih, seed + 1, 0.0625f, NULL));
    CK(moek_cuda_fill_uniform(w3, MOEK_DTYPE_BF16, E * ih, seed + 2, 0.0625f, NULL));
    CK(moek_cuda_fill_uniform(w2, MOEK_DTYPE_BF16, E * ih, seed + 3, 0.044f, NULL));
    /* Uneven split: experts 0-4, 5-15, so top-4 often spans both. */
    const int cut = 5;
    moek_cuda_moe_layer *whole = NULL, *part[2] = {NULL, NULL};
    CK(moek_cuda_moe_layer_new_from_device(&s, MOEK_DTYPE_BF16, w1, w3, w2, 0, &whole));
    moek_moe_shape s0 = s, s1 = s;
    s0.experts = cut;
    s1.experts = E - cut;
    CK(moek_cuda_moe_layer_new_from_device(&s0, MOEK_DTYPE_BF16, w1, w3, w2, 0, &part[0]));
    CK(moek_cuda_moe_layer_new_from_device(&s1, MOEK_DTYPE_BF16, (char *)w1 + cut * ih * 2,
                                           (char *)w3 + cut * ih * 2,
                                           (char *)w2 + cut * ih * 2, 0, &part[1]));
    int32_t remap[2][16];
    for (int e = 0; e < E; e++) {
        remap[0][e] = e < cut ? e : -1;
        remap[1][e] = e < cut ? -1 : e - cut;
    }
    int32_t *d_remap[2] = {dmalloc(sizeof remap[0]), dmalloc(sizeof remap[1])};
    CK(moek_cuda_copy_to_device(d_remap[0], remap[0], sizeof remap[0]));
    CK(moek_cuda_copy_to_device(d_remap[1], remap[1], sizeof remap[1]));

    /* Inputs, on the host too (moek_cuda_ep_forward takes host memory). */
    uint16_t *x = xmalloc((size_t)T * H * 2);
    float *logits = xmalloc(sizeof(float) * T * E), *wts = xmalloc(sizeof(float) * T * k);
    int32_t *ids = xmalloc(sizeof(int32_t) * T * k);
    host_fill(x, MOEK_DTYPE_BF16, seed + 4, 0, (size_t)T * H, 1.0f);
    host_fill(logits, MOEK_DTYPE_FP32, seed + 5, 0, (size_t)T * E, 3.0f);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            ids[t * k + j] = (t * 7 + j * 5) % E; /* distinct: 5 is prime to 16 */
            wts[t * k + j] = (test_randf(rng) + 1.0f) * 0.5f;
        }
    void *dx = dmalloc((size_t)T * H * 2), *dl = dmalloc(sizeof(float) * T * E),
         *di = dmalloc(sizeof(int32_t) * T * k), *dw = dmalloc(sizeof(float) * T * k);
    CK(moek_cuda_copy_to_device(dx, x, (size_t)T * H * 2));
    CK(moek_cuda_copy_to_device(dl, logits, sizeof(float) * T * E));
    CK(moek_cuda_copy_to_device(di, ids, sizeof(int32_t) * T * k));
    CK(moek_cuda_copy_to_device(dw, wts, sizeof(float) * T * k));
    moek_cuda_routing rt = {kind, dl, MOEK_SCORING_SOFTMAX, true, di, dw, NULL, 0};

    moek_cuda_workspace *ws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_moe_workspace_size(whole, T), &ws));
    void *dout = dmalloc((size_t)T * H * 2);
    uint16_t *want = xmalloc((size_t)T * H * 2), *got = xmalloc((size_t)T * H * 2);
    CK(moek_cuda_memset(dout, 0xff, (size_t)T * H * 2));
    CK(moek_cuda_fused_moe(whole, ws, dx, &rt, T, dout, NULL));
    CK(moek_cuda_copy_to_host(want, dout, (size_t)T * H * 2));
    float *wf = xmalloc(sizeof(float) * T * H), *acc = calloc((size_t)T * H, sizeof(float)),
          *tmp = xmalloc(sizeof(float) * T * H);
    CHECK(acc != NULL);
    moek_to_f32(MOEK_DTYPE_BF16, want, wf, (size_t)T * H);

    /* Each shard through fused_moe with its remap; sum on the host. */
    for (int p = 0; p < 2; p++) {
        moek_cuda_routing r = rt;
        r.remap_dev = d_remap[p];
        r.route_experts = E;
        CK(moek_cuda_memset(dout, 0xff, (size_t)T * H * 2));
        CK(moek_cuda_fused_moe(part[p], ws, dx, &r, T, dout, NULL));
        CK(moek_cuda_copy_to_host(got, dout, (size_t)T * H * 2));
        moek_to_f32(MOEK_DTYPE_BF16, got, tmp, (size_t)T * H);
        for (size_t i = 0; i < (size_t)T * H; i++)
            acc[i] += tmp[i];
    }
    double err = moek_rel_error(acc, wf, (size_t)T * H);
    fprintf(stderr, "  shards on one device, %s routing: rel err %.2e\n",
            kind == MOEK_CUDA_ROUTE_LOGITS ? "computed" : "given", err);
    CHECK_MSG(err < 1e-2, "shards summed: rel err %g", err);

    /* A shard whose routing is over fewer experts than its top-k is refused. */
    moek_cuda_routing bad = rt;
    bad.remap_dev = d_remap[0];
    bad.route_experts = 0;
    CHECK_EQ_INT(moek_cuda_fused_moe(part[0], ws, dx, &bad, T, dout, NULL), -EINVAL);

    /* Across devices: every group of the first two GPUs, both transports. */
    if (moek_cuda_device_count() >= 2) {
        const int devs[2] = {0, 1};
        moek_cuda_moe_layer *l1 = NULL;
        void *v1 = NULL, *v3 = NULL, *v2 = NULL;
        int32_t *r1 = NULL;
        CK(moek_cuda_set_device(1));
        v1 = dmalloc(E * ih * 2);
        v3 = dmalloc(E * ih * 2);
        v2 = dmalloc(E * ih * 2);
        CK(moek_cuda_fill_uniform(v1, MOEK_DTYPE_BF16, E * ih, seed + 1, 0.0625f, NULL));
        CK(moek_cuda_fill_uniform(v3, MOEK_DTYPE_BF16, E * ih, seed + 2, 0.0625f, NULL));
        CK(moek_cuda_fill_uniform(v2, MOEK_DTYPE_BF16, E * ih, seed + 3, 0.044f, NULL));
        CK(moek_cuda_moe_layer_new_from_device(&s1, MOEK_DTYPE_BF16, (char *)v1 + cut * ih * 2,
                                               (char *)v3 + cut * ih * 2,
                                               (char *)v2 + cut * ih * 2, 1, &l1));
        r1 = dmalloc(sizeof remap[1]);
        CK(moek_cuda_copy_to_device(r1, remap[1], sizeof remap[1]));
        moek_cuda_moe_layer *layers[2] = {part[0], l1};
        const int32_t *remaps[2] = {d_remap[0], r1};
        moek_cuda_routing rh = {kind, logits, MOEK_SCORING_SOFTMAX, true, ids, wts, NULL, 0};
        for (int tr = MOEK_CUDA_EP_NCCL; tr <= MOEK_CUDA_EP_PEER; tr++) {
            moek_cuda_ep *ep = NULL;
            int rc = moek_cuda_ep_new(devs, 2, (moek_cuda_ep_transport)tr, &ep);
            if (rc == -ENOTSUP) {
                fprintf(stderr, "  two GPUs, transport %d: %s (skipped)\n", tr,
                        moek_cuda_last_error());
                continue;
            }
            CK(rc);
            memset(got, 0xff, (size_t)T * H * 2);
            CK(moek_cuda_ep_forward(ep, layers, remaps, E, x, &rh, T, got));
            moek_to_f32(MOEK_DTYPE_BF16, got, tmp, (size_t)T * H);
            err = moek_rel_error(tmp, wf, (size_t)T * H);
            fprintf(stderr, "  two GPUs over %s: rel err %.2e\n",
                    moek_cuda_ep_transport_name(ep), err);
            CHECK_MSG(err < 1e-2, "two GPUs, transport %d: rel err %g", tr, err);
            moek_cuda_ep_free(ep);
        }
        CK(moek_cuda_set_device(1));
        moek_cuda_moe_layer_free(l1);
        moek_cuda_free(v1);
        moek_cuda_free(v2);
        moek_cuda_free(v3);
        moek_cuda_free(r1);
        CK(moek_cuda_set_device(0));
    } else {
        /* One device: the group of one still runs the whole path. */
        const int dev0 = 0;
        moek_cuda_ep *ep = NULL;
        CK(moek_cuda_ep_new(&dev0, 1, MOEK_CUDA_EP_AUTO, &ep));
        moek_cuda_moe_layer *layers[1] = {whole};
        int32_t ident[16];
        for (int e = 0; e < E; e++)
            ident[e] = e;
        int32_t *d_ident = dmalloc(sizeof ident);
        CK(moek_cuda_copy_to_device(d_ident, ident, sizeof ident));
        const int32_t *remaps[1] = {d_ident};
        moek_cuda_routing rh = {kind, logits, MOEK_SCORING_SOFTMAX, true, ids, wts, NULL, 0};
        memset(got, 0xff, (size_t)T * H * 2);
        CK(moek_cuda_ep_forward(ep, layers, remaps, E, x, &rh, T, got));
        /* Not bit for bit: the order of the fp32 sums over a token's
         * experts follows the device's atomics. */
        moek_to_f32(MOEK_DTYPE_BF16, got, tmp, (size_t)T * H);
        err = moek_rel_error(tmp, wf, (size_t)T * H);
        fprintf(stderr, "  a group of one device: rel err %.2e\n", err);
        CHECK_MSG(err < 1e-2, "a group of one device: rel err %g", err);

        /* A shard that does not match is refused before any work, and the
         * group still serves; a forward that fails part way (its buffers,
         * hundreds of GB, cannot be had) spends the group: later forwards
         * are refused until it is freed. */
        moek_cuda_routing no_ids = rh;
        no_ids.kind = MOEK_CUDA_ROUTE_GIVEN;
        no_ids.ids_dev = NULL;
        CHECK_EQ_INT(moek_cuda_ep_forward(ep, layers, remaps, E, x, &no_ids, T, got), -EINVAL);
        CK(moek_cuda_ep_forward(ep, layers, remaps, E, x, &rh, T, got));
        CHECK(!moek_cuda_ep_failed(ep));
        CHECK_EQ_INT(moek_cuda_ep_forward(ep, layers, remaps, E, x, &rh, 1 << 30, got),
                     -ENOMEM);
        CHECK(moek_cuda_ep_failed(ep));
        CHECK_EQ_INT(moek_cuda_ep_forward(ep, layers, remaps, E, x, &rh, T, got), -EIO);
        CHECK_MSG(strstr(moek_cuda_last_error(), "failed before") != NULL, "%s",
                  moek_cuda_last_error());
        moek_cuda_ep_free(ep);
        moek_cuda_free(d_ident);
    }

    free(x); free(logits); free(wts); free(ids); free(want); free(got);
    free(wf); free(acc); free(tmp);
    moek_cuda_free(dx); moek_cuda_free(dl); moek_cuda_free(di); moek_cuda_free(dw);
    moek_cuda_free(dout); moek_cuda_free(d_remap[0]); moek_cuda_free(d_remap[1]);
    moek_cuda_free(w1); moek_cuda_free(w2); moek_cuda_free(w3);
    moek_cuda_workspace_free(ws);
    moek_cuda_moe_layer_free(whole);
    moek_cuda_moe_layer_free(part[0]);
    moek_cuda_moe_layer_free(part[1]);
}

TEST(moe_shards)
{
    need_gpu();
    uint64_t rng = test_seed();
    run_shards(MOEK_CUDA_ROUTE_LOGITS, &rng);
    run_shards(MOEK_CUDA_ROUTE_GIVEN, &rng);
}

/* MOEK_CUDA_ROUTE_CLUSTER=16 with a layer spread over shards: a shard of 5
 * experts found its routing cluster for one logit a lane, while it routes
 * over all 40 experts (two a lane), whose kernel was never allowed the
 * non-portable 16 CTAs; its route keeps to 8 (moek_route_cluster_use).
 * T = 300 would take 16 CTAs. The shards, the first made and run before
 * the second (whose 35 experts do allow two a lane 16), sum to the whole
 * layer, made first under the default cap. */
TEST(a_shard_routes_within_its_cluster_cap)
{
    need_gpu();
    uint64_t rng = test_seed();
    const moek_moe_shape s = {40, 2, 256, 512};
    const int E = s.experts, H = s.hidden, T = 300, cut = 5;
    const size_t ih = (size_t)s.intermediate * H, xb = (size_t)T * H * 2;
    const uint64_t seed = test_rand(&rng);
    void *w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = dmalloc(E * ih * 2);
        CK(moek_cuda_fill_uniform(w[i], MOEK_DTYPE_BF16, E * ih, seed + i, i < 2 ? 0.0625f : 0.044f,
                                  NULL));
    }
    void *dx = dmalloc(xb), *dl = dmalloc(sizeof(float) * T * E), *dout = dmalloc(xb);
    CK(moek_cuda_fill_uniform(dx, MOEK_DTYPE_BF16, (size_t)T * H, seed + 3, 1.0f, NULL));
    CK(moek_cuda_fill_uniform(dl, MOEK_DTYPE_FP32, (size_t)T * E, seed + 4, 3.0f, NULL));
    moek_cuda_routing rt = {MOEK_CUDA_ROUTE_LOGITS, dl, MOEK_SCORING_SOFTMAX, true, NULL, NULL,
                            NULL, 0};
    moek_cuda_moe_layer *whole = NULL, *part[2] = {NULL, NULL};
    CK(moek_cuda_moe_layer_new_from_device(&s, MOEK_DTYPE_BF16, w[0], w[1], w[2], 0, &whole));
    moek_cuda_workspace *ws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_moe_workspace_size(whole, T), &ws));
    uint16_t *want = xmalloc(xb), *got = xmalloc(xb);
    CK(moek_cuda_memset(dout, 0xff, xb));
    CK(moek_cuda_fused_moe(whole, ws, dx, &rt, T, dout, NULL));
    CK(moek_cuda_copy_to_host(want, dout, xb));
    float *wf = xmalloc(sizeof(float) * T * H), *tmp = xmalloc(sizeof(float) * T * H),
          *acc = calloc((size_t)T * H, sizeof(float));
    CHECK(acc != NULL);
    moek_to_f32(MOEK_DTYPE_BF16, want, wf, (size_t)T * H);
    char *keep = env_set("MOEK_CUDA_ROUTE_CLUSTER", "16");
    for (int p = 0; p < 2; p++) {
        moek_moe_shape sp = s;
        sp.experts = p ? E - cut : cut;
        const size_t off = p ? cut * ih * 2 : 0;
        CK(moek_cuda_moe_layer_new_from_device(&sp, MOEK_DTYPE_BF16, (char *)w[0] + off,
                                               (char *)w[1] + off, (char *)w[2] + off, 0,
                                               &part[p]));
        int32_t remap[40];
        for (int e = 0; e < E; e++)
            remap[e] = (e < cut) == (p == 0) ? e - (p ? cut : 0) : -1;
        int32_t *dr = dmalloc(sizeof remap);
        CK(moek_cuda_copy_to_device(dr, remap, sizeof remap));
        moek_cuda_routing r = rt;
        r.remap_dev = dr;
        r.route_experts = E;
        CK(moek_cuda_memset(dout, 0xff, xb));
        CK(moek_cuda_fused_moe(part[p], ws, dx, &r, T, dout, NULL));
        CK(moek_cuda_copy_to_host(got, dout, xb));
        moek_to_f32(MOEK_DTYPE_BF16, got, tmp, (size_t)T * H);
        for (size_t i = 0; i < (size_t)T * H; i++)
            acc[i] += tmp[i];
        moek_cuda_free(dr);
    }
    env_restore("MOEK_CUDA_ROUTE_CLUSTER", keep);
    double err = moek_rel_error(acc, wf, (size_t)T * H);
    fprintf(stderr, "  shards of 5 and 35 experts against the whole: rel err %.2e\n", err);
    CHECK_MSG(err < 1e-2, "shards summed: rel err %g", err);
    free(want); free(got); free(wf); free(tmp); free(acc);
    for (int p = 0; p < 2; p++)
        moek_cuda_moe_layer_free(part[p]);
    moek_cuda_moe_layer_free(whole);
    moek_cuda_workspace_free(ws);
    for (int i = 0; i < 3; i++)
        moek_cuda_free(w[i]);
    moek_cuda_free(dx);
    moek_cuda_free(dl);
    moek_cuda_free(dout);
}

/* A forward of T tokens on a layer of shape s (made with MOEK_CUDA_NO_DEP=1
 * unless dep), captured once in a CUDA graph and replayed over new inputs. */
static void graph_replay(moek_moe_shape s, int T, bool dep, uint64_t *rngp)
{
    uint64_t rng = test_rand(rngp);
    const int E = s.experts, k = s.topk, H = s.hidden, I = s.intermediate;
    const moek_dtype dt = MOEK_DTYPE_BF16;
    const size_t ih = (size_t)I * H;
    char *w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = xmalloc(E * ih * 2);
        host_fill(w[i], dt, 100 + i, 0, E * ih, 0.1f);
    }
    moek_cuda_moe_layer *layer = NULL;
    char *keep = env_set("MOEK_CUDA_NO_DEP", dep ? NULL : "1");
    CK(moek_cuda_moe_layer_new(&s, dt, w[0], w[1], w[2], 0, &layer));
    env_restore("MOEK_CUDA_NO_DEP", keep);
    moek_cuda_workspace *ws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_moe_workspace_size(layer, T), &ws));
    void *x = dmalloc((size_t)T * H * 2), *out = dmalloc((size_t)T * H * 2),
         *lg = dmalloc(sizeof(float) * T * E), *stream = NULL, *graph = NULL;
    CK(moek_cuda_stream_new(&stream));
    moek_cuda_routing rt = {MOEK_CUDA_ROUTE_LOGITS, lg, MOEK_SCORING_SOFTMAX,
                            true, NULL, NULL, NULL, 0};
    CK(moek_cuda_graph_begin(stream));
    CK(moek_cuda_fused_moe(layer, ws, x, &rt, T, out, stream));
    CK(moek_cuda_graph_end(stream, &graph));
    for (int rep = 0; rep < 3; rep++) {
        uint64_t seed = test_rand(&rng);
        CK(moek_cuda_fill_uniform(x, dt, (size_t)T * H, seed, 1.0f, stream));
        CK(moek_cuda_fill_uniform(lg, MOEK_DTYPE_FP32, (size_t)T * E, seed + 1,
                                  4.0f, stream));
        CK(moek_cuda_memset(out, 0xff, (size_t)T * H * 2));
        CK(moek_cuda_graph_launch(graph, stream));
        CK(moek_cuda_stream_sync(stream));
        char *hx = xmalloc((size_t)T * H * 2), *ref = xmalloc((size_t)T * H * 2),
             *got = xmalloc((size_t)T * H * 2);
        float *hl = xmalloc(sizeof(float) * T * E), *rw = xmalloc(sizeof(float) * T * k);
        int32_t *rid = xmalloc(sizeof(int32_t) * T * k);
        host_fill(hx, dt, seed, 0, (size_t)T * H, 1.0f);
        host_fill(hl, MOEK_DTYPE_FP32, seed + 1, 0, (size_t)T * E, 4.0f);
        moek_ref_route(hl, T, E, k, MOEK_SCORING_SOFTMAX, true, rid, rw);
        CHECK_EQ_INT(moek_ref_fused_moe(&s, dt, hx, rid, rw, w[0], w[1], w[2],
                                        T, ref),
                     0);
        CK(moek_cuda_copy_to_host(got, out, (size_t)T * H * 2));
        float *a = xmalloc(sizeof(float) * T * H), *b = xmalloc(sizeof(float) * T * H);
        moek_to_f32(dt, got, a, (size_t)T * H);
        moek_to_f32(dt, ref, b, (size_t)T * H);
        double err = moek_rel_error(a, b, (size_t)T * H);
        fprintf(stderr, "  graph replay %d: rel err %.2e\n", rep, err);
        CHECK(err < tolerance(dt));
        free(hx); free(ref); free(got); free(hl); free(rw); free(rid); free(a); free(b);
    }
    moek_cuda_graph_free(graph);
    moek_cuda_stream_free(stream);
    for (int i = 0; i < 3; i++)
        free(w[i]);
    moek_cuda_free(x);
    moek_cuda_free(out);
    moek_cuda_free(lg);
    moek_cuda_workspace_free(ws);
    moek_cuda_moe_layer_free(layer);
}

/* Graph replays of a decode forward whose GEMM 1 leaves SMs idle (68
 * items; GEMM 2 after the whole of GEMM 1), and of one token whose 192
 * GEMM 1 items leave a third of the SMs idle in their last round, where
 * GEMM 2 starts per group on counts each replay's routing zeroes again. */
TEST(moe_graph_replay)
{
    need_gpu();
    uint64_t rng = test_seed();
    graph_replay((moek_moe_shape){32, 4, 256, 128}, 8, false, &rng);
    graph_replay((moek_moe_shape){16, 4, 256, 3072}, 1, true, &rng);
}

/* ---- grouped GEMM ------------------------------------------------------- */

static void run_gemm(moek_dtype dt, int G, int N, int K, const int64_t *sizes,
                     int tile, bool generic, uint64_t *rng)
{
    const size_t es = moek_dtype_size(dt);
    int64_t M = 0;
    for (int g = 0; g < G; g++)
        M += sizes[g];
    const uint64_t seed = test_rand(rng);
    char *b = xmalloc((size_t)G * N * K * es), *a = xmalloc((size_t)M * K * es + 1);
    host_fill(b, dt, seed, 0, (size_t)G * N * K, 1.0f / sqrtf((float)K));
    host_fill(a, dt, seed + 1, 0, (size_t)M * K, 1.0f);
    moek_cuda_gemm_weights *w = NULL;
    CK(moek_cuda_gemm_weights_new(dt, G, N, K, b, 0, &w));
    moek_cuda_tuning tu = {tile, generic, 0};
    CK(moek_cuda_gemm_weights_tune(w, &tu));
    moek_cuda_workspace *ws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_gemm_workspace_size(w, M), &ws));
    void *da = dmalloc((size_t)M * K * es), *dc = dmalloc((size_t)M * N * es),
         *dm = dmalloc(sizeof(int64_t) * G);
    CK(moek_cuda_copy_to_device(da, a, (size_t)M * K * es));
    CK(moek_cuda_copy_to_device(dm, sizes, sizeof(int64_t) * G));
    CK(moek_cuda_memset(dc, 0xff, (size_t)M * N * es));
    CK(moek_cuda_grouped_gemm(w, ws, da, dm, M, dc, NULL));
    CK(moek_cuda_stream_sync(NULL));
    char *got = xmalloc((size_t)M * N * es + 1), *ref = xmalloc((size_t)M * N * es + 1);
    CK(moek_cuda_copy_to_host(got, dc, (size_t)M * N * es));
    CHECK_EQ_INT(moek_ref_grouped_gemm(dt, G, N, K, a, sizes, b, ref), 0);
    float *gf = xmalloc(sizeof(float) * M * N + 1), *rf = xmalloc(sizeof(float) * M * N + 1);
    moek_to_f32(dt, got, gf, (size_t)M * N);
    moek_to_f32(dt, ref, rf, (size_t)M * N);
    for (size_t i = 0; i < (size_t)M * N; i++)
        CHECK_MSG(isfinite(gf[i]), "C[%zu][%zu] = %g (unwritten?)", i / N,
                  i % N, gf[i]);
    double err = moek_rel_error(gf, rf, (size_t)M * N);
    fprintf(stderr, "  grouped G=%d N=%d K=%d M=%lld %s tile=%d%s: rel err %.2e\n",
            G, N, K, (long long)M, dt_name(dt), tile, generic ? " simt" : "", err);
    CHECK_MSG(err < tolerance(dt) / 3, "rel err %g", err);
    free(a); free(b); free(got); free(ref); free(gf); free(rf);
    moek_cuda_free(da);
    moek_cuda_free(dc);
    moek_cuda_free(dm);
    moek_cuda_workspace_free(ws);
    moek_cuda_gemm_weights_free(w);
}

TEST(grouped_gemm)
{
    need_gpu();
    uint64_t rng = test_seed();
    /* 64 groups, most empty, N with a padded 16-row block, K not a multiple
     * of the 64-wide K tile. */
    int64_t sizes[64] = {0};
    sizes[3] = 1;
    sizes[17] = 17;
    sizes[40] = 300;
    sizes[63] = 5;
    run_gemm(MOEK_DTYPE_BF16, 64, 72, 200, sizes, 0, false, &rng);
    run_gemm(MOEK_DTYPE_FP16, 64, 72, 200, sizes, 0, false, &rng);
    run_gemm(MOEK_DTYPE_BF16, 64, 72, 200, sizes, 0, true, &rng);
    static const int tiles[] = MOEK_CUDA_TOKEN_TILES;
    int64_t big[8] = {0, 1000, 0, 0, 77, 0, 0, 256};
    for (int i = 0; i < MOEK_CUDA_TILE_CANDIDATES; i++)
        run_gemm(i % 2 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16, 8, 256, 512, big,
                 tiles[i], false, &rng);
    /* Host weights going up a few groups at a time (weights.cu): three of
     * 256 KB a step (steps of 3, 3 and 2 groups), and one at a time. */
    char *keep = env_set("MOEK_CUDA_UPLOAD_KB", "768");
    run_gemm(MOEK_DTYPE_BF16, 8, 256, 512, big, 128, false, &rng);
    env_restore("MOEK_CUDA_UPLOAD_KB", keep);
    keep = env_set("MOEK_CUDA_UPLOAD_KB", "1");
    run_gemm(MOEK_DTYPE_FP16, 64, 72, 200, sizes, 0, false, &rng);
    env_restore("MOEK_CUDA_UPLOAD_KB", keep);
    /* Items of one K block, about 32 per CTA at 64-row tiles: the producer
     * runs up to a pipeline's depth of items ahead of the consumers, twice
     * round the ring of decoded items it hands them (gemm_wgmma.cu,
     * handoff). */
    int64_t many[2] = {6000, 2500};
    run_gemm(MOEK_DTYPE_BF16, 2, 4096, 64, many, 64, false, &rng);
    /* one row in one group of 128 (the decode case FBGEMM's change fixed) */
    int64_t one[128] = {0};
    one[77] = 1;
    run_gemm(MOEK_DTYPE_BF16, 128, 1024, 1024, one, 0, false, &rng);
    /* nothing at all: returns at once */
    moek_cuda_gemm_weights *w = NULL;
    char *b = xmalloc(4 * 16 * 16 * 2);
    host_fill(b, MOEK_DTYPE_BF16, 1, 0, 4 * 16 * 16, 1.0f);
    CK(moek_cuda_gemm_weights_new(MOEK_DTYPE_BF16, 4, 16, 16, b, 0, &w));
    moek_cuda_workspace *ws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_gemm_workspace_size(w, 0), &ws));
    void *dm = dmalloc(4 * sizeof(int64_t));
    CK(moek_cuda_memset(dm, 0, 4 * sizeof(int64_t)));
    CHECK_EQ_INT(moek_cuda_grouped_gemm(w, ws, NULL, dm, 0, NULL, NULL), 0);
    moek_cuda_free(dm);
    moek_cuda_workspace_free(ws);
    moek_cuda_gemm_weights_free(w);
    free(b);
}

/* ---- refusals ------------------------------------------------------------ */

/* The mapped-row copy (moek_cuda_copy_rows_mapped): 150 segments of 0-3
 * rows (three launches) at scattered places of a pinned host buffer, rows
 * of 8192 bytes (the 16-byte path) and of 70 bytes at odd addresses (the
 * byte path), host to device and back; destinations poisoned first, and
 * the host bytes between segments must stay as they were. */
TEST(rows_mapped)
{
    need_gpu();
    uint64_t rng = test_seed();
    void *stream = NULL;
    CK(moek_cuda_stream_new(&stream));
    static const size_t widths[] = {8192, 70};
    for (int wi = 0; wi < 2; wi++) {
        enum { NSEG = 150 };
        const size_t rb = widths[wi], gap = wi ? 5 : 48;
        int rows[NSEG], total = 0;
        for (int i = 0; i < NSEG; i++) {
            rows[i] = (int)(test_rand(&rng) % 4);
            total += rows[i];
        }
        const size_t hbytes = (size_t)total * rb + NSEG * gap + 64;
        uint8_t *host = xmalloc(hbytes), *want = xmalloc(hbytes);
        const size_t dbytes = (size_t)total * rb;
        uint8_t *dev_img = xmalloc(dbytes), *back = xmalloc(dbytes);
        for (size_t i = 0; i < hbytes; i++)
            host[i] = (uint8_t)test_rand(&rng);
        CK(moek_cuda_host_register(host, hbytes));
        void *ptrs[NSEG];
        size_t pos = wi ? 3 : 0;
        for (int i = 0; i < NSEG; i++) {
            ptrs[i] = host + pos;
            pos += (size_t)rows[i] * rb + gap;
        }
        void *dev = dmalloc(dbytes);
        /* In: the segments, in order, become the device buffer. */
        CK(moek_cuda_memset(dev, 0xff, dbytes));
        CK(moek_cuda_copy_rows_mapped(dev, ptrs, rows, NSEG, rb, 0, stream));
        CK(moek_cuda_stream_sync(stream));
        CK(moek_cuda_copy_to_host(back, dev, dbytes));
        size_t at = 0;
        for (int i = 0; i < NSEG; i++) {
            const size_t n = (size_t)rows[i] * rb;
            CHECK_MSG(!memcmp(back + at, ptrs[i], n), "row width %zu, segment %d in", rb, i);
            at += n;
        }
        /* Out: new device rows go back into the segments, nowhere else. */
        for (size_t i = 0; i < dbytes; i++)
            dev_img[i] = (uint8_t)test_rand(&rng);
        CK(moek_cuda_copy_to_device(dev, dev_img, dbytes));
        memset(host, 0xa5, hbytes);
        memset(want, 0xa5, hbytes);
        at = 0;
        for (int i = 0; i < NSEG; i++) {
            const size_t n = (size_t)rows[i] * rb;
            memcpy(want + ((uint8_t *)ptrs[i] - host), dev_img + at, n);
            at += n;
        }
        CK(moek_cuda_copy_rows_mapped(dev, ptrs, rows, NSEG, rb, 1, stream));
        CK(moek_cuda_stream_sync(stream));
        CHECK_MSG(!memcmp(host, want, hbytes), "row width %zu: out", rb);
        CK(moek_cuda_host_unregister(host));
        moek_cuda_free(dev);
        free(host);
        free(want);
        free(dev_img);
        free(back);
    }
    /* Refused: a negative row count. */
    int bad_rows[1] = {-1};
    void *one[1] = {&bad_rows};
    void *dev = dmalloc(64);
    CHECK_EQ_INT(moek_cuda_copy_rows_mapped(dev, one, bad_rows, 1, 16, 0, stream), -EINVAL);
    moek_cuda_free(dev);
    moek_cuda_stream_free(stream);
}

TEST(refuses_unsupported)
{
    need_gpu();
    static char dummy[64];
    moek_cuda_moe_layer *l = NULL;
    moek_moe_shape s = {8, 2, 256, 128};
    CHECK_EQ_INT(moek_cuda_moe_layer_new(&s, MOEK_DTYPE_FP32, dummy, dummy,
                                         dummy, 0, &l),
                 -ENOTSUP);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "bf16 or fp16");
    CHECK(l == NULL);
    moek_moe_shape odd = {8, 2, 100, 128};
    CHECK_EQ_INT(moek_cuda_moe_layer_new(&odd, MOEK_DTYPE_BF16, dummy, dummy,
                                         dummy, 0, &l),
                 -ENOTSUP);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "multiple");
    moek_moe_shape many = {600, 2, 256, 128};
    CHECK_EQ_INT(moek_cuda_moe_layer_new(&many, MOEK_DTYPE_BF16, dummy, dummy,
                                         dummy, 0, &l),
                 -ENOTSUP);
    moek_moe_shape bigk = {64, 40, 256, 128};
    CHECK_EQ_INT(moek_cuda_moe_layer_new(&bigk, MOEK_DTYPE_BF16, dummy, dummy,
                                         dummy, 0, &l),
                 -ENOTSUP);
    /* Top-k above E is a shard of a spread layer: loaded, but routing from
     * logits over its own 4 experts is refused. */
    moek_moe_shape kgte = {4, 5, 256, 128};
    void *kw = dmalloc(4 * 256 * 128 * 2), *kx = dmalloc(4 * 256 * 2), *kl = dmalloc(4 * 4 * 4);
    CK(moek_cuda_fill_uniform(kw, MOEK_DTYPE_BF16, 4 * 256 * 128, 7, 0.1f, NULL));
    CK(moek_cuda_fill_uniform(kl, MOEK_DTYPE_FP32, 16, 8, 1.0f, NULL));
    CK(moek_cuda_moe_layer_new_from_device(&kgte, MOEK_DTYPE_BF16, kw, kw, kw, 0, &l));
    moek_cuda_workspace *kws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_moe_workspace_size(l, 4), &kws));
    moek_cuda_routing kr = {MOEK_CUDA_ROUTE_LOGITS, kl, MOEK_SCORING_SOFTMAX, false,
                            NULL, NULL, NULL, 0};
    CHECK_EQ_INT(moek_cuda_fused_moe(l, kws, kx, &kr, 4, kx, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "fewer experts");
    /* Rows that are not 16-byte aligned are refused, not read. */
    CHECK_EQ_INT(moek_cuda_fused_moe(l, kws, (char *)kx + 2, &kr, 1, kx, NULL),
                 -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "16-byte aligned");
    CHECK_EQ_INT(moek_cuda_fused_moe(l, kws, kx, &kr, 1, (char *)kx + 8, NULL),
                 -EINVAL);
    moek_cuda_workspace_free(kws);
    moek_cuda_moe_layer_free(l);
    l = NULL;
    moek_cuda_free(kw);
    moek_cuda_free(kx);
    moek_cuda_free(kl);
    CHECK_EQ_INT(moek_cuda_moe_layer_new(&s, MOEK_DTYPE_BF16, NULL, dummy,
                                         dummy, 0, &l),
                 -EINVAL);
    CHECK_EQ_INT(moek_cuda_moe_layer_new(&s, MOEK_DTYPE_BF16, dummy, dummy,
                                         dummy, 99, &l),
                 -ENODEV);
    moek_cuda_gemm_weights *g = NULL;
    CHECK_EQ_INT(moek_cuda_gemm_weights_new(MOEK_DTYPE_BF16, 4, 12, 64, dummy,
                                            0, &g),
                 -ENOTSUP);
    CHECK_EQ_INT(moek_cuda_gemm_weights_new(MOEK_DTYPE_BF16, 5000, 16, 64,
                                            dummy, 0, &g),
                 -ENOTSUP);
    CHECK(g == NULL);

    /* A real layer, then calls it must refuse. */
    const size_t n = (size_t)8 * 128 * 256;
    char *w = xmalloc(n * 2);
    host_fill(w, MOEK_DTYPE_BF16, 7, 0, n, 0.05f);
    CK(moek_cuda_moe_layer_new(&s, MOEK_DTYPE_BF16, w, w, w, 0, &l));
    moek_cuda_workspace *ws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_moe_workspace_size(l, 4), &ws));
    void *x = dmalloc(64 * 256 * 2), *lg = dmalloc(64 * 8 * 4);
    moek_cuda_routing rt = {MOEK_CUDA_ROUTE_LOGITS, lg, MOEK_SCORING_SOFTMAX,
                            false, NULL, NULL, NULL, 0};
    CHECK_EQ_INT(moek_cuda_fused_moe(l, ws, x, &rt, 64, x, NULL), -ENOSPC);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "workspace");
    CHECK_EQ_INT(moek_cuda_fused_moe(l, ws, x, &rt, 0, x, NULL), 0);
    CHECK_EQ_INT(moek_cuda_fused_moe(l, ws, x, NULL, 4, x, NULL), -EINVAL);
    moek_cuda_routing bad = {MOEK_CUDA_ROUTE_GIVEN, NULL, 0, false, NULL, NULL, NULL, 0};
    CHECK_EQ_INT(moek_cuda_fused_moe(l, ws, x, &bad, 4, x, NULL), -EINVAL);
    moek_cuda_tuning tu = {100, false, 0};
    CHECK_EQ_INT(moek_cuda_moe_layer_tune(l, &tu), -EINVAL);
    /* A grouped GEMM on rows that are not 16-byte aligned (its loads and
     * stores would fault, poisoning the context) is refused. */
    CK(moek_cuda_gemm_weights_new(MOEK_DTYPE_BF16, 2, 16, 64, w, 0, &g));
    moek_cuda_workspace *gws = NULL;
    CK(moek_cuda_workspace_new(0, moek_cuda_gemm_workspace_size(g, 4), &gws));
    const int64_t ms[2] = {2, 2};
    int64_t *dms = dmalloc(sizeof(ms));
    CK(moek_cuda_copy_to_device(dms, ms, sizeof(ms)));
    char *ga = dmalloc(4 * 64 * 2 + 16), *gc = dmalloc(4 * 16 * 2 + 16);
    CHECK_EQ_INT(moek_cuda_grouped_gemm(g, gws, ga + 2, dms, 4, gc, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moek_cuda_last_error(), "aligned");
    CHECK_EQ_INT(moek_cuda_grouped_gemm(g, gws, ga, dms, 4, gc + 4, NULL), -EINVAL);
    CK(moek_cuda_grouped_gemm(g, gws, ga, dms, 4, gc, NULL));
    CK(moek_cuda_stream_sync(NULL));
    moek_cuda_free(ga);
    moek_cuda_free(gc);
    moek_cuda_free(dms);
    moek_cuda_workspace_free(gws);
    moek_cuda_gemm_weights_free(g);
    CHECK(moek_cuda_context_ok());
    moek_cuda_free(x);
    moek_cuda_free(lg);
    moek_cuda_workspace_free(ws);
    moek_cuda_moe_layer_free(l);
    moek_cuda_moe_layer_free(NULL);
    moek_cuda_gemm_weights_free(NULL);
    moek_cuda_workspace_free(NULL);
    free(w);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv,
                     (struct test_case[]){
                         TEST_CASE(uniform_host_matches_the_generator),
                         TEST_CASE(cuda_device),
                         TEST_CASE(refuses_unsupported),
                         TEST_CASE_TIMEOUT(rows_mapped, 60),
                         TEST_CASE_TIMEOUT(moe_sweep, 300),
                         TEST_CASE_TIMEOUT(moe_decode_slots, 120),
                         TEST_CASE_TIMEOUT(moe_align_chunks, 120),
                         TEST_CASE_TIMEOUT(moe_mid_batches, 120),
                         TEST_CASE_TIMEOUT(moe_dep_groups, 120),
                         TEST_CASE_TIMEOUT(moe_many_tokens_and_nan, 300),
                         TEST_CASE_TIMEOUT(moe_every_tile, 300),
                         TEST_CASE_TIMEOUT(moe_cluster_tiles, 300),
                         TEST_CASE_TIMEOUT(moe_slot_rows, 300),
                         TEST_CASE_TIMEOUT(moe_stream_k, 300),
                         TEST_CASE_TIMEOUT(moe_tile_classes, 300),
                         TEST_CASE_TIMEOUT(moe_two_weight_tiles, 300),
                         TEST_CASE_TIMEOUT(moe_split_tiles, 300),
                         TEST_CASE_TIMEOUT(moe_tile_table, 120),
                         TEST_CASE_TIMEOUT(moe_autotune, 120),
                         TEST_CASE_TIMEOUT(moe_graph_replay, 120),
                         TEST_CASE_TIMEOUT(moe_shards, 120),
                         TEST_CASE(a_shard_routes_within_its_cluster_cap),
                         TEST_CASE_TIMEOUT(grouped_gemm, 300),
                         TEST_CASE_TIMEOUT(moe_qwen3, 300),
                         TEST_CASE_TIMEOUT(moe_mixtral, 300),
                         TEST_CASE_TIMEOUT(moe_deepseek, 300),
                         {0}});
}
