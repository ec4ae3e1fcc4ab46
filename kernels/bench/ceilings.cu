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
    std::vector<float> t;
    for (int it = 0; it < 23; it++) {
        CK(cudaEventRecord(a));
        read_kernel<<<sms * 8, 512>>>(buf, n, sink);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (it >= 3)
            t.push_back(ms);
    }
    out->read_gbs = bytes / (median(t) * 1e-3) / 1e9;

    CK(cudaMalloc(&buf2, bytes / 2));
    t.clear();
    for (int it = 0; it < 13; it++) {
        CK(cudaEventRecord(a));
        CK(cudaMemcpyAsync(buf2, buf, bytes / 2, cudaMemcpyDeviceToDevice));
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (it >= 3)
            t.push_back(ms);
    }
    out->copy_gbs = bytes / (median(t) * 1e-3) / 1e9; /* read + write */
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
    t.clear();
    for (int it = 0; it < 13; it++) {
        CK(cudaEventRecord(a));
        gemm();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (it >= 3)
            t.push_back(ms);
    }
    const double flop = 2.0 * N * N * (double)N;
    out->mm_burst_tflops = flop / (median(t) * 1e-3) / 1e12;

    /* Sustained: calls back to back for about 400 ms, as bench_moe.c's
     * time_graphs runs a case. */
    const int iters = std::max(16, (int)(400.0 / median(t)));
    std::vector<cudaEvent_t> ev(2 * iters);
    for (cudaEvent_t &e : ev)
        CK(cudaEventCreate(&e));
    for (int it = 0; it < iters; it++) {
        CK(cudaEventRecord(ev[2 * it]));
        gemm();
        CK(cudaEventRecord(ev[2 * it + 1]));
    }
    CK(cudaDeviceSynchronize());
    t.clear();
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
