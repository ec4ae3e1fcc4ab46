/*
 * trace.cuh: a timeline of one forward for measuring, in builds with
 * -DMOEK_TRACE only (kernels/bench: EXTRA_NVCCFLAGS=-DMOEK_TRACE); other
 * builds compile every call below to nothing.
 *
 * A kernel thread records an event (moek_trace: the global timer, its SM,
 * its CTA, a kind and two values) into a buffer the host hands each
 * translation unit (moek_trace_set_<unit>, which MOEK_TRACE_UNIT defines;
 * NULL stops it). Each event has its own place, from its kernel (kind /
 * 10), CTA and a sequence number the caller gives, so recording one is a
 * store, with no atomic to wait for in the middle of a pipeline; the host
 * zeroes the buffer first and keeps the entries with a time. A CTA past
 * MOEK_TRACE_CTAS, or an event past MOEK_TRACE_SEQ (a GEMM CTA's items past
 * its 100th), records nothing. The event, its kinds and the buffer's
 * layout are in trace.h; bench_moe with MOEK_TRACE_OUT writes the events
 * of one forward, kernels/bench/timeline.py reads them.
 */
#pragma once

#include "trace.h"

#ifdef MOEK_TRACE
namespace {
__constant__ moek_trace_ev *moek_trace_buf;
}

__device__ __forceinline__ void moek_trace(int kind, int seq, int a = 0,
                                           int b = 0)
{
    moek_trace_ev *buf = moek_trace_buf;
    if (!buf || blockIdx.x >= MOEK_TRACE_CTAS || seq >= MOEK_TRACE_SEQ)
        return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    buf[((size_t)(kind / 10) * MOEK_TRACE_CTAS + blockIdx.x) *
            MOEK_TRACE_SEQ +
        seq] = {t, kind, (int)sm, (int)blockIdx.x, a, b, 0};
}
/* GEMM `which` (moek_gemm_args.which: 0, 1), event `what` (MOEK_TR_ENTRY
 * ...) */
__device__ __forceinline__ void moek_trace_gemm(int which, int what, int seq,
                                                int a = 0, int b = 0)
{
    moek_trace(MOEK_TR_GEMM + 10 * which + what, seq, a, b);
}
/* the same for item `item`'s event `what` (MOEK_TR_ITEM .. MOEK_TR_ISSUE,
 * MOEK_TR_ITEM_END1) */
__device__ __forceinline__ void moek_trace_item(int which, int what, int item,
                                                int a = 0, int b = 0)
{
    moek_trace_gemm(which, what, MOEK_TRACE_SEQ_ITEM(item, what), a, b);
}
/* thread 0 of the CTA: kind (sequence number seq) as it is made, kind + 1
 * (seq + 1) as it goes */
struct moek_trace_scope {
    int kind, seq;
    __device__ moek_trace_scope(int k, int s) : kind(k), seq(s)
    {
        if (threadIdx.x == 0)
            moek_trace(kind, seq);
    }
    __device__ ~moek_trace_scope()
    {
        if (threadIdx.x == 0)
            moek_trace(kind + 1, seq + 1);
    }
};
#define MOEK_TRACE_SCOPE(kind, seq)                                           \
    moek_trace_scope moek_trace_scope_(kind, seq)
#define MOEK_TRACE_UNIT(name)                                                 \
    extern "C" int moek_trace_set_##name(void *buf)                           \
    {                                                                         \
        return cudaMemcpyToSymbol(moek_trace_buf, &buf, sizeof buf) ==       \
                       cudaSuccess                                            \
                   ? 0                                                        \
                   : -1;                                                      \
    }
/* The global timer, ns, for an event's value (0 in other builds). */
__device__ __forceinline__ unsigned long long moek_trace_clock()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#else
#define moek_trace(...) ((void)0)
#define moek_trace_clock() 0ULL
#define moek_trace_gemm(...) ((void)0)
#define moek_trace_item(...) ((void)0)
#define MOEK_TRACE_SCOPE(kind, seq) ((void)0)
#define MOEK_TRACE_UNIT(name)
#endif
