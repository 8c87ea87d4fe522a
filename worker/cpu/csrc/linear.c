/* Linear layers y = x W^T (+ bias) for few-row inputs (CPU: AVX-512, or AVX2 with FMA). Built
 * and loaded by worker/cpu/kernels.py; worker/cpu/linear.py lays the weights out and decides when
 * to call.
 *
 * A decode step multiplies a handful of rows (one per request) by every weight of the model, so
 * the whole model streams from memory once per step and each weight value is used only `rows`
 * times. The kernel keeps a tile of up to 28 rows x 16 output columns in 28 of the 32 registers,
 * streams the weight panel of those 16 columns once (prefetched ahead), and broadcasts the
 * inputs from a small packed copy (embedded broadcasts: no register): one pass over the weights
 * per tile of rows, every load a full cache line. More rows split evenly over the fewest tiles.
 * Each further tile is a whole pass over the panel (from cache, but not overlapped with the
 * stream from memory): with 16-row tiles, a 17th row cost +16% on a Zen 4 (a decode batch of
 * 16 verifying one draft); in one tile it costs a row's share.
 *
 * Weight layout ("panels", made by worker/linear.py): output columns in panels of 16 (the last
 * one zero-padded), each panel contiguous:
 *   float32:  [K][16]          panel element (k, c) = W[16p + c, k]
 *   bfloat16: [K2][16][2]      panel element (k2, c, i) = W[16p + c, 2 k2 + i], K2 = ceil(K/2)
 * A float32 weight whose values are exactly those of a narrower form may also have "narrow"
 * panels of that form (worker/cpu/narrow_panels.py), read instead and widened in registers to the
 * same float32 values, summed in the same order: the same outputs bit for bit from fewer bytes.
 * Their kind is given in bits: 4 (GGUF Q4_1 blocks), 8 (Q8_0 blocks), 16 (bfloat16 values).
 * bfloat16 products use the CPU's bfloat16 pair dot product (vdpbf16ps; without AVX512_BF16 the
 * pairs are widened to float32, as on AVX2 below), accumulated in float32;
 * bias is added in float32 and the result rounded to bfloat16 once, as oneDNN's bf16 GEMM does.
 *
 * With AVX2 a panel is two 8-wide registers per row, so a tile holds 6 rows (12 accumulators)
 * and more rows stream the panel once per 6 (from cache: a panel is 16 columns). AVX2 has no
 * bfloat16 arithmetic: a bfloat16 panel's pairs are widened to float32 in registers (by shifts),
 * the inputs are packed as float32 pairs, and each pair accumulates as vdpbf16ps does
 * (acc += x1 w1, then acc += x0 w0; a product of two bfloat16 is exact in float32), so the sums
 * are the AVX512_BF16 tiles' bit for bit but for subnormals (which vdpbf16ps flushes). It reads
 * half the bytes of float32 panels, which is what a decode step of few rows waits on.
 *
 * On CPUs with AMX tiles, bfloat16 inputs of AMX_MIN_ROWS rows or more multiply on the tiles
 * instead: a bfloat16 panel's [K2][16][2] layout is the tile layout of a B operand (16 pairs of
 * K per 64-byte row), so each 32-deep slice of a panel loads as one tile, and the inputs load
 * straight from their rows as the A operand (no repacking). The tiles accumulate the same
 * bfloat16 pair products in float32 (not always rounded as vdpbf16ps rounds them: hence every
 * row on the tiles where there are tiles); bias and rounding are as above. The
 * process must be granted the tile state first (`linear_enable_amx`, called at load).
 */
#define _DEFAULT_SOURCE 1 /* syscall() under -std=c11 (the AMX tile request) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "team.h"

#define PANEL 16     /* output columns per panel: one 512-bit register of float32 */
#define PREFETCH 1024 /* bytes of the weight stream fetched ahead of use */

/* REPn(F) expands to F(0) ... F(n-1): a tile's accumulators are named registers, never an
 * array (an array of vectors may be kept in memory and stored on every iteration). */
#define REP1(F) F(0)
#define REP2(F) REP1(F) F(1)
#define REP3(F) REP2(F) F(2)
#define REP4(F) REP3(F) F(3)
#define REP5(F) REP4(F) F(4)
#define REP6(F) REP5(F) F(5)
#define REP7(F) REP6(F) F(6)
#define REP8(F) REP7(F) F(7)
#define REP9(F) REP8(F) F(8)
#define REP10(F) REP9(F) F(9)
#define REP11(F) REP10(F) F(10)
#define REP12(F) REP11(F) F(11)
#define REP13(F) REP12(F) F(12)
#define REP14(F) REP13(F) F(13)
#define REP15(F) REP14(F) F(14)
#define REP16(F) REP15(F) F(15)
#define REP17(F) REP16(F) F(16)
#define REP18(F) REP17(F) F(17)
#define REP19(F) REP18(F) F(18)
#define REP20(F) REP19(F) F(19)
#define REP21(F) REP20(F) F(20)
#define REP22(F) REP21(F) F(21)
#define REP23(F) REP22(F) F(22)
#define REP24(F) REP23(F) F(23)
#define REP25(F) REP24(F) F(24)
#define REP26(F) REP25(F) F(25)
#define REP27(F) REP26(F) F(26)
#define REP28(F) REP27(F) F(27)

/* A 4-bit panel's 32-deep block (below): d[16] and m[16] float16, 16 pairs of steps' codes. */
#define Q4_DEPTH 32
#define Q4_BLOCK_BYTES (2 * 2 * PANEL + Q4_DEPTH / 2 * PANEL)
/* The lines of the 4-bit block PREFETCH bytes past `block`, asked for ahead of use. */
#define PREFETCH_Q4_BLOCK(block)                                                             \
    for (int line = 0; line < Q4_BLOCK_BYTES; line += 64)                                    \
        _mm_prefetch((const char *)(block) + PREFETCH + line, _MM_HINT_T0);
/* An 8-bit panel's 32-deep block (below): d[16] float16, then 32 steps' 16 signed codes. */
#define Q8_DEPTH 32
#define Q8_BLOCK_BYTES (2 * PANEL + Q8_DEPTH * PANEL)
#define PREFETCH_Q8_BLOCK(block)                                                             \
    for (int line = 0; line < Q8_BLOCK_BYTES; line += 64)                                    \
        _mm_prefetch((const char *)(block) + PREFETCH + line, _MM_HINT_T0);

#if defined(__AVX512F__)
#define LINEAR_SIMD 512
#define MAX_TILE 28 /* rows per tile: 28 accumulators (no spills; 30 spill in bfloat16) */
#include <immintrin.h>

#define ZERO(i) __m512 acc##i = _mm512_setzero_ps();
#define FMA_F32(i) acc##i = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), w_k, acc##i);
#define STORE_F32(i) _mm512_mask_storeu_ps(y + i * y_stride, mask, _mm512_add_ps(acc##i, b));
#define STORE_BF16(i)                                                                        \
    _mm256_mask_storeu_epi16(y + i * y_stride, mask,                                         \
                             bf16x16_round16(_mm512_add_ps(acc##i, b)));

/* One tile: ROWS rows of packed inputs (`depth` steps of ROWS 4-byte values, a float32 or a
 * pair of bfloat16) times one panel (W_STEP weight elements a step), plus bias `b`, into ROWS
 * rows of `y`. LOAD puts the step's weights in `w_k`, STEP(i) accumulates row i, STORE(i)
 * writes it. */
#define TILE(KIND, ROWS, A_T, W_T, Y_T, W_STEP, LOAD, STEP, STORE)                           \
    static void KIND##_##ROWS(const A_T *ap, const W_T *panel, int64_t depth, __m512 b,      \
                              Y_T *y, int64_t y_stride, __mmask16 mask) {                    \
        REP##ROWS(ZERO)                                                                      \
        for (int64_t d = 0; d < depth; d++) {                                                \
            const A_T *a = ap + d * ROWS;                                                    \
            const W_T *w_d = panel + d * W_STEP;                                             \
            LOAD                                                                             \
            _mm_prefetch((const char *)w_d + PREFETCH, _MM_HINT_T0);                         \
            REP##ROWS(STEP)                                                                  \
        }                                                                                    \
        REP##ROWS(STORE)                                                                     \
    }

/* KIND_1 ... KIND_28, and TABLE[rows] pointing at them. */
#define TILES(KIND, TABLE, A_T, W_T, Y_T, ...)                                               \
    TILE(KIND, 1, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 2, A_T, W_T, Y_T, __VA_ARGS__)      \
    TILE(KIND, 3, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 4, A_T, W_T, Y_T, __VA_ARGS__)      \
    TILE(KIND, 5, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 6, A_T, W_T, Y_T, __VA_ARGS__)      \
    TILE(KIND, 7, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 8, A_T, W_T, Y_T, __VA_ARGS__)      \
    TILE(KIND, 9, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 10, A_T, W_T, Y_T, __VA_ARGS__)     \
    TILE(KIND, 11, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 12, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 13, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 14, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 15, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 16, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 17, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 18, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 19, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 20, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 21, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 22, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 23, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 24, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 25, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 26, A_T, W_T, Y_T, __VA_ARGS__)    \
    TILE(KIND, 27, A_T, W_T, Y_T, __VA_ARGS__) TILE(KIND, 28, A_T, W_T, Y_T, __VA_ARGS__)    \
    static void (*const TABLE[MAX_TILE + 1])(const A_T *, const W_T *, int64_t, __m512,      \
                                             Y_T *, int64_t, __mmask16) = {                  \
        NULL, KIND##_1, KIND##_2, KIND##_3, KIND##_4, KIND##_5, KIND##_6, KIND##_7,          \
        KIND##_8, KIND##_9, KIND##_10, KIND##_11, KIND##_12, KIND##_13, KIND##_14,           \
        KIND##_15, KIND##_16, KIND##_17, KIND##_18, KIND##_19, KIND##_20, KIND##_21,         \
        KIND##_22, KIND##_23, KIND##_24, KIND##_25, KIND##_26, KIND##_27, KIND##_28};

/* float32: inputs [K][rows], panel [K][16]. */
TILES(tile_f32, TILES_F32, float, float, float, PANEL, __m512 w_k = _mm512_loadu_ps(w_d);,
      FMA_F32, STORE_F32)

/* 16-bit panels of a float32 weight whose every value is a bfloat16 (its low 16 bits zero: a
 * model or drafter saved in bfloat16 and run in float32): [K][16] upper halves, half the
 * float32 panels' bytes, widened back by a shift (exact) and summed as the float32 tiles sum. */
#define LOAD_B16                                                                             \
    __m512 w_k = _mm512_castsi512_ps(                                                        \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w_d)), 16));
TILES(tile_b16, TILES_B16, float, uint16_t, float, PANEL, LOAD_B16, FMA_F32, STORE_F32)

#if defined(__AVX512BF16__)
#define DOT_BF16(i)                                                                          \
    acc##i = _mm512_dpbf16_ps(acc##i, (__m512bh)_mm512_set1_epi32((int)a[i]), (__m512bh)w_k);

/* bfloat16: inputs [K2][rows] as bfloat16 pairs, panel [K2][16][2]. */
typedef uint32_t bf16_pair;
TILES(tile_bf16, TILES_BF16, bf16_pair, uint16_t, uint16_t, 2 * PANEL,
      __m512i w_k = _mm512_loadu_si512(w_d);, DOT_BF16, STORE_BF16)
#else
/* AVX-512 without AVX512_BF16 (Intel servers up to Ice Lake, and VMs that hide the flag): a
 * bfloat16 panel's pairs are widened to float32 in registers (by shifts) and each pair
 * accumulates as vdpbf16ps does (acc += x1 w1, then acc += x0 w0; a product of two bfloat16 is
 * exact in float32), the AVX2 body's sums on 16 lanes; the inputs are packed as float32 pairs.
 * Half the bytes of float32 panels, at float32's multiply rate. */
typedef struct {
    float even, odd;
} bf16_pair;
#define WIDEN_PAIRS_512                                                                      \
    const __m512i w_k = _mm512_loadu_si512(w_d);                                             \
    const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w_k, 16));                   \
    const __m512 w_odd =                                                                     \
        _mm512_castsi512_ps(_mm512_and_si512(w_k, _mm512_set1_epi32((int)0xffff0000u)));
#define PAIR_FMA_512(i)                                                                      \
    acc##i = _mm512_fmadd_ps(_mm512_set1_ps(a[i].odd), w_odd, acc##i);                       \
    acc##i = _mm512_fmadd_ps(_mm512_set1_ps(a[i].even), w_even, acc##i);
TILES(tile_bf16, TILES_BF16, bf16_pair, uint16_t, uint16_t, 2 * PANEL, WIDEN_PAIRS_512,
      PAIR_FMA_512, STORE_BF16)
#define PAIRS_AS_FLOAT32 1
#endif

/* 4-bit panels (float32 rows only): a float32 weight whose every 32-deep block of a column is
 * exactly d q + m (d and m float16, q integers 0..15, as a GGUF Q4_1 block dequantizes) is
 * kept as those blocks, a sixth of its float32 bytes, and each step's 16 weights are made
 * again in registers (q widened, then one fused multiply-add: d q is exact in float32, so the
 * value is the float32 weight's bit for bit). The products and their order are the float32
 * tiles', so are the sums. Layout (worker/cpu/narrow_panels.py): per panel of 16 columns, per
 * 32-deep block, Q4_BLOCK_BYTES bytes: d[16] and m[16] as float16, then 16 bytes a pair of
 * steps, byte c = q(2j, c) | q(2j + 1, c) << 4. Tiles of up to Q4_MAX_TILE rows (24
 * accumulators and the expansion's 6 registers), each expanding the panel again: with tiles of
 * 16, a 17th row (batch 16 verifying one draft) cost a second expansion, +20% of the matmuls.
 * Beyond Q4_MAX_ROWS rows the float32 panels run. SmolLM2's 120 layer matmuls on a 2-core Zen
 * 5, float32 panels against 4-bit ones (ms, 24-row tiles): 1 row 10.7 / 4.2, 8 rows 12.7 / 5.9,
 * 16 rows 14.6 / 8.9, 24 rows 18.6 / 12.9, 32 rows 22.3 / 16.6, 64 rows 36.5 / 31.8; with
 * 16-row tiles 128 rows 69.9 / 66.2, 256 rows 142 / 137: the bytes saved outweigh the
 * expansion at every size there; 64 keeps to where the gain is clear (a CPU that runs 512-bit
 * operations in two halves pays the expansion twice). */
#define Q4_MAX_TILE 24
#define Q4_MAX_ROWS 64

#define FMA_Q4_EVEN(i) acc##i = _mm512_fmadd_ps(_mm512_set1_ps(a[(2 * j) * R + i]), w0, acc##i);
#define FMA_Q4_ODD(i)                                                                        \
    acc##i = _mm512_fmadd_ps(_mm512_set1_ps(a[(2 * j + 1) * R + i]), w1, acc##i);
#define TILE_Q4(ROWS)                                                                        \
    static void tile_q4_##ROWS(const float *ap, const uint8_t *panel, int64_t blocks,        \
                               __m512 b, float *y, int64_t y_stride, __mmask16 mask) {       \
        enum { R = ROWS };                                                                   \
        REP##ROWS(ZERO)                                                                      \
        const __m512i low = _mm512_set1_epi32(15);                                           \
        for (int64_t blk = 0; blk < blocks; blk++) {                                         \
            const uint8_t *block = panel + blk * Q4_BLOCK_BYTES;                             \
            PREFETCH_Q4_BLOCK(block)                                                         \
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));    \
            const __m512 m =                                                                 \
                _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 2 * PANEL)));   \
            const uint8_t *codes = block + 4 * PANEL;                                        \
            const float *a = ap + blk * Q4_DEPTH * R;                                        \
            for (int j = 0; j < Q4_DEPTH / 2; j++) {                                         \
                const __m512i q = _mm512_cvtepu8_epi32(                                      \
                    _mm_loadu_si128((const __m128i *)(codes + j * PANEL)));                  \
                const __m512 w0 =                                                            \
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d, m);     \
                const __m512 w1 =                                                            \
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);      \
                REP##ROWS(FMA_Q4_EVEN)                                                       \
                REP##ROWS(FMA_Q4_ODD)                                                        \
            }                                                                                \
        }                                                                                    \
        REP##ROWS(STORE_F32)                                                                 \
    }
TILE_Q4(1) TILE_Q4(2) TILE_Q4(3) TILE_Q4(4) TILE_Q4(5) TILE_Q4(6) TILE_Q4(7) TILE_Q4(8)
TILE_Q4(9) TILE_Q4(10) TILE_Q4(11) TILE_Q4(12) TILE_Q4(13) TILE_Q4(14) TILE_Q4(15) TILE_Q4(16)
TILE_Q4(17) TILE_Q4(18) TILE_Q4(19) TILE_Q4(20) TILE_Q4(21) TILE_Q4(22) TILE_Q4(23)
TILE_Q4(24)
static void (*const TILES_Q4[Q4_MAX_TILE + 1])(const float *, const uint8_t *, int64_t, __m512,
                                               float *, int64_t, __mmask16) = {
    NULL,       tile_q4_1,  tile_q4_2,  tile_q4_3,  tile_q4_4,  tile_q4_5,  tile_q4_6,
    tile_q4_7,  tile_q4_8,  tile_q4_9,  tile_q4_10, tile_q4_11, tile_q4_12, tile_q4_13,
    tile_q4_14, tile_q4_15, tile_q4_16, tile_q4_17, tile_q4_18, tile_q4_19, tile_q4_20,
    tile_q4_21, tile_q4_22, tile_q4_23, tile_q4_24};
#define LINEAR_Q4 1

/* 8-bit panels (float32 rows only): a float32 weight whose every 32-deep block of a column is
 * exactly d q (d float16, q integers -128..127, as a GGUF Q8_0 block dequantizes: a tied LM
 * head or embedding, often a whole model) is kept as those blocks, 17/64 of its float32 bytes;
 * each step's 16 weights are made again with one multiply (d q is exact in float32) and summed
 * as the float32 tiles sum them, so the outputs are theirs bit for bit. Layout
 * (worker/cpu/narrow_panels.py): per panel of 16 columns, per 32-deep block, Q8_BLOCK_BYTES bytes:
 * d[16] as float16, then 32 steps of 16 codes, byte c of step j = q(j, c). Tiles and row
 * limit as the 4-bit ones (Q4_MAX_TILE, Q4_MAX_ROWS). */

#define FMA_Q8(i) acc##i = _mm512_fmadd_ps(_mm512_set1_ps(a[j * R + i]), w, acc##i);
#define TILE_Q8(ROWS)                                                                        \
    static void tile_q8_##ROWS(const float *ap, const uint8_t *panel, int64_t blocks,        \
                               __m512 b, float *y, int64_t y_stride, __mmask16 mask) {       \
        enum { R = ROWS };                                                                   \
        REP##ROWS(ZERO)                                                                      \
        for (int64_t blk = 0; blk < blocks; blk++) {                                         \
            const uint8_t *block = panel + blk * Q8_BLOCK_BYTES;                             \
            PREFETCH_Q8_BLOCK(block)                                                         \
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));    \
            const uint8_t *codes = block + 2 * PANEL;                                        \
            const float *a = ap + blk * Q8_DEPTH * R;                                        \
            for (int j = 0; j < Q8_DEPTH; j++) {                                             \
                const __m512i q = _mm512_cvtepi8_epi32(                                      \
                    _mm_loadu_si128((const __m128i *)(codes + j * PANEL)));                  \
                const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);                    \
                REP##ROWS(FMA_Q8)                                                            \
            }                                                                                \
        }                                                                                    \
        REP##ROWS(STORE_F32)                                                                 \
    }
TILE_Q8(1) TILE_Q8(2) TILE_Q8(3) TILE_Q8(4) TILE_Q8(5) TILE_Q8(6) TILE_Q8(7) TILE_Q8(8)
TILE_Q8(9) TILE_Q8(10) TILE_Q8(11) TILE_Q8(12) TILE_Q8(13) TILE_Q8(14) TILE_Q8(15) TILE_Q8(16)
TILE_Q8(17) TILE_Q8(18) TILE_Q8(19) TILE_Q8(20) TILE_Q8(21) TILE_Q8(22) TILE_Q8(23)
TILE_Q8(24)
static void (*const TILES_Q8[Q4_MAX_TILE + 1])(const float *, const uint8_t *, int64_t, __m512,
                                               float *, int64_t, __mmask16) = {
    NULL,       tile_q8_1,  tile_q8_2,  tile_q8_3,  tile_q8_4,  tile_q8_5,  tile_q8_6,
    tile_q8_7,  tile_q8_8,  tile_q8_9,  tile_q8_10, tile_q8_11, tile_q8_12, tile_q8_13,
    tile_q8_14, tile_q8_15, tile_q8_16, tile_q8_17, tile_q8_18, tile_q8_19, tile_q8_20,
    tile_q8_21, tile_q8_22, tile_q8_23, tile_q8_24};

/* The next tile's rows when `left` rows remain, tiles of at most `max_tile`: the rows split
 * evenly over the fewest tiles (25 rows as 13 and 12, not 24 and 1: a short tile is a whole
 * pass over the panel). */
static inline int64_t tile_rows_of(int64_t left, int64_t max_tile) {
    const int64_t tiles = (left + max_tile - 1) / max_tile;
    return (left + tiles - 1) / tiles;
}

static inline int64_t tile_rows(int64_t left) { return tile_rows_of(left, MAX_TILE); }

/* The next 4-bit tile's rows for an input of `rows` rows when `left` remain. */
static inline int64_t q4_tile_rows(int64_t rows, int64_t left) {
    (void)rows;
    return tile_rows_of(left, Q4_MAX_TILE);
}

static inline __mmask16 column_mask(int64_t n, int64_t p) {
    int64_t valid = n - p * PANEL;
    return valid >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
}

/* The panel's 16 bias values as float32 (zeros without bias; masked beyond n). */
static inline __m512 bias_f32(const void *bias, int64_t p, __mmask16 mask, int is_bf16) {
    if (bias == NULL) return _mm512_setzero_ps();
    if (!is_bf16) return _mm512_maskz_loadu_ps(mask, (const float *)bias + p * PANEL);
    __m256i raw = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + p * PANEL);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Panel p of y for every row: the packed inputs `packed` ([depth][tile rows] per tile). */
static void panel_rows(const void *packed, const void *panels, const void *bias, void *y,
                       int64_t rows, int64_t n, int64_t depth, int64_t p, int is_bf16) {
    const int64_t panel_elems = depth * PANEL * (is_bf16 ? 2 : 1);
    const __mmask16 mask = column_mask(n, p);
    const __m512 b = bias_f32(bias, p, mask, is_bf16);
    for (int64_t r0 = 0, tile; r0 < rows; r0 += tile) {
        tile = tile_rows(rows - r0);
        if (is_bf16) {
            TILES_BF16[tile]((const bf16_pair *)packed + r0 * depth,
                             (const uint16_t *)panels + p * panel_elems, depth, b,
                             (uint16_t *)y + r0 * n + p * PANEL, n, mask);
        } else {
            TILES_F32[tile]((const float *)packed + r0 * depth,
                            (const float *)panels + p * panel_elems, depth, b,
                            (float *)y + r0 * n + p * PANEL, n, mask);
        }
    }
}

/* Panel p of y for every row from 4-bit or 8-bit panels (`bits`; depth k a multiple of
 * Q4_DEPTH): the packed inputs as for float32, in tiles of up to Q4_MAX_TILE rows. */
static void block_rows(const float *packed, const uint8_t *blocks, int bits, const void *bias,
                       float *y, int64_t rows, int64_t n, int64_t k, int64_t p) {
    const int64_t depth = k / Q4_DEPTH;
    const uint8_t *panel = blocks + p * depth * (bits == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES);
    const __mmask16 mask = column_mask(n, p);
    const __m512 b = bias_f32(bias, p, mask, 0);
    for (int64_t r0 = 0, tile; r0 < rows; r0 += tile) {
        tile = q4_tile_rows(rows, rows - r0);
        (bits == 4 ? TILES_Q4 : TILES_Q8)[tile](packed + r0 * k, panel, depth, b,
                                                y + r0 * n + p * PANEL, n, mask);
    }
}

/* Panel p of y for every row from 16-bit panels (`b16`), in the float32 tiles. */
static void b16_rows(const float *packed, const uint16_t *b16, const void *bias, float *y,
                     int64_t rows, int64_t n, int64_t k, int64_t p) {
    const __mmask16 mask = column_mask(n, p);
    const __m512 b = bias_f32(bias, p, mask, 0);
    for (int64_t r0 = 0, tile; r0 < rows; r0 += tile) {
        tile = tile_rows(rows - r0);
        TILES_B16[tile](packed + r0 * k, b16 + p * k * PANEL, k, b, y + r0 * n + p * PANEL, n,
                        mask);
    }
}

#if defined(SPECSERVE_AMX)
#define LINEAR_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* From this many rows on, bfloat16 panels multiply on AMX tiles: every row, since the tiles'
 * float32 sums are not always vdpbf16ps's bit for bit (one output of 7,000 a bfloat16 ulp apart
 * on an Emerald Rapids VM), and a row's result must not depend on the rows beside it. One row
 * on the tiles is also the faster there: SmolLM2's matmuls 10.4-10.7 ms a pass at 1-3 rows
 * against 12.5-16.2 on the AVX512_BF16 panels (`bench/linear.py`). */
#define AMX_MIN_ROWS 1
#define AMX_DEPTH 16 /* bfloat16 pairs per tile row: a 32-deep slice of K */

static int amx_granted = 0;

/* Tiles: 0 the inputs of 16 rows, 1 those of a last, shorter row tile, 2-3 two panels' slices,
 * 4-5 the two panels' sums for 16 rows, 6-7 those for the shorter tile. */
static void amx_configure(int64_t tail_rows) {
    const uint8_t tail = (uint8_t)(tail_rows ? tail_rows : 16);
    const uint8_t rows[8] = {16, tail, AMX_DEPTH, AMX_DEPTH, 16, 16, tail, tail};
    amx_configure_rows(rows);
}

/* Sums (float32, `sums` rows 16 floats apart) + bias, rounded, into `m` rows of y. */
static inline void amx_store(const float *sums, __m512 b, uint16_t *y, int64_t y_stride,
                             int64_t m, __mmask16 mask) {
    for (int64_t i = 0; i < m; i++)
        _mm256_mask_storeu_epi16(y + i * y_stride, mask,
                                 bf16x16_round16(_mm512_add_ps(_mm512_loadu_ps(sums + i * 16), b)));
}

/* One row tile (A: inputs tile, C0/C1: sums tiles) times panels w0 (and w1 when `two`). */
#define AMX_ROW_TILE(A, C0, C1)                                                              \
    do {                                                                                     \
        _tile_zero(C0);                                                                      \
        if (two) _tile_zero(C1);                                                             \
        for (int64_t s = 0; s < depth / AMX_DEPTH; s++) {                                    \
            _tile_loadd(A, xa + s * 2 * AMX_DEPTH, x_stride * 2);                            \
            _tile_loadd(2, w0 + s * AMX_DEPTH * 2 * PANEL, 4 * PANEL);                       \
            _tile_dpbf16ps(C0, A, 2);                                                        \
            if (two) {                                                                       \
                _tile_loadd(3, w1 + s * AMX_DEPTH * 2 * PANEL, 4 * PANEL);                   \
                _tile_dpbf16ps(C1, A, 3);                                                    \
            }                                                                                \
        }                                                                                    \
        _tile_stored(C0, sums, 64);                                                          \
        if (two) _tile_stored(C1, sums + 256, 64);                                           \
    } while (0)

/* Panels p (and p + 1 where there is one) of y for every row, on the tiles. */
static void amx_panel_pair(const uint16_t *x, int64_t x_stride, const uint16_t *panels,
                           const void *bias, uint16_t *y, int64_t rows, int64_t n, int64_t depth,
                           int64_t p) {
    const int64_t panel_elems = depth * PANEL * 2, num_panels = (n + PANEL - 1) / PANEL;
    const int two = p + 1 < num_panels;
    const uint16_t *w0 = panels + p * panel_elems, *w1 = w0 + panel_elems;
    const __mmask16 mask0 = column_mask(n, p), mask1 = two ? column_mask(n, p + 1) : 0;
    const __m512 b0 = bias_f32(bias, p, mask0, 1), b1 = two ? bias_f32(bias, p + 1, mask1, 1) : b0;
    float sums[2 * 16 * 16];
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t m = rows - r0 < 16 ? rows - r0 : 16;
        const uint16_t *xa = x + r0 * x_stride;
        if (m == 16)
            AMX_ROW_TILE(0, 4, 5);
        else
            AMX_ROW_TILE(1, 6, 7);
        uint16_t *yr = y + r0 * n + p * PANEL;
        amx_store(sums, b0, yr, n, m, mask0);
        if (two) amx_store(sums + 256, b1, yr + PANEL, n, m, mask1);
    }
}

/* Whether this call runs on the tiles: bfloat16, enough rows, K whole 32-deep slices. */
static inline int amx_runs(int64_t rows, int64_t k, int is_bf16) {
    return amx_granted && is_bf16 && rows >= AMX_MIN_ROWS && k % (2 * AMX_DEPTH) == 0;
}
#endif /* AMX */
#elif defined(__AVX2__) && defined(__FMA__)
#define LINEAR_SIMD 256
#define MAX_TILE 6 /* rows per tile: 12 accumulators, two weight vectors and a broadcast */
#include <immintrin.h>

#define ZERO_2(i) __m256 lo##i = _mm256_setzero_ps(), hi##i = lo##i;
#define FMA_2(i)                                                                             \
    {                                                                                        \
        const __m256 a_i = _mm256_broadcast_ss(a + i);                                       \
        lo##i = _mm256_fmadd_ps(a_i, w_lo, lo##i), hi##i = _mm256_fmadd_ps(a_i, w_hi, hi##i); \
    }
#define STORE_2(i)                                                                           \
    _mm256_maskstore_ps(y + i * y_stride, mask_lo, _mm256_add_ps(lo##i, b_lo));              \
    _mm256_maskstore_ps(y + i * y_stride + 8, mask_hi, _mm256_add_ps(hi##i, b_hi));

/* One tile: ROWS rows of packed float32 inputs ([depth][ROWS]) times one panel ([depth][16]
 * of W_T, which WIDEN(at) makes 8 float32 weights of), plus bias, into ROWS rows of `y` (the
 * panel's valid columns only). */
#define TILE_2(KIND, ROWS, W_T, WIDEN)                                                       \
    static void KIND##_##ROWS(const float *ap, const W_T *panel, int64_t depth, __m256 b_lo, \
                              __m256 b_hi, float *y, int64_t y_stride, __m256i mask_lo,      \
                              __m256i mask_hi) {                                             \
        REP##ROWS(ZERO_2)                                                                    \
        for (int64_t d = 0; d < depth; d++) {                                                \
            const float *a = ap + d * ROWS;                                                  \
            const W_T *w_d = panel + d * PANEL;                                              \
            const __m256 w_lo = WIDEN(w_d), w_hi = WIDEN(w_d + 8);                           \
            _mm_prefetch((const char *)w_d + PREFETCH, _MM_HINT_T0);                         \
            REP##ROWS(FMA_2)                                                                 \
        }                                                                                    \
        REP##ROWS(STORE_2)                                                                   \
    }
#define TILES_2(KIND, TABLE, W_T, WIDEN)                                                     \
    TILE_2(KIND, 1, W_T, WIDEN) TILE_2(KIND, 2, W_T, WIDEN) TILE_2(KIND, 3, W_T, WIDEN)      \
    TILE_2(KIND, 4, W_T, WIDEN) TILE_2(KIND, 5, W_T, WIDEN) TILE_2(KIND, 6, W_T, WIDEN)      \
    static void (*const TABLE[MAX_TILE + 1])(const float *, const W_T *, int64_t, __m256,    \
                                             __m256, float *, int64_t, __m256i, __m256i) = { \
        NULL, KIND##_1, KIND##_2, KIND##_3, KIND##_4, KIND##_5, KIND##_6};
#define LOAD8_F32(at) _mm256_loadu_ps(at)
/* 8 bfloat16 values widened to float32 (a shift: exact). */
#define WIDEN8_B16(at)                                                                       \
    _mm256_castsi256_ps(                                                                     \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(at))), 16))
TILES_2(tile_f32, TILES_F32, float, LOAD8_F32)
/* 16-bit panels (the AVX-512 body's layout and sums): in the float32 tiles. */
TILES_2(tile_b16, TILES_B16, uint16_t, WIDEN8_B16)

/* bfloat16: inputs [K2][ROWS][2] as float32 pairs, panel [K2][16][2], 8 columns at a time. */
#define PAIR_FMA(acc, i)                                                                     \
    acc##i = _mm256_fmadd_ps(_mm256_broadcast_ss(a + 2 * i + 1), w_odd, acc##i);            \
    acc##i = _mm256_fmadd_ps(_mm256_broadcast_ss(a + 2 * i), w_even, acc##i);
#define PAIR_LO(i) PAIR_FMA(lo, i)
#define PAIR_HI(i) PAIR_FMA(hi, i)
#define WIDEN_PAIRS(half)                                                                    \
    const __m256i w_##half = _mm256_loadu_si256((const __m256i *)w_d + HALF_##half);         \
    w_even = _mm256_castsi256_ps(_mm256_slli_epi32(w_##half, 16));                           \
    w_odd = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(w_##half, 16), 16));
#define HALF_lo 0
#define HALF_hi 1
#define STORE_BF16_2(i) store_bf16_row(y + i * y_stride, _mm256_add_ps(lo##i, b_lo),          \
                                       _mm256_add_ps(hi##i, b_hi), valid);

/* The 16 columns of one row rounded to bfloat16; the first `valid` of them stored. */
static inline void store_bf16_row(uint16_t *y, __m256 lo, __m256 hi, int64_t valid) {
    const __m256i rounded = bf16x8x2_round16(lo, hi);
    if (valid >= PANEL) {
        _mm256_storeu_si256((__m256i *)y, rounded);
    } else {
        uint16_t row[PANEL];
        _mm256_storeu_si256((__m256i *)row, rounded);
        memcpy(y, row, (size_t)valid * sizeof *y);
    }
}

/* ROWS rows (of a tile of STRIDE rows, ROWS <= 3: more would spill the accumulators) times one
 * panel into the float32 sums lo0.., hi0.. of the caller. */
#define PASS_BF16_2(ROWS, STRIDE, FIRST)                                                     \
    for (int64_t d = 0; d < depth; d++) {                                                    \
        const float *a = ap + (d * STRIDE + FIRST) * 2;                                      \
        const uint16_t *w_d = panel + d * 2 * PANEL;                                         \
        _mm_prefetch((const char *)w_d + PREFETCH, _MM_HINT_T0);                             \
        __m256 w_even, w_odd;                                                                \
        {                                                                                    \
            WIDEN_PAIRS(lo)                                                                  \
            REP##ROWS(PAIR_LO)                                                               \
        }                                                                                    \
        {                                                                                    \
            WIDEN_PAIRS(hi)                                                                  \
            REP##ROWS(PAIR_HI)                                                               \
        }                                                                                    \
    }

#define TILE_BF16_HEAD(ROWS)                                                                 \
    static void tile_bf16_##ROWS(const float *ap, const uint16_t *panel, int64_t depth,      \
                                 __m256 b_lo, __m256 b_hi, uint16_t *y, int64_t y_stride,    \
                                 int64_t valid)
/* One tile of up to 3 rows: one pass over the panel. */
#define TILE_BF16_2(ROWS)                                                                    \
    TILE_BF16_HEAD(ROWS) {                                                                   \
        REP##ROWS(ZERO_2)                                                                    \
        PASS_BF16_2(ROWS, ROWS, 0)                                                           \
        REP##ROWS(STORE_BF16_2)                                                              \
    }
/* 4-6 rows: the first 3, then the rest, in two passes over the panel (the second from cache). */
#define TILE_BF16_SPLIT(ROWS, REST)                                                          \
    TILE_BF16_HEAD(ROWS) {                                                                   \
        {                                                                                    \
            REP3(ZERO_2)                                                                     \
            PASS_BF16_2(3, ROWS, 0)                                                          \
            REP3(STORE_BF16_2)                                                               \
        }                                                                                    \
        y += 3 * y_stride;                                                                   \
        REP##REST(ZERO_2)                                                                    \
        PASS_BF16_2(REST, ROWS, 3)                                                           \
        REP##REST(STORE_BF16_2)                                                              \
    }
TILE_BF16_2(1) TILE_BF16_2(2) TILE_BF16_2(3)
TILE_BF16_SPLIT(4, 1) TILE_BF16_SPLIT(5, 2) TILE_BF16_SPLIT(6, 3)
static void (*const TILES_BF16[MAX_TILE + 1])(const float *, const uint16_t *, int64_t, __m256,
                                              __m256, uint16_t *, int64_t, int64_t) = {
    NULL, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4, tile_bf16_5, tile_bf16_6};

#if defined(__F16C__)
/* 4-bit panels (the layout and the sums of the AVX-512 body above, bit for bit). AVX2 has 16
 * registers, and each column's sum is one chain of fused multiply-adds (4 cycles each), so the
 * tiles come in two kinds. Up to Q4_WHOLE_ROWS rows: one tile over the whole panel, two
 * accumulators a row (a 1-row tile runs two chains; from 2 rows the expansion's d and m per
 * half no longer all fit beside the accumulators and are reloaded from the stack, which costs
 * less than a second pass). More rows: tiles of up to Q4_MAX_TILE rows over each half of the
 * panel in turn (the second half from cache), one accumulator a row, so each expansion feeds
 * more rows (6-8 rows spill a few registers too). Beyond Q4_MAX_ROWS the float32 panels
 * run. SmolLM2's 120 layer matmuls on a 2-core Zen 3, float32 panels against 4-bit ones (ms):
 * 1 row 26.1 / 8.3, 4 rows 27.4 / 10.5, 8 rows 41.8 / 20.1, 16 rows 52.4 / 44.2, 24 rows 61.7
 * / 71.4, 48 rows 85.1 / 97.6: beyond 16 rows the expansion outweighs the bytes saved. */
#define Q4_WHOLE_ROWS 4
#define Q4_MAX_TILE 8
#define Q4_MAX_ROWS 16

#define Q4_WHOLE_FMA(i, STEP)                                                                \
    {                                                                                        \
        const __m256 a_i = _mm256_broadcast_ss(a + (STEP) * R + i);                          \
        lo##i = _mm256_fmadd_ps(a_i, w_lo, lo##i), hi##i = _mm256_fmadd_ps(a_i, w_hi, hi##i); \
    }
#define Q4_WHOLE_EVEN(i) Q4_WHOLE_FMA(i, 2 * j)
#define Q4_WHOLE_ODD(i) Q4_WHOLE_FMA(i, 2 * j + 1)
/* Step 2j's (EXPAND: the codes' low nibbles) or 2j + 1's (high) 16 weights, as two halves. */
#define Q4_WEIGHTS(EXPAND)                                                                   \
    const __m256 w_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(EXPAND(q_lo)), d_lo, m_lo);       \
    const __m256 w_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(EXPAND(q_hi)), d_hi, m_hi);
#define LOW_NIBBLES(q) _mm256_and_si256(q, low)
#define HIGH_NIBBLES(q) _mm256_srli_epi32(q, 4)
/* The float16 values at `at` (8 of them) as float32. */
#define HALF8(at) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at)))
/* The codes at `at` (8 bytes) as 32-bit lanes. */
#define CODES8(at) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(at)))

#define TILE_Q4_WHOLE(ROWS)                                                                  \
    static void tile_q4_whole_##ROWS(const float *ap, const uint8_t *panel, int64_t blocks,  \
                                     __m256 b_lo, __m256 b_hi, float *y, int64_t y_stride,  \
                                     __m256i mask_lo, __m256i mask_hi) {                     \
        enum { R = ROWS };                                                                   \
        REP##ROWS(ZERO_2)                                                                    \
        const __m256i low = _mm256_set1_epi32(15);                                           \
        for (int64_t blk = 0; blk < blocks; blk++) {                                         \
            const uint8_t *block = panel + blk * Q4_BLOCK_BYTES;                             \
            PREFETCH_Q4_BLOCK(block)                                                         \
            const __m256 d_lo = HALF8(block), d_hi = HALF8(block + 16);                      \
            const __m256 m_lo = HALF8(block + 2 * PANEL), m_hi = HALF8(block + 2 * PANEL + 16); \
            const uint8_t *codes = block + 4 * PANEL;                                        \
            const float *a = ap + blk * Q4_DEPTH * R;                                        \
            for (int j = 0; j < Q4_DEPTH / 2; j++) {                                         \
                const __m256i q_lo = CODES8(codes + j * PANEL);                              \
                const __m256i q_hi = CODES8(codes + j * PANEL + 8);                          \
                {                                                                            \
                    Q4_WEIGHTS(LOW_NIBBLES)                                                  \
                    REP##ROWS(Q4_WHOLE_EVEN)                                                 \
                }                                                                            \
                {                                                                            \
                    Q4_WEIGHTS(HIGH_NIBBLES)                                                 \
                    REP##ROWS(Q4_WHOLE_ODD)                                                  \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        REP##ROWS(STORE_2)                                                                   \
    }
TILE_Q4_WHOLE(1) TILE_Q4_WHOLE(2) TILE_Q4_WHOLE(3) TILE_Q4_WHOLE(4)
static void (*const TILES_Q4_WHOLE[Q4_WHOLE_ROWS + 1])(const float *, const uint8_t *, int64_t,
                                                       __m256, __m256, float *, int64_t,
                                                       __m256i, __m256i) = {
    NULL, tile_q4_whole_1, tile_q4_whole_2, tile_q4_whole_3, tile_q4_whole_4};

#define ZERO_1(i) __m256 acc##i = _mm256_setzero_ps();
#define Q4_HALF_EVEN(i) acc##i = _mm256_fmadd_ps(_mm256_broadcast_ss(a + 2 * j * R + i), w0, acc##i);
#define Q4_HALF_ODD(i)                                                                       \
    acc##i = _mm256_fmadd_ps(_mm256_broadcast_ss(a + (2 * j + 1) * R + i), w1, acc##i);
#define STORE_HALF(i) _mm256_maskstore_ps(y + i * y_stride, mask, _mm256_add_ps(acc##i, b));

/* One tile over half `half` of a panel (its columns 8 half .. 8 half + 7). */
#define TILE_Q4_HALF(ROWS)                                                                   \
    static void tile_q4_half_##ROWS(const float *ap, const uint8_t *panel, int64_t blocks,   \
                                    int half, __m256 b, float *y, int64_t y_stride,          \
                                    __m256i mask) {                                          \
        enum { R = ROWS };                                                                   \
        REP##ROWS(ZERO_1)                                                                    \
        const __m256i low = _mm256_set1_epi32(15);                                           \
        for (int64_t blk = 0; blk < blocks; blk++) {                                         \
            const uint8_t *block = panel + blk * Q4_BLOCK_BYTES;                             \
            if (half == 0) /* the second half reads the block from cache */                  \
                PREFETCH_Q4_BLOCK(block)                                                     \
            const __m256 d = HALF8(block + 16 * half), m = HALF8(block + 2 * PANEL + 16 * half); \
            const uint8_t *codes = block + 4 * PANEL + 8 * half;                             \
            const float *a = ap + blk * Q4_DEPTH * R;                                        \
            for (int j = 0; j < Q4_DEPTH / 2; j++) {                                         \
                const __m256i q = CODES8(codes + j * PANEL);                                 \
                const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(LOW_NIBBLES(q)), d, m); \
                REP##ROWS(Q4_HALF_EVEN)                                                      \
                const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(HIGH_NIBBLES(q)), d, m); \
                REP##ROWS(Q4_HALF_ODD)                                                       \
            }                                                                                \
        }                                                                                    \
        REP##ROWS(STORE_HALF)                                                                \
    }
TILE_Q4_HALF(1) TILE_Q4_HALF(2) TILE_Q4_HALF(3) TILE_Q4_HALF(4) TILE_Q4_HALF(5) TILE_Q4_HALF(6)
TILE_Q4_HALF(7) TILE_Q4_HALF(8)
static void (*const TILES_Q4_HALF[Q4_MAX_TILE + 1])(const float *, const uint8_t *, int64_t,
                                                    int, __m256, float *, int64_t, __m256i) = {
    NULL,          tile_q4_half_1, tile_q4_half_2, tile_q4_half_3, tile_q4_half_4,
    tile_q4_half_5, tile_q4_half_6, tile_q4_half_7, tile_q4_half_8};

/* 8-bit panels (the AVX-512 body's layout and sums, bit for bit), in the 4-bit tiles' kinds:
 * whole tiles up to Q4_WHOLE_ROWS rows, else half tiles of up to Q4_MAX_TILE rows. */
#define SIGNED_CODES8(at) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(at)))
#define Q8_WHOLE_STEP(i) Q4_WHOLE_FMA(i, j)
#define TILE_Q8_WHOLE(ROWS)                                                                  \
    static void tile_q8_whole_##ROWS(const float *ap, const uint8_t *panel, int64_t blocks,  \
                                     __m256 b_lo, __m256 b_hi, float *y, int64_t y_stride,  \
                                     __m256i mask_lo, __m256i mask_hi) {                     \
        enum { R = ROWS };                                                                   \
        REP##ROWS(ZERO_2)                                                                    \
        for (int64_t blk = 0; blk < blocks; blk++) {                                         \
            const uint8_t *block = panel + blk * Q8_BLOCK_BYTES;                             \
            PREFETCH_Q8_BLOCK(block)                                                         \
            const __m256 d_lo = HALF8(block), d_hi = HALF8(block + 16);                      \
            const uint8_t *codes = block + 2 * PANEL;                                        \
            const float *a = ap + blk * Q8_DEPTH * R;                                        \
            for (int j = 0; j < Q8_DEPTH; j++) {                                             \
                const __m256 w_lo =                                                          \
                    _mm256_mul_ps(_mm256_cvtepi32_ps(SIGNED_CODES8(codes + j * PANEL)), d_lo); \
                const __m256 w_hi = _mm256_mul_ps(                                           \
                    _mm256_cvtepi32_ps(SIGNED_CODES8(codes + j * PANEL + 8)), d_hi);         \
                REP##ROWS(Q8_WHOLE_STEP)                                                     \
            }                                                                                \
        }                                                                                    \
        REP##ROWS(STORE_2)                                                                   \
    }
TILE_Q8_WHOLE(1) TILE_Q8_WHOLE(2) TILE_Q8_WHOLE(3) TILE_Q8_WHOLE(4)
static void (*const TILES_Q8_WHOLE[Q4_WHOLE_ROWS + 1])(const float *, const uint8_t *, int64_t,
                                                       __m256, __m256, float *, int64_t,
                                                       __m256i, __m256i) = {
    NULL, tile_q8_whole_1, tile_q8_whole_2, tile_q8_whole_3, tile_q8_whole_4};

#define Q8_HALF_STEP(i) acc##i = _mm256_fmadd_ps(_mm256_broadcast_ss(a + j * R + i), w, acc##i);
#define TILE_Q8_HALF(ROWS)                                                                   \
    static void tile_q8_half_##ROWS(const float *ap, const uint8_t *panel, int64_t blocks,   \
                                    int half, __m256 b, float *y, int64_t y_stride,          \
                                    __m256i mask) {                                          \
        enum { R = ROWS };                                                                   \
        REP##ROWS(ZERO_1)                                                                    \
        for (int64_t blk = 0; blk < blocks; blk++) {                                         \
            const uint8_t *block = panel + blk * Q8_BLOCK_BYTES;                             \
            if (half == 0) /* the second half reads the block from cache */                  \
                PREFETCH_Q8_BLOCK(block)                                                     \
            const __m256 d = HALF8(block + 16 * half);                                       \
            const uint8_t *codes = block + 2 * PANEL + 8 * half;                             \
            const float *a = ap + blk * Q8_DEPTH * R;                                        \
            for (int j = 0; j < Q8_DEPTH; j++) {                                             \
                const __m256 w =                                                             \
                    _mm256_mul_ps(_mm256_cvtepi32_ps(SIGNED_CODES8(codes + j * PANEL)), d);  \
                REP##ROWS(Q8_HALF_STEP)                                                      \
            }                                                                                \
        }                                                                                    \
        REP##ROWS(STORE_HALF)                                                                \
    }
TILE_Q8_HALF(1) TILE_Q8_HALF(2) TILE_Q8_HALF(3) TILE_Q8_HALF(4) TILE_Q8_HALF(5) TILE_Q8_HALF(6)
TILE_Q8_HALF(7) TILE_Q8_HALF(8)
static void (*const TILES_Q8_HALF[Q4_MAX_TILE + 1])(const float *, const uint8_t *, int64_t,
                                                    int, __m256, float *, int64_t, __m256i) = {
    NULL,          tile_q8_half_1, tile_q8_half_2, tile_q8_half_3, tile_q8_half_4,
    tile_q8_half_5, tile_q8_half_6, tile_q8_half_7, tile_q8_half_8};

/* The next 4-bit (or 8-bit) tile's rows for an input of `rows` rows when `left` remain: all
 * of them up to Q4_WHOLE_ROWS (one whole tile), else split evenly over the fewest half tiles. */
static inline int64_t q4_tile_rows(int64_t rows, int64_t left) {
    if (rows <= Q4_WHOLE_ROWS) return left;
    const int64_t tiles = (left + Q4_MAX_TILE - 1) / Q4_MAX_TILE;
    return (left + tiles - 1) / tiles;
}
#define LINEAR_Q4 1
#endif

static inline int64_t tile_rows_of(int64_t left, int64_t max_tile) {
    return left < max_tile ? left : max_tile;
}

static inline int64_t tile_rows(int64_t left) { return tile_rows_of(left, MAX_TILE); }

/* All-ones in the lanes below `valid` (of 8). */
static inline __m256i lanes_below(int64_t valid) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid < 0 ? 0 : valid > 8 ? 8 : valid)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The panel's bias values in columns 0-7 (`lo`) and 8-15 (`hi`) as float32, zeros beyond n. */
static void bias_f32(const void *bias, int64_t p, int64_t valid, int is_bf16, __m256 *lo,
                     __m256 *hi) {
    float values[PANEL] = {0};
    for (int64_t c = 0; bias != NULL && c < valid && c < PANEL; c++)
        values[c] = is_bf16 ? bf16_load((const uint16_t *)bias, p * PANEL + c)
                            : ((const float *)bias)[p * PANEL + c];
    *lo = _mm256_loadu_ps(values), *hi = _mm256_loadu_ps(values + 8);
}

/* Panel p of y for every row. */
static void panel_rows(const void *packed, const void *panels, const void *bias, void *y,
                       int64_t rows, int64_t n, int64_t depth, int64_t p, int is_bf16) {
    const int64_t valid = n - p * PANEL;
    const __m256i mask_lo = lanes_below(valid), mask_hi = lanes_below(valid - 8);
    __m256 b_lo, b_hi;
    bias_f32(bias, p, valid, is_bf16, &b_lo, &b_hi);
    for (int64_t r0 = 0, tile; r0 < rows; r0 += tile) {
        tile = tile_rows(rows - r0);
        if (is_bf16)
            TILES_BF16[tile]((const float *)packed + 2 * r0 * depth,
                             (const uint16_t *)panels + 2 * p * depth * PANEL, depth, b_lo,
                             b_hi, (uint16_t *)y + r0 * n + p * PANEL, n, valid);
        else
            TILES_F32[tile]((const float *)packed + r0 * depth,
                            (const float *)panels + p * depth * PANEL, depth, b_lo, b_hi,
                            (float *)y + r0 * n + p * PANEL, n, mask_lo, mask_hi);
    }
}

/* Panel p of y for every row from 16-bit panels (`b16`). */
static void b16_rows(const float *packed, const uint16_t *b16, const void *bias, float *y,
                     int64_t rows, int64_t n, int64_t k, int64_t p) {
    const int64_t valid = n - p * PANEL;
    const __m256i mask_lo = lanes_below(valid), mask_hi = lanes_below(valid - 8);
    __m256 b_lo, b_hi;
    bias_f32(bias, p, valid, 0, &b_lo, &b_hi);
    for (int64_t r0 = 0, tile; r0 < rows; r0 += tile) {
        tile = tile_rows(rows - r0);
        TILES_B16[tile](packed + r0 * k, b16 + p * k * PANEL, k, b_lo, b_hi,
                        y + r0 * n + p * PANEL, n, mask_lo, mask_hi);
    }
}
#if defined(LINEAR_Q4)
/* Panel p of y for every row from 4-bit or 8-bit panels (`bits`): whole tiles, or each tile in
 * its two halves. */
static void block_rows(const float *packed, const uint8_t *blocks, int bits, const void *bias,
                       float *y, int64_t rows, int64_t n, int64_t k, int64_t p) {
    const int64_t depth = k / Q4_DEPTH, valid = n - p * PANEL;
    const uint8_t *panel = blocks + p * depth * (bits == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES);
    const __m256i masks[2] = {lanes_below(valid), lanes_below(valid - 8)};
    __m256 b[2];
    bias_f32(bias, p, valid, 0, &b[0], &b[1]);
    for (int64_t r0 = 0, tile; r0 < rows; r0 += tile) {
        tile = q4_tile_rows(rows, rows - r0);
        float *y_tile = y + r0 * n + p * PANEL;
        if (rows <= Q4_WHOLE_ROWS) {
            (bits == 4 ? TILES_Q4_WHOLE : TILES_Q8_WHOLE)[tile](
                packed + r0 * k, panel, depth, b[0], b[1], y_tile, n, masks[0], masks[1]);
            continue;
        }
        for (int half = 0; half < 2 && 8 * half < valid; half++)
            (bits == 4 ? TILES_Q4_HALF : TILES_Q8_HALF)[tile](
                packed + r0 * k, panel, depth, half, b[half], y_tile + 8 * half, n, masks[half]);
    }
}
#endif
#define PAIRS_AS_FLOAT32 1 /* bfloat16 inputs are packed as float32 pairs */
#endif /* SIMD */

#ifndef PAIRS_AS_FLOAT32
#define PAIRS_AS_FLOAT32 0
#endif

#if defined(LINEAR_SIMD)
#if !defined(LINEAR_Q4)
/* No block panels (AVX2 without F16C): the packing's tiles are the float32 ones. */
static inline int64_t q4_tile_rows(int64_t rows, int64_t left) {
    (void)rows;
    return tile_rows(left);
}
#endif

/* The kind of narrow panels (in bits) a call runs on, 0 for none: float32 rows, panels of a kind
 * this build has, and for blocks few rows and K whole blocks. */
static inline int narrow_runs(int bits, int64_t rows, int64_t k, int is_bf16) {
    if (is_bf16) return 0;
    if (bits == 16) return 16;
#if defined(LINEAR_Q4)
    if ((bits == 4 || bits == 8) && rows <= Q4_MAX_ROWS && k % Q4_DEPTH == 0) return bits;
#else
    (void)rows, (void)k;
#endif
    return 0;
}

/* The next tile's rows on panels of kind `bits` (0: float32 or bfloat16). */
static inline int64_t kind_tile_rows(int bits, int64_t rows, int64_t left) {
    return bits == 4 || bits == 8 ? q4_tile_rows(rows, left) : tile_rows(left);
}
#endif

/* Bit 0: float32 is supported (AVX-512, or AVX2 with FMA); bit 1: bfloat16 (AVX512_BF16, or
 * AVX-512 or AVX2 with FMA widening it to float32). */
int linear_kernel_dtypes(void) {
#if defined(LINEAR_SIMD)
    return 1 | 2;
#else
    return 0;
#endif
}

/* The panel kernel's vector width in bits (512: AVX-512, 256: AVX2); 0 without it. */
int linear_vector_bits(void) {
#if defined(LINEAR_SIMD)
    return LINEAR_SIMD;
#else
    return 0;
#endif
}

/* Ask the kernel for the AMX tile state (once per process; Linux grants it on request). Returns
 * 1 when bfloat16 panels will use the tiles, 0 where the CPU, the build or the kernel has none. */
int linear_enable_amx(void) {
#if defined(LINEAR_AMX)
    if (!amx_granted)
        amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                              18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_granted;
#else
    return 0;
#endif
}

/* The fewest rows of a bfloat16 input that run on the tiles; 0 when none do. */
int64_t linear_amx_min_rows(void) {
#if defined(LINEAR_AMX)
    return amx_granted ? AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

/* 1 where bfloat16 panels are widened to float32 (AVX2, AVX-512 without AVX512_BF16: float32's
 * multiply rate, half its bytes). */
int linear_widens_bf16(void) { return PAIRS_AS_FLOAT32; }

/* The row tiles an input of `rows` rows by `k` makes (`bits`: of a weight with narrow panels of
 * that kind, 0 without): each is a pass over every panel, which a step pays beyond its rows'
 * arithmetic (the first from memory, the rest from cache but not overlapped with the stream; a
 * block pass also expands the panel again); 0 without the kernel. */
int64_t linear_row_tiles(int64_t rows, int64_t k, int is_bf16, int bits) {
#if defined(LINEAR_SIMD)
#if defined(LINEAR_AMX)
    if (amx_runs(rows, k, is_bf16)) return (rows + 15) / 16;
#endif
    const int kind = narrow_runs(bits, rows, k, is_bf16);
    int64_t tiles = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += kind_tile_rows(kind, rows, rows - r0)) tiles++;
    return tiles;
#else
    (void)rows, (void)k, (void)is_bf16, (void)bits;
    return 0;
#endif
}

/* Column `column` of float32 panels of depth k times one row x: the float32 tiles' sum for that
 * column bit for bit (one fused multiply-add a step, k in order, from zero), plus the tiles'
 * zero bias. Scalar intrinsics, so that no compiler reorders the sum. */
float panel_column_f32(const float *x, const float *panels, int64_t k, int64_t column) {
#if defined(LINEAR_SIMD)
    const float *panel = panels + column / PANEL * k * PANEL;
    const int64_t c = column % PANEL, depth = k;
    __m128 acc = _mm_setzero_ps();
    for (int64_t d = 0; d < depth; d++)
        acc = _mm_fmadd_ss(_mm_set_ss(x[d]), _mm_set_ss(panel[d * PANEL + c]), acc);
    return _mm_cvtss_f32(_mm_add_ss(acc, _mm_setzero_ps()));
#else
    (void)x, (void)panels, (void)k, (void)column;
    return 0.0f; /* no float32 panels without SIMD (linear_kernel_dtypes) */
#endif
}

int64_t linear_packed_bytes(int64_t rows, int64_t k, int is_bf16) {
    return rows * (is_bf16 ? (k + 1) / 2 * (PAIRS_AS_FLOAT32 ? 2 : 1) : k) * 4;
}

/* y[rows, n] (row stride n) = x[rows, k] (row stride x_stride) W^T + bias, W as panels; the
 * threads of the calling team first repack the inputs into `packed` (tile by tile,
 * [depth][tile rows]: each step of the inner loop then reads one contiguous run of 4-byte
 * values, a float32 or a pair of bfloat16, to broadcast), then split the panels. */
void panel_linear_team(const void *x, int64_t x_stride, const void *panels, const void *narrow,
                       int bits, const void *bias, void *y, int64_t rows, int64_t n, int64_t k,
                       int is_bf16, void *packed) {
#if defined(LINEAR_SIMD)
    const int64_t depth = is_bf16 ? (k + 1) / 2 : k; /* K, or K2 bfloat16 pairs */
    const int kind = narrow == NULL ? 0 : narrow_runs(bits, rows, k, is_bf16);
#if defined(LINEAR_AMX)
    if (amx_runs(rows, k, is_bf16)) { /* every thread decides alike: no barrier is skipped */
        amx_configure(rows % 16);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (n + PANEL - 1) / PANEL; p += 2)
            amx_panel_pair((const uint16_t *)x, x_stride, (const uint16_t *)panels, bias,
                           (uint16_t *)y, rows, n, depth, p);
        _tile_release();
        return;
    }
#endif
    for (int64_t r0 = 0, tile; r0 < rows; r0 += tile) {
        tile = kind_tile_rows(kind, rows, rows - r0);
#pragma omp for schedule(static) nowait
        for (int64_t d = 0; d < depth; d++) {
            for (int64_t r = 0; r < tile; r++) {
                if (is_bf16) {
                    const uint16_t *src = (const uint16_t *)x + (r0 + r) * x_stride;
                    const int has_odd = 2 * d + 1 < k; /* else the pair's zero padding */
                    const int64_t at = r0 * depth + d * tile + r;
                    if (PAIRS_AS_FLOAT32) {
                        float *pair = (float *)packed + 2 * at;
                        pair[0] = bf16_load(src, 2 * d);
                        pair[1] = has_odd ? bf16_load(src, 2 * d + 1) : 0.0f;
                    } else {
                        const uint32_t hi = has_odd ? src[2 * d + 1] : 0;
                        ((uint32_t *)packed)[at] = (uint32_t)src[2 * d] | hi << 16;
                    }
                } else {
                    const float *src = (const float *)x + (r0 + r) * x_stride;
                    ((float *)packed)[r0 * depth + d * tile + r] = src[d];
                }
            }
        }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t p = 0; p < (n + PANEL - 1) / PANEL; p++) {
        switch (kind) {
#if defined(LINEAR_Q4)
        case 4:
        case 8: block_rows(packed, narrow, kind, bias, y, rows, n, k, p); break;
#endif
        case 16: b16_rows(packed, narrow, bias, y, rows, n, k, p); break;
        default: panel_rows(packed, panels, bias, y, rows, n, depth, p, is_bf16);
        }
    }
#else
    (void)x, (void)x_stride, (void)panels, (void)narrow, (void)bits, (void)bias, (void)y;
    (void)rows, (void)n, (void)k, (void)is_bf16, (void)packed;
#endif
}

/* The most rows narrow panels of kind `bits` run: 4-bit and 8-bit blocks 64 (AVX-512) or 16
 * (AVX2), 16-bit ones as many as the float32 panels; 0 where there are none (blocks need AVX-512
 * or AVX2 with F16C) or for another kind. */
int64_t linear_narrow_max_rows(int bits) {
#if defined(LINEAR_SIMD)
    if (bits == 16) return INT32_MAX;
#if defined(LINEAR_Q4)
    if (bits == 4 || bits == 8) return Q4_MAX_ROWS;
#endif
#endif
    (void)bits;
    return 0;
}

/* The standalone call: returns 0, 1 when the packed-input buffer cannot be allocated, 2 for an
 * unsupported dtype. */
int panel_linear(const void *x, int64_t x_stride, const void *panels, const void *narrow,
                 int bits, const void *bias, void *y, int64_t rows, int64_t n, int64_t k,
                 int is_bf16) {
    if (!(linear_kernel_dtypes() & (is_bf16 ? 2 : 1))) return 2;
    void *packed = malloc((size_t)linear_packed_bytes(rows, k, is_bf16));
    if (packed == NULL) return 1;
#pragma omp parallel
    panel_linear_team(x, x_stride, panels, narrow, bits, bias, y, rows, n, k, is_bf16, packed);
    free(packed);
    return 0;
}
