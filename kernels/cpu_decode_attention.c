/* Paged decode attention for CPUs: one new query token per sequence, read against the paged KV
 * cache in place (no gather into a contiguous buffer), all sequences and KV heads of a layer in
 * one call.
 *
 * Why C and not PyTorch ops: the PyTorch reference needs about ten small ops per sequence per
 * layer (gather, cast, two GEMMs, softmax), so a 64-sequence decode step over 30 layers issues
 * tens of thousands of them and the dispatch overhead outweighs the arithmetic. Here one call per
 * layer does it, parallel over (sequence, KV head) on the OpenMP runtime torch already loaded
 * (libgomp.so.1 is resolved to torch's copy, so there is one thread pool, not two).
 *
 * Layouts (all contiguous):
 *   query   [num_seqs, num_heads, head_dim] float32
 *   cache   [num_blocks, block_size, num_kv_heads, head_dim] float32 or bfloat16 (as uint16)
 *   tables  [num_seqs, table_stride] int32, context_lens [num_seqs] int32
 *   out     [num_seqs, num_heads, head_dim] float32
 * Heads h = kv_head * group + g share KV head kv_head (GQA), as in the PyTorch reference.
 * Scores and softmax are float32; two passes over the context (scores, then weighted values).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

/* Row `token` of KV head `kv_head` for a sequence's context position, converted to float32 in
 * `scratch` when the cache is bfloat16 (a float32 cache is read in place). */
/* The K or V row of context position `pos` for KV heads [h0, h1) (contiguous in the cache),
 * converted to float32 in `scratch` when the cache is bfloat16 (a float32 cache is read in place). */
static inline const float *kv_rows(const void *cache, int is_bf16, const int32_t *table, int pos,
                                   int block_size, int num_kv_heads, int head_dim, int h0, int h1,
                                   float *scratch) {
    const int64_t block = table[pos / block_size];
    const int64_t offset = ((block * block_size + pos % block_size) * num_kv_heads + h0) * (int64_t)head_dim;
    if (!is_bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    const int width = (h1 - h0) * head_dim;
    #pragma omp simd
    for (int d = 0; d < width; d++) scratch[d] = bf16_to_float(src[d]);
    return scratch;
}

/* Attention of one sequence's query heads of KV heads [h0, h1). `scores` holds
 * (h1 - h0) * group * n floats, `scratch` (h1 - h0) * head_dim. */
static void attend(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                   const int32_t *table, int n, int num_kv_heads, int group, int head_dim,
                   int block_size, float scale, int h0, int h1, float *scores, float *scratch,
                   float *o) {
    const int rows = (h1 - h0) * group;
    memset(o, 0, sizeof(float) * (size_t)rows * (size_t)head_dim);
    if (n <= 0) return;
    for (int t = 0; t < n; t++) {
        const float *k = kv_rows(k_cache, is_bf16, table, t, block_size, num_kv_heads, head_dim,
                                 h0, h1, scratch);
        for (int r = 0; r < rows; r++) {
            const float *kh = k + (int64_t)(r / group) * head_dim;
            const float *qr = q + (int64_t)r * head_dim;
            float dot = 0.0f;
            #pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qr[d] * kh[d];
            scores[(int64_t)r * n + t] = dot * scale;
        }
    }
    for (int r = 0; r < rows; r++) {
        float *row = scores + (int64_t)r * n;
        float peak = row[0];
        for (int t = 1; t < n; t++) peak = row[t] > peak ? row[t] : peak;
        float total = 0.0f;
        #pragma omp simd reduction(+ : total)
        for (int t = 0; t < n; t++) {
            row[t] = expf(row[t] - peak);
            total += row[t];
        }
        const float inv = 1.0f / total;
        #pragma omp simd
        for (int t = 0; t < n; t++) row[t] *= inv;
    }
    for (int t = 0; t < n; t++) {
        const float *v = kv_rows(v_cache, is_bf16, table, t, block_size, num_kv_heads, head_dim,
                                 h0, h1, scratch);
        for (int r = 0; r < rows; r++) {
            const float p = scores[(int64_t)r * n + t];
            const float *vh = v + (int64_t)(r / group) * head_dim;
            float *orow = o + (int64_t)r * head_dim;
            #pragma omp simd
            for (int d = 0; d < head_dim; d++) orow[d] += p * vh[d];
        }
    }
}

/* Returns 0 on success; before touching anything, KVSCALE_BAD_TABLE if a context needs more
 * blocks than its table row has or a used entry is not a block of the cache (an out-of-range read
 * would crash the process instead of raising); KVSCALE_NO_MEMORY if a score buffer failed. */
enum { KVSCALE_OK = 0, KVSCALE_NO_MEMORY = 1, KVSCALE_BAD_TABLE = 2 };

int kvscale_paged_decode_attention(
    const float *query, const void *k_cache, const void *v_cache, int cache_is_bf16,
    int64_t num_blocks, const int32_t *block_tables, int64_t table_stride,
    const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, float *out, int num_threads) {
    const int group = num_heads / num_kv_heads;
    int max_len = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int n = context_lens[s];
        if (n > max_len) max_len = n;
        const int64_t used = n > 0 ? ((int64_t)n + block_size - 1) / block_size : 0;
        if (used > table_stride) return KVSCALE_BAD_TABLE;
        for (int64_t b = 0; b < used; b++) {
            const int32_t block = block_tables[(int64_t)s * table_stride + b];
            if (block < 0 || block >= num_blocks) return KVSCALE_BAD_TABLE;
        }
    }
    int failed = KVSCALE_OK;

    /* Whole sequences (all KV heads: one contiguous sweep over each block) when there are enough
     * of them to share out; otherwise one task per (sequence, KV head) to keep every thread busy. */
    const int heads_per_task = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
    const int tasks_per_seq = num_kv_heads / heads_per_task;

    #pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const size_t rows = (size_t)heads_per_task * (size_t)group;
        float *scores = malloc(sizeof(float) * rows * (size_t)(max_len > 0 ? max_len : 1));
        float *scratch = malloc(sizeof(float) * (size_t)heads_per_task * (size_t)head_dim);
        if (scores == NULL || scratch == NULL) failed = KVSCALE_NO_MEMORY;

        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)num_seqs * tasks_per_seq; task++) {
            if (scores == NULL || scratch == NULL) continue;
            const int s = (int)(task / tasks_per_seq);
            const int h0 = (int)(task % tasks_per_seq) * heads_per_task;
            const int64_t first_row = (int64_t)s * num_heads + (int64_t)h0 * group;
            attend(query + first_row * head_dim, k_cache, v_cache, cache_is_bf16,
                   block_tables + (int64_t)s * table_stride, context_lens[s], num_kv_heads, group,
                   head_dim, block_size, scale, h0, h0 + heads_per_task, scores, scratch,
                   out + first_row * head_dim);
        }
        free(scores);
        free(scratch);
    }
    return failed;
}
