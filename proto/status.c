/*
 * status.c: see status.h. The table is the single place that pairs an errno
 * value with its wire status and its description.
 */
#include "proto/status.h"

#include <errno.h>
#include <string.h>

#include "moe.pb-c.h"

static const struct {
    int err;
    int status;
    const char *text;
} status_table[] = {
    {0, MOE__STATUS__STATUS_OK, "success"},
    {-EINVAL, MOE__STATUS__STATUS_INVALID_ARGUMENT, "invalid argument"},
    {-ENOENT, MOE__STATUS__STATUS_NOT_FOUND, "not found"},
    {-EEXIST, MOE__STATUS__STATUS_ALREADY_EXISTS, "already exists"},
    {-EACCES, MOE__STATUS__STATUS_PERMISSION_DENIED, "permission denied"},
    {-EDQUOT, MOE__STATUS__STATUS_RESOURCE_EXHAUSTED, "quota or limit exceeded"},
    {-EBUSY, MOE__STATUS__STATUS_BUSY, "daemon busy: queue full, try again"},
    {-ETIME, MOE__STATUS__STATUS_DEADLINE_EXCEEDED, "deadline exceeded before the request ran"},
    {-ECANCELED, MOE__STATUS__STATUS_CANCELLED, "request cancelled"},
    {-ENOTSUP, MOE__STATUS__STATUS_UNSUPPORTED, "not supported"},
    {-EPROTO, MOE__STATUS__STATUS_PROTOCOL, "protocol error: message could not be decoded"},
    {-ENOTRECOVERABLE, MOE__STATUS__STATUS_INTERNAL, "internal error in the daemon"},
    {-EIO, MOE__STATUS__STATUS_IO, "weight file could not be read"},
    {-ENOMEM, MOE__STATUS__STATUS_OUT_OF_MEMORY, "out of memory"},
};

#define N_STATUS (sizeof(status_table) / sizeof(status_table[0]))

int status_from_errno(int err)
{
    /* Codes that share a meaning with a table entry. */
    switch (err) {
    case -EPERM: err = -EACCES; break;
    case -EMFILE: case -ENOSPC: case -E2BIG: case -EMSGSIZE: err = -EDQUOT; break;
    case -EBADMSG: err = -EPROTO; break;
    case -EOVERFLOW: case -ERANGE: err = -EINVAL; break;
    default: break;
    }
    for (unsigned i = 0; i < N_STATUS; i++)
        if (status_table[i].err == err)
            return status_table[i].status;
    return MOE__STATUS__STATUS_INTERNAL;
}

int status_to_errno(int status)
{
    for (unsigned i = 0; i < N_STATUS; i++)
        if (status_table[i].status == status)
            return status_table[i].err;
    return -EPROTO;
}

const char *status_strerror(int err)
{
    for (unsigned i = 0; i < N_STATUS; i++)
        if (status_table[i].err == err)
            return status_table[i].text;
    switch (err) {
    case -ETIMEDOUT: return "timed out waiting for the daemon";
    case -ENOTCONN: return "not connected to the daemon";
    case -ECONNREFUSED: return "connection refused: is moed running?";
    case -ECONNRESET: return "connection to the daemon was lost";
    case -EAGAIN: return "not ready yet";
    default: break;
    }
    return err < 0 && err > -4096 ? strerror(-err) : "unknown error"; /* -INT_MIN overflows */
}
