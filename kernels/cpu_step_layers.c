/* A batched step's decoder layers, all of them in one call from Python.
 *
 * Why: each layer of the bundled model is about ten kernel calls (two norms, four projections,
 * RoPE, the KV write, attention), and from Python each call cost a few microseconds of wrapper,
 * argument checks, tensor allocation and ctypes on top of its work. Over 30 layers that was a
 * fifth of a 64-sequence decode step on two cores (py-spy on W1: the main thread's samples in
 * Python between the C kernels). Here the same kernels run in the same order on the same
 * buffers' contents, so the step's output is bit for bit the module path's (a test checks it).
 *
 * The caller (server/worker/cpu_step_layers.py) takes this path only where every kernel below applies:
 * bfloat16 activations, projections on the AMX kernel (bfloat16 or int8 weights) or, without AMX,
 * on the bf16 dot-product kernel (cpu_linear_dot.c, bfloat16 weights), the fused
 * gate|up with SiLU in its store, rotate-half RoPE over whole heads, a bfloat16 or FP8 cache,
 * and for a step with prompt chunks, the AMX prefill attention kernel.
 *
 * Layouts: hidden and residual [rows, hidden] bfloat16; cos/sin tables [max_len, head_dim]
 * bfloat16, `cos_stride` apart, looked up by `positions`; slots int64 (one per row); the
 * attention's tables and lengths int32 (kvscale_step_attention below).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The kernels this file chains (the other sources of the same library). */
void kvscale_add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t width,
                          float eps, int is_bf16, int num_threads);
void kvscale_rope(const void *x, int64_t row_stride, const int64_t *positions, const void *cos_table,
                  const void *sin_table, int64_t table_stride, void *out, int64_t tokens, int64_t heads,
                  int64_t head_dim, int is_bf16, int num_threads);
int kvscale_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *k_cache,
                     void *v_cache, int64_t num_slots, const int64_t *slots, int64_t num_tokens, int64_t row,
                     int64_t elem);
int kvscale_write_kv_fp8(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                         void *k_cache, void *v_cache, int64_t num_slots, const int64_t *slots, int64_t num_tokens,
                         int64_t row, int is_bf16, int format, float k_scale, float v_scale);
int kvscale_paged_decode_attention(const void *query, const void *k_cache, const void *v_cache, int cache_format,
                                   int query_is_bf16, int64_t num_blocks, const int32_t *block_tables,
                                   int64_t table_stride, const int32_t *context_lens, int num_seqs, int num_heads,
                                   int num_kv_heads, int head_dim, int block_size, float scale, float k_scale,
                                   float v_scale, void *out, int io_bf16, int num_threads);
int kvscale_paged_prefill_attention(const void *query, int64_t query_stride, const void *k_cache, const void *v_cache,
                                    int64_t num_blocks, const int32_t *block_tables, int64_t table_stride,
                                    const int32_t *query_start_loc, const int32_t *context_lens, int num_seqs,
                                    int num_heads, int num_kv_heads, int head_dim, int block_size, int cache_format,
                                    float k_scale, float v_scale, float scale, void *out, int num_threads);
int kvscale_linear_amx(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int silu_mul, int num_threads);
int kvscale_linear_amx_available(void);
int kvscale_linear_dot(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int silu_mul, int num_threads);
int kvscale_linear_amx_int8(const uint8_t *x, const float *x_scales, const int8_t *packed,
                            const int32_t *column_sums, const float *w_scales, const float *bias, int64_t m, int64_t n,
                            int64_t k, void *out, int out_bf16, int silu_mul, int num_threads);
void kvscale_quantize_rows_u8(const void *x, int64_t rows, int64_t width, int is_bf16, uint8_t *q, float *scales,
                              int num_threads);

enum { BF16_CACHE = 1 };  /* cpu_decode_attention.c's cache formats; above it, FP8 */

/* Returned: 0, or which step failed (server/worker/cpu_step_layers.py turns each into its error). */
enum {
    STEP_LAYERS_OK = 0,
    STEP_LAYERS_NO_MEMORY = 1,
    STEP_LAYERS_LINEAR_FAILED = 2,
    STEP_LAYERS_BAD_SLOT = 3,
    STEP_LAYERS_BAD_TABLE = 4,
};

/* One projection as the AMX kernel holds it: bfloat16 where w_scales is NULL, else int8 (its
 * column sums and per-column scales beside it). */
typedef struct {
    const void *packed;
    const int32_t *column_sums;
    const float *w_scales;
    const float *bias;  /* float32 or NULL */
    int64_t out_features, in_features;
} kvscale_projection;

typedef struct {
    const uint16_t *input_norm, *post_norm;  /* [hidden] bfloat16 */
    kvscale_projection qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    float k_scale, v_scale;
} kvscale_decoder_layer;

/* A step's attention: one sequence a row (a decode step: query_start_loc NULL), or sequences of
 * any lengths, whose single-token ones (`single_rows`, with their own table rows and lengths)
 * the prefill kernel leaves to the decode kernel, as the CPU backend's prefill op does. */
typedef struct {
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *context_lens;
    const int32_t *query_start_loc;
    int64_t num_seqs;
    const int64_t *single_rows;
    const int32_t *single_tables;
    const int32_t *single_lens;
    int64_t num_single;
} kvscale_step_attention;

typedef struct {
    int64_t hidden, intermediate;
    int32_t num_heads, num_kv_heads, head_dim;
    float eps, scale;
    int32_t cache_format, block_size;
    int64_t num_blocks;
} kvscale_decoder_shape;

/* out = x W^T (+ bias), or its SiLU-and-multiply; int8 weights quantize x's rows first, as
 * Int8Linear does. */
static int project(const kvscale_projection *p, const uint16_t *x, int64_t rows, void *out, int silu_mul,
                   uint8_t *x_q, float *x_scales, int num_threads) {
    /* bfloat16: packed for AMX tiles where they are permitted, else for the dot-product kernel
     * (server/worker/cpu_linear.py packs by the same test). */
    if (p->w_scales == NULL)
        return (kvscale_linear_amx_available() ? kvscale_linear_amx : kvscale_linear_dot)(
            x, p->in_features, p->packed, p->bias, rows, p->out_features, p->in_features, out, silu_mul, num_threads);
    kvscale_quantize_rows_u8(x, rows, p->in_features, 1, x_q, x_scales, num_threads);
    return kvscale_linear_amx_int8(x_q, x_scales, p->packed, p->column_sums, p->w_scales, p->bias, rows,
                                   p->out_features, p->in_features, out, 1, silu_mul, num_threads);
}

static int decode_attention(const kvscale_decoder_shape *s, const kvscale_decoder_layer *layer, const uint16_t *q,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t num_seqs,
                            uint16_t *out, int num_threads) {
    return kvscale_paged_decode_attention(q, layer->k_cache, layer->v_cache, s->cache_format, 1, s->num_blocks, tables,
                                          table_stride, lens, (int)num_seqs, s->num_heads, s->num_kv_heads, s->head_dim,
                                          s->block_size, s->scale, layer->k_scale, layer->v_scale, out, 1, num_threads);
}

/* Attention of every row's query (`q` [rows, heads, head_dim]) into `attended`; 0, or the
 * kernels' status (2: a bad block table). */
static int attend(const kvscale_step_attention *a, const kvscale_decoder_shape *s, const kvscale_decoder_layer *layer,
                  const uint16_t *q, int64_t rows, uint16_t *attended, uint16_t *single_q, uint16_t *single_out,
                  int num_threads) {
    if (a->query_start_loc == NULL)
        return decode_attention(s, layer, q, a->block_tables, a->table_stride, a->context_lens, rows, attended,
                                num_threads);
    const int64_t q_size = (int64_t)s->num_heads * s->head_dim;
    const int status = kvscale_paged_prefill_attention(
        q, q_size, layer->k_cache, layer->v_cache, s->num_blocks, a->block_tables, a->table_stride, a->query_start_loc,
        a->context_lens, (int)a->num_seqs, s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, s->cache_format,
        layer->k_scale, layer->v_scale, s->scale, attended, num_threads);
    if (status || a->num_single == 0) return status;
    for (int64_t i = 0; i < a->num_single; i++)
        memcpy(single_q + i * q_size, q + a->single_rows[i] * q_size, 2 * (size_t)q_size);
    const int single = decode_attention(s, layer, single_q, a->single_tables, a->table_stride, a->single_lens,
                                        a->num_single, single_out, num_threads);
    if (single) return single;
    for (int64_t i = 0; i < a->num_single; i++)
        memcpy(attended + a->single_rows[i] * q_size, single_out + i * q_size, 2 * (size_t)q_size);
    return 0;
}

/* The decoder layers of a step: `hidden` holds the token embeddings on entry and the last
 * layer's MLP output on return, `residual` the residual stream on return (the final norm's add
 * is the caller's). Or a run of them: with `residual_ready`, `hidden` and `residual` hold on
 * entry what the layers before these left (a caller checking between runs of layers). */
int kvscale_step_layers(const kvscale_decoder_layer *layers, int num_layers, int residual_ready,
                          const kvscale_decoder_shape *s,
                          uint16_t *hidden, uint16_t *residual, int64_t rows, const int64_t *positions,
                          const uint16_t *cos_table, const uint16_t *sin_table, int64_t cos_stride,
                          const int64_t *slots, const kvscale_step_attention *a, int num_threads) {
    const int64_t q_size = (int64_t)s->num_heads * s->head_dim, kv_size = (int64_t)s->num_kv_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size, num_slots = s->num_blocks * s->block_size;
    /* The widest input a projection quantizes (int8 weights). */
    int64_t widest = s->hidden > q_size ? s->hidden : q_size;
    widest = s->intermediate > widest ? s->intermediate : widest;
    /* One allocation for every intermediate of a layer, reused by the next. */
    const size_t normed_n = (size_t)(rows * s->hidden), qkv_n = (size_t)(rows * qkv_width);
    const size_t q_n = (size_t)(rows * q_size), k_n = (size_t)(rows * kv_size), act_n = (size_t)(rows * s->intermediate);
    uint16_t *buffer = malloc(2 * (normed_n + qkv_n + 4 * q_n + k_n + act_n) + (size_t)(rows * widest) + 4 * (size_t)rows);
    if (buffer == NULL) return STEP_LAYERS_NO_MEMORY;
    uint16_t *normed = buffer, *qkv = normed + normed_n, *q = qkv + qkv_n, *k = q + q_n, *attended = k + k_n;
    uint16_t *single_q = attended + q_n, *single_out = single_q + q_n, *act = single_out + q_n;
    uint8_t *x_q = (uint8_t *)(act + act_n);
    float *x_scales = (float *)(x_q + rows * widest);
    int status = STEP_LAYERS_OK;
    for (int i = 0; i < num_layers && status == STEP_LAYERS_OK; i++) {
        const kvscale_decoder_layer *layer = &layers[i];
        if (i == 0 && !residual_ready) {
            memcpy(residual, hidden, 2 * normed_n);
            kvscale_add_rms_norm(hidden, NULL, layer->input_norm, normed, rows, s->hidden, s->eps, 1, num_threads);
        } else {
            kvscale_add_rms_norm(hidden, residual, layer->input_norm, normed, rows, s->hidden, s->eps, 1, num_threads);
        }
        if (project(&layer->qkv, normed, rows, qkv, 0, x_q, x_scales, num_threads)) {
            status = STEP_LAYERS_LINEAR_FAILED;
            break;
        }
        /* q and k rotated into buffers of their own: attention wants the queries contiguous. */
        kvscale_rope(qkv, qkv_width, positions, cos_table, sin_table, cos_stride, q, rows, s->num_heads, s->head_dim, 1,
                     num_threads);
        kvscale_rope(qkv + q_size, qkv_width, positions, cos_table, sin_table, cos_stride, k, rows, s->num_kv_heads,
                     s->head_dim, 1, num_threads);
        const uint16_t *v = qkv + q_size + kv_size;
        const int wrote = s->cache_format == BF16_CACHE
            ? kvscale_write_kv(k, kv_size, v, qkv_width, layer->k_cache, layer->v_cache, num_slots, slots, rows, kv_size, 2)
            : kvscale_write_kv_fp8(k, kv_size, v, qkv_width, layer->k_cache, layer->v_cache, num_slots, slots, rows,
                                   kv_size, 1, s->cache_format, layer->k_scale, layer->v_scale);
        if (wrote) {
            status = STEP_LAYERS_BAD_SLOT;
            break;
        }
        const int attention = attend(a, s, layer, q, rows, attended, single_q, single_out, num_threads);
        if (attention) {
            status = attention == 2 ? STEP_LAYERS_BAD_TABLE : STEP_LAYERS_NO_MEMORY;
            break;
        }
        if (project(&layer->o, attended, rows, hidden, 0, x_q, x_scales, num_threads)) {
            status = STEP_LAYERS_LINEAR_FAILED;
            break;
        }
        kvscale_add_rms_norm(hidden, residual, layer->post_norm, normed, rows, s->hidden, s->eps, 1, num_threads);
        if (project(&layer->gate_up, normed, rows, act, 1, x_q, x_scales, num_threads) ||
            project(&layer->down, act, rows, hidden, 0, x_q, x_scales, num_threads))
            status = STEP_LAYERS_LINEAR_FAILED;
    }
    free(buffer);
    return status;
}
