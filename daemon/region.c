/*
 * region.c: see region.h. The seal check is what makes it safe to map client
 * memory: without F_SEAL_SHRINK a client could truncate the file and turn
 * the daemon's next access into SIGBUS.
 */
#include "daemon/region.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "daemon/util.h"

int region_new(int fd, uint64_t declared_size, uint64_t max_size,
               struct region **out)
{
    struct stat st;
    *out = NULL;
    if (declared_size == 0)
        return -EINVAL;
    if (declared_size > max_size)
        return -EDQUOT;
    /* Seals first, size second: once sealed the size cannot change, so the
     * size checked is the size mapped. (The other order lets a client shrink
     * the file between the two checks, seal it, and make the daemon fault.) */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) /* not a sealable file (EBADF also for an O_PATH descriptor) */
        return errno == EBADF && fcntl(fd, F_GETFD) < 0 ? -EBADF : -EINVAL;
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
        return -EINVAL;
    /* Shared memory only: a memfd of huge pages (hugetlbfs) can have holes
     * punched in it despite the seals, and the daemon's write to a hole
     * with no huge page left to fill it is a SIGBUS. */
    struct statfs sf;
    if (fstatfs(fd, &sf) < 0 || sf.f_type != TMPFS_MAGIC)
        return -EINVAL;
    if (fstat(fd, &st) < 0)
        return -errno;
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size != declared_size)
        return -EINVAL;
    if (declared_size > SIZE_MAX)
        return -EDQUOT;
    void *base = mmap(NULL, (size_t)declared_size, PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        return -errno;
    struct region *r = calloc(1, sizeof(*r));
    if (!r) {
        munmap(base, (size_t)declared_size);
        return -ENOMEM;
    }
    r->fd = fd;
    r->base = base;
    r->size = declared_size;
    r->refs = 1;
    *out = r;
    return 0;
}

struct region *region_ref(struct region *r)
{
    if (r)
        r->refs++;
    return r;
}

void region_unref(struct region **rp)
{
    struct region *r = *rp;
    *rp = NULL;
    if (!r || --r->refs > 0)
        return;
    if (r->release)
        r->release(r->release_ctx, r);
    if (r->base) /* else the release hook took the mapping (and fd) */
        munmap(r->base, (size_t)r->size);
    close_fd(&r->fd);
    free(r);
}

int region_span(const struct region *r, uint64_t offset, uint64_t bytes,
                void **ptr)
{
    uint64_t end;
    if (!add_u64(offset, bytes, &end) || end > r->size)
        return -EINVAL;
    *ptr = (uint8_t *)r->base + offset;
    return 0;
}
