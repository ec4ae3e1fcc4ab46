/*
 * main.c: moed's entry point: arguments and configuration, the backend, the
 * endpoints, signals and systemd notifications, then the loop. The only place
 * where an error becomes a log line and an exit code.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/demo.h"
#include "daemon/log.h"
#include "daemon/loop.h"
#include "daemon/notify.h"
#include "daemon/server.h"
#include "daemon/util.h"
#include "moe.pb-c.h"

struct daemon {
    struct config cfg;
    char *config_path;
    struct loop *loop;
    struct server *server;
    struct backend *backend;
    struct loop_watch *sig_watch;
    struct loop_watch *tick;
    int sigfd;
    bool stopping;
    uint64_t stop_deadline_us;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moed [options]\n"
            "Serve fused-MoE and grouped-GEMM requests to local processes.\n\n"
            "  -c, --config FILE        read configuration from FILE (INI)\n"
            "      --check-config       validate the configuration and exit\n"
            "  -r, --runtime-dir DIR    sockets live here (default: $MOED_RUNTIME_DIR,\n"
            "                           /run/moed as root, else $XDG_RUNTIME_DIR/moed)\n"
            "  -a, --allow-dir DIR      weight files may be loaded from DIR (repeatable)\n"
            "  -b, --backend NAME       auto (default), cpu or cuda\n"
            "  -t, --threads N          CPU backend threads (0: one per CPU)\n"
            "      --max-batch-tokens N tokens in one batched launch (default 4096)\n"
            "      --max-delay-us N     wait up to N us for more requests (default 0)\n"
            "      --max-slice-tokens N rows one request adds to a batch (default 1024)\n"
            "      --no-batch           run every request alone (to measure what batching gains)\n"
            "  -l, --log-level LEVEL    err, warning, notice, info (default), debug\n"
            "      --demo               generate and serve the demo layers 'demo' and 'demo-gemm'\n"
            "  -h, --help               this text\n"
            "  -V, --version            print the version\n");
}

static int parse_u32_arg(const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || !*s || *end || v > UINT32_MAX)
        return -EINVAL;
    *out = (uint32_t)v;
    return 0;
}

static void on_signal(void *data, int fd, uint32_t events);

static void daemon_check_drained(struct daemon *d)
{
    if (!d->stopping)
        return;
    if (server_pending(d->server) == 0 || now_us() >= d->stop_deadline_us)
        loop_stop(d->loop);
}

static void on_tick(void *data)
{
    struct daemon *d = data;
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
            notify_stopping();
            d->stopping = true;
            d->server->draining = true;
            d->stop_deadline_us = now_us() + 10 * 1000000ull;
            daemon_check_drained(d);
        } else if (si.ssi_signo == SIGHUP) {
            notify_reload(d->server, d->config_path);
        }
    }
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

int main(int argc, char **argv)
{
    enum { OPT_CHECK = 256, OPT_MBT, OPT_MDU, OPT_MST, OPT_NOBATCH, OPT_DEMO };
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
        {"log-level", required_argument, NULL, 'l'},
        {"demo", no_argument, NULL, OPT_DEMO},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {0},
    };
    struct daemon d = {.sigfd = -1};
    char err[512] = "";
    bool check_only = false, demo = false;
    const char *runtime_dir = NULL, *backend = NULL, *log_level = NULL;
    const char *allow[64];
    int n_allow = 0, threads = -1;
    uint32_t mbt = 0, mdu = UINT32_MAX, mst = 0;
    bool no_batch = false;
    int c, rc;

    log_init(LOG_LEVEL_INFO);
    if (block_signals() < 0) {
        log_err("cannot block signals");
        return 1;
    }
    if (config_init(&d.cfg) < 0) {
        log_err("out of memory");
        return 1;
    }
    while ((c = getopt_long(argc, argv, "c:r:a:b:t:l:hV", opts, NULL)) != -1) {
        switch (c) {
        case 'c': d.config_path = optarg; break;
        case OPT_CHECK: check_only = true; break;
        case 'r': runtime_dir = optarg; break;
        case 'a':
            if (n_allow == (int)ARRAY_SIZE(allow)) {
                log_err("too many --allow-dir options");
                return 2;
            }
            allow[n_allow++] = optarg;
            break;
        case 'b': backend = optarg; break;
        case 't': threads = atoi(optarg); break;
        case OPT_MBT:
            if (parse_u32_arg(optarg, &mbt) < 0 || mbt == 0) {
                log_err("--max-batch-tokens needs a positive number");
                return 2;
            }
            break;
        case OPT_MDU:
            if (parse_u32_arg(optarg, &mdu) < 0) {
                log_err("--max-delay-us needs a number");
                return 2;
            }
            break;
        case OPT_MST:
            if (parse_u32_arg(optarg, &mst) < 0 || mst == 0) {
                log_err("--max-slice-tokens needs a positive number");
                return 2;
            }
            break;
        case OPT_NOBATCH: no_batch = true; break;
        case 'l': log_level = optarg; break;
        case OPT_DEMO: demo = true; break;
        case 'h': usage(stdout); return 0;
        case 'V': printf("moed %s\n", MOE_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc) {
        log_err("unexpected argument '%s'", argv[optind]);
        return 2;
    }
    if (d.config_path && (rc = config_load(&d.cfg, d.config_path, err, sizeof(err))) < 0) {
        log_err("%s: %s", d.config_path, err);
        return 1;
    }
    /* The command line overrides the file. */
    if (runtime_dir) {
        free(d.cfg.runtime_dir);
        d.cfg.runtime_dir = strdup(runtime_dir);
    }
    for (int i = 0; i < n_allow; i++)
        if ((rc = config_add_allowed_dir(&d.cfg, allow[i])) < 0) {
            log_err("--allow-dir %s: %s", allow[i], strerror(-rc));
            return 1;
        }
    if (backend) {
        free(d.cfg.backend);
        d.cfg.backend = strdup(backend);
    }
    if (threads >= 0)
        d.cfg.cpu_threads = threads;
    if (mbt)
        d.cfg.max_batch_tokens = mbt;
    if (mdu != UINT32_MAX)
        d.cfg.max_delay_us = mdu;
    if (mst)
        d.cfg.max_slice_tokens = mst;
    if (no_batch)
        d.cfg.batching = false;
    if (log_level) {
        int lv = log_level_parse(log_level);
        if (lv < 0) {
            log_err("unknown log level '%s'", log_level);
            return 2;
        }
        d.cfg.log_level = lv;
    }
    log_set_level((enum log_level)d.cfg.log_level);
    if (check_only) {
        printf("configuration OK: %zu allowed directories, %s layers\n", d.cfg.n_allowed_dirs,
               d.cfg.layers ? "configured" : "no");
        config_done(&d.cfg);
        return 0;
    }

    if ((rc = backend_open(d.cfg.backend, d.cfg.cpu_threads, &d.backend)) < 0) {
        log_err("cannot open the %s backend: %s", d.cfg.backend,
                rc == -ENODEV ? "no usable GPU (or moed was built without CUDA)" : strerror(-rc));
        return 1;
    }
    struct backend_device dev;
    if (d.backend->ops->devices(d.backend, &dev, 1) == 1)
        log_info("backend %s: %s", d.backend->name, dev.name);

    if ((rc = loop_new(&d.loop)) < 0 || (rc = setup_signals(&d)) < 0 ||
        (rc = server_new(&d.cfg, d.backend, d.loop, &d.server)) < 0) {
        log_err("cannot start: %s", strerror(-rc));
        return 1;
    }
    int fd_session = -1, fd_zmq = -1;
    notify_listen_fds(&fd_session, &fd_zmq);
    if ((rc = server_listen(d.server, fd_session, fd_zmq)) < 0) {
        log_err("cannot listen in %s: %s%s", d.cfg.runtime_dir, strerror(-rc),
                rc == -EADDRINUSE ? " (another moed serves this runtime directory)" : "");
        return 1;
    }
    if (demo) {
        char dir[PATH_MAX], path[PATH_MAX];
        snprintf(dir, sizeof(dir), "%s/demo", d.cfg.runtime_dir);
        if ((rc = demo_write(dir, path, sizeof(path))) < 0 ||
            (rc = config_add_allowed_dir(&d.cfg, dir)) < 0) {
            log_err("cannot write the demo layer in %s: %s", dir, strerror(-rc));
            return 1;
        }
        struct layer_conf gemm = {.name = "demo-gemm", .kind = MOE__LAYER_KIND__LAYER_GEMM,
                                  .path = path, .prefix = "demo_gemm.weight"};
        struct layer_conf moe = {.name = "demo", .kind = MOE__LAYER_KIND__LAYER_MOE, .topk = 2,
                                 .routing = MOE__ROUTING__ROUTING_SOFTMAX, .renormalize = true,
                                 .path = path, .prefix = "model.layers.0.block_sparse_moe.",
                                 .next = &gemm};
        for (struct layer_conf *lc = &moe; lc; lc = lc->next)
            if ((rc = layer_load_conf(d.server, lc, err, sizeof(err))) < 0) {
                log_err("cannot load demo layer '%s': %s", lc->name, err);
                return 1;
            }
        log_info("demo layers 'demo' (E=8 k=2 H=256 I=512 bf16) and 'demo-gemm' "
                 "(B [8, 512, 256] bf16) from %s", path);
    }
    for (struct layer_conf *lc = d.cfg.layers; lc; lc = lc->next) {
        notify_extend_timeout(120 * 1000000ull);
        if ((rc = layer_load_conf(d.server, lc, err, sizeof(err))) < 0) {
            log_err("cannot load layer '%s': %s", lc->name, err);
            return 1;
        }
        log_info("layer '%s' loaded from %s", lc->name, lc->path);
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
        log_err("the %s backend failed and cannot continue; exiting so the service restarts",
                d.backend->name);
        /* Pending replies cannot be computed; clients see their sessions close. */
        _exit(3);
    }
    log_info("stopped");
    loop_unwatch(d.loop, &d.tick);
    loop_unwatch(d.loop, &d.sig_watch);
    server_free(&d.server);
    backend_free(&d.backend);
    loop_free(&d.loop);
    close_fd(&d.sigfd);
    config_done(&d.cfg);
    return rc < 0 ? 1 : 0;
}
