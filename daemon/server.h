/*
 * server.h: the daemon's state and the structures its modules share.
 *
 * Everything here belongs to the loop thread, with two exceptions that the
 * worker threads own while a job runs: a batch's requests (their tensors'
 * bytes, not their references) and a load job's buffers. As a batch ends,
 * the compute thread also reads the reply fields of the requests whole in it
 * (taken off their queues, so the loop thread no longer touches them) and
 * sends on the reply sockets the batch holds references to (batch.c,
 * batch_after).
 *
 *   session.c  the session socket: OpenSession, regions, client death
 *   server.c   the request socket: decode, authenticate, dispatch, reply
 *   wire.c     tensor handles -> checked pointers; protobuf replies
 *   layer.c    the layer registry and weight loading (loader thread)
 *   batch.c    per-layer queues, batch formation and execution (compute thread)
 */
#ifndef MOED_SERVER_H
#define MOED_SERVER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/shard.h"
#include "daemon/stats.h"
#include "daemon/worker.h"
#include "kernels/moe_kernels.h"

struct loop;
struct loop_watch;
struct out_msg;

/* A session's reply socket as the compute thread holds it while it sends a
 * batch's replies (batch.c): the descriptor is closed when the last holder
 * lets go, so a send can never reach a number reused for another client. */
struct reply_chan {
    atomic_int refs;
    int fd;
    /* The compute thread may send now: the loop thread holds no replies
     * for the socket, which is still open (session.c sets it). */
    atomic_bool direct;
};
struct reply_chan *reply_chan_ref(struct reply_chan *c);
void reply_chan_unref(struct reply_chan **c);
/* Pack a Reply and send it on c's socket without waiting, from either
 * thread: 0, or -errno (-EAGAIN: no room now; -EMSGSIZE: larger than a
 * session message). */
int reply_chan_send(struct reply_chan *c, void *reply);
struct region;

#define SESSION_TOKEN_BYTES 16
#define ROUTE_ID_MAX 256
#define MAX_TENSOR_DIMS 4
#define MAX_GROUPS 65536

/* session_by_id's buckets: a power of two. */
#define SESSION_BUCKETS 1024

struct session {
    struct server *server;
    uint64_t id;
    uint8_t token[SESSION_TOKEN_BYTES];
    int fd;
    struct loop_watch *watch;
    pid_t pid;
    uid_t uid;
    gid_t gid;
    bool opened;
    struct reply_chan *chan; /* OpenSession.reply_socket, or NULL */
    struct loop_watch *reply_watch;
    /* Replies to requests that came on the reply socket, waiting for room
     * there (the socket is then watched for output, not read). */
    struct out_msg *outq, **outq_tail;
    uint32_t n_out;
    char name[64];
    struct region *regions;
    uint32_t n_regions;
    uint64_t region_bytes;
    /* Regions the client unregistered while requests in flight still held
     * them: still mapped, so still counted against max_regions and
     * max_session_bytes until the last of those requests ends. */
    uint32_t n_retired;
    uint64_t retired_bytes;
    uint32_t queued_requests;
    uint64_t queued_tokens;
    bool pinning; /* a region of its is being pinned: its socket is not read */
    /* Answers to its session requests waiting for room on its socket,
     * which is then watched for room, not read (session.c). */
    struct out_msg *unsent;
    struct session *next;
    struct session *id_next; /* the next in its session_by_id bucket */
};

/* A checked tensor: ptr .. ptr + bytes lies inside region, which this holds
 * a reference to. */
struct tensor_ref {
    struct region *region;
    void *ptr;
    int dtype; /* Moe__DType */
    int ndim;
    uint64_t shape[MAX_TENSOR_DIMS];
    uint64_t bytes;
};

enum req_kind { REQ_FUSED_MOE, REQ_GROUPED_GEMM };

/*
 * A compute request from arrival to reply. A MoE request larger than
 * max_slice_tokens runs in slices of rows over several batches, so a long
 * prefill cannot hold the device while other clients' decode requests wait;
 * it stays queued until every row has been handed to a batch.
 */
struct request {
    struct request *next;   /* in its layer's queue */
    struct layer *layer;    /* holds a reference */
    enum req_kind kind;
    uint64_t session_id;
    uint8_t route_id[ROUTE_ID_MAX];
    size_t route_len;
    uint64_t id;
    uint64_t arrival_us, deadline_us, start_us;
    int tokens;             /* T, or GEMM rows M */
    int next_row;           /* rows handed to batches so far */
    int rows_done;          /* rows whose batch has completed */
    bool queued;            /* still in its layer's queue */
    bool no_batch;          /* must run alone */
    struct tensor_ref x, logits, ids, weights, out; /* FusedMoe */
    struct tensor_ref a, c;                         /* GroupedGemm */
    int64_t *m_sizes;       /* [layer->groups] */
    /* Result, set by the compute thread while the request has rows in a
     * running batch, by the loop thread otherwise. */
    int status;
    char message[192];
    /* A cancel that arrived while rows of the request were in the running
     * batch: the loop thread writes it here, never into status, and
     * batch_done merges it once the compute thread is finished. */
    int cancel_err;
    char cancel_why[64];
    uint64_t compute_us;
    uint32_t batch_requests, batch_tokens;
};

enum layer_state { LAYER_LOADING, LAYER_READY };

struct layer {
    char name[65];
    int kind;               /* Moe__LayerKind */
    int wire_dtype;         /* Moe__DType */
    moek_dtype dt;
    moek_moe_shape shape;
    int routing;            /* Moe__Routing */
    bool renormalize;
    uint32_t groups, n, k;
    char source[512];
    uint64_t weight_bytes;
    void *weights;          /* backend handle (device 0), or NULL when sharded */
    struct shard_set shards; /* experts on several devices (shards.n > 0) */
    /* Where the weights live, for LayerInfo: devices and their bytes, and
     * with shards the device of each expert. */
    int n_place;
    uint32_t place_devices[16];
    uint64_t place_bytes[16];
    uint32_t *place_expert;
    enum layer_state state;
    bool unloaded;          /* removed from the registry, freed at refs 0 */
    bool from_config;       /* named by the configuration: a reload may unload it */
    bool conf_behind;       /* a reload kept it as loaded, its new section failing
                             * the checks: the next reload tries again */
    int refs;
    struct request *queue_head, *queue_tail;
    uint32_t queued;
    uint64_t queued_tokens;
    uint64_t requests, tokens;
    struct layer *next;
};

#define MAX_DEVICES 16

struct server {
    struct config *cfg;
    struct loop *loop;
    struct backend *backend;        /* the home device: backends[0] */
    struct backend *backends[MAX_DEVICES];
    int n_backends;
    struct worker *compute;
    struct worker *loader;
    struct worker *pinner;  /* pins and unpins clients' regions (backends that pin) */

    void *zctx;
    void *zsock;
    int zfd;
    struct loop_watch *zwatch;
    bool zmq_dirty;         /* the socket may hold messages ZMQ_FD did not signal */
    bool in_drain;          /* in server_drain, which kicks the batcher at its end */
    char endpoint[300];
    uint8_t *sock_rx;       /* a request read from a reply socket */
    size_t sock_rx_size;

    int listen_fd;
    struct loop_watch *listen_watch;
    struct loop_watch *accept_pause; /* out of descriptors: accept again later */
    char sock_path[300];
    bool sock_from_systemd;

    struct session *sessions;
    uint32_t n_sessions;
    /* The sessions again, by id: every request looks its session up, some
     * several times, and a walk of the list cost each request O(sessions)
     * (3% of the loop thread at 64 clients). Ids count up from 1, so id
     * modulo the bucket count spreads sessions opened together evenly (one
     * a bucket up to SESSION_BUCKETS of them); long-lived sessions beside
     * many later ones can share a bucket. */
    struct session *by_id[SESSION_BUCKETS];
    uint64_t next_session_id;
    uint64_t pinned_bytes;  /* client regions pinned (max_pinned_bytes) */
    uint64_t unpinning_bytes; /* of those, queued to be unpinned on the pinner */

    struct layer *layers;
    unsigned client_loads;  /* clients' loads queued or running (max_loads) */
    bool batch_running;     /* a batch is on the compute worker */
    struct loop_watch *delay_timer; /* max_delay_us: wake to start a batch */
    uint64_t delay_due_us;  /* when delay_timer fires; 0: not armed */
    /* Sessions served by the batch that just completed, which the batcher
     * waits for (up to return_wait_us) before starting a smaller batch. */
    uint64_t awaited[64];
    uint32_t n_awaited;
    /* awaited[0 .. awaited_back) have come back: each kick looks up only
     * the sessions after them (one lookup a session a batch, not one a
     * session a kick). A session that came back and then lost its request
     * (expired, cancelled) is not waited for again. */
    uint32_t awaited_back;
    uint64_t awaited_until_us;
    uint32_t queued_total;
    uint32_t queued_deadlines; /* queued requests with a timeout_us */

    struct stats stats;
    bool draining;
    bool fatal;             /* a device failed for good: exit non-zero */
    int failed_device;      /* which, when fatal */
    /* Staging memory for batches, grown on demand; compute thread only
     * while a batch runs. */
    void *staging;
    size_t staging_size;
};

/* server.c */
/* backends[0] is the home device; the others hold shards of layers whose
 * experts are spread over devices. The server borrows them. */
int server_new(struct config *cfg, struct backend **backends, int n_backends,
               struct loop *loop, struct server **out);
void server_free(struct server **s);
/* Close the request socket and terminate its context, which waits up to
 * linger_ms for ZeroMQ to write the replies it holds (0: drop them); the
 * loop stops watching it. server_free does it with 0; nothing to do once
 * done. */
void server_close_zmq(struct server *s, int linger_ms);
/* Bind the session socket and the ZeroMQ endpoint; an fd >= 0 is one that
 * systemd passed (socket activation) and is used instead of binding. */
int server_listen(struct server *s, int session_fd, int zmq_fd);
/* Work not yet answered: queued requests, a running batch, pending loads. */
unsigned server_pending(const struct server *s);
/* The first of s's devices whose backend failed for good (a sticky device
 * fault), or -1: any of them, not only the home device, since a layer's
 * experts may live on the others. */
int server_failed_device(const struct server *s);
/* After a batch, and at every status tick (a load on the loader thread can
 * break a device too): a failed device makes the server fatal
 * (failed_device says which) and stops the loop; true then. */
bool server_check_devices(struct server *s);
/* Decode, authenticate, validate and dispatch one request that arrived
 * from routing id rid: what the ZeroMQ socket does for each message, callable
 * without it (tests, fuzzing). Every request is answered through
 * server_reply(), now or when its work completes; 0. Except on a reply
 * socket's route: what does not decode, or carries no token of that
 * socket's own session, is not answered there (an answer could come back
 * as the next "request", in a loop that a client wired up on purpose) and
 * returns -EPROTO or -EACCES for the caller to close the socket. */
int server_handle_message(struct server *s, const uint8_t *rid, size_t rlen,
                          const uint8_t *data, size_t len);
/*
 * Requests may also come on a session's reply socket. They carry a route of
 * SOCKET_ROUTE_LEN bytes made here instead of a ZeroMQ routing id, so every
 * reply path handles both: a zero byte, 'S', the session id. ZeroMQ's own
 * ids are 5 bytes; a ZeroMQ peer that claims one of these is refused
 * (server_recv_one), so only the socket's own session is ever answered
 * there.
 */
#define SOCKET_ROUTE_LEN 10
void route_for_session(uint64_t session_id, uint8_t rid[SOCKET_ROUTE_LEN]);
bool route_session(const uint8_t *rid, size_t rlen, uint64_t *session_id);
/* Send a reply to a routing id (or a session's reply socket); frees
 * nothing. */
void server_reply(struct server *s, const uint8_t *route_id, size_t route_len,
                  void *reply /* Moe__Reply */);
/* The same for a compute request of session session_id: on the session's
 * reply socket where it has one that takes the reply at once, else by
 * ZeroMQ to the routing id. */
void server_reply_session(struct server *s, uint64_t session_id, const uint8_t *route_id,
                          size_t route_len, void *reply);
void server_reply_error(struct server *s, const uint8_t *route_id, size_t route_len,
                        uint64_t id, int err, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* session.c */
int session_listen(struct server *s, int fd_from_systemd);
/* Start a session on a connected, non-blocking seqpacket socket (what each
 * accepted connection gets; tests pass one end of a socketpair). Takes
 * ownership of fd, also on error: -EDQUOT at max_sessions (the peer is told
 * why), -ECANCELED while draining, -ENOMEM. */
int session_attach(struct server *s, int fd);
void session_close_all(struct server *s);
struct session *session_by_token(struct server *s, const uint8_t *token, size_t len);
/* Whether token is se's (constant time) and se is open. */
bool session_token_ok(const struct session *se, const uint8_t *token, size_t len);
struct session *session_by_id(struct server *s, uint64_t id);
/* A compute request's Reply on the session's reply socket; 0, or -errno
 * when it has none or the reply could not go at once (the caller then uses
 * ZeroMQ). */
int session_push_reply(struct session *se, void *reply);
/* The Reply to a request that came on the session's reply socket: sent
 * now, or queued until the socket has room (the session's requests are not
 * read meanwhile, so the queue is bounded by its requests in flight).
 * Dropped when the session or its socket is gone. */
void session_send_reply(struct server *s, uint64_t session_id, void *reply);
struct region *session_region(struct session *se, uint64_t region_id);

/* wire.c */
/* Resolve a wire tensor of session se: dtype, rank, shape product and bounds
 * all checked; on success ref->region holds a reference. err gets the why. */
int wire_tensor(struct session *se, const void *wire_tensor /* Moe__Tensor */,
                const char *what, struct tensor_ref *ref, char *err, size_t errlen);
void tensor_ref_done(struct tensor_ref *ref);
size_t wire_dtype_size(int dtype);
int wire_dtype_to_moek(int dtype, moek_dtype *out);
const char *wire_dtype_name(int dtype);
/* Fill a Moe__LayerInfo (strings borrowed from the layer). */
void wire_layer_info(const struct layer *l, void *info /* Moe__LayerInfo */);

/* layer.c */
struct layer *layer_find(struct server *s, const char *name);
/* Layers loaded or loading (what max_layers caps). */
unsigned layer_count(const struct server *s);
struct layer *layer_ref(struct layer *l);
void layer_unref(struct server *s, struct layer **l);
/* Start loading; the reply is sent when the load finishes. */
void layer_handle_load(struct server *s, struct session *se, const uint8_t *route_id,
                       size_t route_len, uint64_t req_id, const void *msg /* Moe__LoadLayer */);
int layer_unload(struct server *s, const char *name);
/* Load a configured layer as a client's LoadLayer of the same fields would
 * (max_loads aside): at once (at start), or queued on the loader thread (a
 * reload), where the outcome is logged. 0 or -errno with err: the load is
 * refused, or (at once) failed. */
int layer_load_conf(struct server *s, const struct layer_conf *lc, bool queued, char *err,
                    size_t errlen);
/* Whether a layer section's load would succeed, short of memory: every
 * check of the load, its file's from the header alone (layer_check_weights,
 * which fills out; may be NULL) and, with s, its placement on s's devices.
 * 0 or -errno with err. */
struct host_weights;
int layer_conf_check(struct server *s, const struct layer_conf *lc, char *const *allowed,
                     size_t n_allowed, struct host_weights *out, char *err, size_t errlen);
/* Whether two layer sections ask for the same load. */
bool layer_conf_same(const struct layer_conf *a, const struct layer_conf *b);
void layer_unload_all(struct server *s);

/* batch.c */
/* The batcher's timer (max_delay_us, return_wait_us). 0 or -errno. */
int batch_init(struct server *s);
/* Take ownership of req and queue it (or reply BUSY and free it). */
void batch_enqueue(struct server *s, struct request *req);
/* Start a batch if the compute worker is idle and work is queued. */
void batch_kick(struct server *s);
/* Cancel the queued requests of a session (it closed). */
void batch_cancel_session(struct server *s, uint64_t session_id);
/* Cancel every queued request of a layer with err. */
void batch_cancel_layer(struct server *s, struct layer *l, int err, const char *why);
/* Free a request that holds no layer reference (see request_finish). */
void request_free(struct request *req);

#endif
