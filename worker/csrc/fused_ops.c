/* Element-wise glue of a decoder layer, fused (CPU): RMSNorm with its residual add, and SwiGLU's
 * silu(gate) * up. In PyTorch each is 3-9 small ops, each a dispatch and a pass over memory.
 * Built and loaded by worker/cpu_kernels.py.
 *
 * The math is the decoder's (worker/models.py) step by step, in float32, rounding to bfloat16
 * exactly where the bfloat16 model rounds: the residual sum, the normalised value before the
 * weight, the product with the weight, silu(gate) and the product with up. Only the order of
 * the sum of squares differs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Elements from which a call runs on all threads. Low on purpose: a decode step's 16 rows are
 * small, but they arrive from memory rather than cache, and each thread has its own misses in
 * flight (16 x 1536 SwiGLU rows: about 5% of a SmolLM2 step at batch 16, measured). */
#define PARALLEL_MIN_ELEMS 4096

/* Row r: s = x[r] (+ delta[r] when delta is given, stored to sum_out[r]);
 * out[r] = weight * (s * rsqrt(mean(s^2) + eps)). Rows are `*_stride` elements apart. */
void add_rms_norm(const void *x, int64_t x_stride, const void *delta, int64_t delta_stride,
                  void *sum_out, const void *weight, void *out, int64_t rows, int64_t dim,
                  float eps, int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float s[dim];
        if (is_bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * x_stride;
            for (int64_t i = 0; i < dim; i++) s[i] = bf16_load(xr, i);
            if (delta != NULL) {
                const uint16_t *dr = (const uint16_t *)delta + r * delta_stride;
                uint16_t *so = (uint16_t *)sum_out + r * dim;
                for (int64_t i = 0; i < dim; i++) {
                    so[i] = bf16_round(s[i] + bf16_load(dr, i));
                    s[i] = bf16_load(so, i);
                }
            }
        } else {
            const float *xr = (const float *)x + r * x_stride;
            if (delta != NULL) {
                const float *dr = (const float *)delta + r * delta_stride;
                float *so = (float *)sum_out + r * dim;
                for (int64_t i = 0; i < dim; i++) s[i] = so[i] = xr[i] + dr[i];
            } else {
                memcpy(s, xr, dim * sizeof(float));
            }
        }
        float squares = 0.0f;
        for (int64_t i = 0; i < dim; i++) squares += s[i] * s[i];
        float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        if (is_bf16) {
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + r * dim;
            for (int64_t i = 0; i < dim; i++)
                o[i] = bf16_round(bf16_load(w, i) * bf16_rounded(s[i] * inv));
        } else {
            const float *w = (const float *)weight;
            float *o = (float *)out + r * dim;
            for (int64_t i = 0; i < dim; i++) o[i] = s[i] * inv * w[i];
        }
    }
}

/* x / (1 + e^-x). The exponent is capped below expf's overflow: compiled with -ffast-math the
 * vector code may not survive an infinite e^-x (x < -88.7 would give NaN, not -0). */
static inline float silu(float x) { return x / (1.0f + expf(fminf(-x, 88.0f))); }

/* out[r] = silu(gate_up[r, :dim]) * gate_up[r, dim:], rows of gate_up `stride` elements apart. */
void silu_mul(const void *gate_up, int64_t stride, void *out, int64_t rows, int64_t dim,
              int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + r * stride, *u = g + dim;
            uint16_t *o = (uint16_t *)out + r * dim;
            for (int64_t i = 0; i < dim; i++) {
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
