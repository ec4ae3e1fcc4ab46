/*
 * itest_service.c: the request path end to end: the real daemon, real
 * clients in several processes, every output compared with the reference.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "daemon/safetensors.h"
#include "tests/integration/itest.h"

static struct itest_layer layer_def(const char *name, moe_dtype dt, int E, int k, int H, int I,
                                    moe_routing routing, bool renorm)
{
    struct itest_layer L = {.dt = dt, .sh = {E, k, H, I}, .routing = routing, .renorm = renorm};
    snprintf(L.name, sizeof(L.name), "%s", name);
    return L;
}

static void forward_and_check(moe_client *c, struct itest_layer *L, size_t T, uint64_t *seed)
{
    struct itest_fwd f;
    moe_timings tm;
    itest_fwd_make(c, L, T, seed, &f);
    int rc = moe_forward(c, &f.args, &tm);
    CHECK_MSG(rc == 0, "forward %s T=%zu: %s", L->name, T, moe_errmsg());
    double err = itest_fwd_error(L, &f);
    CHECK_MSG(err <= itest_tolerance(L->dt), "%s T=%zu: relative error %.3e", L->name, T, err);
    CHECK(tm.batch_requests >= 1);
    moe_region_free(c, &f.r);
}

TEST(routing_modes_match_reference)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L[] = {
        layer_def("soft-bf16", MOE_DTYPE_BF16, 8, 2, 64, 96, MOE_ROUTING_SOFTMAX, true),
        layer_def("soft-fp32-norenorm", MOE_DTYPE_FP32, 8, 3, 32, 48, MOE_ROUTING_SOFTMAX, false),
        layer_def("sig-fp16", MOE_DTYPE_FP16, 16, 4, 48, 64, MOE_ROUTING_SIGMOID, false),
        layer_def("sig-bf16-renorm", MOE_DTYPE_BF16, 16, 2, 32, 32, MOE_ROUTING_SIGMOID, true),
        layer_def("given-fp32", MOE_DTYPE_FP32, 8, 2, 40, 56, MOE_ROUTING_GIVEN, false),
        layer_def("given-bf16-k1", MOE_DTYPE_BF16, 4, 1, 64, 64, MOE_ROUTING_GIVEN, false),
    };
    for (size_t i = 0; i < ARRAY_LEN(L); i++)
        itest_layer_upload(c, &L[i], &seed);
    moe_layer_info infos[16];
    CHECK_EQ_INT(moe_layer_list(c, infos, 16), ARRAY_LEN(L));
    size_t Ts[] = {1, 5, 33};
    for (size_t i = 0; i < ARRAY_LEN(L); i++)
        for (size_t t = 0; t < ARRAY_LEN(Ts); t++)
            forward_and_check(c, &L[i], Ts[t], &seed);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* Several processes at once, each checking every output of its own, over
 * each of libmoe's paths: requests and replies on the client's reply socket
 * (the default), requests by ZeroMQ and replies on the socket
 * (MOE_REQUESTS=zmq), both by ZeroMQ (MOE_REPLIES=zmq). */
TEST(concurrent_clients_get_their_own_results)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_def("shared", MOE_DTYPE_BF16, 8, 2, 64, 128,
                                     MOE_ROUTING_SOFTMAX, true);
    itest_layer_upload(c, &L, &seed);
    enum { CLIENTS = 6, ROUNDS = 25 };
    pid_t pids[CLIENTS];
    for (int i = 0; i < CLIENTS; i++) {
        pids[i] = fork();
        CHECK(pids[i] >= 0);
        if (pids[i] == 0) {
            uint64_t s = seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(i + 1));
            if (i % 3 == 1)
                setenv("MOE_REQUESTS", "zmq", 1);
            else if (i % 3 == 2)
                setenv("MOE_REPLIES", "zmq", 1);
            moe_client *cc = itest_connect(&d, "itest-child");
            for (int r = 0; r < ROUNDS; r++)
                forward_and_check(cc, &L, 1 + test_rand(&s) % 9, &s);
            moe_disconnect(&cc);
            _exit(0);
        }
    }
    for (int i = 0; i < CLIENTS; i++) {
        int st;
        waitpid(pids[i], &st, 0);
        CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "client %d failed (status %d)", i, st);
    }
    moe_stats s;
    CHECK(moe_stats_get(c, &s) == 0);
    CHECK_EQ_INT(s.requests, CLIENTS * ROUNDS);
    CHECK_EQ_INT(s.errors, 0);
    CHECK_EQ_INT(s.sessions, 1);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

TEST(grouped_gemm_matches_reference)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    moe_dtype dts[] = {MOE_DTYPE_BF16, MOE_DTYPE_FP16, MOE_DTYPE_FP32};
    for (size_t di = 0; di < ARRAY_LEN(dts); di++) {
        moe_dtype dt = itest_dt(dts[di]);
        size_t G = 6, N = 40, K = 24, es = moe_dtype_size(dt);
        moe_region *wr;
        CHECK(moe_region_create(c, G * N * K * es, "B", &wr) == 0);
        itest_fill(&seed, dt, moe_region_data(wr), G * N * K, 0.5f);
        void *B = malloc(G * N * K * es);
        memcpy(B, moe_region_data(wr), G * N * K * es);
        char name[32];
        snprintf(name, sizeof(name), "gemm-%zu", di);
        moe_layer_desc desc = {.name = name, .kind = MOE_LAYER_GEMM, .dtype = dt,
                               .groups = (uint32_t)G, .n = (uint32_t)N, .k = (uint32_t)K,
                               .w1 = moe_tensor_3d(wr, 0, dt, G, N, K)};
        CHECK_MSG(moe_layer_load(c, &desc, NULL) == 0, "%s", moe_errmsg());
        moe_region_free(c, &wr);
        /* Groups 1 and 4 empty; the rest random. */
        uint64_t ms[6];
        int64_t ms64[6];
        size_t M = 0;
        for (size_t g = 0; g < G; g++) {
            ms[g] = (g == 1 || g == 4) ? 0 : test_rand(&seed) % 7;
            ms64[g] = (int64_t)ms[g];
            M += ms[g];
        }
        moe_region *r;
        CHECK(moe_region_create(c, (M * K + M * N) * es + 64, "ac", &r) == 0);
        uint8_t *b = moe_region_data(r);
        itest_fill(&seed, dt, b, M * K, 1.0f);
        memset(b + M * K * es, 0xff, M * N * es);
        moe_gemm_args a = {.layer = name, .a = moe_tensor_2d(r, 0, dt, M, K),
                           .c = moe_tensor_2d(r, M * K * es, dt, M, N), .m_sizes = ms, .groups = G};
        CHECK_MSG(moe_gemm(c, &a, NULL) == 0, "%s", moe_errmsg());
        void *ref = malloc(M * N * es + 1);
        CHECK(moek_ref_grouped_gemm(itest_kdt(dt), (int)G, (int)N, (int)K, b, ms64, B, ref) == 0);
        float *g1 = malloc(M * N * 4 + 4), *g2 = malloc(M * N * 4 + 4);
        moek_to_f32(itest_kdt(dt), b + M * K * es, g1, M * N);
        moek_to_f32(itest_kdt(dt), ref, g2, M * N);
        double err = moek_rel_error(g1, g2, M * N);
        CHECK_MSG(err <= itest_tolerance(dt), "gemm dtype %d: error %.3e", (int)dt, err);
        free(g1);
        free(g2);
        free(ref);
        free(B);
        moe_region_free(c, &r);
    }
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* Checkpoints in both naming schemes, loaded by path from an allowed dir. */
TEST(file_layers_in_both_naming_schemes)
{
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-weights.XXXXXX";
    CHECK(mkdtemp(wdir) != NULL);
    struct itest_daemon d;
    itest_daemon_start(&d, "--allow-dir", wdir, NULL);
    moe_client *c = itest_connect(&d, "itest");
    const char *schemes[2][3] = {{"w1", "w3", "w2"}, {"gate_proj", "up_proj", "down_proj"}};
    const char *prefixes[2] = {"model.layers.7.block_sparse_moe.", "model.layers.2.mlp."};
    for (int s = 0; s < 2; s++) {
        struct itest_layer L = layer_def(s ? "qwen" : "mixtral", MOE_DTYPE_BF16, 4, 2, 32, 48,
                                         MOE_ROUTING_SOFTMAX, true);
        size_t E = 4, H = 32, I = 48, per = H * I;
        L.w1 = malloc(E * per * 2);
        L.w3 = malloc(E * per * 2);
        L.w2 = malloc(E * per * 2);
        itest_fill(&seed, MOE_DTYPE_BF16, L.w1, E * per, 0.3f);
        itest_fill(&seed, MOE_DTYPE_BF16, L.w3, E * per, 0.3f);
        itest_fill(&seed, MOE_DTYPE_BF16, L.w2, E * per, 0.25f);
        struct st_out t[12];
        char names[12][128];
        void *src[3] = {L.w1, L.w3, L.w2};
        for (size_t e = 0; e < E; e++)
            for (int p = 0; p < 3; p++) {
                size_t i = e * 3 + (size_t)p;
                snprintf(names[i], sizeof(names[i]), "%sexperts.%zu.%s.weight", prefixes[s], e,
                         schemes[s][p]);
                t[i] = (struct st_out){.name = names[i], .dtype = ST_BF16, .ndim = 2,
                                       .shape = {p < 2 ? I : H, p < 2 ? H : I},
                                       .data = (uint8_t *)src[p] + e * per * 2};
            }
        char path[256];
        snprintf(path, sizeof(path), "%s/%s.safetensors", wdir, L.name);
        CHECK(st_write(path, t, 12) == 0);
        moe_layer_desc desc = {.name = L.name, .kind = MOE_LAYER_MOE, .topk = 2,
                               .routing = MOE_ROUTING_SOFTMAX, .renormalize = 1,
                               .path = path, .prefix = prefixes[s]};
        moe_layer_info info;
        CHECK_MSG(moe_layer_load(c, &desc, &info) == 0, "%s", moe_errmsg());
        CHECK_EQ_INT(info.experts, E);
        CHECK_EQ_INT(info.hidden, H);
        CHECK_EQ_INT(info.intermediate, I);
        CHECK_EQ_INT(info.dtype, MOE_DTYPE_BF16);
        CHECK_STR_CONTAINS(info.source, path);
        forward_and_check(c, &L, 7, &seed);
        itest_layer_free(&L);
    }
    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_rmdir(wdir);
}

TEST(async_submit_poll_and_wait_out_of_order)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_def("async", MOE_DTYPE_FP32, 8, 2, 32, 64,
                                     MOE_ROUTING_SOFTMAX, true);
    itest_layer_upload(c, &L, &seed);
    enum { N = 8 };
    struct itest_fwd f[N];
    moe_request *req[N];
    for (int i = 0; i < N; i++) {
        itest_fwd_make(c, &L, 1 + (size_t)i, &seed, &f[i]);
        CHECK(moe_forward_submit(c, &f[i].args, &req[i]) == 0);
    }
    /* Wait newest first; replies for the others get parked (pushed on the
     * reply socket while each region_free talks on the session socket). */
    for (int i = N - 1; i >= 0; i--) {
        if (i == 0) {
            int p = 0;
            for (int tries = 0; tries < 500 && p == 0; tries++) {
                p = moe_poll(c, req[i]);
                if (!p)
                    itest_sleep_ms(10);
            }
            CHECK_EQ_INT(p, 1);
        }
        CHECK_MSG(moe_wait(c, &req[i], 10000, NULL) == 0, "%s", moe_errmsg());
        CHECK(req[i] == NULL);
        double err = itest_fwd_error(&L, &f[i]);
        CHECK_MSG(err <= itest_tolerance(L.dt), "request %d: error %.3e", i, err);
        moe_region_free(c, &f[i].r);
    }
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* Threads of one client: while one waits for a long request, the others
 * submit, wait and collect their own replies at once (the waiting thread
 * sleeps on the sockets without holding the client, and whoever reads hands
 * each reply to its thread). */
struct waiter {
    moe_client *c;
    moe_request *req;
    int rc;
    _Atomic bool done;
};

static void *wait_long(void *arg)
{
    struct waiter *w = arg;
    w->rc = moe_wait(w->c, &w->req, 60000, NULL);
    w->done = true;
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

TEST(a_waiting_thread_does_not_hold_up_the_others)
{
    if (itest_on_gpu())
        TEST_SKIP("the long request is sized for the CPU backend");
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, "--max-slice-tokens", "8192", NULL);
    moe_client *c = itest_connect(&d, "threads");
    struct itest_layer L = layer_def("long", MOE_DTYPE_BF16, 8, 2, 512, 1024,
                                     MOE_ROUTING_SOFTMAX, true);
    struct itest_layer S = layer_def("short", MOE_DTYPE_BF16, 4, 2, 32, 32,
                                     MOE_ROUTING_SOFTMAX, true);
    itest_layer_upload(c, &L, &seed);
    itest_layer_upload(c, &S, &seed);
    struct itest_fwd big;
    itest_fwd_make(c, &L, 4096, &seed, &big);
    enum { N = 20 };
    struct itest_fwd f[N];
    moe_request *rq[N];
    for (int i = 0; i < N; i++)
        itest_fwd_make(c, &S, 1, &seed, &f[i]);

    struct waiter w = {.c = c};
    CHECK(moe_forward_submit(c, &big.args, &w.req) == 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, wait_long, &w) == 0);
    itest_sleep_ms(50); /* it is asleep in moe_wait */
    uint64_t took[N];
    for (int i = 0; i < N; i++) {
        struct timespec a, b;
        itest_sleep_ms(3); /* at any point of the waiting thread's sleep */
        clock_gettime(CLOCK_MONOTONIC, &a);
        CHECK(moe_forward_submit(c, &f[i].args, &rq[i]) == 0);
        clock_gettime(CLOCK_MONOTONIC, &b);
        took[i] = (uint64_t)(((int64_t)(b.tv_sec - a.tv_sec) * 1000000000 + (b.tv_nsec - a.tv_nsec)) /
                             1000);
    }
    bool still_waiting = !w.done;
    qsort(took, N, sizeof(took[0]), cmp_u64);
    printf("  submits beside a waiting thread: median %llu us, worst %llu us%s\n",
           (unsigned long long)took[N / 2], (unsigned long long)took[N - 1],
           still_waiting ? "" : " (the long request ended first)");
    CHECK_MSG(took[N / 2] < 2000, "a submit took %llu us (median) while another thread waited",
              (unsigned long long)took[N / 2]);
    for (int i = 0; i < N; i++) {
        CHECK_MSG(moe_wait(c, &rq[i], 60000, NULL) == 0, "%s", moe_errmsg());
        CHECK(itest_fwd_error(&S, &f[i]) <= itest_tolerance(S.dt));
        moe_region_free(c, &f[i].r);
    }
    CHECK(pthread_join(th, NULL) == 0);
    CHECK_MSG(w.rc == 0, "the long request: %d", w.rc);
    CHECK(itest_fwd_error(&L, &big) <= itest_tolerance(L.dt));
    moe_region_free(c, &big.r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_layer_free(&S);
    itest_daemon_stop(&d);
}

/* Many requests submitted before any reply is read: the replies pile up on
 * the reply socket until it is full, then go on the request socket; every
 * request still gets its one answer (done, or BUSY from the queue cap), and
 * a session request made meanwhile is answered (its socket carries nothing
 * else). */
TEST(unread_replies_are_all_delivered)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_def("pile", MOE_DTYPE_FP32, 8, 2, 32, 32,
                                     MOE_ROUTING_SOFTMAX, true);
    itest_layer_upload(c, &L, &seed);
    struct itest_fwd f;
    itest_fwd_make(c, &L, 1, &seed, &f);
    enum { N = 1500 };
    static moe_request *req[N];
    for (int i = 0; i < N; i++)
        CHECK_MSG(moe_forward_submit(c, &f.args, &req[i]) == 0, "%s", moe_errmsg());
    itest_sleep_ms(300); /* the replies pile up */
    moe_set_timeout(c, 5000);
    moe_region *extra = NULL;
    CHECK_MSG(moe_region_create(c, 4096, "extra", &extra) == 0, "%s", moe_errmsg());
    CHECK(moe_region_free(c, &extra) == 0);
    int ok = 0, busy = 0;
    for (int i = 0; i < N; i++) {
        int rc = moe_wait(c, &req[i], 20000, NULL);
        CHECK_MSG(rc == 0 || rc == -EBUSY, "request %d: %s", i, moe_errmsg());
        ok += rc == 0;
        busy += rc == -EBUSY;
    }
    fprintf(stderr, "  %d done, %d busy\n", ok, busy);
    CHECK_EQ_INT(ok + busy, N);
    CHECK(ok > 0);
    /* The reply socket did fill: some replies took the other way. */
    FILE *lf = fopen(d.log, "r");
    CHECK(lf != NULL);
    char line[512];
    int rerouted = 0;
    while (lf && fgets(line, sizeof(line), lf))
        rerouted += strstr(line, "on the request socket") != NULL;
    if (lf)
        fclose(lf);
    fprintf(stderr, "  %d replies on the request socket\n", rerouted);
    CHECK(rerouted > 0);
    double err = itest_fwd_error(&L, &f);
    CHECK_MSG(err <= itest_tolerance(L.dt), "error %.3e", err);
    moe_region_free(c, &f.r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

TEST(unload_reload_and_duplicate_names)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_def("cycle", MOE_DTYPE_BF16, 4, 2, 32, 32,
                                     MOE_ROUTING_SOFTMAX, true);
    itest_layer_upload(c, &L, &seed);
    forward_and_check(c, &L, 3, &seed);
    /* A second layer of the same name is refused. */
    struct itest_layer dup = L;
    dup.w1 = dup.w3 = dup.w2 = NULL;
    moe_region *r;
    CHECK(moe_region_create(c, 4096, "x", &r) == 0);
    moe_layer_desc desc = {.name = "cycle", .kind = MOE_LAYER_MOE, .topk = 2, .path = "/nowhere"};
    CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -EEXIST);
    CHECK_EQ_INT(moe_layer_unload(c, "cycle"), 0);
    CHECK_EQ_INT(moe_layer_unload(c, "cycle"), -ENOENT);
    struct itest_fwd f;
    itest_fwd_make(c, &L, 2, &seed, &f);
    CHECK_EQ_INT(moe_forward(c, &f.args, NULL), -ENOENT);
    CHECK_STR_CONTAINS(moe_errmsg(), "cycle");
    moe_region_free(c, &f.r);
    itest_layer_free(&L);
    itest_layer_upload(c, &L, &seed); /* new weights, same name */
    forward_and_check(c, &L, 4, &seed);
    moe_region_free(c, &r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* The daemon's descriptors once they hold still: a region freed just
 * before may still be being unpinned and closed on the daemon's pinner
 * thread (the CUDA backend's unpin takes a while), so the count is taken
 * when no region is left and five readings 20 ms apart agree. */
static int steady_fds(const struct itest_daemon *d, moe_client *c)
{
    int n = -1, same = 0;
    for (int i = 0; i < 250 && same < 5; i++) {
        moe_stats s;
        CHECK(moe_stats_get(c, &s) == 0);
        int m = itest_count_fds(d->pid);
        same = s.regions == 0 && m == n ? same + 1 : 0;
        n = m;
        itest_sleep_ms(20);
    }
    CHECK_MSG(same == 5, "the daemon's descriptors did not hold still in 5 s (last %d)", n);
    return n;
}

/* A client that dies with requests queued and regions mapped: the daemon
 * frees what it held and keeps serving the others. */
TEST(killed_clients_are_cleaned_up)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_def("victim", MOE_DTYPE_BF16, 8, 2, 128, 256,
                                     MOE_ROUTING_SOFTMAX, true);
    itest_layer_upload(c, &L, &seed);
    forward_and_check(c, &L, 2, &seed);
    int fds0 = steady_fds(&d, c);
    CHECK(fds0 > 0);
    for (int round = 0; round < 10; round++) {
        pid_t p = fork();
        CHECK(p >= 0);
        if (p == 0) {
            moe_client *cc = itest_connect(&d, "doomed");
            struct itest_fwd f;
            itest_fwd_make(cc, &L, 64, &seed, &f);
            for (int i = 0; i < 16; i++) {
                moe_request *rq;
                moe_forward_submit(cc, &f.args, &rq);
            }
            if (round % 2)
                kill(getpid(), SIGKILL);
            _exit(0); /* no disconnect: the kernel closes the sockets */
        }
        int st;
        waitpid(p, &st, 0);
    }
    /* The other client is served throughout. */
    forward_and_check(c, &L, 5, &seed);
    moe_stats s;
    /* The live client freed its last region on the session socket, which
     * the daemon may read after a stats request on the other socket:
     * wait for the regions too. */
    for (int i = 0; i < 200; i++) {
        CHECK(moe_stats_get(c, &s) == 0);
        if (s.sessions == 1 && s.regions == 0 && s.queue_depth == 0 &&
            itest_count_fds(d.pid) == fds0)
            break;
        itest_sleep_ms(20);
    }
    CHECK_EQ_INT(s.sessions, 1);
    CHECK_EQ_INT(s.regions, 0);
    CHECK_EQ_INT(s.queue_depth, 0);
    CHECK_EQ_INT(itest_count_fds(d.pid), fds0);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* SIGTERM while a request runs: it is answered, then the daemon exits 0. */
TEST(sigterm_drains_requests_in_flight)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_def("drain", MOE_DTYPE_BF16, 8, 2, 256, 512,
                                     MOE_ROUTING_SOFTMAX, true);
    itest_layer_upload(c, &L, &seed);
    struct itest_fwd f[3];
    moe_request *rq[3];
    for (int i = 0; i < 3; i++) {
        itest_fwd_make(c, &L, 256, &seed, &f[i]);
        CHECK(moe_forward_submit(c, &f[i].args, &rq[i]) == 0);
    }
    /* Requests on one connection arrive in order: once this Hello is
     * answered, the daemon holds all three. */
    CHECK(moe_hello(c, NULL) == 0);
    kill(d.pid, SIGTERM);
    for (int i = 0; i < 3; i++) {
        CHECK_MSG(moe_wait(c, &rq[i], 20000, NULL) == 0, "request %d: %s", i, moe_errmsg());
        CHECK(itest_fwd_error(&L, &f[i]) <= itest_tolerance(L.dt));
    }
    itest_daemon_wait_stopped(&d);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(routing_modes_match_reference),
        TEST_CASE(concurrent_clients_get_their_own_results),
        TEST_CASE(grouped_gemm_matches_reference),
        TEST_CASE(file_layers_in_both_naming_schemes),
        TEST_CASE(async_submit_poll_and_wait_out_of_order),
        TEST_CASE(a_waiting_thread_does_not_hold_up_the_others),
        TEST_CASE(unread_replies_are_all_delivered),
        TEST_CASE(unload_reload_and_duplicate_names),
        TEST_CASE(killed_clients_are_cleaned_up),
        TEST_CASE(sigterm_drains_requests_in_flight),
        {0}});
}
