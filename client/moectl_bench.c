/*
 * moectl_bench.c: `moectl bench`: N client processes, each with its own
 * session and region, send FusedMoe requests back to back for S seconds.
 * They start together (a barrier in shared memory) and record every
 * request's latency there; the parent prints throughput, latency p50/p99/max
 * and the mean batch size the daemon reported.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/moectl.h"
#include "kernels/moe_kernels.h"

#define BENCH_MAX_SAMPLES (1u << 18)
#define BENCH_MAX_CLIENTS 1024

struct bench_slot {
    uint64_t requests, errors, busy, batch_requests_sum;
    /* When this client started sending and when its last reply came
     * (moectl_now_us: the same clock in every process). */
    uint64_t start_us, end_us;
    atomic_int ready;   /* this client reached the barrier */
    int failed_start;   /* it could not set up; error says why */
    char error[160];
    uint32_t n;
    uint32_t lat_us[BENCH_MAX_SAMPLES];
};

struct bench_shared {
    atomic_int ready;
    atomic_int go;
    struct bench_slot slots[];
};

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* A client that cannot start says why and counts as ready; the parent
 * reports it, stops the others before they send and fails the bench (a run
 * with fewer clients than asked would measure another load). */
static _Noreturn void child_fail(struct bench_shared *sh, int idx, moe_client *c, const char *why)
{
    struct bench_slot *sl = &sh->slots[idx];
    sl->failed_start = 1;
    snprintf(sl->error, sizeof(sl->error), "%s", why);
    atomic_store(&sl->ready, 1);
    atomic_fetch_add(&sh->ready, 1);
    moe_disconnect(&c);
    _exit(1);
}

static void bench_child(const char *rt, const moe_layer_info *li, uint64_t tokens,
                        double seconds, struct bench_shared *sh, int idx, int no_batch,
                        unsigned spin_us, unsigned ahead_us)
{
    struct bench_slot *sl = &sh->slots[idx];
    moe_client *c = NULL;
    moe_region *r = NULL;
    int rc = moe_connect(rt, "moectl bench", &c);
    if (!rc && spin_us)
        moe_set_spin_us(c, spin_us);
    if (!rc && ahead_us)
        moe_set_spin_ahead_us(c, ahead_us);
    size_t T = tokens, H = li->hidden, E = li->experts, K = li->topk;
    size_t es = moe_dtype_size(li->dtype);
    bool given = li->routing == MOE_ROUTING_GIVEN;
    size_t r_off = (T * H * es + 63) & ~(size_t)63;
    size_t w_off = r_off + ((given ? T * K * 4 : T * E * 4) + 63) / 64 * 64;
    size_t o_off = w_off + (T * K * 4 + 63) / 64 * 64;
    if (!rc)
        rc = moe_region_create(c, o_off + T * H * es, "bench", &r);
    if (rc)
        child_fail(sh, idx, c, moe_errmsg()[0] ? moe_errmsg() : moe_strerror(rc));
    uint8_t *base = moe_region_data(r);
    uint64_t seed = 0x9e3779b97f4a7c15ull * (uint64_t)(idx + 1);
    float *tmp = malloc(T * (H > E ? H : E) * sizeof(float));
    if (!tmp)
        child_fail(sh, idx, c, "no memory for the inputs");
    for (size_t i = 0; i < T * H; i++) {
        seed ^= seed >> 12; seed ^= seed << 25; seed ^= seed >> 27;
        tmp[i] = (float)((int64_t)(seed * 2685821657736338717ull) >> 40) / (float)(1 << 23);
    }
    moek_from_f32(li->dtype == MOE_DTYPE_BF16 ? MOEK_DTYPE_BF16 :
                  li->dtype == MOE_DTYPE_FP16 ? MOEK_DTYPE_FP16 : MOEK_DTYPE_FP32,
                  tmp, base, T * H);
    free(tmp);
    moe_forward_args a = {.layer = li->name,
                          .x = moe_tensor_2d(r, 0, li->dtype, T, H),
                          .out = moe_tensor_2d(r, o_off, li->dtype, T, H),
                          .no_batch = no_batch};
    if (given) {
        int32_t *ids = (int32_t *)(base + r_off);
        float *w = (float *)(base + w_off);
        for (size_t t = 0; t < T; t++)
            for (size_t j = 0; j < K; j++) {
                ids[t * K + j] = (int32_t)((t * 7 + j * 3 + (size_t)idx) % E);
                w[t * K + j] = 1.0f / (float)K;
            }
        a.topk_ids = moe_tensor_2d(r, r_off, MOE_DTYPE_INT32, T, K);
        a.topk_weights = moe_tensor_2d(r, w_off, MOE_DTYPE_FP32, T, K);
    } else {
        float *lg = (float *)(base + r_off);
        for (size_t i = 0; i < T * E; i++)
            lg[i] = (float)((i * 2654435761u + (size_t)idx * 97) % 1000) / 333.0f;
        a.logits = moe_tensor_2d(r, r_off, MOE_DTYPE_FP32, T, E);
    }
    atomic_store(&sl->ready, 1);
    atomic_fetch_add(&sh->ready, 1);
    int go;
    while (!(go = atomic_load(&sh->go)))
        usleep(200);
    if (go < 0) /* another client could not start; the daemon frees what */
        _exit(0); /* this one held as its session socket closes */
    sl->start_us = moectl_now_us();
    uint64_t end = sl->start_us + (uint64_t)(seconds * 1e6);
    for (;;) {
        uint64_t t0 = moectl_now_us();
        if (t0 >= end)
            break;
        moe_timings tm;
        rc = moe_forward(c, &a, &tm);
        uint64_t dt = moectl_now_us() - t0;
        if (rc == -EBUSY) {
            sl->busy++;
            continue;
        }
        if (rc) {
            sl->errors++;
            snprintf(sl->error, sizeof(sl->error), "%s", moe_errmsg());
            /* No daemon to reconnect to: the figures end here, rather than
             * in calls refused at full speed for the rest of the run. */
            if (rc == -ECONNREFUSED)
                break;
            continue;
        }
        sl->requests++;
        sl->batch_requests_sum += tm.batch_requests;
        if (sl->n < BENCH_MAX_SAMPLES)
            sl->lat_us[sl->n++] = dt > UINT32_MAX ? UINT32_MAX : (uint32_t)dt;
    }
    sl->end_us = moectl_now_us();
    moe_region_free(c, &r);
    moe_disconnect(&c);
    _exit(0);
}

/* Say why each client that could not start did not. */
static void print_start_failures(const struct bench_shared *sh, unsigned long long clients)
{
    for (unsigned long long i = 0; i < clients; i++)
        if (sh->slots[i].failed_start)
            fprintf(stderr, "moectl: client %llu: %s\n", i, sh->slots[i].error);
}

/* Wait until every client is at the barrier. One that exits first and did
 * not report a failure to start (killed, out of memory) never will be: stop
 * the others and fail rather than wait forever. A client reaped here has
 * its status kept and its pid zeroed. */
static bool wait_ready(struct bench_shared *sh, pid_t *pids, int *status,
                       unsigned long long clients)
{
    while (atomic_load(&sh->ready) < (int)clients) {
        for (unsigned long long i = 0; i < clients; i++) {
            if (!pids[i] || waitpid(pids[i], &status[i], WNOHANG) != pids[i])
                continue;
            pids[i] = 0;
            if (atomic_load(&sh->slots[i].ready))
                continue;
            int st = status[i];
            fprintf(stderr, "moectl: bench: client %llu died before it was ready (%s %d); "
                    "stopping the others\n", i, WIFSIGNALED(st) ? "killed by signal" : "exit status",
                    WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            for (unsigned long long j = 0; j < clients; j++)
                if (pids[j]) {
                    kill(pids[j], SIGKILL);
                    waitpid(pids[j], NULL, 0);
                }
            print_start_failures(sh, clients);
            return false;
        }
        usleep(1000);
    }
    return true;
}

/* --seconds: more than 0, at most a day (the end time is computed in
 * microseconds, which a huge double would overflow); -1 after printing why. */
static double parse_seconds(const char *v)
{
    char *end;
    errno = 0;
    double s = strtod(v, &end);
    if (!v[0] || *end || errno || !(s > 0 && s <= 86400)) {
        fprintf(stderr, "moectl: --seconds must be more than 0 and at most 86400, not '%s'\n", v);
        return -1;
    }
    return s;
}

int cmd_bench(const char *rt, int argc, char **argv)
{
    static const struct option o[] = {
        {"layer", required_argument, NULL, 'l'},   {"clients", required_argument, NULL, 'c'},
        {"tokens", required_argument, NULL, 't'},  {"seconds", required_argument, NULL, 's'},
        {"json", no_argument, NULL, 'j'},          {"no-batch", no_argument, NULL, 'n'},
        {"client-spin-us", required_argument, NULL, 'p'},
        {"client-spin-ahead-us", required_argument, NULL, 'a'}, {0},
    };
    const char *layer = "demo";
    unsigned long long clients = 4, tokens = 1;
    double seconds = 2.0;
    int json = 0, no_batch = 0, c;
    unsigned spin_us = 0, ahead_us = 0;
    while ((c = getopt_long(argc, argv, "", o, NULL)) != -1) {
        switch (c) {
        case 'p': spin_us = (unsigned)moectl_num("--client-spin-us", optarg, 0, UINT_MAX); break;
        case 'a':
            ahead_us = (unsigned)moectl_num("--client-spin-ahead-us", optarg, 0, UINT_MAX);
            break;
        case 'l': layer = optarg; break;
        case 'c': clients = moectl_num("--clients", optarg, 1, BENCH_MAX_CLIENTS); break;
        case 't': tokens = moectl_num("--tokens", optarg, 1, MOECTL_MAX_TOKENS); break;
        case 's':
            if ((seconds = parse_seconds(optarg)) < 0)
                return 2;
            break;
        case 'j': json = 1; break;
        case 'n': no_batch = 1; break;
        default: return 2;
        }
    }
    if (moectl_no_more_args(argc, argv, optind))
        return 2;
    moe_client *cl = moectl_connect(rt, "moectl bench");
    if (!cl)
        return 1;
    moe_layer_info li;
    int bad = moectl_layer(cl, layer, &li);
    moe_disconnect(&cl);
    if (bad)
        return 1;
    if (li.kind != MOE_LAYER_MOE) {
        fprintf(stderr, "moectl: bench drives MoE layers; '%s' is a GEMM layer\n", layer);
        return 1;
    }
    size_t shsize = sizeof(struct bench_shared) + clients * sizeof(struct bench_slot);
    struct bench_shared *sh = mmap(NULL, shsize, PROT_READ | PROT_WRITE,
                                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        perror("moectl: mmap");
        return 1;
    }
    pid_t *pids = calloc(clients, sizeof(*pids));
    int *status = calloc(clients, sizeof(*status));
    if (!pids || !status) {
        fprintf(stderr, "moectl: bench: no memory for %llu clients\n", clients);
        free(pids);
        free(status);
        munmap(sh, shsize);
        return 1;
    }
    pid_t self = getpid();
    unsigned long long asked = clients;
    fflush(stdout);
    for (unsigned long long i = 0; i < clients; i++) {
        pids[i] = fork();
        if (pids[i] == 0) {
            /* Die with moectl: orphaned, a client would wait for go (or
             * send) on with nobody to read its results. */
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != self) /* moectl died before the prctl */
                _exit(1);
            bench_child(rt, &li, tokens, seconds, sh, (int)i, no_batch, spin_us, ahead_us);
        }
        if (pids[i] < 0) { /* the clients forked are stopped below */
            fprintf(stderr, "moectl: bench: cannot start client %llu: fork: %s\n", i,
                    strerror(errno));
            clients = i;
            break;
        }
    }
    if (!wait_ready(sh, pids, status, clients)) {
        free(pids);
        free(status);
        munmap(sh, shsize);
        return 1;
    }
    unsigned long long not_started = asked - clients;
    for (unsigned long long i = 0; i < clients; i++)
        not_started += sh->slots[i].failed_start != 0;
    atomic_store(&sh->go, not_started ? -1 : 1);
    int failed = 0;
    for (unsigned long long i = 0; i < clients; i++) {
        if (pids[i] && waitpid(pids[i], &status[i], 0) < 0)
            status[i] = -1;
        failed += !(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0);
    }
    if (not_started) {
        print_start_failures(sh, clients);
        fprintf(stderr, "moectl: bench: %llu of %llu clients could not start; nothing was "
                "measured\n", not_started, asked);
        free(pids);
        free(status);
        munmap(sh, shsize);
        return 1;
    }
    /* The rates are over the time the clients sent for, first start to last
     * reply: each client's last request ends past --seconds, by up to a
     * whole request (longer than --seconds itself with many tokens). */
    uint64_t reqs = 0, errs = 0, busy = 0, bsum = 0, n = 0, first = UINT64_MAX, last = 0;
    for (unsigned long long i = 0; i < clients; i++) {
        if (sh->slots[i].end_us) {
            first = sh->slots[i].start_us < first ? sh->slots[i].start_us : first;
            last = sh->slots[i].end_us > last ? sh->slots[i].end_us : last;
        }
        reqs += sh->slots[i].requests;
        errs += sh->slots[i].errors;
        busy += sh->slots[i].busy;
        bsum += sh->slots[i].batch_requests_sum;
        n += sh->slots[i].n;
        if (sh->slots[i].error[0] && sh->slots[i].errors)
            fprintf(stderr, "moectl: client %llu: %s\n", i, sh->slots[i].error);
    }
    uint32_t *all = malloc((n ? n : 1) * sizeof(*all));
    if (!all) {
        fprintf(stderr, "moectl: bench: no memory for %llu latency samples\n",
                (unsigned long long)n);
        free(pids);
        free(status);
        munmap(sh, shsize);
        return 1;
    }
    size_t k = 0;
    for (unsigned long long i = 0; i < clients; i++) {
        memcpy(all + k, sh->slots[i].lat_us, sh->slots[i].n * sizeof(*all));
        k += sh->slots[i].n;
    }
    qsort(all, n, sizeof(*all), cmp_u32);
    uint32_t p50 = n ? all[n / 2] : 0, p99 = n ? all[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1] : 0,
             mx = n ? all[n - 1] : 0;
    double elapsed = last > first ? (double)(last - first) / 1e6 : seconds;
    double rps = (double)reqs / elapsed, tps = rps * (double)tokens;
    double mean_batch = reqs ? (double)bsum / (double)reqs : 0;
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "layer", layer);
        cJSON_AddNumberToObject(j, "clients", (double)clients);
        cJSON_AddNumberToObject(j, "tokens", (double)tokens);
        cJSON_AddNumberToObject(j, "seconds", seconds);
        cJSON_AddNumberToObject(j, "elapsed_s", elapsed);
        cJSON_AddBoolToObject(j, "batching", !no_batch);
        cJSON_AddNumberToObject(j, "requests", (double)reqs);
        cJSON_AddNumberToObject(j, "errors", (double)errs);
        cJSON_AddNumberToObject(j, "busy", (double)busy);
        cJSON_AddNumberToObject(j, "requests_per_s", rps);
        cJSON_AddNumberToObject(j, "tokens_per_s", tps);
        cJSON_AddNumberToObject(j, "p50_us", p50);
        cJSON_AddNumberToObject(j, "p99_us", p99);
        cJSON_AddNumberToObject(j, "max_us", mx);
        cJSON_AddNumberToObject(j, "mean_batch_requests", mean_batch);
        char *txt = cJSON_PrintUnformatted(j);
        printf("%s\n", txt);
        free(txt);
        cJSON_Delete(j);
    } else {
        printf("bench: layer %s, %llu clients x %llu tokens, %.1f s (%.3f s to the last reply)%s: "
               "%.0f requests/s, "
               "%.0f tokens/s, latency p50 %u us p99 %u us max %u us, mean batch %.2f requests"
               "%s%llu errors, %llu busy\n",
               layer, clients, tokens, seconds, elapsed, no_batch ? ", batching off" : "", rps, tps, p50, p99,
               mx, mean_batch, ", ", (unsigned long long)errs, (unsigned long long)busy);
    }
    free(all);
    free(pids);
    free(status);
    munmap(sh, shsize);
    return (failed || errs || reqs == 0) ? 1 : 0;
}
