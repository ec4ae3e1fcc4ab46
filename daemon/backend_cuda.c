/*
 * backend_cuda.c: the CUDA backend. Built as a stub that reports -ENODEV
 * until the CUDA kernels are compiled in (MOE_HAVE_CUDA).
 */
#include "daemon/backend.h"

#include <errno.h>
#include <stddef.h>

int backend_cuda_new(int device, struct backend **out)
{
    *out = NULL;
    return -ENODEV;
}
