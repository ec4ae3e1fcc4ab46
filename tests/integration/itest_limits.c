/*
 * itest_limits.c: every limit of [limits] is hit, and each answers with an
 * explicit error while the daemon keeps serving everyone else: sessions,
 * regions per session, bytes per region and per session, queued requests and
 * tokens per session, queued requests in all, message size, pending messages
 * per connection, layers, and loads in flight.
 */
#include <pthread.h>
#include <signal.h>

#include "tests/integration/raw.h"

static struct itest_layer big_layer(void)
{
    struct itest_layer L = {.name = "L", .dt = MOE_DTYPE_BF16, .sh = {8, 2, 256, 512},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    return L;
}

/* A forward of T tokens of layer L in region reg of r: x at 0, logits and
 * out after it. */
struct fwd {
    Moe__Request req;
    Moe__FusedMoe fm;
    Moe__Tensor x, lg, out;
    uint64_t sx[2], sl[2];
};

static void fwd_init(struct fwd *f, const struct itest_layer *L, uint64_t reg, uint64_t T)
{
    uint64_t H = (uint64_t)L->sh.hidden, E = (uint64_t)L->sh.experts;
    moe__request__init(&f->req);
    moe__fused_moe__init(&f->fm);
    f->sx[0] = f->sl[0] = T;
    f->sx[1] = H;
    f->sl[1] = E;
    f->x = raw_tensor(reg, 0, MOE__DTYPE__DTYPE_BF16, f->sx, 2);
    f->lg = raw_tensor(reg, (T * H * 2 + 63) & ~63ull, MOE__DTYPE__DTYPE_FP32, f->sl, 2);
    f->out = raw_tensor(reg, ((T * H * 2 + 63) & ~63ull) + ((T * E * 4 + 63) & ~63ull),
                        MOE__DTYPE__DTYPE_BF16, f->sx, 2);
    f->fm.layer = (char *)L->name;
    f->fm.x = &f->x;
    f->fm.logits = &f->lg;
    f->fm.out = &f->out;
    f->req.body_case = MOE__REQUEST__BODY_FUSED_MOE;
    f->req.fused_moe = &f->fm;
}

static size_t fwd_bytes(const struct itest_layer *L, uint64_t T)
{
    uint64_t H = (uint64_t)L->sh.hidden, E = (uint64_t)L->sh.experts;
    return ((T * H * 2 + 63) & ~63ull) + ((T * E * 4 + 63) & ~63ull) + T * H * 2;
}

/* Occupy the device: a long request of its own session that runs alone in
 * one batch (the daemon runs with --max-slice-tokens 4096). Returns once the
 * batch has surely started. */
static void block_device(struct raw *b, const struct itest_layer *L)
{
    uint64_t reg = raw_region(b, fwd_bytes(L, 4096), NULL);
    static struct fwd f;
    fwd_init(&f, L, reg, 4096);
    f.req.no_batch = 1;
    CHECK(raw_send(b, &f.req) == 0);
    itest_sleep_ms(20);
}

/* Receive n replies; count those with each status. */
static void recv_n(struct raw *r, int n, int *count_by_status, char *last_busy, size_t len)
{
    for (int i = 0; i < n; i++) {
        Moe__Reply *rep = raw_recv(r);
        CHECK((int)rep->status < 16);
        count_by_status[rep->status]++;
        if (rep->status == MOE__STATUS__STATUS_BUSY && last_busy)
            snprintf(last_busy, len, "%s", rep->message);
        moe__reply__free_unpacked(rep, NULL);
    }
}

struct late_connect {
    const char *dir;
    int rc;
    char msg[256];
};

static void *late_connect_main(void *arg)
{
    struct late_connect *lc = arg;
    moe_client *c = NULL;
    lc->rc = moe_connect(lc->dir, "late", &c);
    snprintf(lc->msg, sizeof(lc->msg), "%s", moe_errmsg());
    moe_disconnect(&c);
    return NULL;
}

TEST(sessions_are_capped)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", itest_write_conf("[limits]\nmax_sessions = 3\n"), NULL);
    struct raw r[4];
    /* The start-up probe's session may not be gone yet: retry. */
    for (int i = 0; i < 3; i++) {
        int st = 0;
        for (int tries = 0; tries < 100; tries++) {
            memset(&r[i], 0, sizeof(r[i]));
            CHECK(raw_connect_session(&r[i], d.dir) == 0);
            st = raw_open_session_try(&r[i]);
            if (st == 0)
                break;
            close(r[i].sfd);
            itest_sleep_ms(20);
        }
        CHECK_EQ_INT(st, 0);
    }
    /* The fourth is told why as soon as it connects, then closed. */
    memset(&r[3], 0, sizeof(r[3]));
    CHECK(raw_connect_session(&r[3], d.dir) == 0);
    uint8_t buf[512];
    ssize_t n = recv(r[3].sfd, buf, sizeof(buf), 0);
    CHECK(n > 0);
    Moe__SessionReply *rep = moe__session_reply__unpack(NULL, (size_t)n, buf);
    CHECK(rep != NULL);
    CHECK_EQ_INT(rep->status, MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_STR_CONTAINS(rep->message, "too many sessions (limit 3)");
    moe__session_reply__free_unpacked(rep, NULL);
    CHECK_EQ_INT(recv(r[3].sfd, buf, sizeof(buf), 0), 0);
    close(r[3].sfd);
    /* libmoe says the daemon's reason, whether the refusal comes before
     * its OpenSession is sent or after (a busy daemon accepts late, and
     * closes with the request unread: the reset is reported first). */
    moe_client *c = NULL;
    CHECK_EQ_INT(moe_connect(d.dir, "fourth", &c), -EDQUOT);
    CHECK_STR_CONTAINS(moe_errmsg(), "too many sessions (limit 3)");
    for (int i = 0; i < 3; i++) {
        struct late_connect lc = {.dir = d.dir};
        pthread_t t;
        kill(d.pid, SIGSTOP);
        CHECK(pthread_create(&t, NULL, late_connect_main, &lc) == 0);
        itest_sleep_ms(100); /* its OpenSession is sent, unaccepted */
        kill(d.pid, SIGCONT);
        CHECK(pthread_join(t, NULL) == 0);
        CHECK_EQ_INT(lc.rc, -EDQUOT);
        CHECK_STR_CONTAINS(lc.msg, "too many sessions (limit 3)");
    }
    /* One leaves, one more gets in. */
    close(r[0].sfd);
    int rc = -1;
    for (int tries = 0; tries < 100 && rc != 0; tries++) {
        if (tries)
            itest_sleep_ms(20);
        rc = moe_connect(d.dir, "fourth", &c);
    }
    CHECK_MSG(rc == 0, "%s", moe_errmsg());
    moe_disconnect(&c);
    close(r[1].sfd);
    close(r[2].sfd);
    itest_daemon_stop(&d);
}

TEST(regions_and_mapped_bytes_are_capped)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--config",
                       itest_write_conf("[limits]\nmax_regions = 3\nmax_region_bytes = 1048576\n"
                                  "max_session_bytes = 2097152\n"),
                       NULL);
    struct raw r;
    raw_open(&r, d.dir, true);
    char msg[256];
    uint64_t id, ids[3];
    CHECK_EQ_INT(raw_region_try(&r, (1 << 20) + 4096, NULL, &id, msg, sizeof(msg)),
                 MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_STR_CONTAINS(msg, "over the per-region limit");
    ids[0] = raw_region(&r, 1 << 20, NULL);
    ids[1] = raw_region(&r, (1 << 20) - 4096, NULL);
    CHECK_EQ_INT(raw_region_try(&r, 8192, NULL, &id, msg, sizeof(msg)),
                 MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_STR_CONTAINS(msg, "exceed the session's 2097152 mapped bytes");
    ids[2] = raw_region(&r, 4096, NULL);
    CHECK_EQ_INT(raw_region_try(&r, 4096, NULL, &id, msg, sizeof(msg)),
                 MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_STR_CONTAINS(msg, "3 regions, the limit");
    /* Quotas are the session's: another one is not affected, and freeing
     * gives the room back. */
    struct raw o;
    raw_open(&o, d.dir, true);
    raw_region(&o, 1 << 20, NULL);
    CHECK_EQ_INT(raw_unregister(&r, ids[0]), 0);
    raw_region(&r, 1 << 20, NULL);
    raw_close(&o);
    raw_close(&r);
    itest_daemon_stop(&d);
}

/* A region unregistered while a request of its session still uses it stays
 * mapped until that request ends, and counts against max_regions and
 * max_session_bytes until then: unregistering and registering again cannot
 * map more than the limits while requests are queued. */
TEST(unregistered_regions_count_until_their_requests_end)
{
    if (itest_on_gpu())
        TEST_SKIP("block_device's request must outlast the session calls: sized for the CPU");
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, "--max-slice-tokens", "4096", "--config",
                       itest_write_conf("[limits]\nmax_regions = 2\nmax_session_bytes = 8388608\n"), NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = big_layer();
    itest_layer_upload(c, &L, &seed);
    struct raw blocker, r;
    raw_open(&blocker, d.dir, true);
    raw_open(&r, d.dir, true);
    raw_hello(&r);
    void *base;
    uint64_t ra = raw_region(&r, 4 << 20, &base);
    itest_fill(&seed, MOE_DTYPE_BF16, base, 64 * 256, 1.0f);
    itest_fill(&seed, MOE_DTYPE_FP32, (uint8_t *)base + 64 * 256 * 2, 64 * 8, 1.0f);
    struct fwd f;
    fwd_init(&f, &L, ra, 64);

    /* The forward waits behind another session's long one; a Hello after
     * it on the same socket, answered, says the daemon holds it. */
    block_device(&blocker, &L);
    CHECK(raw_send(&r, &f.req) == 0);
    uint64_t fwd_id = f.req.id;
    raw_hello(&r);
    CHECK_EQ_INT(raw_unregister(&r, ra), 0);

    char msg[256];
    uint64_t id;
    CHECK_EQ_INT(raw_region_try(&r, 8 << 20, NULL, &id, msg, sizeof(msg)),
                 MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_STR_CONTAINS(msg, "exceed the session's 8388608 mapped bytes (counting regions "
                            "unregistered that requests in flight still use)");
    raw_region(&r, 4 << 20, NULL);
    CHECK_EQ_INT(raw_region_try(&r, 4096, NULL, &id, msg, sizeof(msg)),
                 MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_STR_CONTAINS(msg, "2 regions, the limit (counting");

    /* The forward still reads and writes its region, and answers; then the
     * room comes back (the last reference may go just after the reply). */
    Moe__Reply *rep = raw_recv(&r);
    CHECK(rep->id == fwd_id);
    CHECK_MSG(rep->status == 0, "forward: %s", rep->message);
    moe__reply__free_unpacked(rep, NULL);
    int st = -1;
    for (int i = 0; i < 100 && st != 0; i++) {
        st = raw_region_try(&r, 4096, NULL, &id, msg, sizeof(msg));
        if (st)
            itest_sleep_ms(20);
    }
    CHECK_MSG(st == 0, "the region's room did not come back: %s", msg);
    rep = raw_recv(&blocker);
    CHECK_EQ_INT((int)rep->status, 0);
    moe__reply__free_unpacked(rep, NULL);
    raw_close(&blocker);
    raw_close(&r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

TEST(queues_are_capped_per_session_and_in_all)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, "--max-slice-tokens", "4096", "--config",
                       itest_write_conf("[limits]\nmax_queued_requests = 4\nmax_queued_tokens = 8192\n"
                                  "max_queued_total = 6\n"),
                       NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = big_layer();
    itest_layer_upload(c, &L, &seed);
    struct raw blocker, a, b;
    raw_open(&blocker, d.dir, true);
    raw_open(&a, d.dir, true);
    raw_open(&b, d.dir, true);
    void *base;
    uint64_t ra = raw_region(&a, fwd_bytes(&L, 8193), &base);
    uint64_t rb = raw_region(&b, fwd_bytes(&L, 1), NULL);
    itest_fill(&seed, MOE_DTYPE_BF16, base, 8193 * 256, 1.0f);
    struct fwd fa, fb, big;
    fwd_init(&fa, &L, ra, 1);
    fwd_init(&fb, &L, rb, 1);

    /* Larger than a session's whole queue: refused for good, not BUSY. */
    fwd_init(&big, &L, ra, 8193);
    raw_expect(&a, &big.req, MOE__STATUS__STATUS_RESOURCE_EXHAUSTED, "max_queued_tokens 8192");

    /* Per session: with the device busy, 10 requests, 4 queue. */
    int st[16] = {0};
    char busy[256] = "";
    block_device(&blocker, &L);
    for (int i = 0; i < 10; i++)
        CHECK(raw_send(&a, &fa.req) == 0);
    recv_n(&a, 10, st, busy, sizeof(busy));
    fprintf(stderr, "  per session: %d ok, %d busy (%s)\n", st[0], st[MOE__STATUS__STATUS_BUSY],
            busy);
    CHECK_EQ_INT(st[0] + st[MOE__STATUS__STATUS_BUSY], 10);
    CHECK_MSG(st[MOE__STATUS__STATUS_BUSY] >= 5, "%d of 10 refused", st[MOE__STATUS__STATUS_BUSY]);
    CHECK_STR_CONTAINS(busy, "session queue full");
    Moe__Reply *rep = raw_recv(&blocker);
    CHECK_EQ_INT(rep->status, 0);
    moe__reply__free_unpacked(rep, NULL);

    /* Queued tokens per session: 5000 + 5000 > 8192. */
    memset(st, 0, sizeof(st));
    fwd_init(&big, &L, ra, 5000);
    block_device(&blocker, &L);
    CHECK(raw_send(&a, &big.req) == 0);
    CHECK(raw_send(&a, &big.req) == 0);
    recv_n(&a, 2, st, busy, sizeof(busy));
    CHECK_EQ_INT(st[MOE__STATUS__STATUS_BUSY], 1);
    CHECK_STR_CONTAINS(busy, "5000 tokens queued");
    rep = raw_recv(&blocker);
    moe__reply__free_unpacked(rep, NULL);

    /* In all: a queues its 4, then b gets 2 of its 4 in (6 in all). */
    memset(st, 0, sizeof(st));
    block_device(&blocker, &L);
    for (int i = 0; i < 4; i++)
        CHECK(raw_send(&a, &fa.req) == 0);
    raw_hello(&a); /* a's four are in the queue */
    for (int i = 0; i < 4; i++)
        CHECK(raw_send(&b, &fb.req) == 0);
    recv_n(&b, 4, st, busy, sizeof(busy));
    fprintf(stderr, "  in all: b %d ok, %d busy (%s)\n", st[0], st[MOE__STATUS__STATUS_BUSY], busy);
    CHECK_EQ_INT(st[MOE__STATUS__STATUS_BUSY], 2);
    CHECK_STR_CONTAINS(busy, "daemon queue full (6 requests queued");
    memset(st, 0, sizeof(st));
    recv_n(&a, 4, st, NULL, 0);
    CHECK_EQ_INT(st[0], 4);
    rep = raw_recv(&blocker);
    moe__reply__free_unpacked(rep, NULL);
    moe_stats s;
    CHECK(moe_stats_get(c, &s) == 0);
    CHECK_EQ_INT(s.queue_depth, 0);
    raw_close(&blocker);
    raw_close(&a);
    raw_close(&b);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* ZeroMQ drops a connection whose message is over ZMQ_MAXMSGSIZE (there is
 * no way to answer it); the Hello reply advertises the limit so that clients
 * can check before they send. The connection comes back and is served. */
TEST(message_size_is_capped)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", itest_write_conf("[limits]\nmax_message_bytes = 4096\n"), NULL);
    moe_client *c = itest_connect(&d, "itest");
    moe_server_info info;
    CHECK(moe_hello(c, &info) == 0);
    CHECK_EQ_INT(info.max_message_bytes, 4096);
    struct raw r;
    raw_open(&r, d.dir, true);
    raw_hello(&r);
    static uint8_t junk[8192];
    memset(junk, 0x80, sizeof(junk));
    raw_expect_bytes(&r, junk, 4000, MOE__STATUS__STATUS_PROTOCOL, "could not be decoded");
    int to = 500;
    zmq_setsockopt(r.zsock, ZMQ_RCVTIMEO, &to, sizeof(to));
    CHECK(zmq_send(r.zsock, junk, 5000, 0) == 5000);
    CHECK_MSG(raw_recv_try(&r) == NULL, "a message over the limit was answered");
    to = 5000;
    zmq_setsockopt(r.zsock, ZMQ_RCVTIMEO, &to, sizeof(to));
    raw_hello(&r); /* reconnected, served */
    CHECK(moe_hello(c, &info) == 0);
    raw_close(&r);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* A client that sends and never reads: its replies wait in the daemon only
 * up to max_pending_messages (then ZeroMQ drops them), so the daemon's memory
 * stays flat and everyone else is served meanwhile. */
TEST(pending_replies_are_capped)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_asan_small_quarantine();
    itest_daemon_start(&d, "--config", itest_write_conf("[limits]\nmax_pending_messages = 16\n"), NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = {.name = "s", .dt = MOE_DTYPE_BF16, .sh = {4, 2, 32, 64},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    itest_layer_upload(c, &L, &seed);
    struct raw r;
    raw_open(&r, d.dir, true);
    /* The flooder reads nothing, and its own queue and socket buffer are
     * tiny (set before it connects: ZeroMQ applies them to new pipes). */
    zmq_close(r.zsock);
    r.zsock = zmq_socket(r.zctx, ZMQ_DEALER);
    int zero = 0, one = 1, small = 4096, sndto = 2000, rcvto = 5000;
    zmq_setsockopt(r.zsock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(r.zsock, ZMQ_RCVHWM, &one, sizeof(one));
    zmq_setsockopt(r.zsock, ZMQ_RCVBUF, &small, sizeof(small));
    zmq_setsockopt(r.zsock, ZMQ_SNDTIMEO, &sndto, sizeof(sndto));
    zmq_setsockopt(r.zsock, ZMQ_RCVTIMEO, &rcvto, sizeof(rcvto));
    char ep[300];
    snprintf(ep, sizeof(ep), "ipc://%s/moed.zmq", d.dir);
    CHECK(zmq_connect(r.zsock, ep) == 0);
    raw_hello(&r);
    long rss0 = itest_rss_kib(d.pid);
    enum { N = 20000 };
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__ListLayers ll = MOE__LIST_LAYERS__INIT;
    req.body_case = MOE__REQUEST__BODY_LIST_LAYERS;
    req.list_layers = &ll;
    struct itest_fwd f;
    itest_fwd_make(c, &L, 2, &seed, &f);
    int served = 0;
    for (int i = 0; i < N; i++) {
        CHECK_MSG(raw_send(&r, &req) == 0, "send %d: %s", i, zmq_strerror(zmq_errno()));
        if (i % 2000 == 0) {
            /* Someone else is served meanwhile. */
            uint64_t t0 = now_ms();
            CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s", moe_errmsg());
            CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
            CHECK_MSG(now_ms() - t0 < 2000, "a forward took %llu ms during the flood",
                      (unsigned long long)(now_ms() - t0));
            served++;
        }
    }
    itest_sleep_ms(300);
    long rss1 = itest_rss_kib(d.pid);
    int to = 300, got = 0;
    zmq_setsockopt(r.zsock, ZMQ_RCVTIMEO, &to, sizeof(to));
    Moe__Reply *rep;
    while ((rep = raw_recv_try(&r))) {
        got++;
        moe__reply__free_unpacked(rep, NULL);
    }
    fprintf(stderr, "  %d requests unread: %d replies reached the client, the rest dropped; "
                    "daemon VmRSS %ld -> %ld KiB; %d forwards of another client served\n",
            N, got, rss0, rss1, served);
    CHECK_MSG(got < N / 2, "%d of %d replies were kept for a client that does not read", got, N);
    CHECK_MSG(rss1 - rss0 < 16 * 1024 + ITEST_RSS_SLACK_KIB, "VmRSS grew by %ld KiB",
              rss1 - rss0);
    raw_hello(&r); /* still served once it reads */
    raw_close(&r);
    moe_region_free(c, &f.r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

TEST(layers_and_loads_are_capped)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", itest_write_conf("[limits]\nmax_layers = 3\nmax_loads = 1\n"),
                       NULL);
    moe_client *c = itest_connect(&d, "itest");
    /* Loads in flight: two large uploads back to back, the second refused
     * while the first is being prepared. */
    enum { E = 16, H = 1024, I = 1024 };
    size_t n = (size_t)E * H * I, bytes = n * 2;
    struct raw r;
    raw_open(&r, d.dir, true);
    void *base;
    uint64_t reg = raw_region(&r, 3 * bytes, &base);
    itest_fill(&seed, MOE_DTYPE_BF16, base, 3 * n, 0.05f);
    uint64_t s13[] = {E, I, H}, s2[] = {E, H, I};
    Moe__Tensor w1 = raw_tensor(reg, 0, MOE__DTYPE__DTYPE_BF16, s13, 3);
    Moe__Tensor w3 = raw_tensor(reg, bytes, MOE__DTYPE__DTYPE_BF16, s13, 3);
    Moe__Tensor w2 = raw_tensor(reg, 2 * bytes, MOE__DTYPE__DTYPE_BF16, s2, 3);
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__LoadLayer ll = MOE__LOAD_LAYER__INIT;
    ll.kind = MOE__LAYER_KIND__LAYER_MOE;
    ll.dtype = MOE__DTYPE__DTYPE_BF16;
    ll.experts = E;
    ll.topk = 2;
    ll.hidden = H;
    ll.intermediate = I;
    ll.w1 = &w1;
    ll.w3 = &w3;
    ll.w2 = &w2;
    req.body_case = MOE__REQUEST__BODY_LOAD_LAYER;
    req.load_layer = &ll;
    ll.name = "first";
    CHECK(raw_send(&r, &req) == 0);
    ll.name = "second";
    raw_expect(&r, &req, MOE__STATUS__STATUS_BUSY, "loads are in flight, the limit (max_loads)");
    Moe__Reply *rep = raw_recv(&r);
    CHECK_MSG(rep->status == 0, "first load: %s", rep->message);
    moe__reply__free_unpacked(rep, NULL);
    ll.name = "second";
    raw_expect(&r, &req, MOE__STATUS__STATUS_OK, NULL);

    /* Layers: a third fits, a fourth does not until one goes. */
    struct itest_layer L3 = {.name = "third", .dt = MOE_DTYPE_BF16, .sh = {4, 2, 32, 64},
                             .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    itest_layer_upload(c, &L3, &seed);
    ll.name = "fourth";
    raw_expect(&r, &req, MOE__STATUS__STATUS_RESOURCE_EXHAUSTED,
               "3 layers are loaded or loading, the limit (max_layers)");
    CHECK(moe_layer_unload(c, "first") == 0);
    raw_expect(&r, &req, MOE__STATUS__STATUS_OK, NULL);
    moe_layer_info infos[8];
    CHECK_EQ_INT(moe_layer_list(c, infos, 8), 3);
    raw_close(&r);
    moe_disconnect(&c);
    itest_layer_free(&L3);
    itest_daemon_stop(&d);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(sessions_are_capped),
        TEST_CASE(regions_and_mapped_bytes_are_capped),
        TEST_CASE(unregistered_regions_count_until_their_requests_end),
        TEST_CASE(queues_are_capped_per_session_and_in_all),
        TEST_CASE(message_size_is_capped),
        TEST_CASE(pending_replies_are_capped),
        TEST_CASE(layers_and_loads_are_capped),
        {0}});
}
