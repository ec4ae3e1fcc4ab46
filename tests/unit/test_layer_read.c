/*
 * test_layer_read.c: daemon/layer_read.c, reading a layer's weights from a
 * safetensors file under an allowed directory. The files are written here
 * with st_write() from random data, in both naming schemes (Mixtral's
 * w1/w3/w2, Qwen's gate_proj/up_proj/down_proj), with and without a prefix,
 * and the stacked buffers are compared byte for byte with what was written.
 *
 * The path checks are the daemon's line between "load a layer" and "read any
 * file on the machine": paths outside the allowed directories, symlinks and
 * ".." that lead out, and not saying whether a file outside exists.
 */
#include "tests/unit/unit.h"
#include "daemon/layer.h"
#include "daemon/safetensors.h"
#include "moe.pb-c.h"
#include "moe_kernels.h"

#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>


/* ---- helpers ------------------------------------------------------------ */


/* A fresh directory with "allowed" and "outside" below it. */
static const char *tmp_dir(void)
{
    char sub[128];
    const char *dir = tmp_dir_new("layer");
    snprintf(sub, sizeof(sub), "%s/allowed", dir);
    CHECK(mkdir(sub, 0700) == 0);
    snprintf(sub, sizeof(sub), "%s/outside", dir);
    CHECK(mkdir(sub, 0700) == 0);
    return dir;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

static moek_dtype st_to_moek(enum st_dtype dt)
{
    return dt == ST_BF16 ? MOEK_DTYPE_BF16 : dt == ST_F16 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_FP32;
}

static int st_to_wire(enum st_dtype dt)
{
    return dt == ST_BF16 ? MOE__DTYPE__DTYPE_BF16
         : dt == ST_F16  ? MOE__DTYPE__DTYPE_FP16
                         : MOE__DTYPE__DTYPE_FP32;
}

static moek_dtype wire_to_moek(int d)
{
    return d == MOE__DTYPE__DTYPE_BF16 ? MOEK_DTYPE_BF16
         : d == MOE__DTYPE__DTYPE_FP16 ? MOEK_DTYPE_FP16
                                       : MOEK_DTYPE_FP32;
}

/* The tensors of a file to write. */
#define TF_MAX 96
struct tfile {
    size_t n;
    struct st_out t[TF_MAX];
    char names[TF_MAX][160];
    void *data[TF_MAX];
};

/* Add a tensor of random contents; returns its bytes (owned by tf). For
 * BF16/F16/F32 the contents are random values in [-1, 1), else random bytes. */
static void *tf_add(struct tfile *tf, uint64_t *s, const char *name, enum st_dtype dt,
                    int ndim, const uint64_t *shape)
{
    CHECK(tf->n < TF_MAX);
    size_t i = tf->n++;
    snprintf(tf->names[i], sizeof(tf->names[i]), "%s", name);
    struct st_out *t = &tf->t[i];
    memset(t, 0, sizeof(*t));
    t->name = tf->names[i];
    t->dtype = dt;
    t->ndim = ndim;
    uint64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        t->shape[d] = shape[d];
        numel *= shape[d];
    }
    void *buf = xmalloc(numel * st_dtype_size(dt));
    if (dt == ST_BF16 || dt == ST_F16 || dt == ST_F32) {
        float *f = xmalloc(numel * sizeof(float));
        for (uint64_t k = 0; k < numel; k++)
            f[k] = test_randf(s);
        moek_from_f32(st_to_moek(dt), f, buf, numel);
        free(f);
    } else {
        for (uint64_t k = 0; k < numel * st_dtype_size(dt); k++)
            ((uint8_t *)buf)[k] = (uint8_t)(test_rand(s) >> 56);
    }
    t->data = buf;
    tf->data[i] = buf;
    return buf;
}

static void tf_write(struct tfile *tf, const char *path)
{
    CHECK_EQ_INT(st_write(path, tf->t, tf->n), 0);
}

static void tf_free(struct tfile *tf)
{
    for (size_t i = 0; i < tf->n; i++)
        free(tf->data[i]);
    tf->n = 0;
}

/* The stacked buffers a MoE layer should read back as (in the file's dtype). */
struct stacked {
    enum st_dtype dt;
    uint32_t E, H, I;
    uint8_t *w[3]; /* w1 [E,I,H], w3 [E,I,H], w2 [E,H,I] */
    uint64_t bytes; /* per buffer */
};

static const char *const schemes[2][3] = {{"w1", "w3", "w2"}, {"gate_proj", "up_proj", "down_proj"}};

/* Add E experts' tensors under prefix in naming scheme sch; fill *st. skip
 * names one tensor ("e.part", e.g. "1.w3") to leave out, or NULL. */
static void add_experts(struct tfile *tf, uint64_t *s, const char *prefix, int sch,
                        enum st_dtype dt, uint32_t E, uint32_t H, uint32_t I,
                        struct stacked *st, const char *skip)
{
    st->dt = dt;
    st->E = E;
    st->H = H;
    st->I = I;
    uint64_t per = (uint64_t)H * I * st_dtype_size(dt);
    st->bytes = per * E;
    for (int p = 0; p < 3; p++)
        st->w[p] = xmalloc(st->bytes);
    /* Written in the file in a scrambled order: down first, experts backwards. */
    for (int e = (int)E - 1; e >= 0; e--)
        for (int p = 2; p >= 0; p--) {
            char name[160], tag[32];
            snprintf(tag, sizeof(tag), "%d.%s", e, schemes[sch][p]);
            snprintf(name, sizeof(name), "%sexperts.%d.%s.weight", prefix, e, schemes[sch][p]);
            uint64_t shape[2] = {p < 2 ? I : H, p < 2 ? H : I};
            void *d = tf_add(tf, s, name, dt, 2, shape);
            memcpy(st->w[p] + (uint64_t)e * per, d, per);
            if (skip && strcmp(skip, tag) == 0)
                tf->n--, free(d);
        }
}

static void stacked_free(struct stacked *st)
{
    for (int p = 0; p < 3; p++)
        free(st->w[p]);
}

/* Convert n elements from one dtype to another the way the loader must:
 * through fp32. */
static void *convert(enum st_dtype from, int to_wire, const void *src, uint64_t n)
{
    float *f = xmalloc(n * sizeof(float));
    moek_to_f32(st_to_moek(from), src, f, n);
    void *out = xmalloc(n * moek_dtype_size(wire_to_moek(to_wire)));
    moek_from_f32(wire_to_moek(to_wire), f, out, n);
    free(f);
    return out;
}

struct env {
    char dir[128], allowed[160], outside[160];
    char *allow[1];
};

static void env_init(struct env *v)
{
    snprintf(v->dir, sizeof(v->dir), "%s", tmp_dir());
    snprintf(v->allowed, sizeof(v->allowed), "%s/allowed", v->dir);
    snprintf(v->outside, sizeof(v->outside), "%s/outside", v->dir);
    v->allow[0] = v->allowed;
}

/* Read with the given spec; on error check the code and that err says so.
 * The header-only check (layer_check_weights) must come to the same answer
 * in the same words. */
static int read_layer(const struct env *v, const struct layer_spec *spec, struct host_weights *w,
                      char *err, size_t errlen)
{
    char why[512] = "";
    struct host_weights hw;
    int want = layer_check_weights(spec, (char *const *)v->allow, 1, &hw, why, sizeof(why));
    CHECK(hw.w1 == NULL && hw.w3 == NULL && hw.w2 == NULL); /* nothing read */
    err[0] = '\0';
    memset(w, 0xa5, sizeof(*w));
    int rc = layer_read_weights(spec, (char *const *)v->allow, 1, w, err, errlen);
    if (rc != 0) {
        CHECK_MSG(err[0] != '\0', "rc %d with an empty message", rc);
        CHECK(w->w1 == NULL && w->w3 == NULL && w->w2 == NULL);
    }
    CHECK_MSG(want == rc && !strcmp(why, err), "check %d '%s', read %d '%s'", want, why, rc, err);
    if (rc == 0) /* and the same layer */
        CHECK(hw.dtype == w->dtype && hw.experts == w->experts && hw.hidden == w->hidden &&
              hw.intermediate == w->intermediate && hw.groups == w->groups && hw.n == w->n &&
              hw.k == w->k && hw.bytes == w->bytes && !strcmp(hw.source, w->source));
    return rc;
}

static void check_moe(const struct host_weights *w, const struct stacked *st, int want_wire)
{
    CHECK_EQ_INT(w->experts, st->E);
    CHECK_EQ_INT(w->hidden, st->H);
    CHECK_EQ_INT(w->intermediate, st->I);
    CHECK_EQ_INT(w->dtype, want_wire);
    uint64_t n = (uint64_t)st->E * st->H * st->I;
    uint64_t bytes = n * moek_dtype_size(wire_to_moek(want_wire));
    CHECK_EQ_INT(w->bytes, 3 * bytes);
    const void *got[3] = {w->w1, w->w3, w->w2};
    for (int p = 0; p < 3; p++) {
        CHECK(got[p] != NULL);
        if (want_wire == st_to_wire(st->dt)) {
            CHECK_MSG(memcmp(got[p], st->w[p], bytes) == 0, "part %d differs", p);
        } else {
            void *want = convert(st->dt, want_wire, st->w[p], n);
            CHECK_MSG(memcmp(got[p], want, bytes) == 0, "part %d differs after conversion", p);
            free(want);
        }
    }
}

/* ---- MoE layers ----------------------------------------------------------- */

/* Mixtral naming, a prefix, the shape given: every file dtype reads back
 * byte for byte in its own dtype. */
TEST(mixtral_named_each_dtype)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    const enum st_dtype dts[3] = {ST_BF16, ST_F16, ST_F32};
    const char *prefix = "model.layers.0.block_sparse_moe.";
    for (int k = 0; k < 3; k++) {
        struct tfile tf = {0};
        struct stacked st;
        uint64_t router[2] = {3, 8};
        tf_add(&tf, &s, "model.layers.0.block_sparse_moe.gate.weight", dts[k], 2, router);
        add_experts(&tf, &s, prefix, 0, dts[k], 3, 8, 12, &st, NULL);
        char path[256];
        snprintf(path, sizeof(path), "%s/mixtral-%d.safetensors", v.allowed, k);
        tf_write(&tf, path);

        struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .experts = 3, .topk = 2,
                                  .hidden = 8, .intermediate = 12, .path = path, .prefix = prefix};
        struct host_weights w;
        char err[512];
        int rc = read_layer(&v, &spec, &w, err, sizeof(err));
        CHECK_MSG(rc == 0, "%s: %d %s", st_dtype_name(dts[k]), rc, err);
        check_moe(&w, &st, st_to_wire(dts[k]));
        char want[600];
        snprintf(want, sizeof(want), "%s:%s", path, prefix);
        CHECK_STR_EQ(w.source, want);
        host_weights_done(&w);
        CHECK(w.w1 == NULL && w.w3 == NULL && w.w2 == NULL);
        host_weights_done(&w); /* twice is fine */
        stacked_free(&st);
        tf_free(&tf);
    }
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* Qwen naming, E/H/I inferred from the file, two layers in one file: the
 * prefix picks the right one. */
TEST(qwen_named_inferred)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    for (int it = 0; it < 4; it++) {
        uint32_t E = 1 + (uint32_t)(test_rand(&s) % 6);
        uint32_t H = 1 + (uint32_t)(test_rand(&s) % 24);
        uint32_t I = 1 + (uint32_t)(test_rand(&s) % 24);
        enum st_dtype dt = (enum st_dtype[]){ST_BF16, ST_F16, ST_F32}[test_rand(&s) % 3];
        struct tfile tf = {0};
        struct stacked l0, l1;
        add_experts(&tf, &s, "model.layers.0.mlp.", 1, dt, E + 1, H, I, &l0, NULL);
        add_experts(&tf, &s, "model.layers.1.mlp.", 1, dt, E, H, I, &l1, NULL);
        uint64_t shared[2] = {I, H};
        tf_add(&tf, &s, "model.layers.1.mlp.shared_expert.gate_proj.weight", dt, 2, shared);
        char path[256];
        snprintf(path, sizeof(path), "%s/qwen.safetensors", v.allowed);
        tf_write(&tf, path);

        struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = path,
                                  .prefix = "model.layers.1.mlp."};
        struct host_weights w;
        char err[512];
        int rc = read_layer(&v, &spec, &w, err, sizeof(err));
        CHECK_MSG(rc == 0, "%d %s", rc, err);
        check_moe(&w, &l1, st_to_wire(dt));
        host_weights_done(&w);

        spec.prefix = "model.layers.0.mlp.";
        CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
        check_moe(&w, &l0, st_to_wire(dt));
        host_weights_done(&w);
        stacked_free(&l0);
        stacked_free(&l1);
        tf_free(&tf);
    }
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* No prefix at all (prefix NULL and ""), Mixtral naming. */
TEST(no_prefix)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    struct tfile tf = {0};
    struct stacked st;
    add_experts(&tf, &s, "", 0, ST_BF16, 4, 16, 8, &st, NULL);
    char path[256];
    snprintf(path, sizeof(path), "%s/bare.safetensors", v.allowed);
    tf_write(&tf, path);
    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = path};
    struct host_weights w;
    char err[512];
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    check_moe(&w, &st, MOE__DTYPE__DTYPE_BF16);
    CHECK_STR_EQ(w.source, path);
    host_weights_done(&w);
    spec.prefix = "";
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    check_moe(&w, &st, MOE__DTYPE__DTYPE_BF16);
    host_weights_done(&w);
    /* Fewer experts than the file has: the first ones. */
    spec.experts = 2;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    st.E = 2;
    check_moe(&w, &st, MOE__DTYPE__DTYPE_BF16);
    host_weights_done(&w);
    stacked_free(&st);
    tf_free(&tf);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* A requested dtype other than the file's: converted through fp32. */
TEST(dtype_conversion)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    const enum st_dtype from[3] = {ST_BF16, ST_F16, ST_F32};
    const int to[3] = {MOE__DTYPE__DTYPE_BF16, MOE__DTYPE__DTYPE_FP16, MOE__DTYPE__DTYPE_FP32};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            struct tfile tf = {0};
            struct stacked st;
            add_experts(&tf, &s, "m.", a % 2, from[a], 3, 8, 12, &st, NULL);
            char path[256];
            snprintf(path, sizeof(path), "%s/conv.safetensors", v.allowed);
            tf_write(&tf, path);
            struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .dtype = to[b],
                                      .path = path, .prefix = "m."};
            struct host_weights w;
            char err[512];
            CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
            check_moe(&w, &st, to[b]);
            if (from[a] == ST_F32 && to[b] == MOE__DTYPE__DTYPE_BF16) {
                /* The plain statement: equals moek_from_f32 of the fp32 data. */
                uint64_t n = 3 * 8 * 12;
                uint16_t *want = xmalloc(n * 2);
                moek_from_f32(MOEK_DTYPE_BF16, (const float *)st.w[2], want, n);
                CHECK(memcmp(w.w2, want, n * 2) == 0);
                free(want);
            }
            host_weights_done(&w);
            stacked_free(&st);
            tf_free(&tf);
        }
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* ---- GEMM layers ------------------------------------------------------------ */

TEST(gemm_by_exact_name)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    struct tfile tf = {0};
    uint64_t G = 1 + test_rand(&s) % 4, N = 1 + test_rand(&s) % 16, K = 1 + test_rand(&s) % 16;
    uint64_t shape[3] = {G, N, K}, other[3] = {G, K, N}, two[2] = {N, K};
    /* Decoys whose names share a prefix with the one asked for. */
    tf_add(&tf, &s, "proj", ST_BF16, 3, other);
    tf_add(&tf, &s, "proj.weight.scale", ST_BF16, 3, other);
    void *b = tf_add(&tf, &s, "proj.weight", ST_BF16, 3, shape);
    tf_add(&tf, &s, "flat.weight", ST_BF16, 2, two);
    tf_add(&tf, &s, "ints", ST_I32, 3, shape);
    void *b32 = tf_add(&tf, &s, "proj32", ST_F32, 3, shape);
    char path[256];
    snprintf(path, sizeof(path), "%s/gemm.safetensors", v.allowed);
    tf_write(&tf, path);

    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_GEMM, .path = path,
                              .prefix = "proj.weight"};
    struct host_weights w;
    char err[512];
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    CHECK_EQ_INT(w.groups, G);
    CHECK_EQ_INT(w.n, N);
    CHECK_EQ_INT(w.k, K);
    CHECK_EQ_INT(w.dtype, MOE__DTYPE__DTYPE_BF16);
    CHECK_EQ_INT(w.bytes, G * N * K * 2);
    CHECK(memcmp(w.w1, b, G * N * K * 2) == 0);
    CHECK(w.w3 == NULL && w.w2 == NULL);
    host_weights_done(&w);

    /* The shape given and matching; given and not matching. */
    spec.groups = (uint32_t)G;
    spec.n = (uint32_t)N;
    spec.k = (uint32_t)K;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    host_weights_done(&w);
    spec.k = (uint32_t)K + 1;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "not the given shape");
    spec.groups = spec.n = spec.k = 0;

    /* fp32 read as bf16. */
    spec.prefix = "proj32";
    spec.dtype = MOE__DTYPE__DTYPE_BF16;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    uint16_t *want = xmalloc(G * N * K * 2);
    moek_from_f32(MOEK_DTYPE_BF16, b32, want, G * N * K);
    CHECK_EQ_INT(w.bytes, G * N * K * 2);
    CHECK(memcmp(w.w1, want, G * N * K * 2) == 0);
    free(want);
    host_weights_done(&w);
    spec.dtype = 0;

    /* Missing, not 3-D, unsupported dtype. */
    spec.prefix = "proj.weigh";
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "'proj.weigh' is missing");
    spec.prefix = "flat.weight";
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "[G, N, K]");
    spec.prefix = "ints";
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -ENOTSUP);
    CHECK_STR_CONTAINS(err, "I32");
    spec.dtype = MOE__DTYPE__DTYPE_BF16;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -ENOTSUP);
    tf_free(&tf);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* ---- errors in the file --------------------------------------------------- */

TEST(error_missing_tensor)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    char path[256], err[512];
    struct host_weights w;
    snprintf(path, sizeof(path), "%s/m.safetensors", v.allowed);
    static const char *const gaps[][2] = {
        {"1.w3", "model.experts.1.w3.weight is missing"},
        {"2.w2", "model.experts.2.w2.weight is missing"},
        {"1.w1", "model.experts.1.w1.weight is missing"},
    };
    for (size_t i = 0; i < ARRAY_LEN(gaps); i++) {
        struct tfile tf = {0};
        struct stacked st;
        add_experts(&tf, &s, "model.", 0, ST_BF16, 3, 8, 12, &st, gaps[i][0]);
        tf_write(&tf, path);
        struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .experts = 3,
                                  .path = path, .prefix = "model."};
        CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
        CHECK_STR_CONTAINS(err, gaps[i][1]);
        stacked_free(&st);
        tf_free(&tf);
    }

    /* Inferred E stops at the first gap in w1: a file with experts 0, 1 and
     * 3 reads as two experts. */
    struct tfile tf = {0};
    struct stacked st;
    add_experts(&tf, &s, "model.", 0, ST_F32, 4, 8, 12, &st, "2.w1");
    tf_write(&tf, path);
    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = path, .prefix = "model."};
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    CHECK_EQ_INT(w.experts, 2);
    host_weights_done(&w);
    /* topk above the experts read. */
    spec.topk = 3;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "topk 3 is above the layer's 2 experts");
    spec.topk = 2;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    host_weights_done(&w);
    /* More experts asked for than the file has. */
    spec.experts = 5;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "model.experts.2.w1.weight is missing");
    stacked_free(&st);
    tf_free(&tf);

    /* No expert tensors under this prefix at all. */
    add_experts(&tf, &s, "model.", 0, ST_F32, 2, 8, 12, &st, NULL);
    tf_write(&tf, path);
    spec.experts = 0;
    spec.prefix = "model.layers.9.";
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "model.layers.9.experts.0.w1.weight");
    CHECK_STR_CONTAINS(err, "model.layers.9.experts.0.gate_proj.weight");
    /* A prefix without its trailing dot is a different prefix. */
    spec.prefix = "model";
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    stacked_free(&st);
    tf_free(&tf);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(error_wrong_shape)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    char path[256], err[512];
    struct host_weights w;
    snprintf(path, sizeof(path), "%s/m.safetensors", v.allowed);

    /* Expert 2's down projection transposed ([I, H] instead of [H, I]). */
    struct tfile tf = {0};
    struct stacked st;
    add_experts(&tf, &s, "p.", 1, ST_BF16, 3, 8, 12, &st, "2.down_proj");
    uint64_t bad[2] = {12, 8};
    tf_add(&tf, &s, "p.experts.2.down_proj.weight", ST_BF16, 2, bad);
    tf_write(&tf, path);
    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = path, .prefix = "p."};
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "p.experts.2.down_proj.weight");
    CHECK_STR_CONTAINS(err, "[8, 12]");
    stacked_free(&st);
    tf_free(&tf);

    /* A complete file, read with a hidden or intermediate size it does not have. */
    add_experts(&tf, &s, "p.", 1, ST_BF16, 3, 8, 12, &st, NULL);
    tf_write(&tf, path);
    spec.hidden = 9;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "H=9");
    spec.hidden = 8;
    spec.intermediate = 8;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    spec.intermediate = 12;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), 0);
    check_moe(&w, &st, MOE__DTYPE__DTYPE_BF16);
    host_weights_done(&w);
    stacked_free(&st);
    tf_free(&tf);

    /* Expert 1's up projection has one element too many in its second dim. */
    add_experts(&tf, &s, "p.", 0, ST_F16, 2, 8, 12, &st, "1.w3");
    uint64_t wide[2] = {12, 9};
    tf_add(&tf, &s, "p.experts.1.w3.weight", ST_F16, 2, wide);
    tf_write(&tf, path);
    spec.hidden = spec.intermediate = 0;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "p.experts.1.w3.weight");
    stacked_free(&st);
    tf_free(&tf);

    /* Expert 0's gate is not a matrix. */
    uint64_t cube[3] = {2, 12, 8};
    tf_add(&tf, &s, "p.experts.0.w1.weight", ST_BF16, 3, cube);
    tf_write(&tf, path);
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "not a matrix");
    tf_free(&tf);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(error_unsupported_dtype)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    char path[256], err[512];
    struct host_weights w;
    snprintf(path, sizeof(path), "%s/m.safetensors", v.allowed);
    const enum st_dtype bad[] = {ST_I32, ST_F64, ST_U8, ST_F8_E4M3};
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        struct tfile tf = {0};
        struct stacked st;
        add_experts(&tf, &s, "x.", (int)(i % 2), bad[i], 2, 4, 6, &st, NULL);
        tf_write(&tf, path);
        struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = path, .prefix = "x."};
        CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -ENOTSUP);
        CHECK_STR_CONTAINS(err, st_dtype_name(bad[i]));
        stacked_free(&st);
        tf_free(&tf);
    }
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(error_truncated_or_not_safetensors)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    char path[256], err[512];
    struct host_weights w;
    snprintf(path, sizeof(path), "%s/m.safetensors", v.allowed);
    struct tfile tf = {0};
    struct stacked st;
    add_experts(&tf, &s, "", 0, ST_BF16, 3, 8, 12, &st, NULL);
    tf_write(&tf, path);
    struct stat sb;
    CHECK(stat(path, &sb) == 0);
    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = path};
    /* One byte short, half the file, the header only, 4 bytes. */
    const off_t cuts[] = {sb.st_size - 1, sb.st_size / 2, 8 + 16, 4, 0};
    for (size_t i = 0; i < ARRAY_LEN(cuts); i++) {
        CHECK(truncate(path, cuts[i]) == 0);
        CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EIO);
        CHECK_STR_CONTAINS(err, "not a valid safetensors file");
    }
    /* Not safetensors at all. */
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL);
    fputs("PK\003\004 this is a zip file, or a pickle, or anything", fp);
    fclose(fp);
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EIO);
    /* A directory inside the allowed one. */
    char sub[256];
    snprintf(sub, sizeof(sub), "%s/sub", v.allowed);
    CHECK(mkdir(sub, 0700) == 0);
    spec.path = sub;
    CHECK_EQ_INT(read_layer(&v, &spec, &w, err, sizeof(err)), -EIO);
    stacked_free(&st);
    tf_free(&tf);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* ---- paths ---------------------------------------------------------------- */

/* A small valid layer at path. */
static void small_layer(uint64_t *s, const char *path)
{
    struct tfile tf = {0};
    struct stacked st;
    add_experts(&tf, s, "", 0, ST_BF16, 1, 2, 2, &st, NULL);
    tf_write(&tf, path);
    stacked_free(&st);
    tf_free(&tf);
}

static int read_path(const char *path, char *const *allow, size_t n_allow,
                     char *err, size_t errlen)
{
    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = path};
    struct host_weights w;
    err[0] = '\0';
    int rc = layer_read_weights(&spec, allow, n_allow, &w, err, errlen);
    if (rc == 0)
        host_weights_done(&w);
    else
        CHECK_MSG(err[0] != '\0', "rc %d with an empty message for %s", rc, path ? path : "(null)");
    return rc;
}

TEST(paths_allowed_and_not)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    char in[256], out[256], p[512], err[512];
    snprintf(in, sizeof(in), "%s/in.safetensors", v.allowed);
    snprintf(out, sizeof(out), "%s/out.safetensors", v.outside);
    small_layer(&s, in);
    small_layer(&s, out);
    char *const *allow = v.allow;

    /* Inside: fine. Through "." and a ".." that stays inside: fine. */
    CHECK_EQ_INT(read_path(in, allow, 1, err, sizeof(err)), 0);
    snprintf(p, sizeof(p), "%s/./../allowed/in.safetensors", v.allowed);
    CHECK_EQ_INT(read_path(p, allow, 1, err, sizeof(err)), 0);

    /* Outside. */
    CHECK_EQ_INT(read_path(out, allow, 1, err, sizeof(err)), -EACCES);
    CHECK_STR_CONTAINS(err, "outside the allowed directories");
    /* "/allowed/../outside/file". */
    snprintf(p, sizeof(p), "%s/../outside/out.safetensors", v.allowed);
    CHECK_EQ_INT(read_path(p, allow, 1, err, sizeof(err)), -EACCES);
    /* A symlink inside the allowed directory pointing outside. */
    snprintf(p, sizeof(p), "%s/link.safetensors", v.allowed);
    CHECK(symlink(out, p) == 0);
    CHECK_EQ_INT(read_path(p, allow, 1, err, sizeof(err)), -EACCES);
    /* A symlinked directory inside pointing outside. */
    snprintf(p, sizeof(p), "%s/dirlink", v.allowed);
    CHECK(symlink(v.outside, p) == 0);
    snprintf(p, sizeof(p), "%s/dirlink/out.safetensors", v.allowed);
    CHECK_EQ_INT(read_path(p, allow, 1, err, sizeof(err)), -EACCES);
    /* A sibling whose name starts with the allowed one's. */
    char sib[256];
    snprintf(sib, sizeof(sib), "%s2", v.allowed);
    CHECK(mkdir(sib, 0700) == 0);
    snprintf(p, sizeof(p), "%s/in.safetensors", sib);
    small_layer(&s, p);
    CHECK_EQ_INT(read_path(p, allow, 1, err, sizeof(err)), -EACCES);
    /* The allowed directory itself is not "under" it. */
    CHECK_EQ_INT(read_path(v.allowed, allow, 1, err, sizeof(err)), -EACCES);

    /* A symlink inside pointing to a file inside: fine, and the source is
     * the canonical target. */
    snprintf(p, sizeof(p), "%s/alias.safetensors", v.allowed);
    CHECK(symlink(in, p) == 0);
    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .path = p};
    struct host_weights w;
    CHECK_EQ_INT(layer_read_weights(&spec, allow, 1, &w, err, sizeof(err)), 0);
    CHECK_STR_EQ(w.source, in);
    host_weights_done(&w);

    /* Not there: inside says so, outside does not. */
    snprintf(p, sizeof(p), "%s/missing.safetensors", v.allowed);
    CHECK_EQ_INT(read_path(p, allow, 1, err, sizeof(err)), -ENOENT);
    snprintf(p, sizeof(p), "%s/missing.safetensors", v.outside);
    CHECK_EQ_INT(read_path(p, allow, 1, err, sizeof(err)), -EACCES);
    CHECK(strstr(err, "no such") == NULL);

    /* Relative paths, no path, no allowed directories. */
    CHECK_EQ_INT(read_path("allowed/in.safetensors", allow, 1, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "absolute");
    CHECK_EQ_INT(read_path("", allow, 1, err, sizeof(err)), -EINVAL);
    CHECK_EQ_INT(read_path(NULL, allow, 1, err, sizeof(err)), -EINVAL);
    CHECK_EQ_INT(read_path(in, NULL, 0, err, sizeof(err)), -EACCES);
    CHECK_STR_CONTAINS(err, "allowed_dirs");

    /* Several allowed directories: any of them; "/" allows everything. */
    char *two[2] = {sib, v.outside};
    CHECK_EQ_INT(read_path(out, two, 2, err, sizeof(err)), 0);
    CHECK_EQ_INT(read_path(in, two, 2, err, sizeof(err)), -EACCES);
    char root[] = "/";
    char *all[1] = {root};
    CHECK_EQ_INT(read_path(out, all, 1, err, sizeof(err)), 0);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* layer_open_allowed itself: an fd for the canonical file, or nothing. */
TEST(open_allowed_fd)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    char in[256], p[512], canon[PATH_MAX], err[512];
    snprintf(in, sizeof(in), "%s/in.safetensors", v.allowed);
    small_layer(&s, in);
    snprintf(p, sizeof(p), "%s/../allowed/./in.safetensors", v.allowed);
    int fd = layer_open_allowed(p, v.allow, 1, canon, sizeof(canon), err, sizeof(err));
    CHECK_MSG(fd >= 0, "%d %s", fd, err);
    CHECK_STR_EQ(canon, in);
    struct stat a, b;
    CHECK(fstat(fd, &a) == 0 && stat(in, &b) == 0);
    CHECK(a.st_ino == b.st_ino && a.st_dev == b.st_dev);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    close(fd);
    snprintf(p, sizeof(p), "%s/x", v.outside);
    CHECK_EQ_INT(layer_open_allowed(p, v.allow, 1, canon, sizeof(canon), err, sizeof(err)), -EACCES);
    /* Neither a regular file nor openable (a socket: ENXIO): the file's
     * fault, -EIO, not an error of the daemon's. A FIFO opens (without
     * waiting for a writer) and is refused as not regular. */
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    CHECK(snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/sock", v.allowed) < (int)sizeof(sa.sun_path));
    int sk = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(sk >= 0 && bind(sk, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    CHECK_EQ_INT(layer_open_allowed(sa.sun_path, v.allow, 1, canon, sizeof(canon), err,
                                    sizeof(err)), -EIO);
    CHECK_STR_CONTAINS(err, "not a readable regular file");
    close(sk);
    snprintf(p, sizeof(p), "%s/fifo", v.allowed);
    CHECK(mkfifo(p, 0600) == 0);
    CHECK_EQ_INT(layer_open_allowed(p, v.allow, 1, canon, sizeof(canon), err, sizeof(err)), -EIO);
    CHECK_STR_CONTAINS(err, "not a regular file");
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* Whether a file outside the allowed directories exists must not show in
 * the answer, whichever way the path gets there. */
TEST(no_existence_leak)
{
    uint64_t s = test_seed();
    struct env v;
    env_init(&v);
    char out[256], p[512], err[512];
    snprintf(out, sizeof(out), "%s/out.safetensors", v.outside);
    small_layer(&s, out);
    /* "/allowed/../outside/missing" against "/allowed/../outside/existing". */
    snprintf(p, sizeof(p), "%s/../outside/out.safetensors", v.allowed);
    CHECK_EQ_INT(read_path(p, v.allow, 1, err, sizeof(err)), -EACCES);
    snprintf(p, sizeof(p), "%s/../outside/missing.safetensors", v.allowed);
    CHECK_EQ_INT(read_path(p, v.allow, 1, err, sizeof(err)), -EACCES);
    /* A dangling symlink inside, pointing at a missing file outside. */
    snprintf(p, sizeof(p), "%s/dangling", v.allowed);
    char target[300];
    snprintf(target, sizeof(target), "%s/missing.safetensors", v.outside);
    CHECK(symlink(target, p) == 0);
    CHECK_EQ_INT(read_path(p, v.allow, 1, err, sizeof(err)), -EACCES);
    /* A missing file directly inside still says so. */
    snprintf(p, sizeof(p), "%s/missing.safetensors", v.allowed);
    CHECK_EQ_INT(read_path(p, v.allow, 1, err, sizeof(err)), -ENOENT);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(mixtral_named_each_dtype),
        TEST_CASE(qwen_named_inferred),
        TEST_CASE(no_prefix),
        TEST_CASE(dtype_conversion),
        TEST_CASE(gemm_by_exact_name),
        TEST_CASE(error_missing_tensor),
        TEST_CASE(error_wrong_shape),
        TEST_CASE(error_unsupported_dtype),
        TEST_CASE(error_truncated_or_not_safetensors),
        TEST_CASE(paths_allowed_and_not),
        TEST_CASE(open_allowed_fd),
        TEST_CASE(no_existence_leak),
        {0}});
}
