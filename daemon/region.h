/*
 * region.h: a client's shared-memory region as the daemon holds it: a sealed
 * memfd, checked and mapped once, referenced by the requests that use it.
 *
 * A region belongs to one session. Requests in flight hold references, so a
 * region that its client unregisters (or whose client dies) stays mapped until
 * the last batch that reads or writes it completes. All reference counting
 * happens on the loop thread; worker threads only touch the bytes.
 */
#ifndef MOED_REGION_H
#define MOED_REGION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct region;

/* Called once before a region's memory is unmapped, e.g. to unpin it. It
 * may take the mapping and descriptor over (setting r->base to NULL and
 * r->fd to -1) to unmap and close them later. */
typedef void (*region_release_fn)(void *ctx, struct region *r);

struct region {
    uint64_t id;          /* random, never 0, unique in the daemon */
    uint64_t session_id;
    int fd;
    void *base;
    uint64_t size;
    char name[64];
    int refs;
    void *pin_cookie;     /* backend's handle for a pinned mapping, or NULL */
    bool retired;         /* unregistered while requests still held it */
    region_release_fn release;
    void *release_ctx;
    struct region *next;  /* in the owning session's list */
};

/*
 * Check that fd is a memfd sealed against shrink and grow whose size equals
 * declared_size (1 byte .. max_size), and map it read-write. On success
 * takes ownership of fd and returns a region with one reference; on error
 * the caller keeps fd. Errors: -EINVAL (not a sealable file, seals missing,
 * size mismatch or zero), -EDQUOT (over max_size), -errno of mmap.
 */
int region_new(int fd, uint64_t declared_size, uint64_t max_size,
               struct region **out);

struct region *region_ref(struct region *r);
/* Drop a reference; the last one unmaps, closes and frees. Sets *r = NULL. */
void region_unref(struct region **r);

/*
 * Resolve bytes [offset, offset + bytes) of r to a pointer, with
 * overflow-safe bounds checks. 0 or -EINVAL.
 */
int region_span(const struct region *r, uint64_t offset, uint64_t bytes,
                void **ptr);

#endif
