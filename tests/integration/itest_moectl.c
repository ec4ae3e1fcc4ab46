/*
 * itest_moectl.c: the CLI against a real daemon: load layers from files in
 * all three routing modes, forward --check on each, gemm --check, ping,
 * stats --json and a short bench; exit statuses for failures; numbers out
 * of range refused (never wrapped), more layers than one listing's worth,
 * and bench's processes when one of them dies.
 */
#include <cjson/cJSON.h>
#include <sys/stat.h>

#include "daemon/safetensors.h"
#include "tests/integration/itest.h"

static void write_moe_file(const char *path, int E, int H, int I, uint64_t *seed)
{
    size_t per = (size_t)H * (size_t)I;
    uint16_t *w = malloc(3 * (size_t)E * per * 2);
    struct st_out *t = calloc(3 * (size_t)E, sizeof(*t));
    char (*names)[64] = calloc(3 * (size_t)E, 64);
    CHECK(w && t && names);
    for (int e = 0; e < E; e++)
        for (int p = 0; p < 3; p++) {
            size_t i = (size_t)e * 3 + (size_t)p;
            itest_fill(seed, MOE_DTYPE_BF16, w + i * per, per, p < 2 ? 0.2f : 0.15f);
            snprintf(names[i], 64, "mlp.experts.%d.%s.weight", e,
                     p == 0 ? "gate_proj" : p == 1 ? "up_proj" : "down_proj");
            t[i] = (struct st_out){.name = names[i], .dtype = ST_BF16, .ndim = 2,
                                   .shape = {p < 2 ? (uint64_t)I : (uint64_t)H,
                                             p < 2 ? (uint64_t)H : (uint64_t)I},
                                   .data = w + i * per};
        }
    CHECK(st_write(path, t, 3 * (size_t)E) == 0);
    free(w);
    free(t);
    free(names);
}

TEST(cli_forward_check_in_every_routing_mode)
{
    uint64_t seed = test_seed();
    char wdir[] = "/tmp/moed-cli.XXXXXX";
    CHECK(mkdtemp(wdir) != NULL);
    char path[300];
    snprintf(path, sizeof(path), "%s/qwen.safetensors", wdir);
    write_moe_file(path, 16, 64, 96, &seed);
    struct itest_daemon d;
    itest_daemon_start(&d, "--allow-dir", wdir, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s load soft --file %s --prefix mlp. --topk 4",
                         b, d.dir, path), 0);
    CHECK_STR_CONTAINS(out, "loaded soft");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                         "%s/moectl -r %s load sig --file %s --prefix mlp. --topk 2 --routing sigmoid "
                         "--no-renormalize --dtype fp32", b, d.dir, path), 0);
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                         "%s/moectl -r %s load given --file %s --prefix mlp. --topk 3 --routing given",
                         b, d.dir, path), 0);
    const char *layers[] = {"soft", "sig", "given", "demo"};
    for (size_t i = 0; i < ARRAY_LEN(layers); i++) {
        CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s forward --layer %s --tokens 9 --check",
                             b, d.dir, layers[i]), 0);
        CHECK_STR_CONTAINS(out, ": ok");
    }
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s layers", b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "sigmoid");
    CHECK_STR_CONTAINS(out, "E=16 k=3");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s gemm --layer demo-gemm --rows 50 --check",
                         b, d.dir), 0);
    CHECK_STR_CONTAINS(out, ": ok");
    /* Failures exit non-zero with a message. */
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s forward --layer nope --tokens 1 2>&1",
                         b, d.dir), 1);
    CHECK_STR_CONTAINS(out, "no layer named 'nope'");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s unload nope 2>&1", b, d.dir), 1);
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s frobnicate 2>&1", b, d.dir), 2);
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r /nonexistent info 2>&1", b), 1);
    CHECK_STR_CONTAINS(out, "is moed running?");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s unload sig", b, d.dir), 0);
    itest_daemon_stop(&d);
    itest_rmdir(wdir);
}

/* moectl bench of two clients for a second with a spin option: the
 * requests it made, all of them answered. */
static double spin_bench(const char *b, const char *dir, const char *opt)
{
    char out[16384];
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                               "%s/moectl -r %s bench --clients 2 --seconds 1 %s --json", b, dir,
                               opt), 0);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL);
    double reqs = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "requests"));
    CHECK_MSG(reqs > 10, "%s: %.0f requests", opt, reqs);
    CHECK_EQ_INT((int)cJSON_GetNumberValue(cJSON_GetObjectItem(j, "errors")), 0);
    cJSON_Delete(j);
    return reqs;
}

TEST(cli_ping_stats_json_and_bench)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[16384];
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s ping --count 50", b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "p50");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s ping --count 20 --interval-us 500", b,
                         d.dir), 0);
    CHECK_STR_CONTAINS(out, "20 round trips");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s info", b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "backend cpu");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                         "%s/moectl -r %s bench --clients 3 --tokens 2 --seconds 1 --json", b, d.dir), 0);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL);
    double reqs = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "requests"));
    CHECK(reqs > 10);
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "p50_us")) > 0);
    CHECK_EQ_INT((int)cJSON_GetNumberValue(cJSON_GetObjectItem(j, "errors")), 0);
    cJSON_Delete(j);
    /* Clients that busy-poll for their replies (moe_set_spin_us), or only
     * around the time their replies come (moe_set_spin_ahead_us), are
     * served the same. */
    reqs += spin_bench(b, d.dir, "--client-spin-us 300");
    reqs += spin_bench(b, d.dir, "--client-spin-ahead-us 200");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s stats --json", b, d.dir), 0);
    j = cJSON_Parse(out);
    CHECK(j != NULL);
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "requests")) >= reqs);
    CHECK(cJSON_GetNumberValue(cJSON_GetObjectItem(j, "batches")) > 0);
    CHECK(cJSON_IsArray(cJSON_GetObjectItem(j, "batch_requests_hist")));
    CHECK_STR_EQ(cJSON_GetStringValue(cJSON_GetObjectItem(j, "backend")), "cpu");
    cJSON_Delete(j);
    itest_daemon_stop(&d);
}

/* Whether `moectl layers` output lists a layer of that name. */
static bool listed(const char *out, const char *name)
{
    for (const char *p = out; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, name, strlen(name)) && p[strlen(name)] == ' ')
            return true;
    return false;
}

/* Each numeric option is refused, naming it, when it does not fit what it
 * feeds: nothing is loaded, sent or run with a wrapped value. */
TEST(cli_numeric_options_out_of_range_are_refused)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    static const struct {
        const char *args, *opt;
    } bad[] = {
        {"load big --random --experts 4294967304 --hidden 64 --intermediate 64", "--experts"},
        {"load big --random --experts 8 --topk 4294967296 --hidden 64 --intermediate 64", "--topk"},
        {"load big --random --experts 8 --topk 0 --hidden 64 --intermediate 64", "--topk"},
        {"load big --random --experts 8 --hidden 4294967297 --intermediate 64", "--hidden"},
        {"load big --random --experts 8 --hidden 64 --intermediate 18446744073709551617",
         "--intermediate"},
        {"load g --random --kind gemm --groups 4294967300 --n 8 --k 8", "--groups"},
        {"load g --random --kind gemm --groups 4 --n 4294967360 --k 8", "--n"},
        {"load g --random --kind gemm --groups 4 --n 8 --k 4294967303", "--k"},
        {"forward --layer demo --tokens 4611686018427387904", "--tokens"},
        {"forward --layer demo --tokens 0", "--tokens"},
        {"gemm --layer demo-gemm --rows 4611686018427387904", "--rows"},
        {"ping --count 5 --interval-us 4294967296", "--interval-us"},
        {"bench --seconds 1 --client-spin-us 4294967296", "--client-spin-us"},
        {"bench --seconds 1 --client-spin-ahead-us 4294967296", "--client-spin-ahead-us"},
        {"bench --seconds 1 --tokens 4611686018427387904", "--tokens"},
        {"bench --seconds 1 --clients 4294967297", "--clients"},
        {"bench --seconds 2x", "--seconds"},
        {"bench --seconds 1e300", "--seconds"},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "timeout 60 %s/moectl -r %s %s", b,
                                   d.dir, bad[i].args), 2);
        CHECK_STR_CONTAINS(out, bad[i].opt);
        CHECK_STR_CONTAINS(out, "must be");
    }
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s layers", b, d.dir), 0);
    CHECK(!listed(out, "big") && !listed(out, "g"));
    /* In range, the same options still work. */
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                               "%s/moectl -r %s load ok --random --experts 4 --topk 2 --hidden 64 "
                               "--intermediate 32 --seed 0x10", b, d.dir), 0);
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                               "%s/moectl -r %s forward --layer ok --tokens 3 --repeat 2", b, d.dir),
                 0);
    itest_daemon_stop(&d);
}

/* Counts that size an allocation are bounded: a huge one is refused, not
 * wrapped into a small buffer that the loop then overruns. */
TEST(cli_huge_counts_are_refused)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    const char *bad[] = {
        "ping --count 2305843009213693952",
        "ping --count 10000001",
        "zmq-rtt --count 2305843009213693952",
        "forward --layer demo --tokens 1 --repeat 2305843009213693952",
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "timeout 60 %s/moectl -r %s %s", b,
                                   d.dir, bad[i]), 2);
        CHECK_STR_CONTAINS(out, "must be from 1 to 10000000");
    }
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s ping --count 3", b, d.dir),
                 0);
    CHECK_STR_CONTAINS(out, "3 round trips");
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl zmq-rtt --count 3", b), 0);
    CHECK_STR_CONTAINS(out, "3 bare ZeroMQ");
    itest_daemon_stop(&d);
}

/* load --random: a shape whose weights do not fit in 64 bits of bytes is
 * refused before anything is allocated or written. */
TEST(cli_load_random_refuses_shapes_too_large_to_address)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    const char *bad[] = {
        /* E*H*I wraps to 2 elements. */
        "load big --random --experts 5 --hidden 429509837 --intermediate 4294836226",
        /* E*H*I fits, its bytes do not. */
        "load big --random --experts 4 --hidden 4294967295 --intermediate 4294967295",
        /* The bytes of one tensor fit (2^63), those of all three do not. */
        "load big --random --experts 536870912 --hidden 65536 --intermediate 65536 --dtype fp32",
        "load g --random --kind gemm --groups 65536 --n 4294967295 --k 4294967295",
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "timeout 60 %s/moectl -r %s %s", b,
                                   d.dir, bad[i]), 2);
        CHECK_STR_CONTAINS(out, "too large");
    }
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s layers", b, d.dir), 0);
    CHECK(!listed(out, "big") && !listed(out, "g"));
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                               "%s/moectl -r %s load g --random --kind gemm --groups 4 --n 16 --k 8",
                               b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "loaded g");
    itest_daemon_stop(&d);
}

/* max_layers goes far past 256: moectl finds every loaded layer, however
 * many there are, and lists them all. */
TEST(cli_finds_layers_past_the_first_256)
{
    enum { N_LAYERS = 300 };
    struct itest_daemon d;
    itest_daemon_start(&d, "--config", itest_write_conf("[limits]\nmax_layers = 400\n"), NULL);
    moe_client *c = itest_connect(&d, "itest");
    uint64_t seed = test_seed();
    for (int i = 0; i < N_LAYERS; i++) {
        struct itest_layer L = {.dt = MOE_DTYPE_BF16, .sh = {2, 1, 8, 8},
                                .routing = MOE_ROUTING_SOFTMAX, .renorm = true};
        snprintf(L.name, sizeof(L.name), "tiny%03d", i);
        itest_layer_upload(c, &L, &seed);
        itest_layer_free(&L);
    }
    /* The daemon's listing order is its own: take the one it lists last. */
    static moe_layer_info infos[N_LAYERS];
    CHECK_EQ_INT(moe_layer_list(c, infos, N_LAYERS), N_LAYERS);
    const char *last = infos[N_LAYERS - 1].name;
    moe_disconnect(&c);
    const char *b = itest_build();
    static char out[1 << 16];
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s forward --layer %s --tokens 2",
                               b, d.dir, last), 0);
    CHECK_STR_CONTAINS(out, "forward: layer tiny");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                               "%s/moectl -r %s bench --layer %s --clients 1 --seconds 0.2", b,
                               d.dir, last), 0);
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s layers", b, d.dir), 0);
    for (int i = 0; i < N_LAYERS; i++)
        CHECK_MSG(listed(out, infos[i].name), "'moectl layers' leaves out %s", infos[i].name);
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s stats --json", b, d.dir),
                 0);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL);
    CHECK_EQ_INT(cJSON_GetArraySize(cJSON_GetObjectItem(j, "layers")), N_LAYERS);
    cJSON_Delete(j);
    itest_daemon_stop(&d);
}

/* Start `moectl -r DIR bench ARGS...` with its output in log; its pid. */
static pid_t spawn_bench(const char *dir, const char *log, const char *const *args)
{
    char bin[256];
    const char *argv[32] = {bin, "-r", dir, "bench"};
    int n = 4;
    snprintf(bin, sizeof(bin), "%s/moectl", itest_build());
    for (; *args && n < 31; args++)
        argv[n++] = *args;
    argv[n] = NULL;
    return itest_spawn(log, (char *const *)argv);
}

/* The children of pid (up to max); how many. */
static int children_of(pid_t pid, pid_t *out, int max)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid, (int)pid);
    FILE *f = fopen(path, "r");
    int n = 0, x;
    if (!f)
        return 0;
    while (n < max && fscanf(f, "%d", &x) == 1)
        out[n++] = x;
    fclose(f);
    return n;
}

/* Wait up to ms for pid (a child of this process) to exit; its status, or
 * -1 if it still runs. */
static int wait_exit(pid_t pid, int ms)
{
    for (int i = 0; i < ms; i += 10) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return st;
        itest_sleep_ms(10);
    }
    return -1;
}

/* Gone, or a zombie not yet reaped by whoever inherited it. */
static bool process_gone(pid_t pid)
{
    char path[64], state = 0;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return true;
    int n = fscanf(f, "%*d (%*[^)]) %c", &state);
    fclose(f);
    return n == 1 && (state == 'Z' || state == 'X');
}

static void print_file(const char *path)
{
    char buf[4096];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    buf[n] = '\0';
    if (f)
        fclose(f);
    fprintf(stderr, "  %s:\n%s", path, buf);
}

/* A bench client that dies before it is ready (OOM, a kill) fails the
 * bench at once, with the others stopped, instead of leaving the parent
 * waiting for it forever. Many tokens make each client spend long (some
 * hundreds of ms) filling its inputs before it is ready: the kill, within
 * a ms or so of the fork, lands in that time. */
TEST(cli_bench_fails_when_a_client_dies_before_it_is_ready)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    char log[300];
    snprintf(log, sizeof(log), "%s/bench.out", d.dir);
    const char *args[] = {"--clients", "2", "--tokens", "65536", "--seconds", "1", NULL};
    pid_t pid = spawn_bench(d.dir, log, args), kids[8];
    int n = 0;
    uint64_t t0 = now_ms();
    while ((n = children_of(pid, kids, 8)) < 1 && now_ms() - t0 < 10000)
        usleep(200);
    CHECK_MSG(n >= 1, "bench started no clients");
    CHECK(kill(kids[0], SIGKILL) == 0);
    int st = wait_exit(pid, 20000);
    if (st == -1) {
        n = children_of(pid, kids, 8);
        kill(pid, SIGKILL);
        for (int i = 0; i < n; i++)
            kill(kids[i], SIGKILL);
        waitpid(pid, NULL, 0);
        print_file(log);
        FAIL_AT("bench still waits 20 s after a client died");
    }
    print_file(log);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "bench exit status %d", st);
    char out[4096];
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "cat %s", log), 0);
    CHECK_STR_CONTAINS(out, "died before it was ready");
    CHECK_STR_CONTAINS(out, "signal 9");
    itest_daemon_stop(&d);
}

/* A bench some of whose clients cannot start (here over max_sessions)
 * measures nothing: it says why and exits 1, and no client sends (a run
 * of 3 clients would have been reported as one of 5). */
TEST(cli_bench_fails_when_a_client_cannot_start)
{
    char out[8192];
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", "--config", itest_write_conf("[limits]\nmax_sessions = 3\n"),
                       NULL);
    const char *b = itest_build();
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                               "timeout 60 %s/moectl -r %s bench --clients 5 --seconds 1", b, d.dir),
                 1);
    CHECK_STR_CONTAINS(out, "too many sessions (limit 3)");
    /* 2 of 5, or 3 where the start-up probe's session was not gone yet */
    CHECK_STR_CONTAINS(out, " of 5 clients could not start; nothing was measured");
    CHECK_MSG(!strstr(out, "requests/s"), "a rate was reported: %s", out);
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s stats", b, d.dir), 0);
    CHECK_MSG(strstr(out, "requests 0,"), "clients sent: %s", out);
    itest_daemon_stop(&d);
}

/* A daemon on its demo layers (*d) and a bench of two clients on it that
 * would run 30 s, its output in log (300 bytes): the bench's pid, once both
 * clients (kids) are connected and sending. */
static pid_t start_long_bench(struct itest_daemon *d, char *log, pid_t *kids)
{
    itest_daemon_start(d, "--demo", NULL);
    snprintf(log, 300, "%s/bench.out", d->dir);
    const char *args[] = {"--clients", "2", "--seconds", "30", NULL};
    pid_t pid = spawn_bench(d->dir, log, args), all[8];
    int n = 0;
    uint64_t t0 = now_ms();
    while ((n = children_of(pid, all, 8)) < 2 && now_ms() - t0 < 10000)
        itest_sleep_ms(10);
    CHECK_EQ_INT(n, 2);
    kids[0] = all[0];
    kids[1] = all[1];
    itest_sleep_ms(500); /* connected and sending */
    return pid;
}

/* The clients of a bench whose moectl is killed die with it rather than
 * go on (here they would run 30 s). */
TEST(cli_bench_clients_die_with_moectl)
{
    struct itest_daemon d;
    char log[300];
    pid_t kids[2], pid = start_long_bench(&d, log, kids);
    CHECK(kill(pid, SIGKILL) == 0);
    waitpid(pid, NULL, 0);
    bool gone = false;
    for (int i = 0; i < 300 && !gone; i++) {
        gone = process_gone(kids[0]) && process_gone(kids[1]);
        if (!gone)
            itest_sleep_ms(10);
    }
    if (!gone) {
        kill(kids[0], SIGKILL);
        kill(kids[1], SIGKILL);
        FAIL_AT("bench clients still run 3 s after moectl was killed");
    }
    itest_daemon_stop(&d);
}

/* A bench whose daemon goes away (here killed) stops once its clients
 * find it gone, with exit status 1 and the reason, rather than retrying
 * at full speed for the rest of --seconds (here 30). */
TEST(cli_bench_stops_when_the_daemon_is_gone)
{
    struct itest_daemon d;
    char log[300];
    pid_t kids[2], pid = start_long_bench(&d, log, kids);
    itest_daemon_kill(&d);
    int st = wait_exit(pid, 10000);
    if (st == -1) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        print_file(log);
        FAIL_AT("bench still runs 10 s after its daemon was killed");
    }
    print_file(log);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "bench exit status %d", st);
    char out[4096];
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "cat %s", log), 0);
    CHECK_STR_CONTAINS(out, "is moed running?");
    itest_rmdir(d.dir);
}

/* zmq-rtt's echo process dies mid-run (killed, or it could not bind): the
 * timing side stops with an error rather than wait for a reply forever. */
TEST(cli_zmq_rtt_fails_when_its_echo_process_dies)
{
    char dir[] = "/tmp/moed-cli-rtt.XXXXXX", log[300], bin[256];
    CHECK(mkdtemp(dir) != NULL);
    snprintf(log, sizeof(log), "%s/rtt.out", dir);
    snprintf(bin, sizeof(bin), "%s/moectl", itest_build());
    char *argv[] = {bin, "zmq-rtt", "--count", "10000000", NULL};
    pid_t pid = itest_spawn(log, argv), kids[8];
    int n = 0;
    uint64_t t0 = now_ms();
    while ((n = children_of(pid, kids, 8)) < 1 && now_ms() - t0 < 10000)
        itest_sleep_ms(10);
    CHECK_MSG(n >= 1, "zmq-rtt started no echo process");
    itest_sleep_ms(300); /* exchanging messages */
    CHECK(kill(kids[0], SIGKILL) == 0);
    int st = wait_exit(pid, 10000);
    if (st == -1) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        print_file(log);
        itest_rmdir(dir);
        FAIL_AT("zmq-rtt still waits 10 s after its echo process died");
    }
    print_file(log);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "zmq-rtt exit status %d", st);
    char out[4096];
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "cat %s", log), 0);
    CHECK_STR_CONTAINS(out, "echo process");
    itest_rmdir(dir);
}

/* bench's rates are over the time its requests took: the last request of a
 * client runs past --seconds, and with requests longer than --seconds
 * dividing by --seconds claimed many times the real rate. One client sends
 * one request after another, so the run lasts at least as long as its
 * slowest request. */
TEST(cli_bench_rates_cover_the_requests_time)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out),
                               "%s/moectl -r %s bench --clients 1 --tokens 8192 --seconds 0.01 --json",
                               b, d.dir), 0);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL);
    double reqs = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "requests")),
           rps = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "requests_per_s")),
           tps = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "tokens_per_s")),
           max_s = cJSON_GetNumberValue(cJSON_GetObjectItem(j, "max_us")) / 1e6;
    CHECK(reqs >= 1 && max_s > 0);
    CHECK_MSG(rps <= reqs / max_s * 1.001, "%.1f requests/s from %.0f requests of up to %.6f s",
              rps, reqs, max_s);
    CHECK_MSG(tps <= 8192 * reqs / max_s * 1.001, "%.1f tokens/s", tps);
    cJSON_Delete(j);
    itest_daemon_stop(&d);
}

/* An argument a command does not take is refused, naming it, before
 * anything is sent: `layers --json` printed text, `ping --count 3 x` ran. */
TEST(cli_arguments_a_command_does_not_take_are_refused)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    static const struct {
        const char *args, *arg;
    } bad[] = {
        {"info extra", "'extra'"},
        {"info --json", "'--json'"},
        {"layers --json", "'--json'"},
        {"stats extra", "'extra'"},
        {"stats --json extra", "'extra'"},
        {"ping --count 3 extra", "'extra'"},
        {"zmq-rtt --count 3 extra", "'extra'"},
        {"forward --layer demo --tokens 2 extra", "'extra'"},
        {"gemm --layer demo-gemm --rows 2 extra", "'extra'"},
        {"bench --seconds 0.1 --clients 1 extra", "'extra'"},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "timeout 60 %s/moectl -r %s %s", b,
                                   d.dir, bad[i].args), 2);
        CHECK_STR_CONTAINS(out, bad[i].arg);
        CHECK_STR_CONTAINS(out, "takes no");
    }
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s stats --json", b, d.dir), 0);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL);
    /* Nothing was sent: the daemon counted no request. */
    CHECK_EQ_INT((int)cJSON_GetNumberValue(cJSON_GetObjectItem(j, "requests")), 0);
    cJSON_Delete(j);
    itest_daemon_stop(&d);
}

/* The runtime directory option without a directory, or with an empty one,
 * is a usage error that says so (it was "unknown option -r", or a connect
 * to /moed.sock); a command's own option errors name moectl and the
 * command, not a bare "ping:". */
TEST(cli_usage_errors_name_what_is_wrong)
{
    const char *b = itest_build();
    char out[8192];
    static const struct {
        const char *args, *msg;
    } bad[] = {
        {"-r", "-r needs a runtime directory"},
        {"--runtime-dir", "--runtime-dir needs a runtime directory"},
        {"-r '' info", "-r needs a runtime directory"},
        {"--runtime-dir= info", "--runtime-dir needs a runtime directory"},
        {"-r /nonexistent ping --bogus", "moectl ping: unrecognized option '--bogus'"},
        {"-r /nonexistent forward --layer", "moectl forward: option '--layer' requires an argument"},
        {"-r /nonexistent unload --help", "usage: moectl unload NAME"},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "timeout 60 %s/moectl %s", b,
                                   bad[i].args), 2);
        CHECK_STR_CONTAINS(out, bad[i].msg);
    }
}

/* forward --input whose 'x' has no rows is refused as such, not sent on to
 * fail as "a region needs at least one byte". */
TEST(cli_forward_input_without_rows_is_refused)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192], path[300];
    snprintf(path, sizeof(path), "%s/empty.safetensors", d.dir);
    uint16_t none[1];
    float nolog[1];
    struct st_out t[] = {
        {.name = "x", .dtype = ST_BF16, .ndim = 2, .shape = {0, 256}, .data = none},
        {.name = "logits", .dtype = ST_F32, .ndim = 2, .shape = {0, 8}, .data = nolog},
    };
    CHECK(st_write(path, t, 2) == 0);
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s forward --layer demo --input %s",
                               b, d.dir, path), 1);
    CHECK_STR_CONTAINS(out, "needs a tensor 'x' [T, 256], T from 1 to");
    itest_daemon_stop(&d);
}

/* forward --output that cannot be written is refused before the daemon
 * computes anything (it was said only after the forward, its result lost),
 * and a device or other non-regular file is never replaced by the rename. */
TEST(cli_forward_output_that_cannot_be_written_is_refused_first)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192], file[300], path[400];
    snprintf(file, sizeof(file), "%s/afile", d.dir);
    FILE *fp = fopen(file, "w");
    CHECK(fp && fclose(fp) == 0);
    const struct {
        const char *path, *msg;
    } bad[] = {
        {"%s", "Is a directory"},
        {"%s/nowhere/o.st", "No such file or directory"},
        {"%s/afile/o.st", "Not a directory"},
        {"%s/new/", "Is a directory"},
        {"/dev/null", "not a regular file"},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        snprintf(path, sizeof(path), bad[i].path, d.dir);
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                                   "%s/moectl -r %s forward --layer demo --tokens 2 --output '%s'",
                                   b, d.dir, path), 1);
        CHECK_STR_CONTAINS(out, bad[i].msg);
        CHECK_MSG(!strstr(out, "forward: layer"), "%s: the forward ran: %s", path, out);
    }
    struct stat st;
    CHECK(stat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode));
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                               "%s/moectl -r %s forward --layer demo --tokens 2 --output ''", b,
                               d.dir), 2);
    CHECK_STR_CONTAINS(out, "--output needs a file name");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                               "%s/moectl -r %s forward --layer demo --input ''", b, d.dir), 2);
    CHECK_STR_CONTAINS(out, "--input needs a file name");
    /* A regular file, there already or not, is written. */
    snprintf(path, sizeof(path), "%s/o.st", d.dir);
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                               "%s/moectl -r %s forward --layer demo --tokens 2 --output %s && "
                               "%s/moectl -r %s forward --layer demo --tokens 3 --output %s",
                               b, d.dir, path, b, d.dir, path), 0);
    struct st_file *f = NULL;
    char err[256] = "";
    CHECK_MSG(st_open(path, &f, err, sizeof(err)) == 0, "%s", err);
    const struct st_tensor *t = st_find(f, "out");
    CHECK(t && t->shape[0] == 3 && t->shape[1] == 256);
    st_close(&f);
    itest_daemon_stop(&d);
}

/* Numbers are decimal (or hexadecimal after 0x), whatever zeros lead them:
 * "010" was read as octal 8 and "08" refused. */
TEST(cli_numbers_with_leading_zeros_are_decimal)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s forward --layer demo --tokens 010",
                               b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "10 tokens");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s ping --count 08", b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "8 round trips");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s ping --count 0x0a", b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "10 round trips");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s ping --count ' 5'", b, d.dir), 2);
    CHECK_STR_CONTAINS(out, "--count needs a non-negative number");
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s ping --count +5", b, d.dir), 2);
    CHECK_STR_CONTAINS(out, "--count needs a non-negative number");
    itest_daemon_stop(&d);
}

/* load refuses options that do not go with the rest rather than drop them
 * unsaid: a prefix for random weights, a seed for a file, MoE options for a
 * GEMM layer and GEMM options for a MoE one, an empty file name, a device
 * list with a trailing comma or past its room. Nothing is loaded. */
TEST(cli_load_refuses_options_that_do_not_apply)
{
    struct itest_daemon d;
    itest_daemon_start(&d, "--demo", NULL);
    const char *b = itest_build();
    char out[8192];
    static const struct {
        const char *args, *msg;
    } bad[] = {
        {"load x --random --prefix p. --experts 2 --hidden 8 --intermediate 8",
         "--prefix goes with --file"},
        {"load x --file /srv/m.safetensors --seed 5", "--seed goes with --random"},
        {"load x --file ''", "--file needs a path"},
        {"load x --random --kind gemm --groups 2 --n 8 --k 8 --experts 2",
         "--experts is for MoE layers"},
        {"load x --random --kind gemm --groups 2 --n 8 --k 8 --topk 1", "--topk is for MoE layers"},
        {"load x --random --kind gemm --groups 2 --n 8 --k 8 --routing given",
         "--routing is for MoE layers"},
        {"load x --random --kind gemm --groups 2 --n 8 --k 8 --devices 0",
         "--devices is for MoE layers"},
        {"load x --random --experts 2 --hidden 8 --intermediate 8 --n 5", "--n is for GEMM layers"},
        {"load x --random --experts 2 --hidden 8 --intermediate 8 --devices 0,",
         "comma-separated list"},
        {"load x --random --experts 2 --hidden 8 --intermediate 8 "
         "--devices 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16", "at most 16"},
    };
    for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
        CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "timeout 60 %s/moectl -r %s %s", b,
                                   d.dir, bad[i].args), 2);
        CHECK_STR_CONTAINS(out, bad[i].msg);
    }
    CHECK_EQ_INT(itest_run_cmd(false, out, sizeof(out), "%s/moectl -r %s layers", b, d.dir), 0);
    CHECK(!listed(out, "x"));
    /* What does apply still works, in any order. */
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                               "%s/moectl -r %s load g --n 8 --random --groups 2 --k 8 --kind gemm",
                               b, d.dir), 0);
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out),
                               "%s/moectl -r %s load m --random --experts 2 --topk 1 --hidden 8 "
                               "--intermediate 8 --routing sigmoid --no-renormalize --devices 0 "
                               "--placement 0,0 --seed 3 --kind moe", b, d.dir), 0);
    itest_daemon_stop(&d);
}

/* A daemon (*d) allowed wdir (made here, "/tmp/moed-cli.XXXXXX"), and
 * its layer 'q' loaded by moectl from a file of that name in wdir. */
static void daemon_with_layer_file(struct itest_daemon *d, char *wdir, const char *name)
{
    uint64_t seed = test_seed();
    CHECK(mkdtemp(wdir) != NULL);
    char path[300], out[8192];
    snprintf(path, sizeof(path), "%s/%s", wdir, name);
    write_moe_file(path, 4, 32, 48, &seed);
    itest_daemon_start(d, "--allow-dir", wdir, NULL);
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s load q --file '%s' --prefix mlp.",
                               itest_build(), d->dir, path), 0);
}

/* forward --check finds the layer's file when its name holds a colon: the
 * layer's source "PATH:PREFIX" was split at the first colon of the name. */
TEST(cli_check_reads_a_file_whose_name_holds_a_colon)
{
    char wdir[] = "/tmp/moed-cli.XXXXXX", out[8192];
    struct itest_daemon d;
    daemon_with_layer_file(&d, wdir, "qwen:2.safetensors");
    const char *b = itest_build();
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s forward --layer q --tokens 5 --check",
                               b, d.dir), 0);
    CHECK_STR_CONTAINS(out, ": ok");
    itest_daemon_stop(&d);
    itest_rmdir(wdir);
}

/* A weight file's name may hold control characters: `moectl layers` and
 * the daemon's log show them as '?', never as what a terminal or the
 * journal would act on. */
TEST(cli_layers_shows_control_characters_of_a_file_name_as_marks)
{
    char wdir[] = "/tmp/moed-cli.XXXXXX", out[8192];
    struct itest_daemon d;
    daemon_with_layer_file(&d, wdir, "esc\x1b[2J\nmoed: x.safetensors");
    const char *b = itest_build();
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "%s/moectl -r %s layers", b, d.dir), 0);
    CHECK_STR_CONTAINS(out, "/esc?[2J?moed: x.safetensors:mlp.");
    CHECK_MSG(!strchr(out, '\x1b'), "an escape reached the terminal: %s", out);
    itest_daemon_stop_keep(&d);
    CHECK_EQ_INT(itest_run_cmd(true, out, sizeof(out), "cat %s", d.log), 0);
    CHECK_STR_CONTAINS(out, "/esc?[2J?moed: x.safetensors");
    CHECK_MSG(!strchr(out, '\x1b'), "an escape reached the log: %s", out);
    itest_rmdir(d.dir);
    itest_rmdir(wdir);
}

int main(int argc, char **argv)
{
    return test_main(argc, argv, (struct test_case[]){
        TEST_CASE(cli_forward_check_in_every_routing_mode),
        TEST_CASE(cli_ping_stats_json_and_bench),
        TEST_CASE(cli_numeric_options_out_of_range_are_refused),
        TEST_CASE(cli_huge_counts_are_refused),
        TEST_CASE(cli_load_random_refuses_shapes_too_large_to_address),
        TEST_CASE(cli_finds_layers_past_the_first_256),
        TEST_CASE(cli_bench_fails_when_a_client_dies_before_it_is_ready),
        TEST_CASE(cli_bench_fails_when_a_client_cannot_start),
        TEST_CASE(cli_bench_clients_die_with_moectl),
        TEST_CASE(cli_bench_stops_when_the_daemon_is_gone),
        TEST_CASE(cli_zmq_rtt_fails_when_its_echo_process_dies),
        TEST_CASE(cli_bench_rates_cover_the_requests_time),
        TEST_CASE(cli_arguments_a_command_does_not_take_are_refused),
        TEST_CASE(cli_usage_errors_name_what_is_wrong),
        TEST_CASE(cli_forward_input_without_rows_is_refused),
        TEST_CASE(cli_forward_output_that_cannot_be_written_is_refused_first),
        TEST_CASE(cli_numbers_with_leading_zeros_are_decimal),
        TEST_CASE(cli_load_refuses_options_that_do_not_apply),
        TEST_CASE(cli_check_reads_a_file_whose_name_holds_a_colon),
        TEST_CASE(cli_layers_shows_control_characters_of_a_file_name_as_marks),
        {0}});
}
