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

/* The same three on 16 lanes, where the CPU has AVX-512: gcc vectorizes the scalar
 * forms above only at 256 bits and around library calls, which left the bfloat16 element-wise
 * kernels slower than their float32 forms (SwiGLU over 2,048 x 1,536 values: 2.16 ms against
 * 0.88 ms on 16 lanes, Sapphire Rapids). With AVX512_BF16 the rounding is the CPU's own
 * (VCVTNEPS2BF16: nearest even, as bf16_round, but float32 subnormals become zeros); without
 * it each lane gives exactly bf16_round's result. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECSERVE_BF16X16 1

static inline __m512 bf16x16_load(const uint16_t *p) {
    const __m256i half = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* bf16_round's result in the top half of each lane, zeros below. */
static inline __m512i bf16x16_round_bits(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, bits, _mm512_set1_epi32(0x400000));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

#ifdef __AVX512BF16__
static inline __m256i bf16x16_round16(__m512 f) { return (__m256i)_mm512_cvtneps_pbh(f); }
#else
static inline __m256i bf16x16_round16(__m512 f) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16x16_round_bits(f), 16));
}
#endif

static inline __m512 bf16x16_rounded(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_round16(f)), 16));
}

static inline void bf16x16_store(uint16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, bf16x16_round16(f));
}
#endif

/* bf16_round on 8 lanes, where the CPU has AVX2 but not AVX-512: the results of two vectors
 * (columns 0-7 and 8-15) as 16 bfloat16 values in order. */
#if !defined(__AVX512F__) && defined(__AVX2__)
#include <immintrin.h>

static inline __m256i bf16x8_round_low(__m256 f) { /* bf16_round's result in each lane's low half */
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}

static inline __m256i bf16x8x2_round16(__m256 lo, __m256 hi) {
    /* packus interleaves 64-bit quarters (lo 0-3, hi 0-3, lo 4-7, hi 4-7): put them back */
    const __m256i packed = _mm256_packus_epi32(bf16x8_round_low(lo), bf16x8_round_low(hi));
    return _mm256_permute4x64_epi64(packed, 0xd8);
}
#endif

/* `n` bfloat16 values at `src` as float32 in `dst`, 16 at a time where the CPU has AVX-512. */
static inline void bf16_widen_row(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
#ifdef SPECSERVE_BF16X16
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, bf16x16_load(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_load(src, i);
}

#endif
