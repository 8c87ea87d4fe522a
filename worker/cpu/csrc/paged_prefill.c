/* Multi-row attention (prompt chunks, verification and draft blocks) read straight from the
 * paged KV cache (CPU: AVX-512, or AVX2 with FMA). Built and loaded by worker/cpu/kernels.py.
 *
 * PyTorch's CPU flash kernel runs a 64-wide head at a fifth of the machine's matmul rate, and
 * every call first needs the request's K and V gathered out of their pages. This kernel reads
 * the pages where they lie and keeps the arithmetic in registers:
 *
 * - A work item is one request's tile of up to TILE_ROWS query rows for the G query heads that
 *   share one KV head. It walks the visible keys in blocks of KB, packing each block once (K
 *   transposed to [dim][KB], V as [KB][dim], float32) for all G x TILE_ROWS rows.
 * - Scores of MR rows x KB keys are 16 registers (a broadcast query value times two key vectors
 *   per step of the head dimension); the running (online) softmax rescales each row's output
 *   once per block; P x V runs two rows at a time, 64 output columns per pass.
 * - A causal tile skips the blocks above its diagonal, and masks only the blocks that cross it
 *   (or a sliding window's edge).
 *
 * Query description, 8 int64 per request (`queries[8 i + f]`):
 *   0 row of its first query in `query`/`out`, 1 number of query rows, 2 position of the first
 *   query row, 3 position of the first key of its first page, 4 keys below this position exist
 *   (seq_len), 5 causal (1) or a block that sees all its keys (0), 6 its first page in `pages`,
 *   7 its number of pages.
 * Request i's keys are its pages `pages[queries[8 i + 6] + j]` (K page numbers: block * 2, the
 * cache viewed as [num_blocks * 2, block_size * kv_heads * dim]), key t of page j at position
 * first_key + j * block_size + t. A query at position p sees the keys at positions k with
 * k < seq_len, k <= p (causal), k > p - window (window > 0), and k >= first_key.
 *
 * Scores, softmax and accumulation are in float32 whatever the storage dtype (float32 or
 * bfloat16), as SDPA's CPU kernel does. Where the CPU has AMX tiles, bfloat16 heads of whole
 * 32-value slices multiply on them instead (attend_tile_amx): the products of bfloat16 pairs
 * accumulate in float32 as before, and the softmax weights are rounded to bfloat16 for P x V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "amx.h"
#include "bf16.h"
#include "team.h"
#include "vec.h"

#define TILE_ROWS 64 /* query rows of one work item, per query head */
#define MR 8         /* rows scored at once */
#define KB 32        /* keys per block: two 16-wide registers */
#define MASKED -1e30f
#define QUERY_FIELDS 8

#if VEC_SIMD == 512
#define PREFILL_SIMD 512
/* Bits [a, b) of a 16-bit mask for lanes `base .. base + 16`. */
static inline __mmask16 lanes(int64_t a, int64_t b, int64_t base) {
    a = a < base ? base : a, b = b > base + 16 ? base + 16 : b;
    if (b <= a) return 0;
    return (__mmask16)((((uint32_t)1 << (b - a)) - 1) << (a - base));
}

/* s[m][0..KB) = q[m] . kt[.][0..KB) for MR rows of `dim` values (16 accumulators). */
static inline void score_tile(float *restrict s, const float *restrict q,
                              const float *restrict kt, int64_t dim) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00,
           a61 = a00, a70 = a00, a71 = a00;
    for (int64_t d = 0; d < dim; d++) {
        const __m512 k0 = _mm512_load_ps(kt + d * KB), k1 = _mm512_load_ps(kt + d * KB + 16);
#define ROW(m)                                                       \
    {                                                                \
        const __m512 qv = _mm512_set1_ps(q[m * dim + d]);            \
        a##m##0 = _mm512_fmadd_ps(qv, k0, a##m##0);                  \
        a##m##1 = _mm512_fmadd_ps(qv, k1, a##m##1);                  \
    }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
    }
#define STORE(m)                                   \
    _mm512_store_ps(s + m * KB, a##m##0);          \
    _mm512_store_ps(s + m * KB + 16, a##m##1);
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
#undef STORE
}

#elif VEC_SIMD == 256
#define PREFILL_SIMD 256
/* The same kernel on 8-wide AVX2 registers: 16 of them hold half the score tile, so it runs
 * in passes; masks and reductions by hand. */
static inline float hsum_ps(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

static inline float hmax_ps(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}

/* All-ones in lanes `base .. base + 8` that lie in [a, b), zero elsewhere. */
static inline __m256 lanes(int64_t a, int64_t b, int64_t base) {
    const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                        _mm256_set1_epi32((int)base));
    const __m256i from = _mm256_cmpgt_epi32(at, _mm256_set1_epi32((int)a - 1));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)b), at);
    return _mm256_castsi256_ps(_mm256_and_si256(from, below));
}

/* s[m][0..16) = q[m] . kt[.][0..16) for 4 rows (8 accumulators); s and kt rows KB apart. */
static inline void score_quarter(float *restrict s, const float *restrict q,
                                 const float *restrict kt, int64_t dim) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    for (int64_t d = 0; d < dim; d++) {
        const __m256 k0 = _mm256_load_ps(kt + d * KB), k1 = _mm256_load_ps(kt + d * KB + 8);
#define ROW(m)                                                       \
    {                                                                \
        const __m256 qv = _mm256_broadcast_ss(q + m * dim + d);      \
        a##m##0 = _mm256_fmadd_ps(qv, k0, a##m##0);                  \
        a##m##1 = _mm256_fmadd_ps(qv, k1, a##m##1);                  \
    }
        ROW(0) ROW(1) ROW(2) ROW(3)
#undef ROW
    }
#define STORE(m)                                   \
    _mm256_store_ps(s + m * KB, a##m##0);          \
    _mm256_store_ps(s + m * KB + 8, a##m##1);
    STORE(0) STORE(1) STORE(2) STORE(3)
#undef STORE
}

/* s[m][0..KB) = q[m] . kt[.][0..KB) for MR rows, in four quarters. */
static inline void score_tile(float *restrict s, const float *restrict q,
                              const float *restrict kt, int64_t dim) {
    for (int64_t m = 0; m < MR; m += 4)
        for (int64_t c = 0; c < KB; c += 16)
            score_quarter(s + m * KB + c, q + m * dim, kt + c, dim);
}

#endif /* SIMD */

#if defined(PREFILL_SIMD)

/* o[r] += sum_n p[r][n] v[n] for two rows, 4 vectors of columns at a time (8 accumulators). */
static inline void weigh_values(float *restrict o0, float *restrict o1,
                                const float *restrict p0, const float *restrict p1,
                                const float *restrict v, int64_t nk, int64_t dim) {
    for (int64_t c = 0; c < dim; c += 4 * VL) {
        const int64_t w = dim - c < 4 * VL ? (dim - c) / VL : 4;
        vf x0 = vf_load(o0 + c), y0 = vf_load(o1 + c);
        vf x1 = w > 1 ? vf_load(o0 + c + VL) : x0, y1 = w > 1 ? vf_load(o1 + c + VL) : y0;
        vf x2 = w > 2 ? vf_load(o0 + c + 2 * VL) : x0, y2 = w > 2 ? vf_load(o1 + c + 2 * VL) : y0;
        vf x3 = w > 3 ? vf_load(o0 + c + 3 * VL) : x0, y3 = w > 3 ? vf_load(o1 + c + 3 * VL) : y0;
        for (int64_t n = 0; n < nk; n++) {
            const float *restrict vn = v + n * dim + c;
            const vf pa = vf_set1(p0[n]), pb = vf_set1(p1[n]);
            const vf v0 = vf_load(vn);
            x0 = vf_fmadd(pa, v0, x0), y0 = vf_fmadd(pb, v0, y0);
            if (w > 1) {
                const vf v1 = vf_load(vn + VL);
                x1 = vf_fmadd(pa, v1, x1), y1 = vf_fmadd(pb, v1, y1);
            }
            if (w > 2) {
                const vf v2 = vf_load(vn + 2 * VL);
                x2 = vf_fmadd(pa, v2, x2), y2 = vf_fmadd(pb, v2, y2);
            }
            if (w > 3) {
                const vf v3 = vf_load(vn + 3 * VL);
                x3 = vf_fmadd(pa, v3, x3), y3 = vf_fmadd(pb, v3, y3);
            }
        }
        vf_store(o0 + c, x0), vf_store(o1 + c, y0);
        if (w > 1) vf_store(o0 + c + VL, x1), vf_store(o1 + c + VL, y1);
        if (w > 2) vf_store(o0 + c + 2 * VL, x2), vf_store(o1 + c + 2 * VL, y2);
        if (w > 3) vf_store(o0 + c + 3 * VL, x3), vf_store(o1 + c + 3 * VL, y3);
    }
}

/* o[0..dim) *= f. */
static inline void scale_row(float *restrict o, float f, int64_t dim) {
    const vf by = vf_set1(f);
    for (int64_t d = 0; d < dim; d += VL) vf_store(o + d, vf_mul(by, vf_load(o + d)));
}

/* Per ISA, a row's weights in one block: p = exp(s - max) on lanes [a, b), zero elsewhere, where max
 * is the row's running maximum updated with this block's (stored back to *row_max); returns
 * the sum of p. */
#if PREFILL_SIMD == 512
static inline float softmax_block(float *restrict p, const float *restrict s, int64_t a,
                                  int64_t b, float *row_max) {
    const __mmask16 lo_mask = lanes(a, b, 0), hi_mask = lanes(a, b, 16);
    const __m512 neg = _mm512_set1_ps(MASKED);
    const __m512 s0 = _mm512_mask_blend_ps(lo_mask, neg, _mm512_load_ps(s));
    const __m512 s1 = _mm512_mask_blend_ps(hi_mask, neg, _mm512_load_ps(s + 16));
    const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float new_max = block_max > *row_max ? block_max : *row_max;
    const __m512 top = _mm512_set1_ps(new_max);
    const __m512 e0 = _mm512_maskz_mov_ps(lo_mask, exp_ps(_mm512_sub_ps(s0, top)));
    const __m512 e1 = _mm512_maskz_mov_ps(hi_mask, exp_ps(_mm512_sub_ps(s1, top)));
    _mm512_store_ps(p, e0), _mm512_store_ps(p + 16, e1);
    *row_max = new_max;
    return _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
}
#else
static inline float softmax_block(float *restrict p, const float *restrict s, int64_t a,
                                  int64_t b, float *row_max) {
    __m256 mask[KB / 8], score[KB / 8], top = _mm256_set1_ps(MASKED);
    for (int j = 0; j < KB / 8; j++) {
        mask[j] = lanes(a, b, 8 * j);
        score[j] = _mm256_blendv_ps(_mm256_set1_ps(MASKED), _mm256_load_ps(s + 8 * j), mask[j]);
        top = _mm256_max_ps(top, score[j]);
    }
    const float block_max = hmax_ps(top);
    const float new_max = block_max > *row_max ? block_max : *row_max;
    top = _mm256_set1_ps(new_max);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < KB / 8; j++) {
        const __m256 e = _mm256_and_ps(mask[j], exp_ps(_mm256_sub_ps(score[j], top)));
        _mm256_store_ps(p + 8 * j, e);
        sum = _mm256_add_ps(sum, e);
    }
    *row_max = new_max;
    return hsum_ps(sum);
}
#endif

/* Row r's value at `d` of the page row `src` (float32 or bfloat16). */
static inline float element(const char *src, int64_t d, int is_bf16) {
    return is_bf16 ? bf16_load((const uint16_t *)src, d) : ((const float *)src)[d];
}

/* Scratch of one thread, in floats: queries and outputs of an item, a block's K and V, a
 * tile's scores, and each row's running maximum and total. Each piece is a multiple of 16
 * floats (dim is), so all of them stay 64-byte aligned. */
static inline int64_t item_floats(int64_t group, int64_t dim) {
    const int64_t rows = group * TILE_ROWS;
    return 2 * rows * dim + 2 * KB * dim + MR * KB + 2 * rows;
}

/* An item's outputs, `of` / `total` for rows [0, rows) of each of its `group` heads, into `out`
 * from row `first_row` on. Returns 1 when a row saw no key (its total is 0). */
static int write_outputs(const float *of, const float *total, void *out, int64_t first_row,
                         int64_t rows, int64_t h, int64_t group, int64_t heads, int64_t dim,
                         int is_bf16) {
    const int64_t esize = is_bf16 ? 2 : 4;
    int bad = 0;
    for (int64_t g = 0; g < group; g++)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t i = g * TILE_ROWS + r;
            if (!(total[i] > 0.0f)) {
                bad = 1;
                continue;
            }
            const float inv = 1.0f / total[i];
            char *dst = (char *)out + ((first_row + r) * heads + h * group + g) * dim * esize;
            int64_t d = 0;
#ifdef SPECSERVE_BF16X16
            for (; is_bf16 && d + 16 <= dim; d += 16) {
                const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(of + i * dim + d), _mm512_set1_ps(inv));
                bf16x16_store((uint16_t *)dst + d, v);
            }
#endif
            for (; d < dim; d++) {
                const float v = of[i * dim + d] * inv;
                if (is_bf16)
                    ((uint16_t *)dst)[d] = bf16_round(v);
                else
                    ((float *)dst)[d] = v;
            }
        }
    return bad;
}

/* Each row's visible keys among block keys [k0, k0 + nk), as lanes [a, b), for query rows
 * m0 .. m0 + count of a tile starting at row r0 (rows past the tile's `rows` repeat its last).
 * Returns whether any real row sees a key. */
static inline int visible_lanes(int64_t *a, int64_t *b, int64_t count, int64_t m0, int64_t rows,
                                int64_t first_row_pos, int64_t k0, int64_t nk, int causal,
                                int64_t window) {
    int any = 0;
    for (int64_t m = 0; m < count; m++) {
        const int64_t r = m0 + m < rows ? m0 + m : rows - 1;
        const int64_t p = first_row_pos + r;
        int64_t first = k0, last = k0 + nk; /* [first, last) */
        if (window > 0 && p - window + 1 > first) first = p - window + 1;
        if (causal && p + 1 < last) last = p + 1;
        a[m] = first - k0, b[m] = last - k0;
        any |= (m0 + m < rows) && a[m] < b[m];
    }
    return any;
}

/* Keys [*lo, *hi) that any of query rows [r0, r1) of request `qd` sees; 0 when its pages do not
 * cover them. */
static inline int tile_keys(const int64_t *qd, int64_t r0, int64_t r1, int64_t window,
                            int64_t block_size, int64_t *lo, int64_t *hi) {
    const int64_t first_pos = qd[2], first_key = qd[3], seq_len = qd[4];
    const int64_t p_first = first_pos + r0, p_last = first_pos + r1 - 1;
    *lo = first_key > 0 ? first_key : 0;
    if (window > 0 && p_first - window + 1 > *lo) *lo = p_first - window + 1;
    *hi = qd[5] != 0 && p_last + 1 < seq_len ? p_last + 1 : seq_len;
    return *hi - first_key <= qd[7] * block_size;
}

/* One item: query rows [r0, r1) of request `qd`, query heads [h * group, (h + 1) * group).
 * Returns 1 when a row sees no key. */
static int attend_tile(const int64_t *qd, const int64_t *pages, int64_t r0, int64_t r1,
                       int64_t h, const void *query, int64_t q_row_stride, const void *cache,
                       void *out,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                       int64_t window, float scale, int is_bf16, float *scratch) {
    const int64_t group = heads / kv_heads, esize = is_bf16 ? 2 : 4;
    const int64_t row0 = qd[0], first_pos = qd[2], first_key = qd[3];
    const int causal = qd[5] != 0;
    const int64_t rows = r1 - r0, padded = (rows + MR - 1) / MR * MR;
    const int64_t token_stride = kv_heads * dim, page_elems = block_size * token_stride;
    float *restrict qf = scratch;                        /* [group][TILE_ROWS][dim], scaled */
    float *restrict of = qf + group * TILE_ROWS * dim;   /* [group][TILE_ROWS][dim] */
    float *restrict kt = of + group * TILE_ROWS * dim;   /* [dim][KB] */
    float *restrict vb = kt + KB * dim;                  /* [KB][dim] */
    float *restrict s = vb + KB * dim;                   /* [MR][KB] */
    float *restrict run_max = s + MR * KB, *restrict total = run_max + group * TILE_ROWS;

    for (int64_t g = 0; g < group; g++)
        for (int64_t r = 0; r < padded; r++) {
            float *restrict dst = qf + (g * TILE_ROWS + r) * dim;
            if (r >= rows) {
                memset(dst, 0, (size_t)dim * sizeof(float));
                continue;
            }
            const char *src =
                (const char *)query + ((row0 + r0 + r) * q_row_stride + (h * group + g) * dim) * esize;
            for (int64_t d = 0; d < dim; d++) dst[d] = element(src, d, is_bf16) * scale;
        }
    memset(of, 0, (size_t)(group * TILE_ROWS * dim) * sizeof(float));
    for (int64_t i = 0; i < group * TILE_ROWS; i++) run_max[i] = MASKED, total[i] = 0.0f;

    int64_t lo, hi;
    if (!tile_keys(qd, r0, r1, window, block_size, &lo, &hi)) return 1;

    for (int64_t k0 = lo; k0 < hi; k0 += KB) {
        const int64_t nk = hi - k0 < KB ? hi - k0 : KB;
        /* Pack the block: K transposed, V as rows; keys past the end are zero. */
        for (int64_t n = 0; n < KB; n++) {
            if (n >= nk) {
                for (int64_t d = 0; d < dim; d++) kt[d * KB + n] = 0.0f;
                memset(vb + n * dim, 0, (size_t)dim * sizeof(float));
                continue;
            }
            const int64_t at = k0 + n - first_key, page = pages[at / block_size];
            const int64_t offset = page * page_elems + at % block_size * token_stride + h * dim;
            const char *k_row = (const char *)cache + offset * esize;
            const char *v_row = (const char *)cache + (offset + page_elems) * esize;
            for (int64_t d = 0; d < dim; d++) kt[d * KB + n] = element(k_row, d, is_bf16);
            for (int64_t d = 0; d < dim; d++) vb[n * dim + d] = element(v_row, d, is_bf16);
        }
        for (int64_t m0 = 0; m0 < padded; m0 += MR) {
            /* Each row's visible keys in this block are one interval [a, b) of its lanes. */
            int64_t a[MR], b[MR];
            if (!visible_lanes(a, b, MR, m0, rows, first_pos + r0, k0, nk, causal, window))
                continue; /* above the diagonal, or behind the window, for every row */
            for (int64_t g = 0; g < group; g++) {
                const int64_t base = g * TILE_ROWS + m0;
                score_tile(s, qf + base * dim, kt, dim);
                float p_rows[MR][KB] __attribute__((aligned(64)));
                for (int64_t m = 0; m < MR; m++) {
                    if (a[m] >= b[m]) {
                        memset(p_rows[m], 0, sizeof p_rows[m]);
                        continue;
                    }
                    const int64_t i = base + m;
                    const float old_max = run_max[i];
                    const float sum = softmax_block(p_rows[m], s + m * KB, a[m], b[m], &run_max[i]);
                    const float rescale = old_max == MASKED ? 0.0f : expf(old_max - run_max[i]);
                    total[i] = total[i] * rescale + sum;
                    if (rescale != 1.0f) scale_row(of + i * dim, rescale, dim);
                }
                for (int64_t m = 0; m < MR; m += 2)
                    weigh_values(of + (base + m) * dim, of + (base + m + 1) * dim, p_rows[m],
                                 p_rows[m + 1], vb, nk, dim);
            }
        }
    }
    return write_outputs(of, total, out, row0 + r0, rows, h, group, heads, dim, is_bf16);
}

#if PREFILL_SIMD == 512 && defined(SPECSERVE_AMX)
#define PREFILL_AMX 1

/* r[i] lane j <-> r[j] lane i, for 16 x 16 32-bit values. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4b + c], 128-bit lane L: column 4L + c of rows 4b .. 4b + 3 */
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i ab_lo = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i ab_hi = _mm512_shuffle_i32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
        t[c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, _MM_SHUFFLE(2, 0, 2, 0));
        t[4 + c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, _MM_SHUFFLE(3, 1, 3, 1));
        t[8 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, _MM_SHUFFLE(2, 0, 2, 0));
        t[12 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* The same item in bfloat16 on AMX tiles, for heads of whole 32-value slices. A block's scores
 * come out of the tiles transposed (keys x 16 query rows: K times the queries' transpose), so
 * the online softmax runs on vectors of 16 rows, one key at a time, with no reductions across
 * lanes; the weights, rounded to bfloat16 (as a bfloat16 flash kernel does, their total taken
 * as rounded), are transposed once into rows for P x V. Products of bfloat16 pairs accumulate
 * in float32; scores are scaled after the product. Packing: the queries once per item as the
 * tiles' B operand ([dim / 2][TILE_ROWS] pairs of the head dimension), each block's K as rows
 * and its V as [KB / 2][dim] pairs of keys.
 * Tiles (16 rows x 64 bytes each): 0-1 two key halves' slices, 2 the queries' slice, 3 weights,
 * 4-5 scores, 6 a value slice, 7 outputs. */
static int attend_tile_amx(const int64_t *qd, const int64_t *pages, int64_t r0, int64_t r1,
                           int64_t h, const void *query, int64_t q_row_stride,
                           const void *cache, void *out, int64_t heads, int64_t kv_heads,
                           int64_t dim, int64_t block_size, int64_t window, float scale,
                           float *scratch) {
    const int64_t group = heads / kv_heads, row0 = qd[0], first_pos = qd[2];
    const int64_t first_key = qd[3];
    const int causal = qd[5] != 0;
    const int64_t rows = r1 - r0, padded = (rows + 15) / 16 * 16, pairs = dim / 2;
    const int64_t token_stride = kv_heads * dim, page_elems = block_size * token_stride;
    float *restrict of = scratch;                                  /* [group][TILE_ROWS][dim] */
    /* [group][dim / 2][TILE_ROWS] */
    uint32_t *restrict qv = (uint32_t *)(of + group * TILE_ROWS * dim);
    uint16_t *restrict kb = (uint16_t *)(qv + group * pairs * TILE_ROWS); /* [KB][dim] */
    uint32_t *restrict vp = (uint32_t *)(kb + KB * dim);           /* [KB / 2][dim] */
    float *restrict st = (float *)(vp + KB / 2 * dim);             /* [KB][16] */
    uint16_t *restrict pw = (uint16_t *)(st + KB * 16);            /* [16][KB], bf16 */
    float *restrict run_max = (float *)(pw + 16 * KB);
    float *restrict total = run_max + group * TILE_ROWS;

    for (int64_t g = 0; g < group; g++) {
        /* 16 rows x 16 pairs at a time, transposed in registers */
        for (int64_t m0 = 0; m0 < padded; m0 += 16)
            for (int64_t d2 = 0; d2 < pairs; d2 += 16) {
                __m512i x[16];
                for (int64_t m = 0; m < 16; m++) {
                    const int64_t at = (row0 + r0 + m0 + m) * q_row_stride + (h * group + g) * dim;
                    x[m] = m0 + m < rows ? _mm512_loadu_si512((const uint16_t *)query + at + 2 * d2)
                                         : _mm512_setzero_si512();
                }
                transpose16_epi32(x);
                for (int64_t i = 0; i < 16; i++)
                    _mm512_store_si512(qv + (g * pairs + d2 + i) * TILE_ROWS + m0, x[i]);
            }
        memset(of + g * TILE_ROWS * dim, 0, (size_t)(padded * dim) * sizeof(float));
        for (int64_t i = g * TILE_ROWS; i < g * TILE_ROWS + padded; i++)
            run_max[i] = MASKED, total[i] = 0.0f;
    }

    int64_t lo, hi;
    if (!tile_keys(qd, r0, r1, window, block_size, &lo, &hi)) return 1;
    const __m512i interleave_lo = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i interleave_hi = _mm512_add_epi16(interleave_lo, _mm512_set1_epi16(16));
    /* [x0 .. x15 | y0 .. y15] -> x0 y0 x1 y1 ... within one register */
    const __m512i interleave_halves = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 by_scale = _mm512_set1_ps(scale), masked = _mm512_set1_ps(MASKED);

    for (int64_t k0 = lo; k0 < hi; k0 += KB) {
        const int64_t nk = hi - k0 < KB ? hi - k0 : KB;
        /* Pack the block; keys past the end are zero. */
        for (int64_t n = 0; n < KB; n += 2) {
            const uint16_t *v_rows[2];
            for (int64_t j = 0; j < 2; j++) {
                v_rows[j] = NULL;
                if (n + j >= nk) {
                    memset(kb + (n + j) * dim, 0, (size_t)dim * 2);
                    continue;
                }
                const int64_t at = k0 + n + j - first_key, page = pages[at / block_size];
                const uint16_t *k_row = (const uint16_t *)cache + page * page_elems +
                                        at % block_size * token_stride + h * dim;
                memcpy(kb + (n + j) * dim, k_row, (size_t)dim * 2);
                v_rows[j] = k_row + page_elems;
            }
            for (int64_t d = 0; d < dim; d += 32) {
                const __m512i zero = _mm512_setzero_si512();
                const __m512i v0 = v_rows[0] ? _mm512_loadu_si512(v_rows[0] + d) : zero;
                const __m512i v1 = v_rows[1] ? _mm512_loadu_si512(v_rows[1] + d) : zero;
                uint32_t *dst = vp + n / 2 * dim + d;
                _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(v0, interleave_lo, v1));
                _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(v0, interleave_hi, v1));
            }
        }
        for (int64_t m0 = 0; m0 < padded; m0 += 16) {
            int64_t a[16], b[16];
            if (!visible_lanes(a, b, 16, m0, rows, first_pos + r0, k0, nk, causal, window))
                continue;
            /* Per key, the rows that see it. */
            __mmask16 sees[KB];
            int32_t a32[16], b32[16];
            for (int m = 0; m < 16; m++) a32[m] = (int32_t)a[m], b32[m] = (int32_t)b[m];
            const __m512i from = _mm512_loadu_si512(a32), below = _mm512_loadu_si512(b32);
            for (int k = 0; k < KB; k++) {
                const __m512i key = _mm512_set1_epi32(k);
                sees[k] = _mm512_cmple_epi32_mask(from, key) & _mm512_cmpgt_epi32_mask(below, key);
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t base = g * TILE_ROWS + m0;
                _tile_zero(4);
                _tile_zero(5);
                for (int64_t d = 0; d < dim; d += 32) {
                    _tile_loadd(0, kb + d, dim * 2);
                    _tile_loadd(1, kb + 16 * dim + d, dim * 2);
                    _tile_loadd(2, qv + (g * pairs + d / 2) * TILE_ROWS + m0, TILE_ROWS * 4);
                    _tile_dpbf16ps(4, 0, 2);
                    _tile_dpbf16ps(5, 1, 2);
                }
                _tile_stored(4, st, 64);
                _tile_stored(5, st + 16 * 16, 64);
                /* The block's maximum per row, on scaled scores of the keys each row sees. */
                const __m512 old_max = _mm512_load_ps(run_max + base);
                __m512 top = old_max;
                for (int k = 0; k < KB; k++) {
                    const __m512 sk = _mm512_mask_blend_ps(
                        sees[k], masked, _mm512_mul_ps(_mm512_load_ps(st + k * 16), by_scale));
                    _mm512_store_ps(st + k * 16, sk);
                    top = _mm512_max_ps(top, sk);
                }
                /* Weights, rounded; pairs of keys interleaved per row; their rounded total. */
                __m512i w[16];
                __m512 sum = _mm512_setzero_ps();
                for (int j = 0; j < 16; j++) {
                    const __m512 p0 = _mm512_maskz_mov_ps(
                        sees[2 * j], exp_ps(_mm512_sub_ps(_mm512_load_ps(st + 2 * j * 16), top)));
                    const __m512 p1 = _mm512_maskz_mov_ps(
                        sees[2 * j + 1],
                        exp_ps(_mm512_sub_ps(_mm512_load_ps(st + (2 * j + 1) * 16), top)));
                    sum = _mm512_add_ps(sum, bf16x16_rounded(p0));
                    sum = _mm512_add_ps(sum, bf16x16_rounded(p1));
                    const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
                    w[j] = _mm512_permutexvar_epi16(interleave_halves, pair);
                }
                transpose16_epi32(w); /* w[m]: row m's 32 weights */
                for (int m = 0; m < 16; m++) _mm512_store_si512(pw + m * KB, w[m]);
                const __m512 rescale = exp_ps(_mm512_sub_ps(old_max, top));
                _mm512_store_ps(run_max + base, top);
                _mm512_store_ps(total + base,
                                _mm512_fmadd_ps(_mm512_load_ps(total + base), rescale, sum));
                float factor[16] __attribute__((aligned(64)));
                _mm512_store_ps(factor, rescale);
                for (__mmask16 rows_to_scale = _mm512_cmp_ps_mask(rescale, _mm512_set1_ps(1.0f),
                                                                  _CMP_NEQ_OQ);
                     rows_to_scale; rows_to_scale &= rows_to_scale - 1) {
                    const int m = __builtin_ctz(rows_to_scale);
                    scale_row(of + (base + m) * dim, factor[m], dim);
                }
                _tile_loadd(3, pw, KB * 2);
                for (int64_t c = 0; c < dim; c += 16) {
                    _tile_loadd(7, of + base * dim + c, dim * 4);
                    _tile_loadd(6, vp + c, dim * 4);
                    _tile_dpbf16ps(7, 3, 6);
                    _tile_stored(7, of + base * dim + c, dim * 4);
                }
            }
        }
    }
    return write_outputs(of, total, out, row0 + r0, rows, h, group, heads, dim, 1);
}

/* Whether items of this call run on the tiles: bfloat16 heads of whole 32-value slices, and
 * the tile state granted. */
static inline int amx_attention_runs(int64_t dim, int is_bf16) {
    return is_bf16 && dim % 32 == 0 && linear_amx_min_rows() > 0;
}
#endif /* AMX */

/* Work items of request `rows` rows: one per KV head per tile. */
static inline int64_t request_items(int64_t rows, int64_t kv_heads) {
    return kv_heads * ((rows + TILE_ROWS - 1) / TILE_ROWS);
}

#endif /* PREFILL_SIMD */

/* Whether items of `dim`-wide heads in this dtype run on AMX tiles (attend_tile_amx). */
int paged_prefill_on_tiles(int64_t dim, int is_bf16) {
#if defined(PREFILL_AMX)
    return amx_attention_runs(dim, is_bf16);
#else
    (void)dim, (void)is_bf16;
    return 0;
#endif
}

int paged_prefill_supported(void) {
#if defined(PREFILL_SIMD)
    return 1;
#else
    return 0;
#endif
}

void paged_prefill_attention_team(const void *query, int64_t q_row_stride, const void *cache,
                                  int64_t num_blocks,
                                  const int64_t *queries, int64_t num_queries,
                                  const int64_t *pages, int64_t num_pages, void *out,
                                  int64_t heads, int64_t kv_heads, int64_t dim,
                                  int64_t block_size, int64_t window, float scale, int is_bf16,
                                  int *failed) {
#if defined(PREFILL_SIMD)
    /* Items in order of requests, each request's tiles last first (they see the most keys,
     * so the dynamic schedule starts the longest items first). */
    int64_t items = 0;
    for (int64_t i = 0; i < num_queries; i++)
        items += request_items(queries[QUERY_FIELDS * i + 1], kv_heads);
    const int64_t group = heads / kv_heads;
    /* Each thread's scratch, once per call; a whole number of 64-byte lines (item_floats is a
     * multiple of 16). */
    float *scratch = aligned_alloc(64, (size_t)item_floats(group, dim) * sizeof(float));
    int my_failed = 0;
#if defined(PREFILL_AMX)
    const int on_tiles = amx_attention_runs(dim, is_bf16);
    if (on_tiles) {
        const uint8_t tile_rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        amx_configure_rows(tile_rows);
    }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        int64_t i = 0, local = item;
        for (; local >= request_items(queries[QUERY_FIELDS * i + 1], kv_heads); i++)
            local -= request_items(queries[QUERY_FIELDS * i + 1], kv_heads);
        const int64_t *qd = queries + QUERY_FIELDS * i;
        const int64_t tiles = (qd[1] + TILE_ROWS - 1) / TILE_ROWS;
        const int64_t tile = tiles - 1 - local / kv_heads, h = local % kv_heads;
        const int64_t r0 = tile * TILE_ROWS, r1 = r0 + TILE_ROWS < qd[1] ? r0 + TILE_ROWS : qd[1];
        int bad = scratch == NULL || qd[6] < 0 || qd[7] < 0 || qd[6] + qd[7] > num_pages;
        for (int64_t j = 0; !bad && j < qd[7]; j++) {
            const int64_t page = pages[qd[6] + j];
            bad = page < 0 || page % 2 || page >= 2 * num_blocks;
        }
#if defined(PREFILL_AMX)
        if (!bad && on_tiles)
            bad = attend_tile_amx(qd, pages + qd[6], r0, r1, h, query, q_row_stride, cache, out,
                                  heads, kv_heads, dim, block_size, window, scale, scratch);
        else
#endif
        if (!bad)
            bad = attend_tile(qd, pages + qd[6], r0, r1, h, query, q_row_stride, cache, out,
                              heads, kv_heads, dim, block_size, window, scale, is_bf16, scratch);
        my_failed += bad;
    }
    free(scratch);
#if defined(PREFILL_AMX)
    if (on_tiles) _tile_release();
#endif
    if (my_failed) {
#pragma omp atomic
        *failed += my_failed;
    }
#else /* no AVX2 or AVX-512: the callers keep SDPA (paged_prefill_supported() is 0) */
    (void)query, (void)q_row_stride, (void)cache, (void)num_blocks, (void)queries;
    (void)num_queries, (void)pages, (void)num_pages, (void)out, (void)heads, (void)kv_heads;
    (void)dim, (void)block_size, (void)window, (void)scale, (void)is_bf16;
#pragma omp single
    *failed += 1;
#endif
}

/* Returns 0, or the number of work items that failed: no scratch memory, pages outside the
 * cache or not covering the keys, a row that sees no key, or neither AVX-512 nor AVX2. `query` rows are
 * `q_row_stride` elements apart, each [heads, dim]; `out` is contiguous [rows, heads, dim];
 * rows of no request are left as they are. */
int paged_prefill_attention(const void *query, int64_t q_row_stride, const void *cache,
                            int64_t num_blocks,
                            const int64_t *queries, int64_t num_queries, const int64_t *pages,
                            int64_t num_pages, void *out, int64_t heads, int64_t kv_heads,
                            int64_t dim, int64_t block_size, int64_t window, float scale,
                            int is_bf16) {
    int failed = 0;
#pragma omp parallel
    paged_prefill_attention_team(query, q_row_stride, cache, num_blocks, queries, num_queries, pages,
                                 num_pages, out, heads, kv_heads, dim, block_size, window,
                                 scale, is_bf16, &failed);
    return failed;
}
