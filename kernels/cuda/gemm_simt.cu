/*
 * gemm_simt.cu: the portable GEMM, for GPUs that are not sm_90 (and, forced
 * through moek_cuda_*_tune, as a second opinion in the tests).
 *
 * It walks the same work items (cuda_common.cuh) and ends in the epilogue
 * gemm_wgmma.cu uses for narrow tiles (moek_epi_pair), so routing, layouts
 * and epilogues are shared and only the inner product differs: plain fp32 FMAs
 * over 32-wide K slices staged in shared memory. One block of 256 threads
 * per item; thread t owns token column t % BN and the row pairs (R, R + 8) of
 * 128 / (2 * 256 / BN) 16-row blocks. Correct everywhere, fast nowhere.
 */
#include "cuda_common.cuh"

namespace {

constexpr int KS = 32;      /* K slice */
constexpr int THREADS = 256;

template <typename T>
__global__ void __launch_bounds__(THREADS)
    gemm_simt_kernel(const moek_gemm_args a)
{
    /* bn is 16 here (see moek_launch_gemm_simt): one tile width. */
    constexpr int BN = 16;
    __shared__ float sW[MOEK_WTILE][KS + 1];
    __shared__ float sB[BN][KS + 1];
    moek_pdl_wait();
    moek_pdl_trigger();
    moek_zero_acc(a, threadIdx.x, THREADS);
    const int ncg = a.plan[MOEK_PLAN_NCG];
    const int split = a.plan[a.which ? MOEK_PLAN_SPLIT1 : MOEK_PLAN_SPLIT0];
    const int items = a.plan[(a.which ? MOEK_PLAN_ENDS1 : MOEK_PLAN_ENDS0) +
                             MOEK_CLASSES - 1];
    const T *w = reinterpret_cast<const T *>(a.w);
    const T *b = reinterpret_cast<const T *>(a.b);
    const int tid = threadIdx.x;
    const int col = tid % BN;      /* token column */
    const int r8 = (tid / BN) % 8; /* row inside the half block */
    const int blk0 = tid / (BN * 8); /* 0 or 1: first 16-row block */

    for (int idx = blockIdx.x; idx < items; idx += gridDim.x) {
        const moek_item it = moek_decode_item(a, ncg, split, idx);
        const long long wrow0 = (long long)it.g * a.rows_pad + it.nt * MOEK_WTILE;
        float acc[4][2] = {};
        for (int kb = it.kb0 * MOEK_KTILE;
             kb < min(it.kb1 * MOEK_KTILE, a.k); kb += KS) {
            for (int i = tid; i < MOEK_WTILE * KS; i += THREADS) {
                const int r = i / KS, kk = i % KS;
                const int R = it.nt * MOEK_WTILE + r;
                float v = 0.f;
                if (R < a.rows_pad && kb + kk < a.k)
                    v = moek_dt<T>::to_f(
                        a.w_tiled ? w[moek_wt_index(it.g, R, kb + kk,
                                                    a.n_tiles, a.kblocks)]
                                  : w[(wrow0 + r) * a.k + kb + kk]);
                sW[r][kk] = v;
            }
            for (int i = tid; i < BN * KS; i += THREADS) {
                const int r = i / KS, kk = i % KS;
                float v = 0.f;
                if (r < it.mlen && kb + kk < a.k) {
                    const int p = it.pos + r;
                    const int row = a.b_rows ? a.b_rows[p] : p;
                    v = moek_dt<T>::to_f(b[(long long)row * a.ldb + kb + kk]);
                }
                sB[r][kk] = v;
            }
            __syncthreads();
#pragma unroll 4
            for (int kk = 0; kk < KS; kk++) {
                const float x = sB[col][kk];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int base = (blk0 + 2 * i) * 16 + r8;
                    acc[i][0] += sW[base][kk] * x;
                    acc[i][1] += sW[base + 8][kk] * x;
                }
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int R_lo = it.nt * MOEK_WTILE + (blk0 + 2 * i) * 16 + r8;
            if (R_lo < a.rows_pad)
                moek_epi_pair<T>(a, it, R_lo, col, acc[i][0], acc[i][1]);
        }
    }
}

} // namespace

cudaError_t moek_launch_gemm_simt(moek_dtype dt, const moek_gemm_args &a,
                                  int grid, cudaStream_t stream, bool pdl)
{
    if (a.bn != 16)
        return cudaErrorInvalidValue;
    if (dt == MOEK_DTYPE_BF16)
        return moek_launch(gemm_simt_kernel<__nv_bfloat16>, dim3(grid),
                           dim3(THREADS), 0, stream, pdl, a);
    return moek_launch(gemm_simt_kernel<__half>, dim3(grid), dim3(THREADS), 0,
                       stream, pdl, a);
}
