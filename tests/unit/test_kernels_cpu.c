/*
 * test_kernels_cpu.c: the CPU kernels: dtype conversions, the reference
 * kernels against brute force, the CPU fast path against the reference, the
 * fast path's bit-identical-per-token promise, and the thread pool.
 *
 * Inputs are fresh random values each run (MOE_TEST_SEED replays a run) and
 * outputs are filled with NaN bytes before every call, so a value the kernel
 * forgot to write shows up as a NaN.
 */
#include "tests/harness.h"
#include "moe_kernels.h"

#include <math.h>
#include <stdatomic.h>

/* ---- helpers ------------------------------------------------------------ */

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 0xff bytes are a NaN in fp32, bf16 and fp16 alike. */
static void poison(void *p, size_t bytes)
{
    memset(p, 0xff, bytes);
}

/* n random values of dtype dt, uniform in [-scale, scale). */
static void *rand_tensor(uint64_t *s, moek_dtype dt, size_t n, float scale)
{
    float *f = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        f[i] = test_randf(s) * scale;
    void *out = xmalloc(n * moek_dtype_size(dt));
    moek_from_f32(dt, f, out, n);
    free(f);
    return out;
}

static float *to_f32_copy(moek_dtype dt, const void *src, size_t n)
{
    float *f = xmalloc(n * sizeof(float));
    moek_to_f32(dt, src, f, n);
    return f;
}

static double dtype_tol(moek_dtype dt)
{
    return dt == MOEK_DTYPE_BF16 ? 1e-2 : dt == MOEK_DTYPE_FP16 ? 2e-3 : 1e-5;
}

static const char *dtype_name(moek_dtype dt)
{
    return dt == MOEK_DTYPE_BF16 ? "bf16" : dt == MOEK_DTYPE_FP16 ? "fp16"
                                                                 : "fp32";
}

/* Random routing: distinct experts per token, weights that sum to one. */
static void rand_routing(uint64_t *s, int tokens, int experts, int topk,
                         int32_t *ids, float *w)
{
    float *logits = xmalloc((size_t)tokens * (size_t)experts * sizeof(float));
    for (size_t i = 0; i < (size_t)tokens * (size_t)experts; i++)
        logits[i] = test_randf(s) * 4.0f;
    moek_ref_route(logits, tokens, experts, topk, MOEK_SCORING_SOFTMAX, true,
                   ids, w);
    free(logits);
}

/* A MoE layer with random weights scaled so activations stay O(1). */
struct layer {
    moek_moe_shape shape;
    moek_dtype dt;
    void *w1, *w3, *w2;
    moek_cpu_moe_weights *packed;
};

static void layer_init(struct layer *l, uint64_t *s, moek_dtype dt, int E,
                       int k, int H, int I)
{
    l->shape = (moek_moe_shape){E, k, H, I};
    l->dt = dt;
    size_t n = (size_t)E * (size_t)H * (size_t)I;
    l->w1 = rand_tensor(s, dt, n, 2.0f / sqrtf((float)H));
    l->w3 = rand_tensor(s, dt, n, 2.0f / sqrtf((float)H));
    l->w2 = rand_tensor(s, dt, n, 2.0f / sqrtf((float)I));
    CHECK_EQ_INT(moek_cpu_moe_weights_new(&l->shape, dt, l->w1, l->w3, l->w2,
                                          &l->packed),
                 0);
}

static void layer_done(struct layer *l)
{
    moek_cpu_moe_weights_free(l->packed);
    free(l->w1);
    free(l->w3);
    free(l->w2);
}

/* ---- conversions -------------------------------------------------------- */

TEST(dtype_sizes)
{
    CHECK_EQ_INT(moek_dtype_size(MOEK_DTYPE_BF16), 2);
    CHECK_EQ_INT(moek_dtype_size(MOEK_DTYPE_FP16), 2);
    CHECK_EQ_INT(moek_dtype_size(MOEK_DTYPE_FP32), 4);
    CHECK_EQ_INT(moek_dtype_size((moek_dtype)7), 0);
}

/* Brute-force rounding of f to the nearest of two adjacent encodings lo and
 * lo + 1 of a format, given their values; ties go to the even encoding. */
static uint32_t nearest_even(double f, uint32_t lo, double vlo, double vhi)
{
    double dlo = fabs(f - vlo), dhi = fabs(vhi - f);
    if (dlo < dhi)
        return lo;
    if (dhi < dlo)
        return lo + 1;
    return (lo & 1) ? lo + 1 : lo;
}

static uint16_t bf16_brute(float f)
{
    uint32_t u = f32_bits(f);
    uint32_t sign = u & 0x80000000u, a = u & 0x7fffffffu;
    uint32_t lo = a >> 16;
    double vlo = fabs((double)bits_f32(lo << 16));
    /* One past the largest finite bf16 is infinity, which as a rounding
     * target sits where the next binade would start. */
    double vhi = lo + 1 == 0x7f80u ? ldexp(1.0, 128)
                                   : fabs((double)bits_f32((lo + 1) << 16));
    return (uint16_t)((sign >> 16) |
                      nearest_even(fabs((double)f), lo, vlo, vhi));
}

TEST(bf16_roundtrip_exhaustive)
{
    for (uint32_t v = 0; v < 0x10000u; v++) {
        float f = moek_bf16_to_f32((uint16_t)v);
        CHECK_EQ_INT(f32_bits(f), v << 16);
        uint16_t back = moek_f32_to_bf16(f);
        if (isnan(f)) {
            CHECK(isnan(moek_bf16_to_f32(back)));
            CHECK_EQ_INT(back & 0x8000u, v & 0x8000u);
            CHECK_EQ_INT(back | 0x0040u, v | 0x0040u);
        } else {
            CHECK_EQ_INT(back, v);
        }
    }
}

TEST(bf16_rounding)
{
    /* Ties to even, in both directions, and the carry into the exponent. */
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x3f808000u)), 0x3f80);
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x3f818000u)), 0x3f82);
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x3f808001u)), 0x3f81);
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x3f807fffu)), 0x3f80);
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x3fffffffu)), 0x4000);
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0xbf818000u)), 0xbf82);
    /* The largest floats round to infinity; infinities stay. */
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x7f7fffffu)), 0x7f80);
    CHECK_EQ_INT(moek_f32_to_bf16(INFINITY), 0x7f80);
    CHECK_EQ_INT(moek_f32_to_bf16(-INFINITY), 0xff80);
    /* A NaN whose payload sits only in the dropped bits stays a NaN. */
    CHECK(isnan(moek_bf16_to_f32(moek_f32_to_bf16(bits_f32(0x7f800001u)))));
    CHECK(isnan(moek_bf16_to_f32(moek_f32_to_bf16(bits_f32(0xff800001u)))));
    CHECK(isnan(moek_bf16_to_f32(moek_f32_to_bf16(NAN))));
    /* Subnormals and signed zero. */
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x00008000u)), 0x0000);
    CHECK_EQ_INT(moek_f32_to_bf16(bits_f32(0x00018000u)), 0x0002);
    CHECK_EQ_INT(moek_f32_to_bf16(-0.0f), 0x8000);

    uint64_t s = test_seed();
    for (int i = 0; i < 2000000; i++) {
        float f = bits_f32((uint32_t)test_rand(&s));
        if (isnan(f))
            continue;
        uint16_t got = moek_f32_to_bf16(f), want = bf16_brute(f);
        CHECK_MSG(got == want, "f32 0x%08x: got 0x%04x want 0x%04x",
                  f32_bits(f), got, want);
    }
}

/* The value of a non-negative finite fp16 encoding, computed from its
 * fields. */
static double fp16_value(uint32_t h)
{
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    return e ? ldexp(1.0 + m / 1024.0, (int)e - 15) : ldexp((double)m, -24);
}

static uint16_t fp16_brute(float f)
{
    uint16_t sign = (f32_bits(f) >> 16) & 0x8000u;
    double a = fabs((double)f);
    if (isinf(f) || a >= 65520.0)
        return sign | 0x7c00u;
    /* Encodings of non-negative finite fp16 values increase with their
     * values; find the last one at or below a. */
    uint32_t lo = 0, hi = 0x7bff;
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        if (fp16_value(mid) <= a)
            lo = mid;
        else
            hi = mid - 1;
    }
    if (lo == 0x7bff)
        return sign | 0x7bffu;
    return (uint16_t)(sign |
                      nearest_even(a, lo, fp16_value(lo), fp16_value(lo + 1)));
}

TEST(fp16_roundtrip_exhaustive)
{
    for (uint32_t v = 0; v < 0x10000u; v++) {
        float f = moek_fp16_to_f32((uint16_t)v);
        uint32_t e = (v >> 10) & 0x1f, m = v & 0x3ff;
        if (e == 31 && m) {
            CHECK(isnan(f));
            uint16_t back = moek_f32_to_fp16(f);
            CHECK_EQ_INT(back & 0x8000u, v & 0x8000u);
            CHECK_EQ_INT(back | 0x0200u, v | 0x0200u);
            continue;
        }
        double want = e == 31 ? INFINITY : fp16_value(v & 0x7fff);
        if (v & 0x8000u)
            want = -want;
        CHECK_MSG((double)f == want && !!signbit(f) == !!(v & 0x8000u),
                  "fp16 0x%04x -> %g, want %g", v, f, want);
        CHECK_EQ_INT(moek_f32_to_fp16(f), v);
    }
}

TEST(fp16_rounding)
{
    CHECK_EQ_INT(moek_f32_to_fp16(ldexpf(1.0f, -24)), 0x0001);
    CHECK_EQ_INT(moek_f32_to_fp16(ldexpf(1.0f, -25)), 0x0000);
    CHECK_EQ_INT(moek_f32_to_fp16(nextafterf(ldexpf(1.0f, -25), 1.0f)),
                 0x0001);
    CHECK_EQ_INT(moek_f32_to_fp16(-ldexpf(1.0f, -25)), 0x8000);
    CHECK_EQ_INT(moek_f32_to_fp16(ldexpf(1.5f, -24)), 0x0002);
    CHECK_EQ_INT(moek_f32_to_fp16(ldexpf(2.5f, -24)), 0x0002);
    CHECK_EQ_INT(moek_f32_to_fp16(ldexpf(1023.5f, -24)), 0x0400);
    CHECK_EQ_INT(moek_f32_to_fp16(ldexpf(1.0f, -14)), 0x0400);
    CHECK_EQ_INT(moek_f32_to_fp16(1.0f + ldexpf(1.0f, -11)), 0x3c00);
    CHECK_EQ_INT(moek_f32_to_fp16(1.0f + 3 * ldexpf(1.0f, -11)), 0x3c02);
    CHECK_EQ_INT(moek_f32_to_fp16(65504.0f), 0x7bff);
    CHECK_EQ_INT(moek_f32_to_fp16(65519.996f), 0x7bff);
    CHECK_EQ_INT(moek_f32_to_fp16(65520.0f), 0x7c00);
    CHECK_EQ_INT(moek_f32_to_fp16(-1e9f), 0xfc00);
    CHECK_EQ_INT(moek_f32_to_fp16(INFINITY), 0x7c00);
    CHECK_EQ_INT(moek_f32_to_fp16(-0.0f), 0x8000);
    CHECK(isnan(moek_fp16_to_f32(moek_f32_to_fp16(NAN))));
    CHECK(isnan(moek_fp16_to_f32(moek_f32_to_fp16(bits_f32(0x7f800001u)))));
    CHECK_EQ_INT(f32_bits(moek_fp16_to_f32(0x7c00)), 0x7f800000u);
    CHECK_EQ_INT(f32_bits(moek_fp16_to_f32(0xfc00)), 0xff800000u);
    CHECK(moek_fp16_to_f32(0x03ff) == ldexpf(1023.0f, -24));

    uint64_t s = test_seed();
    for (int i = 0; i < 300000; i++) {
        /* Exponents around fp16's range, where all the cases live. */
        uint32_t u = (uint32_t)test_rand(&s);
        uint32_t e = 97 + (uint32_t)(test_rand(&s) % 50);
        float f = bits_f32((u & 0x807fffffu) | (e << 23));
        uint16_t got = moek_f32_to_fp16(f), want = fp16_brute(f);
        CHECK_MSG(got == want, "f32 0x%08x: got 0x%04x want 0x%04x",
                  f32_bits(f), got, want);
    }
}

TEST(bulk_conversions_match_scalar)
{
    uint64_t s = test_seed();
    size_t n = 1031;
    uint32_t *bits = xmalloc(n * sizeof(uint32_t));
    for (size_t i = 0; i < n; i++)
        bits[i] = (uint32_t)test_rand(&s);
    float *f = (float *)bits;
    uint16_t *h = xmalloc(n * sizeof(uint16_t));
    float *back = xmalloc(n * sizeof(float));
    for (int d = 0; d < 2; d++) {
        moek_dtype dt = d ? MOEK_DTYPE_FP16 : MOEK_DTYPE_BF16;
        poison(h, n * sizeof(uint16_t));
        moek_from_f32(dt, f, h, n);
        for (size_t i = 0; i < n; i++)
            CHECK_EQ_INT(h[i], d ? moek_f32_to_fp16(f[i])
                                 : moek_f32_to_bf16(f[i]));
        poison(back, n * sizeof(float));
        moek_to_f32(dt, h, back, n);
        for (size_t i = 0; i < n; i++) {
            float want = d ? moek_fp16_to_f32(h[i]) : moek_bf16_to_f32(h[i]);
            CHECK_EQ_INT(f32_bits(back[i]), f32_bits(want));
        }
    }
    poison(back, n * sizeof(float));
    moek_to_f32(MOEK_DTYPE_FP32, f, back, n);
    CHECK(memcmp(back, f, n * sizeof(float)) == 0);
    poison(back, n * sizeof(float));
    moek_from_f32(MOEK_DTYPE_FP32, f, back, n);
    CHECK(memcmp(back, f, n * sizeof(float)) == 0);
    free(bits);
    free(h);
    free(back);
}

TEST(rel_error)
{
    float want[4] = {1, 2, 3, 4}, got[4] = {1, 2, 3, 4};
    CHECK(moek_rel_error(got, want, 4) == 0.0);
    got[3] = 5;
    CHECK(fabs(moek_rel_error(got, want, 4) - 1.0 / sqrt(30.0)) < 1e-12);
    got[3] = NAN;
    CHECK(isinf(moek_rel_error(got, want, 4)));
    got[3] = INFINITY;
    CHECK(isinf(moek_rel_error(got, want, 4)));
    want[3] = NAN;
    got[3] = NAN;
    CHECK(moek_rel_error(got, want, 4) == 0.0);
    CHECK(moek_rel_error(got, want, 0) == 0.0);
}

/* ---- routing ------------------------------------------------------------ */

/* Brute force in double: rank by logit (the scoring functions increase with
 * it, so equal logits are exactly the equal scores), NaN last, lower index
 * first among equals; the softmax is over the logits that are not NaN. */
static void route_brute(const float *l, int E, int k, moek_scoring sc,
                        bool renorm, int32_t *ids, double *w)
{
    int order[64];
    for (int e = 0; e < E; e++)
        order[e] = e;
    for (int i = 1; i < E; i++)
        for (int j = i; j > 0; j--) {
            int a = order[j - 1], b = order[j];
            bool na = isnan(l[a]), nb = isnan(l[b]);
            bool swap = (na && !nb) || (!na && !nb && l[b] > l[a]);
            if (!swap)
                break;
            order[j - 1] = b;
            order[j] = a;
        }
    double max = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++)
        if (l[e] > max)
            max = l[e];
    for (int e = 0; e < E; e++)
        if (!isnan(l[e]))
            sum += exp((double)l[e] - max);
    double chosen = 0;
    for (int j = 0; j < k; j++) {
        int e = order[j];
        ids[j] = e;
        if (isnan(l[e]))
            w[j] = NAN;
        else if (sc == MOEK_SCORING_SIGMOID)
            w[j] = 1.0 / (1.0 + exp(-(double)l[e]));
        else
            w[j] = exp((double)l[e] - max) / sum;
        chosen += w[j];
    }
    if (renorm && chosen != 0)
        for (int j = 0; j < k; j++)
            w[j] /= chosen;
}

TEST(route_against_brute_force)
{
    uint64_t s = test_seed();
    /* Few distinct logits, so ties are common. */
    static const float grid[] = {-2.0f, -1.0f, -0.5f, 0.0f, 0.25f, 1.0f, 3.0f};
    for (int iter = 0; iter < 4000; iter++) {
        int E = 1 + (int)(test_rand(&s) % 12);
        int k = 1 + (int)(test_rand(&s) % (uint64_t)E);
        int T = 1 + (int)(test_rand(&s) % 4);
        moek_scoring sc = (moek_scoring)(test_rand(&s) % 2);
        bool renorm = test_rand(&s) % 2;
        bool with_nan = test_rand(&s) % 4 == 0;
        float l[4 * 12];
        for (int i = 0; i < T * E; i++) {
            l[i] = grid[test_rand(&s) % 7];
            if (with_nan && test_rand(&s) % 5 == 0)
                l[i] = NAN;
        }
        int32_t ids[4 * 12];
        float w[4 * 12];
        poison(ids, sizeof ids);
        poison(w, sizeof w);
        moek_ref_route(l, T, E, k, sc, renorm, ids, w);
        for (int t = 0; t < T; t++) {
            int32_t bids[12];
            double bw[12];
            route_brute(l + t * E, E, k, sc, renorm, bids, bw);
            for (int j = 0; j < k; j++) {
                float got = w[t * k + j];
                CHECK_MSG(ids[t * k + j] == bids[j],
                          "iter %d t %d j %d: id %d want %d", iter, t, j,
                          ids[t * k + j], bids[j]);
                if (isnan(bw[j])) {
                    CHECK(isnan(got));
                } else {
                    CHECK_MSG(fabs(got - bw[j]) <= 4e-6 * fabs(bw[j]) + 1e-7,
                              "iter %d: weight %g want %g", iter, got,
                              bw[j]);
                }
            }
        }
    }
}

TEST(route_edge_cases)
{
    int32_t ids[4];
    float w[4];
    /* Softmax is computed stably: huge logits give finite weights. */
    float big[3] = {1000.0f, 999.0f, -1000.0f};
    moek_ref_route(big, 1, 3, 2, MOEK_SCORING_SOFTMAX, false, ids, w);
    CHECK_EQ_INT(ids[0], 0);
    CHECK_EQ_INT(ids[1], 1);
    CHECK(fabsf(w[0] - 1.0f / (1.0f + expf(-1.0f))) < 1e-6f);
    CHECK(fabsf(w[1] - expf(-1.0f) / (1.0f + expf(-1.0f))) < 1e-6f);
    /* Renormalising sigmoid weights that are all zero leaves them zero. */
    float low[3] = {-1000.0f, -1000.0f, -2000.0f};
    moek_ref_route(low, 1, 3, 2, MOEK_SCORING_SIGMOID, true, ids, w);
    CHECK_EQ_INT(ids[0], 0);
    CHECK_EQ_INT(ids[1], 1);
    CHECK(w[0] == 0.0f && w[1] == 0.0f);
    /* With sigmoid, NaN logits rank last and the numbers keep their
     * order, including -inf. */
    float nan_l[4] = {NAN, -INFINITY, NAN, 0.5f};
    moek_ref_route(nan_l, 1, 4, 3, MOEK_SCORING_SIGMOID, false, ids, w);
    CHECK_EQ_INT(ids[0], 3);
    CHECK_EQ_INT(ids[1], 1);
    CHECK_EQ_INT(ids[2], 0);
    CHECK(w[1] == 0.0f && isnan(w[2]));
    /* With softmax, a NaN logit takes no part: the others still sum to 1. */
    float nan_s[4] = {0.5f, NAN, 0.5f, -0.5f};
    moek_ref_route(nan_s, 1, 4, 4, MOEK_SCORING_SOFTMAX, false, ids, w);
    CHECK(ids[0] == 0 && ids[1] == 2 && ids[2] == 3 && ids[3] == 1);
    CHECK(fabsf(w[0] + w[1] + w[2] - 1.0f) < 1e-6f && isnan(w[3]));
    CHECK(w[0] == w[1]);
    float all_nan[2] = {NAN, NAN};
    moek_ref_route(all_nan, 1, 2, 1, MOEK_SCORING_SOFTMAX, true, ids, w);
    CHECK(ids[0] == 0 && isnan(w[0]));
    /* Renormalised top-k weights sum to one. */
    float l[4] = {0.1f, 0.7f, -0.3f, 0.4f};
    moek_ref_route(l, 1, 4, 3, MOEK_SCORING_SOFTMAX, true, ids, w);
    CHECK(fabsf(w[0] + w[1] + w[2] - 1.0f) < 1e-6f);
    CHECK(ids[0] == 1 && ids[1] == 3 && ids[2] == 0);
}

/* ---- reference MoE against brute force ------------------------------- */

TEST(ref_moe_against_double)
{
    uint64_t s = test_seed();
    int E = 5, k = 2, H = 19, I = 23, T = 7;
    moek_moe_shape sh = {E, k, H, I};
    size_t nw = (size_t)E * H * I;
    float *w1 = rand_tensor(&s, MOEK_DTYPE_FP32, nw, 0.5f);
    float *w3 = rand_tensor(&s, MOEK_DTYPE_FP32, nw, 0.5f);
    float *w2 = rand_tensor(&s, MOEK_DTYPE_FP32, nw, 0.5f);
    float *x = rand_tensor(&s, MOEK_DTYPE_FP32, (size_t)T * H, 1.0f);
    int32_t ids[7 * 2];
    float rw[7 * 2];
    rand_routing(&s, T, E, k, ids, rw);
    float out[7 * 19];
    poison(out, sizeof out);
    CHECK_EQ_INT(moek_ref_fused_moe(&sh, MOEK_DTYPE_FP32, x, ids, rw, w1, w3,
                                    w2, T, out),
                 0);
    float want[7 * 19];
    for (int t = 0; t < T; t++) {
        double acc[19] = {0};
        for (int j = 0; j < k; j++) {
            int e = ids[t * k + j];
            double a[23];
            for (int i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int h = 0; h < H; h++) {
                    g += (double)w1[((size_t)e * I + i) * H + h] * x[t * H + h];
                    u += (double)w3[((size_t)e * I + i) * H + h] * x[t * H + h];
                }
                a[i] = g / (1.0 + exp(-g)) * u;
            }
            for (int h = 0; h < H; h++) {
                double d = 0;
                for (int i = 0; i < I; i++)
                    d += (double)w2[((size_t)e * H + h) * I + i] * a[i];
                acc[h] += rw[t * k + j] * d;
            }
        }
        for (int h = 0; h < H; h++)
            want[t * H + h] = (float)acc[h];
    }
    double err = moek_rel_error(out, want, (size_t)T * H);
    CHECK_MSG(err < 1e-5, "rel error %g", err);
    free(w1);
    free(w3);
    free(w2);
    free(x);
}

TEST(ref_gemm_against_double)
{
    uint64_t s = test_seed();
    int G = 3, N = 11, K = 13;
    int64_t m[3] = {2, 0, 4};
    float *a = rand_tensor(&s, MOEK_DTYPE_FP32, 6 * (size_t)K, 1.0f);
    float *b = rand_tensor(&s, MOEK_DTYPE_FP32, (size_t)G * N * K, 1.0f);
    float c[6 * 11], want[6 * 11];
    poison(c, sizeof c);
    CHECK_EQ_INT(moek_ref_grouped_gemm(MOEK_DTYPE_FP32, G, N, K, a, m, b, c), 0);
    int row = 0;
    for (int g = 0; g < G; g++)
        for (int r = 0; r < m[g]; r++, row++)
            for (int n = 0; n < N; n++) {
                double d = 0;
                for (int kk = 0; kk < K; kk++)
                    d += (double)a[row * K + kk] * b[((size_t)g * N + n) * K + kk];
                want[row * N + n] = (float)d;
            }
    CHECK(moek_rel_error(c, want, 6 * 11) < 1e-6);
    free(a);
    free(b);
}

/* ---- fast path against the reference ---------------------------------- */

/* One comparison of moek_cpu_fused_moe against moek_ref_fused_moe. */
static void moe_case(moek_cpu_pool *pool, uint64_t *s, struct layer *l,
                     int T)
{
    moek_dtype dt = l->dt;
    size_t es = moek_dtype_size(dt), n = (size_t)T * l->shape.hidden;
    int k = l->shape.topk;
    void *x = rand_tensor(s, dt, n, 1.0f);
    int32_t *ids = xmalloc((size_t)T * k * sizeof(int32_t));
    float *w = xmalloc((size_t)T * k * sizeof(float));
    if (T > 0)
        rand_routing(s, T, l->shape.experts, k, ids, w);
    void *got = xmalloc(n * es), *want = xmalloc(n * es);
    poison(got, n * es);
    poison(want, n * es);
    CHECK_EQ_INT(moek_cpu_fused_moe(pool, l->packed, x, ids, w, T, got), 0);
    CHECK_EQ_INT(moek_ref_fused_moe(&l->shape, dt, x, ids, w, l->w1, l->w3,
                                    l->w2, T, want),
                 0);
    float *g = to_f32_copy(dt, got, n), *r = to_f32_copy(dt, want, n);
    double err = moek_rel_error(g, r, n);
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(!isnan(r[i]), "reference left element %zu unwritten", i);
    CHECK_MSG(err <= dtype_tol(dt), "%s E=%d k=%d H=%d I=%d T=%d: %g",
              dtype_name(dt), l->shape.experts, k, l->shape.hidden,
              l->shape.intermediate, T, err);
    free(x);
    free(ids);
    free(w);
    free(got);
    free(want);
    free(g);
    free(r);
}

TEST(fused_moe_matches_reference)
{
    uint64_t s = test_seed();
    moek_cpu_pool *pool = moek_cpu_pool_new(2);
    CHECK(pool != NULL);
    static const int topks[] = {1, 2, 8}, experts[] = {8, 128};
    static const int tokens[] = {0, 1, 3, 64};
    for (int d = 0; d < 3; d++)
        for (int ei = 0; ei < 2; ei++)
            for (int ki = 0; ki < 3; ki++) {
                struct layer l;
                /* H and I not multiples of the panel width or tile. */
                layer_init(&l, &s, (moek_dtype)d, experts[ei], topks[ki], 72,
                           100);
                for (int ti = 0; ti < 4; ti++)
                    moe_case(pool, &s, &l, tokens[ti]);
                layer_done(&l);
            }
    moek_cpu_pool_free(pool);
}

/*
 * An id of -1 is an empty slot (a shard of a layer spread over devices): it
 * contributes nothing, exactly as the same slot with a routing weight of 0,
 * in the fast kernel and the reference; a token whose slots are all empty
 * gets zeros. A shard's top-k may exceed its experts.
 */
TEST(fused_moe_empty_slots)
{
    uint64_t s = test_seed();
    moek_cpu_pool *pool = moek_cpu_pool_new(2);
    CHECK(pool != NULL);
    for (int d = 0; d < 3; d++) {
        struct layer l;
        layer_init(&l, &s, (moek_dtype)d, 3, 4, 40, 56); /* k = 4 > E = 3 */
        const int T = 9, k = 4;
        size_t es = moek_dtype_size(l.dt), n = (size_t)T * 40;
        void *x = rand_tensor(&s, l.dt, n, 1.0f);
        int32_t ids[36], zid[36];
        float w[36], zw[36];
        for (int i = 0; i < T * k; i++) {
            ids[i] = (int32_t)(test_rand(&s) % 4) - 1; /* -1, 0, 1, 2 */
            if (i / k == 4)
                ids[i] = -1; /* token 4: every slot empty */
            w[i] = test_randf(&s) + 1.5f;
            zid[i] = ids[i] < 0 ? (int32_t)(i % 3) : ids[i];
            zw[i] = ids[i] < 0 ? 0.0f : w[i];
        }
        void *got = xmalloc(n * es), *ref = xmalloc(n * es), *zero = xmalloc(n * es);
        poison(got, n * es);
        poison(ref, n * es);
        poison(zero, n * es);
        CHECK_EQ_INT(moek_cpu_fused_moe(pool, l.packed, x, ids, w, T, got), 0);
        CHECK_EQ_INT(moek_ref_fused_moe(&l.shape, l.dt, x, ids, w, l.w1, l.w3, l.w2, T, ref), 0);
        CHECK_EQ_INT(moek_cpu_fused_moe(pool, l.packed, x, zid, zw, T, zero), 0);
        float *g = to_f32_copy(l.dt, got, n), *r = to_f32_copy(l.dt, ref, n),
              *z = to_f32_copy(l.dt, zero, n);
        CHECK_MSG(moek_rel_error(g, r, n) <= dtype_tol(l.dt), "%s: against the reference: %g",
                  dtype_name(l.dt), moek_rel_error(g, r, n));
        for (size_t i = 0; i < n; i++) {
            CHECK_MSG(g[i] == z[i], "%s element %zu: %g with empty slots, %g with weight 0",
                      dtype_name(l.dt), i, g[i], z[i]);
            if (i / 40 == 4)
                CHECK_MSG(g[i] == 0.0f && r[i] == 0.0f, "token 4 (all empty): %g, %g", g[i],
                          r[i]);
        }
        free(g);
        free(r);
        free(z);
        free(x);
        free(got);
        free(ref);
        free(zero);
        layer_done(&l);
    }
    moek_cpu_pool_free(pool);
}

TEST(fused_moe_check_size)
{
    /* The size `moectl --check` uses, with uneven thread counts. */
    uint64_t s = test_seed();
    for (int d = 0; d < 3; d++) {
        moek_cpu_pool *pool = moek_cpu_pool_new(d + 1);
        CHECK(pool != NULL);
        struct layer l;
        layer_init(&l, &s, (moek_dtype)d, 8, 2, 256, 512);
        moe_case(pool, &s, &l, 16);
        moe_case(pool, &s, &l, 5);
        layer_done(&l);
        moek_cpu_pool_free(pool);
    }
}

/* The activation silu(W1 x) * (W3 x) is rounded to the layer's dtype (as
 * the CUDA GEMMs store it): in fp16 a value past 65504 is inf on the
 * reference and the CPU backend alike, and in bf16 the output matches the
 * rounded activation's. x = 16, W1 = W3 = 32 over H = 8: each activation
 * is silu(4096) * 4096 = 2^24; W2 = 2^-13 over I = 8 brings it to 2^14. */
TEST(fused_moe_rounds_the_activation_to_the_dtype)
{
    const moek_moe_shape sh = {1, 1, 8, 8};
    moek_cpu_pool *pool = moek_cpu_pool_new(1);
    for (int d = 0; d < 2; d++) {
        const moek_dtype dt = d ? MOEK_DTYPE_BF16 : MOEK_DTYPE_FP16;
        float xf[8], w13f[64], w2f[64];
        for (int i = 0; i < 8; i++)
            xf[i] = 16.0f;
        for (int i = 0; i < 64; i++) {
            w13f[i] = 32.0f;
            w2f[i] = 1.0f / 8192.0f;
        }
        uint16_t x[8], w13[64], w2[64], want[8], got[8];
        moek_from_f32(dt, xf, x, 8);
        moek_from_f32(dt, w13f, w13, 64);
        moek_from_f32(dt, w2f, w2, 64);
        const int32_t ids[1] = {0};
        const float wts[1] = {1.0f};
        CHECK_EQ_INT(moek_ref_fused_moe(&sh, dt, x, ids, wts, w13, w13, w2, 1, want), 0);
        moek_cpu_moe_weights *cw = NULL;
        CHECK_EQ_INT(moek_cpu_moe_weights_new(&sh, dt, w13, w13, w2, &cw), 0);
        CHECK_EQ_INT(moek_cpu_fused_moe(pool, cw, x, ids, wts, 1, got), 0);
        moek_cpu_moe_weights_free(cw);
        float wf[8], gf[8];
        moek_to_f32(dt, want, wf, 8);
        moek_to_f32(dt, got, gf, 8);
        for (int h = 0; h < 8; h++) {
            if (dt == MOEK_DTYPE_FP16) {
                CHECK_MSG(isinf(wf[h]) && isinf(gf[h]), "fp16: reference %g, CPU %g", wf[h],
                          gf[h]);
            } else {
                CHECK_MSG(wf[h] == 16384.0f && gf[h] == 16384.0f, "bf16: reference %g, CPU %g",
                          wf[h], gf[h]);
            }
        }
    }
    moek_cpu_pool_free(pool);
}

TEST(fused_moe_rejects_bad_ids)
{
    uint64_t s = test_seed();
    struct layer l;
    layer_init(&l, &s, MOEK_DTYPE_BF16, 8, 2, 16, 24);
    int T = 5, k = 2;
    size_t bytes = (size_t)T * 16 * 2;
    void *x = rand_tensor(&s, MOEK_DTYPE_BF16, (size_t)T * 16, 1.0f);
    int32_t ids[10];
    float w[10];
    rand_routing(&s, T, 8, k, ids, w);
    char *out = xmalloc(bytes), *copy = xmalloc(bytes);
    moek_cpu_pool *pool = moek_cpu_pool_new(2);
    static const int32_t bad[] = {-2, 8, INT32_MIN, INT32_MAX}; /* -1: an empty slot */
    for (int b = 0; b < 4; b++) {
        int32_t save = ids[T * k - 1];
        ids[T * k - 1] = bad[b]; /* the last slot: checked before any work */
        for (size_t i = 0; i < bytes; i++)
            out[i] = (char)test_rand(&s);
        memcpy(copy, out, bytes);
        CHECK_EQ_INT(moek_cpu_fused_moe(pool, l.packed, x, ids, w, T, out),
                     -EINVAL);
        CHECK(memcmp(out, copy, bytes) == 0);
        CHECK_EQ_INT(moek_ref_fused_moe(&l.shape, l.dt, x, ids, w, l.w1, l.w3,
                                        l.w2, T, out),
                     -EINVAL);
        CHECK(memcmp(out, copy, bytes) == 0);
        ids[T * k - 1] = save;
    }
    /* Other bad arguments. */
    CHECK_EQ_INT(moek_cpu_fused_moe(pool, l.packed, x, ids, w, -1, out),
                 -EINVAL);
    CHECK_EQ_INT(moek_cpu_fused_moe(pool, NULL, x, ids, w, T, out), -EINVAL);
    CHECK_EQ_INT(moek_cpu_fused_moe(pool, l.packed, x, ids, w, T, NULL),
                 -EINVAL);
    CHECK_EQ_INT(moek_ref_fused_moe(&l.shape, l.dt, x, ids, w, l.w1, l.w3,
                                    l.w2, -1, out),
                 -EINVAL);
    /* Zero tokens is a valid, empty call. */
    CHECK_EQ_INT(moek_cpu_fused_moe(pool, l.packed, NULL, NULL, NULL, 0, NULL),
                 0);
    CHECK(memcmp(out, copy, bytes) == 0);

    moek_moe_shape bad_shapes[] = {
        {0, 1, 16, 24}, {8, 0, 16, 24}, {8, -3, 16, 24}, {8, 2, 0, 24},
        {8, 2, 16, -1}};
    moek_cpu_moe_weights *pw = (moek_cpu_moe_weights *)&s;
    for (int i = 0; i < 5; i++) {
        CHECK_EQ_INT(moek_cpu_moe_weights_new(&bad_shapes[i], l.dt, l.w1,
                                              l.w3, l.w2, &pw),
                     -EINVAL);
        CHECK(pw == NULL);
    }
    CHECK_EQ_INT(moek_cpu_moe_weights_new(&l.shape, (moek_dtype)9, l.w1, l.w3,
                                          l.w2, &pw),
                 -EINVAL);
    moek_cpu_moe_weights_free(NULL);
    moek_cpu_pool_free(pool);
    free(x);
    free(out);
    free(copy);
    layer_done(&l);
}

/* ---- bit-identical per token ------------------------------------------ */

/*
 * Runs tokens sel[0..n) of (x, ids, w) as one call and checks each output row
 * is bit for bit the row of the same token in full (the batch result).
 */
static void check_subset(moek_cpu_pool *pool, const struct layer *l,
                         const void *x, const int32_t *ids, const float *w,
                         const int *sel, int n, const void *full)
{
    int k = l->shape.topk, H = l->shape.hidden;
    size_t es = moek_dtype_size(l->dt), row = (size_t)H * es;
    char *sx = xmalloc((size_t)n * row), *out = xmalloc((size_t)n * row);
    int32_t *sids = xmalloc((size_t)n * k * sizeof(int32_t));
    float *sw = xmalloc((size_t)n * k * sizeof(float));
    for (int i = 0; i < n; i++) {
        memcpy(sx + (size_t)i * row, (const char *)x + (size_t)sel[i] * row,
               row);
        memcpy(sids + (size_t)i * k, ids + (size_t)sel[i] * k,
               (size_t)k * sizeof(int32_t));
        memcpy(sw + (size_t)i * k, w + (size_t)sel[i] * k,
               (size_t)k * sizeof(float));
    }
    poison(out, (size_t)n * row);
    CHECK_EQ_INT(moek_cpu_fused_moe(pool, l->packed, sx, sids, sw, n, out), 0);
    for (int i = 0; i < n; i++)
        CHECK_MSG(memcmp(out + (size_t)i * row,
                         (const char *)full + (size_t)sel[i] * row, row) == 0,
                  "%s: token %d differs when run with %d tokens on %d "
                  "threads",
                  dtype_name(l->dt), sel[i], n, moek_cpu_pool_threads(pool));
    free(sx);
    free(out);
    free(sids);
    free(sw);
}

TEST(fused_moe_bit_identical_per_token)
{
    uint64_t s = test_seed();
    moek_cpu_pool *pools[3] = {moek_cpu_pool_new(1), moek_cpu_pool_new(2),
                               moek_cpu_pool_new(3)};
    CHECK(pools[0] && pools[1] && pools[2]);
    /* Hidden and intermediate sizes whose panel counts (size / 8) leave
     * every remainder modulo the kernel's panel groups (1, 2, 3, 6), so that
     * every kernel shape is used. */
    static const int dims[5][2] = {
        {136, 200}, {64, 112}, {80, 36}, {56, 24}, {24, 72}};
    for (int d = 0; d < 3; d++)
        for (int di = 0; di < 5; di++) {
            struct layer l;
            int T = 45, k = 3, E = 6, H = dims[di][0];
            /* Few experts, so expert row counts change a lot between
             * subsets. */
            layer_init(&l, &s, (moek_dtype)d, E, k, H, dims[di][1]);
            size_t row = (size_t)H * moek_dtype_size(l.dt);
            void *x = rand_tensor(&s, l.dt, (size_t)T * H, 1.0f);
            int32_t *ids = xmalloc((size_t)T * k * sizeof(int32_t));
            float *w = xmalloc((size_t)T * k * sizeof(float));
            rand_routing(&s, T, E, k, ids, w);
            /* One token routed to the same expert twice, a zero weight and
             * a negative one: still per-token arithmetic. */
            ids[1] = ids[0];
            w[4] = 0.0f;
            w[5] = -w[5];
            void *full = xmalloc((size_t)T * row);
            poison(full, (size_t)T * row);
            CHECK_EQ_INT(moek_cpu_fused_moe(pools[1], l.packed, x, ids, w, T,
                                            full),
                         0);

            int sel[45];
            for (int t = 0; t < T; t++) {
                sel[0] = t;
                check_subset(pools[t % 3], &l, x, ids, w, sel, 1, full);
            }
            for (int iter = 0; iter < 12; iter++) {
                /* A random permutation, then a random-length prefix. */
                for (int t = 0; t < T; t++)
                    sel[t] = t;
                for (int t = T - 1; t > 0; t--) {
                    int j = (int)(test_rand(&s) % (uint64_t)(t + 1));
                    int tmp = sel[t];
                    sel[t] = sel[j];
                    sel[j] = tmp;
                }
                int n = iter == 0 ? T : 1 + (int)(test_rand(&s) % (uint64_t)T);
                check_subset(pools[iter % 3], &l, x, ids, w, sel, n, full);
            }
            /* A batch holding the same token many times. */
            for (int t = 0; t < 20; t++)
                sel[t] = 7;
            check_subset(pools[2], &l, x, ids, w, sel, 20, full);
            /* No pool at all: the calling thread alone. */
            for (int t = 0; t < T; t++)
                sel[t] = T - 1 - t;
            check_subset(NULL, &l, x, ids, w, sel, T, full);

            free(x);
            free(ids);
            free(w);
            free(full);
            layer_done(&l);
        }
    for (int i = 0; i < 3; i++)
        moek_cpu_pool_free(pools[i]);
}

/* ---- grouped GEMM ------------------------------------------------------ */

static void gemm_case(moek_cpu_pool *pool, uint64_t *s, moek_dtype dt, int G,
                      int N, int K, const int64_t *m)
{
    size_t es = moek_dtype_size(dt), M = 0;
    for (int g = 0; g < G; g++)
        M += (size_t)m[g];
    void *a = rand_tensor(s, dt, M * K, 1.0f);
    void *b = rand_tensor(s, dt, (size_t)G * N * K, 1.0f);
    moek_cpu_gemm_weights *w = NULL;
    CHECK_EQ_INT(moek_cpu_gemm_weights_new(dt, G, N, K, b, &w), 0);
    void *got = xmalloc(M * N * es), *want = xmalloc(M * N * es);
    poison(got, M * N * es);
    poison(want, M * N * es);
    CHECK_EQ_INT(moek_cpu_grouped_gemm(pool, w, a, m, got), 0);
    CHECK_EQ_INT(moek_ref_grouped_gemm(dt, G, N, K, a, m, b, want), 0);
    float *g = to_f32_copy(dt, got, M * N), *r = to_f32_copy(dt, want, M * N);
    for (size_t i = 0; i < M * N; i++)
        CHECK(!isnan(r[i]) && !isnan(g[i]));
    double err = moek_rel_error(g, r, M * N);
    CHECK_MSG(err <= dtype_tol(dt), "%s G=%d N=%d K=%d: %g", dtype_name(dt),
              G, N, K, err);

    /* Rows do not depend on the others: group g's rows alone, as a call
     * where every other group is empty, give the same bits. */
    size_t row0 = 0;
    int64_t *m1 = xmalloc((size_t)G * sizeof(int64_t));
    for (int gi = 0; gi < G; gi++) {
        if (m[gi] == 0)
            continue;
        memset(m1, 0, (size_t)G * sizeof(int64_t));
        m1[gi] = 1;
        size_t pick = row0 + (size_t)(test_rand(s) % (uint64_t)m[gi]);
        char one[1024 * 4];
        CHECK((size_t)N * es <= sizeof one);
        poison(one, sizeof one);
        CHECK_EQ_INT(moek_cpu_grouped_gemm(NULL, w,
                                           (const char *)a + pick * K * es, m1,
                                           one),
                     0);
        CHECK(memcmp(one, (char *)got + pick * N * es, (size_t)N * es) == 0);
        row0 += (size_t)m[gi];
    }
    free(m1);
    moek_cpu_gemm_weights_free(w);
    free(a);
    free(b);
    free(got);
    free(want);
    free(g);
    free(r);
}

TEST(grouped_gemm_matches_reference)
{
    uint64_t s = test_seed();
    moek_cpu_pool *pool = moek_cpu_pool_new(2);
    CHECK(pool != NULL);
    int64_t m1[5] = {3, 0, 17, 0, 1};
    int64_t m2[4] = {0, 0, 64, 0};
    int64_t m3[1] = {130};
    int64_t m4[3] = {0, 0, 0};
    for (int d = 0; d < 3; d++) {
        gemm_case(pool, &s, (moek_dtype)d, 5, 50, 70, m1);
        gemm_case(pool, &s, (moek_dtype)d, 4, 8, 256, m2);
        gemm_case(pool, &s, (moek_dtype)d, 1, 300, 33, m3);
        gemm_case(pool, &s, (moek_dtype)d, 3, 20, 20, m4);
        gemm_case(pool, &s, (moek_dtype)d, 5, 1, 3, m1);
    }
    moek_cpu_pool_free(pool);
}

TEST(grouped_gemm_edge_cases)
{
    uint64_t s = test_seed();
    int G = 3, N = 9, K = 5;
    float *a = rand_tensor(&s, MOEK_DTYPE_FP32, 10 * (size_t)K, 1.0f);
    float *b = rand_tensor(&s, MOEK_DTYPE_FP32, (size_t)G * N * K, 1.0f);
    moek_cpu_gemm_weights *w = NULL;
    CHECK_EQ_INT(moek_cpu_gemm_weights_new(MOEK_DTYPE_FP32, G, N, K, b, &w),
                 0);
    float c[10 * 9], copy[10 * 9];
    for (int i = 0; i < 90; i++)
        c[i] = test_randf(&s);
    memcpy(copy, c, sizeof c);
    int64_t neg[3] = {4, -1, 6};
    CHECK_EQ_INT(moek_cpu_grouped_gemm(NULL, w, a, neg, c), -EINVAL);
    CHECK_EQ_INT(moek_ref_grouped_gemm(MOEK_DTYPE_FP32, G, N, K, a, neg, b, c),
                 -EINVAL);
    int64_t huge[3] = {INT64_MAX, INT64_MAX, 1};
    CHECK_EQ_INT(moek_cpu_grouped_gemm(NULL, w, a, huge, c), -EINVAL);
    CHECK_EQ_INT(moek_ref_grouped_gemm(MOEK_DTYPE_FP32, G, N, K, a, huge, b, c),
                 -EINVAL);
    CHECK(memcmp(c, copy, sizeof c) == 0);
    CHECK_EQ_INT(moek_cpu_gemm_weights_new(MOEK_DTYPE_FP32, -1, N, K, b, &w),
                 -EINVAL);
    CHECK(w == NULL);
    CHECK_EQ_INT(moek_cpu_gemm_weights_new(MOEK_DTYPE_FP32, G, N, -2, b, &w),
                 -EINVAL);
    moek_cpu_gemm_weights_free(NULL);

    /* K = 0: every product is an empty sum. */
    CHECK_EQ_INT(moek_cpu_gemm_weights_new(MOEK_DTYPE_FP32, 2, 4, 0, b, &w), 0);
    int64_t m[2] = {1, 2};
    float z[12];
    poison(z, sizeof z);
    CHECK_EQ_INT(moek_cpu_grouped_gemm(NULL, w, a, m, z), 0);
    for (int i = 0; i < 12; i++)
        CHECK(z[i] == 0.0f);
    moek_cpu_gemm_weights_free(w);
    free(a);
    free(b);
}

/* ---- thread pool -------------------------------------------------------- */

struct pool_count {
    atomic_int *hits;
    atomic_int calls;
};

static void pool_count_item(void *ctx, int item)
{
    struct pool_count *c = ctx;
    atomic_fetch_add(&c->hits[item], 1);
    atomic_fetch_add(&c->calls, 1);
}

TEST(pool_runs_each_item_once)
{
    static atomic_int hits[1000];
    for (int threads = -1; threads <= 4; threads++) {
        moek_cpu_pool *pool = moek_cpu_pool_new(threads);
        CHECK(pool != NULL);
        if (threads > 0)
            CHECK_EQ_INT(moek_cpu_pool_threads(pool), threads);
        else
            CHECK_EQ_INT(moek_cpu_pool_threads(pool),
                         sysconf(_SC_NPROCESSORS_ONLN));
        for (int round = 0; round < 200; round++) {
            int n = round % 7 == 0 ? 0 : (round * 37) % 1000;
            struct pool_count c = {hits, 0};
            for (int i = 0; i < n; i++)
                atomic_store(&hits[i], 0);
            moek_cpu_pool_run(pool, n, pool_count_item, &c);
            CHECK_EQ_INT(atomic_load(&c.calls), n);
            for (int i = 0; i < n; i++)
                CHECK_EQ_INT(atomic_load(&hits[i]), 1);
        }
        moek_cpu_pool_free(pool);
    }
    struct pool_count c = {hits, 0};
    for (int i = 0; i < 10; i++)
        atomic_store(&hits[i], 0);
    moek_cpu_pool_run(NULL, 10, pool_count_item, &c);
    CHECK_EQ_INT(atomic_load(&c.calls), 10);
    CHECK_EQ_INT(moek_cpu_pool_threads(NULL), 1);
    moek_cpu_pool_free(NULL);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(dtype_sizes),
        TEST_CASE(bf16_roundtrip_exhaustive),
        TEST_CASE(bf16_rounding),
        TEST_CASE(fp16_roundtrip_exhaustive),
        TEST_CASE(fp16_rounding),
        TEST_CASE(bulk_conversions_match_scalar),
        TEST_CASE(rel_error),
        TEST_CASE(route_against_brute_force),
        TEST_CASE(route_edge_cases),
        TEST_CASE(ref_moe_against_double),
        TEST_CASE(ref_gemm_against_double),
        TEST_CASE(fused_moe_matches_reference),
        TEST_CASE(fused_moe_check_size),
        TEST_CASE(fused_moe_empty_slots),
        TEST_CASE(fused_moe_rounds_the_activation_to_the_dtype),
        TEST_CASE(fused_moe_rejects_bad_ids),
        TEST_CASE(fused_moe_bit_identical_per_token),
        TEST_CASE(grouped_gemm_matches_reference),
        TEST_CASE(grouped_gemm_edge_cases),
        TEST_CASE(pool_runs_each_item_once),
        {0}});
}
