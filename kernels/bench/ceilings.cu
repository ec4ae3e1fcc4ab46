/*
 * ceilings.cu: the two ceilings every bench row is measured against, taken
 * on the card in the same run (BENCH.md, "The floor"):
 *
 *   read bandwidth  a streaming kernel of our own: a sum over a 4 GiB
 *                   buffer, 16-byte loads, 4 independent loads in flight per
 *                   thread, 8 blocks of 512 threads per SM; bytes read over
 *                   the median time. Also the device-to-device copy rate
 *                   (read + write counted), the figure BENCH.md's anchors
 *                   used, for comparison;
 *   matmul rate     cuBLAS bf16 8192^3 (fp32 accumulation) on random data,
 *                   timed as the bench times a case: back to back for about
 *                   400 ms, an event pair around each call, the median.
 *                   Under that sustained load the H200 holds its software
 *                   power cap (SM clock about 1575 MHz against 1980 idle),
 *                   so the rate is lower than a burst of calls each waited
 *                   for (the former method, kept as mm_burst_tflops):
 *                   every case is timed under the same cap, so this is the
 *                   ceiling it can reach (kernels/bench/RESULTS.md, run 10).
 *
 * bench_streams (bench_moe --streams) prints what one kernel reaches
 * streaming the byte counts of single decode GEMMs, where the ramp at each
 * end weighs more than in the 4 GiB measure: by plain loads (the kernel
 * above), and by the GEMM kernel's own way, one thread per CTA issuing
 * 16 KB cp.async.bulk copies into 12 mbarrier stages, over items of
 * 192 KB, 512 KB or 1 MB taken grid-strided (a decode GEMM's whole items:
 * qwen3's GEMM 2 and GEMM 1, mixtral's) or over one contiguous
 * share per CTA (stream-K), with L2 flushed before each call; then the
 * same copies' rate from L2, over a 16 MB buffer read 64 times.
 *
 * C linkage; the bench program (bench_moe.c) is plain C.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "ceilings.h"
#include "cuda/mbarrier.cuh"

#define CK(x)                                                                 \
    do {                                                                      \
        cudaError_t e_ = (x);                                                 \
        if (e_ != cudaSuccess) {                                              \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,        \
                    cudaGetErrorString(e_));                                  \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

__global__ void read_kernel(const uint4 *__restrict__ p, size_t n, float *sink)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    uint32_t acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride),
              c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^
               c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        uint4 a = __ldcs(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x12345678u)
        *sink = (float)acc;
}

__global__ void fill_bytes(uint4 *p, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = make_uint4((uint32_t)i * 2654435761u, (uint32_t)i ^ 0x5bd1e995u,
                          (uint32_t)(i >> 7), (uint32_t)i * 40503u);
}

__global__ void fill_bf16(__nv_bfloat16 *p, size_t n, uint32_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = __float2bfloat16((float)(h & 0xffff) / 32768.0f - 1.0f);
    }
}

static double median(std::vector<float> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/* The median time in ms of call() over iters calls after `warm` more, each
 * timed alone with the events a, b; before() runs ahead of each, untimed. */
template <typename B, typename F>
static double median_ms(cudaEvent_t a, cudaEvent_t b, int warm, int iters,
                        B before, F call)
{
    std::vector<float> t;
    for (int it = 0; it < warm + iters; it++) {
        before();
        CK(cudaEventRecord(a));
        call();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (it >= warm)
            t.push_back(ms);
    }
    CK(cudaGetLastError());
    return median(t);
}

extern "C" void bench_ceilings(bench_ceil *out)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t bytes = (size_t)4 << 30, n = bytes / 16;
    uint4 *buf = nullptr, *buf2 = nullptr;
    float *sink = nullptr;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMalloc(&sink, sizeof(float)));
    fill_bytes<<<sms * 8, 512>>>(buf, n);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const auto nothing = [] {};
    out->read_gbs = bytes /
                    (median_ms(a, b, 3, 20, nothing,
                               [&] { read_kernel<<<sms * 8, 512>>>(buf, n, sink); }) *
                     1e-3) /
                    1e9;

    CK(cudaMalloc(&buf2, bytes / 2));
    const double copy_ms = median_ms(a, b, 3, 10, nothing, [&] {
        CK(cudaMemcpyAsync(buf2, buf, bytes / 2, cudaMemcpyDeviceToDevice));
    });
    out->copy_gbs = bytes / (copy_ms * 1e-3) / 1e9; /* read + write */
    CK(cudaFree(buf2));
    CK(cudaFree(buf));
    CK(cudaFree(sink));

    const int N = 8192;
    __nv_bfloat16 *A, *B, *C;
    CK(cudaMalloc(&A, (size_t)N * N * 2));
    CK(cudaMalloc(&B, (size_t)N * N * 2));
    CK(cudaMalloc(&C, (size_t)N * N * 2));
    fill_bf16<<<sms * 8, 512>>>(A, (size_t)N * N, 1);
    fill_bf16<<<sms * 8, 512>>>(B, (size_t)N * N, 2);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasCreate failed\n");
        exit(1);
    }
    const float one = 1.0f, zero = 0.0f;
    auto gemm = [&] {
        cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, N, N,
                                        &one, A, CUDA_R_16BF, N, B, CUDA_R_16BF,
                                        N, &zero, C, CUDA_R_16BF, N,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cublasGemmEx failed (%d)\n", (int)s);
            exit(1);
        }
    };
    const double burst_ms = median_ms(a, b, 3, 10, nothing, gemm);
    const double flop = 2.0 * N * N * (double)N;
    out->mm_burst_tflops = flop / (burst_ms * 1e-3) / 1e12;

    /* Sustained: calls back to back for about 400 ms, as bench_moe.c's
     * time_graphs runs a case. */
    const int iters = std::max(16, (int)(400.0 / burst_ms));
    std::vector<cudaEvent_t> ev(2 * iters);
    for (cudaEvent_t &e : ev)
        CK(cudaEventCreate(&e));
    for (int it = 0; it < iters; it++) {
        CK(cudaEventRecord(ev[2 * it]));
        gemm();
        CK(cudaEventRecord(ev[2 * it + 1]));
    }
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int it = 0; it < iters; it++) {
        float ms;
        CK(cudaEventElapsedTime(&ms, ev[2 * it], ev[2 * it + 1]));
        t.push_back(ms);
    }
    for (cudaEvent_t &e : ev)
        CK(cudaEventDestroy(e));
    out->mm_tflops = flop / (median(t) * 1e-3) / 1e12;
    cublasDestroy(h);
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(C));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
}

/* The GEMM kernel's decode pipeline: 12 stages of one 16 KB weight tile. */
constexpr int STREAM_STAGES = 12, STREAM_CHUNK = 16384;

/* One CTA of 32 threads, one SM: thread 0 streams [the CTA's items of
 * item_bytes] or, item_bytes 0, [its contiguous share] of p (reps times
 * over) in STREAM_CHUNK-byte bulk copies through STREAM_STAGES ring slots,
 * waiting for each slot's bytes before refilling it, with the GEMM
 * kernel's own barriers and copies (cuda/mbarrier.cuh). */
__global__ void bulk_stream_kernel(const char *p, size_t total,
                                   size_t item_bytes, float *sink,
                                   int reps = 1)
{
    constexpr int stages = STREAM_STAGES, chunk = STREAM_CHUNK;
    extern __shared__ __align__(1024) char ring[];
    __shared__ uint64_t full[stages];
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++)
            moek_mbar_init(&full[s], 1);
        moek_mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x != 0)
        return;
    const bool contiguous = item_bytes == 0;
    const size_t items = contiguous ? 0 : total / item_bytes;
    const size_t nch = total / chunk;
    size_t idx = blockIdx.x, off = 0;
    const size_t lo0 = nch * blockIdx.x / gridDim.x * chunk,
                 hi = nch * (blockIdx.x + 1) / gridDim.x * chunk;
    size_t lo = lo0;
    const auto next = [&](size_t *at) {
        if (contiguous) {
            if (lo >= hi && --reps > 0)
                lo = lo0;
            if (lo >= hi)
                return false;
            *at = lo;
            lo += chunk;
            return true;
        }
        if (idx >= items)
            return false;
        *at = idx * item_bytes + off;
        off += chunk;
        if (off >= item_bytes) {
            off = 0;
            idx += gridDim.x;
        }
        return true;
    };
    const auto issue = [&](int s, size_t at) {
        moek_mbar_expect_tx(&full[s], chunk);
        moek_bulk_load(ring + (size_t)s * chunk, p + at, chunk, &full[s],
                       false);
    };
    int issued = 0, done = 0;
    size_t at;
    while (issued < stages && next(&at)) {
        issue(issued, at);
        issued++;
    }
    uint32_t phase = 0, acc = 0;
    for (int s = 0; done < issued;) {
        moek_mbar_wait(&full[s], phase);
        done++;
        acc ^= *reinterpret_cast<volatile uint32_t *>(ring + (size_t)s * chunk);
        if (next(&at)) {
            issue(s, at);
            issued++;
        }
        if (++s == stages) {
            s = 0;
            phase ^= 1;
        }
    }
    if (acc == 0x12345678u)
        *sink = (float)acc;
}

void bench_streams(void)
{
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t MB = (size_t)1 << 20, cap = (size_t)4 << 30;
    const int ring = STREAM_STAGES * STREAM_CHUNK;
    char *buf = nullptr;
    float *sink = nullptr;
    CK(cudaMalloc(&buf, cap));
    CK(cudaMalloc(&sink, sizeof(float)));
    fill_bytes<<<sms * 8, 512>>>((uint4 *)buf, cap / 16);
    CK(cudaFuncSetAttribute(bulk_stream_kernel,
                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                            ring));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    /* The last GiB, read before each timed call, pushes the rest out of L2. */
    const uint4 *scratch = (const uint4 *)(buf + cap - ((size_t)1 << 30));
    const auto flush = [&] {
        read_kernel<<<sms * 8, 512>>>(scratch, ((size_t)1 << 30) / 16, sink);
    };
    const auto time_ms = [&](auto launch) {
        return median_ms(a, b, 2, 10, flush, launch);
    };
    /* Items of 192 KB, 512 KB and 1 MB: qwen3's GEMM 2 and GEMM 1 items,
     * and mixtral's. */
    const size_t items_kb[] = {192, 512, 1024};
    printf("| MB | plain loads GB/s (us) |");
    for (size_t kb : items_kb)
        printf(" bulk, %zu KB items GB/s (us) |", kb);
    printf(" bulk, contiguous shares GB/s (us) |\n|---|---|---|---|---|---|\n");
    const size_t sizes[] = {152, 235, 321, 402, 470, 705, 805, 3072};
    for (size_t mb : sizes) {
        const size_t n = mb * MB;
        printf("| %zu |", mb);
        const auto show = [&](size_t bytes, double ms) {
            printf(" %.0f (%.1f) |", bytes / (ms * 1e-3) / 1e9, ms * 1e3);
        };
        show(n, time_ms([&] {
                 read_kernel<<<sms * 8, 512>>>((const uint4 *)buf, n / 16,
                                               sink);
             }));
        for (size_t kb : items_kb) {
            const size_t item = kb * 1024, bytes = n / item * item;
            show(bytes, time_ms([&] {
                     bulk_stream_kernel<<<sms, 32, ring>>>(buf, bytes, item,
                                                           sink);
                 }));
        }
        show(n, time_ms([&] {
                 bulk_stream_kernel<<<sms, 32, ring>>>(buf, n, 0, sink);
             }));
        printf("\n");
    }
    /* L2's rate for the same copies: each CTA's share of a 16 MB buffer,
     * which L2 holds, read 64 times over (bytes counted per read). */
    const size_t l2_bytes = 16 * MB;
    const int l2_reps = 64;
    const double l2_ms = median_ms(a, b, 2, 10, [] {}, [&] {
        bulk_stream_kernel<<<sms, 32, ring>>>(buf, l2_bytes, 0, sink,
                                              l2_reps);
    });
    printf("\nL2: bulk copies of a 16 MB buffer, each CTA's share read %d "
           "times: %.0f GB/s\n",
           l2_reps, l2_bytes * l2_reps / (l2_ms * 1e-3) / 1e9);
    CK(cudaFree(buf));
    CK(cudaFree(sink));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
}
