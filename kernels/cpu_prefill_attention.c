/* Paged prefill attention for CPUs with AMX (bfloat16 tiles), read against the paged KV cache.
 *
 * Why: with a bfloat16 model the projections run on AMX and a 2048-token prefill step's largest
 * remaining cost was attention through PyTorch: per group of equal sequences a gather of K/V
 * out of the paged cache, a transpose, a mask and one SDPA call, per layer. Here one call per
 * layer does every sequence: K and V of each (sequence, KV head) are packed once from the cache
 * into AMX's tile layouts (shared by the GQA group's query heads and every query tile), then each
 * (sequence, head, 16 query rows) item runs a flash-attention loop over 32-key tiles: scores on
 * AMX in float32, an online softmax on AVX-512 in float32, probabilities rounded to bfloat16 for
 * the value product (as SDPA's bfloat16 kernel rounds them), the output accumulated in float32.
 * Causal: the query at position p sees keys 0..p; a query tile stops at its last row's position.
 *
 * Layouts:
 *   query   [num_tokens, num_heads, head_dim] bfloat16, tokens `query_stride` elements apart
 *   cache   [num_blocks, block_size, num_kv_heads, head_dim] bfloat16 (as uint16), or FP8 bytes
 *           (`cache_format` 2: e4m3, 3: e5m2, holding the values divided by k_scale / v_scale:
 *           kernels/fp8.py), which packing widens to bfloat16 (their values times the scale,
 *           rounded to nearest even, as the PyTorch reference dequantizes them for its SDPA)
 *   tables  [num_seqs, table_stride] int32; query_start_loc [num_seqs + 1], context_lens int32
 *   out     [num_tokens, num_heads, head_dim] bfloat16, contiguous
 * Sequences with fewer than two new tokens are left untouched (the decode kernel serves them).
 * head_dim is a multiple of 32 up to 256. Without AMX in the build (-march=native on a CPU
 * without it) or without the kernel's permission to use it, the call returns UNSUPPORTED and the
 * caller runs the PyTorch reference.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVSCALE_PREFILL_OK 0
#define KVSCALE_PREFILL_UNSUPPORTED 1
#define KVSCALE_PREFILL_BAD_TABLE 2
#define KVSCALE_PREFILL_NO_MEMORY 3
#define KVSCALE_PREFILL_BF16 1
#define KVSCALE_PREFILL_E4M3 2
#define KVSCALE_PREFILL_E5M2 3

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include "cpu_amx.h"

#define Q_ROWS 16     /* query rows per item: one AMX tile's rows */
#define KEYS 32       /* keys per step: two 16-key score tiles, one 32-deep value product */
#define MAX_HEAD_DIM 256
/* Stands for -infinity: the build's -ffast-math lets the compiler assume no infinities. */
#define HIDDEN (-1e30f)

/* Every tile is 16 rows of 64 bytes (configure_tiles, cpu_amx.h): tmm0/1 scores^T of keys 0-15 /
 * 16-31, tmm2 the B operand (a 32-dim chunk of Q^T, then P^T), tmm3 the A operand (a K chunk,
 * then a V^T chunk), tmm4-7 the accumulator out^T, 16 dims each. */

/* 2^x for x <= 0: 2^round(x) by VSCALEFPS times a degree-4 Taylor polynomial of 2^f on
 * [-0.5, 0.5] (relative error below 5e-5, a fortieth of the bfloat16 rounding the probabilities
 * get before the value product). Far below the maximum (-1e29 for a masked key) the result is
 * exactly 0; results in float32's subnormal range are flushed to 0, since the kernel's threads
 * run with flush-to-zero (attention_fp_mode): a subnormal result, and every product of one
 * later, would take a microcode assist each, which doubled the kernel's time. */
static inline __m512 exp2_nonpositive(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) for the calling thread, for the
 * kernel's own loops; the previous mode is restored before the thread goes back to the pool, so
 * nothing else in the process (torch, Python) loses its subnormals. */
static inline unsigned int attention_fp_mode(void) {
    const unsigned int previous = _mm_getcsr();
    _mm_setcsr(previous | 0x8040u);
    return previous;
}

/* Where a (sequence, KV head)'s packed K and V live, and what they are packed from. */
typedef struct {
    const void *k_cache, *v_cache;
    const int32_t *table;
    int context_len, block_size, num_kv_heads, head_dim;
    int format;                /* KVSCALE_PREFILL_BF16 / _E4M3 / _E5M2 */
    float k_factor, v_factor;  /* FP8: what the half-precision reading of an element is multiplied by */
} kv_source;

/* One FP8 row to bfloat16: each byte read as half-precision bits (e5m2 is a half's top byte;
 * e4m3's fields moved into a half's read 2^-8 of its value, subnormals included), widened by
 * VCVTPH2PS, times `factor` (the scale, and 2^8 for e4m3), rounded to nearest even. */
static inline void fp8_row_to_bf16(const uint8_t *src, int head_dim, int format, float factor, uint16_t *dst) {
    const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7f);
    const __m512 times = _mm512_set1_ps(factor);
    for (int d = 0; d < head_dim; d += 32) {
        __m512 wide[2];
        for (int h = 0; h < 2; h++) {
            __m256i half = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + d + 16 * h)));
            half = format == KVSCALE_PREFILL_E5M2
                       ? _mm256_slli_epi16(half, 8)
                       : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(half, sign), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(half, rest), 7));
            wide[h] = _mm512_mul_ps(_mm512_cvtph_ps(half), times);
        }
        const __m512bh packed = _mm512_cvtne2ps_pbh(wide[1], wide[0]);
        memcpy(dst + d, &packed, 64);
    }
}

/* Keys 32*kt .. 32*kt+31 of one KV head into the tile layouts at k_packed and v_packed (zeros
 * past the context):
 *   K: the keys' rows as they are, [32 keys][head_dim]: the A operand of scores^T = K . Q^T.
 *   V: transposed per 16-dim chunk, [16 dims][32 keys]: the A operand of out^T += V^T . P^T.
 * V^T as dwords is the transpose of the key pairs' interleave (dword (kp, d) = V[2kp][d],
 * V[2kp+1][d]): each key pair is interleaved with one permute, then each dim's row gathered. */
static void pack_keys(const kv_source *src, int kv_head, int kt, uint16_t *k_packed, uint16_t *v_packed) {
    const int head_dim = src->head_dim, v_chunks = head_dim / 16;
    const uint16_t *v_rows[KEYS];
    uint16_t v_widened[KEYS * MAX_HEAD_DIM]; /* an FP8 cache's V rows as bfloat16 */
    uint16_t *k_rows = k_packed;
    int block = kt * KEYS / src->block_size, slot = kt * KEYS % src->block_size;
    for (int i = 0; i < KEYS; i++) {
        if (kt * KEYS + i < src->context_len) {
            const int64_t row = ((int64_t)src->table[block] * src->block_size + slot) * src->num_kv_heads + kv_head;
            if (src->format == KVSCALE_PREFILL_BF16) {
                memcpy(k_rows + (size_t)i * head_dim, (const uint16_t *)src->k_cache + row * head_dim,
                       sizeof(uint16_t) * head_dim);
                v_rows[i] = (const uint16_t *)src->v_cache + row * head_dim;
            } else {
                fp8_row_to_bf16((const uint8_t *)src->k_cache + row * head_dim, head_dim, src->format, src->k_factor,
                                k_rows + (size_t)i * head_dim);
                fp8_row_to_bf16((const uint8_t *)src->v_cache + row * head_dim, head_dim, src->format, src->v_factor,
                                v_widened + (size_t)i * head_dim);
                v_rows[i] = v_widened + (size_t)i * head_dim;
            }
            if (++slot == src->block_size) slot = 0, block++;
        } else {
            memset(k_rows + (size_t)i * head_dim, 0, sizeof(uint16_t) * head_dim);
            v_rows[i] = NULL;
        }
    }
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i pair_rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    _Alignas(64) uint32_t pairs[16 * 16];
    uint32_t *v_tiles = (uint32_t *)v_packed;
    for (int c = 0; c < v_chunks; c++) {
        for (int kp = 0; kp < 16; kp++) {
            const __m256i even = v_rows[2 * kp] != NULL ? _mm256_loadu_si256((const __m256i *)(v_rows[2 * kp] + c * 16))
                                                        : _mm256_setzero_si256();
            const __m256i odd = v_rows[2 * kp + 1] != NULL
                                    ? _mm256_loadu_si256((const __m256i *)(v_rows[2 * kp + 1] + c * 16))
                                    : _mm256_setzero_si256();
            _mm512_store_si512(pairs + kp * 16, _mm512_permutexvar_epi16(
                order, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1)));
        }
        for (int d = 0; d < 16; d++)
            _mm512_store_si512(v_tiles + (c * 16 + d) * 16,
                               _mm512_i32gather_epi32(_mm512_add_epi32(pair_rows, _mm512_set1_epi32(d)), pairs, 4));
    }
}

/* Two float32 vectors (16 lanes each) as bfloat16 pairs: dword m = (a[m], b[m]), the VNNI layout
 * of a B operand's row and of two adjacent bfloat16 columns of a row-major output. */
static inline __m512i interleave_bf16(__m512 a, __m512 b) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* The packed K/V of a call, kept for the next one: a fresh multi-megabyte allocation is fresh
 * pages from the OS each time, and their faults cost as much as the attention itself. Per calling
 * thread (the engine calls from one), grown on demand, never freed. */
static uint16_t *packed_scratch(size_t elements) {
    static __thread uint16_t *buffer;
    static __thread size_t capacity;
    if (elements > capacity || buffer == NULL) {
        free(buffer);
        capacity = elements + elements / 4 + 4096;
        buffer = aligned_alloc(64, (sizeof(uint16_t) * capacity + 63) / 64 * 64);
        if (buffer == NULL) capacity = 0;
    }
    return buffer;
}

typedef struct {
    int seq, head, q_tile;
    int64_t cost; /* keys seen times rows: the largest items are handed out first */
} work_item;

static int by_cost_descending(const void *a, const void *b) {
    const int64_t x = ((const work_item *)a)->cost, y = ((const work_item *)b)->cost;
    return (x < y) - (x > y);
}

/* The accumulator's 16-dim chunks (2 or 4) between tiles 4-7 and `acc` ([dim][row]). */
static inline void store_resident(float *acc, int v_chunks) {
    _tile_stored(4, acc, 64);
    _tile_stored(5, acc + 16 * Q_ROWS, 64);
    if (v_chunks == 4) {
        _tile_stored(6, acc + 2 * 16 * Q_ROWS, 64);
        _tile_stored(7, acc + 3 * 16 * Q_ROWS, 64);
    }
}

static inline void load_resident(const float *acc, int v_chunks) {
    _tile_loadd(4, acc, 64);
    _tile_loadd(5, acc + 16 * Q_ROWS, 64);
    if (v_chunks == 4) {
        _tile_loadd(6, acc + 2 * 16 * Q_ROWS, 64);
        _tile_loadd(7, acc + 3 * 16 * Q_ROWS, 64);
    }
}

/* Scores^T of 32 keys (K . Q^T) into tiles 0 and 1, not yet stored: the tile unit works on them
 * while the caller goes on. */
static inline void issue_scores(const uint16_t *keys, const uint32_t *q_t, int k_chunks, int head_dim) {
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < k_chunks; c++) {
        _tile_loadd(2, q_t + c * 16 * Q_ROWS, 64);
        _tile_loadd(3, keys + c * 32, head_dim * 2);
        _tile_dpbf16ps(0, 3, 2);
        _tile_loadd(3, keys + 16 * head_dim + c * 32, head_dim * 2);
        _tile_dpbf16ps(1, 3, 2);
    }
}

static inline void store_scores(float *scores) {
    _tile_stored(0, scores, 64);
    _tile_stored(1, scores + 16 * Q_ROWS, 64);
}

/* One item: query rows q_tile*16 .. +15 of one head of one sequence against its packed keys.
 * Everything runs transposed (keys or dims down, the 16 query rows across a vector's lanes), so
 * the softmax's maxima and sums over keys are lane-wise operations between vectors, never
 * reductions within one. */
static void attend_item(const uint16_t *query, int64_t query_stride, const uint16_t *packed,
                        const int32_t *tiles, int64_t tile_stride, int64_t head_offset, int q_start, int q_len, int context_len, int head,
                        int q_tile, int head_dim, float scale_log2, uint16_t *out, int num_heads) {
    const int k_chunks = head_dim / 32, v_chunks = head_dim / 16, dim_pairs = head_dim / 2;
    const int first = q_tile * Q_ROWS;
    const int rows = q_len - first < Q_ROWS ? q_len - first : Q_ROWS;
    _Alignas(64) uint32_t q_t[MAX_HEAD_DIM / 2 * Q_ROWS]; /* Q^T as VNNI: [dim pair][row] */
    _Alignas(64) float score_buffers[2][KEYS * Q_ROWS];   /* scores^T: [key][row], this tile's and the next's */
    _Alignas(64) uint32_t prob_buffers[2][KEYS / 2 * Q_ROWS]; /* P^T as VNNI: [key pair][row], by tile parity */
    _Alignas(64) float acc[MAX_HEAD_DIM * Q_ROWS];        /* out^T: [dim][row] */
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* Rows past the sequence's end read row 0 again (finite, never stored) and take the last
     * real row's position, so they see no more keys than the real rows. */
    const __m512i row_ids = _mm512_min_epi32(lanes, _mm512_set1_epi32(rows - 1));
    const __m512i positions = _mm512_add_epi32(row_ids, _mm512_set1_epi32(context_len - q_len + first));
    const __m512i q_rows = _mm512_mullo_epi32(row_ids, _mm512_set1_epi32((int)(query_stride / 2)));
    const uint32_t *q_base = (const uint32_t *)(query + (int64_t)(q_start + first) * query_stride + (int64_t)head * head_dim);
    for (int dp = 0; dp < dim_pairs; dp++)
        _mm512_store_si512(q_t + dp * Q_ROWS, _mm512_i32gather_epi32(_mm512_add_epi32(q_rows, _mm512_set1_epi32(dp)), q_base, 4));
    memset(acc, 0, sizeof(float) * Q_ROWS * head_dim);
    /* Up to 64 dims the accumulator stays in tiles 4-7 from the first key to the last; wider
     * heads keep it in memory, one 16-dim chunk through tile 4 at a time. */
    const int resident = v_chunks == 2 || v_chunks == 4;
    if (resident) load_resident(acc, v_chunks);
    __m512 running_max = _mm512_set1_ps(HIDDEN), running_sum = _mm512_setzero_ps();
    const int last_position = context_len - q_len + first + rows - 1;
    const int key_tiles = last_position / KEYS + 1;
    const __m512 scale = _mm512_set1_ps(scale_log2), hidden = _mm512_set1_ps(HIDDEN);
    /* Software-pipelined: the tile unit computes the next key tile's scores while the vector
     * units run this tile's softmax (they wait on each other only through the two score buffers),
     * instead of each idling while the other works. */
    issue_scores(packed + tiles[0] * tile_stride + head_offset, q_t, k_chunks, head_dim);
    store_scores(score_buffers[0]);
    for (int kt = 0; kt < key_tiles; kt++) {
        const uint16_t *keys = packed + tiles[kt] * tile_stride + head_offset;
        float *scores = score_buffers[kt & 1];
        if (kt + 1 < key_tiles) issue_scores(packed + tiles[kt + 1] * tile_stride + head_offset, q_t, k_chunks, head_dim);
        /* Scores stay unscaled until the exponent: scale * s - max is one FMA (scale > 0, so the
         * largest unscaled score is the largest scaled one). A masked key's score is HIDDEN. */
        const int masked = kt * KEYS + KEYS - 1 > context_len - q_len + first;
        if (masked)
            for (int i = 0; i < KEYS; i++) {
                const __mmask16 seen = _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32(kt * KEYS + i));
                _mm512_store_ps(scores + i * Q_ROWS, _mm512_mask_blend_ps(seen, hidden, _mm512_load_ps(scores + i * Q_ROWS)));
            }
        __m512 raw_max = hidden;
        for (int i = 0; i < KEYS; i++) raw_max = _mm512_max_ps(raw_max, _mm512_load_ps(scores + i * Q_ROWS));
        const __m512 tile_max = _mm512_mul_ps(raw_max, scale);
        /* The running maximum moves only when a score passes it by more than 2^8 (probabilities
         * up to 256 are exact enough in float32 and bfloat16 alike), so the accumulator is seldom
         * rescaled. Key 0 is in the first tile and seen by every row: finite from there on. */
        const __mmask16 grew = _mm512_cmp_ps_mask(tile_max, _mm512_add_ps(running_max, _mm512_set1_ps(8.0f)), _CMP_GT_OQ);
        const __m512 new_max = _mm512_mask_mov_ps(running_max, grew, tile_max);
        /* Four partial sums: one chain of 16 dependent adds would be the loop's critical path. */
        __m512 partial[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        const __m512 minus_max = _mm512_sub_ps(_mm512_setzero_ps(), new_max);
        uint32_t *probs = prob_buffers[kt & 1];
        for (int i = 0; i < KEYS; i += 2) {
            const __m512 even = exp2_nonpositive(_mm512_fmadd_ps(_mm512_load_ps(scores + i * Q_ROWS), scale, minus_max));
            const __m512 odd = exp2_nonpositive(_mm512_fmadd_ps(_mm512_load_ps(scores + (i + 1) * Q_ROWS), scale, minus_max));
            partial[(i / 2) & 3] = _mm512_add_ps(partial[(i / 2) & 3], _mm512_add_ps(even, odd));
            _mm512_store_si512(probs + (i / 2) * Q_ROWS, interleave_bf16(even, odd));
        }
        const __m512 tile_sum = _mm512_add_ps(_mm512_add_ps(partial[0], partial[1]), _mm512_add_ps(partial[2], partial[3]));
        if (grew) {
            const __m512 rescale = exp2_nonpositive(_mm512_sub_ps(running_max, new_max));
            running_sum = _mm512_mul_ps(running_sum, rescale);
            /* Before the first tile the accumulator is zeros: nothing to rescale. */
            if (kt > 0) {
                if (resident) store_resident(acc, v_chunks);
                for (int d = 0; d < head_dim; d++)
                    _mm512_store_ps(acc + d * Q_ROWS, _mm512_mul_ps(_mm512_load_ps(acc + d * Q_ROWS), rescale));
                if (resident) load_resident(acc, v_chunks);
            }
            running_max = new_max;
        }
        running_sum = _mm512_add_ps(running_sum, tile_sum);
        _tile_loadd(2, probs, 64);
        const uint16_t *values = keys + KEYS * head_dim;
        if (resident) {
            _tile_loadd(3, values, KEYS * 2);
            _tile_dpbf16ps(4, 3, 2);
            _tile_loadd(3, values + 16 * KEYS, KEYS * 2);
            _tile_dpbf16ps(5, 3, 2);
            if (v_chunks == 4) {
                _tile_loadd(3, values + 2 * 16 * KEYS, KEYS * 2);
                _tile_dpbf16ps(6, 3, 2);
                _tile_loadd(3, values + 3 * 16 * KEYS, KEYS * 2);
                _tile_dpbf16ps(7, 3, 2);
            }
        } else {
            for (int c = 0; c < v_chunks; c++) {
                _tile_loadd(4, acc + c * 16 * Q_ROWS, 64);
                _tile_loadd(3, values + c * 16 * KEYS, KEYS * 2);
                _tile_dpbf16ps(4, 3, 2);
                _tile_stored(4, acc + c * 16 * Q_ROWS, 64);
            }
        }
        if (kt + 1 < key_tiles) store_scores(score_buffers[(kt + 1) & 1]);
    }
    if (resident) store_resident(acc, v_chunks);
    /* out = out^T / sum, back to rows: adjacent dims paired into dwords, then each row's dwords
     * gathered from the pairs' columns. */
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), running_sum);
    for (int dp = 0; dp < dim_pairs; dp++)
        _mm512_store_si512(q_t + dp * Q_ROWS, interleave_bf16(_mm512_mul_ps(_mm512_load_ps(acc + (2 * dp) * Q_ROWS), inverse),
                                                              _mm512_mul_ps(_mm512_load_ps(acc + (2 * dp + 1) * Q_ROWS), inverse)));
    const __m512i columns = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(Q_ROWS));
    for (int r = 0; r < rows; r++) {
        uint32_t *dst = (uint32_t *)(out + ((int64_t)(q_start + first + r) * num_heads + head) * head_dim);
        for (int dp = 0; dp < dim_pairs; dp += 16)
            _mm512_storeu_si512(dst + dp, _mm512_i32gather_epi32(_mm512_add_epi32(columns, _mm512_set1_epi32(dp * Q_ROWS + r)), q_t, 4));
    }
}

int kvscale_paged_prefill_attention(
    const void *query, int64_t query_stride, const void *k_cache, const void *v_cache, int64_t num_blocks,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
    const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int cache_format, float k_scale, float v_scale, float scale, void *out, int num_threads) {
    if (head_dim % 32 || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads || !amx_permitted()
        || cache_format < KVSCALE_PREFILL_BF16 || cache_format > KVSCALE_PREFILL_E5M2)
        return KVSCALE_PREFILL_UNSUPPORTED;
    const float unit = cache_format == KVSCALE_PREFILL_E4M3 ? 256.0f : 1.0f;
    const int group = num_heads / num_kv_heads;
    /* Each sequence's 32-key tiles as ids of packed tiles (tiles_at: where a sequence's ids start).
     * A whole tile over the same blocks as another sequence's (a shared prefix) is packed once.
     * The tables of every used block are checked before anything is read through them. */
    int64_t *tiles_at = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (tiles_at == NULL) return KVSCALE_PREFILL_NO_MEMORY;
    int64_t num_items = 0;
    tiles_at[0] = 0;
    int status = KVSCALE_PREFILL_OK;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s], context_len = context_lens[s];
        int key_tiles = 0;
        if (q_len >= 2) {
            const int blocks = (context_len + block_size - 1) / block_size;
            if (q_len > context_len || blocks > table_stride) status = KVSCALE_PREFILL_BAD_TABLE;
            for (int b = 0; b < blocks && status == KVSCALE_PREFILL_OK; b++) {
                const int32_t block = block_tables[(int64_t)s * table_stride + b];
                if (block < 0 || block >= num_blocks) status = KVSCALE_PREFILL_BAD_TABLE;
            }
            key_tiles = (context_len + KEYS - 1) / KEYS;
            num_items += (int64_t)num_heads * ((q_len + Q_ROWS - 1) / Q_ROWS);
        }
        tiles_at[s + 1] = tiles_at[s] + key_tiles;
    }
    int32_t *tile_ids = status == KVSCALE_PREFILL_OK ? malloc(sizeof(int32_t) * (size_t)(tiles_at[num_seqs] + 1)) : NULL;
    /* Per packed tile: the sequence and step it is packed from. */
    int32_t *source = status == KVSCALE_PREFILL_OK ? malloc(sizeof(int32_t) * 2 * (size_t)(tiles_at[num_seqs] + 1)) : NULL;
    work_item *items = status == KVSCALE_PREFILL_OK ? malloc(sizeof(work_item) * (size_t)(num_items + 1)) : NULL;
    if (status == KVSCALE_PREFILL_OK && (tile_ids == NULL || source == NULL || items == NULL))
        status = KVSCALE_PREFILL_NO_MEMORY;
    int32_t num_packed = 0;
    for (int s = 0; s < num_seqs && status == KVSCALE_PREFILL_OK; s++) {
        const int32_t *table = block_tables + (int64_t)s * table_stride;
        for (int kt = 0; kt < tiles_at[s + 1] - tiles_at[s]; kt++) {
            int32_t id = -1;
            const int first_block = kt * KEYS / block_size, last_block = (kt * KEYS + KEYS - 1) / block_size;
            for (int other = 0; other < s && id < 0 && (kt + 1) * KEYS <= context_lens[s]; other++)
                if (tiles_at[other + 1] - tiles_at[other] > kt && (kt + 1) * KEYS <= context_lens[other]
                    && memcmp(table + first_block, block_tables + (int64_t)other * table_stride + first_block,
                              sizeof(int32_t) * (size_t)(last_block - first_block + 1)) == 0)
                    id = tile_ids[tiles_at[other] + kt];
            if (id < 0) {
                id = num_packed++;
                source[2 * id] = s;
                source[2 * id + 1] = kt;
            }
            tile_ids[tiles_at[s] + kt] = id;
        }
    }
    /* A packed tile: per KV head, K [32 keys][head_dim] then V^T [head_dim][32 keys]. */
    const int64_t head_stride = (int64_t)2 * KEYS * head_dim, tile_stride = head_stride * num_kv_heads;
    uint16_t *packed = status == KVSCALE_PREFILL_OK ? packed_scratch((size_t)(num_packed * tile_stride)) : NULL;
    if (status == KVSCALE_PREFILL_OK && packed == NULL) status = KVSCALE_PREFILL_NO_MEMORY;
    if (status != KVSCALE_PREFILL_OK) {
        free(tiles_at);
        free(tile_ids);
        free(source);
        free(items);
        return status;
    }
    int64_t n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 2) continue;
        for (int h = 0; h < num_heads; h++)
            for (int t = 0; t * Q_ROWS < q_len; t++) {
                const int last = context_lens[s] - q_len + (t * Q_ROWS + Q_ROWS < q_len ? t * Q_ROWS + Q_ROWS : q_len);
                items[n++] = (work_item){s, h, t, (int64_t)last};
            }
    }
    qsort(items, (size_t)num_items, sizeof(work_item), by_cost_descending);
    const float scale_log2 = scale * 1.4426950408889634f;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(dynamic, 8)
        for (int64_t i = 0; i < (int64_t)num_packed * num_kv_heads; i++) {
            const int id = (int)(i / num_kv_heads), kv_head = (int)(i % num_kv_heads), s = source[2 * id];
            const kv_source src = {k_cache, v_cache, block_tables + (int64_t)s * table_stride, context_lens[s],
                                   block_size, num_kv_heads, head_dim, cache_format, k_scale * unit, v_scale * unit};
            uint16_t *k_packed = packed + id * tile_stride + kv_head * head_stride;
            pack_keys(&src, kv_head, source[2 * id + 1], k_packed, k_packed + KEYS * head_dim);
        }
        configure_tiles();
        const unsigned int fp_mode = attention_fp_mode();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            const work_item item = items[i];
            const int s = item.seq;
            attend_item(query, query_stride, packed, tile_ids + tiles_at[s], tile_stride,
                        (int64_t)(item.head / group) * head_stride, query_start_loc[s],
                        query_start_loc[s + 1] - query_start_loc[s], context_lens[s], item.head, item.q_tile,
                        head_dim, scale_log2, out, num_heads);
        }
        _mm_setcsr(fp_mode);
        _tile_release();
    }
    free(tiles_at);
    free(tile_ids);
    free(source);
    free(items);
    return KVSCALE_PREFILL_OK;
}

int kvscale_prefill_attention_available(void) { return amx_permitted(); }

#else

int kvscale_paged_prefill_attention(
    const void *query, int64_t query_stride, const void *k_cache, const void *v_cache, int64_t num_blocks,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
    const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, int cache_format, float k_scale, float v_scale, float scale, void *out, int num_threads) {
    (void)query, (void)query_stride, (void)k_cache, (void)v_cache, (void)num_blocks, (void)block_tables;
    (void)table_stride, (void)query_start_loc, (void)context_lens, (void)num_seqs, (void)num_heads;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)cache_format, (void)k_scale, (void)v_scale;
    (void)scale, (void)out, (void)num_threads;
    return KVSCALE_PREFILL_UNSUPPORTED;
}

int kvscale_prefill_attention_available(void) { return 0; }

#endif
