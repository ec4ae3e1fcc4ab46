/*
 * config.h: moed's configuration: defaults, the INI file (/etc/moed/moed.conf,
 * parsed with inih) and the command line, in that order of precedence.
 *
 *   [daemon]
 *   runtime_dir = /run/moed   ; absolute, at most CONFIG_MAX_RUNTIME_DIR characters
 *   allowed_dirs = /var/lib/moed/weights:/srv/models
 *   backend = auto            ; auto | cpu | cuda
 *   cpu_threads = 0           ; 0: one per CPU
 *   device = 0                ; CUDA device index (the CPU backend ignores it)
 *   gpus = 0,1                ; or "all": own these CUDA devices (daemon devices 0, 1, ...
 *                             ; in this order); unset: only `device`
 *   transport = auto          ; between GPUs: auto (NCCL if installed, else peer) | nccl | peer
 *   io_threads = 1            ; ZeroMQ I/O threads (client connections spread over them)
 *   log_level = info
 *   tile_table = /var/cache/moed/tiles.tsv
 *                             ; token tiles measured by moed --tune (tiles.h); empty: none,
 *                             ; the kernels' heuristic. Default: config_default_tile_table()
 *
 *   [batch]
 *   max_batch_tokens = 4096   ; tokens (or GEMM rows) in one launch
 *   max_delay_us = 0          ; wait this long for more requests when the device frees
 *   max_request_tokens = 65536
 *   max_slice_tokens = 1024   ; rows one MoE request adds to a batch (long prefills run in
 *                             ; slices; a grouped-GEMM request runs whole, alone if larger
 *                             ; than max_batch_tokens)
 *   return_wait_us = 600      ; after a batch of several clients, wait up to this long for
 *                             ; those clients' next requests (0: never)
 *   batching = true           ; false: every request runs alone (for comparison)
 *   spin_us = auto            ; spin this long instead of sleeping: the loop for a batch's
 *                             ; compute to end, the compute thread for the next batch
 *                             ; (auto: 200 with a GPU, 0 on the CPU backend)
 *
 *   [limits]
 *   max_sessions = 256
 *   max_regions = 64          ; per session
 *   max_region_bytes = 17179869184
 *   max_session_bytes = 68719476736
 *   max_pinned_bytes = 17179869184 ; client regions pinned for DMA (CUDA), all sessions;
 *                             ; regions past it work unpinned, at pageable copy speed
 *   max_queued_requests = 256 ; per session
 *   max_queued_tokens = 65536 ; per session
 *   max_queued_total = 4096   ; queued requests of all sessions together
 *   max_message_bytes = 1048576 ; a larger request drops its connection (ZMQ_MAXMSGSIZE)
 *   max_pending_messages = 1024 ; per ZeroMQ connection and direction (ZMQ_SNDHWM/RCVHWM)
 *   max_layers = 256          ; loaded or loading, clients' and configured
 *   max_loads = 8             ; clients' LoadLayer requests in flight
 *
 *   [layer NAME]
 *   kind = moe                ; moe | gemm
 *   file = /var/lib/moed/weights/model.safetensors
 *   prefix = model.layers.0.block_sparse_moe.
 *   experts = 8  topk = 2  hidden = 4096  intermediate = 14336 (one per line)
 *   dtype = bf16  routing = softmax  renormalize = true
 *   groups = 8  n = 512  k = 256 (kind = gemm: the weight's [groups, n, k], one per line)
 *   devices = 0,1             ; spread the experts over these devices (default: 0)
 *   expert_devices = 0,0,1,1  ; optional: the device of each expert
 */
#ifndef MOED_CONFIG_H
#define MOED_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A layer to load at start (and on reload). */
struct layer_conf {
    char *name;
    int kind;        /* Moe__LayerKind */
    int dtype;       /* Moe__DType, 0: from the file */
    uint32_t experts, topk, hidden, intermediate;
    int routing;     /* Moe__Routing */
    bool renormalize;
    uint32_t groups, n, k;
    char *path;
    char *prefix;
    uint32_t devices[16];          /* devices = 0,1: experts spread over them */
    size_t n_devices;
    uint32_t *expert_devices;      /* expert_devices = 0,0,1,1,...: a device per expert */
    size_t n_expert_devices;
    struct layer_conf *next;
};

#define CONFIG_SPIN_AUTO UINT32_MAX

struct config {
    char *runtime_dir;
    char **allowed_dirs;     /* canonical absolute paths */
    size_t n_allowed_dirs;
    char *backend;
    int cpu_threads;
    int device;              /* CUDA device index */
    uint32_t gpus[16];       /* gpus = 0,1: CUDA devices the daemon owns */
    size_t n_gpus;
    bool gpus_all;           /* gpus = all */
    char *transport;         /* auto | nccl | peer */
    char *tile_table;        /* absolute path, or "" for none */
    int io_threads;          /* ZeroMQ I/O threads */
    int log_level;

    uint32_t max_batch_tokens;
    uint32_t max_delay_us;
    uint32_t max_request_tokens;
    uint32_t max_slice_tokens;
    uint32_t return_wait_us;
    uint32_t spin_us;       /* CONFIG_SPIN_AUTO: by backend */
    bool batching;

    uint32_t max_sessions;
    uint32_t max_regions;
    uint64_t max_region_bytes;
    uint64_t max_session_bytes;
    uint64_t max_pinned_bytes;
    uint32_t max_queued_requests;
    uint32_t max_queued_tokens;
    uint32_t max_queued_total;
    uint64_t max_message_bytes;
    uint32_t max_pending_messages;
    uint32_t max_layers;
    uint32_t max_loads;

    struct layer_conf *layers;
};

/* Fill c with the defaults (runtime dir from the environment rule). */
/* The bounds of the numbers the command line sets too. */
#define CONFIG_MAX_THREADS 1024
#define CONFIG_MAX_BATCH_TOKENS (1u << 20)
#define CONFIG_MAX_DELAY_US 10000000u
#define CONFIG_MAX_SLICE_TOKENS (1u << 24)

int config_init(struct config *c);
void config_done(struct config *c);

/* A copy of one layer section (next NULL), or NULL out of memory; freed
 * with layer_conf_free, which frees a whole list. */
struct layer_conf *layer_conf_copy(const struct layer_conf *l);
void layer_conf_free(struct layer_conf *l);

/* Read an INI file over c. 0, or -errno for an unreadable file (-EISDIR for
 * a directory), or -EINVAL; err names the file, and the line and the
 * problem. */
int config_load(struct config *c, const char *path, char *err, size_t errlen);
/* Parse INI text (for tests and fuzzing); same contract as config_load. */
int config_parse_string(struct config *c, const char *text, char *err, size_t errlen);

/* Add one allowed directory; it must exist (stored canonical). */
int config_add_allowed_dir(struct config *c, const char *dir);
/* One [daemon] key as the file would set it: 0, -EINVAL for a bad value,
 * -ENOENT for an unknown key, -ENOMEM. */
int config_set_daemon(struct config *c, const char *key, const char *value);
/* Copy n's [batch] and [limits] numbers that a running daemon can take
 * into c; for each other one that differs, call at_start(key) (it takes
 * effect at the next start). */
void config_take_numbers(struct config *c, const struct config *n,
                         void (*at_start)(const char *key));

/* The longest runtime directory: its sockets' names (dir/moed.sock, the
 * longer) must fit a sockaddr_un's sun_path of 108 bytes. */
#define CONFIG_MAX_RUNTIME_DIR 97
/* 0 when dir can be the runtime directory: an absolute path of at most
 * CONFIG_MAX_RUNTIME_DIR characters; else -EINVAL. */
int config_check_runtime_dir(const char *dir);

/* The runtime directory rule shared with libmoe: $MOED_RUNTIME_DIR, else
 * /run/moed for root, else $XDG_RUNTIME_DIR/moed, else /tmp/moed-<uid>.
 * Caller frees. */
char *config_default_runtime_dir(void);

/* The token-tile table's file when the configuration names none:
 * $CACHE_DIRECTORY/tiles.tsv (the service's CacheDirectory=), else
 * /var/cache/moed/tiles.tsv for root, else $XDG_CACHE_HOME/moed/tiles.tsv,
 * else $HOME/.cache/moed/tiles.tsv, else "" (none). Caller frees. */
char *config_default_tile_table(void);

/* Parse "moe"/"gemm", "bf16"/..., "softmax"/... Return the enum or -1. */
int config_parse_kind(const char *s);
int config_parse_dtype(const char *s);
int config_parse_routing(const char *s);

#endif
