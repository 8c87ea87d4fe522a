/* Decode attention read straight from the paged KV cache (CPU).
 *
 * One query token per request attends to that request's keys where they lie in the cache,
 * so nothing is gathered or padded: the cost is one pass over the keys and values. Built and
 * loaded by worker/cpu_kernels.py (see there for how and when).
 *
 * Cache layout (the FlashInfer one): [num_blocks, 2, block_size, kv_heads, head_dim], K at
 * index 0 and V at index 1 of the second axis. Request b's keys are its pages
 * `pages[b * max_pages + j]` (a page is a K or V block: block * 2 is its K page), key
 * j * block_size + t of them at position `first_pos[b] + j * block_size + t`; it sees the keys
 * at positions [max(0, seq_len - window), seq_len) (window 0: all of them). Queries
 * `q[b, h, :]` (row stride `q_row_stride` elements, heads contiguous) sharing KV head
 * h / group are computed together.
 *
 * A work item is one request's run of KV heads: all of them when there are enough requests to
 * keep every thread busy (a page's rows are then read whole, front to back, which is what the
 * memory system streams fastest: the K/V of a decode step come from memory, not cache, since
 * the weights streamed since have pushed them out), one head per item otherwise. An item walks
 * its pages once with a running (online) softmax, so no buffer grows with the context.
 *
 * Scores and accumulation are in float32 whatever the storage dtype (float32 or bfloat16), as
 * SDPA's CPU kernel does. With AVX-512 and heads of 64, a page's 16 keys are scored as 16
 * vectors of lane-wise products summed across lanes together (`score64`) and the weighted
 * values are summed in registers (`accumulate64`). The keys of a 64-request step come from
 * memory, scattered a page at a time, so while a page is worked on the next page to be read is
 * asked for, a part per query head (`prefetch_part`). `bench/decode_attention.py` (30 layers'
 * K/V of 64 requests x 100-300 keys, pages in random order; docs/benchmarks.md): the scalar
 * loops and one-page-ahead prefetch 43.2 -> 37.9 ms a round in bfloat16 and 40.5 -> 34.1 in
 * float32 (an Emerald Rapids VM); the prefetch asked for in parts instead of at once, 32.1 ->
 * 26.2 and 47.0 -> 40.7 ms (a Zen 4 VM).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "bf16.h"
#include "team.h"

/* `rows` rows of `width` values, `stride` elements apart, as contiguous float32 in `dst`. The
 * bfloat16 rows widen 16 at a time: this copy waits on the page's loads from memory, and with
 * half the instructions a cache line more lines are in flight at once (the 64-prompt bfloat16
 * case 1.04-1.07x in paired runs on a Sapphire Rapids VM, outputs equal). */
static void load_rows(float *dst, const void *src, int64_t rows, int64_t width, int64_t stride,
                      int is_bf16) {
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16) {
            bf16_widen_row(dst + r * width, (const uint16_t *)src + r * stride, width);
        } else {
            memcpy(dst + r * width, (const float *)src + r * stride, width * sizeof(float));
        }
    }
}

/* Rows [t0, t1) of a page, the first `width` values of each: in place for float32 (row stride
 * `token_stride`), converted into `buf` (row stride `width`) for bfloat16. */
static inline const float *page_rows(const char *page, int64_t t0, int64_t t1, int64_t width,
                                     int64_t token_stride, float *buf, int is_bf16,
                                     int64_t *stride) {
    if (!is_bf16) {
        *stride = token_stride;
        return (const float *)page + t0 * token_stride;
    }
    load_rows(buf, (const uint16_t *)page + t0 * token_stride, t1 - t0, width, token_stride, 1);
    *stride = width;
    return buf;
}

#ifdef SPECSERVE_BF16X16
/* Lane t of the result: the sum of v[t]'s 16 lanes, by a tree over a vector's lanes that is the
 * same wherever it sits among the 16 (a key's score does not depend on the keys beside it). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                    _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                    _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

/* s[t] = q . k[t] for `rows` keys of 64 values, `stride` elements apart. */
static inline void score64(float *restrict s, const float *restrict q, const float *restrict k,
                           int64_t rows, int64_t stride) {
    const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16),
                 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
    for (int64_t t0 = 0; t0 < rows; t0 += 16) {
        const int64_t n = rows - t0 < 16 ? rows - t0 : 16;
        __m512 products[16];
        for (int64_t t = 0; t < 16; t++) {
            if (t < n) {
                const float *restrict row = k + (t0 + t) * stride;
                __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(row));
                a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(row + 16), a);
                a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(row + 32), a);
                products[t] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(row + 48), a);
            } else {
                products[t] = _mm512_setzero_ps();
            }
        }
        _mm512_mask_storeu_ps(s + t0, (__mmask16)((1u << n) - 1), sum16(products));
    }
}

/* o += s[t] v[t] over `rows` values of 64, `stride` elements apart, in key order (as the
 * scalar loop below does it, lane by lane). */
static inline void accumulate64(float *restrict o, const float *restrict s,
                                const float *restrict v, int64_t rows, int64_t stride) {
    __m512 o0 = _mm512_loadu_ps(o), o1 = _mm512_loadu_ps(o + 16), o2 = _mm512_loadu_ps(o + 32),
           o3 = _mm512_loadu_ps(o + 48);
    for (int64_t t = 0; t < rows; t++) {
        const float *restrict row = v + t * stride;
        const __m512 w = _mm512_set1_ps(s[t]);
        o0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(row), o0);
        o1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + 16), o1);
        o2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + 32), o2);
        o3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + 48), o3);
    }
    _mm512_storeu_ps(o, o0);
    _mm512_storeu_ps(o + 16, o1);
    _mm512_storeu_ps(o + 32, o2);
    _mm512_storeu_ps(o + 48, o3);
}
#endif

/* Part `part` of `parts` of the cache lines of `bytes` from `p` (nothing for NULL), asked for
 * ahead of their use, into L2 (prefetcht1). A page is asked for in parts among the query
 * heads' work on the page before it: asked for at once, its lines fill the core's queue of
 * misses and the loop waits for them there instead of computing meanwhile. Into L2 rather
 * than L1, the lines in flight hold L2's queue of misses, which is deeper, and not L1's, which
 * the loads of the page being worked on need: on a 2-core Zen 4 VM `bench/decode_attention.py`
 * went 23.3 -> 18.7 ms a round in bfloat16 and 40.2 -> 27.0 in float32 (22.7 GB/s, what one
 * stream of reads gets there), outputs equal. */
static inline void prefetch_part(const char *p, int64_t bytes, int64_t part, int64_t parts) {
    if (p == NULL) return;
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t l = part * lines / parts; l < (part + 1) * lines / parts; l++)
        __builtin_prefetch(p + l * 64, 0, 2);
}

/* Keys scored between two updates of the running softmax (whole pages, at least one): the
 * update rescales the output so far, so it is done once per span rather than per page. */
#define SPAN_KEYS 64

static inline int64_t span_capacity(int64_t block_size) {
    return block_size > SPAN_KEYS ? block_size : SPAN_KEYS;
}

/* Floats of scratch `attend` needs: a page's rows of `width` values, then per query head a
 * span of probabilities, its running maximum and its running total. */
static inline int64_t attend_scratch(int64_t block_size, int64_t width, int64_t nq) {
    return block_size * width + nq * (span_capacity(block_size) + 2);
}

/* The keys [t0, t1) of page j that are visible; empty when t1 <= t0. */
static inline void visible_rows(int64_t j, int64_t first_pos, int64_t lo, int64_t hi,
                                int64_t block_size, int64_t *t0, int64_t *t1) {
    const int64_t page_pos = first_pos + j * block_size;
    *t0 = lo > page_pos ? lo - page_pos : 0;
    *t1 = hi - page_pos < block_size ? hi - page_pos : block_size;
}

/* One item: request rows of `nq` query heads (`q`, scaled; `nq / group` consecutive KV heads
 * from the one at `head_offset` elements into a token row) over the keys at positions
 * [lo, hi), into `out` (normalised). `scratch` holds `attend_scratch` floats. Returns 1 when
 * the pages do not cover the keys. Always inlined, so the calls below with a constant `dim`
 * get loops the compiler unrolls. */
static inline __attribute__((always_inline)) int attend(
    float *restrict out, const float *restrict q, const void *cache, const int64_t *pages,
    int64_t max_pages, int64_t first_pos, int64_t lo, int64_t hi, int64_t head_offset,
    int64_t nq, int64_t group, int64_t kv_heads, int64_t dim, int64_t block_size, int is_bf16,
    float *restrict scratch) {
    const int64_t token_stride = kv_heads * dim, width = nq / group * dim;
    const int64_t page_elems = block_size * token_stride, capacity = span_capacity(block_size);
    const size_t esize = is_bf16 ? 2 : 4;
    const int64_t item_bytes = ((block_size - 1) * token_stride + width) * (int64_t)esize;
    float *restrict rows_buf = scratch;                     /* a page's rows of K or V */
    float *restrict probs = rows_buf + block_size * width; /* [nq][capacity] */
    float *restrict running_max = probs + nq * capacity, *restrict total = running_max + nq;
    int64_t n = 0, j = 0, t0, t1, stride;
#define PAGE(index) ((const char *)cache + ((index) * page_elems + head_offset) * esize)
    memset(out, 0, (size_t)(nq * dim) * sizeof(float));
    while (j < max_pages && n < hi - lo) {
        /* A span: the whole pages [j, end) with `span` visible keys, from page `first` on. */
        int64_t end = j, span = 0, first = -1;
        for (; end < max_pages && n + span < hi - lo; end++) {
            visible_rows(end, first_pos, lo, hi, block_size, &t0, &t1);
            if (t1 <= t0) continue;
            if (span + (t1 - t0) > capacity) break;
            if (first < 0) first = end;
            span += t1 - t0;
        }
        if (first < 0) break; /* no visible key left in the pages: refused below */
        const int last_span = n + span == hi - lo;
        /* Scores, each K page asking for the next page read: the next K page, or the span's
         * first V page. */
        for (int64_t p = first, done = 0; p < end; p++) {
            visible_rows(p, first_pos, lo, hi, block_size, &t0, &t1);
            if (t1 <= t0) continue;
            const char *ahead = p + 1 < end ? PAGE(pages[p + 1]) : PAGE(pages[first] + 1);
            const float *k =
                page_rows(PAGE(pages[p]), t0, t1, width, token_stride, rows_buf, is_bf16, &stride);
            for (int64_t i = 0; i < nq; i++) {
                const float *restrict qi = q + i * dim, *restrict k_head = k + i / group * dim;
                float *restrict s = probs + i * capacity + done;
                prefetch_part(ahead, item_bytes, i, nq);
#ifdef SPECSERVE_BF16X16
                if (dim == 64) {
                    score64(s, qi, k_head, t1 - t0, stride);
                    continue;
                }
#endif
                for (int64_t t = 0; t < t1 - t0; t++) {
                    const float *restrict row = k_head + t * stride;
                    float acc = 0.0f;
                    for (int64_t d = 0; d < dim; d++) acc += qi[d] * row[d];
                    s[t] = acc;
                }
            }
            done += t1 - t0;
        }
        /* Running softmax: rescale what was summed under the old maximum. */
        for (int64_t i = 0; i < nq; i++) {
            float *restrict s = probs + i * capacity;
            float span_max = s[0];
            for (int64_t t = 1; t < span; t++) span_max = s[t] > span_max ? s[t] : span_max;
            const float m = n == 0 || span_max > running_max[i] ? span_max : running_max[i];
            const float rescale = n == 0 ? 0.0f : expf(running_max[i] - m);
            float sum = n == 0 ? 0.0f : total[i] * rescale;
            for (int64_t t = 0; t < span; t++) sum += s[t] = expf(s[t] - m);
            running_max[i] = m, total[i] = sum;
            if (n > 0 && rescale != 1.0f)
                for (int64_t d = 0; d < dim; d++) out[i * dim + d] *= rescale;
        }
        /* The span's values, weighted, each V page asking for the next page read: the next V
         * page or the next span's first K page. */
        for (int64_t p = first, done = 0; p < end; p++) {
            visible_rows(p, first_pos, lo, hi, block_size, &t0, &t1);
            if (t1 <= t0) continue;
            const char *ahead = p + 1 < end ? PAGE(pages[p + 1] + 1)
                                : last_span || end == max_pages ? NULL
                                                                : PAGE(pages[end]);
            const float *v = page_rows(PAGE(pages[p] + 1), t0, t1, width, token_stride,
                                       rows_buf, is_bf16, &stride);
            for (int64_t i = 0; i < nq; i++) {
                float *restrict oi = out + i * dim;
                const float *restrict v_head = v + i / group * dim;
                const float *restrict s = probs + i * capacity + done;
                prefetch_part(ahead, item_bytes, i, nq);
#ifdef SPECSERVE_BF16X16
                if (dim == 64) {
                    accumulate64(oi, s, v_head, t1 - t0, stride);
                    continue;
                }
#endif
                for (int64_t t = 0; t < t1 - t0; t++) {
                    const float *restrict row = v_head + t * stride;
                    for (int64_t d = 0; d < dim; d++) oi[d] = fmaf(s[t], row[d], oi[d]);
                }
            }
            done += t1 - t0;
        }
        n += span;
        j = end;
    }
#undef PAGE
    if (n != hi - lo) return 1; /* the pages do not cover the visible keys: refuse */
    for (int64_t i = 0; i < nq; i++) {
        const float inv = 1.0f / total[i];
        for (int64_t d = 0; d < dim; d++) out[i * dim + d] *= inv;
    }
    return 0;
}

void paged_decode_attention_team(const void *query, int64_t q_row_stride, const void *cache,
                                 int64_t num_blocks, const int64_t *pages,
                                 const int64_t *first_pos,
                                 const int64_t *seq_lens, void *out, int64_t batch,
                                 int64_t heads, int64_t kv_heads, int64_t dim,
                                 int64_t block_size, int64_t max_pages, int64_t window,
                                 float scale, int is_bf16, int *failed) {
    const int64_t group = heads / kv_heads;
    const size_t esize = is_bf16 ? 2 : 4;
    /* Whole requests when there are at least two per thread, else one KV head per item. */
    const int64_t heads_per_item = batch >= 2 * omp_get_num_threads() ? kv_heads : 1;
    const int64_t items_per_request = kv_heads / heads_per_item, nq = heads_per_item * group;
    /* Each thread's scratch, allocated once per call rather than per item. */
    float *scratch =
        malloc((size_t)attend_scratch(block_size, heads_per_item * dim, nq) * sizeof(float));
    float *qf = malloc((size_t)(2 * nq * dim) * sizeof(float)), *of = qf + nq * dim;
    int my_failed = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * items_per_request; item++) {
        const int64_t b = item / items_per_request, h0 = item % items_per_request * heads_per_item;
        const int64_t hi = seq_lens[b];
        const int64_t lo = window > 0 && hi - window > 0 ? hi - window : 0;
        /* No scratch, or no visible key (cannot happen for a decode token, which sees itself). */
        if (scratch == NULL || qf == NULL || hi <= lo) {
            my_failed += (int)heads_per_item;
            continue;
        }
        const char *qrow = (const char *)query + (b * q_row_stride + h0 * group * dim) * esize;
        load_rows(qf, qrow, 1, nq * dim, 0, is_bf16);
        for (int64_t i = 0; i < nq * dim; i++) qf[i] *= scale;
        const int64_t *req_pages = pages + b * max_pages;
        int bad = 0;
        for (int64_t j = 0; j < max_pages; j++) /* K pages (even) of blocks in the cache */
            bad |= req_pages[j] < 0 || req_pages[j] % 2 || req_pages[j] >= 2 * num_blocks;
        if (bad) {
            my_failed += (int)heads_per_item;
            continue;
        }
        if (dim == 64)
            bad = attend(of, qf, cache, req_pages, max_pages, first_pos[b], lo, hi, h0 * dim, nq,
                         group, kv_heads, 64, block_size, is_bf16, scratch);
        else if (dim == 128)
            bad = attend(of, qf, cache, req_pages, max_pages, first_pos[b], lo, hi, h0 * dim, nq,
                         group, kv_heads, 128, block_size, is_bf16, scratch);
        else
            bad = attend(of, qf, cache, req_pages, max_pages, first_pos[b], lo, hi, h0 * dim, nq,
                         group, kv_heads, dim, block_size, is_bf16, scratch);
        my_failed += bad * (int)heads_per_item;
        char *orow = (char *)out + (b * heads + h0 * group) * dim * esize;
        for (int64_t i = 0; i < nq * dim; i++) {
            if (is_bf16)
                ((uint16_t *)orow)[i] = bf16_round(of[i]);
            else
                ((float *)orow)[i] = of[i];
        }
    }
    free(scratch);
    free(qf);
    if (my_failed) {
#pragma omp atomic
        *failed += my_failed;
    }
}

/* Returns 0, or the number of (request, KV head) pairs that failed: no scratch memory, no
 * visible key, pages outside the cache or pages that do not cover the visible keys. */
int paged_decode_attention(const void *query, int64_t q_row_stride, const void *cache,
                           int64_t num_blocks, const int64_t *pages, const int64_t *first_pos,
                           const int64_t *seq_lens, void *out, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_pages,
                           int64_t window, float scale, int is_bf16) {
    int failed = 0;
#pragma omp parallel
    paged_decode_attention_team(query, q_row_stride, cache, num_blocks, pages, first_pos,
                                seq_lens, out,
                                batch, heads, kv_heads, dim, block_size, max_pages, window,
                                scale, is_bf16, &failed);
    return failed;
}
