/*
 * itest_restart.c: a client survives a daemon restart. The call in flight
 * when the daemon dies fails promptly with -ECONNRESET (and moe_poll on it
 * reports an error); the next call opens
 * a new session and re-registers the client's regions behind the same
 * handles, with no code of the client's own.
 */
#include "tests/integration/itest.h"

#include <pthread.h>

/* A daemon, a client of it, a layer L the client uploaded, and f, a
 * forward of T tokens through L. */
static moe_client *start_with_layer(struct itest_daemon *d, const char *client, size_t T,
                                    uint64_t *seed, struct itest_layer *L, struct itest_fwd *f)
{
    itest_daemon_start(d, NULL);
    moe_client *c = itest_connect(d, client);
    *L = (struct itest_layer){.name = "r", .dt = MOE_DTYPE_BF16, .sh = {8, 2, 256, 512},
                              .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    itest_layer_upload(c, L, seed);
    itest_fwd_make(c, L, T, seed, f);
    return c;
}

TEST(client_reconnects_after_a_daemon_restart)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f;
    moe_client *c = start_with_layer(&d, "survivor", 2048, &seed, &L, &f);
    uint64_t id0 = moe_region_id(f.r);
    CHECK(moe_forward(c, &f.args, NULL) == 0);
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));

    /* Killed mid-request: the wait ends at once, not at its timeout. The
     * daemon is stopped before the request goes, so that it is surely
     * unanswered however fast the backend. */
    moe_request *rq;
    kill(d.pid, SIGSTOP);
    CHECK(moe_forward_submit(c, &f.args, &rq) == 0);
    itest_daemon_kill(&d);
    uint64_t t0 = now_ms();
    int rc = moe_wait(c, &rq, 30000, NULL);
    CHECK_MSG(rc == -ECONNRESET, "wait after the kill: %d %s", rc, moe_errmsg());
    CHECK(now_ms() - t0 < 5000);
    CHECK_STR_CONTAINS(moe_errmsg(), "restarted");
    /* While it is down, calls fail clearly. */
    CHECK_EQ_INT(moe_hello(c, NULL), -ECONNREFUSED);

    itest_daemon_restart(&d, NULL);
    /* The uploaded layer died with the daemon; load it again through the
     * same region handles, which reconnect underneath. */
    CHECK_EQ_INT(moe_forward(c, &f.args, NULL), -ENOENT);
    CHECK(moe_region_id(f.r) != id0); /* re-registered */
    itest_layer_free(&L);
    itest_layer_upload(c, &L, &seed);
    memset((uint8_t *)moe_region_data(f.r) + f.o_off, 0xff, f.T * 256 * 2);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));

    /* Killed with a request in flight, moe_poll reports the loss (an
     * error) instead of "not yet" forever. */
    kill(d.pid, SIGSTOP);
    CHECK(moe_forward_submit(c, &f.args, &rq) == 0);
    itest_daemon_kill(&d);
    t0 = now_ms();
    int p = 0;
    while (p == 0 && now_ms() - t0 < 5000) {
        p = moe_poll(c, rq);
        if (p == 0)
            itest_sleep_ms(5);
    }
    CHECK_MSG(p < 0, "moe_poll after the kill: %d (%s)", p, moe_errmsg());
    CHECK_EQ_INT(moe_wait(c, &rq, 1000, NULL), -ECONNRESET);
    itest_daemon_restart(&d, NULL);

    /* A clean restart (SIGTERM) works the same way. */
    itest_daemon_stop_keep(&d);
    itest_daemon_restart(&d, NULL);
    moe_server_info info;
    CHECK_MSG(moe_hello(c, &info) == 0, "%s", moe_errmsg());
    CHECK_STR_EQ(info.backend, itest_on_gpu() ? "cuda" : "cpu");
    moe_stats s;
    CHECK(moe_stats_get(c, &s) == 0);
    CHECK_EQ_INT(s.regions, 1); /* f's region came back with us */
    CHECK(moe_region_free(c, &f.r) == 0);
    CHECK(moe_stats_get(c, &s) == 0);
    CHECK_EQ_INT(s.regions, 0);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/*
 * A call that times out leaves nothing behind. Session replies carry no id,
 * so a region call that timed out ends its session: its late reply must not
 * answer the next call (which would hand out another region's id, and leave
 * the timed-out region registered). A compute request that timed out has its
 * late reply dropped, and the next one gets its own.
 */
TEST(timed_out_calls_leave_no_stale_reply)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f;
    moe_client *c = start_with_layer(&d, "impatient", 16, &seed, &L, &f);
    moe_set_timeout(c, 200);

    /* A region's registration that the stopped daemon answers late. */
    moe_region *a = NULL, *b = NULL;
    kill(d.pid, SIGSTOP);
    int rc = moe_region_create(c, 4096, "late", &a);
    kill(d.pid, SIGCONT);
    moe_set_timeout(c, 10000);
    CHECK_MSG(rc == -ETIMEDOUT, "create while stopped: %d (%s)", rc, moe_errmsg());
    CHECK(a == NULL);
    itest_sleep_ms(300); /* the late reply is sent */
    CHECK_MSG(moe_region_create(c, 8192, "next", &b) == 0, "%s", moe_errmsg());
    moe_stats s;
    CHECK_MSG(moe_stats_get(c, &s) == 0, "%s", moe_errmsg());
    CHECK_EQ_INT(s.regions, 2); /* f's and b, in the new session */
    CHECK_EQ_INT(s.region_bytes, moe_region_size(f.r) + 8192);
    CHECK(moe_region_id(b) != moe_region_id(f.r));
    /* b is the region the daemon knows as b: its last byte is in bounds */
    moe_forward_args args = f.args;
    args.out = moe_tensor_2d(b, 8192 - f.T * 256 * 2, MOE_DTYPE_BF16, f.T, 256);
    CHECK_MSG(moe_forward(c, &args, NULL) == 0, "%s", moe_errmsg());
    memcpy((uint8_t *)moe_region_data(f.r) + f.o_off,
           (uint8_t *)moe_region_data(b) + 8192 - f.T * 256 * 2, f.T * 256 * 2);
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));

    /* A forward that the stopped daemon answers late: its reply is dropped
     * when it comes, and not in place of the next forward's. */
    moe_set_timeout(c, 200);
    kill(d.pid, SIGSTOP);
    rc = moe_forward(c, &f.args, NULL);
    kill(d.pid, SIGCONT);
    moe_set_timeout(c, 10000);
    CHECK_MSG(rc == -ETIMEDOUT, "forward while stopped: %d (%s)", rc, moe_errmsg());
    itest_sleep_ms(300);
    memset((uint8_t *)moe_region_data(f.r) + f.o_off, 0xff, f.T * 256 * 2);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    CHECK(moe_stats_get(c, &s) == 0);
    CHECK_EQ_INT(s.regions, 2);

    CHECK(moe_region_free(c, &b) == 0);
    CHECK(moe_region_free(c, &f.r) == 0);
    CHECK(moe_stats_get(c, &s) == 0);
    CHECK_EQ_INT(s.regions, 0);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/*
 * A daemon that stops reading (SIGSTOP: hung) never holds a call past the
 * client's timeout, however many calls pile up: once the sockets' queues
 * are full a submit waits for room up to the timeout and fails; session
 * calls time out, each ending its session, and the next connects again
 * into the daemon's listen backlog until that is full, when connecting
 * too gives up at the timeout. Resumed, the daemon serves the client
 * again.
 */
TEST(a_hung_daemon_never_holds_a_call_past_its_timeout)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f;
    moe_client *c = start_with_layer(&d, "hung", 1, &seed, &L, &f);
    /* A request given up (moe_request_free): its reply is dropped when it
     * comes, and the next call gets its own. */
    moe_request *given_up;
    CHECK(moe_forward_submit(c, &f.args, &given_up) == 0);
    moe_request_free(c, &given_up);
    CHECK(given_up == NULL);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s", moe_errmsg());
    moe_set_timeout(c, 50);
    kill(d.pid, SIGSTOP);
    enum { MAX_SUBMITS = 50000 };
    moe_request **rq = calloc(MAX_SUBMITS, sizeof(*rq));
    CHECK(rq != NULL);
    int n = 0, rc = 0;
    uint64_t worst = 0;
    for (; n < MAX_SUBMITS && rc == 0; n++) {
        uint64_t t = now_ms();
        rc = moe_forward_submit(c, &f.args, &rq[n]);
        t = now_ms() - t;
        worst = t > worst ? t : worst;
    }
    CHECK_MSG(rc == -ETIMEDOUT, "submit %d: %d (%s)", n, rc, moe_errmsg());
    CHECK_STR_CONTAINS(moe_errmsg(), "took no request within 50 ms");
    CHECK_MSG(worst < 2000, "a submit took %llu ms", (unsigned long long)worst);

    bool backlog_full = false;
    for (int i = 0; i < 400 && !backlog_full; i++) {
        moe_region *r = NULL;
        uint64_t t = now_ms();
        rc = moe_region_create(c, 4096, "hung", &r);
        t = now_ms() - t;
        CHECK_MSG(rc == -ETIMEDOUT, "create %d: %d (%s)", i, rc, moe_errmsg());
        CHECK_MSG(t < 2000, "create %d took %llu ms", i, (unsigned long long)t);
        backlog_full = strstr(moe_errmsg(), "accepted no connection") != NULL;
    }
    CHECK_MSG(backlog_full, "the listen backlog never filled: %s", moe_errmsg());

    kill(d.pid, SIGCONT);
    moe_set_timeout(c, 20000);
    /* The submitted requests went with their session. */
    for (int i = 0; i < (n - 1) / 2; i++) {
        rc = moe_wait(c, &rq[i], 0, NULL);
        CHECK_MSG(rc == -ECONNRESET, "request %d: %d (%s)", i, rc, moe_errmsg());
    }
    for (int i = (n - 1) / 2; i < n - 1; i++)
        moe_request_free(i % 2 ? c : NULL, &rq[i]);
    free(rq);
    memset((uint8_t *)moe_region_data(f.r) + f.o_off, 0xff, f.T * 256 * 2);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    moe_region_free(c, &f.r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* Another client, w, sees the daemon answer n requests more than s0 had
 * (a request is counted once its reply is sent). */
static void wait_answered(moe_client *w, const moe_stats *s0, int n)
{
    moe_stats s;
    for (int i = 0; i < 1000; i++) {
        CHECK_MSG(moe_stats_get(w, &s) == 0, "%s", moe_errmsg());
        if (s.requests + s.errors >= s0->requests + s0->errors + (uint64_t)n)
            break;
        itest_sleep_ms(10);
    }
    CHECK_EQ_INT(s.requests, s0->requests + (uint64_t)n);
}

/* Replies the daemon sent before it died are delivered: moe_poll says they
 * have come and moe_wait returns their results, though the session is
 * over. */
TEST(replies_sent_before_the_daemon_died_are_delivered)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f, g;
    moe_client *c = start_with_layer(&d, "late-reader", 16, &seed, &L, &f);
    itest_fwd_make(c, &L, 8, &seed, &g);
    /* Another client watches the daemon answer both (a request is counted
     * once its reply is sent); this one reads nothing before the kill. */
    moe_client *w = itest_connect(&d, "watcher");
    moe_stats s0;
    CHECK_MSG(moe_stats_get(w, &s0) == 0, "%s", moe_errmsg());
    moe_request *rf, *rg;
    CHECK(moe_forward_submit(c, &f.args, &rf) == 0);
    CHECK(moe_forward_submit(c, &g.args, &rg) == 0);
    wait_answered(w, &s0, 2); /* both answered, the replies unread */
    moe_disconnect(&w);
    itest_daemon_kill(&d);
    CHECK_EQ_INT(moe_poll(c, rf), 1);
    CHECK_MSG(moe_wait(c, &rf, 5000, NULL) == 0, "%s", moe_errmsg());
    CHECK_MSG(moe_wait(c, &rg, 5000, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    CHECK(itest_fwd_error(&L, &g) <= itest_tolerance(L.dt));
    /* Then the session is over, and says so. */
    CHECK_EQ_INT(moe_hello(c, NULL), -ECONNREFUSED);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
}

/* f[0]'s request submitted and polled until answered (its reply read),
 * then f[1..3]'s, longer, whose replies come after the last read, then the
 * daemon stopped cleanly, which answers them before it exits. Requests on
 * one connection arrive in order: once a Hello is answered, the daemon
 * holds all of them. */
static void answered_then_stopped(struct itest_daemon *d, moe_client *c, struct itest_fwd *f,
                                  moe_request **rq)
{
    CHECK_MSG(moe_forward_submit(c, &f[0].args, &rq[0]) == 0, "%s", moe_errmsg());
    int p = 0;
    for (int tries = 0; tries < 1000 && p == 0; tries++) {
        p = moe_poll(c, rq[0]);
        if (p == 0)
            itest_sleep_ms(10);
    }
    CHECK_EQ_INT(p, 1);
    for (int i = 1; i < 4; i++)
        CHECK_MSG(moe_forward_submit(c, &f[i].args, &rq[i]) == 0, "%s", moe_errmsg());
    CHECK_MSG(moe_hello(c, NULL) == 0, "%s", moe_errmsg());
    kill(d->pid, SIGTERM);
    itest_daemon_wait_stopped(d);
}

/* Replies that came before the daemon went stay delivered whichever call
 * notices first that it went: a submit or a Hello that finds the session
 * over (and connects again, or cannot) must not throw away the replies
 * already received, nor those a clean stop sent and the client has not
 * read yet. moe_poll said 1 for the first: its result is there. */
TEST(replies_that_came_survive_another_calls_reconnect)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f[4];
    moe_request *rq[4];
    moe_client *c = start_with_layer(&d, "pipelined", 16, &seed, &L, &f[0]);
    for (int i = 1; i < 4; i++)
        itest_fwd_make(c, &L, 512 * (size_t)i, &seed, &f[i]);
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 4; i++)
            memset((uint8_t *)moe_region_data(f[i].r) + f[i].o_off, 0xff, f[i].T * 256 * 2);
        answered_then_stopped(&d, c, f, rq);
        if (round == 0) {
            /* Another call finds the daemon gone... */
            CHECK_EQ_INT(moe_hello(c, NULL), -ECONNREFUSED);
        } else {
            /* ... or back, and connects again. */
            itest_daemon_restart(&d, NULL);
            CHECK_MSG(moe_hello(c, NULL) == 0, "%s", moe_errmsg());
        }
        for (int i = 0; i < 4; i++) {
            int rc = moe_wait(c, &rq[i], 5000, NULL);
            CHECK_MSG(rc == 0, "round %d, request %d: %d (%s)", round, i, rc, moe_errmsg());
            CHECK(rq[i] == NULL);
            CHECK(itest_fwd_error(&L, &f[i]) <= itest_tolerance(L.dt));
        }
        if (round == 0) {
            itest_daemon_restart(&d, NULL);
            itest_layer_free(&L);
            itest_layer_upload(c, &L, &seed);
        }
    }
    for (int i = 0; i < 4; i++)
        moe_region_free(c, &f[i].r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
}

/* The same when the call that finds the daemon gone is a region's free,
 * which talks on the session socket at once. */
TEST(replies_that_came_survive_a_region_free_that_finds_the_daemon_gone)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f[4];
    moe_request *rq[4];
    moe_client *c = start_with_layer(&d, "pipelined", 16, &seed, &L, &f[0]);
    for (int i = 1; i < 4; i++)
        itest_fwd_make(c, &L, 512 * (size_t)i, &seed, &f[i]);
    moe_region *extra = NULL;
    CHECK_MSG(moe_region_create(c, 4096, "extra", &extra) == 0, "%s", moe_errmsg());
    answered_then_stopped(&d, c, f, rq);
    int rc = moe_region_free(c, &extra);
    CHECK_MSG(rc == 0 || rc == -ECONNRESET, "region free: %d (%s)", rc, moe_errmsg());
    CHECK(extra == NULL);
    for (int i = 0; i < 4; i++) {
        rc = moe_wait(c, &rq[i], 5000, NULL);
        CHECK_MSG(rc == 0, "request %d: %d (%s)", i, rc, moe_errmsg());
        CHECK(itest_fwd_error(&L, &f[i]) <= itest_tolerance(L.dt));
    }
    for (int i = 0; i < 4; i++)
        moe_region_free(c, &f[i].r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
}

/* c's request f answered, its reply unread here; the daemon then stopped
 * (SIGSTOP), so what c sends next stays unread there. */
static moe_request *answered_then_frozen(struct itest_daemon *d, moe_client *c,
                                         struct itest_fwd *f)
{
    moe_client *w = itest_connect(d, "watcher");
    moe_stats s0;
    CHECK_MSG(moe_stats_get(w, &s0) == 0, "%s", moe_errmsg());
    moe_request *r = NULL;
    CHECK_MSG(moe_forward_submit(c, &f->args, &r) == 0, "%s", moe_errmsg());
    wait_answered(w, &s0, 1);
    moe_disconnect(&w);
    CHECK(kill(d->pid, SIGSTOP) == 0);
    return r;
}

struct creator {
    moe_client *c;
    int rc;
};

static void *create_region(void *arg)
{
    struct creator *cr = arg;
    moe_region *r = NULL;
    cr->rc = moe_region_create(cr->c, 4096, "late", &r);
    if (!cr->rc)
        moe_region_free(cr->c, &r);
    return NULL;
}

/* The daemon dies with a session message of the client's unread (a region
 * being registered): the client's socket reports the reset before its end,
 * and the replies that came before are still delivered. */
TEST(replies_that_came_survive_a_daemon_dying_with_a_session_call_unread)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f;
    moe_client *c = start_with_layer(&d, "c", 16, &seed, &L, &f);
    moe_request *rf = answered_then_frozen(&d, c, &f);
    struct creator cr = {.c = c};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, create_region, &cr) == 0);
    itest_sleep_ms(300); /* the registration sent, unread */
    itest_daemon_kill(&d);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK_EQ_INT(cr.rc, -ECONNRESET);
    int rc = moe_wait(c, &rf, 5000, NULL);
    CHECK_MSG(rc == 0, "the answered request: %d (%s)", rc, moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    moe_region_free(c, &f.r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
}

/* The same with a compute request unread on the reply socket (where libmoe
 * sends them by default): that socket too reports the reset before the
 * replies queued in it, which are still delivered; the unread request
 * fails. */
TEST(replies_that_came_survive_a_daemon_dying_with_a_request_unread)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    struct itest_layer L;
    struct itest_fwd f, g;
    moe_client *c = start_with_layer(&d, "c", 16, &seed, &L, &f);
    itest_fwd_make(c, &L, 16, &seed, &g);
    moe_request *rf = answered_then_frozen(&d, c, &f), *rg = NULL;
    CHECK_MSG(moe_forward_submit(c, &g.args, &rg) == 0, "%s", moe_errmsg());
    itest_daemon_kill(&d);
    int rc = moe_wait(c, &rf, 5000, NULL);
    CHECK_MSG(rc == 0, "the answered request: %d (%s)", rc, moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    rc = moe_wait(c, &rg, 5000, NULL);
    CHECK_MSG(rc == -ECONNRESET, "the unread request: %d (%s)", rc, moe_errmsg());
    moe_region_free(c, &f.r);
    moe_region_free(c, &g.r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(client_reconnects_after_a_daemon_restart),
        TEST_CASE(timed_out_calls_leave_no_stale_reply),
        TEST_CASE(replies_sent_before_the_daemon_died_are_delivered),
        TEST_CASE(replies_that_came_survive_another_calls_reconnect),
        TEST_CASE(replies_that_came_survive_a_region_free_that_finds_the_daemon_gone),
        TEST_CASE(replies_that_came_survive_a_daemon_dying_with_a_session_call_unread),
        TEST_CASE(replies_that_came_survive_a_daemon_dying_with_a_request_unread),
        TEST_CASE_TIMEOUT(a_hung_daemon_never_holds_a_call_past_its_timeout, 120),
        {0}});
}
