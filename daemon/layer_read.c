/*
 * layer_read.c: see layer.h. Checkpoints name expert tensors in two ways:
 *   Mixtral:           <prefix>experts.<e>.w1.weight / w3 / w2   (gate/up/down)
 *   Qwen, DeepSeek:    <prefix>experts.<e>.gate_proj.weight / up_proj / down_proj
 * Each is a Linear weight, [out, in]: gate and up [I, H], down [H, I].
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/layer.h"
#include "daemon/safetensors.h"
#include "daemon/util.h"
#include "moe.pb-c.h"

#define MAX_EXPERTS 4096

static bool under_dir(const char *path, const char *dir)
{
    size_t n = strlen(dir);
    if (n == 1 && dir[0] == '/')
        return path[0] == '/';
    return strncmp(path, dir, n) == 0 && path[n] == '/';
}

static bool under_any(const char *path, char *const *allowed, size_t n_allowed)
{
    for (size_t i = 0; i < n_allowed; i++)
        if (under_dir(path, allowed[i]))
            return true;
    return false;
}

int layer_open_allowed(const char *path, char *const *allowed, size_t n_allowed,
                       char *canon, size_t canon_len, char *err, size_t errlen)
{
    if (!path || path[0] != '/')
        return errf(err, errlen, -EINVAL, "weight path must be absolute");
    if (n_allowed == 0)
        return errf(err, errlen, -EACCES,
                    "no directories are allowed for weight files (set allowed_dirs)");
    char *real = realpath(path, NULL);
    if (!real) {
        /* Say "not found" only where the caller may look: the directory
         * that would hold the file, with every link and ".." resolved, lies
         * inside, and the name is no link (a dangling link may point out). */
        int e = errno;
        bool inside = false;
        if (e == ENOENT) {
            char dir[PATH_MAX], *slash;
            struct stat st;
            snprintf(dir, sizeof(dir), "%s", path);
            slash = strrchr(dir, '/');
            const char *base = slash ? slash + 1 : dir;
            if (slash && strcmp(base, "..") && strcmp(base, ".") && lstat(path, &st) < 0) {
                *slash = '\0';
                char *rdir = realpath(dir[0] ? dir : "/", NULL);
                char file[PATH_MAX];
                if (rdir && snprintf(file, sizeof(file), "%s/%s", strcmp(rdir, "/") ? rdir : "",
                                     base) < (int)sizeof(file))
                    inside = under_any(file, allowed, n_allowed);
                free(rdir);
            }
        }
        if (inside)
            return errf(err, errlen, -ENOENT, "%s: no such file", path);
        return errf(err, errlen, -EACCES, "%s is outside the allowed directories", path);
    }
    if (!under_any(real, allowed, n_allowed)) {
        free(real);
        return errf(err, errlen, -EACCES, "%s is outside the allowed directories", path);
    }
    /* O_NONBLOCK: a FIFO must not hang the loader waiting for a writer. */
    int fd = open(real, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        /* Permission, a file gone meanwhile and the daemon's own limits are
         * what they say; any other failure (a socket, a device) is a file
         * that cannot be read as weights. */
        int e = errno;
        free(real);
        int rc = e == EACCES || e == EPERM ? -EACCES
                 : e == ENOENT             ? -ENOENT
                 : e == ENOMEM             ? -ENOMEM
                 : e == EMFILE || e == ENFILE ? -EMFILE
                                              : -EIO;
        return errf(err, errlen, rc, "%s: %s%s", path, strerror(e),
                    rc == -EIO ? " (not a readable regular file)" : "");
    }
    struct stat fst;
    if (fstat(fd, &fst) < 0 || !S_ISREG(fst.st_mode)) {
        close(fd);
        free(real);
        return errf(err, errlen, -EIO, "%s is not a regular file", path);
    }
    /* The file opened is the one checked, whatever was renamed in between. */
    char link[64], got[PATH_MAX];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, got, sizeof(got) - 1);
    free(real);
    if (n <= 0) {
        close(fd);
        return errf(err, errlen, -EACCES, "%s: cannot verify the opened file", path);
    }
    got[n] = '\0';
    if (!under_any(got, allowed, n_allowed)) {
        close(fd);
        return errf(err, errlen, -EACCES, "%s is outside the allowed directories", path);
    }
    snprintf(canon, canon_len, "%s", got);
    return fd;
}

void host_weights_done(struct host_weights *w)
{
    free(w->w1);
    free(w->w3);
    free(w->w2);
    w->w1 = w->w3 = w->w2 = NULL;
}

static int st_to_wire(enum st_dtype d)
{
    switch (d) {
    case ST_BF16: return MOE__DTYPE__DTYPE_BF16;
    case ST_F16: return MOE__DTYPE__DTYPE_FP16;
    case ST_F32: return MOE__DTYPE__DTYPE_FP32;
    default: return 0;
    }
}

static moek_dtype wire_to_moek(int d)
{
    return d == MOE__DTYPE__DTYPE_BF16 ? MOEK_DTYPE_BF16
         : d == MOE__DTYPE__DTYPE_FP16 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_FP32;
}

static int read_tensor(const struct st_file *f, const struct st_tensor *t, void *dst, char *err,
                       size_t errlen)
{
    int rc = st_read(f, t, dst);
    if (rc == -ECANCELED)
        return errf(err, errlen, rc, "tensor %s: not read, since moed is stopping", t->name);
    if (rc < 0)
        return errf(err, errlen, -EIO, "tensor %s: file is truncated", t->name);
    return 0;
}

/* Read tensor t (already shape-checked, numel elements) into dst as dtype. */
static int read_as(const struct st_file *f, const struct st_tensor *t, int dtype,
                   void *dst, uint64_t numel, char *err, size_t errlen)
{
    int src = st_to_wire(t->dtype);
    if (src == dtype)
        return read_tensor(f, t, dst, err, errlen);
    void *tmp = malloc(t->nbytes ? t->nbytes : 1);
    float *f32 = malloc(numel * sizeof(float) + 1);
    int rc = 0;
    if (!tmp || !f32)
        rc = -ENOMEM;
    else
        rc = read_tensor(f, t, tmp, err, errlen);
    if (!rc) {
        moek_to_f32(wire_to_moek(src), tmp, f32, numel);
        moek_from_f32(wire_to_moek(dtype), f32, dst, numel);
    }
    free(tmp);
    free(f32);
    return rc;
}

/* Find "<prefix>experts.<e>.<part>.weight". */
static const struct st_tensor *find_expert(const struct st_file *f, const char *prefix,
                                           uint32_t e, const char *part)
{
    char name[512];
    if (snprintf(name, sizeof(name), "%sexperts.%u.%s.weight", prefix, e, part) >=
        (int)sizeof(name))
        return NULL;
    return st_find(f, name);
}

static bool shape2(const struct st_tensor *t, uint64_t a, uint64_t b)
{
    return t->ndim == 2 && t->shape[0] == a && t->shape[1] == b;
}

static const char *const moe_schemes[2][3] = {{"w1", "w3", "w2"},
                                             {"gate_proj", "up_proj", "down_proj"}};

/* A MoE layer's naming scheme (*scheme, into moe_schemes), experts, sizes
 * and dtype from the file's header, spec's values overriding the file's;
 * no tensor data is read. */
static int moe_shape(const struct layer_spec *spec, const struct st_file *f,
                     struct host_weights *out, int *scheme, char *err, size_t errlen)
{
    const char *prefix = spec->prefix ? spec->prefix : "";
    int sch = -1;
    for (int i = 0; i < 2 && sch < 0; i++)
        if (find_expert(f, prefix, 0, moe_schemes[i][0]))
            sch = i;
    if (sch < 0)
        return errf(err, errlen, -EINVAL,
                    "no tensor %sexperts.0.w1.weight or %sexperts.0.gate_proj.weight in the file",
                    prefix, prefix);
    const char *const *parts = moe_schemes[sch];
    uint32_t E = spec->experts;
    if (!E) {
        while (E < MAX_EXPERTS && find_expert(f, prefix, E, parts[0]))
            E++;
    }
    if (E == 0 || E > MAX_EXPERTS)
        return errf(err, errlen, -EINVAL, "%u experts (1 to %d supported)", E, MAX_EXPERTS);
    const struct st_tensor *g0 = find_expert(f, prefix, 0, parts[0]);
    if (g0->ndim != 2)
        return errf(err, errlen, -EINVAL, "%s is not a matrix", g0->name);
    uint64_t I = spec->intermediate ? spec->intermediate : g0->shape[0];
    uint64_t H = spec->hidden ? spec->hidden : g0->shape[1];
    if (I == 0 || H == 0 || I > (1u << 20) || H > (1u << 20))
        return errf(err, errlen, -EINVAL, "hidden %llu / intermediate %llu out of range",
                    (unsigned long long)H, (unsigned long long)I);
    int dtype = st_to_wire(g0->dtype) ? (spec->dtype ? spec->dtype : st_to_wire(g0->dtype)) : 0;
    if (!dtype)
        return errf(err, errlen, -ENOTSUP, "%s has dtype %s; bf16, fp16 and fp32 are supported",
                    g0->name, st_dtype_name(g0->dtype));
    out->dtype = dtype;
    out->experts = E;
    out->hidden = (uint32_t)H;
    out->intermediate = (uint32_t)I;
    *scheme = sch;
    return 0;
}

/* A MoE layer's tensors from f into out; read false: every check, from the
 * header alone, and nothing read. */
static int read_moe(const struct layer_spec *spec, const struct st_file *f, bool read,
                    struct host_weights *out, char *err, size_t errlen)
{
    const char *prefix = spec->prefix ? spec->prefix : "";
    int sch = 0;
    int rc = moe_shape(spec, f, out, &sch, err, errlen);
    if (rc)
        return rc;
    const char *const *parts = moe_schemes[sch];
    const uint32_t E = out->experts;
    const uint64_t I = out->intermediate, H = out->hidden;
    const int dtype = out->dtype;
    uint64_t per = I * H, esz = dtype == MOE__DTYPE__DTYPE_FP32 ? 4 : 2, total;
    if (!mul_u64(per * esz, E, &total))
        return -EOVERFLOW;
    out->bytes = 3 * total;
    if (spec->topk > E)
        return errf(err, errlen, -EINVAL, "topk %u is above the layer's %u experts", spec->topk,
                    E);
    if (read) {
        out->w1 = malloc(total);
        out->w3 = malloc(total);
        out->w2 = malloc(total);
        if (!out->w1 || !out->w3 || !out->w2)
            return -ENOMEM;
    }
    void *dst[3] = {out->w1, out->w3, out->w2};
    for (uint32_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            const struct st_tensor *t = find_expert(f, prefix, e, parts[p]);
            if (!t)
                return errf(err, errlen, -EINVAL, "tensor %sexperts.%u.%s.weight is missing",
                            prefix, e, parts[p]);
            bool ok = p < 2 ? shape2(t, I, H) : shape2(t, H, I);
            if (!ok || !st_to_wire(t->dtype))
                return errf(err, errlen, -EINVAL,
                            "tensor %s has shape/dtype that does not fit H=%llu I=%llu "
                            "(want %s [%llu, %llu])", t->name, (unsigned long long)H,
                            (unsigned long long)I, p < 2 ? "gate/up" : "down",
                            (unsigned long long)(p < 2 ? I : H), (unsigned long long)(p < 2 ? H : I));
            if (read && (rc = read_as(f, t, dtype, (uint8_t *)dst[p] + (uint64_t)e * per * esz,
                                      per, err, errlen)))
                return rc;
        }
    return 0;
}

/* A GEMM layer's tensor, as read_moe. */
static int read_gemm(const struct layer_spec *spec, const struct st_file *f, bool read,
                     struct host_weights *out, char *err, size_t errlen)
{
    const char *name = spec->prefix ? spec->prefix : "";
    const struct st_tensor *t = st_find(f, name);
    if (!t)
        return errf(err, errlen, -EINVAL, "tensor '%s' is missing", name);
    if (t->ndim != 3 || t->shape[0] == 0 || t->shape[1] == 0 || t->shape[2] == 0 ||
        t->shape[0] > 65536 || t->shape[1] > (1u << 20) || t->shape[2] > (1u << 20))
        return errf(err, errlen, -EINVAL, "tensor '%s' must be [G, N, K] with each dimension nonzero",
                    name);
    if ((spec->groups && spec->groups != t->shape[0]) || (spec->n && spec->n != t->shape[1]) ||
        (spec->k && spec->k != t->shape[2]))
        return errf(err, errlen, -EINVAL, "tensor '%s' is [%llu, %llu, %llu], not the given shape",
                    name, (unsigned long long)t->shape[0], (unsigned long long)t->shape[1],
                    (unsigned long long)t->shape[2]);
    int dtype = spec->dtype ? spec->dtype : st_to_wire(t->dtype);
    if (!dtype || !st_to_wire(t->dtype))
        return errf(err, errlen, -ENOTSUP, "tensor '%s' has dtype %s; bf16, fp16 and fp32 are supported",
                    name, st_dtype_name(t->dtype));
    uint64_t numel = t->shape[0] * t->shape[1] * t->shape[2];
    out->dtype = dtype;
    out->groups = (uint32_t)t->shape[0];
    out->n = (uint32_t)t->shape[1];
    out->k = (uint32_t)t->shape[2];
    out->bytes = numel * (dtype == MOE__DTYPE__DTYPE_FP32 ? 4 : 2);
    if (!read)
        return 0;
    out->w1 = malloc(out->bytes);
    if (!out->w1)
        return -ENOMEM;
    return read_as(f, t, dtype, out->w1, numel, err, errlen);
}

/* Open spec's file (under the allowed directories) as safetensors; its
 * canonical path in canon (PATH_MAX). */
static int open_spec(const struct layer_spec *spec, char *const *allowed, size_t n_allowed,
                     char *canon, struct st_file **f, char *err, size_t errlen)
{
    int fd = layer_open_allowed(spec->path, allowed, n_allowed, canon, PATH_MAX, err, errlen);
    if (fd < 0)
        return fd;
    char why[256] = "";
    int rc = st_open_fd(fd, f, why, sizeof(why));
    if (rc)
        return errf(err, errlen, rc == -ENOMEM ? rc : -EIO, "%s: not a valid safetensors file: %s",
                    canon, why);
    return 0;
}

/* out->source: the canonical path, and ":prefix" when there is one. */
static void set_source(struct host_weights *out, const char *canon, const struct layer_spec *spec)
{
    int n = snprintf(out->source, sizeof(out->source), "%s", canon);
    if (spec->prefix && n >= 0 && (size_t)n < sizeof(out->source))
        snprintf(out->source + n, sizeof(out->source) - (size_t)n, ":%s", spec->prefix);
}

/* layer_read_weights, or (read false) layer_check_weights into out. */
static int read_layer(const struct layer_spec *spec, char *const *allowed, size_t n_allowed,
                      bool read, struct host_weights *out, char *err, size_t errlen)
{
    char canon[PATH_MAX];
    struct st_file *f = NULL;
    memset(out, 0, sizeof(*out));
    int rc = open_spec(spec, allowed, n_allowed, canon, &f, err, errlen);
    if (rc)
        return rc;
    rc = spec->kind == MOE__LAYER_KIND__LAYER_GEMM ? read_gemm(spec, f, read, out, err, errlen)
                                                   : read_moe(spec, f, read, out, err, errlen);
    st_close(&f);
    if (rc) {
        if (rc == -ENOMEM)
            snprintf(err, errlen, "out of host memory reading %s", canon);
        host_weights_done(out);
        return rc;
    }
    set_source(out, canon, spec);
    return 0;
}

int layer_read_weights(const struct layer_spec *spec, char *const *allowed,
                       size_t n_allowed, struct host_weights *out, char *err,
                       size_t errlen)
{
    return read_layer(spec, allowed, n_allowed, true, out, err, errlen);
}

int layer_check_weights(const struct layer_spec *spec, char *const *allowed, size_t n_allowed,
                        struct host_weights *out, char *err, size_t errlen)
{
    return read_layer(spec, allowed, n_allowed, false, out, err, errlen);
}
