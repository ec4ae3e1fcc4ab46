/*
 * itest_soak.c: a bounded soak. Sixteen client processes for a minute: raw
 * clients pipeline valid requests of three layers (checking a sample of the
 * results against the reference), send invalid ones, drop their connection
 * with requests in flight and kill themselves mid-request (the supervisor
 * starts a new process in their place); libmoe clients do checked forwards
 * and grouped GEMMs, synchronous and asynchronous, and reconnect now and
 * then. Every request a live client sent must be answered exactly once:
 * zero lost, zero duplicated replies, zero wrong results, zero daemon
 * crashes; the daemon's resident memory stays flat and its descriptors come
 * back to the baseline. The figures are printed at the end.
 *
 * MOE_SOAK_SECONDS (default 60) and MOE_SOAK_CLIENTS (default 16, at most 32)
 * change the run. The supervisor has no threads while it forks clients (its
 * own client is disconnected): a fork while another thread holds a lock,
 * such as AddressSanitizer's allocator's, leaves the child stuck.
 */
#include "tests/integration/raw.h"

enum { MAXT = 32, SLOTS = 8, SLOT_BYTES = 20480, E = 8, K = 2, H = 64, I = 128 };
enum { G = 4, GN = 64, GK = 64 };
/* Within a slot: x, logits, ids, weights, out (MoE); a, c (GEMM), each
 * sized for MAXT rows (c ends at 18048). */
enum {
    OFF_X = 0, OFF_L = 4096, OFF_IDS = 5120, OFF_W = 5376, OFF_OUT = 5632,
    OFF_A = 9728, OFF_C = 9728 + 4096 + 128,
};

struct slot_stats {
    uint64_t sent, ok, busy, expired, refused, unexpected, lost, dup, checked, wrong;
    uint64_t reconnects, crashes, processes;
    char last[200];
};

struct shared {
    uint64_t deadline_ms;
    struct slot_stats slot[32];
};

static struct itest_layer Lsoft = {.name = "soft", .dt = MOE_DTYPE_BF16, .sh = {E, K, H, I},
                                   .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
static struct itest_layer Lgiven = {.name = "given", .dt = MOE_DTYPE_BF16, .sh = {E, K, H, I},
                                    .routing = MOE_ROUTING_GIVEN};
static void *gemm_b; /* B [G, GN, GK] bf16 */

static void note(struct slot_stats *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct slot_stats *st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->last, sizeof(st->last), fmt, ap);
    va_end(ap);
}

/* ---- reference checks ------------------------------------------------------ */

static double check_moe(const struct itest_layer *L, const uint8_t *slot, size_t T)
{
    int32_t ids[MAXT * K];
    float w[MAXT * K], g[MAXT * H], rf[MAXT * H];
    uint16_t ref[MAXT * H];
    if (L->routing == MOE_ROUTING_GIVEN) {
        memcpy(ids, slot + OFF_IDS, T * K * 4);
        memcpy(w, slot + OFF_W, T * K * 4);
    } else {
        moek_ref_route((const float *)(slot + OFF_L), (int)T, E, K, MOEK_SCORING_SOFTMAX, true,
                       ids, w);
    }
    CHECK(moek_ref_fused_moe(&L->sh, MOEK_DTYPE_BF16, slot + OFF_X, ids, w, L->w1, L->w3, L->w2,
                             (int)T, ref) == 0);
    moek_to_f32(MOEK_DTYPE_BF16, slot + OFF_OUT, g, T * H);
    moek_to_f32(MOEK_DTYPE_BF16, ref, rf, T * H);
    return moek_rel_error(g, rf, T * H);
}

static double check_gemm(const uint8_t *slot, const int64_t *ms, size_t M)
{
    uint16_t ref[MAXT * GN];
    float g[MAXT * GN], rf[MAXT * GN];
    CHECK(moek_ref_grouped_gemm(MOEK_DTYPE_BF16, G, GN, GK, slot + OFF_A, ms, gemm_b, ref) == 0);
    moek_to_f32(MOEK_DTYPE_BF16, slot + OFF_C, g, M * GN);
    moek_to_f32(MOEK_DTYPE_BF16, ref, rf, M * GN);
    return moek_rel_error(g, rf, M * GN);
}

/* ---- raw clients -------------------------------------------------------------- */

struct rclient {
    struct raw r;
    uint64_t reg;
    uint8_t *base;
    struct itest_daemon *d;
};

static void rclient_open(struct rclient *rc)
{
    raw_open(&rc->r, rc->d->dir, true);
    int to = 10000;
    zmq_setsockopt(rc->r.zsock, ZMQ_RCVTIMEO, &to, sizeof(to));
    void *b;
    rc->reg = raw_region(&rc->r, SLOTS * SLOT_BYTES, &b);
    rc->base = b;
}

static void rclient_close(struct rclient *rc)
{
    munmap(rc->base, SLOTS * SLOT_BYTES);
    raw_close(&rc->r);
}

/* One request in a pipeline: what was asked, where, and its id. */
struct pend {
    uint64_t id;
    int kind; /* 0 soft, 1 given, 2 gemm */
    size_t T;
    int64_t ms[G];
    bool answered, timed;
};

struct reqbuf {
    Moe__Request req;
    Moe__FusedMoe fm;
    Moe__GroupedGemm gg;
    Moe__Tensor x, lg, ids, w, out, a, c;
    uint64_t sx[2], sl[2], sk[2], sa[2], sc[2], ms[G];
};

static void build(struct reqbuf *b, uint64_t reg, int slot, int kind, size_t T, const int64_t *ms)
{
    uint64_t base = (uint64_t)slot * SLOT_BYTES;
    moe__request__init(&b->req);
    if (kind < 2) {
        moe__fused_moe__init(&b->fm);
        b->sx[0] = b->sl[0] = b->sk[0] = T;
        b->sx[1] = H;
        b->sl[1] = E;
        b->sk[1] = K;
        b->x = raw_tensor(reg, base + OFF_X, MOE__DTYPE__DTYPE_BF16, b->sx, 2);
        b->out = raw_tensor(reg, base + OFF_OUT, MOE__DTYPE__DTYPE_BF16, b->sx, 2);
        b->fm.x = &b->x;
        b->fm.out = &b->out;
        if (kind == 0) {
            b->fm.layer = "soft";
            b->lg = raw_tensor(reg, base + OFF_L, MOE__DTYPE__DTYPE_FP32, b->sl, 2);
            b->fm.logits = &b->lg;
        } else {
            b->fm.layer = "given";
            b->ids = raw_tensor(reg, base + OFF_IDS, MOE__DTYPE__DTYPE_INT32, b->sk, 2);
            b->w = raw_tensor(reg, base + OFF_W, MOE__DTYPE__DTYPE_FP32, b->sk, 2);
            b->fm.topk_ids = &b->ids;
            b->fm.topk_weights = &b->w;
        }
        b->req.body_case = MOE__REQUEST__BODY_FUSED_MOE;
        b->req.fused_moe = &b->fm;
    } else {
        moe__grouped_gemm__init(&b->gg);
        uint64_t M = 0;
        for (int g = 0; g < G; g++)
            M += (uint64_t)(b->ms[g] = (uint64_t)ms[g]);
        b->sa[0] = b->sc[0] = M;
        b->sa[1] = GK;
        b->sc[1] = GN;
        b->a = raw_tensor(reg, base + OFF_A, MOE__DTYPE__DTYPE_BF16, b->sa, 2);
        b->c = raw_tensor(reg, base + OFF_C, MOE__DTYPE__DTYPE_BF16, b->sc, 2);
        b->gg.layer = "gemm";
        b->gg.m_sizes = b->ms;
        b->gg.n_m_sizes = G;
        b->gg.a = &b->a;
        b->gg.c = &b->c;
        b->req.body_case = MOE__REQUEST__BODY_GROUPED_GEMM;
        b->req.grouped_gemm = &b->gg;
    }
}

static void fill_slot(uint8_t *slot, int kind, size_t T, uint64_t *seed)
{
    if (kind < 2) {
        itest_fill(seed, MOE_DTYPE_BF16, slot + OFF_X, T * H, 1.7f);
        for (size_t i = 0; i < T * E; i++)
            ((float *)(slot + OFF_L))[i] = test_randf(seed) * 3.0f;
        int32_t *ids = (int32_t *)(slot + OFF_IDS);
        float *w = (float *)(slot + OFF_W);
        for (size_t t = 0; t < T; t++) {
            ids[t * K] = (int32_t)(test_rand(seed) % E);
            ids[t * K + 1] = (ids[t * K] + 1 + (int32_t)(test_rand(seed) % (E - 1))) % E;
            w[t * K] = 0.2f + (test_randf(seed) + 1.0f) * 0.4f;
            w[t * K + 1] = 0.2f + (test_randf(seed) + 1.0f) * 0.4f;
        }
        memset(slot + OFF_OUT, 0xff, T * H * 2);
    } else {
        itest_fill(seed, MOE_DTYPE_BF16, slot + OFF_A, T * GK, 1.0f);
        memset(slot + OFF_C, 0xff, T * GN * 2);
    }
}

/* Send a pipeline of valid requests and take every reply. */
static void raw_pipeline(struct rclient *rc, struct slot_stats *st, uint64_t *seed)
{
    int n = 1 + (int)(test_rand(seed) % SLOTS);
    bool check = test_rand(seed) % 4 == 0;
    struct pend p[SLOTS];
    struct reqbuf b;
    for (int i = 0; i < n; i++) {
        p[i] = (struct pend){.kind = (int)(test_rand(seed) % 3), .T = 1 + test_rand(seed) % MAXT};
        if (p[i].kind == 2) {
            size_t left = p[i].T;
            for (int g = 0; g < G; g++) {
                p[i].ms[g] = g == G - 1 ? (int64_t)left : (int64_t)(test_rand(seed) % (left + 1));
                left -= (size_t)p[i].ms[g];
            }
        }
        uint8_t *slot = rc->base + (size_t)i * SLOT_BYTES;
        fill_slot(slot, p[i].kind, p[i].T, seed);
        build(&b, rc->reg, i, p[i].kind, p[i].T, p[i].ms);
        p[i].timed = test_rand(seed) % 10 == 0;
        if (p[i].timed)
            b.req.timeout_us = 1 + test_rand(seed) % 2000;
        b.req.no_batch = test_rand(seed) % 20 == 0;
        CHECK(raw_send(&rc->r, &b.req) == 0);
        p[i].id = b.req.id;
        st->sent++;
    }
    for (int left = n; left > 0;) {
        Moe__Reply *rep = raw_recv_try(&rc->r);
        if (!rep) {
            st->lost += (uint64_t)left;
            note(st, "%d of %d replies never came", left, n);
            return;
        }
        int i = 0;
        while (i < n && p[i].id != rep->id)
            i++;
        if (i == n || p[i].answered) {
            st->dup++;
            note(st, "reply %llu: %s", (unsigned long long)rep->id,
                 i == n ? "not a request in flight" : "a second reply");
        } else {
            p[i].answered = true;
            left--;
            if (rep->status == MOE__STATUS__STATUS_OK) {
                st->ok++;
                if (check) {
                    uint8_t *slot = rc->base + (size_t)i * SLOT_BYTES;
                    double e = p[i].kind == 2 ? check_gemm(slot, p[i].ms, p[i].T)
                                              : check_moe(p[i].kind ? &Lgiven : &Lsoft, slot,
                                                          p[i].T);
                    st->checked++;
                    if (e > itest_tolerance(MOE_DTYPE_BF16)) {
                        st->wrong++;
                        note(st, "kind %d T=%zu: relative error %.3g", p[i].kind, p[i].T, e);
                    }
                }
            } else if (rep->status == MOE__STATUS__STATUS_BUSY) {
                st->busy++;
            } else if (rep->status == MOE__STATUS__STATUS_DEADLINE_EXCEEDED && p[i].timed) {
                st->expired++;
            } else {
                st->unexpected++;
                note(st, "status %d: %s", rep->status, rep->message);
            }
        }
        moe__reply__free_unpacked(rep, NULL);
    }
}

/* One invalid request; exactly one reply with the expected status. */
static void raw_invalid(struct rclient *rc, struct slot_stats *st, uint64_t *seed)
{
    struct reqbuf b;
    fill_slot(rc->base, 0, 4, seed);
    build(&b, rc->reg, 0, 0, 4, NULL);
    uint8_t tok[16];
    int want;
    uint64_t id = 0;
    switch (test_rand(seed) % 6) {
    case 0:
        for (int i = 0; i < 16; i++)
            tok[i] = (uint8_t)test_rand(seed);
        b.req.token.data = tok;
        b.req.token.len = 16;
        want = MOE__STATUS__STATUS_PERMISSION_DENIED;
        break;
    case 1:
        b.out.region = test_rand(seed) & ((1ull << 53) - 1);
        want = MOE__STATUS__STATUS_NOT_FOUND;
        break;
    case 2:
        b.out.offset = SLOTS * SLOT_BYTES - 2 * (test_rand(seed) % 64);
        want = MOE__STATUS__STATUS_INVALID_ARGUMENT;
        break;
    case 3:
        b.fm.layer = "no-such-layer";
        want = MOE__STATUS__STATUS_NOT_FOUND;
        break;
    case 4:
        b.x.dtype = MOE__DTYPE__DTYPE_FP16;
        want = MOE__STATUS__STATUS_INVALID_ARGUMENT;
        break;
    default: {
        uint8_t junk[64];
        for (size_t i = 0; i < sizeof(junk); i++)
            junk[i] = (uint8_t)test_rand(seed) | 0x80;
        CHECK(zmq_send(rc->r.zsock, junk, sizeof(junk), 0) == (int)sizeof(junk));
        want = MOE__STATUS__STATUS_PROTOCOL;
        id = UINT64_MAX;
        break;
    }
    }
    if (id != UINT64_MAX) {
        CHECK(raw_send(&rc->r, &b.req) == 0);
        id = b.req.id;
    } else {
        id = 0;
    }
    st->sent++;
    Moe__Reply *rep = raw_recv_try(&rc->r);
    if (!rep) {
        st->lost++;
        note(st, "no reply to an invalid request");
        return;
    }
    if (rep->id != id) {
        st->dup++;
        note(st, "reply %llu to invalid request %llu", (unsigned long long)rep->id,
             (unsigned long long)id);
    } else if ((int)rep->status == want) {
        st->refused++;
    } else {
        st->unexpected++;
        note(st, "invalid request: status %d (want %d): %s", rep->status, want, rep->message);
    }
    moe__reply__free_unpacked(rep, NULL);
}

static void raw_client(struct itest_daemon *d, struct slot_stats *st, uint64_t seed,
                       uint64_t deadline)
{
    struct rclient rc = {.d = d};
    rclient_open(&rc);
    struct reqbuf b;
    while (now_ms() < deadline) {
        unsigned a = (unsigned)(test_rand(&seed) % 100);
        if (a < 66) {
            raw_pipeline(&rc, st, &seed);
        } else if (a < 92) {
            raw_invalid(&rc, st, &seed);
        } else if (a < 98) {
            /* Leave with requests in flight (they are not lost: nobody is
             * there to lose them), come back as a new session. */
            for (int i = (int)(test_rand(&seed) % 4); i > 0; i--) {
                fill_slot(rc.base, 0, 8, &seed);
                build(&b, rc.reg, 0, 0, 8, NULL);
                CHECK(raw_send(&rc.r, &b.req) == 0);
            }
            rclient_close(&rc);
            rclient_open(&rc);
            st->reconnects++;
        } else {
            for (int i = 1 + (int)(test_rand(&seed) % 4); i > 0; i--) {
                fill_slot(rc.base, 0, MAXT, &seed);
                build(&b, rc.reg, 0, 0, MAXT, NULL);
                CHECK(raw_send(&rc.r, &b.req) == 0);
            }
            kill(getpid(), SIGKILL);
        }
    }
    rclient_close(&rc);
}

/* ---- libmoe clients ------------------------------------------------------------ */

/* Count a libmoe call's outcome: correct or wrong (checked against the
 * reference), busy, or unexpected (lost when it timed out). */
static void moe_tally(struct slot_stats *st, int rc, const struct itest_layer *L,
                      struct itest_fwd *f, const char *what)
{
    if (rc == 0) {
        st->ok++;
        st->checked++;
        double e = itest_fwd_error(L, f);
        if (e > itest_tolerance(L->dt)) {
            st->wrong++;
            note(st, "%s: relative error %.3g", what, e);
        }
    } else if (rc == -EBUSY) {
        st->busy++;
    } else {
        st->unexpected++;
        if (rc == -ETIMEDOUT)
            st->lost++;
        note(st, "%s: %s", what, moe_errmsg());
    }
}

static void moe_client_run(struct itest_daemon *d, struct slot_stats *st, uint64_t seed,
                           uint64_t deadline)
{
    moe_client *c = itest_connect(d, "soak");
    moe_region *gr;
    CHECK(moe_region_create(c, 2 * MAXT * (GK + GN) * 2, "gemm", &gr) == 0);
    while (now_ms() < deadline) {
        unsigned a = (unsigned)(test_rand(&seed) % 100);
        if (a < 60) {
            struct itest_layer *L = a % 2 ? &Lgiven : &Lsoft;
            struct itest_fwd f;
            itest_fwd_make(c, L, 1 + test_rand(&seed) % MAXT, &seed, &f);
            st->sent++;
            moe_tally(st, moe_forward(c, &f.args, NULL), L, &f, "libmoe forward");
            moe_region_free(c, &f.r);
        } else if (a < 80) {
            struct itest_fwd f[4];
            moe_request *rq[4];
            for (int i = 0; i < 4; i++) {
                itest_fwd_make(c, &Lsoft, 1 + test_rand(&seed) % MAXT, &seed, &f[i]);
                CHECK(moe_forward_submit(c, &f[i].args, &rq[i]) == 0);
                st->sent++;
            }
            for (int i = 3; i >= 0; i--) {
                moe_tally(st, moe_wait(c, &rq[i], -1, NULL), &Lsoft, &f[i], "libmoe wait");
                moe_region_free(c, &f[i].r);
            }
        } else if (a < 96) {
            uint64_t ms[G];
            int64_t ms64[G];
            size_t M = 0;
            for (int g = 0; g < G; g++) {
                ms[g] = test_rand(&seed) % (MAXT / G + 1);
                ms64[g] = (int64_t)ms[g];
                M += ms[g];
            }
            uint8_t *b = moe_region_data(gr);
            itest_fill(&seed, MOE_DTYPE_BF16, b, M * GK, 1.0f);
            size_t c_off = MAXT * GK * 2;
            memset(b + c_off, 0xff, M * GN * 2);
            moe_gemm_args ga = {.layer = "gemm", .a = moe_tensor_2d(gr, 0, MOE_DTYPE_BF16, M, GK),
                                .c = moe_tensor_2d(gr, c_off, MOE_DTYPE_BF16, M, GN),
                                .m_sizes = ms, .groups = G};
            st->sent++;
            int rc = moe_gemm(c, &ga, NULL);
            if (rc == 0) {
                st->ok++;
                uint16_t ref[MAXT * GN];
                float g1[MAXT * GN], g2[MAXT * GN];
                CHECK(moek_ref_grouped_gemm(MOEK_DTYPE_BF16, G, GN, GK, b, ms64, gemm_b, ref) == 0);
                moek_to_f32(MOEK_DTYPE_BF16, b + c_off, g1, M * GN);
                moek_to_f32(MOEK_DTYPE_BF16, ref, g2, M * GN);
                st->checked++;
                if (M && moek_rel_error(g1, g2, M * GN) > itest_tolerance(MOE_DTYPE_BF16))
                    st->wrong++;
            } else if (rc == -EBUSY) {
                st->busy++;
            } else {
                st->unexpected++;
                note(st, "libmoe gemm: %s", moe_errmsg());
            }
        } else {
            moe_region_free(c, &gr);
            moe_disconnect(&c);
            c = itest_connect(d, "soak");
            CHECK(moe_region_create(c, 2 * MAXT * (GK + GN) * 2, "gemm", &gr) == 0);
            st->reconnects++;
        }
    }
    moe_region_free(c, &gr);
    moe_disconnect(&c);
}

/* ---- the supervisor ------------------------------------------------------------- */

static pid_t spawn(struct itest_daemon *d, struct shared *sh, int slot, uint64_t seed)
{
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid)
        return pid;
    alarm(0);
    struct slot_stats *st = &sh->slot[slot];
    if (slot % 4 == 3)
        moe_client_run(d, st, seed, sh->deadline_ms);
    else
        raw_client(d, st, seed, sh->deadline_ms);
    _exit(0);
}

TEST(soak)
{
    uint64_t seed = test_seed();
    const char *e1 = getenv("MOE_SOAK_SECONDS"), *e2 = getenv("MOE_SOAK_CLIENTS");
    int secs = e1 ? atoi(e1) : 60, n = e2 ? atoi(e2) : 16;
    CHECK(secs > 0 && n > 0 && n <= 32);
    struct itest_daemon d;
    /* A small queue per session, so that BUSY is part of the mix. */
    itest_asan_small_quarantine();
    itest_daemon_start(&d, "--config", itest_write_conf("[limits]\nmax_queued_requests = 6\n"),
                       NULL);
    moe_client *c = itest_connect(&d, "itest");
    itest_layer_upload(c, &Lsoft, &seed);
    itest_layer_upload(c, &Lgiven, &seed);
    moe_region *wr;
    CHECK(moe_region_create(c, G * GN * GK * 2, "B", &wr) == 0);
    itest_fill(&seed, MOE_DTYPE_BF16, moe_region_data(wr), G * GN * GK, 0.3f);
    gemm_b = malloc(G * GN * GK * 2);
    CHECK(gemm_b != NULL);
    memcpy(gemm_b, moe_region_data(wr), G * GN * GK * 2);
    moe_layer_desc gd = {.name = "gemm", .kind = MOE_LAYER_GEMM, .dtype = MOE_DTYPE_BF16,
                         .groups = G, .n = GN, .k = GK,
                         .w1 = moe_tensor_3d(wr, 0, MOE_DTYPE_BF16, G, GN, GK)};
    CHECK_MSG(moe_layer_load(c, &gd, NULL) == 0, "%s", moe_errmsg());
    moe_region_free(c, &wr);
    moe_disconnect(&c);
    struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(sh != MAP_FAILED);
    memset(sh, 0, sizeof(*sh));
    /* Two seconds of the same first, not counted: the batcher makes its
     * timer when a batch of several sessions first waits for them, and
     * keeps it; the baseline of descriptors comes after. */
    sh->deadline_ms = now_ms() + 2000;
    pid_t warm[32];
    for (int i = 0; i < n; i++)
        warm[i] = spawn(&d, sh, i, test_rand(&seed));
    for (int i = 0; i < n; i++) {
        int st;
        CHECK(waitpid(warm[i], &st, 0) == warm[i]);
        CHECK_MSG((WIFEXITED(st) && WEXITSTATUS(st) == 0) ||
                      (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL),
                  "warm-up client %d: status %d: %s", i, st, sh->slot[i].last);
    }
    memset(sh, 0, sizeof(*sh));
    moe_stats s0;
    c = itest_connect(&d, "itest");
    CHECK(moe_stats_get(c, &s0) == 0);
    moe_disconnect(&c);
    itest_sleep_ms(500);
    int fds0 = itest_count_fds(d.pid);
    uint64_t start = now_ms();
    sh->deadline_ms = start + (uint64_t)secs * 1000;
    pid_t pids[32];
    for (int i = 0; i < n; i++) {
        pids[i] = spawn(&d, sh, i, test_rand(&seed));
        sh->slot[i].processes++;
    }
    long rss_warm = -1, rss_max = 0;
    uint64_t next_sample = start + 1000;
    int live = n, failures = 0;
    while (live > 0) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid > 0) {
            int i = 0;
            while (i < n && pids[i] != pid)
                i++;
            CHECK(i < n);
            if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) {
                sh->slot[i].crashes++;
                if (now_ms() + 1000 < sh->deadline_ms) {
                    pids[i] = spawn(&d, sh, i, test_rand(&seed));
                    sh->slot[i].processes++;
                    continue;
                }
            } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                failures++;
                fprintf(stderr, "  client %d failed (status %d): %s\n", i, st, sh->slot[i].last);
            }
            pids[i] = 0;
            live--;
            continue;
        }
        uint64_t now = now_ms();
        if (now >= next_sample) {
            CHECK_MSG(itest_daemon_alive(&d), "moed died; log in %s", d.log);
            long rss = itest_rss_kib(d.pid);
            /* The first seconds warm the allocator up. */
            if (rss_warm < 0 && now >= start + (uint64_t)(secs < 10 ? secs / 2 : 5) * 1000)
                rss_warm = rss;
            if (rss > rss_max)
                rss_max = rss;
            next_sample = now + 1000;
        }
        CHECK_MSG(now < sh->deadline_ms + 30000, "clients still running 30 s after the end");
        itest_sleep_ms(10);
    }
    double ran = (double)(now_ms() - start) / 1000.0;
    CHECK_MSG(itest_daemon_alive(&d), "moed died; log in %s", d.log);
    moe_stats s1;
    c = itest_connect(&d, "itest");
    for (int i = 0; i < 500; i++) {
        CHECK(moe_stats_get(c, &s1) == 0);
        if (s1.sessions == 1 && s1.regions == 0 && s1.queue_depth == 0)
            break;
        itest_sleep_ms(20);
    }
    moe_disconnect(&c);
    int fds1 = itest_count_fds(d.pid);
    for (int i = 0; i < 250 && fds1 != fds0; i++) {
        itest_sleep_ms(20);
        fds1 = itest_count_fds(d.pid);
    }
    long rss_end = itest_rss_kib(d.pid);

    struct slot_stats t = {0};
    for (int i = 0; i < n; i++) {
        struct slot_stats *x = &sh->slot[i];
        t.sent += x->sent, t.ok += x->ok, t.busy += x->busy, t.expired += x->expired;
        t.refused += x->refused, t.unexpected += x->unexpected, t.lost += x->lost;
        t.dup += x->dup, t.checked += x->checked, t.wrong += x->wrong;
        t.reconnects += x->reconnects, t.crashes += x->crashes, t.processes += x->processes;
        if (x->unexpected || x->lost || x->dup || x->wrong)
            fprintf(stderr, "  client %d: %s\n", i, x->last);
    }
    fprintf(stderr,
            "  soak: %d clients (%d raw, %d libmoe) for %.0f s, %llu client processes\n"
            "  requests: %llu sent and answered (of those sent by clients still there): "
            "%llu ok (%llu checked against the reference, %llu wrong), %llu busy, "
            "%llu expired, %llu invalid ones refused as expected, %llu unexpected\n"
            "  lost replies %llu, duplicated replies %llu; client crashes %llu, reconnects %llu; "
            "daemon crashes 0\n"
            "  daemon: %llu requests served, %llu refused or cancelled; VmRSS %ld KiB after "
            "warm-up, %ld KiB at the end (max %ld); descriptors %d -> %d; sessions %u, regions "
            "%u, queue %u at the end\n",
            n, n - n / 4, n / 4, ran, (unsigned long long)t.processes,
            (unsigned long long)t.sent, (unsigned long long)t.ok, (unsigned long long)t.checked,
            (unsigned long long)t.wrong, (unsigned long long)t.busy, (unsigned long long)t.expired,
            (unsigned long long)t.refused, (unsigned long long)t.unexpected,
            (unsigned long long)t.lost, (unsigned long long)t.dup, (unsigned long long)t.crashes,
            (unsigned long long)t.reconnects, (unsigned long long)(s1.requests - s0.requests),
            (unsigned long long)(s1.errors - s0.errors), rss_warm, rss_end, rss_max, fds0, fds1,
            s1.sessions, s1.regions, s1.queue_depth);
    CHECK_EQ_INT(failures, 0);
    CHECK_EQ_INT(t.lost, 0);
    CHECK_EQ_INT(t.dup, 0);
    CHECK_EQ_INT(t.wrong, 0);
    CHECK_EQ_INT(t.unexpected, 0);
    CHECK(t.ok > 0 && t.refused > 0 && t.crashes > 0);
    CHECK_EQ_INT(s1.sessions, 1);
    CHECK_EQ_INT(s1.regions, 0);
    CHECK_EQ_INT(s1.queue_depth, 0);
    if (fds1 != fds0)
        itest_list_fds(d.pid);
    CHECK_MSG(fds1 == fds0, "descriptors: %d before, %d after", fds0, fds1);
    /* Flat: what the allocator holds after the warm-up may move by a few
     * MiB (more under ASan, whose quarantine holds freed memory). */
    long tol = 16 * 1024 + ITEST_RSS_SLACK_KIB;
    CHECK_MSG(rss_end - rss_warm <= tol, "VmRSS %ld KiB after warm-up, %ld at the end", rss_warm,
              rss_end);
    free(gemm_b);
    itest_layer_free(&Lsoft);
    itest_layer_free(&Lgiven);
    itest_daemon_stop(&d);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE_TIMEOUT(soak, 240),
        {0}});
}
