/*
 * ep.cu: expert parallelism over several GPUs of one process (moe_cuda.h,
 * "expert parallelism").
 *
 * A forward of a layer whose experts are spread over n devices:
 *
 *   1. the batch (x, and the router logits or the given ids and weights) is
 *      copied from the caller's pinned host memory to the home device
 *      (devices[0]);
 *   2. dispatch: the home device sends the batch to every other device;
 *   3. each device runs the one-GPU fused kernel on its own experts: it
 *      routes every token over all E experts (the routing is deterministic,
 *      so every device picks the same top-k) and keeps the slots of its
 *      experts through its remap table; the others contribute nothing;
 *   4. combine: every other device sends its partial output [T, H] back to
 *      the home device, which sums the partials in fp32 (device order) and
 *      copies the sum to the caller.
 *
 * Sending the whole batch to every device costs T*H bytes per device and no
 * host synchronisation: the sizes of every transfer are known on the host
 * before anything is routed, so the whole forward is enqueued at once and
 * the host waits once, at the end.
 *
 * Transports: NCCL send/recv in one group per exchange (libnccl.so.2 is
 * opened at run time, so moed needs NCCL only where it spreads layers over
 * GPUs), or peer copies (cudaMemcpyPeerAsync, over NVLink where the devices
 * have it) ordered by events. NVLink multicast (NVLS) is never used.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"

/* The few NCCL declarations used here (nccl.h is not needed to build: the
 * library is opened at run time; these are stable across NCCL 2.x). */
typedef struct ncclComm *ncclComm_t;
typedef int ncclResult_t;   /* an enum in nccl.h */
typedef int ncclDataType_t; /* an enum in nccl.h */
static const ncclResult_t ncclSuccess = 0;
static const ncclDataType_t ncclUint8 = 1;

#define EP_MAX 16

/* ---- NCCL, opened at run time ------------------------------------------- */

struct nccl_api {
    void *lib;
    ncclResult_t (*comm_init_all)(ncclComm_t *, int, const int *);
    ncclResult_t (*comm_destroy)(ncclComm_t);
    ncclResult_t (*comm_abort)(ncclComm_t); /* NULL where the library lacks it */
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t,
                         cudaStream_t);
    ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t,
                         cudaStream_t);
    const char *(*error_string)(ncclResult_t);
    ncclResult_t (*get_version)(int *);
};

static int nccl_open(nccl_api *api)
{
    memset(api, 0, sizeof(*api));
    api->lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!api->lib)
        return moek_cuda_refuse(-ENOTSUP, "NCCL is not installed (%s)",
                                dlerror());
#define SYM(field, name)                                                      \
    *(void **)&api->field = dlsym(api->lib, name);                            \
    if (!api->field) {                                                        \
        dlclose(api->lib);                                                    \
        api->lib = nullptr;                                                   \
        return moek_cuda_refuse(-ENOTSUP, "libnccl.so.2 lacks %s", name);     \
    }
    SYM(comm_init_all, "ncclCommInitAll");
    SYM(comm_destroy, "ncclCommDestroy");
    SYM(group_start, "ncclGroupStart");
    SYM(group_end, "ncclGroupEnd");
    SYM(send, "ncclSend");
    SYM(recv, "ncclRecv");
    SYM(error_string, "ncclGetErrorString");
    SYM(get_version, "ncclGetVersion");
#undef SYM
    /* Drops a communicator without waiting for its operations: for a group
     * whose forward failed (NCCL 2.4 and later). */
    *(void **)&api->comm_abort = dlsym(api->lib, "ncclCommAbort");
    return 0;
}

/* ---- the group ----------------------------------------------------------- */

struct ep_buf {
    void *p;
    size_t size;
};

struct ep_dev {
    int device;
    cudaStream_t stream;
    cudaEvent_t done;  /* its partial is ready (peer transport) */
    ep_buf x, route, wts, part;
    ep_buf recv;       /* home only: one partial per other device */
    moek_cuda_workspace *ws;
};

struct moek_cuda_ep {
    int n;
    moek_cuda_ep_transport transport;
    bool failed; /* a forward failed part way: the group is not reused */
    nccl_api nccl;
    ncclComm_t comm[EP_MAX];
    cudaEvent_t in_ready; /* the home device holds the batch (peer) */
    ep_dev d[EP_MAX];
    char name[48];
};

#define NCCL_OK(ep, call)                                                     \
    do {                                                                      \
        ncclResult_t r_ = (call);                                             \
        if (r_ != ncclSuccess)                                                \
            return moek_cuda_refuse(-EIO, "%s: %s", #call,                    \
                                    (ep)->nccl.error_string(r_));             \
    } while (0)

static int buf_reserve(ep_dev *d, ep_buf *b, size_t need)
{
    if (need <= b->size)
        return 0;
    size_t size = need + need / 4;
    void *p = nullptr;
    MOEK_CU(cudaSetDevice(d->device));
    MOEK_CU(cudaStreamSynchronize(d->stream));
    MOEK_CU(cudaMalloc(&p, size));
    cudaFree(b->p);
    b->p = p;
    b->size = size;
    return 0;
}

void moek_cuda_ep_free(moek_cuda_ep *ep)
{
    if (!ep)
        return;
    /* After a failure, send/recv may be left without their pairs: abort the
     * communicators before waiting for the streams their kernels are on. */
    if (ep->failed && ep->nccl.comm_abort)
        for (int i = 0; i < ep->n; i++)
            if (ep->comm[i]) {
                cudaSetDevice(ep->d[i].device);
                ep->nccl.comm_abort(ep->comm[i]);
                ep->comm[i] = nullptr;
            }
    for (int i = 0; i < ep->n; i++) {
        ep_dev *d = &ep->d[i];
        cudaSetDevice(d->device);
        if (d->stream)
            cudaStreamSynchronize(d->stream);
        if (ep->comm[i])
            ep->nccl.comm_destroy(ep->comm[i]);
        for (ep_buf *b : {&d->x, &d->route, &d->wts, &d->part, &d->recv})
            cudaFree(b->p);
        moek_cuda_workspace_free(d->ws);
        if (d->done)
            cudaEventDestroy(d->done);
        if (d->stream)
            cudaStreamDestroy(d->stream);
    }
    if (ep->in_ready) {
        cudaSetDevice(ep->d[0].device);
        cudaEventDestroy(ep->in_ready);
    }
    if (ep->nccl.lib)
        dlclose(ep->nccl.lib);
    (void)cudaGetLastError();
    free(ep);
}

bool moek_cuda_ep_failed(const moek_cuda_ep *ep)
{
    return ep && ep->failed;
}

static int ep_open_peer(moek_cuda_ep *ep)
{
    for (int i = 0; i < ep->n; i++)
        for (int j = 0; j < ep->n; j++) {
            int can = 0;
            if (i == j)
                continue;
            MOEK_CU(cudaDeviceCanAccessPeer(&can, ep->d[i].device,
                                            ep->d[j].device));
            if (!can)
                continue; /* copies still work, staged through the host */
            MOEK_CU(cudaSetDevice(ep->d[i].device));
            cudaError_t e = cudaDeviceEnablePeerAccess(ep->d[j].device, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled)
                (void)cudaGetLastError();
            else if (e != cudaSuccess)
                return moek_cuda_fail(e, "cudaDeviceEnablePeerAccess");
        }
    MOEK_CU(cudaSetDevice(ep->d[0].device));
    MOEK_CU(cudaEventCreateWithFlags(&ep->in_ready, cudaEventDisableTiming));
    for (int i = 0; i < ep->n; i++) {
        MOEK_CU(cudaSetDevice(ep->d[i].device));
        MOEK_CU(cudaEventCreateWithFlags(&ep->d[i].done,
                                         cudaEventDisableTiming));
    }
    snprintf(ep->name, sizeof ep->name, "peer copies");
    return 0;
}

static int ep_open_nccl(moek_cuda_ep *ep)
{
    int rc = nccl_open(&ep->nccl);
    if (rc)
        return rc;
    int devs[EP_MAX], version = 0;
    for (int i = 0; i < ep->n; i++)
        devs[i] = ep->d[i].device;
    NCCL_OK(ep, ep->nccl.comm_init_all(ep->comm, ep->n, devs));
    ep->nccl.get_version(&version);
    snprintf(ep->name, sizeof ep->name, "NCCL %d.%d.%d", version / 10000,
             version / 100 % 100, version % 100);
    return 0;
}

int moek_cuda_ep_new(const int *devices, int n,
                     moek_cuda_ep_transport transport, moek_cuda_ep **out)
{
    if (!devices || !out || n < 1 || n > EP_MAX)
        return moek_cuda_refuse(-EINVAL, "ep: %d devices (1 to %d)", n,
                                EP_MAX);
    *out = nullptr;
    const int count = moek_cuda_device_count();
    for (int i = 0; i < n; i++) {
        if (devices[i] < 0 || devices[i] >= count)
            return moek_cuda_refuse(-ENODEV, "ep: no CUDA device %d",
                                    devices[i]);
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i])
                return moek_cuda_refuse(-EINVAL, "ep: device %d twice",
                                        devices[i]);
    }
    moek_cuda_ep *ep = (moek_cuda_ep *)calloc(1, sizeof(*ep));
    if (!ep)
        return -ENOMEM;
    ep->n = n;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        ep->d[i].device = devices[i];
        cudaError_t e = cudaSetDevice(devices[i]);
        if (e == cudaSuccess)
            e = cudaStreamCreateWithFlags(&ep->d[i].stream,
                                          cudaStreamNonBlocking);
        if (e != cudaSuccess)
            rc = moek_cuda_fail(e, "ep: stream");
    }
    if (!rc && n == 1) {
        snprintf(ep->name, sizeof ep->name, "none (one device)");
        transport = MOEK_CUDA_EP_PEER;
    } else if (!rc && transport != MOEK_CUDA_EP_PEER) {
        rc = ep_open_nccl(ep);
        /* AUTO takes peer copies where NCCL is missing, and also where it
         * loads but cannot start (its bootstrap needs sockets that a
         * sandbox, moed.service's among them, may not allow). */
        if (rc && transport == MOEK_CUDA_EP_AUTO) {
            memset(ep->comm, 0, sizeof(ep->comm));
            transport = MOEK_CUDA_EP_PEER;
            rc = 0;
        } else {
            transport = MOEK_CUDA_EP_NCCL;
        }
    }
    if (!rc && transport == MOEK_CUDA_EP_PEER)
        rc = ep_open_peer(ep);
    if (rc) {
        char why[256];
        snprintf(why, sizeof why, "%s", moek_cuda_last_error());
        moek_cuda_ep_free(ep);
        return moek_cuda_refuse(rc, "%s", why);
    }
    ep->transport = transport;
    *out = ep;
    return 0;
}

const char *moek_cuda_ep_transport_name(const moek_cuda_ep *ep)
{
    return ep ? ep->name : "none";
}

/* ---- combine -------------------------------------------------------------- */

struct sum_args {
    const uint4 *part[EP_MAX];
    int n;
    uint4 *out;
    size_t n8; /* 8-element vectors */
};

template <typename T>
__global__ void sum_kernel(sum_args a)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < a.n8;
         i += (size_t)gridDim.x * blockDim.x) {
        float acc[8] = {};
        for (int p = 0; p < a.n; p++) {
            const uint4 v = a.part[p][i];
            const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 f = moek_dt<T>::unpack2(w[j]);
                acc[2 * j] += f.x;
                acc[2 * j + 1] += f.y;
            }
        }
        a.out[i] = make_uint4(moek_dt<T>::pack2(acc[0], acc[1]),
                              moek_dt<T>::pack2(acc[2], acc[3]),
                              moek_dt<T>::pack2(acc[4], acc[5]),
                              moek_dt<T>::pack2(acc[6], acc[7]));
    }
}

/* ---- forward -------------------------------------------------------------- */

static int ep_copy(moek_cuda_ep *ep, int to, void *dst, int from,
                   const void *src, size_t bytes, cudaStream_t st)
{
    MOEK_CU(cudaMemcpyPeerAsync(dst, ep->d[to].device, src, ep->d[from].device,
                                bytes, st));
    return 0;
}

/* Home device's buffer `b` to the same buffer of every other device. */
static int ep_dispatch(moek_cuda_ep *ep, size_t off, size_t bytes)
{
    if (bytes == 0 || ep->n == 1)
        return 0;
    /* off picks the buffer: an ep_buf field of ep_dev. */
    auto buf = [off](ep_dev *d) {
        return ((ep_buf *)((char *)d + off))->p;
    };
    if (ep->transport == MOEK_CUDA_EP_NCCL) {
        NCCL_OK(ep, ep->nccl.group_start());
        for (int i = 1; i < ep->n; i++) {
            ncclResult_t r = ep->nccl.send(buf(&ep->d[0]), bytes, ncclUint8, i,
                                           ep->comm[0], ep->d[0].stream);
            if (r == ncclSuccess)
                r = ep->nccl.recv(buf(&ep->d[i]), bytes, ncclUint8, 0,
                                  ep->comm[i], ep->d[i].stream);
            if (r != ncclSuccess) {
                ep->nccl.group_end();
                return moek_cuda_refuse(-EIO, "ncclSend/ncclRecv: %s",
                                        ep->nccl.error_string(r));
            }
        }
        NCCL_OK(ep, ep->nccl.group_end());
        return 0;
    }
    for (int i = 1; i < ep->n; i++) {
        int rc = ep_copy(ep, i, buf(&ep->d[i]), 0, buf(&ep->d[0]), bytes,
                         ep->d[i].stream);
        if (rc)
            return rc;
    }
    return 0;
}

/* The shards match the group and each other, and the routing is whole. */
static int ep_check(const moek_cuda_ep *ep, moek_cuda_moe_layer *const *layers,
                    const int32_t *const *remap_dev,
                    const moek_cuda_routing *routing_host)
{
    if (!layers[0])
        return moek_cuda_refuse(-EINVAL, "ep_forward: no home shard");
    const moek_cuda_moe_layer *L0 = layers[0];
    for (int i = 0; i < ep->n; i++) {
        const moek_cuda_moe_layer *L = layers[i];
        if (!L || !remap_dev[i] || L->device != ep->d[i].device ||
            L->dt != L0->dt || L->shape.hidden != L0->shape.hidden ||
            L->shape.topk != L0->shape.topk)
            return moek_cuda_refuse(-EINVAL, "ep_forward: shard %d does not "
                                    "match the group", i);
    }
    const bool logits = routing_host->kind == MOEK_CUDA_ROUTE_LOGITS;
    if (logits ? !routing_host->logits_dev
               : (!routing_host->ids_dev || !routing_host->weights_dev))
        return moek_cuda_refuse(-EINVAL, "ep_forward: bad routing");
    return 0;
}

/* The forward itself, once ep_check has passed. */
static int ep_forward(moek_cuda_ep *ep, moek_cuda_moe_layer *const *layers,
                      const int32_t *const *remap_dev, int route_experts,
                      const void *x_host, const moek_cuda_routing *routing_host,
                      int T, void *out_host)
{
    const moek_moe_shape &s0 = layers[0]->shape;
    const moek_dtype dt = layers[0]->dt;
    const int H = s0.hidden, k = s0.topk, E = route_experts;
    const bool logits = routing_host->kind == MOEK_CUDA_ROUTE_LOGITS;
    const size_t xb = (size_t)T * H * moek_dtype_size(dt);
    const size_t rb = (size_t)T * (logits ? E : k) * 4;
    const size_t wb = logits ? 0 : (size_t)T * k * 4;

    /* Buffers (each grows once, after its device's queue drains). */
    for (int i = 0; i < ep->n; i++) {
        ep_dev *d = &ep->d[i];
        int rc = buf_reserve(d, &d->x, xb);
        if (!rc)
            rc = buf_reserve(d, &d->route, rb);
        if (!rc && wb)
            rc = buf_reserve(d, &d->wts, wb);
        if (!rc)
            rc = buf_reserve(d, &d->part, xb);
        if (!rc && i == 0)
            rc = buf_reserve(d, &d->recv, xb * (ep->n - 1 ? ep->n - 1 : 1));
        const size_t need = moek_cuda_moe_workspace_size(layers[i], T);
        if (!rc && (!d->ws || moek_cuda_workspace_bytes(d->ws) < need)) {
            MOEK_CU(cudaSetDevice(d->device));
            MOEK_CU(cudaStreamSynchronize(d->stream));
            moek_cuda_workspace_free(d->ws);
            d->ws = nullptr;
            rc = moek_cuda_workspace_new(d->device, need + need / 4, &d->ws);
        }
        if (rc)
            return rc;
    }

    /* 1. In, on the home device. */
    ep_dev *h = &ep->d[0];
    MOEK_CU(cudaSetDevice(h->device));
    MOEK_CU(cudaMemcpyAsync(h->x.p, x_host, xb, cudaMemcpyHostToDevice,
                            h->stream));
    MOEK_CU(cudaMemcpyAsync(h->route.p,
                            logits ? (const void *)routing_host->logits_dev
                                   : (const void *)routing_host->ids_dev,
                            rb, cudaMemcpyHostToDevice, h->stream));
    if (wb)
        MOEK_CU(cudaMemcpyAsync(h->wts.p, routing_host->weights_dev, wb,
                                cudaMemcpyHostToDevice, h->stream));

    /* 2. Dispatch. */
    if (ep->transport == MOEK_CUDA_EP_PEER && ep->n > 1) {
        MOEK_CU(cudaEventRecord(ep->in_ready, h->stream));
        for (int i = 1; i < ep->n; i++)
            MOEK_CU(cudaStreamWaitEvent(ep->d[i].stream, ep->in_ready, 0));
    }
    int rc = ep_dispatch(ep, offsetof(ep_dev, x), xb);
    if (!rc)
        rc = ep_dispatch(ep, offsetof(ep_dev, route), rb);
    if (!rc)
        rc = ep_dispatch(ep, offsetof(ep_dev, wts), wb);
    if (rc)
        return rc;

    /* 3. Each device computes its experts' share. */
    for (int i = 0; i < ep->n; i++) {
        ep_dev *d = &ep->d[i];
        moek_cuda_routing r = *routing_host;
        if (logits) {
            r.logits_dev = (const float *)d->route.p;
        } else {
            r.ids_dev = (const int32_t *)d->route.p;
            r.weights_dev = (const float *)d->wts.p;
        }
        r.remap_dev = remap_dev[i];
        r.route_experts = E;
        MOEK_CU(cudaSetDevice(d->device));
        rc = moek_cuda_fused_moe(layers[i], d->ws, d->x.p, &r, T, d->part.p,
                                 d->stream);
        if (rc)
            return rc;
    }

    /* 4. Partials back to the home device, summed there. */
    if (ep->n > 1 && ep->transport == MOEK_CUDA_EP_NCCL) {
        NCCL_OK(ep, ep->nccl.group_start());
        for (int i = 1; i < ep->n; i++) {
            ncclResult_t r = ep->nccl.send(ep->d[i].part.p, xb, ncclUint8, 0,
                                           ep->comm[i], ep->d[i].stream);
            if (r == ncclSuccess)
                r = ep->nccl.recv((char *)h->recv.p + (i - 1) * xb, xb,
                                  ncclUint8, i, ep->comm[0], h->stream);
            if (r != ncclSuccess) {
                ep->nccl.group_end();
                return moek_cuda_refuse(-EIO, "ncclSend/ncclRecv: %s",
                                        ep->nccl.error_string(r));
            }
        }
        NCCL_OK(ep, ep->nccl.group_end());
    } else {
        for (int i = 1; i < ep->n; i++) {
            MOEK_CU(cudaSetDevice(ep->d[i].device));
            MOEK_CU(cudaEventRecord(ep->d[i].done, ep->d[i].stream));
            MOEK_CU(cudaSetDevice(h->device));
            MOEK_CU(cudaStreamWaitEvent(h->stream, ep->d[i].done, 0));
            rc = ep_copy(ep, 0, (char *)h->recv.p + (i - 1) * xb, i,
                         ep->d[i].part.p, xb, h->stream);
            if (rc)
                return rc;
        }
    }
    MOEK_CU(cudaSetDevice(h->device));
    sum_args a = {};
    a.part[0] = (const uint4 *)h->part.p;
    for (int i = 1; i < ep->n; i++)
        a.part[i] = (const uint4 *)((char *)h->recv.p + (i - 1) * xb);
    a.n = ep->n;
    a.out = (uint4 *)h->x.p; /* the input is no longer needed */
    a.n8 = (size_t)T * H / 8;
    const int sms = layers[0]->sms > 0 ? layers[0]->sms : 132;
    long long blocks = (long long)((a.n8 + 255) / 256);
    const int grid = (int)(blocks < 4LL * sms ? blocks : 4LL * sms);
    if (dt == MOEK_DTYPE_BF16)
        sum_kernel<__nv_bfloat16><<<grid, 256, 0, h->stream>>>(a);
    else
        sum_kernel<__half><<<grid, 256, 0, h->stream>>>(a);
    MOEK_CU(cudaGetLastError());
    MOEK_CU(cudaMemcpyAsync(out_host, h->x.p, xb, cudaMemcpyDeviceToHost,
                            h->stream));
    MOEK_CU(cudaStreamSynchronize(h->stream));
    return 0;
}

int moek_cuda_ep_forward(moek_cuda_ep *ep, moek_cuda_moe_layer *const *layers,
                         const int32_t *const *remap_dev, int route_experts,
                         const void *x_host,
                         const moek_cuda_routing *routing_host, int T,
                         void *out_host)
{
    if (!ep || !layers || !remap_dev || !routing_host || !x_host ||
        !out_host || T < 0)
        return moek_cuda_refuse(-EINVAL, "ep_forward: bad argument");
    if (ep->failed)
        return moek_cuda_refuse(-EIO, "ep_forward: the group failed before; "
                                "free it and make another");
    if (T == 0)
        return 0;
    int rc = ep_check(ep, layers, remap_dev, routing_host);
    if (rc)
        return rc;
    rc = ep_forward(ep, layers, remap_dev, route_experts, x_host, routing_host,
                    T, out_host);
    if (rc)
        ep->failed = true;
    return rc;
}
