/*
 * raw.h: a raw client for integration tests that must say what libmoe never
 * would: its own seqpacket session, its own DEALER socket and hand-built
 * protobuf. The raw_* helpers that end in _try return an error instead of
 * failing the test, for clients that expect the daemon to refuse them or
 * that count what comes back (the soak test).
 */
#ifndef MOE_TEST_RAW_H
#define MOE_TEST_RAW_H

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <zmq.h>

#include "moe.pb-c.h"
#include "tests/integration/itest.h"

struct raw {
    int sfd;
    void *zctx, *zsock;
    uint8_t token[16];
    uint64_t session_id;
    uint64_t next_id;
};

/* Send one session message (with fds): sendmsg's result (flags: its). */
static inline ssize_t raw_session_send(struct raw *r, const Moe__SessionRequest *req,
                                       const int *fds, int nfds, int flags)
{
    uint8_t buf[4096];
    size_t n = moe__session_request__pack(req, buf);
    union {
        char raw[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr a;
    } cb;
    struct iovec iov = {buf, n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds) {
        memset(&cb, 0, sizeof(cb));
        mh.msg_control = cb.raw;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    return sendmsg(r->sfd, &mh, MSG_NOSIGNAL | flags);
}

/* Send one session message (with fds) and read its reply; NULL on error. */
static inline Moe__SessionReply *raw_session_call_try(struct raw *r, const Moe__SessionRequest *req,
                                                      const int *fds, int nfds)
{
    uint8_t buf[4096];
    if (raw_session_send(r, req, fds, nfds, 0) != (ssize_t)moe__session_request__get_packed_size(req))
        return NULL;
    ssize_t got = recv(r->sfd, buf, sizeof(buf), 0);
    if (got <= 0)
        return NULL;
    return moe__session_reply__unpack(NULL, (size_t)got, buf);
}

static inline Moe__SessionReply *raw_session_call(struct raw *r, const Moe__SessionRequest *req,
                                                  const int *fds, int nfds)
{
    Moe__SessionReply *rep = raw_session_call_try(r, req, fds, nfds);
    CHECK_MSG(rep != NULL, "no session reply: %s", strerror(errno));
    return rep;
}

/* Connect the session socket (0 or -errno) without opening a session. */
static inline int raw_connect_session(struct raw *r, const char *dir)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    static const char name[] = "/moed.sock";
    size_t n = strlen(dir);
    if (n + sizeof(name) > sizeof(sa.sun_path))
        return -ENAMETOOLONG;
    memcpy(sa.sun_path, dir, n);
    memcpy(sa.sun_path + n, name, sizeof(name));
    r->sfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (r->sfd < 0)
        return -errno;
    if (connect(r->sfd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        int e = -errno;
        close(r->sfd);
        r->sfd = -1;
        return e;
    }
    struct timeval tv = {10, 0};
    setsockopt(r->sfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return 0;
}

/* The DEALER socket; replies wait at most rcv_timeout_ms. */
static inline void raw_connect_zmq(struct raw *r, const char *dir, int rcv_timeout_ms)
{
    char ep[300];
    snprintf(ep, sizeof(ep), "ipc://%s/moed.zmq", dir);
    r->zctx = zmq_ctx_new();
    r->zsock = zmq_socket(r->zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(r->zsock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(r->zsock, ZMQ_RCVTIMEO, &rcv_timeout_ms, sizeof(rcv_timeout_ms));
    CHECK(zmq_connect(r->zsock, ep) == 0);
}

/* OpenSession; 0 or the refusal as a negative wire status. */
static inline int raw_open_session_try(struct raw *r)
{
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__OpenSession os = MOE__OPEN_SESSION__INIT;
    os.protocol_version = 1;
    os.client_name = "raw";
    req.body_case = MOE__SESSION_REQUEST__BODY_OPEN;
    req.open = &os;
    Moe__SessionReply *rep = raw_session_call_try(r, &req, NULL, 0);
    if (!rep)
        return -1000;
    int st = (int)rep->status;
    if (st == 0 && rep->token.len == 16) {
        memcpy(r->token, rep->token.data, 16);
        r->session_id = rep->session_id;
    }
    moe__session_reply__free_unpacked(rep, NULL);
    return -st;
}

static inline void raw_open(struct raw *r, const char *dir, bool open_session)
{
    memset(r, 0, sizeof(*r));
    r->sfd = -1;
    int rc = raw_connect_session(r, dir);
    CHECK_MSG(rc == 0, "connect %s/moed.sock: %s", dir, strerror(-rc));
    raw_connect_zmq(r, dir, 5000);
    if (open_session)
        CHECK_EQ_INT(raw_open_session_try(r), 0);
}

static inline void raw_close(struct raw *r)
{
    if (r->zsock)
        zmq_close(r->zsock);
    if (r->zctx)
        zmq_ctx_term(r->zctx);
    if (r->sfd >= 0)
        close(r->sfd);
    r->zsock = r->zctx = NULL;
    r->sfd = -1;
}

/* Register an fd (or several) as a region; returns the reply. */
static inline Moe__SessionReply *raw_register(struct raw *r, uint64_t size, const int *fds, int nfds)
{
    Moe__SessionRequest req = MOE__SESSION_REQUEST__INIT;
    Moe__RegisterRegion rr = MOE__REGISTER_REGION__INIT;
    rr.size = size;
    req.body_case = MOE__SESSION_REQUEST__BODY_REGISTER_REGION;
    req.register_region = &rr;
    return raw_session_call(r, &req, fds, nfds);
}

static inline int raw_unregister(struct raw *r, uint64_t region)
{
    Moe__SessionRequest un = MOE__SESSION_REQUEST__INIT;
    Moe__UnregisterRegion ur = MOE__UNREGISTER_REGION__INIT;
    ur.region = region;
    un.body_case = MOE__SESSION_REQUEST__BODY_UNREGISTER_REGION;
    un.unregister_region = &ur;
    Moe__SessionReply *rep = raw_session_call(r, &un, NULL, 0);
    int st = (int)rep->status;
    moe__session_reply__free_unpacked(rep, NULL);
    return st;
}

static inline int memfd_sized(size_t size, unsigned seals)
{
    int fd = memfd_create("itest", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, (off_t)size) == 0);
    if (seals)
        CHECK(fcntl(fd, F_ADD_SEALS, seals) == 0);
    return fd;
}

/* A good region of `size` bytes: 0 and its id in *id (and its mapping in
 * *base if asked), or the refusal's wire status with its message. */
static inline int raw_region_try(struct raw *r, size_t size, void **base, uint64_t *id,
                                 char *msg, size_t msglen)
{
    int fd = memfd_sized(size, F_SEAL_SHRINK | F_SEAL_GROW);
    Moe__SessionReply *rep = raw_register(r, size, &fd, 1);
    int st = (int)rep->status;
    if (msg)
        snprintf(msg, msglen, "%s", rep->message ? rep->message : "");
    *id = rep->region;
    moe__session_reply__free_unpacked(rep, NULL);
    if (st == 0 && base) {
        *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        CHECK(*base != MAP_FAILED);
    }
    close(fd);
    return st;
}

static inline uint64_t raw_region(struct raw *r, size_t size, void **base)
{
    uint64_t id = 0;
    char msg[256];
    int st = raw_region_try(r, size, base, &id, msg, sizeof(msg));
    CHECK_MSG(st == 0, "register: status %d: %s", st, msg);
    return id;
}

/* One reply, or NULL after the socket's receive timeout. */
static inline Moe__Reply *raw_recv_try(struct raw *r)
{
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, r->zsock, 0) < 0) {
        zmq_msg_close(&m);
        return NULL;
    }
    Moe__Reply *rep = moe__reply__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
    zmq_msg_close(&m);
    return rep;
}

static inline Moe__Reply *raw_recv(struct raw *r)
{
    Moe__Reply *rep = raw_recv_try(r);
    CHECK_MSG(rep != NULL, "no reply from the daemon: %s", zmq_strerror(zmq_errno()));
    return rep;
}

/* Stamp the request with the next id (and the session token unless it
 * carries one) and send it. 0 or -1. */
static inline int raw_send(struct raw *r, Moe__Request *req)
{
    uint8_t stack[8192];
    req->id = ++r->next_id;
    if (!req->token.len) {
        req->token.data = r->token;
        req->token.len = 16;
    }
    size_t n = moe__request__get_packed_size(req);
    uint8_t *buf = n <= sizeof(stack) ? stack : malloc(n);
    CHECK(buf != NULL);
    moe__request__pack(req, buf);
    int rc = zmq_send(r->zsock, buf, n, 0) == (int)n ? 0 : -1;
    if (buf != stack)
        free(buf);
    return rc;
}

/* Send bytes as one message, expect one reply with status; check message. */
static inline void raw_expect_bytes(struct raw *r, const void *data, size_t n, int status,
                                    const char *needle)
{
    CHECK(zmq_send(r->zsock, data, n, 0) == (int)n);
    Moe__Reply *rep = raw_recv(r);
    CHECK_MSG((int)rep->status == status, "status %d (want %d): %s", rep->status, status,
              rep->message);
    if (needle)
        CHECK_STR_CONTAINS(rep->message, needle);
    moe__reply__free_unpacked(rep, NULL);
}

static inline void raw_expect(struct raw *r, Moe__Request *req, int status, const char *needle)
{
    CHECK(raw_send(r, req) == 0);
    Moe__Reply *rep = raw_recv(r);
    CHECK_EQ_INT(rep->id, req->id);
    CHECK_MSG((int)rep->status == status, "status %d (want %d): %s", rep->status, status,
              rep->message ? rep->message : "");
    if (needle)
        CHECK_STR_CONTAINS(rep->message, needle);
    moe__reply__free_unpacked(rep, NULL);
}

static inline Moe__Tensor raw_tensor(uint64_t region, uint64_t off, Moe__DType dt,
                                     uint64_t *shape, int nd)
{
    Moe__Tensor t = MOE__TENSOR__INIT;
    t.region = region;
    t.offset = off;
    t.dtype = dt;
    t.shape = shape;
    t.n_shape = (size_t)nd;
    return t;
}

/* A Hello, answered OK: the DEALER's connection is up. */
static inline void raw_hello(struct raw *r)
{
    Moe__Request req = MOE__REQUEST__INIT;
    Moe__Hello h = MOE__HELLO__INIT;
    h.protocol_version = 1;
    req.body_case = MOE__REQUEST__BODY_HELLO;
    req.hello = &h;
    raw_expect(r, &req, MOE__STATUS__STATUS_OK, NULL);
}

/* Resident memory of a process in KiB (VmRSS), -1 if unknown. */
static inline long itest_rss_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kib = -1;
    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    fclose(f);
    return kib;
}

/* The daemon's descriptors, listed on stderr (when a count is off). */
static inline void itest_list_fds(pid_t pid)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "ls -l /proc/%d/fd >&2", (int)pid);
    if (system(cmd)) {
    }
}

/* Under AddressSanitizer freed memory waits in a 256 MiB quarantine before
 * it is reused, which would hide whether a daemon's memory is flat: daemons
 * started after this call keep 16 MiB. The slack left to allow for it (and
 * for ASan's per-size-class caches) is ITEST_RSS_SLACK_KIB. */
#if defined(__SANITIZE_ADDRESS__)
#define ITEST_RSS_SLACK_KIB (48 * 1024)
#else
#define ITEST_RSS_SLACK_KIB 0
#endif
static inline void itest_asan_small_quarantine(void)
{
#if defined(__SANITIZE_ADDRESS__)
    const char *o = getenv("ASAN_OPTIONS");
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s%squarantine_size_mb=16", o ? o : "", o && o[0] ? ":" : "");
    setenv("ASAN_OPTIONS", buf, 1);
#endif
}

#endif
