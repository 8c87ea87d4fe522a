/* The float32 vector vocabulary the CPU kernels' shared helpers are written in, on the widest
 * registers the build has: 16 lanes with AVX-512 (VEC_SIMD 512), 8 with AVX2 and FMA (256),
 * none otherwise (VEC_SIMD undefined); and exp_ps, the one vector e^x (paged_prefill.c's
 * softmax, fused_ops.c's silu). */
#ifndef SPECSERVE_VEC_H
#define SPECSERVE_VEC_H

#if defined(__AVX512F__)
#define VEC_SIMD 512
#include <immintrin.h>

typedef __m512 vf;
#define VL 16
#define vf_load _mm512_load_ps
#define vf_store _mm512_store_ps
#define vf_set1 _mm512_set1_ps
#define vf_mul _mm512_mul_ps
#define vf_max _mm512_max_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_fnmadd _mm512_fnmadd_ps
#define vf_round_nearest(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_times_pow2 _mm512_scalef_ps /* p * 2^n */

#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_SIMD 256
#include <immintrin.h>

typedef __m256 vf;
#define VL 8
#define vf_load _mm256_load_ps
#define vf_store _mm256_store_ps
#define vf_set1 _mm256_set1_ps
#define vf_mul _mm256_mul_ps
#define vf_max _mm256_max_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_fnmadd _mm256_fnmadd_ps
#define vf_round_nearest(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* p * 2^n for whole n in [-126, 127], built in the exponent bits (AVX2 has no scalef). */
static inline vf vf_times_pow2(vf p, vf n) {
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(VEC_SIMD)
/* exp(x) for x <= 88 within 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
 * series to r^7 (error below 1e-8), scaled by 2^n. Inputs below -87 give exp(-87). */
static inline vf exp_ps(vf x) {
    x = vf_max(x, vf_set1(-87.0f));
    const vf n = vf_round_nearest(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);
    r = vf_fnmadd(n, vf_set1(1.428606765330187e-06f), r);
    vf p = vf_set1(1.0f / 5040);
    p = vf_fmadd(p, r, vf_set1(1.0f / 720));
    p = vf_fmadd(p, r, vf_set1(1.0f / 120));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_times_pow2(p, n);
}
#endif

#endif
