/* The kernels' bodies as "team" functions, shared by the standalone entry points that
 * worker/cpu_kernels.py calls one at a time and by decode_step.c, which runs a whole decode
 * step inside one OpenMP parallel region.
 *
 * Every loop in a team function is an orphaned `omp for` (with its implicit barrier): called by
 * all threads of a parallel region, the threads split the work; called outside one, the
 * calling thread does all of it. So a standalone kernel is `#pragma omp parallel` around its
 * team function, and the fused step keeps one team of threads busy from the first layer to the
 * last instead of waking a new team for each op.
 *
 * Tensors are row-major in the model's dtype (float32, or bfloat16 when `is_bf16`); strides are
 * in elements.
 */
#ifndef SPECSERVE_TEAM_H
#define SPECSERVE_TEAM_H

#include <stdint.h>

/* Row r: s = x[r] (+ delta[r], stored to sum_out[r], rows `dim` apart); out[r] (rows `dim`
 * apart) = weight * (s * rsqrt(mean(s^2) + eps)). sum_out may be x itself. */
void add_rms_norm_team(const void *x, int64_t x_stride, const void *delta, int64_t delta_stride,
                       void *sum_out, const void *weight, void *out, int64_t rows, int64_t dim,
                       float eps, int is_bf16);

/* out[r] (rows `dim` apart) = silu(gate_up[r, :dim]) * gate_up[r, dim:]. */
void silu_mul_team(const void *gate_up, int64_t stride, void *out, int64_t rows, int64_t dim,
                   int is_bf16);

/* For each row of `qkv` ([q heads | k heads | v heads], `heads` q and `kv_heads` k/v heads of
 * `dim`): optional per-head RMSNorm of q and k (`q_norm`, `k_norm` weights, or NULL), RoPE on q
 * and k in place with the row's `cos` and sign-folded `sin` tables (`[rows, dim]`, as
 * worker/models.py `rope_cos_sin` makes them), then k and v written to `cache` rows
 * `k_rows[r]` and `k_rows[r] + block_size` (rows of `kv_heads * dim`; the cache holds
 * `num_blocks` blocks). Adds the number of rows whose K/V rows lie outside the cache (and are
 * not written) to `*bad_rows`. */
void rope_write_kv_team(void *qkv, int64_t qkv_stride, int64_t rows, int64_t heads,
                        int64_t kv_heads, int64_t dim, const void *cos, const void *sin,
                        const void *q_norm, const void *k_norm, float eps, void *cache,
                        int64_t num_blocks, const int64_t *k_rows, int64_t block_size,
                        int is_bf16, int *bad_rows);

/* Decode attention of one query per request over its pages of a cache of `num_blocks` blocks
 * (paged_decode.c describes the arguments); adds the number of (request, KV head) pairs that
 * failed to `*failed`. */
void paged_decode_attention_team(const void *query, int64_t q_row_stride, const void *cache,
                                 int64_t num_blocks, const int64_t *pages,
                                 const int64_t *first_pos,
                                 const int64_t *seq_lens, void *out, int64_t batch,
                                 int64_t heads, int64_t kv_heads, int64_t dim,
                                 int64_t block_size, int64_t max_pages, int64_t window,
                                 float scale, int is_bf16, int *failed);

/* Multi-row attention of `num_queries` requests over their pages (paged_prefill.c describes
 * the arguments); adds the number of work items that failed to `*failed`. */
void paged_prefill_attention_team(const void *query, int64_t q_row_stride, const void *cache,
                                  int64_t num_blocks, const int64_t *queries,
                                  int64_t num_queries, const int64_t *pages, int64_t num_pages,
                                  void *out, int64_t heads, int64_t kv_heads, int64_t dim,
                                  int64_t block_size, int64_t window, float scale, int is_bf16,
                                  int *failed);

/* y[rows, n] = x[rows, k] W^T + bias for W as panels (linear.c), or for float32 rows its narrow
 * panels `narrow` of kind `bits` (4, 8: blocks, 16: bfloat16 values) where given (NULL: none)
 * and they run this many rows (the same sums bit for bit); `packed` is scratch of
 * `linear_packed_bytes(rows, k, is_bf16)` bytes for the repacked inputs. Only where
 * `linear_kernel_dtypes()` has the dtype's bit. */
void panel_linear_team(const void *x, int64_t x_stride, const void *panels, const void *narrow,
                       int bits, const void *bias, void *y, int64_t rows, int64_t n, int64_t k,
                       int is_bf16, void *packed);
int64_t linear_packed_bytes(int64_t rows, int64_t k, int is_bf16);
/* Column `column` of W (float32 panels of depth k) times x: what panel_linear gives for it. */
float panel_column_f32(const float *x, const float *panels, int64_t k, int64_t column);
int linear_kernel_dtypes(void);

/* torch.argmax of one row of `cols` values (sampling.c): the largest, the first one on ties,
 * the first NaN in a row holding one; -1 for no values. */
int64_t first_argmax(const void *row, int64_t cols, int is_bf16);

#endif
