/*
 * replay.c: a main for a fuzz target without libFuzzer (any compiler, the
 * SAN=1 build included): `make test` runs every seed in
 * tests/fuzz/corpus/<target>/ and every crash found so far in
 * tests/fuzz/regress/<target>/ through the target once, as two test cases,
 * and the seeds again under a storm of signals (a third).
 * With file arguments it runs just those (to reproduce a crash under gdb).
 *
 * Compiled with -DFUZZ_TARGET=\"request\" (or safetensors, config) and linked
 * with tests/fuzz/fuzz_<target>.c.
 */
#include <dirent.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/harness.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* A target's teardown, where it has one (fuzz_safetensors: its scratch
 * directory; libFuzzer's process runs it at exit), run here as each case
 * ends: the harness ends a passing case by _exit(). */
void fuzz_target_cleanup(void) __attribute__((weak));

static char current[1024];

/* Say which input crashed, before dying of it. */
static void on_fatal(int sig)
{
    const char pre[] = "  crashed on input: ";
    if (write(2, pre, sizeof(pre) - 1) < 0 || write(2, current, strlen(current)) < 0 ||
        write(2, "\n", 1) < 0) {
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    CHECK(buf && fread(buf, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    snprintf(current, sizeof(current), "%s", path);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every regular file of dir (none if it does not exist); the count. */
static int run_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    char **names = NULL;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        names = realloc(names, (size_t)(n + 1) * sizeof(*names));
        CHECK(names != NULL);
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    if (n)
        qsort(names, (size_t)n, sizeof(*names), name_cmp);
    for (int i = 0; i < n; i++) {
        char path[1024];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        struct stat st;
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode))
            run_file(path);
        free(names[i]);
    }
    free(names);
    return n;
}

static void start(void)
{
    signal(SIGABRT, on_fatal);
    signal(SIGSEGV, on_fatal);
    signal(SIGBUS, on_fatal);
    LLVMFuzzerInitialize(NULL, NULL);
    if (fuzz_target_cleanup)
        test_on_exit(fuzz_target_cleanup);
}

static void run_one_dir(const char *kind, bool must_exist)
{
    char dir[256];
    snprintf(dir, sizeof(dir), "tests/fuzz/%s/%s", kind, FUZZ_TARGET);
    int n = run_dir(dir);
    CHECK_MSG(n > 0 || !must_exist, "no inputs in %s", dir);
    fprintf(stderr, "  %s: %d inputs\n", dir, n);
}

TEST(seed_corpus)
{
    start();
    run_one_dir("corpus", true);
}

TEST(crash_regressions)
{
    start();
    run_one_dir("regress", false);
}

/* The seed corpus again, ten times over, under a signal every 20 us (as
 * libFuzzer's SIGALRM, its -timeout watch, lands now and then): code under
 * test that takes EINTR for an error shows here, not once in a long fuzz
 * run. */
TEST(seed_corpus_under_signals)
{
    start(); /* the target's setup is not under test here */
    test_signal_storm(20);
    for (int pass = 0; pass < 10; pass++)
        run_one_dir("corpus", true);
    test_signal_storm(0);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strchr(argv[1], '/')) {
        start();
        for (int i = 1; i < argc; i++)
            run_file(argv[i]);
        printf("ran %d inputs\n", argc - 1);
        return 0;
    }
    return test_main(argc, argv, (struct test_case[]){
        {FUZZ_TARGET "_seed_corpus", seed_corpus, 0},
        {FUZZ_TARGET "_crash_regressions", crash_regressions, 0},
        {FUZZ_TARGET "_seed_corpus_under_signals", seed_corpus_under_signals, 0},
        {0}});
}
