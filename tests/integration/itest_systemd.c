/*
 * itest_systemd.c: moed as a systemd service, tested without a running
 * systemd.
 *
 *   - sd_notify: the daemon runs with NOTIFY_SOCKET pointing at a datagram
 *     socket bound here (kernel receive timestamps, SO_TIMESTAMPNS, give each
 *     message's arrival time however late it is read). Checked: the order
 *     EXTEND_TIMEOUT_USEC, READY=1, WATCHDOG=1/STATUS=, RELOADING=1, READY=1,
 *     STOPPING=1; the watchdog interval; that pings stop while one batch runs
 *     longer than the watchdog interval; the drain of requests in flight.
 *   - SIGHUP reload: layers loaded, unloaded and reloaded as the file now
 *     says, on the devices it names; a client's layer never touched.
 *   - socket activation through systemd-socket-activate (two chained, since
 *     one passes sockets of one type only).
 *   - the units (systemd-analyze verify and security --offline), sysusers and
 *     tmpfiles (applied to a scratch --root), make install DESTDIR= and
 *     uninstall, the .deb (built, listed, installed, removed and purged;
 *     root only), --check-config, journald priority prefixes.
 *   - the unit's sandbox directives, emulated one by one and together by
 *     packaging/hardening/check.sh (root only).
 *
 * make is run from here for the install and deb checks with the same BUILD
 * (and NVCC= when that build has no CUDA objects), so nothing is rebuilt.
 */
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "daemon/safetensors.h"
#include "tests/integration/itest.h"

/* ---- helpers ----------------------------------------------------------------- */

static uint64_t realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Run a shell command; stdout and stderr into out. The exit status, or -1. */
static int sh(char *out, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sh(char *out, size_t len, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(cmd, sizeof(cmd) - 8, fmt, ap);
    va_end(ap);
    CHECK(n > 0 && n < (int)sizeof(cmd) - 8);
    strcat(cmd, " 2>&1");
    fflush(stdout);
    fflush(stderr);
    FILE *p = popen(cmd, "r");
    CHECK(p != NULL);
    size_t got = 0;
    char sink[4096];
    for (;;) {
        char *dst = out && got + 1 < len ? out + got : sink;
        size_t room = out && got + 1 < len ? len - got - 1 : sizeof(sink);
        size_t r = fread(dst, 1, room, p);
        if (r == 0)
            break;
        if (dst != sink)
            got += r;
    }
    if (out && len)
        out[got] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_file(const char *path, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void write_file(const char *path, const char *fmt, ...)
{
    FILE *f = fopen(path, "w");
    CHECK_MSG(f != NULL, "%s: %s", path, strerror(errno));
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    CHECK(fclose(f) == 0);
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return strdup("");
    char *buf = malloc(1 << 20);
    CHECK(buf != NULL);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void dump_log(const char *path)
{
    char *s = read_file(path);
    fprintf(stderr, "---- %s\n%s----\n", path, s);
    free(s);
}

static bool exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

static const char *find_tool(const char *name)
{
    static char buf[4][256];
    static int next;
    const char *dirs[] = {"/usr/bin", "/bin", "/usr/sbin", "/sbin", "/lib/systemd", "/usr/lib/systemd"};
    for (size_t i = 0; i < ARRAY_LEN(dirs); i++) {
        char *b = buf[next];
        snprintf(b, sizeof(buf[0]), "%s/%s", dirs[i], name);
        if (access(b, X_OK) == 0) {
            next = (next + 1) % 4;
            return b;
        }
    }
    return NULL;
}

/* make, as the outer `make test` ran it: the same build tree, no CUDA when
 * that tree has none, without the outer make's jobserver. */
static void make_prefix(char *buf, size_t len)
{
    char cuda[300];
    const char *b = itest_build();
    snprintf(cuda, sizeof(cuda), "%s/obj/kernels/cuda", b);
    size_t bl = strlen(b);
    bool san = bl >= 9 && !strcmp(b + bl - 9, "build-san");
    snprintf(buf, len, "env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s --no-print-directory "
             "BUILD=%s%s%s", b, exists(cuda) ? "" : " NVCC=", san ? " SAN=1" : "");
}

static void moed_bin(char *buf, size_t len)
{
    char rel[300];
    snprintf(rel, sizeof(rel), "%s/moed", itest_build());
    CHECK_MSG(realpath(rel, buf) != NULL && strlen(buf) < len, "%s: %s", rel, strerror(errno));
}

/* ---- the NOTIFY_SOCKET listener ------------------------------------------------ */

struct nmsg {
    uint64_t t_us; /* arrival, CLOCK_REALTIME, from the kernel */
    char text[512];
};

/* Read by a thread of its own, as systemd reads at once: a receiver that
 * lags fills the socket's queue (net.unix.max_dgram_qlen) and the daemon
 * then drops WATCHDOG=1. n is published after its message is written. */
struct nlisten {
    int fd;
    char dir[40];
    char path[64];
    pthread_t thread;
    int n;
    struct nmsg msgs[4096];
};

static void *nl_main(void *arg)
{
    struct nlisten *nl = arg;
    for (;;) {
        int n = __atomic_load_n(&nl->n, __ATOMIC_ACQUIRE);
        struct nmsg *m = &nl->msgs[n];
        char ctl[CMSG_SPACE(sizeof(struct timespec))];
        struct iovec iov = {m->text, sizeof(m->text) - 1};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                            .msg_controllen = sizeof(ctl)};
        ssize_t r = recvmsg(nl->fd, &mh, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return NULL; /* shut down */
        }
        if (n + 1 >= (int)ARRAY_LEN(nl->msgs))
            continue; /* full: keep draining, record no more */
        m->text[r] = '\0';
        m->t_us = realtime_us();
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                struct timespec ts;
                memcpy(&ts, CMSG_DATA(c), sizeof(ts));
                m->t_us = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
            }
        __atomic_store_n(&nl->n, n + 1, __ATOMIC_RELEASE);
    }
}

static struct nlisten *nl_open(void)
{
    struct nlisten *nl = calloc(1, sizeof(*nl));
    CHECK(nl != NULL);
    snprintf(nl->dir, sizeof(nl->dir), "/tmp/moed-notify.XXXXXX");
    CHECK(mkdtemp(nl->dir) != NULL);
    snprintf(nl->path, sizeof(nl->path), "%s/notify", nl->dir);
    nl->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    CHECK(nl->fd >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", nl->path);
    CHECK(bind(nl->fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    int on = 1;
    CHECK(setsockopt(nl->fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof(on)) == 0);
    CHECK(pthread_create(&nl->thread, NULL, nl_main, nl) == 0);
    return nl;
}

static void nl_close(struct nlisten *nl)
{
    shutdown(nl->fd, SHUT_RDWR);
    pthread_cancel(nl->thread);
    pthread_join(nl->thread, NULL);
    close(nl->fd);
    itest_rmdir(nl->dir);
    free(nl);
}

/* Let ms pass while the thread reads. */
static void nl_pump(struct nlisten *nl, int ms)
{
    (void)nl;
    if (ms > 0)
        itest_sleep_ms(ms);
}

/* True when text has a line that starts with line (a whole line when line
 * ends in "=1"). */
static bool has_line(const char *text, const char *line)
{
    size_t n = strlen(line);
    bool whole = n >= 2 && !strcmp(line + n - 2, "=1");
    for (const char *p = text; p && *p;) {
        if (!strncmp(p, line, n) && (!whole || p[n] == '\n' || p[n] == '\0'))
            return true;
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return false;
}

static int nl_count(struct nlisten *nl)
{
    return __atomic_load_n(&nl->n, __ATOMIC_ACQUIRE);
}

static int nl_find(struct nlisten *nl, int from, const char *line)
{
    int n = nl_count(nl);
    for (int i = from; i < n; i++)
        if (has_line(nl->msgs[i].text, line))
            return i;
    return -1;
}

static int nl_wait(struct nlisten *nl, int from, const char *line, int timeout_ms)
{
    uint64_t end = now_ms() + (uint64_t)timeout_ms;
    int i;
    while ((i = nl_find(nl, from, line)) < 0 && now_ms() < end)
        nl_pump(nl, 20);
    return i;
}

static void nl_print(struct nlisten *nl, int from)
{
    int n = nl_count(nl);
    for (int i = from; i < n; i++)
        fprintf(stderr, "  notify %d +%llu ms: %s\n", i,
                (unsigned long long)((nl->msgs[i].t_us - nl->msgs[0].t_us) / 1000),
                nl->msgs[i].text);
}

/* ---- the daemon under a pretend systemd ------------------------------------- */

/* Start moed with NOTIFY_SOCKET (and WATCHDOG_USEC, WATCHDOG_PID when
 * watchdog_usec is set) and extra arguments (NULL-terminated); does not wait. */
static void sd_start(struct itest_daemon *d, struct nlisten *nl, const char *watchdog_usec, ...)
{
    const char *argv[64];
    int argc = 0;
    char bin[PATH_MAX];
    moed_bin(bin, sizeof(bin));
    snprintf(d->dir, sizeof(d->dir), "/tmp/moed-itest.XXXXXX");
    CHECK(mkdtemp(d->dir) != NULL);
    snprintf(d->log, sizeof(d->log), "%s/moed.log", d->dir);
    argv[argc++] = bin;
    argv[argc++] = "--runtime-dir";
    argv[argc++] = d->dir;
    argv[argc++] = "--backend";
    argv[argc++] = "cpu";
    va_list ap;
    va_start(ap, watchdog_usec);
    const char *a;
    while ((a = va_arg(ap, const char *)) != NULL && argc < 62)
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    fflush(stdout);
    fflush(stderr);
    d->pid = fork();
    CHECK(d->pid >= 0);
    if (d->pid == 0) {
        int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        /* A failed test must not leave its daemon running. */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        char pid[32];
        snprintf(pid, sizeof(pid), "%d", (int)getpid());
        setenv("NOTIFY_SOCKET", nl->path, 1);
        /* sd_watchdog_enabled() checks WATCHDOG_PID against getpid(). */
        if (watchdog_usec) {
            setenv("WATCHDOG_USEC", watchdog_usec, 1);
            setenv("WATCHDOG_PID", pid, 1);
        } else {
            unsetenv("WATCHDOG_USEC");
            unsetenv("WATCHDOG_PID");
        }
        unsetenv("LISTEN_FDS");
        unsetenv("LISTEN_PID");
        unsetenv("LISTEN_FDNAMES");
        unsetenv("JOURNAL_STREAM");
        execv(bin, (char *const *)argv);
        _exit(127);
    }
}

static int sd_wait_ready(struct itest_daemon *d, struct nlisten *nl, int from)
{
    int r = nl_wait(nl, from, "READY=1", 20000);
    if (r < 0) {
        nl_print(nl, 0);
        dump_log(d->log);
        FAIL_AT("no READY=1 within 20 s (daemon %s)", itest_daemon_alive(d) ? "running" : "exited");
    }
    return r;
}

static int wait_exit(pid_t pid, int timeout_ms)
{
    int st = 0;
    for (int i = 0; i < timeout_ms / 10; i++) {
        if (waitpid(pid, &st, WNOHANG) == pid)
            return st;
        itest_sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    FAIL_AT("process %d did not exit within %d ms", (int)pid, timeout_ms);
}

static struct itest_layer layer_def(const char *name, int E, int k, int H, int I)
{
    struct itest_layer L = {.dt = MOE_DTYPE_BF16, .sh = {E, k, H, I},
                            .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
    snprintf(L.name, sizeof(L.name), "%s", name);
    return L;
}

/* A safetensors file dir/file with a Mixtral-named layer under prefix; L
 * keeps the weights for the reference. */
static void layer_file(struct itest_layer *L, const char *path, const char *prefix, uint64_t *seed)
{
    size_t E = (size_t)L->sh.experts, H = (size_t)L->sh.hidden, I = (size_t)L->sh.intermediate;
    size_t per = H * I;
    L->w1 = malloc(E * per * 2);
    L->w3 = malloc(E * per * 2);
    L->w2 = malloc(E * per * 2);
    CHECK(L->w1 && L->w3 && L->w2);
    itest_fill(seed, MOE_DTYPE_BF16, L->w1, E * per, 0.3f);
    itest_fill(seed, MOE_DTYPE_BF16, L->w3, E * per, 0.3f);
    itest_fill(seed, MOE_DTYPE_BF16, L->w2, E * per, 0.25f);
    struct st_out *t = calloc(3 * E, sizeof(*t));
    char(*names)[128] = calloc(3 * E, sizeof(*names));
    const char *part[3] = {"w1", "w3", "w2"};
    void *src[3] = {L->w1, L->w3, L->w2};
    CHECK(t && names);
    for (size_t e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            size_t i = e * 3 + (size_t)p;
            snprintf(names[i], sizeof(names[i]), "%sexperts.%zu.%s.weight", prefix, e, part[p]);
            t[i] = (struct st_out){.name = names[i], .dtype = ST_BF16, .ndim = 2,
                                   .shape = {p < 2 ? I : H, p < 2 ? H : I},
                                   .data = (uint8_t *)src[p] + e * per * 2};
        }
    CHECK(st_write(path, t, 3 * E) == 0);
    free(t);
    free(names);
}

static void forward_and_check(moe_client *c, struct itest_layer *L, size_t T, uint64_t *seed)
{
    struct itest_fwd f;
    itest_fwd_make(c, L, T, seed, &f);
    CHECK_MSG(moe_forward(c, &f.args, NULL) == 0, "forward %s: %s", L->name, moe_errmsg());
    double err = itest_fwd_error(L, &f);
    CHECK_MSG(err <= itest_tolerance(L->dt), "%s: relative error %.3e", L->name, err);
    moe_region_free(c, &f.r);
}

static const moe_layer_info *info_of(const moe_layer_info *infos, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(infos[i].name, name))
            return &infos[i];
    return NULL;
}

/* ---- sd_notify ------------------------------------------------------------ */

/*
 * The whole life of a service: configured layers load (EXTEND_TIMEOUT_USEC)
 * before READY=1, pings at half of WATCHDOG_USEC with STATUS= refreshed,
 * a reload that makes the layers what the file now says (RELOADING=1 ...
 * READY=1), and SIGTERM with requests in flight (STOPPING=1, every request
 * answered, exit 0). The reload covers each case: alpha's section changes,
 * beta's goes, delta's is new (in a newly allowed directory), eps's file is
 * replaced, zeta's stays as it was, and gamma's names a client's layer.
 */
TEST(notify_ready_watchdog_reload_stopping_in_order)
{
    uint64_t seed = test_seed();
    struct nlisten *nl = nl_open();
    char wdir[] = "/tmp/moed-sdw.XXXXXX", xdir[64], conf[128], fa[128], fb[128], fc[128], fe[128];
    CHECK(mkdtemp(wdir) != NULL);
    snprintf(xdir, sizeof(xdir), "%s/extra", wdir);
    CHECK(mkdir(xdir, 0755) == 0);
    snprintf(conf, sizeof(conf), "%s/moed.conf", wdir);
    snprintf(fa, sizeof(fa), "%s/a.safetensors", wdir);
    snprintf(fb, sizeof(fb), "%s/b.safetensors", wdir);
    snprintf(fc, sizeof(fc), "%s/c.safetensors", xdir);
    snprintf(fe, sizeof(fe), "%s/e.safetensors", wdir);
    struct itest_layer A = layer_def("alpha", 4, 2, 32, 48), B = layer_def("beta", 4, 2, 32, 64),
                       C = layer_def("delta", 4, 2, 32, 40), E = layer_def("eps", 4, 2, 32, 48),
                       Z = layer_def("zeta", 4, 2, 32, 48);
    layer_file(&A, fa, "model.layers.0.mlp.", &seed);
    layer_file(&B, fb, "model.layers.1.mlp.", &seed);
    layer_file(&C, fc, "model.layers.2.mlp.", &seed);
    layer_file(&E, fe, "model.layers.3.mlp.", &seed);
    memcpy(&Z.sh, &A.sh, sizeof(Z.sh));
    Z.w1 = A.w1, Z.w3 = A.w3, Z.w2 = A.w2; /* zeta: alpha's file and prefix */
    const char *sec = "[layer %s]\nfile = %s\nprefix = model.layers.%d.mlp.\ntopk = %d\n\n";
    char conf1[2048], conf2[2048], part[512];
    snprintf(conf1, sizeof(conf1), "[daemon]\nallowed_dirs = %s\nlog_level = debug\n\n", wdir);
    const struct { const char *name, *file; int layer, topk; } v1[] = {
        {"alpha", fa, 0, 2}, {"beta", fb, 1, 2}, {"eps", fe, 3, 2}, {"zeta", fa, 0, 2}};
    for (size_t i = 0; i < ARRAY_LEN(v1); i++) {
        snprintf(part, sizeof(part), sec, v1[i].name, v1[i].file, v1[i].layer, v1[i].topk);
        strcat(conf1, part);
    }
    write_file(conf, "%s", conf1);
    struct itest_daemon d;
    sd_start(&d, nl, "400000", "--config", conf, NULL);
    int ready = sd_wait_ready(&d, nl, 0);

    /* The start-up timeout was extended while the layers loaded. */
    int ext = nl_find(nl, 0, "EXTEND_TIMEOUT_USEC=");
    CHECK_MSG(ext >= 0 && ext < ready, "EXTEND_TIMEOUT_USEC at %d, READY=1 at %d", ext, ready);
    int ext_b = nl_find(nl, 0, "STATUS=loading layer 'zeta' (4 of 4)");
    CHECK(ext_b >= 0 && ext_b < ready && has_line(nl->msgs[ext_b].text, "EXTEND_TIMEOUT_USEC="));
    CHECK_STR_CONTAINS(nl->msgs[ready].text, "STATUS=4 layers");

    /* READY=1 means listening, with the configured layers loaded. */
    moe_client *c = NULL;
    CHECK_MSG(moe_connect(d.dir, "itest", &c) == 0, "connect right after READY=1: %s",
              moe_errmsg());
    moe_layer_info infos[8];
    CHECK_EQ_INT(moe_layer_list(c, infos, 8), 4);
    CHECK(info_of(infos, 4, "alpha") && info_of(infos, 4, "beta"));
    forward_and_check(c, &A, 3, &seed);
    snprintf(Z.name, sizeof(Z.name), "zeta");
    forward_and_check(c, &Z, 3, &seed);
    struct itest_layer G = layer_def("gamma", 8, 2, 256, 512);
    itest_layer_upload(c, &G, &seed);

    /* WATCHDOG=1 every 200 ms (half of 400 ms); STATUS= every 2 s. */
    nl_pump(nl, 2400);
    uint64_t pings[64];
    int np = 0;
    for (int i = ready + 1; i < nl_count(nl) && np < 64; i++)
        if (has_line(nl->msgs[i].text, "WATCHDOG=1"))
            pings[np++] = nl->msgs[i].t_us;
    CHECK_MSG(np >= 9, "%d pings in 2.4 s", np);
    uint64_t gaps[64], max_gap = 0;
    for (int i = 1; i < np; i++) {
        gaps[i - 1] = pings[i] - pings[i - 1];
        max_gap = gaps[i - 1] > max_gap ? gaps[i - 1] : max_gap;
    }
    for (int i = 0; i < np - 1; i++) /* sort for the median */
        for (int j = i + 1; j < np - 1; j++)
            if (gaps[j] < gaps[i]) {
                uint64_t t = gaps[i];
                gaps[i] = gaps[j];
                gaps[j] = t;
            }
    uint64_t median = gaps[(np - 1) / 2];
    fprintf(stderr, "  watchdog: %d pings, median interval %llu us, max %llu us\n", np,
            (unsigned long long)median, (unsigned long long)max_gap);
    CHECK_MSG(median >= 170000 && median <= 240000, "median ping interval %llu us",
              (unsigned long long)median);
    CHECK_MSG(max_gap < 400000, "a ping came %llu us after the previous one",
              (unsigned long long)max_gap);
    int status = -1;
    for (int i = ready + 1; i < nl_count(nl) && status < 0; i++)
        if (has_line(nl->msgs[i].text, "STATUS="))
            status = i;
    CHECK_MSG(status > 0, "no STATUS= refresh after READY=1");
    CHECK_STR_CONTAINS(nl->msgs[status].text, "5 layers, 1 sessions, queue 0, ");
    CHECK_STR_CONTAINS(nl->msgs[status].text, " req/s");

    /* The reload. eps's file is written anew (st_write renames a new file
     * into place) with new weights under the same section. */
    snprintf(conf2, sizeof(conf2), "[daemon]\nallowed_dirs = %s:%s\nlog_level = debug\n\n",
             wdir, xdir);
    const struct { const char *name, *file; int layer, topk; } v2[] = {
        {"alpha", fa, 0, 1}, {"delta", fc, 2, 2}, {"eps", fe, 3, 2}, {"zeta", fa, 0, 2},
        {"gamma", fa, 0, 2}};
    for (size_t i = 0; i < ARRAY_LEN(v2); i++) {
        snprintf(part, sizeof(part), sec, v2[i].name, v2[i].file, v2[i].layer, v2[i].topk);
        strcat(conf2, part);
    }
    write_file(conf, "%s", conf2);
    itest_layer_free(&E);
    E = layer_def("eps", 4, 2, 32, 48);
    layer_file(&E, fe, "model.layers.3.mlp.", &seed);
    int before = nl_count(nl);
    kill(d.pid, SIGHUP);
    int reloading = nl_wait(nl, before, "RELOADING=1", 5000);
    CHECK_MSG(reloading >= 0, "no RELOADING=1");
    CHECK(has_line(nl->msgs[reloading].text, "MONOTONIC_USEC="));
    int ready2 = nl_wait(nl, reloading + 1, "READY=1", 15000);
    if (ready2 < 0)
        dump_log(d.log);
    CHECK_MSG(ready2 > reloading, "no READY=1 after RELOADING=1");
    CHECK_STR_CONTAINS(nl->msgs[ready2].text, "reloaded with errors"); /* gamma's section */
    int n = moe_layer_list(c, infos, 8);
    CHECK_EQ_INT(n, 5);
    const moe_layer_info *ia = info_of(infos, n, "alpha"), *idl = info_of(infos, n, "delta"),
                         *ig = info_of(infos, n, "gamma"), *iz = info_of(infos, n, "zeta");
    CHECK(ia && idl && ig && iz && info_of(infos, n, "eps") && !info_of(infos, n, "beta"));
    CHECK_EQ_INT(ia->topk, 1);
    CHECK_EQ_INT(idl->intermediate, 40);
    CHECK_STR_EQ(ig->source, "upload");
    CHECK_EQ_INT(iz->requests, 1); /* the same layer as before the reload */
    A.sh.topk = 1;
    forward_and_check(c, &A, 4, &seed);
    forward_and_check(c, &C, 4, &seed);
    forward_and_check(c, &E, 4, &seed); /* the new weights */
    forward_and_check(c, &Z, 4, &seed);
    char *log = read_file(d.log);
    CHECK_STR_CONTAINS(log, "unloading layer 'alpha': its section changed");
    CHECK_STR_CONTAINS(log, "unloading layer 'beta': its section is gone");
    CHECK_STR_CONTAINS(log, "unloading layer 'eps': its file was replaced");
    CHECK_STR_CONTAINS(log, "not loading layer 'gamma'");
    CHECK_STR_CONTAINS(log, "reload: 3 layers loaded, 3 unloaded, 1 kept, 1 failed");
    free(log);

    /* SIGTERM with requests queued and running: all are answered. */
    enum { N = 6 };
    struct itest_fwd f[N];
    moe_request *rq[N];
    for (int i = 0; i < N; i++) {
        itest_fwd_make(c, &G, 384, &seed, &f[i]);
        CHECK(moe_forward_submit(c, &f[i].args, &rq[i]) == 0);
    }
    /* Replies come in order per connection: once this one is back, the
     * daemon has taken all six (requests that arrive after SIGTERM are
     * refused, not drained). */
    moe_stats stats;
    CHECK(moe_stats_get(c, &stats) == 0);
    before = nl_count(nl);
    uint64_t t_term = now_ms();
    kill(d.pid, SIGTERM);
    int stopping = nl_wait(nl, before, "STOPPING=1", 5000);
    CHECK_MSG(stopping >= 0, "no STOPPING=1");
    unsigned pending = 0;
    const char *p = strstr(nl->msgs[stopping].text, "STATUS=draining ");
    CHECK(p && sscanf(p, "STATUS=draining %u", &pending) == 1);
    CHECK_MSG(pending >= 1, "nothing was pending at SIGTERM; the drain was not exercised");
    for (int i = 0; i < N; i++) {
        CHECK_MSG(moe_wait(c, &rq[i], 20000, NULL) == 0, "request %d: %s", i, moe_errmsg());
        CHECK(itest_fwd_error(&G, &f[i]) <= itest_tolerance(G.dt));
    }
    int st = wait_exit(d.pid, 12000);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
    fprintf(stderr, "  drained %u pending requests and exited in %llu ms\n", pending,
            (unsigned long long)(now_ms() - t_term));
    nl_pump(nl, 50);
    CHECK_MSG(nl_find(nl, stopping + 1, "READY=1") < 0, "READY=1 after STOPPING=1");
    CHECK(ext < ready && ready < reloading && reloading < ready2 && ready2 < stopping);

    moe_disconnect(&c);
    itest_layer_free(&A);
    itest_layer_free(&B);
    itest_layer_free(&C);
    itest_layer_free(&E);
    itest_layer_free(&G);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
    nl_close(nl);
}

/* Wait up to ms for the log to hold text; returns the log (to free). */
/* Wait up to ms for the n-th line of the log holding text; the log. */
static char *wait_log_n(const char *path, const char *text, int n, int ms)
{
    char *log = NULL;
    for (uint64_t end = now_ms() + (uint64_t)ms;; itest_sleep_ms(20)) {
        free(log);
        log = read_file(path);
        int seen = 0;
        for (const char *p = log; (p = strstr(p, text)) != NULL; p++)
            seen++;
        if (seen >= n)
            return log;
        if (now_ms() > end) {
            dump_log(path);
            FAIL_AT("%d of %d '%s' in the log within %d ms", seen, n, text, ms);
        }
    }
}

static char *wait_log(const char *path, const char *text, int ms)
{
    return wait_log_n(path, text, 1, ms);
}

/* Wait up to ms for the layer list to hold name on n_devices devices;
 * returns the list's length (infos filled) or fails the test. */
static int wait_placed(moe_client *c, moe_layer_info *infos, int max, const char *name,
                       int n_devices, int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    for (;;) {
        int n = moe_layer_list(c, infos, max);
        CHECK_MSG(n >= 0, "layer list: %s", moe_errmsg());
        const moe_layer_info *li = info_of(infos, n, name);
        if (li && li->n_devices == n_devices)
            return n;
        if (now_ms() > end)
            FAIL_AT("layer '%s' not on %d devices within %d ms (%s, %d)", name, n_devices, ms,
                    li ? "loaded" : "absent", li ? li->n_devices : 0);
        itest_sleep_ms(50);
    }
}

/* A work directory from the template wdir, with the paths of a
 * configuration file (conf) and of a layer file (fa) in it (128 bytes
 * each). */
static void work_dir(char *wdir, char *conf, char *fa)
{
    CHECK(mkdtemp(wdir) != NULL);
    snprintf(conf, 128, "%s/moed.conf", wdir);
    snprintf(fa, 128, "%s/a.safetensors", wdir);
}

/* reload_places_layers_on_their_devices' file after its reload: alpha
 * with placement alpha_at, kept on devices 1 and 2, late with devices and
 * an expert per device, and room for these three layers alone. */
static void places_conf(char *buf, size_t len, const char *sec, const char *wdir,
                        const char *fa, const char *alpha_at)
{
    char part[512];
    snprintf(buf, len, "[daemon]\nallowed_dirs = %s\n\n[limits]\nmax_layers = 3\n\n", wdir);
    snprintf(part, sizeof(part), sec, "alpha", fa, alpha_at);
    strncat(buf, part, len - strlen(buf) - 1);
    snprintf(part, sizeof(part), sec, "kept", fa, "devices = 1,2\n");
    strncat(buf, part, len - strlen(buf) - 1);
    snprintf(part, sizeof(part), sec, "late", fa, "devices = 0,1,2\nexpert_devices = 2,0,2,1\n");
    strncat(buf, part, len - strlen(buf) - 1);
}

/*
 * A reload places each layer as its section now says (CPU backend, three
 * virtual devices): alpha's `devices =` changes, so it is loaded again on
 * its new devices; late's section is new, with devices and an expert per
 * device named (expert_devices); kept's section, with a placement of its
 * own, does not change, so it is kept. Every layer still computes the
 * reference's result, and the file's new max_layers holds at once.
 */
TEST(reload_places_layers_on_their_devices)
{
    if (itest_on_gpu())
        TEST_SKIP("virtual devices are the CPU backend's");
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-sdd.XXXXXX", conf[128], fa[128];
    work_dir(wdir, conf, fa);
    struct itest_layer A = layer_def("alpha", 4, 2, 32, 48);
    layer_file(&A, fa, "model.layers.0.mlp.", &seed);
    struct itest_layer K = A, L = A; /* the same file and weights */
    snprintf(K.name, sizeof(K.name), "kept");
    snprintf(L.name, sizeof(L.name), "late");
    const char *sec = "[layer %s]\nfile = %s\nprefix = model.layers.0.mlp.\ntopk = 2\n%s\n";
    char conf1[1024], conf2[1536], part[512];
    snprintf(conf1, sizeof(conf1), "[daemon]\nallowed_dirs = %s\n\n", wdir);
    snprintf(part, sizeof(part), sec, "alpha", fa, "");
    strcat(conf1, part);
    snprintf(part, sizeof(part), sec, "kept", fa, "devices = 1,2\n");
    strcat(conf1, part);
    write_file(conf, "%s", conf1);
    struct itest_daemon d;
    itest_daemon_start(&d, "--virtual-devices", "3", "--config", conf, NULL);
    moe_client *c = itest_connect(&d, "placed");
    /* configured layers are loaded before the daemon listens */
    moe_layer_info infos[8];
    int n = moe_layer_list(c, infos, 8);
    CHECK_EQ_INT(n, 2);
    const moe_layer_info *ia = info_of(infos, n, "alpha"), *ik0 = info_of(infos, n, "kept");
    CHECK(ia && ik0);
    CHECK_EQ_INT(ia->n_devices, 1);
    CHECK_EQ_INT(ia->devices[0], 0);
    CHECK_EQ_INT(ik0->n_devices, 2);
    forward_and_check(c, &A, 5, &seed);
    forward_and_check(c, &K, 5, &seed);

    /* The reload: alpha moves to devices 0 and 2, late arrives with two
     * of its four experts on device 2 and one on each of 0 and 1. */
    places_conf(conf2, sizeof(conf2), sec, wdir, fa, "devices = 0,2\n");
    write_file(conf, "%s", conf2);
    kill(d.pid, SIGHUP);
    wait_placed(c, infos, 8, "late", 3, 10000);
    n = wait_placed(c, infos, 8, "alpha", 2, 10000);
    CHECK_EQ_INT(n, 3);
    ia = info_of(infos, n, "alpha");
    const moe_layer_info *ik = info_of(infos, n, "kept"), *il = info_of(infos, n, "late");
    CHECK(ia && ik && il);
    CHECK(ia->devices[0] == 0 && ia->devices[1] == 2);
    CHECK(ik->n_devices == 2 && ik->devices[0] == 1 && ik->devices[1] == 2);
    CHECK_EQ_INT(ik->requests, 1); /* the layer from before the reload */
    CHECK_EQ_INT(ia->requests, 0); /* loaded again */
    /* late: devices 0, 1, 2 hold one, one and two experts' weights */
    CHECK(il->devices[0] == 0 && il->devices[1] == 1 && il->devices[2] == 2);
    CHECK(il->device_bytes[0] > 0 && il->device_bytes[0] == il->device_bytes[1]);
    CHECK_MSG(il->device_bytes[2] == 2 * il->device_bytes[0], "device bytes %llu, %llu, %llu",
              (unsigned long long)il->device_bytes[0], (unsigned long long)il->device_bytes[1],
              (unsigned long long)il->device_bytes[2]);
    forward_and_check(c, &A, 7, &seed);
    forward_and_check(c, &K, 7, &seed);
    forward_and_check(c, &L, 7, &seed);
    /* The reload's limits apply at once: with three layers loaded, a
     * fourth is refused (max_layers = 3). */
    struct itest_layer X = layer_def("extra", 4, 2, 32, 48);
    CHECK_EQ_INT(itest_layer_try_upload(c, &X, &seed, NULL), -EDQUOT);
    CHECK_STR_CONTAINS(moe_errmsg(), "max_layers");
    itest_layer_free(&X);
    /* A placement the layer cannot take (three experts placed, four in the
     * file): alpha keeps serving on 0 and 2. */
    places_conf(conf2, sizeof(conf2), sec, wdir, fa, "devices = 0,2\nexpert_devices = 0,2,2\n");
    write_file(conf, "%s", conf2);
    kill(d.pid, SIGHUP);
    char *log3 = wait_log(d.log, "reload: 0 layers loaded, 0 unloaded, 2 kept, 1 failed", 10000);
    CHECK_STR_CONTAINS(log3, "reload: keeping layer 'alpha' as loaded (its section changed), "
                             "since the load would fail: the expert placement names 3 experts; "
                             "the layer has 4");
    free(log3);
    n = moe_layer_list(c, infos, 8);
    ia = info_of(infos, n, "alpha");
    CHECK(ia && ia->n_devices == 2 && ia->devices[0] == 0 && ia->devices[1] == 2);
    forward_and_check(c, &A, 5, &seed);
    /* The reload's summary follows its last load (poll for it). */
    char *log = NULL;
    for (uint64_t end = now_ms() + 5000;; itest_sleep_ms(20)) {
        free(log);
        log = read_file(d.log);
        if ((strstr(log, "reload: ") && strstr(log, " kept, ")) || now_ms() > end)
            break;
    }
    CHECK_STR_CONTAINS(log, "unloading layer 'alpha': its section changed");
    CHECK_STR_CONTAINS(log, "reload: 2 layers loaded, 1 unloaded, 1 kept, 0 failed");
    free(log);

    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_layer_free(&A);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
}

/*
 * A reload's loads are the configuration's, not a client's: max_loads
 * (here 1) does not cut short a reload that adds four layers, while
 * max_layers holds for them as for a client's (counting the client's
 * layer), and a load it refuses is logged with the reason. A file with
 * more layer sections than max_layers is refused whole.
 */
TEST(reload_loads_past_max_loads_and_names_what_it_refuses)
{
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-sdl.XXXXXX", conf[128], fa[128];
    work_dir(wdir, conf, fa);
    struct itest_layer A = layer_def("alpha", 4, 2, 32, 48);
    layer_file(&A, fa, "model.layers.0.mlp.", &seed);
    const char *sec = "[layer %s]\nfile = %s\nprefix = model.layers.0.mlp.\ntopk = 2\n\n";
    /* conf_n: alpha and the first n of b1 .. b6 */
    char text[4][2048], part[512];
    const int n_b[4] = {0, 4, 5, 6};
    for (int i = 0; i < 4; i++) {
        snprintf(text[i], sizeof(text[i]),
                 "[daemon]\nallowed_dirs = %s\n\n[limits]\nmax_loads = 1\nmax_layers = 6\n\n",
                 wdir);
        snprintf(part, sizeof(part), sec, "alpha", fa);
        strcat(text[i], part);
        for (int j = 1; j <= n_b[i]; j++) {
            char name[16];
            snprintf(name, sizeof(name), "b%d", j);
            snprintf(part, sizeof(part), sec, name, fa);
            strcat(text[i], part);
        }
    }
    write_file(conf, "%s", text[0]);
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", conf, NULL);
    moe_client *c = itest_connect(&d, "reloads");
    struct itest_layer U = layer_def("up", 4, 2, 32, 48);
    itest_layer_upload(c, &U, &seed);

    /* Four new sections, one load allowed in flight to clients. */
    write_file(conf, "%s", text[1]);
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "reload: 4 layers loaded, 0 unloaded, 1 kept, 0 failed", 10000));
    moe_layer_info infos[8];
    CHECK_EQ_INT(moe_layer_list(c, infos, 8), 6);
    for (int j = 1; j <= 4; j++) {
        struct itest_layer B = A; /* the same file and weights */
        snprintf(B.name, sizeof(B.name), "b%d", j);
        forward_and_check(c, &B, 3, &seed);
    }

    /* A fifth: seven layers with the client's, past max_layers. */
    write_file(conf, "%s", text[2]);
    kill(d.pid, SIGHUP);
    char *log = wait_log(d.log, "reload: 0 layers loaded, 0 unloaded, 5 kept, 1 failed", 10000);
    CHECK_STR_CONTAINS(log, "reload: not loading layer 'b5': 6 layers are loaded or loading, "
                            "the limit (max_layers)");
    free(log);

    /* Seven sections: the file is refused, the layers stay. */
    write_file(conf, "%s", text[3]);
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "7 [layer] sections, more than max_layers (6); keeping the running "
                         "configuration", 10000));
    /* Summed up as such, not as a layer that failed. */
    free(wait_log(d.log, "reload: failed (the configuration could not be read); nothing changed",
                  10000));
    CHECK_EQ_INT(moe_layer_list(c, infos, 8), 6);
    forward_and_check(c, &A, 3, &seed);
    forward_and_check(c, &U, 3, &seed);

    /* A new section before a changed one: the changed layer is loaded again
     * into the place it left, and the new one is refused (max_layers). */
    char text4[2048];
    snprintf(text4, sizeof(text4),
             "[daemon]\nallowed_dirs = %s\n\n[limits]\nmax_loads = 1\nmax_layers = 6\n\n", wdir);
    snprintf(part, sizeof(part), sec, "b5", fa);
    strcat(text4, part);
    snprintf(part, sizeof(part),
             "[layer alpha]\nfile = %s\nprefix = model.layers.0.mlp.\ntopk = 1\n\n", fa);
    strcat(text4, part);
    for (int j = 1; j <= 4; j++) {
        char name[16];
        snprintf(name, sizeof(name), "b%d", j);
        snprintf(part, sizeof(part), sec, name, fa);
        strcat(text4, part);
    }
    write_file(conf, "%s", text4);
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "reload: 1 layers loaded, 1 unloaded, 4 kept, 1 failed", 10000));
    struct itest_layer A1 = A; /* alpha's weights, now with topk 1 */
    A1.sh.topk = 1;
    forward_and_check(c, &A1, 3, &seed);
    forward_and_check(c, &U, 3, &seed);

    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_layer_free(&A);
    itest_layer_free(&U);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
}

/*
 * A reload loads a layer again only where the new load would succeed: a
 * changed section naming tensors the file lacks, and a file replaced by one
 * that is not safetensors, leave both layers serving their old weights
 * (the reload counts them failed, and says why). The next reload that
 * mends them loads both again: alpha's section as it was before, beta's
 * file with new weights.
 */
TEST(reload_keeps_a_layer_whose_new_load_would_fail)
{
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-sdk.XXXXXX", conf[128], fa[128], fb[128];
    work_dir(wdir, conf, fa);
    snprintf(fb, sizeof(fb), "%s/b.safetensors", wdir);
    struct itest_layer A = layer_def("alpha", 4, 2, 32, 48), B = layer_def("beta", 4, 2, 32, 48);
    layer_file(&A, fa, "m.", &seed);
    layer_file(&B, fb, "m.", &seed);
    const char *text = "[daemon]\nallowed_dirs = %s\n\n"
                       "[layer alpha]\nfile = %s\nprefix = %s\ntopk = 2\n\n"
                       "[layer beta]\nfile = %s\nprefix = m.\ntopk = 2\n";
    write_file(conf, text, wdir, fa, "m.", fb);
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", conf, NULL);
    moe_client *c = itest_connect(&d, "kept");
    forward_and_check(c, &A, 5, &seed);
    forward_and_check(c, &B, 5, &seed);

    write_file(conf, text, wdir, fa, "wrong.", fb);
    write_file(fb, "not a safetensors file\n");
    kill(d.pid, SIGHUP);
    char *log = wait_log(d.log, "reload: 0 layers loaded, 0 unloaded, 0 kept, 2 failed", 10000);
    CHECK_STR_CONTAINS(log, "reload: keeping layer 'alpha' as loaded (its section changed), "
                            "since the load would fail: no tensor wrong.experts.0.w1.weight");
    CHECK_STR_CONTAINS(log, "reload: keeping layer 'beta' as loaded (its file was replaced), "
                            "since the load would fail: ");
    CHECK(strstr(log, "unloading layer") == NULL);
    free(log);
    forward_and_check(c, &A, 7, &seed);
    forward_and_check(c, &B, 7, &seed);

    /* Mended: alpha's section as at start (the running one is the failed
     * one, so it counts as changed), beta's file with new weights. */
    struct itest_layer B2 = layer_def("beta", 4, 2, 32, 48);
    layer_file(&B2, fb, "m.", &seed);
    write_file(conf, text, wdir, fa, "m.", fb);
    kill(d.pid, SIGHUP);
    log = wait_log(d.log, "reload: 2 layers loaded, 2 unloaded, 0 kept, 0 failed", 10000);
    CHECK_STR_CONTAINS(log, "reload: unloading layer 'alpha': its section changed");
    CHECK_STR_CONTAINS(log, "reload: unloading layer 'beta': its file was replaced");
    free(log);
    forward_and_check(c, &A, 9, &seed);
    forward_and_check(c, &B2, 9, &seed);

    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_layer_free(&A);
    itest_layer_free(&B);
    itest_layer_free(&B2);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
}

/* A reload that lowers max_layers below the layers loaded (a client's
 * count too) and changes a configured layer's section keeps that layer as
 * it was: unloaded, its new load would find no room, and the section it
 * came from none either. Raised again, the next reload applies it. */
TEST(reload_keeps_a_changed_layer_when_max_layers_leaves_no_room)
{
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-sdk.XXXXXX", conf[128], fa[128], fb[128];
    work_dir(wdir, conf, fa);
    snprintf(fb, sizeof(fb), "%s/b.safetensors", wdir);
    struct itest_layer A = layer_def("alpha", 4, 2, 32, 48), G = layer_def("gamma", 4, 2, 32, 48);
    layer_file(&A, fa, "m.", &seed);
    layer_file(&G, fb, "m.", &seed);
    const char *text = "[daemon]\nallowed_dirs = %s\n\n[limits]\nmax_layers = %d\n\n"
                       "[layer alpha]\nfile = %s\nprefix = m.\ntopk = 2\nrenormalize = %s\n";
    write_file(conf, text, wdir, 4, fa, "true");
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", conf, NULL);
    moe_client *c = itest_connect(&d, "quota");
    moe_layer_desc desc = {.name = "gamma", .kind = MOE_LAYER_MOE, .topk = 2,
                           .renormalize = 1, .path = fb, .prefix = "m."};
    CHECK_MSG(moe_layer_load(c, &desc, NULL) == 0, "load gamma: %s", moe_errmsg());
    write_file(conf, text, wdir, 1, fa, "false");
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "so its new load would find no room", 10000));
    moe_layer_info infos[8];
    int n = moe_layer_list(c, infos, 8);
    const moe_layer_info *a = info_of(infos, n, "alpha");
    CHECK_MSG(a != NULL, "the configured layer alpha is gone after the reload");
    CHECK(a->renormalize);
    forward_and_check(c, &A, 5, &seed);
    /* Room again: the new section applies. */
    write_file(conf, text, wdir, 4, fa, "false");
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "reload: unloading layer 'alpha'", 10000));
    for (int i = 0; i < 500; i++) {
        n = moe_layer_list(c, infos, 8);
        a = info_of(infos, n, "alpha");
        if (a && !a->renormalize)
            break;
        usleep(20000);
    }
    CHECK_MSG(a && !a->renormalize, "alpha's new section was not applied");
    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_layer_free(&A);
    itest_layer_free(&G);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
}

/* A reload that swaps the allowed directories applies them whatever the
 * running list held: here the same directory twice (the file's and
 * --allow-dir's), which once made [W, W] against [W2, W] look the same. */
TEST(reload_applies_new_allowed_dirs)
{
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-sdk.XXXXXX", conf[128], fa[128], w2[] = "/tmp/moed-sdk2.XXXXXX",
         fb[128];
    work_dir(wdir, conf, fa);
    CHECK(mkdtemp(w2) != NULL);
    snprintf(fb, sizeof(fb), "%s/b.safetensors", w2);
    struct itest_layer G = layer_def("gamma", 4, 2, 32, 48);
    layer_file(&G, fb, "m.", &seed);
    write_file(conf, "[daemon]\nallowed_dirs = %s\n", wdir);
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", conf, "--allow-dir", wdir, NULL);
    moe_client *c = itest_connect(&d, "dirs");
    moe_layer_desc desc = {.name = "gamma", .kind = MOE_LAYER_MOE, .topk = 2,
                           .renormalize = 1, .path = fb, .prefix = "m."};
    CHECK_EQ_INT(moe_layer_load(c, &desc, NULL), -EACCES);
    write_file(conf, "[daemon]\nallowed_dirs = %s\n", w2);
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "reload: 0 layers loaded", 10000));
    int rc = moe_layer_load(c, &desc, NULL);
    CHECK_MSG(rc == 0, "a directory the reload allowed: %d %s", rc, moe_errmsg());
    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_layer_free(&G);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
    itest_rmdir(w2);
}

/* The daemon's address space in bytes (VmSize). */
static uint64_t vm_size(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    unsigned long long kib = 0;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmSize: %llu kB", &kib) == 1)
            break;
    fclose(f);
    CHECK(kib > 0);
    return (uint64_t)kib << 10;
}

/* A configured layer alpha (A, from fa) serving a client, then a section
 * naming Big (fb, 24 MiB of weights) written while the daemon's address
 * space is capped 8 MiB above what it uses: a reload whose new load fails
 * past its checks. */
struct failing_reload {
    uint64_t seed;
    char wdir[32], conf[128], fa[128], fb[128];
    const char *text;
    struct itest_layer A, Big;
    struct itest_daemon d;
    moe_client *c;
    struct rlimit was;
};

static void failing_reload_start(struct failing_reload *f)
{
#if defined(__SANITIZE_ADDRESS__)
    TEST_SKIP("AddressSanitizer's shadow memory cannot live under an address-space limit");
#endif
    if (itest_on_gpu())
        TEST_SKIP("the address-space limit fails host allocations, the CPU backend's");
    f->seed = test_seed();
    snprintf(f->wdir, sizeof(f->wdir), "/tmp/moed-sdm.XXXXXX");
    work_dir(f->wdir, f->conf, f->fa);
    snprintf(f->fb, sizeof(f->fb), "%s/big.safetensors", f->wdir);
    f->A = layer_def("alpha", 4, 2, 32, 48);
    f->Big = layer_def("alpha", 8, 2, 512, 1024);
    layer_file(&f->A, f->fa, "m.", &f->seed);
    layer_file(&f->Big, f->fb, "m.", &f->seed);
    f->text = "[daemon]\nallowed_dirs = %s\n\n[layer alpha]\nfile = %s\nprefix = m.\ntopk = 2\n";
    write_file(f->conf, f->text, f->wdir, f->fa);
    itest_daemon_start(&f->d, "--config", f->conf, NULL);
    f->c = itest_connect(&f->d, "kept");
    forward_and_check(f->c, &f->A, 5, &f->seed);
    CHECK(prlimit(f->d.pid, RLIMIT_AS, NULL, &f->was) == 0);
    struct rlimit cap = f->was;
    cap.rlim_cur = vm_size(f->d.pid) + (8u << 20);
    CHECK(prlimit(f->d.pid, RLIMIT_AS, &cap, NULL) == 0);
}

/* With room again, the next reload loads the section that names Big. */
static void failing_reload_finish(struct failing_reload *f, const char *loaded)
{
    CHECK(prlimit(f->d.pid, RLIMIT_AS, &f->was, NULL) == 0);
    kill(f->d.pid, SIGHUP);
    free(wait_log(f->d.log, loaded, 20000));
    forward_and_check(f->c, &f->Big, 3, &f->seed);
    moe_disconnect(&f->c);
    itest_daemon_stop(&f->d);
    itest_layer_free(&f->A);
    itest_layer_free(&f->Big);
    itest_rmdir(f->d.dir);
    itest_rmdir(f->wdir);
}

/*
 * A reload whose new section passes every check but whose load then fails
 * (here for memory: the daemon's address space is capped just above what
 * it uses) does not lose the layer: it is loaded again from its former
 * section, whose file is unchanged, and serves the old weights. The next
 * reload tries the new section again; still short of memory, it serves
 * again from the section it was loaded from (not the one the running
 * configuration names); with room, it loads the new section.
 */
TEST(reload_serves_a_layer_again_when_its_new_load_fails)
{
    struct failing_reload f;
    failing_reload_start(&f);
    write_file(f.conf, f.text, f.wdir, f.fb);
    kill(f.d.pid, SIGHUP);
    const char *restored = "reload: 0 layers loaded, 1 unloaded, 0 kept, 1 failed (1 of them "
                           "serving again from their former sections)";
    char *log = wait_log(f.d.log, restored, 20000);
    CHECK_STR_CONTAINS(log, "cannot load layer 'alpha': ");
    char again[300];
    snprintf(again, sizeof(again),
             "reload: loading layer 'alpha' again from its former section (%s)", f.fa);
    CHECK_STR_CONTAINS(log, again);
    CHECK_STR_CONTAINS(log, "reload: layer 'alpha' serves again as loaded from its former section");
    free(log);
    kill(f.d.pid, SIGHUP);
    log = wait_log_n(f.d.log, restored, 2, 20000);
    CHECK_STR_CONTAINS(log, "reload: unloading layer 'alpha': a reload before kept it back");
    CHECK(strstr(strstr(log, restored) + 1, again) != NULL);
    CHECK(strstr(log, "is not loaded") == NULL);
    free(log);
    forward_and_check(f.c, &f.A, 7, &f.seed);
    /* With room, the next reload loads the section the file names. */
    failing_reload_finish(&f, "reload: 1 layers loaded, 1 unloaded, 0 kept, 0 failed");
}

/* The same, but the file the layer was loaded from is replaced meanwhile:
 * its former section would load other weights, so the layer stays
 * unloaded, with the reason logged, until a reload loads it. */
TEST(reload_does_not_serve_a_layer_again_from_a_replaced_file)
{
    struct failing_reload f;
    failing_reload_start(&f);
    char fa2[160];
    snprintf(fa2, sizeof(fa2), "%s.new", f.fa);
    struct itest_layer A2 = layer_def("alpha", 4, 2, 32, 48);
    layer_file(&A2, fa2, "m.", &f.seed);
    CHECK(rename(fa2, f.fa) == 0);
    write_file(f.conf, f.text, f.wdir, f.fb);
    kill(f.d.pid, SIGHUP);
    char *log = wait_log(f.d.log, "reload: 0 layers loaded, 1 unloaded, 0 kept, 1 failed", 20000);
    char gone[400];
    snprintf(gone, sizeof(gone),
             "reload: layer 'alpha' is not loaded: the file it was loaded from, %s, is no longer "
             "the same", f.fa);
    CHECK_STR_CONTAINS(log, gone);
    CHECK(strstr(log, "again from its former section") == NULL);
    free(log);
    moe_layer_info info[4];
    CHECK_EQ_INT(moe_layer_list(f.c, info, 4), 0);
    itest_layer_free(&A2);
    failing_reload_finish(&f, "reload: 1 layers loaded, 0 unloaded, 0 kept, 0 failed");
}

/* Copy the safetensors file in to out with n_keys entries of metadata
 * spliced into its header: a header of megabytes, slow to parse. */
static void pad_header(const char *in, const char *out, unsigned n_keys)
{
    FILE *f = fopen(in, "rb");
    CHECK(f != NULL);
    uint64_t hlen;
    CHECK(fread(&hlen, 8, 1, f) == 1);
    char *hdr = malloc(hlen);
    CHECK(hdr && fread(hdr, 1, hlen, f) == hlen && hdr[0] == '{');
    long data_at = ftell(f);
    CHECK(fseek(f, 0, SEEK_END) == 0);
    size_t data_len = (size_t)(ftell(f) - data_at);
    uint8_t *data = malloc(data_len + 1);
    CHECK(data && fseek(f, data_at, SEEK_SET) == 0 && fread(data, 1, data_len, f) == data_len);
    fclose(f);
    size_t cap = (size_t)n_keys * 24 + hlen + 64, n = 0;
    char *h = malloc(cap);
    CHECK(h != NULL);
    n += (size_t)snprintf(h + n, cap - n, "{\"__metadata__\":{");
    for (unsigned i = 0; i < n_keys; i++)
        n += (size_t)snprintf(h + n, cap - n, "%s\"k%u\":\"v\"", i ? "," : "", i);
    n += (size_t)snprintf(h + n, cap - n, "},");
    memcpy(h + n, hdr + 1, hlen - 1);
    n += hlen - 1;
    while (n % 8)
        h[n++] = ' ';
    uint64_t nl = n;
    f = fopen(out, "wb");
    CHECK(f && fwrite(&nl, 8, 1, f) == 1 && fwrite(h, 1, n, f) == n &&
          fwrite(data, 1, data_len, f) == data_len);
    CHECK(fclose(f) == 0);
    free(hdr);
    free(data);
    free(h);
}

/* Two small layers' files, alpha (fa) and beta (fb), and alpha's weights
 * again behind a header of megabytes (fslow: seconds of parsing). */
struct slow_files {
    uint64_t seed;
    char wdir[32], conf[128], fa[128], fb[128], fslow[128];
    struct itest_layer A, B;
};

static void slow_files_make(struct slow_files *sf)
{
    sf->seed = test_seed();
    snprintf(sf->wdir, sizeof(sf->wdir), "/tmp/moed-sdh.XXXXXX");
    work_dir(sf->wdir, sf->conf, sf->fa);
    snprintf(sf->fb, sizeof(sf->fb), "%s/b.safetensors", sf->wdir);
    snprintf(sf->fslow, sizeof(sf->fslow), "%s/slow.safetensors", sf->wdir);
    sf->A = layer_def("alpha", 4, 2, 32, 48);
    sf->B = layer_def("beta", 4, 2, 32, 48);
    layer_file(&sf->A, sf->fa, "m.", &sf->seed);
    layer_file(&sf->B, sf->fb, "m.", &sf->seed);
    /* 28 MB of header: about 1 s of parsing for a reload here, so that
     * reload_parses_headers_off_the_loop's reload is long enough to tell
     * (14 MB took 495 ms on one run, under its 500 ms bound) */
    pad_header(sf->fa, sf->fslow, 2000000);
}

/* max_loads caps clients' loads only: while a reload's plan and loads keep
 * the loader busy, a client's load is taken (and waits its turn), not
 * refused as BUSY. */
TEST(a_reload_does_not_use_up_clients_loads)
{
    struct slow_files sf;
    slow_files_make(&sf);
    const char *text = "[daemon]\nallowed_dirs = %s\n\n[limits]\nmax_loads = 1\n\n"
                       "[layer alpha]\nfile = %s\nprefix = m.\ntopk = 2\n";
    write_file(sf.conf, text, sf.wdir, sf.fa);
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", sf.conf, NULL);
    moe_client *c = itest_connect(&d, "loads");
    write_file(sf.conf, text, sf.wdir, sf.fslow);
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "reloading the configuration", 10000));
    moe_layer_desc desc = {.name = "beta", .kind = MOE_LAYER_MOE, .topk = 2,
                           .routing = MOE_ROUTING_SOFTMAX, .renormalize = 1, .path = sf.fb,
                           .prefix = "m."};
    moe_layer_info info;
    CHECK_MSG(moe_layer_load(c, &desc, &info) == 0, "%s", moe_errmsg());
    free(wait_log(d.log, "reload: 1 layers loaded, 1 unloaded, 0 kept, 0 failed", 60000));
    forward_and_check(c, &sf.B, 3, &sf.seed);
    forward_and_check(c, &sf.A, 3, &sf.seed);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
    itest_layer_free(&sf.A);
    itest_layer_free(&sf.B);
    itest_rmdir(d.dir);
    itest_rmdir(sf.wdir);
}

/* --demo's directory is allowed as --allow-dir's are: a reload keeps it,
 * and keeps the list of allowed directories as it was (a reload that
 * changes none does not wait for the loader). */
TEST(demo_weights_stay_loadable_after_a_reload)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    moe_client *c = itest_connect(&d, "demo");
    char path[300];
    snprintf(path, sizeof(path), "%s/demo/demo.safetensors", d.dir);
    kill(d.pid, SIGHUP);
    char *log = wait_log(d.log, "reload: 0 layers loaded, 0 unloaded, 0 kept, 0 failed", 20000);
    CHECK(strstr(log, "allowed directories") == NULL); /* the same list */
    free(log);
    moe_layer_desc desc = {.name = "again", .kind = MOE_LAYER_MOE, .topk = 2,
                           .routing = MOE_ROUTING_SOFTMAX, .renormalize = 1, .path = path,
                           .prefix = "model.layers.0.block_sparse_moe."};
    moe_layer_info info;
    CHECK_MSG(moe_layer_load(c, &desc, &info) == 0, "%s", moe_errmsg());
    CHECK_EQ_INT(info.experts, 8);
    moe_disconnect(&c);
    itest_daemon_stop(&d);
}

/*
 * A reload reads headers off the loop thread: while it checks and loads a
 * layer whose file has a header of megabytes (seconds of parsing), another
 * layer's forwards keep being answered promptly.
 */
TEST(reload_parses_headers_off_the_loop)
{
    struct slow_files sf;
    slow_files_make(&sf);
    const char *text = "[daemon]\nallowed_dirs = %s\n\n"
                       "[layer alpha]\nfile = %s\nprefix = m.\ntopk = 2\n\n"
                       "[layer beta]\nfile = %s\nprefix = m.\ntopk = 2\n";
    write_file(sf.conf, text, sf.wdir, sf.fa, sf.fb);
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", sf.conf, NULL);
    moe_client *c = itest_connect(&d, "kept");
    forward_and_check(c, &sf.B, 3, &sf.seed);

    write_file(sf.conf, text, sf.wdir, sf.fslow, sf.fb);
    uint64_t t0 = now_ms(), worst = 0;
    kill(d.pid, SIGHUP);
    char *log = NULL;
    int forwards = 0;
    for (;; forwards++) {
        uint64_t t = now_ms();
        forward_and_check(c, &sf.B, 3, &sf.seed);
        t = now_ms() - t;
        worst = t > worst ? t : worst;
        free(log);
        log = read_file(d.log);
        if (strstr(log, "reload: 1 layers loaded, 1 unloaded, 1 kept, 0 failed"))
            break;
        CHECK_MSG(now_ms() - t0 < 60000, "the reload did not end within 60 s");
    }
    uint64_t took = now_ms() - t0;
    free(log);
    /* The reload parses the header twice (its check, then the load). */
    printf("  reload %llu ms, %d forwards meanwhile, the slowest %llu ms\n",
           (unsigned long long)took, forwards, (unsigned long long)worst);
    CHECK_MSG(took >= 500, "the reload took %llu ms: too fast to tell", (unsigned long long)took);
    CHECK_MSG(worst * 4 < took, "a forward waited %llu ms of the reload's %llu ms",
              (unsigned long long)worst, (unsigned long long)took);
    forward_and_check(c, &sf.A, 5, &sf.seed); /* the same weights, from the padded file */

    /* Stopped at once (two SIGTERMs: no drain) while a reload's plan
     * still parses beta's new header: the daemon exits cleanly, the
     * reload freed once the plan ends (AddressSanitizer's builds would
     * fail the exit status on a leak or a use after free). */
    char fslow_b[160];
    snprintf(fslow_b, sizeof(fslow_b), "%s/slow-b.safetensors", sf.wdir);
    pad_header(sf.fb, fslow_b, 1000000);
    write_file(sf.conf, text, sf.wdir, sf.fslow, fslow_b);
    moe_disconnect(&c);
    kill(d.pid, SIGHUP);
    free(wait_log(d.log, "reloading the configuration", 10000));
    kill(d.pid, SIGTERM);
    itest_sleep_ms(20);
    kill(d.pid, SIGTERM);
    itest_daemon_wait_stopped(&d);
    log = read_file(d.log);
    CHECK_STR_CONTAINS(log, "second signal: stopping without draining");
    CHECK(strstr(log, "unloading layer 'beta'") == NULL); /* it stopped before the plan came */
    free(log);
    itest_layer_free(&sf.A);
    itest_layer_free(&sf.B);
    itest_rmdir(d.dir);
    itest_rmdir(sf.wdir);
}

/*
 * SIGTERM while the configured layers load (before READY=1) stops the load
 * at its next read: moed exits 0 at once, without READY=1 and with most
 * layers never loaded. Before, the signal waited until every layer was in.
 */
TEST(a_stop_during_the_initial_load_ends_it)
{
    enum { N = 120 };
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-sdl.XXXXXX", conf[128], fa[128];
    work_dir(wdir, conf, fa);
    struct itest_layer L = layer_def("l", 8, 2, 256, 512);
    layer_file(&L, fa, "m.", &seed);
    size_t len = 64 + N * 96;
    char *text = malloc(len), *at = text;
    CHECK(text != NULL);
    at += snprintf(at, len, "[daemon]\nallowed_dirs = %s\n[limits]\nmax_layers = %d\n", wdir, N);
    for (int i = 0; i < N; i++)
        at += snprintf(at, len - (size_t)(at - text), "[layer l%d]\nfile = %s\nprefix = m.\ntopk = 2\n",
                       i, fa);
    write_file(conf, "%s", text);
    free(text);
    struct nlisten *nl = nl_open();
    struct itest_daemon d;
    sd_start(&d, nl, NULL, "--config", conf, NULL);
    free(wait_log(d.log, "layer 'l2' loaded", 20000));
    uint64_t t0 = now_ms();
    kill(d.pid, SIGTERM);
    int st = wait_exit(d.pid, 20000);
    uint64_t took = now_ms() - t0;
    nl_pump(nl, 100);
    char *log = read_file(d.log);
    CHECK(log != NULL);
    int loaded = 0;
    for (const char *p = log; (p = strstr(p, " loaded: ")) != NULL; p++)
        loaded++;
    fprintf(stderr, "  stopped %llu ms after SIGTERM, %d of %d layers loaded\n",
            (unsigned long long)took, loaded, N);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %#x", st);
    CHECK_MSG(loaded < N / 2, "%d of %d layers loaded after SIGTERM", loaded, N);
    CHECK_STR_CONTAINS(log, "stopped before serving: SIGTERM came while the configured layers "
                            "loaded");
    CHECK_MSG(nl_find(nl, 0, "READY=1") < 0, "READY=1 after a stop during the load");
    free(log);
    nl_close(nl);
    itest_layer_free(&L);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
}

/*
 * "A hung device must stop the pings": one batch that runs much longer than
 * WATCHDOG_USEC (a CPU layer, one big request, one thread) leaves a gap in
 * the pings as long as the batch; they resume when it completes. The batch
 * size is calibrated on this machine first, so the test holds on fast and
 * slow ones alike.
 */
TEST(watchdog_pings_stop_while_one_batch_runs_too_long)
{
    uint64_t seed = test_seed();
    const uint64_t wd = 100000;
    struct nlisten *nl = nl_open();
    struct itest_daemon d;
    sd_start(&d, nl, "100000", "--threads", "1", "--max-batch-tokens", "65536",
             "--max-slice-tokens", "65536", NULL);
    sd_wait_ready(&d, nl, 0);
    moe_client *c = itest_connect(&d, "itest");
    struct itest_layer L = layer_def("slow", 4, 2, 512, 1024);
    itest_layer_upload(c, &L, &seed);

    /* Calibrate on the round trip (an overestimate of the compute), and cap
     * the size, so a loaded machine cannot make the batch run for long. */
    size_t T = 256;
    struct itest_fwd f;
    moe_timings tm;
    itest_fwd_make(c, &L, T, &seed, &f);
    uint64_t c0 = now_ms();
    CHECK_MSG(moe_forward(c, &f.args, &tm) == 0, "%s", moe_errmsg());
    double per_token = (double)(now_ms() - c0) * 1000.0 / (double)T;
    moe_region_free(c, &f.r);
    T = (size_t)(900000.0 / (per_token > 1 ? per_token : 1));
    T = T < 256 ? 256 : T > 8192 ? 8192 : T;
    itest_fwd_make(c, &L, T, &seed, &f);
    nl_pump(nl, 0);
    uint64_t t0 = realtime_us();
    CHECK_MSG(moe_forward(c, &f.args, &tm) == 0, "%s", moe_errmsg());
    uint64_t t1 = realtime_us();
    moe_region_free(c, &f.r);
    nl_pump(nl, 500);
    fprintf(stderr, "  one batch of %zu tokens: %llu us of compute\n", T,
            (unsigned long long)tm.compute_us);
    if (tm.compute_us < 5 * wd)
        TEST_SKIP("this machine ran %zu tokens in %llu us: too fast to outlast the watchdog",
                  T, (unsigned long long)tm.compute_us);
    /* The largest gap between pings around the batch, and pings after it. */
    uint64_t prev = 0, max_gap = 0;
    int after = 0;
    for (int i = 0; i < nl_count(nl); i++) {
        if (!has_line(nl->msgs[i].text, "WATCHDOG=1"))
            continue;
        uint64_t t = nl->msgs[i].t_us;
        if (prev && t >= t0 && prev <= t1 && t - prev > max_gap)
            max_gap = t - prev;
        after += t > t1;
        prev = t;
    }
    fprintf(stderr, "  longest gap between pings across the batch: %llu us\n",
            (unsigned long long)max_gap);
    CHECK_MSG(max_gap + 2 * wd >= tm.compute_us,
              "pings went on during a %llu us batch (longest gap %llu us)",
              (unsigned long long)tm.compute_us, (unsigned long long)max_gap);
    CHECK_MSG(after >= 3, "only %d pings in the 500 ms after the batch", after);
    moe_disconnect(&c);
    itest_layer_free(&L);
    itest_daemon_stop(&d);
    nl_close(nl);
}

/* ---- socket activation ------------------------------------------------------ */

/* Connect a socket of type to path and keep it open: a systemd-socket-activate
 * without --accept waits for such a connection before it runs its command. */
static int poke(const char *path, int type)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    for (int i = 0; i < 500; i++) {
        int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
        CHECK(fd >= 0);
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            return fd;
        close(fd);
        itest_sleep_ms(10);
    }
    FAIL_AT("nothing listens on %s", path);
}

static void serve_one_forward(struct itest_daemon *d)
{
    uint64_t seed = test_seed();
    moe_client *c = itest_connect(d, "itest");
    struct itest_layer L = layer_def("activated", 4, 2, 32, 48);
    itest_layer_upload(c, &L, &seed);
    forward_and_check(c, &L, 5, &seed);
    moe_disconnect(&c);
    itest_layer_free(&L);
}

/*
 * Both endpoints passed, named as moed.socket's FileDescriptorName= or
 * --fdname would name them. systemd-socket-activate creates sockets of one
 * type per run but passes on the ones it was given, so two run chained: the
 * outer one holds moed.zmq (stream), the inner one adds moed.sock
 * (seqpacket) and names both.
 */
TEST(socket_activation_passes_both_named_sockets)
{
    const char *ssa = find_tool("systemd-socket-activate");
    if (!ssa)
        TEST_SKIP("systemd-socket-activate not found (Debian package systemd)");
    struct nlisten *nl = nl_open();
    struct itest_daemon d;
    char bin[PATH_MAX], zpath[300], spath[300], zarg[310], sarg[310], env[200];
    moed_bin(bin, sizeof(bin));
    snprintf(d.dir, sizeof(d.dir), "/tmp/moed-itest.XXXXXX");
    CHECK(mkdtemp(d.dir) != NULL);
    snprintf(d.log, sizeof(d.log), "%s/moed.log", d.dir);
    snprintf(zpath, sizeof(zpath), "%s/moed.zmq", d.dir);
    snprintf(spath, sizeof(spath), "%s/moed.sock", d.dir);
    snprintf(zarg, sizeof(zarg), "--listen=%s", zpath);
    snprintf(sarg, sizeof(sarg), "--listen=%s", spath);
    snprintf(env, sizeof(env), "--setenv=NOTIFY_SOCKET=%s", nl->path);
    char *argv[] = {(char *)ssa, zarg, "--fdname=zmq", (char *)ssa, "--seqpacket", sarg,
                    "--fdname=zmq:session", env, bin, "--runtime-dir", d.dir, "--backend", "cpu",
                    "--log-level", "debug", NULL};
    d.pid = itest_spawn(d.log, argv);
    int probe = poke(zpath, SOCK_STREAM);
    sd_wait_ready(&d, nl, 0);
    close(probe);
    char *log = read_file(d.log);
    CHECK_STR_CONTAINS(log, "socket activation: session socket passed, ZeroMQ socket passed");
    free(log);
    serve_one_forward(&d);
    kill(d.pid, SIGTERM);
    int st = wait_exit(d.pid, 12000);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
    /* The sockets belong to the activator: moed leaves their files. */
    CHECK(exists(spath) && exists(zpath));
    itest_rmdir(d.dir);
    nl_close(nl);
}

/* Only the session socket passed, unnamed: moed knows it by its type and
 * binds the ZeroMQ endpoint itself. */
TEST(socket_activation_session_only_binds_zmq_itself)
{
    const char *ssa = find_tool("systemd-socket-activate");
    if (!ssa)
        TEST_SKIP("systemd-socket-activate not found (Debian package systemd)");
    struct nlisten *nl = nl_open();
    struct itest_daemon d;
    char bin[PATH_MAX], spath[300], sarg[310], env[200];
    moed_bin(bin, sizeof(bin));
    snprintf(d.dir, sizeof(d.dir), "/tmp/moed-itest.XXXXXX");
    CHECK(mkdtemp(d.dir) != NULL);
    snprintf(d.log, sizeof(d.log), "%s/moed.log", d.dir);
    snprintf(spath, sizeof(spath), "%s/moed.sock", d.dir);
    snprintf(sarg, sizeof(sarg), "--listen=%s", spath);
    snprintf(env, sizeof(env), "--setenv=NOTIFY_SOCKET=%s", nl->path);
    char *argv[] = {(char *)ssa, "--seqpacket", sarg, env, bin, "--runtime-dir", d.dir,
                    "--backend", "cpu", NULL};
    d.pid = itest_spawn(d.log, argv);
    int probe = poke(spath, SOCK_SEQPACKET);
    sd_wait_ready(&d, nl, 0);
    close(probe);
    char *log = read_file(d.log);
    CHECK_STR_CONTAINS(log, "socket activation: session socket passed, ZeroMQ socket bound here");
    free(log);
    serve_one_forward(&d);
    itest_daemon_stop(&d);
    nl_close(nl);
}

/* A socket named "session" that is a stream socket is refused at start. */
TEST(socket_activation_refuses_a_socket_of_the_wrong_type)
{
    const char *ssa = find_tool("systemd-socket-activate");
    if (!ssa)
        TEST_SKIP("systemd-socket-activate not found (Debian package systemd)");
    char dir[] = "/tmp/moed-itest.XXXXXX", bin[PATH_MAX], spath[300], sarg[310], logp[300];
    CHECK(mkdtemp(dir) != NULL);
    moed_bin(bin, sizeof(bin));
    snprintf(spath, sizeof(spath), "%s/moed.sock", dir);
    snprintf(sarg, sizeof(sarg), "--listen=%s", spath);
    snprintf(logp, sizeof(logp), "%s/moed.log", dir);
    char *argv[] = {(char *)ssa, sarg, "--fdname=session", bin, "--runtime-dir", dir,
                    "--backend", "cpu", NULL};
    pid_t pid = itest_spawn(logp, argv);
    int probe = poke(spath, SOCK_STREAM);
    int st = wait_exit(pid, 10000);
    close(probe);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "exit status %d", st);
    char *log = read_file(logp);
    CHECK_STR_CONTAINS(log, "passed socket 'session' (fd 3) is not a listening AF_UNIX "
                            "SOCK_SEQPACKET socket");
    free(log);
    itest_rmdir(dir);
}

/* ---- units, users, directories ----------------------------------------------- */

/*
 * The installed units pass systemd-analyze verify without a word (it exits 0
 * even for unknown keys, so silence is the check; ExecStart= names the
 * installed binary and Documentation= the installed man page, so the install
 * is to a real prefix, not a DESTDIR), and security --offline rates the
 * service's exposure at 2.0 or below. moed.sysusers and moed.tmpfiles,
 * applied to a scratch root, make user moed in group moe and the
 * directories with their modes and owners.
 */
TEST(units_verify_and_sysusers_tmpfiles_apply)
{
    const char *sa = find_tool("systemd-analyze");
    if (!sa)
        TEST_SKIP("systemd-analyze not found (Debian package systemd)");
    char out[16384], mk[400], pfx[] = "/tmp/moed-prefix.XXXXXX", root[] = "/tmp/moed-root.XXXXXX";
    CHECK(mkdtemp(pfx) != NULL && mkdtemp(root) != NULL);
    make_prefix(mk, sizeof(mk));
    int rc = sh(out, sizeof(out), "%s install PREFIX=%s SYSCONFDIR=%s/etc", mk, pfx, pfx);
    CHECK_MSG(rc == 0, "make install: %s", out);
    char unit[300];
    snprintf(unit, sizeof(unit), "%s/lib/systemd/system/moed.service", pfx);
    char *u = read_file(unit), want[400];
    snprintf(want, sizeof(want), "ExecStart=%s/sbin/moed --config %s/etc/moed/moed.conf", pfx, pfx);
    CHECK_STR_CONTAINS(u, want);
    CHECK_STR_CONTAINS(u, "Type=notify");
    CHECK_STR_CONTAINS(u, "WatchdogSec=");
    free(u);
    /* verify runs man(1) for Documentation=; without it, that part is off. */
    rc = sh(out, sizeof(out), "MANPATH=%s/share/man %s verify%s %s %s/lib/systemd/system/moed.socket",
            pfx, sa, find_tool("man") ? "" : " --man=no", unit, pfx);
    CHECK_MSG(rc == 0 && out[0] == '\0', "systemd-analyze verify (status %d):\n%s", rc, out);
    rc = sh(out, sizeof(out), "%s security --offline=true --threshold=20 %s | tail -n 1", sa, unit);
    fprintf(stderr, "  %s", out);
    rc = sh(out, sizeof(out), "%s security --offline=true --threshold=20 %s >/dev/null", sa, unit);
    CHECK_MSG(rc == 0, "exposure above 2.0: %s", out);

    const char *su = find_tool("systemd-sysusers"), *tf = find_tool("systemd-tmpfiles");
    if (su && tf) {
        char etc[300];
        snprintf(etc, sizeof(etc), "%s/etc", root);
        CHECK(mkdir(etc, 0755) == 0);
        rc = sh(out, sizeof(out), "%s --root=%s %s/lib/sysusers.d/moed.conf", su, root, pfx);
        CHECK_MSG(rc == 0, "systemd-sysusers: %s", out);
        rc = sh(out, sizeof(out), "%s --root=%s --create %s/lib/tmpfiles.d/moed.conf", tf, root, pfx);
        CHECK_MSG(rc == 0, "systemd-tmpfiles: %s", out);
        unsigned uid = 0, gid = 0, ggid = 1;
        rc = sh(out, sizeof(out), "grep '^moed:' %s/etc/passwd", root);
        CHECK_MSG(rc == 0 && sscanf(out, "moed:x:%u:%u:", &uid, &gid) == 2, "passwd: %s", out);
        CHECK_STR_CONTAINS(out, ":/var/lib/moed:");
        rc = sh(out, sizeof(out), "grep '^moe:' %s/etc/group", root);
        CHECK_MSG(rc == 0 && sscanf(out, "moe:x:%u:", &ggid) == 1, "group: %s", out);
        CHECK_EQ_INT(gid, ggid);
        const char *dirs[] = {"run/moed", "var/lib/moed", "var/lib/moed/weights", "var/cache/moed"};
        const unsigned modes[] = {0750, 0750, 0750, 0750};
        for (size_t i = 0; i < ARRAY_LEN(dirs); i++) {
            char p[400];
            struct stat st;
            snprintf(p, sizeof(p), "%s/%s", root, dirs[i]);
            CHECK_MSG(stat(p, &st) == 0 && S_ISDIR(st.st_mode), "%s missing", p);
            CHECK_MSG((st.st_mode & 07777) == modes[i], "%s mode %o", p, st.st_mode & 07777);
            CHECK_EQ_INT(st.st_uid, uid);
            CHECK_EQ_INT(st.st_gid, gid);
        }
    }
    itest_rmdir(pfx);
    itest_rmdir(root);
}

/* The tree `make install DESTDIR=` writes, exactly; then uninstall. */
TEST(make_install_destdir_tree_and_uninstall)
{
    char out[16384], mk[400], dest[] = "/tmp/moed-dest.XXXXXX", wdir[] = "/tmp/moed-sdw.XXXXXX";
    CHECK(mkdtemp(dest) != NULL && mkdtemp(wdir) != NULL);
    make_prefix(mk, sizeof(mk));
    int rc = sh(out, sizeof(out), "%s install DESTDIR=%s PREFIX=/usr", mk, dest);
    CHECK_MSG(rc == 0, "make install: %s", out);
    rc = sh(out, sizeof(out), "cd %s && find . ! -type d | sort", dest);
    CHECK_STR_EQ(out, "./etc/moed/moed.conf\n"
                      "./usr/bin/moectl\n"
                      "./usr/include/moe.h\n"
                      "./usr/lib/libmoe.a\n"
                      "./usr/lib/libmoe.so\n"
                      "./usr/lib/libmoe.so.0\n"
                      "./usr/lib/pkgconfig/libmoe.pc\n"
                      "./usr/lib/systemd/system/moed.service\n"
                      "./usr/lib/systemd/system/moed.socket\n"
                      "./usr/lib/sysusers.d/moed.conf\n"
                      "./usr/lib/tmpfiles.d/moed.conf\n"
                      "./usr/sbin/moed\n"
                      "./usr/share/man/man1/moectl.1\n"
                      "./usr/share/man/man8/moed.8\n");
    struct {
        const char *path;
        unsigned mode;
    } modes[] = {{"usr/sbin/moed", 0755}, {"usr/bin/moectl", 0755}, {"usr/lib/libmoe.so.0", 0755},
                 {"usr/lib/systemd/system/moed.service", 0644}, {"etc/moed/moed.conf", 0644},
                 {"usr/lib/pkgconfig/libmoe.pc", 0644}, {"usr/share/man/man8/moed.8", 0644}};
    for (size_t i = 0; i < ARRAY_LEN(modes); i++) {
        char p[400];
        struct stat st;
        snprintf(p, sizeof(p), "%s/%s", dest, modes[i].path);
        CHECK(stat(p, &st) == 0);
        CHECK_MSG((st.st_mode & 07777) == modes[i].mode, "%s: mode %o", p, st.st_mode & 07777);
    }
    rc = sh(out, sizeof(out), "readlink %s/usr/lib/libmoe.so", dest);
    CHECK_STR_EQ(out, "libmoe.so.0\n");
    rc = sh(out, sizeof(out), "cat %s/usr/lib/pkgconfig/libmoe.pc", dest);
    CHECK_STR_CONTAINS(out, "prefix=/usr\n");
    CHECK_STR_CONTAINS(out, "libdir=/usr/lib\n");
    rc = sh(out, sizeof(out), "PKG_CONFIG_PATH=%s/usr/lib/pkgconfig pkg-config --modversion libmoe",
            dest);
    CHECK_MSG(rc == 0 && !strcmp(out, MOE_VERSION "\n"), "pkg-config: %s", out);
    rc = sh(out, sizeof(out), "grep ^ExecStart= %s/usr/lib/systemd/system/moed.service", dest);
    CHECK_STR_EQ(out, "ExecStart=/usr/sbin/moed --config /etc/moed/moed.conf\n");
    rc = sh(out, sizeof(out), "%s/usr/sbin/moed --version", dest);
    CHECK_STR_EQ(out, "moed " MOE_VERSION "\n");
    if (find_tool("groff")) {
        rc = sh(out, sizeof(out), "groff -man -ww -z %s/usr/share/man/man8/moed.8 "
                "%s/usr/share/man/man1/moectl.1", dest, dest);
        CHECK_MSG(rc == 0 && out[0] == '\0', "groff: %s", out);
    }
    /* The example configuration is valid once its weight directory exists. */
    rc = sh(out, sizeof(out), "sed 's|/var/lib/moed/weights|%s|' %s/etc/moed/moed.conf > %s/c.conf"
            " && %s/usr/sbin/moed --config %s/c.conf --check-config", wdir, dest, wdir, dest, wdir);
    CHECK_MSG(rc == 0, "the example moed.conf: %s", out);
    /* A second install keeps an edited moed.conf; uninstall removes the
     * rest and keeps that too. */
    rc = sh(out, sizeof(out), "echo '# edited' >> %s/etc/moed/moed.conf && %s install DESTDIR=%s "
            "PREFIX=/usr && tail -n 1 %s/etc/moed/moed.conf", dest, mk, dest, dest);
    CHECK_MSG(rc == 0 && strstr(out, "# edited\n"), "reinstall: %s", out);
    rc = sh(out, sizeof(out), "%s uninstall DESTDIR=%s PREFIX=/usr && cd %s && find . ! -type d",
            mk, dest, dest);
    CHECK_MSG(rc == 0, "make uninstall: %s", out);
    CHECK_STR_EQ(out, "./etc/moed/moed.conf\n");
    itest_rmdir(dest);
    itest_rmdir(wdir);
}

/*
 * Each sandbox directive of moed.service, built by hand (namespaces, mounts,
 * setpriv, a devices cgroup, seccomp filters as systemd makes them) by
 * packaging/hardening/check.sh, leaves the daemon serving checked requests
 * and stopping cleanly: here on the CPU backend (the same script ran on an
 * H200 with CUDA). Root only, where namespaces can be made.
 */
TEST(hardening_directives_leave_the_daemon_working)
{
    char out[16384], dir[300], bin[PATH_MAX], ctl[PATH_MAX];
    if (geteuid() != 0)
        TEST_SKIP("not root: the sandbox is built with mounts, namespaces and setpriv");
    const char *need[] = {"unshare", "setpriv", "python3", "cc", "systemd-analyze"};
    for (size_t i = 0; i < ARRAY_LEN(need); i++)
        if (!find_tool(need[i]))
            TEST_SKIP("%s not found", need[i]);
    if (sh(out, sizeof(out), "unshare -m -n true") != 0)
        TEST_SKIP("cannot make mount and network namespaces here: %s", out);
    /* Not under /tmp, which the sandbox replaces (PrivateTmp=). */
    snprintf(dir, sizeof(dir), "%s/hardening", itest_build());
    CHECK(mkdir(dir, 0755) == 0 || errno == EEXIST);
    moed_bin(bin, sizeof(bin));
    snprintf(ctl, sizeof(ctl), "%s/moectl", itest_build());
    int rc = sh(out, sizeof(out), "cc -O2 -o %s/seccomp-exec packaging/hardening/seccomp-exec.c && "
                "python3 packaging/hardening/syscalls.py > %s/allow.txt", dir, dir);
    CHECK_MSG(rc == 0, "building the helpers: %s", out);
    /* In a sanitizer build, LeakSanitizer's exit-time scan (it stops the
     * threads through ptrace) is what the sandbox forbids: turn only that
     * off; the address and undefined-behaviour checks stay. */
    rc = sh(out, sizeof(out),
            "ASAN_OPTIONS=detect_leaks=0 packaging/hardening/check.sh cpu %s %s %s/seccomp-exec "
            "%s/allow.txt", bin, ctl, dir, dir);
    /* Indented: tests/run.sh counts lines that start with PASS and FAIL. */
    for (char *line = out; line && *line;) {
        char *nl = strchr(line, '\n');
        fprintf(stderr, "  %.*s\n", nl ? (int)(nl - line) : (int)strlen(line), line);
        line = nl ? nl + 1 : NULL;
    }
    CHECK_MSG(rc == 0 && !strstr(out, "\nFAIL "), "a directive broke the daemon");
    CHECK_STR_CONTAINS(out, "\nPASS all (");
    int passes = 0;
    for (const char *p = out; (p = strstr(p, "\nPASS ")); p++)
        passes++;
    CHECK_MSG(passes >= 10, "only %d cases passed", passes);
    itest_rmdir(dir);
}

/* ---- the Debian package ---------------------------------------------------------- */

static void deb_install_remove(const char *deb)
{
    char out[65536];
    int rc = sh(out, sizeof(out), "dpkg -i %s", deb);
    CHECK_MSG(rc == 0, "dpkg -i: %s", out);
    const char *files[] = {"/usr/sbin/moed", "/usr/bin/moectl", "/usr/include/moe.h",
                           "/usr/lib/systemd/system/moed.service",
                           "/usr/lib/systemd/system/moed.socket", "/usr/lib/sysusers.d/moed.conf",
                           "/usr/lib/tmpfiles.d/moed.conf", "/etc/moed/moed.conf",
                           "/usr/share/man/man8/moed.8.gz"};
    for (size_t i = 0; i < ARRAY_LEN(files); i++)
        CHECK_MSG(exists(files[i]), "%s not installed", files[i]);
    rc = sh(out, sizeof(out), "/usr/sbin/moed --version && moectl --help >/dev/null");
    CHECK_MSG(rc == 0, "installed binaries: %s", out);
    /* postinst ran systemd-sysusers and systemd-tmpfiles. */
    struct passwd *pw = getpwnam("moed");
    struct group *gr = getgrnam("moe");
    CHECK_MSG(pw && gr, "user moed or group moe missing after dpkg -i");
    CHECK_EQ_INT(pw->pw_gid, gr->gr_gid);
    struct stat st;
    CHECK(stat("/var/lib/moed/weights", &st) == 0);
    CHECK_EQ_INT(st.st_uid, pw->pw_uid);
    CHECK_EQ_INT(st.st_mode & 07777, 0750);
    CHECK(stat("/run/moed", &st) == 0 && (st.st_mode & 07777) == 0750);
    rc = sh(out, sizeof(out), "/usr/sbin/moed --config /etc/moed/moed.conf --check-config");
    CHECK_MSG(rc == 0, "the installed configuration: %s", out);

    rc = sh(out, sizeof(out), "dpkg -r moed");
    CHECK_MSG(rc == 0, "dpkg -r: %s", out);
    CHECK(!exists("/usr/sbin/moed") && !exists("/usr/lib/systemd/system/moed.service"));
    CHECK(exists("/etc/moed/moed.conf")); /* a conffile: kept until purge */
    rc = sh(out, sizeof(out), "dpkg-query -W -f='${Status}' moed");
    CHECK_STR_EQ(out, "deinstall ok config-files");
    rc = sh(out, sizeof(out), "dpkg --purge moed");
    CHECK_MSG(rc == 0, "dpkg --purge: %s", out);
    rc = sh(out, sizeof(out), "dpkg-deb -c %s | awk '{print $6}' | sed 's|^\\.||' | "
            "while read -r f; do [ -f \"$f\" ] || [ -L \"$f\" ] && echo \"$f\"; done; "
            "ls -d /etc/moed /var/lib/moed /etc/systemd/system/moed.* "
            "/etc/systemd/system/*.wants/moed.* 2>/dev/null; true", deb);
    CHECK_MSG(out[0] == '\0', "left after purge:\n%s", out);
}

/*
 * make deb builds the package; dpkg-deb -c lists every installed file;
 * dpkg -i installs it (and its maintainer scripts make the user, group and
 * directories); dpkg -r removes it but the conffile; dpkg --purge leaves
 * nothing. Root only, and only where no moed is installed already. The
 * user and group the package made are deleted at the end (Debian's own
 * scripts keep them).
 */
TEST(deb_builds_lists_installs_and_removes)
{
    char out[65536], mk[400], deb[400] = "";
    if (geteuid() != 0)
        TEST_SKIP("not root: dpkg -i cannot run (the build and listing need root too here)");
    if (!find_tool("dpkg-deb") || !find_tool("dpkg") || !find_tool("dpkg-architecture"))
        TEST_SKIP("dpkg-deb, dpkg or dpkg-architecture (Debian package dpkg-dev) not found");
    sh(out, sizeof(out), "dpkg-query -W -f='${Status}' moed");
    if (strstr(out, "installed") || strstr(out, "config-files"))
        TEST_SKIP("a moed package is on this machine (%s); not touching it", out);
    if (exists("/usr/sbin/moed") || exists("/etc/moed"))
        TEST_SKIP("/usr/sbin/moed or /etc/moed exists on this machine; not overwriting it");
    make_prefix(mk, sizeof(mk));
    int rc = sh(out, sizeof(out), "%s deb", mk);
    CHECK_MSG(rc == 0, "make deb: %s", out);
    char *b = !strncmp(out, "built ", 6) ? out : strstr(out, "\nbuilt ");
    b = b && b != out ? b + 1 : b;
    CHECK_MSG(b && sscanf(b, "built %399s", deb) == 1 && strstr(deb, ".deb"),
              "make deb said: %s", out);
    fprintf(stderr, "  %s", b);

    char ma[64] = "";
    sh(ma, sizeof(ma), "dpkg-architecture -qDEB_HOST_MULTIARCH");
    ma[strcspn(ma, "\n")] = '\0';
    rc = sh(out, sizeof(out), "dpkg-deb -c %s", deb);
    CHECK_MSG(rc == 0, "dpkg-deb -c: %s", out);
    char want[64][160];
    int nw = 0;
    const char *plain[] = {"./usr/sbin/moed", "./usr/bin/moectl", "./usr/include/moe.h",
                           "./usr/lib/systemd/system/moed.service",
                           "./usr/lib/systemd/system/moed.socket", "./usr/lib/sysusers.d/moed.conf",
                           "./usr/lib/tmpfiles.d/moed.conf", "./etc/moed/moed.conf",
                           "./usr/share/man/man8/moed.8.gz", "./usr/share/man/man1/moectl.1.gz",
                           "./usr/share/doc/moed/copyright"};
    for (size_t i = 0; i < ARRAY_LEN(plain); i++)
        snprintf(want[nw++], sizeof(want[0]), " %s\n", plain[i]);
    const char *libs[] = {"libmoe.so.0\n", "libmoe.a\n", "libmoe.so -> libmoe.so.0\n",
                          "pkgconfig/libmoe.pc\n"};
    for (size_t i = 0; i < ARRAY_LEN(libs); i++)
        snprintf(want[nw++], sizeof(want[0]), " ./usr/lib/%s/%s", ma, libs[i]);
    for (int i = 0; i < nw; i++)
        CHECK_MSG(strstr(out, want[i]), "dpkg-deb -c lacks%s", want[i]);
    CHECK_MSG(!strstr(out, " ./DEBIAN"), "DEBIAN/ in the data");
    for (char *line = out; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        CHECK_MSG(!strncmp(strchr(line, ' ') + 1, "root/root ", 10), "not owned by root: %.100s",
                  line);
    rc = sh(out, sizeof(out), "dpkg-deb -f %s Depends", deb);
    CHECK_STR_CONTAINS(out, "libzmq5");
    CHECK_STR_CONTAINS(out, "systemd");
    rc = sh(out, sizeof(out), "dpkg-deb -I %s conffiles", deb);
    CHECK_STR_EQ(out, "/etc/moed/moed.conf\n");

    /* Install and remove in a child, so that the package, user and group
     * go whatever it finds. */
    bool had_user = getpwnam("moed") != NULL, had_group = getgrnam("moe") != NULL;
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        deb_install_remove(deb);
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    sh(out, sizeof(out), "dpkg --purge moed");
    if (!had_user)
        sh(out, sizeof(out), "userdel moed");
    if (!had_group)
        sh(out, sizeof(out), "groupdel moe");
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "install/remove failed (status %d)", st);
    unlink(deb);
}

/* The command line's numbers are held to the bounds the file's are: out of
 * them, or not numbers, they are refused (status 2), naming the option. */
TEST(option_numbers_out_of_bounds_are_refused)
{
    char bin[PATH_MAX], out[4096];
    moed_bin(bin, sizeof(bin));
    const char *bad[][2] = {
        {"--threads abc", "--threads"},
        {"--threads -1", "--threads"},
        {"--threads 1025", "--threads"},
        {"--max-batch-tokens 0", "--max-batch-tokens"},
        {"--max-batch-tokens 1048577", "--max-batch-tokens"},
        {"--max-delay-us 10000001", "--max-delay-us"},
        {"--max-slice-tokens 16777217", "--max-slice-tokens"},
        {"--spin-us 100001", "--spin-us"},
        {"--return-wait-us 1000001", "--return-wait-us"},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        int rc = sh(out, sizeof(out), "%s %s --check-config", bin, bad[i][0]);
        CHECK_MSG(rc == 2, "%s: status %d: %s", bad[i][0], rc, out);
        CHECK_MSG(strstr(out, bad[i][1]) != NULL, "%s said: %s", bad[i][0], out);
    }
    int rc = sh(out, sizeof(out),
                "%s --threads 1024 --max-batch-tokens 1048576 --max-delay-us 10000000 "
                "--max-slice-tokens 16777216 --check-config", bin);
    CHECK_MSG(rc == 0, "the bounds themselves: status %d: %s", rc, out);
}

/* A number on the command line is decimal digits, as in the file: no
 * leading space or sign (strtoul would read " 5" and "+5" as 5, and wrap
 * "-18446744073709551615" round to 1). */
TEST(option_numbers_are_plain_decimal_digits)
{
    char bin[PATH_MAX], out[4096];
    moed_bin(bin, sizeof(bin));
    const char *bad[][2] = {
        {"--threads ' 5'", "--threads"},
        {"--threads +5", "--threads"},
        {"--threads -18446744073709551615", "--threads"},
        {"--max-batch-tokens +64", "--max-batch-tokens"},
        {"--max-delay-us -0", "--max-delay-us"},
        {"--max-slice-tokens ' 64'", "--max-slice-tokens"},
        {"--spin-us -18446744073709551615", "--spin-us"},
        {"--return-wait-us +1", "--return-wait-us"},
        {"--backend cpu --virtual-devices +2", "--virtual-devices"},
        {"--io-threads +2", "--io-threads"},
        {"--gpus +1", "--gpus"},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        int rc = sh(out, sizeof(out), "%s %s --check-config", bin, bad[i][0]);
        CHECK_MSG(rc != 0, "%s: accepted: %s", bad[i][0], out);
        CHECK_MSG(strstr(out, bad[i][1]) != NULL, "%s said: %s", bad[i][0], out);
    }
}

/* What the configuration file refuses, the command line refuses too, and
 * --check-config says so (status 1, naming the option) instead of passing
 * a configuration the daemon cannot start with: an unknown backend, a
 * runtime directory that is relative, empty, or too long for its sockets'
 * names (however it was given). --virtual-devices without the CPU backend
 * is a bad command line (status 2) for the check too. */
TEST(check_config_refuses_what_the_start_would)
{
    char bin[PATH_MAX], out[4096], wdir[] = "/tmp/moed-sdw.XXXXXX", conf[64], longdir[160];
    CHECK(mkdtemp(wdir) != NULL);
    moed_bin(bin, sizeof(bin));
    snprintf(conf, sizeof(conf), "%s/c.conf", wdir);
    /* 98 characters: its moed.sock would need 109 bytes of a sun_path's 108 */
    snprintf(longdir, sizeof(longdir), "/tmp/%093d", 0);
    CHECK_EQ_INT(strlen(longdir), 98);
    struct {
        const char *env, *args;
        int rc;
        const char *says;
    } cases[] = {
        {"", "--backend gpu", 1, "--backend gpu"},
        {"", "--backend ''", 1, "--backend"},
        {"", "--runtime-dir relative/run", 1, "--runtime-dir relative/run"},
        {"", "--runtime-dir ''", 1, "--runtime-dir"},
        {"", "--runtime-dir $LONGDIR", 1, "--runtime-dir /tmp/0000"},
        {"MOED_RUNTIME_DIR=$LONGDIR", "", 1, "/tmp/0000"},
        {"MOED_RUNTIME_DIR=relative/run", "", 1, "relative/run"},
        {"", "--config $CONF", 1, "line 2: bad value"},
        {"", "--config ''", 2, "--config needs a file name"},
        {"", "--backend cuda --virtual-devices 2", 2, "--virtual-devices"},
    };
    write_file(conf, "[daemon]\nruntime_dir = %s\n", longdir);
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        int rc = sh(out, sizeof(out), "LONGDIR=%s CONF=%s; env %s %s %s --check-config", longdir,
                conf, cases[i].env, bin, cases[i].args);
        CHECK_MSG(rc == cases[i].rc, "%s %s: status %d: %s", cases[i].env, cases[i].args, rc, out);
        CHECK_MSG(strstr(out, cases[i].says), "%s %s said: %s", cases[i].env, cases[i].args, out);
    }
    /* The longest that fits is taken. */
    longdir[97] = '\0';
    int rc = sh(out, sizeof(out), "%s --runtime-dir %s --backend cpu --check-config", bin, longdir);
    CHECK_MSG(rc == 0, "97 characters: status %d: %s", rc, out);
    /* A gpus list the CPU backend cannot honour is said to be ignored. */
    rc = sh(out, sizeof(out), "%s --backend cpu --gpus 0 --check-config", bin);
    CHECK_MSG(rc == 0 && strstr(out, "gpus is ignored"), "--gpus with the CPU backend: "
              "status %d: %s", rc, out);
    rc = sh(out, sizeof(out), "%s --backend cpu --check-config", bin);
    CHECK_MSG(rc == 0 && !strstr(out, "gpus"), "the CPU backend alone: status %d: %s", rc, out);
    itest_rmdir(wdir);
}

/* ---- configuration and logging ------------------------------------------------ */

TEST(check_config_validates_and_exits)
{
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-sdw.XXXXXX", conf[64], fa[64], out[4096], bin[PATH_MAX];
    CHECK(mkdtemp(wdir) != NULL);
    moed_bin(bin, sizeof(bin));
    snprintf(conf, sizeof(conf), "%s/c.conf", wdir);
    snprintf(fa, sizeof(fa), "%s/a.safetensors", wdir);
    struct itest_layer A = layer_def("alpha", 4, 2, 32, 48);
    layer_file(&A, fa, "m.", &seed);
    char other[80], nowhere[80], missing[80];
    snprintf(other, sizeof(other), "%s/other", wdir);
    snprintf(nowhere, sizeof(nowhere), "%s/nowhere", wdir);
    snprintf(missing, sizeof(missing), "%s.missing", fa);
    CHECK(mkdir(other, 0755) == 0);
    const char *layer = "[daemon]\nallowed_dirs = %s\ndevice = 1\n"
                        "[layer a]\nfile = %s\nprefix = m.\ntopk = 2\n";
    struct {
        const char *body, *allowed, *file;
        int rc;
        const char *says;
    } cases[] = {
        {layer, wdir, fa, 0, "configuration OK: 1 allowed directories, 1 layers"},
        {"[daemon]\nallowed_dirs = %s\nbogus = 1\n# %s\n", wdir, fa, 1,
         "line 3: unknown key 'bogus' in [daemon]"},
        {layer, nowhere, fa, 1, "line 2: bad value"},
        {"[daemon]\nallowed_dirs = %s\n[layer a]\nfile = %s\nprefix = m.\n", wdir, fa, 1,
         "layer 'a': topk is required"},
        {"[daemon]\nallowed_dirs = %s\n[layer a]\nfile = %s\nprefix = x.\ntopk = 2\n", wdir,
         fa, 1, "layer 'a': no tensor x.experts.0.w1.weight"},
        {layer, other, fa, 1, "layer 'a': "},   /* outside the allowed directories */
        {layer, wdir, missing, 1, "layer 'a': "},
    };
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        write_file(conf, cases[i].body, cases[i].allowed, cases[i].file);
        int rc = sh(out, sizeof(out), "%s --config %s --check-config", bin, conf);
        CHECK_MSG(rc == cases[i].rc, "case %zu: status %d: %s", i, rc, out);
        CHECK_MSG(strstr(out, cases[i].says), "case %zu said: %s", i, out);
    }
    itest_layer_free(&A);
    itest_rmdir(wdir);
}

/* Under journald (JOURNAL_STREAM names stderr) lines carry <N> priority
 * prefixes; --log-level filters. */
TEST(journal_prefixes_and_log_level)
{
    char dir[] = "/tmp/moed-itest.XXXXXX", logp[300], bin[PATH_MAX];
    CHECK(mkdtemp(dir) != NULL);
    moed_bin(bin, sizeof(bin));
    snprintf(logp, sizeof(logp), "%s/moed.log", dir);
    for (int pass = 0; pass < 2; pass++) {
        int fd = open(logp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        struct stat st;
        CHECK(fd >= 0 && fstat(fd, &st) == 0);
        char js[64];
        snprintf(js, sizeof(js), "%llu:%llu", (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
        fflush(stderr);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGTERM);
            dup2(fd, 2);
            setenv("JOURNAL_STREAM", js, 1);
            unsetenv("NOTIFY_SOCKET");
            execl(bin, bin, "--runtime-dir", dir, "--backend", "cpu", "--log-level",
                  pass ? "notice" : "info", (char *)NULL);
            _exit(127);
        }
        close(fd);
        struct itest_daemon d = {.pid = pid};
        snprintf(d.dir, sizeof(d.dir), "%s", dir);
        moe_client *c = NULL;
        for (int i = 0; i < 300 && moe_connect(dir, "probe", &c) != 0; i++)
            itest_sleep_ms(20);
        CHECK(c != NULL);
        moe_disconnect(&c);
        kill(pid, SIGTERM);
        int stt = wait_exit(pid, 12000);
        CHECK(WIFEXITED(stt) && WEXITSTATUS(stt) == 0);
        char *log = read_file(logp);
        CHECK_STR_CONTAINS(log, "<5>stopping: draining 0 pending requests\n");
        CHECK_MSG(!strstr(log, "moed: "), "unprefixed line under journald: %s", log);
        if (pass == 0)
            CHECK_STR_CONTAINS(log, "<6>moed " MOE_VERSION " serving on ");
        else
            CHECK_MSG(!strstr(log, "<6>"), "info line at --log-level notice: %s", log);
        free(log);
    }
    itest_rmdir(dir);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE_TIMEOUT(notify_ready_watchdog_reload_stopping_in_order, 60),
        TEST_CASE_TIMEOUT(reload_places_layers_on_their_devices, 60),
        TEST_CASE_TIMEOUT(reload_loads_past_max_loads_and_names_what_it_refuses, 60),
        TEST_CASE_TIMEOUT(reload_keeps_a_layer_whose_new_load_would_fail, 60),
        TEST_CASE_TIMEOUT(reload_applies_new_allowed_dirs, 60),
        TEST_CASE_TIMEOUT(reload_keeps_a_changed_layer_when_max_layers_leaves_no_room, 60),
        TEST_CASE_TIMEOUT(reload_serves_a_layer_again_when_its_new_load_fails, 60),
        TEST_CASE_TIMEOUT(reload_does_not_serve_a_layer_again_from_a_replaced_file, 60),
        TEST_CASE_TIMEOUT(reload_parses_headers_off_the_loop, 120),
        TEST_CASE(demo_weights_stay_loadable_after_a_reload),
        TEST_CASE_TIMEOUT(a_reload_does_not_use_up_clients_loads, 120),
        TEST_CASE_TIMEOUT(a_stop_during_the_initial_load_ends_it, 90),
        TEST_CASE_TIMEOUT(watchdog_pings_stop_while_one_batch_runs_too_long, 90),
        TEST_CASE_TIMEOUT(socket_activation_passes_both_named_sockets, 30),
        TEST_CASE_TIMEOUT(socket_activation_session_only_binds_zmq_itself, 30),
        TEST_CASE_TIMEOUT(socket_activation_refuses_a_socket_of_the_wrong_type, 30),
        TEST_CASE_TIMEOUT(units_verify_and_sysusers_tmpfiles_apply, 60),
        TEST_CASE_TIMEOUT(make_install_destdir_tree_and_uninstall, 60),
        TEST_CASE_TIMEOUT(hardening_directives_leave_the_daemon_working, 240),
        TEST_CASE_TIMEOUT(deb_builds_lists_installs_and_removes, 90),
        TEST_CASE_TIMEOUT(check_config_validates_and_exits, 30),
        TEST_CASE(option_numbers_out_of_bounds_are_refused),
        TEST_CASE(option_numbers_are_plain_decimal_digits),
        TEST_CASE(check_config_refuses_what_the_start_would),
        TEST_CASE_TIMEOUT(journal_prefixes_and_log_level, 30),
        {0}});
}
