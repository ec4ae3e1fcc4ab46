/*
 * mbarrier.cuh: the shared-memory barriers and bulk copies of sm_90 that a
 * pipeline of stages runs on (gemm_wgmma.cu's producer and consumers, and
 * the benchmark's stream of the same copies, kernels/bench/ceilings.cu): a
 * stage's "full" barrier expects its bytes (moek_mbar_expect_tx), a bulk
 * copy completes on it (moek_bulk_load), the reader waits for its phase
 * (moek_mbar_wait) and gives the stage back on an "empty" barrier
 * (moek_mbar_arrive). Also the counts in global memory by which one
 * kernel waits for another's stores (moek_dep), and the debug builds'
 * watchdog over every such wait.
 */
#ifndef MOEK_MBARRIER_CUH
#define MOEK_MBARRIER_CUH

#include <stdint.h>

__device__ __forceinline__ uint32_t moek_smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void moek_mbar_init(uint64_t *bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(
                     moek_smem_u32(bar)),
                 "r"(count));
}

/* Makes the barriers this thread initialised visible to the CTA's other
 * threads, its cluster's and the async proxy (the copies), ahead of a
 * CTA or cluster barrier. */
__device__ __forceinline__ void moek_mbar_init_fence()
{
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* MOEK_WATCHDOG (debug builds): a wait longer than 4 s traps, so a broken
 * pipeline fails the launch instead of hanging the GPU. A waiting loop
 * calls tick() on each failed try; the clock is read every 1024th. Empty
 * in other builds. */
struct moek_watchdog {
#ifdef MOEK_WATCHDOG
    uint64_t t0;
    uint32_t spins = 0;
    __device__ __forceinline__ moek_watchdog()
    {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    }
    __device__ __forceinline__ void tick()
    {
        if ((++spins & 1023) != 0)
            return;
        uint64_t t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 4000000000ull)
            __trap();
    }
#else
    __device__ __forceinline__ void tick() {}
#endif
};

__device__ __forceinline__ void moek_mbar_wait(uint64_t *bar, uint32_t parity)
{
    uint32_t done = 0;
    const uint32_t addr = moek_smem_u32(bar);
    moek_watchdog wd;
    while (!done) {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(addr), "r"(parity)
                     : "memory");
        if (!done)
            wd.tick();
    }
}

__device__ __forceinline__ void moek_mbar_arrive(uint64_t *bar)
{
    asm volatile("{\n\t.reg .b64 st;\n\t"
                 "mbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(
                     moek_smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void moek_mbar_expect_tx(uint64_t *bar,
                                                    uint32_t bytes)
{
    asm volatile("{\n\t.reg .b64 st;\n\t"
                 "mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], "
                 "%1;\n\t}" ::"r"(moek_smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

/* bytes of contiguous global memory (in the GEMM, one block of tiled
 * weights: moek_wt_index) into shared memory, completing on the stage's
 * mbarrier like a TMA load; evict_first: they leave L2 first. */
__device__ __forceinline__ void moek_bulk_load(void *dst, const void *src,
                                               uint32_t bytes, uint64_t *bar,
                                               bool evict_first)
{
    if (evict_first) {
        /* Weights stream through once per call: let them leave L2 first,
         * before the token rows and the accumulator. */
        uint64_t pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;"
                     : "=l"(pol));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::"
                     "complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
                     "%4;" ::"r"(moek_smem_u32(dst)),
                     "l"(src), "r"(bytes), "r"(moek_smem_u32(bar)), "l"(pol)
                     : "memory");
        return;
    }
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::"
                 "bytes [%0], [%1], %2, [%3];" ::"r"(moek_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(moek_smem_u32(bar))
                 : "memory");
}

/*
 * moek_dep (GEMM 2 starting per group; layer.cu says where): a count in
 * global memory that one kernel adds to after its stores and a later one
 * waits on before its reads. moek_dep_add: the caller's group of threads
 * has finished its stores and met at a barrier; one thread of it adds.
 * moek_dep_wait: until *p >= v, by an acquire load (L1 never holds the
 * count), under the watchdog.
 */
__device__ __forceinline__ void moek_dep_add(int *p, int v)
{
    /* the release pattern: a fence, then the add; the barrier before put
     * the group's stores ahead of this thread's fence */
    asm volatile("fence.acq_rel.gpu;\n\t"
                 "red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(p),
                 "r"(v)
                 : "memory");
}
__device__ __forceinline__ void moek_dep_wait(const int *p, int v)
{
    moek_watchdog wd;
    for (;;) {
        int n;
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];"
                     : "=r"(n)
                     : "l"(p)
                     : "memory");
        if (n >= v)
            return;
        __nanosleep(100);
        wd.tick();
    }
}

#endif
