/*
 * main.c: moed's entry point: arguments and configuration, the backend, the
 * endpoints, signals and systemd notifications, then the loop. The only place
 * where an error becomes a log line and an exit code. `moed --tune` also
 * starts here: it measures token tiles on the device and writes the tile
 * table (tiles.h), without opening any socket.
 */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/demo.h"
#include "daemon/fdguard.h"
#include "daemon/log.h"
#include "daemon/loop.h"
#include "daemon/notify.h"
#include "daemon/reload.h"
#include "daemon/safetensors.h"
#include "daemon/server.h"
#include "daemon/tiles.h"
#include "daemon/tune.h"
#include "daemon/util.h"
#include "moe.pb-c.h"
#include "proto/rundir.h"

/* What the command line sets: it overrides the file, at start and again on
 * every reload. */
struct cli {
    const char *runtime_dir, *backend;
    const char *allow[64];
    int n_allow, threads, log_level;
    uint32_t mbt, mdu, mst, rwu, spin, vdev;
    const char *gpus, *transport, *io_threads, *tile_table;
    bool no_batch;
    char demo_dir[PATH_MAX]; /* --demo's weights, once written: allowed too */
};

struct daemon {
    struct config cfg;
    char *config_path;
    struct cli cli;
    struct reload *reload;
    struct loop *loop;
    struct server *server;
    struct backend *backend;        /* backends[0] */
    struct backend *backends[MAX_DEVICES];
    int n_backends;
    struct loop_watch *sig_watch;
    struct loop_watch *tick;
    int sigfd;
    bool stopping;
    uint64_t stop_deadline_us;
    uint64_t drained_us;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moed [options]\n"
            "Serve fused-MoE and grouped-GEMM requests to local processes.\n\n"
            "  -c, --config FILE        read configuration from FILE (INI)\n"
            "      --check-config       validate the configuration and exit\n"
            "  -r, --runtime-dir DIR    sockets live here (default: $MOED_RUNTIME_DIR,\n"
            "                           /run/moed as root, else $XDG_RUNTIME_DIR/moed,\n"
            "                           else /tmp/moed-UID)\n"
            "  -a, --allow-dir DIR      weight files may be loaded from DIR (repeatable)\n"
            "  -b, --backend NAME       auto (default), cpu or cuda\n"
            "  -t, --threads N          CPU backend threads (0: one per CPU)\n"
            "      --max-batch-tokens N tokens in one batched launch (default 4096)\n"
            "      --max-delay-us N     wait up to N us for more requests (default 0)\n"
            "      --max-slice-tokens N rows one MoE request adds to a batch (default 1024;\n"
            "                           grouped-GEMM requests run whole)\n"
            "      --return-wait-us N   after a batch of several clients, wait up to N us for\n"
            "                           their next requests (default 600; 0: never)\n"
            "      --spin-us N          spin up to N us instead of sleeping (the loop for a\n"
            "                           batch's end, the compute thread for the next batch)\n"
            "                           (default: 200 with a GPU, 0 on the CPU backend)\n"
            "      --no-batch           run every request alone (to measure what batching gains)\n"
            "      --virtual-devices N  with --backend cpu: N devices (threads split between\n"
            "                           them) for layers whose experts are spread over devices\n"
            "      --gpus LIST|all      own these CUDA devices (e.g. 0,1; default: the\n"
            "                           configuration's device)\n"
            "      --transport NAME     between GPUs: auto (default), nccl or peer\n"
            "      --io-threads N       ZeroMQ I/O threads (default 1)\n"
            "  -l, --log-level LEVEL    err, warning, notice, info (default), debug\n"
            "      --demo               generate and serve the demo layers 'demo' and 'demo-gemm'\n"
            "      --tile-table FILE    token tiles measured by --tune (default: see moed(8);\n"
            "                           empty: none, the kernels' heuristic)\n"
            "      --tune               measure the fastest token tile of each MoE layer shape\n"
            "                           (configured layers, --demo's, --tune-shape's) on the GPU,\n"
            "                           merge them into the tile table and exit\n"
            "      --tune-tokens LIST   token counts to measure (default 1,2,4,...,4096 up to\n"
            "                           max_batch_tokens; at most 32)\n"
            "      --tune-shape E,k,H,I[,DTYPE]  a shape to tune with random weights (repeatable;\n"
            "                           DTYPE bf16, the default, or fp16)\n"
            "  -h, --help               this text\n"
            "  -V, --version            print the version\n");
}

/* Decimal digits only, as in the file: strtoul would also take leading
 * spaces, a '+', and a '-' that wraps ("-18446744073709551615" is 1). */
static int parse_u32_arg(const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    if (!isdigit((unsigned char)s[0]))
        return -EINVAL;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *end || v > UINT32_MAX)
        return -EINVAL;
    *out = (uint32_t)v;
    return 0;
}

static int cli_apply(const struct cli *o, struct config *c, char *err, size_t errlen)
{
    int rc;
    if (o->runtime_dir && (rc = config_set_daemon(c, "runtime_dir", o->runtime_dir)) < 0) {
        if (rc == -ENOMEM)
            snprintf(err, errlen, "--runtime-dir %s: out of memory", o->runtime_dir);
        else
            snprintf(err, errlen, "--runtime-dir %s: not an absolute path of at most %d "
                     "characters (its sockets' names must fit 108 bytes)", o->runtime_dir,
                     CONFIG_MAX_RUNTIME_DIR);
        return rc;
    }
    /* Nor from the environment (MOED_RUNTIME_DIR, XDG_RUNTIME_DIR): found
     * out here, not when the socket will not bind. */
    if (config_check_runtime_dir(c->runtime_dir) < 0) {
        snprintf(err, errlen, "the runtime directory %s (from the environment): not an absolute "
                 "path of at most %d characters", c->runtime_dir, CONFIG_MAX_RUNTIME_DIR);
        return -EINVAL;
    }
    for (int i = 0; i < o->n_allow; i++)
        if ((rc = config_add_allowed_dir(c, o->allow[i])) < 0) {
            snprintf(err, errlen, "--allow-dir %s: %s", o->allow[i], strerror(-rc));
            return rc;
        }
    if (o->demo_dir[0] && (rc = config_add_allowed_dir(c, o->demo_dir)) < 0) {
        snprintf(err, errlen, "--demo's %s: %s", o->demo_dir, strerror(-rc));
        return rc;
    }
    if (o->backend && (rc = config_set_daemon(c, "backend", o->backend)) < 0) {
        snprintf(err, errlen, "--backend %s: %s", o->backend,
                 rc == -ENOMEM ? "out of memory" : "not auto, cpu or cuda");
        return rc;
    }
    if (o->threads >= 0)
        c->cpu_threads = o->threads;
    if (o->mbt)
        c->max_batch_tokens = o->mbt;
    if (o->mdu != UINT32_MAX)
        c->max_delay_us = o->mdu;
    if (o->mst)
        c->max_slice_tokens = o->mst;
    if (o->no_batch)
        c->batching = false;
    if (o->rwu != UINT32_MAX)
        c->return_wait_us = o->rwu;
    if (o->spin != UINT32_MAX)
        c->spin_us = o->spin;
    if (o->log_level >= 0)
        c->log_level = o->log_level;
    if (o->gpus && (rc = config_set_daemon(c, "gpus", o->gpus)) < 0) {
        snprintf(err, errlen, "--gpus %s: %s", o->gpus,
                 rc == -ENOMEM ? "out of memory" : "not a list of device numbers or 'all'");
        return rc;
    }
    if (o->io_threads && (rc = config_set_daemon(c, "io_threads", o->io_threads)) < 0) {
        snprintf(err, errlen, "--io-threads %s: %s", o->io_threads,
                 rc == -ENOMEM ? "out of memory" : "not a number from 1 to 64");
        return rc;
    }
    if (o->transport && (rc = config_set_daemon(c, "transport", o->transport)) < 0) {
        snprintf(err, errlen, "--transport %s: %s", o->transport,
                 rc == -ENOMEM ? "out of memory" : "not auto, nccl or peer");
        return rc;
    }
    if (o->tile_table && (rc = config_set_daemon(c, "tile_table", o->tile_table)) < 0) {
        snprintf(err, errlen, "--tile-table %s: %s", o->tile_table,
                 rc == -ENOMEM ? "out of memory" : "not an absolute file name (nor empty)");
        return rc;
    }
    return 0;
}

/* The configuration: defaults, the file, the command line; at start and as
 * the reload_read_fn of a SIGHUP reload. */
static int read_config(void *data, struct config *out, char *err, size_t errlen)
{
    struct daemon *d = data;
    char why[512] = "";
    int rc = config_init(out);
    if (rc) {
        snprintf(err, errlen, "out of memory");
        return rc;
    }
    if (d->config_path && (rc = config_load(out, d->config_path, why, sizeof(why))) < 0) {
        snprintf(err, errlen, "%s", why); /* it names the file */
        return rc;
    }
    if ((rc = cli_apply(&d->cli, out, err, errlen)) == -ENOMEM)
        snprintf(err, errlen, "out of memory");
    return rc;
}

/* The CPU backend as n virtual devices, each with its share of the threads,
 * so that layers spread over devices are served (and tested) without GPUs. */
static int open_virtual_devices(const struct config *c, uint32_t n, struct backend **out)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int total = c->cpu_threads > 0 ? c->cpu_threads : (int)(cpus > 0 ? cpus : 1);
    int each = total / (int)n > 0 ? total / (int)n : 1;
    for (uint32_t i = 0; i < n; i++) {
        int rc = backend_cpu_new(each, &out[i]);
        if (rc) {
            while (i > 0)
                backend_free(&out[--i]);
            return rc;
        }
    }
    return 0;
}

/* [daemon] gpus: a CUDA backend per listed device (or every visible one),
 * daemon device i being the i-th. -ENODEV when there is none. The first
 * device must open (batches arrive there); another that fails is reported
 * and kept as unavailable: layers placed on it are refused. */
static int open_gpus(const struct config *c, struct backend **out, int *n)
{
    uint32_t list[MAX_DEVICES];
    int count = 0;
    *n = 0;
    if (c->gpus_all) {
        int have = backend_cuda_count();
        for (int i = 0; i < have && i < MAX_DEVICES; i++)
            list[count++] = (uint32_t)i;
    } else {
        for (size_t i = 0; i < c->n_gpus && i < MAX_DEVICES; i++)
            list[count++] = c->gpus[i];
    }
    if (count == 0)
        return -ENODEV;
    /* Nothing of moed's uses NVLink multicast; keep NCCL off it too (set
     * here, before any thread runs, unless the environment says). */
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    backend_cuda_transport(c->transport);
    for (int i = 0; i < count; i++) {
        int rc = backend_cuda_new((int)list[i], &out[i]);
        if (rc) {
            char why[96];
            snprintf(why, sizeof(why), "CUDA device %u: %s", list[i],
                     rc == -ENODEV ? "no such usable device" : strerror(-rc));
            log_err("%s%s", why, i ? "; its layers will be refused" : "");
            if (i > 0)
                rc = backend_unavailable_new(why, &out[i]);
            if (rc) {
                while (i > 0)
                    backend_free(&out[--i]);
                return rc;
            }
        }
    }
    *n = count;
    return 0;
}

/* The backend of [daemon] backend and device. */
static int open_backend(const struct config *c, struct backend **out)
{
    return backend_open(c->backend, c->device, c->cpu_threads, out);
}

/* The daemon's devices as the configuration and command line ask:
 * --virtual-devices (main() has refused it without the CPU backend),
 * [daemon] gpus, or one backend. -errno when none opens. */
static int open_backends(struct daemon *d)
{
    int rc;
    if (d->cli.vdev > 1) {
        rc = open_virtual_devices(&d->cfg, d->cli.vdev, d->backends);
        d->n_backends = rc < 0 ? 0 : (int)d->cli.vdev;
    } else if (strcmp(d->cfg.backend, "cpu") != 0 && (d->cfg.gpus_all || d->cfg.n_gpus > 0)) {
        rc = open_gpus(&d->cfg, d->backends, &d->n_backends);
        if (rc == -ENODEV && !strcmp(d->cfg.backend, "auto")) {
            log_warn("no usable GPU: gpus is ignored, and the CPU backend serves");
            rc = backend_open("cpu", 0, d->cfg.cpu_threads, &d->backends[0]);
            d->n_backends = rc < 0 ? 0 : 1;
        }
    } else {
        rc = open_backend(&d->cfg, &d->backends[0]);
        d->n_backends = rc < 0 ? 0 : 1;
    }
    d->backend = d->backends[0];
    return rc;
}

static const char *open_error(int rc)
{
    return rc == -ENODEV ? "no usable GPU (or moed was built without CUDA)" : strerror(-rc);
}

/* ---- moed --tune ------------------------------------------------------------ */

/* moed --tune (tune.h) on the daemon's first device: opens no socket.
 * Returns the exit status. */
static int tune_main(struct daemon *d, struct tune_plan *p, bool demo)
{
    const struct config *c = &d->cfg;
    char err[1024] = "";
    int rc;
    if (tune_set_tokens(p, c->max_batch_tokens) < 0) {
        log_err("--tune-tokens %d: above max_batch_tokens (%u); no batch is that large",
                p->tokens[p->n_tokens - 1], c->max_batch_tokens);
        return 2;
    }
    if ((rc = open_backends(d)) < 0) {
        log_err("tuning needs a CUDA device: cannot open the %s backend: %s", c->backend,
                open_error(rc));
        return 1;
    }
    int status = 1;
    if (tune_check(d->backend, c->tile_table, err, sizeof(err)) < 0) {
        log_err("%s", err);
        goto out;
    }
    if (demo) {
        struct tune_shape t = {{8, 2, 256, 512}, MOEK_DTYPE_BF16, "demo layer 'demo'", 0};
        tune_add(p, &t);
    }
    if (tune_add_configured(p, c, stdout, err, sizeof(err)) < 0) {
        log_err("%s", err);
        goto out;
    }
    log_info("tuning on %s; the tile table is %s", d->backend->name, c->tile_table);
    if (tune_run(d->backend, p, c->tile_table, stdout, err, sizeof(err)) < 0) {
        fflush(stdout);
        log_err("%s", err);
        goto out;
    }
    status = 0;
out:
    fflush(stdout);
    for (int i = 0; i < d->n_backends; i++)
        backend_free(&d->backends[i]);
    d->backend = NULL;
    return status;
}

/* --check-config: what the tile table file holds (a malformed one is
 * reported but does not fail the check: the daemon starts with the
 * heuristic). */
static void check_tile_table(const char *path)
{
    struct tile_table t;
    char err[512] = "";
    if (!path[0]) {
        printf("tile table: none (tile_table is empty)\n");
        return;
    }
    tiles_init(&t);
    int rc = tiles_read(&t, path, err, sizeof(err));
    if (rc == -ENOENT)
        printf("tile table %s: not written yet (moed --tune writes it)\n", path);
    else if (rc)
        log_warn("tile table %s; the daemon would use the kernels' heuristic", err);
    else
        printf("tile table %s: %zu entr%s\n", path, t.n, t.n == 1 ? "y" : "ies");
    tiles_done(&t);
}

static void on_signal(void *data, int fd, uint32_t events);

/* Stop once nothing is pending and the last replies have had 100 ms to
 * reach their clients (see server_close_zmq() in main()), or at the
 * deadline. */
static void daemon_check_drained(struct daemon *d)
{
    uint64_t now = now_us();
    if (!d->stopping)
        return;
    if (server_pending(d->server) > 0)
        d->drained_us = 0;
    else if (!d->drained_us)
        d->drained_us = now;
    if ((d->drained_us && now - d->drained_us >= 100000) || now >= d->stop_deadline_us)
        loop_stop(d->loop);
}

static void on_tick(void *data)
{
    struct daemon *d = data;
    if (server_check_devices(d->server))
        return; /* no watchdog ping: main exits non-zero */
    int why;
    uint64_t closed = fdguard_closed(&why);
    if (closed)
        log_warn("closed %llu incoming connection%s: %s", (unsigned long long)closed,
                 closed == 1 ? "" : "s",
                 why == EMFILE ? "out of descriptors" : "the system is out of files");
    notify_tick(d->server);
    daemon_check_drained(d);
}

static void on_signal(void *data, int fd, uint32_t events)
{
    struct daemon *d = data;
    struct signalfd_siginfo si;
    while (read(fd, &si, sizeof(si)) == sizeof(si)) {
        if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
            if (d->stopping) {
                log_notice("second signal: stopping without draining");
                loop_stop(d->loop);
                return;
            }
            log_notice("stopping: draining %u pending requests", server_pending(d->server));
            /* A load under way ends at its next read: its layer would go
             * with the daemon anyway. */
            st_cancel_reads();
            notify_stopping(d->server);
            d->stopping = true;
            d->server->draining = true;
            d->stop_deadline_us = now_us() + 10 * 1000000ull;
            /* Notice the end of the drain within 50 ms, not at the next
             * STATUS tick. */
            if (d->tick)
                loop_timer_set(d->tick, 50000, 50000);
            daemon_check_drained(d);
        } else if (si.ssi_signo == SIGHUP && !d->stopping) {
            log_notice("reloading the configuration%s%s", d->config_path ? " from " : "",
                       d->config_path ? d->config_path : "");
            notify_reload(d->server, d->reload);
        }
    }
}

/* ---- a stop while the configured layers load ------------------------------
 *
 * The configured layers load before the loop runs, so a SIGTERM or SIGINT
 * meanwhile would wait until every layer was in. While the load lasts, a
 * thread takes those two signals instead and cancels the reads
 * (st_cancel_reads): the load ends within a part of ST_READ_PART bytes, and
 * moed exits without serving; a second signal exits at once. SIGHUP waits
 * for the loop. */
struct load_watch {
    pthread_t thread;
    int sigfd, endfd; /* SIGTERM and SIGINT; the load's end */
    atomic_int signo;
};

static void *load_watch_main(void *arg)
{
    struct load_watch *w = arg;
    struct pollfd p[2] = {{.fd = w->sigfd, .events = POLLIN}, {.fd = w->endfd, .events = POLLIN}};
    struct signalfd_siginfo si;
    for (;;) {
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (p[1].revents)
            break;
        if (read(w->sigfd, &si, sizeof(si)) != sizeof(si))
            continue;
        if (atomic_load(&w->signo)) {
            /* The load may be stuck where no read comes (an upload). */
            log_notice("second signal: stopping at once");
            _exit(0);
        }
        atomic_store(&w->signo, (int)si.ssi_signo);
        st_cancel_reads();
        log_notice("stopping: the configured layers' load ends at its next read");
    }
    return NULL;
}

static int load_watch_start(struct load_watch *w)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    *w = (struct load_watch){.sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC),
                             .endfd = eventfd(0, EFD_CLOEXEC)};
    int rc = w->sigfd < 0 || w->endfd < 0 ? -errno : -pthread_create(&w->thread, NULL,
                                                                        load_watch_main, w);
    if (rc) {
        close_fd(&w->sigfd);
        close_fd(&w->endfd);
    }
    return rc;
}

/* The load is over: the signal that came meanwhile, or 0. */
static int load_watch_end(struct load_watch *w)
{
    uint64_t one = 1;
    if (write(w->endfd, &one, sizeof(one)) != sizeof(one))
        log_err("cannot end the load's signal watch: %s", strerror(errno));
    pthread_join(w->thread, NULL);
    close_fd(&w->sigfd);
    close_fd(&w->endfd);
    return atomic_load(&w->signo);
}

static void signals_set(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
}

/* Block the signals before any thread exists (the CPU pool, the workers,
 * ZeroMQ's I/O threads), so each inherits the mask and only the signalfd
 * ever sees them. */
static int block_signals(void)
{
    sigset_t set;
    signals_set(&set);
    signal(SIGPIPE, SIG_IGN);
    return pthread_sigmask(SIG_BLOCK, &set, NULL) == 0 ? 0 : -EINVAL;
}

static int setup_signals(struct daemon *d)
{
    sigset_t set;
    signals_set(&set);
    d->sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (d->sigfd < 0)
        return -errno;
    d->sig_watch = loop_watch(d->loop, d->sigfd, EPOLLIN, on_signal, d);
    return d->sig_watch ? 0 : -errno;
}

/* Each client holds a session socket, a reply socket, a ZeroMQ connection
 * and up to max_regions memfds, so the soft limit on descriptors (often
 * 1024) is raised to the hard one (moed.service sets both). Out of
 * descriptors, new connections wait (sessions) or are closed (fdguard.h).
 * The daemon waits on epoll and poll, never select, so descriptors past
 * 1024 are fine. */
static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur >= rl.rlim_max)
        return;
    rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
        log_debug("open files: up to %llu (was %llu)", (unsigned long long)rl.rlim_cur,
                  (unsigned long long)was);
}

/* What main made for serving, in reverse. */
static void daemon_free(struct daemon *d)
{
    loop_unwatch(d->loop, &d->tick);
    loop_unwatch(d->loop, &d->sig_watch);
    reload_free(&d->reload);
    server_free(&d->server);
    for (int i = 0; i < d->n_backends; i++)
        backend_free(&d->backends[i]);
    d->backend = NULL;
    loop_free(&d->loop);
    close_fd(&d->sigfd);
    config_done(&d->cfg);
}

int main(int argc, char **argv)
{
    enum { OPT_CHECK = 256, OPT_MBT, OPT_MDU, OPT_MST, OPT_RWU, OPT_SPIN, OPT_VDEV, OPT_NOBATCH,
           OPT_DEMO, OPT_GPUS, OPT_TRANSPORT, OPT_IOT, OPT_TILES, OPT_TUNE, OPT_TUNE_TOKENS,
           OPT_TUNE_SHAPE };
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"check-config", no_argument, NULL, OPT_CHECK},
        {"runtime-dir", required_argument, NULL, 'r'},
        {"allow-dir", required_argument, NULL, 'a'},
        {"backend", required_argument, NULL, 'b'},
        {"threads", required_argument, NULL, 't'},
        {"max-batch-tokens", required_argument, NULL, OPT_MBT},
        {"max-delay-us", required_argument, NULL, OPT_MDU},
        {"max-slice-tokens", required_argument, NULL, OPT_MST},
        {"no-batch", no_argument, NULL, OPT_NOBATCH},
        {"return-wait-us", required_argument, NULL, OPT_RWU},
        {"spin-us", required_argument, NULL, OPT_SPIN},
        {"virtual-devices", required_argument, NULL, OPT_VDEV},
        {"gpus", required_argument, NULL, OPT_GPUS},
        {"transport", required_argument, NULL, OPT_TRANSPORT},
        {"io-threads", required_argument, NULL, OPT_IOT},
        {"log-level", required_argument, NULL, 'l'},
        {"demo", no_argument, NULL, OPT_DEMO},
        {"tile-table", required_argument, NULL, OPT_TILES},
        {"tune", no_argument, NULL, OPT_TUNE},
        {"tune-tokens", required_argument, NULL, OPT_TUNE_TOKENS},
        {"tune-shape", required_argument, NULL, OPT_TUNE_SHAPE},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {0},
    };
    struct daemon d = {.sigfd = -1, .cli = {.threads = -1, .log_level = -1, .mdu = UINT32_MAX, .rwu = UINT32_MAX, .spin = UINT32_MAX}};
    struct cli *o = &d.cli;
    static struct tune_plan tune; /* large: not on the stack */
    bool tuning = false;
    char err[512] = "";
    bool check_only = false, demo = false;
    int c, rc;

    log_init(LOG_LEVEL_INFO);
    if (block_signals() < 0) {
        log_err("cannot block signals");
        return 1;
    }
    while ((c = getopt_long(argc, argv, "c:r:a:b:t:l:hV", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            if (!optarg[0]) { /* else "cannot open : No such file or directory" */
                log_err("--config needs a file name");
                return 2;
            }
            d.config_path = optarg;
            break;
        case OPT_CHECK: check_only = true; break;
        case 'r': o->runtime_dir = optarg; break;
        case 'a':
            if (o->n_allow == (int)ARRAY_SIZE(o->allow)) {
                log_err("too many --allow-dir options");
                return 2;
            }
            o->allow[o->n_allow++] = optarg;
            break;
        case 'b': o->backend = optarg; break;
        case 't': {
            uint32_t n;
            if (parse_u32_arg(optarg, &n) < 0 || n > CONFIG_MAX_THREADS) {
                log_err("--threads needs a number from 0 to %d", CONFIG_MAX_THREADS);
                return 2;
            }
            o->threads = (int)n;
            break;
        }
        case OPT_MBT:
            if (parse_u32_arg(optarg, &o->mbt) < 0 || o->mbt == 0 ||
                o->mbt > CONFIG_MAX_BATCH_TOKENS) {
                log_err("--max-batch-tokens needs a number from 1 to %u", CONFIG_MAX_BATCH_TOKENS);
                return 2;
            }
            break;
        case OPT_MDU:
            if (parse_u32_arg(optarg, &o->mdu) < 0 || o->mdu > CONFIG_MAX_DELAY_US) {
                log_err("--max-delay-us needs a number of microseconds up to %u",
                        CONFIG_MAX_DELAY_US);
                return 2;
            }
            break;
        case OPT_MST:
            if (parse_u32_arg(optarg, &o->mst) < 0 || o->mst == 0 ||
                o->mst > CONFIG_MAX_SLICE_TOKENS) {
                log_err("--max-slice-tokens needs a number from 1 to %u", CONFIG_MAX_SLICE_TOKENS);
                return 2;
            }
            break;
        case OPT_NOBATCH: o->no_batch = true; break;
        case OPT_GPUS: o->gpus = optarg; break;
        case OPT_TRANSPORT: o->transport = optarg; break;
        case OPT_IOT: o->io_threads = optarg; break;
        case OPT_VDEV:
            if (parse_u32_arg(optarg, &o->vdev) < 0 || o->vdev < 1 || o->vdev > MAX_DEVICES) {
                log_err("--virtual-devices needs a number from 1 to %d", MAX_DEVICES);
                return 2;
            }
            break;
        case OPT_SPIN:
            if (parse_u32_arg(optarg, &o->spin) < 0 || o->spin > 100000) {
                log_err("--spin-us needs a number of microseconds up to 100000");
                return 2;
            }
            break;
        case OPT_RWU:
            if (parse_u32_arg(optarg, &o->rwu) < 0 || o->rwu > 1000000) {
                log_err("--return-wait-us needs a number of microseconds up to 1000000");
                return 2;
            }
            break;
        case 'l':
            if ((o->log_level = log_level_parse(optarg)) < 0) {
                log_err("unknown log level '%s'", optarg);
                return 2;
            }
            break;
        case OPT_DEMO: demo = true; break;
        case OPT_TILES: o->tile_table = optarg; break;
        case OPT_TUNE: tuning = true; break;
        case OPT_TUNE_TOKENS:
            if (tune_parse_tokens(optarg, &tune) < 0) {
                log_err("--tune-tokens %s: want up to %d token counts from 1, separated by "
                        "commas", optarg, BACKEND_TUNE_MAX);
                return 2;
            }
            break;
        case OPT_TUNE_SHAPE: {
            struct tune_shape t;
            if (tune_parse_shape(optarg, &t) < 0) {
                log_err("--tune-shape %s: want E,k,H,I[,dtype]: experts (up to 4096), top-k "
                        "(up to E), hidden, intermediate, and bf16 (the default) or fp16",
                        optarg);
                return 2;
            }
            if (tune_add(&tune, &t) < 0) {
                log_err("too many --tune-shape options");
                return 2;
            }
            break;
        }
        case 'h': usage(stdout); return 0;
        case 'V': printf("moed %s\n", MOE_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc) {
        log_err("unexpected argument '%s'", argv[optind]);
        return 2;
    }
    if (!tuning && (tune.n_tokens || tune.n_shapes)) {
        log_err("--tune-tokens and --tune-shape go with --tune");
        return 2;
    }
    if (tuning && check_only) {
        log_err("--tune and --check-config exclude each other");
        return 2;
    }
    if ((rc = read_config(&d, &d.cfg, err, sizeof(err))) < 0) {
        log_err("%s", err);
        config_done(&d.cfg);
        return 1;
    }
    log_set_level((enum log_level)d.cfg.log_level);
    /* Before --check-config answers: it would fail the start. */
    if (d.cli.vdev > 1 && strcmp(d.cfg.backend, "cpu") != 0) {
        log_err("--virtual-devices needs --backend cpu");
        config_done(&d.cfg);
        return 2;
    }
    /* The CPU backend owns no GPU: a gpus list (say, in a configuration
     * file that --backend cpu overrides) is said to be ignored. */
    if (!strcmp(d.cfg.backend, "cpu") && (d.cfg.gpus_all || d.cfg.n_gpus > 0))
        log_warn("gpus is ignored: the CPU backend owns no GPU");
    if (check_only) {
        unsigned n = 0;
        for (struct layer_conf *lc = d.cfg.layers; lc; lc = lc->next)
            n++;
        rc = reload_check_layers(&d.cfg, err, sizeof(err));
        if (rc < 0) {
            log_err("%s: %s", d.config_path ? d.config_path : "(no file)", err);
        } else {
            printf("%s: configuration OK: %zu allowed directories, %u layers\n",
                   d.config_path ? d.config_path : "(no file)", d.cfg.n_allowed_dirs, n);
            check_tile_table(d.cfg.tile_table);
        }
        config_done(&d.cfg);
        return rc < 0 ? 1 : 0;
    }
    if (tuning) {
        rc = tune_main(&d, &tune, demo);
        config_done(&d.cfg);
        return rc;
    }

    raise_nofile();
    if ((rc = open_backends(&d)) < 0) {
        log_err("cannot open the %s backend: %s", d.cfg.backend, open_error(rc));
        return 1;
    }
    for (int i = 0; i < d.n_backends; i++) {
        struct backend_device dev;
        if (d.backends[i]->ops->devices(d.backends[i], &dev, 1) == 1)
            log_info("backend %s, device %d: %s", d.backends[i]->name, i, dev.name);
    }
    if ((rc = loop_new(&d.loop)) < 0 || (rc = setup_signals(&d)) < 0 ||
        (rc = server_new(&d.cfg, d.backends, d.n_backends, d.loop, &d.server)) < 0 ||
        (rc = reload_new(d.server, read_config, &d, &d.reload)) < 0) {
        log_err("cannot start: %s", strerror(-rc));
        return 1;
    }
    /* Before any layer is made: MoE layers take their token tiles from it.
     * A table that cannot be used is no reason not to serve. */
    reload_tiles(d.reload);
    int fd_session = -1, fd_zmq = -1;
    if (notify_listen_fds(d.cfg.runtime_dir, &fd_session, &fd_zmq, err, sizeof(err)) < 0) {
        log_err("socket activation: %s", err);
        return 1;
    }
    /* Made here if missing; whoever can write it could pose as moed. */
    if (mkdir(d.cfg.runtime_dir, 0750) < 0 && errno != EEXIST) {
        log_err("cannot make the runtime directory %s: %s", d.cfg.runtime_dir, strerror(errno));
        return 1;
    }
    if (rundir_check(d.cfg.runtime_dir, err, sizeof(err)) < 0) {
        log_err("%s", err);
        return 1;
    }
    if ((rc = server_listen(d.server, fd_session, fd_zmq)) < 0) {
        log_err("cannot listen in %s: %s%s", d.cfg.runtime_dir, strerror(-rc),
                rc == -EADDRINUSE ? " (another moed serves this runtime directory)" : "");
        return 1;
    }
    if (demo) {
        char *dir = d.cli.demo_dir, path[PATH_MAX];
        snprintf(dir, sizeof(d.cli.demo_dir), "%s/demo", d.cfg.runtime_dir);
        /* Allowed as the command line's directories are: again at every
         * reload. */
        if ((rc = demo_write(dir, path, sizeof(path))) < 0 ||
            (rc = config_add_allowed_dir(&d.cfg, dir)) < 0) {
            log_err("cannot write the demo layer in %s: %s", dir,
                    rc == -EINVAL ? "demo.safetensors there is not a regular file" : strerror(-rc));
            return 1;
        }
        struct layer_conf gemm = {.name = "demo-gemm", .kind = MOE__LAYER_KIND__LAYER_GEMM,
                                  .path = path, .prefix = "demo_gemm.weight"};
        struct layer_conf moe = {.name = "demo", .kind = MOE__LAYER_KIND__LAYER_MOE, .topk = 2,
                                 .routing = MOE__ROUTING__ROUTING_SOFTMAX, .renormalize = true,
                                 .path = path, .prefix = "model.layers.0.block_sparse_moe.",
                                 .next = &gemm};
        for (struct layer_conf *lc = &moe; lc; lc = lc->next)
            if ((rc = layer_load_conf(d.server, lc, false, err, sizeof(err))) < 0) {
                log_err("cannot load demo layer '%s': %s", lc->name, err);
                return 1;
            }
        log_info("demo layers 'demo' (E=8 k=2 H=256 I=512 bf16) and 'demo-gemm' "
                 "(B [8, 512, 256] bf16) from %s", path);
    }
    struct load_watch lw;
    int watch = load_watch_start(&lw);
    if (watch < 0)
        log_warn("cannot watch for a stop during the load (%s): a stop waits for its end",
                 strerror(-watch));
    rc = reload_load_initial(d.reload, err, sizeof(err));
    int sig = watch < 0 ? 0 : load_watch_end(&lw);
    if (sig) {
        if (rc < 0 && rc != -ECANCELED)
            log_err("cannot load %s", err);
        log_notice("stopped before serving: %s came while the configured layers loaded",
                   sig == SIGTERM ? "SIGTERM" : "SIGINT");
        daemon_free(&d);
        return 0;
    }
    if (rc < 0) {
        log_err("cannot load %s", err);
        return 1;
    }
    d.tick = loop_timer(d.loop, notify_tick_interval_us(), on_tick, &d);
    if (!d.tick) {
        log_err("cannot create a timer: %s", strerror(errno));
        return 1;
    }
    log_info("moed %s serving on %s (session socket %s/moed.sock)", MOE_VERSION,
             d.server->endpoint, d.cfg.runtime_dir);
    notify_ready(d.server);

    rc = loop_run(d.loop);
    if (rc < 0)
        log_err("event loop failed: %s", strerror(-rc));
    bool fatal = d.server->fatal;
    if (fatal) {
        int dev = d.server->failed_device;
        log_err("device %d (%s) failed and cannot continue; exiting so the service restarts",
                dev, d.server->backends[dev]->name);
        /* Pending replies cannot be computed; clients see their sessions close. */
        _exit(3);
    }
    /* After the drain: write the last replies out before server_free()
     * closes the sessions, since a client takes a closed session socket for
     * a daemon that went away and gives up on what it still waits for.
     * The request socket runs with ZMQ_LINGER 0; closed with a linger, its
     * context's termination returns once ZeroMQ has written everything (at
     * most 1 s). */
    server_close_zmq(d.server, 1000);
    log_info("stopped");
    daemon_free(&d);
    return rc < 0 ? 1 : 0;
}
