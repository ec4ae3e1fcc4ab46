/*
 * test_pin.c: clients' regions pinned and unpinned off the loop thread
 * (session.c). The daemon's server runs in this process, on the CPU
 * backend with its operations copied and a pin added that takes PIN_MS (as
 * cudaHostRegister takes about 15 ms per 256 MiB) and an unpin that
 * counts; its clients are libmoe's, and a raw session socket where the
 * test must say what libmoe never would. One case slows the GEMMs down
 * instead, to time libmoe's waits (moe_set_spin_ahead_us); another fails
 * them, as a device can, to read what the client is told.
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
#include "daemon/region.h"
#include "daemon/server.h"
#include "kernels/moe_kernels.h"
#include "moe.pb-c.h"

#define PIN_MS 400

static atomic_int pins, unpins;
static atomic_int pins_begun;
static atomic_uintptr_t unpinned_base;
static atomic_int unpin_ms; /* how long an unpin takes (0: at once) */
static atomic_int pin_ms = PIN_MS;
static atomic_bool tick_notifies; /* the loop's timer calls notify_tick() */
static atomic_bool unpin_unwritten; /* a region unpinned may hold its zeros still */

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* The stress case's pins: random, 0 to 30 ms, and one in five fails with
 * -ENOMEM (the region then goes unpinned); its unpins take 0 to 10 ms. pinned_live counts the bytes
 * pinned and not yet unpinned, as the driver would; pin_over_limit the
 * pins that would have taken it past pin_limit (max_pinned_bytes). */
static atomic_bool pin_random;
static atomic_llong pinned_live;
static atomic_int pin_failures, pin_over_limit, unpin_unknown;
static uint64_t pin_limit, pin_rng; /* pin_rng: the pinner thread's alone */

static int slow_pin(struct backend *b, void *base, size_t size, void **cookie)
{
    (void)b;
    atomic_fetch_add(&pins_begun, 1);
    if (atomic_load(&pin_random)) {
        pin_rng = pin_rng * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t r = pin_rng >> 33;
        if ((uint64_t)atomic_load(&pinned_live) + size > pin_limit)
            atomic_fetch_add(&pin_over_limit, 1);
        sleep_ms((int)(r % 31));
        if ((r >> 8) % 5 == 0) {
            atomic_fetch_add(&pin_failures, 1);
            return -ENOMEM;
        }
    } else {
        sleep_ms(atomic_load(&pin_ms));
    }
    atomic_fetch_add(&pinned_live, (long long)size);
    atomic_fetch_add(&pins, 1);
    *cookie = base;
    return 0;
}

static void counting_unpin(struct backend *b, void *base, size_t size, void *cookie)
{
    (void)b;
    CHECK(cookie == base);
    /* Still mapped: the unmap comes after. */
    unsigned char first = ((volatile unsigned char *)base)[0];
    if (!atomic_load(&pin_random)) {
        CHECK(first == 0x5a || atomic_load(&unpin_unwritten));
        sleep_ms(atomic_load(&unpin_ms));
    } else { /* on the pinner thread, as the pins: pin_rng is its own */
        pin_rng = pin_rng * 6364136223846793005ull + 1442695040888963407ull;
        sleep_ms((int)((pin_rng >> 33) % 11));
    }
    if (atomic_fetch_sub(&pinned_live, (long long)size) < (long long)size)
        atomic_fetch_add(&unpin_unknown, 1); /* more unpinned than pinned */
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
    /* Stepped (the stress case): the loop runs in turns until halting is
     * set, then on until the pinner and the workers are idle and no more
     * than settle_sessions sessions are left (or 60 s have gone; not at
     * all for UINT32_MAX). */
    bool stepped;
    atomic_bool halting;
    uint32_t settle_sessions;
};

/* loop_stop() only marks the loop: a timer wakes it to notice. It also
 * stands for the daemon's status tick where a case asks. */
static void tick(void *data)
{
    struct daemon_here *d = data;
    if (atomic_load(&tick_notifies))
        notify_tick(d->s);
}

static uint64_t ms_now(void);

static void *loop_thread(void *arg)
{
    struct daemon_here *d = arg;
    if (!d->stepped) {
        CHECK_EQ_INT(loop_run(d->loop), 0);
        return NULL;
    }
    while (!atomic_load(&d->halting))
        CHECK(loop_run_once(d->loop, 20) >= 0);
    if (d->settle_sessions == UINT32_MAX)
        return NULL; /* no settling */
    uint64_t end = ms_now() + 60000;
    while ((server_pending(d->s) || d->s->n_sessions > d->settle_sessions) && ms_now() < end)
        CHECK(loop_run_once(d->loop, 20) >= 0);
    return NULL;
}

/* dir: the runtime directory of an earlier one (a restart), or NULL. */
static void daemon_start_opts(struct daemon_here *d, uint64_t max_pinned_bytes, bool stepped,
                              const char *dir)
{
    memset(d, 0, sizeof(*d));
    d->stepped = stepped;
    CHECK_EQ_INT(config_init(&d->cfg), 0);
    if (max_pinned_bytes)
        d->cfg.max_pinned_bytes = max_pinned_bytes;
    free(d->cfg.runtime_dir);
    d->cfg.runtime_dir = strdup(dir ? dir : tmp_dir_new("pin"));
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

static void daemon_start_with(struct daemon_here *d, uint64_t max_pinned_bytes)
{
    daemon_start_opts(d, max_pinned_bytes, false, NULL);
}

static void daemon_start(struct daemon_here *d)
{
    daemon_start_with(d, 0);
}

/* For a case that reads the server's counts after daemon_halt: the loop
 * goes on past the halt until the pinner's ends have been taken in (an
 * unpin counted here is subtracted from pinned_bytes only then) and no
 * more than `sessions` sessions are left. */
static void daemon_start_settled(struct daemon_here *d, uint32_t sessions)
{
    daemon_start_opts(d, 0, true, NULL);
    d->settle_sessions = sessions;
}

static void daemon_halt(struct daemon_here *d)
{
    if (d->stepped)
        atomic_store(&d->halting, true);
    else
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

/* A call on a thread of its own: its result and how long it took. */
struct client_call {
    moe_client *c;
    moe_region *r; /* create_region's */
    int rc;
    uint64_t took_ms;
};

static void *create_region(void *arg)
{
    struct client_call *cr = arg;
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
    struct client_call cr = {.c = a};
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
    daemon_start_settled(&d, 0);
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
    CHECK_MSG(wait_for(&pins_begun, 1, 5000), "the pin did not start");
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
    daemon_start_settled(&d, 0);
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
    struct client_call cr = {.c = a};
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

/* A region whose registration outlasts the client's timeout (the pin is
 * slow): the call fails with -ETIMEDOUT and ends the session, the next
 * call opens a new one and works, and the region that the daemon pinned
 * for the session gone is unpinned. */
TEST(a_region_create_timed_out_during_its_pin_leaves_the_client_usable)
{
    atomic_store(&unpin_unwritten, true);
    struct daemon_here d;
    daemon_start_settled(&d, 1);
    moe_client *c = NULL;
    CHECK_MSG(moe_connect(d.cfg.runtime_dir, "c", &c) == 0, "%s", moe_errmsg());
    moe_region *kept = NULL;
    CHECK_MSG(moe_region_create(c, 1 << 16, "kept", &kept) == 0, "%s", moe_errmsg());
    moe_set_timeout(c, PIN_MS / 4);
    moe_region *r = NULL;
    CHECK_EQ_INT(moe_region_create(c, 1 << 20, "slow", &r), -ETIMEDOUT);
    CHECK(r == NULL);
    moe_set_timeout(c, 20000);
    CHECK_MSG(moe_hello(c, NULL) == 0, "%s", moe_errmsg()); /* a new session, kept again */
    CHECK_MSG(moe_region_create(c, 1 << 20, "next", &r) == 0, "%s", moe_errmsg());
    CHECK_EQ_INT(moe_region_free(c, &r), 0);
    CHECK_EQ_INT(moe_region_free(c, &kept), 0);
    CHECK_MSG(wait_for(&unpins, 4, 10000), "unpinned %d of 4", atomic_load(&unpins));
    daemon_halt(&d);
    CHECK_EQ_INT(d.s->n_sessions, 1);
    CHECK_EQ_INT(d.s->pinned_bytes, 0);
    CHECK_EQ_INT(d.s->unpinning_bytes, 0);
    CHECK_EQ_INT(atomic_load(&pins), 4);
    daemon_free(&d);
    moe_disconnect(&c);
    CHECK_NO_LEAKS();
}

static void *call_hello(void *arg)
{
    struct client_call *h = arg;
    uint64_t t0 = ms_now();
    h->rc = moe_hello(h->c, NULL);
    h->took_ms = ms_now() - t0;
    return NULL;
}

/* A daemon (*d) and a client of it; dir (PATH_MAX bytes) gets the runtime
 * directory, which outlives the daemon for a restart in it. */
static moe_client *daemon_start_connected(struct daemon_here *d, char *dir)
{
    daemon_start(d);
    snprintf(dir, PATH_MAX, "%s", d->cfg.runtime_dir);
    moe_client *c = NULL;
    CHECK_MSG(moe_connect(dir, "c", &c) == 0, "%s", moe_errmsg());
    return c;
}

/* After a daemon restart the next call reconnects and registers the
 * client's regions again, each pinned as it is registered (here 4 x
 * RECONNECT_PIN_MS). Meanwhile the client's other threads are not held
 * up: a call that only sets the client returns at once, and one that
 * needs the daemon waits for the reconnection no longer than its timeout
 * (-ETIMEDOUT, nothing sent, the session unharmed), a region's create
 * waits for it and goes on; once it is done, calls work and every region
 * was pinned again. */
#define RECONNECT_PIN_MS 600
TEST(a_reconnection_does_not_hold_up_the_clients_other_threads)
{
    atomic_store(&unpin_unwritten, true);
    atomic_store(&pin_ms, 0);
    struct daemon_here d;
    char dir[PATH_MAX];
    moe_client *c = daemon_start_connected(&d, dir);
    moe_region *r[4] = {NULL};
    for (int i = 0; i < 4; i++)
        CHECK_MSG(moe_region_create(c, 1 << 16, "r", &r[i]) == 0, "%s", moe_errmsg());
    daemon_stop(&d); /* pins == unpins */
    atomic_store(&pin_ms, RECONNECT_PIN_MS);
    daemon_start_opts(&d, 0, false, dir);
    /* Each registration waits one pin; another call's wait for the
     * reconnection ends 1.5 pins before it does, and a second one's 1 pin
     * after it. */
    moe_set_timeout(c, 5 * RECONNECT_PIN_MS / 2);
    struct client_call a = {.c = c}, b = {.c = c};
    pthread_t t;
    CHECK_EQ_INT(pthread_create(&t, NULL, call_hello, &a), 0);
    /* Its first region is being pinned again: the reconnection is under
     * way (three pins to go). */
    CHECK_MSG(wait_for(&pins_begun, 5, 10000), "no region was registered again");
    uint64_t t0 = ms_now();
    moe_set_spin_us(c, 0);
    uint64_t set_ms = ms_now() - t0;
    call_hello(&b);
    /* A region's create waits for the claim on the session socket, which
     * the reconnection gives up 1.5 pins later: in time. */
    moe_region *late = NULL;
    t0 = ms_now();
    int late_rc = moe_region_create(c, 1 << 16, "late", &late);
    uint64_t late_ms = ms_now() - t0;
    CHECK_EQ_INT(pthread_join(t, NULL), 0);
    fprintf(stderr, "  reconnection %llu ms; meanwhile a setting took %llu ms, a hello %llu ms "
            "(%d), then a region's create %llu ms (%d)\n", (unsigned long long)a.took_ms,
            (unsigned long long)set_ms, (unsigned long long)b.took_ms, b.rc,
            (unsigned long long)late_ms, late_rc);
    CHECK_MSG(a.rc == 0, "the reconnecting call: %s", moe_errmsg());
    CHECK(a.took_ms >= 4 * RECONNECT_PIN_MS);
    CHECK_MSG(set_ms < RECONNECT_PIN_MS / 2, "setting the client waited %llu ms",
              (unsigned long long)set_ms);
    CHECK_EQ_INT(b.rc, -ETIMEDOUT);
    CHECK(b.took_ms + 20 >= 5 * RECONNECT_PIN_MS / 2 && b.took_ms < 4 * RECONNECT_PIN_MS);
    CHECK_MSG(late_rc == 0, "a region created meanwhile: %s", moe_errmsg());
    CHECK(late_ms >= RECONNECT_PIN_MS);
    CHECK_EQ_INT(atomic_load(&pins), 9);
    CHECK_EQ_INT(moe_region_free(c, &late), 0);
    CHECK_MSG(moe_hello(c, NULL) == 0, "%s", moe_errmsg());
    for (int i = 0; i < 4; i++)
        CHECK_EQ_INT(moe_region_free(c, &r[i]), 0);
    moe_disconnect(&c);
    daemon_stop(&d);
    CHECK_NO_LEAKS();
}

/* A daemon that accepts no more connections (hung, its listen backlog
 * full: here a socket that listens and never accepts) makes a reconnection
 * try its connect again up to the client's timeout. Meanwhile the client's
 * other threads go on, as they do while it waits for OpenSession and the
 * registrations: a call that only sets the client returns at once. */
TEST(a_reconnection_into_a_full_backlog_does_not_hold_up_the_clients_other_threads)
{
    struct daemon_here d;
    char dir[PATH_MAX];
    moe_client *c = daemon_start_connected(&d, dir);
    moe_set_timeout(c, 1500);
    daemon_stop(&d);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    CHECK(snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/moed.sock", dir) <
          (int)sizeof(sa.sun_path));
    unlink(sa.sun_path);
    int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(lfd, 0) == 0);
    int queued[16], n_queued = 0;
    for (;;) {
        int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        CHECK(fd >= 0);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
            CHECK_MSG(errno == EAGAIN, "connect: %s", strerror(errno));
            close(fd);
            break;
        }
        CHECK(n_queued < (int)ARRAY_LEN(queued));
        queued[n_queued++] = fd;
    }
    struct client_call a = {.c = c};
    pthread_t t;
    CHECK_EQ_INT(pthread_create(&t, NULL, call_hello, &a), 0);
    sleep_ms(400); /* its connect is tried again and again */
    uint64_t t0 = ms_now();
    moe_set_spin_us(c, 0);
    uint64_t set_ms = ms_now() - t0;
    CHECK_EQ_INT(pthread_join(t, NULL), 0);
    fprintf(stderr, "  reconnection %llu ms (%d); meanwhile a setting took %llu ms\n",
            (unsigned long long)a.took_ms, a.rc, (unsigned long long)set_ms);
    CHECK_EQ_INT(a.rc, -ETIMEDOUT);
    CHECK(a.took_ms >= 1500);
    CHECK_MSG(set_ms < 300, "setting the client waited %llu ms", (unsigned long long)set_ms);
    for (int i = 0; i < n_queued; i++)
        close(queued[i]);
    close(lfd);
    unlink(sa.sun_path);
    daemon_start_opts(&d, 0, false, dir);
    CHECK_MSG(moe_hello(c, NULL) == 0, "%s", moe_errmsg());
    moe_disconnect(&c);
    daemon_stop(&d);
    CHECK_NO_LEAKS();
}

/* ---- a client that spins ahead -----------------------------------------
 *
 * moe_set_spin_ahead_us against a daemon whose GEMMs take gemm_ms each:
 * the waiting thread sleeps until shortly before the reply's expected
 * time and busy-polls from there, and a reply that comes much later than
 * expected is slept for again after the window, not spun for.
 */
static atomic_int gemm_ms;
static int (*cpu_gemm_run)(struct backend *b, void *handle, const void *a, const int64_t *m_sizes,
                           int64_t m, void *c);

static int slow_gemm_run(struct backend *b, void *handle, const void *a, const int64_t *m_sizes,
                         int64_t m, void *c)
{
    sleep_ms(atomic_load(&gemm_ms));
    return cpu_gemm_run(b, handle, a, m_sizes, m, c);
}

/* The calling thread's CPU time, us. */
static uint64_t thread_cpu_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (uint64_t)t.tv_sec * 1000000 + (uint64_t)t.tv_nsec / 1000;
}

#define AN 8 /* the layer: one group, n = k = AN; one row a request */
#define W_OFF 64 /* byte 0: the fixture's unpin reads 0x5a there */
#define A_OFF (W_OFF + AN * AN * 2)
#define C_OFF (A_OFF + AN * 2)

/* n GEMMs of one row, each checked; the thread's CPU time for them, us. */
static uint64_t spin_gemms(moe_client *c, moe_region *r, int n, uint64_t *seed)
{
    uint8_t *base = moe_region_data(r);
    uint16_t *a = (uint16_t *)(base + A_OFF), *out = (uint16_t *)(base + C_OFF);
    uint64_t ms[1] = {1};
    int64_t ms64[1] = {1};
    moe_gemm_args ga = {.layer = "g1", .a = moe_tensor_2d(r, A_OFF, MOE_DTYPE_BF16, 1, AN),
                        .c = moe_tensor_2d(r, C_OFF, MOE_DTYPE_BF16, 1, AN), .m_sizes = ms,
                        .groups = 1};
    uint64_t cpu = 0;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < AN; j++) {
            a[j] = moek_f32_to_bf16(test_randf(seed));
            out[j] = 0x7fc1; /* NaN: poisoned */
        }
        uint64_t t0 = thread_cpu_us();
        CHECK_MSG(moe_gemm(c, &ga, NULL) == 0, "%s", moe_errmsg());
        cpu += thread_cpu_us() - t0;
        uint16_t ref[AN];
        float got[AN], want[AN];
        CHECK(moek_ref_grouped_gemm(MOEK_DTYPE_BF16, 1, AN, AN, a, ms64, base + W_OFF, ref) == 0);
        moek_to_f32(MOEK_DTYPE_BF16, out, got, AN);
        moek_to_f32(MOEK_DTYPE_BF16, ref, want, AN);
        CHECK(moek_rel_error(got, want, AN) < 2e-2);
    }
    return cpu;
}

/* A client of its own with a region and layer "g1" loaded from it. */
static void gemm_layer_load(struct daemon_here *d, const char *name, moe_client **c,
                            moe_region **r, uint64_t *seed)
{
    CHECK_MSG(moe_connect(d->cfg.runtime_dir, name, c) == 0, "%s", moe_errmsg());
    CHECK_MSG(moe_region_create(*c, C_OFF + AN * 2, name, r) == 0, "%s", moe_errmsg());
    *(uint8_t *)moe_region_data(*r) = 0x5a;
    uint16_t *w = (uint16_t *)((uint8_t *)moe_region_data(*r) + W_OFF);
    for (int i = 0; i < AN * AN; i++)
        w[i] = moek_f32_to_bf16(test_randf(seed) * 0.3f);
    moe_layer_desc gd = {.name = "g1", .kind = MOE_LAYER_GEMM, .dtype = MOE_DTYPE_BF16,
                         .groups = 1, .n = AN, .k = AN,
                         .w1 = moe_tensor_3d(*r, W_OFF, MOE_DTYPE_BF16, 1, AN, AN)};
    CHECK_MSG(moe_layer_load(*c, &gd, NULL) == 0, "%s", moe_errmsg());
}

TEST(a_client_spinning_ahead_spins_around_its_replies_time_only)
{
    struct daemon_here d;
    atomic_store(&pin_ms, 0);
    daemon_start(&d);
    cpu_gemm_run = d.ops.gemm_run;
    d.ops.gemm_run = slow_gemm_run;
    atomic_store(&gemm_ms, 40);
    moe_client *c = NULL;
    moe_region *r = NULL;
    uint64_t seed = 0x5eed5;
    gemm_layer_load(&d, "ahead", &c, &r, &seed);
    /* Sleeping waits (these also time the round trip, about 40 ms). */
    uint64_t cpu_off = spin_gemms(c, r, 4, &seed);
    /* Spinning from 15 ms before the reply is due: some 15 ms a call. */
    moe_set_spin_ahead_us(c, 15000);
    uint64_t cpu_on = spin_gemms(c, r, 4, &seed);
    /* A reply 110 ms late: spun for up to 30 ms (the window), then slept
     * for, where a whole wait's spin would take 150 ms. */
    atomic_store(&gemm_ms, 150);
    uint64_t cpu_late = spin_gemms(c, r, 1, &seed);
    fprintf(stderr, "  client CPU: 4 sleeping waits %llu us, 4 spinning ahead %llu us, "
            "a late reply %llu us\n", (unsigned long long)cpu_off, (unsigned long long)cpu_on,
            (unsigned long long)cpu_late);
    CHECK_MSG(cpu_off < 8000, "sleeping waits took %llu us of CPU", (unsigned long long)cpu_off);
    CHECK_MSG(cpu_on >= 15000, "4 waits spinning ahead took only %llu us of CPU",
              (unsigned long long)cpu_on);
    CHECK_MSG(cpu_late < 75000, "a late reply's wait took %llu us of CPU",
              (unsigned long long)cpu_late);
    /* Off again: sleeping. */
    atomic_store(&gemm_ms, 40);
    moe_set_spin_ahead_us(c, 0);
    uint64_t cpu_again = spin_gemms(c, r, 2, &seed);
    CHECK_MSG(cpu_again < 4000, "sleeping waits took %llu us of CPU",
              (unsigned long long)cpu_again);
    CHECK_EQ_INT(moe_region_free(c, &r), 0);
    moe_disconnect(&c);
    daemon_stop(&d);
    CHECK_NO_LEAKS();
}

/* ---- a batch the backend fails -----------------------------------------
 *
 * The backend's GEMM fails (as a device's run can): the batch's client
 * hears the backend's own reason where it gives one, the output is not
 * touched, and the daemon goes on serving.
 */
static atomic_int gemm_failures;           /* the next this many GEMM runs fail */
static _Atomic(const char *) gemm_fail_why; /* the backend's text for it, or NULL */

static int failing_gemm_run(struct backend *b, void *handle, const void *a,
                            const int64_t *m_sizes, int64_t m, void *c)
{
    if (atomic_load(&gemm_failures) > 0) {
        atomic_fetch_sub(&gemm_failures, 1);
        return -EIO;
    }
    return cpu_gemm_run(b, handle, a, m_sizes, m, c);
}

static const char *failing_last_error(struct backend *b)
{
    (void)b;
    return atomic_load(&gemm_fail_why);
}

/* One GEMM that the backend fails: its message, and its output untouched. */
static void failed_gemm(moe_client *c, moe_region *r, char *msg, size_t len)
{
    uint8_t *base = moe_region_data(r);
    uint16_t *out = (uint16_t *)(base + C_OFF);
    for (int j = 0; j < AN; j++)
        out[j] = 0x7fc1;
    uint64_t ms[1] = {1};
    moe_gemm_args ga = {.layer = "g1", .a = moe_tensor_2d(r, A_OFF, MOE_DTYPE_BF16, 1, AN),
                        .c = moe_tensor_2d(r, C_OFF, MOE_DTYPE_BF16, 1, AN), .m_sizes = ms,
                        .groups = 1};
    atomic_store(&gemm_failures, 1);
    CHECK_EQ_INT(moe_gemm(c, &ga, NULL), -EIO);
    snprintf(msg, len, "%s", moe_errmsg());
    CHECK_EQ_INT(atomic_load(&gemm_failures), 0);
    for (int j = 0; j < AN; j++)
        CHECK_MSG(out[j] == 0x7fc1, "output %d written: %#x", j, out[j]);
}

TEST(a_batch_the_backend_fails_says_why_and_the_next_runs)
{
    struct daemon_here d;
    atomic_store(&pin_ms, 0);
    daemon_start(&d);
    cpu_gemm_run = d.ops.gemm_run;
    d.ops.gemm_run = failing_gemm_run;
    d.ops.last_error = failing_last_error;
    moe_client *c = NULL;
    moe_region *r = NULL;
    uint64_t seed = 0xfa11;
    gemm_layer_load(&d, "fails", &c, &r, &seed);
    char msg[512];
    atomic_store(&gemm_fail_why, "the device's run failed: illegal address");
    failed_gemm(c, r, msg, sizeof(msg));
    CHECK_STR_CONTAINS(msg, "cpu backend failed: ");
    CHECK_STR_CONTAINS(msg, strerror(EIO));
    CHECK_STR_CONTAINS(msg, " (the device's run failed: illegal address)");
    /* No reason from the backend: no empty parentheses. */
    atomic_store(&gemm_fail_why, NULL);
    failed_gemm(c, r, msg, sizeof(msg));
    CHECK_STR_CONTAINS(msg, "cpu backend failed: ");
    CHECK_MSG(strchr(msg, '(') == NULL, "%s", msg);
    /* The daemon serves on: the next GEMMs are computed, and checked. */
    spin_gemms(c, r, 2, &seed);
    CHECK_EQ_INT(moe_region_free(c, &r), 0);
    moe_disconnect(&c);
    daemon_stop(&d);
    CHECK_NO_LEAKS();
}

/* ---- stress -------------------------------------------------------------
 *
 * For ten seconds, at random: regions created and freed (up to and past
 * max_pinned_bytes) by three threads sharing one client and two clients of
 * their own (which also reconnect, dropping what they hold), hellos,
 * grouped GEMMs over a layer uploaded from a region (some with their
 * region freed while the request is in flight), and raw sessions that
 * register regions and go mid-pin; every pin takes 0 to 30 ms and one in
 * five fails (0 to 10 ms an unpin). Every call must succeed; no pin may
 * take the driver past max_pinned_bytes. Then the counts must agree: the
 * daemon's pinned bytes with the regions it holds pinned and with the
 * driver's, nothing left to unpin, no session paused, and nothing pinned
 * once the server is freed. A second case restarts the daemon three times
 * meanwhile. STRESS_SEED=n repeats a run's choices (not its timing).
 */
#define STRESS_MAXP (6u << 20)
#define SG 4  /* the GEMM layer: groups, n, k */
#define SN 16
#define SK 32
#define SMAXM 8
#define STRESS_SHARED 3
#define STRESS_OWN 2
#define STRESS_HELD 4

enum { OP_CREATE, OP_FREE, OP_HELLO, OP_GEMM, OP_GEMM_FREED, OP_RECONNECT, OP_RAW, OP_N };
static const char *const op_names[OP_N] = {"create", "free", "hello", "gemm",
                                          "gemm-freed", "reconnect", "raw"};

struct stress {
    struct daemon_here *d;
    /* The daemon restarts meanwhile: a call may also fail with
     * -ECONNRESET (the daemon went) or -ECONNREFUSED (it is not back yet),
     * as moe.h says; GEMMs are left out (the layer goes with the daemon). */
    bool restarts;
    char dir[64];
    uint64_t deadline_ms;
    moe_client *shared;
    pthread_mutex_t mu; /* pool, first_bad */
    moe_region *pool[8]; /* the shared client's regions, for any of its threads to free */
    int n_pool;
    uint16_t b[SG * SN * SK]; /* the layer's weights, bf16 */
    atomic_int ops[OP_N];
    atomic_int bad;
    atomic_int lost; /* calls that met a restart */
    char first_bad[512];
};

struct stress_thread {
    struct stress *st;
    int idx;
    bool own; /* a client of its own, which it may drop and make again */
    moe_client *c;
    uint64_t seed;
    moe_region *held[STRESS_HELD];
    int n_held;
    moe_region *gr; /* its GEMM's operands */
    pthread_t t;
};

static void stress_bad(struct stress *st, int idx, const char *what, int rc)
{
    if (st->restarts && (rc == -ECONNRESET || rc == -ECONNREFUSED)) {
        atomic_fetch_add(&st->lost, 1);
        sleep_ms(2); /* not back yet: a moment's pause */
        return;
    }
    char msg[512];
    snprintf(msg, sizeof(msg), "thread %d: %s: %d (%s): %s", idx, what, rc, moe_strerror(rc),
             moe_errmsg());
    pthread_mutex_lock(&st->mu);
    if (atomic_fetch_add(&st->bad, 1) == 0)
        snprintf(st->first_bad, sizeof(st->first_bad), "%s", msg);
    pthread_mutex_unlock(&st->mu);
    fprintf(stderr, "  %s\n", msg);
}

static size_t stress_size(uint64_t *seed)
{
    static const size_t sizes[] = {4096, 65536, 1 << 20, STRESS_MAXP / 2,
                                   STRESS_MAXP - 4096, STRESS_MAXP, STRESS_MAXP + 4096};
    uint64_t r = test_rand(seed);
    if (r % 4 == 0)
        return 1 + (size_t)(r >> 8) % (256 << 10);
    return sizes[(r >> 8) % ARRAY_LEN(sizes)];
}

#define GEMM_C_OFF ((SMAXM * SK * 2 + 63) & ~(size_t)63)
#define GEMM_BYTES (GEMM_C_OFF + SMAXM * SN * 2)

/* A [M, SK] at 0 and C [M, SN] at GEMM_C_OFF of r, A filled; rows split
 * over the groups at random. */
static size_t gemm_setup(struct stress_thread *th, moe_region *r, uint64_t ms[SG])
{
    size_t M = 1 + test_rand(&th->seed) % SMAXM;
    uint16_t *a = moe_region_data(r);
    for (size_t i = 0; i < M * SK; i++)
        a[i] = moek_f32_to_bf16(test_randf(&th->seed));
    memset(ms, 0, sizeof(uint64_t) * SG);
    for (size_t i = 0; i < M; i++)
        ms[test_rand(&th->seed) % SG]++;
    return M;
}

static moe_gemm_args gemm_args(moe_region *r, size_t M, const uint64_t ms[SG])
{
    return (moe_gemm_args){.layer = "g", .a = moe_tensor_2d(r, 0, MOE_DTYPE_BF16, M, SK),
                           .c = moe_tensor_2d(r, GEMM_C_OFF, MOE_DTYPE_BF16, M, SN),
                           .m_sizes = ms, .groups = SG};
}

static void stress_gemm(struct stress_thread *th)
{
    struct stress *st = th->st;
    int rc;
    if (!th->gr && (rc = moe_region_create(th->c, GEMM_BYTES, "gemm", &th->gr)) != 0) {
        stress_bad(st, th->idx, "moe_region_create (gemm)", rc);
        return;
    }
    uint64_t ms[SG];
    size_t M = gemm_setup(th, th->gr, ms);
    moe_gemm_args ga = gemm_args(th->gr, M, ms);
    if ((rc = moe_gemm(th->c, &ga, NULL)) != 0) {
        stress_bad(st, th->idx, "moe_gemm", rc);
        return;
    }
    int64_t ms64[SG];
    for (int g = 0; g < SG; g++)
        ms64[g] = (int64_t)ms[g];
    uint8_t *base = moe_region_data(th->gr);
    uint16_t ref[SMAXM * SN];
    float got[SMAXM * SN], want[SMAXM * SN];
    CHECK(moek_ref_grouped_gemm(MOEK_DTYPE_BF16, SG, SN, SK, base, ms64, st->b, ref) == 0);
    moek_to_f32(MOEK_DTYPE_BF16, base + GEMM_C_OFF, got, M * SN);
    moek_to_f32(MOEK_DTYPE_BF16, ref, want, M * SN);
    double err = moek_rel_error(got, want, M * SN);
    if (!(err < 2e-2))
        stress_bad(st, th->idx, "moe_gemm: wrong result", (int)(err * 1000));
}

/* Its region freed while the request is in flight: the daemon holds it
 * until the request ends. The free can also reach the daemon first (by
 * another socket): then the request names no region, -ENOENT. */
static void stress_gemm_freed(struct stress_thread *th)
{
    struct stress *st = th->st;
    moe_region *r = NULL;
    int rc = moe_region_create(th->c, GEMM_BYTES, "gemm-freed", &r);
    if (rc) {
        stress_bad(st, th->idx, "moe_region_create (gemm-freed)", rc);
        return;
    }
    uint64_t ms[SG];
    size_t M = gemm_setup(th, r, ms);
    moe_gemm_args ga = gemm_args(r, M, ms);
    moe_request *req = NULL;
    if ((rc = moe_gemm_submit(th->c, &ga, &req)) != 0)
        stress_bad(st, th->idx, "moe_gemm_submit", rc);
    if ((rc = moe_region_free(th->c, &r)) != 0)
        stress_bad(st, th->idx, "moe_region_free (gemm-freed)", rc);
    if (req && (rc = moe_wait(th->c, &req, -1, NULL)) != 0 && rc != -ENOENT)
        stress_bad(st, th->idx, "moe_wait (gemm-freed)", rc);
}

static void stress_create(struct stress_thread *th)
{
    struct stress *st = th->st;
    moe_region *r = NULL;
    size_t size = stress_size(&th->seed);
    int rc = moe_region_create(th->c, size, "stress", &r);
    if (rc) {
        stress_bad(st, th->idx, "moe_region_create", rc);
        return;
    }
    ((unsigned char *)moe_region_data(r))[size - 1] = 0x5a;
    if (!th->own && test_rand(&th->seed) % 2) {
        pthread_mutex_lock(&st->mu);
        if (st->n_pool < (int)ARRAY_LEN(st->pool)) {
            st->pool[st->n_pool++] = r;
            r = NULL;
        }
        pthread_mutex_unlock(&st->mu);
        if (!r)
            return;
    }
    if (th->n_held < STRESS_HELD) {
        th->held[th->n_held++] = r;
        return;
    }
    if ((rc = moe_region_free(th->c, &r)) != 0)
        stress_bad(st, th->idx, "moe_region_free (over)", rc);
}

static void stress_free(struct stress_thread *th)
{
    struct stress *st = th->st;
    moe_region *r = NULL;
    if (!th->own && test_rand(&th->seed) % 2) {
        pthread_mutex_lock(&st->mu);
        if (st->n_pool) {
            int i = (int)(test_rand(&th->seed) % (uint64_t)st->n_pool);
            r = st->pool[i];
            st->pool[i] = st->pool[--st->n_pool];
        }
        pthread_mutex_unlock(&st->mu);
    }
    if (!r && th->n_held) {
        int i = (int)(test_rand(&th->seed) % (uint64_t)th->n_held);
        r = th->held[i];
        th->held[i] = th->held[--th->n_held];
    }
    int rc;
    if (r && (rc = moe_region_free(th->c, &r)) != 0)
        stress_bad(st, th->idx, "moe_region_free", rc);
}

static void *stress_client(void *arg)
{
    struct stress_thread *th = arg;
    struct stress *st = th->st;
    int rc;
    while (ms_now() < st->deadline_ms) {
        if (!th->c) { /* its reconnection met a restart */
            if ((rc = moe_connect(st->dir, "own", &th->c)) != 0) {
                stress_bad(st, th->idx, "moe_connect", rc);
                sleep_ms(10);
                continue;
            }
            moe_set_timeout(th->c, 30000);
        }
        uint64_t r = test_rand(&th->seed) % 100;
        int op = r < 30 ? OP_CREATE : r < 52 ? OP_FREE : r < 67 ? OP_HELLO : r < 85 ? OP_GEMM
                 : r < 96 ? OP_GEMM_FREED : th->own ? OP_RECONNECT : OP_HELLO;
        if (st->restarts && (op == OP_GEMM || op == OP_GEMM_FREED))
            op = OP_HELLO;
        atomic_fetch_add(&st->ops[op], 1);
        switch (op) {
        case OP_CREATE:
            stress_create(th);
            break;
        case OP_FREE:
            stress_free(th);
            break;
        case OP_HELLO:
            if ((rc = moe_hello(th->c, NULL)) != 0)
                stress_bad(st, th->idx, "moe_hello", rc);
            break;
        case OP_GEMM:
            stress_gemm(th);
            break;
        case OP_GEMM_FREED:
            stress_gemm_freed(th);
            break;
        case OP_RECONNECT: /* what it holds goes with the session */
            moe_disconnect(&th->c);
            th->n_held = 0;
            th->gr = NULL;
            if ((rc = moe_connect(st->dir, "own", &th->c)) != 0)
                stress_bad(st, th->idx, "moe_connect", rc);
            else
                moe_set_timeout(th->c, 30000);
            break;
        }
    }
    return NULL;
}

/* Raw sessions that register one to four regions and go: at once (mid-pin),
 * a moment later, or after the answers (and one unregister). */
static void *stress_raw(void *arg)
{
    struct stress_thread *th = arg;
    struct stress *st = th->st;
    while (ms_now() < st->deadline_ms) {
        atomic_fetch_add(&st->ops[OP_RAW], 1);
        int fd = raw_session(st->dir);
        int k = 1 + (int)(test_rand(&th->seed) % 4);
        for (int i = 0; i < k; i++) {
            uint64_t r = test_rand(&th->seed);
            raw_register(fd, r % 3 == 0 ? STRESS_MAXP / 2 : 4096 + (size_t)(r >> 8) % (512 << 10));
        }
        uint64_t mode = test_rand(&th->seed) % 3;
        if (mode == 1)
            sleep_ms((int)(test_rand(&th->seed) % 40));
        if (mode == 2) {
            uint64_t id = 0;
            for (int i = 0; i < k; i++) {
                Moe__SessionReply *rep = raw_reply(fd);
                if (rep->status != MOE__STATUS__STATUS_OK || !rep->region)
                    stress_bad(st, th->idx, "raw register", -(int)rep->status);
                id = rep->region;
                moe__session_reply__free_unpacked(rep, NULL);
            }
            Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
            Moe__UnregisterRegion un = MOE__UNREGISTER_REGION__INIT;
            un.region = id;
            req.body_case = MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION;
            req.unregister_region = &un;
            uint8_t buf[256];
            size_t n = moe__session_request__pack(&req, buf);
            CHECK(send(fd, buf, n, 0) == (ssize_t)n);
            if (test_rand(&th->seed) % 2) {
                Moe__SessionReply *rep = raw_reply(fd);
                if (rep->status != MOE__STATUS__STATUS_OK || rep->region != id)
                    stress_bad(st, th->idx, "raw unregister", -(int)rep->status);
                moe__session_reply__free_unpacked(rep, NULL);
            }
        }
        close(fd);
    }
    return NULL;
}

/* The GEMM layer, uploaded from a region of the shared client. */
static void stress_layer(struct stress *st)
{
    moe_region *wr = NULL;
    CHECK_MSG(moe_region_create(st->shared, sizeof(st->b), "B", &wr) == 0, "%s", moe_errmsg());
    memcpy(moe_region_data(wr), st->b, sizeof(st->b));
    moe_layer_desc gd = {.name = "g", .kind = MOE_LAYER_GEMM, .dtype = MOE_DTYPE_BF16,
                         .groups = SG, .n = SN, .k = SK,
                         .w1 = moe_tensor_3d(wr, 0, MOE_DTYPE_BF16, SG, SN, SK)};
    CHECK_MSG(moe_layer_load(st->shared, &gd, NULL) == 0, "%s", moe_errmsg());
    CHECK_EQ_INT(moe_region_free(st->shared, &wr), 0);
}

/* restarts: the daemon is stopped and started again (on the same runtime
 * directory) this many times while the clients run; raw sessions and
 * GEMMs are left out then. */
static void stress_run(int restarts, uint64_t ms)
{
    const char *seed_env = getenv("STRESS_SEED");
    uint64_t seed = seed_env ? strtoull(seed_env, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)getpid();
    fprintf(stderr, "  seed %llu (STRESS_SEED)\n", (unsigned long long)seed);
    pin_rng = seed;
    pin_limit = STRESS_MAXP;
    atomic_store(&pin_random, true);
    static struct stress st;
    static struct daemon_here d;
    daemon_start_opts(&d, STRESS_MAXP, true, NULL);
    st.d = &d;
    st.restarts = restarts > 0;
    snprintf(st.dir, sizeof(st.dir), "%s", d.cfg.runtime_dir);
    pthread_mutex_init(&st.mu, NULL);
    CHECK_MSG(moe_connect(st.dir, "shared", &st.shared) == 0, "%s", moe_errmsg());
    moe_set_timeout(st.shared, 30000);
    uint64_t s2 = seed;
    for (size_t i = 0; i < ARRAY_LEN(st.b); i++)
        st.b[i] = moek_f32_to_bf16(test_randf(&s2) * 0.3f);
    if (!restarts)
        stress_layer(&st);

    enum { NT = STRESS_SHARED + STRESS_OWN + 1 };
    static struct stress_thread th[NT];
    int nt = restarts ? NT - 1 : NT; /* the raw sessions' thread last */
    uint64_t t0 = ms_now();
    st.deadline_ms = t0 + ms;
    for (int i = 0; i < nt; i++) {
        th[i] = (struct stress_thread){.st = &st, .idx = i, .seed = seed * 31 + (uint64_t)i + 1,
                                       .own = i >= STRESS_SHARED && i < NT - 1, .c = st.shared};
        if (th[i].own) {
            CHECK_MSG(moe_connect(st.dir, "own", &th[i].c) == 0, "%s", moe_errmsg());
            moe_set_timeout(th[i].c, 30000);
        }
        CHECK_EQ_INT(pthread_create(&th[i].t, NULL, i == NT - 1 ? stress_raw : stress_client,
                                    &th[i]), 0);
    }
    for (int k = 1; k <= restarts; k++) {
        /* At random times in the run's k-th slice: the daemon stops as
         * moed does (its server freed), the pins and unpins undone. */
        uint64_t slice = ms / ((uint64_t)restarts + 1);
        uint64_t at = t0 + slice * (uint64_t)k - slice / 2 + (seed >> (k * 7)) % (slice / 2);
        while (ms_now() < at)
            sleep_ms(5);
        d.settle_sessions = UINT32_MAX;
        daemon_halt(&d);
        daemon_free(&d); /* pins == unpins */
        CHECK_EQ_INT(atomic_load(&pinned_live), 0);
        sleep_ms((int)((seed >> (k * 5)) % 50));
        daemon_start_opts(&d, STRESS_MAXP, true, st.dir);
    }
    for (int i = 0; i < nt; i++) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += (time_t)(ms / 1000) + 60;
        int e = pthread_timedjoin_np(th[i].t, NULL, &until);
        CHECK_MSG(e == 0, "thread %d did not end (a call hung): %s", i, strerror(e));
    }
    fprintf(stderr, "  ops:");
    for (int i = 0; i < OP_N; i++)
        fprintf(stderr, " %s %d", op_names[i], atomic_load(&st.ops[i]));
    fprintf(stderr, "; pins %d, failed %d, unpins %d; %d calls met a restart\n",
            atomic_load(&pins), atomic_load(&pin_failures), atomic_load(&unpins),
            atomic_load(&st.lost));
    CHECK_MSG(atomic_load(&st.bad) == 0, "%d calls failed, the first: %s", atomic_load(&st.bad),
              st.first_bad);
    if (restarts) {
        /* After the last restart each client's next call reconnects and
         * registers its regions again. */
        int rc;
        for (int i = 0; i < nt; i++)
            if (th[i].c && (rc = moe_hello(th[i].c, NULL)) != 0)
                CHECK_MSG(rc == -ECONNRESET && moe_hello(th[i].c, NULL) == 0,
                          "thread %d's client: %d: %s", i, rc, moe_errmsg());
    }

    /* The regions the clients hold, each registered once. */
    unsigned held = (unsigned)st.n_pool;
    unsigned sessions = 1;
    for (int i = 0; i < STRESS_SHARED + STRESS_OWN; i++) {
        held += (unsigned)th[i].n_held + (th[i].gr != NULL);
        sessions += th[i].own && th[i].c;
    }
    d.settle_sessions = sessions;
    daemon_halt(&d);
    struct server *s = d.s;
    CHECK_EQ_INT(server_pending(s), 0);
    CHECK_EQ_INT(s->n_sessions, sessions);
    CHECK_EQ_INT(s->unpinning_bytes, 0);
    uint64_t pinned = 0;
    unsigned n_pinned = 0, regions = 0;
    for (struct session *se = s->sessions; se; se = se->next) {
        CHECK_MSG(!se->pinning, "session %llu left paused", (unsigned long long)se->id);
        CHECK_EQ_INT(se->n_retired, 0);
        unsigned n = 0;
        uint64_t bytes = 0;
        for (struct region *r = se->regions; r; r = r->next) {
            n++;
            bytes += r->size;
            if (r->pin_cookie) {
                n_pinned++;
                pinned += r->size;
            }
        }
        CHECK_EQ_INT(n, se->n_regions);
        CHECK_EQ_INT(bytes, se->region_bytes);
        regions += n;
    }
    CHECK_EQ_INT(regions, held);
    CHECK_EQ_INT(s->pinned_bytes, pinned);
    CHECK_EQ_INT(atomic_load(&pinned_live), (long long)pinned);
    CHECK_EQ_INT(atomic_load(&pins) - atomic_load(&unpins), n_pinned);
    CHECK_EQ_INT(atomic_load(&pin_over_limit), 0);
    CHECK_EQ_INT(atomic_load(&unpin_unknown), 0);
    fprintf(stderr, "  at the end: %u sessions, %u regions, %u pinned (%llu bytes)\n", sessions,
            regions, n_pinned, (unsigned long long)pinned);
    daemon_free(&d); /* pins == unpins */
    CHECK_EQ_INT(atomic_load(&pinned_live), 0);
    CHECK_EQ_INT(atomic_load(&unpin_unknown), 0);
    for (int i = STRESS_SHARED; i < STRESS_SHARED + STRESS_OWN; i++)
        moe_disconnect(&th[i].c);
    moe_disconnect(&st.shared);
    pthread_mutex_destroy(&st.mu);
    CHECK_NO_LEAKS();
}

TEST(stress_regions_gemms_and_raw_sessions_under_random_pins)
{
    stress_run(0, 10000);
}

TEST(stress_regions_across_daemon_restarts_under_random_pins)
{
    stress_run(3, 6000);
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
        TEST_CASE(a_region_create_timed_out_during_its_pin_leaves_the_client_usable),
        TEST_CASE(a_reconnection_does_not_hold_up_the_clients_other_threads),
        TEST_CASE(a_reconnection_into_a_full_backlog_does_not_hold_up_the_clients_other_threads),
        TEST_CASE(a_client_spinning_ahead_spins_around_its_replies_time_only),
        TEST_CASE(a_batch_the_backend_fails_says_why_and_the_next_runs),
        TEST_CASE_TIMEOUT(stress_regions_gemms_and_raw_sessions_under_random_pins, 180),
        TEST_CASE_TIMEOUT(stress_regions_across_daemon_restarts_under_random_pins, 180),
        {0}});
}
