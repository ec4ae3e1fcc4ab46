/* ceilings.h: the card's measured ceilings (ceilings.cu). */
#ifndef MOE_BENCH_CEILINGS_H
#define MOE_BENCH_CEILINGS_H

typedef struct bench_ceil {
    double read_gbs;  /* streaming read, GB/s */
    double copy_gbs;  /* device-to-device copy, read + write, GB/s */
    double mm_tflops; /* cuBLAS bf16 8192^3, sustained (as cases run) */
    double mm_burst_tflops; /* the same, calls waited for one by one */
} bench_ceil;

#ifdef __cplusplus
extern "C" {
#endif
void bench_ceilings(bench_ceil *out);
/* A table of single-kernel streaming rates at decode GEMM sizes (stdout). */
void bench_streams(void);
#ifdef __cplusplus
}
#endif

#endif
