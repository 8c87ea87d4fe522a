/* A whole decode step of the decoder (worker/models.py) in one call (CPU, AVX-512 panels).
 *
 * In a decode step every request brings one token, so each op of a layer is small (16 rows at
 * batch 16) and the step is a long chain of them: ~15 per layer, 30 layers. Run from Python,
 * each op pays a dispatch, allocations and, for the parallel ones, waking the second thread;
 * together that was about a third of a SmolLM2 step at batch 16. Here one OpenMP team runs all
 * layers: the ops are the same team functions the standalone kernels use (team.h), so results
 * are bit for bit those of the layer-by-layer path, and between two ops the threads only meet
 * at a barrier.
 *
 * Per layer, in the order of worker/models.py `DecoderLayer`:
 *   h = rms_norm(x)                              (fused into the previous layer's residual add)
 *   qkv = h Wqkv^T + b; q/k norms, RoPE, K/V written to the cache
 *   x, h = x + attention(q) Wo^T + b, rms_norm(...)
 *   x = x + (silu(h Wg^T) * h Wu^T) Wd^T + b
 * and after the last layer `out = rms_norm(x)` with the final norm's weight.
 *
 * The first layer may instead read a given attention input (`attn_input` in `dims`, `attn_in`
 * values a row): an EAGLE-3 drafter's layer reads `[norm(embeddings), norm(hidden)]`, twice
 * the residual's width, made before the call; its residual stream starts in `x` as usual.
 *
 * `layers` is `num_layers` rows of LAYER_FIELDS int64 values (the weights, built once per
 * model) and `groups` one row of GROUP_FIELDS per KV group (the step's metadata);
 * worker/cpu/fused_decode.py builds both, and the column lists below name their columns.
 * `caches` holds each layer's KV cache and `captures` where to copy each layer's output (0:
 * nowhere). Pointers are addresses; absent biases and norms are 0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "team.h"

/* Each table's columns, in order, written once: the enums index the rows, and
 * `decode_table_fields` hands the same names to the loader (worker/cpu/kernels.py), which
 * refuses a library whose columns differ by name from the rows Python builds. */
#define LAYER_COLUMNS(X)                                                                      \
    X(L_INPUT_NORM, input_norm) X(L_QKV, qkv) X(L_QKV_BIAS, qkv_bias) X(L_Q_NORM, q_norm)     \
    X(L_K_NORM, k_norm) X(L_O, o) X(L_O_BIAS, o_bias) X(L_POST_NORM, post_norm)               \
    X(L_GATE_UP, gate_up) X(L_GATE_UP_BIAS, gate_up_bias) X(L_DOWN, down)                     \
    X(L_DOWN_BIAS, down_bias) X(L_QKV_NARROW, qkv_narrow) X(L_QKV_BITS, qkv_bits)             \
    X(L_O_NARROW, o_narrow) X(L_O_BITS, o_bits) X(L_GATE_UP_NARROW, gate_up_narrow)           \
    X(L_GATE_UP_BITS, gate_up_bits) X(L_DOWN_NARROW, down_narrow) X(L_DOWN_BITS, down_bits)   \
    X(L_GROUP, group)
#define GROUP_COLUMNS(X)                                                                      \
    X(G_K_ROWS, k_rows) X(G_PAGES, pages) X(G_MAX_PAGES, max_pages)                           \
    X(G_FIRST_POS, first_pos) X(G_SEQ_LENS, seq_lens) X(G_WINDOW, window)
#define DIMS_COLUMNS(X)                                                                       \
    X(D_ROWS, rows) X(D_HIDDEN, hidden) X(D_HEADS, heads) X(D_KV_HEADS, kv_heads)             \
    X(D_HEAD_DIM, head_dim) X(D_INTER, inter) X(D_BLOCK_SIZE, block_size)                     \
    X(D_NUM_BLOCKS, num_blocks) X(D_IS_BF16, is_bf16) X(D_ATTN_INPUT, attn_input)              \
    X(D_ATTN_IN, attn_in)
#define CHAIN_COLUMNS(X)                                                                      \
    X(C_DEPTHS, depths) X(C_NUM_GROUPS, num_groups) X(C_EMBED, embed)                         \
    X(C_EMBED_ROWS, embed_rows) X(C_EMBED_BF16, embed_bf16) X(C_INPUT_NORM, input_norm)       \
    X(C_HIDDEN_NORM, hidden_norm) X(C_NORM_BEFORE_RESIDUAL, norm_before_residual)             \
    X(C_HEAD, head) X(C_HEAD_NARROW, head_narrow) X(C_HEAD_BITS, head_bits)                   \
    X(C_DRAFT_VOCAB, draft_vocab) X(C_DRAFT_TO_TARGET, draft_to_target)
#define COLUMN_INDEX(id, name) id,
#define COLUMN_NAME(id, name) #name ","

enum { LAYER_COLUMNS(COLUMN_INDEX) LAYER_FIELDS };
enum { GROUP_COLUMNS(COLUMN_INDEX) GROUP_FIELDS };
enum { DIMS_COLUMNS(COLUMN_INDEX) DIMS };
enum { CHAIN_COLUMNS(COLUMN_INDEX) CHAIN_FIELDS };

/* The column names of table 0 (layers), 1 (KV groups), 2 (dims) or 3 (a draft chain),
 * comma-separated (with a trailing comma); NULL for another table. */
const char *decode_table_fields(int table) {
    static const char *const names[] = {LAYER_COLUMNS(COLUMN_NAME), GROUP_COLUMNS(COLUMN_NAME),
                                        DIMS_COLUMNS(COLUMN_NAME), CHAIN_COLUMNS(COLUMN_NAME)};
    return table >= 0 && table < 4 ? names[table] : NULL;
}

#define PTR(value) ((void *)(intptr_t)(value))

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* A decode step's intermediates, one allocation: each buffer on its own cache lines. */
typedef struct {
    char *base;
    void *h, *qkv, *attn, *delta, *gate_up, *act, *packed;
} Scratch;

/* `extra` more buffers of `extra_bytes[i]` each follow the layers' own (NULL: none). */
static int scratch_alloc(Scratch *s, const int64_t *dims, int64_t attn_in, int extra,
                         const size_t *extra_bytes, void **extra_out) {
    const int64_t rows = dims[D_ROWS], hidden = dims[D_HIDDEN], inter = dims[D_INTER];
    const int64_t q_width = dims[D_HEADS] * dims[D_HEAD_DIM];
    const int64_t qkv_width = q_width + 2 * dims[D_KV_HEADS] * dims[D_HEAD_DIM];
    const int is_bf16 = (int)dims[D_IS_BF16];
    const size_t esize = is_bf16 ? 2 : 4;
    const int64_t widths[] = {hidden, qkv_width, q_width, hidden, 2 * inter, inter};
    size_t offsets[7 + 8] = {0};
    for (int i = 0; i < 6; i++)
        offsets[i + 1] = offsets[i] + ((size_t)(rows * widths[i]) * esize + 63) / 64 * 64;
    const size_t packed_bytes = (size_t)linear_packed_bytes(
        rows, max3(attn_in > hidden ? attn_in : hidden, q_width, inter), is_bf16);
    offsets[7] = offsets[6] + (packed_bytes + 63) / 64 * 64;
    for (int i = 0; i < extra; i++) offsets[8 + i] = offsets[7 + i] + (extra_bytes[i] + 63) / 64 * 64;
    s->base = aligned_alloc(64, offsets[7 + extra]);
    if (s->base == NULL) return 1;
    s->h = s->base + offsets[0], s->qkv = s->base + offsets[1], s->attn = s->base + offsets[2];
    s->delta = s->base + offsets[3], s->gate_up = s->base + offsets[4];
    s->act = s->base + offsets[5], s->packed = s->base + offsets[6];
    for (int i = 0; i < extra; i++) extra_out[i] = s->base + offsets[7 + i];
    return 0;
}

/* The layers of one step, called by every thread of a parallel region (decode_layers
 * describes the arguments; `attn_input`: NULL, or the first layer's q/k/v input of `attn_in`
 * values a row). Stops after the first layer where anything failed (`*bad_rows`, `*failed`,
 * shared by the team). */
static void layers_team(const int64_t *layers, int64_t num_layers, const int64_t *caches,
                        const int64_t *captures, const int64_t *groups, const int64_t *dims,
                        const void *attn_input, int64_t attn_in, void *x, void *out,
                        const void *final_norm, const void *cos, const void *sin, float eps,
                        float scale, const Scratch *s, int *bad_rows, int *failed) {
    const int64_t rows = dims[D_ROWS], hidden = dims[D_HIDDEN], heads = dims[D_HEADS];
    const int64_t kv_heads = dims[D_KV_HEADS], head_dim = dims[D_HEAD_DIM];
    const int64_t inter = dims[D_INTER], block_size = dims[D_BLOCK_SIZE];
    const int64_t num_blocks = dims[D_NUM_BLOCKS];
    const int is_bf16 = (int)dims[D_IS_BF16];
    const size_t esize = is_bf16 ? 2 : 4;
    const int64_t q_width = heads * head_dim, qkv_width = q_width + 2 * kv_heads * head_dim;
    void *h = s->h, *qkv = s->qkv, *attn = s->attn, *delta = s->delta;
    void *gate_up = s->gate_up, *act = s->act, *packed = s->packed;
    if (!attn_input)
        add_rms_norm_team(x, hidden, NULL, 0, NULL, PTR(layers[L_INPUT_NORM]), h, rows, hidden,
                          eps, is_bf16);
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *layer = layers + l * LAYER_FIELDS;
        const int64_t *group = groups + layer[L_GROUP] * GROUP_FIELDS;
        const int given = l == 0 && attn_input;
        const int64_t in = given ? attn_in : hidden;
        panel_linear_team(given ? attn_input : h, in, PTR(layer[L_QKV]), PTR(layer[L_QKV_NARROW]),
                          (int)layer[L_QKV_BITS], PTR(layer[L_QKV_BIAS]), qkv, rows, qkv_width,
                          in, is_bf16, packed);
        rope_write_kv_team(qkv, qkv_width, rows, heads, kv_heads, head_dim, cos, sin,
                           PTR(layer[L_Q_NORM]), PTR(layer[L_K_NORM]), eps, PTR(caches[l]),
                           num_blocks, PTR(group[G_K_ROWS]), block_size, is_bf16, bad_rows);
        paged_decode_attention_team(qkv, qkv_width, PTR(caches[l]), num_blocks,
                                    PTR(group[G_PAGES]), PTR(group[G_FIRST_POS]),
                                    PTR(group[G_SEQ_LENS]), attn, rows, heads, kv_heads,
                                    head_dim, block_size, group[G_MAX_PAGES], group[G_WINDOW],
                                    scale, is_bf16, failed);
#pragma omp barrier
        if (*bad_rows || *failed) break; /* every thread sees the same counts after it */
        panel_linear_team(attn, q_width, PTR(layer[L_O]), PTR(layer[L_O_NARROW]),
                          (int)layer[L_O_BITS], PTR(layer[L_O_BIAS]), delta, rows, hidden,
                          q_width, is_bf16, packed);
        add_rms_norm_team(x, hidden, delta, hidden, x, PTR(layer[L_POST_NORM]), h, rows, hidden,
                          eps, is_bf16);
        panel_linear_team(h, hidden, PTR(layer[L_GATE_UP]), PTR(layer[L_GATE_UP_NARROW]),
                          (int)layer[L_GATE_UP_BITS], PTR(layer[L_GATE_UP_BIAS]), gate_up, rows,
                          2 * inter, hidden, is_bf16, packed);
        silu_mul_team(gate_up, 2 * inter, act, rows, inter, is_bf16);
        panel_linear_team(act, inter, PTR(layer[L_DOWN]), PTR(layer[L_DOWN_NARROW]),
                          (int)layer[L_DOWN_BITS], PTR(layer[L_DOWN_BIAS]), delta, rows, hidden,
                          inter, is_bf16, packed);
        /* The residual add, and the norm the next layer (or the model's end) starts with. */
        const int last = l + 1 == num_layers;
        add_rms_norm_team(x, hidden, delta, hidden, x,
                          last ? final_norm : PTR(layer[LAYER_FIELDS + L_INPUT_NORM]),
                          last ? out : h, rows, hidden, eps, is_bf16);
        if (captures && captures[l]) {
#pragma omp single
            memcpy(PTR(captures[l]), x, (size_t)(rows * hidden) * esize);
        }
    }
}

/* Runs `num_layers` layers on `x` ([rows, hidden], the embeddings; left holding the residual
 * stream after the last layer) and writes `out = rms_norm(x) * final_norm`. A layer with a
 * capture address gets its output (the residual stream after it) copied there. Returns 0,
 * 1 when scratch memory cannot be had, 2 when the panel kernel does not run the dtype, 4 for
 * no layers or no rows, or 3
 * when the first layer where anything failed stopped the step: `errors[0]` rows whose K/V rows
 * lie outside the cache, `errors[1]` (request, KV head) pairs whose attention failed (pages
 * outside the cache or not covering the keys). */
int decode_layers(const int64_t *layers, int64_t num_layers, const int64_t *caches,
                  const int64_t *captures, const int64_t *groups, const int64_t *dims,
                  void *x, void *out, const void *final_norm, const void *cos, const void *sin,
                  float eps, float scale, int64_t *errors) {
    const int is_bf16 = (int)dims[D_IS_BF16];
    const void *attn_input = PTR(dims[D_ATTN_INPUT]); /* NULL: rms_norm(x), as every layer */
    const int64_t attn_in = attn_input ? dims[D_ATTN_IN] : dims[D_HIDDEN];
    if (!(linear_kernel_dtypes() & (is_bf16 ? 2 : 1))) return 2;
    if (num_layers < 1 || dims[D_ROWS] < 1 || attn_in < 1) return 4;
    Scratch s;
    if (scratch_alloc(&s, dims, attn_in, 0, NULL, NULL)) return 1;
    int bad_rows = 0, failed = 0;
#pragma omp parallel
    layers_team(layers, num_layers, caches, captures, groups, dims, attn_input, attn_in, x, out,
                final_norm, cos, sin, eps, scale, &s, &bad_rows, &failed);
    free(s.base);
    errors[0] = bad_rows, errors[1] = failed;
    return bad_rows || failed ? 3 : 0;
}

/* Row `token` of the embedding table `embed` (`hidden` values, bfloat16 when `embed_bf16`)
 * into `dst` in the model's dtype, rounded to nearest even as PyTorch casts. */
static void embedding_row(void *dst, const void *embed, int embed_bf16, int64_t token,
                          int64_t hidden, int is_bf16) {
    const size_t src_size = embed_bf16 ? 2 : 4;
    const char *src = (const char *)embed + (size_t)(token * hidden) * src_size;
    if (embed_bf16 == is_bf16) {
        memcpy(dst, src, (size_t)hidden * src_size);
    } else if (is_bf16) {
        for (int64_t i = 0; i < hidden; i++) ((uint16_t *)dst)[i] = bf16_round(((const float *)src)[i]);
    } else {
        bf16_widen_row(dst, (const uint16_t *)src, hidden);
    }
}

/* An EAGLE-3 drafter's greedy drafts for `chain[C_DEPTHS]` more depths, in one call: for each
 * depth, what worker/spec_decode/eagle3.py `greedy_chain` runs op by op, with the same team
 * functions in the same order (so the same drafts and drafter K/V, bit for bit):
 *   e = embed[token] (cast to the model's dtype); a = [rms_norm(e), rms_norm(x)] (the input
 *   and hidden norms); x = rms_norm(x) where the norm comes before the residual;
 *   the layers on x with a as the first layer's q/k/v input (layers_team), normed = out;
 *   token = draft_to_target[argmax(normed head^T)] (the first on ties, as torch.argmax).
 * `x` ([rows, hidden]) holds the pre-norm state that drafted `first_tokens` ([rows] target
 * ids) and is left holding the last depth's; `tokens` gets [depths, rows] target ids. Depth
 * d reads the KV group rows `groups + d * num_groups` and RoPE rows `d * rows ..` of `cos`
 * and `sin`. `dims` as decode_layers takes them (attn_in: twice hidden; attn_input unused).
 * Returns decode_layers' codes; 3 also for a token outside the embedding table (`errors[2]`:
 * a `draft_to_target` entry past it), the depths before it drafted. */
int draft_chain(const int64_t *layers, int64_t num_layers, const int64_t *caches,
                const int64_t *groups, const int64_t *dims, const int64_t *chain, void *x,
                const int64_t *first_tokens, int64_t *tokens, const void *final_norm,
                const void *cos, const void *sin, float eps, float scale, int64_t *errors) {
    const int64_t rows = dims[D_ROWS], hidden = dims[D_HIDDEN], head_dim = dims[D_HEAD_DIM];
    const int64_t attn_in = 2 * hidden, depths = chain[C_DEPTHS];
    const int64_t vocab = chain[C_DRAFT_VOCAB], embed_rows = chain[C_EMBED_ROWS];
    const int is_bf16 = (int)dims[D_IS_BF16], embed_bf16 = (int)chain[C_EMBED_BF16];
    const int norm_first = (int)chain[C_NORM_BEFORE_RESIDUAL];
    const int64_t *draft_to_target = PTR(chain[C_DRAFT_TO_TARGET]);
    const size_t esize = is_bf16 ? 2 : 4, row_bytes = (size_t)hidden * esize;
    if (!(linear_kernel_dtypes() & (is_bf16 ? 2 : 1))) return 2;
    if (num_layers < 1 || rows < 1 || hidden < 1 || depths < 0 || vocab < 1) return 4;
    const size_t sizes[] = {rows * row_bytes, rows * row_bytes, rows * row_bytes,
                            2 * rows * row_bytes, rows * row_bytes, (size_t)(rows * vocab) * esize};
    void *buffers[6];
    Scratch s;
    if (scratch_alloc(&s, dims, attn_in, 6, sizes, buffers)) return 1;
    char *embeds = buffers[0], *normed_e = buffers[1], *normed_h = buffers[2];
    char *attn_input = buffers[3], *normed = buffers[4], *logits = buffers[5];
    int bad_rows = 0, failed = 0, bad_tokens = 0;
#pragma omp parallel
    for (int64_t d = 0; d < depths; d++) {
        const int64_t *in = d == 0 ? first_tokens : tokens + (d - 1) * rows;
#pragma omp single
        for (int64_t r = 0; r < rows; r++) {
            if (in[r] < 0 || in[r] >= embed_rows) {
                bad_tokens++;
                continue;
            }
            embedding_row(embeds + r * row_bytes, PTR(chain[C_EMBED]), embed_bf16, in[r], hidden,
                          is_bf16);
        }
        if (bad_tokens) break; /* read by every thread after the single's barrier */
        add_rms_norm_team(embeds, hidden, NULL, 0, NULL, PTR(chain[C_INPUT_NORM]), normed_e, rows,
                          hidden, eps, is_bf16);
        add_rms_norm_team(x, hidden, NULL, 0, NULL, PTR(chain[C_HIDDEN_NORM]), normed_h, rows,
                          hidden, eps, is_bf16);
#pragma omp single
        {
            for (int64_t r = 0; r < rows; r++) {
                memcpy(attn_input + 2 * r * row_bytes, normed_e + r * row_bytes, row_bytes);
                memcpy(attn_input + (2 * r + 1) * row_bytes, normed_h + r * row_bytes, row_bytes);
            }
            if (norm_first) memcpy(x, normed_h, rows * row_bytes);
        }
        const size_t rope = (size_t)(d * rows * head_dim) * esize;
        layers_team(layers, num_layers, caches, NULL,
                    groups + d * chain[C_NUM_GROUPS] * GROUP_FIELDS, dims, attn_input, attn_in,
                    x, normed, final_norm, (const char *)cos + rope, (const char *)sin + rope,
                    eps, scale, &s, &bad_rows, &failed);
        if (bad_rows || failed) break; /* the layers' last barrier came after their counts */
        panel_linear_team(normed, hidden, PTR(chain[C_HEAD]), PTR(chain[C_HEAD_NARROW]),
                          (int)chain[C_HEAD_BITS], NULL, logits, rows, vocab, hidden, is_bf16,
                          s.packed);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) /* vocab >= 1: an index, never -1 */
            tokens[d * rows + r] =
                draft_to_target[first_argmax(logits + (size_t)(r * vocab) * esize, vocab, is_bf16)];
    }
    free(s.base);
    errors[0] = bad_rows, errors[1] = failed, errors[2] = bad_tokens;
    return bad_rows || failed || bad_tokens ? 3 : 0;
}
