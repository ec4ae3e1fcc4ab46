/*
 * stats.h: the daemon's counters and histograms, read by the Stats request
 * and the systemd STATUS= line. Loop thread only.
 */
#ifndef MOED_STATS_H
#define MOED_STATS_H

#include <stdint.h>

/* Power-of-two buckets: bucket i counts values v with 2^(i-1) < v <= 2^i
 * (bucket 0: v <= 1). */
#define HIST_BUCKETS 32

struct hist {
    uint64_t count;
    uint64_t sum;
    uint64_t max;
    uint64_t buckets[HIST_BUCKETS];
};

void hist_add(struct hist *h, uint64_t v);
/* The q-quantile (0..1), reported as the upper bound of its bucket, clamped to
 * the largest value seen; 0 when empty. */
uint64_t hist_quantile(const struct hist *h, double q);
uint64_t hist_bucket_le(int i);

/* Exact quantiles over a ring of recent samples (latencies). */
#define RING_SAMPLES 4096
struct ring {
    uint32_t n, next;
    uint32_t v[RING_SAMPLES];
};
void ring_add(struct ring *r, uint64_t v);
uint64_t ring_quantile(const struct ring *r, double q);

struct stats {
    uint64_t start_us;
    uint64_t requests, errors, busy, expired, batches, tokens;
    uint64_t compute_us_total;
    struct hist batch_requests, batch_tokens;
    struct ring queue_wait_us, compute_us;
    /* A batch cycle under load: the device idles from one batch's end to
     * the next one's start (idle_us, gaps under 10 ms); of that, the
     * daemon answers the batch's requests (reply_us: the compute thread's
     * replies from the end, then any the loop thread sends), the loop
     * thread takes the batch back after the compute thread's replies
     * (notice_us), waits for the rest of the next requests (return_us:
     * from the last reply to the next submit; requests that came back
     * while replies went out were read meanwhile) and the compute thread
     * starts (launch_us). */
    struct ring idle_us, notice_us, reply_us, return_us, launch_us;
    uint64_t prev_end_us, prev_replied_us;
};

#endif
