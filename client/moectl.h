/*
 * moectl.h: the commands of moectl, one file each family:
 * moectl_cmd.c (ping, info, layers, load, unload, stats), moectl_compute.c
 * (forward, gemm: inputs, the reference check), moectl_bench.c (bench).
 * Each takes the runtime directory (NULL: default) and its own argv, whose
 * argv[0] is "moectl NAME" (for messages), and returns the exit status.
 */
#ifndef MOECTL_H
#define MOECTL_H

#include "moe.h"

/* The most tokens (rows) one forward, gemm or bench request may carry:
 * with any 32-bit layer dimension, every size derived from it stays far
 * below 2^64, so none of them can wrap. */
#define MOECTL_MAX_TOKENS (1ull << 24)
/* The most round trips of ping, zmq-rtt or forward --repeat: each keeps a
 * latency sample, 80 MB at most. */
#define MOECTL_MAX_COUNT 10000000ull

int cmd_ping(const char *rt, int argc, char **argv);
int cmd_info(const char *rt, int argc, char **argv);
int cmd_layers(const char *rt, int argc, char **argv);
int cmd_load(const char *rt, int argc, char **argv);
int cmd_unload(const char *rt, int argc, char **argv);
int cmd_forward(const char *rt, int argc, char **argv);
int cmd_gemm(const char *rt, int argc, char **argv);
int cmd_stats(const char *rt, int argc, char **argv);
int cmd_bench(const char *rt, int argc, char **argv);
int cmd_zmq_rtt(const char *rt, int argc, char **argv);

/* Connect or print why not; NULL on failure. */
moe_client *moectl_connect(const char *rt, const char *who);
/* Print "moectl: what: <moe_errmsg() or moe_strerror(rc)>" and return 1. */
int moectl_fail(const char *what, int rc);
/* All loaded layers in *out (caller frees; NULL on error): their count, or
 * a negative error. */
int moectl_layers(moe_client *c, moe_layer_info **out);
/* Find a layer by name; 0, or prints and returns 1. */
int moectl_layer(moe_client *c, const char *name, moe_layer_info *out);
/* Parse an integer option that must lie in [min, max], or print why not,
 * naming the option, and exit 2. */
unsigned long long moectl_num(const char *opt, const char *v, unsigned long long min,
                              unsigned long long max);
/* After a command's options, from argv[first]: 0 if nothing is left, else
 * print the first argument the command does not take and return 2. */
int moectl_no_more_args(int argc, char **argv, int first);
const char *moectl_dtype_name(moe_dtype dt);
/* Parse "0,1,2" into out (max entries); the count, or 0 after printing why. */
size_t moectl_list(const char *opt, const char *v, uint32_t *out, size_t max);
/* For `load --random`: whether d (dtype defaulted to bf16) gives a shape
 * whose weights can be allocated; 0 or -EINVAL (printed). */
int moectl_random_check(moe_layer_desc *d);
/* For `load --random`: a region holding weights drawn from N(0, 1/fan_in)
 * (uniform with that variance) for the layer d describes, and d's tensors
 * pointed at it. Caller frees *r. 0 or the error (printed). */
int moectl_random_weights(moe_client *c, moe_layer_desc *d, uint64_t seed, moe_region **r);
uint64_t moectl_now_us(void);

#endif
