/*
 * test_config.c: daemon/config.c, the defaults, the INI file and the runtime
 * directory rule. A valid file sets every key it names and nothing else; an
 * invalid one is refused with a message that names the line and the key, so
 * that a typo stops the daemon at start instead of silently keeping a default.
 *
 * Each case runs in its own child, so setenv() and seteuid() here cannot leak
 * into other cases.
 */
#include "tests/unit/unit.h"
#include "daemon/config.h"
#include "daemon/server.h"
#include "moe.pb-c.h"

#include <ftw.h>
#include <limits.h>
#include <sys/stat.h>


/* ---- helpers ------------------------------------------------------------ */


static const char *tmp_dir(void)
{
    return tmp_dir_new("cfg");
}

static void write_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL);
    CHECK(fputs(text, fp) >= 0);
    CHECK(fclose(fp) == 0);
}

/* Parse text over fresh defaults; return the code, message in err. */
static int parse_fresh(const char *text, char *err, size_t errlen)
{
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    err[0] = '\0';
    int rc = config_parse_string(&c, text, err, errlen);
    config_done(&c);
    return rc;
}

/* text must be refused with -EINVAL; the message contains each of the
 * (up to two) strings given, e.g. "line 3: " and the key. */
static void expect_error_at(int line, const char *text, const char *want1, const char *want2)
{
    char err[512];
    int rc = parse_fresh(text, err, sizeof(err));
    if (rc != -EINVAL)
        FAIL_AT("line %d: rc %d (want -EINVAL) for:\n%s", line, rc, text);
    if (!err[0])
        FAIL_AT("line %d: empty message for:\n%s", line, text);
    if (want1 && !strstr(err, want1))
        FAIL_AT("line %d: \"%s\" lacks \"%s\"", line, err, want1);
    if (want2 && !strstr(err, want2))
        FAIL_AT("line %d: \"%s\" lacks \"%s\"", line, err, want2);
}
#define expect_error(text, w1, w2) expect_error_at(__LINE__, text, w1, w2)

static void expect_ok_at(int line, const char *text)
{
    char err[512];
    int rc = parse_fresh(text, err, sizeof(err));
    if (rc != 0)
        FAIL_AT("line %d: rc %d (%s) for:\n%s", line, rc, err, text);
}
#define expect_ok(text) expect_ok_at(__LINE__, text)

static uint64_t rand_in(uint64_t *s, uint64_t lo, uint64_t hi)
{
    return lo + test_rand(s) % (hi - lo + 1);
}

/* ---- defaults ------------------------------------------------------------- */

TEST(defaults)
{
    setenv("MOED_RUNTIME_DIR", "/tmp/moed-test-runtime", 1);
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_STR_EQ(c.runtime_dir, "/tmp/moed-test-runtime");
    CHECK_EQ_INT(c.n_allowed_dirs, 0);
    CHECK(c.allowed_dirs == NULL);
    CHECK_STR_EQ(c.backend, "auto");
    CHECK_EQ_INT(c.cpu_threads, 0);
    CHECK_EQ_INT(c.device, 0);
    CHECK_EQ_INT(c.log_level, 6); /* info */
    CHECK_EQ_INT(c.max_batch_tokens, 4096);
    CHECK_EQ_INT(c.max_delay_us, 0);
    CHECK_EQ_INT(c.max_request_tokens, 65536);
    CHECK_EQ_INT(c.max_slice_tokens, 1024);
    CHECK(c.batching);
    CHECK_EQ_INT(c.max_sessions, 256);
    CHECK_EQ_INT(c.max_regions, 64);
    CHECK(c.max_region_bytes == 17179869184ull);
    CHECK(c.max_session_bytes == 68719476736ull);
    CHECK_EQ_INT(c.max_queued_requests, 256);
    CHECK_EQ_INT(c.max_queued_tokens, 65536);
    CHECK_EQ_INT(c.max_message_bytes, 1048576);
    CHECK(c.layers == NULL);

    /* An empty file, comments and blank lines change nothing. */
    char err[256] = "";
    CHECK_EQ_INT(config_parse_string(&c, "", err, sizeof(err)), 0);
    CHECK_EQ_INT(config_parse_string(&c, "; comment\n# comment\n\n[daemon]\n", err, sizeof(err)), 0);
    CHECK_STR_EQ(c.backend, "auto");
    CHECK_EQ_INT(c.max_sessions, 256);
    CHECK(c.layers == NULL);
    config_done(&c);
    CHECK(c.runtime_dir == NULL && c.backend == NULL);
    CHECK_NO_LEAKS();
}

TEST(value_parsers)
{
    CHECK_EQ_INT(config_parse_kind("moe"), MOE__LAYER_KIND__LAYER_MOE);
    CHECK_EQ_INT(config_parse_kind("GEMM"), MOE__LAYER_KIND__LAYER_GEMM);
    CHECK_EQ_INT(config_parse_kind("dense"), -1);
    CHECK_EQ_INT(config_parse_kind(""), -1);
    CHECK_EQ_INT(config_parse_dtype("bf16"), MOE__DTYPE__DTYPE_BF16);
    CHECK_EQ_INT(config_parse_dtype("bfloat16"), MOE__DTYPE__DTYPE_BF16);
    CHECK_EQ_INT(config_parse_dtype("fp16"), MOE__DTYPE__DTYPE_FP16);
    CHECK_EQ_INT(config_parse_dtype("float16"), MOE__DTYPE__DTYPE_FP16);
    CHECK_EQ_INT(config_parse_dtype("FP32"), MOE__DTYPE__DTYPE_FP32);
    CHECK_EQ_INT(config_parse_dtype("int8"), -1);
    CHECK_EQ_INT(config_parse_dtype("bf"), -1);
    CHECK_EQ_INT(config_parse_routing("softmax"), MOE__ROUTING__ROUTING_SOFTMAX);
    CHECK_EQ_INT(config_parse_routing("sigmoid"), MOE__ROUTING__ROUTING_SIGMOID);
    CHECK_EQ_INT(config_parse_routing("given"), MOE__ROUTING__ROUTING_GIVEN);
    CHECK_EQ_INT(config_parse_routing("topk"), -1);
    CHECK_NO_LEAKS();
}

/* ---- a full file ----------------------------------------------------------- */

TEST(full_file)
{
    uint64_t s = test_seed();
    const char *dir = tmp_dir();
    char d1[256], d2[256], d2link[256], d2dots[300], path[256];
    snprintf(d1, sizeof(d1), "%s/weights", dir);
    snprintf(d2, sizeof(d2), "%s/models", dir);
    snprintf(d2link, sizeof(d2link), "%s/models-link", dir);
    CHECK(mkdir(d1, 0700) == 0);
    CHECK(mkdir(d2, 0700) == 0);
    CHECK(symlink(d2, d2link) == 0);
    /* The second directory named through a symlink and a "..": stored canonical. */
    snprintf(d2dots, sizeof(d2dots), "%s/../%s", d2link, strrchr(d2link, '/') + 1);

    uint64_t cpu_threads = rand_in(&s, 1, 1024), device = rand_in(&s, 0, 255);
    uint64_t mbt = rand_in(&s, 1, 1u << 20), mdu = rand_in(&s, 0, 10000000);
    uint64_t mrt = rand_in(&s, 1, 1u << 24), mst = rand_in(&s, 1, 1u << 24);
    uint64_t ms = rand_in(&s, 1, 65536), mr = rand_in(&s, 1, 65536);
    uint64_t mrb = rand_in(&s, 1, UINT64_MAX - 1), msb = rand_in(&s, 1, 1ull << 40);
    uint64_t mqr = rand_in(&s, 1, 1u << 20), mqt = rand_in(&s, 1, 1u << 30);
    uint64_t mmb = rand_in(&s, 4096, 1ull << 32);
    uint64_t E = rand_in(&s, 1, 256), K = rand_in(&s, 1, 8), H = rand_in(&s, 1, 1u << 16),
             I = rand_in(&s, 1, 1u << 16), G = rand_in(&s, 1, 64), N = rand_in(&s, 1, 4096),
             KK = rand_in(&s, 1, 4096);

    char text[4096];
    int n = snprintf(text, sizeof(text),
        "; moed.conf written by test_config\n"
        "[daemon]\n"
        "runtime_dir = %s/run\n"
        "allowed_dirs = %s:%s\n"
        "backend = cpu\n"
        "cpu_threads = %llu\n"
        "device = %llu\n"
        "log_level = debug\n"
        "\n"
        "[batch]\n"
        "max_batch_tokens = %llu\n"
        "max_delay_us = %llu\n"
        "max_request_tokens = %llu\n"
        "max_slice_tokens = %llu\n"
        "batching = false\n"
        "\n"
        "[limits]\n"
        "max_sessions = %llu\n"
        "max_regions = %llu\n"
        "max_region_bytes = %llu\n"
        "max_session_bytes = %llu\n"
        "max_queued_requests = %llu\n"
        "max_queued_tokens = %llu\n"
        "max_message_bytes = %llu\n"
        "\n"
        "[layer mixtral.0]\n"
        "kind = moe\n"
        "file = %s/model.safetensors\n"
        "prefix = model.layers.0.block_sparse_moe.\n"
        "experts = %llu\n"
        "topk = %llu\n"
        "hidden = %llu\n"
        "intermediate = %llu\n"
        "dtype = fp16\n"
        "routing = sigmoid\n"
        "renormalize = no\n"
        "\n"
        "[layer proj_1]\n"
        "kind = gemm\n"
        "file = %s/proj.safetensors\n"
        "prefix = proj.weight\n"
        "groups = %llu\n"
        "n = %llu\n"
        "k = %llu\n"
        "dtype = fp32\n",
        dir, d1, d2dots, (unsigned long long)cpu_threads, (unsigned long long)device,
        (unsigned long long)mbt, (unsigned long long)mdu, (unsigned long long)mrt,
        (unsigned long long)mst, (unsigned long long)ms, (unsigned long long)mr,
        (unsigned long long)mrb, (unsigned long long)msb, (unsigned long long)mqr,
        (unsigned long long)mqt, (unsigned long long)mmb, d1, (unsigned long long)E,
        (unsigned long long)K, (unsigned long long)H, (unsigned long long)I, d2,
        (unsigned long long)G, (unsigned long long)N, (unsigned long long)KK);
    CHECK(n > 0 && (size_t)n < sizeof(text));
    snprintf(path, sizeof(path), "%s/moed.conf", dir);
    write_text(path, text);

    setenv("MOED_RUNTIME_DIR", "/tmp/moed-test-default", 1);
    struct config c;
    char err[512] = "";
    CHECK_EQ_INT(config_init(&c), 0);
    int rc = config_load(&c, path, err, sizeof(err));
    CHECK_MSG(rc == 0, "config_load: %d %s", rc, err);

    char want[512];
    snprintf(want, sizeof(want), "%s/run", dir);
    CHECK_STR_EQ(c.runtime_dir, want);
    CHECK_EQ_INT(c.n_allowed_dirs, 2);
    char *r1 = realpath(d1, NULL), *r2 = realpath(d2, NULL);
    CHECK(r1 && r2);
    CHECK_STR_EQ(c.allowed_dirs[0], r1);
    CHECK_STR_EQ(c.allowed_dirs[1], r2);
    free(r1);
    free(r2);
    CHECK_STR_EQ(c.backend, "cpu");
    CHECK_EQ_INT(c.cpu_threads, cpu_threads);
    CHECK_EQ_INT(c.device, device);
    CHECK_EQ_INT(c.log_level, 7);
    CHECK_EQ_INT(c.max_batch_tokens, mbt);
    CHECK_EQ_INT(c.max_delay_us, mdu);
    CHECK_EQ_INT(c.max_request_tokens, mrt);
    CHECK_EQ_INT(c.max_slice_tokens, mst);
    CHECK(!c.batching);
    CHECK_EQ_INT(c.max_sessions, ms);
    CHECK_EQ_INT(c.max_regions, mr);
    CHECK(c.max_region_bytes == mrb);
    CHECK(c.max_session_bytes == msb);
    CHECK_EQ_INT(c.max_queued_requests, mqr);
    CHECK_EQ_INT(c.max_queued_tokens, mqt);
    CHECK(c.max_message_bytes == mmb);

    /* Layers in file order, each with its own keys. */
    struct layer_conf *l = c.layers;
    CHECK(l != NULL);
    CHECK_STR_EQ(l->name, "mixtral.0");
    CHECK_EQ_INT(l->kind, MOE__LAYER_KIND__LAYER_MOE);
    snprintf(want, sizeof(want), "%s/model.safetensors", d1);
    CHECK_STR_EQ(l->path, want);
    CHECK_STR_EQ(l->prefix, "model.layers.0.block_sparse_moe.");
    CHECK_EQ_INT(l->experts, E);
    CHECK_EQ_INT(l->topk, K);
    CHECK_EQ_INT(l->hidden, H);
    CHECK_EQ_INT(l->intermediate, I);
    CHECK_EQ_INT(l->dtype, MOE__DTYPE__DTYPE_FP16);
    CHECK_EQ_INT(l->routing, MOE__ROUTING__ROUTING_SIGMOID);
    CHECK(!l->renormalize);
    CHECK_EQ_INT(l->groups, 0);
    l = l->next;
    CHECK(l != NULL);
    CHECK_STR_EQ(l->name, "proj_1");
    CHECK_EQ_INT(l->kind, MOE__LAYER_KIND__LAYER_GEMM);
    snprintf(want, sizeof(want), "%s/proj.safetensors", d2);
    CHECK_STR_EQ(l->path, want);
    CHECK_STR_EQ(l->prefix, "proj.weight");
    CHECK_EQ_INT(l->groups, G);
    CHECK_EQ_INT(l->n, N);
    CHECK_EQ_INT(l->k, KK);
    CHECK_EQ_INT(l->dtype, MOE__DTYPE__DTYPE_FP32);
    CHECK_EQ_INT(l->routing, MOE__ROUTING__ROUTING_SOFTMAX); /* not given: default */
    CHECK(l->renormalize);                                   /* not given: default */
    CHECK_EQ_INT(l->experts, 0);
    CHECK(l->next == NULL);
    config_done(&c);

    /* The same text through config_parse_string gives the same result. */
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_parse_string(&c, text, err, sizeof(err)), 0);
    CHECK_EQ_INT(c.max_sessions, ms);
    CHECK(c.layers && c.layers->next && !c.layers->next->next);
    config_done(&c);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* A file overrides only the keys it names; a second file over the first
 * keeps both (config_load over an already loaded config). */
TEST(partial_files_layer)
{
    struct config c;
    char err[256] = "";
    setenv("MOED_RUNTIME_DIR", "/tmp/moed-test-x", 1);
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_parse_string(&c, "[limits]\nmax_sessions = 3\n", err, sizeof(err)), 0);
    CHECK_EQ_INT(config_parse_string(&c, "[batch]\nmax_batch_tokens = 5\nbatching = off\n", err,
                                     sizeof(err)), 0);
    CHECK_EQ_INT(c.max_sessions, 3);
    CHECK_EQ_INT(c.max_batch_tokens, 5);
    CHECK(!c.batching);
    CHECK_EQ_INT(c.max_regions, 64);
    CHECK_STR_EQ(c.backend, "auto");
    CHECK_STR_EQ(c.runtime_dir, "/tmp/moed-test-x");
    /* Booleans in all their spellings. */
    const char *yes[] = {"true", "yes", "1", "on", "TRUE", "Yes"};
    const char *no[] = {"false", "no", "0", "off", "False", "NO"};
    for (size_t i = 0; i < ARRAY_LEN(yes); i++) {
        char t[64];
        snprintf(t, sizeof(t), "[batch]\nbatching = %s\n", no[i]);
        CHECK_EQ_INT(config_parse_string(&c, t, err, sizeof(err)), 0);
        CHECK(!c.batching);
        snprintf(t, sizeof(t), "[batch]\nbatching = %s\n", yes[i]);
        CHECK_EQ_INT(config_parse_string(&c, t, err, sizeof(err)), 0);
        CHECK(c.batching);
    }
    /* A layer split over two sections of the same name is one layer. */
    CHECK_EQ_INT(config_parse_string(&c, "[layer a]\nfile = /x\ntopk = 2\n[layer b]\nfile = /y\ntopk = 2\n"
                                         "[layer a]\nexperts = 4\n", err, sizeof(err)), 0);
    CHECK(c.layers && c.layers->next && !c.layers->next->next);
    CHECK_STR_EQ(c.layers->name, "a");
    CHECK_STR_EQ(c.layers->path, "/x");
    CHECK_EQ_INT(c.layers->experts, 4);
    config_done(&c);

    /* Boundaries accepted. */
    expect_ok("[limits]\nmax_sessions = 65536\nmax_regions = 1\n"
              "max_region_bytes = 18446744073709551615\nmax_message_bytes = 4096\n");
    expect_ok("[batch]\nmax_batch_tokens = 1048576\nmax_delay_us = 10000000\n");
    expect_ok("[daemon]\ncpu_threads = 1024\ndevice = 255\n");
    expect_ok("[layer a]\nfile = /x\ntopk = 2\nhidden = 16777216\nexperts = 0\n");
    CHECK_NO_LEAKS();
}

/* ---- errors ----------------------------------------------------------------- */

TEST(error_unknown_section_and_key)
{
    expect_error("[daemon]\nbackend = cpu\n\n[nosuch]\nkey = 1\n", "line 5: ", "unknown section [nosuch]");
    expect_error("[Daemon]\nbackend = cpu\n", "line 2: ", "unknown section [Daemon]");
    expect_error("key = 1\n", "line 1: ", "unknown section []");
    expect_error("[daemon]\nbackend = cpu\nbakcend = cpu\n", "line 3: ", "unknown key 'bakcend' in [daemon]");
    expect_error("[batch]\nmax_batch = 4\n", "line 2: ", "unknown key 'max_batch' in [batch]");
    expect_error("[limits]\n\n\nmax_session = 4\n", "line 4: ", "unknown key 'max_session' in [limits]");
    /* [batch] keys are not [limits] keys and the other way round. */
    expect_error("[limits]\nmax_batch_tokens = 4\n", "line 2: ", "unknown key 'max_batch_tokens'");
    expect_error("[batch]\nmax_sessions = 4\n", "line 2: ", "unknown key 'max_sessions'");
    expect_error("[limits]\nbatching = true\n", "line 2: ", "unknown key 'batching'");
    expect_error("[layer a]\nfile = /x\nexpert = 4\n", "line 3: ", "unknown key 'expert' in [layer a]");
    /* Keys are case-sensitive. */
    expect_error("[daemon]\nBackend = cpu\n", "line 2: ", "unknown key 'Backend'");
    /* The first error is the one reported. */
    expect_error("[daemon]\nnope = 1\nbackend = cpu\nmore = 2\n", "line 2: ", "'nope'");
    /* The first error is reported with its own line, whichever kind comes
     * first (inih keeps the line of the first, the message was the bad
     * value's). */
    expect_error("[daemon]\nno equals sign\n[limits]\nmax_sessions = 0\n", "line 2: ", "syntax error");
    expect_error("[limits]\nmax_sessions = 0\nno equals sign\n", "line 2: ", "'max_sessions'");
    /* Not INI at all. */
    expect_error("[daemon]\nbackend = cpu\nthis line has no equals sign\n", "line 3: ", "syntax error");
    expect_error("[daemon]\nbackend = cpu\n[limits\n", "line 3: ", "syntax error");
    CHECK_NO_LEAKS();
}

TEST(error_bad_numbers)
{
    static const struct {
        const char *text, *key;
        int line;
    } bad[] = {
        {"[limits]\nmax_sessions = -1\n", "max_sessions", 2},
        {"[limits]\nmax_sessions = 65537\n", "max_sessions", 2},
        {"[limits]\nmax_sessions = 0\n", "max_sessions", 2},
        {"[limits]\nmax_regions = 12abc\n", "max_regions", 2},
        {"[limits]\nmax_regions = twelve\n", "max_regions", 2},
        {"[limits]\nmax_regions =\n", "max_regions", 2},
        {"[limits]\nmax_regions = 1.5\n", "max_regions", 2},
        {"[limits]\nmax_region_bytes = 18446744073709551616\n", "max_region_bytes", 2},
        {"[limits]\nmax_region_bytes = 0\n", "max_region_bytes", 2},
        {"[limits]\nmax_session_bytes = -68719476736\n", "max_session_bytes", 2},
        {"[limits]\nmax_message_bytes = 4095\n", "max_message_bytes", 2},
        {"[limits]\nmax_queued_requests = 1048577\n", "max_queued_requests", 2},
        {"[limits]\n\nmax_queued_tokens = 1073741825\n", "max_queued_tokens", 3},
        {"[batch]\nmax_batch_tokens = 1048577\n", "max_batch_tokens", 2},
        {"[batch]\nmax_batch_tokens = 0\n", "max_batch_tokens", 2},
        {"[batch]\nmax_delay_us = 10000001\n", "max_delay_us", 2},
        {"[batch]\nmax_request_tokens = 99999999999999999999999\n", "max_request_tokens", 2},
        {"[batch]\nmax_slice_tokens = 16777217\n", "max_slice_tokens", 2},
        {"[batch]\nmax_slice_tokens = 0x\n", "max_slice_tokens", 2},
        {"[daemon]\ncpu_threads = -4\n", "cpu_threads", 2},
        {"[daemon]\ncpu_threads = 1025\n", "cpu_threads", 2},
        {"[daemon]\ndevice = 256\n", "device", 2},
        {"[daemon]\ndevice = gpu0\n", "device", 2},
        {"[layer a]\nfile = /x\nexperts = -3\n", "experts", 3},
        {"[layer a]\nfile = /x\nhidden = 16777217\n", "hidden", 3},
        {"[layer a]\nfile = /x\ntopk = two\n", "topk", 3},
        {"[layer a]\nfile = /x\nk = 18446744073709551617\n", "'k'", 3},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        char line[32];
        snprintf(line, sizeof(line), "line %d: bad value", bad[i].line);
        expect_error(bad[i].text, line, bad[i].key);
    }
    CHECK_NO_LEAKS();
}

/* Numbers are written in decimal digits and nothing else: no sign (strtoull
 * would take "+5", and "-0" as 0) and no empty item in a list ("0," is a
 * list cut short, not the list 0). */
TEST(numbers_are_plain_decimal_digits)
{
    static const char *bad[] = {
        "[limits]\nmax_sessions = +5\n",
        "[limits]\nmax_region_bytes = +4096\n",
        "[batch]\nmax_delay_us = -0\n",
        "[daemon]\ncpu_threads = +2\n",
        "[daemon]\nio_threads = +2\n",
        "[daemon]\ndevice = +0\n",
        "[daemon]\ngpus = +1\n",
        "[daemon]\ngpus = 0,\n",
        "[daemon]\ngpus = 0,-0\n",
        "[daemon]\ngpus = 0, \n",
        "[layer x]\nexperts = +8\n",
        "[layer x]\ndevices = 0,+1\n",
        "[layer x]\nexpert_devices = 0,1,\n",
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++)
        expect_error(bad[i], "line 2: bad value", NULL);
    /* A leading zero is still decimal (nothing here is octal). */
    struct config c;
    char err[512] = "";
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_parse_string(&c, "[limits]\nmax_sessions = 010\n[daemon]\ngpus = 0 , 1\n",
                                     err, sizeof(err)), 0);
    CHECK_EQ_INT(c.max_sessions, 10);
    CHECK_EQ_INT(c.n_gpus, 2);
    config_done(&c);
    CHECK_NO_LEAKS();
}

/* A key set twice in a section is refused at its second line: the first
 * value was dropped without a word. inih reads an indented line after a
 * key as more of its value and hands it over as the key again, so that one
 * (which would replace the value) is refused too. A layer's section may
 * come again, with other keys. */
TEST(keys_set_twice_are_refused)
{
    expect_error("[limits]\nmax_sessions = 5\nmax_regions = 4\nmax_sessions = 6\n", "line 4: ",
                 "'max_sessions' in [limits] is set twice");
    expect_error("[limits]\nmax_sessions = 5\n  6\n", "line 3: ", "'max_sessions'");
    expect_error("[daemon]\nbackend = cpu\n[limits]\n[daemon]\nbackend = cuda\n", "line 5: ",
                 "'backend' in [daemon]");
    expect_error("[layer a]\nfile = /x\ntopk = 2\n   /y\n", "line 4: ", "'topk' in [layer a]");
    expect_error("[layer a]\nfile = /x\ntopk = 2\n[layer b]\nfile = /y\ntopk = 2\n[layer a]\n"
                 "file = /z\n", "line 8: ", "'file' in [layer a]");
    expect_ok("[layer a]\nfile = /x\n[layer b]\nfile = /y\ntopk = 1\n[layer a]\ntopk = 2\n");
    expect_ok("[limits]\nmax_sessions = 5\n[batch]\nmax_delay_us = 5\n");
    CHECK_NO_LEAKS();
}

TEST(error_bad_words)
{
    expect_error("[batch]\nbatching = maybe\n", "line 2: ", "bad value 'maybe' for 'batching' in [batch]");
    expect_error("[batch]\nbatching = 2\n", "line 2: ", "'batching'");
    expect_error("[batch]\nbatching =\n", "line 2: ", "'batching'");
    expect_error("[layer a]\nfile = /x\nrenormalize = yess\n", "line 3: ", "'renormalize'");
    expect_error("[daemon]\nbackend = gpu\n", "line 2: ", "bad value 'gpu' for 'backend'");
    expect_error("[daemon]\nlog_level = verbose\n", "line 2: ", "'log_level'");
    expect_error("[daemon]\nlog_level = 8\n", "line 2: ", "'log_level'");
    /* The file takes the names the command line does (log_level_parse). */
    static const struct {
        const char *v;
        int level;
    } lv[] = {{"err", 3}, {"error", 3}, {"warning", 4}, {"warn", 4}, {"notice", 5},
              {"info", 6}, {"debug", 7}, {"7", 7}};
    for (size_t i = 0; i < ARRAY_LEN(lv); i++) {
        struct config c;
        char text[64], err[256] = "";
        snprintf(text, sizeof(text), "[daemon]\nlog_level = %s\n", lv[i].v);
        CHECK_EQ_INT(config_init(&c), 0);
        CHECK_MSG(config_parse_string(&c, text, err, sizeof(err)) == 0, "%s: %s", lv[i].v, err);
        CHECK_EQ_INT(c.log_level, lv[i].level);
        config_done(&c);
    }
    expect_error("[daemon]\nruntime_dir = relative/run\n", "line 2: ", "'runtime_dir'");
    expect_error("[layer a]\nfile = /x\nkind = dense\n", "line 3: ", "'kind'");
    expect_error("[layer a]\nfile = /x\ndtype = int8\n", "line 3: ", "'dtype'");
    expect_error("[layer a]\nfile = /x\nrouting = topk\n", "line 3: ", "'routing'");
    CHECK_NO_LEAKS();
}

TEST(error_allowed_dirs)
{
    const char *dir = tmp_dir();
    char text[512], good[256];
    snprintf(good, sizeof(good), "%s/ok", dir);
    CHECK(mkdir(good, 0700) == 0);
    snprintf(text, sizeof(text), "[daemon]\nbackend = cpu\nallowed_dirs = %s:%s/missing\n", good, dir);
    expect_error(text, "line 3: bad value", "(each directory must exist)");
    snprintf(text, sizeof(text), "[daemon]\nallowed_dirs = %s/missing\n", dir);
    expect_error(text, "line 2: ", "allowed_dirs");
    /* A file where a directory is expected below it. */
    snprintf(text, sizeof(text), "%s/file", dir);
    write_text(text, "x");
    snprintf(text, sizeof(text), "[daemon]\nallowed_dirs = %s/file/sub\n", dir);
    {
        /* config.h promises -EINVAL; config.c passes realpath's -ENOTDIR
         * through (see the report). The message is what a user reads. */
        char err[512];
        int rc = parse_fresh(text, err, sizeof(err));
        CHECK_MSG(rc == -EINVAL || rc == -ENOTDIR, "rc %d", rc);
        CHECK_STR_CONTAINS(err, "line 2: bad value");
        CHECK_STR_CONTAINS(err, "allowed_dirs");
    }

    /* The direct call: the directory must exist, and is stored canonical. */
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    snprintf(text, sizeof(text), "%s/missing", dir);
    CHECK_EQ_INT(config_add_allowed_dir(&c, text), -ENOENT);
    CHECK_EQ_INT(c.n_allowed_dirs, 0);
    snprintf(text, sizeof(text), "%s/ok/../ok/", dir);
    CHECK_EQ_INT(config_add_allowed_dir(&c, text), 0);
    CHECK_EQ_INT(c.n_allowed_dirs, 1);
    CHECK_STR_EQ(c.allowed_dirs[0], good);
    /* Named again, or through a link to it: still one (a reload compares
     * the lists as sets). */
    CHECK_EQ_INT(config_add_allowed_dir(&c, good), 0);
    snprintf(text, sizeof(text), "%s/link", dir);
    CHECK(symlink(good, text) == 0);
    CHECK_EQ_INT(config_add_allowed_dir(&c, text), 0);
    CHECK_EQ_INT(c.n_allowed_dirs, 1);
    config_done(&c);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* An allowed directory is a directory, named by an absolute path in the
 * file: a regular file was taken (and allowed nothing), and a relative name
 * was resolved against whatever directory the daemon started in. */
TEST(allowed_dirs_are_absolute_directories)
{
    const char *dir = tmp_dir();
    char text[512], file[256];
    snprintf(file, sizeof(file), "%s/file", dir);
    write_text(file, "x");
    snprintf(text, sizeof(text), "[daemon]\nallowed_dirs = %s\n", file);
    expect_error(text, "line 2: bad value", "allowed_dirs");
    CHECK(chdir(dir) == 0);
    CHECK(mkdir("sub", 0700) == 0);
    expect_error("[daemon]\nallowed_dirs = sub\n", "line 2: bad value", "allowed_dirs");
    snprintf(text, sizeof(text), "[daemon]\nallowed_dirs = %s/sub:.\n", dir);
    expect_error(text, "line 2: bad value", "allowed_dirs");
    snprintf(text, sizeof(text), "[daemon]\nallowed_dirs = %s/sub\n", dir);
    expect_ok(text);

    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_add_allowed_dir(&c, file), -ENOTDIR);
    CHECK_EQ_INT(c.n_allowed_dirs, 0);
    config_done(&c);
    CHECK(chdir("/") == 0);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(error_layers)
{
    /* Names: 1-64 of [A-Za-z0-9._-]. These errors come after parsing, so
     * they name the layer instead of a line. */
    expect_error("[layer bad/name]\nfile = /x\n", "layer 'bad/name'", "names are");
    expect_error("[layer two words]\nfile = /x\n", "layer 'two words'", NULL);
    expect_error("[layer ]\nfile = /x\n", "layer ''", NULL);
    expect_ok("[layer \"quoted.name\"]\nfile = /x\ntopk = 2\n");
    expect_ok("[layer A-z_0.9]\nfile = /x\ntopk = 2\n");

    /* A layer needs a file. */
    expect_error("[layer nofile]\nkind = moe\nexperts = 8\n", "layer 'nofile'", "no file");
    expect_error("[layer good]\nfile = /x\ntopk = 2\n[layer second]\ndtype = bf16\n", "layer 'second'", "no file");

    /* What a load would refuse, refused here with the layer's name: a MoE
     * layer without topk (it may come in a later section of the same name),
     * a GEMM layer without the tensor's name. */
    expect_error("[layer m]\nfile = /x\nexperts = 8\n", "layer 'm'", "topk is required");
    expect_ok("[layer m]\nfile = /x\n[layer n]\nfile = /y\ntopk = 1\n[layer m]\ntopk = 2\n");
    expect_error("[layer g]\nkind = gemm\nfile = /x\n", "layer 'g'", "prefix =");
    expect_error("[layer g]\nkind = gemm\nfile = /x\nprefix =\n", "layer 'g'", "prefix =");
    expect_ok("[layer g]\nkind = gemm\nfile = /x\nprefix = w\n");

    /* No more sections than max_layers, wherever the limit is set. */
    expect_error("[layer a]\nfile = /x\ntopk = 2\n[layer b]\nfile = /x\ntopk = 2\n"
                 "[limits]\nmax_layers = 1\n", "2 [layer] sections", "max_layers (1)");
    expect_ok("[limits]\nmax_layers = 2\n[layer a]\nfile = /x\ntopk = 2\n"
              "[layer b]\nfile = /x\ntopk = 2\n");
    CHECK_NO_LEAKS();
}

/* inih (as Debian builds it) cuts section names at 49 characters and lines
 * at 199, and reads the rest of a long line as a line of its own. A layer
 * name of 44..64 characters, or a longer line, must either come through
 * whole or be refused with its line number; neither may be cut silently, and
 * the tail of a comment is not a setting. */
TEST(long_names_and_lines)
{
    uint64_t s = test_seed();
    char name[80], text[1200], err[512];
    for (int i = 0; i < 64; i++)
        name[i] = "abcdefghijklmnopqrstuvwxyz0123456789"[test_rand(&s) % 36];
    name[64] = '\0';
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    snprintf(text, sizeof(text), "[layer %s]\nfile = /x\ntopk = 2\n", name);
    int rc = config_parse_string(&c, text, err, sizeof(err));
    CHECK(rc == 0 || rc == -EINVAL);
    bool cut = rc == 0 && strcmp(c.layers->name, name) != 0;
    config_done(&c);

    /* 65 characters: too long for name_valid, whatever inih does. */
    name[64] = 'x';
    name[65] = '\0';
    snprintf(text, sizeof(text), "[layer %s]\nfile = /x\ntopk = 2\n", name);
    CHECK_EQ_INT(config_init(&c), 0);
    rc = config_parse_string(&c, text, err, sizeof(err));
    cut = cut || rc == 0;
    config_done(&c);

    /* A 300-character path. */
    char path[310];
    path[0] = '/';
    for (int i = 1; i < 300; i++)
        path[i] = "abcdefghij/"[test_rand(&s) % 10];
    path[300] = '\0';
    snprintf(text, sizeof(text), "[layer a]\nfile = %s\nexperts = 4\ntopk = 2\n", path);
    CHECK_EQ_INT(config_init(&c), 0);
    rc = config_parse_string(&c, text, err, sizeof(err));
    bool line_ok = rc == 0 ? strcmp(c.layers->path, path) == 0 : strstr(err, "line 2") != NULL;
    config_done(&c);

    /* A long comment whose tail (past character 199) reads as a setting. */
    char pad[200];
    memset(pad, 'c', 197);
    pad[197] = '\0';
    snprintf(text, sizeof(text), "[limits]\n; %s max_sessions = 5\n", pad);
    CHECK_EQ_INT(config_init(&c), 0);
    rc = config_parse_string(&c, text, err, sizeof(err));
    bool comment_ok = c.max_sessions == 256;
    config_done(&c);

    CHECK_NO_LEAKS();
    CHECK_MSG(!cut, "a long layer name was cut short silently");
    CHECK_MSG(line_ok, "a line over 199 characters was cut or misreported");
    CHECK_MSG(comment_ok, "the tail of a long comment was applied as a setting");
}

TEST(load_missing_file)
{
    const char *dir = tmp_dir();
    char path[256], err[512] = "";
    snprintf(path, sizeof(path), "%s/none.conf", dir);
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_load(&c, path, err, sizeof(err)), -ENOENT);
    CHECK_STR_CONTAINS(err, path);
    /* An error in a file names its line too. */
    write_text(path, "[daemon]\nbackend = cpu\n\n[limits]\nmax_regions = lots\n");
    CHECK_EQ_INT(config_load(&c, path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "line 5: bad value 'lots' for 'max_regions' in [limits]");
    config_done(&c);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* A file that is not a text file, or not a file, is refused naming the file
 * (and the line): a NUL byte ended the text that inih saw, so whatever
 * followed it was dropped without a word; a directory was a "read error". */
TEST(load_odd_files)
{
    const char *dir = tmp_dir();
    char path[256], err[512] = "";
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    snprintf(path, sizeof(path), "%s/nul.conf", dir);
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL);
    static const char text[] = "[limits]\nmax_sessions = 5\nmax_regions = 4\0\nnosuch = 1\n";
    CHECK(fwrite(text, 1, sizeof(text) - 1, fp) == sizeof(text) - 1);
    CHECK(fclose(fp) == 0);
    CHECK_EQ_INT(config_load(&c, path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, path);
    CHECK_STR_CONTAINS(err, "line 3: ");
    CHECK_STR_CONTAINS(err, "NUL");

    err[0] = '\0';
    CHECK(config_load(&c, dir, err, sizeof(err)) < 0);
    CHECK_STR_CONTAINS(err, dir);
    CHECK_STR_CONTAINS(err, "directory");

    /* An empty file is a valid one that sets nothing. */
    snprintf(path, sizeof(path), "%s/empty.conf", dir);
    write_text(path, "");
    CHECK_EQ_INT(config_load(&c, path, err, sizeof(err)), 0);
    CHECK_EQ_INT(c.max_sessions, 256);
    config_done(&c);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* ---- the runtime directory rule --------------------------------------------- */

TEST(runtime_dir_rule)
{
    setenv("MOED_RUNTIME_DIR", "/some/where/moed-rt", 1);
    setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
    char *d = config_default_runtime_dir();
    CHECK_STR_EQ(d, "/some/where/moed-rt");
    free(d);

    /* An empty MOED_RUNTIME_DIR is as good as none. */
    setenv("MOED_RUNTIME_DIR", "", 1);
    d = config_default_runtime_dir();
    CHECK_STR_EQ(d, geteuid() == 0 ? "/run/moed" : "/run/user/4242/moed");
    free(d);
    unsetenv("MOED_RUNTIME_DIR");
    d = config_default_runtime_dir();
    CHECK_STR_EQ(d, geteuid() == 0 ? "/run/moed" : "/run/user/4242/moed");
    free(d);

    /* As an unprivileged user (root can become one in this child). */
    uid_t euid = geteuid();
    if (euid == 0)
        CHECK(seteuid(65534) == 0);
    char want[64];
    d = config_default_runtime_dir();
    CHECK_STR_EQ(d, "/run/user/4242/moed");
    free(d);
    setenv("XDG_RUNTIME_DIR", "", 1);
    snprintf(want, sizeof(want), "/tmp/moed-%u", (unsigned)geteuid());
    d = config_default_runtime_dir();
    CHECK_STR_EQ(d, want);
    free(d);
    unsetenv("XDG_RUNTIME_DIR");
    d = config_default_runtime_dir();
    CHECK_STR_EQ(d, want);
    free(d);
    /* config_init follows the same rule. */
    setenv("XDG_RUNTIME_DIR", "/run/user/77", 1);
    struct config c;
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_STR_EQ(c.runtime_dir, "/run/user/77/moed");
    config_done(&c);
    CHECK(seteuid(euid) == 0); /* LeakSanitizer needs the original user */
    CHECK_NO_LEAKS();
}

/* ---- the token-tile table ---------------------------------------------------- */

/* [daemon] tile_table: an absolute file name, or empty for none; unset,
 * the rule of config_default_tile_table(). */
TEST(tile_table)
{
    struct config c;
    char err[512] = "";
    setenv("CACHE_DIRECTORY", "/var/cache/moed-test", 1);
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_STR_EQ(c.tile_table, "/var/cache/moed-test/tiles.tsv");
    CHECK_EQ_INT(config_parse_string(&c, "[daemon]\ntile_table = /srv/t/tiles.tsv\n", err,
                                     sizeof(err)), 0);
    CHECK_STR_EQ(c.tile_table, "/srv/t/tiles.tsv");
    CHECK_EQ_INT(config_parse_string(&c, "[daemon]\ntile_table =\n", err, sizeof(err)), 0);
    CHECK_STR_EQ(c.tile_table, "");
    CHECK_EQ_INT(config_set_daemon(&c, "tile_table", "/a/b.tsv"), 0);
    CHECK_STR_EQ(c.tile_table, "/a/b.tsv");
    CHECK_EQ_INT(config_set_daemon(&c, "tile_table", "b.tsv"), -EINVAL);
    CHECK_STR_EQ(c.tile_table, "/a/b.tsv");
    config_done(&c);
    CHECK(c.tile_table == NULL);
    expect_error("[daemon]\ntile_table = cache/tiles.tsv\n", "line 2: ",
                 "bad value 'cache/tiles.tsv' for 'tile_table' in [daemon]");
    expect_error("[batch]\ntile_table = /x\n", "line 2: ", "unknown key 'tile_table' in [batch]");

    /* The default: the service's CacheDirectory= (the first of a list),
     * else /var/cache/moed for root, else the user's cache directory. */
    setenv("CACHE_DIRECTORY", "/var/cache/a:/var/cache/b", 1);
    char *d = config_default_tile_table();
    CHECK_STR_EQ(d, "/var/cache/a/tiles.tsv");
    free(d);
    unsetenv("CACHE_DIRECTORY");
    setenv("XDG_CACHE_HOME", "/home/u/.xdg-cache", 1);
    setenv("HOME", "/home/u", 1);
    uid_t euid = geteuid();
    d = config_default_tile_table();
    CHECK_STR_EQ(d, euid == 0 ? "/var/cache/moed/tiles.tsv" : "/home/u/.xdg-cache/moed/tiles.tsv");
    free(d);
    if (euid == 0)
        CHECK(seteuid(65534) == 0);
    d = config_default_tile_table();
    CHECK_STR_EQ(d, "/home/u/.xdg-cache/moed/tiles.tsv");
    free(d);
    setenv("XDG_CACHE_HOME", "relative", 1); /* not absolute: ignored */
    d = config_default_tile_table();
    CHECK_STR_EQ(d, "/home/u/.cache/moed/tiles.tsv");
    free(d);
    unsetenv("XDG_CACHE_HOME");
    d = config_default_tile_table();
    CHECK_STR_EQ(d, "/home/u/.cache/moed/tiles.tsv");
    free(d);
    unsetenv("HOME");
    d = config_default_tile_table();
    CHECK_STR_EQ(d, ""); /* nowhere to keep one: none */
    free(d);
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_STR_EQ(c.tile_table, "");
    config_done(&c);
    CHECK(seteuid(euid) == 0);
    CHECK_NO_LEAKS();
}

/* [layer] devices and expert_devices: lists of device numbers. */
TEST(layer_devices)
{
    struct config c;
    char err[512] = "";
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_parse_string(&c, "[layer x]\nfile = /x\ntopk = 2\ndevices = 0, 2,1\n"
                                         "expert_devices = 0,1,1,2\n", err, sizeof(err)), 0);
    CHECK_EQ_INT(c.layers->n_devices, 3);
    CHECK_EQ_INT(c.layers->devices[1], 2);
    CHECK_EQ_INT(c.layers->n_expert_devices, 4);
    CHECK_EQ_INT(c.layers->expert_devices[3], 2);
    config_done(&c);
    const char *bad[] = {"devices = \n", "devices = 0,,1\n", "devices = a\n", "devices = 70000\n",
                         "devices = 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16\n",
                         "expert_devices = 1;2\n"};
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        char text[256];
        snprintf(text, sizeof(text), "[layer x]\nfile = /x\n%s", bad[i]);
        CHECK_EQ_INT(config_init(&c), 0);
        CHECK_MSG(config_parse_string(&c, text, err, sizeof(err)) == -EINVAL, "accepted: %s", bad[i]);
        CHECK_STR_CONTAINS(err, "line 3");
        config_done(&c);
    }
    CHECK_NO_LEAKS();
}

static char at_start_keys[256];
static void note_at_start(const char *key)
{
    strcat(at_start_keys, key);
    strcat(at_start_keys, " ");
}

/* A reload takes every [batch] and [limits] number a running daemon can
 * apply, and names each of the others that changed instead of taking it. */
TEST(take_numbers)
{
    struct config c, n;
    char err[512] = "";
    CHECK_EQ_INT(config_init(&c), 0);
    CHECK_EQ_INT(config_init(&n), 0);
    CHECK_EQ_INT(config_parse_string(&n, "[batch]\nmax_delay_us = 7\nspin_us = 9\n"
                                         "[limits]\nmax_layers = 3\nmax_loads = 2\n"
                                         "max_queued_total = 5\nmax_region_bytes = 12345\n"
                                         "max_message_bytes = 8192\n"
                                         "max_pending_messages = 64\n",
                                     err, sizeof(err)), 0);
    at_start_keys[0] = '\0';
    config_take_numbers(&c, &n, note_at_start);
    CHECK_EQ_INT(c.max_delay_us, 7);
    CHECK_EQ_INT(c.max_layers, 3);
    CHECK_EQ_INT(c.max_loads, 2);
    CHECK_EQ_INT(c.max_queued_total, 5);
    CHECK_EQ_INT(c.max_region_bytes, 12345);
    CHECK_EQ_INT(c.max_batch_tokens, 4096); /* the same in both */
    CHECK(c.spin_us == CONFIG_SPIN_AUTO);
    CHECK_EQ_INT(c.max_message_bytes, 1u << 20);
    CHECK_EQ_INT(c.max_pending_messages, 1024);
    CHECK_STR_EQ(at_start_keys, "spin_us max_message_bytes max_pending_messages ");
    /* nothing left to take: no call */
    at_start_keys[0] = '\0';
    n.spin_us = c.spin_us;
    n.max_message_bytes = c.max_message_bytes;
    n.max_pending_messages = c.max_pending_messages;
    config_take_numbers(&c, &n, note_at_start);
    CHECK_STR_EQ(at_start_keys, "");
    config_done(&c);
    config_done(&n);
    CHECK_NO_LEAKS();
}

/* The first layer section of text (parsed into c). */
static const struct layer_conf *first_layer(struct config *c, const char *text)
{
    char err[512] = "";
    CHECK_EQ_INT(config_init(c), 0);
    CHECK_MSG(config_parse_string(c, text, err, sizeof(err)) == 0, "%s: %s", text, err);
    CHECK(c->layers != NULL);
    return c->layers;
}

/* A reload loads a layer again when its section asks for another load
 * (layer_conf_same): any field of the load, the placement's order
 * included, and nothing else (the order of keys, an empty prefix). */
TEST(layer_sections_compare)
{
    const char *base = "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\n";
    const char *same[] = {
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\n",
        "[layer a]\ndevices = 0, 1\ntopk = 2\nprefix = p.\nfile = /x\nkind = moe\n",
        "[layer a]\nfile = /x\nprefix = p.\n[layer a]\ntopk = 2\ndevices = 0,1\n",
    };
    const char *differ[] = {
        "[layer a]\nfile = /y\nprefix = p.\ntopk = 2\ndevices = 0,1\n",
        "[layer a]\nfile = /x\nprefix = q.\ntopk = 2\ndevices = 0,1\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 3\ndevices = 0,1\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 1,0\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1,2\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\nexpert_devices = 0,1\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\nrouting = sigmoid\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\nrenormalize = no\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\ndtype = fp16\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\nexperts = 8\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\nhidden = 64\n",
        "[layer a]\nfile = /x\nprefix = p.\ntopk = 2\ndevices = 0,1\nintermediate = 64\n",
        "[layer a]\nkind = gemm\nfile = /x\nprefix = p.\ndevices = 0,1\n",
    };
    struct config a, b;
    const struct layer_conf *la = first_layer(&a, base);
    for (size_t i = 0; i < ARRAY_LEN(same); i++) {
        CHECK_MSG(layer_conf_same(la, first_layer(&b, same[i])), "differs: %s", same[i]);
        config_done(&b);
    }
    for (size_t i = 0; i < ARRAY_LEN(differ); i++) {
        CHECK_MSG(!layer_conf_same(la, first_layer(&b, differ[i])), "same: %s", differ[i]);
        config_done(&b);
    }
    config_done(&a);
    /* An empty prefix is no prefix. */
    la = first_layer(&a, "[layer g]\nfile = /x\ntopk = 1\nprefix =\n");
    CHECK(layer_conf_same(la, first_layer(&b, "[layer g]\nfile = /x\ntopk = 1\n")));
    config_done(&a);
    config_done(&b);
    CHECK_NO_LEAKS();
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(layer_devices),
        TEST_CASE(take_numbers),
        TEST_CASE(defaults),
        TEST_CASE(value_parsers),
        TEST_CASE(full_file),
        TEST_CASE(partial_files_layer),
        TEST_CASE(error_unknown_section_and_key),
        TEST_CASE(error_bad_numbers),
        TEST_CASE(numbers_are_plain_decimal_digits),
        TEST_CASE(keys_set_twice_are_refused),
        TEST_CASE(error_bad_words),
        TEST_CASE(error_allowed_dirs),
        TEST_CASE(allowed_dirs_are_absolute_directories),
        TEST_CASE(error_layers),
        TEST_CASE(long_names_and_lines),
        TEST_CASE(load_missing_file),
        TEST_CASE(load_odd_files),
        TEST_CASE(runtime_dir_rule),
        TEST_CASE(tile_table),
        TEST_CASE(layer_sections_compare),
        {0}});
}
