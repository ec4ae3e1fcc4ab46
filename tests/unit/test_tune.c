/*
 * test_tune.c: daemon/tune.c, the body of `moed --tune`, on a fake backend
 * whose moe_tune returns made-up timings (the real measurement is the CUDA
 * kernel test's moe_autotune case): the options' parsers, the default token
 * counts, the shapes of configured layers read from their files' headers,
 * the rules made from the timings, the report, the merge into the table
 * file, a shape that fails, and the refusals (a backend that cannot tune, a
 * malformed table, no table, nothing to tune).
 */
#include "tests/unit/unit.h"
#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/layer.h"
#include "daemon/safetensors.h"
#include "daemon/tiles.h"
#include "daemon/tune.h"
#include "moe.pb-c.h"

/* ---- a backend that pretends to measure ------------------------------------ */

struct fake {
    struct backend base;
    int calls;
    bool broken;
};

/* Tile 16 is fastest below 8 tokens, 64 from 8, 256 from 64, except that
 * a shape with H = 1024 prefers 32 everywhere. E = 13 fails; E = 14 fails
 * and leaves the device unusable. The heuristic says 32. */
static int fake_tune(struct backend *b, const moek_moe_shape *s, moek_dtype dt, const int *tokens,
                     int n, struct backend_tune *out, char *err, size_t errlen)
{
    struct fake *f = (struct fake *)b;
    f->calls++;
    if (s->experts == 13 || s->experts == 14) {
        f->broken = s->experts == 14;
        snprintf(err, errlen, "shape not supported here");
        return -ENOTSUP;
    }
    snprintf(out->device, sizeof(out->device), "Fake GPU 9000");
    out->n = n;
    for (int i = 0; i < n; i++) {
        int T = tokens[i];
        int best = s->hidden == 1024 ? 32 : T < 8 ? 16 : T < 64 ? 64 : 256;
        out->tokens[i] = T;
        out->best[i] = best;
        out->heuristic[i] = 32;
        for (int j = 0; j < TILES_N_OFFERED; j++)
            out->us[i][j] = tiles_offered[j] == best ? 10.0f : 20.0f + (float)j;
    }
    return 0;
}

static bool fake_healthy(struct backend *b)
{
    return !((struct fake *)b)->broken;
}

static const struct backend_ops fake_ops = {.moe_tune = fake_tune, .healthy = fake_healthy};

static void fake_init(struct fake *f)
{
    memset(f, 0, sizeof(*f));
    f->base.ops = &fake_ops;
    f->base.name = "fake";
}

/* ---- helpers ------------------------------------------------------------ */

static char *slurp(const char *path)
{
    static char buf[1 << 16];
    FILE *fp = fopen(path, "r");
    CHECK(fp != NULL);
    size_t n = fread(buf, 1, sizeof(buf) - 1, fp);
    fclose(fp);
    buf[n] = '\0';
    return buf;
}

static void add_shape(struct tune_plan *p, const char *arg)
{
    struct tune_shape t;
    CHECK_EQ_INT(tune_parse_shape(arg, &t), 0);
    CHECK_EQ_INT(tune_add(p, &t), 0);
}

/* Run the plan into a report in memory; returns the code. */
static int run(struct backend *b, const struct tune_plan *p, const char *table, char *report,
               size_t len, char *err, size_t errlen)
{
    FILE *out = fmemopen(report, len, "w");
    CHECK(out != NULL);
    err[0] = '\0';
    int rc = tune_run(b, p, table, out, err, errlen);
    fclose(out);
    return rc;
}

/* ---- cases ---------------------------------------------------------------- */

TEST(parse_options)
{
    struct tune_shape t;
    CHECK_EQ_INT(tune_parse_shape("256,8,7168,2048", &t), 0);
    CHECK(t.s.experts == 256 && t.s.topk == 8 && t.s.hidden == 7168 &&
          t.s.intermediate == 2048 && t.dt == MOEK_DTYPE_BF16);
    CHECK_EQ_INT(tune_parse_shape("8,2,4096,14336,fp16", &t), 0);
    CHECK(t.dt == MOEK_DTYPE_FP16 && t.s.intermediate == 14336);
    CHECK_EQ_INT(tune_parse_shape("8,2,4096,14336,bf16", &t), 0);
    CHECK(t.dt == MOEK_DTYPE_BF16);
    static const char *bad[] = {"", "8", "8,2,4096", "8,2,4096,", "8,2,4096,14336,",
                                "8,2,4096,14336,fp32", "8,2,4096,14336,bf16,", "8,9,4096,14336",
                                "0,1,64,64", "8,0,64,64", "8,2,0,64", "8,2,64,-64", "8,2,64,6x4",
                                "5000,2,64,64", "8,2,2000000,64", " 8,2,64,64", "8;2;64;64"};
    for (size_t i = 0; i < ARRAY_LEN(bad); i++)
        CHECK_MSG(tune_parse_shape(bad[i], &t) == -EINVAL, "'%s' was taken", bad[i]);

    struct tune_plan *p = calloc(1, sizeof(*p));
    CHECK(p != NULL);
    CHECK_EQ_INT(tune_parse_tokens("64,1,8,8,4096", p), 0);
    CHECK_EQ_INT(p->n_tokens, 4);
    CHECK(p->tokens[0] == 1 && p->tokens[1] == 8 && p->tokens[2] == 64 && p->tokens[3] == 4096);
    static const char *badt[] = {"", "0", "1,,2", "1,2,", ",1", "1 2", "-1", "x",
                                 "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,"
                                 "25,26,27,28,29,30,31,32,33"};
    for (size_t i = 0; i < ARRAY_LEN(badt); i++)
        CHECK_MSG(tune_parse_tokens(badt[i], p) == -EINVAL, "'%s' was taken", badt[i]);
    CHECK_EQ_INT(p->n_tokens, 4); /* refused lists change nothing */
    /* Given counts must fit max_batch_tokens. */
    CHECK_EQ_INT(tune_set_tokens(p, 4096), 0);
    CHECK_EQ_INT(tune_set_tokens(p, 4095), -ERANGE);
    /* The default: powers of two up to 4096 and max_batch_tokens. */
    memset(p, 0, sizeof(*p));
    CHECK_EQ_INT(tune_set_tokens(p, 4096), 0);
    CHECK_EQ_INT(p->n_tokens, 13);
    CHECK(p->tokens[0] == 1 && p->tokens[12] == 4096);
    memset(p, 0, sizeof(*p));
    CHECK_EQ_INT(tune_set_tokens(p, 100), 0);
    CHECK_EQ_INT(p->n_tokens, 7);
    CHECK_EQ_INT(p->tokens[6], 64);
    memset(p, 0, sizeof(*p));
    CHECK_EQ_INT(tune_set_tokens(p, 1u << 20), 0);
    CHECK_EQ_INT(p->tokens[p->n_tokens - 1], 4096);
    /* Repeated shapes count once. */
    memset(p, 0, sizeof(*p));
    add_shape(p, "8,2,256,512");
    add_shape(p, "8,2,256,512,bf16");
    add_shape(p, "8,2,256,512,fp16");
    CHECK_EQ_INT(p->n_shapes, 2);
    CHECK_EQ_INT(p->shapes[0].more, 1);
    free(p);
}

/* Rules where the fastest tile changes; T below the first keeps the
 * heuristic. */
TEST(rules_from_timings)
{
    struct backend_tune r = {.device = "Card", .n = 6};
    const int tok[] = {2, 4, 8, 16, 64, 4096}, best[] = {16, 16, 64, 64, 256, 256};
    for (int i = 0; i < 6; i++) {
        r.tokens[i] = tok[i];
        r.best[i] = best[i];
    }
    struct tune_shape t = {{8, 2, 256, 512}, MOEK_DTYPE_FP16, "x", 0};
    struct tile_entry e;
    tune_entry(&r, &t, &e);
    CHECK_STR_EQ(e.device, "Card");
    CHECK(e.dt == MOEK_DTYPE_FP16 && e.experts == 8 && e.topk == 2 && e.hidden == 256 &&
          e.intermediate == 512);
    CHECK_EQ_INT(e.n_rules, 3);
    CHECK(e.rules[0].min_tokens == 2 && e.rules[0].tile == 16);
    CHECK(e.rules[1].min_tokens == 8 && e.rules[1].tile == 64);
    CHECK(e.rules[2].min_tokens == 64 && e.rules[2].tile == 256);
    char err[256];
    CHECK_EQ_INT(tiles_check_entry(&e, err, sizeof(err)), 0);
}

TEST(tune_writes_and_merges_the_table)
{
    const char *dir = tmp_dir_new("tune");
    char path[256], err[512], report[16384];
    snprintf(path, sizeof(path), "%s/tiles.tsv", dir);
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL);
    fputs("Fake GPU 9000\tbf16\t256\t512\t8\t2\t1:192\n"
          "Other GPU\tbf16\t256\t512\t8\t2\t1:128\n", fp);
    fclose(fp);
    struct fake f;
    fake_init(&f);
    struct tune_plan *p = calloc(1, sizeof(*p));
    CHECK(p != NULL);
    add_shape(p, "8,2,256,512");
    add_shape(p, "16,4,1024,512,fp16");
    CHECK_EQ_INT(tune_parse_tokens("1,2,4,8,16,32,64,128", p), 0);
    CHECK_EQ_INT(run(&f.base, p, path, report, sizeof(report), err, sizeof(err)), 0);
    fprintf(stderr, "%s", report);
    CHECK_EQ_INT(f.calls, 2);
    /* The report: a heading per shape, a row per count with the chosen
     * tile, the heuristic's, their times and the gain. */
    CHECK_STR_CONTAINS(report, "Fake GPU 9000, bf16, E=8 k=2 H=256 I=512 (--tune-shape)");
    CHECK_STR_CONTAINS(report, "Fake GPU 9000, fp16, E=16 k=4 H=1024 I=512 (--tune-shape)");
    CHECK_STR_CONTAINS(report, "     8    64      10.0        32      21.0  52.4% |");
    CHECK_STR_CONTAINS(report, "     1    32      10.0        32      10.0   0.0% |");
    CHECK_STR_CONTAINS(report, "2 entries written, 1 other kept");
    /* The file: both new entries, the same key replaced, the other card
     * kept. */
    const char *text = slurp(path);
    CHECK_STR_CONTAINS(text, "Fake GPU 9000\tbf16\t256\t512\t8\t2\t1:16 8:64 64:256\n");
    CHECK_STR_CONTAINS(text, "Fake GPU 9000\tfp16\t1024\t512\t16\t4\t1:32\n");
    CHECK_STR_CONTAINS(text, "Other GPU\tbf16\t256\t512\t8\t2\t1:128\n");
    CHECK(strstr(text, "1:192") == NULL);
    struct tile_table t;
    tiles_init(&t);
    CHECK_EQ_INT(tiles_read(&t, path, err, sizeof(err)), 0);
    CHECK_EQ_INT(t.n, 3);
    tiles_done(&t);
    free(p);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(a_failed_shape_keeps_the_others)
{
    const char *dir = tmp_dir_new("tune");
    char path[256], err[512], report[16384];
    snprintf(path, sizeof(path), "%s/sub/tiles.tsv", dir);
    struct fake f;
    fake_init(&f);
    struct tune_plan *p = calloc(1, sizeof(*p));
    CHECK(p != NULL);
    add_shape(p, "13,2,256,512");
    add_shape(p, "8,2,256,512");
    CHECK_EQ_INT(tune_set_tokens(p, 4096), 0);
    CHECK_EQ_INT(run(&f.base, p, path, report, sizeof(report), err, sizeof(err)), -EIO);
    CHECK_STR_CONTAINS(err, "1 of 2 layer shapes could not be tuned");
    CHECK_STR_CONTAINS(report, "cannot tune bf16 E=13 k=2 H=256 I=512 (--tune-shape): shape "
                               "not supported here");
    CHECK_STR_CONTAINS(slurp(path), "Fake GPU 9000\tbf16\t256\t512\t8\t2\t1:16 8:64 64:256\n");
    /* A device that became unusable ends the run. */
    memset(p, 0, sizeof(*p));
    add_shape(p, "14,2,256,512");
    add_shape(p, "8,2,128,512");
    CHECK_EQ_INT(tune_set_tokens(p, 4096), 0);
    f.calls = 0;
    CHECK_EQ_INT(run(&f.base, p, path, report, sizeof(report), err, sizeof(err)), -EIO);
    CHECK_EQ_INT(f.calls, 1);
    CHECK_STR_CONTAINS(err, "2 of 2 layer shapes");
    CHECK(strstr(slurp(path), "\t128\t512\t") == NULL);
    free(p);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(refusals)
{
    const char *dir = tmp_dir_new("tune");
    char path[256], err[512], report[4096];
    snprintf(path, sizeof(path), "%s/tiles.tsv", dir);
    struct tune_plan *p = calloc(1, sizeof(*p));
    CHECK(p != NULL);
    add_shape(p, "8,2,256,512");
    CHECK_EQ_INT(tune_set_tokens(p, 4096), 0);
    /* The CPU backend has no tiles. */
    struct backend *cpu = NULL;
    CHECK_EQ_INT(backend_cpu_new(1, &cpu), 0);
    CHECK_EQ_INT(run(cpu, p, path, report, sizeof(report), err, sizeof(err)), -ENOTSUP);
    CHECK_STR_CONTAINS(err, "tuning needs a CUDA device: the cpu backend");
    struct backend_tune r;
    CHECK_EQ_INT(backend_moe_tune(cpu, &p->shapes[0].s, MOEK_DTYPE_BF16, p->tokens, 1, &r, err,
                                  sizeof(err)), -ENOTSUP);
    backend_free(&cpu);
    CHECK(access(path, F_OK) != 0);
    struct fake f;
    fake_init(&f);
    /* No table to keep the result. */
    CHECK_EQ_INT(run(&f.base, p, "", report, sizeof(report), err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "tile_table is empty");
    /* A malformed table is neither measured for nor overwritten. */
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL);
    fputs("# mine\nFake GPU 9000\tbf16\t256\n", fp);
    fclose(fp);
    CHECK_EQ_INT(run(&f.base, p, path, report, sizeof(report), err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, ":2: ");
    CHECK_STR_CONTAINS(err, "does not overwrite it");
    CHECK_STR_EQ(slurp(path), "# mine\nFake GPU 9000\tbf16\t256\n");
    CHECK_EQ_INT(f.calls, 0);
    unlink(path);
    /* Nothing to tune. */
    struct tune_plan *none = calloc(1, sizeof(*none));
    CHECK(none != NULL);
    CHECK_EQ_INT(tune_set_tokens(none, 4096), 0);
    CHECK_EQ_INT(run(&f.base, none, path, report, sizeof(report), err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "nothing to tune");
    /* Too many token counts for the backend. */
    CHECK_EQ_INT(backend_moe_tune(&f.base, &p->shapes[0].s, MOEK_DTYPE_BF16, p->tokens, 0, &r,
                                  err, sizeof(err)), -EINVAL);
    CHECK_EQ_INT(backend_moe_tune(&f.base, &p->shapes[0].s, MOEK_DTYPE_BF16, p->tokens,
                                  BACKEND_TUNE_MAX + 1, &r, err, sizeof(err)), -EINVAL);
    free(none);
    free(p);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* Write a MoE layer of E experts [I, H] / [H, I] named as Qwen names them. */
static void write_layer(const char *path, int E, int H, int I, enum st_dtype dt)
{
    size_t per = (size_t)H * I, es = dt == ST_F32 ? 4 : 2;
    char *w = calloc(3 * (size_t)E, per * es);
    struct st_out *t = calloc(3 * (size_t)E, sizeof(*t));
    char (*names)[64] = calloc(3 * (size_t)E, 64);
    CHECK(w && t && names);
    for (int e = 0; e < E; e++)
        for (int q = 0; q < 3; q++) {
            size_t i = (size_t)e * 3 + (size_t)q;
            snprintf(names[i], 64, "mlp.experts.%d.%s.weight", e,
                     q == 0 ? "gate_proj" : q == 1 ? "up_proj" : "down_proj");
            t[i] = (struct st_out){.name = names[i], .dtype = dt, .ndim = 2,
                                   .shape = {q < 2 ? (uint64_t)I : (uint64_t)H,
                                             q < 2 ? (uint64_t)H : (uint64_t)I},
                                   .data = w + i * per * es};
        }
    CHECK_EQ_INT(st_write(path, t, 3 * (size_t)E), 0);
    free(w);
    free(t);
    free(names);
}

TEST(configured_layers)
{
    const char *dir = tmp_dir_new("tune");
    char a[256], b[256], c32[256], text[4096], err[512], notes[2048];
    snprintf(a, sizeof(a), "%s/a.safetensors", dir);
    snprintf(b, sizeof(b), "%s/b.safetensors", dir);
    snprintf(c32, sizeof(c32), "%s/c.safetensors", dir);
    write_layer(a, 6, 64, 32, ST_BF16);
    write_layer(b, 4, 32, 16, ST_F16);
    write_layer(c32, 4, 32, 16, ST_F32);
    snprintf(text, sizeof(text),
             "[daemon]\nallowed_dirs = %s\n"
             "[layer one]\nfile = %s\nprefix = mlp.\ntopk = 2\n"
             "[layer two]\nfile = %s\nprefix = mlp.\ntopk = 2\n"          /* same shape */
             "[layer three]\nfile = %s\nprefix = mlp.\ntopk = 3\n"        /* another topk */
             "[layer four]\nfile = %s\nprefix = mlp.\ntopk = 1\n"         /* fp16 */
             "[layer five]\nfile = %s\nprefix = mlp.\ntopk = 1\ndtype = bf16\n" /* as bf16 */
             "[layer six]\nfile = %s\nprefix = mlp.\ntopk = 1\n"          /* fp32: skipped */
             "[layer seven]\nfile = %s\nprefix = mlp.\ntopk = 2\ndevices = 0,1\n" /* spread */
             "[layer eight]\nkind = gemm\nfile = %s\nprefix = mlp.experts.0.up_proj.weight\n",
             dir, a, a, a, b, c32, c32, a, a);
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_parse_string(&c, text, err, sizeof(err)), 0);
    struct tune_plan *p = calloc(1, sizeof(*p));
    CHECK(p != NULL);
    FILE *out = fmemopen(notes, sizeof(notes), "w");
    CHECK(out != NULL);
    CHECK_EQ_INT(tune_add_configured(p, &c, out, err, sizeof(err)), 0);
    fclose(out);
    fprintf(stderr, "%s", notes);
    CHECK_EQ_INT(p->n_shapes, 4);
    const struct { int E, k, H, I; moek_dtype dt; int more; const char *from; } want[] = {
        {6, 2, 64, 32, MOEK_DTYPE_BF16, 1, "layer 'one'"},
        {6, 3, 64, 32, MOEK_DTYPE_BF16, 0, "layer 'three'"},
        {4, 1, 32, 16, MOEK_DTYPE_FP16, 0, "layer 'four'"},
        {4, 1, 32, 16, MOEK_DTYPE_BF16, 0, "layer 'five'"},
    };
    for (int i = 0; i < 4; i++) {
        const struct tune_shape *t = &p->shapes[i];
        CHECK_MSG(t->s.experts == want[i].E && t->s.topk == want[i].k &&
                      t->s.hidden == want[i].H && t->s.intermediate == want[i].I &&
                      t->dt == want[i].dt && t->more == want[i].more,
                  "shape %d: E=%d k=%d H=%d I=%d dt=%d more=%d", i, t->s.experts, t->s.topk,
                  t->s.hidden, t->s.intermediate, (int)t->dt, t->more);
        CHECK_STR_EQ(t->from, want[i].from);
    }
    CHECK_STR_CONTAINS(notes, "layer 'six' is fp32");
    CHECK_STR_CONTAINS(notes, "layer 'seven' is spread over devices");
    /* The shape comes from the header alone: no weights are read. */
    struct layer_spec spec = {.kind = MOE__LAYER_KIND__LAYER_MOE, .topk = 2, .path = a,
                              .prefix = "mlp."};
    struct host_weights hw;
    CHECK_EQ_INT(layer_check_weights(&spec, c.allowed_dirs, c.n_allowed_dirs, &hw, err,
                                     sizeof(err)), 0);
    CHECK(hw.experts == 6 && hw.hidden == 64 && hw.intermediate == 32 &&
          hw.dtype == MOE__DTYPE__DTYPE_BF16);
    CHECK(hw.w1 == NULL && hw.w3 == NULL && hw.w2 == NULL);
    CHECK_STR_CONTAINS(hw.source, "a.safetensors:mlp.");
    spec.kind = MOE__LAYER_KIND__LAYER_GEMM;
    CHECK_EQ_INT(layer_check_weights(&spec, c.allowed_dirs, c.n_allowed_dirs, &hw, err,
                                     sizeof(err)), -EINVAL);
    config_done(&c);

    /* A layer whose file is missing (or outside the allowed directories)
     * is an error that names it. */
    snprintf(text, sizeof(text), "[daemon]\nallowed_dirs = %s\n"
             "[layer gone]\nfile = %s/none.safetensors\nprefix = mlp.\ntopk = 2\n", dir, dir);
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_parse_string(&c, text, err, sizeof(err)), 0);
    out = fmemopen(notes, sizeof(notes), "w");
    CHECK(tune_add_configured(p, &c, out, err, sizeof(err)) < 0);
    fclose(out);
    CHECK_STR_CONTAINS(err, "layer 'gone'");
    config_done(&c);
    snprintf(text, sizeof(text), "[layer far]\nfile = %s\nprefix = mlp.\ntopk = 2\n", a);
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_parse_string(&c, text, err, sizeof(err)), 0);
    out = fmemopen(notes, sizeof(notes), "w");
    CHECK_EQ_INT(tune_add_configured(p, &c, out, err, sizeof(err)), -EACCES);
    fclose(out);
    config_done(&c);
    free(p);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(parse_options),
        TEST_CASE(rules_from_timings),
        TEST_CASE(tune_writes_and_merges_the_table),
        TEST_CASE(a_failed_shape_keeps_the_others),
        TEST_CASE(refusals),
        TEST_CASE(configured_layers),
        {0}});
}
