/*
 * moe.c: libmoe. See moe.h for the API. Two sockets per client: the session
 * socket (UNIX seqpacket: OpenSession, regions with their memfds) and a
 * ZeroMQ DEALER for requests. Replies may come back in any order; a reply
 * that arrives for another waiter is parked in the client's pending list.
 *
 * Library code does not log: errors are returned, with a message for
 * moe_errmsg().
 */
#include "moe.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "moe.pb-c.h"
#include "proto/rundir.h"
#include "proto/status.h"

struct moe_region {
    uint64_t id;
    int fd;
    void *base;
    size_t size;
    /* Its label, cut to what the daemon keeps (63 bytes; a memfd's name may
     * have 249): for the memfd, and each registration, the first and those
     * after a daemon restart. */
    char name[64];
    struct moe_region *next;
};

/* A reply that came, or a mark. Request ids are never reused over the
 * client's life (next_id goes on across connections), so a reply of an
 * earlier connection is still its request's: it stays here until that
 * request is waited for or given up, through any reconnection. */
struct pending {
    uint64_t id;
    Moe__Reply *reply; /* NULL: a synchronous call gave up on id; its reply,
                        * when it comes, is dropped (the current connection's
                        * only) */
    struct pending *next;
};

/*
 * A client survives a daemon restart: when the session socket reports the
 * daemon gone, the call in flight fails with -ECONNRESET and the next call
 * opens a new session, re-registers every region (the client still holds
 * their memfds; their ids change, the moe_region handles stay valid) and
 * replaces the request socket. Requests of the old connection are lost,
 * except those whose replies had come (read before the reconnection, or
 * collected then from the sockets of a daemon that went away): a wait
 * returns them.
 */
struct moe_client {
    pthread_mutex_t mu;
    /* One waiting thread at a time reads the sockets, sleeping on them
     * without mu (so that other threads submit meanwhile); the others wait
     * on cv, which a change of the pending list or the reader's leaving
     * signals. A thread that touches the ZeroMQ socket under mu while the
     * reader sleeps may consume the edge that ZMQ_FD would have woken it
     * with: it writes wake_fd. */
    pthread_cond_t cv;
    bool reading;
    int wake_fd;          /* eventfd */
    /* A region's create or free, or a reconnection, waiting for the daemon
     * without mu (session_claim): the session socket is the owner's
     * meanwhile. */
    bool session_busy;
    pthread_t session_owner;
    int sfd;
    void *zctx;
    void *zsock;
    int zfd;              /* zsock's ZMQ_FD, for poll() */
    uint8_t token[16];
    size_t token_len;
    uint64_t session_id;
    uint64_t next_id;
    int timeout_ms;
    unsigned spin_us;     /* busy-poll this long for a reply before sleeping */
    unsigned spin_ahead_us; /* busy-poll this long either side of a compute
                             * reply's expected time (rt_us after its send) */
    uint64_t rt_us;       /* compute requests' round trip, a running mean */
    bool want_rfd;        /* ask for a reply socket at connect (MOE_REPLIES) */
    int rfd;              /* the reply socket (OpenSession.reply_socket), or -1 */
    int rpeer;            /* its other end, until OpenSession has sent it, or -1 */
    bool want_socket_requests; /* send compute requests on it (MOE_REQUESTS) */
    bool socket_requests; /* ... and this daemon reads them there */
    uint64_t max_message; /* the largest Request the daemon takes (0: not said) */
    struct moe_region *regions;
    struct pending *pending;
    unsigned generation;  /* connections made so far */
    bool broken;          /* the daemon went away; reconnect before the next call */
    const char *lost;     /* why the requests of an ended session are lost, when
                           * the daemon did not go away (NULL: it did) */
    char dir[PATH_MAX];
    char name[64];
    pid_t pid;            /* the process that connected it */
    uint64_t serial;      /* unique in this process: a request handle of a
                           * client gone names it, not one made since at
                           * the same address (request_of) */
    unsigned forks;       /* fork_count then (see forked()) */
    struct moe_client *next_live; /* this process's clients (live_clients) */
};

struct moe_request {
    /* Request ids are the client's own (each client counts from 1): in
     * another client's hands id would name one of that client's requests. */
    const moe_client *client;
    uint64_t client_serial;
    uint64_t id;
    unsigned generation;
    uint64_t sent_us;     /* when it was sent (mono_us) */
};

static _Thread_local char moe_err_buf[512];

/* fork(): a child has a copy of every client, but its sockets are the
 * parent's session (the daemon cannot tell the two processes apart, and
 * each would take the other's replies), libzmq's threads are not there,
 * and mu may be held by a thread that is not either. fork_count counts
 * the forks of this process's ancestry since libmoe's first connect. The
 * child closes its copies of the session and reply sockets at once: while
 * it held them, the parent's session would outlive the parent's
 * disconnect (or exit) for as long as the child lives. */
static atomic_uint fork_count;
static atomic_ullong client_serials;
static pthread_once_t fork_watch_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static struct moe_client *live_clients;

static void on_fork_prepare(void)
{
    pthread_mutex_lock(&live_mu);
}

static void on_fork_parent(void)
{
    pthread_mutex_unlock(&live_mu);
}

static void on_fork_child(void)
{
    atomic_fetch_add(&fork_count, 1);
    for (struct moe_client *c = live_clients; c; c = c->next_live) {
        int *fds[] = {&c->sfd, &c->rfd, &c->rpeer};
        for (int i = 0; i < 3; i++) {
            if (*fds[i] >= 0)
                close(*fds[i]);
            *fds[i] = -1;
        }
    }
    live_clients = NULL; /* the parent's; this process starts with none */
    pthread_mutex_unlock(&live_mu);
}

static void fork_watch(void)
{
    pthread_atfork(on_fork_prepare, on_fork_parent, on_fork_child);
}

/* A live client's session sockets are made and closed under live_mu: the
 * fork child's handler then finds every one of them in its client, and
 * closes no number that was freed and given to something else meanwhile. */
static void fd_drop(int *fd)
{
    pthread_mutex_lock(&live_mu);
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
    pthread_mutex_unlock(&live_mu);
}

static void live_add(struct moe_client *c)
{
    pthread_mutex_lock(&live_mu);
    c->next_live = live_clients;
    live_clients = c;
    pthread_mutex_unlock(&live_mu);
}

static void live_remove(struct moe_client *c)
{
    pthread_mutex_lock(&live_mu);
    for (struct moe_client **pp = &live_clients; *pp; pp = &(*pp)->next_live)
        if (*pp == c) {
            *pp = c->next_live;
            break;
        }
    pthread_mutex_unlock(&live_mu);
}

/* Whether c was connected by another process (this one is a fork since). */
static bool forked(const moe_client *c)
{
    return c->forks != atomic_load(&fork_count);
}

const char *moe_errmsg(void)
{
    return moe_err_buf;
}

const char *moe_strerror(int err)
{
    return status_strerror(err);
}

static int seterr(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int seterr(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(moe_err_buf, sizeof(moe_err_buf), fmt, ap);
    va_end(ap);
    return err;
}

/* What every call on a client of another process answers. */
static int refuse_forked(const moe_client *c)
{
    return seterr(-EINVAL, "this client was connected by process %d, of which this one is a "
                  "fork: a child connects anew (moe_connect)", (int)c->pid);
}

/* A pointer the call cannot do without is NULL. */
static int null_arg(const char *what)
{
    return seterr(-EINVAL, "%s is NULL", what);
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* The monotonic time timeout_ms from now (<0: never, UINT64_MAX). */
static uint64_t deadline_ms(int timeout_ms)
{
    return timeout_ms >= 0 ? mono_ms() + (uint64_t)timeout_ms : UINT64_MAX;
}

/* ---- session socket ---------------------------------------------------- */

static void kick_reader(moe_client *c);
static int session_gone(moe_client *c);

/* The session is over: the next call opens a new one. lost says why its
 * requests are lost where the daemon did not go away (NULL: it did).
 * Caller holds mu. */
static void session_over(moe_client *c, const char *lost)
{
    c->broken = true;
    c->lost = lost;
    kick_reader(c); /* the waiting threads learn it now */
    pthread_cond_broadcast(&c->cv);
}

/* Why a request of a session that ended is lost. Caller holds mu. */
static const char *lost_why(const moe_client *c)
{
    return c->lost ? c->lost : "the daemon stopped or restarted; the request is lost";
}

/* Wait on cv up to deadline (UINT64_MAX: for good). Caller holds mu. */
static void cv_wait_until(moe_client *c, uint64_t deadline)
{
    if (deadline == UINT64_MAX) {
        pthread_cond_wait(&c->cv, &c->mu);
        return;
    }
    uint64_t now = mono_ms(), left = deadline > now ? deadline - now : 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(left / 1000);
    ts.tv_nsec += (long)(left % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&c->cv, &c->mu, &ts);
}

/* Session calls that wait for their reply without mu (a region's create
 * and free, whose registration may take the daemon a while: it pins the
 * region; a reconnection, which registers every region again) claim the
 * session socket first: no other thread uses or replaces it meanwhile.
 * Another thread's claim is waited for up to the client's timeout (timed:
 * else for good): 0, or -ETIMEDOUT with nothing sent. Caller holds mu. */
static int session_claim(moe_client *c, bool timed)
{
    uint64_t deadline = timed ? deadline_ms(c->timeout_ms) : UINT64_MAX;
    while (c->session_busy) {
        if (mono_ms() >= deadline)
            return seterr(-ETIMEDOUT, "the client's session socket stayed busy for %d ms "
                          "(another thread's region registration or reconnection); nothing "
                          "was sent", c->timeout_ms);
        cv_wait_until(c, deadline);
    }
    c->session_busy = true;
    c->session_owner = pthread_self();
    return 0;
}

static void session_unclaim(moe_client *c)
{
    c->session_busy = false;
    pthread_cond_broadcast(&c->cv);
}

static bool session_claimed_here(const moe_client *c)
{
    return c->session_busy && pthread_equal(c->session_owner, pthread_self());
}

/* Send mh on sfd and wait up to timeout_ms for the reply, into buf: its
 * length (0: the daemon closed the socket), or -ETIMEDOUT, or -errno of
 * the send (*send_failed) or of the wait. Touches nothing of the client's.
 * EINTR is a signal of the caller's handlers, not news from the daemon. */
static ssize_t session_exchange(int sfd, const struct msghdr *mh, uint8_t *buf, size_t len,
                                int timeout_ms, bool *send_failed)
{
    ssize_t sent;
    *send_failed = false;
    while ((sent = sendmsg(sfd, mh, MSG_NOSIGNAL)) < 0 && errno == EINTR)
        ;
    if (sent < 0) {
        *send_failed = true;
        return -errno;
    }
    struct pollfd p = {sfd, POLLIN, 0};
    uint64_t deadline = deadline_ms(timeout_ms), now;
    int pr, wait = timeout_ms;
    while ((pr = poll(&p, 1, wait)) < 0 && errno == EINTR)
        if (deadline != UINT64_MAX) /* what is left of it */
            wait = (now = mono_ms()) < deadline ? (int)(deadline - now) : 0;
    if (pr < 0)
        return -errno;
    if (pr == 0)
        return -ETIMEDOUT;
    ssize_t r;
    while ((r = recv(sfd, buf, len, 0)) < 0 && errno == EINTR)
        ;
    return r < 0 ? -errno : r;
}

/* A daemon that refuses a session (too many sessions, shutting down) says
 * why before it closes: that answer beats "reset". Its error (set as the
 * thread's message), or 0 when no refusal is waiting on sfd. */
static int refusal(int sfd, uint8_t *buf, size_t len)
{
    ssize_t w = recv(sfd, buf, len, MSG_DONTWAIT);
    Moe__SessionReply *why = w > 0 ? moe__session_reply__unpack(NULL, (size_t)w, buf) : NULL;
    int err = 0;
    if (why && why->status != MOE__STATUS__STATUS_OK) {
        err = status_to_errno(why->status);
        seterr(err, "%s", why->message && why->message[0] ? why->message : status_strerror(err));
    }
    if (why)
        moe__session_reply__free_unpacked(why, NULL);
    return err;
}

/* One session request and its reply. Caller holds mu; unlocked: the
 * caller has claimed the session socket (session_claim), and the wait for
 * the reply releases mu, so that the client's other threads go on. */
static int session_call(moe_client *c, Moe__SessionRequest *req, int fd, bool unlocked,
                        Moe__SessionReply **out)
{
    uint8_t buf[4096];
    size_t n = moe__session_request__get_packed_size(req);
    if (n > sizeof(buf))
        return seterr(-EINVAL, "session message too large");
    moe__session_request__pack(req, buf);
    union {
        char raw[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cbuf;
    struct iovec iov = {buf, n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&cbuf, 0, sizeof(cbuf));
        mh.msg_control = cbuf.raw;
        mh.msg_controllen = sizeof(cbuf.raw);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    int timeout_ms = c->timeout_ms, sfd = c->sfd;
    bool send_failed;
    if (unlocked)
        pthread_mutex_unlock(&c->mu);
    ssize_t r = session_exchange(sfd, &mh, buf, sizeof(buf), timeout_ms, &send_failed);
    if (unlocked)
        pthread_mutex_lock(&c->mu);
    if (send_failed) {
        int e = (int)-r;
        bool gone = e == EPIPE || e == ECONNRESET || e == ENOTCONN;
        if (gone)
            (void)session_gone(c); /* an error there ends the session too */
        int why = gone ? refusal(c->sfd, buf, sizeof(buf)) : 0;
        if (why)
            return why;
        return seterr(gone ? -ECONNRESET : -e, "cannot reach the daemon: %s", strerror(e));
    }
    /* Session replies carry no id: one that comes late would answer the
     * next call. So the session ends here, and the next call opens a new one
     * (the daemon frees what the old one held). */
    if (r == -ETIMEDOUT) {
        session_over(c, "a session call timed out, which ends the session; the request is lost");
        return seterr(-ETIMEDOUT, "the daemon did not answer within %d ms", timeout_ms);
    }
    /* The daemon went away, or refused and closed, with this request
     * unread: the reset is reported before what was sent. The replies it
     * sent before it went are taken, and a refusal's answer is still there. */
    if (r == -ECONNRESET) {
        (void)session_gone(c);
        int why = refusal(c->sfd, buf, sizeof(buf));
        if (why)
            return why;
        return seterr(-ECONNRESET, "the daemon closed the session");
    }
    if (r < 0) {
        session_over(c, "a session call failed, which ends the session; the request is lost");
        return seterr((int)r, "waiting for the daemon: %s", strerror((int)-r));
    }
    if (r == 0) {
        (void)session_gone(c);
        return seterr(-ECONNRESET, "the daemon closed the session");
    }
    Moe__SessionReply *rep = moe__session_reply__unpack(NULL, (size_t)r, buf);
    if (!rep) {
        session_over(c, "a session reply was malformed, which ends the session; the request is "
                        "lost");
        return seterr(-EPROTO, "malformed session reply");
    }
    if (rep->status != MOE__STATUS__STATUS_OK) {
        int e = status_to_errno(rep->status);
        seterr(e, "%s", rep->message && rep->message[0] ? rep->message : status_strerror(e));
        moe__session_reply__free_unpacked(rep, NULL);
        return e;
    }
    *out = rep;
    return 0;
}

/* ---- connection -------------------------------------------------------- */

static int default_runtime_dir(char *buf, size_t len)
{
    const char *env = getenv("MOED_RUNTIME_DIR");
    if (env && env[0])
        return snprintf(buf, len, "%s", env) < (int)len ? 0 : -ENAMETOOLONG;
    if (geteuid() == 0)
        return snprintf(buf, len, "/run/moed") < (int)len ? 0 : -ENAMETOOLONG;
    env = getenv("XDG_RUNTIME_DIR");
    if (env && env[0])
        return snprintf(buf, len, "%s/moed", env) < (int)len ? 0 : -ENAMETOOLONG;
    return snprintf(buf, len, "/tmp/moed-%u", (unsigned)geteuid()) < (int)len ? 0 : -ENAMETOOLONG;
}

void moe_set_timeout(moe_client *c, int timeout_ms)
{
    if (!c || forked(c))
        return;
    pthread_mutex_lock(&c->mu);
    c->timeout_ms = timeout_ms;
    pthread_mutex_unlock(&c->mu);
}

void moe_set_spin_us(moe_client *c, unsigned spin_us)
{
    if (!c || forked(c))
        return;
    pthread_mutex_lock(&c->mu);
    c->spin_us = spin_us;
    pthread_mutex_unlock(&c->mu);
}

void moe_set_spin_ahead_us(moe_client *c, unsigned ahead_us)
{
    if (!c || forked(c))
        return;
    pthread_mutex_lock(&c->mu);
    c->spin_ahead_us = ahead_us;
    pthread_mutex_unlock(&c->mu);
}

/* Drop the pending list, but for the replies that came where keep_replies. */
static void pending_clear(moe_client *c, bool keep_replies)
{
    for (struct pending **pp = &c->pending; *pp;) {
        struct pending *p = *pp;
        if (keep_replies && p->reply) {
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        if (p->reply)
            moe__reply__free_unpacked(p->reply, NULL);
        free(p);
    }
}

/* Close the sockets of the current connection (not the regions); a thread
 * asleep on them is woken to notice. The replies that came stay for their
 * waits where keep_replies (a reconnection), the marks of given-up requests
 * go with the connection. */
static void connection_close(moe_client *c, bool keep_replies)
{
    kick_reader(c);
    if (c->zsock)
        zmq_close(c->zsock);
    c->zsock = NULL;
    fd_drop(&c->sfd);
    fd_drop(&c->rfd);
    pending_clear(c, keep_replies);
}

static int region_register(moe_client *c, struct moe_region *r, bool unlocked);
static int session_socket_ready(moe_client *c);

/* Open the session socket, say OpenSession, connect the request socket and
 * register the regions the client already holds. Caller owns c alone, or
 * holds mu and has claimed the session socket (unlocked: the waits for
 * the daemon's replies release mu, so that the client's other threads go
 * on; c->broken keeps them off the connection until it is done). */
static int connection_open(moe_client *c, bool unlocked)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/moed.sock", c->dir) >= (int)sizeof(sa.sun_path))
        return seterr(-ENAMETOOLONG, "runtime directory path too long for a socket");
    /* Not through a directory where someone could pose as moed and take
     * the regions' memfds; a missing one is "is moed running?" below. */
    char why[512];
    int rc = rundir_check(c->dir, why, sizeof(why));
    if (rc < 0 && rc != -ENOENT)
        return seterr(rc, "%s", why);
    pthread_mutex_lock(&live_mu);
    c->sfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int serr = errno;
    pthread_mutex_unlock(&live_mu);
    if (c->sfd < 0)
        return seterr(-serr, "socket: %s", strerror(serr));
    /* Not blocking: a daemon that has stopped accepting (hung) fills its
     * backlog, and a blocking connect would then wait for good. EAGAIN
     * says the backlog is full: tried again every 2 ms up to the client's
     * timeout, with mu released where unlocked (the claim keeps sfd ours). */
    uint64_t deadline = deadline_ms(c->timeout_ms);
    int sfd = c->sfd;
    while ((rc = connect(sfd, (struct sockaddr *)&sa, sizeof(sa))) < 0 &&
           (errno == EINTR || (errno == EAGAIN && mono_ms() < deadline)))
        if (errno == EAGAIN) {
            if (unlocked)
                pthread_mutex_unlock(&c->mu);
            nanosleep(&(struct timespec){0, 2000000}, NULL);
            if (unlocked)
                pthread_mutex_lock(&c->mu);
        }
    if (rc < 0) {
        int e = errno;
        if (e == EAGAIN)
            return seterr(-ETIMEDOUT, "%s accepted no connection within %d ms (its backlog is "
                          "full: is moed hung?)", sa.sun_path, c->timeout_ms);
        return seterr(e == ENOENT || e == ECONNREFUSED ? -ECONNREFUSED : -e,
                      "cannot connect to %s: %s%s", sa.sun_path, strerror(e),
                      e == ENOENT || e == ECONNREFUSED ? " (is moed running?)" : "");
    }
    int sfl = fcntl(c->sfd, F_GETFL);
    if (sfl < 0 || fcntl(c->sfd, F_SETFL, sfl & ~O_NONBLOCK) < 0)
        return seterr(-errno, "fcntl: %s", strerror(errno));
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__OpenSession open = MOE__OPEN_SESSION__INIT;
    open.protocol_version = MOE_PROTOCOL_VERSION;
    open.client_name = c->name;
    req.body_case = MOE__SESSION_REQUEST__BODY_OPEN;
    req.open = &open;
    /* The reply socket: this end for us, the other for the daemon. */
    int sv[2];
    pthread_mutex_lock(&live_mu);
    if (c->want_rfd && socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0) {
        c->rfd = sv[0];
        c->rpeer = sv[1];
        open.reply_socket = true;
    }
    pthread_mutex_unlock(&live_mu);
    Moe__SessionReply *rep = NULL;
    rc = session_call(c, &req, c->rpeer, unlocked, &rep);
    fd_drop(&c->rpeer); /* the daemon has its own now, or none */
    if (rc < 0)
        return rc;
    if (rep->token.len != sizeof(c->token) || !rep->request_endpoint) {
        moe__session_reply__free_unpacked(rep, NULL);
        return seterr(-EPROTO, "daemon sent no session token");
    }
    memcpy(c->token, rep->token.data, rep->token.len);
    c->token_len = rep->token.len;
    c->session_id = rep->session_id;
    c->socket_requests = c->rfd >= 0 && rep->socket_requests && c->want_socket_requests;
    c->max_message = rep->max_message_bytes;
    char endpoint[PATH_MAX + 16];
    snprintf(endpoint, sizeof(endpoint), "%s", rep->request_endpoint);
    moe__session_reply__free_unpacked(rep, NULL);

    c->zsock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->zsock)
        return seterr(-ENOMEM, "cannot create a ZeroMQ socket");
    int linger = 0;
    zmq_setsockopt(c->zsock, ZMQ_LINGER, &linger, sizeof(linger));
    /* EINTR: libzmq looks at its command pipe before it does anything, and
     * a signal landed there. */
    while ((rc = zmq_connect(c->zsock, endpoint)) < 0 && zmq_errno() == EINTR)
        ;
    if (rc < 0)
        return seterr(-zmq_errno(), "cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
    size_t fl = sizeof(c->zfd);
    if (zmq_getsockopt(c->zsock, ZMQ_FD, &c->zfd, &fl) < 0)
        return seterr(-zmq_errno(), "ZMQ_FD: %s", zmq_strerror(zmq_errno()));
    /* The list holds still: its changes (a region's create and free) wait
     * for the claim. */
    for (struct moe_region *r = c->regions; r; r = r->next)
        if ((rc = region_register(c, r, unlocked)) < 0)
            return rc;
    /* Marks of given-up requests belong to the connection before, whose
     * replies can no longer come; those left while this one was being
     * opened (its waits release mu) go now, not with the next. */
    for (struct pending **pp = &c->pending; *pp;) {
        struct pending *p = *pp;
        if (p->reply) {
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        free(p);
    }
    c->generation++;
    c->broken = false;
    return 0;
}

/* Make sure the connection is usable: reconnect after the daemon went
 * away, with the session socket claimed (a region's create has claimed it
 * already). A thread that finds another's claim waits for it up to the
 * client's timeout. Caller holds mu. */
static int connection_ensure(moe_client *c)
{
    if (!c->broken && c->sfd >= 0) {
        /* A closed session socket means the daemon stopped or restarted:
         * the replies it sent before are collected, as a waiting thread
         * would have, before the sockets close. */
        struct pollfd p = {c->sfd, POLLIN, 0};
        if (poll(&p, 1, 0) == 1)
            (void)session_socket_ready(c); /* an error there ends the session too */
    }
    if (!c->broken)
        return 0;
    bool claimed = session_claimed_here(c);
    int rc = claimed ? 0 : session_claim(c, true);
    if (rc < 0)
        return rc;
    if (c->broken) { /* else another thread reconnected meanwhile */
        connection_close(c, true);
        rc = connection_open(c, true);
        if (rc < 0)
            connection_close(c, true);
        c->broken = rc < 0;
    }
    if (!claimed)
        session_unclaim(c);
    return rc;
}

int moe_connect(const char *runtime_dir, const char *client_name, moe_client **out)
{
    moe_err_buf[0] = '\0';
    if (!out)
        return null_arg("out");
    *out = NULL;
    pthread_once(&fork_watch_once, fork_watch);
    moe_client *c = calloc(1, sizeof(*c));
    if (!c)
        return seterr(-ENOMEM, "out of memory");
    c->pid = getpid();
    c->serial = atomic_fetch_add(&client_serials, 1) + 1;
    c->forks = atomic_load(&fork_count);
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    c->timeout_ms = 60000;
    c->sfd = -1;
    c->rfd = -1;
    c->rpeer = -1;
    live_add(c); /* a fork from now on closes the child's copies of its sockets */
    /* Compute replies on a reply socket unless MOE_REPLIES=zmq (for
     * measuring the difference). */
    const char *rp = getenv("MOE_REPLIES");
    c->want_rfd = !(rp && !strcmp(rp, "zmq"));
    /* Compute requests on it too unless MOE_REQUESTS=zmq. */
    const char *rq = getenv("MOE_REQUESTS");
    c->want_socket_requests = !(rq && !strcmp(rq, "zmq"));
    snprintf(c->name, sizeof(c->name), "%s", client_name ? client_name : "");
    int rc = 0;
    if (runtime_dir && runtime_dir[0])
        snprintf(c->dir, sizeof(c->dir), "%s", runtime_dir);
    else if (default_runtime_dir(c->dir, sizeof(c->dir)) < 0)
        rc = seterr(-ENAMETOOLONG, "runtime directory path too long");
    if (!rc && c->wake_fd < 0)
        rc = seterr(-errno, "eventfd: %s", strerror(errno));
    c->zctx = rc ? NULL : zmq_ctx_new();
    if (!rc && !c->zctx)
        rc = seterr(-ENOMEM, "cannot create a ZeroMQ context");
    if (!rc)
        rc = connection_open(c, false);
    if (rc) {
        moe_disconnect(&c);
        return rc;
    }
    *out = c;
    return 0;
}

static void region_unmap(struct moe_region *r)
{
    munmap(r->base, r->size);
    close(r->fd);
    free(r);
}

void moe_disconnect(moe_client **cp)
{
    if (!cp)
        return;
    moe_client *c = *cp;
    *cp = NULL;
    if (!c)
        return;
    /* In a fork, this process's copies go: the sockets were closed at the
     * fork (on_fork_child), the parent's session is not told, and libzmq's
     * objects, whose threads are not in this process, and mu, which one of
     * them may hold, are left as they are. */
    bool mine = !forked(c);
    if (mine) {
        connection_close(c, false); /* its sockets first: see fd_drop() */
        live_remove(c);
        if (c->zctx)
            while (zmq_ctx_term(c->zctx) < 0 && zmq_errno() == EINTR)
                ; /* interrupted by a signal of the caller's: it can be restarted */
    } else {
        pending_clear(c, false);
    }
    while (c->regions) {
        struct moe_region *r = c->regions;
        c->regions = r->next;
        region_unmap(r);
    }
    if (c->wake_fd >= 0)
        close(c->wake_fd);
    if (mine) {
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
    }
    free(c);
}

/* ---- request channel --------------------------------------------------- */

/* The reading thread sleeps on the sockets without mu: after touching the
 * ZeroMQ socket (which may take in what ZMQ_FD would have signalled), wake
 * it to look again. Caller holds mu. */
static void kick_reader(moe_client *c)
{
    if (c->reading) {
        uint64_t one = 1;
        ssize_t w = write(c->wake_fd, &one, sizeof(one));
        (void)w; /* EAGAIN: the counter is already set, it wakes anyway */
    }
}

/* Pack and send; caller holds c->mu. Fills req->id, req->token. A compute
 * request goes on the reply socket where the daemon reads it there (its
 * loop wakes on it directly), unless the socket is full: then, like every
 * other request, by ZeroMQ. Its reply may come on either. */
static int send_request(moe_client *c, Moe__Request *req, bool compute)
{
    req->id = ++c->next_id;
    req->token.data = c->token;
    req->token.len = c->token_len;
    size_t n = moe__request__get_packed_size(req);
    /* ZeroMQ would drop a larger one with the connection, unanswered: the
     * call would wait out its timeout for nothing. */
    if (c->max_message && n > c->max_message)
        return seterr(-EDQUOT, "the request packs to %zu bytes, over the daemon's "
                      "max_message_bytes (%llu)", n, (unsigned long long)c->max_message);
    if (compute && c->socket_requests && n <= 4096) {
        uint8_t buf[4096];
        moe__request__pack(req, buf);
        if (send(c->rfd, buf, n, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)n)
            return 0;
        /* EAGAIN: full; anything else: the daemon is going away, which
         * the session socket tells. Either way ZeroMQ takes it. */
    }
    zmq_msg_t msg;
    if (zmq_msg_init_size(&msg, n) != 0)
        return seterr(-ENOMEM, "out of memory");
    moe__request__pack(req, zmq_msg_data(&msg));
    /* A daemon that stops reading lets ZeroMQ's queue fill (1000
     * messages); a send then waits for room up to the client's timeout, in
     * slices with mu released, so that the other threads go on (polling
     * ZMQ_FD, not the socket, which is only used under mu). A connection
     * replaced meanwhile makes this request's token and region ids stale:
     * it is not sent. */
    uint64_t deadline = deadline_ms(c->timeout_ms);
    unsigned gen = c->generation;
    for (;;) {
        int sent = zmq_msg_send(&msg, c->zsock, ZMQ_DONTWAIT);
        int e = zmq_errno();
        kick_reader(c); /* the call took in ZeroMQ's commands, sent or not */
        if (sent >= 0)
            return 0;
        if (e == EINTR) /* a signal of the caller's landed first; nothing was sent */
            continue;
        uint64_t now = mono_ms();
        if (e != EAGAIN || now >= deadline) {
            zmq_msg_close(&msg);
            if (e == EAGAIN)
                return seterr(-ETIMEDOUT, "the daemon took no request within %d ms (it "
                              "has stopped reading them)", c->timeout_ms);
            return seterr(-e, "cannot send to the daemon: %s", zmq_strerror(e));
        }
        struct pollfd p = {c->zfd, POLLIN, 0};
        pthread_mutex_unlock(&c->mu);
        poll(&p, 1, deadline - now > 10 ? 10 : (int)(deadline - now));
        pthread_mutex_lock(&c->mu);
        if (c->generation != gen || c->broken || !c->zsock) {
            zmq_msg_close(&msg);
            return seterr(-ECONNRESET, "%s", lost_why(c));
        }
    }
}

/* Take the reply for id from the pending list, or NULL. Caller holds mu. */
static Moe__Reply *pending_take(moe_client *c, uint64_t id)
{
    for (struct pending **pp = &c->pending; *pp; pp = &(*pp)->next)
        if ((*pp)->id == id && (*pp)->reply) {
            struct pending *p = *pp;
            *pp = p->next;
            Moe__Reply *r = p->reply;
            free(p);
            return r;
        }
    return NULL;
}

/* Stop waiting for id, a request of connection gen: drop its reply if it
 * has come, else, on the current connection, leave a mark so that
 * pending_add drops it when it comes (it would stay in the list for good).
 * A request of an earlier connection gets no reply any more: no mark.
 * Caller holds mu. */
static void give_up_locked(moe_client *c, uint64_t id, unsigned gen)
{
    Moe__Reply *r = pending_take(c, id);
    if (r) {
        moe__reply__free_unpacked(r, NULL);
    } else if (gen == c->generation) {
        struct pending *p = malloc(sizeof(*p));
        if (p) { /* else the reply, when it comes, stays in the list */
            *p = (struct pending){.id = id, .next = c->pending};
            c->pending = p;
        }
    }
}

static void give_up(moe_client *c, uint64_t id, unsigned gen)
{
    pthread_mutex_lock(&c->mu);
    give_up_locked(c, id, gen);
    pthread_mutex_unlock(&c->mu);
}

/* Keep the packed Reply of n bytes for whoever waits on its id. Caller
 * holds mu. 1 if it answers stop_id, else 0 (also for bytes that are not a
 * Reply: nobody waits on them), or -errno. */
static int pending_add(moe_client *c, const void *buf, size_t n, uint64_t stop_id)
{
    Moe__Reply *rep = moe__reply__unpack(NULL, n, buf);
    if (!rep)
        return 0;
    /* An id never issued answers nobody; kept, it would stay in the list,
     * or answer a later request of that id. */
    if (rep->id == 0 || rep->id > c->next_id) {
        moe__reply__free_unpacked(rep, NULL);
        return 0;
    }
    for (struct pending **pp = &c->pending; *pp; pp = &(*pp)->next)
        if ((*pp)->id == rep->id && !(*pp)->reply) { /* given up on */
            struct pending *gone = *pp;
            *pp = gone->next;
            free(gone);
            moe__reply__free_unpacked(rep, NULL);
            return 0;
        }
    struct pending *p = malloc(sizeof(*p));
    if (!p) {
        moe__reply__free_unpacked(rep, NULL);
        return seterr(-ENOMEM, "out of memory");
    }
    p->id = rep->id;
    p->reply = rep;
    p->next = c->pending;
    c->pending = p;
    pthread_cond_broadcast(&c->cv); /* for the threads that wait on it */
    return stop_id && p->id == stop_id;
}

/* Move the replies the daemon pushed on the reply socket into the pending
 * list. Caller holds mu. 1 if stop_id's reply came, else 0 (end of file
 * too: the session socket is what tells that the daemon went away), or
 * -errno. */
static int receive_pushed(moe_client *c, uint64_t stop_id)
{
    int found = 0;
    bool reset = false;
    for (;;) {
        uint8_t buf[4096];
        ssize_t r = recv(c->rfd, buf, sizeof(buf), MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return found;
        /* ECONNRESET (closed with requests of ours unread) is reported once,
         * before the replies that came ahead of the close: read on. */
        if (r < 0 && errno == ECONNRESET && !reset) {
            reset = true;
            continue;
        }
        /* End of file: the daemon closed this socket, or went away, which
         * the session socket tells. Either way requests and replies go by
         * ZeroMQ from now on, and a socket that polls as hung up forever is
         * no longer polled. */
        if (r == 0 || (r < 0 && errno == ECONNRESET)) {
            fd_drop(&c->rfd);
            c->socket_requests = false;
            return found;
        }
        if (r < 0)
            return seterr(-errno, "reply socket: %s", strerror(errno));
        int rc = pending_add(c, buf, (size_t)r, stop_id);
        if (rc < 0)
            return rc;
        found |= rc;
    }
}

/*
 * Move the replies that have arrived (reply socket, then ZeroMQ) into the
 * pending list, until the sockets say EAGAIN or (stop_id != 0) the reply to
 * stop_id is taken. Caller holds mu. 1 if stop_id's reply came, else 0, or
 * -errno.
 *
 * ZMQ_FD only signals edges: a receive that returns EAGAIN has consumed the
 * socket's pending commands, so only after one may the caller sleep on the
 * fd. Receiving until EAGAIN is also what ZMQ_EVENTS would cost (libzmq
 * looks at its command pipe either way), without the second look.
 */
static int receive_ready(moe_client *c, uint64_t stop_id)
{
    if (c->rfd >= 0) {
        int rc = receive_pushed(c, stop_id);
        if (rc)
            return rc;
    }
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, c->zsock, ZMQ_DONTWAIT) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&msg);
            /* EINTR is not "nothing there": a reply may be, and ZMQ_FD,
             * edge-triggered, would not wake the poll for it. */
            if (e == EINTR)
                continue;
            return 0;
        }
        int rc = pending_add(c, zmq_msg_data(&msg), zmq_msg_size(&msg), stop_id);
        zmq_msg_close(&msg);
        if (rc)
            return rc;
    }
}

/* The daemon went away: take the replies it sent before, still on their way
 * through ZeroMQ, until none has come for 100 ms. A signal only shortens
 * one wait, not the quiet time. Caller holds mu. 0 or -errno. */
static int drain_last_replies(moe_client *c)
{
    zmq_pollitem_t z = {c->zsock, 0, ZMQ_POLLIN, 0};
    uint64_t quiet_end = mono_ms() + 100;
    for (;;) {
        uint64_t now = mono_ms();
        if (now >= quiet_end)
            return 0;
        int n = zmq_poll(&z, 1, (long)(quiet_end - now));
        if (n < 0 && zmq_errno() == EINTR)
            continue;
        if (n <= 0)
            return 0;
        int rc = receive_ready(c, 0);
        if (rc < 0)
            return rc;
        quiet_end = mono_ms() + 100;
    }
}

/* The daemon went away: take the replies it sent before (what the sockets
 * hold now, the reply socket's included, then what is still on its way
 * through ZeroMQ) and end the session, whichever call noticed. Caller
 * holds mu. 0 or -errno (the session ends either way). */
static int session_gone(moe_client *c)
{
    int rc = 0;
    if (c->zsock) { /* else no request was sent yet (OpenSession) */
        rc = receive_ready(c, 0);
        if (rc >= 0)
            rc = drain_last_replies(c);
    }
    session_over(c, NULL);
    return rc < 0 ? rc : 0;
}

/* The session socket became readable: at its end (the daemon went away),
 * take the replies it sent before and end the session. Caller holds mu. 0
 * or -errno. */
static int session_socket_ready(moe_client *c)
{
    char b;
    ssize_t n = recv(c->sfd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
        return session_gone(c);
    return 0;
}

/* Receive whatever has arrived into the pending list without waiting
 * (moe_poll). The reply socket wakes the reader with pushed replies; the
 * session socket only becomes readable (EOF) when the daemon goes away,
 * which is why it is polled too. Caller holds mu. */
static int receive_some(moe_client *c)
{
    if (c->broken || !c->zsock)
        return seterr(-ECONNRESET, "%s", lost_why(c));
    int rc = receive_ready(c, 0);
    kick_reader(c);
    if (rc)
        return rc < 0 ? rc : 0;
    struct pollfd p = {c->sfd, POLLIN, 0};
    if (poll(&p, 1, 0) == 1 && (rc = session_socket_ready(c)) < 0)
        return rc;
    return 0;
}

/* As the reading thread: receive what has arrived; if nothing has, sleep
 * on the sockets up to wait_us without mu, then receive. Caller holds mu
 * (released and taken again). 0 or -errno. */
static int read_sockets(moe_client *c, uint64_t id, uint64_t wait_us)
{
    int rc = receive_ready(c, id);
    if (rc)
        return rc < 0 ? rc : 0;
    struct pollfd p[4] = {{c->zfd, POLLIN, 0}, {c->sfd, POLLIN, 0}, {c->wake_fd, POLLIN, 0},
                          {c->rfd, POLLIN, 0}};
    unsigned gen = c->generation;
    int nfds = c->rfd >= 0 ? 4 : 3;
    pthread_mutex_unlock(&c->mu);
    struct timespec ts = {(time_t)(wait_us / 1000000u), (long)(wait_us % 1000000u) * 1000};
    int n = ppoll(p, (nfds_t)nfds, &ts, NULL);
    int e = errno;
    pthread_mutex_lock(&c->mu);
    if (n < 0 && e != EINTR)
        return seterr(-e, "poll: %s", strerror(e));
    if (gen != c->generation || c->broken || !c->zsock)
        return 0; /* replaced meanwhile: the caller sees it */
    if (p[2].revents) {
        uint64_t v;
        ssize_t r = read(c->wake_fd, &v, sizeof(v));
        (void)r;
    }
    if (p[1].revents && (rc = session_socket_ready(c)) < 0)
        return rc;
    if (c->broken)
        return 0;
    rc = receive_ready(c, id);
    return rc < 0 ? rc : 0;
}

/* Wait for the reply to id, sent on connection gen (at sent_us, for a
 * compute request; else 0). timeout_ms < 0: forever. On success *out is
 * the reply (caller frees) whatever its status. A connection that another
 * thread replaced meanwhile lost it. */
static int wait_reply(moe_client *c, uint64_t id, unsigned gen, uint64_t sent_us, int timeout_ms,
                      Moe__Reply **out)
{
    uint64_t deadline = deadline_ms(timeout_ms);
    pthread_mutex_lock(&c->mu);
    uint64_t spin_end = c->spin_us ? mono_us() + c->spin_us : 0;
    /* moe_set_spin_ahead_us: busy-poll from ahead before the time a
     * compute reply has been taking to ahead after it; sleep outside. */
    uint64_t win_lo = 0, win_hi = 0, ahead = c->spin_ahead_us;
    if (sent_us && ahead && c->rt_us) {
        win_lo = sent_us + (c->rt_us > ahead ? c->rt_us - ahead : 0);
        win_hi = sent_us + c->rt_us + ahead;
    }
    Moe__Reply *rep = NULL;
    int rc = 0;
    bool tried = false, waited = false;
    for (;; tried = true) {
        /* A reply that came stands, even when the connection broke or was
         * replaced since (the replies sent before the daemon went are
         * collected; ids are not reused). */
        if ((rep = pending_take(c, id)) != NULL)
            break;
        waited = tried; /* the first pass only looks: not there yet */
        if (gen != c->generation || c->broken || !c->zsock) {
            rc = seterr(-ECONNRESET, "%s", lost_why(c));
            break;
        }
        /* One clock read a pass (this loop spins): ms for the deadline. */
        const uint64_t now_u = mono_us(), now = now_u / 1000;
        if (tried && now >= deadline) {
            rc = seterr(-ETIMEDOUT, "no reply from the daemon within %d ms", timeout_ms);
            break;
        }
        if (c->reading) {
            cv_wait_until(c, deadline); /* another thread reads; its news comes on cv */
            continue;
        }
        /* Spinning: no sleep. Else up to the deadline, at most 1 s at a
         * time (a missed edge costs no more), and not past the window's
         * start. */
        uint64_t wait = now >= deadline ? 0 : 1000 * (deadline - now > 1000 ? 1000 : deadline - now);
        const bool in_window = now_u >= win_lo && now_u < win_hi;
        if ((spin_end && now_u < spin_end) || in_window || !tried)
            wait = 0;
        else if (now_u < win_lo && win_lo - now_u < wait)
            wait = win_lo - now_u;
        c->reading = true;
        rc = read_sockets(c, id, wait);
        c->reading = false;
        pthread_cond_broadcast(&c->cv); /* the next may read */
        if (rc < 0)
            break;
        if (in_window) {
            /* Many clients may spin at once, on fewer cores than they
             * are: each pass lets the daemon's threads (and the rest) run. */
            pthread_mutex_unlock(&c->mu);
            sched_yield();
            pthread_mutex_lock(&c->mu);
        }
    }
    /* A compute reply that was waited for times the round trip (one
     * already here, or in the sockets, when the wait began says nothing of
     * it). */
    if (rep && sent_us && waited) {
        uint64_t rt = mono_us() - sent_us;
        c->rt_us = c->rt_us ? (3 * c->rt_us + rt) / 4 : rt;
    }
    /* A failure other than the timeout (which the caller may wait past)
     * ends the wait for good: a reply that comes later is dropped. */
    if (rc && rc != -ETIMEDOUT)
        give_up_locked(c, id, gen);
    pthread_mutex_unlock(&c->mu);
    if (rc)
        return rc;
    *out = rep;
    return 0;
}

/* A reply's status as an error code, with the daemon's message. */
static int reply_status(const Moe__Reply *rep)
{
    if (rep->status == MOE__STATUS__STATUS_OK) {
        moe_err_buf[0] = '\0';
        return 0;
    }
    int e = status_to_errno(rep->status);
    return seterr(e, "%s", rep->message && rep->message[0] ? rep->message : status_strerror(e));
}

/* Send req and wait for its reply (kept in *out on success if out !=
 * NULL). fill(req, arg), if given, completes req under the same hold of mu
 * as the connection check and the send: what names regions by id, since
 * a reconnection gives them new ids. */
static int call_filled(moe_client *c, Moe__Request *req,
                       int (*fill)(moe_client *, Moe__Request *, const void *), const void *arg,
                       Moe__Reply **out)
{
    if (forked(c))
        return refuse_forked(c);
    pthread_mutex_lock(&c->mu);
    int rc = connection_ensure(c);
    if (!rc && fill)
        rc = fill(c, req, arg);
    if (!rc)
        rc = send_request(c, req, false);
    unsigned gen = c->generation;
    int timeout_ms = c->timeout_ms;
    pthread_mutex_unlock(&c->mu);
    if (rc)
        return rc;
    Moe__Reply *rep = NULL;
    if ((rc = wait_reply(c, req->id, gen, 0, timeout_ms, &rep)) < 0) {
        if (rc == -ETIMEDOUT)
            give_up(c, req->id, gen);
        return rc;
    }
    rc = reply_status(rep);
    if (rc || !out)
        moe__reply__free_unpacked(rep, NULL);
    else
        *out = rep;
    return rc;
}

static int call(moe_client *c, Moe__Request *req, Moe__Reply **out)
{
    return call_filled(c, req, NULL, NULL, out);
}

static int hello(moe_client *c, Moe__Reply **rep)
{
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__Hello h = MOE__HELLO__INIT;
    h.protocol_version = MOE_PROTOCOL_VERSION;
    req.body_case = MOE__REQUEST__BODY_HELLO;
    req.hello = &h;
    return call(c, &req, rep);
}

static void device_info(const Moe__DeviceInfo *d, moe_device_info *out)
{
    *out = (moe_device_info){.memory_bytes = d->memory_bytes, .compute_units = d->compute_units};
    snprintf(out->name, sizeof(out->name), "%s", d->name);
}

int moe_devices(moe_client *c, moe_device_info *out, int max)
{
    if (!c)
        return null_arg("the client");
    if (max < 0 || (max > 0 && !out))
        return seterr(-EINVAL, "moe_devices: room for %d devices%s", max,
                      max < 0 ? "" : " at NULL");
    Moe__Reply *rep = NULL;
    int rc = hello(c, &rep);
    if (rc)
        return rc;
    int n = 0;
    if (rep->body_case == MOE__REPLY__BODY_HELLO) {
        Moe__HelloReply *hr = rep->hello;
        n = hr->n_devices > INT_MAX ? INT_MAX : (int)hr->n_devices;
        for (int i = 0; i < n && i < max; i++)
            device_info(hr->devices[i], &out[i]);
    }
    moe__reply__free_unpacked(rep, NULL);
    return n;
}

int moe_hello(moe_client *c, moe_server_info *info)
{
    if (!c)
        return null_arg("the client");
    Moe__Reply *rep = NULL;
    int rc = hello(c, &rep);
    if (rc)
        return rc;
    if (info && rep->body_case == MOE__REPLY__BODY_HELLO) {
        Moe__HelloReply *hr = rep->hello;
        memset(info, 0, sizeof(*info));
        info->protocol_version = hr->protocol_version;
        snprintf(info->server_version, sizeof(info->server_version), "%s", hr->server_version);
        snprintf(info->backend, sizeof(info->backend), "%s", hr->backend);
        for (size_t i = 0; i < hr->n_devices && i < sizeof(info->devices) / sizeof(info->devices[0]); i++)
            device_info(hr->devices[i], &info->devices[info->n_devices++]);
        info->max_message_bytes = hr->max_message_bytes;
        info->max_batch_tokens = hr->max_batch_tokens;
        size_t o = 0;
        for (size_t i = 0; i < hr->n_capabilities && o < sizeof(info->capabilities); i++)
            o += (size_t)snprintf(info->capabilities + o, sizeof(info->capabilities) - o, "%s%s",
                                  i ? "," : "", hr->capabilities[i]);
    }
    moe__reply__free_unpacked(rep, NULL);
    return 0;
}

/* ---- regions ----------------------------------------------------------- */

/* Pass the region's memfd to the daemon; sets r->id. Caller holds mu. */
static int region_register(moe_client *c, struct moe_region *r, bool unlocked)
{
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__RegisterRegion reg = MOE__REGISTER_REGION__INIT;
    reg.size = r->size;
    reg.name = r->name;
    req.body_case = MOE__SESSION_REQUEST__BODY_REGISTER_REGION;
    req.register_region = &reg;
    Moe__SessionReply *rep = NULL;
    int rc = session_call(c, &req, r->fd, unlocked, &rep);
    if (!rc) {
        r->id = rep->region;
        moe__session_reply__free_unpacked(rep, NULL);
    }
    return rc;
}

int moe_region_create(moe_client *c, size_t size, const char *name, moe_region **out)
{
    if (!out)
        return null_arg("out");
    *out = NULL;
    if (!c)
        return null_arg("the client");
    if (forked(c))
        return refuse_forked(c);
    if (size == 0)
        return seterr(-EINVAL, "a region needs at least one byte");
    /* ftruncate takes a signed size: SIZE_MAX would be -1, "Invalid argument". */
    if (size > (size_t)INT64_MAX)
        return seterr(-EFBIG, "a region of %zu bytes is larger than a file can be", size);
    moe_region *r = calloc(1, sizeof(*r));
    if (!r)
        return seterr(-ENOMEM, "out of memory");
    snprintf(r->name, sizeof(r->name), "%s", name && name[0] ? name : "moe-region");
    r->fd = memfd_create(r->name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (r->fd < 0) {
        int e = -errno;
        free(r);
        return seterr(e, "memfd_create: %s", strerror(-e));
    }
    int rc = 0;
    if (ftruncate(r->fd, (off_t)size) < 0 ||
        fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
        rc = seterr(-errno, "cannot size and seal a region of %zu bytes: %s", size,
                    strerror(errno));
        close(r->fd);
        free(r);
        return rc;
    }
    r->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
    if (r->base == MAP_FAILED) {
        rc = seterr(-errno, "cannot map a region of %zu bytes: %s", size, strerror(errno));
        close(r->fd);
        free(r);
        return rc;
    }
    r->size = size;
    pthread_mutex_lock(&c->mu);
    bool claimed = (rc = session_claim(c, true)) == 0;
    if (!rc)
        rc = connection_ensure(c);
    if (!rc)
        rc = region_register(c, r, true);
    if (!rc) {
        r->next = c->regions;
        c->regions = r;
    }
    if (claimed)
        session_unclaim(c);
    pthread_mutex_unlock(&c->mu);
    if (rc) {
        region_unmap(r);
        return rc;
    }
    *out = r;
    return 0;
}

/* Whether r is one of c's regions, found by its address alone (a handle
 * freed already is not read). Caller holds mu. */
static bool region_of(const moe_client *c, const moe_region *r)
{
    for (const struct moe_region *q = c->regions; q; q = q->next)
        if (q == r)
            return true;
    return false;
}

/* Take r off c's list; false where it was not on it. Caller holds mu (or
 * is a fork's only user of c). */
static bool region_unlink(moe_client *c, const moe_region *r)
{
    for (moe_region **pp = &c->regions; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            return true;
        }
    return false;
}

static int not_this_clients_region(void)
{
    return seterr(-EINVAL, "the region is not one of this client's (another client's, or freed "
                  "already)");
}

int moe_region_free(moe_client *c, moe_region **rp)
{
    moe_region *r = rp ? *rp : NULL;
    if (!r)
        return 0;
    if (!c)
        return null_arg("the client");
    if (forked(c)) { /* this process's mapping only: the parent's stays registered */
        if (!region_unlink(c, r))
            return not_this_clients_region();
        *rp = NULL;
        region_unmap(r);
        return 0;
    }
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__UnregisterRegion un = MOE__UNREGISTER_REGION__INIT;
    req.body_case = MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION;
    req.unregister_region = &un;
    Moe__SessionReply *rep = NULL;
    pthread_mutex_lock(&c->mu);
    /* For good: the region has to leave the list, which only the claim's
     * holder may change (another's wait is bounded by its timeout). */
    session_claim(c, false);
    /* Another client's region (or one freed already, through a copy of
     * its handle) is left alone: unmapping it would pull the memory from
     * under its owner, which still lists it. */
    if (!region_of(c, r)) {
        session_unclaim(c);
        pthread_mutex_unlock(&c->mu);
        return not_this_clients_region();
    }
    *rp = NULL;
    un.region = r->id; /* claimed: a reconnection (which re-registers it) waits */
    /* After a daemon restart the region was never registered with the new
     * one; there is nothing to tell it. */
    int rc = c->broken ? 0 : session_call(c, &req, -1, true, &rep);
    if (!rc && rep)
        moe__session_reply__free_unpacked(rep, NULL);
    region_unlink(c, r);
    session_unclaim(c);
    pthread_mutex_unlock(&c->mu);
    region_unmap(r);
    return rc;
}

void *moe_region_data(const moe_region *r)
{
    return r ? r->base : NULL;
}

size_t moe_region_size(const moe_region *r)
{
    return r ? r->size : 0;
}

uint64_t moe_region_id(const moe_region *r)
{
    return r ? r->id : 0;
}

moe_tensor moe_tensor_2d(const moe_region *r, uint64_t offset, moe_dtype dt, uint64_t d0,
                         uint64_t d1)
{
    return (moe_tensor){.region = r, .offset = offset, .dtype = dt, .ndim = 2, .shape = {d0, d1}};
}

moe_tensor moe_tensor_3d(const moe_region *r, uint64_t offset, moe_dtype dt, uint64_t d0,
                         uint64_t d1, uint64_t d2)
{
    return (moe_tensor){.region = r, .offset = offset, .dtype = dt, .ndim = 3,
                        .shape = {d0, d1, d2}};
}

size_t moe_dtype_size(moe_dtype dt)
{
    switch (dt) {
    case MOE_DTYPE_BF16: case MOE_DTYPE_FP16: return 2;
    case MOE_DTYPE_FP32: case MOE_DTYPE_INT32: return 4;
    case MOE_DTYPE_INT64: return 8;
    default: return 0;
    }
}

uint64_t moe_tensor_bytes(const moe_tensor *t)
{
    if (!t || !t->region || t->ndim < 1 || t->ndim > MOE_MAX_DIMS)
        return 0;
    uint64_t n = moe_dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++)
        if (__builtin_mul_overflow(n, t->shape[i], &n))
            return 0;
    return n;
}

/* The wire Tensor for t (in *w), into *out; NULL when t is absent. 0, or
 * -EINVAL for a tensor that names a region not of this client's (the
 * region is looked for by its address before its handle is read: a freed
 * one's is gone) or has more dimensions than it holds, or none (on the
 * wire that would be an empty shape, which the daemon would call rank 0).
 * Caller holds mu. */
static int wire_tensor(const moe_client *c, const char *what, const moe_tensor *t,
                       Moe__Tensor *w, Moe__Tensor **out)
{
    *out = NULL;
    if (!t->region)
        return 0;
    if (!region_of(c, t->region))
        return seterr(-EINVAL, "tensor %s: its region is not one of this client's (another "
                      "client's, or freed)", what);
    if (t->ndim < 1 || t->ndim > MOE_MAX_DIMS)
        return seterr(-EINVAL, "tensor %s: ndim %d is outside [1, %d]", what, t->ndim,
                      MOE_MAX_DIMS);
    moe__tensor__init(w);
    w->region = t->region->id;
    w->offset = t->offset;
    w->dtype = (Moe__DType)t->dtype;
    w->n_shape = (size_t)t->ndim;
    w->shape = (uint64_t *)t->shape;
    *out = w;
    return 0;
}

/* ---- layers ------------------------------------------------------------ */

static void layer_info_from(const Moe__LayerInfo *li, moe_layer_info *o)
{
    memset(o, 0, sizeof(*o));
    snprintf(o->name, sizeof(o->name), "%s", li->name ? li->name : "");
    o->kind = (moe_layer_kind)li->kind;
    o->dtype = (moe_dtype)li->dtype;
    o->experts = li->experts;
    o->topk = li->topk;
    o->hidden = li->hidden;
    o->intermediate = li->intermediate;
    o->routing = (moe_routing)li->routing;
    o->renormalize = li->renormalize;
    o->groups = li->groups;
    o->n = li->n;
    o->k = li->k;
    snprintf(o->source, sizeof(o->source), "%s", li->source ? li->source : "");
    o->weight_bytes = li->weight_bytes;
    o->requests = li->requests;
    o->tokens = li->tokens;
    for (size_t i = 0; i < li->n_devices && i < 16; i++) {
        o->devices[i] = li->devices[i];
        o->device_bytes[i] = i < li->n_device_bytes ? li->device_bytes[i] : 0;
        o->n_devices++;
    }
}

/* The uploaded tensors of a LoadLayer, which name regions by id: filled
 * under mu (call_filled). */
struct upload_tensors {
    const moe_layer_desc *d;
    Moe__Tensor t1, t3, t2;
};

static int upload_fill(moe_client *c, Moe__Request *req, const void *arg)
{
    struct upload_tensors *u = (struct upload_tensors *)arg;
    Moe__LoadLayer *m = req->load_layer;
    int rc = wire_tensor(c, "w1", &u->d->w1, &u->t1, &m->w1);
    if (!rc)
        rc = wire_tensor(c, "w3", &u->d->w3, &u->t3, &m->w3);
    if (!rc)
        rc = wire_tensor(c, "w2", &u->d->w2, &u->t2, &m->w2);
    return rc;
}

int moe_layer_load(moe_client *c, const moe_layer_desc *d, moe_layer_info *info)
{
    if (!c || !d)
        return null_arg(!c ? "the client" : "desc");
    int rc;
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__LoadLayer m = MOE__LOAD_LAYER__INIT;
    struct upload_tensors u = {.d = d};
    m.name = (char *)(d->name ? d->name : "");
    m.kind = (Moe__LayerKind)d->kind;
    m.dtype = (Moe__DType)d->dtype;
    m.experts = d->experts;
    m.topk = d->topk;
    m.hidden = d->hidden;
    m.intermediate = d->intermediate;
    m.routing = (Moe__Routing)d->routing;
    m.renormalize = d->renormalize != 0;
    m.groups = d->groups;
    m.n = d->n;
    m.k = d->k;
    m.path = (char *)(d->path ? d->path : "");
    m.prefix = (char *)(d->prefix ? d->prefix : "");
    m.n_devices = d->devices ? d->n_devices : 0;
    m.devices = (uint32_t *)d->devices;
    m.n_expert_device = d->expert_device ? d->n_expert_device : 0;
    m.expert_device = (uint32_t *)d->expert_device;
    req.body_case = MOE__REQUEST__BODY_LOAD_LAYER;
    req.load_layer = &m;
    Moe__Reply *rep = NULL;
    rc = call_filled(c, &req, upload_fill, &u, &rep);
    if (rc)
        return rc;
    if (info && rep->body_case == MOE__REPLY__BODY_LAYER)
        layer_info_from(rep->layer, info);
    moe__reply__free_unpacked(rep, NULL);
    return 0;
}

int moe_layer_unload(moe_client *c, const char *name)
{
    if (!c)
        return null_arg("the client");
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__UnloadLayer m = MOE__UNLOAD_LAYER__INIT;
    m.name = (char *)(name ? name : "");
    req.body_case = MOE__REQUEST__BODY_UNLOAD_LAYER;
    req.unload_layer = &m;
    return call(c, &req, NULL);
}

int moe_layer_list(moe_client *c, moe_layer_info *out, int max)
{
    if (!c)
        return null_arg("the client");
    if (!out && max > 0)
        return null_arg("out (with max > 0)");
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__ListLayers m = MOE__LIST_LAYERS__INIT;
    req.body_case = MOE__REQUEST__BODY_LIST_LAYERS;
    req.list_layers = &m;
    Moe__Reply *rep = NULL;
    int rc = call(c, &req, &rep);
    if (rc)
        return rc;
    int n = 0;
    if (rep->body_case == MOE__REPLY__BODY_LAYERS) {
        n = (int)rep->layers->n_layers;
        for (int i = 0; i < n && i < max; i++)
            layer_info_from(rep->layers->layers[i], &out[i]);
    }
    moe__reply__free_unpacked(rep, NULL);
    return n;
}

/* ---- compute ----------------------------------------------------------- */

static void timings_from(const Moe__Reply *rep, moe_timings *t)
{
    if (!t)
        return;
    memset(t, 0, sizeof(*t));
    if (rep->timings) {
        t->queue_us = rep->timings->queue_us;
        t->compute_us = rep->timings->compute_us;
        t->batch_requests = rep->timings->batch_requests;
        t->batch_tokens = rep->timings->batch_tokens;
    }
}

/* A compute request on the stack: the message and its parts. */
struct compute_msg {
    Moe__Request req;
    Moe__FusedMoe fused;
    Moe__GroupedGemm gemm;
    Moe__Tensor t[5];
};

/* Build the request from the caller's arguments: 0, or -EINVAL for what
 * cannot go on the wire. Caller holds mu. */
static int forward_build(moe_client *c, struct compute_msg *cm, const void *args)
{
    const moe_forward_args *a = args;
    Moe__FusedMoe *m = &cm->fused;
    moe__request__init(&cm->req);
    moe__fused_moe__init(m);
    m->layer = (char *)(a->layer ? a->layer : "");
    int rc = wire_tensor(c, "x", &a->x, &cm->t[0], &m->x);
    if (!rc)
        rc = wire_tensor(c, "logits", &a->logits, &cm->t[1], &m->logits);
    if (!rc)
        rc = wire_tensor(c, "topk_ids", &a->topk_ids, &cm->t[2], &m->topk_ids);
    if (!rc)
        rc = wire_tensor(c, "topk_weights", &a->topk_weights, &cm->t[3], &m->topk_weights);
    if (!rc)
        rc = wire_tensor(c, "out", &a->out, &cm->t[4], &m->out);
    if (rc)
        return rc;
    cm->req.timeout_us = a->timeout_us;
    cm->req.no_batch = a->no_batch != 0;
    cm->req.body_case = MOE__REQUEST__BODY_FUSED_MOE;
    cm->req.fused_moe = m;
    return 0;
}

static int gemm_build(moe_client *c, struct compute_msg *cm, const void *args)
{
    const moe_gemm_args *a = args;
    /* The packer reads groups entries from m_sizes. */
    if (a->groups && !a->m_sizes)
        return seterr(-EINVAL, "m_sizes is NULL but groups is %zu", a->groups);
    Moe__GroupedGemm *m = &cm->gemm;
    moe__request__init(&cm->req);
    moe__grouped_gemm__init(m);
    m->layer = (char *)(a->layer ? a->layer : "");
    int rc = wire_tensor(c, "a", &a->a, &cm->t[0], &m->a);
    if (!rc)
        rc = wire_tensor(c, "c", &a->c, &cm->t[1], &m->c);
    if (rc)
        return rc;
    m->n_m_sizes = a->groups;
    m->m_sizes = (uint64_t *)a->m_sizes;
    cm->req.timeout_us = a->timeout_us;
    cm->req.no_batch = a->no_batch != 0;
    cm->req.body_case = MOE__REQUEST__BODY_GROUPED_GEMM;
    cm->req.grouped_gemm = m;
    return 0;
}

typedef int build_fn(moe_client *, struct compute_msg *, const void *);

/* Check the connection (reconnecting if the daemon went away), build the
 * request and send it, all under one hold of mu: the tensors name regions
 * by id, and a reconnection gives the regions new ids. Fills *r. */
static int submit(moe_client *c, build_fn *build, const void *args, moe_request *r)
{
    if (!c || !args)
        return null_arg(!c ? "the client" : "args");
    if (forked(c))
        return refuse_forked(c);
    struct compute_msg cm;
    pthread_mutex_lock(&c->mu);
    int rc = connection_ensure(c);
    if (!rc)
        rc = build(c, &cm, args);
    if (!rc)
        rc = send_request(c, &cm.req, true);
    r->client = c;
    r->client_serial = c->serial;
    r->generation = c->generation;
    r->id = rc ? 0 : cm.req.id;
    r->sent_us = mono_us();
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static int submit_new(moe_client *c, build_fn *build, const void *args, moe_request **out)
{
    if (!out)
        return null_arg("req");
    *out = NULL;
    moe_request *r = malloc(sizeof(*r));
    if (!r)
        return seterr(-ENOMEM, "out of memory");
    int rc = submit(c, build, args, r);
    if (rc) {
        free(r);
        return rc;
    }
    *out = r;
    return 0;
}

int moe_forward_submit(moe_client *c, const moe_forward_args *a, moe_request **out)
{
    return submit_new(c, forward_build, a, out);
}

int moe_gemm_submit(moe_client *c, const moe_gemm_args *a, moe_request **out)
{
    return submit_new(c, gemm_build, a, out);
}

/* moe_wait() without freeing r. */
static int request_wait(moe_client *c, const moe_request *r, int timeout_ms, moe_timings *timings)
{
    Moe__Reply *rep = NULL;
    int rc;
    pthread_mutex_lock(&c->mu);
    if (timeout_ms < 0)
        timeout_ms = c->timeout_ms;
    pthread_mutex_unlock(&c->mu);
    rc = wait_reply(c, r->id, r->generation, r->sent_us, timeout_ms, &rep);
    if (rc)
        return rc;
    timings_from(rep, timings);
    rc = reply_status(rep);
    moe__reply__free_unpacked(rep, NULL);
    return rc;
}

/* r was made by c: by this client, not by one disconnected before c was
 * made at the same address (request ids restart at 1 in every client). */
static bool request_of(const moe_client *c, const moe_request *r)
{
    return r->client == c && r->client_serial == c->serial;
}

int moe_wait(moe_client *c, moe_request **rp, int timeout_ms, moe_timings *timings)
{
    if (!c)
        return null_arg("the client");
    moe_request *r = rp ? *rp : NULL;
    if (!r)
        return null_arg("the request");
    if (!request_of(c, r))
        return seterr(-EINVAL, "the request is not this client's");
    if (forked(c))
        return refuse_forked(c); /* the handle stays the caller's */
    int rc = request_wait(c, r, timeout_ms, timings);
    if (rc == -ETIMEDOUT)
        return rc; /* still the caller's: wait again or give up */
    free(r);
    *rp = NULL;
    return rc;
}

int moe_poll(moe_client *c, moe_request *r)
{
    if (!c || !r)
        return null_arg(!c ? "the client" : "the request");
    if (!request_of(c, r))
        return seterr(-EINVAL, "the request is not this client's");
    if (forked(c))
        return refuse_forked(c);
    pthread_mutex_lock(&c->mu);
    /* A reply that has come is looked for first: it stands even when the
     * connection broke or was replaced since. Else a request of an earlier
     * connection is settled: moe_wait says lost. */
    bool found = false;
    int rc = 0;
    for (int pass = 0; pass < 2 && !found && !rc; pass++) {
        if (pass == 1 && r->generation != c->generation) {
            found = true;
            break;
        }
        if (pass == 1)
            rc = receive_some(c);
        for (struct pending *p = c->pending; p && !found; p = p->next)
            found = p->id == r->id && p->reply;
    }
    pthread_mutex_unlock(&c->mu);
    return found ? 1 : rc;
}

void moe_request_free(moe_client *c, moe_request **rp)
{
    if (!rp)
        return;
    moe_request *r = *rp;
    *rp = NULL;
    if (!r)
        return;
    /* Another client's hands: its requests of the same id are not touched
     * (the owner keeps the reply, when it comes, until it disconnects). */
    if (c && request_of(c, r) && !forked(c))
        give_up(c, r->id, r->generation);
    free(r);
}

/* A synchronous call's wait: up to the client's timeout, then it gives up
 * on the reply. */
static int sync_wait(moe_client *c, const moe_request *r, moe_timings *timings)
{
    int rc = request_wait(c, r, -1, timings);
    if (rc == -ETIMEDOUT)
        give_up(c, r->id, r->generation);
    return rc;
}

/* The synchronous calls: a request on the stack, one connection check. */
int moe_forward(moe_client *c, const moe_forward_args *a, moe_timings *timings)
{
    moe_request r;
    int rc = submit(c, forward_build, a, &r);
    return rc ? rc : sync_wait(c, &r, timings);
}

int moe_gemm(moe_client *c, const moe_gemm_args *a, moe_timings *timings)
{
    moe_request r;
    int rc = submit(c, gemm_build, a, &r);
    return rc ? rc : sync_wait(c, &r, timings);
}

/* ---- stats ------------------------------------------------------------- */

int moe_stats_get(moe_client *c, moe_stats *o)
{
    if (!c || !o)
        return null_arg(!c ? "the client" : "out");
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__GetStats m = MOE__GET_STATS__INIT;
    req.body_case = MOE__REQUEST__BODY_GET_STATS;
    req.get_stats = &m;
    Moe__Reply *rep = NULL;
    int rc = call(c, &req, &rep);
    if (rc)
        return rc;
    memset(o, 0, sizeof(*o));
    if (rep->body_case == MOE__REPLY__BODY_STATS) {
        const Moe__StatsReply *s = rep->stats;
        o->uptime_us = s->uptime_us;
        o->requests = s->requests;
        o->errors = s->errors;
        o->busy = s->busy;
        o->expired = s->expired;
        o->batches = s->batches;
        o->tokens = s->tokens;
        o->sessions = s->sessions;
        o->regions = s->regions;
        o->region_bytes = s->region_bytes;
        o->queue_depth = s->queue_depth;
        o->queue_wait_p50_us = s->queue_wait_p50_us;
        o->queue_wait_p99_us = s->queue_wait_p99_us;
        o->compute_p50_us = s->compute_p50_us;
        o->compute_p99_us = s->compute_p99_us;
        o->compute_us_total = s->compute_us_total;
        o->idle_p50_us = s->idle_p50_us;
        o->idle_p99_us = s->idle_p99_us;
        o->notice_p50_us = s->notice_p50_us;
        o->reply_p50_us = s->reply_p50_us;
        o->return_p50_us = s->return_p50_us;
        o->launch_p50_us = s->launch_p50_us;
        for (size_t i = 0; i < s->n_batch_requests && i < MOE_STATS_BUCKETS; i++) {
            o->batch_requests[i].le = s->batch_requests[i]->le;
            o->batch_requests[i].count = s->batch_requests[i]->count;
            o->n_batch_requests++;
        }
        for (size_t i = 0; i < s->n_batch_tokens && i < MOE_STATS_BUCKETS; i++) {
            o->batch_tokens[i].le = s->batch_tokens[i]->le;
            o->batch_tokens[i].count = s->batch_tokens[i]->count;
            o->n_batch_tokens++;
        }
        snprintf(o->backend, sizeof(o->backend), "%s", s->backend ? s->backend : "");
    }
    moe__reply__free_unpacked(rep, NULL);
    return 0;
}
