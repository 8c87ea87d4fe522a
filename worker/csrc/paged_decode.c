/* Decode attention read straight from the paged KV cache (CPU).
 *
 * One query token per request attends to that request's keys where they lie in the cache,
 * so nothing is gathered or padded: the cost is one pass over the keys and one over the
 * values. Built and loaded by worker/cpu_kernels.py (see there for how and when).
 *
 * Cache layout (the FlashInfer one): [num_blocks, 2, block_size, kv_heads, head_dim], K at
 * index 0 and V at index 1 of the second axis. Request b's keys are its pages
 * `pages[b * max_pages + j]` (a page is a K or V block: block * 2 is its K page), key
 * j * block_size + t of them at position `first_pos[b] + j * block_size + t`; it sees the keys
 * at positions [max(0, seq_len - window), seq_len) (window 0: all of them). Queries
 * `q[b, h, :]` (row stride `q_row_stride` elements, heads contiguous) sharing KV head
 * h / group are computed together.
 *
 * Scores and accumulation are in float32 whatever the storage dtype (float32 or bfloat16), as
 * SDPA's CPU kernel does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* `rows` rows of `dim` values, `stride` elements apart, as contiguous float32 in `dst`. */
static void load_rows(float *dst, const void *src, int64_t rows, int64_t dim, int64_t stride,
                      int is_bf16) {
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16) {
            const uint16_t *s = (const uint16_t *)src + r * stride;
            for (int64_t d = 0; d < dim; d++) dst[r * dim + d] = bf16_load(s, d);
        } else {
            memcpy(dst + r * dim, (const float *)src + r * stride, dim * sizeof(float));
        }
    }
}

/* One (request, KV head) pair: `group` query heads over `n_keys` visible keys. Always inlined,
 * so the calls below with a constant `dim` get loops the compiler fully unrolls. */
static inline __attribute__((always_inline)) int attend(
    float *restrict out_f, const float *restrict q, const void *cache, const int64_t *pages,
    int64_t max_pages, int64_t first_pos, int64_t lo, int64_t hi, int64_t kv_head, int64_t group,
    int64_t kv_heads, int64_t dim, int64_t block_size, int is_bf16) {
    const int64_t n_keys = hi - lo;
    const int64_t token_stride = kv_heads * dim;
    const int64_t page_elems = block_size * token_stride;
    const size_t esize = is_bf16 ? 2 : 4;
    float *scores = malloc((size_t)(group * n_keys + block_size * dim) * sizeof(float));
    if (scores == NULL) return 1;
    float *rows = scores + group * n_keys; /* one page of this head, as float32 */

    for (int pass = 0; pass < 2; pass++) { /* 0: scores from K, 1: output from V */
        int64_t n = 0;
        for (int64_t j = 0; j < max_pages && n < n_keys; j++) {
            int64_t page_pos = first_pos + j * block_size;
            int64_t t0 = lo > page_pos ? lo - page_pos : 0;
            int64_t t1 = hi - page_pos < block_size ? hi - page_pos : block_size;
            if (t1 <= t0) continue;
            const char *page = (const char *)cache +
                               ((pages[j] + pass) * page_elems + kv_head * dim) * esize;
            const float *kv;
            if (is_bf16) {
                load_rows(rows, page + t0 * token_stride * esize, t1 - t0, dim, token_stride, 1);
                kv = rows;
            } else {
                kv = (const float *)page + t0 * token_stride;
            }
            const int64_t kv_stride = is_bf16 ? dim : token_stride, count = t1 - t0;
            /* Head-major: one query head's q (or output) stays in registers across the keys. */
            for (int64_t g = 0; g < group; g++) {
                float *restrict s = scores + g * n_keys + n;
                if (pass == 0) {
                    const float *restrict qg = q + g * dim;
                    for (int64_t t = 0; t < count; t++) {
                        const float *restrict row = kv + t * kv_stride;
                        float acc = 0.0f;
                        for (int64_t d = 0; d < dim; d++) acc += qg[d] * row[d];
                        s[t] = acc;
                    }
                } else {
                    float *restrict og = out_f + g * dim;
                    for (int64_t t = 0; t < count; t++) {
                        const float *restrict row = kv + t * kv_stride;
                        for (int64_t d = 0; d < dim; d++) og[d] += s[t] * row[d];
                    }
                }
            }
            n += count;
        }
        if (n != n_keys) { /* the pages do not cover the visible keys: refuse, never read junk */
            free(scores);
            return 1;
        }
        if (pass == 0) { /* softmax numerators in place; normalised after the V pass */
            for (int64_t g = 0; g < group; g++) {
                float *s = scores + g * n_keys;
                float m = s[0];
                for (int64_t i = 1; i < n_keys; i++) m = s[i] > m ? s[i] : m;
                for (int64_t i = 0; i < n_keys; i++) s[i] = expf(s[i] - m);
            }
            memset(out_f, 0, (size_t)(group * dim) * sizeof(float));
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float *s = scores + g * n_keys;
        float total = 0.0f;
        for (int64_t i = 0; i < n_keys; i++) total += s[i];
        float inv = 1.0f / total;
        for (int64_t d = 0; d < dim; d++) out_f[g * dim + d] *= inv;
    }
    free(scores);
    return 0;
}

/* Returns 0, or the number of (request, KV head) pairs that failed: no scratch memory, no
 * visible key, or pages that do not cover the visible keys. */
int paged_decode_attention(const void *query, int64_t q_row_stride, const void *cache,
                           const int64_t *pages, const int64_t *first_pos,
                           const int64_t *seq_lens, void *out, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_pages,
                           int64_t window, float scale, int is_bf16) {
    const int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : failed)
    for (int64_t item = 0; item < batch * kv_heads; item++) {
        int64_t b = item / kv_heads, h = item % kv_heads;
        int64_t hi = seq_lens[b];
        int64_t lo = window > 0 && hi - window > 0 ? hi - window : 0;
        float qf[group * dim], of[group * dim];
        const size_t esize = is_bf16 ? 2 : 4;
        const char *qrow = (const char *)query + (b * q_row_stride + h * group * dim) * esize;
        load_rows(qf, qrow, group, dim, dim, is_bf16);
        for (int64_t i = 0; i < group * dim; i++) qf[i] *= scale;
        if (hi <= lo) { /* no visible key: cannot happen for a decode token, which sees itself */
            failed++;
            continue;
        }
        const int64_t *req_pages = pages + b * max_pages;
        if (dim == 64)
            failed += attend(of, qf, cache, req_pages, max_pages, first_pos[b], lo, hi, h, group,
                             kv_heads, 64, block_size, is_bf16);
        else if (dim == 128)
            failed += attend(of, qf, cache, req_pages, max_pages, first_pos[b], lo, hi, h, group,
                             kv_heads, 128, block_size, is_bf16);
        else
            failed += attend(of, qf, cache, req_pages, max_pages, first_pos[b], lo, hi, h, group,
                             kv_heads, dim, block_size, is_bf16);
        char *orow = (char *)out + ((b * heads) + h * group) * dim * esize;
        for (int64_t i = 0; i < group * dim; i++) {
            if (is_bf16)
                ((uint16_t *)orow)[i] = bf16_round(of[i]);
            else
                ((float *)orow)[i] = of[i];
        }
    }
    return failed;
}
