/*
 * itest_shard.c: expert parallelism on the CPU backend's virtual devices,
 * or with MOE_TEST_BACKEND=cuda on every GPU of the machine (moed --gpus
 * all; cases that need more devices than there are are skipped). A layer
 * spread over 2 or 3 devices (evenly or by an explicit map) gives the
 * single-device result within tolerance in every routing mode, its
 * placement is visible, several clients are served at once, and bad
 * placements are refused without half-loading anything.
 */
#include "tests/integration/itest.h"

/* moed with n virtual devices, or with every GPU; returns the device
 * count the daemon reports (the test is skipped under 2). */
static int shard_daemon(struct itest_daemon *d, const char *n, moe_client **c)
{
    if (itest_on_gpu())
        itest_daemon_start(d, "--gpus", "all", NULL);
    else
        itest_daemon_start(d, "--virtual-devices", n, NULL);
    *c = itest_connect(d, "shard");
    moe_server_info info;
    CHECK(moe_hello(*c, &info) == 0);
    if (info.n_devices < 2) {
        moe_disconnect(c);
        itest_daemon_stop(d);
        TEST_SKIP("one device: a layer needs two to be spread");
    }
    return (int)info.n_devices;
}

static void forward_matches(moe_client *c, struct itest_layer *L, struct itest_layer *whole,
                            size_t T, uint64_t *seed)
{
    struct itest_fwd f;
    itest_fwd_make(c, L, T, seed, &f);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s: %s", L->name, moe_errmsg());
    double err = itest_fwd_error(L, &f);
    CHECK_MSG(err <= itest_tolerance(L->dt), "%s T=%zu: error %.3e", L->name, T, err);
    /* The same inputs through the layer on one device. */
    size_t bytes = T * (size_t)L->sh.hidden * moe_dtype_size(L->dt);
    uint8_t *sharded = malloc(bytes), *b = moe_region_data(f.r);
    memcpy(sharded, b + f.o_off, bytes);
    f.args.layer = whole->name;
    memset(b + f.o_off, 0xff, bytes);
    CHECK(moe_forward(c, &f.args, NULL) == 0);
    float *g = malloc(bytes / moe_dtype_size(L->dt) * 4), *w = malloc(bytes / moe_dtype_size(L->dt) * 4);
    size_t n = T * (size_t)L->sh.hidden;
    moek_to_f32(itest_kdt(L->dt), sharded, g, n);
    moek_to_f32(itest_kdt(L->dt), b + f.o_off, w, n);
    double diff = moek_rel_error(g, w, n);
    CHECK_MSG(diff <= itest_tolerance(L->dt), "%s T=%zu: %.3e from the one-device run", L->name, T,
              diff);
    free(sharded);
    free(g);
    free(w);
    moe_region_free(c, &f.r);
}

/* A daemon of more devices than moe_server_info holds (8): moe_devices
 * lists every one, and tells how many there are past the room it was
 * given; moectl info prints them all. */
TEST(every_device_is_listed)
{
    if (itest_on_gpu())
        TEST_SKIP("needs 12 of the CPU backend's virtual devices");
    struct itest_daemon d;
    itest_daemon_start(&d, "--virtual-devices", "12", NULL);
    moe_client *c = itest_connect(&d, "devices");
    moe_server_info info;
    CHECK(moe_hello(c, &info) == 0);
    CHECK_EQ_INT(info.n_devices, 8);
    CHECK_EQ_INT(moe_devices(c, NULL, 0), 12);
    moe_device_info dev[16];
    memset(dev, 0x5a, sizeof(dev));
    CHECK_EQ_INT(moe_devices(c, dev, 4), 12);
    CHECK(dev[3].name[0] != 0x5a && dev[4].name[0] == 0x5a);
    CHECK_EQ_INT(moe_devices(c, dev, 16), 12);
    for (int i = 0; i < 12; i++)
        CHECK_MSG(!strcmp(dev[i].name, dev[0].name) && dev[i].compute_units > 0,
                  "device %d: '%s', %u compute units", i, dev[i].name, dev[i].compute_units);
    CHECK(dev[12].name[0] == 0x5a);
    CHECK_EQ_INT(moe_devices(c, NULL, 1), -EINVAL);
    CHECK_EQ_INT(moe_devices(c, dev, -1), -EINVAL);
    CHECK_EQ_INT(moe_devices(NULL, dev, 1), -EINVAL);
    moe_disconnect(&c);
    char out[8192];
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s info", itest_build(),
                               d.dir), 0);
    CHECK_STR_CONTAINS(out, "device 11: ");
    itest_daemon_stop(&d);
}

TEST(sharded_layers_match_one_device)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    moe_client *c;
    int n_dev = shard_daemon(&d, "3", &c);
    if (!itest_on_gpu())
        CHECK_EQ_INT(n_dev, 3);
    static const uint32_t two[] = {0, 1}, three[] = {2, 0, 1}, odd[] = {1, 2}, rev[] = {1, 0};
    static const uint32_t map[] = {2, 1, 2, 2, 1, 2, 2, 2, 1, 1, 2, 2, 2, 2, 2, 1};
    static const uint32_t map01[] = {1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0};
    const struct {
        moe_routing routing;
        bool renorm;
        moe_dtype dt;
        int E, k;
        const uint32_t *devs, *map;
        size_t n_devs, n_map;
    } cases[] = {
        {MOE_ROUTING_SOFTMAX, true, MOE_DTYPE_BF16, 8, 2, two, NULL, 2, 0},
        {MOE_ROUTING_SIGMOID, false, MOE_DTYPE_FP16, 16, 4, three, NULL, 3, 0},
        {MOE_ROUTING_GIVEN, false, MOE_DTYPE_FP32, 16, 3, odd, map, 2, 16},
        {MOE_ROUTING_SOFTMAX, false, MOE_DTYPE_BF16, 4, 4, three, NULL, 3, 0}, /* k = E */
        {MOE_ROUTING_GIVEN, false, MOE_DTYPE_BF16, 16, 3, rev, map01, 2, 16},
        {MOE_ROUTING_SOFTMAX, true, MOE_DTYPE_FP16, 4, 4, two, NULL, 2, 0}, /* k = E */
    };
    bool loaded[ARRAY_LEN(cases)] = {false};
    int n_loaded = 0;
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        bool fits = true;
        for (size_t j = 0; j < cases[i].n_devs; j++)
            fits &= (int)cases[i].devs[j] < n_dev;
        if (!fits)
            continue; /* more devices than this machine has */
        loaded[i] = true;
        n_loaded++;
        struct itest_layer L = {.dt = itest_dt(cases[i].dt), .sh = {cases[i].E, cases[i].k, 64, 96},
                                .routing = cases[i].routing, .renorm = cases[i].renorm,
                                .devices = cases[i].devs, .n_devices = cases[i].n_devs,
                                .expert_device = cases[i].map, .n_expert_device = cases[i].n_map};
        snprintf(L.name, sizeof(L.name), "sharded-%zu", i);
        itest_layer_upload(c, &L, &seed);
        /* The same weights, whole on device 0. */
        struct itest_layer W = L;
        W.devices = W.expert_device = NULL;
        W.n_devices = W.n_expert_device = 0;
        snprintf(W.name, sizeof(W.name), "whole-%zu", i);
        moe_region *r;
        size_t bytes = (size_t)L.sh.experts * 64 * 96 * moe_dtype_size(L.dt);
        CHECK(moe_region_create(c, 3 * bytes, "w", &r) == 0);
        uint8_t *b = moe_region_data(r);
        memcpy(b, L.w1, bytes);
        memcpy(b + bytes, L.w3, bytes);
        memcpy(b + 2 * bytes, L.w2, bytes);
        moe_layer_desc desc = {.name = W.name, .kind = MOE_LAYER_MOE, .dtype = L.dt,
                               .experts = (uint32_t)L.sh.experts, .topk = (uint32_t)L.sh.topk,
                               .hidden = 64, .intermediate = 96, .routing = L.routing,
                               .renormalize = L.renorm,
                               .w1 = moe_tensor_3d(r, 0, L.dt, L.sh.experts, 96, 64),
                               .w3 = moe_tensor_3d(r, bytes, L.dt, L.sh.experts, 96, 64),
                               .w2 = moe_tensor_3d(r, 2 * bytes, L.dt, L.sh.experts, 64, 96)};
        CHECK_MSG(moe_layer_load(c, &desc, NULL) == 0, "%s", moe_errmsg());
        moe_region_free(c, &r);
        size_t Ts[] = {1, 7, 40};
        for (size_t t = 0; t < ARRAY_LEN(Ts); t++)
            forward_matches(c, &L, &W, Ts[t], &seed);
        itest_layer_free(&L);
    }
    /* Placement is visible: bytes split over the devices named. */
    moe_layer_info infos[16];
    int n = moe_layer_list(c, infos, 16);
    CHECK_EQ_INT(n, 2 * n_loaded);
    for (int i = 0; i < n; i++) {
        if (strncmp(infos[i].name, "sharded-", 8))
            continue;
        size_t which = (size_t)(infos[i].name[8] - '0');
        CHECK(which < ARRAY_LEN(cases) && loaded[which]);
        CHECK_EQ_INT(infos[i].n_devices, cases[which].n_devs);
        uint64_t sum = 0;
        for (int k = 0; k < infos[i].n_devices; k++) {
            CHECK_EQ_INT(infos[i].devices[k], cases[which].devs[k]);
            CHECK(infos[i].device_bytes[k] > 0);
            sum += infos[i].device_bytes[k];
        }
        CHECK_EQ_INT(sum, infos[i].weight_bytes);
    }
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

TEST(bad_placements_are_refused)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    moe_client *c;
    int n_dev = shard_daemon(&d, "2", &c);
    const uint32_t nodev[] = {0, (uint32_t)n_dev};
    /* Above INT_MAX: not a negative index into the daemon's devices. */
    static const uint32_t huge[] = {0, 0x80000000u}, all_ones[] = {0xffffffffu, 0},
                          high[] = {0xfffffffeu};
    static const uint32_t dup[] = {1, 1}, ok2[] = {0, 1};
    static const uint32_t short_map[] = {0, 1, 0}, stray[] = {0, 1, 1, 2},
                          empty_dev[] = {0, 0, 0, 0};
    const struct {
        const uint32_t *devs, *map;
        size_t n_devs, n_map;
        const char *needle;
    } cases[] = {
        {nodev, NULL, 2, 0, "does not exist"},
        {huge, NULL, 2, 0, "device 2147483648 does not exist"},
        {all_ones, NULL, 2, 0, "device 4294967295 does not exist"},
        {high, NULL, 1, 0, "device 4294967294 does not exist"},
        {dup, NULL, 2, 0, "listed twice"},
        {ok2, short_map, 2, 3, "names 3 experts"},
        {ok2, stray, 2, 4, "not among the layer's devices"},
        {ok2, empty_dev, 2, 4, "would hold no expert"},
    };
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        struct itest_layer L = {.name = "bad", .dt = MOE_DTYPE_BF16, .sh = {4, 2, 32, 32},
                                .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
        size_t bytes = 4 * 32 * 32 * 2;
        moe_region *r;
        CHECK(moe_region_create(c, 3 * bytes, "w", &r) == 0);
        itest_fill(&seed, MOE_DTYPE_BF16, moe_region_data(r), 3 * 4 * 32 * 32, 0.2f);
        moe_layer_desc desc = {.name = L.name, .kind = MOE_LAYER_MOE, .dtype = L.dt, .experts = 4,
                               .topk = 2, .hidden = 32, .intermediate = 32,
                               .w1 = moe_tensor_3d(r, 0, L.dt, 4, 32, 32),
                               .w3 = moe_tensor_3d(r, bytes, L.dt, 4, 32, 32),
                               .w2 = moe_tensor_3d(r, 2 * bytes, L.dt, 4, 32, 32),
                               .devices = cases[i].devs, .n_devices = cases[i].n_devs,
                               .expert_device = cases[i].map, .n_expert_device = cases[i].n_map};
        CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -EINVAL);
        CHECK_STR_CONTAINS(moe_errmsg(), cases[i].needle);
        moe_region_free(c, &r);
    }
    moe_layer_desc gemm = {.name = "g", .kind = MOE_LAYER_GEMM, .path = "/x", .devices = ok2,
                           .n_devices = 2};
    CHECK_EQ_INT(moe_layer_load(c, &gemm, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "only MoE layers");
    moe_layer_info infos[4];
    CHECK_EQ_INT(moe_layer_list(c, infos, 4), 0); /* nothing half-loaded */
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* Several clients on a sharded layer: batched, each output correct. */
TEST(sharded_layer_serves_concurrent_clients)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    moe_client *c;
    shard_daemon(&d, "2", &c);
    static const uint32_t devs[] = {0, 1};
    struct itest_layer L = {.name = "shared", .dt = MOE_DTYPE_BF16, .sh = {8, 2, 64, 128},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true, .devices = devs,
                            .n_devices = 2};
    itest_layer_upload(c, &L, &seed);
    pid_t pids[4];
    for (int i = 0; i < 4; i++) {
        pids[i] = fork();
        if (pids[i] == 0) {
            uint64_t s = seed + (uint64_t)i * 131;
            moe_client *cc = itest_connect(&d, "client");
            for (int r = 0; r < 15; r++) {
                struct itest_fwd f;
                itest_fwd_make(cc, &L, 1 + test_rand(&s) % 6, &s, &f);
                CHECK(moe_forward(cc, &f.args, NULL) == 0);
                CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
                moe_region_free(cc, &f.r);
            }
            _exit(0);
        }
    }
    for (int i = 0; i < 4; i++) {
        int st;
        waitpid(pids[i], &st, 0);
        CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "client %d failed", i);
    }
    moe_stats s;
    CHECK(moe_stats_get(c, &s) == 0);
    CHECK_EQ_INT(s.requests, 60);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(every_device_is_listed),
        TEST_CASE(sharded_layers_match_one_device),
        TEST_CASE(bad_placements_are_refused),
        TEST_CASE(sharded_layer_serves_concurrent_clients),
        {0}});
}
