/*
 * status.h: the one table between moed's internal error codes (negative
 * errno values), the wire's Moe__Status and the text moe_strerror() prints.
 * Compiled into both the daemon and libmoe.
 */
#ifndef MOE_PROTO_STATUS_H
#define MOE_PROTO_STATUS_H

/* Wire status for an internal code (0 or negative errno). Unknown codes
 * become STATUS_INTERNAL. Returns a Moe__Status value. */
int status_from_errno(int err);

/* Negative errno for a wire status; 0 for STATUS_OK, -EPROTO for values this
 * build does not know. */
int status_to_errno(int status);

/* Text for a code, never NULL: moed's wording for the codes the protocol
 * uses, strerror()'s for the rest. */
const char *status_strerror(int err);

#endif
