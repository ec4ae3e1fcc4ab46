/*
 * demo.h: the built-in demo layers that `moed --demo` serves: a MoE layer
 * "demo" (E=8, k=2, H=256, I=512, bf16, softmax routing, renormalised) and a
 * grouped-GEMM layer "demo-gemm" (B [8, 512, 256], bf16), written to a
 * safetensors file and then loaded through the normal loader.
 */
#ifndef MOED_DEMO_H
#define MOED_DEMO_H

#include <stddef.h>

/* Write dir/demo.safetensors (dir is created). 0 or -errno. */
int demo_write(const char *dir, char *path, size_t path_len);

#endif
