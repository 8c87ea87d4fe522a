/* Greedy picks over vocabulary-wide rows (CPU). Built and loaded by worker/cpu_kernels.py.
 *
 * PyTorch's CPU max/argmax over a row tracks the index of every candidate as it goes, one
 * element at a time: ~0.65 ms for 16 rows of 49152 logits, as much as a decoder layer of
 * SmolLM2. Here a row is split in chunks whose maxima are found with vector max instructions;
 * only the first chunk holding the row's maximum is scanned for its index.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "team.h"

#define CHUNK 256
#define PARALLEL_MIN_ELEMS 65536

static inline float value(const void *row, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_load((const uint16_t *)row, i) : ((const float *)row)[i];
}

/* Whether element i is a NaN, from its bits (compiled with -ffast-math, `v != v` is false). */
static inline int is_nan(const void *row, int64_t i, int is_bf16) {
    if (is_bf16) return (((const uint16_t *)row)[i] & 0x7fffu) > 0x7f80u;
    return (((const uint32_t *)row)[i] & 0x7fffffffu) > 0x7f800000u;
}

/* The index of the largest value of a row of `cols` values, the first one on ties, as
 * torch.argmax gives; -1 for a row holding a NaN. Leaves the maximum of each chunk of CHUNK
 * values in `chunk_max` (cols / CHUNK rounded up of them). */
static int64_t row_argmax(const char *row, int64_t cols, int is_bf16, float *chunk_max) {
    const int64_t chunks = (cols + CHUNK - 1) / CHUNK;
    int nans = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * CHUNK < cols ? (c + 1) * CHUNK : cols;
        float m = value(row, c * CHUNK, is_bf16);
        for (int64_t i = c * CHUNK; i < end; i++) {
            const float v = value(row, i, is_bf16);
            m = v > m ? v : m;
            nans |= is_nan(row, i, is_bf16);
        }
        chunk_max[c] = m;
    }
    if (nans) return -1;
    float best = chunk_max[0];
    for (int64_t c = 1; c < chunks; c++) best = chunk_max[c] > best ? chunk_max[c] : best;
    for (int64_t c = 0; c < chunks; c++) {
        if (chunk_max[c] != best) continue;
        const int64_t end = (c + 1) * CHUNK < cols ? (c + 1) * CHUNK : cols;
        for (int64_t i = c * CHUNK; i < end; i++)
            if (value(row, i, is_bf16) == best) return i;
    }
    return -1;
}

/* out[r] = index of the largest value of row r (rows `stride` elements apart), the first one
 * on ties, as torch.argmax gives; -1 for a row holding a NaN, for the caller to settle
 * (torch.argmax picks the first NaN). */
void argmax_rows(const void *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out,
                 int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float chunk_max[(cols + CHUNK - 1) / CHUNK];
        out[r] = row_argmax((const char *)x + r * stride * (is_bf16 ? 2 : 4), cols, is_bf16,
                            chunk_max);
    }
}

int64_t first_argmax(const void *row, int64_t cols, int is_bf16) {
    if (cols < 1) return -1;
    float chunk_max[(cols + CHUNK - 1) / CHUNK];
    const int64_t best = row_argmax((const char *)row, cols, is_bf16, chunk_max);
    if (best >= 0) return best;
    for (int64_t i = 0; i < cols; i++) /* a row holding a NaN: torch.argmax picks the first */
        if (is_nan(row, i, is_bf16)) return i;
    return -1;
}

/* Whether a double is finite, from its bits (-ffast-math folds isfinite() to true). */
static inline int finite_f64(double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return ((bits >> 52) & 0x7ff) != 0x7ff;
}

/* screen_argmax's answer for row `xr` and its screened logits `row`: the float32 head's
 * argmax, or -1 where the screen cannot promise it. */
static int64_t screen_row(const float *xr, int64_t k, const char *row, int64_t cols, int is_bf16,
                          const float *bounds, float max_bound, double margin,
                          const float *panels, int64_t max_candidates) {
    const uint32_t *x_bits = (const uint32_t *)xr;
    double norm2 = 0.0;
    for (int64_t i = 0; i < k; i++) {
        if ((x_bits[i] & 0x7f800000u) == 0x7f800000u) return -1;
        norm2 += (double)xr[i] * (double)xr[i];
    }
    const int64_t chunks = (cols + CHUNK - 1) / CHUNK;
    float chunk_max[chunks];
    const int64_t b = row_argmax(row, cols, is_bf16, chunk_max);
    if (b < 0) return -1;
    const float best = value(row, b, is_bf16);
    const double scale = sqrt(norm2) * (1.0 + margin);
    const double widest = fabs((double)best) + 2.0 * scale * (double)max_bound;
    const double floor_d = (double)best - scale * (double)bounds[b] - widest * margin - 0x1p-140;
    if (!finite_f64(floor_d) || !finite_f64(widest)) return -1;
    const float floor = (float)floor_d, scale_f = (float)scale;
    int64_t found = 0, winner = -1;
    float winner_logit = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        if (!(chunk_max[c] + scale_f * max_bound >= floor)) continue;
        const int64_t end = (c + 1) * CHUNK < cols ? (c + 1) * CHUNK : cols;
        for (int64_t i = c * CHUNK; i < end; i++) {
            if (!(value(row, i, is_bf16) + scale_f * bounds[i] >= floor)) continue;
            if (++found > max_candidates) return -1;
            const float logit = panel_column_f32(xr, panels, k, i);
            uint32_t logit_bits;
            memcpy(&logit_bits, &logit, sizeof logit_bits);
            if ((logit_bits & 0x7fffffffu) > 0x7f800000u) return -1; /* NaN */
            if (winner < 0 || logit > winner_logit) winner = i, winner_logit = logit;
        }
    }
    return winner; /* b itself always passes: never -1 here */
}

/* The greedy screen's answer (worker/cpu/greedy_screen.py) for `rows` float32 rows x
 * (`x_stride` apart, `k` values each) whose screened logits are `screen` (`cols` a row,
 * `screen_stride` apart, float32 or bfloat16): out[r] = the float32 head's argmax of row r,
 * first index on ties. With b a row's screened argmax, B_j = ||x|| (1 + margin) bounds[j]:
 * column j may hold the argmax only if screen_j + B_j >= screen_b - B_b (tested in float32,
 * the floor moved down by `margin` of the terms it holds, so that rounding only ever keeps
 * more columns); those columns' logits are computed as the head's panels give them
 * (`panel_column_f32` over `panels`, the head packed as float32 panels of depth k), and the
 * largest wins. Returns 0; 1 where it cannot promise a row (a value that is not finite, more
 * than `max_candidates` columns passing), and the caller computes the logits instead.
 * `max_bound` bounds `bounds`: a chunk of 256 columns whose maximum cannot pass is skipped
 * whole. One call (the same steps as PyTorch ops took ~1.5 ms of a batch-1 step), one read
 * of a row's logits, its rows split among the threads. */
int screen_argmax(const float *x, int64_t x_stride, int64_t rows, int64_t k, const void *screen,
                  int64_t screen_stride, int64_t cols, int is_bf16, const float *bounds,
                  float max_bound, double margin, const float *panels, int64_t max_candidates,
                  int64_t *out) {
    int failed = 0;
#pragma omp parallel for schedule(static) if (rows > 1) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)screen + r * screen_stride * (is_bf16 ? 2 : 4);
        out[r] = screen_row(x + r * x_stride, k, row, cols, is_bf16, bounds, max_bound, margin,
                            panels, max_candidates);
        failed |= out[r] < 0;
    }
    return failed;
}
