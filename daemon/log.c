/*
 * log.c: see log.h. One formatted write per line, so lines from the worker
 * thread and the loop never interleave.
 */
#include "daemon/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static enum log_level log_max = LOG_LEVEL_INFO;
static int log_prefix; /* 1: "<N>" prefixes for journald */

/* JOURNAL_STREAM is "device:inode" of the stream journald gave us; only if
 * stderr is still that stream do prefixes belong on it. */
static int stderr_is_journal(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2)
        return 0;
    if (fstat(STDERR_FILENO, &st) < 0)
        return 0;
    return (unsigned long long)st.st_dev == dev &&
           (unsigned long long)st.st_ino == ino;
}

void log_init(enum log_level max_level)
{
    log_max = max_level;
    log_prefix = stderr_is_journal();
}

void log_set_level(enum log_level max_level)
{
    log_max = max_level;
}

int log_level_parse(const char *s)
{
    static const char *names[] = {"emerg", "alert", "crit", "err",
                                  "warning", "notice", "info", "debug"};
    if (!s)
        return -1;
    for (int i = 3; i < 8; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    if (strcmp(s, "error") == 0)
        return LOG_LEVEL_ERR;
    if (strcmp(s, "warn") == 0)
        return LOG_LEVEL_WARNING;
    if (s[0] >= '3' && s[0] <= '7' && s[1] == '\0')
        return s[0] - '0';
    return -1;
}

void log_msg(enum log_level level, const char *fmt, ...)
{
    static const char *tags[] = {"", "", "", "error: ", "warning: ", "", "", "debug: "};
    char line[2048];
    int n = 0;
    if (level > log_max)
        return;
    if (log_prefix)
        n = snprintf(line, sizeof(line), "<%d>", (int)level);
    else
        n = snprintf(line, sizeof(line), "moed: %s", tags[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        return;
    int start = n;
    n += m;
    if (n > (int)sizeof(line) - 2)
        n = (int)sizeof(line) - 2;
    /* One message, one line: a control character in what a client named (a
     * session's name, a file's path) would begin a line of its own in the
     * journal, which could pass for moed's. */
    for (int i = start; i < n; i++)
        if ((unsigned char)line[i] < 0x20 || line[i] == 0x7f)
            line[i] = '?';
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}
