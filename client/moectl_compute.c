/*
 * moectl_compute.c: `moectl forward` and `moectl gemm`: build inputs in a
 * region (random from a seed, or read from a safetensors file), run them
 * through the daemon, and with --check recompute the result here with the
 * reference kernels on the layer's own weights (read from the file the daemon
 * loaded) and compare by relative Frobenius error.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client/moectl.h"
#include "daemon/layer.h"
#include "daemon/safetensors.h"
#include "kernels/moe_kernels.h"
#include "moe.pb-c.h"

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

/* Uniform in [-1, 1). */
static float rng_unit(uint64_t *s)
{
    return (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static moek_dtype kdt(moe_dtype dt)
{
    return dt == MOE_DTYPE_BF16 ? MOEK_DTYPE_BF16 : dt == MOE_DTYPE_FP16 ? MOEK_DTYPE_FP16
                                                                          : MOEK_DTYPE_FP32;
}

/* Tolerance of the relative error for a layer dtype. */
static double tolerance(moe_dtype dt)
{
    return dt == MOE_DTYPE_BF16 ? 1e-2 : dt == MOE_DTYPE_FP16 ? 2e-3 : 1e-4;
}

static size_t align64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

/* Read the weights a LayerInfo source names: "PATH", or "PATH:PREFIX" for
 * a layer loaded with a prefix. A colon may be part of the file's name
 * too, and a slash part of the prefix, so no one split is right: each that
 * leaves a regular file on the left is tried, leftmost first, then the
 * whole source as the path. */
static int read_layer_weights(const moe_layer_info *li, struct host_weights *hw)
{
    if (li->source[0] != '/') {
        fprintf(stderr, "moectl: --check needs weights from a file; layer '%s' came from '%s'\n",
                li->name, li->source);
        return -ENOTSUP;
    }
    char path[sizeof(li->source)], err[512] = "";
    int rc = -ENOENT;
    size_t len = strlen(li->source);
    for (size_t i = 1; i <= len; i++) {
        if (li->source[i] != ':' && li->source[i] != '\0')
            continue;
        memcpy(path, li->source, i);
        path[i] = '\0';
        struct stat st;
        if (stat(path, &st) || !S_ISREG(st.st_mode))
            continue;
        struct layer_spec spec = {
            .kind = li->kind == MOE_LAYER_GEMM ? MOE__LAYER_KIND__LAYER_GEMM
                                               : MOE__LAYER_KIND__LAYER_MOE,
            .dtype = (int)li->dtype, .experts = li->experts, .hidden = li->hidden,
            .intermediate = li->intermediate, .groups = li->groups, .n = li->n, .k = li->k,
            .path = path, .prefix = li->source[i] ? li->source + i + 1 : NULL,
        };
        char *root[] = {"/"}, why[512] = "";
        int r = layer_read_weights(&spec, root, 1, hw, why, sizeof(why));
        if (!r)
            return 0;
        if (!err[0]) /* the likeliest split's reason */
            snprintf(err, sizeof(err), "%s", why);
        rc = r;
    }
    if (!err[0])
        snprintf(err, sizeof(err), "no file at %s", li->source);
    fprintf(stderr, "moectl: --check cannot read the layer's weights: %s\n", err);
    return rc;
}

static double compare(moe_dtype dt, const void *got, const void *want, size_t n)
{
    float *g = malloc(n * sizeof(float) + 4), *w = malloc(n * sizeof(float) + 4);
    double e = INFINITY;
    if (g && w) {
        moek_to_f32(kdt(dt), got, g, n);
        moek_to_f32(kdt(dt), want, w, n);
        e = moek_rel_error(g, w, n);
    }
    free(g);
    free(w);
    return e;
}

/* --check's verdict on got against the reference, whose call returned
 * ref_rc (ref unwritten unless 0): printed; 0, or 1 for the exit status. */
static int check_report(const char *cmd, int ref_rc, moe_dtype dt, const void *got,
                        const void *ref, size_t n)
{
    if (ref_rc) {
        fprintf(stderr, "moectl: %s: the reference cannot run: %s\n", cmd, strerror(-ref_rc));
        return 1;
    }
    double err = compare(dt, got, ref, n), tol = tolerance(dt);
    bool ok = err <= tol;
    printf("check: relative error %.3e against the reference (tolerance %.0e, %s): %s\n", err,
           tol, moectl_dtype_name(dt), ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}

/* Inputs read from a safetensors file into the region. */
static int load_input(const char *file, const moe_layer_info *li, uint64_t *tokens,
                      struct st_file **out)
{
    char err[512] = "";
    int rc = st_open(file, out, err, sizeof(err));
    if (rc) {
        fprintf(stderr, "moectl: %s: %s\n", file, err);
        return rc;
    }
    const struct st_tensor *x = st_find(*out, "x");
    /* T bounded as --tokens is; none would make an empty region. */
    if (!x || x->ndim != 2 || x->shape[1] != li->hidden || x->shape[0] < 1 ||
        x->shape[0] > MOECTL_MAX_TOKENS) {
        fprintf(stderr, "moectl: %s needs a tensor 'x' [T, %u], T from 1 to %llu\n", file,
                li->hidden, MOECTL_MAX_TOKENS);
        st_close(out);
        return -EINVAL;
    }
    *tokens = x->shape[0];
    return 0;
}

static int read_into(const struct st_file *f, const char *name, int st_dt, uint64_t d0,
                     uint64_t d1, void *dst)
{
    const struct st_tensor *t = st_find(f, name);
    if (!t || t->dtype != (enum st_dtype)st_dt || t->ndim != 2 || t->shape[0] != d0 ||
        t->shape[1] != d1) {
        fprintf(stderr, "moectl: input needs '%s' as %s [%llu, %llu]\n", name,
                st_dtype_name((enum st_dtype)st_dt), (unsigned long long)d0,
                (unsigned long long)d1);
        return -EINVAL;
    }
    return st_read(f, t, dst);
}

static int st_of(moe_dtype dt)
{
    return dt == MOE_DTYPE_BF16 ? ST_BF16 : dt == MOE_DTYPE_FP16 ? ST_F16 : ST_F32;
}

/* Fill n elements with uniform values of variance 1/fan_in, converting in
 * chunks so a multi-gigabyte layer needs no second copy. */
static void fill_random(moe_dtype dt, void *dst, size_t n, double fan_in, uint64_t *seed)
{
    float buf[4096];
    float a = (float)(1.7320508075688772 / sqrt(fan_in));
    size_t es = moe_dtype_size(dt);
    for (size_t i = 0; i < n; i += 4096) {
        size_t m = n - i < 4096 ? n - i : 4096;
        for (size_t j = 0; j < m; j++)
            buf[j] = rng_unit(seed) * a;
        moek_from_f32(kdt(dt), buf, (uint8_t *)dst + i * es, m);
    }
}

/* The elements of one weight tensor (a MoE layer has three of that size),
 * its bytes and the region's: false if any of them passes 2^64. Unchecked,
 * E*H*I wrapped to a small region that fill_random then overran. */
static bool random_sizes(const moe_layer_desc *d, size_t *per, size_t *bytes, size_t *total)
{
    bool moe = d->kind == MOE_LAYER_MOE;
    size_t a = moe ? d->experts : d->groups, b = moe ? d->hidden : d->n,
           c = moe ? d->intermediate : d->k, ab;
    return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, per) &&
           !__builtin_mul_overflow(*per, moe_dtype_size(d->dtype), bytes) &&
           !__builtin_mul_overflow(*bytes, (size_t)(moe ? 3 : 1), total);
}

/* moectl_random_check, with the sizes it checked. */
static int random_check(moe_layer_desc *d, size_t *per, size_t *bytes, size_t *total)
{
    if (!d->dtype)
        d->dtype = MOE_DTYPE_BF16;
    bool moe = d->kind == MOE_LAYER_MOE;
    if (moe ? (!d->experts || !d->hidden || !d->intermediate) : (!d->groups || !d->n || !d->k)) {
        fprintf(stderr, "moectl: --random needs %s\n",
                moe ? "--experts, --hidden and --intermediate" : "--groups, --n and --k");
        return -EINVAL;
    }
    if (!random_sizes(d, per, bytes, total)) {
        fprintf(stderr, "moectl: --random: weights of %u %s x %u %s x %u %s in %s are too large "
                "(2^64 bytes or more)\n", moe ? d->experts : d->groups, moe ? "experts" : "groups",
                moe ? d->hidden : d->n, moe ? "hidden" : "n", moe ? d->intermediate : d->k,
                moe ? "intermediate" : "k", moectl_dtype_name(d->dtype));
        return -EINVAL;
    }
    return 0;
}

int moectl_random_check(moe_layer_desc *d)
{
    size_t per, bytes, total;
    return random_check(d, &per, &bytes, &total);
}

int moectl_random_weights(moe_client *c, moe_layer_desc *d, uint64_t seed, moe_region **r)
{
    if (!seed) /* xorshift stays at 0 from 0: every weight would be -1 */
        seed = 0x9e3779b97f4a7c15ull;
    size_t per, bytes, total;
    int rc = random_check(d, &per, &bytes, &total);
    if (rc)
        return rc;
    bool moe = d->kind == MOE_LAYER_MOE;
    uint64_t E = d->experts, H = d->hidden, I = d->intermediate;
    rc = moe_region_create(c, total, "moectl-weights", r);
    if (rc)
        return moectl_fail("create a region for the weights", rc), rc;
    uint8_t *base = moe_region_data(*r);
    if (moe) {
        fill_random(d->dtype, base, per, (double)H, &seed);
        fill_random(d->dtype, base + bytes, per, (double)H, &seed);
        fill_random(d->dtype, base + 2 * bytes, per, (double)I, &seed);
        d->w1 = moe_tensor_3d(*r, 0, d->dtype, E, I, H);
        d->w3 = moe_tensor_3d(*r, bytes, d->dtype, E, I, H);
        d->w2 = moe_tensor_3d(*r, 2 * bytes, d->dtype, E, H, I);
    } else {
        fill_random(d->dtype, base, per, (double)d->k, &seed);
        d->w1 = moe_tensor_3d(*r, 0, d->dtype, d->groups, d->n, d->k);
    }
    return 0;
}

int cmd_forward(const char *rt, int argc, char **argv)
{
    static const struct option o[] = {
        {"layer", required_argument, NULL, 'l'}, {"tokens", required_argument, NULL, 't'},
        {"input", required_argument, NULL, 'i'}, {"output", required_argument, NULL, 'o'},
        {"check", no_argument, NULL, 'c'},       {"seed", required_argument, NULL, 's'},
        {"repeat", required_argument, NULL, 'n'}, {0},
    };
    const char *layer = NULL, *input = NULL, *output = NULL;
    uint64_t tokens = 0, seed = 0, repeat = 1;
    int check = 0, c, rc;
    while ((c = getopt_long(argc, argv, "", o, NULL)) != -1) {
        switch (c) {
        case 'l': layer = optarg; break;
        case 't': tokens = moectl_num("--tokens", optarg, 1, MOECTL_MAX_TOKENS); break;
        case 'i': input = optarg; break;
        case 'o': output = optarg; break;
        case 'c': check = 1; break;
        case 's': seed = moectl_num("--seed", optarg, 0, UINT64_MAX); break;
        case 'n': repeat = moectl_num("--repeat", optarg, 1, MOECTL_MAX_COUNT); break;
        default: return 2;
        }
    }
    if (moectl_no_more_args(argc, argv, optind))
        return 2;
    if (!layer || (!tokens && !input) || (tokens && input) || repeat == 0) {
        fprintf(stderr, "usage: moectl forward --layer L (--tokens T | --input FILE) [--check]\n");
        return 2;
    }
    if ((input && !input[0]) || (output && !output[0])) {
        fprintf(stderr, "moectl forward: --%s needs a file name\n",
                input && !input[0] ? "input" : "output");
        return 2;
    }
    /* Before the daemon computes what could not be kept. */
    if (output && (rc = st_write_check(output)) < 0) {
        fprintf(stderr, "moectl: cannot write %s: %s\n", output,
                rc == -EINVAL ? "not a regular file" : strerror(-rc));
        return 1;
    }
    if (!seed)
        seed = moectl_now_us() | 1;
    moe_client *cl = moectl_connect(rt, "moectl forward");
    if (!cl)
        return 1;
    moe_layer_info li;
    struct st_file *in = NULL;
    moe_region *r = NULL;
    int status = 1;
    if (moectl_layer(cl, layer, &li))
        goto out;
    if (li.kind != MOE_LAYER_MOE) {
        fprintf(stderr, "moectl: '%s' is a GEMM layer; use 'moectl gemm'\n", layer);
        goto out;
    }
    if (input && load_input(input, &li, &tokens, &in))
        goto out;
    size_t T = tokens, H = li.hidden, E = li.experts, K = li.topk;
    size_t es = moe_dtype_size(li.dtype);
    bool given = li.routing == MOE_ROUTING_GIVEN;
    size_t x_off = 0, r_off = align64(T * H * es);
    size_t w_off = r_off + align64(given ? T * K * 4 : T * E * 4);
    size_t o_off = w_off + align64(given ? T * K * 4 : 0);
    size_t size = o_off + align64(T * H * es);
    if ((rc = moe_region_create(cl, size, "moectl-forward", &r)) < 0) {
        moectl_fail("create region", rc);
        goto out;
    }
    uint8_t *base = moe_region_data(r);
    float *tmp = malloc((T * (H > E ? H : E) + 1) * sizeof(float));
    if (!tmp) {
        fprintf(stderr, "moectl: forward: no memory for %zu tokens of input\n", T);
        goto out;
    }
    if (in) {
        rc = read_into(in, "x", st_of(li.dtype), T, H, base + x_off);
        if (!rc && given)
            rc = read_into(in, "topk_ids", ST_I32, T, K, base + r_off) ||
                 read_into(in, "topk_weights", ST_F32, T, K, base + w_off);
        else if (!rc)
            rc = read_into(in, "logits", ST_F32, T, E, base + r_off);
        if (rc) {
            free(tmp);
            goto out;
        }
    } else {
        for (size_t i = 0; i < T * H; i++)
            tmp[i] = rng_unit(&seed) * 1.7320508f;
        moek_from_f32(kdt(li.dtype), tmp, base + x_off, T * H);
        if (given) {
            int32_t *ids = (int32_t *)(base + r_off);
            float *w = (float *)(base + w_off);
            for (size_t t = 0; t < T; t++) {
                float sum = 0;
                for (size_t j = 0; j < K; j++) {
                    int32_t e;
                    bool dup;
                    do { /* distinct experts per token, as a router gives */
                        e = (int32_t)(rng_next(&seed) % E);
                        dup = false;
                        for (size_t q = 0; q < j; q++)
                            dup |= ids[t * K + q] == e;
                    } while (dup);
                    ids[t * K + j] = e;
                    w[t * K + j] = 0.1f + (rng_unit(&seed) + 1.0f);
                    sum += w[t * K + j];
                }
                for (size_t j = 0; j < K; j++)
                    w[t * K + j] /= sum;
            }
        } else {
            float *lg = (float *)(base + r_off);
            for (size_t i = 0; i < T * E; i++)
                lg[i] = rng_unit(&seed) * 3.0f;
        }
    }
    free(tmp);
    moe_forward_args a = {
        .layer = layer,
        .x = moe_tensor_2d(r, x_off, li.dtype, T, H),
        .out = moe_tensor_2d(r, o_off, li.dtype, T, H),
    };
    if (given) {
        a.topk_ids = moe_tensor_2d(r, r_off, MOE_DTYPE_INT32, T, K);
        a.topk_weights = moe_tensor_2d(r, w_off, MOE_DTYPE_FP32, T, K);
    } else {
        a.logits = moe_tensor_2d(r, r_off, MOE_DTYPE_FP32, T, E);
    }
    moe_timings tm = {0};
    uint64_t *lat = calloc(repeat, sizeof(*lat)), *comp = calloc(repeat, sizeof(*comp));
    if (!lat || !comp) {
        fprintf(stderr, "moectl: forward: no memory for %llu samples\n",
                (unsigned long long)repeat);
        free(lat);
        free(comp);
        goto out;
    }
    for (uint64_t it = 0; it < repeat; it++) {
        memset(base + o_off, 0xff, T * H * es); /* NaN: an unwritten row cannot pass */
        uint64_t t0 = moectl_now_us();
        if ((rc = moe_forward(cl, &a, &tm)) < 0) {
            moectl_fail("forward", rc);
            free(lat);
            free(comp);
            goto out;
        }
        lat[it] = moectl_now_us() - t0;
        comp[it] = tm.compute_us;
    }
    qsort(lat, repeat, sizeof(*lat), cmp_u64);
    qsort(comp, repeat, sizeof(*comp), cmp_u64);
    size_t p99 = (size_t)((repeat * 99) / 100 < repeat ? (repeat * 99) / 100 : repeat - 1);
    if (repeat > 1)
        printf("forward: layer %s, %zu tokens, %llu runs: round trip p50 %llu us p99 %llu us "
               "min %llu us; daemon compute p50 %llu us\n",
               layer, T, (unsigned long long)repeat, (unsigned long long)lat[repeat / 2],
               (unsigned long long)lat[p99], (unsigned long long)lat[0],
               (unsigned long long)comp[repeat / 2]);
    else
        printf("forward: layer %s, %zu tokens: round trip %llu us, daemon compute %llu us, "
               "queue %llu us, batch of %u requests\n",
               layer, T, (unsigned long long)lat[0], (unsigned long long)tm.compute_us,
               (unsigned long long)tm.queue_us, tm.batch_requests);
    free(lat);
    free(comp);
    status = 0;
    if (output) {
        struct st_out so = {.name = "out", .dtype = (enum st_dtype)st_of(li.dtype), .ndim = 2,
                            .shape = {T, H}, .data = base + o_off};
        if ((rc = st_write(output, &so, 1)) < 0) {
            fprintf(stderr, "moectl: cannot write %s: %s\n", output,
                    rc == -EINVAL ? "not a regular file" : strerror(-rc));
            status = 1;
        }
    }
    if (check) {
        struct host_weights hw;
        if (read_layer_weights(&li, &hw)) {
            status = 1;
            goto out;
        }
        moek_moe_shape sh = {(int)E, (int)K, (int)H, (int)li.intermediate};
        int32_t *ids = malloc(T * K * sizeof(int32_t));
        float *w = malloc(T * K * sizeof(float));
        void *ref = malloc(T * H * es);
        if (!ids || !w || !ref) {
            status = 1;
        } else {
            if (given) {
                memcpy(ids, base + r_off, T * K * 4);
                memcpy(w, base + w_off, T * K * 4);
            } else {
                moek_ref_route((const float *)(base + r_off), (int)T, (int)E, (int)K,
                               li.routing == MOE_ROUTING_SIGMOID ? MOEK_SCORING_SIGMOID
                                                                 : MOEK_SCORING_SOFTMAX,
                               li.renormalize != 0, ids, w);
            }
            int rrc = moek_ref_fused_moe(&sh, kdt(li.dtype), base + x_off, ids, w, hw.w1, hw.w3,
                                         hw.w2, (int)T, ref);
            if (check_report("forward", rrc, li.dtype, base + o_off, ref, T * H))
                status = 1;
        }
        free(ids);
        free(w);
        free(ref);
        host_weights_done(&hw);
    }
out:
    st_close(&in);
    if (r)
        moe_region_free(cl, &r);
    moe_disconnect(&cl);
    return status;
}

int cmd_gemm(const char *rt, int argc, char **argv)
{
    static const struct option o[] = {
        {"layer", required_argument, NULL, 'l'}, {"rows", required_argument, NULL, 'm'},
        {"check", no_argument, NULL, 'c'},       {"seed", required_argument, NULL, 's'}, {0},
    };
    const char *layer = NULL;
    uint64_t rows = 0, seed = 0;
    int check = 0, c, rc, status = 1;
    while ((c = getopt_long(argc, argv, "", o, NULL)) != -1) {
        switch (c) {
        case 'l': layer = optarg; break;
        case 'm': rows = moectl_num("--rows", optarg, 1, MOECTL_MAX_TOKENS); break;
        case 'c': check = 1; break;
        case 's': seed = moectl_num("--seed", optarg, 0, UINT64_MAX); break;
        default: return 2;
        }
    }
    if (moectl_no_more_args(argc, argv, optind))
        return 2;
    if (!layer || !rows) {
        fprintf(stderr, "usage: moectl gemm --layer L --rows M [--check]\n");
        return 2;
    }
    if (!seed)
        seed = moectl_now_us() | 1;
    moe_client *cl = moectl_connect(rt, "moectl gemm");
    if (!cl)
        return 1;
    moe_layer_info li;
    moe_region *r = NULL;
    uint64_t *m_sizes = NULL;
    if (moectl_layer(cl, layer, &li))
        goto out;
    if (li.kind != MOE_LAYER_GEMM) {
        fprintf(stderr, "moectl: '%s' is a MoE layer; use 'moectl forward'\n", layer);
        goto out;
    }
    size_t G = li.groups, N = li.n, K = li.k, M = rows, es = moe_dtype_size(li.dtype);
    /* Rows land in about half of the groups: empty groups are the point. */
    m_sizes = calloc(G, sizeof(*m_sizes));
    int64_t *ms64 = calloc(G, sizeof(*ms64));
    if (!m_sizes || !ms64) {
        free(ms64);
        goto out;
    }
    for (size_t i = 0; i < M; i++) {
        size_t g = (size_t)(rng_next(&seed) % G);
        if (G > 1 && (g & 1))
            g -= 1;
        m_sizes[g]++;
    }
    for (size_t g = 0; g < G; g++)
        ms64[g] = (int64_t)m_sizes[g];
    size_t c_off = align64(M * K * es), size = c_off + align64(M * N * es);
    if ((rc = moe_region_create(cl, size, "moectl-gemm", &r)) < 0) {
        free(ms64);
        moectl_fail("create region", rc);
        goto out;
    }
    uint8_t *base = moe_region_data(r);
    float *tmp = malloc(M * K * sizeof(float));
    for (size_t i = 0; tmp && i < M * K; i++)
        tmp[i] = rng_unit(&seed);
    if (tmp)
        moek_from_f32(kdt(li.dtype), tmp, base, M * K);
    free(tmp);
    memset(base + c_off, 0xff, M * N * es);
    moe_gemm_args a = {.layer = layer,
                       .a = moe_tensor_2d(r, 0, li.dtype, M, K),
                       .c = moe_tensor_2d(r, c_off, li.dtype, M, N),
                       .m_sizes = m_sizes,
                       .groups = G};
    moe_timings tm;
    uint64_t t0 = moectl_now_us();
    if ((rc = moe_gemm(cl, &a, &tm)) < 0) {
        free(ms64);
        moectl_fail("gemm", rc);
        goto out;
    }
    printf("gemm: layer %s, %zu rows over %zu groups: round trip %llu us, daemon compute %llu us\n",
           layer, M, G, (unsigned long long)(moectl_now_us() - t0),
           (unsigned long long)tm.compute_us);
    status = 0;
    if (check) {
        struct host_weights hw;
        void *ref = malloc(M * N * es);
        if (!ref || read_layer_weights(&li, &hw)) {
            free(ref);
            free(ms64);
            status = 1;
            goto out;
        }
        int rrc = moek_ref_grouped_gemm(kdt(li.dtype), (int)G, (int)N, (int)K, base, ms64,
                                        hw.w1, ref);
        status = check_report("gemm", rrc, li.dtype, base + c_off, ref, M * N);
        free(ref);
        host_weights_done(&hw);
    }
    free(ms64);
out:
    free(m_sizes);
    if (r)
        moe_region_free(cl, &r);
    moe_disconnect(&cl);
    return status;
}
