/*
 * test_misc.c: the small modules: daemon/stats.c (power-of-two histograms,
 * exact quantiles over a ring of samples), proto/status.c (the one table
 * between errno values, wire statuses and messages), proto/rundir.c (which
 * runtime directories both ends trust) and daemon/util.c (names,
 * overflow-checked arithmetic, random bytes).
 *
 * Expected values come from independent computations (sorting, 128-bit
 * arithmetic) or from hand-worked data, never from the code under test.
 */
#include "tests/unit/unit.h"
#include "daemon/backend.h"
#include "daemon/loop.h"
#include "daemon/notify.h"
#include "daemon/safetensors.h"
#include "daemon/server.h"
#include "daemon/shard.h"
#include "daemon/stats.h"
#include "daemon/util.h"
#include "moe.pb-c.h"
#include "proto/rundir.h"
#include "proto/status.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <unistd.h>

#include <limits.h>


/* ---- helpers ------------------------------------------------------------ */

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The bucket stats.h describes: i with 2^(i-1) < v <= 2^i, 0 for v <= 1,
 * everything larger in the last. */
static int ref_bucket(uint64_t v)
{
    int i = 0;
    uint64_t le = 1;
    while (i < HIST_BUCKETS - 1 && v > le) {
        i++;
        le *= 2;
    }
    return i;
}

/* ---- histograms ------------------------------------------------------------ */

TEST(hist_buckets)
{
    for (int i = 0; i < 63; i++)
        CHECK(hist_bucket_le(i) == (uint64_t)1 << i);
    CHECK(hist_bucket_le(63) == UINT64_MAX);

    struct hist h;
    memset(&h, 0, sizeof(h));
    /* Hand-worked: the edges of the first buckets and the last one. */
    const struct {
        uint64_t v;
        int bucket;
    } known[] = {
        {0, 0}, {1, 0}, {2, 1}, {3, 2}, {4, 2}, {5, 3}, {8, 3}, {9, 4},
        {1024, 10}, {1025, 11}, {(1u << 30) + 1, 31}, {1u << 31, 31},
        {(1ull << 31) + 1, 31}, {1ull << 40, 31}, {UINT64_MAX / 2, 31},
    };
    uint64_t sum = 0;
    for (size_t i = 0; i < ARRAY_LEN(known); i++) {
        uint64_t before[HIST_BUCKETS];
        memcpy(before, h.buckets, sizeof(before));
        hist_add(&h, known[i].v);
        sum += known[i].v;
        for (int b = 0; b < HIST_BUCKETS; b++)
            CHECK_MSG(h.buckets[b] == before[b] + (b == known[i].bucket),
                      "value %llu: bucket %d", (unsigned long long)known[i].v, b);
    }
    CHECK_EQ_INT(h.count, ARRAY_LEN(known));
    CHECK(h.sum == sum);

    /* Random values against the reference bucket. */
    uint64_t s = test_seed();
    uint64_t want[HIST_BUCKETS] = {0};
    memset(&h, 0, sizeof(h));
    sum = 0;
    for (int i = 0; i < 20000; i++) {
        uint64_t v = test_rand(&s) >> (test_rand(&s) % 64);
        hist_add(&h, v);
        want[ref_bucket(v)]++;
        sum += v;
    }
    CHECK_EQ_INT(h.count, 20000);
    CHECK(h.sum == sum); /* modulo 2^64, like the field */
    for (int b = 0; b < HIST_BUCKETS; b++)
        CHECK_MSG(h.buckets[b] == want[b], "bucket %d: %llu, want %llu", b,
                  (unsigned long long)h.buckets[b], (unsigned long long)want[b]);
    CHECK_NO_LEAKS();
}

TEST(hist_quantiles)
{
    struct hist h;
    memset(&h, 0, sizeof(h));
    CHECK_EQ_INT(hist_quantile(&h, 0.5), 0);
    CHECK_EQ_INT(hist_quantile(&h, 1.0), 0);

    /* Hand-worked, with values at their buckets' upper bounds: 50 x 4,
     * 40 x 128, 10 x 1024. The q-quantile is sample floor(q * 100). */
    for (int i = 0; i < 50; i++)
        hist_add(&h, 4);
    for (int i = 0; i < 40; i++)
        hist_add(&h, 128);
    for (int i = 0; i < 10; i++)
        hist_add(&h, 1024);
    CHECK_EQ_INT(hist_quantile(&h, 0.0), 4);
    CHECK_EQ_INT(hist_quantile(&h, 0.49), 4);
    CHECK_EQ_INT(hist_quantile(&h, 0.5), 128);
    CHECK_EQ_INT(hist_quantile(&h, 0.89), 128);
    CHECK_EQ_INT(hist_quantile(&h, 0.9), 1024);
    CHECK_EQ_INT(hist_quantile(&h, 0.99), 1024);
    CHECK_EQ_INT(hist_quantile(&h, 1.0), 1024);

    /* Random data: the quantile is the upper bound of the bucket that holds
     * the sorted sample at floor(q * n), clamped to the largest sample, and
     * never below that sample. Values stay below 2^31, where buckets are
     * exact powers of two. */
    uint64_t s = test_seed();
    for (int round = 0; round < 20; round++) {
        size_t n = 1 + test_rand(&s) % 3000;
        uint64_t *v = malloc(n * sizeof(*v));
        CHECK(v != NULL);
        memset(&h, 0, sizeof(h));
        for (size_t i = 0; i < n; i++) {
            v[i] = (test_rand(&s) >> 33) >> (test_rand(&s) % 31);
            hist_add(&h, v[i]);
        }
        qsort(v, n, sizeof(*v), cmp_u64);
        const double qs[] = {0, 0.1, 0.5, 0.9, 0.99, 0.999, 1};
        for (size_t k = 0; k < ARRAY_LEN(qs); k++) {
            size_t at = (size_t)(qs[k] * (double)n);
            if (at >= n)
                at = n - 1;
            uint64_t le = (uint64_t)1 << ref_bucket(v[at]);
            if (le > v[n - 1])
                le = v[n - 1];
            uint64_t got = hist_quantile(&h, qs[k]);
            CHECK_MSG(got == le, "n %zu q %g: %llu, want %llu (sample %llu)", n, qs[k],
                      (unsigned long long)got, (unsigned long long)le, (unsigned long long)v[at]);
            CHECK(got >= v[at]);
        }
        free(v);
    }
    CHECK_NO_LEAKS();
}

/* stats.h: "reported as the upper bound of its bucket, clamped to the largest
 * value seen". */
TEST(hist_quantile_clamped_to_max)
{
    struct hist h;
    memset(&h, 0, sizeof(h));
    for (int i = 0; i < 10; i++)
        hist_add(&h, 100);
    hist_add(&h, 1000);
    /* The median's bucket bound (128) is below the maximum: not clamped. */
    CHECK_EQ_INT(hist_quantile(&h, 0.5), 128);
    CHECK_EQ_INT(hist_quantile(&h, 1.0), 1000);
    CHECK_NO_LEAKS();
}

/* ---- rings ---------------------------------------------------------------- */

TEST(ring_quantiles_exact)
{
    static struct ring r;
    memset(&r, 0, sizeof(r));
    CHECK_EQ_INT(ring_quantile(&r, 0.5), 0);

    /* 1..101 in a random order: the q-quantile is the sample of rank
     * q * 100 exactly. */
    uint64_t s = test_seed();
    uint64_t perm[101];
    for (int i = 0; i < 101; i++)
        perm[i] = (uint64_t)i + 1;
    for (int i = 100; i > 0; i--) {
        int j = (int)(test_rand(&s) % (uint64_t)(i + 1));
        uint64_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int i = 0; i < 101; i++)
        ring_add(&r, perm[i]);
    CHECK_EQ_INT(r.n, 101);
    CHECK_EQ_INT(ring_quantile(&r, 0.0), 1);
    CHECK_EQ_INT(ring_quantile(&r, 0.25), 26);
    CHECK_EQ_INT(ring_quantile(&r, 0.5), 51);
    CHECK_EQ_INT(ring_quantile(&r, 0.9), 91);
    CHECK_EQ_INT(ring_quantile(&r, 0.99), 100);
    CHECK_EQ_INT(ring_quantile(&r, 1.0), 101);
    /* The ring is not reordered by a query. */
    for (int i = 0; i < 101; i++)
        CHECK_EQ_INT(r.v[i], perm[i]);

    /* Ranks between samples round to the nearer one: with four samples
     * p99 is the largest, not the third. */
    memset(&r, 0, sizeof(r));
    const uint64_t four[4] = {30, 10, 40, 20};
    for (int i = 0; i < 4; i++)
        ring_add(&r, four[i]);
    CHECK_EQ_INT(ring_quantile(&r, 0.1), 10);
    CHECK_EQ_INT(ring_quantile(&r, 0.4), 20);
    CHECK_EQ_INT(ring_quantile(&r, 0.9), 40);
    CHECK_EQ_INT(ring_quantile(&r, 0.99), 40);

    /* One sample; values above 32 bits saturate. */
    memset(&r, 0, sizeof(r));
    ring_add(&r, 77);
    CHECK_EQ_INT(ring_quantile(&r, 0.0), 77);
    CHECK_EQ_INT(ring_quantile(&r, 1.0), 77);
    ring_add(&r, 1ull << 40);
    CHECK_EQ_INT(ring_quantile(&r, 1.0), UINT32_MAX);

    /* Random data: the answer is a sample whose rank is q * (n - 1) rounded
     * one way or the other. */
    for (int round = 0; round < 20; round++) {
        uint32_t n = 1 + (uint32_t)(test_rand(&s) % RING_SAMPLES);
        uint64_t *v = malloc(n * sizeof(*v));
        CHECK(v != NULL);
        memset(&r, 0, sizeof(r));
        for (uint32_t i = 0; i < n; i++) {
            v[i] = test_rand(&s) >> (32 + test_rand(&s) % 32);
            ring_add(&r, v[i]);
        }
        qsort(v, n, sizeof(*v), cmp_u64);
        const double qs[] = {0, 0.5, 0.9, 0.99, 1};
        for (size_t k = 0; k < ARRAY_LEN(qs); k++) {
            double rank = qs[k] * (double)(n - 1);
            uint64_t lo = v[(size_t)rank], hi = v[(size_t)rank + (rank > (double)(size_t)rank)];
            uint64_t got = ring_quantile(&r, qs[k]);
            CHECK_MSG(got == lo || got == hi, "n %u q %g: %llu, want %llu or %llu", n, qs[k],
                      (unsigned long long)got, (unsigned long long)lo, (unsigned long long)hi);
        }
        CHECK_EQ_INT(ring_quantile(&r, 0), v[0]);
        CHECK_EQ_INT(ring_quantile(&r, 1), v[n - 1]);
        free(v);
    }
    CHECK_NO_LEAKS();
}

TEST(ring_wraps_around)
{
    static struct ring r;
    memset(&r, 0, sizeof(r));
    uint64_t s = test_seed();
    /* An old burst of huge values, then a full ring and then some of small
     * ones: only the last RING_SAMPLES samples count. */
    for (int i = 0; i < 1000; i++)
        ring_add(&r, 1000000000u + (uint64_t)i);
    uint32_t extra = 1 + (uint32_t)(test_rand(&s) % RING_SAMPLES);
    uint32_t total = RING_SAMPLES + extra;
    uint64_t *all = malloc(total * sizeof(*all));
    CHECK(all != NULL);
    for (uint32_t i = 0; i < total; i++) {
        all[i] = test_rand(&s) % 100000;
        ring_add(&r, all[i]);
        CHECK_EQ_INT(r.n, i + 1000 + 1 < RING_SAMPLES ? i + 1000 + 1 : RING_SAMPLES);
    }
    CHECK_EQ_INT(r.n, RING_SAMPLES);
    CHECK(r.next < RING_SAMPLES);
    uint64_t *last = all + extra;
    qsort(last, RING_SAMPLES, sizeof(*last), cmp_u64);
    CHECK_EQ_INT(ring_quantile(&r, 1.0), last[RING_SAMPLES - 1]);
    CHECK_EQ_INT(ring_quantile(&r, 0.0), last[0]);
    uint64_t med = ring_quantile(&r, 0.5);
    CHECK(med == last[(RING_SAMPLES - 1) / 2] || med == last[RING_SAMPLES / 2]);
    CHECK(ring_quantile(&r, 1.0) < 1000000000u);
    free(all);
    CHECK_NO_LEAKS();
}

/* ---- status table ---------------------------------------------------------- */

static const struct {
    int err, status;
} status_pairs[] = {
    {0, MOE__STATUS__STATUS_OK},
    {-EINVAL, MOE__STATUS__STATUS_INVALID_ARGUMENT},
    {-ENOENT, MOE__STATUS__STATUS_NOT_FOUND},
    {-EEXIST, MOE__STATUS__STATUS_ALREADY_EXISTS},
    {-EACCES, MOE__STATUS__STATUS_PERMISSION_DENIED},
    {-EDQUOT, MOE__STATUS__STATUS_RESOURCE_EXHAUSTED},
    {-EBUSY, MOE__STATUS__STATUS_BUSY},
    {-ETIME, MOE__STATUS__STATUS_DEADLINE_EXCEEDED},
    {-ECANCELED, MOE__STATUS__STATUS_CANCELLED},
    {-ENOTSUP, MOE__STATUS__STATUS_UNSUPPORTED},
    {-EPROTO, MOE__STATUS__STATUS_PROTOCOL},
    {-ENOTRECOVERABLE, MOE__STATUS__STATUS_INTERNAL},
    {-EIO, MOE__STATUS__STATUS_IO},
    {-ENOMEM, MOE__STATUS__STATUS_OUT_OF_MEMORY},
};

TEST(status_round_trip)
{
    /* Every wire status this build knows (the enum, from the generated
     * descriptor) has one errno, and back. */
    const ProtobufCEnumDescriptor *d = &moe__status__descriptor;
    CHECK_EQ_INT(d->n_values, ARRAY_LEN(status_pairs));
    for (unsigned i = 0; i < d->n_values; i++) {
        int st = d->values[i].value;
        int e = status_to_errno(st);
        CHECK_MSG(e <= 0, "status %d -> %d", st, e);
        CHECK_MSG(status_from_errno(e) == st, "status %d -> errno %d -> %d", st, e,
                  status_from_errno(e));
    }
    for (size_t i = 0; i < ARRAY_LEN(status_pairs); i++) {
        CHECK_MSG(status_from_errno(status_pairs[i].err) == status_pairs[i].status,
                  "errno %d", status_pairs[i].err);
        CHECK_MSG(status_to_errno(status_pairs[i].status) == status_pairs[i].err,
                  "status %d", status_pairs[i].status);
        for (size_t j = 0; j < i; j++)
            CHECK(status_pairs[i].status != status_pairs[j].status);
    }
    /* Statuses from a newer peer: a protocol error here. */
    const int unknown_status[] = {14, 15, 100, -1, INT_MAX, INT_MIN};
    for (size_t i = 0; i < ARRAY_LEN(unknown_status); i++)
        CHECK_EQ_INT(status_to_errno(unknown_status[i]), -EPROTO);
    /* Codes with the meaning of a table entry. */
    CHECK_EQ_INT(status_from_errno(-EPERM), MOE__STATUS__STATUS_PERMISSION_DENIED);
    CHECK_EQ_INT(status_from_errno(-EMFILE), MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_EQ_INT(status_from_errno(-ENOSPC), MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_EQ_INT(status_from_errno(-E2BIG), MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_EQ_INT(status_from_errno(-EMSGSIZE), MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_EQ_INT(status_from_errno(-EBADMSG), MOE__STATUS__STATUS_PROTOCOL);
    CHECK_EQ_INT(status_from_errno(-EOVERFLOW), MOE__STATUS__STATUS_INVALID_ARGUMENT);
    CHECK_EQ_INT(status_from_errno(-ERANGE), MOE__STATUS__STATUS_INVALID_ARGUMENT);
    /* Anything else is internal: other errnos, positive values, nonsense. */
    const int unknown_err[] = {-EXDEV, -ESPIPE, -ECHILD, 1, EINVAL, -99999, INT_MIN, INT_MAX};
    for (size_t i = 0; i < ARRAY_LEN(unknown_err); i++)
        CHECK_MSG(status_from_errno(unknown_err[i]) == MOE__STATUS__STATUS_INTERNAL, "errno %d",
                  unknown_err[i]);
    CHECK_NO_LEAKS();
}

TEST(status_strerror_texts)
{
    /* Never NULL, never empty, whatever the code. */
    for (int e = -5000; e <= 5000; e++) {
        const char *t = status_strerror(e);
        CHECK_MSG(t != NULL && t[0] != '\0', "code %d", e);
    }
    const int odd[] = {INT_MAX, INT_MIN + 1, INT_MIN, -1000000};
    for (size_t i = 0; i < ARRAY_LEN(odd); i++) {
        const char *t = status_strerror(odd[i]);
        CHECK_MSG(t != NULL && t[0] != '\0', "code %d", odd[i]);
    }
    /* The table's texts are moed's own and distinct. */
    for (size_t i = 0; i < ARRAY_LEN(status_pairs); i++)
        for (size_t j = 0; j < i; j++)
            CHECK(strcmp(status_strerror(status_pairs[i].err), status_strerror(status_pairs[j].err)) != 0);
    CHECK_STR_EQ(status_strerror(0), "success");
    CHECK_STR_CONTAINS(status_strerror(-EBUSY), "busy");
    CHECK_STR_CONTAINS(status_strerror(-ETIME), "deadline");
    CHECK_STR_CONTAINS(status_strerror(-EIO), "weight file");
    CHECK_STR_CONTAINS(status_strerror(-ECONNREFUSED), "moed running");
    CHECK_STR_CONTAINS(status_strerror(-ETIMEDOUT), "timed out");
    /* Other errnos read as strerror() does; positive codes are unknown. */
    CHECK_STR_EQ(status_strerror(-EXDEV), strerror(EXDEV));
    CHECK_STR_EQ(status_strerror(5), "unknown error");
    CHECK_NO_LEAKS();
}

/* ---- util ------------------------------------------------------------------ */

/* rundir_check's verdict on dir, with the reason's text checked for
 * words that say why. */
static void check_rundir(const char *dir, int want, const char *says)
{
    char why[512] = "";
    int rc = rundir_check(dir, why, sizeof(why));
    CHECK_MSG(rc == want, "%s: %d (%s), wanted %d", dir, rc, why, want);
    if (says)
        CHECK_MSG(strstr(why, says) != NULL, "%s: \"%s\" does not say \"%s\"", dir, why, says);
}

TEST(runtime_directories_others_could_write_are_refused)
{
    char top[] = "/tmp/moed-rundir.XXXXXX", d[96], f[96], link[96];
    CHECK(mkdtemp(top) != NULL);
    snprintf(d, sizeof(d), "%s/rt", top);
    snprintf(f, sizeof(f), "%s/file", top);
    snprintf(link, sizeof(link), "%s/link", top);
    CHECK(mkdir(d, 0700) == 0 && chmod(d, 0750) == 0);
    check_rundir(d, 0, NULL);
    check_rundir(top, 0, NULL);
    CHECK(chmod(d, 0770) == 0);
    check_rundir(d, -EACCES, "writable by its group (mode 0770)");
    CHECK(chmod(d, 01777) == 0);
    check_rundir(d, -EACCES, "writable by anyone (mode 1777)");
    CHECK(chmod(d, 0755) == 0);
    FILE *fp = fopen(f, "w");
    CHECK(fp != NULL && fclose(fp) == 0);
    check_rundir(f, -ENOTDIR, "not a directory");
    char gone[128];
    snprintf(gone, sizeof(gone), "%s/none", top);
    check_rundir(gone, -ENOENT, "No such file");
    /* In a directory anyone may write: ours, and a link of ours to it,
     * where it is sticky (as /tmp: no one else can replace them); nothing
     * where it is not. */
    CHECK(symlink(d, link) == 0);
    CHECK(chmod(top, 01777) == 0);
    check_rundir(d, 0, NULL);
    check_rundir(link, 0, NULL);
    CHECK(chmod(top, 0777) == 0);
    check_rundir(d, -EACCES, "an entry of uid");
    check_rundir(link, -EACCES, "a link of uid");
    CHECK(chmod(top, 0700) == 0);
    if (geteuid() == 0) {
        /* Another user's directory: fine in a directory root alone writes
         * (as /run), refused in one anyone writes (anyone could have made
         * it) and in one of another user's. So is another user's link to
         * ours in a sticky directory. */
        CHECK(chown(d, 4242, 4242) == 0);
        CHECK(chmod(top, 0755) == 0);
        check_rundir(d, 0, NULL);
        char slash[128];
        snprintf(slash, sizeof(slash), "%s/", d);
        check_rundir(slash, 0, NULL);
        CHECK(chmod(top, 01777) == 0);
        check_rundir(d, -EACCES, "an entry of uid 4242");
        check_rundir(slash, -EACCES, "an entry of uid 4242");
        CHECK(chmod(top, 0755) == 0);
        char sub[128];
        snprintf(sub, sizeof(sub), "%s/sub", d);
        CHECK(mkdir(sub, 0755) == 0 && chown(sub, 4242, 4242) == 0);
        check_rundir(sub, -EACCES, "belongs to uid 4242");
        CHECK(rmdir(sub) == 0 && chown(d, 0, 0) == 0);
        CHECK(lchown(link, 4242, 4242) == 0 && chmod(top, 01777) == 0);
        check_rundir(link, -EACCES, "a link of uid 4242");
    }
    CHECK(unlink(link) == 0 && unlink(f) == 0 && rmdir(d) == 0 && rmdir(top) == 0);
}

TEST(names)
{
    char n64[65], n65[66];
    memset(n64, 'a', 64);
    n64[64] = '\0';
    memset(n65, 'a', 65);
    n65[65] = '\0';
    const char *good[] = {"a", "Z", "0", "layer.0", "A-z_0.9", "-", "mixtral-8x7b_l31", n64};
    const char *bad[] = {NULL, "", n65, "a b", "a/b", "../x", "a\n", "tab\t", "caf\xc3\xa9",
                         "a:b", "semi;", "x*", "\x7f"};
    for (size_t i = 0; i < ARRAY_LEN(good); i++)
        CHECK_MSG(name_valid(good[i]), "\"%s\"", good[i]);
    for (size_t i = 0; i < ARRAY_LEN(bad); i++)
        CHECK_MSG(!name_valid(bad[i]), "\"%s\"", bad[i] ? bad[i] : "(null)");
    /* Every single byte: exactly the 65 allowed characters pass. */
    int passed = 0;
    for (int c = 1; c < 256; c++) {
        char one[2] = {(char)c, 0};
        bool want = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
        CHECK_MSG(name_valid(one) == want, "byte 0x%02x", c);
        passed += want;
    }
    CHECK_EQ_INT(passed, 65);
    CHECK_NO_LEAKS();
}

TEST(checked_arithmetic)
{
    uint64_t r = 12345;
    CHECK(mul_u64(0, UINT64_MAX, &r) && r == 0);
    CHECK(mul_u64(1, UINT64_MAX, &r) && r == UINT64_MAX);
    CHECK(mul_u64(1ull << 32, (1ull << 32) - 1, &r) && r == (1ull << 32) * ((1ull << 32) - 1));
    CHECK(!mul_u64(1ull << 32, 1ull << 32, &r));
    CHECK(!mul_u64(UINT64_MAX, 2, &r));
    CHECK(!mul_u64(3, UINT64_MAX / 3 + 1, &r));
    CHECK(mul_u64(3, UINT64_MAX / 3, &r) && r == UINT64_MAX / 3 * 3);
    CHECK(add_u64(UINT64_MAX, 0, &r) && r == UINT64_MAX);
    CHECK(add_u64(UINT64_MAX - 5, 5, &r) && r == UINT64_MAX);
    CHECK(!add_u64(UINT64_MAX, 1, &r));
    CHECK(!add_u64(UINT64_MAX - 5, 6, &r));
    CHECK(!add_u64(1ull << 63, 1ull << 63, &r));
    /* Random operands of random widths against 128-bit arithmetic. */
    uint64_t s = test_seed();
    for (int i = 0; i < 100000; i++) {
        uint64_t a = test_rand(&s) >> (test_rand(&s) % 64);
        uint64_t b = test_rand(&s) >> (test_rand(&s) % 64);
        unsigned __int128 p = (unsigned __int128)a * b, q = (unsigned __int128)a + b;
        bool pf = p <= UINT64_MAX, qf = q <= UINT64_MAX;
        r = 0;
        CHECK(mul_u64(a, b, &r) == pf);
        if (pf)
            CHECK(r == (uint64_t)p);
        r = 0;
        CHECK(add_u64(a, b, &r) == qf);
        if (qf)
            CHECK(r == (uint64_t)q);
    }
    CHECK_NO_LEAKS();
}

/* A cache's slot to fill: the first free one, else the least recently
 * used, wherever it is (the spread layers' device sets replaced slot 0,
 * the newest, every time). */
TEST(slot_to_fill_takes_free_then_least_recently_used)
{
    bool in_use[4] = {true, false, true, false};
    uint64_t used[4] = {5, 0, 2, 0};
    CHECK_EQ_INT(slot_to_fill(in_use, used, 4), 1);
    in_use[1] = in_use[3] = true;
    used[1] = 7;
    used[3] = 9;
    CHECK_EQ_INT(slot_to_fill(in_use, used, 4), 2); /* used 2 */
    used[2] = 10;
    CHECK_EQ_INT(slot_to_fill(in_use, used, 4), 0); /* used 5 */
    used[0] = 11;
    CHECK_EQ_INT(slot_to_fill(in_use, used, 4), 1); /* used 7 */
    /* The clock as cuda_ep_get keeps it: 12 sets in turn over 4 slots, then
     * the last four again: each is still there, and none is replaced. */
    bool busy[4] = {false, false, false, false};
    uint64_t at[4] = {0}, clock = 0;
    int set_of[4] = {-1, -1, -1, -1};
    for (int set = 0; set < 12; set++) {
        int i = slot_to_fill(busy, at, 4);
        busy[i] = true;
        at[i] = ++clock;
        set_of[i] = set;
    }
    for (int set = 8; set < 12; set++) {
        int hit = -1;
        for (int i = 0; i < 4; i++)
            hit = set_of[i] == set ? i : hit;
        CHECK_MSG(hit >= 0, "set %d was replaced", set);
        at[hit] = ++clock;
    }
    /* The next new set replaces the one used longest ago: set 8. */
    int i = slot_to_fill(busy, at, 4);
    CHECK_EQ_INT(set_of[i], 8);
}

TEST(random_bytes_random)
{
    uint8_t a[64], b[64], zero[64] = {0};
    memset(a, 0, sizeof(a));
    memset(b, 0, sizeof(b));
    CHECK_EQ_INT(random_bytes(a, sizeof(a)), 0);
    CHECK_EQ_INT(random_bytes(b, sizeof(b)), 0);
    CHECK(memcmp(a, zero, sizeof(a)) != 0);
    CHECK(memcmp(b, zero, sizeof(b)) != 0);
    CHECK(memcmp(a, b, sizeof(a)) != 0);
    CHECK_EQ_INT(random_bytes(a, 0), 0);
    /* A large buffer: every byte value turns up about as often as the
     * others (1 MiB: 4096 expected each, far outside the bounds only if
     * broken). The tail of the buffer is filled too. */
    size_t n = 1u << 20;
    uint8_t *big = calloc(n, 1);
    CHECK(big != NULL);
    CHECK_EQ_INT(random_bytes(big, n), 0);
    unsigned hist[256] = {0};
    for (size_t i = 0; i < n; i++)
        hist[big[i]]++;
    for (int v = 0; v < 256; v++)
        CHECK_MSG(hist[v] > 3500 && hist[v] < 4700, "byte %d seen %u times", v, hist[v]);
    CHECK(memcmp(big + n - 64, zero, 64) != 0);
    free(big);
    CHECK_NO_LEAKS();
}

/* A device that failed at start: layers placed on it are refused whole,
 * with the reason, and nothing stays on the devices that work. */
TEST(unavailable_device_refuses_its_layers)
{
    struct backend *b[2] = {NULL, NULL};
    CHECK_EQ_INT(backend_cpu_new(1, &b[0]), 0);
    CHECK_EQ_INT(backend_unavailable_new("CUDA device 3: no such usable device", &b[1]), 0);
    struct backend_device dev;
    CHECK_EQ_INT(b[1]->ops->devices(b[1], &dev, 1), 1);
    CHECK_STR_CONTAINS(dev.name, "CUDA device 3");
    const uint32_t devs[2] = {0, 1};
    struct shard_set set;
    char err[256] = "";
    /* A device number above INT_MAX is no negative index. */
    struct shard_set bad;
    const uint32_t huge[2] = {0, 0x80000000u};
    CHECK_EQ_INT(shard_plan(4, huge, 2, NULL, 0, 2, &bad, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "device 2147483648 does not exist");
    CHECK_EQ_INT(shard_plan(4, devs, 2, NULL, 0, 2, &set, err, sizeof(err)), 0);
    const moek_moe_shape shape = {4, 2, 16, 8};
    uint16_t w[4 * 16 * 8];
    for (size_t i = 0; i < sizeof(w) / sizeof(w[0]); i++)
        w[i] = (uint16_t)(0x3c00 + (i % 64));
    CHECK_EQ_INT(shard_upload(&set, b, &shape, MOEK_DTYPE_BF16, MOEK_SCORING_SOFTMAX, true, w, w,
                              w, err, sizeof(err)),
                 -ENODEV);
    CHECK_STR_CONTAINS(err, "device 1 (unavailable: CUDA device 3");
    CHECK(set.shards[0].weights == NULL && set.shards[1].weights == NULL);
    shard_done(&set, b);
    backend_free(&b[0]);
    backend_free(&b[1]);
}

/* A layer spread over devices routes over all its experts at home, though
 * each device holds only some: a device that routes at most max_experts
 * refuses the layer whole (CUDA: 512), before anything is uploaded. */
TEST(a_spread_layer_over_the_routing_limit_is_refused)
{
    struct backend *b[2] = {NULL, NULL};
    CHECK_EQ_INT(backend_cpu_new(1, &b[0]), 0);
    CHECK_EQ_INT(backend_cpu_new(1, &b[1]), 0);
    b[0]->max_experts = b[1]->max_experts = 4;
    const uint32_t devs[2] = {0, 1};
    struct shard_set set;
    char err[256] = "";
    CHECK_EQ_INT(shard_plan(8, devs, 2, NULL, 0, 2, &set, err, sizeof(err)), 0);
    const moek_moe_shape shape = {8, 2, 16, 8};
    static uint16_t w[8 * 16 * 8];
    for (size_t i = 0; i < sizeof(w) / sizeof(w[0]); i++)
        w[i] = (uint16_t)(0x3c00 + (i % 64));
    CHECK_EQ_INT(shard_upload(&set, b, &shape, MOEK_DTYPE_BF16, MOEK_SCORING_SOFTMAX, true, w, w,
                              w, err, sizeof(err)),
                 -ENOTSUP);
    CHECK_STR_CONTAINS(err, "device 0 (cpu) routes at most 4 experts; this layer has 8");
    CHECK(set.shards[0].weights == NULL && set.shards[1].weights == NULL);
    shard_done(&set, b);
    /* Within the limit, the same spread loads. */
    b[0]->max_experts = b[1]->max_experts = 8;
    CHECK_EQ_INT(shard_plan(8, devs, 2, NULL, 0, 2, &set, err, sizeof(err)), 0);
    CHECK_EQ_INT(shard_upload(&set, b, &shape, MOEK_DTYPE_BF16, MOEK_SCORING_SOFTMAX, true, w, w,
                              w, err, sizeof(err)),
                 0);
    shard_done(&set, b);
    backend_free(&b[0]);
    backend_free(&b[1]);
}

/* A backend that refuses every layer, saying why through last_error (or
 * not, with why NULL). */
struct picky {
    struct backend base;
    const char *why;
};

static int picky_moe_new(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                         moek_scoring scoring, bool renormalize, const void *w1, const void *w3,
                         const void *w2, void **handle)
{
    (void)b, (void)shape, (void)dt, (void)scoring, (void)renormalize, (void)w1, (void)w3, (void)w2;
    *handle = NULL;
    return -ENOTSUP;
}

static const char *picky_last_error(struct backend *b)
{
    return ((struct picky *)b)->why;
}

static const struct backend_ops picky_ops = {.moe_new = picky_moe_new,
                                             .last_error = picky_last_error};

/* A device that refuses its part of a spread layer: the error names the
 * device and carries the backend's own reason where it gives one; the
 * parts already made on other devices are freed. */
TEST(a_refused_shard_says_the_backends_reason)
{
    struct backend *b[2] = {NULL, NULL};
    CHECK_EQ_INT(backend_cpu_new(1, &b[0]), 0);
    struct picky dev1 = {.base = {.ops = &picky_ops, .name = "picky"},
                         .why = "hidden 16: not on this device"};
    b[1] = &dev1.base;
    CHECK_STR_CONTAINS(backend_last_error(b[1]), "hidden 16");
    CHECK(strcmp(backend_last_error(b[0]), "") == 0); /* no last_error op */
    const uint32_t devs[2] = {0, 1};
    const moek_moe_shape shape = {8, 2, 16, 8};
    static uint16_t w[8 * 16 * 8];
    for (size_t i = 0; i < sizeof(w) / sizeof(w[0]); i++)
        w[i] = (uint16_t)(0x3c00 + (i % 64));
    for (int with_why = 1; with_why >= 0; with_why--) {
        dev1.why = with_why ? "hidden 16: not on this device" : NULL;
        struct shard_set set;
        char err[256] = "";
        CHECK_EQ_INT(shard_plan(8, devs, 2, NULL, 0, 2, &set, err, sizeof(err)), 0);
        CHECK_EQ_INT(shard_upload(&set, b, &shape, MOEK_DTYPE_BF16, MOEK_SCORING_SOFTMAX, true, w,
                                  w, w, err, sizeof(err)),
                     -ENOTSUP);
        CHECK_STR_CONTAINS(err, "device 1 (picky) cannot hold its 4 experts: ");
        if (with_why)
            CHECK_STR_CONTAINS(err, "supported (hidden 16: not on this device)");
        else
            CHECK_MSG(strchr(err, '(') == strstr(err, "(picky)"), "%s", err);
        CHECK(set.shards[0].weights == NULL && set.shards[1].weights == NULL);
        shard_done(&set, b);
    }
    backend_free(&b[0]);
    CHECK_NO_LEAKS();
}

/* A backend whose device can fail (healthy() false), for the daemon's
 * check of all its devices. */
struct flaky {
    struct backend base;
    bool failed;
};

static bool flaky_healthy(struct backend *b)
{
    return !((struct flaky *)b)->failed;
}

static const struct backend_ops flaky_ops = {.healthy = flaky_healthy};

/* A device that fails for good stops the daemon, whichever it is: the home
 * device or one that holds only some layers' experts. A device that was
 * unavailable from the start (no usable GPU there) does not. */
TEST(a_failed_device_other_than_the_first_is_noticed)
{
    struct flaky dev[3];
    struct backend *absent = NULL;
    CHECK_EQ_INT(backend_unavailable_new("CUDA device 3: no such usable device", &absent), 0);
    static struct server s; /* large: not on the stack */
    memset(&s, 0, sizeof(s));
    for (int i = 0; i < 3; i++) {
        dev[i] = (struct flaky){.base = {.ops = &flaky_ops, .name = "flaky"}};
        s.backends[i] = &dev[i].base;
    }
    s.backends[3] = absent;
    s.n_backends = 4;
    s.backend = s.backends[0];
    CHECK_EQ_INT(server_failed_device(&s), -1);
    dev[2].failed = true;
    CHECK_EQ_INT(server_failed_device(&s), 2);
    dev[0].failed = true;
    CHECK_EQ_INT(server_failed_device(&s), 0);
    backend_free(&absent);
    CHECK_NO_LEAKS();
}

/* server_check_devices (after each batch and at each status tick): a
 * healthy server goes on; a failed device makes it fatal, names the device
 * and stops the loop (main then exits 3). */
TEST(a_failed_device_stops_the_server)
{
    struct flaky dev[2];
    static struct server s; /* large: not on the stack */
    memset(&s, 0, sizeof(s));
    for (int i = 0; i < 2; i++) {
        dev[i] = (struct flaky){.base = {.ops = &flaky_ops, .name = "flaky"}};
        s.backends[i] = &dev[i].base;
    }
    s.n_backends = 2;
    s.backend = s.backends[0];
    CHECK_EQ_INT(loop_new(&s.loop), 0);
    CHECK(!server_check_devices(&s));
    CHECK(!s.fatal);
    dev[1].failed = true;
    CHECK(server_check_devices(&s));
    CHECK(s.fatal);
    CHECK_EQ_INT(s.failed_device, 1);
    /* The loop was stopped: run returns at once. */
    CHECK_EQ_INT(loop_run(s.loop), 0);
    CHECK(server_check_devices(&s)); /* and stays fatal */
    loop_free(&s.loop);
    CHECK_NO_LEAKS();
}

/* session_by_id's buckets: sessions whose ids share a bucket (ids SESSION_BUCKETS
 * apart) are each found, a closed one is gone from its bucket wherever it
 * was in it (middle, head, tail, alone), an emptied bucket takes a session
 * again, and an id never given is not found. */
TEST(sessions_are_found_by_id_across_one_bucket)
{
    struct config cfg;
    CHECK_EQ_INT(config_init(&cfg), 0);
    cfg.max_sessions = 8;
    struct backend *be = NULL;
    struct loop *loop = NULL;
    struct server *s = NULL;
    CHECK_EQ_INT(backend_cpu_new(1, &be), 0);
    CHECK_EQ_INT(loop_new(&loop), 0);
    CHECK_EQ_INT(server_new(&cfg, &be, 1, loop, &s), 0);
    enum { N = 4 };
    int peer[N];
    uint64_t id[N];
    for (int i = 0; i < N; i++) {
        /* ids 7, 7 + B, 7 + 2B, then 8: three in one bucket */
        s->next_session_id = i < 3 ? 6 + (uint64_t)i * SESSION_BUCKETS : 7;
        int sv[2];
        CHECK_EQ_INT(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
        CHECK_EQ_INT(session_attach(s, sv[0]), 0);
        peer[i] = sv[1];
        id[i] = s->next_session_id;
    }
    CHECK(id[0] % SESSION_BUCKETS == id[2] % SESSION_BUCKETS && id[3] == 8);
    for (int i = 0; i < N; i++)
        CHECK(session_by_id(s, id[i]) && session_by_id(s, id[i])->id == id[i]);
    CHECK(!session_by_id(s, 7 + 3 * SESSION_BUCKETS));
    CHECK(!session_by_id(s, 0));
    /* Close the shared bucket's middle (id[1]), its head (id[2], the last
     * attached), its tail (id[0]), then the session alone in its bucket
     * (id[3]): the loop notices each peer's end and closes the session;
     * the others stay found. */
    const int order[N] = {1, 2, 0, 3};
    bool open[N] = {true, true, true, true};
    for (int o = 0; o < N; o++) {
        const int c = order[o];
        close(peer[c]);
        open[c] = false;
        for (int t = 0; t < 100 && session_by_id(s, id[c]); t++)
            loop_run_once(loop, 10);
        CHECK(!session_by_id(s, id[c]));
        for (int i = 0; i < N; i++)
            if (open[i])
                CHECK(session_by_id(s, id[i]) && session_by_id(s, id[i])->id == id[i]);
    }
    CHECK_EQ_INT((int)s->n_sessions, 0);
    /* No bucket holds a closed session (a lookup might not tell: the freed
     * memory need not keep its id). */
    for (int b = 0; b < SESSION_BUCKETS; b++)
        CHECK(s->by_id[b] == NULL);
    /* The emptied bucket takes a new session. */
    s->next_session_id = 6 + 3 * SESSION_BUCKETS;
    int sv[2];
    CHECK_EQ_INT(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    CHECK_EQ_INT(session_attach(s, sv[0]), 0);
    CHECK(session_by_id(s, 7 + 3 * SESSION_BUCKETS) != NULL);
    CHECK(!session_by_id(s, id[0]));
    server_free(&s);
    loop_free(&loop);
    backend_free(&be);
    config_done(&cfg);
    close(sv[1]);
    CHECK_NO_LEAKS();
}

/* ---- the start-up timeout's keeper (notify.c) ------------------------- */

/* EXTEND_TIMEOUT_USEC= datagrams on the notify socket within ms. */
static int extensions_within(int fd, int ms)
{
    int n = 0;
    uint64_t end = now_us() + (uint64_t)ms * 1000;
    for (uint64_t now; (now = now_us()) < end;) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, (int)((end - now) / 1000) + 1) != 1)
            continue;
        char buf[512];
        ssize_t k = recv(fd, buf, sizeof(buf) - 1, 0);
        buf[k > 0 ? k : 0] = '\0';
        n += strstr(buf, "EXTEND_TIMEOUT_USEC=") != NULL;
    }
    return n;
}

static atomic_bool reader_stop;

static void *weights_reader(void *arg)
{
    struct st_file *f = arg;
    const struct st_tensor *t = st_find(f, "w");
    static uint8_t buf[1 << 16];
    while (!atomic_load(&reader_stop)) {
        CHECK_EQ_INT(st_read(f, t, buf), 0);
        usleep(20000);
    }
    return NULL;
}

/* While weights load the timeout is extended only for progress: weights
 * read (by any thread), or CPU time of the loading thread; a load stuck in
 * a read (here a loading thread that sleeps) gets no extension, however
 * much the process's other threads read or compute (the keeper's own look
 * at its progress included). */
TEST(the_loading_keeper_extends_the_timeout_for_progress_only)
{
    const char *dir = tmp_dir_new("keeper");
    char sock[PATH_MAX], wpath[PATH_MAX];
    snprintf(sock, sizeof(sock), "%s/notify", dir);
    snprintf(wpath, sizeof(wpath), "%s/w.safetensors", dir);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    CHECK(strlen(sock) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, sock, strlen(sock) + 1);
    CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    CHECK(setenv("NOTIFY_SOCKET", sock, 1) == 0);
    static uint16_t w[1 << 15];
    struct st_out o = {.name = "w", .dtype = ST_BF16, .ndim = 1, .shape = {1 << 15}, .data = w};
    CHECK_EQ_INT(st_write(wpath, &o, 1), 0);
    struct st_file *f = NULL;
    char err[256];
    CHECK_MSG(st_open(wpath, &f, err, sizeof(err)) == 0, "%s", err);

    clockid_t mine;
    CHECK_EQ_INT(pthread_getcpuclockid(pthread_self(), &mine), 0);
    notify_set_loading_check_us(100000);
    notify_loading_begin(mine);
    notify_loading_layer("stuck", 1, 1);
    /* The layer's own, and the first look's (a layer begun is progress). */
    int begun = extensions_within(fd, 300);
    CHECK_MSG(begun >= 1 && begun <= 2, "%d extensions as the layer began", begun);
    /* Stuck: this thread sleeps (in poll) through several looks. */
    int stuck = extensions_within(fd, 550);
    CHECK_MSG(stuck == 0, "%d extensions while nothing was read or computed", stuck);
    /* Computing on the loading thread. */
    uint64_t end = now_us() + 400000;
    volatile uint64_t x = 0;
    while (now_us() < end)
        x = x * 6364136223846793005ull + 1;
    CHECK(extensions_within(fd, 150) >= 2);
    /* Reading weights, on another thread. */
    pthread_t t;
    atomic_store(&reader_stop, false);
    CHECK_EQ_INT(pthread_create(&t, NULL, weights_reader, f), 0);
    int reading = extensions_within(fd, 550);
    atomic_store(&reader_stop, true);
    CHECK_EQ_INT(pthread_join(t, NULL), 0);
    CHECK_MSG(reading >= 3, "%d extensions while weights were read", reading);
    notify_loading_end();
    notify_set_loading_check_us(0);
    unsetenv("NOTIFY_SOCKET");
    st_close(&f);
    close(fd);
    unlink(sock);
    unlink(wpath);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(hist_buckets),
        TEST_CASE(sessions_are_found_by_id_across_one_bucket),
        TEST_CASE(hist_quantiles),
        TEST_CASE(hist_quantile_clamped_to_max),
        TEST_CASE(ring_quantiles_exact),
        TEST_CASE(ring_wraps_around),
        TEST_CASE(status_round_trip),
        TEST_CASE(status_strerror_texts),
        TEST_CASE(runtime_directories_others_could_write_are_refused),
        TEST_CASE(names),
        TEST_CASE(checked_arithmetic),
        TEST_CASE(slot_to_fill_takes_free_then_least_recently_used),
        TEST_CASE(random_bytes_random),
        TEST_CASE(unavailable_device_refuses_its_layers),
        TEST_CASE(a_failed_device_other_than_the_first_is_noticed),
        TEST_CASE(a_failed_device_stops_the_server),
        TEST_CASE(a_spread_layer_over_the_routing_limit_is_refused),
        TEST_CASE(a_refused_shard_says_the_backends_reason),
        TEST_CASE(the_loading_keeper_extends_the_timeout_for_progress_only),
        {0}});
}
