/*
 * unit.h: helpers shared by the unit tests: a leak check for sanitizer
 * builds and a scratch directory removed when the case ends.
 */
#ifndef MOE_TEST_UNIT_H
#define MOE_TEST_UNIT_H

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "tests/harness.h"

/* In the SAN build, a case that leaked fails: the harness ends each child
 * with _exit(), which skips LeakSanitizer's own check at exit. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#define CHECK_NO_LEAKS() CHECK(__lsan_do_recoverable_leak_check() == 0)
#else
#define CHECK_NO_LEAKS() ((void)0)
#endif

/* The case's scratch directories (a case may make more than one: a
 * daemon's runtime directory beside its own). */
#define TMP_DIRS 4
static char tmp_dirs[TMP_DIRS][64];
static int tmp_ndirs;

static inline int tmp_rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

static inline void tmp_cleanup(void)
{
    while (tmp_ndirs > 0)
        nftw(tmp_dirs[--tmp_ndirs], tmp_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A fresh directory /tmp/moed-test-<tag>-XXXXXX for this case; removed,
 * with the case's others, by tmp_cleanup() or as the case ends
 * (test_on_exit). */
static inline const char *tmp_dir_new(const char *tag)
{
    CHECK_MSG(tmp_ndirs < TMP_DIRS, "more than %d scratch directories", TMP_DIRS);
    char *dir = tmp_dirs[tmp_ndirs];
    snprintf(dir, sizeof(tmp_dirs[0]), "/tmp/moed-test-%s-XXXXXX", tag);
    CHECK(mkdtemp(dir) != NULL);
    tmp_ndirs++;
    test_on_exit(tmp_cleanup);
    return dir;
}

#endif
