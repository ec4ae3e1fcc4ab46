/*
 * moe.h: libmoe, the client library of moed.
 *
 * A process connects to the daemon (moe_connect), puts its tensors in shared
 * memory regions it creates (moe_region_create), and asks the daemon to run
 * layers over them (moe_forward, moe_gemm). Tensors are named by region,
 * byte offset, dtype and shape; they never travel in messages.
 *
 *     moe_client *c;
 *     if (moe_connect(NULL, "my-app", &c) < 0) ...   // default runtime dir
 *     moe_region *r;
 *     moe_region_create(c, 1 << 20, "acts", &r);
 *     void *base = moe_region_data(r);               // write x and logits here
 *     moe_forward_args a = {
 *         .layer = "demo",
 *         .x = moe_tensor_2d(r, 0, MOE_DTYPE_BF16, T, H),
 *         .logits = moe_tensor_2d(r, off_logits, MOE_DTYPE_FP32, T, E),
 *         .out = moe_tensor_2d(r, off_out, MOE_DTYPE_BF16, T, H),
 *     };
 *     int rc = moe_forward(c, &a, NULL);             // out now holds the result
 *     if (rc < 0) fprintf(stderr, "%s\n", moe_errmsg());
 *     moe_region_free(c, &r);
 *     moe_disconnect(&c);
 *
 * Errors: every function that can fail returns 0 (or a count) on success and
 * a negative errno value on failure: -EINVAL invalid argument, -ENOENT no such
 * layer or region, -EEXIST layer exists, -EACCES permission denied, -EDQUOT a
 * quota or limit, -EBUSY daemon queue full, or the layer still loading or
 * unloading (retry), -ETIME deadline passed,
 * -ECANCELED cancelled, -ENOTSUP unsupported, -EPROTO protocol error,
 * -EIO unreadable weight file, -ENOMEM out of memory, -ENOTRECOVERABLE
 * daemon fault, -ETIMEDOUT no answer in time, -ECONNREFUSED daemon not
 * running, -ECONNRESET connection lost. moe_strerror() names a code;
 * moe_errmsg() gives the calling thread's last detailed message (the
 * daemon's own words where it answered).
 *
 * NULL: where a call needs a pointer (the client, an argument block, an
 * out pointer, a request), NULL is refused with -EINVAL, unless the call
 * says that it accepts NULL; the calls that return nothing ignore a NULL
 * client, and the region accessors give NULL or 0 for a NULL region. A
 * request larger than the daemon takes (its max_message_bytes: a long
 * m_sizes or expert_device, say) is refused with -EDQUOT, nothing sent.
 *
 * Threads: a moe_client may be used from several threads at once; calls on
 * it are serialised where they touch its sockets. moe_request handles belong
 * to the client that made them.
 *
 * fork(): a client belongs to the process that connected it. A child of
 * fork() closes its copies of the client's session sockets as it starts
 * (so the parent's session ends when the parent disconnects or exits, child
 * or not; the child's copy of the ZeroMQ connection, which only libzmq's
 * threads could close, lasts as long as the child and holds nothing of the
 * session). Its calls fail at once with -EINVAL (they never use the parent's
 * session, whose replies the child would take), moe_set_timeout and
 * moe_set_spin_us do nothing, moe_request_free frees the handle alone, and
 * moe_region_free and moe_disconnect release only the child's copies (the
 * parent's regions stay registered; moe_region_data stays valid, the
 * memory is shared), from one thread of the child at a time. A child
 * connects anew with moe_connect. fork() from a signal handler that
 * interrupted a libmoe call is not supported.
 *
 * Signals: the caller's signal handlers may run during any call (with or
 * without SA_RESTART); a call that a signal interrupts goes on where it was,
 * within its timeout, and loses no request or reply.
 *
 * Daemon restarts: when moed stops or restarts, the call in flight fails
 * with -ECONNRESET (requests already submitted are lost and moe_wait says
 * so, except those the daemon answered before it went: moe_wait returns
 * their results, whichever call noticed first, also after a reconnection)
 * and calls fail with -ECONNREFUSED while it is down. The next call
 * after it is back opens a new session and re-registers the client's
 * regions: moe_region handles stay valid (their ids change). Layers that the
 * client uploaded died with the old daemon and must be loaded again.
 */
#ifndef MOE_H
#define MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_PROTOCOL_VERSION 1

typedef struct moe_client moe_client;
typedef struct moe_region moe_region;
typedef struct moe_request moe_request;

typedef enum moe_dtype {
    MOE_DTYPE_BF16 = 1,
    MOE_DTYPE_FP16 = 2,
    MOE_DTYPE_FP32 = 3,
    MOE_DTYPE_INT32 = 4,
    MOE_DTYPE_INT64 = 5,
} moe_dtype;

typedef enum moe_routing {
    MOE_ROUTING_SOFTMAX = 0,
    MOE_ROUTING_SIGMOID = 1,
    MOE_ROUTING_GIVEN = 2,
} moe_routing;

typedef enum moe_layer_kind {
    MOE_LAYER_MOE = 0,
    MOE_LAYER_GEMM = 1,
} moe_layer_kind;

#define MOE_MAX_DIMS 4

/* A tensor in one of the caller's regions. region NULL means "absent". A
 * call given a tensor in a region that is not its client's (another
 * client's, or freed) refuses it with -EINVAL. */
typedef struct moe_tensor {
    const moe_region *region;
    uint64_t offset;
    moe_dtype dtype;
    int ndim;
    uint64_t shape[MOE_MAX_DIMS];
} moe_tensor;

/* Daemon timings of one request. */
typedef struct moe_timings {
    uint64_t queue_us;      /* arrival to the start of its batch */
    uint64_t compute_us;    /* the whole batch's compute, copies included */
    uint32_t batch_requests;
    uint32_t batch_tokens;
} moe_timings;

/* ---- errors ------------------------------------------------------------ */

/* Static text for an error code; never NULL. */
const char *moe_strerror(int err);
/* The calling thread's last error message; "" if none. Valid until the
 * thread's next libmoe call. */
const char *moe_errmsg(void);

/* ---- connection -------------------------------------------------------- */

/*
 * Connect to moed. runtime_dir NULL (or empty) follows the daemon's rule:
 * $MOED_RUNTIME_DIR, else /run/moed for root, else $XDG_RUNTIME_DIR/moed,
 * else /tmp/moed-<uid>.
 * client_name appears in the daemon's logs (may be NULL). Caller owns *out;
 * release with moe_disconnect().
 *
 * Compute requests and their replies go on a socket of the client's own
 * (the daemon's loop reads the request, the reply wakes the waiting thread:
 * no ZeroMQ I/O thread on the way); whatever it cannot take at once goes by
 * ZeroMQ. In the environment at connect time, MOE_REQUESTS=zmq sends the
 * requests by ZeroMQ, MOE_REPLIES=zmq keeps both on ZeroMQ.
 */
int moe_connect(const char *runtime_dir, const char *client_name, moe_client **out);
/* Close the session (the daemon releases its regions); sets *c = NULL.
 * Regions not freed are unmapped here too. Requests not yet collected are
 * lost: free their handles with moe_request_free(NULL, &req). Accepts
 * NULL. moe_connect waits up to the default timeout of 60 s to connect and
 * as long again for OpenSession: no timeout can be set before there is a
 * client. */
void moe_disconnect(moe_client **c);

/* Default timeout of synchronous calls, ms (default 60000; <0: forever).
 * It bounds each wait of a call on a daemon that stopped answering: for
 * room to send (a submit too: -ETIMEDOUT, nothing sent), to connect (and
 * then for OpenSession), and for the reply. A region's create or free,
 * and a reconnection (its connect, OpenSession and the regions registered
 * again), wait for the daemon (which pins a region as it registers it) without
 * holding up the client's other threads, but one at a time: a create, or
 * a call that must reconnect or finds a reconnection under way, waits for
 * the one before up to its timeout (then -ETIMEDOUT, nothing sent, the
 * session kept); a free waits as long as that one takes. A call that times out gives up
 * its reply (the request may still run).
 * Where it waited on the session socket (a region's create or free, or the
 * regions registered again after a restart), it also ends the session: the
 * next call opens a new one, as after a daemon restart, so requests in
 * flight, other threads' too, are lost (-ECONNRESET), and the regions are
 * registered again. */
void moe_set_timeout(moe_client *c, int timeout_ms);
/* Busy-poll up to spin_us microseconds for a reply before sleeping on the
 * socket (default 0: sleep at once). Spinning trades a CPU for the
 * wake-up latency of a sleeping thread; worth it only where cores are
 * spare. */
void moe_set_spin_us(moe_client *c, unsigned spin_us);
/* Busy-poll for a compute request's reply (moe_forward, moe_gemm,
 * moe_wait) only around the time it is expected: from ahead_us before to
 * ahead_us after the round trip this client's compute requests have been
 * taking (a running mean of the waits that found no reply yet), sleeping
 * on the socket before and after. Each pass yields the CPU
 * (sched_yield), so other threads runnable on the core go first. Meant
 * for clients that send back to back under a steady load: their reply
 * finds them awake instead of waking them. Default 0: off. */
void moe_set_spin_ahead_us(moe_client *c, unsigned ahead_us);

typedef struct moe_device_info {
    char name[96];
    uint64_t memory_bytes;
    uint32_t compute_units;
} moe_device_info;

typedef struct moe_server_info {
    uint32_t protocol_version;
    char server_version[32];
    char backend[16];
    int n_devices; /* up to 8: moe_devices() lists every one */
    moe_device_info devices[8];
    uint64_t max_message_bytes;
    uint32_t max_batch_tokens;
    char capabilities[512]; /* comma separated */
} moe_server_info;

/* One round trip (Hello). info may be NULL. */
int moe_hello(moe_client *c, moe_server_info *info);

/* Every device the daemon serves on (one round trip, Hello; a daemon may
 * have up to 16, moe_server_info holds 8): returns how many it has, n, or
 * -errno, and fills out[0 .. min(n, max)); past max the rest are left out.
 * out may be NULL with max 0, to count them. Symbol version LIBMOE_0.1:
 * a program that calls it does not start against an older libmoe.so.0. */
int moe_devices(moe_client *c, moe_device_info *out, int max);

/* ---- regions ----------------------------------------------------------- */

/* Create a shared-memory region of size bytes (a sealed memfd), map it here
 * and register it with the daemon. name labels it (in the daemon's logs
 * and /proc; NULL or "": "moe-region"), cut to 63 bytes. Caller owns *out;
 * free with moe_region_free(). -EINVAL for size 0, -EFBIG for a size above
 * INT64_MAX, -ENOMEM where it cannot be mapped, -EDQUOT over the daemon's
 * max_region_bytes, max_regions or max_session_bytes. */
int moe_region_create(moe_client *c, size_t size, const char *name, moe_region **out);
/* Unregister, unmap and free; sets *r = NULL. Accepts NULL. A region that
 * is not one of c's (another client's, or freed already through a copy of
 * the handle) is refused with -EINVAL and left as it is; but a copy of a
 * freed handle, like any freed pointer, may name a region made since at
 * the same address. */
int moe_region_free(moe_client *c, moe_region **r);
void *moe_region_data(const moe_region *r);
size_t moe_region_size(const moe_region *r);
uint64_t moe_region_id(const moe_region *r);

/* Build tensors. */
moe_tensor moe_tensor_2d(const moe_region *r, uint64_t offset, moe_dtype dt, uint64_t d0,
                         uint64_t d1);
moe_tensor moe_tensor_3d(const moe_region *r, uint64_t offset, moe_dtype dt, uint64_t d0,
                         uint64_t d1, uint64_t d2);
size_t moe_dtype_size(moe_dtype dt);
/* Bytes of a tensor, 0 if absent or on overflow. */
uint64_t moe_tensor_bytes(const moe_tensor *t);

/* ---- layers ------------------------------------------------------------ */

typedef struct moe_layer_desc {
    const char *name;
    moe_layer_kind kind;
    moe_dtype dtype;            /* 0: the file's */
    /* MOE layers; 0 for a dimension means "from the file". */
    uint32_t experts, topk, hidden, intermediate;
    moe_routing routing;
    int renormalize;
    /* GEMM layers: B [groups, n, k]. */
    uint32_t groups, n, k;
    /* From a file under one of the daemon's allowed directories ... */
    const char *path;
    const char *prefix;         /* MOE: name prefix; GEMM: tensor name */
    /* ... or uploaded from regions: MOE w1/w3 [E,I,H], w2 [E,H,I]; GEMM w1. */
    moe_tensor w1, w3, w2;
    /* MOE: spread the experts over these devices (NULL: device 0 alone),
     * evenly in contiguous ranges or as expert_device ([experts]) says. */
    const uint32_t *devices;
    size_t n_devices;
    const uint32_t *expert_device;
    size_t n_expert_device;
} moe_layer_desc;

typedef struct moe_layer_info {
    char name[65];
    moe_layer_kind kind;
    moe_dtype dtype;
    uint32_t experts, topk, hidden, intermediate;
    moe_routing routing;
    int renormalize;
    uint32_t groups, n, k;
    char source[512];
    uint64_t weight_bytes;
    uint64_t requests, tokens;
    /* Where the weights live: devices and the bytes on each. */
    int n_devices;
    uint32_t devices[16];
    uint64_t device_bytes[16];
} moe_layer_info;

/* Load a layer; info (may be NULL) receives what the daemon loaded. */
int moe_layer_load(moe_client *c, const moe_layer_desc *desc, moe_layer_info *info);
int moe_layer_unload(moe_client *c, const char *name);
/* Fill up to max entries; returns the number of layers loaded (which may
 * exceed max) or a negative error. out may be NULL where max <= 0. */
int moe_layer_list(moe_client *c, moe_layer_info *out, int max);

/* ---- compute ----------------------------------------------------------- */

/* One MoE block forward. x [T, H] and out [T, H] in the layer's dtype.
 * Routing from logits [T, E] (fp32 or the layer dtype), or for a layer with
 * MOE_ROUTING_GIVEN from topk_ids [T, k] (int32/int64) and topk_weights
 * [T, k] (fp32). timeout_us > 0: the request expires unless it starts within
 * that time of reaching the daemon. */
typedef struct moe_forward_args {
    const char *layer;
    moe_tensor x, logits, topk_ids, topk_weights, out;
    uint64_t timeout_us;
    int no_batch;       /* run alone, never merged with other requests */
} moe_forward_args;

/* C [M, N] = A [M, K] . B[g]^T with A's rows grouped by m_sizes[groups]
 * (m_sizes NULL with groups > 0: -EINVAL). */
typedef struct moe_gemm_args {
    const char *layer;
    moe_tensor a, c;
    const uint64_t *m_sizes;
    size_t groups;
    uint64_t timeout_us;
    int no_batch;
} moe_gemm_args;

/* Synchronous: returns when out/c holds the result. timings may be NULL. */
int moe_forward(moe_client *c, const moe_forward_args *args, moe_timings *timings);
int moe_gemm(moe_client *c, const moe_gemm_args *args, moe_timings *timings);

/* Asynchronous: submit now, collect later with moe_wait (or test with
 * moe_poll). Caller owns *req until moe_wait returns, which frees it. */
int moe_forward_submit(moe_client *c, const moe_forward_args *args, moe_request **req);
int moe_gemm_submit(moe_client *c, const moe_gemm_args *args, moe_request **req);
/* Wait up to timeout_ms (<0: the client's default) for the result; returns
 * the request's status and frees *req (set to NULL) unless -ETIMEDOUT. A
 * request of another client is refused (-EINVAL, *req left as it is), here
 * and by moe_poll. */
int moe_wait(moe_client *c, moe_request **req, int timeout_ms, moe_timings *timings);
/* 1 if the result has arrived (moe_wait will not block), 0 if not, <0 error. */
int moe_poll(moe_client *c, moe_request *req);
/* Give up a request without waiting for it: its result, when it comes, is
 * dropped. c may be NULL (after moe_disconnect: the handle is freed).
 * Sets *req = NULL; accepts NULL. A request that c did not make is freed
 * as with c NULL, and c's requests are left alone (the client that made it
 * keeps its result, when it comes, until moe_disconnect). */
void moe_request_free(moe_client *c, moe_request **req);

/* ---- stats ------------------------------------------------------------- */

#define MOE_STATS_BUCKETS 32
typedef struct moe_stats {
    uint64_t uptime_us;
    uint64_t requests, errors, busy, expired, batches, tokens;
    uint32_t sessions, regions;
    uint64_t region_bytes;
    uint32_t queue_depth;
    uint64_t queue_wait_p50_us, queue_wait_p99_us;
    uint64_t compute_p50_us, compute_p99_us, compute_us_total;
    /* A batch cycle under load (p50s): the device's idle time between two
     * batches, and of it, in order, the daemon answering a batch's requests
     * (reply), taking the batch back (notice), waiting for the rest of the
     * next requests (return) and starting the compute (launch). */
    uint64_t idle_p50_us, idle_p99_us, notice_p50_us, reply_p50_us, return_p50_us,
        launch_p50_us;
    /* Histograms: count of batches with at most `le` requests / tokens. */
    int n_batch_requests, n_batch_tokens;
    struct {
        uint64_t le, count;
    } batch_requests[MOE_STATS_BUCKETS], batch_tokens[MOE_STATS_BUCKETS];
    char backend[16];
} moe_stats;

int moe_stats_get(moe_client *c, moe_stats *out);

#ifdef __cplusplus
}
#endif

#endif
