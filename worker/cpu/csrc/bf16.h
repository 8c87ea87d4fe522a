/* bfloat16 <-> float32 for the CPU kernels: bfloat16 is the top half of a float32. */
#ifndef SPECSERVE_BF16_H
#define SPECSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p, int64_t i) {
    uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* `f` rounded to bfloat16 and back: where the bfloat16 model rounds an intermediate. */
static inline float bf16_rounded(float f) {
    uint32_t bits = (uint32_t)bf16_round(f) << 16;
    float r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

#endif
