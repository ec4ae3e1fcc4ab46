/*
 * ref.c: the portable reference kernels, the definition every fast path
 * (moek_cpu_*, moek_cuda_*) is checked against, and the error measure those
 * checks use.
 *
 * The code favours plain loops over speed, with two concessions so that
 * `moectl --check` and the tests stay quick: weights are converted to fp32 one
 * row at a time and each row is used for every token routed to that expert,
 * and dot products keep eight partial sums so they need not run at the
 * latency of one floating-point add.
 */
#include "moe_kernels.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Sums in eight fixed lanes, then lanes pairwise; fp32 throughout. */
static float ref_dot(const float *a, const float *b, size_t n)
{
    float lane[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (size_t l = 0; l < 8; l++)
            lane[l] += a[i + l] * b[i + l];
    for (; i < n; i++)
        lane[i % 8] += a[i] * b[i];
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
           ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

static float ref_silu(float v)
{
    return v / (1.0f + expf(-v));
}

/* a * b into *out; false on size_t overflow. */
static bool ref_size_mul(size_t a, size_t b, size_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* The score of expert e for one token; see moek_ref_route. */
static float ref_score(const float *logits, int e, moek_scoring scoring,
                       float max, float sum)
{
    if (scoring == MOEK_SCORING_SIGMOID)
        return 1.0f / (1.0f + expf(-logits[e]));
    return expf(logits[e] - max) / sum;
}

/* True if expert a ranks before expert b: the larger score first, a NaN
 * after every number, and the lower index first among equals. */
static bool ref_ranks_before(float sa, int a, float sb, int b)
{
    bool na = isnan(sa), nb = isnan(sb);
    if (na != nb)
        return nb;
    if (!na && sa != sb)
        return sa > sb;
    return a < b;
}

/*
 * Experts are ranked by their score, the value the scoring function gives
 * (softmax or sigmoid), which is also the weight reported. A NaN logit has a
 * NaN score, so it ranks after every number; the softmax leaves NaN logits
 * out of its max and its sum, so the other experts keep a proper distribution
 * (the CUDA router does the same). Each pick is the best expert ranked
 * strictly after the previous pick, which needs no scratch memory.
 */
void moek_ref_route(const float *logits, int tokens, int experts, int topk,
                    moek_scoring scoring, bool renormalize, int32_t *ids,
                    float *weights)
{
    if (tokens <= 0 || experts <= 0 || topk <= 0 || topk > experts)
        return;
    for (int t = 0; t < tokens; t++) {
        const float *l = logits + (size_t)t * (size_t)experts;
        int32_t *tid = ids + (size_t)t * (size_t)topk;
        float *tw = weights + (size_t)t * (size_t)topk;
        float max = -INFINITY, sum = 0.0f;

        if (scoring == MOEK_SCORING_SOFTMAX) {
            for (int e = 0; e < experts; e++)
                max = fmaxf(max, l[e]); /* fmaxf skips a NaN */
            for (int e = 0; e < experts; e++)
                if (!isnan(l[e]))
                    sum += expf(l[e] - max);
        }
        int prev = -1;
        float prev_s = 0.0f;
        for (int j = 0; j < topk; j++) {
            int best = -1;
            float best_s = 0.0f;
            for (int e = 0; e < experts; e++) {
                float s = ref_score(l, e, scoring, max, sum);
                if (prev >= 0 && !ref_ranks_before(prev_s, prev, s, e))
                    continue;
                if (best < 0 || ref_ranks_before(s, e, best_s, best)) {
                    best = e;
                    best_s = s;
                }
            }
            tid[j] = best;
            tw[j] = best_s;
            prev = best;
            prev_s = best_s;
        }
        if (renormalize) {
            float chosen = 0.0f;
            for (int j = 0; j < topk; j++)
                chosen += tw[j];
            if (chosen != 0.0f)
                for (int j = 0; j < topk; j++)
                    tw[j] /= chosen;
        }
    }
}

static bool ref_shape_ok(const moek_moe_shape *s)
{
    /* top-k may exceed E in a shard of a spread layer (empty slots). */
    return s && s->experts > 0 && s->topk > 0 && s->hidden > 0 && s->intermediate > 0;
}

/*
 * Expert by expert: convert each weight row once and apply it to every token
 * slot (t, j) routed to the expert, keeping each slot's down projection y;
 * then out[t] = sum over j = 0..k-1 of w[t][j] * y[t][j], in that order.
 */
int moek_ref_fused_moe(const moek_moe_shape *shape, moek_dtype dt,
                       const void *x, const int32_t *ids, const float *weights,
                       const void *w1, const void *w3, const void *w2,
                       int tokens, void *out)
{
    size_t es = moek_dtype_size(dt);
    if (!ref_shape_ok(shape) || es == 0 || tokens < 0)
        return -EINVAL;
    if (tokens == 0)
        return 0;
    if (!x || !ids || !weights || !w1 || !w3 || !w2 || !out)
        return -EINVAL;

    size_t E = (size_t)shape->experts, k = (size_t)shape->topk;
    size_t H = (size_t)shape->hidden, I = (size_t)shape->intermediate;
    size_t T = (size_t)tokens, slots, xs_n, act_n, y_n, mat;
    if (!ref_size_mul(T, k, &slots) || !ref_size_mul(T, H, &xs_n) ||
        !ref_size_mul(slots, I, &act_n) || !ref_size_mul(slots, H, &y_n) ||
        !ref_size_mul(H, I, &mat))
        return -EINVAL;
    for (size_t s = 0; s < slots; s++)
        if (ids[s] < -1 || (ids[s] >= 0 && (size_t)ids[s] >= E))
            return -EINVAL;

    float *xf = malloc(xs_n * sizeof(float));
    float *act = malloc(act_n * sizeof(float));
    float *y = malloc(y_n * sizeof(float));
    float *row1 = malloc((H > I ? H : I) * sizeof(float));
    float *row3 = malloc(H * sizeof(float));
    size_t *list = malloc(slots * sizeof(size_t));
    int rc = -ENOMEM;
    if (!xf || !act || !y || !row1 || !row3 || !list)
        goto done;

    moek_to_f32(dt, x, xf, xs_n);
    for (size_t e = 0; e < E; e++) {
        size_t n = 0;
        for (size_t s = 0; s < slots; s++)
            if ((size_t)ids[s] == e)
                list[n++] = s;
        if (n == 0)
            continue;
        const char *g = (const char *)w1 + e * mat * es;
        const char *u = (const char *)w3 + e * mat * es;
        const char *d = (const char *)w2 + e * mat * es;
        for (size_t i = 0; i < I; i++) {
            moek_to_f32(dt, g + i * H * es, row1, H);
            moek_to_f32(dt, u + i * H * es, row3, H);
            for (size_t q = 0; q < n; q++) {
                const float *xt = xf + list[q] / k * H;
                float gv = ref_dot(row1, xt, H), uv = ref_dot(row3, xt, H);
                act[list[q] * I + i] = moek_round(dt, ref_silu(gv) * uv);
            }
        }
        for (size_t h = 0; h < H; h++) {
            moek_to_f32(dt, d + h * I * es, row1, I);
            for (size_t q = 0; q < n; q++)
                y[list[q] * H + h] = ref_dot(row1, act + list[q] * I, I);
        }
    }
    for (size_t t = 0; t < T; t++) {
        float *o = xf + t * H; /* x is no longer needed; reuse its row. */
        for (size_t h = 0; h < H; h++)
            o[h] = 0.0f;
        for (size_t j = 0; j < k; j++) {
            if (ids[t * k + j] < 0)
                continue; /* an empty slot */
            float wj = weights[t * k + j];
            const float *yj = y + (t * k + j) * H;
            for (size_t h = 0; h < H; h++)
                o[h] += wj * yj[h];
        }
    }
    moek_from_f32(dt, xf, out, xs_n);
    rc = 0;
done:
    free(xf);
    free(act);
    free(y);
    free(row1);
    free(row3);
    free(list);
    return rc;
}

int moek_ref_grouped_gemm(moek_dtype dt, int groups, int n, int k,
                          const void *a, const int64_t *m_sizes, const void *b,
                          void *c)
{
    size_t es = moek_dtype_size(dt);
    if (es == 0 || groups < 0 || n < 0 || k < 0 || (groups > 0 && !m_sizes))
        return -EINVAL;
    size_t N = (size_t)n, K = (size_t)k, M = 0, mat;
    if (!ref_size_mul(N, K, &mat))
        return -EINVAL;
    for (int g = 0; g < groups; g++) {
        if (m_sizes[g] < 0 ||
            __builtin_add_overflow(M, m_sizes[g], &M))
            return -EINVAL;
    }
    size_t an, cn;
    if (!ref_size_mul(M, K, &an) || !ref_size_mul(M, N, &cn) ||
        !ref_size_mul(an, sizeof(float), &an) ||
        !ref_size_mul(cn, sizeof(float), &cn))
        return -EINVAL;
    if (M == 0 || N == 0)
        return 0;
    if (!a || !b || !c)
        return -EINVAL;

    /* Per group: A's rows in fp32, then one row of B at a time against all
     * of them, so each B row is converted once per call. */
    size_t max_mg = 0;
    for (int g = 0; g < groups; g++)
        if ((size_t)m_sizes[g] > max_mg)
            max_mg = (size_t)m_sizes[g];
    float *af = malloc(max_mg * K * sizeof(float) + 1);
    float *cf = malloc(max_mg * N * sizeof(float));
    float *brow = malloc(K * sizeof(float) + 1);
    int rc = -ENOMEM;
    if (!af || !cf || !brow)
        goto done;

    size_t row = 0;
    for (int g = 0; g < groups; g++) {
        size_t mg = (size_t)m_sizes[g];
        if (mg == 0)
            continue;
        const char *bg = (const char *)b + (size_t)g * mat * es;
        moek_to_f32(dt, (const char *)a + row * K * es, af, mg * K);
        for (size_t j = 0; j < N; j++) {
            moek_to_f32(dt, bg + j * K * es, brow, K);
            for (size_t r = 0; r < mg; r++)
                cf[r * N + j] = ref_dot(af + r * K, brow, K);
        }
        moek_from_f32(dt, cf, (char *)c + row * N * es, mg * N);
        row += mg;
    }
    rc = 0;
done:
    free(af);
    free(cf);
    free(brow);
    return rc;
}

double moek_rel_error(const float *got, const float *want, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        float g = got[i], w = want[i];
        if (!isfinite(w)) {
            /* A NaN or infinity the reference also produced is agreement. */
            if ((isnan(w) && isnan(g)) || g == w)
                continue;
            return INFINITY;
        }
        if (!isfinite(g))
            return INFINITY;
        double d = (double)g - (double)w;
        num += d * d;
        den += (double)w * (double)w;
    }
    if (num == 0.0)
        return 0.0;
    if (den == 0.0)
        return INFINITY;
    return sqrt(num / den);
}
