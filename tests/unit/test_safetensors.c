/*
 * test_safetensors.c: daemon/safetensors.c, the checkpoint format reader and
 * writer. A file written with st_write() must read back tensor for tensor and
 * byte for byte; a header that is malformed in any of the ways an untrusted
 * checkpoint can be (bad JSON, missing fields, bad numbers, byte ranges that
 * disagree with the shape or leave the file) must be refused with a message
 * that says what is wrong.
 *
 * Files live in a fresh mkdtemp() directory under /tmp, removed at the end of
 * each case (and at exit when a check fails).
 */
#include "tests/unit/unit.h"
#include "daemon/safetensors.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>


/* ---- helpers ------------------------------------------------------------ */


/* A fresh directory for this case; removed by tmp_cleanup() or as the
 * case ends. */
static const char *tmp_dir(void)
{
    return tmp_dir_new("st");
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

static void rand_bytes(uint64_t *s, void *dst, size_t n)
{
    uint8_t *p = dst;
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(test_rand(s) >> 56);
}

/* Write a file of exactly: 8-byte length field, json, then data_len bytes. */
static void write_raw(const char *path, uint64_t len_field, const char *json,
                      size_t data_len)
{
    FILE *fp = fopen(path, "wb");
    CHECK(fp != NULL);
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)(len_field >> (8 * i));
    CHECK(fwrite(len, 1, 8, fp) == 8);
    size_t jl = strlen(json);
    CHECK(fwrite(json, 1, jl, fp) == jl);
    for (size_t i = 0; i < data_len; i++)
        CHECK(fputc((int)(i * 131u & 0xff), fp) != EOF);
    CHECK(fclose(fp) == 0);
}

static void write_bytes(const char *path, const void *buf, size_t n)
{
    FILE *fp = fopen(path, "wb");
    CHECK(fp != NULL);
    CHECK(n == 0 || fwrite(buf, 1, n, fp) == n);
    CHECK(fclose(fp) == 0);
}

/* Parse json as the header of a file with data_len bytes of data. */
static int parse(const char *json, uint64_t data_len, struct st_file *f, char *err,
                 size_t errlen)
{
    err[0] = '\0';
    size_t n = strlen(json);
    return st_parse_header(json, n, 8 + n + data_len, f, err, errlen);
}

/* The header must be refused with -EINVAL and a message containing want. */
static void expect_reject_at(int line, const char *json, uint64_t data_len, const char *want)
{
    struct st_file f;
    char err[512];
    int rc = parse(json, data_len, &f, err, sizeof(err));
    if (rc != -EINVAL)
        FAIL_AT("line %d: header %s: rc %d, want -EINVAL", line, json, rc);
    if (!err[0])
        FAIL_AT("line %d: header %s: empty error message", line, json);
    if (want && !strstr(err, want))
        FAIL_AT("line %d: header %s: error \"%s\" lacks \"%s\"", line, json, err, want);
    CHECK(f.tensors == NULL && f.count == 0);
}
#define expect_reject(json, data_len, want) expect_reject_at(__LINE__, json, data_len, want)

static void expect_accept_at(int line, const char *json, uint64_t data_len, size_t count)
{
    struct st_file f;
    char err[512];
    int rc = parse(json, data_len, &f, err, sizeof(err));
    if (rc != 0)
        FAIL_AT("line %d: header %s: rc %d (%s), want 0", line, json, rc, err);
    if (f.count != count)
        FAIL_AT("line %d: header %s: %zu tensors, want %zu", line, json, f.count, count);
    st_header_done(&f);
}
#define expect_accept(json, data_len, count) expect_accept_at(__LINE__, json, data_len, count)

/* ---- writing and reading back ------------------------------------------- */

TEST(roundtrip_every_dtype)
{
    uint64_t s = test_seed();
    const char *dir = tmp_dir();
    char path[256];
    snprintf(path, sizeof(path), "%s/all.safetensors", dir);

    /* One tensor per dtype with a random shape of 1..4 dims, plus a scalar
     * and an empty tensor; written in an order that is not sorted by name. */
    enum { N = ST_DTYPE_COUNT + 2 };
    struct st_out t[N];
    char names[N][32];
    void *data[N];
    size_t nbytes[N];
    for (int i = 0; i < N; i++) {
        memset(&t[i], 0, sizeof(t[i]));
        enum st_dtype dt = (enum st_dtype)(i % ST_DTYPE_COUNT);
        snprintf(names[i], sizeof(names[i]), "%c.layer%d.%s", 'z' - i, (int)(test_rand(&s) % 100),
                 st_dtype_name(dt));
        t[i].name = names[i];
        t[i].dtype = dt;
        size_t numel = 1;
        if (i == ST_DTYPE_COUNT) {
            t[i].ndim = 0; /* a scalar: one element */
        } else if (i == ST_DTYPE_COUNT + 1) {
            t[i].ndim = 2; /* no elements at all */
            t[i].shape[0] = 0;
            t[i].shape[1] = 5;
            numel = 0;
        } else {
            t[i].ndim = 1 + (int)(test_rand(&s) % 4);
            for (int d = 0; d < t[i].ndim; d++) {
                t[i].shape[d] = 1 + test_rand(&s) % 6;
                numel *= t[i].shape[d];
            }
        }
        nbytes[i] = numel * st_dtype_size(dt);
        data[i] = xmalloc(nbytes[i]);
        rand_bytes(&s, data[i], nbytes[i]);
        t[i].data = data[i];
    }
    /* Overwriting an existing file replaces it. */
    write_raw(path, 2, "{}", 0);
    CHECK_EQ_INT(st_write(path, t, N), 0);

    struct st_file *f = NULL;
    char err[256] = "";
    int rc = st_open(path, &f, err, sizeof(err));
    CHECK_MSG(rc == 0, "st_open: %d %s", rc, err);
    CHECK(f != NULL && f->fd >= 0);
    CHECK_EQ_INT(f->count, N);
    struct stat st;
    CHECK(stat(path, &st) == 0);
    CHECK_EQ_INT(f->size, st.st_size);

    /* The table is sorted by name. */
    for (size_t i = 1; i < f->count; i++)
        CHECK(strcmp(f->tensors[i - 1].name, f->tensors[i].name) < 0);

    /* Every tensor is there with its dtype, shape and bytes; the data lies
     * in write order, back to back, from an 8-aligned start. */
    uint64_t expect_off = 0;
    for (int i = 0; i < N; i++) {
        const struct st_tensor *x = st_find(f, names[i]);
        CHECK_MSG(x != NULL, "tensor %s not found", names[i]);
        CHECK_STR_EQ(x->name, names[i]);
        CHECK_EQ_INT(x->dtype, t[i].dtype);
        CHECK_EQ_INT(x->ndim, t[i].ndim);
        for (int d = 0; d < t[i].ndim; d++)
            CHECK_EQ_INT(x->shape[d], t[i].shape[d]);
        CHECK_EQ_INT(x->nbytes, nbytes[i]);
        if (i == 0) {
            expect_off = x->offset;
            CHECK(expect_off % 8 == 0);
            CHECK(expect_off > 8);
        }
        CHECK_EQ_INT(x->offset, expect_off);
        expect_off += nbytes[i];
        uint8_t *back = xmalloc(nbytes[i]);
        memset(back, 0, nbytes[i]);
        CHECK_EQ_INT(st_read(f, x, back), 0);
        CHECK(memcmp(back, data[i], nbytes[i]) == 0);
        free(back);
    }
    CHECK_EQ_INT(expect_off, f->size);
    CHECK(st_find(f, "no.such.tensor") == NULL);
    CHECK(st_find(f, "") == NULL);

    /* The header length field matches the first tensor's data offset. */
    uint8_t len[8];
    CHECK(pread(f->fd, len, 8, 0) == 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len[i];
    CHECK_EQ_INT(8 + hlen, st_find(f, names[0])->offset);

    st_close(&f);
    CHECK(f == NULL);
    st_close(&f); /* NULL is fine */

    /* The temp file was renamed into place: nothing else is in the dir. */
    char other[256];
    snprintf(other, sizeof(other), "%s/all.safetensors.tmp.%d", dir, (int)getpid());
    CHECK(access(other, F_OK) != 0);

    for (int i = 0; i < N; i++)
        free(data[i]);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

TEST(dtype_table)
{
    CHECK_EQ_INT(st_dtype_size(ST_BF16), 2);
    CHECK_EQ_INT(st_dtype_size(ST_F16), 2);
    CHECK_EQ_INT(st_dtype_size(ST_F32), 4);
    CHECK_EQ_INT(st_dtype_size(ST_F64), 8);
    CHECK_EQ_INT(st_dtype_size(ST_I64), 8);
    CHECK_EQ_INT(st_dtype_size(ST_F8_E5M2), 1);
    CHECK_EQ_INT(st_dtype_size(ST_BOOL), 1);
    CHECK_STR_EQ(st_dtype_name(ST_BF16), "BF16");
    CHECK_STR_EQ(st_dtype_name(ST_F8_E4M3), "F8_E4M3");
    CHECK_STR_EQ(st_dtype_name(ST_U64), "U64");
    CHECK_EQ_INT(st_dtype_size(ST_DTYPE_COUNT), 0);
    CHECK_EQ_INT(st_dtype_size((enum st_dtype)-1), 0);
    CHECK(st_dtype_name(ST_DTYPE_COUNT) != NULL);
    /* Every name is distinct and parses back as its own dtype. */
    for (int d = 0; d < ST_DTYPE_COUNT; d++) {
        CHECK(st_dtype_size((enum st_dtype)d) > 0);
        for (int e = 0; e < d; e++)
            CHECK(strcmp(st_dtype_name((enum st_dtype)d), st_dtype_name((enum st_dtype)e)) != 0);
        char json[160];
        snprintf(json, sizeof(json), "{\"x\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,%zu]}}",
                 st_dtype_name((enum st_dtype)d), 3 * st_dtype_size((enum st_dtype)d));
        struct st_file f;
        char err[256];
        CHECK_EQ_INT(parse(json, 64, &f, err, sizeof(err)), 0);
        CHECK_EQ_INT(f.count, 1);
        CHECK_EQ_INT(f.tensors[0].dtype, d);
        st_header_done(&f);
    }
    CHECK_NO_LEAKS();
}

/* ---- headers that parse --------------------------------------------------- */

TEST(header_valid_and_metadata_ignored)
{
    const char *json =
        "{\"__metadata__\":{\"format\":\"pt\",\"x\":\"y\"},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
        "\"a\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]}}";
    struct st_file f;
    char err[256];
    size_t n = strlen(json);
    CHECK_EQ_INT(parse(json, 40, &f, err, sizeof(err)), 0);
    CHECK_EQ_INT(f.fd, -1);
    CHECK_EQ_INT(f.size, 8 + n + 40);
    CHECK_EQ_INT(f.count, 2);
    CHECK(st_find(&f, "__metadata__") == NULL);
    const struct st_tensor *a = st_find(&f, "a"), *b = st_find(&f, "b");
    CHECK(a && b);
    CHECK(a == &f.tensors[0]); /* sorted */
    CHECK_EQ_INT(a->offset, 8 + n + 24);
    CHECK_EQ_INT(a->nbytes, 8);
    CHECK_EQ_INT(b->offset, 8 + n);
    CHECK_EQ_INT(b->nbytes, 24);
    CHECK_EQ_INT(b->ndim, 2);
    CHECK_EQ_INT(b->shape[0], 2);
    CHECK_EQ_INT(b->shape[1], 3);
    st_header_done(&f);
    CHECK(f.tensors == NULL && f.count == 0);

    /* A __metadata__ of any JSON type is skipped, not parsed as a tensor. */
    expect_accept("{\"__metadata__\":\"text\"}", 0, 0);
    expect_accept("{\"__metadata__\":[1,2],\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                  1, 1);
    expect_accept("{}", 0, 0);
    /* A scalar, an empty tensor, 8 dims, a tensor that ends exactly at EOF. */
    expect_accept("{\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]}}", 8, 1);
    expect_accept("{\"e\":{\"dtype\":\"F32\",\"shape\":[0,7],\"data_offsets\":[5,5]}}", 5, 1);
    expect_accept("{\"d\":{\"dtype\":\"I8\",\"shape\":[1,1,1,1,1,1,1,2],\"data_offsets\":[0,2]}}", 2, 1);
    /* Big but exact integers in exponent form are fine. */
    expect_accept("{\"x\":{\"dtype\":\"U8\",\"shape\":[1e1],\"data_offsets\":[0,1.0e1]}}", 10, 1);
    CHECK_NO_LEAKS();
}

/* ---- headers that are refused -------------------------------------------- */

TEST(reject_not_json)
{
    expect_reject("", 0, "not valid JSON");
    expect_reject("{", 0, "not valid JSON");
    expect_reject("nonsense", 0, "not valid JSON");
    expect_reject("{\"a\":{\"dtype\":\"F32\",}}", 0, "not valid JSON");
    expect_reject("{'a':1}", 0, "not valid JSON");
    CHECK_NO_LEAKS();
}

TEST(reject_not_object)
{
    expect_reject("[]", 0, "not a JSON object");
    expect_reject("42", 0, "not a JSON object");
    expect_reject("\"str\"", 0, "not a JSON object");
    expect_reject("null", 0, "not a JSON object");
    expect_reject("{\"a\":5}", 0, "'a' is not an object");
    expect_reject("{\"a\":[0,1]}", 0, "'a' is not an object");
    CHECK_NO_LEAKS();
}

TEST(reject_missing_fields)
{
    expect_reject("{\"t\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "'t' lacks");
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "'t' lacks");
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "'t' lacks");
    expect_reject("{\"t\":{}}", 4, "lacks");
    /* Present with the wrong JSON type. */
    expect_reject("{\"t\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "lacks");
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, "lacks");
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":\"0,4\"}}", 4, "lacks");
    /* Keys are case-sensitive. */
    expect_reject("{\"t\":{\"DTYPE\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "lacks");
    CHECK_NO_LEAKS();
}

TEST(reject_unknown_dtype)
{
    expect_reject("{\"t\":{\"dtype\":\"F128\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
                  "unknown dtype 'F128'");
    expect_reject("{\"t\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "unknown dtype");
    expect_reject("{\"t\":{\"dtype\":\"\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "unknown dtype");
    expect_reject("{\"t\":{\"dtype\":\"F32 \",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "unknown dtype");
    CHECK_NO_LEAKS();
}

TEST(reject_bad_numbers)
{
    /* In the shape. */
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 0, "bad shape");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}", 2, "bad shape");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[1e300],\"data_offsets\":[0,1]}}", 2, "bad shape");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[18446744073709551616],\"data_offsets\":[0,1]}}",
                  2, "bad shape");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[\"2\"],\"data_offsets\":[0,2]}}", 2, "bad shape");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[null],\"data_offsets\":[0,2]}}", 2, "bad shape");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[[2]],\"data_offsets\":[0,2]}}", 2, "bad shape");
    /* Each dimension fits, the product does not fit in 64 bits. */
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,4294967296],"
                  "\"data_offsets\":[0,1]}}", 2, "bad shape");
    /* The product fits, the byte size does not. */
    expect_reject("{\"t\":{\"dtype\":\"F64\",\"shape\":[2097152,2097152,2097152],"
                  "\"data_offsets\":[0,8]}}", 8, NULL);
    /* In data_offsets. */
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[-4,0]}}", 4, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0.5,4.5]}}", 8, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4.25]}}", 8, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[1e300,1e300]}}", 8,
                  "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],"
                  "\"data_offsets\":[18446744073709551612,18446744073709551616]}}", 8, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[\"0\",4]}}", 4, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0]}}", 4, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4,8]}}", 8, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[]}}", 8, "bad data_offsets");
    CHECK_NO_LEAKS();
}

TEST(reject_too_many_dims)
{
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1,
                  "9 dimensions");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],"
                  "\"data_offsets\":[0,1]}}", 1, "dimensions");
    expect_accept("{\"t\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1, 1);
    CHECK_NO_LEAKS();
}

TEST(reject_offsets_not_matching_shape)
{
    uint64_t s = test_seed();
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", 64, "needs 24");
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,28]}}", 64, "span 28");
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,4]}}", 64, "needs 0");
    expect_reject("{\"t\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,4]}}", 64, "needs 2");
    /* Random shapes: the right span parses, one byte more or less does not. */
    for (int it = 0; it < 50; it++) {
        uint64_t a = 1 + test_rand(&s) % 50, b = 1 + test_rand(&s) % 50;
        enum st_dtype dt = (enum st_dtype)(test_rand(&s) % ST_DTYPE_COUNT);
        uint64_t nb = a * b * st_dtype_size(dt), begin = test_rand(&s) % 16;
        for (int delta = -1; delta <= 1; delta++) {
            char json[200];
            snprintf(json, sizeof(json),
                     "{\"t\":{\"dtype\":\"%s\",\"shape\":[%llu,%llu],\"data_offsets\":[%llu,%llu]}}",
                     st_dtype_name(dt), (unsigned long long)a, (unsigned long long)b,
                     (unsigned long long)begin, (unsigned long long)(begin + nb + (uint64_t)delta));
            if (delta == 0)
                expect_accept(json, begin + nb, 1);
            else
                expect_reject(json, begin + nb + 1, "data_offsets span");
        }
    }
    CHECK_NO_LEAKS();
}

TEST(reject_end_beyond_data)
{
    /* The tensor needs 24 bytes; the data section has 23: a truncated file. */
    expect_reject("{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 23, "truncated");
    expect_accept("{\"t\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", 24, 1);
    /* The second of two tensors is the one that leaves the file. */
    expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[8,16]}}", 15, "'b' ends at byte 16");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[9,9]}}", 8, "truncated");

    /* The header itself longer than the file. */
    const char *json = "{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}";
    struct st_file f;
    char err[256] = "";
    CHECK_EQ_INT(st_parse_header(json, strlen(json), strlen(json) + 7, &f, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "does not fit");
    CHECK_EQ_INT(st_parse_header(json, strlen(json), strlen(json) + 8, &f, err, sizeof(err)), 0);
    st_header_done(&f);
    CHECK_NO_LEAKS();
}

TEST(reject_begin_after_end)
{
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[8,0]}}", 16, "bad data_offsets");
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[12,8]}}", 16, "bad data_offsets");
    CHECK_NO_LEAKS();
}

TEST(reject_duplicate_names)
{
    expect_reject("{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                  "\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}", 8, "'t' appears twice");
    expect_reject("{\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                  "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]},"
                  "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}", 3, "appears twice");
    CHECK_NO_LEAKS();
}

/* An error in a later tensor frees what was parsed before it (the SAN build
 * checks for leaks), and the message fits any buffer size. */
TEST(reject_late_error_and_small_err_buffer)
{
    const char *json = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                       "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]},"
                       "\"c\":{\"dtype\":\"XX\",\"shape\":[1],\"data_offsets\":[2,3]}}";
    expect_reject(json, 3, "'c' has unknown dtype");
    struct st_file f;
    char small[8];
    memset(small, 'x', sizeof(small));
    size_t n = strlen(json);
    CHECK_EQ_INT(st_parse_header(json, n, 8 + n + 3, &f, small, sizeof(small)), -EINVAL);
    CHECK_EQ_INT(strlen(small), sizeof(small) - 1);
    CHECK_EQ_INT(st_parse_header(json, n, 8 + n + 3, &f, NULL, 0), -EINVAL);
    CHECK_NO_LEAKS();
}

/* ---- whole files ---------------------------------------------------------- */

static int open_file(const char *path, char *err, size_t errlen)
{
    struct st_file *f = (struct st_file *)1;
    err[0] = '\0';
    int rc = st_open(path, &f, err, errlen);
    if (rc == 0)
        st_close(&f);
    else
        CHECK(f == NULL);
    return rc;
}

TEST(open_rejects_crafted_files)
{
    const char *dir = tmp_dir();
    char path[256], err[256];
    const char *json = "{\"t\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}";
    uint64_t jl = strlen(json);
    snprintf(path, sizeof(path), "%s/f.safetensors", dir);

    /* The well-formed file, for contrast. */
    write_raw(path, jl, json, 4);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), 0);

    /* A header length one byte larger than the rest of the file. */
    write_raw(path, jl + 5, json, 4);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "larger than the file");
    /* Absurd header lengths: 2^63, 2^64-1, just over the 100 MiB limit. */
    write_raw(path, 1ull << 63, json, 4);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "header length");
    write_raw(path, UINT64_MAX, json, 4);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);
    write_raw(path, ST_MAX_HEADER + 1ull, json, 4);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);

    /* The data section one byte short. */
    write_raw(path, jl, json, 3);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "truncated");

    /* Shorter than the 8-byte length field, and empty. */
    write_bytes(path, "\x02\0\0\0\0", 5);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "too short");
    write_bytes(path, "", 0);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "0 bytes");
    /* Exactly the length field, saying 0: an empty (invalid JSON) header. */
    write_bytes(path, "\0\0\0\0\0\0\0\0", 8);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -EINVAL);
    CHECK(err[0] != '\0');

    /* Not a regular file; not there at all. */
    CHECK_EQ_INT(open_file(dir, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "regular file");
    snprintf(path, sizeof(path), "%s/missing.safetensors", dir);
    CHECK_EQ_INT(open_file(path, err, sizeof(err)), -ENOENT);
    CHECK(err[0] != '\0');
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* st_open_fd takes the fd: closed on success (by st_close) and on error. */
TEST(open_fd_closes_on_error)
{
    const char *dir = tmp_dir();
    char path[256], err[256];
    snprintf(path, sizeof(path), "%s/bad.safetensors", dir);
    write_raw(path, 1000, "{}", 0);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    struct st_file *f = NULL;
    CHECK_EQ_INT(st_open_fd(fd, &f, err, sizeof(err)), -EINVAL);
    CHECK(f == NULL);
    errno = 0;
    CHECK(fcntl(fd, F_GETFD) == -1 && errno == EBADF);

    int p[2];
    CHECK(pipe(p) == 0);
    CHECK_EQ_INT(st_open_fd(p[0], &f, err, sizeof(err)), -EINVAL);
    CHECK(fcntl(p[0], F_GETFD) == -1);
    close(p[1]);

    write_raw(path, 2, "{}", 0);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    CHECK_EQ_INT(st_open_fd(fd, &f, err, sizeof(err)), 0);
    CHECK_EQ_INT(f->fd, fd);
    CHECK_EQ_INT(f->count, 0);
    st_close(&f);
    CHECK(fcntl(fd, F_GETFD) == -1);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* A file that shrinks after it was opened: st_read says -EIO, no SIGBUS. */
TEST(read_after_truncation)
{
    uint64_t s = test_seed();
    const char *dir = tmp_dir();
    char path[256], err[256];
    snprintf(path, sizeof(path), "%s/t.safetensors", dir);
    float a[64], b[16];
    for (int i = 0; i < 64; i++)
        a[i] = test_randf(&s);
    for (int i = 0; i < 16; i++)
        b[i] = test_randf(&s);
    struct st_out t[2] = {
        {.name = "a", .dtype = ST_F32, .ndim = 2, .shape = {8, 8}, .data = a},
        {.name = "b", .dtype = ST_F32, .ndim = 1, .shape = {16}, .data = b},
    };
    CHECK_EQ_INT(st_write(path, t, 2), 0);
    struct st_file *f = NULL;
    CHECK_EQ_INT(st_open(path, &f, err, sizeof(err)), 0);
    const struct st_tensor *ta = st_find(f, "a"), *tb = st_find(f, "b");
    CHECK(ta && tb);
    CHECK(truncate(path, (off_t)(tb->offset + 3)) == 0);
    float back[64];
    CHECK_EQ_INT(st_read(f, ta, back), 0);
    CHECK(memcmp(back, a, sizeof(a)) == 0);
    CHECK_EQ_INT(st_read(f, tb, back), -EIO);
    st_close(&f);
    /* Reopened, the header no longer fits the file. */
    CHECK_EQ_INT(st_open(path, &f, err, sizeof(err)), -EINVAL);
    CHECK_STR_CONTAINS(err, "'b'");
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* A stop that comes after a read's first part (st_set_part_hook). */
static void cancel_after_a_part(void)
{
    st_cancel_reads();
}

/* A tensor larger than ST_READ_PART reads back whole across the parts, and
 * counts in st_bytes_read; a stop during a read ends it after the part
 * under way, and once reads are cancelled st_read refuses with -ECANCELED
 * and writes nothing, while headers still open. */
TEST(reads_in_parts_until_cancelled)
{
    uint64_t s = test_seed();
    const char *dir = tmp_dir();
    char path[256], err[256];
    snprintf(path, sizeof(path), "%s/big.safetensors", dir);
    const uint64_t n = ST_READ_PART / 4 + 1000;
    float *a = malloc(n * 4), *back = malloc(n * 4);
    CHECK(a && back);
    for (uint64_t i = 0; i < n; i++)
        a[i] = test_randf(&s);
    struct st_out t = {.name = "a", .dtype = ST_F32, .ndim = 1, .shape = {n}, .data = a};
    CHECK_EQ_INT(st_write(path, &t, 1), 0);
    struct st_file *f = NULL;
    CHECK_EQ_INT(st_open(path, &f, err, sizeof(err)), 0);
    const struct st_tensor *ta = st_find(f, "a");
    CHECK(ta != NULL);
    memset(back, 0xa5, n * 4);
    uint64_t was = st_bytes_read();
    CHECK_EQ_INT(st_read(f, ta, back), 0);
    CHECK(memcmp(back, a, n * 4) == 0);
    CHECK_EQ_INT((long long)(st_bytes_read() - was), (long long)(n * 4));
    memset(back, 0xa5, n * 4);
    was = st_bytes_read();
    CHECK(!st_reads_cancelled());
    st_set_part_hook(cancel_after_a_part);
    CHECK_EQ_INT(st_read(f, ta, back), -ECANCELED);
    st_set_part_hook(NULL);
    CHECK(st_reads_cancelled());
    CHECK_EQ_INT((long long)(st_bytes_read() - was), (long long)ST_READ_PART);
    CHECK(memcmp(back, a, ST_READ_PART) == 0 && back[n - 1] != a[n - 1]);
    memset(back, 0xa5, n * 4);
    CHECK_EQ_INT(st_read(f, ta, back), -ECANCELED);
    CHECK(back[0] != a[0] && back[n - 1] != a[n - 1]);
    st_close(&f);
    CHECK_EQ_INT(st_open(path, &f, err, sizeof(err)), 0);
    st_close(&f);
    free(a);
    free(back);
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

/* st_write() writes only where a regular file is, or can be made: never
 * over a directory or a device (its rename would put a file in the
 * device's place), never into a directory that is not there. */
TEST(write_only_where_a_regular_file_can_be)
{
    const char *dir = tmp_dir();
    char path[300];
    float a[4] = {1, 2, 3, 4};
    struct st_out t = {.name = "a", .dtype = ST_F32, .ndim = 1, .shape = {4}, .data = a};
    CHECK_EQ_INT(st_write_check(dir), -EISDIR);
    CHECK_EQ_INT(st_write(dir, &t, 1), -EISDIR);
    CHECK_EQ_INT(st_write_check("/dev/null"), -EINVAL);
    CHECK_EQ_INT(st_write("/dev/null", &t, 1), -EINVAL);
    struct stat st;
    CHECK(stat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode));
    CHECK_EQ_INT(st_write_check(""), -ENOENT);
    snprintf(path, sizeof(path), "%s/none/t.st", dir);
    CHECK_EQ_INT(st_write(path, &t, 1), -ENOENT);
    snprintf(path, sizeof(path), "%s/t.st/", dir);
    CHECK_EQ_INT(st_write_check(path), -EISDIR);
    snprintf(path, sizeof(path), "%s/t.st", dir);
    CHECK_EQ_INT(st_write_check(path), 0);
    CHECK_EQ_INT(st_write(path, &t, 1), 0);
    CHECK_EQ_INT(st_write_check(path), 0); /* there now, and regular */
    snprintf(path, sizeof(path), "%s/t.st/x", dir);
    CHECK_EQ_INT(st_write_check(path), -ENOTDIR);
    snprintf(path, sizeof(path), "%s/t.st/", dir); /* a file named as a directory */
    CHECK_EQ_INT(st_write_check(path), -ENOTDIR);
    /* A link is replaced by the rename, not written through: one to a
     * device is fine, and the device stays. */
    char link[300];
    snprintf(link, sizeof(link), "%s/null", dir);
    CHECK(symlink("/dev/null", link) == 0);
    CHECK_EQ_INT(st_write_check(link), 0);
    CHECK_EQ_INT(st_write(link, &t, 1), 0);
    CHECK(lstat(link, &st) == 0 && S_ISREG(st.st_mode));
    CHECK(stat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode));
    /* A file that is there needs its directory writable too (the temp file
     * and the rename go there); root may write anywhere. */
    if (geteuid() != 0) {
        snprintf(path, sizeof(path), "%s/t.st", dir);
        CHECK(chmod(dir, 0555) == 0);
        CHECK_EQ_INT(st_write_check(path), -EACCES);
        CHECK(chmod(dir, 0755) == 0);
    }
    tmp_cleanup();
    CHECK_NO_LEAKS();
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(roundtrip_every_dtype),
        TEST_CASE(reads_in_parts_until_cancelled),
        TEST_CASE(dtype_table),
        TEST_CASE(header_valid_and_metadata_ignored),
        TEST_CASE(reject_not_json),
        TEST_CASE(reject_not_object),
        TEST_CASE(reject_missing_fields),
        TEST_CASE(reject_unknown_dtype),
        TEST_CASE(reject_bad_numbers),
        TEST_CASE(reject_too_many_dims),
        TEST_CASE(reject_offsets_not_matching_shape),
        TEST_CASE(reject_end_beyond_data),
        TEST_CASE(reject_begin_after_end),
        TEST_CASE(reject_duplicate_names),
        TEST_CASE(reject_late_error_and_small_err_buffer),
        TEST_CASE(open_rejects_crafted_files),
        TEST_CASE(open_fd_closes_on_error),
        TEST_CASE(read_after_truncation),
        TEST_CASE(write_only_where_a_regular_file_can_be),
        {0}});
}
