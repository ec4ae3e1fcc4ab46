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
 * its 252nd), records nothing. Kinds:
 * MOEK_TR_* below; bench_moe with MOEK_TRACE_OUT writes the events of one
 * forward, kernels/bench/timeline.py reads them.
 */
#pragma once

struct moek_trace_ev {
    unsigned long long t; /* %globaltimer, ns; 0: no event */
    int kind, sm, cta, a, b, pad;
};
enum {
    MOEK_TR_ROUTE = 1,    /* +0 a routing kernel's CTA starts (after its
                             wait for the kernel before), +1 ends */
    MOEK_TR_ALIGN = 3,    /* +0 a CTA of the align kernel after it, +1 */
    MOEK_TR_GEMM = 10,    /* + 10 which (GEMM 1, 2) + ... */
    MOEK_TR_ENTRY = 0,    /* a CTA enters (before any wait) */
    MOEK_TR_FIRST = 1,    /* the producer issues its first weight load */
    MOEK_TR_ITEM = 2,     /* consumer 0 has an item's first stage (a: group,
                             b: its K blocks) */
    MOEK_TR_ITEM_END = 3, /* consumer 0's MMAs of it are done */
    MOEK_TR_EXIT = 4,     /* consumer 0 leaves */
    MOEK_TR_FINAL = 40,   /* +0 a finalize CTA starts, +1 ends */
    MOEK_TR_PERMUTE = 50, /* +0 a CTA of the copy of x starts, +1 ends */
};
/* The buffer: [kernel (kind / 10)][CTA][sequence number] events. */
#define MOEK_TRACE_KERNELS 6
#define MOEK_TRACE_CTAS 1024
#define MOEK_TRACE_SEQ 512
/* a GEMM's sequence numbers: entry, first load, exit, then two per item */
#define MOEK_TRACE_SEQ_ITEM(i) (8 + 2 * (i))

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
#else
#define moek_trace(...) ((void)0)
#define MOEK_TRACE_SCOPE(kind, seq) ((void)0)
#define MOEK_TRACE_UNIT(name)
#endif
