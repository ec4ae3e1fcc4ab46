/*
 * tune.c: see tune.h.
 */
#include "daemon/tune.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/layer.h"
#include "daemon/server.h"
#include "daemon/util.h"
#include "moe.pb-c.h"

/* ---- the plan ------------------------------------------------------------ */

/* A decimal number from 1 to max at *p, which moves past it. */
static long parse_count(const char **p, long max)
{
    const char *s = *p;
    long v = 0;
    if (*s < '0' || *s > '9')
        return -1;
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (*s++ - '0');
        if (v > max)
            return -1;
    }
    *p = s;
    return v >= 1 ? v : -1;
}

int tune_parse_shape(const char *arg, struct tune_shape *t)
{
    long v[4];
    const char *p = arg;
    for (int i = 0; i < 4; i++) {
        if ((v[i] = parse_count(&p, 1 << 20)) < 0)
            return -EINVAL;
        if (*p == ',')
            p++;
        else if (*p || i < 3)
            return -EINVAL;
    }
    int dt = MOEK_DTYPE_BF16;
    if (p > arg && p[-1] == ',' && (dt = tiles_dtype_parse(p)) < 0)
        return -EINVAL;
    if (v[0] > 4096 || v[1] > v[0])
        return -EINVAL;
    memset(t, 0, sizeof(*t));
    t->s = (moek_moe_shape){(int)v[0], (int)v[1], (int)v[2], (int)v[3]};
    t->dt = (moek_dtype)dt;
    snprintf(t->from, sizeof(t->from), "--tune-shape");
    return 0;
}

static int int_cmp(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return x < y ? -1 : x > y;
}

int tune_parse_tokens(const char *arg, struct tune_plan *pl)
{
    int tok[BACKEND_TUNE_MAX], n = 0;
    const char *p = arg;
    while (*p) {
        long v = parse_count(&p, 1 << 24);
        if (v < 0 || n == BACKEND_TUNE_MAX)
            return -EINVAL;
        tok[n++] = (int)v;
        if (*p == ',' && p[1])
            p++;
        else if (*p)
            return -EINVAL;
    }
    if (n == 0)
        return -EINVAL;
    qsort(tok, (size_t)n, sizeof(int), int_cmp);
    pl->n_tokens = 0;
    for (int i = 0; i < n; i++)
        if (i == 0 || tok[i] != tok[i - 1])
            pl->tokens[pl->n_tokens++] = tok[i];
    return 0;
}

int tune_set_tokens(struct tune_plan *p, uint32_t max_batch_tokens)
{
    if (p->n_tokens)
        return (uint32_t)p->tokens[p->n_tokens - 1] > max_batch_tokens ? -ERANGE : 0;
    for (int t = 1; t <= 4096 && (uint32_t)t <= max_batch_tokens; t *= 2)
        p->tokens[p->n_tokens++] = t;
    return 0;
}

int tune_add(struct tune_plan *p, const struct tune_shape *t)
{
    for (int i = 0; i < p->n_shapes; i++) {
        struct tune_shape *h = &p->shapes[i];
        if (h->dt == t->dt && h->s.experts == t->s.experts && h->s.topk == t->s.topk &&
            h->s.hidden == t->s.hidden && h->s.intermediate == t->s.intermediate) {
            h->more++;
            return 0;
        }
    }
    if (p->n_shapes == TUNE_MAX_SHAPES)
        return -ENOSPC;
    p->shapes[p->n_shapes++] = *t;
    return 0;
}

/* Spread over devices, as layer.c places it: not on device 0 alone. */
static bool conf_spread(const struct layer_conf *lc)
{
    if (lc->n_expert_devices)
        return true;
    return lc->n_devices > 1 || (lc->n_devices == 1 && lc->devices[0] != 0);
}

int tune_add_configured(struct tune_plan *p, const struct config *c, FILE *out, char *err,
                        size_t errlen)
{
    for (const struct layer_conf *lc = c->layers; lc; lc = lc->next) {
        if (lc->kind != MOE__LAYER_KIND__LAYER_MOE)
            continue;
        if (conf_spread(lc)) {
            fprintf(out, "# layer '%s' is spread over devices: its shards keep the kernels' "
                         "heuristic and are not tuned\n", lc->name);
            continue;
        }
        struct host_weights hw;
        char why[512] = "";
        int rc = layer_conf_check(NULL, lc, c->allowed_dirs, c->n_allowed_dirs, &hw, why,
                                  sizeof(why));
        if (rc < 0)
            return errf(err, errlen, rc, "layer '%s': %s", lc->name, why);
        if (hw.dtype != MOE__DTYPE__DTYPE_BF16 && hw.dtype != MOE__DTYPE__DTYPE_FP16) {
            fprintf(out, "# layer '%s' is fp32, which the CUDA kernels do not compute: not "
                         "tuned\n", lc->name);
            continue;
        }
        struct tune_shape t = {
            .s = {(int)hw.experts, (int)lc->topk, (int)hw.hidden, (int)hw.intermediate},
            .dt = hw.dtype == MOE__DTYPE__DTYPE_BF16 ? MOEK_DTYPE_BF16 : MOEK_DTYPE_FP16,
        };
        snprintf(t.from, sizeof(t.from), "layer '%s'", lc->name);
        if (tune_add(p, &t) < 0)
            return errf(err, errlen, -ENOSPC, "more than %d layer shapes to tune",
                        TUNE_MAX_SHAPES);
    }
    return 0;
}

/* ---- measuring ----------------------------------------------------------- */

int tune_check(struct backend *b, const char *path, char *err, size_t errlen)
{
    if (!b->ops->moe_tune)
        return errf(err, errlen, -ENOTSUP,
                    "tuning needs a CUDA device: the %s backend has no token tiles to tune",
                    b->name);
    if (!path[0])
        return errf(err, errlen, -EINVAL,
                    "tile_table is empty, so nothing would keep the measured tiles: set it in "
                    "the configuration or with --tile-table FILE");
    struct tile_table have;
    char why[512] = "";
    tiles_init(&have);
    int rc = tiles_read(&have, path, why, sizeof(why));
    tiles_done(&have);
    if (rc == -ENOENT)
        return 0;
    if (rc < 0)
        return errf(err, errlen, rc, "tile table %s; moed --tune does not overwrite it: fix "
                                     "or remove it", why);
    return 0;
}

void tune_entry(const struct backend_tune *r, const struct tune_shape *t, struct tile_entry *e)
{
    memset(e, 0, sizeof(*e));
    snprintf(e->device, sizeof(e->device), "%s", r->device);
    e->dt = t->dt;
    e->hidden = t->s.hidden;
    e->intermediate = t->s.intermediate;
    e->experts = t->s.experts;
    e->topk = t->s.topk;
    for (int i = 0; i < r->n && e->n_rules < TILES_MAX_RULES; i++)
        if (e->n_rules == 0 || e->rules[e->n_rules - 1].tile != r->best[i])
            e->rules[e->n_rules++] = (struct tile_rule){r->tokens[i], r->best[i]};
}

static float us_of(const struct backend_tune *r, int i, int tile)
{
    for (int j = 0; j < TILES_N_OFFERED; j++)
        if (tiles_offered[j] == tile)
            return r->us[i][j];
    return 0;
}

static void print_shape(FILE *out, const struct backend_tune *r, const struct tune_shape *t)
{
    fprintf(out, "\n%s, %s, E=%d k=%d H=%d I=%d (%s", r->device, tiles_dtype_name(t->dt),
            t->s.experts, t->s.topk, t->s.hidden, t->s.intermediate, t->from);
    if (t->more)
        fprintf(out, " and %d more", t->more);
    fprintf(out, ")\n%6s %5s %9s %9s %9s %6s |", "T", "tile", "us", "heuristic", "its us",
            "gain");
    for (int j = 0; j < TILES_N_OFFERED; j++)
        fprintf(out, " %8d", tiles_offered[j]);
    fprintf(out, "\n");
    for (int i = 0; i < r->n; i++) {
        float best = us_of(r, i, r->best[i]), heur = us_of(r, i, r->heuristic[i]);
        fprintf(out, "%6d %5d %9.1f %9d %9.1f %5.1f%% |", r->tokens[i], r->best[i], best,
                r->heuristic[i], heur, heur > 0 ? 100.0 * (heur - best) / heur : 0.0);
        for (int j = 0; j < TILES_N_OFFERED; j++)
            fprintf(out, " %8.1f", r->us[i][j]);
        fprintf(out, "\n");
    }
    fflush(out);
}

int tune_run(struct backend *b, const struct tune_plan *p, const char *path, FILE *out, char *err,
             size_t errlen)
{
    int rc = tune_check(b, path, err, errlen);
    if (rc < 0)
        return rc;
    if (p->n_shapes == 0)
        return errf(err, errlen, -EINVAL, "nothing to tune: no MoE layer is configured; name "
                                          "shapes with --tune-shape E,k,H,I[,dtype] or add --demo");
    if (p->n_tokens == 0)
        return errf(err, errlen, -EINVAL, "no token counts to tune");
    struct tile_table upd;
    tiles_init(&upd);
    int failed = 0, done = 0;
    char why[512];
    fprintf(out, "# tuning %d layer shape%s at T =", p->n_shapes, p->n_shapes == 1 ? "" : "s");
    for (int i = 0; i < p->n_tokens; i++)
        fprintf(out, "%s%d", i ? "," : " ", p->tokens[i]);
    fprintf(out, "; \"gain\" is the time saved against the heuristic's tile\n");
    for (int i = 0; i < p->n_shapes; i++, done++) {
        const struct tune_shape *t = &p->shapes[i];
        struct backend_tune r;
        struct tile_entry e;
        uint64_t t0 = now_us();
        why[0] = '\0';
        rc = backend_moe_tune(b, &t->s, t->dt, p->tokens, p->n_tokens, &r, why, sizeof(why));
        if (rc < 0) {
            fprintf(out, "\n# cannot tune %s E=%d k=%d H=%d I=%d (%s): %s\n",
                    tiles_dtype_name(t->dt), t->s.experts, t->s.topk, t->s.hidden,
                    t->s.intermediate, t->from, why[0] ? why : strerror(-rc));
            failed++;
            if (b->ops->healthy && !b->ops->healthy(b)) {
                done++;
                break;
            }
            continue;
        }
        print_shape(out, &r, t);
        fprintf(out, "# measured in %.1f s\n", (double)(now_us() - t0) / 1e6);
        tune_entry(&r, t, &e);
        if (tiles_put(&upd, &e, why, sizeof(why)) < 0) {
            fprintf(out, "# cannot keep the tiles of %s: %s\n", t->from, why);
            failed++;
        }
    }
    rc = 0;
    if (upd.n > 0) {
        size_t kept = 0;
        rc = tiles_write(path, &upd, &kept, err, errlen);
        if (rc == 0)
            fprintf(out, "\ntile table %s: %zu entr%s written, %zu other%s kept; moed gives "
                         "them to the layers it loads after reading the table (at start and "
                         "on reload)\n",
                    path, upd.n, upd.n == 1 ? "y" : "ies", kept, kept == 1 ? "" : "s");
    }
    tiles_done(&upd);
    if (rc < 0)
        return rc;
    if (failed || done < p->n_shapes)
        return errf(err, errlen, -EIO, "%d of %d layer shapes could not be tuned (see above)",
                    failed + (p->n_shapes - done), p->n_shapes);
    return 0;
}
