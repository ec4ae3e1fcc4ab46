/*
 * session.c: the session socket. A client connects to
 * <runtime dir>/moed.sock (SOCK_SEQPACKET), says OpenSession and gets a
 * random token for its ZeroMQ requests; it passes memfds for its regions with
 * SCM_RIGHTS. The socket's lifetime is the session's: when it closes (the
 * client exited, crashed or was killed) the session's queued requests are
 * cancelled and its regions released.
 */
#include "daemon/server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/fdguard.h"
#include "daemon/log.h"
#include "daemon/loop.h"
#include "daemon/region.h"
#include "daemon/util.h"
#include "daemon/worker.h"
#include "moe.pb-c.h"
#include "proto/status.h"

#define SESSION_MSG_MAX 4096
#define SESSION_MAX_FDS 4

static void session_close(struct server *s, struct session *se, const char *why);

bool session_token_ok(const struct session *se, const uint8_t *token, size_t len)
{
    if (len != SESSION_TOKEN_BYTES)
        return false;
    /* Constant time in the token's bytes: timing must not reveal how much
     * of a guessed token matched. */
    uint8_t diff = 0;
    for (size_t i = 0; i < SESSION_TOKEN_BYTES; i++)
        diff |= se->token[i] ^ token[i];
    return diff == 0 && se->opened;
}

struct session *session_by_token(struct server *s, const uint8_t *token, size_t len)
{
    if (len != SESSION_TOKEN_BYTES)
        return NULL;
    for (struct session *se = s->sessions; se; se = se->next)
        if (session_token_ok(se, token, len))
            return se;
    return NULL;
}

static struct session **id_bucket(struct server *s, uint64_t id)
{
    return &s->by_id[id & (SESSION_BUCKETS - 1)];
}

struct session *session_by_id(struct server *s, uint64_t id)
{
    for (struct session *se = *id_bucket(s, id); se; se = se->id_next)
        if (se->id == id)
            return se;
    return NULL;
}

struct region *session_region(struct session *se, uint64_t region_id)
{
    for (struct region *r = se->regions; r; r = r->next)
        if (r->id == region_id)
            return r;
    return NULL;
}

/* A packed message waiting for room on its socket. */
struct out_msg {
    struct out_msg *next;
    uint64_t id; /* the reply's, for the error that may take its place */
    size_t n;
    uint8_t data[];
};

static void out_msgs_free(struct out_msg **q)
{
    while (*q) {
        struct out_msg *m = *q;
        *q = m->next;
        free(m);
    }
}

/* One datagram, never waiting: 0, -EAGAIN (no room now) or -errno. */
static int send_nowait(int fd, const void *buf, size_t n)
{
    if (send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT) >= 0)
        return 0;
    return errno == EWOULDBLOCK ? -EAGAIN : -errno;
}

/* Answers to session requests go out in order. One that finds the socket
 * full (a client that sends session requests without reading their
 * answers) waits in se->unsent, and the socket is watched for room instead
 * of read (session_watch) until it has gone: every request is answered,
 * and the answers held never outnumber the requests read.
 *
 * session_flush sends what waits: 0 once nothing does, -EAGAIN while the
 * socket is still full, or the socket's error. */
static int session_flush(struct session *se)
{
    while (se->unsent) {
        struct out_msg *m = se->unsent;
        int rc = send_nowait(se->fd, m->data, m->n);
        if (rc)
            return rc;
        se->unsent = m->next;
        free(m);
    }
    return 0;
}

/* The socket's watch for the session's state: nothing while a region of
 * its is being pinned (only a hang-up wakes it), room while an answer
 * waits, else requests. False, and the session closed, if the watch
 * cannot be changed (the socket would be left spinning or deaf). */
static bool session_watch(struct server *s, struct session *se)
{
    uint32_t ev = se->pinning ? 0 : se->unsent ? EPOLLOUT : EPOLLIN;
    int rc = loop_watch_events(s->loop, se->watch, ev);
    if (rc)
        session_close(s, se, "its socket cannot be watched");
    return rc == 0;
}

/* One datagram per reply. A reply must not pack to zero bytes: on a
 * seqpacket socket an empty datagram is indistinguishable from EOF. */
static void session_send(struct server *s, struct session *se, Moe__SessionReply *rep)
{
    uint8_t buf[SESSION_MSG_MAX];
    size_t n = moe__session_reply__get_packed_size(rep);
    if (n > sizeof(buf))
        return;
    moe__session_reply__pack(rep, buf);
    int rc = se->unsent ? -EAGAIN : send_nowait(se->fd, buf, n);
    if (rc == -EAGAIN) {
        struct out_msg *m = malloc(sizeof(*m) + n), **tail = &se->unsent;
        if (m) {
            *m = (struct out_msg){.n = n};
            memcpy(m->data, buf, n);
            while (*tail)
                tail = &(*tail)->next;
            *tail = m;
            return;
        }
        rc = -ENOMEM;
    }
    if (rc)
        log_debug("session %llu (pid %d): reply not sent: %s",
                  (unsigned long long)se->id, (int)se->pid, strerror(-rc));
}

/* One datagram on the reply socket, never waiting. */
static int chan_send_bytes(const struct reply_chan *c, const void *buf, size_t n)
{
    return send_nowait(c->fd, buf, n);
}

int reply_chan_send(struct reply_chan *c, void *reply)
{
    uint8_t buf[SESSION_MSG_MAX];
    size_t n = moe__reply__get_packed_size(reply);
    if (n > sizeof(buf))
        return -EMSGSIZE;
    moe__reply__pack(reply, buf);
    return chan_send_bytes(c, buf, n);
}

int session_push_reply(struct session *se, void *reply)
{
    if (!se->chan)
        return -ENOTCONN;
    if (se->outq)
        return -EAGAIN; /* the socket's room is promised to its own requests */
    /* Never blocks: a client that does not read its reply socket gets its
     * replies on the request socket once that one is full. The session
     * socket itself carries only the answers to session requests. */
    return reply_chan_send(se->chan, reply);
}

/* ---- requests on the reply socket ---------------------------------------
 *
 * A client may send its Requests on its reply socket too (libmoe sends
 * compute requests there): the daemon's loop reads them itself, without the
 * two ZeroMQ I/O threads of the request socket. Their replies go back on
 * the same socket and nowhere else, so when it is full they wait in the
 * session's queue, and the socket is not read until the queue is empty:
 * a client that does not read its replies stops being read, and the queue
 * never holds more than its requests in flight. */


/* At most this many requests read from one socket per wake-up, so one busy
 * client cannot hold the loop. */
#define SOCKET_READ_BUDGET 64

struct reply_chan *reply_chan_ref(struct reply_chan *c)
{
    atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
    return c;
}

void reply_chan_unref(struct reply_chan **cp)
{
    struct reply_chan *c = *cp;
    *cp = NULL;
    if (c && atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1) {
        close(c->fd);
        free(c);
    }
}

static void reply_socket_close(struct server *s, struct session *se, const char *why)
{
    if (!se->chan)
        return;
    if (why)
        log_debug("session %llu (pid %d): reply socket closed (%s), %u replies dropped",
                  (unsigned long long)se->id, (int)se->pid, why, se->n_out);
    if (se->reply_watch)
        loop_unwatch(s->loop, &se->reply_watch);
    atomic_store_explicit(&se->chan->direct, false, memory_order_release);
    reply_chan_unref(&se->chan); /* closes it unless a batch still holds it */
    out_msgs_free(&se->outq);
    se->outq_tail = &se->outq;
    se->n_out = 0;
}

/* The outcome of a send on the reply socket: 1 sent, 0 no room now, -1
 * the socket failed and is closed. */
static int reply_socket_sent(struct server *s, struct session *se, int rc)
{
    if (rc == 0)
        return 1;
    if (rc == -EAGAIN)
        return 0;
    reply_socket_close(s, se, strerror(-rc));
    return -1;
}

/* Wait for room (EPOLLOUT) or for requests (EPOLLIN); a watch that cannot
 * be changed would leave the socket spinning or deaf: closed instead. */
static bool reply_socket_watch(struct server *s, struct session *se, uint32_t events)
{
    int rc = loop_watch_events(s->loop, se->reply_watch, events);
    if (rc)
        reply_socket_close(s, se, strerror(-rc));
    return rc == 0;
}

/* A reply larger than one datagram of the reply socket (its send buffer,
 * which the client chose when it made the socket) becomes an error with
 * the same id, in place: the client learns what happened, and the socket,
 * with the replies queued behind this one, stays open. False when the
 * error itself would not fit (a reply that small always goes). */
static bool reply_shrink(struct server *s, struct session *se, struct out_msg *m)
{
    char msg[200];
    snprintf(msg, sizeof(msg),
             "the reply (%zu bytes) is larger than one datagram of the reply socket; "
             "send this request on the request socket",
             m->n);
    Moe__Reply rep = MOE__REPLY__INIT;
    rep.id = m->id;
    rep.status = status_from_errno(-EMSGSIZE);
    rep.message = msg;
    size_t n = moe__reply__get_packed_size(&rep);
    if (n >= m->n)
        return false;
    log_debug("session %llu (pid %d): reply %llu of %zu bytes does not fit the reply socket; "
              "an error sent in its place",
              (unsigned long long)se->id, (int)se->pid, (unsigned long long)m->id, m->n);
    m->n = moe__reply__pack(&rep, m->data);
    s->stats.errors++;
    return true;
}

/* The socket has room: send what waits, and read requests again once
 * nothing does. */
static void reply_socket_flush(struct server *s, struct session *se)
{
    while (se->outq) {
        struct out_msg *m = se->outq;
        int rc = chan_send_bytes(se->chan, m->data, m->n);
        if (rc == -EMSGSIZE && reply_shrink(s, se, m))
            rc = chan_send_bytes(se->chan, m->data, m->n);
        if (reply_socket_sent(s, se, rc) <= 0)
            return;
        se->outq = m->next;
        se->n_out--;
        free(m);
    }
    se->outq_tail = &se->outq;
    if (reply_socket_watch(s, se, EPOLLIN))
        atomic_store_explicit(&se->chan->direct, true, memory_order_release);
}

void session_send_reply(struct server *s, uint64_t session_id, void *reply)
{
    struct session *se = session_by_id(s, session_id);
    if (!se || !se->chan) {
        log_debug("session %llu: reply %llu dropped: the reply socket is gone",
                  (unsigned long long)session_id,
                  (unsigned long long)((Moe__Reply *)reply)->id);
        return;
    }
    /* Too large for one buffer (-EMSGSIZE) or no room: queued. */
    int rc = se->outq ? -EAGAIN : reply_chan_send(se->chan, reply);
    if (rc != -EMSGSIZE && reply_socket_sent(s, se, rc) != 0)
        return; /* sent, or the socket is gone */
    size_t n = moe__reply__get_packed_size(reply);
    struct out_msg *m = malloc(sizeof(*m) + n);
    if (!m) {
        log_warn("session %llu: reply dropped: out of memory", (unsigned long long)se->id);
        return;
    }
    m->next = NULL;
    m->id = ((Moe__Reply *)reply)->id;
    m->n = moe__reply__pack(reply, m->data);
    if (!se->outq) {
        /* Replies wait here now, and the compute thread leaves this
         * socket's to the loop from here on. A send of its that began
         * before this store may still go first: replies carry their
         * request's id and clients match them by it, so the order of
         * replies to different requests is not promised. */
        atomic_store_explicit(&se->chan->direct, false, memory_order_release);
        if (!reply_socket_watch(s, se, EPOLLOUT)) {
            free(m);
            return;
        }
    }
    *se->outq_tail = m;
    se->outq_tail = &m->next;
    se->n_out++;
}

static void reply_socket_read(struct server *s, struct session *se)
{
    /* A datagram is at most the socket's send buffer (a few hundred KiB);
     * bigger requests go by ZeroMQ. */
    size_t limit = s->cfg->max_message_bytes < (4u << 20) ? (size_t)s->cfg->max_message_bytes
                                                          : (size_t)4u << 20;
    size_t cap = limit + 1;
    if (s->sock_rx_size < cap) {
        uint8_t *b = realloc(s->sock_rx, cap);
        if (!b)
            return; /* level-triggered: tried again on the next wake-up */
        s->sock_rx = b;
        s->sock_rx_size = cap;
    }
    uint8_t rid[SOCKET_ROUTE_LEN];
    route_for_session(se->id, rid);
    int got = 0;
    s->in_drain = true; /* one batch_kick for all of them, below */
    while (got < SOCKET_READ_BUDGET && se->chan && !se->outq) {
        ssize_t n = recv(se->chan->fd, s->sock_rx, cap, MSG_DONTWAIT | MSG_TRUNC);
        if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                reply_socket_close(s, se, strerror(errno));
            break;
        }
        if (n == 0) { /* the client closed its end (or sent an empty datagram) */
            reply_socket_close(s, se, "end of file");
            break;
        }
        got++;
        /* What is not this session's request is not answered (server.h):
         * the socket is closed, and the session goes on by ZeroMQ. */
        int rc = (size_t)n >= cap ? -EMSGSIZE
                                  : server_handle_message(s, rid, sizeof(rid), s->sock_rx,
                                                          (size_t)n);
        if (rc) {
            log_warn("session %llu (pid %d): reply socket closed: a datagram of %zd bytes that "
                     "is %s",
                     (unsigned long long)se->id, (int)se->pid, n,
                     rc == -EMSGSIZE ? "too large"
                     : rc == -EPROTO ? "no moe.Request"
                                     : "not this session's (token)");
            reply_socket_close(s, se, NULL);
            break;
        }
    }
    s->in_drain = false;
    if (got)
        batch_kick(s);
}

static void reply_socket_ready(void *data, int fd, uint32_t events)
{
    struct session *se = data;
    struct server *s = se->server;
    if (se->outq) {
        reply_socket_flush(s, se);
        if (se->outq)
            return;
    }
    reply_socket_read(s, se);
}

static void session_fail(struct server *s, struct session *se, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void session_fail(struct server *s, struct session *se, int err, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    Moe__SessionReply rep = MOE__SESSION_REPLY__INIT;
    rep.status = status_from_errno(err);
    rep.message = msg;
    session_send(s, se, &rep);
}

static uint64_t region_new_id(struct server *s)
{
    for (;;) {
        uint64_t id = 0;
        if (random_bytes(&id, sizeof(id)) < 0)
            id = now_us() * 6364136223846793005ull + 1442695040888963407ull;
        id &= (1ull << 53) - 1; /* stays exact in JSON and doubles */
        if (id == 0)
            continue;
        bool used = false;
        for (struct session *se = s->sessions; se && !used; se = se->next)
            used = session_region(se, id) != NULL;
        if (!used)
            return id;
    }
}

/*
 * Pinning a region for DMA (CUDA: cudaHostRegister, about 15 ms per 256
 * MiB) and unpinning it run on the pinner thread, not the loop's, which
 * goes on serving every other client meanwhile. A session whose region is
 * being pinned is not read until its reply goes out, so its session
 * requests are still answered one at a time, in order. pinned_bytes
 * counts a region from the pin's start to the unpin's end.
 */
struct pin_job {
    struct job job;
    struct server *s;
    struct region *r;
    uint64_t session_id;
    pid_t pid;
    int rc;
};

struct unpin_job {
    struct job job;
    struct server *s;
    void *base, *cookie;
    uint64_t size;
    int fd;
};

static void region_add(struct server *s, struct session *se, struct region *r);

static void pin_run(struct job *job)
{
    struct pin_job *pj = (struct pin_job *)job;
    struct backend *b = pj->s->backend;
    pj->rc = b->ops->pin(b, pj->r->base, (size_t)pj->r->size, &pj->r->pin_cookie);
}

static void pin_done(struct job *job)
{
    struct pin_job *pj = (struct pin_job *)job;
    struct server *s = pj->s;
    struct region *r = pj->r;
    if (pj->rc || !r->pin_cookie) {
        r->pin_cookie = NULL;
        s->pinned_bytes -= r->size;
        log_debug("region of %llu bytes of pid %d not pinned: %s", (unsigned long long)r->size,
                  (int)pj->pid, strerror(pj->rc ? -pj->rc : EINVAL));
    }
    struct session *se = session_by_id(s, pj->session_id);
    free(pj);
    if (!se) { /* the client went meanwhile */
        region_unref(&r);
        return;
    }
    region_add(s, se, r);
    session_watch(s, se);
}

/* Queue r's pin: true, and pin_done answers; false (out of memory), and r
 * goes unpinned. */
static bool pin_submit(struct server *s, struct session *se, struct region *r)
{
    struct pin_job *pj = calloc(1, sizeof(*pj));
    if (!pj || loop_watch_events(s->loop, se->watch, 0) < 0) {
        free(pj);
        return false;
    }
    *pj = (struct pin_job){.job = {.run = pin_run, .done = pin_done}, .s = s, .r = r,
                           .session_id = se->id, .pid = se->pid};
    s->pinned_bytes += r->size;
    se->pinning = true;
    worker_submit(s->pinner, &pj->job);
    return true;
}

static void unpin_run(struct job *job)
{
    struct unpin_job *uj = (struct unpin_job *)job;
    struct backend *b = uj->s->backend;
    b->ops->unpin(b, uj->base, (size_t)uj->size, uj->cookie);
    munmap(uj->base, (size_t)uj->size);
    close_fd(&uj->fd);
}

static void unpin_done(struct job *job)
{
    struct unpin_job *uj = (struct unpin_job *)job;
    uj->s->pinned_bytes -= uj->size;
    uj->s->unpinning_bytes -= uj->size;
    free(uj);
}

/* Unpin r, then unmap and close it, on the pinner thread: r gives up its
 * mapping and descriptor. Without the thread (shutting down) or memory,
 * here and now. */
static void unpin(struct server *s, struct region *r)
{
    struct unpin_job *uj = s->pinner ? calloc(1, sizeof(*uj)) : NULL;
    if (!uj) {
        s->backend->ops->unpin(s->backend, r->base, (size_t)r->size, r->pin_cookie);
        s->pinned_bytes -= r->size;
        return;
    }
    *uj = (struct unpin_job){.job = {.run = unpin_run, .done = unpin_done}, .s = s,
                             .base = r->base, .cookie = r->pin_cookie, .size = r->size,
                             .fd = r->fd};
    r->base = NULL;
    r->fd = -1;
    s->unpinning_bytes += r->size;
    worker_submit(s->pinner, &uj->job);
}

/* A region's last reference is gone: unpinned, and no longer counted
 * against its session (if that is still there) when the client had
 * unregistered it before. */
static void region_release(void *ctx, struct region *r)
{
    struct server *s = ctx;
    if (r->pin_cookie && s->backend->ops->unpin)
        unpin(s, r);
    struct session *se = r->retired ? session_by_id(s, r->session_id) : NULL;
    if (se) {
        se->n_retired--;
        se->retired_bytes -= r->size;
    }
}

static void session_register(struct server *s, struct session *se,
                             const Moe__RegisterRegion *m, int *fds, int nfds)
{
    struct region *r = NULL;
    uint64_t total;
    if (nfds != 1) {
        session_fail(s, se, -EINVAL, "RegisterRegion needs exactly one file descriptor, got %d", nfds);
        return;
    }
    static const char in_flight[] = " (counting regions unregistered that requests in flight still use)";
    if (se->n_regions + se->n_retired >= s->cfg->max_regions) {
        session_fail(s, se, -EDQUOT, "session has %u regions, the limit%s",
                     se->n_regions + se->n_retired, se->n_retired ? in_flight : "");
        return;
    }
    if (!add_u64(se->region_bytes + se->retired_bytes, m->size, &total) ||
        total > s->cfg->max_session_bytes) {
        session_fail(s, se, -EDQUOT,
                     "region of %llu bytes would exceed the session's %llu mapped bytes%s",
                     (unsigned long long)m->size, (unsigned long long)s->cfg->max_session_bytes,
                     se->retired_bytes ? in_flight : "");
        return;
    }
    int rc = region_new(fds[0], m->size, s->cfg->max_region_bytes, &r);
    if (rc) {
        session_fail(s, se, rc,
                     rc == -EINVAL ? "region must be a memfd (shared memory, not huge pages) "
                                     "sealed with F_SEAL_SHRINK and F_SEAL_GROW whose size is "
                                     "the declared %llu bytes (nonzero)"
                     : rc == -EDQUOT ? "region of %llu bytes is over the per-region limit"
                                     : "cannot map region of %llu bytes",
                     (unsigned long long)m->size);
        return;
    }
    fds[0] = -1; /* the region owns it now */
    r->session_id = se->id;
    snprintf(r->name, sizeof(r->name), "%s", m->name ? m->name : "");
    r->release = region_release;
    r->release_ctx = s;
    /* Pinned (on the pinner thread) while the daemon's total stays within
     * max_pinned_bytes, so clients cannot make it lock more RAM than that.
     * The unpins queued before it have ended when its pin starts (the
     * pinner runs its jobs in order): their bytes are room already. */
    if (s->pinner) { /* made where the backend pins */
        if (s->pinned_bytes - s->unpinning_bytes + r->size > s->cfg->max_pinned_bytes)
            log_debug("region of %llu bytes of pid %d not pinned: over max_pinned_bytes",
                      (unsigned long long)r->size, (int)se->pid);
        else if (pin_submit(s, se, r))
            return;
    }
    region_add(s, se, r);
}

/* A registered region joins its session, under a new id, and is answered. */
static void region_add(struct server *s, struct session *se, struct region *r)
{
    se->pinning = false;
    r->id = region_new_id(s);
    r->next = se->regions;
    se->regions = r;
    se->n_regions++;
    se->region_bytes += r->size;
    Moe__SessionReply rep = MOE__SESSION_REPLY__INIT;
    rep.region = r->id;
    session_send(s, se, &rep);
}

static void session_unregister(struct server *s, struct session *se, uint64_t id)
{
    for (struct region **pp = &se->regions; *pp; pp = &(*pp)->next) {
        struct region *r = *pp;
        if (r->id != id)
            continue;
        *pp = r->next;
        se->n_regions--;
        se->region_bytes -= r->size;
        if (r->refs > 1) { /* requests in flight hold it: counted until they end */
            r->retired = true;
            se->n_retired++;
            se->retired_bytes += r->size;
        }
        region_unref(&r); /* batches in flight keep their own references */
        Moe__SessionReply rep = MOE__SESSION_REPLY__INIT;
        rep.region = id; /* never an empty datagram: that reads as EOF */
        session_send(s, se, &rep);
        return;
    }
    session_fail(s, se, -ENOENT, "no region %llu in this session", (unsigned long long)id);
}

/* A reply socket must be one end of a seqpacket socketpair that the
 * session's own process made: not a socket connected to a listener (moed's
 * own session socket, another service), whose peer would get the replies,
 * nor one that another user's process made. */
static bool reply_socket_ok(const struct session *se, int fd)
{
    int type = 0, domain = 0;
    socklen_t tl = sizeof(type), dl = sizeof(domain);
    struct sockaddr_un peer;
    socklen_t pl = sizeof(peer);
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) == 0 && type == SOCK_SEQPACKET &&
           getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dl) == 0 && domain == AF_UNIX &&
           getpeername(fd, (struct sockaddr *)&peer, &pl) == 0 &&
           pl <= offsetof(struct sockaddr_un, sun_path) && /* unnamed: a socketpair */
           getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0 && cred.pid == se->pid &&
           cred.uid == se->uid;
}

static void session_open(struct server *s, struct session *se, const Moe__OpenSession *m,
                         int *fds, int nfds)
{
    if (se->opened) {
        session_fail(s, se, -EINVAL, "session is already open");
        return;
    }
    if (m->protocol_version != 1) {
        session_fail(s, se, -ENOTSUP, "protocol version %u is not supported (this daemon speaks 1)",
                     m->protocol_version);
        return;
    }
    if (m->reply_socket) {
        if (nfds != 1 || !reply_socket_ok(se, fds[0])) {
            session_fail(s, se, -EINVAL,
                         "reply_socket needs one end of an AF_UNIX SOCK_SEQPACKET socketpair "
                         "made by the session's own process, beside OpenSession");
            return;
        }
        se->chan = calloc(1, sizeof(*se->chan));
        se->reply_watch = se->chan ? loop_watch(s->loop, fds[0], EPOLLIN, reply_socket_ready, se)
                                   : NULL;
        if (!se->reply_watch) {
            int e = se->chan ? errno : ENOMEM;
            free(se->chan);
            se->chan = NULL;
            session_fail(s, se, -e, "reply socket: %s", strerror(e));
            return;
        }
        atomic_init(&se->chan->refs, 1);
        atomic_init(&se->chan->direct, true);
        se->chan->fd = fds[0];
        fds[0] = -1; /* the session owns it now */
    }
    se->opened = true;
    snprintf(se->name, sizeof(se->name), "%s", m->client_name ? m->client_name : "");
    Moe__SessionReply rep = MOE__SESSION_REPLY__INIT;
    rep.token.data = se->token;
    rep.token.len = SESSION_TOKEN_BYTES;
    rep.session_id = se->id;
    rep.request_endpoint = s->endpoint;
    rep.socket_requests = se->chan != NULL;
    rep.max_message_bytes = s->cfg->max_message_bytes;
    session_send(s, se, &rep);
    log_debug("session %llu opened by pid %d uid %u (%s)", (unsigned long long)se->id,
              (int)se->pid, (unsigned)se->uid, se->name);
}

static void session_on_readable(void *data, int fd, uint32_t events);

static void session_handle(struct server *s, struct session *se, const uint8_t *buf,
                           size_t n, int *fds, int nfds)
{
    Moe__SessionRequest *m = moe__session_request__unpack(NULL, n, buf);
    if (!m) {
        session_fail(s, se, -EPROTO, "session message of %zu bytes could not be decoded", n);
        return;
    }
    if (!se->opened && m->body_case != MOE__SESSION_REQUEST__BODY_OPEN) {
        session_fail(s, se, -EACCES, "OpenSession must come first");
    } else {
        switch (m->body_case) {
        case MOE__SESSION_REQUEST__BODY_OPEN:
            session_open(s, se, m->open, fds, nfds);
            break;
        case MOE__SESSION_REQUEST__BODY_REGISTER_REGION:
            session_register(s, se, m->register_region, fds, nfds);
            break;
        case MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION:
            session_unregister(s, se, m->unregister_region->region);
            break;
        default:
            session_fail(s, se, -EPROTO, "unknown session message");
            break;
        }
    }
    moe__session_request__free_unpacked(m, NULL);
}

static void session_on_readable(void *data, int fd, uint32_t events)
{
    struct session *se = data;
    struct server *s = se->server;
    /* Not read while its region is pinned, yet woken by a hang-up (epoll
     * reports one whatever the watch asks): the client is gone, and what
     * it sent after that region is not for anyone. */
    if (se->pinning) {
        session_close(s, se, (events & EPOLLERR) ? "failed" : "closed");
        return;
    }
    /* Watched for room: the answers that wait go first, then reading. */
    if (se->unsent) {
        if (events & (EPOLLERR | EPOLLHUP)) {
            session_close(s, se, (events & EPOLLERR) ? "failed" : "closed");
            return;
        }
        int rc = session_flush(se);
        if (rc == -EAGAIN)
            return;
        if (rc) {
            session_close(s, se, strerror(-rc));
            return;
        }
        if (!session_watch(s, se))
            return;
    }
    for (int iter = 0; iter < 64; iter++) {
        uint8_t buf[SESSION_MSG_MAX];
        union {
            char raw[CMSG_SPACE(sizeof(int) * SESSION_MAX_FDS)];
            struct cmsghdr align;
        } cbuf;
        struct iovec iov = {buf, sizeof(buf)};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1,
                            .msg_control = cbuf.raw, .msg_controllen = sizeof(cbuf.raw)};
        ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        if (n < 0) {
            session_close(s, se, strerror(errno));
            return;
        }
        int fds[SESSION_MAX_FDS];
        int nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            size_t cnt = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < cnt; i++) {
                int f;
                memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (nfds < SESSION_MAX_FDS)
                    fds[nfds++] = f;
                else
                    close(f);
            }
        }
        /* An empty datagram reads as the end; the descriptors that came
         * with it are closed like those of any other. */
        if (n > 0 && (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
            session_fail(s, se, -EPROTO, "session message or its descriptors were truncated");
        else if (n > 0)
            session_handle(s, se, buf, (size_t)n, fds, nfds);
        for (int i = 0; i < nfds; i++)
            close_fd(&fds[i]);
        if (n == 0) {
            session_close(s, se, "closed");
            return;
        }
        if (se->pinning)
            return; /* read again once its region is answered */
        if (se->unsent) {
            session_watch(s, se); /* read again once the answer has gone */
            return;
        }
    }
}

static void session_close(struct server *s, struct session *se, const char *why)
{
    struct session **pp = &s->sessions;
    while (*pp && *pp != se)
        pp = &(*pp)->next;
    if (*pp)
        *pp = se->next;
    for (pp = id_bucket(s, se->id); *pp; pp = &(*pp)->id_next)
        if (*pp == se) {
            *pp = se->id_next;
            break;
        }
    s->n_sessions--;
    log_debug("session %llu of pid %d ended (%s): %u regions released",
              (unsigned long long)se->id, (int)se->pid, why, se->n_regions);
    batch_cancel_session(s, se->id);
    while (se->regions) {
        struct region *r = se->regions;
        se->regions = r->next;
        region_unref(&r);
    }
    loop_unwatch(s->loop, &se->watch);
    close_fd(&se->fd);
    reply_socket_close(s, se, NULL);
    out_msgs_free(&se->unsent);
    free(se);
}

int session_attach(struct server *s, int fd)
{
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    if (s->n_sessions >= s->cfg->max_sessions || s->draining) {
        Moe__SessionReply rep = MOE__SESSION_REPLY__INIT;
        char msg[128];
        snprintf(msg, sizeof(msg), s->draining ? "daemon is shutting down"
                                               : "too many sessions (limit %u)",
                 s->cfg->max_sessions);
        rep.status = s->draining ? MOE__STATUS__STATUS_CANCELLED
                                 : MOE__STATUS__STATUS_RESOURCE_EXHAUSTED;
        rep.message = msg;
        uint8_t buf[256];
        size_t n = moe__session_reply__pack(&rep, buf);
        ssize_t w = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w;
        log_warn("session from pid %d refused: %s", (int)cred.pid, msg);
        close(fd);
        return s->draining ? -ECANCELED : -EDQUOT;
    }
    struct session *se = calloc(1, sizeof(*se));
    if (!se || random_bytes(se->token, sizeof(se->token)) < 0) {
        free(se);
        close(fd);
        return -ENOMEM;
    }
    se->id = ++s->next_session_id;
    se->server = s;
    se->fd = fd;
    se->outq_tail = &se->outq;
    se->pid = cred.pid;
    se->uid = cred.uid;
    se->gid = cred.gid;
    se->watch = loop_watch(s->loop, fd, EPOLLIN, session_on_readable, se);
    if (!se->watch) {
        int e = -errno;
        close(fd);
        free(se);
        return e;
    }
    se->next = s->sessions;
    s->sessions = se;
    se->id_next = *id_bucket(s, se->id);
    *id_bucket(s, se->id) = se;
    s->n_sessions++;
    return 0;
}

static void session_accept_resume(void *data)
{
    struct server *s = data;
    int rc = s->listen_watch ? loop_watch_events(s->loop, s->listen_watch, EPOLLIN) : 0;
    if (rc < 0)
        log_err("cannot watch the session socket again: %s", strerror(-rc));
}

/* Out of descriptors or memory, a pending connection stays pending and its
 * socket readable: rather than spin on it (and log each turn), stop
 * accepting for 100 ms. */
static void session_accept_pause(struct server *s, int err)
{
    log_warn("cannot accept a session: %s; accepting again in 100 ms", strerror(err));
    if (loop_timer_set(s->accept_pause, 100000, 0) < 0 ||
        loop_watch_events(s->loop, s->listen_watch, 0) < 0)
        log_err("cannot pause accepting sessions");
}

static void session_on_accept(void *data, int lfd, uint32_t events)
{
    struct server *s = data;
    for (;;) {
        int fd = fdguard_accept_unguarded(lfd, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                session_accept_pause(s, errno);
            else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
                log_warn("cannot accept a session: %s", strerror(errno));
            return;
        }
        session_attach(s, fd);
    }
}

int session_listen(struct server *s, int fd_from_systemd)
{
    int fd = fd_from_systemd;
    if (snprintf(s->sock_path, sizeof(s->sock_path), "%s/moed.sock", s->cfg->runtime_dir) >=
        (int)sizeof(((struct sockaddr_un *)0)->sun_path))
        return -ENAMETOOLONG;
    if (fd < 0) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        memcpy(sa.sun_path, s->sock_path, strlen(s->sock_path) + 1); /* length checked above */
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return -errno;
        /* A socket file that answers belongs to a running daemon: never steal
         * it. One that refuses is stale and can go. */
        int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
            close(probe);
            close(fd);
            return -EADDRINUSE;
        }
        close_fd(&probe);
        unlink(sa.sun_path);
        if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 128) < 0) {
            int e = -errno;
            close(fd);
            return e;
        }
        chmod(sa.sun_path, 0660);
    } else {
        s->sock_from_systemd = true;
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0)
            fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    }
    s->listen_fd = fd;
    /* The pause's timer is made now, disarmed: out of descriptors it could
     * not be. */
    s->accept_pause = loop_timer(s->loop, 0, session_accept_resume, s);
    if (!s->accept_pause)
        return -errno;
    s->listen_watch = loop_watch(s->loop, fd, EPOLLIN, session_on_accept, s);
    return s->listen_watch ? 0 : -errno;
}

void session_close_all(struct server *s)
{
    while (s->sessions)
        session_close(s, s->sessions, "daemon stopping");
    loop_unwatch(s->loop, &s->listen_watch);
    if (s->accept_pause)
        loop_unwatch(s->loop, &s->accept_pause);
    close_fd(&s->listen_fd);
    if (!s->sock_from_systemd && s->sock_path[0])
        unlink(s->sock_path);
}
