/*
 * rows.cu: a batch's rows between the clients' pinned regions and one
 * device buffer, moved by a kernel whose threads read or write the host
 * memory over the bus. A batch of decode requests is many segments of one
 * row each; a DMA per segment costs more than its few kilobytes, while one
 * launch moves every segment at once. Large transfers stay with the copy
 * engines (the caller chooses).
 */
#include <errno.h>
#include <stdint.h>

#include <atomic>

#include "cuda_common.cuh"

/* Segments per launch: the list travels in the kernel's parameters. */
#define ROWS_SEGS 64

struct rows_args {
    char *host[ROWS_SEGS];
    int first[ROWS_SEGS + 1]; /* device row of each segment, from the launch's first */
    int n;
};

/* One block per device row. */
__global__ void __launch_bounds__(256) copy_rows(char *dev, rows_args a, size_t row_bytes,
                                                 int to_host)
{
    const int row = blockIdx.x;
    int lo = 0, hi = a.n - 1;
    while (lo < hi) { /* the last segment whose first row is <= row */
        const int mid = (lo + hi + 1) / 2;
        if (a.first[mid] <= row)
            lo = mid;
        else
            hi = mid - 1;
    }
    char *d = dev + (size_t)row * row_bytes;
    char *h = a.host[lo] + (size_t)(row - a.first[lo]) * row_bytes;
    const char *src = to_host ? d : h;
    char *dst = to_host ? h : d;
    if (((uintptr_t)src | (uintptr_t)dst | row_bytes) % 16 == 0) {
        const uint4 *s4 = reinterpret_cast<const uint4 *>(src);
        uint4 *d4 = reinterpret_cast<uint4 *>(dst);
        for (size_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
            d4[i] = s4[i];
    } else {
        for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x)
            dst[i] = src[i];
    }
}

/* Whether a kernel on the current device may use registered (mapped) host
 * memory through the host's own pointers
 * (cudaDevAttrCanUseHostPointerForRegisteredMem), asked once per device. */
static bool host_pointers_ok(void)
{
    static std::atomic<signed char> known[64]; /* 0 unknown, 1 yes, -1 no */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    if (dev >= 0 && dev < 64 && known[dev].load(std::memory_order_relaxed))
        return known[dev].load(std::memory_order_relaxed) > 0;
    int ok = 0;
    if (cudaDeviceGetAttribute(&ok, cudaDevAttrCanUseHostPointerForRegisteredMem, dev) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        ok = 0;
    }
    if (dev >= 0 && dev < 64)
        known[dev].store(ok ? 1 : -1, std::memory_order_relaxed);
    return ok != 0;
}

int moek_cuda_copy_rows_mapped(void *dev, void *const *host, const int *rows, int n,
                               size_t row_bytes, int to_host, void *stream)
{
    if (!dev || (n > 0 && (!host || !rows)) || n < 0 || !row_bytes)
        return moek_cuda_refuse(-EINVAL, "copy_rows_mapped: bad arguments");
    if (!host_pointers_ok())
        return moek_cuda_refuse(-ENOTSUP,
                                "this device cannot use registered host memory through "
                                "host pointers");
    char *d = static_cast<char *>(dev);
    for (int i = 0; i < n;) {
        rows_args a;
        a.n = 0;
        int total = 0;
        for (; i < n && a.n < ROWS_SEGS; i++) {
            if (rows[i] < 0 || !host[i])
                return moek_cuda_refuse(-EINVAL, "copy_rows_mapped: segment %d", i);
            if (!rows[i])
                continue;
            a.host[a.n] = static_cast<char *>(host[i]);
            a.first[a.n++] = total;
            total += rows[i];
        }
        if (!total)
            continue;
        a.first[a.n] = total;
        copy_rows<<<total, 256, 0, (cudaStream_t)stream>>>(d, a, row_bytes, to_host);
        MOEK_CU(cudaGetLastError());
        d += (size_t)total * row_bytes;
    }
    return 0;
}
