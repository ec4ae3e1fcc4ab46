/*
 * itest_tune.c: the token-tile table and `moed --tune` through the real
 * binary: without a GPU --tune exits 1 with one line saying it needs a CUDA
 * device and writes nothing (on a GPU, MOE_TEST_BACKEND=cuda, it measures a
 * small shape, writes the table, and a daemon started afterwards gives the
 * demo layer the table's tiles); bad tuning options exit 2; --check-config
 * takes tile_table and reports a malformed table without failing; a daemon
 * starts with a malformed table (the kernels' heuristic then picks) and
 * reads the table again on SIGHUP.
 */
#include "tests/integration/itest.h"

static void write_file(const char *path, const char *text)
{
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL);
    CHECK(fputs(text, fp) >= 0);
    CHECK(fclose(fp) == 0);
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static char *read_file(const char *path)
{
    static char buf[1 << 16];
    FILE *fp = fopen(path, "r");
    if (!fp)
        return NULL;
    size_t n = fread(buf, 1, sizeof(buf) - 1, fp);
    fclose(fp);
    buf[n] = '\0';
    return buf;
}

/* Wait up to 5 s for the daemon's log to hold want. */
static bool log_waits_for(const struct itest_daemon *d, const char *want)
{
    for (int i = 0; i < 250; i++) {
        const char *log = read_file(d->log);
        if (log && strstr(log, want))
            return true;
        itest_sleep_ms(20);
    }
    return false;
}

/* want appears n times in the daemon's log (within 5 s). */
static bool log_waits_for_n(const struct itest_daemon *d, const char *want, int n)
{
    for (int i = 0; i < 250; i++) {
        const char *log = read_file(d->log);
        int seen = 0;
        for (const char *p = log; p && (p = strstr(p, want)) != NULL; p++)
            seen++;
        if (seen >= n)
            return true;
        itest_sleep_ms(20);
    }
    return false;
}

TEST(tune_needs_a_cuda_device)
{
    char dir[] = "/tmp/moed-tune.XXXXXX", table[300], rt[300], out[8192];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(table, sizeof(table), "%s/cache/tiles.tsv", dir);
    snprintf(rt, sizeof(rt), "%s/rt", dir);
    const char *b = itest_build();
    if (itest_on_gpu()) {
        /* A real, small tune; the table then serves the demo layer. */
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                             "%s/moed --tune --backend cuda --tile-table %s --tune-shape "
                             "8,2,256,512 --tune-tokens 1,16,256 --runtime-dir %s",
                             b, table, rt), 0);
        CHECK_STR_CONTAINS(out, ", bf16, E=8 k=2 H=256 I=512 (--tune-shape)");
        CHECK_STR_CONTAINS(out, "1 entry written");
        const char *text = read_file(table);
        CHECK(text != NULL);
        CHECK_STR_CONTAINS(text, "\tbf16\t256\t512\t8\t2\t1:");
        CHECK(access(rt, F_OK) != 0); /* no socket, not even the directory */
        struct itest_daemon d;
        itest_daemon_start(&d, "--demo", "--tile-table", table, NULL);
        CHECK(log_waits_for(&d, "layer 'demo': token tiles from the tile table"));
        itest_daemon_stop(&d);
        itest_rmdir(dir);
        return;
    }
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                         "%s/moed --tune --backend cpu --tile-table %s --tune-shape 8,2,256,512 "
                         "--runtime-dir %s", b, table, rt), 1);
    CHECK_STR_CONTAINS(out, "tuning needs a CUDA device");
    CHECK_EQ_INT(count_lines(out), 1);
    /* The same for the demo layer's shape, and before a configured layer
     * is even looked at. */
    char conf[300], text[400];
    snprintf(conf, sizeof(conf), "%s/moed.conf", dir);
    snprintf(text, sizeof(text), "[layer x]\nfile = %s/none.safetensors\ntopk = 2\n", dir);
    write_file(conf, text);
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moed --tune --backend cpu --config %s "
                         "--tile-table %s --demo --runtime-dir %s", b, conf, table, rt), 1);
    CHECK_STR_CONTAINS(out, "tuning needs a CUDA device: the cpu backend");
    CHECK_EQ_INT(count_lines(out), 1);
    /* Nothing was written, no socket opened. */
    CHECK(access(table, F_OK) != 0);
    CHECK(access(rt, F_OK) != 0);
    itest_rmdir(dir);
}

TEST(tune_refuses_bad_options)
{
    char out[8192];
    const char *b = itest_build();
    static const char *bad[] = {
        "--tune --tune-shape 8,2,256",
        "--tune --tune-shape 8,2,256,512,fp32",
        "--tune --tune-shape 8,9,256,512",
        "--tune --tune-tokens 1,0",
        "--tune --tune-tokens 1,,2",
        "--tune --max-batch-tokens 64 --tune-tokens 1,128",
        "--tune-shape 8,2,256,512",
        "--tune --check-config",
        "--tune --tile-table relative.tsv",
    };
    static const char *why[] = {
        "--tune-shape 8,2,256: want E,k,H,I[,dtype]", "--tune-shape 8,2,256,512,fp32",
        "--tune-shape 8,9,256,512", "--tune-tokens 1,0", "--tune-tokens 1,,2",
        "--tune-tokens 128: above max_batch_tokens (64)", "go with --tune",
        "exclude each other", "--tile-table relative.tsv: not an absolute file name",
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        int rc = itest_run_cmd(true, out, sizeof(out), "%s/moed --backend cpu %s", b, bad[i]);
        CHECK_MSG(rc == (i == ARRAY_LEN(bad) - 1 ? 1 : 2), "moed %s: exit status %d", bad[i], rc);
        CHECK_STR_CONTAINS(out, why[i]);
    }
}

TEST(check_config_with_tile_table)
{
    char dir[] = "/tmp/moed-tune.XXXXXX", conf[300], table[300], out[8192], text[600];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(conf, sizeof(conf), "%s/moed.conf", dir);
    snprintf(table, sizeof(table), "%s/tiles.tsv", dir);
    snprintf(text, sizeof(text), "[daemon]\nbackend = cpu\ntile_table = %s\n", table);
    write_file(conf, text);
    const char *b = itest_build();
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moed --config %s --check-config", b, conf), 0);
    CHECK_STR_CONTAINS(out, "configuration OK");
    char want[400];
    snprintf(want, sizeof(want), "tile table %s: not written yet", table);
    CHECK_STR_CONTAINS(out, want);
    write_file(table, "# tuned\nNVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16 64:32 512:128\n");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moed --config %s --check-config", b, conf), 0);
    snprintf(want, sizeof(want), "tile table %s: 1 entry", table);
    CHECK_STR_CONTAINS(out, want);
    /* A malformed table is reported with its line; the configuration is
     * still good (the daemon would start with the heuristic). */
    write_file(table, "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\nNVIDIA H200\tbf16\t1\t1\t1\t1\t1:100\n");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moed --config %s --check-config", b, conf), 0);
    snprintf(want, sizeof(want), "%s:2: rule '1:100': tile 100 is not", table);
    CHECK_STR_CONTAINS(out, want);
    CHECK_STR_CONTAINS(out, "configuration OK");
    /* Empty: no table. */
    write_file(conf, "[daemon]\ntile_table =\n");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moed --config %s --check-config", b, conf), 0);
    CHECK_STR_CONTAINS(out, "tile table: none");
    /* A relative name is a configuration error. */
    write_file(conf, "[daemon]\ntile_table = tiles.tsv\n");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moed --config %s --check-config", b, conf), 1);
    CHECK_STR_CONTAINS(out, "line 2: bad value 'tiles.tsv' for 'tile_table'");
    itest_rmdir(dir);
}

TEST(a_bad_table_does_not_stop_the_daemon)
{
    char dir[] = "/tmp/moed-tune.XXXXXX", table[300], want[400];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(table, sizeof(table), "%s/tiles.tsv", dir);
    write_file(table, "# broken\nNVIDIA H200\tbf16\t4096\n");
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", "--tile-table", table, NULL);
    snprintf(want, sizeof(want), "tile table %s:2: 3 fields; want 7", table);
    CHECK_MSG(log_waits_for(&d, want), "no \"%s\" in %s", want, d.log);
    CHECK(log_waits_for(&d, "token tiles from the kernels' heuristic"));
    /* It serves. */
    char out[4096];
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s forward --layer demo --tokens 3 --check",
                         itest_build(), d.dir), 0);
    CHECK_STR_CONTAINS(out, ": ok");
    /* A reload reads the table again. */
    write_file(table, "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\nOther\tfp16\t64\t64\t4\t1\t1:32\n");
    kill(d.pid, SIGHUP);
    snprintf(want, sizeof(want), "tile table %s: 2 entries", table);
    CHECK_MSG(log_waits_for(&d, want), "no \"%s\" in %s", want, d.log);
    /* A table half-written meanwhile keeps the one in use; where a backend
     * takes tiles (CUDA), the reload is one with errors. */
    write_file(table, "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\nOther\tfp16\t64\n");
    kill(d.pid, SIGHUP);
    CHECK(log_waits_for(&d, "tiles.tsv:2: 3 fields; want 7 separated by tabs: card, dtype, hidden, "
                            "intermediate, experts, topk, rules; keeping the table in use (2 "
                            "entries)"));
    CHECK(log_waits_for_n(&d, "reload: 0 layers loaded", 2));
    const char *log = read_file(d.log);
    bool said = log && strstr(log, "reload: the tile table could not be used");
    CHECK_MSG(said == itest_on_gpu(), "the reload %s a table it could not use",
              said ? "counts as with errors" : "does not count as with errors");
    unlink(table);
    kill(d.pid, SIGHUP);
    snprintf(want, sizeof(want), "no tile table at %s", table);
    CHECK_MSG(log_waits_for(&d, want), "no \"%s\" in %s", want, d.log);
    /* With no table in use, a malformed one leaves the heuristic. */
    write_file(table, "Other\tfp16\t64\n");
    kill(d.pid, SIGHUP);
    CHECK(log_waits_for(&d, "tiles.tsv:1: 3 fields; want 7 separated by tabs: card, dtype, hidden, "
                            "intermediate, experts, topk, rules; token tiles from the kernels' "
                            "heuristic"));
    itest_daemon_stop(&d);
    itest_rmdir(dir);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(tune_needs_a_cuda_device),
        TEST_CASE(tune_refuses_bad_options),
        TEST_CASE(check_config_with_tile_table),
        TEST_CASE(a_bad_table_does_not_stop_the_daemon),
        {0}});
}
