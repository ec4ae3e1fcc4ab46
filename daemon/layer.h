/*
 * layer.h: reading a layer's weights into host memory, stacked the way the
 * kernels' ABI wants them (w1/w3 [E, I, H], w2 [E, H, I], or B [G, N, K]),
 * from a safetensors file under an allowed directory.
 *
 * Pure functions of their inputs (no server state), so the loader thread can
 * run them and the tests can call them directly.
 */
#ifndef MOED_LAYER_H
#define MOED_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/moe_kernels.h"

struct layer_spec {
    int kind;            /* Moe__LayerKind */
    int dtype;           /* Moe__DType; 0: take the file's */
    uint32_t experts, topk, hidden, intermediate; /* 0: infer from the file */
    uint32_t groups, n, k;
    const char *path;
    const char *prefix;
};

struct host_weights {
    int dtype;           /* Moe__DType of the buffers */
    uint32_t experts, hidden, intermediate;
    uint32_t groups, n, k;
    void *w1, *w3, *w2;  /* MOE; GEMM uses w1 for B */
    uint64_t bytes;
    char source[512];    /* canonical path and prefix, for LayerInfo */
};

/*
 * Resolve path against the allowed directories and open it: -EACCES when it
 * lies outside them (symbolic links resolved), -ENOENT when it does not exist
 * inside them. On success returns an fd and writes the canonical path.
 */
int layer_open_allowed(const char *path, char *const *allowed, size_t n_allowed,
                       char *canon, size_t canon_len, char *err, size_t errlen);

/*
 * Read a layer's weights from spec->path (already allowed: this function
 * checks again). Fills out (caller frees with host_weights_done). Errors:
 * -EACCES, -ENOENT, -EIO (truncated or malformed file), -EINVAL (missing
 * tensors, shapes that disagree), -ENOMEM; err says which and why.
 */
int layer_read_weights(const struct layer_spec *spec, char *const *allowed,
                       size_t n_allowed, struct host_weights *out, char *err,
                       size_t errlen);
void host_weights_done(struct host_weights *w);

/*
 * Every check layer_read_weights makes (the file, its tensors' names, shapes
 * and dtypes, and a MoE layer's topk against its experts), from the file's
 * header alone: whether that load would succeed short of memory. out gets
 * what the read would (sizes, dtype, bytes and source), with no buffers.
 * Same errors.
 */
int layer_check_weights(const struct layer_spec *spec, char *const *allowed, size_t n_allowed,
                        struct host_weights *out, char *err, size_t errlen);

#endif
