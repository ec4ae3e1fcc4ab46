/*
 * itest.h: helpers for integration tests: start the real moed binary in a
 * temporary runtime directory, stop it (SIGTERM, expecting a clean exit 0),
 * and build layers with random weights uploaded through libmoe, with the
 * reference result computed here for comparison.
 *
 * The daemon binary is $BUILD/moed (BUILD defaults to "build"), run from the
 * repository root as `make test` does.
 */
#ifndef MOE_ITEST_H
#define MOE_ITEST_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/moe.h"
#include "kernels/moe_kernels.h"
#include "tests/harness.h"

struct itest_daemon {
    pid_t pid;
    char dir[256];
    char log[300];
};

/* Run a shell command and capture its standard output (and standard error
 * when err_too) into buf, echoed to the test's log; its exit status. */
static inline int itest_run_cmd(bool err_too, char *buf, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline int itest_run_cmd(bool err_too, char *buf, size_t len, const char *fmt, ...)
{
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    if (err_too)
        strncat(cmd, " 2>&1", sizeof(cmd) - strlen(cmd) - 1);
    FILE *p = popen(cmd, "r");
    CHECK(p != NULL);
    size_t n = fread(buf, 1, len - 1, p);
    buf[n] = '\0';
    int st = pclose(p);
    fprintf(stderr, "  $ %s\n%s", cmd, buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* The backend under test: $MOE_TEST_BACKEND (cpu, the default, or cuda on
 * a GPU machine). */
static inline const char *itest_backend(void)
{
    const char *b = getenv("MOE_TEST_BACKEND");
    return b && b[0] ? b : "cpu";
}

static inline bool itest_on_gpu(void)
{
    return strcmp(itest_backend(), "cpu") != 0;
}

/* The CUDA kernels compute bf16 and fp16 only: an fp32 case becomes fp16
 * there (same checks, the dtype's own tolerance). */
static inline moe_dtype itest_dt(moe_dtype dt)
{
    return itest_on_gpu() && dt == MOE_DTYPE_FP32 ? MOE_DTYPE_FP16 : dt;
}

static inline const char *itest_build(void)
{
    const char *b = getenv("BUILD");
    return b && b[0] ? b : "build";
}

static inline uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline void itest_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The case's config file (moed --config): made by its first
 * itest_write_conf, written over by later ones, removed as the case ends. */
#define ITEST_CONF_PATH_MAX 64
static inline char *itest_conf_path(void)
{
    static char path[ITEST_CONF_PATH_MAX];
    return path;
}

static inline void itest_conf_remove(void)
{
    unlink(itest_conf_path());
}

static inline const char *itest_write_conf(const char *text)
{
    char *path = itest_conf_path();
    int fd;
    if (!path[0]) {
        snprintf(path, ITEST_CONF_PATH_MAX, "/tmp/moed-itest-conf.XXXXXX");
        fd = mkstemp(path);
        CHECK_MSG(fd >= 0, "mkstemp: %s", strerror(errno));
        test_on_exit(itest_conf_remove);
    } else {
        fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC);
        CHECK_MSG(fd >= 0, "%s: %s", path, strerror(errno));
    }
    const size_t n = strlen(text);
    CHECK(write(fd, text, n) == (ssize_t)n && close(fd) == 0);
    return path;
}

static inline void itest_daemon_spawn(struct itest_daemon *d, bool reuse_dir, va_list ap)
{
    const char *argv[64];
    int argc = 0;
    char bin[256];
    if (!reuse_dir) {
        snprintf(d->dir, sizeof(d->dir), "/tmp/moed-itest.XXXXXX");
        CHECK(mkdtemp(d->dir) != NULL);
    }
    snprintf(d->log, sizeof(d->log), "%s/moed.log", d->dir);
    snprintf(bin, sizeof(bin), "%s/moed", itest_build());
    argv[argc++] = bin;
    argv[argc++] = "--runtime-dir";
    argv[argc++] = d->dir;
    argv[argc++] = "--backend";
    argv[argc++] = itest_backend();
    argv[argc++] = "--log-level";
    argv[argc++] = "debug";
    const char *a;
    while ((a = va_arg(ap, const char *)) != NULL && argc < 62)
        argv[argc++] = a;
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
        unsetenv("NOTIFY_SOCKET");
        unsetenv("LISTEN_FDS");
        /* A test that fails (or dies) before stopping it leaves no daemon
         * behind. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1)
            _exit(127);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; i < 300; i++) {
        moe_client *c = NULL;
        if (moe_connect(d->dir, "itest-probe", &c) == 0) {
            moe_disconnect(&c);
            return;
        }
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            char cmd[400];
            snprintf(cmd, sizeof(cmd), "cat %s >&2", d->log);
            if (system(cmd) < 0) {}
            FAIL_AT("moed exited during start-up (status %d)", st);
        }
        itest_sleep_ms(20);
    }
    FAIL_AT("moed did not start within 6 s");
}

/* Start moed with extra arguments (NULL-terminated list) in a new runtime
 * directory; waits until a client can connect. Fails the test on error. */
static inline void itest_daemon_start(struct itest_daemon *d, ...)
{
    va_list ap;
    va_start(ap, d);
    itest_daemon_spawn(d, false, ap);
    va_end(ap);
}

/* Start moed again in the runtime directory of a daemon that stopped. */
static inline void itest_daemon_restart(struct itest_daemon *d, ...)
{
    va_list ap;
    va_start(ap, d);
    itest_daemon_spawn(d, true, ap);
    va_end(ap);
}

/* True while the daemon process runs. */
static inline bool itest_daemon_alive(struct itest_daemon *d)
{
    int st;
    return waitpid(d->pid, &st, WNOHANG) == 0;
}

static inline void itest_rmdir(const char *dir)
{
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) < 0) {}
}

/* A daemon sent SIGTERM: expect exit status 0 within 10 s. */
static inline void itest_daemon_wait_stopped(struct itest_daemon *d)
{
    int st = 0;
    for (int i = 0; i < 500; i++) {
        if (waitpid(d->pid, &st, WNOHANG) == d->pid)
            break;
        itest_sleep_ms(20);
        if (i == 499) {
            kill(d->pid, SIGKILL);
            waitpid(d->pid, &st, 0);
            FAIL_AT("moed did not stop within 10 s of SIGTERM");
        }
    }
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "moed exit status %d", st);
}

/* SIGTERM, then expect exit status 0 within 10 s; the runtime directory
 * stays. */
static inline void itest_daemon_stop_keep(struct itest_daemon *d)
{
    CHECK_MSG(itest_daemon_alive(d), "moed died during the test; log in %s", d->log);
    kill(d->pid, SIGTERM);
    itest_daemon_wait_stopped(d);
}

/* SIGTERM, expect exit status 0, remove the runtime directory. */
static inline void itest_daemon_stop(struct itest_daemon *d)
{
    itest_daemon_stop_keep(d);
    itest_rmdir(d->dir);
}

/* SIGKILL: the daemon dies as a crash would kill it; the runtime
 * directory stays (with its stale socket files). */
static inline void itest_daemon_kill(struct itest_daemon *d)
{
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
}

/* Run argv[0] (a path) with argv, its output in log, dying with the test
 * (SIGTERM) and without the socket activation or notify socket that the
 * test may have in its environment; its pid. */
static inline pid_t itest_spawn(const char *log, char *const *argv)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        unsetenv("LISTEN_FDS");
        unsetenv("LISTEN_PID");
        unsetenv("LISTEN_FDNAMES");
        unsetenv("NOTIFY_SOCKET");
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static inline moe_client *itest_connect(struct itest_daemon *d, const char *name)
{
    moe_client *c = NULL;
    int rc = moe_connect(d->dir, name, &c);
    CHECK_MSG(rc == 0, "connect: %s", moe_errmsg());
    return c;
}

static inline moek_dtype itest_kdt(moe_dtype dt)
{
    return dt == MOE_DTYPE_BF16 ? MOEK_DTYPE_BF16 : dt == MOE_DTYPE_FP16 ? MOEK_DTYPE_FP16
                                                                          : MOEK_DTYPE_FP32;
}

static inline double itest_tolerance(moe_dtype dt)
{
    return dt == MOE_DTYPE_BF16 ? 1e-2 : dt == MOE_DTYPE_FP16 ? 2e-3 : 1e-4;
}

/* Fill n elements of dtype dt with uniform values in [-scale, scale). */
static inline void itest_fill(uint64_t *seed, moe_dtype dt, void *dst, size_t n, float scale)
{
    float *tmp = calloc(n + 1, sizeof(float));
    CHECK(tmp != NULL);
    for (size_t i = 0; i < n; i++)
        tmp[i] = test_randf(seed) * scale;
    moek_from_f32(itest_kdt(dt), tmp, dst, n);
    free(tmp);
}

/* A MoE layer with random weights uploaded from a region; the host copies
 * are kept for the reference. */
struct itest_layer {
    char name[64];
    moe_dtype dt;
    moek_moe_shape sh;
    moe_routing routing;
    bool renorm;
    void *w1, *w3, *w2;
    /* Optional: spread the experts over devices (see moe_layer_desc). */
    const uint32_t *devices, *expert_device;
    size_t n_devices, n_expert_device;
};

/* itest_layer_upload's load, returning moe_layer_load's result (info
 * filled on success; the host copies of the weights are kept either way). */
static inline int itest_layer_try_upload(moe_client *c, struct itest_layer *L, uint64_t *seed,
                                         moe_layer_info *info)
{
    L->dt = itest_dt(L->dt);
    size_t es = moe_dtype_size(L->dt);
    size_t E = (size_t)L->sh.experts, H = (size_t)L->sh.hidden, I = (size_t)L->sh.intermediate;
    size_t n = E * H * I, bytes = n * es;
    moe_region *r = NULL;
    CHECK_MSG(moe_region_create(c, 3 * bytes, "weights", &r) == 0, "%s", moe_errmsg());
    uint8_t *base = moe_region_data(r);
    itest_fill(seed, L->dt, base, n, 1.7320508f / sqrtf((float)H));
    itest_fill(seed, L->dt, base + bytes, n, 1.7320508f / sqrtf((float)H));
    itest_fill(seed, L->dt, base + 2 * bytes, n, 1.7320508f / sqrtf((float)I));
    L->w1 = malloc(bytes);
    L->w3 = malloc(bytes);
    L->w2 = malloc(bytes);
    CHECK(L->w1 && L->w3 && L->w2);
    memcpy(L->w1, base, bytes);
    memcpy(L->w3, base + bytes, bytes);
    memcpy(L->w2, base + 2 * bytes, bytes);
    moe_layer_desc d = {
        .name = L->name, .kind = MOE_LAYER_MOE, .dtype = L->dt,
        .experts = (uint32_t)E, .topk = (uint32_t)L->sh.topk, .hidden = (uint32_t)H,
        .intermediate = (uint32_t)I, .routing = L->routing, .renormalize = L->renorm,
        .w1 = moe_tensor_3d(r, 0, L->dt, E, I, H),
        .w3 = moe_tensor_3d(r, bytes, L->dt, E, I, H),
        .w2 = moe_tensor_3d(r, 2 * bytes, L->dt, E, H, I),
        .devices = L->devices, .n_devices = L->n_devices,
        .expert_device = L->expert_device, .n_expert_device = L->n_expert_device,
    };
    int rc = moe_layer_load(c, &d, info);
    moe_region_free(c, &r);
    return rc;
}

static inline void itest_layer_upload(moe_client *c, struct itest_layer *L, uint64_t *seed)
{
    moe_layer_info info;
    int rc = itest_layer_try_upload(c, L, seed, &info);
    CHECK_MSG(rc == 0, "load %s: %s", L->name, moe_errmsg());
    CHECK_EQ_INT(info.experts, L->sh.experts);
}

static inline void itest_layer_free(struct itest_layer *L)
{
    free(L->w1);
    free(L->w3);
    free(L->w2);
}

/* Inputs and output of one forward in one region:
 * x [T,H] | logits [T,E] fp32 or ids [T,k] int32 + weights [T,k] | out [T,H]. */
struct itest_fwd {
    moe_region *r;
    size_t T;
    size_t x_off, l_off, i_off, w_off, o_off;
    moe_forward_args args;
};

static inline size_t itest_align(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

static inline void itest_fwd_make(moe_client *c, const struct itest_layer *L, size_t T,
                                  uint64_t *seed, struct itest_fwd *f)
{
    size_t es = moe_dtype_size(L->dt), H = (size_t)L->sh.hidden, E = (size_t)L->sh.experts,
           K = (size_t)L->sh.topk;
    memset(f, 0, sizeof(*f));
    f->T = T;
    f->x_off = 0;
    f->l_off = itest_align(T * H * es);
    f->i_off = f->l_off + itest_align(T * E * 4);
    f->w_off = f->i_off + itest_align(T * K * 4);
    f->o_off = f->w_off + itest_align(T * K * 4);
    size_t size = f->o_off + itest_align(T * H * es);
    CHECK_MSG(moe_region_create(c, size, "fwd", &f->r) == 0, "%s", moe_errmsg());
    uint8_t *b = moe_region_data(f->r);
    itest_fill(seed, L->dt, b + f->x_off, T * H, 1.7f);
    float *lg = (float *)(b + f->l_off);
    for (size_t i = 0; i < T * E; i++)
        lg[i] = test_randf(seed) * 3.0f;
    int32_t *ids = (int32_t *)(b + f->i_off);
    float *w = (float *)(b + f->w_off);
    for (size_t t = 0; t < T; t++)
        for (size_t j = 0; j < K; j++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(test_rand(seed) % E);
                dup = false;
                for (size_t q = 0; q < j; q++)
                    dup |= ids[t * K + q] == e;
            } while (dup);
            ids[t * K + j] = e;
            w[t * K + j] = 0.1f + (test_randf(seed) + 1.0f) * 0.5f;
        }
    memset(b + f->o_off, 0xff, T * H * es);
    f->args.layer = L->name;
    f->args.x = moe_tensor_2d(f->r, f->x_off, L->dt, T, H);
    f->args.out = moe_tensor_2d(f->r, f->o_off, L->dt, T, H);
    if (L->routing == MOE_ROUTING_GIVEN) {
        f->args.topk_ids = moe_tensor_2d(f->r, f->i_off, MOE_DTYPE_INT32, T, K);
        f->args.topk_weights = moe_tensor_2d(f->r, f->w_off, MOE_DTYPE_FP32, T, K);
    } else {
        f->args.logits = moe_tensor_2d(f->r, f->l_off, MOE_DTYPE_FP32, T, E);
    }
}

/* Relative error of f's output against the reference. */
static inline double itest_fwd_error(const struct itest_layer *L, const struct itest_fwd *f)
{
    size_t T = f->T, H = (size_t)L->sh.hidden, K = (size_t)L->sh.topk,
           es = moe_dtype_size(L->dt);
    const uint8_t *b = moe_region_data(f->r);
    int32_t *ids = malloc(T * K * 4);
    float *w = malloc(T * K * 4);
    void *ref = malloc(T * H * es);
    float *g = malloc(T * H * 4), *rf = malloc(T * H * 4);
    CHECK(ids && w && ref && g && rf);
    if (L->routing == MOE_ROUTING_GIVEN) {
        memcpy(ids, b + f->i_off, T * K * 4);
        memcpy(w, b + f->w_off, T * K * 4);
    } else {
        moek_ref_route((const float *)(b + f->l_off), (int)T, L->sh.experts, L->sh.topk,
                       L->routing == MOE_ROUTING_SIGMOID ? MOEK_SCORING_SIGMOID
                                                         : MOEK_SCORING_SOFTMAX,
                       L->renorm, ids, w);
    }
    CHECK(moek_ref_fused_moe(&L->sh, itest_kdt(L->dt), b + f->x_off, ids, w, L->w1, L->w3,
                             L->w2, (int)T, ref) == 0);
    moek_to_f32(itest_kdt(L->dt), b + f->o_off, g, T * H);
    moek_to_f32(itest_kdt(L->dt), ref, rf, T * H);
    double e = moek_rel_error(g, rf, T * H);
    free(ids);
    free(w);
    free(ref);
    free(g);
    free(rf);
    return e;
}

/* Number of open file descriptors of a process. */
static inline int itest_count_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    int n = 0;
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n - 2;
}

#endif
