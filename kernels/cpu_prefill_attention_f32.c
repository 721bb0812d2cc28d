/* Paged prefill attention in float32 for CPUs with AVX2 and FMA, read against the paged KV cache
 * (a bfloat16 model on AMX has its own kernel, cpu_prefill_attention.c).
 *
 * Why: a float32 model's prefill attention otherwise goes through PyTorch: per group of equal
 * sequences a gather of K/V out of the paged cache, a mask for a chunk after cached tokens, and
 * one SDPA call, every layer; on AVX2 CPUs, where float32 is what `--dtype auto` picks, SDPA ran
 * causal float32 attention at about 50 GFLOP/s on two cores. This kernel took prefill attention
 * over W1 from 2.44 to 1.62 s on an AVX2 EPYC (`python -m bench.profile_engine --dtype float32`,
 * bench/results/profile_engine_fp32_t2_epyc_avx2_f32_prefill_{c,sdpa}_1128.json).
 *
 * Here one call per layer does every sequence. A task is (sequence, KV head, up to POSITIONS
 * query positions): it packs the keys its last position sees once, for the GQA group's query
 * heads, as K^T in 16-key tiles (a tile: head_dim rows of 16 keys, so a vector holds eight keys'
 * element d), and their values as contiguous rows; then, per 4 query rows,
 *   1. scores against 16 keys at a time: 8 accumulators, each query element broadcast once for
 *      two key vectors (4 rows x 2 vectors of FMAs per loaded pair);
 *   2. each row's softmax over the keys its position sees (causal: position p sees keys 0..p);
 *   3. the rows' outputs as p . V, two rows and 32 dims at a time (8 accumulators).
 * Two passes over the context rather than an online softmax: 4 rows' scores fit in L1 or L2.
 *
 * Layouts:
 *   query   [num_tokens, num_heads, head_dim] float32, tokens `query_stride` elements apart
 *   cache   [num_blocks, block_size, num_kv_heads, head_dim] float32, contiguous
 *   tables  [num_seqs, table_stride] int32; query_start_loc [num_seqs + 1], context_lens int32
 *   out     [num_tokens, num_heads, head_dim] float32, contiguous
 * Sequences with fewer than two new tokens are left untouched (the decode kernel serves them).
 * head_dim is a multiple of 8 up to 256. Built without AVX2 and FMA, the call returns
 * UNSUPPORTED and the caller runs the PyTorch reference.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_softmax.h"

#define KVSCALE_PREFILL_F32_OK 0
#define KVSCALE_PREFILL_F32_UNSUPPORTED 1
#define KVSCALE_PREFILL_F32_BAD_TABLE 2
#define KVSCALE_PREFILL_F32_NO_MEMORY 3

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define POSITIONS 32  /* query positions per task: each packs its keys once for this many */
#define QUAD 4        /* query rows per score pass */
#define KEYS 16       /* keys per score step: two 8-key vectors, one K^T tile */
#define MAX_HEAD_DIM 256

typedef struct {
    int seq, kv_head, first;  /* first: the task's first query position among the sequence's new tokens */
    int keys;                 /* the keys its last position sees (its cost, for ordering) */
} task;

static int by_keys_descending(const void *a, const void *b) {
    return ((const task *)b)->keys - ((const task *)a)->keys;
}

/* K^T of keys [0, n) of one KV head in 16-key tiles, and their V rows. The last tile's columns
 * past n are zeroed: their scores are never read, but stale bits there (a subnormal, a NaN from
 * uninitialised memory) would still go through the FMAs, and a subnormal costs a microcode assist. */
static void pack_kv(const float *k_cache, const float *v_cache, const int32_t *table, int n, int block_size,
                    int num_kv_heads, int head_dim, int kv_head, float *k_t, float *v) {
    const int64_t row = (int64_t)num_kv_heads * head_dim, tile = (int64_t)head_dim * KEYS;
    for (int j = 0; j < n; j++) {
        const int64_t at = ((int64_t)table[j / block_size] * block_size + j % block_size) * row
                           + (int64_t)kv_head * head_dim;
        const float *k = k_cache + at;
        float *column = k_t + (j / KEYS) * tile + j % KEYS;
        for (int d = 0; d < head_dim; d++) column[(int64_t)d * KEYS] = k[d];
        memcpy(v + (int64_t)j * head_dim, v_cache + at, sizeof(float) * (size_t)head_dim);
    }
    for (int j = n; j % KEYS; j++) {
        float *column = k_t + (j / KEYS) * tile + j % KEYS;
        for (int d = 0; d < head_dim; d++) column[(int64_t)d * KEYS] = 0.0f;
    }
}

/* scores[i][j] = scale * q[i] . k_j for the QUAD rows and keys [0, n) (n rounded up to a tile). */
static inline __attribute__((always_inline)) void quad_scores(const float *const *q, const float *k_t, int n,
                                                              int head_dim, float scale, float *const *scores) {
    const __m256 scaled = _mm256_set1_ps(scale);
    for (int j = 0; j < n; j += KEYS) {
        const float *tile = k_t + (int64_t)(j / KEYS) * head_dim * KEYS;
        __m256 acc[QUAD][2];
        for (int i = 0; i < QUAD; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d++) {
            const __m256 k0 = _mm256_loadu_ps(tile + d * KEYS), k1 = _mm256_loadu_ps(tile + d * KEYS + 8);
            for (int i = 0; i < QUAD; i++) {
                const __m256 qd = _mm256_broadcast_ss(q[i] + d);
                acc[i][0] = _mm256_fmadd_ps(qd, k0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(qd, k1, acc[i][1]);
            }
        }
        for (int i = 0; i < QUAD; i++) {
            _mm256_storeu_ps(scores[i] + j, _mm256_mul_ps(acc[i][0], scaled));
            _mm256_storeu_ps(scores[i] + j + 8, _mm256_mul_ps(acc[i][1], scaled));
        }
    }
}

/* o[i] = p[i] . V over keys [0, n) for `rows` rows, two rows and 32 dims at a time: each value
 * vector loaded serves two rows' FMAs. */
static inline __attribute__((always_inline)) void weighted_values(float *const *p, int rows, int n, const float *v,
                                                                  int head_dim, float *const *o) {
    for (int i = 0; i < rows; i += 2) {
        const float *p0 = p[i], *p1 = p[i + 1 < rows ? i + 1 : i];
        for (int d0 = 0; d0 < head_dim; d0 += 32) {
            const int vectors = (head_dim - d0 < 32 ? head_dim - d0 : 32) / 8;
            __m256 acc0[4], acc1[4];
            for (int c = 0; c < vectors; c++) acc0[c] = acc1[c] = _mm256_setzero_ps();
            for (int j = 0; j < n; j++) {
                const __m256 w0 = _mm256_broadcast_ss(p0 + j), w1 = _mm256_broadcast_ss(p1 + j);
                const float *row = v + (int64_t)j * head_dim + d0;
                for (int c = 0; c < vectors; c++) {
                    const __m256 x = _mm256_loadu_ps(row + 8 * c);
                    acc0[c] = _mm256_fmadd_ps(w0, x, acc0[c]);
                    acc1[c] = _mm256_fmadd_ps(w1, x, acc1[c]);
                }
            }
            for (int c = 0; c < vectors; c++) _mm256_storeu_ps(o[i] + d0 + 8 * c, acc0[c]);
            if (i + 1 < rows)
                for (int c = 0; c < vectors; c++) _mm256_storeu_ps(o[i + 1] + d0 + 8 * c, acc1[c]);
        }
    }
}

/* One task: rows r = position * group + g (query head kv_head * group + g) of its positions. */
static inline __attribute__((always_inline)) void attend_task(
    const float *query, int64_t query_stride, const float *k_cache, const float *v_cache, const int32_t *table,
    int q_start, int q_len, int context_len, task work, int group, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, float *k_t, float *v, float *scores, float *out) {
    const int positions = q_len - work.first < POSITIONS ? q_len - work.first : POSITIONS;
    const int cached = context_len - q_len;  /* the first new token's position */
    pack_kv(k_cache, v_cache, table, work.keys, block_size, num_kv_heads, head_dim, work.kv_head, k_t, v);
    const int rows = positions * group, stride = (work.keys + KEYS - 1) / KEYS * KEYS;
    for (int r0 = 0; r0 < rows; r0 += QUAD) {
        const float *q[QUAD];
        float *row_scores[QUAD];
        for (int i = 0; i < QUAD; i++) {
            const int r = r0 + i < rows ? r0 + i : r0;  /* past the last row: row r0 again, unused */
            q[i] = query + (int64_t)(q_start + work.first + r / group) * query_stride
                   + (int64_t)(work.kv_head * group + r % group) * head_dim;
            row_scores[i] = scores + (int64_t)i * stride;
        }
        const int last = (r0 + QUAD < rows ? r0 + QUAD : rows) - 1;
        const int keys = cached + work.first + last / group + 1;  /* what the quad's last row sees */
        quad_scores(q, k_t, keys, head_dim, scale, row_scores);
        float *row_out[QUAD];
        for (int r = r0; r <= last; r++) {
            const int position = work.first + r / group, seen = cached + position + 1;
            float *weights = row_scores[r - r0];
            softmax_rows(weights, 1, seen);
            /* Keys a row does not see weigh 0, so the quad's rows share one pass over V. */
            for (int j = seen; j < keys; j++) weights[j] = 0.0f;
            row_out[r - r0] = out + ((int64_t)(q_start + position) * num_heads + work.kv_head * group + r % group)
                                        * head_dim;
        }
        weighted_values(row_scores, last - r0 + 1, keys, v, head_dim, row_out);
    }
}

int kvscale_paged_prefill_attention_f32(
    const float *query, int64_t query_stride, const float *k_cache, const float *v_cache, int64_t num_blocks,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
    const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, float *out, int num_threads) {
    if (head_dim % 8 || head_dim > MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads || block_size <= 0)
        return KVSCALE_PREFILL_F32_UNSUPPORTED;
    const int group = num_heads / num_kv_heads;
    /* Every used block of every sequence is checked before anything is read through the tables. */
    int64_t num_tasks = 0;
    int max_keys = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s], context_len = context_lens[s];
        if (q_len < 2) continue;
        const int64_t blocks = ((int64_t)context_len + block_size - 1) / block_size;
        if (q_len > context_len || blocks > table_stride) return KVSCALE_PREFILL_F32_BAD_TABLE;
        for (int64_t b = 0; b < blocks; b++) {
            const int32_t block = block_tables[(int64_t)s * table_stride + b];
            if (block < 0 || block >= num_blocks) return KVSCALE_PREFILL_F32_BAD_TABLE;
        }
        num_tasks += (int64_t)num_kv_heads * ((q_len + POSITIONS - 1) / POSITIONS);
        if (context_len > max_keys) max_keys = context_len;
    }
    if (num_tasks == 0) return KVSCALE_PREFILL_F32_OK;
    task *tasks = malloc(sizeof(task) * (size_t)num_tasks);
    if (tasks == NULL) return KVSCALE_PREFILL_F32_NO_MEMORY;
    int64_t n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 2) continue;
        for (int h = 0; h < num_kv_heads; h++)
            for (int first = 0; first < q_len; first += POSITIONS) {
                const int end = first + POSITIONS < q_len ? first + POSITIONS : q_len;
                tasks[n++] = (task){s, h, first, context_lens[s] - q_len + end};
            }
    }
    /* The longest first, so the last tasks to start are short ones and the threads end together. */
    qsort(tasks, (size_t)num_tasks, sizeof(task), by_keys_descending);
    const int64_t padded = (int64_t)(max_keys + KEYS - 1) / KEYS * KEYS;
    int failed = KVSCALE_PREFILL_F32_OK;
    #pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *k_t = malloc(sizeof(float) * (size_t)(padded * head_dim));
        float *v = malloc(sizeof(float) * (size_t)(padded * head_dim));
        float *scores = malloc(sizeof(float) * (size_t)(QUAD * padded));
        if (k_t == NULL || v == NULL || scores == NULL) failed = KVSCALE_PREFILL_F32_NO_MEMORY;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++) {
            if (failed != KVSCALE_PREFILL_F32_OK) continue;
            const task work = tasks[i];
            const int s = work.seq, q_len = query_start_loc[s + 1] - query_start_loc[s];
            const int32_t *table = block_tables + (int64_t)s * table_stride;
            /* Constant head sizes let the compiler keep the accumulators in registers. */
#define ATTEND(dim) attend_task(query, query_stride, k_cache, v_cache, table, query_start_loc[s], q_len, \
                                context_lens[s], work, group, num_heads, num_kv_heads, dim, block_size, scale, \
                                k_t, v, scores, out)
            if (head_dim == 64) ATTEND(64);
            else if (head_dim == 128) ATTEND(128);
            else ATTEND(head_dim);
#undef ATTEND
        }
        free(k_t);
        free(v);
        free(scores);
    }
    free(tasks);
    return failed;
}

int kvscale_prefill_attention_f32_available(void) { return 1; }

#else

int kvscale_paged_prefill_attention_f32(
    const float *query, int64_t query_stride, const float *k_cache, const float *v_cache, int64_t num_blocks,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
    const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, float *out, int num_threads) {
    (void)query, (void)query_stride, (void)k_cache, (void)v_cache, (void)num_blocks, (void)block_tables;
    (void)table_stride, (void)query_start_loc, (void)context_lens, (void)num_seqs, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)out, (void)num_threads;
    return KVSCALE_PREFILL_F32_UNSUPPORTED;
}

int kvscale_prefill_attention_f32_available(void) { return 0; }

#endif
