/*
 * demo.c: see demo.h. Weights are drawn uniformly with the variance of
 * N(0, 1/fan_in) from a fixed seed, so every demo daemon serves the same
 * layer and a client's --check means the same thing everywhere.
 */
#include "daemon/demo.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "daemon/safetensors.h"
#include "kernels/moe_kernels.h"

enum { DEMO_E = 8, DEMO_H = 256, DEMO_I = 512, DEMO_G = 8, DEMO_N = 512, DEMO_K = 256 };

static uint64_t demo_rand(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

/* Uniform in [-a, a) with a = sqrt(3 / fan_in): variance 1 / fan_in. */
static void demo_fill(uint16_t *dst, size_t n, double fan_in, uint64_t *seed)
{
    static const double sqrt3 = 1.7320508075688772;
    double a = sqrt3 / sqrt(fan_in);
    for (size_t i = 0; i < n; i++) {
        double u = (double)(demo_rand(seed) >> 11) * (1.0 / 9007199254740992.0);
        dst[i] = moek_f32_to_bf16((float)((2.0 * u - 1.0) * a));
    }
}

int demo_write(const char *dir, char *path, size_t path_len)
{
    if (mkdir(dir, 0750) < 0 && errno != EEXIST)
        return -errno;
    if (snprintf(path, path_len, "%s/demo.safetensors", dir) >= (int)path_len)
        return -ENAMETOOLONG;
    size_t per = (size_t)DEMO_H * DEMO_I;
    struct st_out t[3 * DEMO_E + 1];
    uint16_t *buf = malloc((3 * DEMO_E * per + (size_t)DEMO_G * DEMO_N * DEMO_K) * 2);
    if (!buf)
        return -ENOMEM;
    static char names[3 * DEMO_E][64];
    static const char *parts[3] = {"w1", "w3", "w2"};
    uint64_t seed = 0x6d6f6564u; /* "moed" */
    size_t n = 0;
    for (int e = 0; e < DEMO_E; e++)
        for (int p = 0; p < 3; p++, n++) {
            uint16_t *w = buf + n * per;
            snprintf(names[n], sizeof(names[n]), "model.layers.0.block_sparse_moe.experts.%d.%s.weight",
                     e, parts[p]);
            demo_fill(w, per, p < 2 ? DEMO_H : DEMO_I, &seed);
            t[n] = (struct st_out){.name = names[n], .dtype = ST_BF16, .ndim = 2,
                                   .shape = {p < 2 ? DEMO_I : DEMO_H, p < 2 ? DEMO_H : DEMO_I},
                                   .data = w};
        }
    uint16_t *b = buf + n * per;
    demo_fill(b, (size_t)DEMO_G * DEMO_N * DEMO_K, DEMO_K, &seed);
    t[n++] = (struct st_out){.name = "demo_gemm.weight", .dtype = ST_BF16, .ndim = 3,
                             .shape = {DEMO_G, DEMO_N, DEMO_K}, .data = b};
    int rc = st_write(path, t, n);
    free(buf);
    return rc;
}
