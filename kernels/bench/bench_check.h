/*
 * bench_check.h: the benchmarks' checks. A failed moek_cuda_* call (CK) or
 * CUDA runtime call (CR) prints where and why, and ends the program.
 */
#ifndef MOEK_BENCH_CHECK_H
#define MOEK_BENCH_CHECK_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/moe_cuda.h"

#define CK(call)                                                              \
    do {                                                                      \
        int r_ = (call);                                                      \
        if (r_) {                                                             \
            fprintf(stderr, "%s:%d: %s = %d (%s)\n", __FILE__, __LINE__,      \
                    #call, r_, moek_cuda_last_error());                       \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#define CR(call)                                                              \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess) {                                              \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,     \
                    cudaGetErrorString(e_));                                  \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#endif
