/*
 * tiles.h: the token-tile table: which GEMM token tile the CUDA kernels use
 * for a MoE layer of a given shape on a given card, by token count, as
 * `moed --tune` measured it there. Cards and shapes the table does not name
 * keep the kernels' heuristic.
 *
 * The file (tile_table in moed.conf) is text, one line per (card, dtype,
 * hidden, intermediate, experts, topk), the fields separated by tabs (a
 * card's name holds spaces; spaces around a field are dropped), '#'
 * starting a comment line; with the tabs shown as spaces:
 *
 *   # card        dtype  hidden  intermediate  experts  topk  rules
 *   NVIDIA H200   bf16   4096    14336         8        2     1:16 64:32 512:128 2048:256
 *
 * The rules are "min_tokens:tile" separated by spaces, min_tokens strictly
 * ascending from at least 1, at most TILES_MAX_RULES of them, tiles among
 * tiles_offered[]: a forward of T tokens uses the rule with the largest
 * min_tokens <= T (below the first rule, the heuristic). The card is named
 * as the CUDA driver names it (cudaDeviceProp.name).
 *
 * Library code: nothing here logs. A malformed file is refused whole with a
 * message naming file and line; the daemon then keeps the heuristic.
 */
#ifndef MOED_TILES_H
#define MOED_TILES_H

#include <stdbool.h>
#include <stddef.h>

#include "kernels/cuda/moe_cuda.h" /* plain C: the tiles the kernels offer */
#include "kernels/moe_kernels.h"

#define TILES_MAX_RULES MOEK_CUDA_MAX_TILE_RULES
#define TILES_DEVICE_MAX 96 /* a card's name, with its NUL */
#define TILES_N_OFFERED MOEK_CUDA_TILE_CANDIDATES

/* The token tiles the CUDA kernels offer, ascending (MOEK_CUDA_TOKEN_TILES):
 * also the order of backend_tune.us's columns. */
extern const int tiles_offered[TILES_N_OFFERED];
bool tiles_tile_ok(int tile);

struct tile_rule {
    int min_tokens;
    int tile;
};

struct tile_entry {
    char device[TILES_DEVICE_MAX];
    moek_dtype dt;           /* MOEK_DTYPE_BF16 or MOEK_DTYPE_FP16 */
    int hidden, intermediate, experts, topk;
    int n_rules;
    struct tile_rule rules[TILES_MAX_RULES];
};

/* Caller storage: tiles_init(), then tiles_done() (which accepts a table
 * that was only initialised). */
struct tile_table {
    struct tile_entry *entries;
    size_t n, cap;
};

void tiles_init(struct tile_table *t);
void tiles_done(struct tile_table *t);

/*
 * Parse the text of a table file over an empty table t; name is the file
 * name that messages start with ("NAME:LINE: why"). 0, -EINVAL for a
 * malformed line (nothing of the text is kept) or -ENOMEM.
 */
int tiles_parse(struct tile_table *t, const char *text, const char *name, char *err,
                size_t errlen);

/* Read and parse a table file (at most 1 MiB): 0, -ENOENT when there is no
 * such file, -EINVAL for a malformed one, another -errno when it cannot be
 * read; err says why. */
int tiles_read(struct tile_table *t, const char *path, char *err, size_t errlen);

/* The entry of this card, dtype and shape, or NULL. Borrowed; valid until
 * the table changes. */
const struct tile_entry *tiles_find(const struct tile_table *t, const char *device, moek_dtype dt,
                                    const moek_moe_shape *shape);

/* Check an entry as the parser checks a line: 0 or -EINVAL with err. */
int tiles_check_entry(const struct tile_entry *e, char *err, size_t errlen);

/* Add e (checked first), replacing an entry of the same key. 0, -EINVAL
 * with err, -ENOMEM. */
int tiles_put(struct tile_table *t, const struct tile_entry *e, char *err, size_t errlen);

/* The table as file text, entries sorted by key, after a header comment.
 * Caller frees *out. 0 or -ENOMEM. */
int tiles_format(const struct tile_table *t, char **out);

/*
 * Merge the entries of `updates` into the table file at path (its other
 * entries are kept; its comments are not) and write it atomically: a
 * temporary file in the same directory, fsync, rename, fsync of the
 * directory. A missing directory is created (mode 0755). A file that exists
 * but does not parse is refused (-EINVAL), never overwritten. *kept, when
 * not NULL, gets the number of entries that came from the file untouched.
 * 0 or -errno with err.
 */
int tiles_write(const char *path, const struct tile_table *updates, size_t *kept, char *err,
                size_t errlen);

/* "bf16" / "fp16" (NULL for another dtype), and back (-1 when unknown). */
const char *tiles_dtype_name(moek_dtype dt);
int tiles_dtype_parse(const char *s);

#endif
