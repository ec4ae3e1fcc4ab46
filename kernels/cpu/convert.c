/*
 * convert.c: dtype sizes and the bf16/fp16 <-> fp32 conversions every kernel
 * family shares.
 *
 * The scalar functions are the definition (round to nearest, ties to even;
 * NaN stays NaN and is made quiet; fp16 subnormals and infinities exact). The
 * bulk moek_to_f32() / moek_from_f32() loops call inline copies of the same
 * code, so they give the same bits as the scalar functions. The widening
 * conversions and the bf16 narrowing are written as selects without branches
 * so those loops vectorise; fp16 narrowing only runs on outputs and at weight
 * load time, so it stays the plain branchy version.
 */
#include "moe_kernels.h"

#include <string.h>

static inline uint32_t convert_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float convert_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float convert_bf16_f32(uint16_t v)
{
    return convert_bits_f32((uint32_t)v << 16);
}

static inline uint16_t convert_f32_bf16(float f)
{
    uint32_t u = convert_f32_bits(f);
    /* Adding 0x7fff plus the lowest kept bit rounds to nearest even; a carry
     * out of the mantissa moves into the exponent, which is exactly the
     * rounding up to the next binade or to infinity. */
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    /* A NaN must not be rounded (it could turn into infinity); keep its top
     * payload bits and set the quiet bit so it stays a NaN. */
    uint32_t nan = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float convert_fp16_f32(uint16_t v)
{
    uint32_t sign = (uint32_t)(v & 0x8000u) << 16;
    uint32_t exp = (v >> 10) & 0x1fu;
    uint32_t mant = v & 0x3ffu;
    uint32_t normal = sign | ((exp + 112u) << 23) | (mant << 13);
    uint32_t special = sign | 0x7f800000u | (mant << 13);
    /* A subnormal is mant * 2^-24; that product is exact in fp32. */
    float sub = (float)mant * 0x1p-24f;
    uint32_t subnormal = sign | convert_f32_bits(sub);
    uint32_t u = exp == 0 ? subnormal : exp == 31 ? special : normal;
    return convert_bits_f32(u);
}

static inline uint16_t convert_f32_fp16(float f)
{
    uint32_t u = convert_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;

    if (a > 0x7f800000u) /* NaN: keep the top payload bits, force quiet. */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* At or above 65520 rounds to infinity. */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        /* Normal in fp16: rebias the exponent (127 - 15 = 112) and round the
         * 13 dropped mantissa bits to nearest even; a carry is a valid
         * exponent increment. */
        uint32_t r = a + 0x0fffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | ((r >> 13) - (112u << 10)));
    }
    if (a <= 0x33000000u) /* At most 2^-25: rounds (ties to even) to zero. */
        return (uint16_t)sign;
    /* Subnormal in fp16: the value in units of 2^-24 is m >> (126 - e). */
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 ..= 24 here */
    uint32_t h = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

size_t moek_dtype_size(moek_dtype dt)
{
    switch (dt) {
    case MOEK_DTYPE_BF16:
    case MOEK_DTYPE_FP16:
        return 2;
    case MOEK_DTYPE_FP32:
        return 4;
    }
    return 0;
}

float moek_bf16_to_f32(uint16_t v)
{
    return convert_bf16_f32(v);
}

uint16_t moek_f32_to_bf16(float f)
{
    return convert_f32_bf16(f);
}

float moek_fp16_to_f32(uint16_t v)
{
    return convert_fp16_f32(v);
}

uint16_t moek_f32_to_fp16(float f)
{
    return convert_f32_fp16(f);
}

float moek_round(moek_dtype dt, float f)
{
    switch (dt) {
    case MOEK_DTYPE_BF16:
        return convert_bf16_f32(convert_f32_bf16(f));
    case MOEK_DTYPE_FP16:
        return convert_fp16_f32(convert_f32_fp16(f));
    case MOEK_DTYPE_FP32:
        break;
    }
    return f;
}

void moek_to_f32(moek_dtype dt, const void *src, float *dst, size_t n)
{
    const uint16_t *s16 = src;
    switch (dt) {
    case MOEK_DTYPE_BF16:
        for (size_t i = 0; i < n; i++)
            dst[i] = convert_bf16_f32(s16[i]);
        break;
    case MOEK_DTYPE_FP16:
        for (size_t i = 0; i < n; i++)
            dst[i] = convert_fp16_f32(s16[i]);
        break;
    case MOEK_DTYPE_FP32:
        if (n)
            memmove(dst, src, n * sizeof(float));
        break;
    }
}

void moek_from_f32(moek_dtype dt, const float *src, void *dst, size_t n)
{
    uint16_t *d16 = dst;
    switch (dt) {
    case MOEK_DTYPE_BF16:
        for (size_t i = 0; i < n; i++)
            d16[i] = convert_f32_bf16(src[i]);
        break;
    case MOEK_DTYPE_FP16:
        for (size_t i = 0; i < n; i++)
            d16[i] = convert_f32_fp16(src[i]);
        break;
    case MOEK_DTYPE_FP32:
        if (n)
            memmove(dst, src, n * sizeof(float));
        break;
    }
}
