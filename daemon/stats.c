/*
 * stats.c: see stats.h.
 */
#include "daemon/stats.h"

#include <stdlib.h>
#include <string.h>

uint64_t hist_bucket_le(int i)
{
    return i >= 63 ? UINT64_MAX : (uint64_t)1 << i;
}

void hist_add(struct hist *h, uint64_t v)
{
    int i = 0;
    while (i < HIST_BUCKETS - 1 && v > hist_bucket_le(i))
        i++;
    h->buckets[i]++;
    h->count++;
    h->sum += v;
    if (v > h->max)
        h->max = v;
}

uint64_t hist_quantile(const struct hist *h, double q)
{
    if (!h->count)
        return 0;
    uint64_t want = (uint64_t)(q * (double)h->count);
    if (want >= h->count)
        want = h->count - 1;
    uint64_t seen = 0;
    for (int i = 0; i < HIST_BUCKETS; i++) {
        seen += h->buckets[i];
        if (seen > want)
            return hist_bucket_le(i) < h->max ? hist_bucket_le(i) : h->max;
    }
    return h->max;
}

void ring_add(struct ring *r, uint64_t v)
{
    r->v[r->next] = v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
    r->next = (r->next + 1) % RING_SAMPLES;
    if (r->n < RING_SAMPLES)
        r->n++;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

uint64_t ring_quantile(const struct ring *r, double q)
{
    uint32_t tmp[RING_SAMPLES];
    if (!r->n)
        return 0;
    memcpy(tmp, r->v, r->n * sizeof(tmp[0]));
    qsort(tmp, r->n, sizeof(tmp[0]), cmp_u32);
    uint32_t i = (uint32_t)(q * (double)(r->n - 1) + 0.5);
    return tmp[i < r->n ? i : r->n - 1];
}
