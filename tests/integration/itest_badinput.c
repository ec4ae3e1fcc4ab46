/*
 * itest_badinput.c: every kind of bad input a client can send gets a clear
 * error and the daemon keeps serving. Most cases go through a raw client
 * (its own seqpacket session and DEALER socket, hand-built protobuf) so that
 * they can say things libmoe never would.
 */
#include "daemon/safetensors.h"
#include "tests/integration/raw.h"

/* Shapes of the test layers. */
enum { E = 8, K = 2, H = 32, I = 32, T = 4 };

#define tensor raw_tensor

TEST(bad_requests_are_refused_and_the_daemon_keeps_serving)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "good");
    struct itest_layer L = {.name = "L", .dt = MOE_DTYPE_BF16, .sh = {E, K, H, I},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    struct itest_layer G = {.name = "G", .dt = MOE_DTYPE_BF16, .sh = {E, K, H, I},
                            .routing = MOE_ROUTING_GIVEN};
    itest_layer_upload(c, &L, &seed);
    itest_layer_upload(c, &G, &seed);

    struct raw r, other;
    raw_open(&r, d.dir, true);
    raw_open(&other, d.dir, true);
    void *base = NULL;
    const size_t RS = 1 << 16;
    uint64_t reg = raw_region(&r, RS, &base);
    uint64_t foreign = raw_region(&other, RS, NULL);
    /* Layout: x at 0 (T*H bf16), logits at 4096 (T*E fp32), ids at 8192,
     * weights at 12288, out at 16384. */
    itest_fill(&seed, MOE_DTYPE_BF16, base, T * H, 1.0f);
    for (int i = 0; i < T * E; i++)
        ((float *)((char *)base + 4096))[i] = test_randf(&seed);
    uint64_t sx[] = {T, H}, sl[] = {T, E}, sk[] = {T, K}, so[] = {T, H};
    Moe__Tensor x = tensor(reg, 0, MOE__DTYPE__DTYPE_BF16, sx, 2);
    Moe__Tensor lg = tensor(reg, 4096, MOE__DTYPE__DTYPE_FP32, sl, 2);
    Moe__Tensor ids = tensor(reg, 8192, MOE__DTYPE__DTYPE_INT32, sk, 2);
    Moe__Tensor wts = tensor(reg, 12288, MOE__DTYPE__DTYPE_FP32, sk, 2);
    Moe__Tensor out = tensor(reg, 16384, MOE__DTYPE__DTYPE_BF16, so, 2);
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__FusedMoe fm = MOE__FUSED_MOE__INIT;
    req.body_case = MOE__REQUEST__BODY_FUSED_MOE;
    req.fused_moe = &fm;
#define RESET()                                                                \
    do {                                                                       \
        fm.layer = "L";                                                        \
        fm.x = &x;                                                             \
        fm.logits = &lg;                                                       \
        fm.topk_ids = NULL;                                                    \
        fm.topk_weights = NULL;                                                \
        fm.out = &out;                                                         \
        req.token.len = 0;                                                     \
    } while (0)
    RESET();
    raw_expect(&r, &req, MOE__STATUS__STATUS_OK, NULL); /* the good request */

    RESET(); fm.layer = "nope";
    raw_expect(&r, &req, MOE__STATUS__STATUS_NOT_FOUND, "no layer named 'nope'");

    Moe__Tensor bad = x;
    RESET(); bad.dtype = MOE__DTYPE__DTYPE_FP16; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "dtype");
    uint64_t sbad[] = {T, H + 1};
    RESET(); bad = x; bad.shape = sbad; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "shape");
    uint64_t s3[] = {T, H, 1};
    RESET(); bad = x; bad.shape = s3; bad.n_shape = 3; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "x must be [tokens, hidden] (2 dimensions), not 3");
    uint64_t sT[] = {T + 1, H};
    RESET(); bad = out; bad.shape = sT; fm.out = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "out");
    RESET(); fm.logits = NULL;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "logits");
    RESET(); bad = x; bad.region = foreign; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_NOT_FOUND, "not registered in this session");
    RESET(); bad = x; bad.region = 12345; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_NOT_FOUND, "not registered");
    RESET(); bad = out; bad.offset = RS - 8; fm.out = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "outside region");
    RESET(); bad = out; bad.offset = UINT64_MAX - 7; fm.out = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "outside region");
    uint64_t shuge[] = {1ull << 40, 1ull << 40};
    RESET(); bad = x; bad.shape = shuge; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "overflows");
    RESET(); bad = x; bad.offset = 1; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "aligned");
    RESET(); bad = x; bad.dtype = (Moe__DType)77; fm.x = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "dtype");
    RESET(); fm.topk_ids = &ids; fm.topk_weights = &wts;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "routes from logits");

    /* Given routing: ids are range-checked in the daemon's own copy. */
    int32_t *idp = (int32_t *)((char *)base + 8192);
    float *wp = (float *)((char *)base + 12288);
    for (int i = 0; i < T * K; i++) {
        idp[i] = i % E;
        wp[i] = 0.5f;
    }
    RESET(); fm.layer = "G"; fm.logits = NULL; fm.topk_ids = &ids; fm.topk_weights = &wts;
    raw_expect(&r, &req, MOE__STATUS__STATUS_OK, NULL);
    idp[5] = E;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "outside [0, 8)");
    idp[5] = -1;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "= -1");
    idp[5] = 1;
    int64_t *id64 = (int64_t *)((char *)base + 20480);
    for (int i = 0; i < T * K; i++)
        id64[i] = i % E;
    id64[3] = 1ll << 40;
    Moe__Tensor ids64 = tensor(reg, 20480, MOE__DTYPE__DTYPE_INT64, sk, 2);
    fm.topk_ids = &ids64;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "1099511627776");
    id64[3] = 3;
    raw_expect(&r, &req, MOE__STATUS__STATUS_OK, NULL);
    bad = wts; bad.dtype = MOE__DTYPE__DTYPE_BF16; fm.topk_weights = &bad;
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "topk_weights");
    RESET(); fm.layer = "G";
    raw_expect(&r, &req, MOE__STATUS__STATUS_INVALID_ARGUMENT, "not logits");

    /* Envelope problems. */
    RESET();
    uint8_t wrong[16] = {1};
    req.token.data = wrong;
    req.token.len = 16;
    raw_expect(&r, &req, MOE__STATUS__STATUS_PERMISSION_DENIED, "token");
    req.token.len = 3;
    raw_expect(&r, &req, MOE__STATUS__STATUS_PERMISSION_DENIED, "token");
    Moe__Request empty = MOE__REQUEST__INIT;
    raw_expect(&r, &empty, MOE__STATUS__STATUS_PROTOCOL, "no known message");
    Moe__Request hello = MOE__REQUEST__INIT;
    Moe__Hello h = MOE__HELLO__INIT;
    h.protocol_version = 99;
    hello.body_case = MOE__REQUEST__BODY_HELLO;
    hello.hello = &h;
    raw_expect(&r, &hello, MOE__STATUS__STATUS_UNSUPPORTED, "protocol version 99");
    uint8_t garbage[64];
    for (size_t i = 0; i < sizeof(garbage); i++)
        garbage[i] = (uint8_t)test_rand(&seed) | 0x80;
    raw_expect_bytes(&r, garbage, sizeof(garbage), MOE__STATUS__STATUS_PROTOCOL, "decoded");
    RESET();
    req.id = 99;
    req.token.data = r.token;
    req.token.len = 16;
    uint8_t packed[1024];
    size_t plen = moe__request__pack(&req, packed);
    raw_expect_bytes(&r, packed, plen / 2, MOE__STATUS__STATUS_PROTOCOL, NULL);
    CHECK(zmq_send(r.zsock, "a", 1, ZMQ_SNDMORE) == 1);
    raw_expect_bytes(&r, "b", 1, MOE__STATUS__STATUS_PROTOCOL, "one message part");

    /* The session socket. */
    int fd;
    Moe__SessionReply *srep;
#define EXPECT_REG(fds, nfds, size, st)                                        \
    do {                                                                       \
        srep = raw_register(&r, size, fds, nfds);                              \
        CHECK_MSG(srep->status == (st), "register: status %d: %s", srep->status, \
                  srep->message);                                              \
        moe__session_reply__free_unpacked(srep, NULL);                         \
    } while (0)
    /* Both raw clients' ZeroMQ connections are up before the baseline. */
    Moe__Request ping = MOE__REQUEST__INIT;
    Moe__Hello ph = MOE__HELLO__INIT;
    ph.protocol_version = 1;
    ping.body_case = MOE__REQUEST__BODY_HELLO;
    ping.hello = &ph;
    raw_expect(&other, &ping, MOE__STATUS__STATUS_OK, NULL);
    int fds_before = itest_count_fds(d.pid);
    fd = memfd_sized(4096, 0);
    EXPECT_REG(&fd, 1, 4096, MOE__STATUS__STATUS_INVALID_ARGUMENT); /* unsealed */
    close(fd);
    fd = memfd_sized(4096, F_SEAL_SHRINK);
    EXPECT_REG(&fd, 1, 4096, MOE__STATUS__STATUS_INVALID_ARGUMENT); /* can grow */
    close(fd);
    fd = memfd_sized(4096, F_SEAL_SHRINK | F_SEAL_GROW);
    EXPECT_REG(&fd, 1, 8192, MOE__STATUS__STATUS_INVALID_ARGUMENT); /* size lies */
    EXPECT_REG(&fd, 1, 0, MOE__STATUS__STATUS_INVALID_ARGUMENT);
    EXPECT_REG(NULL, 0, 4096, MOE__STATUS__STATUS_INVALID_ARGUMENT); /* no fd */
    int two[2] = {fd, fd};
    EXPECT_REG(two, 2, 4096, MOE__STATUS__STATUS_INVALID_ARGUMENT);
    close(fd);
    int pfd[2];
    CHECK(pipe(pfd) == 0);
    EXPECT_REG(pfd, 1, 4096, MOE__STATUS__STATUS_INVALID_ARGUMENT);
    close(pfd[0]);
    close(pfd[1]);
    /* ZeroMQ accepts and closes connections on its own threads (a probe's
     * connection may come and go late), so allow the count time to settle;
     * a leaked descriptor never goes away. */
    for (int i = 0; i < 100 && itest_count_fds(d.pid) > fds_before; i++)
        itest_sleep_ms(20);
    if (itest_count_fds(d.pid) != fds_before) {
        char cmd[128];
        snprintf(cmd, sizeof(cmd), "ls -l /proc/%d/fd >&2", (int)d.pid);
        if (system(cmd)) {}
    }
    CHECK_EQ_INT(itest_count_fds(d.pid), fds_before); /* refused fds were closed */
    Moe__SessionRequest un = MOE__SESSION_REQUEST__INIT;
    Moe__UnregisterRegion ur = MOE__UNREGISTER_REGION__INIT;
    ur.region = foreign;
    un.body_case = MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION;
    un.unregister_region = &ur;
    srep = raw_session_call(&r, &un, NULL, 0);
    CHECK_EQ_INT(srep->status, MOE__STATUS__STATUS_NOT_FOUND);
    moe__session_reply__free_unpacked(srep, NULL);
    CHECK(send(r.sfd, garbage, sizeof(garbage), 0) == (ssize_t)sizeof(garbage));
    uint8_t sbuf[1024];
    ssize_t sn = recv(r.sfd, sbuf, sizeof(sbuf), 0);
    CHECK(sn > 0);
    srep = moe__session_reply__unpack(NULL, (size_t)sn, sbuf);
    CHECK(srep && srep->status == MOE__STATUS__STATUS_PROTOCOL);
    moe__session_reply__free_unpacked(srep, NULL);

    struct raw unopened;
    raw_open(&unopened, d.dir, false);
    fd = memfd_sized(4096, F_SEAL_SHRINK | F_SEAL_GROW);
    srep = raw_register(&unopened, 4096, &fd, 1);
    CHECK_EQ_INT(srep->status, MOE__STATUS__STATUS_PERMISSION_DENIED);
    moe__session_reply__free_unpacked(srep, NULL);
    close(fd);
    raw_close(&unopened);

    /* After all that, the good client is served, correctly. */
    struct itest_fwd f;
    itest_fwd_make(c, &L, 6, &seed, &f);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    moe_region_free(c, &f.r);
    raw_close(&r);
    raw_close(&other);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_layer_free(&G);
    itest_daemon_stop(&d);
}

static void write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(data, 1, n, f) == n);
    fclose(f);
}

TEST(bad_weight_files_are_refused)
{
    uint64_t seed = test_seed();
    char allowed[] = "/tmp/moed-allowed.XXXXXX", outside[] = "/tmp/moed-outside.XXXXXX";
    CHECK(mkdtemp(allowed) && mkdtemp(outside));
    struct itest_daemon d;
    itest_daemon_start(&d, "--allow-dir", allowed, NULL);
    moe_client *c = itest_connect(&d, "loader");
    /* A good file, two experts, H=8, I=16. */
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
    char good[300], missing[300], outfile[300], trunc[300], junk[300], link[300], rel[300];
    snprintf(good, sizeof(good), "%s/good.safetensors", allowed);
    snprintf(missing, sizeof(missing), "%s/missing.safetensors", allowed);
    snprintf(outfile, sizeof(outfile), "%s/good.safetensors", outside);
    snprintf(trunc, sizeof(trunc), "%s/trunc.safetensors", allowed);
    snprintf(junk, sizeof(junk), "%s/junk.safetensors", allowed);
    snprintf(link, sizeof(link), "%s/link.safetensors", allowed);
    snprintf(rel, sizeof(rel), "%s/../%s/good.safetensors", allowed, strrchr(outside, '/') + 1);
    CHECK(st_write(good, t, 6) == 0);
    CHECK(st_write(missing, t, 5) == 0); /* expert 1's w2 is absent */
    CHECK(st_write(outfile, t, 6) == 0);
    CHECK(symlink(outfile, link) == 0);
    FILE *f = fopen(good, "rb");
    uint8_t buf[8192];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    write_file(trunc, buf, n - 100);
    write_file(junk, "\x10\0\0\0\0\0\0\0{not json at all", 24);

    moe_layer_desc desc = {.name = "w", .kind = MOE_LAYER_MOE, .topk = 2, .routing = MOE_ROUTING_SOFTMAX};
    struct {
        const char *path;
        int err;
        const char *needle;
    } cases[] = {
        {outfile, -EACCES, "outside the allowed directories"},
        {link, -EACCES, "outside the allowed directories"},
        {rel, -EACCES, "outside the allowed directories"},
        {"relative/path.safetensors", -EINVAL, "absolute"},
        {"/etc/passwd", -EACCES, "outside"},
        {"/no/such/file", -EACCES, "outside"},
        {trunc, -EIO, "truncated"},
        {junk, -EIO, "not a valid safetensors file"},
        {missing, -EINVAL, "experts.1.w2.weight is missing"},
    };
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        desc.path = cases[i].path;
        int rc = moe_layer_load(c, &desc, NULL);
        CHECK_MSG(rc == cases[i].err, "%s: got %d (%s), want %d", cases[i].path, rc, moe_errmsg(),
                  cases[i].err);
        CHECK_STR_CONTAINS(moe_errmsg(), cases[i].needle);
    }
    char nothere[300];
    snprintf(nothere, sizeof(nothere), "%s/nothere.safetensors", allowed);
    desc.path = nothere;
    CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -ENOENT);
    desc.path = good;
    desc.topk = 3; /* more than the two experts */
    CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "topk");
    desc.topk = 2;
    desc.name = "bad name!";
    CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -EINVAL);
    desc.name = "w";
    desc.hidden = 9; /* disagrees with the file */
    CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -EINVAL);
    desc.hidden = 0;
    moe_layer_desc gd = {.name = "g", .kind = MOE_LAYER_GEMM, .path = good, .prefix = "nope"};
    CHECK_EQ_INT(moe_layer_load(c, &gd, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "'nope' is missing");
    /* Uploads with the wrong shapes. */
    moe_region *r;
    CHECK(moe_region_create(c, 1 << 16, "up", &r) == 0);
    moe_layer_desc up = {.name = "up", .kind = MOE_LAYER_MOE, .dtype = MOE_DTYPE_BF16,
                         .experts = 2, .topk = 1, .hidden = 8, .intermediate = 16,
                         .w1 = moe_tensor_3d(r, 0, MOE_DTYPE_BF16, 2, 16, 8),
                         .w3 = moe_tensor_3d(r, 1024, MOE_DTYPE_BF16, 2, 16, 8),
                         .w2 = moe_tensor_3d(r, 2048, MOE_DTYPE_BF16, 2, 16, 8)};
    CHECK_EQ_INT(moe_layer_load(c, &up, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "w2 [2, 8, 16]");
    up.w2 = moe_tensor_3d(r, 1 << 16, MOE_DTYPE_BF16, 2, 8, 16);
    CHECK_EQ_INT(moe_layer_load(c, &up, NULL), -EINVAL);
    up.w2 = moe_tensor_3d(r, 2048, MOE_DTYPE_BF16, 2, 8, 16);
    up.path = good;
    CHECK_EQ_INT(moe_layer_load(c, &up, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "not both");
    /* None of that was half-loaded; the good file loads fine. */
    moe_layer_info infos[4];
    CHECK_EQ_INT(moe_layer_list(c, infos, 4), 0);
    desc.path = good;
    CHECK_MSG(moe_layer_load(c, &desc, NULL) == 0, "%s", moe_errmsg());
    CHECK_EQ_INT(moe_layer_list(c, infos, 4), 1);
    moe_region_free(c, &r);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_rmdir(allowed);
    itest_rmdir(outside);
}

/* A region handle passed to a client other than its own, or freed already
 * (through a copy of the handle), is refused: the owner's mapping stays. */
TEST(a_region_is_freed_only_by_its_own_client)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *a = itest_connect(&d, "a"), *b = itest_connect(&d, "b");
    moe_region *ra, *rb;
    CHECK(moe_region_create(a, 4096, "ra", &ra) == 0);
    CHECK(moe_region_create(b, 4096, "rb", &rb) == 0);
    memset(moe_region_data(ra), 0x5a, 4096);
    moe_region *wrong = ra;
    CHECK_EQ_INT(moe_region_free(b, &wrong), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "not one of this client's");
    CHECK(wrong == ra); /* still the caller's */
    /* Still mapped, still registered with a's session. */
    CHECK(((uint8_t *)moe_region_data(ra))[4095] == 0x5a);
    moe_stats st;
    CHECK(moe_stats_get(a, &st) == 0);
    CHECK_EQ_INT(st.regions, 2);
    moe_region *copy = ra;
    CHECK_EQ_INT(moe_region_free(a, &ra), 0);
    CHECK(ra == NULL);
    CHECK_EQ_INT(moe_region_free(a, &copy), -EINVAL); /* freed already */
    CHECK_EQ_INT(moe_region_free(b, &rb), 0);
    CHECK(moe_stats_get(a, &st) == 0);
    CHECK_EQ_INT(st.regions, 0);
    moe_disconnect(&a);
    moe_disconnect(&b);
    itest_daemon_stop(&d);
}

/* Request ids are the client's own: a request handle passed to another
 * client is refused there, and neither client's requests are touched. */
TEST(a_request_is_waited_for_only_by_its_own_client)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *a = itest_connect(&d, "a"), *b = itest_connect(&d, "b");
    struct itest_layer L = {.name = "L", .dt = MOE_DTYPE_BF16, .sh = {E, K, H, I},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    itest_layer_upload(a, &L, &seed); /* a's request 1 */
    CHECK(moe_hello(b, NULL) == 0);   /* b's request 1 */
    struct itest_fwd fa, fb;
    itest_fwd_make(a, &L, T, &seed, &fa);
    itest_fwd_make(b, &L, T, &seed, &fb);
    moe_request *ra, *ra2, *rb, *rb2;
    /* The same ids on both clients: 2 and 3. */
    CHECK(moe_forward_submit(a, &fa.args, &ra) == 0);
    CHECK(moe_forward_submit(b, &fb.args, &rb) == 0);
    CHECK(moe_forward_submit(a, &fa.args, &ra2) == 0);
    CHECK(moe_forward_submit(b, &fb.args, &rb2) == 0);
    CHECK_EQ_INT(moe_poll(b, ra), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "not this client's");
    moe_request *wrong = ra;
    CHECK_EQ_INT(moe_wait(b, &wrong, 5000, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "not this client's");
    CHECK(wrong == ra); /* still the caller's */
    /* Given up through the wrong client: the handle goes, b's own request
     * of the same id stays. */
    moe_request_free(b, &ra2);
    CHECK(ra2 == NULL);
    CHECK_MSG(moe_wait(b, &rb, 10000, NULL) == 0, "%s", moe_errmsg());
    CHECK_MSG(moe_wait(b, &rb2, 10000, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &fb) <= itest_tolerance(L.dt));
    CHECK_MSG(moe_wait(a, &ra, 10000, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &fa) <= itest_tolerance(L.dt));
    moe_region_free(a, &fa.r);
    moe_region_free(b, &fb.r);
    moe_disconnect(&a);
    moe_disconnect(&b);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* A handle of a client disconnected with it uncollected names that client
 * alone, also when a client made since got its address (and counts its
 * request ids from 1 again, as every client does): moe_request_free
 * through the new one frees the handle alone, and moe_wait refuses it. */
TEST(a_request_of_a_client_gone_is_not_the_next_clients)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    struct itest_layer L = {.name = "L", .dt = MOE_DTYPE_BF16, .sh = {E, K, H, I},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    moe_client *c1 = itest_connect(&d, "c1");
    itest_layer_upload(c1, &L, &seed); /* c1's request 1 */
    struct itest_fwd f, g;
    itest_fwd_make(c1, &L, T, &seed, &f);
    moe_request *old = NULL, *old2 = NULL;
    CHECK(moe_forward_submit(c1, &f.args, &old) == 0);  /* 2 */
    CHECK(moe_forward_submit(c1, &f.args, &old2) == 0); /* 3 */
    const void *addr = c1;
    moe_region_free(c1, &f.r);
    moe_disconnect(&c1);
    /* glibc hands the freed block back to the next allocation of its
     * size; a few tries where another thread's allocation got there. */
    moe_client *c2 = NULL, *spare[8] = {0};
    for (int i = 0; i < 8; i++) {
        c2 = itest_connect(&d, "c2");
        if ((const void *)c2 == addr)
            break;
        spare[i] = c2;
        c2 = NULL;
    }
    for (int i = 0; i < 8; i++)
        if (spare[i])
            moe_disconnect(&spare[i]);
    if (!c2)
        TEST_SKIP("no new client got the old one's address");
    itest_fwd_make(c2, &L, T, &seed, &g);
    CHECK(moe_hello(c2, NULL) == 0); /* 1 */
    moe_request *mine = NULL, *mine2 = NULL;
    CHECK(moe_forward_submit(c2, &g.args, &mine) == 0);  /* 2 */
    CHECK(moe_forward_submit(c2, &g.args, &mine2) == 0); /* 3 */
    moe_request *wrong = old2;
    CHECK_EQ_INT(moe_wait(c2, &wrong, 5000, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "not this client's");
    CHECK_EQ_INT(moe_poll(c2, old2), -EINVAL);
    moe_request_free(c2, &old);
    moe_request_free(NULL, &old2);
    CHECK_MSG(moe_wait(c2, &mine, 10000, NULL) == 0, "%s", moe_errmsg());
    CHECK_MSG(moe_wait(c2, &mine2, 10000, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &g) <= itest_tolerance(L.dt));
    moe_region_free(c2, &g.r);
    moe_disconnect(&c2);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* Arguments libmoe cannot put on the wire as they are get -EINVAL and a
 * message naming them, and the client goes on. */
TEST(arguments_libmoe_cannot_send_are_refused)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "args");
    enum { G = 4, N = 16, KK = 16 };
    moe_region *wr, *r;
    CHECK(moe_region_create(c, G * N * KK * 2, "B", &wr) == 0);
    itest_fill(&seed, MOE_DTYPE_BF16, moe_region_data(wr), G * N * KK, 0.5f);
    moe_layer_desc gd = {.name = "g", .kind = MOE_LAYER_GEMM, .dtype = MOE_DTYPE_BF16,
                         .groups = G, .n = N, .k = KK,
                         .w1 = moe_tensor_3d(wr, 0, MOE_DTYPE_BF16, G, N, KK)};
    CHECK_MSG(moe_layer_load(c, &gd, NULL) == 0, "%s", moe_errmsg());
    CHECK(moe_region_create(c, 4096, "ac", &r) == 0);
    uint64_t ms[G] = {1, 0, 2, 0};
    moe_gemm_args ga = {.layer = "g", .a = moe_tensor_2d(r, 0, MOE_DTYPE_BF16, 3, KK),
                        .c = moe_tensor_2d(r, 1024, MOE_DTYPE_BF16, 3, N), .m_sizes = ms,
                        .groups = G};
    moe_request *req = NULL;

    /* groups without m_sizes */
    ga.m_sizes = NULL;
    CHECK_EQ_INT(moe_gemm(c, &ga, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "m_sizes");
    CHECK_EQ_INT(moe_gemm_submit(c, &ga, &req), -EINVAL);
    CHECK(req == NULL);
    ga.m_sizes = ms;

    /* Tensors in another client's region, or in one freed already: the
     * handle is not read. */
    moe_client *other = itest_connect(&d, "other");
    moe_region *foreign, *freed;
    CHECK(moe_region_create(other, 4096, "foreign", &foreign) == 0);
    CHECK(moe_region_create(c, 4096, "freed", &freed) == 0);
    moe_tensor in_freed = moe_tensor_2d(freed, 0, MOE_DTYPE_BF16, 3, N);
    CHECK(moe_region_free(c, &freed) == 0);
    ga.c = moe_tensor_2d(foreign, 0, MOE_DTYPE_BF16, 3, N);
    CHECK_EQ_INT(moe_gemm(c, &ga, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "tensor c: its region is not one of this client's");
    ga.c = in_freed;
    CHECK_EQ_INT(moe_gemm_submit(c, &ga, &req), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "tensor c: its region is not one of this client's");
    ga.c = moe_tensor_2d(r, 1024, MOE_DTYPE_BF16, 3, N);
    moe_forward_args fa = {.layer = "g", .x = in_freed, .out = in_freed};
    CHECK_EQ_INT(moe_forward(c, &fa, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "tensor x: its region is not one of this client's");
    moe_layer_desc up = gd;
    up.name = "g2";
    up.w1 = moe_tensor_3d(foreign, 0, MOE_DTYPE_BF16, 2, 8, 8);
    CHECK_EQ_INT(moe_layer_load(c, &up, NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "tensor w1: its region is not one of this client's");
    moe_region_free(other, &foreign);
    moe_disconnect(&other);

    /* More dimensions than a tensor holds, or none: said as the caller
     * gave them, not as the empty shape they would go out as. */
    int ndims[] = {0, -1, MOE_MAX_DIMS + 1, INT32_MAX};
    for (size_t i = 0; i < ARRAY_LEN(ndims); i++) {
        ga.a.ndim = ndims[i];
        CHECK_EQ_INT(moe_gemm(c, &ga, NULL), -EINVAL);
        char want[64];
        snprintf(want, sizeof(want), "tensor a: ndim %d is outside [1, %d]", ndims[i],
                 MOE_MAX_DIMS);
        CHECK_STR_CONTAINS(moe_errmsg(), want);
    }
    ga.a.ndim = 2;

    /* A request larger than the daemon takes (its ZeroMQ socket would drop
     * it with the connection, unanswered): said at once, not by a timeout. */
    size_t many = (1u << 20) / 4;
    uint64_t *big = malloc(many * sizeof(*big));
    CHECK(big != NULL);
    for (size_t i = 0; i < many; i++)
        big[i] = 1ull << 40; /* 6 bytes each on the wire */
    moe_gemm_args huge = ga;
    huge.m_sizes = big;
    huge.groups = many;
    moe_set_timeout(c, 5000);
    uint64_t t0 = now_ms();
    CHECK_EQ_INT(moe_gemm(c, &huge, NULL), -EDQUOT);
    CHECK_STR_CONTAINS(moe_errmsg(), "max_message_bytes");
    CHECK(now_ms() - t0 < 1000);
    free(big);
    moe_set_timeout(c, 60000);

    /* After all that, the client is served. */
    CHECK_MSG(moe_gemm(c, &ga, NULL) == 0, "%s", moe_errmsg());
    moe_region_free(c, &r);
    moe_region_free(c, &wr);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* An empty runtime directory is as good as none, as an empty
 * MOED_RUNTIME_DIR is: the default (here the environment's) is used, not a
 * socket at /moed.sock. */
TEST(an_empty_runtime_dir_is_the_default)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    setenv("MOED_RUNTIME_DIR", d.dir, 1);
    moe_client *c = NULL;
    CHECK_MSG(moe_connect("", "e", &c) == 0, "%s", moe_errmsg());
    CHECK_MSG(moe_hello(c, NULL) == 0, "%s", moe_errmsg());
    moe_disconnect(&c);
    unsetenv("MOED_RUNTIME_DIR");
    itest_daemon_stop(&d);
}

/* A NULL where a call needs a pointer is refused with -EINVAL (or ignored
 * by the calls that return nothing), never dereferenced. */
TEST(null_pointers_are_refused)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    CHECK_EQ_INT(moe_connect(d.dir, "n", NULL), -EINVAL);
    CHECK_STR_CONTAINS(moe_errmsg(), "NULL");
    moe_client *c = itest_connect(&d, "n");
    moe_region *r = NULL;
    moe_request *req = NULL;
    moe_forward_args fa = {.layer = "L"};
    moe_gemm_args ga = {.layer = "g"};
    moe_layer_desc ld = {.name = "x", .path = "/nope"};
    moe_stats st;
    moe_layer_info li;
#define REFUSED(call)                                                          \
    do {                                                                       \
        int rc_ = (call);                                                      \
        CHECK_MSG(rc_ == -EINVAL, "%s: %d (%s)", #call, rc_, moe_errmsg());    \
        CHECK_STR_CONTAINS(moe_errmsg(), "NULL");                              \
    } while (0)
    REFUSED(moe_hello(NULL, NULL));
    REFUSED(moe_region_create(NULL, 4096, "r", &r));
    REFUSED(moe_region_create(c, 4096, "r", NULL));
    REFUSED(moe_layer_load(NULL, &ld, NULL));
    REFUSED(moe_layer_load(c, NULL, NULL));
    REFUSED(moe_layer_unload(NULL, "x"));
    REFUSED(moe_layer_list(NULL, &li, 1));
    REFUSED(moe_layer_list(c, NULL, 1));
    REFUSED(moe_forward(NULL, &fa, NULL));
    REFUSED(moe_forward(c, NULL, NULL));
    REFUSED(moe_gemm(NULL, &ga, NULL));
    REFUSED(moe_gemm(c, NULL, NULL));
    REFUSED(moe_forward_submit(NULL, &fa, &req));
    REFUSED(moe_forward_submit(c, NULL, &req));
    REFUSED(moe_forward_submit(c, &fa, NULL));
    REFUSED(moe_gemm_submit(NULL, &ga, &req));
    REFUSED(moe_gemm_submit(c, NULL, &req));
    REFUSED(moe_gemm_submit(c, &ga, NULL));
    REFUSED(moe_wait(c, NULL, 0, NULL));
    REFUSED(moe_poll(c, NULL));
    REFUSED(moe_stats_get(NULL, &st));
    REFUSED(moe_stats_get(c, NULL));
    CHECK_EQ_INT(moe_region_free(c, NULL), 0); /* nothing to free */
    CHECK(moe_region_create(c, 4096, "r", &r) == 0);
    REFUSED(moe_region_free(NULL, &r));
    CHECK(r != NULL);
    CHECK(moe_forward_submit(c, &fa, &req) == 0);
    CHECK(moe_wait(c, &req, -1, NULL) == -ENOENT); /* no such layer */
    CHECK(req == NULL);
    REFUSED(moe_wait(NULL, &req, 0, NULL)); /* *req NULL as well */
#undef REFUSED
    /* A count of the layers needs no room for them. */
    CHECK_EQ_INT(moe_layer_list(c, NULL, 0), 0);
    /* The calls that return nothing, and the accessors. */
    moe_set_timeout(NULL, 10);
    moe_set_spin_us(NULL, 10);
    moe_set_spin_ahead_us(NULL, 10);
    moe_request_free(c, NULL);
    moe_disconnect(NULL);
    CHECK(moe_region_data(NULL) == NULL);
    CHECK(moe_region_size(NULL) == 0);
    CHECK(moe_region_id(NULL) == 0);
    CHECK(moe_tensor_bytes(NULL) == 0);
    /* The client is none the worse. */
    CHECK_MSG(moe_hello(c, NULL) == 0, "%s", moe_errmsg());
    CHECK(moe_region_free(c, &r) == 0);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* A region's name is a label: one longer than a memfd's name may be is
 * cut, not refused for a reason the caller cannot see. */
TEST(a_long_region_name_is_cut)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "n");
    char name[1000];
    memset(name, 'n', sizeof(name) - 1);
    name[sizeof(name) - 1] = '\0';
    moe_region *r = NULL;
    CHECK_MSG(moe_region_create(c, 4096, name, &r) == 0, "%s", moe_errmsg());
    CHECK(moe_region_free(c, &r) == 0);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* A region no file or address space can hold is refused with its size
 * named; the client goes on. */
TEST(an_impossible_region_size_is_said)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "z");
    moe_region *r = (moe_region *)&d; /* not left as it was */
    CHECK_EQ_INT(moe_region_create(c, SIZE_MAX, "r", &r), -EFBIG);
    CHECK(r == NULL);
    CHECK_STR_CONTAINS(moe_errmsg(), "larger than a file can be");
    char want[64];
    snprintf(want, sizeof(want), "%zu bytes", (size_t)1 << 62);
    int rc = moe_region_create(c, (size_t)1 << 62, "r", &r);
    CHECK_MSG(rc < 0 && r == NULL, "2^62 bytes: %d", rc);
    CHECK_STR_CONTAINS(moe_errmsg(), want);
    CHECK_MSG(moe_region_create(c, 4096, "r", &r) == 0, "%s", moe_errmsg());
    CHECK(moe_region_free(c, &r) == 0);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* A layer the device's kernels cannot run (H = 12: the CUDA kernels take
 * multiples of 8) is refused with the kernels' own reason, and the daemon
 * goes on serving; the CPU backend runs any shape, so there it loads. */
TEST(a_shape_the_device_cannot_run_is_said)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "shape");
    moe_region *r;
    CHECK(moe_region_create(c, 1 << 16, "w", &r) == 0);
    const size_t n = 2 * 16 * 12; /* each of w1, w3, w2: E = 2, I = 16, H = 12 */
    itest_fill(&seed, MOE_DTYPE_BF16, moe_region_data(r), 3 * n, 0.5f);
    moe_layer_desc odd = {.name = "odd", .kind = MOE_LAYER_MOE, .dtype = MOE_DTYPE_BF16,
                          .experts = 2, .topk = 1, .hidden = 12, .intermediate = 16,
                          .routing = MOE_ROUTING_SOFTMAX,
                          .w1 = moe_tensor_3d(r, 0, MOE_DTYPE_BF16, 2, 16, 12),
                          .w3 = moe_tensor_3d(r, 2 * n, MOE_DTYPE_BF16, 2, 16, 12),
                          .w2 = moe_tensor_3d(r, 4 * n, MOE_DTYPE_BF16, 2, 12, 16)};
    int rc = moe_layer_load(c, &odd, NULL);
    if (itest_on_gpu()) {
        CHECK_MSG(rc == -ENOTSUP, "got %d (%s)", rc, moe_errmsg());
        CHECK_STR_CONTAINS(moe_errmsg(), "shape not supported");
        CHECK_STR_CONTAINS(moe_errmsg(), "multiples of 8");
    } else {
        CHECK_MSG(rc == 0, "%s", moe_errmsg());
        CHECK(moe_layer_unload(c, "odd") == 0);
    }
    /* Nothing was half-loaded, and a shape both backends run loads. */
    CHECK_EQ_INT(moe_layer_list(c, NULL, 0), 0);
    odd.hidden = 8;
    odd.w1 = moe_tensor_3d(r, 0, MOE_DTYPE_BF16, 2, 16, 8);
    odd.w3 = moe_tensor_3d(r, 2 * n, MOE_DTYPE_BF16, 2, 16, 8);
    odd.w2 = moe_tensor_3d(r, 4 * n, MOE_DTYPE_BF16, 2, 8, 16);
    CHECK_MSG(moe_layer_load(c, &odd, NULL) == 0, "%s", moe_errmsg());
    CHECK_EQ_INT(moe_layer_list(c, NULL, 0), 1);
    moe_region_free(c, &r);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/* What a client names (here its session's name) cannot begin a line of its
 * own in the daemon's log, where it could pass for one of moed's. */
TEST(a_client_cannot_forge_log_lines)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--log-level", "debug", NULL);
    moe_client *c = NULL;
    CHECK_MSG(moe_connect(d.dir, "x\nmoed: error: forged\r\x1b[2J", &c) == 0, "%s", moe_errmsg());
    CHECK(moe_hello(c, NULL) == 0);
    moe_disconnect(&c);
    itest_daemon_stop_keep(&d);
    FILE *fp = fopen(d.log, "r");
    CHECK(fp != NULL);
    char line[4096];
    bool named = false;
    while (fgets(line, sizeof(line), fp)) {
        CHECK_MSG(strncmp(line, "moed: error: forged", 19) != 0, "a forged line: %s", line);
        CHECK_MSG(!strchr(line, '\r') && !strchr(line, '\x1b'), "a control character: %s", line);
        named |= strstr(line, "(x?moed: error: forged??[2J)") != NULL;
    }
    fclose(fp);
    CHECK_MSG(named, "the session's name was not logged");
    itest_rmdir(d.dir);
}

/* fork() copies a client into the child, with the parent's session: the
 * child's calls are refused at once (they hung, and would have taken the
 * parent's replies), its region free and disconnect release only its own
 * copies, and it can connect anew; the parent goes on as if nothing
 * happened, its request in flight and its region included. */
TEST(a_forked_child_does_not_use_its_parents_client)
{
    uint64_t seed = test_seed();
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "parent");
    struct itest_layer L = {.name = "L", .dt = MOE_DTYPE_BF16, .sh = {E, K, H, I},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    itest_layer_upload(c, &L, &seed);
    struct itest_fwd f;
    itest_fwd_make(c, &L, T, &seed, &f);
    moe_request *req = NULL;
    CHECK(moe_forward_submit(c, &f.args, &req) == 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20); /* a hang is a failure, not a stuck test */
        moe_server_info info;
        moe_region *r2 = NULL;
        moe_client *c2 = NULL;
        if (moe_hello(c, &info) != -EINVAL || !strstr(moe_errmsg(), "a child connects anew"))
            _exit(1);
        if (moe_forward(c, &f.args, NULL) != -EINVAL)
            _exit(2);
        if (moe_wait(c, &req, 1000, NULL) != -EINVAL || !req)
            _exit(3);
        if (moe_poll(c, req) != -EINVAL)
            _exit(4);
        if (moe_region_create(c, 4096, "child", &r2) != -EINVAL || r2)
            _exit(5);
        if (moe_region_free(c, &f.r) != 0 || f.r)
            _exit(6);
        moe_request_free(c, &req);
        moe_set_timeout(c, 1);
        moe_disconnect(&c);
        if (moe_connect(d.dir, "child", &c2) != 0 || moe_hello(c2, NULL) != 0)
            _exit(7);
        moe_disconnect(&c2);
        _exit(0);
    }
    CHECK(pid > 0);
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child: %s %d",
              WIFEXITED(st) ? "exit status" : "signal",
              WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    /* The parent's request, region and session are as they were. */
    CHECK_MSG(moe_wait(c, &req, 10000, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    memset((uint8_t *)moe_region_data(f.r) + f.o_off, 0xff,
           f.T * (size_t)L.sh.hidden * moe_dtype_size(L.dt));
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "%s", moe_errmsg());
    CHECK(itest_fwd_error(&L, &f) <= itest_tolerance(L.dt));
    moe_stats stats;
    CHECK(moe_stats_get(c, &stats) == 0);
    moe_region_free(c, &f.r);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
}

/* A child of fork() does not keep its parent's session alive: the parent's
 * disconnect ends it (with its regions) while the child lives on, as if
 * there were no child. */
TEST(a_forked_child_does_not_keep_its_parents_session)
{
    struct itest_daemon d;
    itest_daemon_start(&d, NULL);
    moe_client *c = itest_connect(&d, "parent"), *o = itest_connect(&d, "observer");
    moe_region *r = NULL;
    CHECK(moe_region_create(c, 1 << 20, "parent", &r) == 0);
    int p[2];
    CHECK(pipe(p) == 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20);
        close(p[1]);
        char b;
        ssize_t n = read(p[0], &b, 1); /* until the parent closes its end */
        _exit(n == 0 ? 0 : 1);
    }
    CHECK(pid > 0);
    close(p[0]);
    moe_stats st;
    CHECK(moe_stats_get(o, &st) == 0);
    CHECK_EQ_INT(st.sessions, 2);
    moe_disconnect(&c);
    uint64_t t0 = now_ms();
    do {
        itest_sleep_ms(10);
        CHECK(moe_stats_get(o, &st) == 0);
    } while (st.sessions != 1 && now_ms() - t0 < 5000);
    CHECK_MSG(st.sessions == 1 && st.regions == 0,
              "with the child alive: %u sessions, %u regions", st.sessions, st.regions);
    close(p[1]);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    moe_disconnect(&o);
    itest_daemon_stop(&d);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(bad_requests_are_refused_and_the_daemon_keeps_serving),
        TEST_CASE(bad_weight_files_are_refused),
        TEST_CASE(a_region_is_freed_only_by_its_own_client),
        TEST_CASE(a_request_is_waited_for_only_by_its_own_client),
        TEST_CASE(a_request_of_a_client_gone_is_not_the_next_clients),
        TEST_CASE(arguments_libmoe_cannot_send_are_refused),
        TEST_CASE(an_empty_runtime_dir_is_the_default),
        TEST_CASE(null_pointers_are_refused),
        TEST_CASE(a_long_region_name_is_cut),
        TEST_CASE(an_impossible_region_size_is_said),
        TEST_CASE(a_forked_child_does_not_use_its_parents_client),
        TEST_CASE(a_forked_child_does_not_keep_its_parents_session),
        TEST_CASE(a_client_cannot_forge_log_lines),
        TEST_CASE(a_shape_the_device_cannot_run_is_said),
        {0}});
}
