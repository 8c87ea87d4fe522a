/* y = (x Q^T) * scale for float32 rows x and an int8 weight Q with one float32 scale per output
 * column: the greedy screen's read of a float32 LM head (worker/cpu/greedy_screen.py), a
 * quarter of the head's bytes, which is what a decode step of few rows waits on. Built and
 * loaded by worker/cpu/kernels.py.
 *
 * Layout (kernels.pack_panels of the int8 Q, as for float32): output columns in panels of 16 (the
 * last one zero-padded), each panel [K][16] int8, panel element (k, c) = Q[16p + c, k].
 *
 * Each column's sum is float32: acc = fma(x[k], (float)Q[c, k], acc) over k in order, then one
 * product by the column's scale. The screen bounds that sum's distance from the float32 head's
 * logit whatever the order, so the order is free; it is fixed here so that a row gives the same
 * logits in any batch.
 *
 * With AVX2 a panel's 16 columns are two 8-wide registers a row; a tile keeps 6 rows (12
 * accumulators), widens each step's 16 weights once (sign extension and conversion) and
 * streams the panel once per tile. Without AVX2 a scalar loop gives the same sums.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define PREFETCH 512 /* bytes of the weight stream fetched ahead of use */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MAX_TILE 6

/* ROWS rows of x (`x_stride` apart) times one panel, scaled, into `y` (rows `y_stride` apart,
 * `cols` <= 16 columns written). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride,
                                                      const int8_t *panel, int64_t depth,
                                                      const float *scale, float *y,
                                                      int64_t y_stride, int64_t cols,
                                                      const int rows) {
    __m256 lo[MAX_TILE], hi[MAX_TILE];
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < depth; d++) {
        const int8_t *w_d = panel + d * PANEL;
        _mm_prefetch((const char *)w_d + PREFETCH, _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128((const __m128i *)w_d);
        const __m256 w_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        const __m256 w_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
        for (int r = 0; r < rows; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * x_stride + d);
            lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);
        }
    }
    __m256 s_lo, s_hi;
    float buf[PANEL];
    if (cols == PANEL) {
        s_lo = _mm256_loadu_ps(scale), s_hi = _mm256_loadu_ps(scale + 8);
    } else {
        memset(buf, 0, sizeof buf);
        memcpy(buf, scale, (size_t)cols * sizeof(float));
        s_lo = _mm256_loadu_ps(buf), s_hi = _mm256_loadu_ps(buf + 8);
    }
    for (int r = 0; r < rows; r++) {
        float *out = y + r * y_stride;
        const __m256 v_lo = _mm256_mul_ps(lo[r], s_lo), v_hi = _mm256_mul_ps(hi[r], s_hi);
        if (cols == PANEL) {
            _mm256_storeu_ps(out, v_lo), _mm256_storeu_ps(out + 8, v_hi);
        } else {
            _mm256_storeu_ps(buf, v_lo), _mm256_storeu_ps(buf + 8, v_hi);
            memcpy(out, buf, (size_t)cols * sizeof(float));
        }
    }
}

static void panel_rows(const float *x, int64_t x_stride, const int8_t *panel, int64_t depth,
                       const float *scale, float *y, int64_t y_stride, int64_t rows,
                       int64_t cols) {
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_TILE) {
        const float *xr = x + r0 * x_stride;
        float *yr = y + r0 * y_stride;
        switch (rows - r0 < MAX_TILE ? rows - r0 : MAX_TILE) {
        case 1: tile(xr, x_stride, panel, depth, scale, yr, y_stride, cols, 1); break;
        case 2: tile(xr, x_stride, panel, depth, scale, yr, y_stride, cols, 2); break;
        case 3: tile(xr, x_stride, panel, depth, scale, yr, y_stride, cols, 3); break;
        case 4: tile(xr, x_stride, panel, depth, scale, yr, y_stride, cols, 4); break;
        case 5: tile(xr, x_stride, panel, depth, scale, yr, y_stride, cols, 5); break;
        default: tile(xr, x_stride, panel, depth, scale, yr, y_stride, cols, 6); break;
        }
    }
}
#else
static void panel_rows(const float *x, int64_t x_stride, const int8_t *panel, int64_t depth,
                       const float *scale, float *y, int64_t y_stride, int64_t rows,
                       int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < depth; d++)
                acc = __builtin_fmaf(x[r * x_stride + d], (float)panel[d * PANEL + c], acc);
            y[r * y_stride + c] = acc * scale[c];
        }
    }
}
#endif

/* y[rows, n] = (x[rows, k] Q^T) * scale[n], Q as int8 panels; rows of x `x_stride` apart, of y
 * `n` apart. */
void int8_panel_linear(const float *x, int64_t x_stride, const int8_t *panels,
                       const float *scale, float *y, int64_t rows, int64_t n, int64_t k) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        panel_rows(x, x_stride, panels + p * k * PANEL, k, scale + p * PANEL, y + p * PANEL, n,
                   rows, cols);
    }
}
