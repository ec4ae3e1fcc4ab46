/*
 * test_tiles.c: daemon/tiles.c, the token-tile table file: a table written
 * and read back is the same table; writing merges with the entries of other
 * cards and shapes already in the file and replaces the same key; lookups
 * miss what the table does not name; every kind of malformed line is
 * refused whole with the file name and line number, and a malformed file is
 * never overwritten.
 */
#include "tests/unit/unit.h"
#include "daemon/tiles.h"

#include <sys/stat.h>

/* ---- helpers ------------------------------------------------------------ */

static void write_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "w");
    CHECK(fp != NULL);
    CHECK(fputs(text, fp) >= 0);
    CHECK(fclose(fp) == 0);
}

static char *read_text(const char *path)
{
    FILE *fp = fopen(path, "r");
    CHECK(fp != NULL);
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof(buf) - 1, fp);
    fclose(fp);
    buf[n] = '\0';
    return buf;
}

static struct tile_entry entry(const char *dev, moek_dtype dt, int H, int I, int E, int k,
                               const int *rules, int n)
{
    struct tile_entry e;
    memset(&e, 0, sizeof(e));
    snprintf(e.device, sizeof(e.device), "%s", dev);
    e.dt = dt;
    e.hidden = H;
    e.intermediate = I;
    e.experts = E;
    e.topk = k;
    e.n_rules = n;
    for (int i = 0; i < n; i++)
        e.rules[i] = (struct tile_rule){rules[2 * i], rules[2 * i + 1]};
    return e;
}

static bool entry_eq(const struct tile_entry *a, const struct tile_entry *b)
{
    if (strcmp(a->device, b->device) || a->dt != b->dt || a->hidden != b->hidden ||
        a->intermediate != b->intermediate || a->experts != b->experts || a->topk != b->topk ||
        a->n_rules != b->n_rules)
        return false;
    for (int i = 0; i < a->n_rules; i++)
        if (a->rules[i].min_tokens != b->rules[i].min_tokens || a->rules[i].tile != b->rules[i].tile)
            return false;
    return true;
}

static const struct tile_entry *find(const struct tile_table *t, const struct tile_entry *e)
{
    moek_moe_shape s = {e->experts, e->topk, e->hidden, e->intermediate};
    return tiles_find(t, e->device, e->dt, &s);
}

/* text must be refused with -EINVAL and a message "NAME:LINE: ..." holding
 * want; the table stays empty. */
static void expect_bad_at(int at, const char *text, int line, const char *want)
{
    struct tile_table t;
    char err[512] = "", where[64];
    tiles_init(&t);
    int rc = tiles_parse(&t, text, "tiles.tsv", err, sizeof(err));
    if (rc != -EINVAL)
        FAIL_AT("line %d: rc %d (want -EINVAL), \"%s\", for:\n%s", at, rc, err, text);
    snprintf(where, sizeof(where), "tiles.tsv:%d: ", line);
    if (strncmp(err, where, strlen(where)) != 0)
        FAIL_AT("line %d: \"%s\" does not start with \"%s\"", at, err, where);
    if (!strstr(err, want))
        FAIL_AT("line %d: \"%s\" lacks \"%s\"", at, err, want);
    CHECK_EQ_INT(t.n, 0);
    tiles_done(&t);
}
#define expect_bad(text, line, want) expect_bad_at(__LINE__, text, line, want)

/* ---- cases ---------------------------------------------------------------- */

static const int R1[] = {1, 16, 64, 32, 512, 128, 2048, 256};
static const int R2[] = {1, 32};
static const int R3[] = {4, 64, 16, 192};

TEST(parse_and_lookup)
{
    const char *text =
        "# a comment\n"
        "\n"
        "   # an indented comment\n"
        "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16 64:32 512:128 2048:256\n"
        "NVIDIA H200\tfp16\t4096\t14336\t8\t2\t1:32\r\n"
        "NVIDIA H100 80GB HBM3\t\tbf16\t 7168 \t2048\t256\t8\t  4:64   16:192  \n";
    struct tile_table t;
    char err[512] = "";
    tiles_init(&t);
    CHECK_EQ_INT(tiles_parse(&t, text, "x.tsv", err, sizeof(err)), 0);
    CHECK_EQ_INT(t.n, 3);
    struct tile_entry a = entry("NVIDIA H200", MOEK_DTYPE_BF16, 4096, 14336, 8, 2, R1, 4);
    struct tile_entry b = entry("NVIDIA H200", MOEK_DTYPE_FP16, 4096, 14336, 8, 2, R2, 1);
    struct tile_entry c = entry("NVIDIA H100 80GB HBM3", MOEK_DTYPE_BF16, 7168, 2048, 256, 8,
                                R3, 2);
    CHECK(find(&t, &a) && entry_eq(find(&t, &a), &a));
    CHECK(find(&t, &b) && entry_eq(find(&t, &b), &b));
    CHECK(find(&t, &c) && entry_eq(find(&t, &c), &c));
    /* Misses: another card, dtype, or any dimension. */
    moek_moe_shape s = {8, 2, 4096, 14336};
    CHECK(tiles_find(&t, "NVIDIA H200", MOEK_DTYPE_BF16, &s) != NULL);
    CHECK(tiles_find(&t, "NVIDIA H20", MOEK_DTYPE_BF16, &s) == NULL);
    CHECK(tiles_find(&t, "nvidia h200", MOEK_DTYPE_BF16, &s) == NULL);
    CHECK(tiles_find(&t, "NVIDIA H200", MOEK_DTYPE_FP32, &s) == NULL);
    const moek_moe_shape miss[] = {
        {16, 2, 4096, 14336}, {8, 1, 4096, 14336}, {8, 2, 4095, 14336}, {8, 2, 4096, 14335}};
    for (size_t i = 0; i < ARRAY_LEN(miss); i++)
        CHECK(tiles_find(&t, "NVIDIA H200", MOEK_DTYPE_BF16, &miss[i]) == NULL);
    CHECK(tiles_find(NULL, "NVIDIA H200", MOEK_DTYPE_BF16, &s) == NULL);
    tiles_done(&t);

    /* An empty file (or one of comments) is an empty table. */
    tiles_init(&t);
    CHECK_EQ_INT(tiles_parse(&t, "", "x", err, sizeof(err)), 0);
    CHECK_EQ_INT(tiles_parse(&t, "# only\n\n", "x", err, sizeof(err)), 0);
    CHECK_EQ_INT(t.n, 0);
    CHECK(tiles_find(&t, "NVIDIA H200", MOEK_DTYPE_BF16, &s) == NULL);
    tiles_done(&t);
    tiles_done(&t); /* twice is fine */
    CHECK_NO_LEAKS();
}

TEST(malformed_lines)
{
    const char *ok = "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\n";
    char text[1024];
    /* The bad line is line 3, after a comment and a good line. */
#define AT3(line) (snprintf(text, sizeof(text), "# c\n%s%s\n", ok, line), text)
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2"), 3, "6 fields; want 7");
    expect_bad(AT3("NVIDIA H200 bf16 4096 14336 8 2 1:16"), 3, "1 field; want 7");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\textra"), 3, "more than 7");
    expect_bad(AT3("NVIDIA H200\tbf32\t4096\t14336\t8\t2\t1:16"), 3, "unknown dtype 'bf32'");
    expect_bad(AT3("NVIDIA H200\tfp32\t4096\t14336\t8\t2\t1:16"), 3, "unknown dtype 'fp32'");
    expect_bad(AT3("NVIDIA H200\tbf16\t40x6\t14336\t8\t2\t1:16"), 3, "bad hidden '40x6'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t-1\t8\t2\t1:16"), 3, "bad intermediate '-1'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t0\t2\t1:16"), 3, "bad experts '0'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2.5\t1:16"), 3, "bad topk '2.5'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t9\t1:16"), 3, "topk 9 is not between");
    expect_bad(AT3("NVIDIA H200\tbf16\t9999999\t14336\t8\t2\t1:16"), 3, "hidden 9999999");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:100"), 3,
               "rule '1:100': tile 100 is not 16, 32, 64, 128, 144, 192 or 256");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16 64:32 64:64"), 3,
               "rule '64:64': min_tokens does not ascend");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t8:16 4:32"), 3, "does not ascend");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t0:16"), 3, "rule '0:16'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1-16"), 3, "bad rule '1-16'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16 x:32"), 3, "bad rule 'x:32'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:"), 3, "bad rule '1:'");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t   "), 3, "no rules");
    expect_bad(AT3("NVIDIA H200\tbf16\t4096\t14336\t16\t2\t1:16\n"
                   "NVIDIA H200\tbf16\t4096\t14336\t16\t2\t1:32"), 4,
               "the same card, dtype and shape as line 3");
    expect_bad(AT3(" \tbf16\t4096\t14336\t8\t2\t1:16"), 3, "name is empty");
    char many[1024] = "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t";
    for (int i = 1; i <= TILES_MAX_RULES + 1; i++)
        snprintf(many + strlen(many), sizeof(many) - strlen(many), "%d:16 ", i);
    expect_bad(AT3(many), 3, "more than 32 rules");
    char longname[200];
    memset(longname, 'A', 120);
    snprintf(longname + 120, sizeof(longname) - 120, "\tbf16\t1\t1\t1\t1\t1:16");
    expect_bad(AT3(longname), 3, "longer than 95");
    expect_bad("NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\x01\n", 1, "bad rule");
#undef AT3
    CHECK_NO_LEAKS();
}

TEST(read_missing_and_malformed_files)
{
    const char *dir = tmp_dir_new("tiles");
    char path[256], err[512];
    struct tile_table t;
    tiles_init(&t);
    snprintf(path, sizeof(path), "%s/none.tsv", dir);
    CHECK_EQ_INT(tiles_read(&t, path, err, sizeof(err)), -ENOENT);
    CHECK_STR_CONTAINS(err, "none.tsv");
    snprintf(path, sizeof(path), "%s/bad.tsv", dir);
    write_text(path, "# c\nNVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\nNVIDIA H200\tbf17\t1\t1\t1\t1\t1:16\n");
    CHECK_EQ_INT(tiles_read(&t, path, err, sizeof(err)), -EINVAL);
    char want[300];
    snprintf(want, sizeof(want), "%s:3: unknown dtype 'bf17'", path);
    CHECK_STR_CONTAINS(err, want);
    CHECK_EQ_INT(t.n, 0);
    /* A file with a NUL byte is not text. */
    FILE *fp = fopen(path, "w");
    CHECK(fp && fwrite("a\0b\n", 1, 4, fp) == 4 && fclose(fp) == 0);
    CHECK_EQ_INT(tiles_read(&t, path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "line 1: a NUL byte");
    /* A directory is named as one, not as a "read error". */
    CHECK_EQ_INT(tiles_read(&t, dir, err, sizeof(err)), -EISDIR);
    snprintf(want, sizeof(want), "%s: Is a directory", dir);
    CHECK_STR_EQ(err, want);
    /* More than 1 MiB is refused. */
    fp = fopen(path, "w");
    CHECK(fp);
    for (int i = 0; i < (1 << 16) + 1; i++)
        fputs("# 16 bytes line\n", fp);
    CHECK(fclose(fp) == 0);
    CHECK_EQ_INT(tiles_read(&t, path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "larger than 1 MiB");
    tiles_done(&t);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(write_then_read_round_trip)
{
    const char *dir = tmp_dir_new("tiles");
    char path[256], err[512] = "";
    /* The directory is created. */
    snprintf(path, sizeof(path), "%s/cache/moed/tiles.tsv", dir);
    struct tile_table up, back;
    tiles_init(&up);
    tiles_init(&back);
    struct tile_entry e[3] = {
        entry("NVIDIA H200", MOEK_DTYPE_BF16, 4096, 14336, 8, 2, R1, 4),
        entry("NVIDIA H200", MOEK_DTYPE_FP16, 2048, 768, 128, 8, R2, 1),
        entry("NVIDIA A100-SXM4-80GB", MOEK_DTYPE_BF16, 7168, 2048, 256, 8, R3, 2),
    };
    for (int i = 0; i < 3; i++)
        CHECK_EQ_INT(tiles_put(&up, &e[i], err, sizeof(err)), 0);
    size_t kept = 99;
    CHECK_EQ_INT(tiles_write(path, &up, &kept, err, sizeof(err)), 0);
    CHECK_EQ_INT(kept, 0);
    struct stat st;
    CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0644);
    CHECK_EQ_INT(tiles_read(&back, path, err, sizeof(err)), 0);
    CHECK_EQ_INT(back.n, 3);
    for (int i = 0; i < 3; i++)
        CHECK(find(&back, &e[i]) && entry_eq(find(&back, &e[i]), &e[i]));
    /* The text: a header comment, tabs, sorted by card. */
    const char *text = read_text(path);
    CHECK(text[0] == '#');
    CHECK_STR_CONTAINS(text, "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16 64:32 512:128 2048:256\n");
    CHECK(strstr(text, "NVIDIA A100") < strstr(text, "NVIDIA H200"));
    /* No temporary file is left beside it. */
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "test $(ls -A %s/cache/moed | wc -l) = 1", dir);
    CHECK_EQ_INT(system(cmd), 0);
    /* Formatting and parsing agree on a table of every rule count. */
    struct tile_table big;
    tiles_init(&big);
    for (int n = 1; n <= TILES_MAX_RULES; n++) {
        struct tile_entry x = entry("Card", n % 2 ? MOEK_DTYPE_BF16 : MOEK_DTYPE_FP16, 64 * n,
                                    128, 8, 2, NULL, 0);
        x.n_rules = n;
        for (int r = 0; r < n; r++)
            x.rules[r] = (struct tile_rule){1 + r * 1000, tiles_offered[r % TILES_N_OFFERED]};
        CHECK_EQ_INT(tiles_put(&big, &x, err, sizeof(err)), 0);
    }
    char *fmt = NULL;
    CHECK_EQ_INT(tiles_format(&big, &fmt), 0);
    struct tile_table again;
    tiles_init(&again);
    CHECK_EQ_INT(tiles_parse(&again, fmt, "fmt", err, sizeof(err)), 0);
    CHECK_EQ_INT(again.n, TILES_MAX_RULES);
    for (size_t i = 0; i < big.n; i++)
        CHECK(find(&again, &big.entries[i]) && entry_eq(find(&again, &big.entries[i]),
                                                         &big.entries[i]));
    free(fmt);
    tiles_done(&again);
    tiles_done(&big);
    tiles_done(&up);
    tiles_done(&back);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(write_merges_with_the_file)
{
    const char *dir = tmp_dir_new("tiles");
    char path[256], err[512] = "";
    snprintf(path, sizeof(path), "%s/tiles.tsv", dir);
    write_text(path, "# hand-written\n"
                     "Other Card\tbf16\t4096\t14336\t8\t2\t1:64\n"
                     "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:256\n"
                     "NVIDIA H200\tbf16\t2048\t768\t128\t8\t1:16 100:64\n");
    struct tile_table up, back;
    tiles_init(&up);
    tiles_init(&back);
    struct tile_entry same = entry("NVIDIA H200", MOEK_DTYPE_BF16, 4096, 14336, 8, 2, R1, 4);
    struct tile_entry add = entry("NVIDIA H200", MOEK_DTYPE_FP16, 4096, 14336, 8, 2, R2, 1);
    CHECK_EQ_INT(tiles_put(&up, &same, err, sizeof(err)), 0);
    CHECK_EQ_INT(tiles_put(&up, &add, err, sizeof(err)), 0);
    size_t kept = 0;
    CHECK_EQ_INT(tiles_write(path, &up, &kept, err, sizeof(err)), 0);
    CHECK_EQ_INT(kept, 2);
    CHECK_EQ_INT(tiles_read(&back, path, err, sizeof(err)), 0);
    CHECK_EQ_INT(back.n, 4);
    CHECK(entry_eq(find(&back, &same), &same)); /* replaced */
    CHECK(entry_eq(find(&back, &add), &add));   /* added */
    const int r_other[] = {1, 64}, r_qwen[] = {1, 16, 100, 64};
    struct tile_entry other = entry("Other Card", MOEK_DTYPE_BF16, 4096, 14336, 8, 2, r_other, 1);
    struct tile_entry qwen = entry("NVIDIA H200", MOEK_DTYPE_BF16, 2048, 768, 128, 8, r_qwen, 2);
    CHECK(find(&back, &other) && entry_eq(find(&back, &other), &other)); /* kept */
    CHECK(find(&back, &qwen) && entry_eq(find(&back, &qwen), &qwen));
    tiles_done(&back);

    /* tiles_put replaces in memory too, and checks what it adds. */
    struct tile_entry bad = entry("NVIDIA H200", MOEK_DTYPE_BF16, 4096, 14336, 8, 2, R1, 4);
    bad.rules[2].tile = 100;
    CHECK_EQ_INT(tiles_put(&up, &bad, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "tile 100");
    CHECK_EQ_INT(up.n, 2);
    bad = entry("", MOEK_DTYPE_BF16, 4096, 14336, 8, 2, R1, 4);
    CHECK_EQ_INT(tiles_put(&up, &bad, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "name is empty");
    bad = entry("NVIDIA H200", MOEK_DTYPE_BF16, 4096, 14336, 8, 2, R1, 0);
    CHECK_EQ_INT(tiles_put(&up, &bad, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "no rules");

    /* A malformed file is refused and left as it is. */
    const char *broken = "NVIDIA H200\tbf16\t4096\t14336\t8\t2\t1:16\nnot a line\n";
    write_text(path, broken);
    CHECK_EQ_INT(tiles_write(path, &up, NULL, err, sizeof(err)), -EINVAL);
    char want[300];
    snprintf(want, sizeof(want), "%s:2: ", path);
    CHECK_STR_CONTAINS(err, want);
    CHECK_STR_CONTAINS(err, "not overwritten");
    CHECK_STR_EQ(read_text(path), broken);
    /* A relative name is refused. */
    CHECK_EQ_INT(tiles_write("tiles.tsv", &up, NULL, err, sizeof(err)), -EINVAL);
    tiles_done(&up);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(dtype_names_and_tiles)
{
    CHECK_STR_EQ(tiles_dtype_name(MOEK_DTYPE_BF16), "bf16");
    CHECK_STR_EQ(tiles_dtype_name(MOEK_DTYPE_FP16), "fp16");
    CHECK(tiles_dtype_name(MOEK_DTYPE_FP32) == NULL);
    CHECK_EQ_INT(tiles_dtype_parse("bf16"), MOEK_DTYPE_BF16);
    CHECK_EQ_INT(tiles_dtype_parse("fp16"), MOEK_DTYPE_FP16);
    CHECK_EQ_INT(tiles_dtype_parse("fp32"), -1);
    CHECK_EQ_INT(tiles_dtype_parse("BF16"), -1);
    for (int t = 0; t <= 512; t++)
        CHECK_EQ_INT(tiles_tile_ok(t), t == 16 || t == 32 || t == 64 || t == 128 || t == 144 ||
                                           t == 192 || t == 256);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(parse_and_lookup),
        TEST_CASE(malformed_lines),
        TEST_CASE(read_missing_and_malformed_files),
        TEST_CASE(write_then_read_round_trip),
        TEST_CASE(write_merges_with_the_file),
        TEST_CASE(dtype_names_and_tiles),
        {0}});
}
