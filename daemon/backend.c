/*
 * backend.c: choosing a backend, and the one wrapper of an optional op that
 * answers for backends without it (backend_moe_tune). The other vtable calls
 * go straight through b->ops.
 */
#include "daemon/backend.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int backend_open(const char *which, int device, int cpu_threads, struct backend **out)
{
    *out = NULL;
    if (!which || strcmp(which, "auto") == 0) {
        if (backend_cuda_new(device, out) == 0)
            return 0;
        return backend_cpu_new(cpu_threads, out);
    }
    if (strcmp(which, "cpu") == 0)
        return backend_cpu_new(cpu_threads, out);
    if (strcmp(which, "cuda") == 0)
        return backend_cuda_new(device, out);
    return -EINVAL;
}

void backend_free(struct backend **bp)
{
    struct backend *b = *bp;
    *bp = NULL;
    if (b)
        b->ops->destroy(b);
}

const char *backend_last_error(struct backend *b)
{
    const char *e = b->ops->last_error ? b->ops->last_error(b) : NULL;
    return e ? e : "";
}

const char *backend_error_note(struct backend *b, char *buf, size_t len)
{
    const char *e = backend_last_error(b);
    if (*e)
        snprintf(buf, len, " (%s)", e);
    else if (len)
        buf[0] = '\0';
    return buf;
}

int backend_moe_tune(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                     const int *tokens, int n, struct backend_tune *out, char *err,
                     size_t errlen)
{
    if (!b->ops->moe_tune) {
        snprintf(err, errlen, "the %s backend has no token tiles to tune", b->name);
        return -ENOTSUP;
    }
    if (n < 1 || n > BACKEND_TUNE_MAX) {
        snprintf(err, errlen, "%d token counts (1 to %d)", n, BACKEND_TUNE_MAX);
        return -EINVAL;
    }
    memset(out, 0, sizeof(*out));
    return b->ops->moe_tune(b, shape, dt, tokens, n, out, err, errlen);
}

/* ---- a device that failed at start ----------------------------------------- */

struct dead_backend {
    struct backend base;
    char name[160];
};

static int dead_moe_new(struct backend *b, const moek_moe_shape *shape, moek_dtype dt,
                        moek_scoring scoring, bool renormalize, const void *w1, const void *w3,
                        const void *w2, void **handle)
{
    return -ENODEV;
}

static int dead_gemm_new(struct backend *b, moek_dtype dt, int groups, int n, int k,
                         const void *w, void **handle)
{
    return -ENODEV;
}

static void dead_weights_free(struct backend *b, void *handle)
{
}

static int dead_moe_run(struct backend *b, void *handle, const struct backend_moe_io *io)
{
    return -ENODEV;
}

static int dead_gemm_run(struct backend *b, void *handle, const void *a, const int64_t *m_sizes,
                         int64_t m, void *c)
{
    return -ENODEV;
}

static void *dead_host_alloc(struct backend *b, size_t size)
{
    return NULL;
}

static void dead_host_free(struct backend *b, void *p, size_t size)
{
}

static int dead_devices(struct backend *b, struct backend_device *out, int max)
{
    if (max < 1)
        return 0;
    memset(out, 0, sizeof(*out));
    snprintf(out->name, sizeof(out->name), "%s", b->name);
    return 1;
}

static void dead_destroy(struct backend *b)
{
    free(b);
}

static const struct backend_ops dead_ops = {
    .moe_new = dead_moe_new,
    .gemm_new = dead_gemm_new,
    .weights_free = dead_weights_free,
    .moe_run = dead_moe_run,
    .gemm_run = dead_gemm_run,
    .host_alloc = dead_host_alloc,
    .host_free = dead_host_free,
    .devices = dead_devices,
    .destroy = dead_destroy,
};

int backend_unavailable_new(const char *why, struct backend **out)
{
    struct dead_backend *d = calloc(1, sizeof(*d));
    *out = NULL;
    if (!d)
        return -ENOMEM;
    snprintf(d->name, sizeof(d->name), "unavailable: %s", why);
    d->base.ops = &dead_ops;
    d->base.name = d->name;
    *out = &d->base;
    return 0;
}
