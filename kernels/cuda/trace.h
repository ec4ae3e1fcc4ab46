/*
 * trace.h: the layout of trace.cuh's event buffer, shared by the kernels
 * (trace.cuh) and the host that reads it (kernels/bench/bench_moe.c).
 * Plain C.
 */
#ifndef MOEK_TRACE_H
#define MOEK_TRACE_H

typedef struct moek_trace_ev {
    unsigned long long t; /* %globaltimer, ns; 0: no event */
    int kind, sm, cta, a, b, pad;
} moek_trace_ev;

/* Kinds (kernels/bench/timeline.py reads the same numbers). */
enum {
    MOEK_TR_ROUTE = 1,    /* +0 a routing kernel's CTA starts (after its
                             wait for the kernel before), +1 ends;
                             sequence numbers 0, 1 */
    MOEK_TR_ALIGN = 3,    /* +0 a CTA of the align kernel after it, +1;
                             the same kernel slot (kind / 10), so
                             sequence numbers 2, 3 */
    MOEK_TR_GEMM = 10,    /* + 10 which (GEMM 1, 2) + ... */
    MOEK_TR_ENTRY = 0,    /* a CTA enters (before any wait) */
    MOEK_TR_FIRST = 1,    /* the producer issues its first weight load */
    MOEK_TR_EXIT = 2,     /* consumer 0 leaves */
    /* an item's events, consecutive (MOEK_TRACE_SEQ_ITEM): */
    MOEK_TR_ITEM = 3,     /* consumer 0 has an item's first stage (a: group,
                             b: its K blocks) */
    MOEK_TR_ITEM_END = 4, /* consumer 0's MMAs of it are done */
    MOEK_TR_EPI_END = 5,  /* consumer 0 is done with its epilogue */
    MOEK_TR_ISSUE = 6,    /* the producer issues its first weight load (a:
                             ns since its load before, b: ns it waited for
                             the stage to be free; both 0 for the stages
                             issued before the wait for the kernel
                             before) */
    /* the prologue, thread 0 (sequence numbers 3, 4): */
    MOEK_TR_WAITED = 7,   /* past the wait for the kernel before (early_a:
                             the producer's, after its first loads) */
    MOEK_TR_LISTED = 8,   /* has the tile list (plan, cg_before) */
    MOEK_TR_ITEM_END1 = 9, /* consumer 1's MMAs of an item are done (a:
                              group; the fifth of an item's events) */
    MOEK_TR_RELIST = 30,  /* +0 GEMM 2's tile list of its own starts
                             (after its wait), +1 ends */
    MOEK_TR_FINAL = 40,   /* +0 a finalize CTA starts, +1 ends */
    MOEK_TR_PERMUTE = 50, /* +0 a CTA of the copy of x starts, +1 ends */
};

/* The buffer: [kernel (kind / 10)][CTA][sequence number] events. */
#define MOEK_TRACE_KERNELS 6
#define MOEK_TRACE_CTAS 1024
#define MOEK_TRACE_SEQ 512
#define MOEK_TRACE_EVENTS                                                     \
    ((unsigned long)MOEK_TRACE_KERNELS * MOEK_TRACE_CTAS * MOEK_TRACE_SEQ)
/* a GEMM's sequence numbers: entry, first load, exit, then item i's
 * event `what` (MOEK_TR_ITEM .. MOEK_TR_ISSUE, MOEK_TR_ITEM_END1) */
#define MOEK_TRACE_SEQ_ITEM(i, what)                                          \
    (8 + 5 * (i) +                                                            \
     ((what) == MOEK_TR_ITEM_END1 ? 4 : (what) - MOEK_TR_ITEM))

#endif
