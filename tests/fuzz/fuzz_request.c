/*
 * fuzz_request.c: libFuzzer target for everything a client can send: request
 * envelopes and each message type (decode, authenticate, validate, dispatch,
 * then the batch that computes it), and session-socket messages. See fuzz.h
 * for the input format.
 *
 * The server is the daemon's own (config, CPU backend, loop, layers loaded
 * from a small safetensors file), driven step by step without its sockets:
 * requests go in through server_handle_message() from the routing id "fuzz",
 * replies come back on an inproc DEALER, sessions are socketpairs passed to
 * session_attach(). After every input the target checks what must always
 * hold, and aborts (a crash to libFuzzer) when it does not:
 *   - every request is answered exactly once, with a reply that decodes;
 *   - all work completes (nothing stays queued, nothing hangs);
 *   - another session's region is never written;
 *   - a session that closes gives back every descriptor it brought.
 *
 * Built by `make fuzz` (clang, -fsanitize=fuzzer,address,undefined) and, with
 * tests/fuzz/replay.c as main, by `make test` as test_fuzz_request, which
 * runs the seed corpus and the crash regressions once, and the seed corpus
 * again under a storm of signals (EINTR everywhere).
 */
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/log.h"
#include "daemon/loop.h"
#include "daemon/region.h"
#include "daemon/safetensors.h"
#include "daemon/server.h"
#include "daemon/util.h"
#include "moe.pb-c.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct {
    struct config cfg;
    struct loop *loop;
    struct backend *be;
    struct server *s;
    void *zctx, *router, *dealer;
    int peer, other_peer;    /* client ends of the two sessions */
    uint8_t *mine, *other;   /* the two regions, as their clients map them */
    uint8_t *pattern, *other_pattern;
    unsigned base_sessions;
    struct layer_conf layers[4];
    bool verbose; /* MOE_FUZZ_VERBOSE=1: print every reply */
} F;

static const uint8_t route_id[] = "fuzz";

/* ---- driving the loop ----------------------------------------------------- */

/* Run the loop until no work is pending; a request that never completes is
 * a bug (it would hold its client forever). */
static void pump_idle(void)
{
    uint64_t t0 = now_us();
    while (server_pending(F.s) > 0) {
        loop_run_once(F.loop, 100);
        FUZZ_CHECK(now_us() - t0 < 10000000, "work never completed: %u pending",
                   server_pending(F.s));
    }
    while (loop_run_once(F.loop, 0) > 0)
        ;
}

/* Send a session message (with an optional fd) and wait for its reply. */
static ssize_t session_call(int fd, const void *msg, size_t n, int pass_fd, uint8_t *reply,
                            size_t reply_cap)
{
    union {
        char raw[CMSG_SPACE(sizeof(int))];
        struct cmsghdr a;
    } cb;
    struct iovec iov = {(void *)msg, n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (pass_fd >= 0) {
        memset(&cb, 0, sizeof(cb));
        mh.msg_control = cb.raw;
        mh.msg_controllen = sizeof(cb.raw);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
    }
    FUZZ_CHECK(sendmsg(fd, &mh, MSG_NOSIGNAL) == (ssize_t)n, "sendmsg: %s", strerror(errno));
    uint64_t t0 = now_us();
    for (;;) {
        ssize_t got = recv(fd, reply, reply_cap, MSG_DONTWAIT);
        if (got > 0)
            return got;
        FUZZ_CHECK(got < 0 && errno == EAGAIN, "session socket closed by the daemon");
        FUZZ_CHECK(now_us() - t0 < 5000000, "session message of %zu bytes not answered", n);
        loop_run_once(F.loop, 10);
    }
}

static int new_session(void)
{
    int sv[2];
    FUZZ_CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
    fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK);
    FUZZ_CHECK(session_attach(F.s, sv[0]) == 0, "session_attach");
    return sv[1];
}

static Moe__SessionReply *session_do(int fd, const Moe__SessionRequest *req, int pass_fd)
{
    uint8_t buf[4096], rep[4096];
    size_t n = moe__session_request__pack(req, buf);
    ssize_t got = session_call(fd, buf, n, pass_fd, rep, sizeof(rep));
    Moe__SessionReply *r = moe__session_reply__unpack(NULL, (size_t)got, rep);
    FUZZ_CHECK(r && r->status == 0, "session setup: %s", r ? r->message : "undecodable");
    return r;
}

static int memfd_of(size_t size, bool sealed)
{
    int fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    FUZZ_CHECK(fd >= 0 && ftruncate(fd, (off_t)size) == 0, "memfd");
    if (sealed)
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
    return fd;
}

/* A session with a fixed token and one region with a fixed id. */
static int fixed_session(const char *token, uint64_t region_id, uint8_t **map)
{
    int fd = new_session();
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__OpenSession os = MOE__OPEN_SESSION__INIT;
    os.protocol_version = 1;
    req.body_case = MOE__SESSION_REQUEST__BODY_OPEN;
    req.open = &os;
    Moe__SessionReply *rep = session_do(fd, &req, -1);
    struct session *se = session_by_token(F.s, rep->token.data, rep->token.len);
    FUZZ_CHECK(se != NULL, "the new session's token");
    memcpy(se->token, token, SESSION_TOKEN_BYTES);
    moe__session_reply__free_unpacked(rep, NULL);

    int mfd = memfd_of(FUZZ_REGION_BYTES, true);
    Moe__RegisterRegion rr = MOE__REGISTER_REGION__INIT;
    rr.size = FUZZ_REGION_BYTES;
    req.body_case = MOE__SESSION_REQUEST__BODY_REGISTER_REGION;
    req.register_region = &rr;
    rep = session_do(fd, &req, mfd);
    struct region *r = session_region(se, rep->region);
    FUZZ_CHECK(r != NULL, "the new region");
    r->id = region_id;
    moe__session_reply__free_unpacked(rep, NULL);
    *map = mmap(NULL, FUZZ_REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    FUZZ_CHECK(*map != MAP_FAILED, "mmap");
    close(mfd);
    return fd;
}

/* ---- the server's fixed state -------------------------------------------- */

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static float rndf(uint64_t *s)
{
    return (float)((rnd(s) >> 40) * (1.0 / (1ull << 24)));
}

static void write_weights(void)
{
    enum { E = FUZZ_E, H = FUZZ_H, I = FUZZ_I };
    static uint16_t a[3][E][H * I], g[FUZZ_G * FUZZ_N * FUZZ_K];
    static float b[3][E][H * I];
    static char names[6 * E][64];
    struct st_out t[6 * E + 1];
    uint64_t seed = 0x5eed;
    size_t n = 0;
    static const char *parts[3] = {"w1", "w3", "w2"};
    for (int set = 0; set < 2; set++)
        for (int e = 0; e < E; e++)
            for (int p = 0; p < 3; p++, n++) {
                for (int i = 0; i < H * I; i++) {
                    float v = (rndf(&seed) * 2.0f - 1.0f) * 0.5f;
                    if (set == 0)
                        a[p][e][i] = moek_f32_to_bf16(v);
                    else
                        b[p][e][i] = v;
                }
                snprintf(names[n], sizeof(names[n]), "%c.experts.%d.%s.weight", set ? 'b' : 'a',
                         e, parts[p]);
                t[n] = (struct st_out){.name = names[n], .dtype = set ? ST_F32 : ST_BF16,
                                       .ndim = 2, .shape = {p < 2 ? I : H, p < 2 ? H : I},
                                       .data = set ? (void *)b[p][e] : (void *)a[p][e]};
            }
    for (size_t i = 0; i < ARRAY_SIZE(g); i++)
        g[i] = moek_f32_to_bf16(rndf(&seed) - 0.5f);
    t[n++] = (struct st_out){.name = "g.weight", .dtype = ST_BF16, .ndim = 3,
                             .shape = {FUZZ_G, FUZZ_N, FUZZ_K}, .data = g};
    mkdir(FUZZ_DIR, 0755);
    FUZZ_CHECK(st_write(FUZZ_WEIGHTS, t, n) == 0, "cannot write %s", FUZZ_WEIGHTS);
}

static void fill_pattern(uint8_t *p, uint64_t seed)
{
    for (int i = 0; i < (FUZZ_OFF_I64 - FUZZ_OFF_I32) / 4; i++)
        ((int32_t *)(p + FUZZ_OFF_I32))[i] = i % FUZZ_E;
    for (int i = 0; i < (FUZZ_OFF_F32 - FUZZ_OFF_I64) / 8; i++)
        ((int64_t *)(p + FUZZ_OFF_I64))[i] = i % FUZZ_E;
    for (int i = 0; i < (FUZZ_OFF_BF16 - FUZZ_OFF_F32) / 4; i++)
        ((float *)(p + FUZZ_OFF_F32))[i] = 0.25f + 0.75f * rndf(&seed);
    for (int i = 0; i < (FUZZ_OFF_OUT - FUZZ_OFF_BF16) / 2; i++)
        ((uint16_t *)(p + FUZZ_OFF_BF16))[i] = moek_f32_to_bf16(rndf(&seed) * 2.0f - 1.0f);
    for (int i = FUZZ_OFF_OUT; i < FUZZ_REGION_BYTES; i++)
        p[i] = (uint8_t)rnd(&seed);
}

static bool layer_is_base(const struct layer *l, const struct layer_conf *lc)
{
    char src[600];
    snprintf(src, sizeof(src), "%s:%s", FUZZ_WEIGHTS, lc->prefix);
    return l && l->state == LAYER_READY && l->kind == lc->kind && !strcmp(l->source, src) &&
           (lc->kind == MOE__LAYER_KIND__LAYER_GEMM ||
            (l->routing == lc->routing && l->renormalize == lc->renormalize &&
             l->shape.topk == (int)lc->topk));
}

/* Back to the base layers: what an input loaded goes, what it unloaded (or
 * replaced) comes back. */
static void restore_layers(void)
{
    struct layer *l = F.s->layers;
    while (l) {
        bool keep = false;
        for (size_t i = 0; i < ARRAY_SIZE(F.layers); i++)
            keep |= !strcmp(l->name, F.layers[i].name) && layer_is_base(l, &F.layers[i]);
        if (keep) {
            l = l->next;
            continue;
        }
        FUZZ_CHECK(layer_unload(F.s, l->name) == 0, "unload '%s'", l->name);
        l = F.s->layers; /* l is gone: start over */
    }
    for (size_t i = 0; i < ARRAY_SIZE(F.layers); i++) {
        if (layer_find(F.s, F.layers[i].name))
            continue;
        char err[512];
        int rc = layer_load_conf(F.s, &F.layers[i], false, err, sizeof(err));
        FUZZ_CHECK(rc == 0, "load base layer '%s': %s", F.layers[i].name, err);
    }
    pump_idle();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    log_init(LOG_LEVEL_ERR);
    F.verbose = getenv("MOE_FUZZ_VERBOSE") != NULL;
    FUZZ_CHECK(config_init(&F.cfg) == 0, "config");
    write_weights();
    FUZZ_CHECK(config_add_allowed_dir(&F.cfg, FUZZ_DIR) == 0, "allowed dir");
    /* Small enough that inputs reach the limits and the slicing. */
    F.cfg.max_batch_tokens = 64;
    F.cfg.max_slice_tokens = 16;
    F.cfg.max_request_tokens = 512;
    F.cfg.max_queued_requests = 16;
    F.cfg.max_queued_tokens = 1024;
    F.cfg.max_queued_total = 32;
    F.cfg.max_regions = 4;
    F.cfg.max_session_bytes = 1 << 20;
    F.cfg.max_layers = 8;
    F.cfg.max_loads = 2;
    F.cfg.max_sessions = 8;
    FUZZ_CHECK(backend_cpu_new(1, &F.be) == 0, "backend");
    FUZZ_CHECK(loop_new(&F.loop) == 0, "loop");
    FUZZ_CHECK(server_new(&F.cfg, &F.be, 1, F.loop, &F.s) == 0, "server");

    /* Replies travel as they would: a ROUTER (the server's) and a DEALER. */
    F.zctx = zmq_ctx_new();
    F.router = zmq_socket(F.zctx, ZMQ_ROUTER);
    F.dealer = zmq_socket(F.zctx, ZMQ_DEALER);
    int linger = 0, hwm = 100000;
    zmq_setsockopt(F.router, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(F.dealer, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(F.router, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(F.dealer, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(F.dealer, ZMQ_ROUTING_ID, route_id, 4);
    FUZZ_CHECK(zmq_bind(F.router, "inproc://moed-fuzz") == 0, "bind");
    FUZZ_CHECK(zmq_connect(F.dealer, "inproc://moed-fuzz") == 0, "connect");
    FUZZ_CHECK(zmq_send(F.dealer, "x", 1, 0) == 1, "send");
    char buf[16];
    FUZZ_CHECK(zmq_recv(F.router, buf, sizeof(buf), 0) == 4, "routing id");
    FUZZ_CHECK(zmq_recv(F.router, buf, sizeof(buf), 0) == 1, "first message");
    F.s->zsock = F.router;

    static const struct layer_conf base[4] = {
        {.name = "moe", .kind = MOE__LAYER_KIND__LAYER_MOE, .topk = 2, .renormalize = true,
         .routing = MOE__ROUTING__ROUTING_SOFTMAX, .path = FUZZ_WEIGHTS, .prefix = "a."},
        {.name = "given", .kind = MOE__LAYER_KIND__LAYER_MOE, .topk = 2,
         .routing = MOE__ROUTING__ROUTING_GIVEN, .path = FUZZ_WEIGHTS, .prefix = "a."},
        {.name = "moe32", .kind = MOE__LAYER_KIND__LAYER_MOE, .topk = 1,
         .routing = MOE__ROUTING__ROUTING_SIGMOID, .path = FUZZ_WEIGHTS, .prefix = "b."},
        {.name = "gemm", .kind = MOE__LAYER_KIND__LAYER_GEMM, .path = FUZZ_WEIGHTS,
         .prefix = "g.weight"},
    };
    memcpy(F.layers, base, sizeof(base));
    restore_layers();

    F.peer = fixed_session(FUZZ_TOKEN, FUZZ_REGION, &F.mine);
    F.other_peer = fixed_session(FUZZ_OTHER_TOKEN, FUZZ_OTHER_REGION, &F.other);
    F.pattern = malloc(FUZZ_REGION_BYTES);
    F.other_pattern = malloc(FUZZ_REGION_BYTES);
    FUZZ_CHECK(F.pattern && F.other_pattern, "malloc");
    fill_pattern(F.pattern, 1);
    fill_pattern(F.other_pattern, 2);
    memcpy(F.other, F.other_pattern, FUZZ_REGION_BYTES);
    F.base_sessions = F.s->n_sessions;
    return 0;
}

/* ---- one input ------------------------------------------------------------- */

static size_t put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* Receive `expected` replies; each must decode, and nothing more may come. */
static void collect_replies(unsigned expected)
{
    unsigned got = 0;
    uint64_t t0 = now_us();
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, F.dealer, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            /* ZeroMQ's calls fail with EINTR when libFuzzer's SIGALRM (its
             * -timeout watch) lands in them: look again, to the same end
             * (the replies were sent before this ran). */
            if (zmq_errno() == EINTR)
                continue;
            if (got >= expected)
                break;
            zmq_pollitem_t pi = {F.dealer, 0, ZMQ_POLLIN, 0};
            int n = zmq_poll(&pi, 1, 100);
            FUZZ_CHECK(n >= 0 || zmq_errno() == EINTR, "zmq_poll: %s", zmq_strerror(zmq_errno()));
            FUZZ_CHECK(n > 0 || now_us() - t0 < 2000000, "%u of %u replies", got, expected);
            continue;
        }
        Moe__Reply *rep = moe__reply__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
        FUZZ_CHECK(rep != NULL, "a reply of %zu bytes does not decode", zmq_msg_size(&m));
        if (F.verbose)
            fprintf(stderr, "  reply %llu: status %d %s\n", (unsigned long long)rep->id,
                    rep->status, rep->message ? rep->message : "");
        moe__reply__free_unpacked(rep, NULL);
        zmq_msg_close(&m);
        got++;
        FUZZ_CHECK(got <= expected, "%u replies to %u requests", got, expected);
    }
}

static void run_envelopes(const uint8_t *data, size_t size, int mode)
{
    unsigned sent = 0;
    if (mode == FUZZ_MODE_ENVELOPE) {
        server_handle_message(F.s, route_id, 4, data, size);
        sent = 1;
    } else if (mode == FUZZ_MODE_MULTI) {
        while (size >= 2 && sent < 64) {
            size_t n = (size_t)data[0] | (size_t)data[1] << 8;
            data += 2;
            size -= 2;
            if (n > size)
                n = size;
            server_handle_message(F.s, route_id, 4, data, n);
            sent++;
            data += n;
            size -= n;
        }
    } else {
        /* id 7, the session's token, then body field 9 + mode. */
        uint8_t *buf = malloc(size + 32);
        FUZZ_CHECK(buf != NULL, "malloc");
        size_t n = 0;
        buf[n++] = 0x08;
        buf[n++] = 7;
        buf[n++] = 0x12;
        buf[n++] = SESSION_TOKEN_BYTES;
        memcpy(buf + n, FUZZ_TOKEN, SESSION_TOKEN_BYTES);
        n += SESSION_TOKEN_BYTES;
        n += put_varint(buf + n, (uint64_t)(9 + mode) << 3 | 2);
        n += put_varint(buf + n, size);
        memcpy(buf + n, data, size);
        n += size;
        server_handle_message(F.s, route_id, 4, buf, n);
        free(buf);
        sent = 1;
    }
    pump_idle();
    collect_replies(sent);
}

static int count_fds(void)
{
    int n = 0;
    for (int fd = 0; fd < 1024; fd++)
        n += fcntl(fd, F_GETFD) >= 0;
    return n;
}

static void run_session(const uint8_t *data, size_t size)
{
    int fds_before = count_fds();
    int fd = new_session();
    for (unsigned recs = 0; size >= 2 && recs < 32; recs++) {
        size_t n = data[0];
        uint8_t flags = data[1];
        data += 2;
        size -= 2;
        if (n > size)
            n = size;
        if (n > 0) {
            int mfd = -1;
            if (flags & 1)
                mfd = memfd_of((size_t)4096 << (flags >> 2 & 3), flags & 2);
            uint8_t rep[4096];
            ssize_t got = session_call(fd, data, n, mfd, rep, sizeof(rep));
            Moe__SessionReply *r = moe__session_reply__unpack(NULL, (size_t)got, rep);
            FUZZ_CHECK(r != NULL, "a session reply of %zd bytes does not decode", got);
            if (F.verbose)
                fprintf(stderr, "  session reply: status %d %s\n", r->status,
                        r->message ? r->message : "");
            moe__session_reply__free_unpacked(r, NULL);
            if (mfd >= 0)
                close(mfd);
        }
        data += n;
        size -= n;
    }
    close(fd);
    uint64_t t0 = now_us();
    while (F.s->n_sessions > F.base_sessions) {
        loop_run_once(F.loop, 10);
        FUZZ_CHECK(now_us() - t0 < 5000000, "a closed session stays");
    }
    pump_idle();
    FUZZ_CHECK(count_fds() == fds_before, "%d descriptors open, %d before the session",
               count_fds(), fds_before);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!F.s)
        LLVMFuzzerInitialize(NULL, NULL);
    if (size < 1)
        return 0;
    int mode = data[0] % FUZZ_MODES;
    memcpy(F.mine, F.pattern, FUZZ_REGION_BYTES);
    if (mode == FUZZ_MODE_SESSION)
        run_session(data + 1, size - 1);
    else
        run_envelopes(data + 1, size - 1, mode);
    restore_layers();
    FUZZ_CHECK(memcmp(F.other, F.other_pattern, FUZZ_REGION_BYTES) == 0,
               "another session's region was written");
    FUZZ_CHECK(F.s->queued_total == 0 && F.s->n_sessions == F.base_sessions,
               "%u queued, %u sessions", F.s->queued_total, F.s->n_sessions);
    return 0;
}
