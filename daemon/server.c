/*
 * server.c: the request socket. A ZeroMQ ROUTER on ipc://<runtime>/moed.zmq
 * receives [routing id][Request]; each Request is decoded, its token matched
 * to a session, and either answered at once (Hello, ListLayers, Stats,
 * UnloadLayer), handed to the loader (LoadLayer) or validated into a request
 * for the batcher (FusedMoe, GroupedGemm). Every failure is answered with a
 * status and a message; nothing a client sends can stop the loop. Requests
 * that come on a session's reply socket (session.c reads them) take the
 * same path with a route that names that socket (route_for_session).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/stat.h>
#include <zmq.h>

#include "daemon/fdguard.h"
#include "daemon/log.h"
#include "daemon/loop.h"
#include "daemon/server.h"
#include "daemon/util.h"
#include "moe.pb-c.h"
#include "proto/status.h"

#define PROTOCOL_VERSION 1

void route_for_session(uint64_t session_id, uint8_t rid[SOCKET_ROUTE_LEN])
{
    rid[0] = 0;
    rid[1] = 'S';
    memcpy(rid + 2, &session_id, sizeof(session_id));
}

bool route_session(const uint8_t *rid, size_t rlen, uint64_t *session_id)
{
    if (rlen != SOCKET_ROUTE_LEN || rid[0] != 0 || rid[1] != 'S')
        return false;
    if (session_id)
        memcpy(session_id, rid + 2, sizeof(*session_id));
    return true;
}

void server_reply(struct server *s, const uint8_t *route_id, size_t route_len, void *reply)
{
    Moe__Reply *rep = reply;
    uint64_t sid;
    if (route_session(route_id, route_len, &sid)) {
        session_send_reply(s, sid, reply);
        return;
    }
    size_t n = moe__reply__get_packed_size(rep);
    zmq_msg_t msg;
    if (zmq_msg_init_size(&msg, n) != 0)
        return;
    moe__reply__pack(rep, zmq_msg_data(&msg));
    s->zmq_dirty = true; /* see server_drain */
    /* Unroutable (the client is gone) or over its high-water mark (it does
     * not read): ROUTER drops the reply, which is all that can be done. A
     * signal that lands while ZeroMQ reads its command pipe fails the call
     * with EINTR having queued nothing: send again, or the client would
     * wait for a reply that was never sent (and a body left unsent would
     * take the next reply's routing id for its own). moed blocks the
     * signals it handles; a program that embeds the server (the fuzz
     * target under libFuzzer's SIGALRM) may not. */
    int rc;
    do
        rc = zmq_send(s->zsock, route_id, route_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    while (rc < 0 && zmq_errno() == EINTR);
    if (rc >= 0)
        do
            rc = zmq_msg_send(&msg, s->zsock, ZMQ_DONTWAIT);
        while (rc < 0 && zmq_errno() == EINTR);
    if (rc < 0) {
        log_debug("reply %llu not sent: %s", (unsigned long long)rep->id, zmq_strerror(zmq_errno()));
        zmq_msg_close(&msg);
    }
}

void server_reply_session(struct server *s, uint64_t session_id, const uint8_t *route_id,
                          size_t route_len, void *reply)
{
    if (route_session(route_id, route_len, NULL)) {
        server_reply(s, route_id, route_len, reply); /* it came on the reply socket */
        return;
    }
    struct session *se = session_by_id(s, session_id);
    int rc = se ? session_push_reply(se, reply) : -ENOTCONN;
    if (rc == 0)
        return;
    if (rc != -ENOTCONN)
        log_debug("session %llu: reply %llu on the request socket (%s)",
                  (unsigned long long)session_id,
                  (unsigned long long)((Moe__Reply *)reply)->id, strerror(-rc));
    server_reply(s, route_id, route_len, reply);
}

void server_reply_error(struct server *s, const uint8_t *route_id, size_t route_len,
                        uint64_t id, int err, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    Moe__Reply rep = MOE__REPLY__INIT;
    rep.id = id;
    rep.status = status_from_errno(err);
    rep.message = msg;
    s->stats.errors++;
    server_reply(s, route_id, route_len, &rep);
}

static void handle_hello(struct server *s, const uint8_t *rid, size_t rlen, const Moe__Request *m)
{
    Moe__Reply rep = MOE__REPLY__INIT;
    Moe__HelloReply hr = MOE__HELLO_REPLY__INIT;
    struct backend_device devs[16];
    Moe__DeviceInfo di[16], *dip[16];
    static char *caps[] = {"fused_moe", "grouped_gemm", "routing_softmax", "routing_sigmoid",
                           "routing_given", "load_file", "load_upload", "dtype_bf16",
                           "dtype_fp16", "dtype_fp32"};
    if (m->hello->protocol_version != PROTOCOL_VERSION) {
        server_reply_error(s, rid, rlen, m->id, -ENOTSUP,
                           "protocol version %u is not supported (this daemon speaks %u)",
                           m->hello->protocol_version, PROTOCOL_VERSION);
        return;
    }
    int nd = 0;
    for (int b = 0; b < s->n_backends && nd < 16; b++) {
        int got = s->backends[b]->ops->devices(s->backends[b], devs + nd, 16 - nd);
        nd += got > 0 ? got : 0;
    }
    for (int i = 0; i < nd; i++) {
        moe__device_info__init(&di[i]);
        di[i].name = devs[i].name;
        di[i].memory_bytes = devs[i].memory_bytes;
        di[i].compute_units = devs[i].compute_units;
        dip[i] = &di[i];
    }
    hr.protocol_version = PROTOCOL_VERSION;
    hr.server_version = (char *)MOE_VERSION;
    hr.backend = (char *)s->backend->name;
    hr.n_devices = nd > 0 ? (size_t)nd : 0;
    hr.devices = dip;
    hr.n_capabilities = ARRAY_SIZE(caps);
    hr.capabilities = caps;
    hr.max_message_bytes = s->cfg->max_message_bytes;
    hr.max_batch_tokens = s->cfg->max_batch_tokens;
    rep.id = m->id;
    rep.body_case = MOE__REPLY__BODY_HELLO;
    rep.hello = &hr;
    server_reply(s, rid, rlen, &rep);
}

static void handle_list(struct server *s, const uint8_t *rid, size_t rlen, const Moe__Request *m)
{
    size_t n = 0;
    for (struct layer *l = s->layers; l; l = l->next)
        n += l->state == LAYER_READY;
    Moe__LayerInfo *infos = calloc(n ? n : 1, sizeof(*infos));
    Moe__LayerInfo **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
    if (!infos || !ptrs) {
        free(infos);
        free(ptrs);
        server_reply_error(s, rid, rlen, m->id, -ENOMEM, "out of memory");
        return;
    }
    size_t i = 0;
    for (struct layer *l = s->layers; l; l = l->next)
        if (l->state == LAYER_READY) {
            wire_layer_info(l, &infos[i]);
            ptrs[i] = &infos[i];
            i++;
        }
    Moe__LayerList list = MOE__LAYER_LIST__INIT;
    list.n_layers = n;
    list.layers = ptrs;
    Moe__Reply rep = MOE__REPLY__INIT;
    rep.id = m->id;
    rep.body_case = MOE__REPLY__BODY_LAYERS;
    rep.layers = &list;
    server_reply(s, rid, rlen, &rep);
    free(infos);
    free(ptrs);
}

static size_t fill_hist(const struct hist *h, Moe__HistogramBucket *b, Moe__HistogramBucket **p)
{
    size_t n = 0;
    for (int i = 0; i < HIST_BUCKETS; i++) {
        if (!h->buckets[i])
            continue;
        moe__histogram_bucket__init(&b[n]);
        b[n].le = hist_bucket_le(i);
        b[n].count = h->buckets[i];
        p[n] = &b[n];
        n++;
    }
    return n;
}

static void handle_stats(struct server *s, const uint8_t *rid, size_t rlen, const Moe__Request *m)
{
    struct stats *st = &s->stats;
    Moe__StatsReply sr = MOE__STATS_REPLY__INIT;
    Moe__HistogramBucket hb1[HIST_BUCKETS], hb2[HIST_BUCKETS], *hp1[HIST_BUCKETS], *hp2[HIST_BUCKETS];
    sr.uptime_us = now_us() - st->start_us;
    sr.requests = st->requests;
    sr.errors = st->errors;
    sr.busy = st->busy;
    sr.expired = st->expired;
    sr.batches = st->batches;
    sr.tokens = st->tokens;
    sr.sessions = s->n_sessions;
    for (struct session *se = s->sessions; se; se = se->next) {
        sr.regions += se->n_regions + se->n_retired;
        sr.region_bytes += se->region_bytes + se->retired_bytes;
    }
    sr.queue_depth = s->queued_total;
    sr.queue_wait_p50_us = ring_quantile(&st->queue_wait_us, 0.5);
    sr.queue_wait_p99_us = ring_quantile(&st->queue_wait_us, 0.99);
    sr.compute_p50_us = ring_quantile(&st->compute_us, 0.5);
    sr.compute_p99_us = ring_quantile(&st->compute_us, 0.99);
    sr.compute_us_total = st->compute_us_total;
    sr.idle_p50_us = ring_quantile(&st->idle_us, 0.5);
    sr.idle_p99_us = ring_quantile(&st->idle_us, 0.99);
    sr.notice_p50_us = ring_quantile(&st->notice_us, 0.5);
    sr.reply_p50_us = ring_quantile(&st->reply_us, 0.5);
    sr.return_p50_us = ring_quantile(&st->return_us, 0.5);
    sr.launch_p50_us = ring_quantile(&st->launch_us, 0.5);
    sr.n_batch_requests = fill_hist(&st->batch_requests, hb1, hp1);
    sr.batch_requests = hp1;
    sr.n_batch_tokens = fill_hist(&st->batch_tokens, hb2, hp2);
    sr.batch_tokens = hp2;
    sr.backend = (char *)s->backend->name;
    size_t n = 0;
    for (struct layer *l = s->layers; l; l = l->next)
        n += l->state == LAYER_READY;
    Moe__LayerInfo *infos = calloc(n ? n : 1, sizeof(*infos));
    Moe__LayerInfo **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
    if (infos && ptrs) {
        size_t i = 0;
        for (struct layer *l = s->layers; l; l = l->next)
            if (l->state == LAYER_READY) {
                wire_layer_info(l, &infos[i]);
                ptrs[i] = &infos[i];
                i++;
            }
        sr.n_layers = n;
        sr.layers = ptrs;
    }
    Moe__Reply rep = MOE__REPLY__INIT;
    rep.id = m->id;
    rep.body_case = MOE__REPLY__BODY_STATS;
    rep.stats = &sr;
    server_reply(s, rid, rlen, &rep);
    free(infos);
    free(ptrs);
}

/* Check a tensor's dtype and 2-D shape [d0, d1]. */
static int expect_2d(const struct tensor_ref *t, const char *what, int dtype_a, int dtype_b,
                     uint64_t d0, uint64_t d1, char *err, size_t errlen)
{
    if (t->dtype != dtype_a && t->dtype != dtype_b) {
        snprintf(err, errlen, "%s: dtype %s, expected %s%s%s", what, wire_dtype_name(t->dtype),
                 wire_dtype_name(dtype_a), dtype_b != dtype_a ? " or " : "",
                 dtype_b != dtype_a ? wire_dtype_name(dtype_b) : "");
        return -EINVAL;
    }
    if (t->ndim != 2 || t->shape[0] != d0 || t->shape[1] != d1) {
        char got[96] = "";
        size_t o = 0;
        for (int i = 0; i < t->ndim; i++)
            o += (size_t)snprintf(got + o, sizeof(got) - o, "%s%llu", i ? ", " : "",
                                  (unsigned long long)t->shape[i]);
        snprintf(err, errlen, "%s: shape [%s], expected [%llu, %llu]", what, got,
                 (unsigned long long)d0, (unsigned long long)d1);
        return -EINVAL;
    }
    return 0;
}

static struct layer *compute_layer(struct server *s, const char *name, int kind, char *err,
                                   size_t errlen, int *rc)
{
    struct layer *l = name ? layer_find(s, name) : NULL;
    if (!l) {
        snprintf(err, errlen, "no layer named '%s'", name ? name : "");
        *rc = -ENOENT;
    } else if (l->state != LAYER_READY) {
        snprintf(err, errlen, "layer '%s' is still loading", name);
        *rc = -EBUSY;
    } else if (l->kind != kind) {
        snprintf(err, errlen, "layer '%s' is a %s layer", name,
                 l->kind == MOE__LAYER_KIND__LAYER_MOE ? "MoE" : "GEMM");
        *rc = -EINVAL;
    } else {
        return l;
    }
    return NULL;
}

static int build_fused(struct server *s, struct session *se, const Moe__FusedMoe *m,
                       struct request *req, char *err, size_t errlen)
{
    int rc = 0;
    struct layer *l = compute_layer(s, m->layer, MOE__LAYER_KIND__LAYER_MOE, err, errlen, &rc);
    if (!l)
        return rc;
    req->layer = layer_ref(l);
    req->kind = REQ_FUSED_MOE;
    if ((rc = wire_tensor(se, m->x, "x", &req->x, err, errlen)))
        return rc;
    if (req->x.ndim != 2) {
        snprintf(err, errlen, "x must be [tokens, hidden] (2 dimensions), not %d", req->x.ndim);
        return -EINVAL;
    }
    uint64_t T = req->x.shape[0];
    if (T < 1 || T > s->cfg->max_request_tokens) {
        snprintf(err, errlen, "x: %llu tokens (1 to %u per request)", (unsigned long long)T,
                 s->cfg->max_request_tokens);
        return -EINVAL;
    }
    req->tokens = (int)T;
    uint64_t H = (uint64_t)l->shape.hidden, E = (uint64_t)l->shape.experts,
             k = (uint64_t)l->shape.topk;
    if ((rc = expect_2d(&req->x, "x", l->wire_dtype, l->wire_dtype, T, H, err, errlen)))
        return rc;
    if ((rc = wire_tensor(se, m->out, "out", &req->out, err, errlen)) ||
        (rc = expect_2d(&req->out, "out", l->wire_dtype, l->wire_dtype, T, H, err, errlen)))
        return rc;
    if (l->routing == MOE__ROUTING__ROUTING_GIVEN) {
        if (m->logits) {
            snprintf(err, errlen, "layer '%s' takes given top-k ids and weights, not logits", l->name);
            return -EINVAL;
        }
        if ((rc = wire_tensor(se, m->topk_ids, "topk_ids", &req->ids, err, errlen)) ||
            (rc = expect_2d(&req->ids, "topk_ids", MOE__DTYPE__DTYPE_INT32,
                            MOE__DTYPE__DTYPE_INT64, T, k, err, errlen)) ||
            (rc = wire_tensor(se, m->topk_weights, "topk_weights", &req->weights, err, errlen)) ||
            (rc = expect_2d(&req->weights, "topk_weights", MOE__DTYPE__DTYPE_FP32,
                            MOE__DTYPE__DTYPE_FP32, T, k, err, errlen)))
            return rc;
    } else {
        if (m->topk_ids || m->topk_weights) {
            snprintf(err, errlen, "layer '%s' routes from logits; topk_ids/topk_weights not accepted",
                     l->name);
            return -EINVAL;
        }
        if ((rc = wire_tensor(se, m->logits, "logits", &req->logits, err, errlen)) ||
            (rc = expect_2d(&req->logits, "logits", MOE__DTYPE__DTYPE_FP32, l->wire_dtype, T, E,
                            err, errlen)))
            return rc;
    }
    return 0;
}

static int build_gemm(struct server *s, struct session *se, const Moe__GroupedGemm *m,
                      struct request *req, char *err, size_t errlen)
{
    int rc = 0;
    struct layer *l = compute_layer(s, m->layer, MOE__LAYER_KIND__LAYER_GEMM, err, errlen, &rc);
    if (!l)
        return rc;
    req->layer = layer_ref(l);
    req->kind = REQ_GROUPED_GEMM;
    if (m->n_m_sizes != l->groups) {
        snprintf(err, errlen, "m_sizes has %zu entries; layer '%s' has %u groups", m->n_m_sizes,
                 l->name, l->groups);
        return -EINVAL;
    }
    uint64_t M = 0;
    req->m_sizes = malloc(l->groups * sizeof(int64_t));
    if (!req->m_sizes)
        return -ENOMEM;
    for (size_t g = 0; g < m->n_m_sizes; g++) {
        if (!add_u64(M, m->m_sizes[g], &M) || M > s->cfg->max_request_tokens) {
            snprintf(err, errlen, "m_sizes sum to more than %u rows", s->cfg->max_request_tokens);
            return -EINVAL;
        }
        req->m_sizes[g] = (int64_t)m->m_sizes[g];
    }
    req->tokens = (int)M;
    if ((rc = wire_tensor(se, m->a, "a", &req->a, err, errlen)) ||
        (rc = expect_2d(&req->a, "a", l->wire_dtype, l->wire_dtype, M, l->k, err, errlen)) ||
        (rc = wire_tensor(se, m->c, "c", &req->c, err, errlen)) ||
        (rc = expect_2d(&req->c, "c", l->wire_dtype, l->wire_dtype, M, l->n, err, errlen)))
        return rc;
    return 0;
}

static void handle_compute(struct server *s, struct session *se, const uint8_t *rid,
                           size_t rlen, const Moe__Request *m, uint64_t arrival)
{
    char err[512] = "";
    struct request *req = calloc(1, sizeof(*req));
    if (!req) {
        server_reply_error(s, rid, rlen, m->id, -ENOMEM, "out of memory");
        return;
    }
    req->session_id = se->id;
    memcpy(req->route_id, rid, rlen);
    req->route_len = rlen;
    req->id = m->id;
    req->arrival_us = arrival;
    /* A timeout too large to add is no deadline at all. */
    if (!m->timeout_us || !add_u64(arrival, m->timeout_us, &req->deadline_us))
        req->deadline_us = 0;
    req->no_batch = m->no_batch;
    int rc = m->body_case == MOE__REQUEST__BODY_FUSED_MOE
                 ? build_fused(s, se, m->fused_moe, req, err, sizeof(err))
                 : build_gemm(s, se, m->grouped_gemm, req, err, sizeof(err));
    if (rc) {
        server_reply_error(s, rid, rlen, m->id, rc, "%s", err[0] ? err : status_strerror(rc));
        layer_unref(s, &req->layer);
        request_free(req);
        return;
    }
    batch_enqueue(s, req);
}

int server_handle_message(struct server *s, const uint8_t *rid, size_t rlen,
                          const uint8_t *data, size_t len)
{
    uint64_t arrival = now_us();
    uint64_t sid;
    const bool on_socket = route_session(rid, rlen, &sid);
    int rc = 0;
    Moe__Request *m = moe__request__unpack(NULL, len, data);
    if (!m) {
        if (on_socket)
            return -EPROTO; /* never answered there: see server.h */
        server_reply_error(s, rid, rlen, 0, -EPROTO,
                           "request of %zu bytes could not be decoded as moe.Request", len);
        return 0;
    }
    /* On a reply socket the session is known: its token is checked, not
     * searched for (a walk of every session per request). */
    struct session *se = on_socket ? session_by_id(s, sid)
                                   : session_by_token(s, m->token.data, m->token.len);
    if (on_socket && (!se || !session_token_ok(se, m->token.data, m->token.len))) {
        rc = -EACCES;
        goto out;
    }
    if (s->draining) {
        /* Decoded first, so the refusal carries the request's id. */
        server_reply_error(s, rid, rlen, m->id, -ECANCELED, "daemon is shutting down");
        goto out;
    }
    if (!se) {
        server_reply_error(s, rid, rlen, m->id, -EACCES,
                           "unknown or missing session token: open a session first");
        goto out;
    }
    switch (m->body_case) {
    case MOE__REQUEST__BODY_HELLO:
        handle_hello(s, rid, rlen, m);
        break;
    case MOE__REQUEST__BODY_LIST_LAYERS:
        handle_list(s, rid, rlen, m);
        break;
    case MOE__REQUEST__BODY_GET_STATS:
        handle_stats(s, rid, rlen, m);
        break;
    case MOE__REQUEST__BODY_LOAD_LAYER:
        layer_handle_load(s, se, rid, rlen, m->id, m->load_layer);
        break;
    case MOE__REQUEST__BODY_UNLOAD_LAYER: {
        const char *name = m->unload_layer->name;
        int urc = layer_unload(s, name);
        if (urc)
            server_reply_error(s, rid, rlen, m->id, urc,
                               urc == -EBUSY ? "layer '%s' is still loading"
                                             : "no layer named '%s'",
                               name);
        else {
            Moe__Reply rep = MOE__REPLY__INIT;
            rep.id = m->id;
            server_reply(s, rid, rlen, &rep);
            log_info("layer '%s' unloaded by pid %d", name, (int)se->pid);
        }
        break;
    }
    case MOE__REQUEST__BODY_FUSED_MOE:
    case MOE__REQUEST__BODY_GROUPED_GEMM:
        handle_compute(s, se, rid, rlen, m, arrival);
        break;
    default:
        server_reply_error(s, rid, rlen, m->id, -EPROTO, "request carries no known message");
        break;
    }
out:
    moe__request__free_unpacked(m, NULL);
    return rc;
}

/* Read one message: [routing id] [body], and nothing else (extra parts are
 * drained and the request refused). 0, or -errno of the receive: -EAGAIN
 * when none is waiting. */
static int server_recv_one(struct server *s)
{
    zmq_msg_t part;
    uint8_t rid[ROUTE_ID_MAX];
    size_t rlen = 0;
    int nparts = 0;
    zmq_msg_t body;
    zmq_msg_init(&body);
    bool bad = false;
    int more = 1;
    while (more) {
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, s->zsock, ZMQ_DONTWAIT) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&part);
            if (e == EINTR && nparts > 0)
                continue; /* nothing taken: the rest of this message is next */
            if (nparts == 0) {
                zmq_msg_close(&body);
                return -e;
            }
            break;
        }
        more = zmq_msg_more(&part);
        if (nparts == 0) {
            rlen = zmq_msg_size(&part);
            if (rlen > sizeof(rid))
                rlen = 0;
            memcpy(rid, zmq_msg_data(&part), rlen);
            zmq_msg_close(&part);
        } else if (nparts == 1) {
            zmq_msg_move(&body, &part);
            zmq_msg_close(&part);
        } else {
            bad = true;
            zmq_msg_close(&part);
        }
        nparts++;
    }
    if (rlen == 0) {
        /* Without a routing id there is nobody to answer. */
    } else if (route_session(rid, rlen, NULL)) {
        /* Answering would write to a session's reply socket. */
        static bool warned;
        if (!warned)
            log_warn("request socket: a peer uses a routing id reserved for reply sockets; "
                     "its messages are dropped (logged once)");
        warned = true;
    } else if (bad || nparts != 2) {
        server_reply_error(s, rid, rlen, 0, -EPROTO,
                           "a request is one message part, got %d", nparts - 1);
    } else {
        server_handle_message(s, rid, rlen, zmq_msg_data(&body), zmq_msg_size(&body));
    }
    zmq_msg_close(&body);
    return 0;
}

/*
 * Read every waiting message, until the socket says EAGAIN. ZMQ_FD only
 * signals edges, and a receive that returns EAGAIN has consumed the socket's
 * pending commands, so from then on a new message makes the fd readable
 * again. Receiving until EAGAIN costs one look at the socket's command pipe
 * per drain; asking ZMQ_EVENTS before each message costs one per message
 * (a poll() and a getpid() each, in libzmq).
 *
 * A send may also consume the fd's edge (libzmq processes commands there
 * too), so every reply marks the socket for another drain before the loop
 * sleeps (zmq_dirty).
 */
static void server_drain(struct server *s)
{
    int budget = 0, rc = 0;
    s->in_drain = true;
    while (budget++ < 4096 && (rc = server_recv_one(s)) == 0)
        ;
    s->in_drain = false;
    /* EINTR, ETERM or the budget spent: look again before sleeping. */
    s->zmq_dirty = rc != -EAGAIN;
    if (budget > 1)
        batch_kick(s); /* what the drain queued (see batch_enqueue) */
}

static void server_on_zmq(void *data, int fd, uint32_t events)
{
    server_drain(data);
}

/* How long to spin for a running batch, from the configuration. */
static unsigned server_spin_us(const struct server *s)
{
    if (s->cfg->spin_us != CONFIG_SPIN_AUTO)
        return s->cfg->spin_us;
    return strcmp(s->backend->name, "cpu") ? 200 : 0;
}

static void server_before_sleep(void *data)
{
    struct server *s = data;
    /* With a GPU a decode batch takes a few hundred microseconds: the loop
     * thread spins for its compute to end (worker_poll returns once the
     * compute thread is in the batch's replies, and the loop serves the
     * requests they bring back), so it is awake as they come: without the
     * spin it took the batch back 51-63 us after its replies instead of
     * 17-23, on an H100 host at 32 clients (tests/gpu/RESULTS.md). The
     * compute thread spins for the next batch likewise (worker_set_spin). */
    unsigned spin = server_spin_us(s);
    if (spin && s->batch_running)
        worker_poll(s->compute, spin);
    if (s->zmq_dirty)
        server_drain(s);
    batch_kick(s);
}

int server_new(struct config *cfg, struct backend **backends, int n_backends,
               struct loop *loop, struct server **out)
{
    if (n_backends < 1 || n_backends > MAX_DEVICES)
        return -EINVAL;
    struct server *s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->cfg = cfg;
    for (int i = 0; i < n_backends; i++)
        s->backends[i] = backends[i];
    s->n_backends = n_backends;
    s->backend = backends[0];
    s->loop = loop;
    s->listen_fd = -1;
    s->zfd = -1;
    s->stats.start_us = now_us();
    int rc = worker_new(loop, "moed-compute", &s->compute);
    if (!rc)
        rc = worker_new(loop, "moed-loader", &s->loader);
    if (!rc && s->backend->ops->pin)
        rc = worker_new(loop, "moed-pinner", &s->pinner);
    if (rc) {
        server_free(&s);
        return rc;
    }
    worker_set_spin(s->compute, server_spin_us(s));
    if ((rc = batch_init(s)) < 0) {
        server_free(&s);
        return rc;
    }
    *out = s;
    return 0;
}

int server_failed_device(const struct server *s)
{
    for (int i = 0; i < s->n_backends; i++) {
        struct backend *b = s->backends[i];
        if (b->ops->healthy && !b->ops->healthy(b))
            return i;
    }
    return -1;
}

bool server_check_devices(struct server *s)
{
    if (s->fatal)
        return true;
    if ((s->failed_device = server_failed_device(s)) < 0)
        return false;
    /* Nothing more can run on that device; main exits non-zero. */
    s->fatal = true;
    loop_stop(s->loop);
    return true;
}

unsigned server_pending(const struct server *s)
{
    return s->queued_total + (s->batch_running ? 1u : 0u) + worker_pending(s->loader) +
           (s->pinner ? worker_pending(s->pinner) : 0u);
}

int server_listen(struct server *s, int session_fd, int zmq_fd)
{
    int rc = session_listen(s, session_fd);
    if (rc)
        return rc;
    /* Before libzmq's listener accepts anything (fdguard.h). */
    if ((rc = fdguard_init()) < 0)
        return rc;
    s->zctx = zmq_ctx_new();
    if (!s->zctx)
        return -ENOMEM;
    /* Before the first socket: each client connection is served by one of
     * these threads, so many clients' sends and receives spread over cores. */
    zmq_ctx_set(s->zctx, ZMQ_IO_THREADS, s->cfg->io_threads);
    s->zsock = zmq_socket(s->zctx, ZMQ_ROUTER);
    if (!s->zsock)
        return -zmq_errno();
    int64_t maxmsg = s->cfg->max_message_bytes > INT64_MAX ? INT64_MAX
                                                           : (int64_t)s->cfg->max_message_bytes;
    /* Replies to a peer that does not read wait here, requests of a peer
     * the loop has not read yet there: both bounded per connection. */
    int linger = 0, hwm = (int)s->cfg->max_pending_messages;
    zmq_setsockopt(s->zsock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    zmq_setsockopt(s->zsock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s->zsock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s->zsock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    if (zmq_fd >= 0)
        zmq_setsockopt(s->zsock, ZMQ_USE_FD, &zmq_fd, sizeof(zmq_fd));
    snprintf(s->endpoint, sizeof(s->endpoint), "ipc://%s/moed.zmq", s->cfg->runtime_dir);
    /* EINTR: a signal landed as libzmq looked at its command pipe, before
     * it did anything (moed blocks its signals; programs that embed the
     * server may not). */
    while ((rc = zmq_bind(s->zsock, s->endpoint)) < 0 && zmq_errno() == EINTR)
        ;
    if (rc < 0)
        return -zmq_errno();
    /* Clients need write permission on the socket file to connect; access
     * is governed by the runtime directory's group, as for moed.sock. */
    if (zmq_fd < 0)
        chmod(s->endpoint + strlen("ipc://"), 0660);
    size_t fl = sizeof(s->zfd);
    if (zmq_getsockopt(s->zsock, ZMQ_FD, &s->zfd, &fl) < 0)
        return -zmq_errno();
    s->zmq_dirty = true;
    s->zwatch = loop_watch(s->loop, s->zfd, EPOLLIN, server_on_zmq, s);
    if (!s->zwatch)
        return -errno;
    loop_set_before_sleep(s->loop, server_before_sleep, s);
    return 0;
}

void server_close_zmq(struct server *s, int linger_ms)
{
    if (s->zwatch)
        loop_unwatch(s->loop, &s->zwatch);
    if (s->zsock) {
        zmq_setsockopt(s->zsock, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
        zmq_close(s->zsock);
        s->zsock = NULL;
    }
    if (s->zctx) {
        while (zmq_ctx_term(s->zctx) < 0 && zmq_errno() == EINTR)
            ; /* zmq_ctx_term(3): it can be restarted */
        s->zctx = NULL;
    }
}

void server_free(struct server **sp)
{
    struct server *s = *sp;
    *sp = NULL;
    if (!s)
        return;
    /* Finish what the workers hold before the state they point into goes. */
    worker_free(&s->loader);
    worker_free(&s->compute);
    /* Its last pins answer their sessions, or release their regions; the
     * sessions' regions are unpinned here and now after it. */
    worker_free(&s->pinner);
    session_close_all(s);
    layer_unload_all(s);
    if (s->delay_timer)
        loop_unwatch(s->loop, &s->delay_timer);
    server_close_zmq(s, 0);
    if (s->staging)
        s->backend->ops->host_free(s->backend, s->staging, s->staging_size);
    free(s->sock_rx);
    free(s);
}
