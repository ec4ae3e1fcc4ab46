/*
 * layer.c: the layer registry. A LoadLayer request reserves its name at once
 * (state LOADING, so a second load of the same name fails fast), reads and
 * uploads the weights on the loader thread, and answers when they are
 * resident. Requests hold references to their layer, so an unload while a
 * batch runs frees the weights only after that batch completes.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/layer.h"
#include "daemon/log.h"
#include "daemon/region.h"
#include "daemon/server.h"
#include "daemon/util.h"
#include "moe.pb-c.h"

struct load_job {
    struct job job;
    struct server *s;
    struct layer *layer;
    struct layer_spec spec;
    char *path, *prefix;
    /* Upload from regions instead of a file. */
    bool upload;
    struct tensor_ref w1, w3, w2;
    /* Expert parallelism: the devices, and optionally a device per expert. */
    uint32_t devices[MAX_DEVICES];
    int n_devices;
    uint32_t *expert_map;
    int n_map;
    /* The reply goes here. */
    uint8_t route_id[ROUTE_ID_MAX];
    size_t route_len;
    uint64_t req_id;
    uint64_t start_us;
    /* Run at once by its caller, which reports a failure (a queued load's
     * is logged here). */
    bool sync;
    /* A client's LoadLayer: counted in s->client_loads until done. */
    bool from_client;
    /* Result. */
    int rc;
    char err[512];
};

struct layer *layer_find(struct server *s, const char *name)
{
    for (struct layer *l = s->layers; l; l = l->next)
        if (strcmp(l->name, name) == 0)
            return l;
    return NULL;
}

unsigned layer_count(const struct server *s)
{
    unsigned n = 0;
    for (const struct layer *l = s->layers; l; l = l->next)
        n++;
    return n;
}

struct layer *layer_ref(struct layer *l)
{
    l->refs++;
    return l;
}

void layer_unref(struct server *s, struct layer **lp)
{
    struct layer *l = *lp;
    *lp = NULL;
    if (!l || --l->refs > 0)
        return;
    if (l->weights)
        s->backend->ops->weights_free(s->backend, l->weights);
    shard_done(&l->shards, s->backends);
    free(l->place_expert);
    free(l);
}

static void layer_unlink(struct server *s, struct layer *l)
{
    for (struct layer **pp = &s->layers; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    l->unloaded = true;
}

/* Record where the weights ended up, for LayerInfo. */
static void layer_set_placement(struct layer *l)
{
    const struct shard_set *set = &l->shards;
    if (set->n == 0) {
        l->n_place = 1;
        l->place_devices[0] = 0;
        l->place_bytes[0] = l->weight_bytes;
        return;
    }
    l->n_place = set->n;
    for (int i = 0; i < set->n; i++) {
        l->place_devices[i] = (uint32_t)set->shards[i].device;
        l->place_bytes[i] = set->shards[i].bytes;
    }
    l->place_expert = calloc((size_t)set->experts, sizeof(uint32_t));
    for (int e = 0; l->place_expert && e < set->experts; e++)
        l->place_expert[e] = (uint32_t)set->shards[set->expert_shard[e]].device;
}

/* Loader thread: read (or take from regions), then hand to the backend. */
static void load_run(struct job *job)
{
    struct load_job *lj = (struct load_job *)job;
    struct layer *l = lj->layer;
    struct backend *b = lj->s->backend;
    struct host_weights hw = {0};
    const void *w1, *w3, *w2;
    if (lj->upload) {
        w1 = lj->w1.ptr;
        w3 = lj->w3.ptr;
        w2 = lj->w2.ptr;
        hw.bytes = lj->w1.bytes + lj->w3.bytes + lj->w2.bytes;
        snprintf(hw.source, sizeof(hw.source), "upload");
    } else {
        lj->rc = layer_read_weights(&lj->spec, lj->s->cfg->allowed_dirs,
                                    lj->s->cfg->n_allowed_dirs, &hw, lj->err, sizeof(lj->err));
        if (lj->rc)
            return;
        w1 = hw.w1;
        w3 = hw.w3;
        w2 = hw.w2;
        l->wire_dtype = hw.dtype;
        wire_dtype_to_moek(hw.dtype, &l->dt);
        if (l->kind == MOE__LAYER_KIND__LAYER_MOE) {
            l->shape.experts = (int)hw.experts;
            l->shape.hidden = (int)hw.hidden;
            l->shape.intermediate = (int)hw.intermediate;
        } else {
            l->groups = hw.groups;
            l->n = hw.n;
            l->k = hw.k;
        }
    }
    const bool spread = l->kind == MOE__LAYER_KIND__LAYER_MOE && lj->n_devices > 0;
    if (spread) {
        lj->rc = shard_plan(l->shape.experts, lj->devices, lj->n_devices, lj->expert_map, lj->n_map,
                            lj->s->n_backends, &l->shards, lj->err, sizeof(lj->err));
        if (!lj->rc)
            lj->rc = shard_upload(&l->shards, lj->s->backends, &l->shape, l->dt,
                                  l->routing == MOE__ROUTING__ROUTING_SIGMOID
                                      ? MOEK_SCORING_SIGMOID : MOEK_SCORING_SOFTMAX,
                                  l->renormalize, w1, w3, w2, lj->err, sizeof(lj->err));
        if (lj->rc)
            shard_done(&l->shards, lj->s->backends);
    } else if (l->kind == MOE__LAYER_KIND__LAYER_MOE) {
        moek_scoring sc = l->routing == MOE__ROUTING__ROUTING_SIGMOID ? MOEK_SCORING_SIGMOID
                                                                     : MOEK_SCORING_SOFTMAX;
        lj->rc = b->ops->moe_new(b, &l->shape, l->dt, sc, l->renormalize, w1, w3, w2, &l->weights);
    } else {
        lj->rc = b->ops->gemm_new(b, l->dt, (int)l->groups, (int)l->n, (int)l->k, w1, &l->weights);
    }
    if (lj->rc && !lj->err[0]) {
        /* The backend's note only where its own call failed: a spread
         * layer's plan can fail short of memory before any. */
        char why[256] = "";
        if (!spread)
            backend_error_note(b, why, sizeof(why));
        snprintf(lj->err, sizeof(lj->err), "%s backend cannot hold the weights: %s%s", b->name,
                 lj->rc == -ENOMEM ? "out of memory" : lj->rc == -ENOTSUP ? "shape not supported"
                                                     : strerror(-lj->rc),
                 why);
    }
    l->weight_bytes = hw.bytes;
    snprintf(l->source, sizeof(l->source), "%s", hw.source);
    host_weights_done(&hw);
    if (!lj->rc)
        layer_set_placement(l);
}

/* Where a ready MoE layer's token tiles come from (the tile table or the
 * kernels' heuristic), once per layer, for backends that choose tiles; a
 * spread layer reports its first shard. */
static void layer_log_tiles(struct server *s, const struct layer *l)
{
    struct backend *b = s->backend;
    void *h = l->weights;
    bool shard = false;
    if (!h && l->shards.n > 0) {
        b = s->backends[l->shards.shards[0].device];
        h = l->shards.shards[0].weights;
        shard = true;
    }
    if (l->kind != MOE__LAYER_KIND__LAYER_MOE || !h || !b->ops->moe_tiles)
        return;
    char how[400] = "";
    b->ops->moe_tiles(b, h, how, sizeof(how));
    if (how[0])
        log_info("layer '%s': token tiles from %s%s", l->name, how,
                 shard ? " (its first shard)" : "");
}

/* What a job holds besides itself. */
static void load_job_clear(struct load_job *lj)
{
    tensor_ref_done(&lj->w1);
    tensor_ref_done(&lj->w3);
    tensor_ref_done(&lj->w2);
    free(lj->path);
    free(lj->prefix);
    free(lj->expert_map);
    lj->path = lj->prefix = NULL;
    lj->expert_map = NULL;
}

static void load_job_free(struct load_job *lj)
{
    load_job_clear(lj);
    free(lj);
}

/* Loop thread: publish the layer or drop it, and answer. */
static void load_done(struct job *job)
{
    struct load_job *lj = (struct load_job *)job;
    struct server *s = lj->s;
    struct layer *l = lj->layer;
    Moe__Reply rep = MOE__REPLY__INIT;
    Moe__LayerInfo info;
    if (lj->from_client)
        s->client_loads--;
    if (lj->rc) {
        if (!lj->sync)
            log_warn("cannot load layer '%s': %s", l->name, lj->err);
        layer_unlink(s, l);
        layer_unref(s, &l);
        if (lj->route_len)
            server_reply_error(s, lj->route_id, lj->route_len, lj->req_id, lj->rc, "%s", lj->err);
    } else {
        l->state = LAYER_READY;
        log_info("layer '%s' loaded: %s, %.1f MiB in %.2f s", l->name, l->source,
                 (double)l->weight_bytes / (1 << 20), (double)(now_us() - lj->start_us) / 1e6);
        layer_log_tiles(s, l);
        if (lj->route_len) {
            wire_layer_info(l, &info);
            rep.id = lj->req_id;
            rep.body_case = MOE__REPLY__BODY_LAYER;
            rep.layer = &info;
            server_reply(s, lj->route_id, lj->route_len, &rep);
        }
    }
    load_job_free(lj);
}

static struct layer *layer_reserve(struct server *s, const char *name)
{
    struct layer *l = calloc(1, sizeof(*l));
    if (!l)
        return NULL;
    snprintf(l->name, sizeof(l->name), "%s", name);
    l->state = LAYER_LOADING;
    l->refs = 1; /* the registry's */
    l->next = s->layers;
    s->layers = l;
    return l;
}

/* Fill the layer's declared fields; 0 or -EINVAL with err. */
static int layer_declare(struct layer *l, const struct layer_spec *sp, int routing,
                         bool renormalize, char *err, size_t errlen)
{
    l->kind = sp->kind;
    l->wire_dtype = sp->dtype;
    if (sp->dtype && wire_dtype_to_moek(sp->dtype, &l->dt) < 0) {
        snprintf(err, errlen, "dtype %s cannot hold weights (bf16, fp16 or fp32)",
                 wire_dtype_name(sp->dtype));
        return -EINVAL;
    }
    if (sp->kind != MOE__LAYER_KIND__LAYER_MOE && sp->kind != MOE__LAYER_KIND__LAYER_GEMM) {
        snprintf(err, errlen, "unknown layer kind %d", sp->kind);
        return -EINVAL;
    }
    if (routing < MOE__ROUTING__ROUTING_SOFTMAX || routing > MOE__ROUTING__ROUTING_GIVEN) {
        snprintf(err, errlen, "unknown routing %d", routing);
        return -EINVAL;
    }
    if (sp->experts > 4096 || sp->hidden > (1u << 20) || sp->intermediate > (1u << 20) ||
        sp->groups > 65536 || sp->n > (1u << 20) || sp->k > (1u << 20)) {
        snprintf(err, errlen, "layer dimensions out of range");
        return -EINVAL;
    }
    if (sp->kind == MOE__LAYER_KIND__LAYER_MOE && sp->topk == 0) {
        snprintf(err, errlen, "topk is required for a MoE layer");
        return -EINVAL;
    }
    l->shape.experts = (int)sp->experts;
    l->shape.topk = (int)sp->topk;
    l->shape.hidden = (int)sp->hidden;
    l->shape.intermediate = (int)sp->intermediate;
    l->routing = routing;
    l->renormalize = renormalize;
    l->groups = sp->groups;
    l->n = sp->n;
    l->k = sp->k;
    return 0;
}

static bool tensor_is(const struct tensor_ref *t, int dtype, uint64_t a, uint64_t b, uint64_t c)
{
    return t->dtype == dtype && t->ndim == 3 && t->shape[0] == a && t->shape[1] == b &&
           t->shape[2] == c;
}

/* Devices for a layer's experts: a list (with an optional device per
 * expert); nothing, or device 0 alone, keeps the layer whole on device 0. */
static int load_job_devices(struct server *s, struct load_job *lj, int kind, const uint32_t *devs,
                            size_t n_devs, const uint32_t *map, size_t n_map, char *err,
                            size_t errlen)
{
    if (n_devs == 0 && n_map == 0)
        return 0;
    if (kind != MOE__LAYER_KIND__LAYER_MOE) {
        snprintf(err, errlen, "only MoE layers spread their experts over devices");
        return -EINVAL;
    }
    if (n_devs == 0 || n_devs > MAX_DEVICES) {
        snprintf(err, errlen, "%zu devices listed (1 to %d)", n_devs, MAX_DEVICES);
        return -EINVAL;
    }
    for (size_t i = 0; i < n_devs; i++)
        if (devs[i] >= (uint32_t)s->n_backends) {
            snprintf(err, errlen, "device %u does not exist (this daemon has %d)", devs[i],
                     s->n_backends);
            return -EINVAL;
        }
    if (n_devs == 1 && devs[0] == 0 && n_map == 0)
        return 0;
    memcpy(lj->devices, devs, n_devs * sizeof(uint32_t));
    lj->n_devices = (int)n_devs;
    if (n_map) {
        if (n_map > 4096 || !(lj->expert_map = malloc(n_map * sizeof(uint32_t)))) {
            snprintf(err, errlen, "expert placement of %zu entries refused", n_map);
            return -EINVAL;
        }
        memcpy(lj->expert_map, map, n_map * sizeof(uint32_t));
        lj->n_map = (int)n_map;
    }
    return 0;
}

/* A LoadLayer's checks that need no file, into lj (cleared by the caller
 * with load_job_clear on error too): the declared layer, the file or the
 * uploaded tensors (from se's regions), and with s its placement on s's
 * devices (without a daemon, as for --check-config, there are none to
 * check it against). 0 or -errno with err. */
static int load_job_fill(struct server *s, struct session *se, const Moe__LoadLayer *m,
                         struct load_job *lj, char *err, size_t errlen)
{
    struct layer_spec *sp = &lj->spec;
    *sp = (struct layer_spec){
        .kind = m->kind, .dtype = m->dtype, .experts = m->experts, .topk = m->topk,
        .hidden = m->hidden, .intermediate = m->intermediate, .groups = m->groups, .n = m->n,
        .k = m->k,
    };
    struct layer tmp = {0};
    int rc = layer_declare(&tmp, sp, m->routing, m->renormalize, err, errlen);
    bool has_path = m->path && m->path[0];
    lj->upload = m->w1 != NULL;
    if (!rc && has_path == lj->upload) {
        rc = -EINVAL;
        snprintf(err, errlen, "give either a file path or weight tensors (w1, w3, w2), not %s",
                 has_path ? "both" : "neither");
    }
    if (!rc && lj->upload) {
        bool moe = sp->kind == MOE__LAYER_KIND__LAYER_MOE;
        uint64_t E = sp->experts, H = sp->hidden, I = sp->intermediate;
        if (!sp->dtype || (moe && (!E || !H || !I)) || (!moe && (!sp->groups || !sp->n || !sp->k))) {
            rc = -EINVAL;
            snprintf(err, errlen, "an upload must state dtype and every dimension");
        } else if (moe && sp->topk > E) { /* a file's experts are checked as it is read */
            rc = -EINVAL;
            snprintf(err, errlen, "topk %u is above the layer's %llu experts", sp->topk,
                     (unsigned long long)E);
        }
        if (!rc)
            rc = wire_tensor(se, m->w1, "w1", &lj->w1, err, errlen);
        if (!rc && moe)
            rc = wire_tensor(se, m->w3, "w3", &lj->w3, err, errlen);
        if (!rc && moe)
            rc = wire_tensor(se, m->w2, "w2", &lj->w2, err, errlen);
        if (!rc && moe && !(tensor_is(&lj->w1, sp->dtype, E, I, H) &&
                            tensor_is(&lj->w3, sp->dtype, E, I, H) &&
                            tensor_is(&lj->w2, sp->dtype, E, H, I))) {
            rc = -EINVAL;
            snprintf(err, errlen, "w1/w3 must be %s [%llu, %llu, %llu] and w2 [%llu, %llu, %llu]",
                     wire_dtype_name(sp->dtype), (unsigned long long)E, (unsigned long long)I,
                     (unsigned long long)H, (unsigned long long)E, (unsigned long long)H,
                     (unsigned long long)I);
        }
        if (!rc && !moe && !tensor_is(&lj->w1, sp->dtype, sp->groups, sp->n, sp->k)) {
            rc = -EINVAL;
            snprintf(err, errlen, "w1 must be %s [%u, %u, %u]", wire_dtype_name(sp->dtype),
                     sp->groups, sp->n, sp->k);
        }
    } else if (!rc) {
        lj->path = strdup(m->path);
        lj->prefix = m->prefix && m->prefix[0] ? strdup(m->prefix) : NULL;
        if (!lj->path || (m->prefix && m->prefix[0] && !lj->prefix))
            rc = -ENOMEM;
        sp->path = lj->path;
        sp->prefix = lj->prefix;
    }
    if (!rc && s)
        rc = load_job_devices(s, lj, sp->kind, m->devices, m->n_devices, m->expert_device,
                              m->n_expert_device, err, errlen);
    if (rc && !err[0])
        snprintf(err, errlen, "out of memory");
    return rc;
}

/* Check a load and reserve its name: *out is the job, ready to run, its
 * layer LOADING; or an error with err. from_client: a client's LoadLayer,
 * which counts against max_loads (the configuration's loads do not). */
static int load_prepare(struct server *s, struct session *se, const Moe__LoadLayer *m,
                        bool from_client, struct load_job **out, char *err, size_t errlen)
{
    err[0] = '\0';
    if (!name_valid(m->name)) {
        snprintf(err, errlen, "layer names are 1-64 characters of A-Z a-z 0-9 . _ -");
        return -EINVAL;
    }
    const struct layer *had = layer_find(s, m->name);
    if (had) {
        snprintf(err, errlen, "a layer named '%s' is already %s", m->name,
                 had->state == LAYER_LOADING ? "being loaded" : "loaded");
        return -EEXIST;
    }
    /* Layers outlive the sessions that load them, so their number is
     * capped, and so is the loader's queue. */
    unsigned n_layers = layer_count(s);
    if (n_layers >= s->cfg->max_layers) {
        snprintf(err, errlen, "%u layers are loaded or loading, the limit (max_layers)", n_layers);
        return -EDQUOT;
    }
    if (from_client && s->client_loads >= s->cfg->max_loads) {
        snprintf(err, errlen, "%u loads are in flight, the limit (max_loads); try again",
                 s->client_loads);
        return -EBUSY;
    }
    struct load_job *lj = calloc(1, sizeof(*lj));
    if (!lj) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    lj->s = s;
    lj->start_us = now_us();
    int rc = load_job_fill(s, se, m, lj, err, errlen);
    if (!rc && !(lj->layer = layer_reserve(s, m->name))) {
        rc = -ENOMEM;
        snprintf(err, errlen, "out of memory");
    }
    if (rc) {
        load_job_free(lj);
        return rc;
    }
    layer_declare(lj->layer, &lj->spec, m->routing, m->renormalize, err, errlen);
    lj->job.run = load_run;
    lj->job.done = load_done;
    *out = lj;
    return 0;
}

void layer_handle_load(struct server *s, struct session *se, const uint8_t *route_id,
                       size_t route_len, uint64_t req_id, const void *msg)
{
    struct load_job *lj;
    char err[512] = "";
    int rc = load_prepare(s, se, msg, true, &lj, err, sizeof(err));
    if (rc) {
        server_reply_error(s, route_id, route_len, req_id, rc, "%s", err);
        return;
    }
    lj->req_id = req_id;
    memcpy(lj->route_id, route_id, route_len);
    lj->route_len = route_len;
    lj->from_client = true;
    s->client_loads++;
    worker_submit(s->loader, &lj->job);
}

/* A layer section as the LoadLayer request a client would send for it: the
 * one translation of a section into a load (strings borrowed from lc). */
static void conf_request(const struct layer_conf *lc, Moe__LoadLayer *m)
{
    *m = (Moe__LoadLayer)MOE__LOAD_LAYER__INIT;
    m->name = lc->name;
    m->kind = lc->kind;
    m->dtype = lc->dtype;
    m->experts = lc->experts;
    m->topk = lc->topk;
    m->hidden = lc->hidden;
    m->intermediate = lc->intermediate;
    m->routing = lc->routing;
    m->renormalize = lc->renormalize;
    m->groups = lc->groups;
    m->n = lc->n;
    m->k = lc->k;
    m->path = lc->path;
    m->prefix = lc->prefix ? lc->prefix : "";
    m->n_devices = lc->n_devices;
    m->devices = (uint32_t *)lc->devices;
    m->n_expert_device = lc->n_expert_devices;
    m->expert_device = lc->expert_devices;
}

int layer_load_conf(struct server *s, const struct layer_conf *lc, bool queued, char *err,
                    size_t errlen)
{
    Moe__LoadLayer m;
    conf_request(lc, &m);
    struct load_job *lj;
    int rc = load_prepare(s, NULL, &m, false, &lj, err, errlen);
    if (rc)
        return rc;
    if (queued) {
        worker_submit(s->loader, &lj->job);
        return 0;
    }
    lj->sync = true;
    load_run(&lj->job);
    rc = lj->rc;
    if (rc)
        snprintf(err, errlen, "%s", lj->err);
    load_done(&lj->job);
    return rc;
}

int layer_conf_check(struct server *s, const struct layer_conf *lc, char *const *allowed,
                     size_t n_allowed, struct host_weights *out, char *err, size_t errlen)
{
    Moe__LoadLayer m;
    struct load_job lj = {.s = s};
    struct host_weights hw;
    out = out ? out : &hw;
    memset(out, 0, sizeof(*out));
    conf_request(lc, &m);
    err[0] = '\0';
    int rc = load_job_fill(s, NULL, &m, &lj, err, errlen);
    if (!rc)
        rc = layer_check_weights(&lj.spec, allowed, n_allowed, out, err, errlen);
    /* the placement against the experts the file holds, as load_run plans it */
    if (!rc && lj.n_devices > 0) {
        struct shard_set set;
        rc = shard_plan((int)out->experts, lj.devices, lj.n_devices, lj.expert_map, lj.n_map,
                        s->n_backends, &set, err, errlen);
        if (!rc)
            shard_done(&set, s->backends);
        else if (rc == -ENOMEM)
            snprintf(err, errlen, "out of memory");
    }
    load_job_clear(&lj);
    return rc;
}

bool layer_conf_same(const struct layer_conf *a, const struct layer_conf *b)
{
    Moe__LoadLayer ma, mb;
    conf_request(a, &ma);
    conf_request(b, &mb);
    size_t na = moe__load_layer__get_packed_size(&ma), nb = moe__load_layer__get_packed_size(&mb);
    if (na != nb)
        return false;
    uint8_t *pa = malloc(na ? na : 1), *pb = malloc(nb ? nb : 1);
    bool same = pa && pb && moe__load_layer__pack(&ma, pa) == na &&
                moe__load_layer__pack(&mb, pb) == nb && !memcmp(pa, pb, na);
    free(pa);
    free(pb);
    return same;
}

int layer_unload(struct server *s, const char *name)
{
    struct layer *l = layer_find(s, name);
    if (!l)
        return -ENOENT;
    if (l->state == LAYER_LOADING)
        return -EBUSY;
    layer_unlink(s, l);
    batch_cancel_layer(s, l, -ECANCELED, "layer was unloaded");
    layer_unref(s, &l);
    return 0;
}

void layer_unload_all(struct server *s)
{
    /* Loading layers belong to queued load jobs, which the loader worker's
     * shutdown completes first; what is left here is ready. */
    while (s->layers) {
        struct layer *l = s->layers;
        layer_unlink(s, l);
        batch_cancel_layer(s, l, -ECANCELED, "daemon is stopping");
        layer_unref(s, &l);
    }
}
