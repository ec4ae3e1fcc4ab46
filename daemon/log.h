/*
 * log.h: the daemon's log. Lines go to stderr; when stderr is journald's
 * stream (JOURNAL_STREAM names it) each line starts with a syslog priority
 * prefix such as "<3>", which journald turns into the entry's priority.
 * Only main-level code logs: modules below return errors to their caller.
 */
#ifndef MOED_LOG_H
#define MOED_LOG_H

#include <stdarg.h>

enum log_level {
    LOG_LEVEL_ERR = 3,
    LOG_LEVEL_WARNING = 4,
    LOG_LEVEL_NOTICE = 5,
    LOG_LEVEL_INFO = 6,
    LOG_LEVEL_DEBUG = 7,
};

/* Decide once whether to print priority prefixes; sets the threshold. */
void log_init(enum log_level max_level);
void log_set_level(enum log_level max_level);
/* "err", "warning", "notice", "info", "debug" (or 3..7); -1 if unknown. */
int log_level_parse(const char *s);

void log_msg(enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define log_err(...) log_msg(LOG_LEVEL_ERR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_LEVEL_WARNING, __VA_ARGS__)
#define log_notice(...) log_msg(LOG_LEVEL_NOTICE, __VA_ARGS__)
#define log_info(...) log_msg(LOG_LEVEL_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_LEVEL_DEBUG, __VA_ARGS__)

#endif
