/*
 * runtime.cu: the thin part of the C ABI over the CUDA runtime: devices, the
 * per-thread error string, memory, streams and graphs, so the daemon and the
 * tests stay plain C and never include a CUDA header.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <thread>
#include <vector>

#include "cuda_common.cuh"

#define NO_ERROR "no error"
static thread_local char g_err[256] = NO_ERROR;

int moek_cuda_fail(cudaError_t e, const char *what)
{
    snprintf(g_err, sizeof g_err, "%s: %s (%s)", what, cudaGetErrorString(e),
             cudaGetErrorName(e));
    (void)cudaGetLastError(); /* clear it unless it is sticky */
    switch (e) {
    case cudaErrorMemoryAllocation:
        return -ENOMEM;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
        return -ENODEV;
    default:
        return -EIO;
    }
}

int moek_cuda_refuse(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return err;
}

const char *moek_cuda_last_error(void) { return g_err; }

/* Called at the start of every backend call: a copy, not a format. */
void moek_cuda_clear_error(void) { memcpy(g_err, NO_ERROR, sizeof NO_ERROR); }

bool moek_cuda_context_ok(void)
{
    (void)cudaGetLastError();
    return cudaPeekAtLastError() == cudaSuccess;
}

int moek_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

static int check_device(int device)
{
    int n = moek_cuda_device_count();
    if (n <= 0 || device < 0 || device >= n) {
        return moek_cuda_refuse(-ENODEV, "no CUDA device %d (%d present)",
                                device, n);
    }
    return 0;
}

int moek_cuda_device_name(int device, char *buf, size_t size)
{
    if (!buf || !size)
        return -EINVAL;
    int r = check_device(device);
    if (r)
        return r;
    cudaDeviceProp p;
    MOEK_CU(cudaGetDeviceProperties(&p, device));
    snprintf(buf, size, "%s", p.name);
    return 0;
}

int moek_cuda_device_info(int device, int *cc, int *sms, size_t *mem_bytes)
{
    int r = check_device(device);
    if (r)
        return r;
    int maj = 0, min = 0, n = 0;
    MOEK_CU(cudaDeviceGetAttribute(&maj, cudaDevAttrComputeCapabilityMajor,
                                   device));
    MOEK_CU(cudaDeviceGetAttribute(&min, cudaDevAttrComputeCapabilityMinor,
                                   device));
    MOEK_CU(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    if (cc)
        *cc = maj * 10 + min;
    if (sms)
        *sms = n;
    if (mem_bytes) {
        cudaDeviceProp p;
        MOEK_CU(cudaGetDeviceProperties(&p, device));
        *mem_bytes = p.totalGlobalMem;
    }
    return 0;
}

int moek_cuda_set_device(int device)
{
    int r = check_device(device);
    if (r)
        return r;
    MOEK_CU(cudaSetDevice(device));
    return 0;
}

int moek_cuda_malloc(size_t bytes, void **out)
{
    if (!out)
        return -EINVAL;
    *out = nullptr;
    MOEK_CU(cudaMalloc(out, bytes ? bytes : 1));
    return 0;
}

void moek_cuda_free(void *p)
{
    if (p)
        cudaFree(p);
}

int moek_cuda_copy_to_device(void *dst, const void *src, size_t bytes)
{
    if ((!dst || !src) && bytes)
        return -EINVAL;
    MOEK_CU(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    return 0;
}

int moek_cuda_copy_to_host(void *dst, const void *src, size_t bytes)
{
    if ((!dst || !src) && bytes)
        return -EINVAL;
    MOEK_CU(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    return 0;
}

int moek_cuda_memset(void *dst, int byte, size_t bytes)
{
    if (!dst && bytes)
        return -EINVAL;
    MOEK_CU(cudaMemset(dst, byte, bytes));
    MOEK_CU(cudaDeviceSynchronize());
    return 0;
}

int moek_cuda_copy_async(void *dst, const void *src, size_t bytes, int kind,
                         void *stream)
{
    static const cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice,
                                           cudaMemcpyDeviceToHost,
                                           cudaMemcpyDeviceToDevice};
    if (kind < 0 || kind > 2 || ((!dst || !src) && bytes))
        return -EINVAL;
    MOEK_CU(cudaMemcpyAsync(dst, src, bytes, kinds[kind],
                            (cudaStream_t)stream));
    return 0;
}

int moek_cuda_copy_batch_async(void *const *dsts, const void *const *srcs,
                               const size_t *sizes, size_t n, void *stream)
{
    if (n == 0)
        return 0;
    if (!dsts || !srcs || !sizes || !stream)
        return -EINVAL;
#if CUDART_VERSION >= 13000
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
    cudaError_t e = cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &idx, 1,
                                         (cudaStream_t)stream);
#else /* the batch call's signature changed in CUDA 13: copy one by one */
    cudaError_t e = cudaErrorNotSupported;
#endif
    if (e == cudaErrorNotSupported) {
        /* An older driver: one copy at a time. */
        (void)cudaGetLastError();
        for (size_t i = 0; i < n; i++)
            MOEK_CU(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault,
                                    (cudaStream_t)stream));
        return 0;
    }
    MOEK_CU(e);
    return 0;
}

int moek_cuda_host_register(void *p, size_t bytes)
{
    if (!p || !bytes)
        return -EINVAL;
    /* Mapped too: kernels may then reach it through the host pointer
     * (moek_cuda_copy_rows_mapped). */
    MOEK_CU(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    return 0;
}

int moek_cuda_host_unregister(void *p)
{
    if (!p)
        return -EINVAL;
    MOEK_CU(cudaHostUnregister(p));
    return 0;
}

int moek_cuda_stream_new(void **out)
{
    if (!out)
        return -EINVAL;
    cudaStream_t s = nullptr;
    MOEK_CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    *out = s;
    return 0;
}

void moek_cuda_stream_free(void *stream)
{
    if (stream)
        cudaStreamDestroy((cudaStream_t)stream);
}

int moek_cuda_stream_sync(void *stream)
{
    MOEK_CU(cudaStreamSynchronize((cudaStream_t)stream));
    return 0;
}

int moek_cuda_graph_begin(void *stream)
{
    if (!stream)
        return -EINVAL; /* the legacy stream cannot be captured */
    MOEK_CU(cudaStreamBeginCapture((cudaStream_t)stream,
                                   cudaStreamCaptureModeThreadLocal));
    return 0;
}

int moek_cuda_graph_end(void *stream, void **out)
{
    if (!stream || !out)
        return -EINVAL;
    *out = nullptr;
    cudaGraph_t g = nullptr;
    MOEK_CU(cudaStreamEndCapture((cudaStream_t)stream, &g));
    cudaGraphExec_t x = nullptr;
    cudaError_t e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return moek_cuda_fail(e, "cudaGraphInstantiate");
    *out = x;
    return 0;
}

int moek_cuda_graph_launch(void *graph, void *stream)
{
    if (!graph)
        return -EINVAL;
    MOEK_CU(cudaGraphLaunch((cudaGraphExec_t)graph, (cudaStream_t)stream));
    return 0;
}

void moek_cuda_graph_free(void *graph)
{
    if (graph)
        cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

/* ---- counter-based fill -------------------------------------------------- */

__host__ __device__ static inline float uniform_value(uint64_t seed,
                                                      uint64_t i, float scale)
{
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    /* Exact: a multiple of 2^-23 in [-1, 1); then one rounding. */
    const float u = (float)(uint32_t)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
#if defined(__CUDA_ARCH__)
    return __fmul_rn(u, scale);
#else
    return u * scale;
#endif
}

float moek_cuda_uniform_value(uint64_t seed, uint64_t i, float scale)
{
    return uniform_value(seed, i, scale);
}

namespace {
/* Elements [first, first + n) into dst, through a float buffer. */
void uniform_host_part(void *dst, moek_dtype dt, uint64_t seed, size_t first,
                       size_t n, float scale)
{
    static const size_t chunk = 1 << 14;
    float f[chunk];
    for (size_t done = 0; done < n; done += chunk) {
        const size_t m = n - done < chunk ? n - done : chunk;
        for (size_t i = 0; i < m; i++)
            f[i] = uniform_value(seed, first + done + i, scale);
        moek_from_f32(dt, f, (char *)dst + done * moek_dtype_size(dt), m);
    }
}
} // namespace

int moek_cuda_uniform_host(void *dst, moek_dtype dt, uint64_t seed,
                           size_t first, size_t n, float scale)
{
    if (!dst && n)
        return -EINVAL;
    const size_t es = moek_dtype_size(dt);
    if (!es)
        return -EINVAL;
    unsigned nt = std::thread::hardware_concurrency();
    nt = nt < 1 ? 1 : nt > 16 ? 16 : nt;
    const size_t per = (n + nt - 1) / nt;
    std::vector<std::thread> th;
    for (unsigned i = 1; i < nt && per * i < n; i++) {
        const size_t b = per * i, m = b + per > n ? n - b : per;
        try {
            th.emplace_back(uniform_host_part, (char *)dst + b * es, dt, seed,
                            first + b, m, scale);
        } catch (...) { /* no thread to be had: this part here */
            uniform_host_part((char *)dst + b * es, dt, seed, first + b, m,
                              scale);
        }
    }
    uniform_host_part(dst, dt, seed, first, per < n ? per : n, scale);
    for (std::thread &t : th)
        t.join();
    return 0;
}

template <typename T>
__global__ void fill_kernel(T *dst, size_t n, uint64_t seed, float scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = moek_dt<T>::from_f(uniform_value(seed, i, scale));
}

__global__ void fill_kernel_f32(float *dst, size_t n, uint64_t seed,
                                float scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = uniform_value(seed, i, scale);
}

int moek_cuda_fill_uniform(void *dst, moek_dtype dt, size_t n, uint64_t seed,
                           float scale, void *stream)
{
    if (!dst && n)
        return -EINVAL;
    if (!n)
        return 0;
    cudaStream_t st = (cudaStream_t)stream;
    size_t blocks = (n + 255) / 256;
    unsigned grid = (unsigned)(blocks < 65536 ? blocks : 65536);
    switch (dt) {
    case MOEK_DTYPE_BF16:
        fill_kernel<<<grid, 256, 0, st>>>((__nv_bfloat16 *)dst, n, seed, scale);
        break;
    case MOEK_DTYPE_FP16:
        fill_kernel<<<grid, 256, 0, st>>>((__half *)dst, n, seed, scale);
        break;
    case MOEK_DTYPE_FP32:
        fill_kernel_f32<<<grid, 256, 0, st>>>((float *)dst, n, seed, scale);
        break;
    default:
        return moek_cuda_refuse(-EINVAL, "fill: dtype %d", (int)dt);
    }
    MOEK_CU(cudaGetLastError());
    return 0;
}
