/* Greedy picks over vocabulary-wide rows (CPU). Built and loaded by worker/cpu_kernels.py.
 *
 * PyTorch's CPU max/argmax over a row tracks the index of every candidate as it goes, one
 * element at a time: ~0.65 ms for 16 rows of 49152 logits, as much as a decoder layer of
 * SmolLM2. Here a row is split in chunks whose maxima are found with vector max instructions;
 * only the first chunk holding the row's maximum is scanned for its index.
 */
#include <stdint.h>

#include "bf16.h"

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

/* out[r] = index of the largest value of row r (rows `stride` elements apart), the first one
 * on ties, as torch.argmax gives; -1 for a row holding a NaN, for the caller to settle. */
void argmax_rows(const void *x, int64_t stride, int64_t rows, int64_t cols, int64_t *out,
                 int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * stride * (is_bf16 ? 2 : 4);
        const int64_t chunks = (cols + CHUNK - 1) / CHUNK;
        float chunk_max[chunks];
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
        out[r] = -1;
        if (nans) continue; /* torch.argmax picks the first NaN: the caller asks it */
        float best = chunk_max[0];
        for (int64_t c = 1; c < chunks; c++) best = chunk_max[c] > best ? chunk_max[c] : best;
        for (int64_t c = 0; c < chunks && out[r] < 0; c++) {
            if (chunk_max[c] != best) continue;
            const int64_t end = (c + 1) * CHUNK < cols ? (c + 1) * CHUNK : cols;
            for (int64_t i = c * CHUNK; i < end; i++) {
                if (value(row, i, is_bf16) == best) {
                    out[r] = i;
                    break;
                }
            }
        }
    }
}

/* The (row, column) pairs, row by row and column by column, with x[r][i] + scales[r] *
 * norms[i] >= floors[r] (NaN never), written to `pairs` as [row, column] while they fit
 * `capacity` pairs; returns how many there are. `max_norm` bounds `norms`: a chunk of 256
 * columns whose maximum cannot pass is skipped whole. This is the greedy screen's test
 * (worker/cpu/greedy_screen.py) of which columns may hold a row's argmax: one pass, where
 * PyTorch's compare and nonzero took ~0.7 ms for 16 rows of 49152 bfloat16 logits. */
int64_t screen_columns(const void *x, int64_t stride, int64_t rows, int64_t cols,
                       const float *floors, const float *scales, const float *norms,
                       float max_norm, int64_t *pairs, int64_t capacity, int is_bf16) {
    int64_t found = 0;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * stride * (is_bf16 ? 2 : 4);
        const float floor = floors[r], scale = scales[r];
        for (int64_t c = 0; c < cols; c += CHUNK) {
            const int64_t end = c + CHUNK < cols ? c + CHUNK : cols;
            float m = value(row, c, is_bf16);
            for (int64_t i = c; i < end; i++) {
                const float v = value(row, i, is_bf16);
                m = v > m ? v : m;
            }
            if (!(m + scale * max_norm >= floor)) continue;
            for (int64_t i = c; i < end; i++) {
                if (!(value(row, i, is_bf16) + scale * norms[i] >= floor)) continue;
                if (is_nan(row, i, is_bf16)) continue;
                if (found < capacity) pairs[2 * found] = r, pairs[2 * found + 1] = i;
                found++;
            }
        }
    }
    return found;
}
