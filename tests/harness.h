/*
 * harness.h: the tiny test harness every unit and integration test uses.
 *
 * A test file defines cases with TEST(name) and lists them in main():
 *
 *     TEST(parses_header) { CHECK(x == 1); CHECK_EQ_INT(a, b); }
 *     int main(int argc, char **argv) {
 *         return test_main(argc, argv, (struct test_case[]){
 *             TEST_CASE(parses_header), {0}});
 *     }
 *
 * Each case runs in its own child process (a crash fails that case only) under
 * an alarm. The binary prints one "PASS name" / "FAIL name" / "SKIP name" line
 * per case, which tests/run.sh counts, and exits non-zero if a case failed.
 * A case skips by calling TEST_SKIP("why") (e.g. no GPU on this machine).
 * An argument names the only case to run.
 */
#ifndef MOE_TEST_HARNESS_H
#define MOE_TEST_HARNESS_H

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct test_case {
    const char *name;
    void (*fn)(void);
    unsigned timeout_s; /* 0: the default, 120 s */
};

#define TEST(name) static void name(void)
#define TEST_CASE(name) {#name, name, 0}
#define TEST_CASE_TIMEOUT(name, s) {#name, name, (s)}

#define TEST_EXIT_SKIP 77
#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#define FAIL_AT(...)                                                          \
    do {                                                                      \
        fprintf(stderr, "  %s:%d: ", __FILE__, __LINE__);                     \
        fprintf(stderr, __VA_ARGS__);                                         \
        fputc('\n', stderr);                                                  \
        exit(1);                                                              \
    } while (0)

#define CHECK(cond)                                                           \
    do {                                                                      \
        if (!(cond))                                                          \
            FAIL_AT("check failed: %s", #cond);                               \
    } while (0)

#define CHECK_MSG(cond, ...)                                                  \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "  %s:%d: check failed: %s: ", __FILE__,          \
                    __LINE__, #cond);                                         \
            fprintf(stderr, __VA_ARGS__);                                     \
            fputc('\n', stderr);                                              \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                    \
    do {                                                                      \
        long long a_ = (long long)(a), b_ = (long long)(b);                   \
        if (a_ != b_)                                                         \
            FAIL_AT("%s == %s: %lld != %lld", #a, #b, a_, b_);                \
    } while (0)

#define CHECK_STR_EQ(a, b)                                                    \
    do {                                                                      \
        const char *a_ = (a), *b_ = (b);                                      \
        if (!a_ || !b_ || strcmp(a_, b_) != 0)                                \
            FAIL_AT("%s == %s: \"%s\" != \"%s\"", #a, #b, a_ ? a_ : "(null)", \
                    b_ ? b_ : "(null)");                                      \
    } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                       \
    do {                                                                      \
        const char *h_ = (hay), *n_ = (needle);                               \
        if (!h_ || !strstr(h_, n_))                                           \
            FAIL_AT("\"%s\" does not contain \"%s\"", h_ ? h_ : "(null)",     \
                    n_);                                                      \
    } while (0)

#define TEST_SKIP(...)                                                        \
    do {                                                                      \
        fprintf(stderr, "  skip: ");                                          \
        fprintf(stderr, __VA_ARGS__);                                         \
        fputc('\n', stderr);                                                  \
        exit(TEST_EXIT_SKIP);                                                 \
    } while (0)

/* Cleanups a case registers for its scratch files (test_on_exit): they run
 * as the case's process ends, whether it passed (the harness then ends it
 * with _exit(), which skips atexit handlers) or failed (exit(1), through
 * atexit). Each runs once, and only in the process that registered it: a
 * child the case forks inherits the atexit handler, and its exit must not
 * remove the case's files. */
#define TEST_CLEANUPS 8
struct test_cleanup_list {
    void (*fn[TEST_CLEANUPS])(void);
    int n;
    pid_t pid;
};
static inline struct test_cleanup_list *test_cleanup_list(void)
{
    static struct test_cleanup_list list;
    return &list;
}
static inline void test_run_cleanups(void)
{
    struct test_cleanup_list *l = test_cleanup_list();
    if (l->pid != getpid())
        return;
    while (l->n > 0)
        l->fn[--l->n]();
}
static inline void test_on_exit(void (*fn)(void))
{
    struct test_cleanup_list *l = test_cleanup_list();
    static int hooked;
    if (l->pid != getpid()) { /* a forked child's own: not its parent's */
        l->n = 0;
        l->pid = getpid();
    }
    for (int i = 0; i < l->n; i++)
        if (l->fn[i] == fn)
            return;
    CHECK_MSG(l->n < TEST_CLEANUPS, "more than %d cleanups", TEST_CLEANUPS);
    if (!hooked)
        hooked = atexit(test_run_cleanups) == 0;
    l->fn[l->n++] = fn;
}

/* A storm of signals: test_signal_storm(period_us) sends this process
 * SIGUSR1 every period_us, to a handler installed without SA_RESTART, so
 * that system calls that can fail with EINTR do (poll and ZeroMQ's calls
 * would even with SA_RESTART), as in a program with a profiler's timer or
 * handlers of its own; test_signal_storm(0) stops it. test_signals_taken
 * counts the signals handled since the storm started. */
static volatile sig_atomic_t test_signals_taken;

static void test_on_storm_signal(int sig)
{
    (void)sig;
    test_signals_taken++;
}

static inline void test_signal_storm(long period_us)
{
    static timer_t tid;
    static int created;
    if (!created) {
        struct sigaction sa = {.sa_handler = test_on_storm_signal};
        sigemptyset(&sa.sa_mask);
        struct sigevent sev = {.sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGUSR1};
        CHECK(sigaction(SIGUSR1, &sa, NULL) == 0 &&
              timer_create(CLOCK_MONOTONIC, &sev, &tid) == 0);
        created = 1;
    }
    struct timespec every = {period_us / 1000000, period_us % 1000000 * 1000};
    struct itimerspec its = {.it_value = every, .it_interval = every};
    if (period_us > 0)
        test_signals_taken = 0;
    CHECK(timer_settime(tid, 0, &its, NULL) == 0);
}

static inline int test_main(int argc, char **argv, const struct test_case *cases)
{
    int failed = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (const struct test_case *tc = cases; tc->name; tc++)
            printf("%s\n", tc->name);
        return 0;
    }
    for (const struct test_case *tc = cases; tc->name; tc++) {
        if (argc > 1 && strcmp(argv[1], tc->name) != 0)
            continue;
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        if (pid < 0) {
            printf("FAIL %s (fork: %s)\n", tc->name, strerror(errno));
            failed++;
            continue;
        }
        if (pid == 0) {
            alarm(tc->timeout_s ? tc->timeout_s : 120);
            tc->fn();
            test_run_cleanups();
            fflush(stdout);
            fflush(stderr);
            _exit(0);
        }
        int st = 0;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
            printf("PASS %s\n", tc->name);
        } else if (WIFEXITED(st) && WEXITSTATUS(st) == TEST_EXIT_SKIP) {
            printf("SKIP %s\n", tc->name);
        } else {
            if (WIFSIGNALED(st))
                printf("FAIL %s (signal %d%s)\n", tc->name, WTERMSIG(st),
                       WTERMSIG(st) == SIGALRM ? ", timed out" : "");
            else
                printf("FAIL %s\n", tc->name);
            failed++;
        }
    }
    return failed ? 1 : 0;
}

/* A deterministic per-test random stream (xorshift64*), seeded from the
 * clock unless MOE_TEST_SEED is set; the seed is printed so a failure can be
 * replayed. */
static inline uint64_t test_seed(void)
{
    const char *s = getenv("MOE_TEST_SEED");
    uint64_t seed = s ? strtoull(s, NULL, 0) : 0;
    if (!seed) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = ((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec ^
               ((uint64_t)getpid() << 32);
        if (!seed)
            seed = 1;
    }
    fprintf(stderr, "  seed: MOE_TEST_SEED=0x%llx\n", (unsigned long long)seed);
    return seed;
}

static inline uint64_t test_rand(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

/* Uniform in [-1, 1). */
static inline float test_randf(uint64_t *s)
{
    return (float)((test_rand(s) >> 40) * (1.0 / (1ull << 24))) * 2.0f - 1.0f;
}

#endif
