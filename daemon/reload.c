/*
 * reload.c: see reload.h. A reload is a small state machine on the loop
 * thread, polled by a short timer:
 *
 *   read the file -> [wait until the loader is idle, if allowed_dirs changed:
 *   the loader thread reads them] -> the plan: which layers load again, and
 *   would their loads pass their checks (on the loader thread, since it
 *   reads files) -> unload and submit loads -> wait until
 *   every submitted load has finished -> [load the layers whose new load
 *   failed again from their former sections, and wait] -> done (READY=1)
 */
#include "daemon/reload.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "daemon/config.h"
#include "daemon/layer.h"
#include "daemon/log.h"
#include "daemon/loop.h"
#include "daemon/notify.h"
#include "daemon/safetensors.h"
#include "daemon/server.h"
#include "daemon/tiles.h"
#include "daemon/util.h"
#include "daemon/worker.h"
#include "moe.pb-c.h"

#define POLL_US 20000

/* The section a configured layer was loaded from (a copy), and the
 * identity its file had then, if known. */
struct file_id {
    char name[65];
    struct layer_conf *lc;
    bool have_st;
    struct stat st;
    struct file_id *next;
};

enum phase { IDLE, WAIT_LOADER, WAIT_PLAN, WAIT_LOADS };

/* A layer a reload unloaded to load it from its changed section: the
 * section it was loaded from (taken from its file_id; not always the
 * running configuration's, which may be one a reload kept it back from)
 * and the identity of that section's file when it was. */
struct former {
    struct layer_conf *lc;
    struct stat st;
};

struct plan;

struct reload {
    struct server *s;
    reload_read_fn read;
    void *read_data;
    reload_done_fn done;
    void *done_data;
    enum phase phase;
    bool again;
    struct config next;       /* being applied; holds the old parts afterwards */
    bool have_next;
    struct loop_watch *poll;
    struct file_id *files;
    char (*loading)[65];      /* names submitted to the loader */
    unsigned n_loading;
    struct former *former;    /* layers unloaded to load their new sections */
    unsigned n_former;
    bool restoring;           /* the loads are of former sections */
    struct plan *plan;        /* on the loader thread (WAIT_PLAN) */
    bool orphan;              /* reload_free ran meanwhile: the plan frees it */
    unsigned loaded, unloaded, kept, failed, restored;
    bool unread;              /* the configuration could not be read: nothing changed */
    size_t tiles_in_use;      /* the tile table's entries the backends hold (0: none) */
    bool tiles_bad;           /* this reload's table could not be used */
};

int reload_new(struct server *s, reload_read_fn read, void *read_data, struct reload **out)
{
    struct reload *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->s = s;
    r->read = read;
    r->read_data = read_data;
    *out = r;
    return 0;
}

static void formers_clear(struct reload *r)
{
    for (unsigned i = 0; i < r->n_former; i++)
        layer_conf_free(r->former[i].lc);
    r->n_former = 0;
}

/* What the reload holds (a plan on the loader thread reads r->next and
 * r->files: not while one is out). */
static void reload_destroy(struct reload *r)
{
    if (r->have_next)
        config_done(&r->next);
    while (r->files) {
        struct file_id *f = r->files;
        r->files = f->next;
        layer_conf_free(f->lc);
        free(f);
    }
    free(r->loading);
    formers_clear(r);
    free(r->former);
    free(r);
}

void reload_free(struct reload **rp)
{
    struct reload *r = *rp;
    *rp = NULL;
    if (!r)
        return;
    if (r->poll)
        loop_unwatch(r->s->loop, &r->poll);
    if (r->phase == WAIT_LOADS)
        notify_loading_end();
    if (r->plan) {
        r->orphan = true; /* the loader's last jobs finish in server_free: the plan frees it */
        return;
    }
    reload_destroy(r);
}

bool reload_running(const struct reload *r)
{
    return r->phase != IDLE;
}

/* ---- file identities ------------------------------------------------------ */

static struct file_id *file_find(struct reload *r, const char *name)
{
    for (struct file_id *f = r->files; f; f = f->next)
        if (!strcmp(f->name, name))
            return f;
    return NULL;
}

/* A layer is being loaded from section lc, whose file was st (NULL:
 * unknown). Out of memory, the layer is never seen as replaced and cannot
 * serve again from this section: harmless. */
static void file_track(struct reload *r, const struct layer_conf *lc, const struct stat *st)
{
    struct file_id *f = file_find(r, lc->name);
    struct layer_conf *copy = layer_conf_copy(lc);
    if (!f && copy && (f = calloc(1, sizeof(*f)))) {
        snprintf(f->name, sizeof(f->name), "%s", lc->name);
        f->next = r->files;
        r->files = f;
    }
    if (!f) {
        layer_conf_free(copy);
        return;
    }
    layer_conf_free(f->lc);
    f->lc = copy;
    f->have_st = copy && st;
    if (st)
        f->st = *st;
}

static bool same_file(const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* True when the file at path, which the layer was loaded from, is no
 * longer the one it was then. A file that cannot be stat'ed now is not
 * "changed": reloading it would fail and lose weights that are still
 * resident. A layer loaded from another path (a reload served it again
 * from its former section) is not "replaced" either: conf_behind says
 * why it loads again. */
static bool file_replaced(struct reload *r, const char *name, const char *path)
{
    struct file_id *f = file_find(r, name);
    struct stat st;
    if (!f || !f->lc || !f->have_st || strcmp(f->lc->path, path) != 0 || stat(path, &st) < 0)
        return false;
    return !same_file(&st, &f->st);
}

/* ---- the token-tile table ------------------------------------------------ */

int reload_tiles(struct reload *r)
{
    struct server *s = r->s;
    const char *path = s->cfg->tile_table;
    bool chooses = false;
    for (int i = 0; i < s->n_backends; i++)
        chooses |= s->backends[i]->ops->set_tiles != NULL;
    struct tile_table t;
    char err[512] = "", keep[128] = "token tiles from the kernels' heuristic";
    int rc = -ENOENT;
    tiles_init(&t);
    /* A table in use stays when its file cannot be used: the file may be
     * half-written, and the layers loaded meanwhile deserve the tiles the
     * others have. */
    if (r->tiles_in_use)
        snprintf(keep, sizeof(keep), "keeping the table in use (%zu entr%s)", r->tiles_in_use,
                 r->tiles_in_use == 1 ? "y" : "ies");
    if (!path[0])
        log_debug("no tile table (tile_table is empty): token tiles from the kernels' heuristic");
    else if ((rc = tiles_read(&t, path, err, sizeof(err))) == -ENOENT)
        log_msg(chooses ? LOG_LEVEL_INFO : LOG_LEVEL_DEBUG,
                "no tile table at %s (moed --tune writes one): token tiles from the kernels' "
                "heuristic", path);
    else if (rc == -EINVAL)
        log_warn("tile table %s; %s", err, keep);
    else if (rc)
        log_warn("tile table: %s; %s", err, keep);
    else
        log_info("tile table %s: %zu entr%s", path, t.n, t.n == 1 ? "y" : "ies");
    bool bad = rc && rc != -ENOENT, taken = true;
    if (!(bad && r->tiles_in_use)) {
        for (int i = 0; i < s->n_backends; i++) {
            struct backend *b = s->backends[i];
            if (b->ops->set_tiles && b->ops->set_tiles(b, rc ? NULL : &t) < 0) {
                log_warn("device %d: cannot take the tile table (out of memory); token tiles "
                         "from the kernels' heuristic", i);
                taken = false;
            }
        }
        r->tiles_in_use = rc == 0 && taken ? t.n : 0;
    }
    tiles_done(&t);
    return bad && chooses ? rc : 0;
}

/* ---- configured layers ----------------------------------------------------- */

static const struct layer_conf *conf_find(const struct layer_conf *l, const char *name)
{
    for (; l; l = l->next)
        if (!strcmp(l->name, name))
            return l;
    return NULL;
}

static unsigned conf_count(const struct layer_conf *l)
{
    unsigned n = 0;
    for (; l; l = l->next)
        n++;
    return n;
}

/* Load a section's layer (layer_load_conf: at once, or queued), marked as
 * the configuration's, with st, the identity its file had before the load
 * read it (NULL: unknown, and then never seen as replaced). 0 or -errno
 * with why. */
static int load_section(struct reload *r, const struct layer_conf *lc, bool queued,
                        const struct stat *st, char *why, size_t whylen)
{
    int rc = layer_load_conf(r->s, lc, queued, why, whylen);
    if (rc < 0)
        return rc;
    layer_find(r->s, lc->name)->from_config = true;
    file_track(r, lc, st);
    return 0;
}

int reload_load_initial(struct reload *r, char *err, size_t errlen)
{
    struct server *s = r->s;
    unsigned n = conf_count(s->cfg->layers), i = 0;
    char why[512] = "";
    int rc = 0;
    if (!n)
        return 0;
    notify_loading_begin(CLOCK_PROCESS_CPUTIME_ID); /* the loop is not serving yet */
    for (const struct layer_conf *lc = s->cfg->layers; lc; lc = lc->next) {
        notify_loading_layer(lc->name, ++i, n);
        struct stat st;
        bool have_st = stat(lc->path, &st) == 0;
        if ((rc = load_section(r, lc, false, have_st ? &st : NULL, why, sizeof(why))) < 0) {
            snprintf(err, errlen, "layer '%s': %s", lc->name, why);
            break;
        }
    }
    notify_loading_end();
    return rc;
}

/* ---- a reload ------------------------------------------------------------ */

static void reload_begin(struct reload *r);
static void on_poll(void *data);

static bool poll_start(struct reload *r)
{
    if (!r->poll)
        r->poll = loop_timer(r->s->loop, POLL_US, on_poll, r);
    return r->poll != NULL;
}

static void finish(struct reload *r)
{
    if (r->poll)
        loop_unwatch(r->s->loop, &r->poll);
    if (r->phase == WAIT_LOADS)
        notify_loading_end();
    if (r->have_next) {
        config_done(&r->next);
        r->have_next = false;
    }
    r->n_loading = 0;
    formers_clear(r);
    r->restoring = false;
    if (r->unread)
        log_notice("reload: failed (the configuration could not be read); nothing changed");
    else if (r->restored)
        log_notice("reload: %u layers loaded, %u unloaded, %u kept, %u failed (%u of them "
                   "serving again from their former sections)",
                   r->loaded, r->unloaded, r->kept, r->failed, r->restored);
    else
        log_notice("reload: %u layers loaded, %u unloaded, %u kept, %u failed", r->loaded,
                   r->unloaded, r->kept, r->failed);
    if (r->tiles_bad)
        log_notice("reload: the tile table could not be used (see above)");
    if (r->again && !r->s->draining) {
        log_info("reload: reading the configuration again, as asked meanwhile");
        reload_begin(r);
        return;
    }
    r->phase = IDLE;
    r->again = false;
    if (r->done)
        r->done(r->done_data, r->failed + r->tiles_bad);
}

/* Queue a section's load on the loader thread, st its file's identity
 * before (NULL: unknown): its outcome is logged by layer.c and checked by
 * on_poll(). */
static void submit_load(struct reload *r, const struct layer_conf *lc, const struct stat *st)
{
    char why[512] = "";
    /* A load refused here is counted with those that fail on the loader
     * (restore_begin): a layer just unloaded for it serves again from
     * its former section either way. */
    snprintf(r->loading[r->n_loading++], sizeof(r->loading[0]), "%s", lc->name);
    if (load_section(r, lc, true, st, why, sizeof(why)) < 0)
        log_err("reload: not loading layer '%s': %s", lc->name, why);
    else
        log_info("reload: loading layer '%s' from %s", lc->name, lc->path);
}

/* ---- the plan: what a reload does with each layer ---------------------------
 *
 * Which configured layers to load again, and whether their new load would
 * pass its checks, is decided on the loader thread: it stats the files and
 * reads their headers, which the loop thread must not wait on (a slow
 * disk or network filesystem would hold up every request). The loop thread
 * takes a snapshot of the layers first and applies the plan when it comes
 * back, skipping a layer that a client unloaded meanwhile. The plan reads
 * the old and new sections, r->files and allowed_dirs, none of which
 * changes until it is applied. */

struct plan_item {
    char name[65];
    const struct layer_conf *was, *is; /* the running and the new section */
    bool behind;                       /* the layer's conf_behind */
    const char *why;                   /* why it loads again, or NULL */
    bool bad;                          /* its new load would fail: */
    char bad_why[512];
};

/* The identity of a new section's file before its load reads it. */
struct plan_stat {
    const struct layer_conf *lc;
    const struct former *fo; /* a restore's: the former section of lc */
    bool have;
    int err; /* stat's, when not have */
    struct stat st;
};

struct plan {
    struct job job;
    struct reload *r;
    void (*apply)(struct reload *r, struct plan *p); /* on the loop thread */
    struct plan_item *items;
    unsigned n_items;
    struct plan_stat *stats;
    unsigned n_stats;
};

static void plan_free(struct plan *p)
{
    free(p->items);
    free(p->stats);
    free(p);
}

/* Loader thread. */
static void plan_run(struct job *job)
{
    struct plan *p = (struct plan *)job;
    struct reload *r = p->r;
    struct server *s = r->s;
    for (unsigned i = 0; i < p->n_items; i++) {
        struct plan_item *it = &p->items[i];
        it->why = !it->is ? "its section is gone"
                  : !it->was || !layer_conf_same(it->was, it->is) ? "its section changed"
                  : file_replaced(r, it->name, it->is->path) ? "its file was replaced"
                  : it->behind ? "a reload before kept it back"
                               : NULL;
        /* A layer is loaded again only where the new load would succeed
         * (short of memory): a mistake in its section or a broken file
         * keeps it serving as it was. */
        it->bad = it->why && it->is &&
                  layer_conf_check(s, it->is, s->cfg->allowed_dirs, s->cfg->n_allowed_dirs,
                                   NULL, it->bad_why, sizeof(it->bad_why)) < 0;
    }
    for (unsigned i = 0; i < p->n_stats; i++) {
        struct plan_stat *ps = &p->stats[i];
        ps->have = stat(ps->lc->path, &ps->st) == 0;
        ps->err = ps->have ? 0 : errno;
    }
}

static void reconcile_apply(struct reload *r, struct plan *p);

/* Loop thread (or server_free's, at shutdown, once reload_free has let
 * the reload go: then it is freed here). */
static void plan_done(struct job *job)
{
    struct plan *p = (struct plan *)job;
    struct reload *r = p->r;
    r->plan = NULL;
    if (r->orphan)
        reload_destroy(r);
    else
        p->apply(r, p);
    plan_free(p);
}

/* Submit p (items and stats filled) to the loader; apply takes it back. */
static void plan_submit(struct reload *r, struct plan *p,
                        void (*apply)(struct reload *r, struct plan *p))
{
    p->r = r;
    p->apply = apply;
    p->job.run = plan_run;
    p->job.done = plan_done;
    r->plan = p;
    worker_submit(r->s->loader, &p->job);
}

/* Unload what the new configuration no longer names (or names differently),
 * then load what is new: the plan is made on the loader thread, from a
 * snapshot of the configured layers. */
static void reconcile(struct reload *r)
{
    struct server *s = r->s;
    const struct layer_conf *old = s->cfg->layers, *now = r->next.layers;
    unsigned n_layers = layer_count(s);
    struct plan *p = calloc(1, sizeof(*p));
    if (p) {
        p->items = calloc(n_layers + 1, sizeof(*p->items));
        p->stats = calloc(conf_count(now) + 1, sizeof(*p->stats));
    }
    if (!p || !p->items || !p->stats) {
        if (p)
            plan_free(p);
        log_err("reload: out of memory; keeping the running layers");
        r->failed++;
        finish(r);
        return;
    }
    for (struct layer *l = s->layers; l; l = l->next) {
        if (!l->from_config || l->state != LAYER_READY)
            continue;
        struct plan_item *it = &p->items[p->n_items++];
        snprintf(it->name, sizeof(it->name), "%s", l->name);
        it->was = conf_find(old, l->name);
        it->is = conf_find(now, l->name);
        it->behind = l->conf_behind;
    }
    for (const struct layer_conf *lc = now; lc; lc = lc->next)
        p->stats[p->n_stats++].lc = lc;
    r->phase = WAIT_PLAN;
    plan_submit(r, p, reconcile_apply);
}

/* The layer an item of the plan unloads (to load again, or for good), or
 * NULL: unchanged, or unloaded by a client meanwhile. */
static struct layer *item_layer(struct server *s, const struct plan_item *it)
{
    struct layer *l = it->why ? layer_find(s, it->name) : NULL;
    return l && l->from_config && l->state == LAYER_READY ? l : NULL;
}

static void reconcile_apply(struct reload *r, struct plan *p)
{
    struct server *s = r->s;
    const struct layer_conf *now = r->next.layers;
    char (*drop)[65] = NULL;
    unsigned n_drop = 0;
    free(r->loading);
    formers_clear(r);
    free(r->former);
    r->loading = calloc(p->n_stats + 1, sizeof(*r->loading));
    r->former = calloc(p->n_items + 1, sizeof(*r->former));
    drop = calloc(p->n_items + 1, sizeof(*drop));
    if (!r->loading || !r->former || !drop) {
        free(drop);
        log_err("reload: out of memory; keeping the running layers");
        r->failed++;
        finish(r);
        return;
    }
    /* A changed layer is unloaded to be loaded again, which needs room under
     * the new max_layers: if the layers that stay (those whose sections
     * are gone leave) are more than that, no such load would find room and
     * the layer would be lost. Then the changed layers stay as they are. */
    unsigned n_stay = layer_count(s);
    for (unsigned i = 0; i < p->n_items; i++)
        n_stay -= !p->items[i].is && item_layer(s, &p->items[i]);
    char no_room[128] = "";
    if (n_stay > s->cfg->max_layers)
        snprintf(no_room, sizeof(no_room), "%u layers stay loaded, more than max_layers (%u), "
                 "so its new load would find no room", n_stay, s->cfg->max_layers);
    for (unsigned i = 0; i < p->n_items; i++) {
        const struct plan_item *it = &p->items[i];
        struct layer *l = item_layer(s, it);
        if (!l)
            continue;
        const char *fail = it->bad ? it->bad_why : it->is && no_room[0] ? no_room : NULL;
        if (fail) {
            log_err("reload: keeping layer '%s' as loaded (%s), since the load would fail: %s",
                    l->name, it->why, fail);
            l->conf_behind = true; /* the next reload tries again */
            r->failed++;
            continue;
        }
        log_info("reload: unloading layer '%s': %s", l->name, it->why);
        snprintf(drop[n_drop++], sizeof(drop[0]), "%s", l->name);
        /* The section it was loaded from, should the new load fail after
         * all (for memory): while that file is unchanged, it can serve
         * again. The layer's file_id gives it up: the next load tracks
         * its own. */
        struct file_id *f = file_find(r, l->name);
        if (it->is && f && f->lc && f->have_st) {
            r->former[r->n_former++] = (struct former){.lc = f->lc, .st = f->st};
            f->lc = NULL;
            f->have_st = false;
        }
    }
    for (unsigned i = 0; i < n_drop; i++)
        if (layer_unload(s, drop[i]) == 0)
            r->unloaded++;
    /* The layers just unloaded are loaded again first (pass 0), so that no
     * new section takes the place they left under max_layers. */
    for (int pass = 0; pass < 2; pass++)
        for (const struct layer_conf *lc = now; lc; lc = lc->next) {
            bool again = false;
            for (unsigned i = 0; i < n_drop && !again; i++)
                again = !strcmp(drop[i], lc->name);
            if (again != (pass == 0))
                continue;
            struct layer *l = layer_find(s, lc->name);
            if (l && l->from_config && l->conf_behind) {
                /* kept as it was, counted as failed above */
            } else if (l && l->from_config) {
                r->kept++;
            } else if (l) {
                log_warn("reload: not loading layer '%s': a layer of that name was loaded by "
                         "a client", lc->name);
                r->failed++;
            } else {
                const struct plan_stat *ps = NULL;
                for (unsigned i = 0; i < p->n_stats && !ps; i++)
                    if (p->stats[i].lc == lc)
                        ps = &p->stats[i];
                submit_load(r, lc, ps && ps->have ? &ps->st : NULL);
            }
        }
    free(drop);
    /* The new sections are now the running ones; the old go with r->next. */
    struct layer_conf *tmp = s->cfg->layers;
    s->cfg->layers = r->next.layers;
    r->next.layers = tmp;
    if (r->n_loading == 0) {
        finish(r);
        return;
    }
    r->phase = WAIT_LOADS;
    /* The loads' own CPU time: the loop's, serving meanwhile, is no
     * progress of theirs. */
    clockid_t loader_cpu;
    if (worker_cpu_clock(s->loader, &loader_cpu) < 0)
        loader_cpu = CLOCK_PROCESS_CPUTIME_ID;
    notify_loading_begin(loader_cpu);
    if (!poll_start(r)) {
        /* Without the timer the outcome is never checked; the loads still
         * complete on their own. */
        log_err("reload: cannot create a timer; not waiting for the loads");
        finish(r);
    }
}

/* Every directory of a is in b. */
static bool dirs_within(const struct config *a, const struct config *b)
{
    for (size_t i = 0; i < a->n_allowed_dirs; i++) {
        bool found = false;
        for (size_t j = 0; j < b->n_allowed_dirs && !found; j++)
            found = !strcmp(a->allowed_dirs[i], b->allowed_dirs[j]);
        if (!found)
            return false;
    }
    return true;
}

static bool dirs_same(const struct config *a, const struct config *b)
{
    return dirs_within(a, b) && dirs_within(b, a);
}

static void swap_dirs(struct config *a, struct config *b)
{
    char **d = a->allowed_dirs;
    size_t n = a->n_allowed_dirs;
    a->allowed_dirs = b->allowed_dirs;
    a->n_allowed_dirs = b->n_allowed_dirs;
    b->allowed_dirs = d;
    b->n_allowed_dirs = n;
}

/* A layer that a reload unloaded for its changed section, and that failed
 * to load from it (its checks passed, so for want of memory or a read
 * error), is loaded again from its former section, whose file must still
 * be the one it was loaded from. The loader stats those files (a plan of
 * stats only, restore_begin); restore_apply queues the loads, and on_poll
 * waits for them. */
static const struct former *former_of(const struct reload *r, const char *name)
{
    for (unsigned i = 0; i < r->n_former; i++)
        if (!strcmp(r->former[i].lc->name, name))
            return &r->former[i];
    return NULL;
}

static void restore_apply(struct reload *r, struct plan *p)
{
    for (unsigned i = 0; i < p->n_stats; i++) {
        const struct plan_stat *ps = &p->stats[i];
        const struct former *fo = ps->fo;
        const struct layer_conf *lc = ps->lc;
        if (layer_find(r->s, lc->name)) {
            log_warn("reload: layer '%s' is not loaded from its former section: a client loaded "
                     "a layer of that name meanwhile", lc->name);
            continue;
        }
        if (!ps->have || !same_file(&ps->st, &fo->st)) {
            log_err("reload: layer '%s' is not loaded: the file it was loaded from, %s, %s%s",
                    lc->name, lc->path, ps->have ? "is no longer the same" : "cannot be found: ",
                    ps->have ? "" : strerror(ps->err));
            continue;
        }
        char why[512] = "";
        if (load_section(r, lc, true, &ps->st, why, sizeof(why)) < 0) {
            log_err("reload: layer '%s' is not loaded: not even from its former section: %s",
                    lc->name, why);
            continue;
        }
        snprintf(r->loading[r->n_loading++], sizeof(r->loading[0]), "%s", lc->name);
        log_info("reload: loading layer '%s' again from its former section (%s)", lc->name,
                 lc->path);
    }
    if (r->n_loading == 0)
        finish(r);
    else
        r->restoring = true;
}

/* The loads of r->loading are over: count them, and restore the layers
 * that failed and have a former section. */
static void restore_begin(struct reload *r)
{
    struct server *s = r->s;
    unsigned n = r->n_loading;
    /* A stop cancels the loads (st_cancel_reads): a restore would fail too. */
    bool stopping = st_reads_cancelled();
    struct plan *p = calloc(1, sizeof(*p));
    if (p && !(p->stats = calloc(n + 1, sizeof(*p->stats)))) {
        free(p);
        p = NULL;
    }
    for (unsigned i = 0; i < n; i++) {
        struct layer *l = layer_find(s, r->loading[i]);
        if (l && l->from_config && l->state == LAYER_READY) {
            r->loaded++;
            continue;
        }
        r->failed++; /* layer.c logged why */
        const struct former *fo = former_of(r, r->loading[i]);
        if (fo && stopping)
            log_notice("reload: layer '%s' is not loaded again from its former section: moed "
                       "is stopping", fo->lc->name);
        else if (fo && p)
            p->stats[p->n_stats++] = (struct plan_stat){.lc = fo->lc, .fo = fo};
        else if (fo)
            log_err("reload: layer '%s' is not loaded: out of memory", fo->lc->name);
    }
    r->n_loading = 0;
    if (!p || !p->n_stats) {
        if (p)
            plan_free(p);
        finish(r);
        return;
    }
    plan_submit(r, p, restore_apply);
}

static void on_poll(void *data)
{
    struct reload *r = data;
    struct server *s = r->s;
    if (r->phase == WAIT_LOADER) {
        /* Loads run on the loader thread and read cfg->allowed_dirs there;
         * swap them only while no load is queued or running. */
        if (worker_pending(s->loader) > 0)
            return;
        swap_dirs(s->cfg, &r->next);
        log_info("reload: %zu allowed directories", s->cfg->n_allowed_dirs);
        reconcile(r);
        return;
    }
    if (r->phase != WAIT_LOADS || r->plan)
        return;
    for (unsigned i = 0; i < r->n_loading; i++) {
        struct layer *l = layer_find(s, r->loading[i]);
        if (l && l->state == LAYER_LOADING)
            return;
    }
    if (r->restoring) {
        for (unsigned i = 0; i < r->n_loading; i++) {
            struct layer *l = layer_find(s, r->loading[i]);
            if (l && l->from_config && l->state == LAYER_READY) {
                l->conf_behind = true; /* the next reload tries its section again */
                r->restored++;
                log_notice("reload: layer '%s' serves again as loaded from its former section",
                           r->loading[i]);
            }
        }
        finish(r);
        return;
    }
    restore_begin(r);
}

static void at_next_start(const char *key)
{
    log_warn("reload: '%s' changed; it takes effect at the next start", key);
}

static void warn_restart(const char *key, bool changed)
{
    if (changed)
        at_next_start(key);
}

static void reload_begin(struct reload *r)
{
    struct server *s = r->s;
    struct config *c = s->cfg, *n = &r->next;
    char err[512] = "";
    r->again = false;
    r->loaded = r->unloaded = r->kept = r->failed = r->restored = 0;
    r->unread = r->tiles_bad = false;
    r->phase = WAIT_LOADER; /* running from here on */
    if (r->have_next)
        config_done(n);
    r->have_next = true;
    if (r->read(r->read_data, n, err, sizeof(err)) < 0) {
        log_err("reload: %s; keeping the running configuration", err);
        r->failed++;
        r->unread = true;
        finish(r);
        return;
    }
    warn_restart("runtime_dir", strcmp(c->runtime_dir, n->runtime_dir) != 0);
    warn_restart("backend", strcmp(c->backend, n->backend) != 0);
    warn_restart("cpu_threads", c->cpu_threads != n->cpu_threads);
    warn_restart("device", c->device != n->device);
    warn_restart("gpus", c->gpus_all != n->gpus_all || c->n_gpus != n->n_gpus ||
                             memcmp(c->gpus, n->gpus, sizeof(c->gpus)) != 0);
    warn_restart("transport", strcmp(c->transport, n->transport) != 0);
    warn_restart("io_threads", c->io_threads != n->io_threads);
    /* [batch] and [limits] (config.c's table says which wait for a start) */
    config_take_numbers(c, n, at_next_start);
    /* The table file may have been rewritten by moed --tune: read it again
     * for the layers loaded from now on. */
    char *tt = c->tile_table;
    c->tile_table = n->tile_table;
    n->tile_table = tt;
    r->tiles_bad = reload_tiles(r) < 0;
    c->log_level = n->log_level;
    log_set_level((enum log_level)n->log_level);
    c->batching = n->batching;
    if (dirs_same(c, n)) {
        reconcile(r);
        return;
    }
    if (!poll_start(r)) {
        log_err("reload: cannot create a timer; keeping the running layers");
        r->failed++;
        finish(r);
        return;
    }
    on_poll(r);
}

void reload_start(struct reload *r, reload_done_fn done, void *data)
{
    if (r->phase != IDLE) {
        r->again = true;
        return;
    }
    r->done = done;
    r->done_data = data;
    reload_begin(r);
}

/* ---- --check-config ---------------------------------------------------------- */

int reload_check_layers(const struct config *c, char *err, size_t errlen)
{
    for (const struct layer_conf *lc = c->layers; lc; lc = lc->next) {
        char why[512] = "";
        int rc = layer_conf_check(NULL, lc, c->allowed_dirs, c->n_allowed_dirs, NULL, why,
                                  sizeof(why));
        if (rc) {
            snprintf(err, errlen, "layer '%s': %s", lc->name, why);
            return rc;
        }
    }
    return 0;
}
