/*
 * wire.c: where protobuf types meet the daemon's own. A wire Tensor becomes a
 * tensor_ref only after its dtype, rank, element count, byte size and range
 * inside the session's own region are checked with overflow-safe arithmetic.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "daemon/region.h"
#include "daemon/server.h"
#include "daemon/util.h"
#include "moe.pb-c.h"

size_t wire_dtype_size(int dtype)
{
    switch (dtype) {
    case MOE__DTYPE__DTYPE_BF16: return 2;
    case MOE__DTYPE__DTYPE_FP16: return 2;
    case MOE__DTYPE__DTYPE_FP32: return 4;
    case MOE__DTYPE__DTYPE_INT32: return 4;
    case MOE__DTYPE__DTYPE_INT64: return 8;
    default: return 0;
    }
}

const char *wire_dtype_name(int dtype)
{
    switch (dtype) {
    case MOE__DTYPE__DTYPE_BF16: return "bf16";
    case MOE__DTYPE__DTYPE_FP16: return "fp16";
    case MOE__DTYPE__DTYPE_FP32: return "fp32";
    case MOE__DTYPE__DTYPE_INT32: return "int32";
    case MOE__DTYPE__DTYPE_INT64: return "int64";
    default: return "unspecified";
    }
}

int wire_dtype_to_moek(int dtype, moek_dtype *out)
{
    switch (dtype) {
    case MOE__DTYPE__DTYPE_BF16: *out = MOEK_DTYPE_BF16; return 0;
    case MOE__DTYPE__DTYPE_FP16: *out = MOEK_DTYPE_FP16; return 0;
    case MOE__DTYPE__DTYPE_FP32: *out = MOEK_DTYPE_FP32; return 0;
    default: return -EINVAL;
    }
}

void tensor_ref_done(struct tensor_ref *ref)
{
    region_unref(&ref->region);
    memset(ref, 0, sizeof(*ref));
}

int wire_tensor(struct session *se, const void *wt, const char *what,
                struct tensor_ref *ref, char *err, size_t errlen)
{
    const Moe__Tensor *t = wt;
    memset(ref, 0, sizeof(*ref));
    if (!t) {
        snprintf(err, errlen, "%s: tensor missing", what);
        return -EINVAL;
    }
    size_t esize = wire_dtype_size(t->dtype);
    if (!esize) {
        snprintf(err, errlen, "%s: unknown dtype %d", what, (int)t->dtype);
        return -EINVAL;
    }
    if (t->n_shape < 1 || t->n_shape > MAX_TENSOR_DIMS) {
        snprintf(err, errlen, "%s: rank %zu (1 to %d allowed)", what, t->n_shape, MAX_TENSOR_DIMS);
        return -EINVAL;
    }
    uint64_t bytes = esize;
    for (size_t i = 0; i < t->n_shape; i++)
        if (!mul_u64(bytes, t->shape[i], &bytes)) {
            snprintf(err, errlen, "%s: shape overflows", what);
            return -EINVAL;
        }
    if (t->offset % esize) {
        snprintf(err, errlen, "%s: offset %llu is not aligned to its %zu-byte elements", what,
                 (unsigned long long)t->offset, esize);
        return -EINVAL;
    }
    struct region *r = session_region(se, t->region);
    if (!r) {
        snprintf(err, errlen, "%s: region %llu is not registered in this session", what,
                 (unsigned long long)t->region);
        return -ENOENT;
    }
    void *ptr;
    if (region_span(r, t->offset, bytes, &ptr) < 0) {
        snprintf(err, errlen, "%s: bytes [%llu, +%llu) lie outside region %llu of %llu bytes",
                 what, (unsigned long long)t->offset, (unsigned long long)bytes,
                 (unsigned long long)t->region, (unsigned long long)r->size);
        return -EINVAL;
    }
    ref->region = region_ref(r);
    ref->ptr = ptr;
    ref->dtype = t->dtype;
    ref->ndim = (int)t->n_shape;
    for (size_t i = 0; i < t->n_shape; i++)
        ref->shape[i] = t->shape[i];
    ref->bytes = bytes;
    return 0;
}

void wire_layer_info(const struct layer *l, void *out)
{
    Moe__LayerInfo *info = out;
    moe__layer_info__init(info);
    info->name = (char *)l->name;
    info->kind = l->kind;
    info->dtype = l->wire_dtype;
    info->experts = (uint32_t)l->shape.experts;
    info->topk = (uint32_t)l->shape.topk;
    info->hidden = (uint32_t)l->shape.hidden;
    info->intermediate = (uint32_t)l->shape.intermediate;
    info->routing = l->routing;
    info->renormalize = l->renormalize;
    info->groups = l->groups;
    info->n = l->n;
    info->k = l->k;
    info->source = (char *)l->source;
    info->weight_bytes = l->weight_bytes;
    info->requests = l->requests;
    info->tokens = l->tokens;
    info->n_devices = info->n_device_bytes = (size_t)l->n_place;
    info->devices = (uint32_t *)l->place_devices;
    info->device_bytes = (uint64_t *)l->place_bytes;
    info->n_expert_device = l->place_expert ? (size_t)l->shape.experts : 0;
    info->expert_device = l->place_expert;
}

