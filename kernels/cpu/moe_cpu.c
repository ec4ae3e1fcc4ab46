/*
 * moe_cpu.c: the CPU backend's fast path, the fused MoE forward and the
 * grouped GEMM, on weights packed once at load time.
 *
 * Both compute Y = X . W^T with one register-blocked microkernel. W is packed
 * into panels of PANEL_NR output columns laid out [K][PANEL_NR], in fp32, so
 * the kernel loads a vector of weights for one k and multiplies it by one
 * broadcast element of each of up to MR rows of X. Every output element is
 * then a single fp32 accumulator that starts at zero and adds x[k] * w[k] for
 * k = 0, 1, ..., K-1 in order, whatever the number of rows or panels the
 * kernel handles at once. That is what makes the result of a row
 * independent of the other rows of the call and of the thread count: blocking
 * and scheduling change which elements are computed together, never the
 * arithmetic of one element. (-ffp-contract=off keeps the compiler from
 * fusing some of those multiply-adds and not others.)
 *
 * The MoE forward for T tokens and top-k routing:
 *   1. check every id, then counting-sort the T*k token slots by expert, so
 *      each expert's slots are one contiguous run of rows;
 *   2. per (expert, tile of I): gate and up for all of the expert's rows
 *      against each packed panel, fused into act = silu(gate) * up, so each
 *      weight panel is read once per call;
 *   3. per (expert, tile of H): y = W2 . act for the expert's rows;
 *   4. per token: out = sum over j = 0..k-1 of w[j] * y[slot j], in that
 *      order, rounded once to the dtype.
 * Steps 2-4 are parallel-fors on the pool; experts with no rows make no work
 * items. The grouped GEMM is step 3 alone, one group per "expert".
 */
#include "moe_kernels.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/*
 * The vector type matches the widest registers the build targets: 16 bytes
 * on baseline x86-64 (SSE2), where GCC splits wider generic vectors through
 * memory, and 32 bytes where AVX is enabled. Only the lane count changes;
 * each lane does the same fp32 operations either way.
 */
#ifdef __AVX__
#define VEC_LANES 8
#define VEC_SPLAT(x) {x, x, x, x, x, x, x, x}
#else
#define VEC_LANES 4
#define VEC_SPLAT(x) {x, x, x, x}
#endif
typedef float moe_vf __attribute__((vector_size(VEC_LANES * sizeof(float))));

/* Columns per packed panel: one vector. */
#define PANEL_NR 8
/*
 * The kernel keeps mr * np * nv * (PANEL_NR / VEC_LANES) vector accumulators
 * for mr rows of X against np panels at once, nv = 1 for a plain product and
 * 2 for gate-and-up; mr * np * nv <= KERN_ACC. With SSE2 that is twelve of
 * the sixteen registers. Of the shapes that fit, few rows and several panels
 * measured fastest (2 x 3 panels plain, 1 x 3 panels gate-and-up, about 10%
 * ahead of 6 x 1 and 3 x 1): each broadcast of an x element then feeds more
 * multiplies. A single row takes six panels, to keep twelve independent
 * additions in flight.
 */
#define KERN_ACC 6
#define KERN_MR_PLAIN 2
#define KERN_MR_GATEUP 1
/* Panels per work item; a multiple of every panel count the kernel takes at
 * once (1, 2, 3, 6), so the grouping never straddles two items. */
#define TILE_PANELS 6
/* Tokens per work item of the final combine. */
#define COMBINE_TOKENS 16

/* ---- sizes -------------------------------------------------------------- */

static bool moe_mul(size_t a, size_t b, size_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* Reserves bytes in a scratch layout at a 64-byte boundary; false on
 * overflow. */
static bool moe_layout_add(size_t *total, size_t bytes, size_t *off)
{
    size_t at = (*total + 63) & ~(size_t)63;
    if (at < *total || __builtin_add_overflow(at, bytes, total))
        return false;
    *off = at;
    return true;
}

static size_t moe_panels(size_t n)
{
    return (n + PANEL_NR - 1) / PANEL_NR;
}

/* ---- microkernel -------------------------------------------------------- */

/*
 * tile[r][q][v][c] = sum over k of rows[r][k] * panel_q[k][v][c], panel q at
 * panel + q * pstride; each panel row holds nv groups of PANEL_NR weights.
 * Only ever called with constant mr, np and nv, so the loops unroll and acc
 * lives in registers.
 */
static inline __attribute__((always_inline)) void
moe_kernel_body(const int mr, const int np, const int nv,
                const float *const *rows, const float *panel, size_t pstride,
                size_t K, float *tile)
{
    enum { PV = PANEL_NR / VEC_LANES, MAXV = KERN_ACC * PV };
    /* acc[(r * np + q) * nv * PV + v]: the vectors of row r, panel q. */
    moe_vf acc[MAXV];
    const int per_row = np * nv * PV;
    const size_t step = (size_t)nv * PANEL_NR;

#pragma GCC unroll 64
    for (int i = 0; i < mr * per_row; i++)
        acc[i] = (moe_vf){0};
    for (size_t k = 0; k < K; k++) {
        moe_vf w[MAXV];
#pragma GCC unroll 8
        for (int q = 0; q < np; q++)
#pragma GCC unroll 8
            for (int v = 0; v < nv * PV; v++)
                w[q * nv * PV + v] =
                    *(const moe_vf *)(panel + (size_t)q * pstride + k * step +
                                      (size_t)v * VEC_LANES);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            float xs = rows[r][k];
            moe_vf xv = VEC_SPLAT(xs);
#pragma GCC unroll 16
            for (int v = 0; v < per_row; v++)
                acc[r * per_row + v] += w[v] * xv;
        }
    }
#pragma GCC unroll 64
    for (int i = 0; i < mr * per_row; i++)
        *(moe_vf *)(tile + (size_t)i * VEC_LANES) = acc[i];
}

/* The panel count the kernel takes at once for mr rows, nv groups each. */
static int moe_kernel_np(int mr, int nv)
{
    int np = KERN_ACC / (mr * nv);
    return np > 0 ? np : 1;
}

/* Largest row block for nv groups per panel row. */
static int moe_kernel_mr(int nv)
{
    return nv == 1 ? KERN_MR_PLAIN : KERN_MR_GATEUP;
}

#define MOE_KCASE(mr, np, nv)                                                 \
    case (mr) * 16 + (np):                                                    \
        moe_kernel_body(mr, np, nv, rows, panel, pstride, K, tile);           \
        return

/* One product: mr <= KERN_MR_PLAIN, mr * np <= KERN_ACC. */
static void moe_kernel_plain(int mr, int np, const float *const *rows,
                             const float *panel, size_t pstride, size_t K,
                             float *tile)
{
    switch (mr * 16 + np) {
        MOE_KCASE(1, 1, 1); MOE_KCASE(1, 2, 1); MOE_KCASE(1, 3, 1);
        MOE_KCASE(1, 4, 1); MOE_KCASE(1, 5, 1); MOE_KCASE(1, 6, 1);
        MOE_KCASE(2, 1, 1); MOE_KCASE(2, 2, 1); MOE_KCASE(2, 3, 1);
    }
}

/* Gate and up side by side: mr <= KERN_MR_GATEUP, mr * np <= KERN_ACC / 2. */
static void moe_kernel_gateup(int mr, int np, const float *const *rows,
                              const float *panel, size_t pstride, size_t K,
                              float *tile)
{
    switch (mr * 16 + np) {
        MOE_KCASE(1, 1, 2); MOE_KCASE(1, 2, 2); MOE_KCASE(1, 3, 2);
    }
}

/*
 * A packed matrix: ceil(n / NR) panels, each [k][nv][NR] fp32; nv = 2 holds
 * gate and up side by side.
 */
struct moe_panels {
    const float *base;
    int nv;
    size_t n, k;
};

static size_t moe_panel_elems(const struct moe_panels *m)
{
    return m->k * (size_t)m->nv * PANEL_NR;
}

/*
 * Runs the kernel over panels [p0, p1) of m for n_rows rows. The row
 * pointers come from row_of(arg, i) for i in [0, n_rows); store(arg, i, col,
 * ncols, vals) receives nv groups of PANEL_NR values of one row per panel.
 */
typedef const float *(*moe_row_fn)(const void *arg, size_t i);
typedef void (*moe_store_fn)(const void *arg, size_t i, size_t col, int ncols,
                             const float *vals);

static void moe_run_panels(const struct moe_panels *m, size_t p0, size_t p1,
                           size_t n_rows, moe_row_fn row_of,
                           moe_store_fn store, const void *arg)
{
    const int nv = m->nv;
    const int mr_max = moe_kernel_mr(nv);
    const int np_full =
        moe_kernel_np(n_rows < (size_t)mr_max ? (int)n_rows : mr_max, nv);
    const size_t pstride = moe_panel_elems(m);
    float tile[KERN_ACC * PANEL_NR] __attribute__((aligned(64)));
    const float *rows[KERN_MR_PLAIN > KERN_MR_GATEUP ? KERN_MR_PLAIN
                                                     : KERN_MR_GATEUP];

    /* np_full panels at a time for every row block: a short last block
     * has fewer rows, so it has room for at least as many panels. */
    for (size_t p = p0; p < p1; p += (size_t)np_full) {
        int np = p1 - p < (size_t)np_full ? (int)(p1 - p) : np_full;
        const float *panel = m->base + p * pstride;
        for (size_t r0 = 0; r0 < n_rows; r0 += (size_t)mr_max) {
            int mr = n_rows - r0 < (size_t)mr_max ? (int)(n_rows - r0) : mr_max;
            for (int r = 0; r < mr; r++)
                rows[r] = row_of(arg, r0 + (size_t)r);
            if (nv == 2)
                moe_kernel_gateup(mr, np, rows, panel, pstride, m->k, tile);
            else
                moe_kernel_plain(mr, np, rows, panel, pstride, m->k, tile);
            for (int r = 0; r < mr; r++)
                for (int q = 0; q < np; q++) {
                    size_t col = (p + (size_t)q) * PANEL_NR;
                    size_t left = m->n - col;
                    int ncols = left < PANEL_NR ? (int)left : PANEL_NR;
                    store(arg, r0 + (size_t)r, col, ncols,
                          tile + (size_t)(r * np + q) * nv * PANEL_NR);
                }
        }
    }
}

/*
 * Packs one [n, k] matrix of dtype dt into the panels at dst, at group v of
 * each panel row; columns past n become zero. tmp is scratch of PANEL_NR * k
 * floats: a panel's rows are converted first, so that the panel itself is
 * written in order.
 */
static void moe_pack(moek_dtype dt, const void *src, size_t n, size_t k,
                     int nv, int v, float *dst, float *tmp)
{
    size_t es = moek_dtype_size(dt), width = (size_t)nv * PANEL_NR;
    for (size_t p0 = 0; p0 < n; p0 += PANEL_NR) {
        size_t rows = n - p0 < PANEL_NR ? n - p0 : PANEL_NR;
        float *d = dst + p0 / PANEL_NR * k * width + (size_t)v * PANEL_NR;
        moek_to_f32(dt, (const char *)src + p0 * k * es, tmp, rows * k);
        for (size_t kk = 0; kk < k; kk++) {
            for (size_t c = 0; c < rows; c++)
                d[kk * width + c] = tmp[c * k + kk];
            for (size_t c = rows; c < PANEL_NR; c++)
                d[kk * width + c] = 0.0f;
        }
    }
}

/* 64-byte aligned, so every panel row starts on a vector boundary. */
static void *moe_alloc_panels(size_t bytes)
{
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) == 0 ? p : NULL;
}

/* ---- MoE weights -------------------------------------------------------- */

struct moek_cpu_moe_weights {
    moek_moe_shape shape;
    moek_dtype dt;
    size_t gu_stride; /* floats per expert of gate/up panels */
    size_t dn_stride; /* floats per expert of down panels */
    float *gu;        /* [E][ceil(I/NR)][H][2][NR] */
    float *dn;        /* [E][ceil(H/NR)][I][NR] */
};

int moek_cpu_moe_weights_new(const moek_moe_shape *shape, moek_dtype dt,
                             const void *w1, const void *w3, const void *w2,
                             moek_cpu_moe_weights **out)
{
    if (!out)
        return -EINVAL;
    *out = NULL;
    size_t es = moek_dtype_size(dt);
    if (!shape || es == 0 || shape->experts <= 0 || shape->topk <= 0 ||
        shape->hidden <= 0 ||
        shape->intermediate <= 0 || !w1 || !w3 || !w2)
        return -EINVAL;

    size_t E = (size_t)shape->experts, H = (size_t)shape->hidden;
    size_t I = (size_t)shape->intermediate, gu_stride, dn_stride, mat;
    size_t gu_bytes, dn_bytes, tmp_bytes;
    if (!moe_mul(moe_panels(I) * PANEL_NR * 2, H, &gu_stride) ||
        !moe_mul(moe_panels(H) * PANEL_NR, I, &dn_stride) ||
        !moe_mul(H, I, &mat) || !moe_mul(mat, es, &mat) ||
        !moe_mul(gu_stride, E, &gu_bytes) ||
        !moe_mul(gu_bytes, sizeof(float), &gu_bytes) ||
        !moe_mul(dn_stride, E, &dn_bytes) ||
        !moe_mul(dn_bytes, sizeof(float), &dn_bytes) ||
        !moe_mul(PANEL_NR * sizeof(float), H > I ? H : I, &tmp_bytes))
        return -EINVAL;

    moek_cpu_moe_weights *w = calloc(1, sizeof *w);
    float *tmp = malloc(tmp_bytes);
    if (w) {
        w->gu = moe_alloc_panels(gu_bytes);
        w->dn = moe_alloc_panels(dn_bytes);
    }
    if (!w || !tmp || !w->gu || !w->dn) {
        free(tmp);
        moek_cpu_moe_weights_free(w);
        return -ENOMEM;
    }
    w->shape = *shape;
    w->dt = dt;
    w->gu_stride = gu_stride;
    w->dn_stride = dn_stride;
    for (size_t e = 0; e < E; e++) {
        float *gu = w->gu + e * gu_stride, *dn = w->dn + e * dn_stride;
        moe_pack(dt, (const char *)w1 + e * mat, I, H, 2, 0, gu, tmp);
        moe_pack(dt, (const char *)w3 + e * mat, I, H, 2, 1, gu, tmp);
        moe_pack(dt, (const char *)w2 + e * mat, H, I, 1, 0, dn, tmp);
    }
    free(tmp);
    *out = w;
    return 0;
}

void moek_cpu_moe_weights_free(moek_cpu_moe_weights *w)
{
    if (!w)
        return;
    free(w->gu);
    free(w->dn);
    free(w);
}

/* ---- MoE forward -------------------------------------------------------- */

/* Everything one call's work items share; read-only once built, except the
 * disjoint rows each item writes. */
struct moe_call {
    const moek_cpu_moe_weights *w;
    size_t T, k, H, I;
    const float *xf;       /* [T][H] tokens in fp32 */
    const float *weights;
    void *out;
    float *act;            /* [T*k][I] by sorted position */
    float *y;              /* [T*k][H] by sorted position */
    float *comb;           /* [T][H] fp32 combine rows, NULL for fp32 out */
    const int32_t *order;  /* sorted position -> slot */
    const int32_t *pos;    /* slot -> sorted position */
    const int32_t *start;  /* [E + 1] first sorted position per expert */
    const int32_t *used;   /* experts with rows, ascending */
    size_t tiles1, tiles2; /* work items per used expert, steps 2 and 3 */
};

/* The rows of one expert as step 2 and 3 see them. */
struct moe_rows {
    const struct moe_call *c;
    size_t base; /* first sorted position of the expert */
};

static const float *moe_row_x(const void *arg, size_t i)
{
    const struct moe_rows *r = arg;
    size_t slot = (size_t)r->c->order[r->base + i];
    return r->c->xf + slot / r->c->k * r->c->H;
}

static const float *moe_row_act(const void *arg, size_t i)
{
    const struct moe_rows *r = arg;
    return r->c->act + (r->base + i) * r->c->I;
}

static float moe_silu(float v)
{
    return v / (1.0f + expf(-v));
}

static void moe_store_act(const void *arg, size_t i, size_t col, int ncols,
                          const float *vals)
{
    const struct moe_rows *r = arg;
    float *dst = r->c->act + (r->base + i) * r->c->I + col;
    const moek_dtype dt = r->c->w->dt;
    for (int n = 0; n < ncols; n++)
        dst[n] = moek_round(dt, moe_silu(vals[n]) * vals[PANEL_NR + n]);
}

static void moe_store_y(const void *arg, size_t i, size_t col, int ncols,
                        const float *vals)
{
    const struct moe_rows *r = arg;
    memcpy(r->c->y + (r->base + i) * r->c->H + col, vals,
           (size_t)ncols * sizeof(float));
}

static void moe_gateup_item(void *arg, int item)
{
    const struct moe_call *c = arg;
    size_t e = (size_t)c->used[(size_t)item / c->tiles1];
    size_t tile = (size_t)item % c->tiles1, npan = moe_panels(c->I);
    size_t p0 = tile * TILE_PANELS;
    size_t p1 = p0 + TILE_PANELS < npan ? p0 + TILE_PANELS : npan;
    struct moe_rows rows = {c, (size_t)c->start[e]};
    size_t n = (size_t)c->start[e + 1] - rows.base;

    struct moe_panels m = {c->w->gu + e * c->w->gu_stride, 2, c->I, c->H};
    moe_run_panels(&m, p0, p1, n, moe_row_x, moe_store_act, &rows);
}

static void moe_down_item(void *arg, int item)
{
    const struct moe_call *c = arg;
    size_t e = (size_t)c->used[(size_t)item / c->tiles2];
    size_t tile = (size_t)item % c->tiles2, npan = moe_panels(c->H);
    size_t p0 = tile * TILE_PANELS;
    size_t p1 = p0 + TILE_PANELS < npan ? p0 + TILE_PANELS : npan;
    struct moe_rows rows = {c, (size_t)c->start[e]};
    size_t n = (size_t)c->start[e + 1] - rows.base;

    struct moe_panels m = {c->w->dn + e * c->w->dn_stride, 1, c->H, c->I};
    moe_run_panels(&m, p0, p1, n, moe_row_act, moe_store_y, &rows);
}

static void moe_combine_item(void *arg, int item)
{
    const struct moe_call *c = arg;
    size_t t0 = (size_t)item * COMBINE_TOKENS;
    size_t t1 = t0 + COMBINE_TOKENS < c->T ? t0 + COMBINE_TOKENS : c->T;
    size_t H = c->H;
    for (size_t t = t0; t < t1; t++) {
        float *o = c->comb ? c->comb + t * H : (float *)c->out + t * H;
        for (size_t h = 0; h < H; h++)
            o[h] = 0.0f;
        /* j in the order of the ids array, never in scheduling order. */
        for (size_t j = 0; j < c->k; j++) {
            if (c->pos[t * c->k + j] < 0)
                continue; /* an empty slot */
            float wj = c->weights[t * c->k + j];
            const float *yj = c->y + (size_t)c->pos[t * c->k + j] * H;
            for (size_t h = 0; h < H; h++)
                o[h] += wj * yj[h];
        }
        if (c->comb)
            moek_from_f32(c->w->dt, o,
                          (char *)c->out + t * H * moek_dtype_size(c->w->dt),
                          H);
    }
}

int moek_cpu_fused_moe(moek_cpu_pool *pool, const moek_cpu_moe_weights *w,
                       const void *x, const int32_t *ids, const float *weights,
                       int tokens, void *out)
{
    if (!w || tokens < 0)
        return -EINVAL;
    if (tokens == 0)
        return 0;
    if (!x || !ids || !weights || !out)
        return -EINVAL;

    size_t E = (size_t)w->shape.experts, k = (size_t)w->shape.topk;
    size_t H = (size_t)w->shape.hidden, I = (size_t)w->shape.intermediate;
    size_t T = (size_t)tokens, S;
    if (!moe_mul(T, k, &S) || S > INT32_MAX)
        return -EINVAL;
    for (size_t s = 0; s < S; s++)
        if (ids[s] < -1 || (ids[s] >= 0 && (size_t)ids[s] >= E))
            return -EINVAL;

    /* One scratch block, sized from the token count. */
    bool f32 = w->dt == MOEK_DTYPE_FP32;
    size_t total = 0, o_xf = 0, o_act, o_y, o_order, o_pos, o_start, o_used;
    size_t n_xf, n_act, n_y;
    if (!moe_mul(T, H, &n_xf) || !moe_mul(n_xf, sizeof(float), &n_xf) ||
        !moe_mul(S, I, &n_act) || !moe_mul(n_act, sizeof(float), &n_act) ||
        !moe_mul(S, H, &n_y) || !moe_mul(n_y, sizeof(float), &n_y) ||
        (!f32 && !moe_layout_add(&total, n_xf, &o_xf)) ||
        !moe_layout_add(&total, n_act, &o_act) ||
        !moe_layout_add(&total, n_y, &o_y) ||
        !moe_layout_add(&total, S * sizeof(int32_t), &o_order) ||
        !moe_layout_add(&total, S * sizeof(int32_t), &o_pos) ||
        !moe_layout_add(&total, (E + 1) * sizeof(int32_t), &o_start) ||
        !moe_layout_add(&total, E * sizeof(int32_t), &o_used))
        return -EINVAL;
    char *scratch = NULL;
    if (posix_memalign((void **)&scratch, 64, total) != 0)
        return -ENOMEM;

    int32_t *order = (int32_t *)(scratch + o_order);
    int32_t *pos = (int32_t *)(scratch + o_pos);
    int32_t *start = (int32_t *)(scratch + o_start);
    int32_t *used = (int32_t *)(scratch + o_used);

    /* Counting sort of the slots by expert, stable in slot order. */
    memset(start, 0, (E + 1) * sizeof(int32_t));
    for (size_t s = 0; s < S; s++)
        if (ids[s] >= 0) /* -1: an empty slot */
            start[ids[s] + 1]++;
    size_t n_used = 0;
    for (size_t e = 0; e < E; e++) {
        if (start[e + 1] > 0)
            used[n_used++] = (int32_t)e;
        start[e + 1] += start[e];
    }
    for (size_t s = 0; s < S; s++) {
        if (ids[s] < 0) {
            pos[s] = -1;
            continue;
        }
        int32_t p = start[ids[s]]++;
        order[p] = (int32_t)s;
        pos[s] = p;
    }
    /* The fill moved each start to the next expert's; shift them back. */
    for (size_t e = E; e > 0; e--)
        start[e] = start[e - 1];
    start[0] = 0;

    struct moe_call c = {
        .w = w, .T = T, .k = k, .H = H, .I = I,
        .xf = f32 ? x : (const float *)(scratch + o_xf),
        .weights = weights, .out = out,
        .act = (float *)(scratch + o_act), .y = (float *)(scratch + o_y),
        .comb = f32 ? NULL : (float *)(scratch + o_xf),
        .order = order, .pos = pos, .start = start, .used = used,
        .tiles1 = (moe_panels(I) + TILE_PANELS - 1) / TILE_PANELS,
        .tiles2 = (moe_panels(H) + TILE_PANELS - 1) / TILE_PANELS,
    };
    if (!f32)
        moek_to_f32(w->dt, x, (float *)(scratch + o_xf), T * H);

    size_t items1, items2;
    if (!moe_mul(n_used, c.tiles1, &items1) || items1 > INT32_MAX ||
        !moe_mul(n_used, c.tiles2, &items2) || items2 > INT32_MAX) {
        free(scratch);
        return -EINVAL;
    }
    moek_cpu_pool_run(pool, (int)items1, moe_gateup_item, &c);
    moek_cpu_pool_run(pool, (int)items2, moe_down_item, &c);
    /* The combine writes fp32 rows over xf, which step 2 no longer needs. */
    moek_cpu_pool_run(pool, (int)((T + COMBINE_TOKENS - 1) / COMBINE_TOKENS),
                      moe_combine_item, &c);
    free(scratch);
    return 0;
}

/* ---- grouped GEMM ------------------------------------------------------- */

struct moek_cpu_gemm_weights {
    moek_dtype dt;
    int groups;
    size_t n, k;
    size_t stride; /* floats per group */
    float *panels; /* [G][ceil(N/NR)][K][NR] */
};

int moek_cpu_gemm_weights_new(moek_dtype dt, int groups, int n, int k,
                              const void *b, moek_cpu_gemm_weights **out)
{
    if (!out)
        return -EINVAL;
    *out = NULL;
    size_t es = moek_dtype_size(dt);
    if (es == 0 || groups < 0 || n < 0 || k < 0)
        return -EINVAL;
    size_t G = (size_t)groups, N = (size_t)n, K = (size_t)k, stride, bytes;
    size_t mat, tmp_bytes;
    if (!moe_mul(moe_panels(N) * PANEL_NR, K, &stride) ||
        !moe_mul(stride, G, &bytes) || !moe_mul(bytes, sizeof(float), &bytes) ||
        !moe_mul(N, K, &mat) || !moe_mul(mat, es, &mat) ||
        !moe_mul(PANEL_NR * sizeof(float), K, &tmp_bytes))
        return -EINVAL;
    if (!b && G > 0 && mat > 0)
        return -EINVAL;

    moek_cpu_gemm_weights *w = calloc(1, sizeof *w);
    float *tmp = malloc(tmp_bytes ? tmp_bytes : 1);
    if (w)
        w->panels = moe_alloc_panels(bytes);
    if (!w || !tmp || !w->panels) {
        free(tmp);
        moek_cpu_gemm_weights_free(w);
        return -ENOMEM;
    }
    w->dt = dt;
    w->groups = groups;
    w->n = N;
    w->k = K;
    w->stride = stride;
    for (size_t g = 0; g < G && mat > 0; g++)
        moe_pack(dt, (const char *)b + g * mat, N, K, 1, 0,
                 w->panels + g * stride, tmp);
    free(tmp);
    *out = w;
    return 0;
}

void moek_cpu_gemm_weights_free(moek_cpu_gemm_weights *w)
{
    if (!w)
        return;
    free(w->panels);
    free(w);
}

struct gemm_call {
    const moek_cpu_gemm_weights *w;
    const float *af;        /* [M][K] in fp32 */
    void *c;                /* [M][N] of the dtype */
    const size_t *row0;     /* [G + 1] first row per group */
    const int32_t *used;    /* groups with rows */
    size_t tiles;           /* work items per used group */
};

struct gemm_rows {
    const struct gemm_call *c;
    size_t base;
};

static const float *gemm_row_a(const void *arg, size_t i)
{
    const struct gemm_rows *r = arg;
    return r->c->af + (r->base + i) * r->c->w->k;
}

static void gemm_store_c(const void *arg, size_t i, size_t col, int ncols,
                         const float *vals)
{
    const struct gemm_rows *r = arg;
    const moek_cpu_gemm_weights *w = r->c->w;
    size_t es = moek_dtype_size(w->dt);
    moek_from_f32(w->dt, vals,
                  (char *)r->c->c + ((r->base + i) * w->n + col) * es,
                  (size_t)ncols);
}

static void gemm_item(void *arg, int item)
{
    const struct gemm_call *c = arg;
    size_t g = (size_t)c->used[(size_t)item / c->tiles];
    size_t tile = (size_t)item % c->tiles, npan = moe_panels(c->w->n);
    size_t p0 = tile * TILE_PANELS;
    size_t p1 = p0 + TILE_PANELS < npan ? p0 + TILE_PANELS : npan;
    struct gemm_rows rows = {c, c->row0[g]};

    struct moe_panels m = {c->w->panels + g * c->w->stride, 1, c->w->n,
                           c->w->k};
    moe_run_panels(&m, p0, p1, c->row0[g + 1] - c->row0[g], gemm_row_a,
                   gemm_store_c, &rows);
}

int moek_cpu_grouped_gemm(moek_cpu_pool *pool, const moek_cpu_gemm_weights *w,
                          const void *a, const int64_t *m_sizes, void *c)
{
    if (!w || (w->groups > 0 && !m_sizes))
        return -EINVAL;
    size_t G = (size_t)w->groups, M = 0;
    for (size_t g = 0; g < G; g++)
        if (m_sizes[g] < 0 || __builtin_add_overflow(M, m_sizes[g], &M))
            return -EINVAL;
    size_t n_af, n_c;
    if (!moe_mul(M, w->k, &n_af) || !moe_mul(n_af, sizeof(float), &n_af) ||
        !moe_mul(M, w->n, &n_c) || !moe_mul(n_c, sizeof(float), &n_c))
        return -EINVAL;
    if (M == 0 || w->n == 0)
        return 0;
    if (!a || !c)
        return -EINVAL;

    bool f32 = w->dt == MOEK_DTYPE_FP32;
    size_t total = 0, o_af = 0, o_row0, o_used;
    if ((!f32 && !moe_layout_add(&total, n_af, &o_af)) ||
        !moe_layout_add(&total, (G + 1) * sizeof(size_t), &o_row0) ||
        !moe_layout_add(&total, G * sizeof(int32_t), &o_used))
        return -EINVAL;
    char *scratch = NULL;
    if (posix_memalign((void **)&scratch, 64, total) != 0)
        return -ENOMEM;
    size_t *row0 = (size_t *)(scratch + o_row0);
    int32_t *used = (int32_t *)(scratch + o_used);
    size_t n_used = 0;
    row0[0] = 0;
    for (size_t g = 0; g < G; g++) {
        row0[g + 1] = row0[g] + (size_t)m_sizes[g];
        if (m_sizes[g] > 0)
            used[n_used++] = (int32_t)g;
    }
    if (!f32)
        moek_to_f32(w->dt, a, (float *)(scratch + o_af), M * w->k);

    struct gemm_call call = {
        .w = w, .af = f32 ? a : (const float *)(scratch + o_af), .c = c,
        .row0 = row0, .used = used,
        .tiles = (moe_panels(w->n) + TILE_PANELS - 1) / TILE_PANELS,
    };
    size_t items;
    if (!moe_mul(n_used, call.tiles, &items) || items > INT32_MAX) {
        free(scratch);
        return -EINVAL;
    }
    moek_cpu_pool_run(pool, (int)items, gemm_item, &call);
    free(scratch);
    return 0;
}
