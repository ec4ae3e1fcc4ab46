/*
 * test_region.c: daemon/region.c, the check that makes client memory safe to
 * map (a memfd sealed against shrink and grow, of exactly the declared size),
 * the overflow-safe span check, and the reference count.
 *
 * Every refused fd must still be open afterwards: on error the caller keeps
 * the fd, and a region_new() that closed it would make the session close it
 * a second time (possibly someone else's fd by then).
 */
#include "tests/unit/unit.h"
#include "daemon/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>


/* ---- helpers ------------------------------------------------------------ */

/* A memfd of size bytes with the given seals added (0: none). */
static int make_memfd(uint64_t size, unsigned flags, int seals)
{
    int fd = memfd_create("moed-test", MFD_CLOEXEC | flags);
    CHECK(fd >= 0);
    if (size)
        CHECK(ftruncate(fd, (off_t)size) == 0);
    if (seals)
        CHECK(fcntl(fd, F_ADD_SEALS, seals) == 0);
    return fd;
}

static int sealed_memfd(uint64_t size)
{
    return make_memfd(size, MFD_ALLOW_SEALING, F_SEAL_SHRINK | F_SEAL_GROW);
}

static bool fd_open(int fd)
{
    return fcntl(fd, F_GETFD) != -1;
}

/* region_new must refuse fd with want, leave *out NULL and fd open. */
static void expect_refused_at(int line, int fd, uint64_t declared, uint64_t max, int want)
{
    struct region *r = (struct region *)1;
    int rc = region_new(fd, declared, max, &r);
    if (rc != want)
        FAIL_AT("line %d: region_new: %d, want %d", line, rc, want);
    if (r != NULL)
        FAIL_AT("line %d: *out not NULL on error", line);
    if (!fd_open(fd))
        FAIL_AT("line %d: fd %d was closed on error", line, fd);
}
#define expect_refused(fd, d, m, want) expect_refused_at(__LINE__, fd, d, m, want)

/* ---- cases ---------------------------------------------------------------- */

TEST(sealed_memfd_maps_and_spans)
{
    uint64_t s = test_seed();
    uint64_t size = 4096 * (1 + test_rand(&s) % 8) + test_rand(&s) % 4096;
    int fd = sealed_memfd(size);
    struct region *r = NULL;
    CHECK_EQ_INT(region_new(fd, size, size, &r), 0); /* max_size == size is fine */
    CHECK(r != NULL);
    CHECK_EQ_INT(r->fd, fd);
    CHECK_EQ_INT(r->size, size);
    CHECK_EQ_INT(r->refs, 1);
    CHECK(r->base != NULL);

    void *p = NULL;
    CHECK_EQ_INT(region_span(r, 0, size, &p), 0);
    CHECK(p == r->base);
    /* offset + bytes == size: the last bytes, fine; one more is not. */
    uint64_t off = test_rand(&s) % size;
    CHECK_EQ_INT(region_span(r, off, size - off, &p), 0);
    CHECK(p == (uint8_t *)r->base + off);
    p = NULL;
    CHECK_EQ_INT(region_span(r, off, size - off + 1, &p), -EINVAL);
    CHECK(p == NULL);
    CHECK_EQ_INT(region_span(r, 0, size + 1, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, size, 1, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, size + 1, 0, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, size - 1, 1, &p), 0);
    CHECK(p == (uint8_t *)r->base + size - 1);
    /* Sums that wrap around 2^64 must not pass as small. */
    p = NULL;
    CHECK_EQ_INT(region_span(r, UINT64_MAX, 1, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, UINT64_MAX - 2, 8, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, UINT64_MAX - size + 1, size, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, 1, UINT64_MAX, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, 16, UINT64_MAX - 15, &p), -EINVAL);
    CHECK_EQ_INT(region_span(r, 0, UINT64_MAX, &p), -EINVAL);
    CHECK(p == NULL);
    /* Random spans agree with a 128-bit reference. */
    for (int i = 0; i < 10000; i++) {
        uint64_t o = test_rand(&s), b = test_rand(&s);
        switch (i % 4) {
        case 0: o %= size + 2; b %= size + 2; break;
        case 1: o %= size + 2; break;
        case 2: b %= size + 2; break;
        default: break;
        }
        bool ok = (unsigned __int128)o + b <= size;
        p = NULL;
        int rc = region_span(r, o, b, &p);
        CHECK_MSG(rc == (ok ? 0 : -EINVAL), "offset %llu bytes %llu size %llu: %d",
                  (unsigned long long)o, (unsigned long long)b, (unsigned long long)size, rc);
        CHECK(ok ? p == (uint8_t *)r->base + o : p == NULL);
    }
    region_unref(&r);
    CHECK(r == NULL);
    CHECK(!fd_open(fd)); /* the region owned it */
    CHECK_NO_LEAKS();
}

TEST(refuses_unsealed_and_wrong_files)
{
    const uint64_t size = 8192, max = 1 << 20;
    /* A memfd that allows sealing but has no seals. */
    int fd = make_memfd(size, MFD_ALLOW_SEALING, 0);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);
    /* A memfd created without MFD_ALLOW_SEALING (it reports F_SEAL_SEAL only). */
    fd = make_memfd(size, 0, 0);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);
    /* Sealed against shrink only, then grow only: both seals are needed. */
    fd = make_memfd(size, MFD_ALLOW_SEALING, F_SEAL_SHRINK);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);
    fd = make_memfd(size, MFD_ALLOW_SEALING, F_SEAL_GROW);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);
    /* F_SEAL_SEAL alone (nothing more can be added, nothing is sealed). */
    fd = make_memfd(size, MFD_ALLOW_SEALING, F_SEAL_SEAL);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);

    /* A pipe. */
    int p[2];
    CHECK(pipe2(p, O_CLOEXEC) == 0);
    expect_refused(p[0], size, max, -EINVAL);
    expect_refused(p[1], size, max, -EINVAL);
    close(p[0]);
    close(p[1]);

    /* A regular file of the right size (not sealable, or tmpfs's F_SEAL_SEAL). */
    char path[] = "/tmp/moed-test-region-XXXXXX";
    fd = mkostemp(path, O_CLOEXEC);
    CHECK(fd >= 0);
    unlink(path);
    CHECK(ftruncate(fd, (off_t)size) == 0);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);

    /* A sealed memfd opened again by path (O_PATH: no file operations). */
    fd = sealed_memfd(size);
    char self[64];
    snprintf(self, sizeof(self), "/proc/self/fd/%d", fd);
    int pfd = open(self, O_PATH | O_CLOEXEC);
    CHECK(pfd >= 0);
    expect_refused(pfd, size, max, -EINVAL);
    close(pfd);
    close(fd);

    /* A sealed memfd of huge pages: holes can be punched in it. Created
     * where the kernel has hugetlbfs, with or without pages reserved. */
    fd = memfd_create("moed-test-huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
    if (fd >= 0) {
        CHECK(ftruncate(fd, 2 << 20) == 0);
        CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
        expect_refused(fd, 2 << 20, 4 << 20, -EINVAL);
        close(fd);
    } else {
        printf("  (no hugetlbfs memfd here: %s)\n", strerror(errno));
    }

    /* A directory, /dev/null. */
    fd = open("/tmp", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(fd >= 0);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);
    fd = open("/dev/null", O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0);
    expect_refused(fd, size, max, -EINVAL);
    close(fd);
    CHECK_NO_LEAKS();
}

TEST(refuses_wrong_sizes)
{
    uint64_t s = test_seed();
    uint64_t size = 4096 + test_rand(&s) % 65536;
    int fd = sealed_memfd(size);
    /* The declared size must be the real one, both ways. */
    expect_refused(fd, size - 1, 1 << 20, -EINVAL);
    expect_refused(fd, size + 1, 1 << 20, -EINVAL);
    expect_refused(fd, size * 2, 1 << 20, -EINVAL);
    expect_refused(fd, (uint64_t)1 << 40 | size, UINT64_MAX, -EINVAL);
    /* Size 0. */
    expect_refused(fd, 0, 1 << 20, -EINVAL);
    /* Over max_size: -EDQUOT, even by one byte. */
    expect_refused(fd, size, size - 1, -EDQUOT);
    expect_refused(fd, size, 0, -EDQUOT);
    close(fd);

    /* An empty sealed memfd declared as empty. */
    fd = sealed_memfd(0);
    expect_refused(fd, 0, 1 << 20, -EINVAL);
    expect_refused(fd, 1, 1 << 20, -EINVAL);
    close(fd);

    /* A closed fd. */
    fd = sealed_memfd(4096);
    close(fd);
    struct region *r = NULL;
    CHECK_EQ_INT(region_new(fd, 4096, 1 << 20, &r), -EBADF);
    CHECK(r == NULL);
    CHECK_NO_LEAKS();
}

/* A write-sealed memfd cannot be mapped writable: mmap's -EPERM comes back. */
TEST(refuses_write_sealed)
{
    int fd = make_memfd(4096, MFD_ALLOW_SEALING, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
    expect_refused(fd, 4096, 1 << 20, -EPERM);
    close(fd);
    CHECK_NO_LEAKS();
}

TEST(memory_is_shared)
{
    uint64_t s = test_seed();
    const uint64_t size = 3 * 4096 + 100;
    int fd = sealed_memfd(size);
    uint8_t *mine = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(mine != MAP_FAILED);
    struct region *r = NULL;
    CHECK_EQ_INT(region_new(fd, size, size, &r), 0);
    CHECK((void *)mine != r->base);

    /* Creator writes, region reads. */
    for (uint64_t i = 0; i < size; i++)
        mine[i] = (uint8_t)(test_rand(&s) >> 56);
    void *p;
    CHECK_EQ_INT(region_span(r, 0, size, &p), 0);
    CHECK(memcmp(p, mine, size) == 0);
    /* Region writes (the last bytes too), creator reads. */
    uint8_t buf[512];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (uint8_t)(test_rand(&s) >> 56);
    CHECK_EQ_INT(region_span(r, size - sizeof(buf), sizeof(buf), &p), 0);
    memcpy(p, buf, sizeof(buf));
    CHECK(memcmp(mine + size - sizeof(buf), buf, sizeof(buf)) == 0);
    CHECK_EQ_INT(region_span(r, 4096, 8, &p), 0);
    memcpy(p, "sharedok", 8);
    CHECK(memcmp(mine + 4096, "sharedok", 8) == 0);
    region_unref(&r);
    /* The creator's mapping outlives the region's. */
    CHECK(memcmp(mine + 4096, "sharedok", 8) == 0);
    munmap(mine, size);
    CHECK_NO_LEAKS();
}

static int release_calls;
static void *release_base;
static size_t release_size;
static void *release_cookie;

static void on_release(void *ctx, struct region *r)
{
    CHECK(ctx == &release_calls);
    release_calls++;
    release_base = r->base;
    release_size = (size_t)r->size;
    release_cookie = r->pin_cookie;
    /* Still mapped while the release hook runs. */
    CHECK(((volatile uint8_t *)r->base)[r->size - 1] == 0x5a);
}

TEST(refcount_frees_once)
{
    const uint64_t size = 8192;
    int fd = sealed_memfd(size);
    struct region *r = NULL;
    CHECK_EQ_INT(region_new(fd, size, size, &r), 0);
    int cookie;
    r->release = on_release;
    r->release_ctx = &release_calls;
    r->pin_cookie = &cookie;
    void *base = r->base;
    ((uint8_t *)base)[size - 1] = 0x5a;

    struct region *batch = region_ref(r);
    CHECK(batch == r);
    CHECK_EQ_INT(r->refs, 2);
    CHECK(region_ref(NULL) == NULL);

    /* The client lets go first: the batch's reference keeps it mapped. */
    struct region *client = r;
    r = NULL;
    region_unref(&client);
    CHECK(client == NULL);
    CHECK_EQ_INT(release_calls, 0);
    CHECK_EQ_INT(batch->refs, 1);
    CHECK(fd_open(fd));
    CHECK(((volatile uint8_t *)base)[size - 1] == 0x5a);

    /* The batch completes: released once, unmapped, fd closed. */
    region_unref(&batch);
    CHECK(batch == NULL);
    CHECK_EQ_INT(release_calls, 1);
    CHECK(release_base == base);
    CHECK_EQ_INT(release_size, size);
    CHECK(release_cookie == &cookie);
    errno = 0;
    CHECK(fcntl(fd, F_GETFD) == -1 && errno == EBADF);
    /* The range is no longer mapped: msync on it fails with ENOMEM. */
    CHECK(msync(base, size, MS_ASYNC) == -1 && errno == ENOMEM);

    /* A NULL pointer, or a pointer to NULL, is fine; no second release. */
    region_unref(&batch);
    struct region *none = NULL;
    region_unref(&none);
    CHECK_EQ_INT(release_calls, 1);
    CHECK_NO_LEAKS();
}

/* Many references, dropped in a random order, free exactly once. */
TEST(refcount_many)
{
    uint64_t s = test_seed();
    int fd = sealed_memfd(4096);
    struct region *refs[64];
    CHECK_EQ_INT(region_new(fd, 4096, 4096, &refs[0]), 0);
    refs[0]->release = on_release;
    refs[0]->release_ctx = &release_calls;
    ((uint8_t *)refs[0]->base)[4095] = 0x5a;
    for (int i = 1; i < 64; i++)
        refs[i] = region_ref(refs[0]);
    CHECK_EQ_INT(refs[0]->refs, 64);
    for (int i = 63; i > 0; i--) {
        int j = (int)(test_rand(&s) % (uint64_t)(i + 1));
        struct region *t = refs[i];
        refs[i] = refs[j];
        refs[j] = t;
    }
    for (int i = 0; i < 64; i++) {
        CHECK_EQ_INT(release_calls, 0);
        CHECK(fd_open(fd));
        region_unref(&refs[i]);
        CHECK(refs[i] == NULL);
    }
    CHECK_EQ_INT(release_calls, 1);
    CHECK(!fd_open(fd));
    CHECK_NO_LEAKS();
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(sealed_memfd_maps_and_spans),
        TEST_CASE(refuses_unsealed_and_wrong_files),
        TEST_CASE(refuses_wrong_sizes),
        TEST_CASE(refuses_write_sealed),
        TEST_CASE(memory_is_shared),
        TEST_CASE(refcount_frees_once),
        TEST_CASE(refcount_many),
        {0}});
}
