/*
 * reload.h: the layers the configuration names, at start and on SIGHUP.
 *
 * At start reload_load_initial() loads every [layer NAME] section, one after
 * the other, before READY=1. On SIGHUP reload_start() reads the
 * configuration again (through main, so the command line still overrides the
 * file) and reconciles the running daemon with it:
 *
 *   - a section that is gone unloads its layer;
 *   - a new section loads a layer;
 *   - a changed section (any key), or one whose file was replaced (device,
 *     inode, size or modification time differ), is unloaded and loaded again;
 *   - an unchanged section keeps its layer, weights and queue untouched;
 *   - layers that clients loaded are never unloaded, and a section whose name
 *     a client's layer already holds is not loaded (a warning says so).
 *
 * Batching limits, quotas, allowed_dirs and log_level take effect at once;
 * the token-tile table (tile_table) is read again, for the layers loaded
 * from then on (layers already loaded keep their tiles; a table that
 * cannot be used keeps the one in use);
 * runtime_dir, backend, cpu_threads, device, spin_us and max_message_bytes
 * need a restart (a warning says so). A new setting is applied here too, or
 * listed among those that need a restart. Reload loads run on the loader thread, like
 * clients' loads, so serving and the watchdog go on meanwhile.
 */
#ifndef MOED_RELOAD_H
#define MOED_RELOAD_H

#include <stdbool.h>
#include <stddef.h>

struct backend;
struct config;
struct reload;
struct server;

/* Read the configuration as at start: defaults, the file, the command line.
 * Fills out (config_done() by the caller even on error); 0 or -errno with
 * err saying why. */
typedef int (*reload_read_fn)(void *data, struct config *out, char *err, size_t errlen);
/* A reload has finished, on the loop thread; failed counts sections that
 * could not be applied, and a tile table that could not be used (the log
 * says why). */
typedef void (*reload_done_fn)(void *data, unsigned failed);

/* Caller owns the result; release with reload_free() before s is freed
 * (a reload whose plan is still on the loader thread is freed by
 * server_free, when that job ends). */
int reload_new(struct server *s, reload_read_fn read, void *read_data, struct reload **out);
void reload_free(struct reload **r);

/* Load s->cfg->layers synchronously (start-up, before READY=1), extending
 * the start-up timeout as it goes. 0, or the first failure with err naming
 * the layer and the reason; -ECANCELED once moed is stopping
 * (st_cancel_reads). */
int reload_load_initial(struct reload *r, char *err, size_t errlen);

/* Begin a reload; done(data, failed) follows on the loop thread, maybe
 * before this returns. A reload requested while one runs makes that one read
 * the configuration again when it finishes, and done is called once. */
void reload_start(struct reload *r, reload_done_fn done, void *data);
bool reload_running(const struct reload *r);

/* Read the token-tile table, the configuration's tile_table ("": none),
 * and give it to every backend that chooses tiles (set_tiles), for the MoE
 * layers made from then on; logs what it found. At start, before any layer
 * is made, and on every reload. No file means no table: the kernels'
 * heuristic picks. A file that cannot be used (malformed: the log names
 * its line) keeps the table in use, if one is, and the daemon serves on.
 * 0, or -errno for such a file where a backend chooses tiles (a reload
 * with errors). */
int reload_tiles(struct reload *r);

/* --check-config: every configured layer's file lies under the allowed
 * directories, is a readable safetensors file and holds the tensors its
 * prefix names; a MoE layer states topk. 0 or -errno with err. */
int reload_check_layers(const struct config *c, char *err, size_t errlen);

#endif
