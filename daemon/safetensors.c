/*
 * safetensors.c: see safetensors.h. The header is untrusted input (a
 * checkpoint from anywhere); it is parsed with cJSON and every number is
 * checked before it is used as a size or an offset.
 */
#include "daemon/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/util.h"

static const struct {
    const char *name;
    size_t size;
} st_dtypes[ST_DTYPE_COUNT] = {
    [ST_BOOL] = {"BOOL", 1}, [ST_U8] = {"U8", 1},     [ST_I8] = {"I8", 1},
    [ST_I16] = {"I16", 2},   [ST_U16] = {"U16", 2},   [ST_F16] = {"F16", 2},
    [ST_BF16] = {"BF16", 2}, [ST_I32] = {"I32", 4},   [ST_U32] = {"U32", 4},
    [ST_F32] = {"F32", 4},   [ST_F64] = {"F64", 8},   [ST_I64] = {"I64", 8},
    [ST_U64] = {"U64", 8},   [ST_F8_E4M3] = {"F8_E4M3", 1},
    [ST_F8_E5M2] = {"F8_E5M2", 1},
};

size_t st_dtype_size(enum st_dtype dt)
{
    return (unsigned)dt < ST_DTYPE_COUNT ? st_dtypes[dt].size : 0;
}

const char *st_dtype_name(enum st_dtype dt)
{
    return (unsigned)dt < ST_DTYPE_COUNT ? st_dtypes[dt].name : "?";
}

static int st_fail(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int st_fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -EINVAL;
}

/* A JSON number that is an exact non-negative integer below 2^53. */
static bool json_u64(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j))
        return false;
    double d = j->valuedouble;
    if (!(d >= 0) || d > 9007199254740992.0 || floor(d) != d)
        return false;
    *out = (uint64_t)d;
    return true;
}

static int st_cmp(const void *a, const void *b)
{
    return strcmp(((const struct st_tensor *)a)->name,
                  ((const struct st_tensor *)b)->name);
}

void st_header_done(struct st_file *f)
{
    for (size_t i = 0; i < f->count; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    f->tensors = NULL;
    f->count = 0;
}

static int st_cmp_offset(const void *a, const void *b)
{
    const struct st_tensor *x = *(const struct st_tensor *const *)a;
    const struct st_tensor *y = *(const struct st_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* No two tensors may share bytes. Overlapping ranges would let a small file
 * describe far more data than it holds (every expert of a layer on the same
 * bytes), and readers allocate what the header describes. */
static int st_check_disjoint(const struct st_file *f, char *err, size_t errlen)
{
    if (f->count < 2)
        return 0;
    const struct st_tensor **by = malloc(f->count * sizeof(*by));
    if (!by)
        return -ENOMEM;
    for (size_t i = 0; i < f->count; i++)
        by[i] = &f->tensors[i];
    qsort(by, f->count, sizeof(*by), st_cmp_offset);
    int rc = 0;
    uint64_t end = 0;
    const struct st_tensor *last = NULL;
    for (size_t i = 0; i < f->count && !rc; i++) {
        if (by[i]->nbytes == 0)
            continue;
        if (last && by[i]->offset < end)
            rc = st_fail(err, errlen, "tensors '%.80s' and '%.80s' overlap in the file",
                         last->name, by[i]->name);
        end = by[i]->offset + by[i]->nbytes;
        last = by[i];
    }
    free(by);
    return rc;
}

int st_parse_header(const char *json, size_t json_len, uint64_t file_size,
                    struct st_file *f, char *err, size_t errlen)
{
    memset(f, 0, sizeof(*f));
    f->fd = -1;
    f->size = file_size;
    uint64_t data_start = 8 + (uint64_t)json_len;
    if (data_start > file_size)
        return st_fail(err, errlen, "header of %zu bytes does not fit in a file of %llu bytes",
                       json_len, (unsigned long long)file_size);
    uint64_t data_size = file_size - data_start;

    cJSON *root = cJSON_ParseWithLength(json, json_len);
    if (!root)
        return st_fail(err, errlen, "header is not valid JSON");
    int rc = 0;
    if (!cJSON_IsObject(root)) {
        rc = st_fail(err, errlen, "header is not a JSON object");
        goto out;
    }
    size_t n = 0;
    for (cJSON *it = root->child; it; it = it->next)
        if (strcmp(it->string, "__metadata__") != 0)
            n++;
    f->tensors = calloc(n ? n : 1, sizeof(*f->tensors));
    if (!f->tensors) {
        rc = -ENOMEM;
        goto out;
    }
    for (cJSON *it = root->child; it; it = it->next) {
        if (strcmp(it->string, "__metadata__") == 0)
            continue;
        struct st_tensor *t = &f->tensors[f->count];
        const char *name = it->string;
        if (!cJSON_IsObject(it)) {
            rc = st_fail(err, errlen, "tensor '%.80s' is not an object", name);
            goto out;
        }
        const cJSON *jd = cJSON_GetObjectItemCaseSensitive(it, "dtype");
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(it, "shape");
        const cJSON *jo = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        if (!cJSON_IsString(jd) || !cJSON_IsArray(js) || !cJSON_IsArray(jo)) {
            rc = st_fail(err, errlen, "tensor '%.80s' lacks dtype, shape or data_offsets", name);
            goto out;
        }
        int dt = -1;
        for (int d = 0; d < ST_DTYPE_COUNT; d++)
            if (strcmp(jd->valuestring, st_dtypes[d].name) == 0)
                dt = d;
        if (dt < 0) {
            rc = st_fail(err, errlen, "tensor '%.80s' has unknown dtype '%.16s'", name,
                         jd->valuestring);
            goto out;
        }
        int ndim = cJSON_GetArraySize(js);
        if (ndim > ST_MAX_DIMS) {
            rc = st_fail(err, errlen, "tensor '%.80s' has %d dimensions (at most %d)", name,
                         ndim, ST_MAX_DIMS);
            goto out;
        }
        uint64_t numel = 1;
        int d = 0;
        for (const cJSON *e = js->child; e; e = e->next, d++) {
            if (!json_u64(e, &t->shape[d]) || !mul_u64(numel, t->shape[d], &numel)) {
                rc = st_fail(err, errlen, "tensor '%.80s' has a bad shape", name);
                goto out;
            }
        }
        uint64_t begin, end, nbytes;
        if (cJSON_GetArraySize(jo) != 2 || !json_u64(jo->child, &begin) ||
            !json_u64(jo->child->next, &end) || begin > end) {
            rc = st_fail(err, errlen, "tensor '%.80s' has bad data_offsets", name);
            goto out;
        }
        if (!mul_u64(numel, st_dtypes[dt].size, &nbytes) || end - begin != nbytes) {
            rc = st_fail(err, errlen,
                         "tensor '%.80s': data_offsets span %llu bytes but its shape needs %llu",
                         name, (unsigned long long)(end - begin), (unsigned long long)nbytes);
            goto out;
        }
        if (end > data_size) {
            rc = st_fail(err, errlen,
                         "tensor '%.80s' ends at byte %llu of a data section of %llu bytes "
                         "(file truncated?)",
                         name, (unsigned long long)end, (unsigned long long)data_size);
            goto out;
        }
        t->name = strdup(name);
        if (!t->name) {
            rc = -ENOMEM;
            goto out;
        }
        t->dtype = (enum st_dtype)dt;
        t->ndim = ndim;
        t->offset = data_start + begin;
        t->nbytes = nbytes;
        f->count++;
    }
    qsort(f->tensors, f->count, sizeof(*f->tensors), st_cmp);
    for (size_t i = 1; i < f->count; i++)
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0) {
            rc = st_fail(err, errlen, "tensor '%.80s' appears twice", f->tensors[i].name);
            goto out;
        }
    rc = st_check_disjoint(f, err, errlen);
out:
    cJSON_Delete(root);
    if (rc)
        st_header_done(f);
    return rc;
}

static atomic_uint_fast64_t bytes_read_total;
static atomic_bool reads_cancelled;

static void (*part_hook)(void);

void st_set_part_hook(void (*fn)(void))
{
    part_hook = fn;
}

void st_cancel_reads(void)
{
    atomic_store(&reads_cancelled, true);
}

bool st_reads_cancelled(void)
{
    return atomic_load(&reads_cancelled);
}

uint64_t st_bytes_read(void)
{
    return atomic_load_explicit(&bytes_read_total, memory_order_relaxed);
}

/* In parts of at most ST_READ_PART bytes, each counted as it completes: a
 * large tensor's read shows progress long before its end, even from slow
 * storage. A tensor's read (cancellable) also ends before its next part
 * once a stop cancels the reads. */
static int pread_full(int fd, void *dst, uint64_t n, uint64_t off, bool cancellable)
{
    uint8_t *p = dst;
    while (n > 0) {
        if (cancellable && st_reads_cancelled())
            return -ECANCELED;
        size_t chunk = n > ST_READ_PART ? ST_READ_PART : (size_t)n;
        ssize_t r = pread(fd, p, chunk, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            return -EIO;
        atomic_fetch_add_explicit(&bytes_read_total, (uint_fast64_t)r, memory_order_relaxed);
        if (cancellable && part_hook)
            part_hook();
        p += r;
        n -= (uint64_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

int st_open_fd(int fd, struct st_file **out, char *err, size_t errlen)
{
    struct stat st;
    uint8_t lenbuf[8];
    *out = NULL;
    if (fstat(fd, &st) < 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return st_fail(err, errlen, "not a regular file");
    }
    uint64_t size = (uint64_t)st.st_size;
    if (size < 8 || pread_full(fd, lenbuf, 8, 0, false) < 0) {
        close(fd);
        return st_fail(err, errlen, "file of %llu bytes is too short for a safetensors header",
                       (unsigned long long)size);
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | lenbuf[i];
    if (hlen > ST_MAX_HEADER || hlen > size - 8) {
        close(fd);
        return st_fail(err, errlen, "header length %llu is larger than the file or the %u MiB limit",
                       (unsigned long long)hlen, ST_MAX_HEADER >> 20);
    }
    char *json = malloc(hlen ? hlen : 1);
    struct st_file *f = calloc(1, sizeof(*f));
    int rc = (!json || !f) ? -ENOMEM : pread_full(fd, json, hlen, 8, false);
    if (rc == -EIO)
        rc = st_fail(err, errlen, "file is truncated inside its header");
    if (rc == 0)
        rc = st_parse_header(json, (size_t)hlen, size, f, err, errlen);
    free(json);
    if (rc) {
        free(f);
        close(fd);
        return rc;
    }
    f->fd = fd;
    *out = f;
    return 0;
}

int st_open(const char *path, struct st_file **out, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = -errno;
        snprintf(err, errlen, "cannot open: %s", strerror(-e));
        *out = NULL;
        return e;
    }
    return st_open_fd(fd, out, err, errlen);
}

void st_close(struct st_file **fp)
{
    struct st_file *f = *fp;
    *fp = NULL;
    if (!f)
        return;
    st_header_done(f);
    close_fd(&f->fd);
    free(f);
}

const struct st_tensor *st_find(const struct st_file *f, const char *name)
{
    struct st_tensor key = {.name = (char *)name};
    return bsearch(&key, f->tensors, f->count, sizeof(key), st_cmp);
}

int st_read(const struct st_file *f, const struct st_tensor *t, void *dst)
{
    return pread_full(f->fd, dst, t->nbytes, t->offset, true);
}

int st_write_check(const char *path)
{
    struct stat st;
    size_t len = strlen(path);
    if (len == 0)
        return -ENOENT;
    /* lstat: the rename replaces a link, not what it points to. */
    if (lstat(path, &st) == 0) {
        if (S_ISDIR(st.st_mode))
            return -EISDIR;
        if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
            return -EINVAL;
    } else if (errno != ENOENT) {
        return -errno; /* ENOTDIR for "file/", EACCES, ... */
    } else if (path[len - 1] == '/') {
        return -EISDIR; /* "new/" names a directory */
    }
    /* The temp file and the rename go in the file's directory, there
     * already or not. */
    char dir[PATH_MAX];
    if (path_dir(path, dir, sizeof(dir)) < 0)
        return -ENAMETOOLONG;
    if (stat(dir, &st) < 0)
        return -errno;
    if (!S_ISDIR(st.st_mode))
        return -ENOTDIR;
    return access(dir, W_OK | X_OK) < 0 ? -errno : 0;
}

int st_write(const char *path, const struct st_out *tensors, size_t count)
{
    int rc = st_write_check(path);
    if (rc)
        return rc;
    cJSON *root = cJSON_CreateObject();
    uint64_t off = 0;
    if (!root)
        return -ENOMEM;
    for (size_t i = 0; i < count && rc == 0; i++) {
        const struct st_out *t = &tensors[i];
        uint64_t n = st_dtype_size(t->dtype);
        for (int d = 0; d < t->ndim; d++)
            n *= t->shape[d];
        cJSON *o = cJSON_AddObjectToObject(root, t->name);
        cJSON *s = o ? cJSON_AddArrayToObject(o, "shape") : NULL;
        cJSON *dof = o ? cJSON_AddArrayToObject(o, "data_offsets") : NULL;
        if (!o || !s || !dof || !cJSON_AddStringToObject(o, "dtype", st_dtype_name(t->dtype))) {
            rc = -ENOMEM;
            break;
        }
        for (int d = 0; d < t->ndim; d++)
            cJSON_AddItemToArray(s, cJSON_CreateNumber((double)t->shape[d]));
        cJSON_AddItemToArray(dof, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(dof, cJSON_CreateNumber((double)(off + n)));
        off += n;
    }
    char *json = rc ? NULL : cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!json)
        return -ENOMEM;
    size_t jlen = strlen(json);
    size_t padded = (jlen + 7) & ~(size_t)7;

    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof(tmp)) {
        free(json);
        return -ENAMETOOLONG;
    }
    FILE *fp = fopen(tmp, "wbe");
    if (!fp) {
        rc = -errno;
        free(json);
        return rc;
    }
    uint8_t lenbuf[8];
    for (int i = 0; i < 8; i++)
        lenbuf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    bool ok = fwrite(lenbuf, 8, 1, fp) == 1 && fwrite(json, 1, jlen, fp) == jlen;
    for (size_t i = jlen; ok && i < padded; i++)
        ok = fputc(' ', fp) != EOF;
    for (size_t i = 0; ok && i < count; i++) {
        const struct st_out *t = &tensors[i];
        uint64_t n = st_dtype_size(t->dtype);
        for (int d = 0; d < t->ndim; d++)
            n *= t->shape[d];
        ok = n == 0 || fwrite(t->data, 1, (size_t)n, fp) == n;
    }
    free(json);
    if (fclose(fp) != 0)
        ok = false;
    if (!ok || rename(tmp, path) < 0) {
        rc = -errno ? -errno : -EIO;
        unlink(tmp);
        return rc;
    }
    return 0;
}
