/*
 * fuzz_safetensors.c: libFuzzer target for the safetensors reader, the
 * format of weight files from anywhere. By the first byte (mod 3):
 *   0   st_parse_header() on the rest as the JSON header, with a data
 *       section whose size the next two bytes give; a header that parses
 *       must describe tensors that lie inside the data, do not overlap and
 *       are found by name;
 *   1   the rest as a whole file read by layer_read_weights() as a MoE layer
 *       (experts, hidden, intermediate and dtype from the file, or declared
 *       by the second byte), as a client's LoadLayer would;
 *   2   the same as a GEMM layer of the tensor "B".
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/layer.h"
#include "daemon/safetensors.h"
#include "moe.pb-c.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[64], file[96];
static char *allowed[1];

/* Run at exit, and by replay.c as each case ends (so twice there). */
void fuzz_target_cleanup(void);
void fuzz_target_cleanup(void)
{
    unlink(file);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    if (allowed[0])
        return 0;
    atexit(fuzz_target_cleanup);
    snprintf(dir, sizeof(dir), "/tmp/moed-fuzz-st.%d", (int)getpid());
    mkdir(dir, 0700);
    snprintf(file, sizeof(file), "%s/w.safetensors", dir);
    allowed[0] = realpath(dir, NULL);
    FUZZ_CHECK(allowed[0] != NULL, "%s", dir);
    return 0;
}

static void check_header(const uint8_t *data, size_t size)
{
    if (size < 2)
        return;
    uint64_t data_bytes = (uint64_t)data[0] | (uint64_t)data[1] << 8;
    const char *json = (const char *)data + 2;
    size_t json_len = size - 2;
    uint64_t file_size = 8 + json_len + data_bytes;
    struct st_file f;
    char err[256];
    if (st_parse_header(json, json_len, file_size, &f, err, sizeof(err)) != 0)
        return;
    for (size_t i = 0; i < f.count; i++) {
        const struct st_tensor *t = &f.tensors[i];
        FUZZ_CHECK(t->offset >= 8 + json_len && t->offset + t->nbytes <= file_size,
                   "tensor %s [%llu, +%llu) outside the data", t->name,
                   (unsigned long long)t->offset, (unsigned long long)t->nbytes);
        FUZZ_CHECK(st_find(&f, t->name) == t, "tensor %s not found by name", t->name);
        FUZZ_CHECK(t->ndim >= 0 && t->ndim <= ST_MAX_DIMS, "rank %d", t->ndim);
        uint64_t n = st_dtype_size(t->dtype);
        for (int d = 0; d < t->ndim; d++)
            n *= t->shape[d];
        FUZZ_CHECK(n == t->nbytes, "tensor %s: %llu bytes for its shape, %llu in the file",
                   t->name, (unsigned long long)n, (unsigned long long)t->nbytes);
        for (size_t j = 0; j < i && f.count <= 64; j++) {
            const struct st_tensor *u = &f.tensors[j];
            FUZZ_CHECK(!t->nbytes || !u->nbytes || t->offset + t->nbytes <= u->offset ||
                           u->offset + u->nbytes <= t->offset,
                       "tensors %s and %s overlap", t->name, u->name);
        }
    }
    st_header_done(&f);
}

static void check_file(const uint8_t *data, size_t size, int kind)
{
    if (size < 1)
        return;
    uint8_t opt = data[0];
    int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FUZZ_CHECK(fd >= 0, "%s", file);
    FUZZ_CHECK(write(fd, data + 1, size - 1) == (ssize_t)(size - 1), "write");
    close(fd);
    struct layer_spec spec = {.kind = kind, .path = file};
    static const int dtypes[4] = {0, MOE__DTYPE__DTYPE_BF16, MOE__DTYPE__DTYPE_FP16,
                                  MOE__DTYPE__DTYPE_FP32};
    spec.dtype = dtypes[opt & 3];
    if (kind == MOE__LAYER_KIND__LAYER_GEMM) {
        spec.prefix = "B";
        if (opt & 4)
            spec.groups = 2;
    } else {
        spec.prefix = opt & 8 ? "p." : NULL;
        if (opt & 4) {
            spec.experts = 2;
            spec.hidden = 4;
            spec.intermediate = 8;
        }
    }
    struct host_weights hw;
    char err[512];
    if (layer_read_weights(&spec, allowed, 1, &hw, err, sizeof(err)) != 0)
        return;
    uint64_t es = hw.dtype == MOE__DTYPE__DTYPE_FP32 ? 4 : 2;
    if (kind == MOE__LAYER_KIND__LAYER_GEMM) {
        FUZZ_CHECK(hw.bytes == (uint64_t)hw.groups * hw.n * hw.k * es && hw.w1, "gemm bytes");
        volatile uint8_t last = ((uint8_t *)hw.w1)[hw.bytes - 1];
        (void)last;
    } else {
        uint64_t per = (uint64_t)hw.experts * hw.hidden * hw.intermediate * es;
        FUZZ_CHECK(hw.bytes == 3 * per && hw.w1 && hw.w3 && hw.w2, "moe bytes");
        volatile uint8_t last = ((uint8_t *)hw.w2)[per - 1];
        (void)last;
        /* Weights read may not exceed what the file holds (twice, for
         * tensors converted to another dtype). */
        FUZZ_CHECK(hw.bytes <= 2 * (uint64_t)size, "%llu bytes from a file of %zu",
                   (unsigned long long)hw.bytes, size);
    }
    host_weights_done(&hw);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    LLVMFuzzerInitialize(NULL, NULL);
    if (size < 1)
        return 0;
    switch (data[0] % 3) {
    case 0: check_header(data + 1, size - 1); break;
    case 1: check_file(data + 1, size - 1, MOE__LAYER_KIND__LAYER_MOE); break;
    default: check_file(data + 1, size - 1, MOE__LAYER_KIND__LAYER_GEMM); break;
    }
    return 0;
}
