/*
 * gen_corpus.c: writes the fuzz targets' seed corpus (`make fuzz-corpus`):
 * the requests a real client sends (packed with the same protobuf code as
 * libmoe, addressed to the fuzz target's session, region and layers; see
 * fuzz.h), session-socket exchanges, safetensors files as st_write() and
 * checkpoints lay them out, and configuration files.
 *
 *   gen_corpus DIR     writes DIR/request, DIR/safetensors, DIR/config
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/safetensors.h"
#include "moe.pb-c.h"
#include "tests/fuzz/fuzz.h"

static char root[512];
static int written;

static void put(const char *target, const char *name, int mode, const void *data, size_t n)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", root, target);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/%s/%s", root, target, name);
    FILE *f = fopen(path, "wb");
    if (!f || (mode >= 0 && fputc(mode, f) == EOF) || (n && fwrite(data, 1, n, f) != n)) {
        fprintf(stderr, "gen_corpus: cannot write %s: %s\n", path, strerror(errno));
        exit(1);
    }
    fclose(f);
    written++;
}

/* ---- requests ------------------------------------------------------------- */

static Moe__Tensor tensor(uint64_t off, Moe__DType dt, uint64_t *shape, int nd)
{
    Moe__Tensor t = MOE__TENSOR__INIT;
    t.region = FUZZ_REGION;
    t.offset = off;
    t.dtype = dt;
    t.shape = shape;
    t.n_shape = (size_t)nd;
    return t;
}

static uint64_t next_id = 1;

static size_t envelope(Moe__Request *req, uint8_t *buf)
{
    req->id = next_id++;
    if (!req->token.len) {
        req->token.data = (uint8_t *)FUZZ_TOKEN;
        req->token.len = 16;
    }
    return moe__request__pack(req, buf);
}

/* The seed as a whole envelope (mode 0) and as its body alone (its type's
 * mode), where the request has a body. */
static void put_request(const char *name, Moe__Request *req)
{
    uint8_t buf[8192];
    char nm[128];
    size_t n = envelope(req, buf);
    snprintf(nm, sizeof(nm), "env-%s", name);
    put("request", nm, FUZZ_MODE_ENVELOPE, buf, n);
    if (req->body_case == MOE__REQUEST__BODY__NOT_SET)
        return;
    const ProtobufCMessage *body = NULL;
    switch (req->body_case) {
    case MOE__REQUEST__BODY_HELLO: body = &req->hello->base; break;
    case MOE__REQUEST__BODY_LOAD_LAYER: body = &req->load_layer->base; break;
    case MOE__REQUEST__BODY_UNLOAD_LAYER: body = &req->unload_layer->base; break;
    case MOE__REQUEST__BODY_LIST_LAYERS: body = &req->list_layers->base; break;
    case MOE__REQUEST__BODY_FUSED_MOE: body = &req->fused_moe->base; break;
    case MOE__REQUEST__BODY_GROUPED_GEMM: body = &req->grouped_gemm->base; break;
    case MOE__REQUEST__BODY_GET_STATS: body = &req->get_stats->base; break;
    default: return;
    }
    n = protobuf_c_message_pack(body, buf);
    snprintf(nm, sizeof(nm), "body-%s", name);
    put("request", nm, (int)req->body_case - 9, buf, n);
}

/* Several envelopes in one input (mode 9). */
struct multi {
    uint8_t buf[16384];
    size_t n;
};

static void multi_add(struct multi *m, Moe__Request *req)
{
    uint8_t tmp[8192];
    size_t n = envelope(req, tmp);
    m->buf[m->n++] = (uint8_t)n;
    m->buf[m->n++] = (uint8_t)(n >> 8);
    memcpy(m->buf + m->n, tmp, n);
    m->n += n;
}

/* FusedMoe on layer "moe": T tokens, x bf16, logits fp32, out bf16. */
static uint64_t sx[2], sl[2], so[2], sk[2], sw[2];
static Moe__Tensor tx, tl, to, tk, tw;
static Moe__FusedMoe fm;
static Moe__Request fused(const char *layer, uint64_t T)
{
    moe__fused_moe__init(&fm);
    sx[0] = sl[0] = so[0] = T;
    sx[1] = so[1] = FUZZ_H;
    sl[1] = FUZZ_E;
    tx = tensor(FUZZ_OFF_BF16, MOE__DTYPE__DTYPE_BF16, sx, 2);
    tl = tensor(FUZZ_OFF_F32, MOE__DTYPE__DTYPE_FP32, sl, 2);
    to = tensor(FUZZ_OFF_OUT, MOE__DTYPE__DTYPE_BF16, so, 2);
    fm.layer = (char *)layer;
    fm.x = &tx;
    fm.logits = &tl;
    fm.out = &to;
    Moe__Request req = MOE__REQUEST__INIT;
    req.body_case = MOE__REQUEST__BODY_FUSED_MOE;
    req.fused_moe = &fm;
    return req;
}

static Moe__Request given(uint64_t T, uint64_t ids_off, Moe__DType ids_dt)
{
    Moe__Request req = fused("given", T);
    sk[0] = sw[0] = T;
    sk[1] = sw[1] = 2;
    tk = tensor(ids_off, ids_dt, sk, 2);
    tw = tensor(FUZZ_OFF_F32, MOE__DTYPE__DTYPE_FP32, sw, 2);
    fm.logits = NULL;
    fm.topk_ids = &tk;
    fm.topk_weights = &tw;
    return req;
}

static Moe__GroupedGemm gg;
static uint64_t sa[2], sc[2], msz[FUZZ_G];
static Moe__Tensor ta, tc;
static Moe__Request gemm(uint64_t m0, uint64_t m1, uint64_t m2)
{
    moe__grouped_gemm__init(&gg);
    msz[0] = m0;
    msz[1] = m1;
    msz[2] = m2;
    sa[0] = sc[0] = m0 + m1 + m2;
    sa[1] = FUZZ_K;
    sc[1] = FUZZ_N;
    ta = tensor(FUZZ_OFF_BF16, MOE__DTYPE__DTYPE_BF16, sa, 2);
    tc = tensor(FUZZ_OFF_OUT, MOE__DTYPE__DTYPE_BF16, sc, 2);
    gg.layer = "gemm";
    gg.n_m_sizes = FUZZ_G;
    gg.m_sizes = msz;
    gg.a = &ta;
    gg.c = &tc;
    Moe__Request req = MOE__REQUEST__INIT;
    req.body_case = MOE__REQUEST__BODY_GROUPED_GEMM;
    req.grouped_gemm = &gg;
    return req;
}

static Moe__LoadLayer ll;
static uint64_t s3[3];
static Moe__Tensor t1, t3, t2;
static Moe__Request load_path(const char *name, int kind, const char *prefix)
{
    moe__load_layer__init(&ll);
    ll.name = (char *)name;
    ll.kind = kind;
    ll.topk = kind == MOE__LAYER_KIND__LAYER_MOE ? 2 : 0;
    ll.path = FUZZ_WEIGHTS;
    ll.prefix = (char *)prefix;
    Moe__Request req = MOE__REQUEST__INIT;
    req.body_case = MOE__REQUEST__BODY_LOAD_LAYER;
    req.load_layer = &ll;
    return req;
}

static Moe__Request load_upload(const char *name, bool moe)
{
    moe__load_layer__init(&ll);
    ll.name = (char *)name;
    ll.kind = moe ? MOE__LAYER_KIND__LAYER_MOE : MOE__LAYER_KIND__LAYER_GEMM;
    ll.dtype = MOE__DTYPE__DTYPE_BF16;
    s3[0] = 2;
    s3[1] = s3[2] = 4;
    if (moe) {
        ll.experts = 2;
        ll.topk = 1;
        ll.hidden = ll.intermediate = 4;
    } else {
        ll.groups = 2;
        ll.n = ll.k = 4;
    }
    t1 = tensor(FUZZ_OFF_BF16, MOE__DTYPE__DTYPE_BF16, s3, 3);
    t3 = tensor(FUZZ_OFF_BF16 + 64, MOE__DTYPE__DTYPE_BF16, s3, 3);
    t2 = tensor(FUZZ_OFF_BF16 + 128, MOE__DTYPE__DTYPE_BF16, s3, 3);
    ll.w1 = &t1;
    if (moe) {
        ll.w3 = &t3;
        ll.w2 = &t2;
    }
    Moe__Request req = MOE__REQUEST__INIT;
    req.body_case = MOE__REQUEST__BODY_LOAD_LAYER;
    req.load_layer = &ll;
    return req;
}

static Moe__UnloadLayer ul;
static Moe__Request unload(const char *name)
{
    moe__unload_layer__init(&ul);
    ul.name = (char *)name;
    Moe__Request req = MOE__REQUEST__INIT;
    req.body_case = MOE__REQUEST__BODY_UNLOAD_LAYER;
    req.unload_layer = &ul;
    return req;
}

static Moe__Hello hh;
static Moe__Request hello(uint32_t version)
{
    moe__hello__init(&hh);
    hh.protocol_version = version;
    Moe__Request req = MOE__REQUEST__INIT;
    req.body_case = MOE__REQUEST__BODY_HELLO;
    req.hello = &hh;
    return req;
}

static void requests(void)
{
    Moe__Request r;
    r = hello(1);
    put_request("hello", &r);
    r = hello(99);
    put_request("hello-v99", &r);
    Moe__ListLayers lst = MOE__LIST_LAYERS__INIT;
    r = (Moe__Request)MOE__REQUEST__INIT;
    r.body_case = MOE__REQUEST__BODY_LIST_LAYERS;
    r.list_layers = &lst;
    put_request("list", &r);
    Moe__GetStats gs = MOE__GET_STATS__INIT;
    r = (Moe__Request)MOE__REQUEST__INIT;
    r.body_case = MOE__REQUEST__BODY_GET_STATS;
    r.get_stats = &gs;
    put_request("stats", &r);
    r = (Moe__Request)MOE__REQUEST__INIT;
    put_request("empty", &r);

    r = fused("moe", 3);
    put_request("fused", &r);
    r = fused("moe", 3);
    tl = tensor(FUZZ_OFF_BF16 + 0x400, MOE__DTYPE__DTYPE_BF16, sl, 2);
    put_request("fused-bf16-logits", &r);
    r = fused("moe", 100);
    put_request("fused-long", &r);
    r = fused("moe", 2);
    r.timeout_us = 1;
    put_request("fused-timeout", &r);
    r = fused("moe", 2);
    r.no_batch = 1;
    put_request("fused-nobatch", &r);
    r = fused("moe", 3);
    r.token.data = (uint8_t *)FUZZ_OTHER_TOKEN;
    r.token.len = 16;
    put_request("fused-other-token", &r);
    r = fused("moe", 3);
    to.region = FUZZ_OTHER_REGION;
    put_request("fused-other-region", &r);
    r = fused("moe32", 5);
    tx = tensor(FUZZ_OFF_F32, MOE__DTYPE__DTYPE_FP32, sx, 2);
    tl = tensor(FUZZ_OFF_F32 + 0x200, MOE__DTYPE__DTYPE_FP32, sl, 2);
    to = tensor(FUZZ_OFF_OUT, MOE__DTYPE__DTYPE_FP32, so, 2);
    put_request("fused-fp32-sigmoid", &r);
    r = given(3, FUZZ_OFF_I32, MOE__DTYPE__DTYPE_INT32);
    put_request("given-i32", &r);
    r = given(3, FUZZ_OFF_I64, MOE__DTYPE__DTYPE_INT64);
    put_request("given-i64", &r);
    r = given(3, FUZZ_OFF_OUT, MOE__DTYPE__DTYPE_INT32);
    put_request("given-bad-ids", &r);

    r = gemm(1, 0, 2);
    put_request("gemm", &r);
    r = gemm(0, 0, 0);
    put_request("gemm-empty", &r);

    r = load_path("x1", MOE__LAYER_KIND__LAYER_MOE, "a.");
    put_request("load-file", &r);
    r = load_path("x2", MOE__LAYER_KIND__LAYER_GEMM, "g.weight");
    put_request("load-file-gemm", &r);
    r = load_path("x3", MOE__LAYER_KIND__LAYER_MOE, "a.");
    ll.path = "/etc/passwd";
    put_request("load-outside", &r);
    r = load_upload("up", true);
    put_request("load-upload", &r);
    r = load_upload("upg", false);
    put_request("load-upload-gemm", &r);
    r = unload("moe");
    put_request("unload", &r);
    r = unload("nope");
    put_request("unload-missing", &r);

    struct multi m = {0};
    r = fused("moe", 100);
    multi_add(&m, &r);
    r = fused("moe", 3);
    multi_add(&m, &r);
    r = given(3, FUZZ_OFF_I32, MOE__DTYPE__DTYPE_INT32);
    multi_add(&m, &r);
    r = gemm(2, 1, 0);
    multi_add(&m, &r);
    r = hello(1);
    multi_add(&m, &r);
    put("request", "multi-batch", FUZZ_MODE_MULTI, m.buf, m.n);

    m.n = 0;
    r = fused("moe", 200);
    multi_add(&m, &r);
    r = fused("moe", 2);
    multi_add(&m, &r);
    r = unload("moe");
    multi_add(&m, &r);
    r = fused("moe", 2);
    multi_add(&m, &r);
    put("request", "multi-unload-while-running", FUZZ_MODE_MULTI, m.buf, m.n);

    m.n = 0;
    r = fused("moe", 100);
    multi_add(&m, &r);
    for (int i = 0; i < 4; i++) {
        r = fused("moe", 1);
        r.timeout_us = 1;
        multi_add(&m, &r);
    }
    put("request", "multi-expire", FUZZ_MODE_MULTI, m.buf, m.n);

    m.n = 0;
    for (int i = 0; i < 20; i++) {
        r = fused("moe", 4);
        multi_add(&m, &r);
    }
    put("request", "multi-queue-full", FUZZ_MODE_MULTI, m.buf, m.n);

    m.n = 0;
    r = load_upload("up", true);
    multi_add(&m, &r);
    r = fused("up", 2);
    multi_add(&m, &r);
    r = unload("up");
    multi_add(&m, &r);
    r = load_path("x1", MOE__LAYER_KIND__LAYER_MOE, "a.");
    multi_add(&m, &r);
    r = load_path("x2", MOE__LAYER_KIND__LAYER_MOE, "a.");
    multi_add(&m, &r);
    put("request", "multi-loads", FUZZ_MODE_MULTI, m.buf, m.n);
}

/* ---- session messages ------------------------------------------------------ */

struct recs {
    uint8_t buf[4096];
    size_t n;
};

static void rec_add(struct recs *r, const Moe__SessionRequest *req, int flags)
{
    uint8_t tmp[1024];
    size_t n = moe__session_request__pack(req, tmp);
    r->buf[r->n++] = (uint8_t)n;
    r->buf[r->n++] = (uint8_t)flags;
    memcpy(r->buf + r->n, tmp, n);
    r->n += n;
}

static void sessions(void)
{
    Moe__SessionRequest open = MOE__SESSION_REQUEST__INIT, reg = MOE__SESSION_REQUEST__INIT,
                        unreg = MOE__SESSION_REQUEST__INIT;
    Moe__OpenSession os = MOE__OPEN_SESSION__INIT;
    Moe__RegisterRegion rr = MOE__REGISTER_REGION__INIT;
    Moe__UnregisterRegion ur = MOE__UNREGISTER_REGION__INIT;
    os.protocol_version = 1;
    os.client_name = "fuzz";
    open.body_case = MOE__SESSION_REQUEST__BODY_OPEN;
    open.open = &os;
    rr.size = 4096;
    rr.name = "r";
    reg.body_case = MOE__SESSION_REQUEST__BODY_REGISTER_REGION;
    reg.register_region = &rr;
    ur.region = 12345;
    unreg.body_case = MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION;
    unreg.unregister_region = &ur;
    enum { FD = 1, SEALED = 2, X2 = 4 };

    struct recs r = {0};
    rec_add(&r, &open, 0);
    rec_add(&r, &reg, FD | SEALED);
    rec_add(&r, &unreg, 0);
    rec_add(&r, &reg, FD | SEALED);
    put("request", "session-open-register", FUZZ_MODE_SESSION, r.buf, r.n);

    r.n = 0;
    rec_add(&r, &reg, FD | SEALED);
    rec_add(&r, &open, 0);
    rec_add(&r, &open, 0);
    put("request", "session-register-first", FUZZ_MODE_SESSION, r.buf, r.n);

    r.n = 0;
    rec_add(&r, &open, 0);
    rec_add(&r, &reg, FD);
    rec_add(&r, &reg, FD | SEALED | X2);
    rec_add(&r, &reg, 0);
    put("request", "session-bad-regions", FUZZ_MODE_SESSION, r.buf, r.n);

    r.n = 0;
    rec_add(&r, &open, 0);
    for (int i = 0; i < 6; i++)
        rec_add(&r, &reg, FD | SEALED);
    put("request", "session-region-quota", FUZZ_MODE_SESSION, r.buf, r.n);
}

/* ---- safetensors ------------------------------------------------------------ */

static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)len + 2);
    if (buf && fread(buf + 1, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *n = (size_t)len;
    return buf;
}

/* File seeds: [option byte][file] in modes 1 (MoE) and 2 (GEMM); header
 * seeds in mode 0: [data size, 2 bytes][JSON]. */
static void st_seed(const char *name, int mode, int opt, const struct st_out *t, size_t n)
{
    char tmp[] = "/tmp/moed-gen-corpus.XXXXXX";
    int fd = mkstemp(tmp);
    if (fd < 0 || st_write(tmp, t, n) != 0) {
        fprintf(stderr, "gen_corpus: cannot write a safetensors file\n");
        exit(1);
    }
    close(fd);
    size_t len;
    uint8_t *buf = slurp(tmp, &len);
    unlink(tmp);
    if (!buf)
        exit(1);
    buf[0] = (uint8_t)opt;
    char nm[128];
    snprintf(nm, sizeof(nm), "file-%s", name);
    put("safetensors", nm, mode, buf, len + 1);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[1 + i];
    uint64_t data = len - 8 - hlen;
    uint8_t *h = buf + 1 + 8 - 2;
    h[0] = (uint8_t)data;
    h[1] = (uint8_t)(data >> 8);
    snprintf(nm, sizeof(nm), "header-%s", name);
    put("safetensors", nm, 0, h, (size_t)hlen + 2);
    free(buf);
}

static void safetensors(void)
{
    static uint8_t data[4096];
    for (size_t i = 0; i < sizeof(data); i++)
        data[i] = (uint8_t)(i * 37 + 11) & 0x3f; /* small finite values */
    struct st_out t[8];
    char names[8][64];
    static const char *mix[3] = {"w1", "w3", "w2"}, *qwen[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int scheme = 0; scheme < 2; scheme++) {
        size_t n = 0;
        for (int e = 0; e < 2; e++)
            for (int p = 0; p < 3; p++, n++) {
                snprintf(names[n], sizeof(names[n]), "%sexperts.%d.%s.weight", scheme ? "p." : "",
                         e, scheme ? qwen[p] : mix[p]);
                t[n] = (struct st_out){.name = names[n], .dtype = scheme ? ST_F16 : ST_BF16,
                                       .ndim = 2, .shape = {p < 2 ? 8 : 4, p < 2 ? 4 : 8},
                                       .data = data};
            }
        st_seed(scheme ? "qwen-f16" : "mixtral-bf16", 1, scheme ? 8 : 0, t, n);
        if (!scheme) {
            st_seed("mixtral-declared", 1, 4, t, n);
            st_seed("mixtral-to-fp32", 1, 3, t, n);
        }
    }
    t[0] = (struct st_out){.name = "B", .dtype = ST_F32, .ndim = 3, .shape = {2, 4, 8},
                           .data = data};
    t[1] = (struct st_out){.name = "other", .dtype = ST_I64, .ndim = 1, .shape = {3},
                           .data = data};
    st_seed("gemm-f32", 2, 0, t, 2);
    st_seed("gemm-f32-as-bf16", 2, 1 | 4, t, 1);
}

/* ---- configuration ------------------------------------------------------------ */

static void configs(void)
{
    static const char *full =
        "; moed.conf\n"
        "[daemon]\n"
        "runtime_dir = /run/moed\n"
        "allowed_dirs = /tmp:/\n"
        "backend = auto\n"
        "cpu_threads = 4\n"
        "log_level = debug\n"
        "\n[batch]\n"
        "max_batch_tokens = 4096\n"
        "max_delay_us = 200\n"
        "max_request_tokens = 65536\n"
        "max_slice_tokens = 1024\n"
        "batching = true\n"
        "\n[limits]\n"
        "max_sessions = 256\n"
        "max_regions = 64\n"
        "max_region_bytes = 17179869184\n"
        "max_session_bytes = 0x1000000000\n"
        "max_queued_requests = 256\n"
        "max_queued_tokens = 65536\n"
        "max_queued_total = 4096\n"
        "max_message_bytes = 1048576\n"
        "max_pending_messages = 1024\n"
        "max_layers = 256\n"
        "max_loads = 8\n"
        "\n[layer mixtral0]\n"
        "kind = moe\n"
        "file = /var/lib/moed/weights/model.safetensors\n"
        "prefix = model.layers.0.block_sparse_moe.\n"
        "experts = 8\ntopk = 2\nhidden = 4096\nintermediate = 14336\n"
        "dtype = bf16\nrouting = softmax\nrenormalize = true\n"
        "\n[layer \"gemm\"]\n"
        "kind = gemm\nfile = /srv/b.safetensors\nprefix = B\ngroups = 8\nn = 512\nk = 256\n";
    put("config", "full.conf", -1, full, strlen(full));
    static const char *small = "[batch]\nbatching = off\n[limits]\nmax_sessions=1\n";
    put("config", "small.conf", -1, small, strlen(small));
    static const char *bad[] = {
        "[limits]\nmax_sessions = 0\n",
        "[limits]\nmax_message_bytes = 18446744073709551616\n",
        "[daemon]\nruntime_dir = relative\n",
        "[nope]\nx = 1\n",
        "[daemon]\nunknown = 1\n",
        "[layer bad name!]\nfile = /x\n",
        "[layer nofile]\nkind = moe\n",
        "no section = 1\n",
        "[daemon\n",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char nm[32];
        snprintf(nm, sizeof(nm), "bad-%zu.conf", i);
        put("config", nm, -1, bad[i], strlen(bad[i]));
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_corpus DIR\n");
        return 2;
    }
    snprintf(root, sizeof(root), "%s", argv[1]);
    mkdir(root, 0755);
    requests();
    sessions();
    safetensors();
    configs();
    printf("gen_corpus: %d seeds in %s\n", written, root);
    return 0;
}
