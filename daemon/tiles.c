/*
 * tiles.c: see tiles.h. The file is small (an entry per card and layer
 * shape), read once at start and on reload and written only by moed --tune,
 * so the code favours plain checks and exact messages over speed.
 */
#include "daemon/tiles.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/util.h"

#define TILES_MAX_ENTRIES 4096
#define TILES_MAX_DIM (1 << 20)
#define TILES_MAX_EXPERTS 4096
#define TILES_MAX_TOKENS (1 << 24)
#define TILES_FIELDS 7

const int tiles_offered[TILES_N_OFFERED] = MOEK_CUDA_TOKEN_TILES;

bool tiles_tile_ok(int tile)
{
    for (int i = 0; i < TILES_N_OFFERED; i++)
        if (tiles_offered[i] == tile)
            return true;
    return false;
}

void tiles_init(struct tile_table *t)
{
    memset(t, 0, sizeof(*t));
}

void tiles_done(struct tile_table *t)
{
    free(t->entries);
    memset(t, 0, sizeof(*t));
}

const char *tiles_dtype_name(moek_dtype dt)
{
    return dt == MOEK_DTYPE_BF16 ? "bf16" : dt == MOEK_DTYPE_FP16 ? "fp16" : NULL;
}

int tiles_dtype_parse(const char *s)
{
    if (!strcmp(s, "bf16"))
        return MOEK_DTYPE_BF16;
    if (!strcmp(s, "fp16"))
        return MOEK_DTYPE_FP16;
    return -1;
}

static bool same_key(const struct tile_entry *a, const struct tile_entry *b)
{
    return a->dt == b->dt && a->hidden == b->hidden && a->intermediate == b->intermediate &&
           a->experts == b->experts && a->topk == b->topk && !strcmp(a->device, b->device);
}

int tiles_check_entry(const struct tile_entry *e, char *err, size_t errlen)
{
    size_t len = strnlen(e->device, TILES_DEVICE_MAX);
    if (len == 0)
        return errf(err, errlen, -EINVAL, "the card's name is empty");
    if (len == TILES_DEVICE_MAX)
        return errf(err, errlen, -EINVAL, "the card's name is longer than %d characters",
                    TILES_DEVICE_MAX - 1);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)e->device[i] < 0x20 || e->device[i] == 0x7f)
            return errf(err, errlen, -EINVAL, "the card's name holds a control character");
    if (!tiles_dtype_name(e->dt))
        return errf(err, errlen, -EINVAL, "dtype %d is not bf16 or fp16", (int)e->dt);
    if (e->hidden < 1 || e->hidden > TILES_MAX_DIM || e->intermediate < 1 ||
        e->intermediate > TILES_MAX_DIM)
        return errf(err, errlen, -EINVAL, "hidden %d / intermediate %d: each from 1 to %d",
                    e->hidden, e->intermediate, TILES_MAX_DIM);
    if (e->experts < 1 || e->experts > TILES_MAX_EXPERTS)
        return errf(err, errlen, -EINVAL, "%d experts (1 to %d)", e->experts, TILES_MAX_EXPERTS);
    if (e->topk < 1 || e->topk > e->experts)
        return errf(err, errlen, -EINVAL, "topk %d is not between 1 and the %d experts", e->topk,
                    e->experts);
    if (e->n_rules < 1)
        return errf(err, errlen, -EINVAL, "no rules");
    if (e->n_rules > TILES_MAX_RULES)
        return errf(err, errlen, -EINVAL, "%d rules; at most %d", e->n_rules, TILES_MAX_RULES);
    for (int i = 0; i < e->n_rules; i++) {
        const struct tile_rule *r = &e->rules[i];
        if (r->min_tokens < 1 || r->min_tokens > TILES_MAX_TOKENS)
            return errf(err, errlen, -EINVAL, "rule '%d:%d': min_tokens is not from 1 to %d",
                        r->min_tokens, r->tile, TILES_MAX_TOKENS);
        if (i > 0 && r->min_tokens <= e->rules[i - 1].min_tokens)
            return errf(err, errlen, -EINVAL,
                        "rule '%d:%d': min_tokens does not ascend (the rule before has %d)",
                        r->min_tokens, r->tile, e->rules[i - 1].min_tokens);
        if (!tiles_tile_ok(r->tile))
            return errf(err, errlen, -EINVAL,
                        "rule '%d:%d': tile %d is not 16, 32, 64, 128, 144, 192 or 256",
                        r->min_tokens, r->tile, r->tile);
    }
    return 0;
}

static int table_reserve(struct tile_table *t, size_t n)
{
    if (n <= t->cap)
        return 0;
    size_t cap = t->cap ? 2 * t->cap : 16;
    while (cap < n)
        cap *= 2;
    struct tile_entry *p = realloc(t->entries, cap * sizeof(*p));
    if (!p)
        return -ENOMEM;
    t->entries = p;
    t->cap = cap;
    return 0;
}

int tiles_put(struct tile_table *t, const struct tile_entry *e, char *err, size_t errlen)
{
    int rc = tiles_check_entry(e, err, errlen);
    if (rc)
        return rc;
    for (size_t i = 0; i < t->n; i++)
        if (same_key(&t->entries[i], e)) {
            t->entries[i] = *e;
            return 0;
        }
    if (t->n >= TILES_MAX_ENTRIES)
        return errf(err, errlen, -EINVAL, "more than %d entries", TILES_MAX_ENTRIES);
    if (table_reserve(t, t->n + 1))
        return -ENOMEM;
    t->entries[t->n++] = *e;
    return 0;
}

const struct tile_entry *tiles_find(const struct tile_table *t, const char *device, moek_dtype dt,
                                    const moek_moe_shape *s)
{
    for (size_t i = 0; t && i < t->n; i++) {
        const struct tile_entry *e = &t->entries[i];
        if (e->dt == dt && e->hidden == s->hidden && e->intermediate == s->intermediate &&
            e->experts == s->experts && e->topk == s->topk && !strcmp(e->device, device))
            return e;
    }
    return NULL;
}

/* ---- parsing ------------------------------------------------------------- */

/* A decimal number of at most 9 digits (no sign, no spaces): its value, or
 * -1. */
static int parse_num(const char *s, size_t len)
{
    if (len == 0 || len > 9)
        return -1;
    int v = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v;
}

/* Split line (len bytes, no newline) at runs of tabs into at most max
 * fields, trimming the spaces around each; returns the count (max + 1 when
 * there are more). */
static int split_tabs(const char *line, size_t len, const char **f, size_t *flen, int max)
{
    int n = 0;
    size_t i = 0;
    while (i < len) {
        while (i < len && line[i] == '\t')
            i++;
        if (i == len)
            break;
        size_t b = i;
        while (i < len && line[i] != '\t')
            i++;
        size_t e = i;
        while (b < e && line[b] == ' ')
            b++;
        while (e > b && line[e - 1] == ' ')
            e--;
        if (n == max)
            return max + 1;
        f[n] = line + b;
        flen[n] = e - b;
        n++;
    }
    return n;
}

/* One entry line into e; 0 or -EINVAL with err (without the file:line). */
static int parse_line(const char *line, size_t len, struct tile_entry *e, char *err,
                      size_t errlen)
{
    const char *f[TILES_FIELDS];
    size_t fl[TILES_FIELDS];
    static const char *names[] = {"card", "dtype", "hidden", "intermediate", "experts", "topk",
                                  "rules"};
    int n = split_tabs(line, len, f, fl, TILES_FIELDS);
    if (n != TILES_FIELDS)
        return errf(err, errlen, -EINVAL,
                    "%s%d field%s; want 7 separated by tabs: card, dtype, hidden, "
                    "intermediate, experts, topk, rules",
                    n > TILES_FIELDS ? "more than " : "", n > TILES_FIELDS ? TILES_FIELDS : n,
                    n == 1 ? "" : "s");
    memset(e, 0, sizeof(*e));
    if (fl[0] >= TILES_DEVICE_MAX)
        return errf(err, errlen, -EINVAL, "the card's name is longer than %d characters",
                    TILES_DEVICE_MAX - 1);
    memcpy(e->device, f[0], fl[0]);
    char word[16];
    snprintf(word, sizeof(word), "%.*s", (int)(fl[1] < 15 ? fl[1] : 15), f[1]);
    int dt = fl[1] < 15 ? tiles_dtype_parse(word) : -1;
    if (dt < 0)
        return errf(err, errlen, -EINVAL, "unknown dtype '%.*s' (bf16 or fp16)", (int)fl[1], f[1]);
    e->dt = (moek_dtype)dt;
    int *nums[] = {&e->hidden, &e->intermediate, &e->experts, &e->topk};
    for (int i = 0; i < 4; i++) {
        *nums[i] = parse_num(f[2 + i], fl[2 + i]);
        if (*nums[i] < 1)
            return errf(err, errlen, -EINVAL, "bad %s '%.*s' (a positive number)", names[2 + i],
                        (int)fl[2 + i], f[2 + i]);
    }
    const char *p = f[6], *end = f[6] + fl[6];
    while (p < end) {
        while (p < end && *p == ' ')
            p++;
        if (p == end)
            break;
        const char *w = p;
        while (p < end && *p != ' ')
            p++;
        const char *colon = memchr(w, ':', (size_t)(p - w));
        int m = colon ? parse_num(w, (size_t)(colon - w)) : -1;
        int tile = colon ? parse_num(colon + 1, (size_t)(p - colon - 1)) : -1;
        if (m < 0 || tile < 0)
            return errf(err, errlen, -EINVAL, "bad rule '%.*s' (min_tokens:tile, two numbers)",
                        (int)(p - w), w);
        if (e->n_rules == TILES_MAX_RULES)
            return errf(err, errlen, -EINVAL, "more than %d rules", TILES_MAX_RULES);
        e->rules[e->n_rules++] = (struct tile_rule){m, tile};
    }
    return tiles_check_entry(e, err, errlen);
}

int tiles_parse(struct tile_table *t, const char *text, const char *name, char *err, size_t errlen)
{
    int *lines = NULL; /* the line of each entry, for duplicates */
    int rc = 0, lineno = 0;
    char why[256];
    for (const char *p = text; *p && !rc;) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        const char *line = p;
        p = nl ? nl + 1 : p + len;
        lineno++;
        if (len && line[len - 1] == '\r')
            len--;
        size_t i = 0;
        while (i < len && (line[i] == ' ' || line[i] == '\t'))
            i++;
        if (i == len || line[i] == '#')
            continue;
        struct tile_entry e;
        if ((rc = parse_line(line, len, &e, why, sizeof(why)))) {
            errf(err, errlen, rc, "%s:%d: %s", name, lineno, why);
            break;
        }
        for (size_t j = 0; j < t->n; j++)
            if (same_key(&t->entries[j], &e)) {
                rc = errf(err, errlen, -EINVAL,
                          "%s:%d: the same card, dtype and shape as line %d", name, lineno,
                          lines[j]);
                break;
            }
        if (rc)
            break;
        if (t->n >= TILES_MAX_ENTRIES) {
            rc = errf(err, errlen, -EINVAL, "%s:%d: more than %d entries", name, lineno,
                      TILES_MAX_ENTRIES);
            break;
        }
        if (table_reserve(t, t->n + 1)) {
            rc = -ENOMEM;
            break;
        }
        int *nl2 = realloc(lines, t->cap * sizeof(int));
        if (!nl2) {
            rc = -ENOMEM;
            break;
        }
        lines = nl2;
        lines[t->n] = lineno;
        t->entries[t->n++] = e;
    }
    free(lines);
    if (rc) {
        if (rc == -ENOMEM)
            errf(err, errlen, rc, "%s: out of memory", name);
        t->n = 0;
    }
    return rc;
}

int tiles_read(struct tile_table *t, const char *path, char *err, size_t errlen)
{
    char *text;
    int rc = read_text_file(path, &text, err, errlen);
    if (rc)
        return rc;
    rc = tiles_parse(t, text, path, err, errlen);
    free(text);
    return rc;
}

/* ---- writing ------------------------------------------------------------- */

static int entry_cmp(const void *pa, const void *pb)
{
    const struct tile_entry *a = *(const struct tile_entry *const *)pa;
    const struct tile_entry *b = *(const struct tile_entry *const *)pb;
    int c = strcmp(a->device, b->device);
    if (c)
        return c;
    if (a->dt != b->dt)
        return (int)a->dt - (int)b->dt;
    const int ka[] = {a->hidden, a->intermediate, a->experts, a->topk};
    const int kb[] = {b->hidden, b->intermediate, b->experts, b->topk};
    for (int i = 0; i < 4; i++)
        if (ka[i] != kb[i])
            return ka[i] < kb[i] ? -1 : 1;
    return 0;
}

static const char header[] =
    "# moed token-tile table, written by moed --tune (see moed(8)). One line per card,\n"
    "# dtype and layer shape, fields separated by tabs:\n"
    "# card  dtype  hidden  intermediate  experts  topk  min_tokens:tile ...\n"
    "# A forward of T tokens uses the rule with the largest min_tokens <= T.\n";

int tiles_format(const struct tile_table *t, char **out)
{
    /* An entry is at most the name, 4 numbers of 8 digits and 32 rules of
     * "16777216:256 ". */
    size_t cap = sizeof(header) + t->n * (TILES_DEVICE_MAX + 64 + TILES_MAX_RULES * 14) + 1;
    char *buf = malloc(cap);
    const struct tile_entry **order = malloc((t->n ? t->n : 1) * sizeof(*order));
    if (!buf || !order) {
        free(buf);
        free(order);
        return -ENOMEM;
    }
    for (size_t i = 0; i < t->n; i++)
        order[i] = &t->entries[i];
    qsort(order, t->n, sizeof(*order), entry_cmp);
    size_t len = (size_t)snprintf(buf, cap, "%s", header);
    for (size_t i = 0; i < t->n; i++) {
        const struct tile_entry *e = order[i];
        len += (size_t)snprintf(buf + len, cap - len, "%s\t%s\t%d\t%d\t%d\t%d\t", e->device,
                                tiles_dtype_name(e->dt) ? tiles_dtype_name(e->dt) : "?",
                                e->hidden, e->intermediate, e->experts, e->topk);
        for (int r = 0; r < e->n_rules; r++)
            len += (size_t)snprintf(buf + len, cap - len, "%s%d:%d", r ? " " : "",
                                    e->rules[r].min_tokens, e->rules[r].tile);
        len += (size_t)snprintf(buf + len, cap - len, "\n");
    }
    free(order);
    *out = buf;
    return 0;
}

/* mkdir -p of path's directories, each 0755. */
static int make_dirs(const char *dir)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof(buf), "%s", dir) >= (int)sizeof(buf))
        return -ENAMETOOLONG;
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0755) < 0 && errno != EEXIST)
                return -errno;
            *p = c;
            if (!c)
                break;
        }
    }
    return 0;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -errno;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int tiles_write(const char *path, const struct tile_table *updates, size_t *kept, char *err,
                size_t errlen)
{
    char dir[PATH_MAX], tmp[PATH_MAX + 16];
    const char *slash = strrchr(path, '/');
    if (!path[0] || !slash || !slash[1])
        return errf(err, errlen, -EINVAL, "'%s' is not an absolute file name", path);
    if (path_dir(path, dir, sizeof(dir)) < 0)
        return errf(err, errlen, -ENAMETOOLONG, "%s: name too long", path);
    if (snprintf(tmp, sizeof(tmp), "%s/.%s.XXXXXX", dir, slash + 1) >= (int)sizeof(tmp))
        return errf(err, errlen, -ENAMETOOLONG, "%s: name too long", path);

    struct tile_table t;
    char why[400] = "";
    tiles_init(&t);
    int rc = tiles_read(&t, path, why, sizeof(why));
    if (rc == -ENOENT) {
        rc = 0;
    } else if (rc) {
        tiles_done(&t);
        return errf(err, errlen, rc, "%s; not overwritten (fix or remove it)", why);
    }
    size_t from_file = t.n, replaced = 0;
    for (size_t i = 0; i < updates->n && !rc; i++) {
        for (size_t j = 0; j < from_file; j++)
            replaced += same_key(&t.entries[j], &updates->entries[i]);
        rc = tiles_put(&t, &updates->entries[i], why, sizeof(why));
    }
    char *text = NULL;
    if (!rc)
        rc = tiles_format(&t, &text);
    tiles_done(&t);
    if (rc) {
        free(text);
        return rc == -ENOMEM ? errf(err, errlen, rc, "out of memory")
                             : errf(err, errlen, rc, "%s", why);
    }
    if ((rc = make_dirs(dir)) < 0) {
        free(text);
        return errf(err, errlen, rc, "cannot create %s: %s", dir, strerror(-rc));
    }
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
        free(text);
        return errf(err, errlen, rc, "cannot create a file in %s: %s", dir, strerror(-rc));
    }
    rc = write_all(fd, text, strlen(text));
    free(text);
    if (!rc && fchmod(fd, 0644) < 0)
        rc = -errno;
    if (!rc && fsync(fd) < 0)
        rc = -errno;
    if (close(fd) < 0 && !rc)
        rc = -errno;
    if (!rc && rename(tmp, path) < 0)
        rc = -errno;
    if (rc) {
        unlink(tmp);
        return errf(err, errlen, rc, "cannot write %s: %s", path, strerror(-rc));
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        if (fsync(dfd) < 0)
            rc = -errno;
        close(dfd);
    }
    if (rc)
        return errf(err, errlen, rc, "%s written, but the directory's fsync failed: %s", path,
                    strerror(-rc));
    if (kept)
        *kept = from_file - replaced;
    return 0;
}
