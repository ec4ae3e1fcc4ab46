/*
 * itest_hostile.c: clients that crash and clients that attack. Hundreds of
 * client processes are killed with SIGKILL at every awkward point while
 * another client checks every one of its results; afterwards the daemon's
 * sessions, regions, queue, descriptors and resident memory are back where
 * they were. Clients cannot use another session's token or regions, cannot
 * guess them, cannot reach outside their own regions, cannot load weights
 * from outside the allowed directories, and cannot connect at all without
 * access to the runtime directory. Also the regression tests of the bugs
 * these cases found.
 *
 * MOE_HOSTILE_KILLS sets the number of kills after the warm-up (default 600).
 *
 * The processes that fork clients have no threads when they fork (their own
 * libmoe clients are disconnected first): a fork while another thread holds
 * a lock, such as AddressSanitizer's allocator's, leaves the child stuck.
 */
#include <grp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "daemon/safetensors.h"
#include "tests/integration/raw.h"

/* The layer every case serves: small enough for CPU, big enough that a
 * batch takes a while. */
static struct itest_layer layer_make(void)
{
    struct itest_layer L = {.name = "h", .dt = MOE_DTYPE_BF16, .sh = {8, 2, 128, 256},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    return L;
}

static void *shared_map(size_t n)
{
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    memset(p, 0, n);
    return p;
}

static void get_stats(moe_client *c, moe_stats *s)
{
    CHECK_MSG(moe_stats_get(c, s) == 0, "stats: %s", moe_errmsg());
}

/* Wait until the daemon holds only what the live clients hold (sessions
 * other than the one asking), then leave; the daemon's stats in *out. */
static void quiesce(struct itest_daemon *d, uint32_t sessions, uint32_t regions, moe_stats *out)
{
    moe_client *c = itest_connect(d, "stats");
    moe_stats s;
    for (int i = 0; i < 500; i++) {
        get_stats(c, &s);
        if (s.sessions == sessions + 1 && s.regions == regions && s.queue_depth == 0) {
            if (out)
                *out = s;
            moe_disconnect(&c);
            return;
        }
        itest_sleep_ms(20);
    }
    FAIL_AT("daemon still holds %u sessions, %u regions, %u queued (want %u, %u, 0)",
            s.sessions - 1, s.regions, s.queue_depth, sessions, regions);
}

/* The descriptor count settles: ZeroMQ closes dead peers' connections on
 * its own threads, a little after the session socket closes. */
static int settled_fds(pid_t pid, int want)
{
    int n = itest_count_fds(pid);
    for (int i = 0; i < 250 && n != want; i++) {
        itest_sleep_ms(20);
        n = itest_count_fds(pid);
    }
    return n;
}

/* ---- the observer: a client that checks every result -------------------- */

struct observer {
    volatile int stop;
    volatile uint64_t ok, wrong, failed;
    char msg[256];
};

static pid_t observer_start(struct itest_daemon *d, struct itest_layer *L, uint64_t seed,
                            struct observer *o)
{
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid)
        return pid;
    moe_client *c = itest_connect(d, "observer");
    struct itest_fwd f;
    /* One region for the whole run, laid out for 24 tokens; each forward
     * uses its first T rows, with new inputs. */
    itest_fwd_make(c, L, 24, &seed, &f);
    uint8_t *b = moe_region_data(f.r);
    size_t H = (size_t)L->sh.hidden, E = (size_t)L->sh.experts;
    while (!o->stop) {
        size_t T = 1 + test_rand(&seed) % 24;
        f.T = T;
        itest_fill(&seed, L->dt, b + f.x_off, T * H, 1.7f);
        for (size_t i = 0; i < T * E; i++)
            ((float *)(b + f.l_off))[i] = test_randf(&seed) * 3.0f;
        memset(b + f.o_off, 0xff, T * H * moe_dtype_size(L->dt));
        f.args.x = moe_tensor_2d(f.r, f.x_off, L->dt, T, H);
        f.args.logits = moe_tensor_2d(f.r, f.l_off, MOE_DTYPE_FP32, T, E);
        f.args.out = moe_tensor_2d(f.r, f.o_off, L->dt, T, H);
        int rc = moe_forward(c, &f.args, NULL);
        if (rc < 0) {
            o->failed++;
            snprintf(o->msg, sizeof(o->msg), "forward: %s", moe_errmsg());
        } else {
            double e = itest_fwd_error(L, &f);
            if (e > itest_tolerance(L->dt)) {
                o->wrong++;
                snprintf(o->msg, sizeof(o->msg), "T=%zu: relative error %.3g", T, e);
            } else {
                o->ok++;
            }
        }
    }
    moe_region_free(c, &f.r);
    moe_disconnect(&c);
    _exit(0);
}

static void observer_stop(pid_t pid, struct observer *o)
{
    o->stop = 1;
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "observer died (status %d)", st);
    CHECK_MSG(o->wrong == 0 && o->failed == 0,
              "observer: %llu correct, %llu wrong, %llu failed; last: %s",
              (unsigned long long)o->ok, (unsigned long long)o->wrong,
              (unsigned long long)o->failed, o->msg);
}

/* ---- victims -------------------------------------------------------------- */

enum victim_kind {
    V_CONNECTED,          /* killed after connecting, before OpenSession */
    V_OPENED,             /* after OpenSession, before any region */
    V_REGION_UNSENT,      /* between creating a region and registering it */
    V_REGISTER_IN_FLIGHT, /* RegisterRegion sent with its fd, reply unread */
    V_MID_REQUEST,        /* requests submitted, replies not yet read */
    V_DURING_OUTPUT,      /* a long request, killed from outside while it runs */
    V_UNREGISTERED_BUSY,  /* region unregistered while its request is queued */
    V_QUEUE_FLOOD,        /* more requests than its queue holds */
    V_LOADING,            /* a LoadLayer of its region in flight */
    V_KINDS
};

static const char *victim_names[V_KINDS] = {
    "connected", "opened", "region-unsent", "register-in-flight", "mid-request",
    "during-output", "unregistered-busy", "queue-flood", "loading",
};

static void die(void)
{
    kill(getpid(), SIGKILL);
    for (;;)
        pause();
}

/* Spin for up to max_us microseconds (a random point in time). */
static void jitter(uint64_t *seed, unsigned max_us)
{
    if (!max_us)
        return;
    struct timespec ts = {0, (long)(test_rand(seed) % max_us) * 1000L};
    nanosleep(&ts, NULL);
}

static void victim_run(struct itest_daemon *d, struct itest_layer *L, enum victim_kind kind,
                       uint64_t seed)
{
    struct raw r;
    moe_client *c;
    struct itest_fwd f;
    moe_request *rq;
    switch (kind) {
    case V_CONNECTED:
        memset(&r, 0, sizeof(r));
        CHECK(raw_connect_session(&r, d->dir) == 0);
        jitter(&seed, 2000);
        die();
        break;
    case V_OPENED:
        raw_open(&r, d->dir, true);
        die();
        break;
    case V_REGION_UNSENT: {
        raw_open(&r, d->dir, true);
        int fd = memfd_sized(1 << 16, F_SEAL_SHRINK | F_SEAL_GROW);
        (void)fd;
        die();
        break;
    }
    case V_REGISTER_IN_FLIGHT: {
        raw_open(&r, d->dir, true);
        raw_region(&r, 4096, NULL);
        int fd = memfd_sized(1 << 16, F_SEAL_SHRINK | F_SEAL_GROW);
        Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
        Moe__RegisterRegion rr = MOE__REGISTER_REGION__INIT;
        rr.size = 1 << 16;
        req.body_case = MOE__SESSION_REQUEST__BODY_REGISTER_REGION;
        req.register_region = &rr;
        uint8_t buf[256];
        size_t n = moe__session_request__pack(&req, buf);
        union {
            char raw[CMSG_SPACE(sizeof(int))];
            struct cmsghdr a;
        } cb;
        memset(&cb, 0, sizeof(cb));
        struct iovec iov = {buf, n};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb.raw,
                            .msg_controllen = sizeof(cb.raw)};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
        CHECK(sendmsg(r.sfd, &mh, MSG_NOSIGNAL) == (ssize_t)n);
        jitter(&seed, 200);
        die();
        break;
    }
    case V_MID_REQUEST: {
        c = itest_connect(d, "victim");
        int n = 1 + (int)(test_rand(&seed) % 4);
        itest_fwd_make(c, L, 1 + test_rand(&seed) % 300, &seed, &f);
        for (int i = 0; i < n; i++)
            CHECK_MSG(moe_forward_submit(c, &f.args, &rq) == 0, "%s", moe_errmsg());
        jitter(&seed, 3000);
        die();
        break;
    }
    case V_DURING_OUTPUT:
        c = itest_connect(d, "victim");
        itest_fwd_make(c, L, 1024, &seed, &f);
        CHECK_MSG(moe_forward_submit(c, &f.args, &rq) == 0, "%s", moe_errmsg());
        for (;;) /* the parent kills it */
            pause();
        break;
    case V_UNREGISTERED_BUSY:
        c = itest_connect(d, "victim");
        itest_fwd_make(c, L, 1 + test_rand(&seed) % 200, &seed, &f);
        CHECK_MSG(moe_forward_submit(c, &f.args, &rq) == 0, "%s", moe_errmsg());
        moe_region_free(c, &f.r);
        jitter(&seed, 1000);
        die();
        break;
    case V_QUEUE_FLOOD:
        c = itest_connect(d, "victim");
        itest_fwd_make(c, L, 1, &seed, &f);
        for (int i = 0; i < 300; i++)
            if (moe_forward_submit(c, &f.args, &rq) < 0)
                break;
        die();
        break;
    case V_LOADING: {
        /* Layers outlive the sessions that load them; a fixed name keeps
         * it to one (the others are refused as duplicates). */
        c = itest_connect(d, "victim");
        moe_region *w;
        size_t n = 2 * 8 * 16;
        CHECK(moe_region_create(c, 3 * n * 2, "w", &w) == 0);
        itest_fill(&seed, MOE_DTYPE_BF16, moe_region_data(w), 3 * n, 0.3f);
        moe_layer_desc desc = {.name = "victim", .kind = MOE_LAYER_MOE, .dtype = MOE_DTYPE_BF16,
                               .experts = 2, .topk = 1, .hidden = 8, .intermediate = 16,
                               .w1 = moe_tensor_3d(w, 0, MOE_DTYPE_BF16, 2, 16, 8),
                               .w3 = moe_tensor_3d(w, n * 2, MOE_DTYPE_BF16, 2, 16, 8),
                               .w2 = moe_tensor_3d(w, 2 * n * 2, MOE_DTYPE_BF16, 2, 8, 16)};
        moe_set_timeout(c, 1);
        moe_layer_load(c, &desc, NULL); /* gives up waiting after 1 ms */
        die();
        break;
    }
    default:
        break;
    }
    _exit(3);
}

struct kill_stats {
    unsigned by_kind[V_KINDS];
    unsigned total;
};

/* Kill `n` victims, up to `par` at a time, checking the daemon lives. */
static void kill_loop(struct itest_daemon *d, struct itest_layer *L, uint64_t *seed, unsigned n,
                      unsigned par, struct kill_stats *ks)
{
    struct {
        pid_t pid;
        enum victim_kind kind;
        uint64_t kill_at_ms;
    } live[16] = {{0}};
    unsigned started = 0, done = 0;
    CHECK(par <= ARRAY_LEN(live));
    while (done < n) {
        for (unsigned i = 0; i < par && started < n; i++) {
            if (live[i].pid)
                continue;
            enum victim_kind kind = (enum victim_kind)(test_rand(seed) % V_KINDS);
            uint64_t vs = test_rand(seed);
            fflush(stderr);
            pid_t pid = fork();
            CHECK(pid >= 0);
            if (pid == 0) {
                alarm(20);
                victim_run(d, L, kind, vs);
            }
            live[i].pid = pid;
            live[i].kind = kind;
            /* Self-killing victims get a safety kill; a long request is
             * killed from outside at a random point of its run. */
            live[i].kill_at_ms = now_ms() + (kind == V_DURING_OUTPUT ? 5 + test_rand(seed) % 60
                                                                     : 10000);
            started++;
        }
        for (unsigned i = 0; i < par; i++) {
            if (!live[i].pid)
                continue;
            int st;
            pid_t w = waitpid(live[i].pid, &st, WNOHANG);
            if (w == 0 && now_ms() >= live[i].kill_at_ms) {
                kill(live[i].pid, SIGKILL);
                w = waitpid(live[i].pid, &st, 0);
            }
            if (w != live[i].pid)
                continue;
            CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
                      "victim '%s' did not die of SIGKILL (status %d)",
                      victim_names[live[i].kind], st);
            ks->by_kind[live[i].kind]++;
            ks->total++;
            live[i].pid = 0;
            done++;
            if (done % 50 == 0)
                CHECK_MSG(itest_daemon_alive(d), "moed died after %u kills; log in %s", done,
                          d->log);
        }
        itest_sleep_ms(1);
    }
}

/* SIGKILLed clients, hundreds of them, at every awkward point. */
TEST(killed_clients_leak_nothing)
{
    uint64_t seed = test_seed();
    const char *env = getenv("MOE_HOSTILE_KILLS");
    unsigned kills = env ? (unsigned)atoi(env) : 600;
    struct itest_daemon d;
    itest_asan_small_quarantine();
    itest_daemon_start(&d, "--max-slice-tokens", "128", NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_make();
    itest_layer_upload(c, &L, &seed);
    moe_disconnect(&c);
    struct observer *o = shared_map(sizeof(*o));

    /* Warm up: every kind of victim once or more, next to an observer, so
     * caches, staging buffers, the "victim" layer and the batcher's timer
     * (made when a batch of two sessions first waits for them) exist before
     * the baseline. */
    struct kill_stats warm, ks;
    memset(&warm, 0, sizeof(warm));
    memset(&ks, 0, sizeof(ks));
    pid_t obs = observer_start(&d, &L, seed ^ 0x33, o);
    kill_loop(&d, &L, &seed, 60, 6, &warm);
    observer_stop(obs, o);
    memset(o, 0, sizeof(*o));
    moe_stats s0, s1;
    quiesce(&d, 0, 0, &s0);
    itest_sleep_ms(300);
    int fds0 = itest_count_fds(d.pid);
    long rss0 = itest_rss_kib(d.pid);

    /* The observer checks every result while the victims die. */
    obs = observer_start(&d, &L, seed ^ 0x55, o);
    uint64_t t0 = now_ms();
    kill_loop(&d, &L, &seed, kills, 6, &ks);
    double secs = (double)(now_ms() - t0) / 1000.0;
    CHECK_MSG(itest_daemon_alive(&d), "moed died; log in %s", d.log);
    observer_stop(obs, o);
    quiesce(&d, 0, 0, &s1);
    int fds1 = settled_fds(d.pid, fds0);
    long rss1 = itest_rss_kib(d.pid);
    fprintf(stderr, "  kills survived: %u in %.1f s after %u warm-up kills:", ks.total, secs,
            warm.total);
    for (int k = 0; k < V_KINDS; k++)
        fprintf(stderr, " %s %u%s", victim_names[k], ks.by_kind[k], k + 1 < V_KINDS ? "," : "\n");
    fprintf(stderr, "  observer: %llu forwards, every one correct\n", (unsigned long long)o->ok);
    fprintf(stderr, "  daemon: descriptors %d -> %d, VmRSS %ld -> %ld KiB "
                    "(%+ld); %llu requests served, %llu cancelled or refused\n",
            fds0, fds1, rss0, rss1, rss1 - rss0, (unsigned long long)(s1.requests - s0.requests),
            (unsigned long long)(s1.errors - s0.errors));
    CHECK_EQ_INT(ks.total, kills);
    if (fds1 != fds0)
        itest_list_fds(d.pid);
    CHECK_MSG(fds1 == fds0, "descriptors: %d at the baseline, %d after", fds0, fds1);
    /* Allocator caching may keep a few MiB (glibc arenas of the daemon's
     * four threads; ASan's quarantine under SAN=1); a leak per kill would
     * be hundreds of KiB per kill here. */
    long tol = 8 * 1024 + ITEST_RSS_SLACK_KIB;
    CHECK_MSG(rss1 - rss0 <= tol, "VmRSS grew by %ld KiB (tolerance %ld KiB)", rss1 - rss0, tol);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* A client that dies while its long request is in the running batch must not
 * shift the other clients' rows of that batch (the scatter used to skip the
 * dead client's rows while the gather had used them, so the next client got
 * the dead one's output). */
TEST(a_dying_client_never_shifts_another_clients_rows)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, "--max-slice-tokens", "32", NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = {.name = "L", .dt = MOE_DTYPE_BF16, .sh = {8, 2, 256, 512},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    itest_layer_upload(c, &L, &seed);
    moe_disconnect(&c);
    struct observer *o = shared_map(sizeof(*o));
    pid_t obs = observer_start(&d, &L, seed ^ 0x77, o);
    for (int round = 0; round < 12; round++) {
        fflush(stderr);
        pid_t a = fork();
        CHECK(a >= 0);
        if (a == 0) {
            uint64_t s2 = seed + (uint64_t)round;
            moe_client *ca = itest_connect(&d, "A");
            struct itest_fwd fa;
            itest_fwd_make(ca, &L, 4096, &s2, &fa);
            moe_request *rq;
            CHECK(moe_forward_submit(ca, &fa.args, &rq) == 0);
            for (;;)
                pause();
        }
        itest_sleep_ms(30 + (int)(test_rand(&seed) % 150));
        kill(a, SIGKILL);
        waitpid(a, NULL, 0);
        itest_sleep_ms(100);
    }
    observer_stop(obs, o);
    fprintf(stderr, "  %llu results checked around 12 deaths mid-batch, every one correct\n",
            (unsigned long long)o->ok);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* ---- isolation ------------------------------------------------------------- */

#define tensor raw_tensor

static void fused_req(Moe__Request *req, Moe__FusedMoe *fm, Moe__Tensor *x, Moe__Tensor *lg,
                      Moe__Tensor *out)
{
    moe__request__init(req);
    moe__fused_moe__init(fm);
    fm->layer = "h";
    fm->x = x;
    fm->logits = lg;
    fm->out = out;
    req->body_case = MOE__REQUEST__BODY_FUSED_MOE;
    req->fused_moe = fm;
}

TEST(tokens_and_region_ids_are_not_guessable_and_are_checked)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_make();
    itest_layer_upload(c, &L, &seed);
    enum { T = 4, H = 128, E = 8 };
    const size_t RS = 1 << 16;
    struct raw me, other, dead;
    raw_open(&me, d.dir, true);
    raw_open(&other, d.dir, true);
    void *mine, *theirs;
    uint64_t reg = raw_region(&me, RS, &mine);
    uint64_t foreign = raw_region(&other, RS, &theirs);
    memset(theirs, 0x5a, RS);
    itest_fill(&seed, MOE_DTYPE_BF16, mine, T * H, 1.0f);
    uint64_t sx[] = {T, H}, sl[] = {T, E};
    Moe__Tensor x = tensor(reg, 0, MOE__DTYPE__DTYPE_BF16, sx, 2);
    Moe__Tensor lg = tensor(reg, 4096, MOE__DTYPE__DTYPE_FP32, sl, 2);
    Moe__Tensor out = tensor(reg, 8192, MOE__DTYPE__DTYPE_BF16, sx, 2);
    Moe__Request req;
    Moe__FusedMoe fm;
    fused_req(&req, &fm, &x, &lg, &out);
    raw_expect(&me, &req, MOE__STATUS__STATUS_OK, NULL);

    /* Tokens: random guesses, near misses, other lengths, a closed
     * session's token. */
    uint8_t tok[32];
    for (int i = 0; i < 2000; i++) {
        for (int j = 0; j < 16; j++)
            tok[j] = (uint8_t)test_rand(&seed);
        req.token.data = tok;
        req.token.len = 16;
        raw_expect(&me, &req, MOE__STATUS__STATUS_PERMISSION_DENIED, "token");
    }
    memcpy(tok, me.token, 16);
    for (int j = 0; j < 16; j++) {
        tok[j] ^= 1;
        req.token.data = tok;
        req.token.len = 16;
        raw_expect(&me, &req, MOE__STATUS__STATUS_PERMISSION_DENIED, "token");
        tok[j] ^= 1;
    }
    tok[16] = 0;
    size_t lens[] = {0, 1, 15, 17, 32};
    for (size_t i = 0; i < ARRAY_LEN(lens); i++) {
        req.token.data = tok;
        req.token.len = lens[i];
        if (lens[i] == 0) {
            /* raw_send would stamp the real token on an empty one. */
            uint8_t buf[1024];
            req.token.data = NULL;
            req.id = 4242;
            size_t n = moe__request__pack(&req, buf);
            raw_expect_bytes(&me, buf, n, MOE__STATUS__STATUS_PERMISSION_DENIED, "token");
            continue;
        }
        raw_expect(&me, &req, MOE__STATUS__STATUS_PERMISSION_DENIED, "token");
    }
    raw_open(&dead, d.dir, true);
    uint64_t dead_region = raw_region(&dead, 4096, NULL);
    uint8_t dead_token[16];
    memcpy(dead_token, dead.token, 16);
    close(dead.sfd); /* the session ends; its token and region must die with it */
    dead.sfd = -1;
    for (int i = 0; i < 100; i++) {
        moe_stats st;
        get_stats(c, &st);
        if (st.sessions == 3)
            break;
        itest_sleep_ms(20);
    }
    req.token.data = dead_token;
    req.token.len = 16;
    raw_expect(&dead, &req, MOE__STATUS__STATUS_PERMISSION_DENIED, "token");
    req.token.len = 0;

    /* Region ids: random, 53 bits, far apart. */
    uint64_t ids[33];
    ids[0] = reg;
    for (int i = 1; i < 33; i++)
        ids[i] = raw_region(&me, 4096, NULL);
    for (int i = 0; i < 33; i++) {
        CHECK(ids[i] != 0 && ids[i] < (1ull << 53));
        for (int j = 0; j < i; j++) {
            uint64_t gap = ids[i] > ids[j] ? ids[i] - ids[j] : ids[j] - ids[i];
            CHECK_MSG(gap > (1ull << 20), "region ids %llu and %llu are %llu apart",
                      (unsigned long long)ids[i], (unsigned long long)ids[j],
                      (unsigned long long)gap);
        }
    }
    for (int i = 1; i < 33; i++)
        CHECK_EQ_INT(raw_unregister(&me, ids[i]), 0);

    /* Another session's region, a dead session's, an unregistered one and
     * guesses, in every role a tensor can play. */
    Moe__Tensor bad;
    uint64_t names[] = {foreign, dead_region, ids[5], 1, 2, 12345};
    for (size_t i = 0; i < ARRAY_LEN(names) + 500; i++) {
        uint64_t id = i < ARRAY_LEN(names) ? names[i] : (test_rand(&seed) & ((1ull << 53) - 1));
        if (id == reg)
            continue;
        fused_req(&req, &fm, &x, &lg, &out);
        bad = i % 3 == 0 ? x : i % 3 == 1 ? lg : out;
        bad.region = id;
        if (i % 3 == 0)
            fm.x = &bad;
        else if (i % 3 == 1)
            fm.logits = &bad;
        else
            fm.out = &bad;
        raw_expect(&me, &req, MOE__STATUS__STATUS_NOT_FOUND, "not registered in this session");
    }
    CHECK_EQ_INT(raw_unregister(&me, foreign), MOE__STATUS__STATUS_NOT_FOUND);
    CHECK_EQ_INT(raw_unregister(&me, dead_region), MOE__STATUS__STATUS_NOT_FOUND);
    /* Uploading weights from another session's region. */
    Moe__Request lr = MOE__REQUEST__INIT;
    Moe__LoadLayer ll = MOE__LOAD_LAYER__INIT;
    uint64_t s3[] = {2, 16, 8};
    Moe__Tensor w = tensor(foreign, 0, MOE__DTYPE__DTYPE_BF16, s3, 3);
    ll.name = "steal";
    ll.dtype = MOE__DTYPE__DTYPE_BF16;
    ll.experts = 2;
    ll.topk = 1;
    ll.hidden = 8;
    ll.intermediate = 16;
    ll.w1 = ll.w3 = ll.w2 = &w;
    lr.body_case = MOE__REQUEST__BODY_LOAD_LAYER;
    lr.load_layer = &ll;
    raw_expect(&me, &lr, MOE__STATUS__STATUS_NOT_FOUND, "not registered in this session");

    /* Bounds: random offsets and shapes at and past the region's end; the
     * bytes around the output and the other session's bytes stay. */
    memset((uint8_t *)mine + 16384, 0xa5, RS - 16384);
    unsigned refused = 0, ok = 0;
    for (int i = 0; i < 3000; i++) {
        fused_req(&req, &fm, &x, &lg, &out);
        bad = out;
        uint64_t t = 1 + test_rand(&seed) % 8;
        uint64_t so[2] = {t, H};
        uint64_t bytes = t * H * 2;
        switch (test_rand(&seed) % 4) {
        case 0: bad.offset = RS - bytes + 2 * (1 + test_rand(&seed) % 64); break;
        case 1: bad.offset = (test_rand(&seed) % (RS / 2)) * 2; break;
        case 2: bad.offset = UINT64_MAX - 2 * (test_rand(&seed) % 1024) - 1; break;
        default: bad.offset = RS - bytes; break;
        }
        bad.shape = so;
        uint64_t sxt[2] = {t, H}, slt[2] = {t, E};
        Moe__Tensor xt = x, lt = lg;
        xt.shape = sxt;
        lt.shape = slt;
        fm.x = &xt;
        fm.logits = &lt;
        fm.out = &bad;
        bool inside = bad.offset <= RS && bad.offset % 2 == 0 && bytes <= RS - bad.offset;
        bool clobbers = inside && bad.offset < 8192 + T * H * 2 * 2; /* over x, logits */
        if (clobbers)
            continue;
        raw_expect(&me, &req,
                   inside ? MOE__STATUS__STATUS_OK : MOE__STATUS__STATUS_INVALID_ARGUMENT, NULL);
        if (inside) {
            ok++;
            memset((uint8_t *)mine + bad.offset, 0xa5, bytes);
        } else {
            refused++;
        }
    }
    for (size_t i = 16384; i < RS; i++)
        CHECK_MSG(((uint8_t *)mine)[i] == 0xa5, "byte %zu of the region changed", i);
    for (size_t i = 0; i < RS; i++)
        CHECK_MSG(((uint8_t *)theirs)[i] == 0x5a, "byte %zu of another session's region changed",
                  i);
    fprintf(stderr, "  2000 guessed tokens, 500 guessed region ids refused; %u tensors in "
                    "bounds served, %u out of bounds refused\n", ok, refused);
    raw_close(&me);
    raw_close(&other);
    raw_close(&dead);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

TEST(weights_load_only_from_allowed_dirs)
{
    uint64_t seed = test_seed();
    char allowed[] = "/tmp/moed-allowed.XXXXXX", outside[] = "/tmp/moed-outside.XXXXXX";
    CHECK(mkdtemp(allowed) && mkdtemp(outside));
    char sibling[64];
    snprintf(sibling, sizeof(sibling), "%s-sibling", allowed);
    CHECK(mkdir(sibling, 0700) == 0);
    uint16_t w[3][2][16 * 8];
    struct st_out t[6];
    char names[6][64];
    for (int e = 0; e < 2; e++)
        for (int p = 0; p < 3; p++) {
            itest_fill(&seed, MOE_DTYPE_BF16, w[p][e], 128, 0.5f);
            snprintf(names[e * 3 + p], 64, "experts.%d.w%d.weight", e, p == 0 ? 1 : p == 1 ? 3 : 2);
            t[e * 3 + p] = (struct st_out){.name = names[e * 3 + p], .dtype = ST_BF16, .ndim = 2,
                                           .shape = {p < 2 ? 16 : 8, p < 2 ? 8 : 16},
                                           .data = w[p][e]};
        }
    char good[300], out_file[300], sib_file[300], fifo[300], subdir[300], dirlink[300],
        via_link[300], dotdot[300];
    snprintf(good, sizeof(good), "%s/good.safetensors", allowed);
    snprintf(out_file, sizeof(out_file), "%s/w.safetensors", outside);
    snprintf(sib_file, sizeof(sib_file), "%s/w.safetensors", sibling);
    snprintf(fifo, sizeof(fifo), "%s/fifo.safetensors", allowed);
    snprintf(subdir, sizeof(subdir), "%s/sub", allowed);
    snprintf(dirlink, sizeof(dirlink), "%s/link", allowed);
    snprintf(via_link, sizeof(via_link), "%s/link/w.safetensors", allowed);
    snprintf(dotdot, sizeof(dotdot), "%s/sub/../../%s/w.safetensors", allowed,
             strrchr(outside, '/') + 1);
    CHECK(st_write(good, t, 6) == 0 && st_write(out_file, t, 6) == 0 &&
          st_write(sib_file, t, 6) == 0);
    CHECK(mkfifo(fifo, 0600) == 0 && mkdir(subdir, 0700) == 0 && symlink(outside, dirlink) == 0);

    /* Without allowed directories nothing loads. */
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "loader");
    moe_layer_desc desc = {.name = "w", .kind = MOE_LAYER_MOE, .topk = 2, .path = good,
                           .routing = MOE_ROUTING_SOFTMAX};
    CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -EACCES);
    CHECK_STR_CONTAINS(moe_errmsg(), "no directories are allowed");
    moe_disconnect(&c);
    itest_daemon_stop(&d);

    itest_daemon_start(&d, "--allow-dir", allowed, NULL);
    c = itest_connect(&d, "loader");
    moe_set_timeout(c, 5000);
    struct {
        const char *path;
        int err;
        const char *needle;
    } cases[] = {
        {out_file, -EACCES, "outside the allowed directories"},
        {sib_file, -EACCES, "outside the allowed directories"}, /* a prefix is not a parent */
        {via_link, -EACCES, "outside the allowed directories"}, /* a linked directory */
        {dotdot, -EACCES, "outside the allowed directories"},
        {"/proc/self/environ", -EACCES, "outside"},
        {"/dev/zero", -EACCES, "outside"},
        {fifo, -EIO, "not a regular file"}, /* used to block the loader forever */
        {subdir, -EIO, "not a regular file"},
        {allowed, -EACCES, "outside the allowed directories"}, /* not under itself */
    };
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        desc.path = cases[i].path;
        int rc = moe_layer_load(c, &desc, NULL);
        CHECK_MSG(rc == cases[i].err, "%s: got %d (%s), want %d", cases[i].path, rc, moe_errmsg(),
                  cases[i].err);
        CHECK_STR_CONTAINS(moe_errmsg(), cases[i].needle);
    }
    desc.path = good;
    CHECK_MSG(moe_layer_load(c, &desc, NULL) == 0, "%s", moe_errmsg());
    moe_disconnect(&c);
    itest_daemon_stop(&d); /* a loader stuck on the FIFO would hang here */
    itest_rmdir(allowed);
    itest_rmdir(outside);
    itest_rmdir(sibling);
}

/* Access is the runtime directory's: a user outside its group cannot
 * connect to either socket, even holding a valid token; a member can. */
TEST(connecting_needs_access_to_the_runtime_dir)
{
    if (geteuid() != 0)
        TEST_SKIP("needs root to switch to the user nobody (uid 65534)");
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    /* The two clients fork now, while this process has no threads; they
     * wait for a valid session token to try. */
    struct itest_layer L = layer_make();
    pid_t pids[2];
    int pipes[2][2];
    for (int member = 0; member < 2; member++) {
        CHECK(pipe(pipes[member]) == 0);
        fflush(stderr);
        pids[member] = fork();
        CHECK(pids[member] >= 0);
        if (pids[member])
            continue;
        uint8_t token[16];
        CHECK(read(pipes[member][0], token, 16) == 16);
        gid_t gid = member ? 65534 : 65533;
        CHECK(setgroups(0, NULL) == 0 && setgid(gid) == 0 && setuid(65534) == 0);
        prctl(PR_SET_DUMPABLE, 1); /* LeakSanitizer at exit needs it (SAN=1) */
        struct raw r;
        memset(&r, 0, sizeof(r));
        int rc = raw_connect_session(&r, d.dir);
        moe_client *cc = NULL;
        int crc = moe_connect(d.dir, "nobody", &cc);
        if (!member) {
            CHECK_MSG(rc == -EACCES, "session socket: %s", strerror(-rc));
            CHECK_MSG(crc < 0, "libmoe connected without access");
            /* Even with a stolen valid token, the request socket is out of
             * reach: nothing answers. */
            raw_connect_zmq(&r, d.dir, 1000);
            memcpy(r.token, token, 16);
            Moe__Request req = MOE__REQUEST__INIT;
            Moe__Hello h = MOE__HELLO__INIT;
            h.protocol_version = 1;
            req.body_case = MOE__REQUEST__BODY_HELLO;
            req.hello = &h;
            raw_send(&r, &req);
            Moe__Reply *rep = raw_recv_try(&r);
            CHECK_MSG(rep == NULL, "a reply came through the request socket");
            raw_close(&r);
            _exit(0);
        }
        CHECK_MSG(rc == 0, "session socket: %s", strerror(-rc));
        close(r.sfd);
        CHECK_MSG(crc == 0, "libmoe as a member: %s", moe_errmsg());
        struct itest_fwd f;
        uint64_t s2 = 7;
        itest_fwd_make(cc, &L, 3, &s2, &f);
        CHECK_MSG(moe_forward(cc, &f.args, NULL) == 0, "%s", moe_errmsg());
        moe_region_free(cc, &f.r);
        moe_disconnect(&cc);
        _exit(0);
    }
    uint64_t seed = test_seed();
    moe_client *c = itest_connect(&d, "itest");
    itest_layer_upload(c, &L, &seed);
    struct raw owner;
    raw_open(&owner, d.dir, true);
    char sock[300], zsock[300];
    snprintf(sock, sizeof(sock), "%s/moed.sock", d.dir);
    snprintf(zsock, sizeof(zsock), "%s/moed.zmq", d.dir);
    struct stat st;
    CHECK(stat(sock, &st) == 0 && (st.st_mode & 0777) == 0660);
    CHECK(stat(zsock, &st) == 0 && (st.st_mode & 0777) == 0660);
    /* As the service's tmpfiles would: the directory and the sockets
     * belong to the group that may connect (here nogroup, 65534). */
    CHECK(chown(d.dir, 0, 65534) == 0 && chmod(d.dir, 0750) == 0);
    CHECK(chown(sock, 0, 65534) == 0 && chown(zsock, 0, 65534) == 0);
    for (int member = 0; member < 2; member++) {
        CHECK(write(pipes[member][1], owner.token, 16) == 16);
        int wst;
        CHECK(waitpid(pids[member], &wst, 0) == pids[member]);
        CHECK_MSG(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "%s client failed",
                  member ? "member" : "non-member");
    }
    fprintf(stderr, "  uid 65534 outside the group: refused on both sockets; in the group: served\n");
    raw_close(&owner);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* ---- regressions ----------------------------------------------------------- */

/* A grouped GEMM whose groups are all empty used to stay queued forever
 * (a batch takes rows; it had none) and stall every later request of its
 * layer, and, being the oldest, every other layer too. */
TEST(an_empty_grouped_gemm_does_not_stall_the_batcher)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_make();
    itest_layer_upload(c, &L, &seed);
    moe_region *wr;
    enum { G = 4, N = 16, K = 16 };
    CHECK(moe_region_create(c, G * N * K * 2, "B", &wr) == 0);
    itest_fill(&seed, MOE_DTYPE_BF16, moe_region_data(wr), G * N * K, 0.5f);
    moe_layer_desc gd = {.name = "g", .kind = MOE_LAYER_GEMM, .dtype = MOE_DTYPE_BF16,
                         .groups = G, .n = N, .k = K,
                         .w1 = moe_tensor_3d(wr, 0, MOE_DTYPE_BF16, G, N, K)};
    CHECK_MSG(moe_layer_load(c, &gd, NULL) == 0, "%s", moe_errmsg());
    moe_region *r;
    CHECK(moe_region_create(c, 4096, "ac", &r) == 0);
    uint64_t ms[G] = {0, 0, 0, 0};
    moe_gemm_args a = {.layer = "g", .a = moe_tensor_2d(r, 0, MOE_DTYPE_BF16, 0, K),
                       .c = moe_tensor_2d(r, 0, MOE_DTYPE_BF16, 0, N), .m_sizes = ms,
                       .groups = G};
    moe_set_timeout(c, 5000);
    CHECK_MSG(moe_gemm(c, &a, NULL) == 0, "empty gemm: %s", moe_errmsg());
    ms[2] = 3;
    a.a = moe_tensor_2d(r, 0, MOE_DTYPE_BF16, 3, K);
    a.c = moe_tensor_2d(r, 1024, MOE_DTYPE_BF16, 3, N);
    CHECK_MSG(moe_gemm(c, &a, NULL) == 0, "gemm after the empty one: %s", moe_errmsg());
    struct itest_fwd f;
    itest_fwd_make(c, &L, 5, &seed, &f);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "forward after the empty gemm: %s",
              moe_errmsg());
    moe_region_free(c, &f.r);
    moe_region_free(c, &r);
    moe_region_free(c, &wr);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* timeout_us near 2^64 used to wrap the deadline into the past, so the
 * request expired at once. */
TEST(a_huge_timeout_is_no_deadline)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_make();
    itest_layer_upload(c, &L, &seed);
    struct raw r;
    raw_open(&r, d.dir, true);
    void *base;
    uint64_t reg = raw_region(&r, 1 << 16, &base);
    itest_fill(&seed, MOE_DTYPE_BF16, base, 4 * 128, 1.0f);
    uint64_t sx[] = {4, 128}, sl[] = {4, 8};
    Moe__Tensor x = tensor(reg, 0, MOE__DTYPE__DTYPE_BF16, sx, 2);
    Moe__Tensor lg = tensor(reg, 4096, MOE__DTYPE__DTYPE_FP32, sl, 2);
    Moe__Tensor out = tensor(reg, 8192, MOE__DTYPE__DTYPE_BF16, sx, 2);
    Moe__Request req;
    Moe__FusedMoe fm;
    uint64_t timeouts[] = {UINT64_MAX, UINT64_MAX - 1000, 1ull << 63, 60000000};
    for (size_t i = 0; i < ARRAY_LEN(timeouts); i++) {
        fused_req(&req, &fm, &x, &lg, &out);
        req.timeout_us = timeouts[i];
        raw_expect(&r, &req, MOE__STATUS__STATUS_OK, NULL);
    }
    raw_close(&r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* The reply to a successful UnregisterRegion used to be an empty datagram,
 * which the client cannot tell from the end of its session: libmoe's
 * moe_region_free() returned -ECONNRESET every time. */
TEST(unregistering_a_region_is_answered)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    for (int i = 0; i < 3; i++) {
        moe_region *r;
        CHECK(moe_region_create(c, 4096, "r", &r) == 0);
        CHECK_MSG(moe_region_free(c, &r) == 0, "moe_region_free: %s", moe_errmsg());
    }
    struct raw raw;
    raw_open(&raw, d.dir, true);
    uint64_t id = raw_region(&raw, 4096, NULL);
    CHECK_EQ_INT(raw_unregister(&raw, id), MOE__STATUS__STATUS_OK);
    CHECK_EQ_INT(raw_unregister(&raw, id), MOE__STATUS__STATUS_NOT_FOUND);
    raw_hello(&raw);
    raw_close(&raw);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* A session request sent without waiting: 1 sent, 0 no room (EAGAIN). */
static int session_send_nowait(struct raw *r, const Moe__SessionRequest *req, int fd)
{
    ssize_t k = raw_session_send(r, req, &fd, fd >= 0, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0;
    CHECK_MSG(k == (ssize_t)moe__session_request__get_packed_size(req), "sendmsg: %s",
              strerror(errno));
    return 1;
}

/* A client that sends its session requests back to back and reads their
 * answers only when it cannot send more: the daemon's answers fill the
 * socket, and the rest wait in the daemon, which stops reading that
 * client meanwhile. Every request is answered, in order: the unknown
 * regions' refusals, and the registration among them with an id that
 * works. Another client is served all the while. */
TEST(session_requests_sent_back_to_back_are_all_answered)
{
    enum { N = 3000, REG = N / 2 };
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    struct raw r, other;
    raw_open(&r, d.dir, true);
    raw_open(&other, d.dir, true);
    Moe__SessionRequest un = MOE__SESSION_REQUEST__INIT, reg = MOE__SESSION_REQUEST__INIT;
    Moe__UnregisterRegion ur = MOE__UNREGISTER_REGION__INIT;
    Moe__RegisterRegion rr = MOE__REGISTER_REGION__INIT;
    ur.region = 12345;
    un.body_case = MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION;
    un.unregister_region = &ur;
    rr.size = 4096;
    reg.body_case = MOE__SESSION_REQUEST__BODY_REGISTER_REGION;
    reg.register_region = &rr;
    int mfd = memfd_sized(4096, F_SEAL_SHRINK | F_SEAL_GROW);
    int sent = 0, got = 0, stalls = 0;
    uint64_t region = 0;
    while (got < N) {
        if (sent < N && session_send_nowait(&r, sent == REG ? &reg : &un,
                                            sent == REG ? mfd : -1)) {
            sent++;
            continue;
        }
        /* No room for more: the daemon has stopped reading this client. */
        if (sent < N && stalls++ % 64 == 0)
            raw_hello(&other);
        struct pollfd p = {r.sfd, POLLIN, 0};
        CHECK_MSG(poll(&p, 1, 5000) == 1, "no answer to request %d of %d (%d sent)", got, N,
                  sent);
        uint8_t buf[512];
        ssize_t k = recv(r.sfd, buf, sizeof(buf), 0);
        CHECK_MSG(k > 0, "answer %d: %s", got, k < 0 ? strerror(errno) : "end of session");
        Moe__SessionReply *rep = moe__session_reply__unpack(NULL, (size_t)k, buf);
        CHECK(rep != NULL);
        if (got == REG) {
            CHECK_MSG(rep->status == MOE__STATUS__STATUS_OK && rep->region,
                      "registration: status %d (%s)", (int)rep->status,
                      rep->message ? rep->message : "");
            region = rep->region;
        } else {
            CHECK_MSG(rep->status == MOE__STATUS__STATUS_NOT_FOUND,
                      "answer %d: status %d (%s)", got, (int)rep->status,
                      rep->message ? rep->message : "");
        }
        moe__session_reply__free_unpacked(rep, NULL);
        got++;
    }
    fprintf(stderr, "  %d requests, %d times the client could not send more\n", N, stalls);
    CHECK_MSG(stalls > 0, "the client never had to wait: the daemon's answers did not back up");
    close(mfd);
    CHECK_EQ_INT(raw_unregister(&r, region), MOE__STATUS__STATUS_OK);
    raw_hello(&r);
    raw_close(&r);
    raw_hello(&other);
    raw_close(&other);
    itest_daemon_stop(&d);
}

/* OpenSession asking for a reply socket, with these descriptors beside it. */
static Moe__SessionReply *open_asking_reply_socket(struct raw *r, const int *fds, int nfds)
{
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__OpenSession os = MOE__OPEN_SESSION__INIT;
    os.protocol_version = 1;
    os.client_name = "raw";
    os.reply_socket = true;
    req.body_case = MOE__SESSION_REQUEST__BODY_OPEN;
    req.open = &os;
    return raw_session_call(r, &req, fds, nfds);
}

/* OpenSession's reply socket must be one end of an AF_UNIX SOCK_SEQPACKET
 * socketpair: none, a pipe, a stream socket, two descriptors or a socket
 * connected to a listener are refused with a message, the session stays
 * closed, and the daemon serves on. */
static int open_with_reply_fds(const char *dir, const int *fds, int nfds)
{
    struct raw r;
    memset(&r, 0, sizeof(r));
    CHECK(raw_connect_session(&r, dir) == 0);
    Moe__SessionReply *rep = open_asking_reply_socket(&r, fds, nfds);
    int st = (int)rep->status;
    if (st)
        CHECK_MSG(rep->message && strstr(rep->message, "reply_socket"), "message: %s",
                  rep->message ? rep->message : "(none)");
    moe__session_reply__free_unpacked(rep, NULL);
    close(r.sfd);
    return st;
}

TEST(a_bad_reply_socket_is_refused)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    int pfd[2], st[2], sp[2];
    CHECK(pipe(pfd) == 0);
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, st) == 0);
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sp) == 0);
    CHECK(open_with_reply_fds(d.dir, NULL, 0) != 0);
    CHECK(open_with_reply_fds(d.dir, &pfd[1], 1) != 0);
    CHECK(open_with_reply_fds(d.dir, &st[1], 1) != 0);
    int two[2] = {sp[1], sp[1]};
    CHECK(open_with_reply_fds(d.dir, two, 2) != 0);
    /* A socket connected to a listener (here moed's own session socket):
     * the replies would go to whoever listens there. */
    struct raw named;
    memset(&named, 0, sizeof(named));
    CHECK(raw_connect_session(&named, d.dir) == 0);
    CHECK(open_with_reply_fds(d.dir, &named.sfd, 1) != 0);
    close(named.sfd);
    CHECK_EQ_INT(open_with_reply_fds(d.dir, &sp[1], 1), 0);
    for (int i = 0; i < 2; i++) {
        close(pfd[i]);
        close(st[i]);
        close(sp[i]);
    }
    moe_client *c = itest_connect(&d, "itest");
    moe_server_info info;
    CHECK_MSG(moe_hello(c, &info) == 0, "%s", moe_errmsg());
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* A raw session with a reply socket: its token in r, our end in *rfd;
 * the daemon's end gets a send buffer of sndbuf bytes unless 0. */
static void open_with_socket_buf(struct raw *r, const char *dir, int *rfd, int sndbuf)
{
    int sp[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0);
    if (sndbuf)
        CHECK(setsockopt(sp[1], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)) == 0);
    memset(r, 0, sizeof(*r));
    CHECK(raw_connect_session(r, dir) == 0);
    raw_connect_zmq(r, dir, 300);
    Moe__SessionReply *rep = open_asking_reply_socket(r, &sp[1], 1);
    CHECK_EQ_INT((int)rep->status, 0);
    CHECK_MSG(rep->socket_requests, "the daemon does not read requests on reply sockets");
    CHECK(rep->token.len == 16);
    memcpy(r->token, rep->token.data, 16);
    r->session_id = rep->session_id;
    moe__session_reply__free_unpacked(rep, NULL);
    close(sp[1]);
    *rfd = sp[0];
}

static void open_with_socket(struct raw *r, const char *dir, int *rfd)
{
    open_with_socket_buf(r, dir, rfd, 0);
}

/* Send bytes on a reply socket without blocking: 0, or -errno. */
static int socket_send(int fd, const void *buf, size_t n)
{
    return send(fd, buf, n, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)n ? 0 : -errno;
}

static int socket_send_req(struct raw *r, int fd, Moe__Request *req, const uint8_t *token)
{
    uint8_t buf[1024];
    req->id = ++r->next_id;
    req->token.data = (uint8_t *)(token ? token : r->token);
    req->token.len = 16;
    return socket_send(fd, buf, moe__request__pack(req, buf));
}

/* True when the daemon closed its end of the reply socket within wait_ms,
 * with nothing sent on it first. */
static bool socket_closed(int fd, int wait_ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, wait_ms) <= 0)
        return false;
    uint8_t b[64];
    return recv(fd, b, sizeof(b), MSG_DONTWAIT) == 0;
}

/* The next reply on a reply socket, or NULL after wait_ms. */
static Moe__Reply *socket_recv(int fd, int wait_ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, wait_ms) <= 0)
        return NULL;
    uint8_t buf[8192];
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    return n > 0 ? moe__reply__unpack(NULL, (size_t)n, buf) : NULL;
}

static Moe__Request hello_req(Moe__Hello *h)
{
    Moe__Request req = MOE__REQUEST__INIT;
    moe__hello__init(h);
    h->protocol_version = 1;
    req.body_case = MOE__REQUEST__BODY_HELLO;
    return req;
}

/* Requests on a reply socket are answered there, and only there; a foreign
 * token, garbage, a ZeroMQ peer posing as a reply socket and a client that
 * floods its socket without reading are refused or held back, and nothing
 * is lost. */
TEST(requests_on_a_reply_socket_are_checked)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    struct raw a, b;
    int afd;
    open_with_socket(&a, d.dir, &afd);
    raw_open(&b, d.dir, true);
    Moe__Hello h;
    Moe__Request req = hello_req(&h);
    req.hello = &h;

    /* Its own token: answered on the socket. */
    CHECK_EQ_INT(socket_send_req(&a, afd, &req, NULL), 0);
    Moe__Reply *rep = socket_recv(afd, 5000);
    CHECK_MSG(rep != NULL, "no reply on the reply socket");
    CHECK_EQ_INT((int)rep->status, 0);
    CHECK(rep->id == a.next_id && rep->body_case == MOE__REPLY__BODY_HELLO);
    moe__reply__free_unpacked(rep, NULL);

    /* Another session's token, bytes that are no Request, an empty
     * datagram: never answered on the socket (an answer could loop back as
     * the next "request"); the daemon closes it and the session goes on by
     * ZeroMQ; b hears nothing. */
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0x01, 0x02};
    for (int k = 0; k < 3; k++) {
        struct raw x;
        int xfd;
        open_with_socket(&x, d.dir, &xfd);
        if (k == 0)
            CHECK_EQ_INT(socket_send_req(&x, xfd, &req, b.token), 0);
        else
            CHECK_EQ_INT(socket_send(xfd, junk, k == 1 ? sizeof(junk) : 0), 0);
        CHECK_MSG(socket_closed(xfd, 5000), "case %d: the reply socket was answered or kept", k);
        raw_hello(&x);
        close(xfd);
        raw_close(&x);
    }
    CHECK(raw_recv_try(&b) == NULL);

    /* A ZeroMQ peer whose routing id is the one the daemon gives a's socket
     * (a zero byte, 'S', the session id): its request must not be answered
     * on a's socket. libzmq may refuse such an id outright. */
    uint8_t forged[10] = {0, 'S'};
    memcpy(forged + 2, &a.session_id, 8);
    struct raw c;
    memset(&c, 0, sizeof(c));
    CHECK(raw_connect_session(&c, d.dir) == 0);
    CHECK_EQ_INT(raw_open_session_try(&c), 0);
    c.zctx = zmq_ctx_new();
    c.zsock = zmq_socket(c.zctx, ZMQ_DEALER);
    int linger = 0, tmo = 300;
    zmq_setsockopt(c.zsock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(c.zsock, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
    if (zmq_setsockopt(c.zsock, ZMQ_ROUTING_ID, forged, sizeof(forged)) == 0) {
        char ep[300];
        snprintf(ep, sizeof(ep), "ipc://%s/moed.zmq", d.dir);
        CHECK(zmq_connect(c.zsock, ep) == 0);
        CHECK_EQ_INT(raw_send(&c, &req), 0);
        rep = socket_recv(afd, 500);
        CHECK_MSG(rep == NULL, "a ZeroMQ peer's request was answered on another's reply socket");
        CHECK(raw_recv_try(&c) == NULL);
    }
    raw_close(&c);

    /* Flood: send until the socket is full, without reading. The daemon
     * stops reading a socket whose replies wait, so others are still served
     * and, once a reads, every request is answered exactly once. */
    uint64_t first = a.next_id + 1;
    int sent = 0;
    while (sent < 200000 && socket_send_req(&a, afd, &req, NULL) == 0)
        sent++;
    a.next_id = first - 1 + (uint64_t)sent; /* the failed send took an id */
    CHECK_MSG(sent > 100, "only %d requests fit", sent);
    raw_hello(&b);
    moe_client *other = itest_connect(&d, "itest");
    moe_server_info info;
    CHECK_MSG(moe_hello(other, &info) == 0, "%s", moe_errmsg());
    moe_disconnect(&other);
    uint8_t *seen = calloc((size_t)sent, 1);
    CHECK(seen != NULL);
    int got = 0;
    while (got < sent && (rep = socket_recv(afd, 5000)) != NULL) {
        CHECK_MSG(rep->id >= first && rep->id < first + (uint64_t)sent && !seen[rep->id - first],
                  "unexpected or repeated reply %llu", (unsigned long long)rep->id);
        CHECK_EQ_INT((int)rep->status, 0);
        seen[rep->id - first] = 1;
        got++;
        moe__reply__free_unpacked(rep, NULL);
    }
    CHECK_MSG(got == sent, "%d of %d flooded requests answered", got, sent);
    CHECK(raw_recv_try(&a) == NULL); /* none of them on the request socket */
    free(seen);
    close(afd);
    raw_close(&a);
    raw_close(&b);
    itest_daemon_stop(&d);
}

/* A reply too large for one datagram of the reply socket (a ListLayers of
 * many layers, on a socket whose send buffer the client made small) comes
 * back as an error with the request's id, and the socket stays open: the
 * replies behind it still come, and the same request on the request
 * socket is answered in full. */
TEST(a_reply_too_large_for_the_reply_socket_is_an_error)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    uint64_t seed = 0x5eed1157;
    enum { LAYERS = 64 };
    for (int i = 0; i < LAYERS; i++) {
        struct itest_layer L = {.dt = MOE_DTYPE_BF16, .sh = {2, 1, 64, 64},
                                .routing = MOE_ROUTING_SOFTMAX};
        /* 64 characters, the longest name. */
        snprintf(L.name, sizeof(L.name), "a-long-layer-name-to-make-the-list-reply-large-%016d", i);
        itest_layer_upload(c, &L, &seed);
        itest_layer_free(&L);
    }
    struct raw a;
    int afd;
    open_with_socket_buf(&a, d.dir, &afd, 1); /* the kernel's least: a few KiB */
    Moe__ListLayers ll = MOE__LIST_LAYERS__INIT;
    Moe__Request list = MOE__REQUEST__INIT;
    list.body_case = MOE__REQUEST__BODY_LIST_LAYERS;
    list.list_layers = &ll;
    Moe__Hello h;
    Moe__Request hello = hello_req(&h);
    hello.hello = &h;

    CHECK_EQ_INT(socket_send_req(&a, afd, &list, NULL), 0);
    uint64_t list_id = a.next_id;
    CHECK_EQ_INT(socket_send_req(&a, afd, &hello, NULL), 0);
    Moe__Reply *rep = socket_recv(afd, 5000);
    CHECK_MSG(rep != NULL, "no reply: the reply socket was closed or the reply lost");
    CHECK(rep->id == list_id);
    CHECK_EQ_INT((int)rep->status, MOE__STATUS__STATUS_RESOURCE_EXHAUSTED);
    CHECK_MSG(rep->message && strstr(rep->message, "request socket"), "message: %s",
              rep->message ? rep->message : "(none)");
    moe__reply__free_unpacked(rep, NULL);
    rep = socket_recv(afd, 5000);
    CHECK_MSG(rep != NULL, "the reply queued behind the large one was lost");
    CHECK(rep->id == a.next_id && rep->status == 0 && rep->body_case == MOE__REPLY__BODY_HELLO);
    moe__reply__free_unpacked(rep, NULL);

    /* The socket still carries requests, and ZeroMQ carries the list. */
    CHECK_EQ_INT(socket_send_req(&a, afd, &hello, NULL), 0);
    rep = socket_recv(afd, 5000);
    CHECK_MSG(rep != NULL && rep->status == 0, "the reply socket stopped answering");
    moe__reply__free_unpacked(rep, NULL);
    CHECK_EQ_INT(raw_send(&a, &list), 0);
    rep = raw_recv(&a);
    CHECK_EQ_INT((int)rep->status, 0);
    CHECK(rep->body_case == MOE__REPLY__BODY_LAYERS && rep->layers->n_layers == LAYERS);
    moe__reply__free_unpacked(rep, NULL);

    close(afd);
    raw_close(&a);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* Descriptors sent with an empty datagram on the session socket (which
 * reads as the end of the session) are closed with it, not kept by the
 * daemon for good. */
TEST(descriptors_with_an_empty_datagram_are_closed)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    struct raw probe;
    raw_open(&probe, d.dir, true);
    raw_hello(&probe);
    int before = itest_count_fds(d.pid);
    for (int i = 0; i < 30; i++) {
        struct raw r;
        memset(&r, 0, sizeof(r));
        CHECK(raw_connect_session(&r, d.dir) == 0);
        int fds[4];
        for (int k = 0; k < 4; k++)
            fds[k] = memfd_sized(4096, F_SEAL_SHRINK | F_SEAL_GROW);
        union {
            char raw[CMSG_SPACE(sizeof(fds))];
            struct cmsghdr align;
        } cb;
        memset(&cb, 0, sizeof(cb));
        struct iovec iov = {NULL, 0};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb.raw,
                            .msg_controllen = sizeof(cb.raw)};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(fds));
        memcpy(CMSG_DATA(cm), fds, sizeof(fds));
        CHECK(sendmsg(r.sfd, &mh, MSG_NOSIGNAL) == 0);
        for (int k = 0; k < 4; k++)
            close(fds[k]);
        /* The daemon closes the session: our end reads its end. */
        uint8_t b;
        CHECK(recv(r.sfd, &b, 1, 0) == 0);
        close(r.sfd);
    }
    raw_hello(&probe); /* the daemon has read everything before */
    int after = itest_count_fds(d.pid);
    CHECK_MSG(after <= before + 2, "the daemon holds %d descriptors, %d before", after, before);
    raw_close(&probe);
    itest_daemon_stop(&d);
}

/* CPU time (user + system, clock ticks) the process has used. */
static long cpu_ticks(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the name may hold spaces */
    CHECK(p != NULL);
    long ut = 0, st = 0;
    /* After ") ": state, then fields 4..13, then utime (14), stime (15). */
    CHECK(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld", &ut, &st) == 2);
    return ut + st;
}

/* The daemon's soft limit on descriptors (that of whoever started it, often
 * 1024) is raised to the hard one: every client holds several. */
TEST(the_descriptor_limit_is_raised_to_the_hard_one)
{
    struct rlimit mine, low;
    CHECK(getrlimit(RLIMIT_NOFILE, &mine) == 0);
    if (mine.rlim_max < 512)
        TEST_SKIP("a hard limit of %llu leaves nothing to raise", (unsigned long long)mine.rlim_max);
    low = mine;
    low.rlim_cur = 256;
    CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0);
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    CHECK(setrlimit(RLIMIT_NOFILE, &mine) == 0);
    struct rlimit got;
    CHECK(prlimit(d.pid, RLIMIT_NOFILE, NULL, &got) == 0);
    CHECK_MSG(got.rlim_cur == mine.rlim_max, "the daemon's limit is %llu of %llu",
              (unsigned long long)got.rlim_cur, (unsigned long long)mine.rlim_max);
    itest_daemon_stop(&d);
}

/* Whoever can write the runtime directory can replace moed.sock and pose
 * as the daemon: moed will not serve from a directory its group or others
 * may write, and libmoe will not connect through one. */
TEST(a_runtime_directory_others_can_write_is_refused)
{
    char dir[] = "/tmp/moed-itest.XXXXXX", log[64], bin[256];
    CHECK(mkdtemp(dir) != NULL);
    CHECK(chmod(dir, 0770) == 0);
    snprintf(log, sizeof(log), "%s.log", dir);
    snprintf(bin, sizeof(bin), "%s/moed", itest_build());
    char *argv[] = {bin, "--runtime-dir", dir, "--backend", "cpu", NULL};
    pid_t pid = itest_spawn(log, argv);
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "moed's status %d", st);
    FILE *f = fopen(log, "r");
    CHECK(f != NULL);
    char text[2048] = "";
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    text[n] = '\0';
    fclose(f);
    CHECK_STR_CONTAINS(text, "is writable by its group (mode 0770)");
    char sock[96];
    snprintf(sock, sizeof(sock), "%s/moed.sock", dir);
    struct stat sb;
    CHECK_MSG(stat(sock, &sb) < 0, "moed made its socket in %s", dir);
    CHECK(unlink(log) == 0 && rmdir(dir) == 0);

    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "before");
    CHECK(chmod(d.dir, 0777) == 0);
    moe_client *c2 = NULL;
    CHECK_EQ_INT(moe_connect(d.dir, "through", &c2), -EACCES);
    CHECK_STR_CONTAINS(moe_errmsg(), "is writable by anyone (mode 0777)");
    CHECK(c2 == NULL);
    CHECK(chmod(d.dir, 0700) == 0);
    c2 = itest_connect(&d, "after");
    CHECK_EQ_INT(moe_hello(c2, NULL), 0);
    CHECK_EQ_INT(moe_hello(c, NULL), 0);
    moe_disconnect(&c2);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* A daemon with a session (probe) whose limit on descriptors leaves it 8
 * more than it holds; was is the limit before. */
static void start_short_of_descriptors(struct itest_daemon *d, struct raw *probe, struct rlimit *was)
{
    itest_daemon_start(d, NULL);
    raw_open(probe, d->dir, true);
    raw_hello(probe);
    CHECK(prlimit(d->pid, RLIMIT_NOFILE, NULL, was) == 0);
    struct rlimit cap = *was;
    cap.rlim_cur = (rlim_t)itest_count_fds(d->pid) + 8;
    CHECK(prlimit(d->pid, RLIMIT_NOFILE, &cap, NULL) == 0);
}

/* The daemon does not spin out of descriptors: at most 10 ticks of CPU in
 * 600 ms. */
static void check_idle_out_of_descriptors(const struct itest_daemon *d)
{
    long t0 = cpu_ticks(d->pid);
    itest_sleep_ms(600);
    long spent = cpu_ticks(d->pid) - t0;
    CHECK_MSG(spent <= 10, "the daemon used %ld ticks of CPU in 600 ms out of descriptors", spent);
}

/* Lines of the daemon's log holding both a and b. */
static int log_lines_with(const struct itest_daemon *d, const char *a, const char *b)
{
    FILE *f = fopen(d->log, "r");
    CHECK(f != NULL);
    int n = 0;
    char line[512];
    while (fgets(line, sizeof(line), f))
        n += strstr(line, a) && strstr(line, b);
    fclose(f);
    return n;
}

/* The limit back as it was, the probe's session and a new one both work. */
static void check_recovers(struct itest_daemon *d, struct raw *probe, const struct rlimit *was)
{
    CHECK(prlimit(d->pid, RLIMIT_NOFILE, was, NULL) == 0);
    raw_hello(probe);
    struct raw late;
    raw_open(&late, d->dir, true);
    raw_hello(&late);
    raw_close(&late);
    raw_close(probe);
    itest_daemon_stop(d);
}

/* Out of descriptors, connections to the ZeroMQ socket are closed as they
 * come (their peers retry, as libzmq does) rather than kill the daemon:
 * libzmq's own listener aborts the process when accept fails so. */
TEST(a_zeromq_connection_flood_out_of_descriptors_is_survived)
{
    struct itest_daemon d;
    struct raw probe;
    struct rlimit was;
    start_short_of_descriptors(&d, &probe, &was);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    CHECK(strlen(d.dir) + sizeof("/moed.zmq") <= sizeof(sa.sun_path));
    strcat(strcpy(sa.sun_path, d.dir), "/moed.zmq");
    enum { CONNS = 40 };
    int fds[CONNS];
    for (int i = 0; i < CONNS; i++) {
        fds[i] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        CHECK(fds[i] >= 0);
        CHECK_MSG(connect(fds[i], (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect %d: %s", i,
                  strerror(errno));
    }
    itest_sleep_ms(300);
    CHECK_MSG(itest_daemon_alive(&d), "the daemon died in the flood");
    check_idle_out_of_descriptors(&d);
    int dropped = 0;
    for (int i = 0; i < CONNS; i++) {
        char c;
        dropped += recv(fds[i], &c, 1, MSG_DONTWAIT) == 0;
        close(fds[i]);
    }
    CHECK_MSG(dropped > 0, "none of %d connections past the limit was closed", CONNS);
    /* Logged at the next status tick (every 2 s). */
    uint64_t t0 = now_ms();
    while (log_lines_with(&d, "incoming connection", "out of descriptors") == 0 &&
           now_ms() - t0 < 5000)
        itest_sleep_ms(50);
    CHECK_MSG(log_lines_with(&d, "incoming connection", "out of descriptors") >= 1,
              "no warning of closed connections in %s", d.log);
    check_recovers(&d, &probe, &was);
}

/* Out of descriptors, the daemon stops accepting sessions for a while
 * instead of spinning on its readable listening socket (and logging at
 * each turn); once descriptors are free again, sessions are accepted. */
TEST(running_out_of_descriptors_pauses_accepting)
{
    struct itest_daemon d;
    struct raw probe;
    struct rlimit was;
    start_short_of_descriptors(&d, &probe, &was);
    enum { CONNS = 40 };
    struct raw r[CONNS];
    for (int i = 0; i < CONNS; i++) {
        memset(&r[i], 0, sizeof(r[i]));
        CHECK(raw_connect_session(&r[i], d.dir) == 0); /* the backlog takes it */
    }
    itest_sleep_ms(100);
    check_idle_out_of_descriptors(&d);
    int warned = log_lines_with(&d, "cannot accept a session: ", "Too many open files");
    CHECK_MSG(warned >= 1 && warned <= 12, "%d warnings in 700 ms", warned);
    for (int i = 0; i < CONNS; i++)
        close(r[i].sfd);
    check_recovers(&d, &probe, &was);
}

/* Two sessions whose reply sockets are the two ends of one socketpair, and
 * bytes that are no request written into it: the daemon must not answer
 * one session's socket into the other's for ever (it closes the socket
 * that got them), nor take sockets connected to a listener. */
TEST(cross_wired_reply_sockets_do_not_loop)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    int sp[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) == 0);
    struct raw a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    CHECK(raw_connect_session(&a, d.dir) == 0);
    CHECK(raw_connect_session(&b, d.dir) == 0);
    raw_connect_zmq(&a, d.dir, 2000);
    raw_connect_zmq(&b, d.dir, 2000);
    for (int i = 0; i < 2; i++) {
        struct raw *r = i ? &b : &a;
        Moe__SessionReply *rep = open_asking_reply_socket(r, &sp[i], 1);
        CHECK_EQ_INT((int)rep->status, 0);
        memcpy(r->token, rep->token.data, 16);
        moe__session_reply__free_unpacked(rep, NULL);
    }
    close(sp[1]); /* only the daemon reads b's socket now */
    static const uint8_t junk[] = {0x08, 0x01, 0x12, 0x03, 'a', 'b', 'c'};
    CHECK_EQ_INT(socket_send(sp[0], junk, sizeof(junk)), 0);
    /* More, until the daemon has closed b's end (EPIPE). */
    for (int i = 0; i < 20 && socket_send(sp[0], junk, sizeof(junk)) == 0; i++)
        ;
    usleep(300 * 1000);
    long t0 = cpu_ticks(d.pid);
    usleep(500 * 1000);
    long used = cpu_ticks(d.pid) - t0;
    CHECK_MSG(used < 15, "the daemon used %ld clock ticks of CPU in 500 ms of quiet", used);
    raw_hello(&a);
    raw_hello(&b);
    close(sp[0]);
    raw_close(&a);
    raw_close(&b);
    itest_daemon_stop(&d);
}

/* A client whose process takes signals (a profiler's timer, a handler for
 * SIGCHLD): libmoe's system calls and ZeroMQ calls can fail with EINTR,
 * having done nothing. A send or a session call so failed used to fail the
 * request; a receive so failed left a reply unread until the next slice of
 * the wait. Every request is answered, on ZeroMQ and on the reply socket. */

TEST(a_client_taking_signals_loses_no_reply)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    struct itest_layer L = layer_make();
    static const char *const paths[] = {"zmq", "socket"};
    for (size_t p = 0; p < ARRAY_LEN(paths); p++) {
        /* Requests and replies on ZeroMQ, then on the session's reply
         * socket (libmoe's default). */
        if (p == 0) {
            setenv("MOE_REQUESTS", "zmq", 1);
            setenv("MOE_REPLIES", "zmq", 1);
        } else {
            unsetenv("MOE_REQUESTS");
            unsetenv("MOE_REPLIES");
        }
        moe_client *c = itest_connect(&d, "itest");
        if (p == 0)
            itest_layer_upload(c, &L, &seed); /* the daemon keeps it */
        moe_set_timeout(c, 10000);
        test_signal_storm(50); /* several signals land in each round trip */
        uint64_t t0 = now_ms();
        int n = 0;
        for (; n < 200 || now_ms() - t0 < 1000; n++) {
            struct itest_fwd f;
            itest_fwd_make(c, &L, 1 + (size_t)(test_rand(&seed) % 7), &seed, &f);
            int rc = moe_forward(c, &f.args, NULL);
            CHECK_MSG(rc == 0, "%s path, request %d, %d signals in: %s", paths[p], n,
                      (int)test_signals_taken, moe_errmsg());
            double e = itest_fwd_error(&L, &f);
            CHECK_MSG(e < itest_tolerance(L.dt), "%s path, request %d: error %.3g", paths[p],
                      n, e);
            moe_region_free(c, &f.r);
        }
        test_signal_storm(0);
        printf("  %s: %d requests, %d signals taken in %llu ms\n", paths[p], n,
               (int)test_signals_taken, (unsigned long long)(now_ms() - t0));
        CHECK_MSG(test_signals_taken > n, "%d signals for %d requests: the timer did not fire",
                  (int)test_signals_taken, n);
        moe_disconnect(&c);
    }
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* A clean stop (SIGTERM) with requests in flight answers them all, and a
 * client taking signals meanwhile gets every answer. (Replies still on
 * their way through ZeroMQ when the session socket closes are waited for
 * until none has come for 100 ms, a signal or not; that race is rare here,
 * so this checks the stop under signals, not that wait.) */
TEST(a_client_taking_signals_gets_the_replies_of_a_clean_stop)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    struct itest_layer L = layer_make();
    setenv("MOE_REQUESTS", "zmq", 1);
    setenv("MOE_REPLIES", "zmq", 1);
    moe_client *c = itest_connect(&d, "itest");
    unsetenv("MOE_REQUESTS");
    unsetenv("MOE_REPLIES");
    itest_layer_upload(c, &L, &seed);
    enum { N = 32 };
    struct itest_fwd f[N];
    moe_request *rq[N];
    for (int i = 0; i < N; i++) {
        itest_fwd_make(c, &L, 1 + (size_t)(test_rand(&seed) % 7), &seed, &f[i]);
        CHECK(moe_forward_submit(c, &f[i].args, &rq[i]) == 0);
    }
    /* Requests on one connection arrive in order: once this Hello is
     * answered, the daemon holds all of them. */
    CHECK(moe_hello(c, NULL) == 0);
    test_signal_storm(50);
    kill(d.pid, SIGTERM);
    for (int i = 0; i < N; i++) {
        int rc = moe_wait(c, &rq[i], 20000, NULL);
        CHECK_MSG(rc == 0, "request %d, %d signals in: %s", i, (int)test_signals_taken,
                  moe_errmsg());
        double e = itest_fwd_error(&L, &f[i]);
        CHECK_MSG(e < itest_tolerance(L.dt), "request %d: error %.3g", i, e);
    }
    test_signal_storm(0);
    itest_daemon_wait_stopped(&d);
    for (int i = 0; i < N; i++)
        moe_region_free(c, &f[i].r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE_TIMEOUT(killed_clients_leak_nothing, 300),
        TEST_CASE(a_dying_client_never_shifts_another_clients_rows),
        TEST_CASE(tokens_and_region_ids_are_not_guessable_and_are_checked),
        TEST_CASE(weights_load_only_from_allowed_dirs),
        TEST_CASE(connecting_needs_access_to_the_runtime_dir),
        TEST_CASE(an_empty_grouped_gemm_does_not_stall_the_batcher),
        TEST_CASE(a_huge_timeout_is_no_deadline),
        TEST_CASE(unregistering_a_region_is_answered),
        TEST_CASE(session_requests_sent_back_to_back_are_all_answered),
        TEST_CASE(a_bad_reply_socket_is_refused),
        TEST_CASE(requests_on_a_reply_socket_are_checked),
        TEST_CASE(a_reply_too_large_for_the_reply_socket_is_an_error),
        TEST_CASE(descriptors_with_an_empty_datagram_are_closed),
        TEST_CASE(a_zeromq_connection_flood_out_of_descriptors_is_survived),
        TEST_CASE(a_runtime_directory_others_can_write_is_refused),
        TEST_CASE(cross_wired_reply_sockets_do_not_loop),
        TEST_CASE(running_out_of_descriptors_pauses_accepting),
        TEST_CASE(the_descriptor_limit_is_raised_to_the_hard_one),
        TEST_CASE(a_client_taking_signals_loses_no_reply),
        TEST_CASE(a_client_taking_signals_gets_the_replies_of_a_clean_stop),
        {0}});
}
