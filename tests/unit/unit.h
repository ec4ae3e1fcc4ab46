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

static char tmp_root[64];

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
    if (tmp_root[0])
        nftw(tmp_root, tmp_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    tmp_root[0] = '\0';
}

/* A fresh directory /tmp/moed-test-<tag>-XXXXXX for this case; removed by
 * tmp_cleanup() or as the case ends (test_on_exit). */
static inline const char *tmp_dir_new(const char *tag)
{
    snprintf(tmp_root, sizeof(tmp_root), "/tmp/moed-test-%s-XXXXXX", tag);
    CHECK(mkdtemp(tmp_root) != NULL);
    test_on_exit(tmp_cleanup);
    return tmp_root;
}

#endif
