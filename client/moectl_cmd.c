/*
 * moectl_cmd.c: the small commands: ping, info, layers, load, unload, stats.
 */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "client/moectl.h"

uint64_t moectl_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

int moectl_fail(const char *what, int rc)
{
    const char *m = moe_errmsg();
    fprintf(stderr, "moectl: %s: %s\n", what, m && m[0] ? m : moe_strerror(rc));
    return 1;
}

moe_client *moectl_connect(const char *rt, const char *who)
{
    moe_client *c = NULL;
    int rc = moe_connect(rt, who, &c);
    if (rc < 0) {
        moectl_fail("connect", rc);
        return NULL;
    }
    return c;
}

unsigned long long moectl_num(const char *opt, const char *v, unsigned long long min,
                              unsigned long long max)
{
    char *end;
    errno = 0;
    /* Decimal, or hexadecimal after 0x: base 0 would read "010" as octal 8
     * and refuse "08". A digit first: strtoull would also skip spaces and
     * take a sign ("-1" wraps to 2^64 - 1). */
    bool hex = v[0] == '0' && (v[1] == 'x' || v[1] == 'X');
    unsigned long long x = strtoull(v, &end, hex ? 16 : 10);
    if (!isdigit((unsigned char)v[0]) || (hex && !isxdigit((unsigned char)v[2])) || *end ||
        (errno && errno != ERANGE)) {
        fprintf(stderr, "moectl: %s needs a non-negative number, not '%s'\n", opt, v);
        exit(2);
    }
    /* Past 2^64 strtoull saturates (ERANGE): out of range like any other. */
    if (errno == ERANGE || x < min || x > max) {
        fprintf(stderr, "moectl: %s must be from %llu to %llu, not '%s'\n", opt, min, max, v);
        exit(2);
    }
    return x;
}

int moectl_no_more_args(int argc, char **argv, int first)
{
    if (first >= argc)
        return 0;
    fprintf(stderr, "%s: takes no argument '%s'\n", argv[0], argv[first]);
    return 2;
}

size_t moectl_list(const char *opt, const char *v, uint32_t *out, size_t max)
{
    size_t n = 0;
    const char *p = v;
    /* Each entry a number (strtoul alone would skip spaces and take a
     * sign), each comma followed by one: "0," is not a list of one. */
    for (;;) {
        char *end;
        errno = 0;
        unsigned long x = isdigit((unsigned char)*p) ? strtoul(p, &end, 10) : 0;
        if (!isdigit((unsigned char)*p) || errno || x > 65535 || (*end && *end != ',')) {
            fprintf(stderr, "moectl: %s needs a comma-separated list of numbers, not '%s'\n",
                    opt, v);
            return 0;
        }
        if (n == max) {
            fprintf(stderr, "moectl: %s takes at most %zu entries\n", opt, max);
            return 0;
        }
        out[n++] = (uint32_t)x;
        if (!*end)
            return n;
        p = end + 1;
    }
}

const char *moectl_dtype_name(moe_dtype dt)
{
    switch (dt) {
    case MOE_DTYPE_BF16: return "bf16";
    case MOE_DTYPE_FP16: return "fp16";
    case MOE_DTYPE_FP32: return "fp32";
    case MOE_DTYPE_INT32: return "int32";
    case MOE_DTYPE_INT64: return "int64";
    default: return "?";
    }
}

static const char *routing_name(moe_routing r)
{
    return r == MOE_ROUTING_SOFTMAX ? "softmax" : r == MOE_ROUTING_SIGMOID ? "sigmoid" : "given";
}

int moectl_layers(moe_client *c, moe_layer_info **out)
{
    /* moe_layer_list fills what fits but counts them all, and max_layers
     * goes to 65536: grow until the count fits (it may grow meanwhile). */
    for (int cap = 256;;) {
        moe_layer_info *infos = malloc((size_t)cap * sizeof(*infos));
        if (!infos)
            return -ENOMEM;
        int n = moe_layer_list(c, infos, cap);
        if (n <= cap) {
            if (n < 0)
                free(infos);
            *out = n < 0 ? NULL : infos;
            return n;
        }
        free(infos);
        cap = n + 16;
    }
}

int moectl_layer(moe_client *c, const char *name, moe_layer_info *out)
{
    moe_layer_info *infos;
    int n = moectl_layers(c, &infos);
    if (n < 0)
        return moectl_fail("list layers", n);
    for (int i = 0; i < n; i++)
        if (!strcmp(infos[i].name, name)) {
            *out = infos[i];
            free(infos);
            return 0;
        }
    free(infos);
    fprintf(stderr, "moectl: no layer named '%s' (see 'moectl layers')\n", name);
    return 1;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int cmd_ping(const char *rt, int argc, char **argv)
{
    static const struct option o[] = {{"count", required_argument, NULL, 'n'},
                                      {"interval-us", required_argument, NULL, 'i'}, {0}};
    unsigned long long count = 1000, interval = 0;
    int c;
    while ((c = getopt_long(argc, argv, "n:", o, NULL)) != -1) {
        if (c == 'n')
            count = moectl_num("--count", optarg, 1, MOECTL_MAX_COUNT);
        else if (c == 'i') /* usleep takes 32 bits */
            interval = moectl_num("--interval-us", optarg, 0, UINT32_MAX);
        else
            return 2;
    }
    if (moectl_no_more_args(argc, argv, optind))
        return 2;
    uint64_t *lat = malloc(count * sizeof(*lat));
    if (!lat) {
        fprintf(stderr, "moectl: ping: no memory for %llu samples\n", count);
        return 1;
    }
    moe_client *cl = moectl_connect(rt, "moectl ping");
    if (!cl) {
        free(lat);
        return 1;
    }
    int rc = moe_hello(cl, NULL); /* warm-up */
    for (unsigned long long i = 0; i < count && !rc; i++) {
        if (interval) /* idle between calls, as a client between decode steps */
            usleep((useconds_t)interval);
        uint64_t t0 = moectl_now_us();
        rc = moe_hello(cl, NULL);
        lat[i] = moectl_now_us() - t0;
    }
    if (rc) {
        free(lat);
        moe_disconnect(&cl);
        return moectl_fail("ping", rc);
    }
    qsort(lat, count, sizeof(*lat), cmp_u64);
    printf("ping: %llu round trips over the request socket: p50 %llu us, p99 %llu us, max %llu us\n",
           count, (unsigned long long)lat[count / 2],
           (unsigned long long)lat[(count * 99) / 100 < count ? (count * 99) / 100 : count - 1],
           (unsigned long long)lat[count - 1]);
    free(lat);
    moe_disconnect(&cl);
    return 0;
}

/* zmq-rtt's reply from the echo process: the receive times out now and
 * then to see whether that process still runs, since one that died (killed,
 * or unable to bind) never answers. False on an error or once it is gone
 * (reaped: *gone set). */
static bool rtt_recv(void *s, char *buf, size_t len, pid_t pid, bool *gone)
{
    for (;;) {
        if (zmq_recv(s, buf, len, 0) >= 0)
            return true;
        if (zmq_errno() != EAGAIN && zmq_errno() != EINTR)
            return false;
        if (waitpid(pid, NULL, WNOHANG) == pid) {
            *gone = true;
            return false;
        }
    }
}

/* The floor under `ping`: a bare ZeroMQ DEALER/ROUTER round trip of 64
 * bytes between two processes of this machine over ipc, no daemon. */
int cmd_zmq_rtt(const char *rt, int argc, char **argv)
{
    static const struct option o[] = {{"count", required_argument, NULL, 'n'}, {0}};
    unsigned long long count = 10000;
    int c;
    while ((c = getopt_long(argc, argv, "n:", o, NULL)) != -1) {
        if (c == 'n')
            count = moectl_num("--count", optarg, 1, MOECTL_MAX_COUNT);
        else
            return 2;
    }
    if (moectl_no_more_args(argc, argv, optind))
        return 2;
    /* Before the fork: once the echo process runs, it waits for us. */
    uint64_t *lat = malloc(count * sizeof(*lat));
    if (!lat) {
        fprintf(stderr, "moectl: zmq-rtt: no memory for %llu samples\n", count);
        return 1;
    }
    char dir[] = "/tmp/moectl-rtt.XXXXXX", ep[64];
    if (!mkdtemp(dir)) {
        perror("moectl: mkdtemp");
        free(lat);
        return 1;
    }
    snprintf(ep, sizeof(ep), "ipc://%s/rtt.zmq", dir);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        perror("moectl: fork");
        rmdir(dir);
        free(lat);
        return 1;
    }
    if (pid == 0) {
        /* Waiting in zmq_recv, it would outlive a parent that died. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
        if (zmq_bind(s, ep) < 0)
            _exit(1);
        for (unsigned long long i = 0; i <= count; i++) {
            char id[256], msg[256];
            int n = zmq_recv(s, id, sizeof(id), 0), m = zmq_recv(s, msg, sizeof(msg), 0);
            if (n < 0 || m < 0 || zmq_send(s, id, (size_t)n, ZMQ_SNDMORE) < 0 ||
                zmq_send(s, msg, (size_t)m, 0) < 0)
                _exit(1);
        }
        zmq_close(s);
        zmq_ctx_term(ctx);
        _exit(0);
    }
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0, timeout_ms = 100;
    bool gone = false;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
    zmq_connect(s, ep);
    char msg[64] = {0}, back[256];
    int rc = 0;
    for (unsigned long long i = 0; i <= count && !rc; i++) {
        uint64_t t0 = moectl_now_us();
        if (zmq_send(s, msg, sizeof(msg), 0) < 0 || !rtt_recv(s, back, sizeof(back), pid, &gone))
            rc = 1;
        if (i > 0) /* the first waits for the connection */
            lat[i - 1] = moectl_now_us() - t0;
    }
    zmq_close(s);
    zmq_ctx_term(ctx);
    if (rc && !gone) /* still waiting for messages that will not come */
        kill(pid, SIGKILL);
    if (!gone)
        waitpid(pid, NULL, 0);
    char path[96];
    snprintf(path, sizeof(path), "%s/rtt.zmq", dir);
    unlink(path);
    rmdir(dir);
    if (rc) {
        fprintf(stderr, "moectl: zmq-rtt: the echo process failed\n");
        free(lat);
        return 1;
    }
    qsort(lat, count, sizeof(*lat), cmp_u64);
    printf("zmq-rtt: %llu bare ZeroMQ DEALER/ROUTER ipc round trips of 64 bytes: p50 %llu us, "
           "p99 %llu us\n", count, (unsigned long long)lat[count / 2],
           (unsigned long long)lat[(count * 99) / 100 < count ? (count * 99) / 100 : count - 1]);
    free(lat);
    (void)rt;
    return 0;
}

int cmd_info(const char *rt, int argc, char **argv)
{
    if (moectl_no_more_args(argc, argv, 1))
        return 2;
    moe_client *cl = moectl_connect(rt, "moectl info");
    if (!cl)
        return 1;
    moe_server_info info;
    moe_device_info dev[64];
    int rc = moe_hello(cl, &info), n = rc ? rc : moe_devices(cl, dev, 64);
    moe_disconnect(&cl);
    if (rc || n < 0)
        return moectl_fail("info", rc ? rc : n);
    printf("moed %s, protocol %u, backend %s\n", info.server_version, info.protocol_version,
           info.backend);
    for (int i = 0; i < n && i < 64; i++)
        printf("device %d: %s, %.1f GiB, %u compute units\n", i, dev[i].name,
               (double)dev[i].memory_bytes / (1ull << 30), dev[i].compute_units);
    printf("max batch tokens %u, max message %llu bytes\n", info.max_batch_tokens,
           (unsigned long long)info.max_message_bytes);
    printf("capabilities: %s\n", info.capabilities);
    return 0;
}

int cmd_layers(const char *rt, int argc, char **argv)
{
    if (moectl_no_more_args(argc, argv, 1))
        return 2;
    moe_client *cl = moectl_connect(rt, "moectl layers");
    if (!cl)
        return 1;
    moe_layer_info *infos;
    int n = moectl_layers(cl, &infos);
    moe_disconnect(&cl);
    if (n < 0)
        return moectl_fail("layers", n);
    if (n == 0)
        printf("no layers loaded\n");
    for (int i = 0; i < n; i++) {
        moe_layer_info *l = &infos[i];
        /* A file's name may hold anything but '/' and NUL: no control
         * character of it reaches the terminal. */
        for (char *p = l->source; *p; p++)
            if ((unsigned char)*p < 0x20 || *p == 0x7f)
                *p = '?';
        if (l->kind == MOE_LAYER_MOE)
            printf("%-20s moe  E=%u k=%u H=%u I=%u %s %s%s  %.1f MiB  %llu requests %llu tokens  %s\n",
                   l->name, l->experts, l->topk, l->hidden, l->intermediate,
                   moectl_dtype_name(l->dtype), routing_name(l->routing),
                   l->routing != MOE_ROUTING_GIVEN && l->renormalize ? "+renorm" : "",
                   (double)l->weight_bytes / (1 << 20), (unsigned long long)l->requests,
                   (unsigned long long)l->tokens, l->source);
        else
            printf("%-20s gemm G=%u N=%u K=%u %s  %.1f MiB  %llu requests %llu rows  %s\n", l->name,
                   l->groups, l->n, l->k, moectl_dtype_name(l->dtype),
                   (double)l->weight_bytes / (1 << 20), (unsigned long long)l->requests,
                   (unsigned long long)l->tokens, l->source);
        if (l->n_devices > 1 || (l->n_devices == 1 && l->devices[0] != 0)) {
            printf("%-20s   experts on devices:", "");
            for (int d = 0; d < l->n_devices; d++)
                printf(" %u (%.1f MiB)", l->devices[d], (double)l->device_bytes[d] / (1 << 20));
            printf("\n");
        }
    }
    free(infos);
    return 0;
}

/* A layer dimension: the wire carries 32 bits, so a larger value must be
 * refused here rather than wrap; 0 would mean "from the file", which is
 * what leaving the option out says. */
static uint32_t dim(const char *opt, const char *v)
{
    return (uint32_t)moectl_num(opt, v, 1, UINT32_MAX);
}

int cmd_load(const char *rt, int argc, char **argv)
{
    enum { O_FILE = 1, O_PREFIX, O_KIND, O_TOPK, O_E, O_H, O_I, O_DT, O_ROUTE, O_NORENORM,
           O_G, O_N, O_K, O_RANDOM, O_SEED, O_DEVICES, O_PLACEMENT };
    static const struct option o[] = {
        {"file", required_argument, NULL, O_FILE}, {"prefix", required_argument, NULL, O_PREFIX},
        {"kind", required_argument, NULL, O_KIND}, {"topk", required_argument, NULL, O_TOPK},
        {"experts", required_argument, NULL, O_E}, {"hidden", required_argument, NULL, O_H},
        {"intermediate", required_argument, NULL, O_I}, {"dtype", required_argument, NULL, O_DT},
        {"routing", required_argument, NULL, O_ROUTE},
        {"no-renormalize", no_argument, NULL, O_NORENORM},
        {"groups", required_argument, NULL, O_G}, {"n", required_argument, NULL, O_N},
        {"k", required_argument, NULL, O_K}, {"random", no_argument, NULL, O_RANDOM},
        {"seed", required_argument, NULL, O_SEED}, {"devices", required_argument, NULL, O_DEVICES},
        {"placement", required_argument, NULL, O_PLACEMENT}, {0},
    };
    static uint32_t devs[16], place[4096];
    moe_layer_desc d = {.renormalize = 1, .topk = 0};
    int c, random = 0;
    uint64_t seed = 1;
    bool given[O_PLACEMENT + 1] = {false};
    while ((c = getopt_long(argc, argv, "", o, NULL)) != -1) {
        if (c > 0 && c <= O_PLACEMENT)
            given[c] = true;
        switch (c) {
        case O_FILE:
            if (!optarg[0]) {
                fprintf(stderr, "moectl: --file needs a path\n");
                return 2;
            }
            d.path = optarg;
            break;
        case O_PREFIX: d.prefix = optarg; break;
        case O_KIND:
            if (!strcmp(optarg, "moe")) d.kind = MOE_LAYER_MOE;
            else if (!strcmp(optarg, "gemm")) d.kind = MOE_LAYER_GEMM;
            else { fprintf(stderr, "moectl: --kind is moe or gemm\n"); return 2; }
            break;
        case O_TOPK: d.topk = dim("--topk", optarg); break;
        case O_E: d.experts = dim("--experts", optarg); break;
        case O_H: d.hidden = dim("--hidden", optarg); break;
        case O_I: d.intermediate = dim("--intermediate", optarg); break;
        case O_G: d.groups = dim("--groups", optarg); break;
        case O_N: d.n = dim("--n", optarg); break;
        case O_K: d.k = dim("--k", optarg); break;
        case O_DT:
            if (!strcmp(optarg, "bf16")) d.dtype = MOE_DTYPE_BF16;
            else if (!strcmp(optarg, "fp16")) d.dtype = MOE_DTYPE_FP16;
            else if (!strcmp(optarg, "fp32")) d.dtype = MOE_DTYPE_FP32;
            else { fprintf(stderr, "moectl: --dtype is bf16, fp16 or fp32\n"); return 2; }
            break;
        case O_ROUTE:
            if (!strcmp(optarg, "softmax")) d.routing = MOE_ROUTING_SOFTMAX;
            else if (!strcmp(optarg, "sigmoid")) d.routing = MOE_ROUTING_SIGMOID;
            else if (!strcmp(optarg, "given")) d.routing = MOE_ROUTING_GIVEN;
            else { fprintf(stderr, "moectl: --routing is softmax, sigmoid or given\n"); return 2; }
            break;
        case O_NORENORM: d.renormalize = 0; break;
        case O_RANDOM: random = 1; break;
        case O_SEED: seed = moectl_num("--seed", optarg, 0, UINT64_MAX); break;
        case O_DEVICES:
            if ((d.n_devices = moectl_list("--devices", optarg, devs, 16)) == 0)
                return 2;
            d.devices = devs;
            break;
        case O_PLACEMENT:
            if ((d.n_expert_device = moectl_list("--placement", optarg, place, 4096)) == 0)
                return 2;
            d.expert_device = place;
            break;
        default: return 2;
        }
    }
    if (optind + 1 != argc || (!d.path) == !random) {
        fprintf(stderr, "usage: moectl load NAME (--file FILE | --random) [options]\n");
        return 2;
    }
    /* An option that does not go with the rest would be dropped unsaid
     * (the daemon reads only what the layer's source and kind use): refuse
     * it, so that what loads is what the command line says. */
    static const struct {
        int opt;
        const char *name, *why;
    } misfit[] = {
        {O_PREFIX, "--prefix", "goes with --file"}, {O_SEED, "--seed", "goes with --random"},
        {O_TOPK, "--topk", "is for MoE layers"}, {O_E, "--experts", "is for MoE layers"},
        {O_H, "--hidden", "is for MoE layers"}, {O_I, "--intermediate", "is for MoE layers"},
        {O_ROUTE, "--routing", "is for MoE layers"},
        {O_NORENORM, "--no-renormalize", "is for MoE layers"},
        {O_DEVICES, "--devices", "is for MoE layers"},
        {O_PLACEMENT, "--placement", "is for MoE layers"},
        {O_G, "--groups", "is for GEMM layers (--kind gemm)"},
        {O_N, "--n", "is for GEMM layers (--kind gemm)"},
        {O_K, "--k", "is for GEMM layers (--kind gemm)"},
    };
    for (size_t m = 0; m < sizeof(misfit) / sizeof(misfit[0]); m++) {
        int opt = misfit[m].opt;
        bool gemm_opt = opt == O_G || opt == O_N || opt == O_K;
        bool fits = opt == O_PREFIX ? !random
                    : opt == O_SEED ? random
                    : gemm_opt      ? d.kind == MOE_LAYER_GEMM
                                    : d.kind == MOE_LAYER_MOE;
        if (given[opt] && !fits) {
            fprintf(stderr, "moectl: load: %s %s\n", misfit[m].name, misfit[m].why);
            return 2;
        }
    }
    d.name = argv[optind];
    if (d.kind == MOE_LAYER_MOE && !d.topk)
        d.topk = 2;
    if (random && moectl_random_check(&d))
        return 2;
    moe_client *cl = moectl_connect(rt, "moectl load");
    if (!cl)
        return 1;
    moe_region *r = NULL;
    int rc = random ? moectl_random_weights(cl, &d, seed, &r) : 0;
    if (rc) { /* printed */
        moe_disconnect(&cl);
        return 1;
    }
    /* A large checkpoint's layer may take minutes to read: the load is
     * waited for as long as it takes (a daemon that goes away still ends
     * the wait, through the session socket). */
    moe_set_timeout(cl, -1);
    moe_layer_info info;
    rc = moe_layer_load(cl, &d, &info);
    if (r)
        moe_region_free(cl, &r);
    moe_disconnect(&cl);
    if (rc)
        return moectl_fail("load", rc);
    printf("loaded %s: %.1f MiB from %s\n", info.name, (double)info.weight_bytes / (1 << 20),
           info.source);
    return 0;
}

int cmd_unload(const char *rt, int argc, char **argv)
{
    if (argc != 2 || argv[1][0] == '-') {
        fprintf(stderr, "usage: moectl unload NAME\n");
        return 2;
    }
    moe_client *cl = moectl_connect(rt, "moectl unload");
    if (!cl)
        return 1;
    int rc = moe_layer_unload(cl, argv[1]);
    moe_disconnect(&cl);
    if (rc)
        return moectl_fail("unload", rc);
    printf("unloaded %s\n", argv[1]);
    return 0;
}

static cJSON *hist_json(int n, const uint64_t (*b)[2])
{
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "le", (double)b[i][0]);
        cJSON_AddNumberToObject(o, "count", (double)b[i][1]);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

int cmd_stats(const char *rt, int argc, char **argv)
{
    static const struct option o[] = {{"json", no_argument, NULL, 'j'}, {0}};
    int json = 0, c;
    while ((c = getopt_long(argc, argv, "", o, NULL)) != -1) {
        if (c == 'j')
            json = 1;
        else
            return 2;
    }
    if (moectl_no_more_args(argc, argv, optind))
        return 2;
    moe_client *cl = moectl_connect(rt, "moectl stats");
    if (!cl)
        return 1;
    moe_stats s;
    moe_layer_info *layers = NULL;
    int rc = moe_stats_get(cl, &s);
    int nl = rc ? 0 : moectl_layers(cl, &layers);
    moe_disconnect(&cl);
    if (rc)
        return moectl_fail("stats", rc);
    if (nl < 0)
        return moectl_fail("stats", nl);
    uint64_t br[MOE_STATS_BUCKETS][2], bt[MOE_STATS_BUCKETS][2];
    for (int i = 0; i < s.n_batch_requests; i++) {
        br[i][0] = s.batch_requests[i].le;
        br[i][1] = s.batch_requests[i].count;
    }
    for (int i = 0; i < s.n_batch_tokens; i++) {
        bt[i][0] = s.batch_tokens[i].le;
        bt[i][1] = s.batch_tokens[i].count;
    }
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "backend", s.backend);
        cJSON_AddNumberToObject(j, "uptime_us", (double)s.uptime_us);
        cJSON_AddNumberToObject(j, "requests", (double)s.requests);
        cJSON_AddNumberToObject(j, "errors", (double)s.errors);
        cJSON_AddNumberToObject(j, "busy", (double)s.busy);
        cJSON_AddNumberToObject(j, "expired", (double)s.expired);
        cJSON_AddNumberToObject(j, "batches", (double)s.batches);
        cJSON_AddNumberToObject(j, "tokens", (double)s.tokens);
        cJSON_AddNumberToObject(j, "sessions", s.sessions);
        cJSON_AddNumberToObject(j, "regions", s.regions);
        cJSON_AddNumberToObject(j, "region_bytes", (double)s.region_bytes);
        cJSON_AddNumberToObject(j, "queue_depth", s.queue_depth);
        cJSON_AddNumberToObject(j, "queue_wait_p50_us", (double)s.queue_wait_p50_us);
        cJSON_AddNumberToObject(j, "queue_wait_p99_us", (double)s.queue_wait_p99_us);
        cJSON_AddNumberToObject(j, "compute_p50_us", (double)s.compute_p50_us);
        cJSON_AddNumberToObject(j, "compute_p99_us", (double)s.compute_p99_us);
        cJSON_AddNumberToObject(j, "compute_us_total", (double)s.compute_us_total);
        cJSON_AddNumberToObject(j, "idle_p50_us", (double)s.idle_p50_us);
        cJSON_AddNumberToObject(j, "idle_p99_us", (double)s.idle_p99_us);
        cJSON_AddNumberToObject(j, "notice_p50_us", (double)s.notice_p50_us);
        cJSON_AddNumberToObject(j, "reply_p50_us", (double)s.reply_p50_us);
        cJSON_AddNumberToObject(j, "return_p50_us", (double)s.return_p50_us);
        cJSON_AddNumberToObject(j, "launch_p50_us", (double)s.launch_p50_us);
        cJSON_AddNumberToObject(j, "mean_batch_requests",
                                s.batches ? (double)s.requests / (double)s.batches : 0);
        cJSON_AddItemToObject(j, "batch_requests_hist", hist_json(s.n_batch_requests, br));
        cJSON_AddItemToObject(j, "batch_tokens_hist", hist_json(s.n_batch_tokens, bt));
        cJSON *ls = cJSON_AddArrayToObject(j, "layers");
        for (int i = 0; i < nl; i++) {
            cJSON *lo = cJSON_CreateObject();
            cJSON_AddStringToObject(lo, "name", layers[i].name);
            cJSON_AddNumberToObject(lo, "requests", (double)layers[i].requests);
            cJSON_AddNumberToObject(lo, "tokens", (double)layers[i].tokens);
            cJSON_AddItemToArray(ls, lo);
        }
        char *txt = cJSON_Print(j);
        printf("%s\n", txt);
        free(txt);
        cJSON_Delete(j);
        free(layers);
        return 0;
    }
    printf("backend %s, up %.1f s, %u sessions, %u regions (%.1f MiB)\n", s.backend,
           (double)s.uptime_us / 1e6, s.sessions, s.regions, (double)s.region_bytes / (1 << 20));
    printf("requests %llu, errors %llu, busy %llu, expired %llu, tokens %llu\n",
           (unsigned long long)s.requests, (unsigned long long)s.errors,
           (unsigned long long)s.busy, (unsigned long long)s.expired, (unsigned long long)s.tokens);
    printf("batches %llu (mean %.2f requests), queue depth %u\n", (unsigned long long)s.batches,
           s.batches ? (double)s.requests / (double)s.batches : 0.0, s.queue_depth);
    printf("queue wait p50 %llu us p99 %llu us; compute p50 %llu us p99 %llu us, total %.3f s\n",
           (unsigned long long)s.queue_wait_p50_us, (unsigned long long)s.queue_wait_p99_us,
           (unsigned long long)s.compute_p50_us, (unsigned long long)s.compute_p99_us,
           (double)s.compute_us_total / 1e6);
    /* In the cycle's order (stats.h): replies, the loop taking the batch
     * back, the rest of the next requests, the launch. */
    printf("between batches under load: device idle p50 %llu us p99 %llu us; p50s: reply %llu, "
           "notice %llu, return %llu, launch %llu us\n",
           (unsigned long long)s.idle_p50_us, (unsigned long long)s.idle_p99_us,
           (unsigned long long)s.reply_p50_us, (unsigned long long)s.notice_p50_us,
           (unsigned long long)s.return_p50_us, (unsigned long long)s.launch_p50_us);
    printf("requests per batch:");
    for (int i = 0; i < s.n_batch_requests; i++)
        printf(" <=%llu:%llu", (unsigned long long)br[i][0], (unsigned long long)br[i][1]);
    printf("\ntokens per batch:  ");
    for (int i = 0; i < s.n_batch_tokens; i++)
        printf(" <=%llu:%llu", (unsigned long long)bt[i][0], (unsigned long long)bt[i][1]);
    printf("\n");
    for (int i = 0; i < nl; i++)
        printf("layer %-20s %llu requests, %llu tokens\n", layers[i].name,
               (unsigned long long)layers[i].requests, (unsigned long long)layers[i].tokens);
    free(layers);
    return 0;
}
