/*
 * test_pin.c: clients' regions pinned and unpinned off the loop thread
 * (session.c). The daemon's server runs in this process, on the CPU
 * backend with its operations copied and a pin added that takes PIN_MS (as
 * cudaHostRegister takes about 15 ms per 256 MiB) and an unpin that
 * counts; its clients are libmoe's, and a raw session socket where the
 * test must say what libmoe never would.
 */
#include "tests/unit/unit.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client/moe.h"
#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/loop.h"
#include "daemon/notify.h"
#include "daemon/server.h"
#include "moe.pb-c.h"

#define PIN_MS 400

static atomic_int pins, unpins;
static atomic_uintptr_t unpinned_base;
static atomic_int unpin_ms; /* how long an unpin takes (0: at once) */
static atomic_int pin_ms = PIN_MS;
static atomic_bool tick_notifies; /* the loop's timer calls notify_tick() */

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static int slow_pin(struct backend *b, void *base, size_t size, void **cookie)
{
    (void)b;
    (void)size;
    sleep_ms(atomic_load(&pin_ms));
    atomic_fetch_add(&pins, 1);
    *cookie = base;
    return 0;
}

static void counting_unpin(struct backend *b, void *base, size_t size, void *cookie)
{
    (void)b;
    (void)size;
    CHECK(cookie == base);
    /* Still mapped: the unmap comes after. */
    CHECK(((volatile unsigned char *)base)[0] == 0x5a);
    sleep_ms(atomic_load(&unpin_ms));
    atomic_store(&unpinned_base, (uintptr_t)base);
    atomic_fetch_add(&unpins, 1);
}

struct daemon_here {
    struct config cfg;
    struct backend *b;
    struct backend_ops ops;
    struct loop *loop;
    struct loop_watch *tick;
    struct server *s;
    pthread_t thread;
};

/* loop_stop() only marks the loop: a timer wakes it to notice. It also
 * stands for the daemon's status tick where a case asks. */
static void tick(void *data)
{
    struct daemon_here *d = data;
    if (atomic_load(&tick_notifies))
        notify_tick(d->s);
}

static void *loop_thread(void *arg)
{
    struct daemon_here *d = arg;
    CHECK_EQ_INT(loop_run(d->loop), 0);
    return NULL;
}

static void daemon_start_with(struct daemon_here *d, uint64_t max_pinned_bytes)
{
    memset(d, 0, sizeof(*d));
    CHECK_EQ_INT(config_init(&d->cfg), 0);
    if (max_pinned_bytes)
        d->cfg.max_pinned_bytes = max_pinned_bytes;
    free(d->cfg.runtime_dir);
    d->cfg.runtime_dir = strdup(tmp_dir_new("pin"));
    CHECK(d->cfg.runtime_dir != NULL);
    CHECK_EQ_INT(backend_open("cpu", 0, 1, &d->b), 0);
    d->ops = *d->b->ops;
    d->ops.pin = slow_pin;
    d->ops.unpin = counting_unpin;
    d->b->ops = &d->ops;
    CHECK_EQ_INT(loop_new(&d->loop), 0);
    d->tick = loop_timer(d->loop, 10000, tick, d);
    CHECK(d->tick != NULL);
    CHECK_EQ_INT(server_new(&d->cfg, &d->b, 1, d->loop, &d->s), 0);
    CHECK_EQ_INT(server_listen(d->s, -1, -1), 0);
    CHECK_EQ_INT(pthread_create(&d->thread, NULL, loop_thread, d), 0);
}

static void daemon_start(struct daemon_here *d)
{
    daemon_start_with(d, 0);
}

static void daemon_halt(struct daemon_here *d)
{
    loop_stop(d->loop);
    CHECK_EQ_INT(pthread_join(d->thread, NULL), 0);
}

/* After daemon_halt: frees the server (which finishes the pinner's jobs):
 * no region is left pinned. */
static void daemon_free(struct daemon_here *d)
{
    server_free(&d->s);
    loop_unwatch(d->loop, &d->tick);
    loop_free(&d->loop);
    backend_free(&d->b);
    config_done(&d->cfg);
    CHECK_EQ_INT(atomic_load(&pins), atomic_load(&unpins));
}

static void daemon_stop(struct daemon_here *d)
{
    daemon_halt(d);
    daemon_free(d);
}

static uint64_t ms_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

static bool wait_for(atomic_int *n, int want, int ms)
{
    uint64_t end = ms_now() + (uint64_t)ms;
    while (atomic_load(n) < want && ms_now() < end)
        usleep(2000);
    return atomic_load(n) >= want;
}

struct creator {
    moe_client *c;
    moe_region *r;
    int rc;
    uint64_t took_ms;
};

static void *create_region(void *arg)
{
    struct creator *cr = arg;
    uint64_t t0 = ms_now();
    cr->rc = moe_region_create(cr->c, 1 << 20, "pinned", &cr->r);
    cr->took_ms = ms_now() - t0;
    return NULL;
}

/* While one client's region is being pinned, another client's requests are
 * answered at once, and so are the requests of the same client's other
 * threads (libmoe waits for the region without holding the client); the
 * region, once pinned, is unpinned when freed (still mapped as it is). */
TEST(a_pin_does_not_hold_up_other_clients)
{
    struct daemon_here d;
    daemon_start(&d);
    moe_client *a = NULL, *b = NULL;
    CHECK_MSG(moe_connect(d.cfg.runtime_dir, "a", &a) == 0, "%s", moe_errmsg());
    CHECK_MSG(moe_connect(d.cfg.runtime_dir, "b", &b) == 0, "%s", moe_errmsg());
    struct creator cr = {.c = a};
    pthread_t t;
    CHECK_EQ_INT(pthread_create(&t, NULL, create_region, &cr), 0);
    usleep(50 * 1000);
    uint64_t worst = 0;
    for (int i = 0; i < 10; i++) {
        uint64_t t0 = ms_now();
        CHECK_EQ_INT(moe_hello(i % 2 ? a : b, NULL), 0);
        uint64_t took = ms_now() - t0;
        worst = took > worst ? took : worst;
    }
    CHECK_EQ_INT(pthread_join(t, NULL), 0);
    CHECK_MSG(cr.rc == 0, "region: %s", moe_errmsg());
    fprintf(stderr, "  the region took %llu ms; ten hellos meanwhile (five of its client), "
            "the slowest %llu ms\n", (unsigned long long)cr.took_ms, (unsigned long long)worst);
    CHECK_MSG(cr.took_ms >= PIN_MS, "registering took %llu ms", (unsigned long long)cr.took_ms);
    CHECK_MSG(worst < PIN_MS / 4, "a hello waited %llu ms for a pin",
              (unsigned long long)worst);
    CHECK_EQ_INT(atomic_load(&pins), 1);
    unsigned char *p = moe_region_data(cr.r);
    memset(p, 0x5a, 1 << 20);
    CHECK_EQ_INT(moe_region_free(a, &cr.r), 0);
    CHECK_MSG(wait_for(&unpins, 1, 5000), "the freed region was not unpinned");
    moe_disconnect(&a);
    moe_disconnect(&b);
    daemon_stop(&d);
    CHECK_NO_LEAKS();
}

/* A raw session: connected, opened, its token unused. */
static int raw_session(const char *dir)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/moed.sock", dir);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__OpenSession os = MOE__OPEN_SESSION__INIT;
    os.protocol_version = MOE_PROTOCOL_VERSION;
    os.client_name = "raw";
    req.body_case = MOE__SESSION_REQUEST__BODY_OPEN;
    req.open = &os;
    uint8_t buf[4096];
    size_t n = moe__session_request__pack(&req, buf);
    CHECK(send(fd, buf, n, 0) == (ssize_t)n);
    ssize_t got = recv(fd, buf, sizeof(buf), 0);
    Moe__SessionReply *rep = got > 0 ? moe__session_reply__unpack(NULL, (size_t)got, buf) : NULL;
    CHECK(rep && rep->status == MOE__STATUS__STATUS_OK);
    moe__session_reply__free_unpacked(rep, NULL);
    return fd;
}

/* Send RegisterRegion for a fresh sealed memfd of size bytes. */
static void raw_register(int fd, size_t size)
{
    int mfd = memfd_create("raw", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(mfd >= 0 && ftruncate(mfd, (off_t)size) == 0 &&
          fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    CHECK(m != MAP_FAILED);
    memset(m, 0x5a, size);
    munmap(m, size);
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__RegisterRegion reg = MOE__REGISTER_REGION__INIT;
    reg.size = size;
    reg.name = "raw";
    req.body_case = MOE__SESSION_REQUEST__BODY_REGISTER_REGION;
    req.register_region = &reg;
    uint8_t buf[4096];
    size_t n = moe__session_request__pack(&req, buf);
    union {
        char raw[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cb;
    memset(&cb, 0, sizeof(cb));
    struct iovec iov = {buf, n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb.raw,
                        .msg_controllen = sizeof(cb.raw)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &mfd, sizeof(int));
    CHECK(sendmsg(fd, &mh, 0) == (ssize_t)n);
    close(mfd);
}

static Moe__SessionReply *raw_reply(int fd)
{
    uint8_t buf[4096];
    ssize_t got = recv(fd, buf, sizeof(buf), 0);
    CHECK_MSG(got > 0, "no session reply: %s", got < 0 ? strerror(errno) : "closed");
    Moe__SessionReply *rep = moe__session_reply__unpack(NULL, (size_t)got, buf);
    CHECK(rep != NULL);
    return rep;
}

/* A session's requests sent back to back while its region is pinned are
 * answered in order: the region's id, then the unregistering of a region
 * it never had. */
TEST(session_requests_behind_a_pin_are_answered_in_order)
{
    struct daemon_here d;
    daemon_start(&d);
    int fd = raw_session(d.cfg.runtime_dir);
    raw_register(fd, 1 << 16);
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__UnregisterRegion un = MOE__UNREGISTER_REGION__INIT;
    un.region = 12345;
    req.body_case = MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION;
    req.unregister_region = &un;
    uint8_t buf[256];
    size_t n = moe__session_request__pack(&req, buf);
    CHECK(send(fd, buf, n, 0) == (ssize_t)n);
    Moe__SessionReply *rep = raw_reply(fd);
    CHECK_EQ_INT(rep->status, MOE__STATUS__STATUS_OK);
    CHECK(rep->region != 0);
    moe__session_reply__free_unpacked(rep, NULL);
    rep = raw_reply(fd);
    CHECK(rep->status != MOE__STATUS__STATUS_OK);
    moe__session_reply__free_unpacked(rep, NULL);
    CHECK_EQ_INT(atomic_load(&pins), 1);
    close(fd);
    CHECK_MSG(wait_for(&unpins, 1, 5000), "the closed session's region was not unpinned");
    daemon_stop(&d);
    CHECK_NO_LEAKS();
}

/* A client that goes while its region is being pinned leaves nothing
 * pinned or mapped: the pin's end releases the region. */
TEST(a_client_gone_during_its_pin_leaves_nothing_pinned)
{
    struct daemon_here d;
    daemon_start(&d);
    int fd = raw_session(d.cfg.runtime_dir);
    raw_register(fd, 1 << 16);
    usleep(50 * 1000);
    close(fd);
    CHECK_MSG(wait_for(&pins, 1, 5000), "no pin");
    CHECK_MSG(wait_for(&unpins, 1, 5000), "the region of a client gone was not unpinned");
    daemon_halt(&d);
    CHECK_EQ_INT(d.s->n_sessions, 0);
    CHECK_EQ_INT(d.s->pinned_bytes, 0);
    daemon_free(&d);
    CHECK_NO_LEAKS();
}

/* Stopped while a pin runs: the server's end finishes it, answers or
 * releases it, and unpins every region. */
TEST(a_pin_in_flight_at_the_stop_is_finished_and_undone)
{
    struct daemon_here d;
    daemon_start(&d);
    int fd = raw_session(d.cfg.runtime_dir);
    raw_register(fd, 1 << 16);
    usleep(50 * 1000);
    daemon_stop(&d); /* pins == unpins */
    CHECK_EQ_INT(atomic_load(&pins), 1);
    close(fd);
    CHECK_NO_LEAKS();
}

/* At max_pinned_bytes, a region freed and another registered right after
 * (its unpin still queued on the pinner): the new one is pinned, since
 * its pin runs after that unpin has ended. */
TEST(a_region_freed_at_the_pinned_limit_makes_room_for_the_next)
{
    struct daemon_here d;
    daemon_start_with(&d, 1 << 20);
    moe_client *c = NULL;
    CHECK_MSG(moe_connect(d.cfg.runtime_dir, "c", &c) == 0, "%s", moe_errmsg());
    moe_region *r = NULL;
    CHECK_MSG(moe_region_create(c, 1 << 20, "first", &r) == 0, "%s", moe_errmsg());
    CHECK_EQ_INT(atomic_load(&pins), 1);
    memset(moe_region_data(r), 0x5a, 1 << 20);
    atomic_store(&unpin_ms, PIN_MS);
    CHECK_EQ_INT(moe_region_free(c, &r), 0);
    CHECK_MSG(moe_region_create(c, 1 << 20, "second", &r) == 0, "%s", moe_errmsg());
    CHECK_MSG(atomic_load(&pins) == 2, "the second region was not pinned");
    CHECK_EQ_INT(atomic_load(&unpins), 1);
    memset(moe_region_data(r), 0x5a, 1 << 20);
    atomic_store(&unpin_ms, 0);
    CHECK_EQ_INT(moe_region_free(c, &r), 0);
    moe_disconnect(&c);
    daemon_stop(&d);
    CHECK_NO_LEAKS();
}

/* A client that sends several regions back to back and goes while the
 * first is being pinned: its session ends then (the socket hangs up, which
 * wakes the loop even while the session is not read); its other regions
 * are neither mapped nor pinned. */
TEST(a_client_gone_during_its_pin_has_no_more_regions_pinned)
{
    struct daemon_here d;
    daemon_start(&d);
    int fd = raw_session(d.cfg.runtime_dir);
    for (int i = 0; i < 4; i++)
        raw_register(fd, 1 << 16);
    usleep(50 * 1000);
    close(fd);
    CHECK_MSG(wait_for(&unpins, 1, 5000), "the region of a client gone was not unpinned");
    usleep(3 * PIN_MS * 1000);
    daemon_halt(&d);
    CHECK_EQ_INT(d.s->n_sessions, 0);
    CHECK_EQ_INT(d.s->pinned_bytes, 0);
    CHECK_EQ_INT(atomic_load(&pins), 1);
    daemon_free(&d);
    CHECK_NO_LEAKS();
}

/* A pin that runs past the watchdog interval stops the watchdog's pings,
 * as a batch that does: the driver is stuck. They come again after it. */
TEST(a_pin_stuck_past_the_watchdog_interval_stops_the_pings)
{
    char path[96];
    snprintf(path, sizeof(path), "%s/notify", tmp_dir_new("wd"));
    int ns = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    CHECK(ns >= 0 && bind(ns, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    char pid[32];
    snprintf(pid, sizeof(pid), "%d", (int)getpid());
    setenv("NOTIFY_SOCKET", path, 1);
    setenv("WATCHDOG_USEC", "300000", 1);
    setenv("WATCHDOG_PID", pid, 1);
    atomic_store(&pin_ms, 1500);
    struct daemon_here d;
    char rt[64];
    daemon_start(&d);
    snprintf(rt, sizeof(rt), "%s", d.cfg.runtime_dir);
    moe_client *a = NULL;
    CHECK_MSG(moe_connect(rt, "a", &a) == 0, "%s", moe_errmsg());
    atomic_store(&tick_notifies, true);
    struct creator cr = {.c = a};
    pthread_t t;
    uint64_t t0 = ms_now();
    CHECK_EQ_INT(pthread_create(&t, NULL, create_region, &cr), 0);
    /* Pings up to the pin's start, none from 500 ms into it (past the
     * interval, with room for a loaded machine) to its last 200 ms. */
    int before = 0, during = 0, after = 0;
    struct timeval tv = {0, 20000};
    setsockopt(ns, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    while (ms_now() - t0 < 2500) {
        char msg[1024];
        ssize_t n = recv(ns, msg, sizeof(msg) - 1, 0);
        if (n <= 0)
            continue;
        msg[n] = '\0';
        if (!strstr(msg, "WATCHDOG=1"))
            continue;
        uint64_t at = ms_now() - t0;
        before += at < 100;
        during += at >= 500 && at < 1300;
        after += at >= 1700;
    }
    CHECK_EQ_INT(pthread_join(t, NULL), 0);
    CHECK_MSG(cr.rc == 0, "region: %s", moe_errmsg());
    atomic_store(&tick_notifies, false);
    fprintf(stderr, "  watchdog pings: %d before the pin, %d during it, %d after\n", before,
            during, after);
    CHECK(before > 0);
    CHECK_EQ_INT(during, 0);
    CHECK(after > 0);
    memset(moe_region_data(cr.r), 0x5a, 1 << 20);
    moe_region_free(a, &cr.r);
    moe_disconnect(&a);
    daemon_stop(&d);
    close(ns);
    CHECK_NO_LEAKS();
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(a_pin_does_not_hold_up_other_clients),
        TEST_CASE(a_pin_stuck_past_the_watchdog_interval_stops_the_pings),
        TEST_CASE(session_requests_behind_a_pin_are_answered_in_order),
        TEST_CASE(a_client_gone_during_its_pin_leaves_nothing_pinned),
        TEST_CASE(a_pin_in_flight_at_the_stop_is_finished_and_undone),
        TEST_CASE(a_region_freed_at_the_pinned_limit_makes_room_for_the_next),
        TEST_CASE(a_client_gone_during_its_pin_has_no_more_regions_pinned),
        {0}});
}
