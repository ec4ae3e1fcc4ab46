/*
 * config.c: see config.h. Unknown keys are errors, not warnings: a typo in a
 * limit should stop the daemon at start, not silently keep a default.
 */
#include "daemon/config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/log.h"
#include "daemon/util.h"
#include "moe.pb-c.h"

char *config_default_runtime_dir(void)
{
    const char *env = getenv("MOED_RUNTIME_DIR");
    char buf[PATH_MAX];
    if (env && env[0])
        return strdup(env);
    if (geteuid() == 0)
        return strdup("/run/moed");
    env = getenv("XDG_RUNTIME_DIR");
    if (env && env[0]) {
        snprintf(buf, sizeof(buf), "%s/moed", env);
        return strdup(buf);
    }
    snprintf(buf, sizeof(buf), "/tmp/moed-%u", (unsigned)geteuid());
    return strdup(buf);
}

int config_check_runtime_dir(const char *dir)
{
    return dir[0] == '/' && strlen(dir) <= CONFIG_MAX_RUNTIME_DIR ? 0 : -EINVAL;
}

/* An absolute directory from the environment (the first of a
 * colon-separated list when `list`), or NULL. */
static const char *env_dir(const char *name, bool list, size_t *len)
{
    const char *v = getenv(name);
    if (!v || v[0] != '/')
        return NULL;
    *len = list ? strcspn(v, ":") : strlen(v);
    return v;
}

char *config_default_tile_table(void)
{
    char buf[PATH_MAX];
    const char *d;
    size_t n = 0;
    int w;
    if ((d = env_dir("CACHE_DIRECTORY", true, &n)))
        w = snprintf(buf, sizeof(buf), "%.*s/tiles.tsv", (int)n, d);
    else if (geteuid() == 0)
        w = snprintf(buf, sizeof(buf), "/var/cache/moed/tiles.tsv");
    else if ((d = env_dir("XDG_CACHE_HOME", false, &n)))
        w = snprintf(buf, sizeof(buf), "%.*s/moed/tiles.tsv", (int)n, d);
    else if ((d = env_dir("HOME", false, &n)))
        w = snprintf(buf, sizeof(buf), "%.*s/.cache/moed/tiles.tsv", (int)n, d);
    else
        w = snprintf(buf, sizeof(buf), "%s", "");
    return strdup(w >= 0 && (size_t)w < sizeof(buf) ? buf : "");
}

int config_init(struct config *c)
{
    memset(c, 0, sizeof(*c));
    c->runtime_dir = config_default_runtime_dir();
    c->backend = strdup("auto");
    c->transport = strdup("auto");
    c->tile_table = config_default_tile_table();
    if (!c->runtime_dir || !c->backend || !c->transport || !c->tile_table)
        return -ENOMEM;
    c->log_level = 6;
    c->io_threads = 1;
    c->max_batch_tokens = 4096;
    c->max_delay_us = 0;
    c->max_request_tokens = 65536;
    c->max_slice_tokens = 1024;
    c->return_wait_us = 600;
    c->spin_us = CONFIG_SPIN_AUTO;
    c->batching = true;
    c->max_sessions = 256;
    c->max_regions = 64;
    c->max_region_bytes = 16ull << 30;
    c->max_session_bytes = 64ull << 30;
    c->max_pinned_bytes = 16ull << 30;
    c->max_queued_requests = 256;
    c->max_queued_tokens = 65536;
    c->max_queued_total = 4096;
    c->max_message_bytes = 1u << 20;
    c->max_pending_messages = 1024;
    c->max_layers = 256;
    c->max_loads = 8;
    return 0;
}

void layer_conf_free(struct layer_conf *l)
{
    while (l) {
        struct layer_conf *next = l->next;
        free(l->name);
        free(l->path);
        free(l->prefix);
        free(l->expert_devices);
        free(l);
        l = next;
    }
}

struct layer_conf *layer_conf_copy(const struct layer_conf *l)
{
    struct layer_conf *c = malloc(sizeof(*c));
    if (!c)
        return NULL;
    *c = *l;
    c->next = NULL;
    c->name = strdup(l->name);
    c->path = l->path ? strdup(l->path) : NULL;
    c->prefix = l->prefix ? strdup(l->prefix) : NULL;
    c->expert_devices = NULL;
    if (l->n_expert_devices &&
        (c->expert_devices = malloc(l->n_expert_devices * sizeof(*l->expert_devices))))
        memcpy(c->expert_devices, l->expert_devices, l->n_expert_devices * sizeof(*l->expert_devices));
    if (!c->name || (l->path && !c->path) || (l->prefix && !c->prefix) ||
        (l->n_expert_devices && !c->expert_devices)) {
        layer_conf_free(c);
        return NULL;
    }
    return c;
}

void config_done(struct config *c)
{
    free(c->runtime_dir);
    free(c->backend);
    free(c->transport);
    free(c->tile_table);
    for (size_t i = 0; i < c->n_allowed_dirs; i++)
        free(c->allowed_dirs[i]);
    free(c->allowed_dirs);
    layer_conf_free(c->layers);
    memset(c, 0, sizeof(*c));
}

/* Append s (taken over) to the array *v of *n; -ENOMEM (s freed). */
static int strv_push(char ***v, size_t *n, char *s)
{
    char **grown = realloc(*v, (*n + 1) * sizeof(*grown));
    if (!grown) {
        free(s);
        return -ENOMEM;
    }
    *v = grown;
    grown[(*n)++] = s;
    return 0;
}

int config_add_allowed_dir(struct config *c, const char *dir)
{
    struct stat st;
    char *canon = realpath(dir, NULL);
    if (!canon)
        return -errno;
    /* A file would be taken and allow nothing under it. */
    int e = stat(canon, &st) < 0 ? -errno : S_ISDIR(st.st_mode) ? 0 : -ENOTDIR;
    /* Once each: a directory named twice (or through a link to it) is one. */
    bool known = false;
    for (size_t i = 0; i < c->n_allowed_dirs && !known; i++)
        known = !strcmp(c->allowed_dirs[i], canon);
    if (e || known) {
        free(canon);
        return e;
    }
    return strv_push(&c->allowed_dirs, &c->n_allowed_dirs, canon);
}

int config_parse_kind(const char *s)
{
    if (strcasecmp(s, "moe") == 0)
        return MOE__LAYER_KIND__LAYER_MOE;
    if (strcasecmp(s, "gemm") == 0)
        return MOE__LAYER_KIND__LAYER_GEMM;
    return -1;
}

int config_parse_dtype(const char *s)
{
    if (strcasecmp(s, "bf16") == 0 || strcasecmp(s, "bfloat16") == 0)
        return MOE__DTYPE__DTYPE_BF16;
    if (strcasecmp(s, "fp16") == 0 || strcasecmp(s, "f16") == 0 || strcasecmp(s, "float16") == 0)
        return MOE__DTYPE__DTYPE_FP16;
    if (strcasecmp(s, "fp32") == 0 || strcasecmp(s, "f32") == 0 || strcasecmp(s, "float32") == 0)
        return MOE__DTYPE__DTYPE_FP32;
    return -1;
}

int config_parse_routing(const char *s)
{
    if (strcasecmp(s, "softmax") == 0)
        return MOE__ROUTING__ROUTING_SOFTMAX;
    if (strcasecmp(s, "sigmoid") == 0)
        return MOE__ROUTING__ROUTING_SIGMOID;
    if (strcasecmp(s, "given") == 0)
        return MOE__ROUTING__ROUTING_GIVEN;
    return -1;
}

struct parse_ctx {
    struct config *c;
    char *err;
    size_t errlen;
    int rc;
    char msg[400];
    char **seen;     /* "section\nkey" of each key set so far */
    size_t n_seen;
};

/* 0 the first time a section's key is set, -EEXIST after, -ENOMEM. */
static int key_first_time(struct parse_ctx *p, const char *section, const char *key)
{
    char *sk;
    if (asprintf(&sk, "%s\n%s", section, key) < 0)
        return -ENOMEM;
    for (size_t i = 0; i < p->n_seen; i++)
        if (!strcmp(p->seen[i], sk)) {
            free(sk);
            return -EEXIST;
        }
    return strv_push(&p->seen, &p->n_seen, sk);
}

/* Decimal digits only: strtoull would also take leading spaces, a '+', and
 * a '-' that wraps ("-18446744073709551615" is 1). */
static int parse_u64(const char *v, uint64_t max, uint64_t *out)
{
    char *end;
    errno = 0;
    if (!isdigit((unsigned char)v[0]))
        return -EINVAL;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || *end || x > max)
        return -EINVAL;
    *out = x;
    return 0;
}

static int parse_bool(const char *v, bool *out)
{
    if (!strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcmp(v, "1") || !strcasecmp(v, "on"))
        *out = true;
    else if (!strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcmp(v, "0") || !strcasecmp(v, "off"))
        *out = false;
    else
        return -EINVAL;
    return 0;
}

/* "0,1,1,2": up to max numbers below 2^16, in decimal digits; every comma
 * is followed by a number ("0," is refused, not read as "0"). */
static int parse_u32_list(const char *v, size_t max, uint32_t **out, size_t *n)
{
    uint32_t *list = calloc(max, sizeof(uint32_t));
    size_t k = 0;
    if (!list)
        return -ENOMEM;
    const char *p = v;
    for (;;) {
        char *end;
        while (*p == ' ')
            p++;
        if (!isdigit((unsigned char)*p) || k == max)
            goto bad;
        errno = 0;
        unsigned long x = strtoul(p, &end, 10);
        if (errno || x > 65535)
            goto bad;
        list[k++] = (uint32_t)x;
        p = end;
        while (*p == ' ')
            p++;
        if (!*p)
            break;
        if (*p++ != ',')
            goto bad;
    }
    *out = list;
    *n = k;
    return 0;
bad:
    free(list);
    return -EINVAL;
}

static int set_str(char **dst, const char *v)
{
    char *s = strdup(v);
    if (!s)
        return -ENOMEM;
    free(*dst);
    *dst = s;
    return 0;
}

int config_set_daemon(struct config *c, const char *k, const char *v)
{
    uint64_t x = 0;
    if (!strcmp(k, "runtime_dir"))
        return config_check_runtime_dir(v) ? -EINVAL : set_str(&c->runtime_dir, v);
    if (!strcmp(k, "allowed_dirs")) {
        char *copy = strdup(v), *save = NULL;
        if (!copy)
            return -ENOMEM;
        int rc = 0;
        /* Absolute, as runtime_dir and tile_table are: a relative one would
         * be resolved against the directory the daemon happened to start
         * in. */
        for (char *d = strtok_r(copy, ":", &save); d && !rc; d = strtok_r(NULL, ":", &save))
            rc = d[0] == '/' ? config_add_allowed_dir(c, d) : -EINVAL;
        free(copy);
        return rc == -ENOENT ? -EINVAL : rc; /* -ENOENT means "unknown key" here */
    }
    if (!strcmp(k, "backend")) {
        if (strcmp(v, "auto") && strcmp(v, "cpu") && strcmp(v, "cuda"))
            return -EINVAL;
        return set_str(&c->backend, v);
    }
    if (!strcmp(k, "cpu_threads")) {
        int rc = parse_u64(v, CONFIG_MAX_THREADS, &x);
        c->cpu_threads = (int)x;
        return rc;
    }
    if (!strcmp(k, "gpus")) {
        if (!strcmp(v, "all")) {
            c->gpus_all = true;
            c->n_gpus = 0;
            return 0;
        }
        uint32_t *list;
        size_t n;
        int rc = parse_u32_list(v, 16, &list, &n);
        if (rc)
            return rc;
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < i; j++)
                if (list[i] == list[j]) {
                    free(list);
                    return -EINVAL;
                }
        memcpy(c->gpus, list, n * sizeof(uint32_t));
        c->n_gpus = n;
        c->gpus_all = false;
        free(list);
        return 0;
    }
    if (!strcmp(k, "io_threads")) {
        int rc = parse_u64(v, 64, &x);
        if (!rc && x == 0)
            rc = -EINVAL;
        c->io_threads = rc ? c->io_threads : (int)x;
        return rc;
    }
    if (!strcmp(k, "transport")) {
        if (strcmp(v, "auto") && strcmp(v, "nccl") && strcmp(v, "peer"))
            return -EINVAL;
        return set_str(&c->transport, v);
    }
    if (!strcmp(k, "tile_table"))
        return !v[0] || v[0] == '/' ? set_str(&c->tile_table, v) : -EINVAL;
    if (!strcmp(k, "device")) {
        int rc = parse_u64(v, 255, &x);
        c->device = (int)x;
        return rc;
    }
    if (!strcmp(k, "log_level")) {
        int lv = log_level_parse(v); /* the names --log-level takes */
        if (lv < 0)
            return -EINVAL;
        c->log_level = lv;
        return 0;
    }
    return -ENOENT;
}

/* Numeric keys of [batch] and [limits]: name, field, bounds, and whether a
 * reload can apply them (config_take_numbers) or only a restart. */
struct num_key {
    const char *section, *name;
    size_t off;
    bool is64;
    uint64_t lo, hi;
    bool at_start;
};

#define NUM32(sec, nm, field, lo, hi) \
    {sec, nm, offsetof(struct config, field), false, lo, hi, false}
#define NUM64(sec, nm, field, lo) \
    {sec, nm, offsetof(struct config, field), true, lo, UINT64_MAX, false}

static const struct num_key num_keys[] = {
    NUM32("batch", "max_batch_tokens", max_batch_tokens, 1, CONFIG_MAX_BATCH_TOKENS),
    NUM32("batch", "max_delay_us", max_delay_us, 0, CONFIG_MAX_DELAY_US),
    NUM32("batch", "max_request_tokens", max_request_tokens, 1, 1u << 24),
    NUM32("batch", "max_slice_tokens", max_slice_tokens, 1, CONFIG_MAX_SLICE_TOKENS),
    NUM32("batch", "return_wait_us", return_wait_us, 0, 1000000),
    /* the compute thread reads it as it starts */
    {"batch", "spin_us", offsetof(struct config, spin_us), false, 0, 100000, true},
    NUM32("limits", "max_sessions", max_sessions, 1, 65536),
    NUM32("limits", "max_regions", max_regions, 1, 65536),
    NUM64("limits", "max_region_bytes", max_region_bytes, 1),
    NUM64("limits", "max_session_bytes", max_session_bytes, 1),
    NUM64("limits", "max_pinned_bytes", max_pinned_bytes, 0),
    NUM32("limits", "max_queued_requests", max_queued_requests, 1, 1u << 20),
    NUM32("limits", "max_queued_tokens", max_queued_tokens, 1, 1u << 30),
    NUM32("limits", "max_queued_total", max_queued_total, 1, 1u << 24),
    /* socket options, set as the sockets open */
    {"limits", "max_message_bytes", offsetof(struct config, max_message_bytes), true, 4096,
     UINT64_MAX, true},
    {"limits", "max_pending_messages", offsetof(struct config, max_pending_messages), false, 16,
     1u << 20, true},
    NUM32("limits", "max_layers", max_layers, 1, 65536),
    NUM32("limits", "max_loads", max_loads, 1, 1024),
};

static uint64_t num_get(const struct config *c, const struct num_key *nk)
{
    const char *p = (const char *)c + nk->off;
    return nk->is64 ? *(const uint64_t *)p : *(const uint32_t *)p;
}

void config_take_numbers(struct config *c, const struct config *n,
                         void (*at_start)(const char *key))
{
    for (size_t i = 0; i < sizeof(num_keys) / sizeof(num_keys[0]); i++) {
        const struct num_key *nk = &num_keys[i];
        if (num_get(c, nk) == num_get(n, nk))
            continue;
        if (nk->at_start)
            at_start(nk->name);
        else
            memcpy((char *)c + nk->off, (const char *)n + nk->off, nk->is64 ? 8 : 4);
    }
}

static int num_key(struct config *c, const char *section, const char *k, const char *v)
{
    for (size_t i = 0; i < sizeof(num_keys) / sizeof(num_keys[0]); i++) {
        const struct num_key *nk = &num_keys[i];
        uint64_t x;
        if (strcmp(section, nk->section) || strcmp(k, nk->name))
            continue;
        if (parse_u64(v, nk->hi, &x) || x < nk->lo)
            return -EINVAL;
        if (nk->is64)
            *(uint64_t *)((char *)c + nk->off) = x;
        else
            *(uint32_t *)((char *)c + nk->off) = (uint32_t)x;
        return 0;
    }
    return -ENOENT;
}

static struct layer_conf *layer_for(struct config *c, const char *name)
{
    struct layer_conf **tail = &c->layers;
    for (struct layer_conf *l = c->layers; l; l = l->next) {
        if (!strcmp(l->name, name))
            return l;
        tail = &l->next;
    }
    struct layer_conf *l = calloc(1, sizeof(*l));
    if (!l || !(l->name = strdup(name))) {
        free(l);
        return NULL;
    }
    l->renormalize = true;
    *tail = l;
    return l;
}

static int layer_key(struct layer_conf *l, const char *k, const char *v)
{
    uint64_t x;
    int e;
    if (!strcmp(k, "kind"))
        return (e = config_parse_kind(v)) < 0 ? -EINVAL : (l->kind = e, 0);
    if (!strcmp(k, "dtype"))
        return (e = config_parse_dtype(v)) < 0 ? -EINVAL : (l->dtype = e, 0);
    if (!strcmp(k, "routing"))
        return (e = config_parse_routing(v)) < 0 ? -EINVAL : (l->routing = e, 0);
    if (!strcmp(k, "renormalize"))
        return parse_bool(v, &l->renormalize);
    if (!strcmp(k, "file"))
        return set_str(&l->path, v);
    if (!strcmp(k, "prefix"))
        return set_str(&l->prefix, v);
    if (!strcmp(k, "devices")) {
        uint32_t *list = NULL;
        size_t n = 0;
        int rc = parse_u32_list(v, 16, &list, &n);
        if (!rc) {
            memcpy(l->devices, list, n * sizeof(uint32_t));
            l->n_devices = n;
        }
        free(list);
        return rc;
    }
    if (!strcmp(k, "expert_devices")) {
        free(l->expert_devices);
        l->expert_devices = NULL;
        return parse_u32_list(v, 4096, &l->expert_devices, &l->n_expert_devices);
    }
    static const struct {
        const char *name;
        size_t off;
    } nums[] = {
        {"experts", offsetof(struct layer_conf, experts)},
        {"topk", offsetof(struct layer_conf, topk)},
        {"hidden", offsetof(struct layer_conf, hidden)},
        {"intermediate", offsetof(struct layer_conf, intermediate)},
        {"groups", offsetof(struct layer_conf, groups)},
        {"n", offsetof(struct layer_conf, n)},
        {"k", offsetof(struct layer_conf, k)},
    };
    for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++)
        if (!strcmp(k, nums[i].name)) {
            if (parse_u64(v, 1u << 24, &x))
                return -EINVAL;
            *(uint32_t *)((char *)l + nums[i].off) = (uint32_t)x;
            return 0;
        }
    return -ENOENT;
}

/* The name of a "[layer NAME]" section (quotes and spaces around it
 * dropped), into out. */
static void layer_section_name(const char *section, char *out, size_t len)
{
    const char *name = section + 6;
    while (*name == ' ' || *name == '"')
        name++;
    snprintf(out, len, "%s", name);
    size_t n = strlen(out);
    while (n && (out[n - 1] == '"' || out[n - 1] == ' '))
        out[--n] = '\0';
}

/* inih reports the line of the first handler that returns 0; the message
 * is written here and the line added by the caller. */
static int on_ini(void *user, const char *section, const char *key, const char *value)
{
    struct parse_ctx *p = user;
    int rc;
    if (p->rc)
        return 1;
    /* The second value of a key would replace the first (or, for
     * allowed_dirs, add to it) without a word; inih also hands an indented
     * line after a key over as the key again (a continuation). A layer's
     * section may come again, with other keys; an unknown section's first
     * key ends the parse below. */
    bool layer = !strncmp(section, "layer ", 6);
    char nm[80] = "", sec[96];
    if (layer)
        layer_section_name(section, nm, sizeof(nm));
    snprintf(sec, sizeof(sec), layer ? "layer %s" : "%s", layer ? nm : section);
    if ((rc = key_first_time(p, sec, key)) == -EEXIST)
        snprintf(p->msg, sizeof(p->msg), "'%s' in [%s] is set twice (an indented line "
                 "continues the key above it)", key, sec);
    if (rc) {
        p->rc = rc == -ENOMEM ? rc : -EINVAL;
        return 0;
    }
    if (!strcmp(section, "daemon"))
        rc = config_set_daemon(p->c, key, value);
    else if (!strcmp(section, "batch") && !strcmp(key, "batching"))
        rc = parse_bool(value, &p->c->batching);
    else if (!strcmp(section, "batch") && !strcmp(key, "spin_us") && !strcmp(value, "auto"))
        rc = (p->c->spin_us = CONFIG_SPIN_AUTO, 0);
    else if (!strcmp(section, "batch") || !strcmp(section, "limits"))
        rc = num_key(p->c, section, key, value);
    else if (layer) {
        struct layer_conf *l = layer_for(p->c, nm);
        rc = l ? layer_key(l, key, value) : -ENOMEM;
    } else {
        snprintf(p->msg, sizeof(p->msg), "unknown section [%s]", section);
        p->rc = -EINVAL;
        return 0;
    }
    if (rc == -ENOENT)
        snprintf(p->msg, sizeof(p->msg), "unknown key '%s' in [%s]", key, section);
    else if (rc && !strcmp(section, "daemon") && !strcmp(key, "runtime_dir"))
        snprintf(p->msg, sizeof(p->msg), "bad value '%s' for '%s' in [%s] (an absolute path of "
                 "at most %d characters)", value, key, section, CONFIG_MAX_RUNTIME_DIR);
    else if (rc)
        snprintf(p->msg, sizeof(p->msg), "bad value '%s' for '%s' in [%s]%s", value, key, section,
                 !strcmp(key, "allowed_dirs") ? " (each directory must exist)" : "");
    if (rc)
        p->rc = rc == -ENOMEM ? rc : -EINVAL; /* config.h promises -EINVAL for bad text */
    return rc ? 0 : 1;
}

/* What can be said of the layer sections without reading their files. */
static int config_check(struct config *c, char *err, size_t errlen)
{
    unsigned n = 0;
    for (struct layer_conf *l = c->layers; l; l = l->next, n++) {
        const char *why = !name_valid(l->name)
                              ? "names are 1-64 characters of A-Z a-z 0-9 . _ -"
                          : !l->path ? "no file"
                          : l->kind == MOE__LAYER_KIND__LAYER_MOE && !l->topk
                              ? "topk is required for a MoE layer"
                          : l->kind == MOE__LAYER_KIND__LAYER_GEMM && (!l->prefix || !l->prefix[0])
                              ? "a GEMM layer names its weight tensor with prefix ="
                              : NULL;
        if (why) {
            snprintf(err, errlen, "layer '%s': %s", l->name, why);
            return -EINVAL;
        }
    }
    if (n > c->max_layers) {
        snprintf(err, errlen, "%u [layer] sections, more than max_layers (%u)", n,
                 c->max_layers);
        return -EINVAL;
    }
    return 0;
}

static int on_ini_nothing(void *user, const char *section, const char *key, const char *value)
{
    (void)user, (void)section, (void)key, (void)value;
    return 1;
}

static int config_parse_with(struct config *c, const char *text, int rc_ini, struct parse_ctx *p)
{
    /* inih keeps the line of the first error, a handler's or its own
     * syntax error's; p->msg is the handler's. A syntax error on that line
     * came first. */
    if (p->rc && rc_ini > 0 && ini_parse_string(text, on_ini_nothing, NULL) == rc_ini) {
        snprintf(p->err, p->errlen, "line %d: syntax error", rc_ini);
        return -EINVAL;
    }
    if (p->rc) {
        snprintf(p->err, p->errlen, "line %d: %s", rc_ini, p->msg);
        return p->rc;
    }
    if (rc_ini > 0) {
        snprintf(p->err, p->errlen, "line %d: syntax error", rc_ini);
        return -EINVAL;
    }
    if (rc_ini == -2)
        return -ENOMEM;
    return config_check(c, p->err, p->errlen);
}

/* inih, as Debian builds it, cuts lines at 199 characters (reading the rest
 * as a line of its own) and section names at 49. Rather than let a long
 * comment's tail become a setting, or two long layer names become one,
 * refuse such text with its line number. */
#define CONF_MAX_LINE 198
#define CONF_MAX_SECTION 48

static int config_scan(const char *text, char *err, size_t errlen)
{
    int line = 1;
    for (const char *p = text; *p; line++) {
        const char *end = strchr(p, '\n');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > CONF_MAX_LINE) {
            snprintf(err, errlen, "line %d: longer than %d characters", line, CONF_MAX_LINE);
            return -EINVAL;
        }
        const char *q = p;
        while (q < p + len && (*q == ' ' || *q == '\t'))
            q++;
        if (q < p + len && *q == '[') {
            const char *close = memchr(q, ']', (size_t)(p + len - q));
            if (close && close - q - 1 > CONF_MAX_SECTION) {
                snprintf(err, errlen,
                         "line %d: section name longer than %d characters (layer names in the "
                         "configuration file are limited to %d)", line, CONF_MAX_SECTION,
                         CONF_MAX_SECTION - 6);
                return -EINVAL;
            }
        }
        p = end ? end + 1 : p + len;
    }
    return 0;
}

int config_load(struct config *c, const char *path, char *err, size_t errlen)
{
    char *text;
    int rc = read_text_file(path, &text, err, errlen);
    if (rc)
        return rc;
    /* inih would read up to the first NUL (refused above): the rest of the
     * file would be dropped without a word. */
    char why[480] = "";
    rc = config_parse_string(c, text, why, sizeof(why));
    free(text);
    if (rc)
        snprintf(err, errlen, "%s: %s", path, why);
    return rc;
}

int config_parse_string(struct config *c, const char *text, char *err, size_t errlen)
{
    struct parse_ctx p = {c, err, errlen, 0, "", NULL, 0};
    int rc = config_scan(text, err, errlen);
    if (rc)
        return rc;
    rc = ini_parse_string(text, on_ini, &p);
    rc = config_parse_with(c, text, rc, &p);
    for (size_t i = 0; i < p.n_seen; i++)
        free(p.seen[i]);
    free(p.seen);
    return rc;
}
