/* Element-wise glue of a decoder layer, fused (CPU): RMSNorm with its residual add, SwiGLU's
 * silu(gate) * up, and q/k norms with RoPE and the KV-cache write. In PyTorch each is 3-9 small
 * ops, each a dispatch and a pass over memory. Built and loaded by worker/cpu_kernels.py.
 *
 * The math is the decoder's (worker/models.py) step by step, in float32, rounding to bfloat16
 * exactly where the bfloat16 model rounds: the residual sum, the normalised value before the
 * weight, the product with the weight, silu(gate) and the product with up, and each product and
 * the sum of RoPE. Only the order of the sum of squares differs, and on AVX-512 the bfloat16
 * forms run 16 lanes at a time (bf16.h), silu's e^x there vec.h's exp_ps (within 2 ulp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "team.h"
#include "vec.h"

/* Elements from which a standalone call runs on all threads. Low on purpose: a decode step's
 * 16 rows are small, but they arrive from memory rather than cache, and each thread has its own
 * misses in flight (16 x 1536 SwiGLU rows: about 5% of a SmolLM2 step at batch 16, measured). */
#define PARALLEL_MIN_ELEMS 4096

/* dst[i] = s[i] * inv * w[i] with the model's roundings (bfloat16: w * round(s * inv)). */
static inline void scale_by_weight(void *dst, const float *s, float inv, const void *weight,
                                   int64_t dim, int is_bf16) {
    if (is_bf16) {
        const uint16_t *w = (const uint16_t *)weight;
        uint16_t *o = (uint16_t *)dst;
        int64_t i = 0;
#ifdef SPECSERVE_BF16X16
        const __m512 vinv = _mm512_set1_ps(inv);
        for (; i + 16 <= dim; i += 16) {
            const __m512 normed = bf16x16_rounded(_mm512_mul_ps(_mm512_loadu_ps(s + i), vinv));
            bf16x16_store(o + i, _mm512_mul_ps(bf16x16_load(w + i), normed));
        }
#endif
        for (; i < dim; i++) o[i] = bf16_round(bf16_load(w, i) * bf16_rounded(s[i] * inv));
    } else {
        const float *w = (const float *)weight;
        float *o = (float *)dst;
        for (int64_t i = 0; i < dim; i++) o[i] = s[i] * inv * w[i];
    }
}

static inline float rms_inverse(const float *s, int64_t dim, float eps) {
    float squares = 0.0f;
    for (int64_t i = 0; i < dim; i++) squares += s[i] * s[i];
    return 1.0f / sqrtf(squares / (float)dim + eps);
}

/* `dim` values at `src` as float32 in `dst`. */
static inline void load_f32(float *dst, const void *src, int64_t dim, int is_bf16) {
    if (is_bf16)
        bf16_widen_row(dst, (const uint16_t *)src, dim);
    else
        memcpy(dst, src, dim * sizeof(float));
}

void add_rms_norm_team(const void *x, int64_t x_stride, const void *delta, int64_t delta_stride,
                       void *sum_out, const void *weight, void *out, int64_t rows, int64_t dim,
                       float eps, int is_bf16) {
    const size_t esize = is_bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float s[dim];
        load_f32(s, (const char *)x + r * x_stride * esize, dim, is_bf16);
        if (delta != NULL) {
            const char *dr = (const char *)delta + r * delta_stride * esize;
            char *so = (char *)sum_out + r * dim * esize;
            if (is_bf16) {
                int64_t i = 0;
#ifdef SPECSERVE_BF16X16
                for (; i + 16 <= dim; i += 16) {
                    const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(s + i),
                                                     bf16x16_load((const uint16_t *)dr + i));
                    bf16x16_store((uint16_t *)so + i, sum);
                    _mm512_storeu_ps(s + i, bf16x16_rounded(sum));
                }
#endif
                for (; i < dim; i++) {
                    ((uint16_t *)so)[i] = bf16_round(s[i] + bf16_load((const uint16_t *)dr, i));
                    s[i] = bf16_load((const uint16_t *)so, i);
                }
            } else {
                for (int64_t i = 0; i < dim; i++) s[i] = ((float *)so)[i] = s[i] + ((const float *)dr)[i];
            }
        }
        scale_by_weight((char *)out + r * dim * esize, s, rms_inverse(s, dim, eps), weight, dim,
                        is_bf16);
    }
}

void add_rms_norm(const void *x, int64_t x_stride, const void *delta, int64_t delta_stride,
                  void *sum_out, const void *weight, void *out, int64_t rows, int64_t dim,
                  float eps, int is_bf16) {
#pragma omp parallel if (rows * dim >= PARALLEL_MIN_ELEMS)
    add_rms_norm_team(x, x_stride, delta, delta_stride, sum_out, weight, out, rows, dim, eps,
                      is_bf16);
}

/* x / (1 + e^-x). The exponent is capped below expf's overflow: compiled with -ffast-math the
 * vector code may not survive an infinite e^-x (x < -88.7 would give NaN, not -0). */
static inline float silu(float x) { return x / (1.0f + expf(fminf(-x, 88.0f))); }

#ifdef SPECSERVE_BF16X16
/* silu on 16 lanes, the exponent capped as `silu` caps it (exp_ps takes anything below -87 as
 * -87, where e^x adds nothing to 1 in float32). */
static inline __m512 silu16(__m512 x) {
    const __m512 e = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.0f));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(e));
    const __m512 y = _mm512_rcp14_ps(d); /* 1/d to 2^-14, one Newton step to ~2^-28 */
    return _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_fnmadd_ps(d, y, _mm512_set1_ps(1.0f)), y, y));
}
#endif

void silu_mul_team(const void *gate_up, int64_t stride, void *out, int64_t rows, int64_t dim,
                   int is_bf16) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + r * stride, *u = g + dim;
            uint16_t *o = (uint16_t *)out + r * dim;
            int64_t i = 0;
#ifdef SPECSERVE_BF16X16
            for (; i + 16 <= dim; i += 16)
                bf16x16_store(o + i, _mm512_mul_ps(bf16x16_rounded(silu16(bf16x16_load(g + i))),
                                                   bf16x16_load(u + i)));
#endif
            for (; i < dim; i++) {
                float x = bf16_load(g, i);
                o[i] = bf16_round(bf16_rounded(silu(x)) * bf16_load(u, i));
            }
        } else {
            const float *g = (const float *)gate_up + r * stride, *u = g + dim;
            float *o = (float *)out + r * dim;
            for (int64_t i = 0; i < dim; i++) o[i] = silu(g[i]) * u[i];
        }
    }
}

void silu_mul(const void *gate_up, int64_t stride, void *out, int64_t rows, int64_t dim,
              int is_bf16) {
#pragma omp parallel if (rows * dim >= PARALLEL_MIN_ELEMS)
    silu_mul_team(gate_up, stride, out, rows, dim, is_bf16);
}

/* One head in place: `x * cos + [x2, x1] * sin` (sin sign-folded), each product and the sum
 * rounded as the model rounds them (the library is built without fused multiply-adds, so
 * float32 matches the reference's separate multiplies and add bit for bit). */
static inline void rope_head(void *head, const float *x, const void *cos, const void *sin,
                             int64_t dim, int is_bf16) {
    const int64_t half = dim / 2;
    if (is_bf16) {
        const uint16_t *c = (const uint16_t *)cos, *s = (const uint16_t *)sin;
        uint16_t *o = (uint16_t *)head;
        int64_t i = 0;
#ifdef SPECSERVE_BF16X16
#define ROUNDED_PRODUCT(a, b) bf16x16_rounded(_mm512_mul_ps(a, bf16x16_load(b)))
        for (; i + 16 <= half; i += 16) {
            const __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + i + half);
            bf16x16_store(o + i, _mm512_add_ps(ROUNDED_PRODUCT(x1, c + i),
                                               ROUNDED_PRODUCT(x2, s + i)));
            bf16x16_store(o + i + half, _mm512_add_ps(ROUNDED_PRODUCT(x2, c + i + half),
                                                      ROUNDED_PRODUCT(x1, s + i + half)));
        }
#undef ROUNDED_PRODUCT
#endif
        for (; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            o[i] = bf16_round(bf16_rounded(x1 * bf16_load(c, i)) +
                              bf16_rounded(x2 * bf16_load(s, i)));
            o[i + half] = bf16_round(bf16_rounded(x2 * bf16_load(c, i + half)) +
                                     bf16_rounded(x1 * bf16_load(s, i + half)));
        }
    } else {
        const float *c = (const float *)cos, *s = (const float *)sin;
        float *o = (float *)head;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            o[i] = x1 * c[i] + x2 * s[i];
            o[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
    }
}

void rope_write_kv_team(void *qkv, int64_t qkv_stride, int64_t rows, int64_t heads,
                        int64_t kv_heads, int64_t dim, const void *cos, const void *sin,
                        const void *q_norm, const void *k_norm, float eps, void *cache,
                        int64_t num_blocks, const int64_t *k_rows, int64_t block_size,
                        int is_bf16, int *bad_rows) {
    const size_t esize = is_bf16 ? 2 : 4;
    const int64_t kv_width = kv_heads * dim, cache_rows = num_blocks * 2 * block_size;
    int my_bad = 0;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (k_rows[r] < 0 || k_rows[r] >= cache_rows - block_size) { /* outside the cache */
            my_bad++;
            continue;
        }
        char *row = (char *)qkv + r * qkv_stride * esize;
        const char *cos_r = (const char *)cos + r * dim * esize;
        const char *sin_r = (const char *)sin + r * dim * esize;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            char *head = row + h * dim * esize;
            const void *norm = h < heads ? q_norm : k_norm;
            float x[dim];
            load_f32(x, head, dim, is_bf16);
            if (norm != NULL) { /* the normed head, rounded as stored, is what RoPE rotates */
                scale_by_weight(head, x, rms_inverse(x, dim, eps), norm, dim, is_bf16);
                load_f32(x, head, dim, is_bf16);
            }
            rope_head(head, x, cos_r, sin_r, dim, is_bf16);
        }
        char *k_dst = (char *)cache + k_rows[r] * kv_width * esize;
        memcpy(k_dst, row + heads * dim * esize, kv_width * esize);
        memcpy(k_dst + block_size * kv_width * esize, row + (heads + kv_heads) * dim * esize,
               kv_width * esize);
    }
    if (my_bad) {
#pragma omp atomic
        *bad_rows += my_bad;
    }
}

/* Returns the number of rows whose K/V rows lie outside the cache (0: all written). */
int rope_write_kv(void *qkv, int64_t qkv_stride, int64_t rows, int64_t heads, int64_t kv_heads,
                  int64_t dim, const void *cos, const void *sin, const void *q_norm,
                  const void *k_norm, float eps, void *cache, int64_t num_blocks,
                  const int64_t *k_rows, int64_t block_size, int is_bf16) {
    int bad_rows = 0;
#pragma omp parallel if (rows * (heads + kv_heads) * dim >= PARALLEL_MIN_ELEMS)
    rope_write_kv_team(qkv, qkv_stride, rows, heads, kv_heads, dim, cos, sin, q_norm, k_norm,
                       eps, cache, num_blocks, k_rows, block_size, is_bf16, &bad_rows);
    return bad_rows;
}
