/*
 * tune.h: `moed --tune`: measure which GEMM token tile is fastest for each
 * MoE layer shape the daemon serves, at each token count, on the device at
 * hand, and merge the results into the token-tile table file (tiles.h),
 * which the daemon reads at start and on reload.
 *
 * The plan lists distinct (dtype, shape) pairs (from --tune-shape, the demo
 * layer, the configured MoE layers, whose shapes are read from their files'
 * headers) and the token counts. tune_run() measures each shape once through
 * the backend's moe_tune (a layer of random weights: the values do not
 * change the time), prints a report, and writes the table. It opens no
 * socket and logs nothing: the report and the notes go to `out`, and an
 * error comes back with its message.
 */
#ifndef MOED_TUNE_H
#define MOED_TUNE_H

#include <stdint.h>
#include <stdio.h>

#include "daemon/backend.h"
#include "daemon/tiles.h"

struct config;

#define TUNE_MAX_SHAPES 256

struct tune_shape {
    moek_moe_shape s;
    moek_dtype dt;          /* MOEK_DTYPE_BF16 or MOEK_DTYPE_FP16 */
    char from[96];          /* what asked for it, for the report */
    int more;               /* further layers of the same shape */
};

/* Caller storage; zero it to start. */
struct tune_plan {
    struct tune_shape shapes[TUNE_MAX_SHAPES];
    int n_shapes;
    int tokens[BACKEND_TUNE_MAX]; /* ascending, no repeats */
    int n_tokens;
};

/* "E,k,H,I[,dtype]" (dtype bf16, the default, or fp16; E up to 4096, k up
 * to E, H and I up to 2^20) into t. 0 or -EINVAL. */
int tune_parse_shape(const char *arg, struct tune_shape *t);

/* "1,8,64" (up to BACKEND_TUNE_MAX counts from 1) into p's tokens, sorted,
 * repeats dropped. 0 or -EINVAL. */
int tune_parse_tokens(const char *arg, struct tune_plan *p);

/* Without --tune-tokens: 1, 2, 4, ..., 4096, none above max_batch_tokens
 * (no batch is larger). With them: -ERANGE when one is above it. */
int tune_set_tokens(struct tune_plan *p, uint32_t max_batch_tokens);

/* Add a shape unless the plan has it (then it counts one more user).
 * 0 or -ENOSPC. */
int tune_add(struct tune_plan *p, const struct tune_shape *t);

/*
 * Add the configured MoE layers' shapes, read from their files' headers
 * (under the allowed directories). Layers spread over devices (their shards
 * keep the heuristic) and fp32 layers (the CUDA kernels compute bf16 and
 * fp16) are skipped with a note on `out`. 0, or -errno with err naming the
 * layer.
 */
int tune_add_configured(struct tune_plan *p, const struct config *c, FILE *out, char *err,
                        size_t errlen);

/* Whether b can tune and the table at path can take the result: b has
 * moe_tune (else -ENOTSUP, "tuning needs a CUDA device: ..."), path is set
 * (else -EINVAL) and, if the file exists, it parses (else its error: it
 * would not be overwritten). 0 or -errno with err. */
int tune_check(struct backend *b, const char *path, char *err, size_t errlen);

/* The table entry of one measurement: a rule at each token count where the
 * fastest tile changes. */
void tune_entry(const struct backend_tune *r, const struct tune_shape *t, struct tile_entry *e);

/*
 * tune_check, then measure every shape of the plan on b, print the report
 * to out (per shape: T, the tile chosen, the heuristic's, their times, the
 * time of every tile), merge the entries into the table at path and say so.
 * A shape that fails is reported and the others go on (not past a device
 * that became unusable); what was measured is written. 0 when every shape
 * was tuned and the table written; else -errno with err.
 */
int tune_run(struct backend *b, const struct tune_plan *p, const char *path, FILE *out, char *err,
             size_t errlen);

#endif
