/*
 * backend.c: choosing a backend. The vtable calls themselves go straight
 * through b->ops.
 */
#include "daemon/backend.h"

#include <errno.h>
#include <string.h>

int backend_open(const char *which, int device, int cpu_threads, struct backend **out)
{
    *out = NULL;
    if (!which || strcmp(which, "auto") == 0) {
        if (backend_cuda_new(device, out) == 0)
            return 0;
        return backend_cpu_new(cpu_threads, out);
    }
    if (strcmp(which, "cpu") == 0)
        return backend_cpu_new(cpu_threads, out);
    if (strcmp(which, "cuda") == 0)
        return backend_cuda_new(device, out);
    return -EINVAL;
}

void backend_free(struct backend **bp)
{
    struct backend *b = *bp;
    *bp = NULL;
    if (b)
        b->ops->destroy(b);
}
