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
 *   cache   [num_blocks, block_size, num_kv_heads, head_dim] float32, bfloat16 (as uint16) or FP8
 *           (e4m3 / e5m2 bytes: the values divided by k_scale / v_scale, kernels/fp8.py)
 *   tables  [num_seqs, table_stride] int32, context_lens [num_seqs] int32
 *   out     [num_seqs, num_heads, head_dim] float32
 * head_dim is a multiple of 16 up to 128 (the Python side sends anything else to the reference).
 * Heads h = kv_head * group + g share KV head kv_head (GQA), as in the PyTorch reference.
 * Scores and softmax are float32; two passes over the context (scores, then weighted values).
 *
 * An FP8 cache is half a bfloat16 one's bytes, and decode attention reads every cached byte of a
 * batch once per step: each tile of FP8 rows is widened in L1, once for all the query rows of its
 * GQA group, to bfloat16 for the bf16 dot products with a bfloat16 query (fp8x32_to_bf16, exact),
 * else to float32 (fp8_row_to_float: zero-extension and a shift to IEEE half-precision bits, then
 * VCVTPH2PS; e5m2 is the top byte of a half; e4m3's exponent bias is 7 where a half's is 15, so
 * its bits, moved into a half's exponent and mantissa, read 2^-8 of its value, subnormals
 * included). The 2^8 and the scales are not multiplied into every element: the K factor goes
 * into the score scale, the V factor onto each output row (sum p * (s * v) = s * sum p * v).
 *
 * On CPUs with AMX a bfloat16 or FP8 cache (bfloat16 query, blocks of whole 16-key tiles, heads of
 * 64 or 128 dims) runs on tiles instead (attend_rows_amx, below): the same two passes, with scores and
 * the value product as tile dot products and the softmax between them unchanged. Where the
 * cache is in L3 the AVX-512 path is bound by its arithmetic: a score is a dot product summed
 * across a vector's lanes, and each pair of value rows is interleaved again for every query row
 * of the GQA group.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_softmax.h"

/* bf16 dot products need the instructions (AVX-512 BF16, known from -march=native) and a compiler
 * with __builtin_shufflevector (gcc 12, clang); without either, bf16 tiles are widened instead. */
#if defined(__AVX512BF16__) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KVSCALE_BF16_DOTS 1
#endif
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 without AVX-512 (AMD's Zen 1-3, Intel's client cores): gcc lowers the 64-byte vectors of
 * the float32 loops below into register pairs that do not fit AVX2's sixteen registers, and a
 * score's lane sum into scalar adds; attend_rows then takes the 8-wide loops of scores_f32x8 and
 * weighted_values_f32x8 instead. */
#include <immintrin.h>
#define KVSCALE_AVX2_F32 1
#endif

/* The cache formats (`cache_format`; kernels/fp8.py's cache_format() gives them). */
enum { KVSCALE_F32 = 0, KVSCALE_BF16 = 1, KVSCALE_E4M3 = 2, KVSCALE_E5M2 = 3 };

static inline size_t format_bytes(int format) {
    return format == KVSCALE_F32 ? 4 : format == KVSCALE_BF16 ? 2 : 1;
}

/* What widen_tile's float32 copy of an FP8 element is worth in its value: e4m3 is read as a
 * half 2^-8 of its value (see above). */
static inline float fp8_unit(int format) {
    return format == KVSCALE_E4M3 ? 256.0f : 1.0f;
}

/* One row of `width` FP8 bytes (width a multiple of 16) to float32, times 1/fp8_unit. */
static inline __attribute__((always_inline)) void fp8_row_to_float(const uint8_t *src, int width, int format,
                                                                   float *dst) {
#if defined(__AVX512F__)
    const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7f);
    for (int d = 0; d < width; d += 16) {
        __m256i half = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + d)));
        half = format == KVSCALE_E5M2 ? _mm256_slli_epi16(half, 8)
                                      : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(half, sign), 8),
                                                        _mm256_slli_epi16(_mm256_and_si256(half, rest), 7));
        _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(half));
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    /* The same through 8-wide halves: the field-by-field loop below took 40 ms where a bfloat16
     * cache took 1.6 (decode attention, 64 sequences, an AVX2 EPYC). */
    const __m128i sign = _mm_set1_epi16(0x80), rest = _mm_set1_epi16(0x7f);
    for (int d = 0; d < width; d += 8) {
        __m128i half = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + d)));
        half = format == KVSCALE_E5M2 ? _mm_slli_epi16(half, 8)
                                      : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(half, sign), 8),
                                                     _mm_slli_epi16(_mm_and_si128(half, rest), 7));
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(half));
    }
#else
    /* Without AVX-512 or F16C: the same values from the fields (sign, exponent, mantissa). */
    const int mantissa_bits = format == KVSCALE_E5M2 ? 2 : 3, bias = format == KVSCALE_E5M2 ? 15 : 7;
    const float unit = 1.0f / fp8_unit(format);
    for (int d = 0; d < width; d++) {
        const int exponent = (src[d] & 0x7f) >> mantissa_bits, mantissa = src[d] & ((1 << mantissa_bits) - 1);
        const float magnitude = exponent == 0 ? ldexpf((float)mantissa, 1 - bias - mantissa_bits)
                                              : ldexpf((float)((1 << mantissa_bits) | mantissa), exponent - bias - mantissa_bits);
        dst[d] = (src[d] & 0x80 ? -magnitude : magnitude) * unit;
    }
#endif
}

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

/* Round to nearest even, as torch's cast does (outputs here are finite). */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } value = { .f = f };
    return (uint16_t)((value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16);
}

/* Rows of head_dim = 16 * chunks floats in vector registers (chunks <= 8). Tokens go in tiles
 * so one tile's K/V rows (of this KV head) stay in L1 while each query row of the GQA group runs
 * over them, with that row's query (or output accumulator) held in registers throughout. */
typedef float vfloat16 __attribute__((vector_size(64)));
#define TILE 32
_Static_assert(TILE == 32, "weighted_values_bf16 packs one tile of weights into one 32-wide bf16 vector");
#define MAX_CHUNKS 8

static inline __attribute__((always_inline)) vfloat16 load16(const char *row, int c) {
    vfloat16 value;
    memcpy(&value, row + (size_t)c * 64, 64);
    return value;
}

/* A bfloat16 or FP8 tile's rows widened once into `widened` (float32, `width` per row), and the
 * row pointers moved there: each row is then read by every query row of its GQA group at float32
 * speed instead of being widened once per query row. */
static inline __attribute__((always_inline)) void widen_tile(const char **rows, int tile, int width, int format,
                                                             float *widened) {
    for (int i = 0; i < tile; i++) {
        float *dst = widened + (size_t)i * width;
        if (format == KVSCALE_BF16) {
            const uint16_t *src = (const uint16_t *)rows[i];
            #pragma omp simd
            for (int d = 0; d < width; d++) dst[d] = bf16_to_float(src[d]);
        } else {
            fp8_row_to_float((const uint8_t *)rows[i], width, format, dst);
        }
        rows[i] = (const char *)dst;
    }
}

#if defined(KVSCALE_BF16_DOTS)
/* 32 FP8 values as bfloat16 bits, exactly (every e4m3 and e5m2 value is a bfloat16 one), on
 * integer lanes: a normal value's exponent and mantissa move up into bfloat16's and its exponent
 * is rebiased (+120 for e4m3's bias 7, +112 for e5m2's 15); zero and the subnormals (exponent 0),
 * which that would get wrong, are looked up by their mantissa instead (VPERMW takes the low five
 * bits, which for them are the mantissa alone). Cheaper than widening to float32 and rounding
 * back, and this conversion is all an FP8 tile costs on top of a bfloat16 one. */
static inline __attribute__((always_inline)) __m512i fp8x32_to_bf16(const uint8_t *src, int format) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x80)), 8);
    __m512i magnitude, subnormal_table;
    __mmask32 subnormal;
    if (format == KVSCALE_E4M3) {
        magnitude = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x7f)), 4),
                                     _mm512_set1_epi16(120 << 7));
        subnormal = _mm512_testn_epi16_mask(bytes, _mm512_set1_epi16(0x78));
        /* m * 2^-9 for m = 0..7: 0, 2^-9, 2^-8, 1.5 * 2^-8, 2^-7, 1.25, 1.5, 1.75 * 2^-7. */
        subnormal_table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                           0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0);
    } else {
        magnitude = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(bytes, _mm512_set1_epi16(0x7f)), 5),
                                     _mm512_set1_epi16(112 << 7));
        subnormal = _mm512_testn_epi16_mask(bytes, _mm512_set1_epi16(0x7c));
        /* m * 2^-16 for m = 0..3: 0, 2^-16, 2^-15, 1.5 * 2^-15. */
        subnormal_table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                           0, 0, 0, 0, 0x3840, 0x3800, 0x3780, 0);
    }
    magnitude = _mm512_mask_permutexvar_epi16(magnitude, subnormal, bytes, subnormal_table);
    return _mm512_or_si512(magnitude, sign);
}

#if defined(__AVX512VBMI__)
/* The bfloat16 bits of FP8 codes 0..127 (the sign is bit 7 in both), split into their high and
 * low bytes, 64 codes a register: the tables of VPERMI2B lookups (fp8x64_to_bf16; VBMI, which
 * Cooper Lake's bf16 lacks: there the integer conversion does it all). */
#define KVSCALE_FP8_LOOKUP 1
typedef struct {
    __m512i high[2], low[2];
} fp8_tables;

static inline float fp8_code_value(int code, int format) {
    const int mantissa_bits = format == KVSCALE_E5M2 ? 2 : 3, bias = format == KVSCALE_E5M2 ? 15 : 7;
    const int exponent = code >> mantissa_bits, mantissa = code & ((1 << mantissa_bits) - 1);
    return exponent == 0 ? ldexpf((float)mantissa, 1 - bias - mantissa_bits)
                         : ldexpf((float)((1 << mantissa_bits) | mantissa), exponent - bias - mantissa_bits);
}

static fp8_tables make_fp8_tables(int format) {
    _Alignas(64) uint8_t high[128], low[128];
    for (int code = 0; code < 128; code++) {
        union { float f; uint32_t u; } value = { .f = fp8_code_value(code, format) };
        high[code] = (uint8_t)(value.u >> 24); /* exact: an FP8 value has at most 3 mantissa bits */
        low[code] = (uint8_t)(value.u >> 16);
    }
    fp8_tables tables;
    for (int h = 0; h < 2; h++) {
        tables.high[h] = _mm512_load_si512(high + 64 * h);
        tables.low[h] = _mm512_load_si512(low + 64 * h);
    }
    return tables;
}

/* 64 FP8 values as bfloat16, exactly, by table: two VPERMI2B lookups (the code's low seven bits
 * pick the high and the low byte of its magnitude), the sign ORed in, and two VPERMT2B
 * interleaving the bytes into words in order: six instructions where the integer conversion
 * (fp8x32_to_bf16) takes about twenty. */
static inline __attribute__((always_inline)) void fp8x64_to_bf16(const uint8_t *src, const fp8_tables *tables,
                                                                 uint16_t *dst) {
    const __m512i codes = _mm512_loadu_si512(src);
    __m512i high = _mm512_permutex2var_epi8(tables->high[0], codes, tables->high[1]);
    const __m512i low = _mm512_permutex2var_epi8(tables->low[0], codes, tables->low[1]);
    high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8((char)0x80), 0xF8); /* high | (codes & 0x80) */
    /* Word j of the first half: low[j], high[j] (bit 6 of an index picks the second register). */
    const __m512i first = _mm512_set_epi8(
        95, 31, 94, 30, 93, 29, 92, 28, 91, 27, 90, 26, 89, 25, 88, 24, 87, 23, 86, 22, 85, 21, 84, 20, 83, 19, 82, 18,
        81, 17, 80, 16, 79, 15, 78, 14, 77, 13, 76, 12, 75, 11, 74, 10, 73, 9, 72, 8, 71, 7, 70, 6, 69, 5, 68, 4, 67, 3,
        66, 2, 65, 1, 64, 0);
    const __m512i second = _mm512_add_epi8(first, _mm512_set1_epi8(32));
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi8(low, first, high));
    _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi8(low, second, high));
}
#endif

/* An FP8 tile's rows widened to bfloat16 for the bf16 dot products; the row pointers moved there. */
static inline __attribute__((always_inline)) void widen_tile_bf16(const char **rows, int tile, int width, int format,
                                                                  const void *tables, uint16_t *widened) {
    for (int i = 0; i < tile; i++) {
        uint16_t *dst = widened + (size_t)i * width;
        const uint8_t *src = (const uint8_t *)rows[i];
        int d = 0;
#if defined(KVSCALE_FP8_LOOKUP)
        for (; d + 64 <= width; d += 64) fp8x64_to_bf16(src + d, (const fp8_tables *)tables, dst + d);
#else
        (void)tables;
#endif
        for (; d < width; d += 32) _mm512_storeu_si512(dst + d, fp8x32_to_bf16(src + d, format));
        rows[i] = (const char *)dst;
    }
}
#endif

/* Asks for every cache line of context positions t0 .. t0 + tile - 1 ahead of their use: blocks
 * lie scattered over the cache and the hardware prefetcher loses the stream at each block edge.
 * One line per 1 KiB, leaving the rest to the hardware, read 9.4 GB/s from memory on a Xeon; every
 * line, 11 GB/s (`python -m bench.cpu_kernels`, separate builds alternated; docs/engine.md,
 * "Measured and not kept"). */
static inline __attribute__((always_inline)) void prefetch_tile(
    const void *cache, int format, const int32_t *table, int t0, int tile, int block_size,
    int num_kv_heads, int head_dim) {
    const size_t elem = format_bytes(format);
    const int64_t row_bytes = (int64_t)num_kv_heads * head_dim * elem;
    for (int t = t0; t < t0 + tile;) {
        const int slot = t % block_size;
        const int in_block = block_size - slot < t0 + tile - t ? block_size - slot : t0 + tile - t;
        const char *start = (const char *)cache + ((int64_t)table[t / block_size] * block_size + slot) * row_bytes;
        for (int64_t b = 0; b < in_block * row_bytes; b += 64) __builtin_prefetch(start + b, 0, 3);
        t += in_block;
    }
}

/* Pointers to the rows (KV heads [h0, h1)) of context positions t0 .. t0 + tile - 1: into the
 * cache itself (float32; bfloat16 for the bf16 dot products), or into `widened`: copies in
 * float32, or for the bf16 dot products an FP8 tile's in bfloat16. The next tile of the n
 * positions is asked for meanwhile. */
static inline __attribute__((always_inline)) void tile_rows(
    const void *cache, int format, int bf16_dots, const void *tables, const int32_t *table, int t0, int tile, int n,
    int block_size, int num_kv_heads, int head_dim, int h0, int h1, float *widened, const char **rows) {
    const size_t elem = format_bytes(format);
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    /* One division per tile: the block and slot of each next position follow by increment. */
    int b = t0 / block_size, slot = t0 % block_size;
    const char *block = (const char *)cache
                        + (((int64_t)table[b] * block_size) * row_stride + (int64_t)h0 * head_dim) * elem;
    for (int i = 0; i < tile; i++) {
        rows[i] = block + (int64_t)slot * row_stride * elem;
        if (++slot == block_size && i + 1 < tile) {
            slot = 0;
            block = (const char *)cache
                    + (((int64_t)table[++b] * block_size) * row_stride + (int64_t)h0 * head_dim) * elem;
        }
    }
    if (t0 + TILE < n)
        prefetch_tile(cache, format, table, t0 + TILE, n - t0 - TILE < TILE ? n - t0 - TILE : TILE,
                      block_size, num_kv_heads, head_dim);
    const int width = (h1 - h0) * head_dim;
#if defined(KVSCALE_BF16_DOTS)
    if (bf16_dots) {
        if (format != KVSCALE_BF16)
            widen_tile_bf16(rows, tile, width, format, tables, (uint16_t *)widened);
        return;
    }
#else
    (void)tables;
#endif
    if (format != KVSCALE_F32) widen_tile(rows, tile, width, format, widened);
}

static inline __attribute__((always_inline)) float sum16(vfloat16 v) {
    float total = 0.0f;
    for (int i = 0; i < 16; i++) total += v[i];
    return total;
}

#if defined(KVSCALE_BF16_DOTS)
/* The lane sums of sixteen vectors as one vector (lane j: the sum of v[j]'s lanes). Each level
 * adds the halves of every vector while interleaving pairs: 15 shuffle-adds instead of sixteen
 * reductions of four, which would otherwise cost more than the dot products below. */
#define HALVES(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
static inline __attribute__((always_inline)) vfloat16 sum16x16(const vfloat16 *v) {
    vfloat16 w[8], u[4], s[2];
    for (int i = 0; i < 8; i++)
        w[i] = HALVES(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + HALVES(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        u[i] = HALVES(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + HALVES(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        s[i] = HALVES(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + HALVES(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return HALVES(s[0], s[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + HALVES(s[0], s[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* q . k over `pairs` 32-wide chunks of bfloat16 with VDPBF16PS: a bf16 x bf16 product is exact
 * in float32, so with a query that is bfloat16 itself this is the widened dot product up to
 * summation order, without widening K. */
static inline __attribute__((always_inline)) vfloat16 dot_bf16(const __m512bh *q, const char *k, int pairs) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < pairs; c++) {
        __m512bh kc;
        memcpy(&kc, k + (size_t)c * 64, 64);
        acc = _mm512_dpbf16_ps(acc, q[c], kc);
    }
    return (vfloat16)acc;
}

/* Scores of one tile of bfloat16 K rows against every query row of the task (see attend_rows). */
static inline __attribute__((always_inline)) void scores_bf16(
    const float *q, const char **k_rows, int tile, int rows, int group, int head_dim, float scale,
    float *scores, int64_t n, int t0) {
    const int pairs = head_dim / 32;
    for (int r = 0; r < rows; r++) {
        const size_t head_offset = (size_t)(r / group) * head_dim * sizeof(uint16_t);
        __m512bh qv[MAX_CHUNKS / 2];
        for (int c = 0; c < pairs; c++) {
            const float *src = q + (size_t)r * head_dim + (size_t)c * 32;
            qv[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
        float *row_scores = scores + (int64_t)r * n + t0;
        int i = 0;
        for (; i + 16 <= tile; i += 16) {
            vfloat16 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = dot_bf16(qv, k_rows[i + j] + head_offset, pairs);
            const vfloat16 sixteen = sum16x16(acc) * scale;
            memcpy(row_scores + i, &sixteen, 64);
        }
        for (; i < tile; i++) row_scores[i] = sum16(dot_bf16(qv, k_rows[i] + head_offset, pairs)) * scale;
    }
}

/* o += p . V over one tile of bfloat16 V rows with VDPBF16PS, two positions per instruction:
 * each 32-wide chunk of two rows is interleaved (t, t+1 per output element) and multiplied by
 * the pair of their probabilities, rounded to bfloat16 as SDPA's bf16 kernel rounds them before
 * its PV product. Accumulators come out in the interleave's order and are put back per tile. */
static inline __attribute__((always_inline)) void weighted_values_bf16(
    const float *scores, const char **v_rows, int tile, int rows, int group, int head_dim,
    int64_t n, int t0, float *o) {
    const int pairs = head_dim / 32;
    const __m512i first16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i last16 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int r = 0; r < rows; r++) {
        const size_t head_offset = (size_t)(r / group) * head_dim * sizeof(uint16_t);
        const float *p = scores + (int64_t)r * n + t0;
        /* The tile's weights as bf16, zero past its end (an odd tail pairs with a zero). */
        uint16_t weights[TILE];
        float padded[TILE] = {0};
        memcpy(padded, p, sizeof(float) * (size_t)tile);
        const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(padded + 16), _mm512_loadu_ps(padded));
        memcpy(weights, &packed, 64);
        __m512 low[MAX_CHUNKS / 2], high[MAX_CHUNKS / 2];
        for (int c = 0; c < pairs; c++) low[c] = high[c] = _mm512_setzero_ps();
        for (int i = 0; i < tile; i += 2) {
            const uint32_t pair = weights[i] | (uint32_t)weights[i + 1] << 16;
            __m512bh both;
            const __m512i broadcast = _mm512_set1_epi32((int)pair);
            memcpy(&both, &broadcast, 64);
            for (int c = 0; c < pairs; c++) {
                const __m512i a = _mm512_loadu_si512(v_rows[i] + head_offset + (size_t)c * 64);
                const __m512i b = i + 1 < tile ? _mm512_loadu_si512(v_rows[i + 1] + head_offset + (size_t)c * 64)
                                               : _mm512_setzero_si512();
                const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                __m512bh lo_bh, hi_bh;
                memcpy(&lo_bh, &lo, 64);
                memcpy(&hi_bh, &hi, 64);
                low[c] = _mm512_dpbf16_ps(low[c], lo_bh, both);
                high[c] = _mm512_dpbf16_ps(high[c], hi_bh, both);
            }
        }
        float *orow = o + (size_t)r * head_dim;
        for (int c = 0; c < pairs; c++) {
            float *dst = orow + (size_t)c * 32;
            _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_permutex2var_ps(low[c], first16, high[c])));
            _mm512_storeu_ps(dst + 16,
                             _mm512_add_ps(_mm512_loadu_ps(dst + 16), _mm512_permutex2var_ps(low[c], last16, high[c])));
        }
    }
}
#endif

/* Whether a call takes its scores and weighted values as bf16 dot products (the AVX-512 loops'
 * VDPBF16PS, or AMX tiles): only when the query is bfloat16 itself (rounding a float32 query
 * would change the result), the cache bfloat16 or FP8, and rows whole 32-element chunks. */
static int bf16_dots_apply(int cache_format, int query_is_bf16, int head_dim) {
#if defined(KVSCALE_BF16_DOTS)
    return cache_format >= KVSCALE_BF16 && cache_format <= KVSCALE_E5M2 && query_is_bf16 && head_dim % 32 == 0;
#else
    (void)cache_format, (void)query_is_bf16, (void)head_dim;
    return 0;
#endif
}

#if defined(KVSCALE_BF16_DOTS) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "cpu_amx.h"
#define KVSCALE_DECODE_AMX 1
/* A bfloat16 or FP8 cache's heads on AMX tiles, where the cache's blocks hold whole 16-key tiles
 * (block_size a multiple of 16) and heads are whole 64-dim value chunks. On AVX-512 each score
 * is a dot product summed across a vector's lanes and each value pair is interleaved once per
 * query row of the GQA group; here K's rows are the A operand as they lie in the cache (16 keys
 * of one block, a row stride apart), the group's query rows the columns of a B operand
 * (scores^T = K . Q^T: [key][row], 16 rows of which the group uses `group`), and a value pair is
 * interleaved once into a B operand (out = P . V, P's rows the group's). Tiles (16 rows of 64
 * bytes, configure_tiles): tmm0 scores^T, tmm1 Q^T's 32-dim chunk, tmm2 the A operand (K's
 * chunk, then P), tmm3 V's interleaved chunk, tmm4-7 out, 16 dims each, for 64 dims at a time. */

/* Asks for the tiles one and two ahead of key t0 (both at the context's start, then the second
 * each TILE keys): with the arithmetic on tiles a tile's work is too short to hide one tile's
 * fetch. */
static inline __attribute__((always_inline)) void prefetch_ahead(
    const void *cache, int format, const int32_t *table, int t0, int n, int block_size, int num_kv_heads,
    int head_dim) {
    if (t0 % TILE) return;
    for (int ahead = t0 == 0 ? TILE : 2 * TILE; ahead <= 2 * TILE; ahead += TILE)
        if (t0 + ahead < n)
            prefetch_tile(cache, format, table, t0 + ahead, n - t0 - ahead < TILE ? n - t0 - ahead : TILE, block_size,
                          num_kv_heads, head_dim);
}

/* `count` rows of `width` elements starting at `first`, `stride` bytes apart, as bfloat16: a
 * bfloat16 cache's rows where they lie, an FP8 cache's widened into `staging` (exactly; the
 * scales are applied outside). *row_stride says how far apart the returned rows are, in elements. */
static inline __attribute__((always_inline)) const uint16_t *rows_as_bf16(
    const char *first, int64_t stride, int count, int width, int format, const void *tables, uint16_t *staging,
    int64_t *row_stride) {
    if (format == KVSCALE_BF16) {
        *row_stride = stride / 2;
        return (const uint16_t *)first;
    }
    const char *rows[16];
    for (int i = 0; i < count; i++) rows[i] = first + i * stride;
    widen_tile_bf16(rows, count, width, format, tables, staging);
    *row_stride = width;
    return staging;
}

/* The scores of KV head `head` (its `group` query rows, float32 in q) against the context's
 * keys, scaled, into scores[row][t] (rows head_row .. head_row + group - 1). */
static inline __attribute__((always_inline)) void amx_scores(
    const float *q, const void *k_cache, int format, const void *tables, const int32_t *table, int n, int num_kv_heads,
    int group, int head_dim, int block_size, float scale, int head, int head_row, int prefetch, float *scores) {
    const int k_chunks = head_dim / 32;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim * format_bytes(format);
    _Alignas(64) uint16_t staging[16 * 128]; /* an FP8 tile's K rows as bfloat16 */
    _Alignas(64) uint32_t q_t[128 / 2 * 16]; /* Q^T as bf16 pairs: [dim pair][16 columns] */
    _Alignas(64) float tile_scores[16 * 16];
    memset(q_t, 0, sizeof(uint32_t) * (size_t)(head_dim / 2) * 16);
    for (int g = 0; g < group; g++) {
        const float *row = q + (size_t)(head_row + g) * head_dim;
        for (int dp = 0; dp < head_dim / 2; dp++)
            q_t[dp * 16 + g] = float_to_bf16(row[2 * dp]) | (uint32_t)float_to_bf16(row[2 * dp + 1]) << 16;
    }
    const __m512i key_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(16));
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int t0 = 0; t0 < n; t0 += 16) {
        if (prefetch) prefetch_ahead(k_cache, format, table, t0, n, block_size, num_kv_heads, head_dim);
        /* Rows past the context (to the block's end) are computed and never read. */
        int64_t key_stride;
        const uint16_t *keys = rows_as_bf16(
            (const char *)k_cache + ((int64_t)table[t0 / block_size] * block_size + t0 % block_size) * row_stride
                + (int64_t)head * head_dim * format_bytes(format),
            row_stride, 16, head_dim, format, tables, staging, &key_stride);
        _tile_zero(0);
        for (int c = 0; c < k_chunks; c++) {
            _tile_loadd(1, q_t + c * 16 * 16, 64);
            _tile_loadd(2, keys + c * 32, key_stride * 2);
            _tile_dpbf16ps(0, 2, 1);
        }
        _tile_stored(0, tile_scores, 64);
        const __mmask16 valid = n - t0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
        for (int g = 0; g < group; g++) {
            const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid,
                                                           _mm512_add_epi32(key_rows, _mm512_set1_epi32(g)),
                                                           tile_scores, 4);
            _mm512_mask_storeu_ps(scores + (int64_t)(head_row + g) * n + t0, valid, _mm512_mul_ps(column, scaled));
        }
    }
}

/* out rows head_row .. + group - 1 = P . V over the context, for KV head `head`, from the
 * normalized probabilities in scores (rounded to bfloat16, as the AVX-512 path rounds them). */
static inline __attribute__((always_inline)) void amx_values(
    const float *scores, const void *v_cache, int format, const void *tables, const int32_t *table, int n,
    int num_kv_heads, int group, int head_dim, int block_size, int head, int head_row, int prefetch, float *o) {
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim * format_bytes(format);
    _Alignas(64) uint16_t staging[16 * 64]; /* an FP8 half-step's V rows (64 dims) as bfloat16 */
    _Alignas(64) uint16_t probs[16 * 32];      /* A: [row][32 keys] */
    _Alignas(64) uint32_t values[4][16 * 16];  /* B: per 16-dim chunk (in unpack order), [key pair][dim] */
    _Alignas(64) float out[4][16 * 16];
    const __m512i first16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i last16 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    memset(probs, 0, sizeof probs);
    for (int d0 = 0; d0 < head_dim; d0 += 64) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int t0 = 0; t0 < n; t0 += 32) {
            if (prefetch && d0 == 0) prefetch_ahead(v_cache, format, table, t0, n, block_size, num_kv_heads, head_dim);
            const int keys = n - t0 < 32 ? n - t0 : 32;
            const __mmask16 low = keys >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << keys) - 1);
            const __mmask16 high = keys <= 16 ? 0 : keys >= 32 ? (__mmask16)0xFFFF : (__mmask16)((1u << (keys - 16)) - 1);
            for (int g = 0; g < group; g++) {
                const float *p = scores + (int64_t)(head_row + g) * n + t0;
                const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, p + 16), _mm512_maskz_loadu_ps(low, p));
                memcpy(probs + g * 32, &packed, 64);
            }
            /* Two keys' rows interleaved (key pair kp: dword d = V[2kp][d], V[2kp+1][d], in the
             * unpack's lane order); keys past the context are zeros, not the block's stale rows. */
            for (int half = 0; half < 2; half++) {
                /* 16 keys of one block (block_size is a multiple of 16), a row stride apart. */
                const int t = t0 + 16 * half;
                const int valid = n - t < 16 ? n - t : 16;
                int64_t stride = 0;
                const uint16_t *rows = valid > 0 ? rows_as_bf16(
                    (const char *)v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_stride
                        + ((int64_t)head * head_dim + d0) * format_bytes(format),
                    row_stride, valid, 64, format, tables, staging, &stride) : NULL;
                for (int kp = 8 * half; kp < 8 * half + 8; kp++) {
                    const int i = 2 * (kp - 8 * half);
                    for (int c = 0; c < 2; c++) {
                        const __m512i a = i < valid ? _mm512_loadu_si512(rows + i * stride + c * 32) : _mm512_setzero_si512();
                        const __m512i b = i + 1 < valid ? _mm512_loadu_si512(rows + (i + 1) * stride + c * 32)
                                                        : _mm512_setzero_si512();
                        _mm512_store_si512(values[2 * c] + kp * 16, _mm512_unpacklo_epi16(a, b));
                        _mm512_store_si512(values[2 * c + 1] + kp * 16, _mm512_unpackhi_epi16(a, b));
                    }
                }
            }
            _tile_loadd(2, probs, 64);
            _tile_loadd(3, values[0], 64);
            _tile_dpbf16ps(4, 2, 3);
            _tile_loadd(3, values[1], 64);
            _tile_dpbf16ps(5, 2, 3);
            _tile_loadd(3, values[2], 64);
            _tile_dpbf16ps(6, 2, 3);
            _tile_loadd(3, values[3], 64);
            _tile_dpbf16ps(7, 2, 3);
        }
        _tile_stored(4, out[0], 64);
        _tile_stored(5, out[1], 64);
        _tile_stored(6, out[2], 64);
        _tile_stored(7, out[3], 64);
        for (int g = 0; g < group; g++) {
            float *dst = o + (size_t)(head_row + g) * head_dim + d0;
            for (int c = 0; c < 2; c++) {
                const __m512 lo = _mm512_load_ps(out[2 * c] + g * 16), hi = _mm512_load_ps(out[2 * c + 1] + g * 16);
                _mm512_storeu_ps(dst + c * 32, _mm512_permutex2var_ps(lo, first16, hi));
                _mm512_storeu_ps(dst + c * 32 + 16, _mm512_permutex2var_ps(lo, last16, hi));
            }
        }
    }
}

/* attend_rows on AMX tiles (decode_amx_applies says when); `v_factor` as attend_rows'. */
static void attend_rows_amx(const float *q, const void *k_cache, const void *v_cache, int format, const void *tables,
                            const int32_t *table, int n, int num_kv_heads, int group, int head_dim, int block_size,
                            float scale, float v_factor, int h0, int h1, float *scores, float *o) {
    const int rows = (h1 - h0) * group;
    memset(o, 0, sizeof(float) * (size_t)rows * (size_t)head_dim);
    if (n <= 0) return;
    /* The first head's pass asks for every head's rows of the next tiles (a position's heads are
     * adjacent in the cache); the other heads find them in L2. */
    for (int h = h0; h < h1; h++)
        amx_scores(q, k_cache, format, tables, table, n, num_kv_heads, group, head_dim, block_size, scale, h,
                   (h - h0) * group, h == h0, scores);
    /* V's first tile is asked for while the softmax runs. */
    prefetch_tile(v_cache, format, table, 0, n < TILE ? n : TILE, block_size, num_kv_heads, head_dim);
    softmax_rows(scores, rows, n);
    for (int h = h0; h < h1; h++)
        amx_values(scores, v_cache, format, tables, table, n, num_kv_heads, group, head_dim, block_size, h,
                   (h - h0) * group, h == h0, o);
    if (v_factor != 1.0f) {
        #pragma omp simd
        for (size_t i = 0; i < (size_t)rows * (size_t)head_dim; i++) o[i] *= v_factor;
    }
}

/* `bf16_dots`: bf16_dots_apply's answer (a bfloat16 query over a bfloat16 or FP8 cache). */
static int decode_amx_applies(int bf16_dots, int block_size, int group, int head_dim) {
    return bf16_dots && block_size % 16 == 0 && group <= 16 && head_dim % 64 == 0 && head_dim <= 128
           && amx_permitted();
}
#endif

#if defined(KVSCALE_AVX2_F32)
/* Eight lane sums as one vector (lane j: the sum of v[j]'s lanes): three rounds of pairwise adds
 * within 128-bit halves, then the halves added, about a third of eight separate reductions. */
static inline __attribute__((always_inline)) __m256 sum8x8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    /* ab: the low halves' sums of v0..v3, then their high halves'; cd the same for v4..v7. */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

static inline __attribute__((always_inline)) float sum8(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

/* Scores of one tile of float32 K rows against every query row of the task, eight keys at a
 * time: eight accumulators, one per key, over the head's 8-wide chunks, then one transposing sum. */
static inline __attribute__((always_inline)) void scores_f32x8(
    const float *q, const char **k_rows, int tile, int rows, int group, int head_dim, float scale,
    float *scores, int64_t n, int t0) {
    const __m256 scaled = _mm256_set1_ps(scale);
    for (int r = 0; r < rows; r++) {
        const size_t head_offset = (size_t)(r / group) * head_dim * sizeof(float);
        const float *qr = q + (size_t)r * head_dim;
        float *row_scores = scores + (int64_t)r * n + t0;
        int i = 0;
        for (; i + 8 <= tile; i += 8) {
            const float *k[8];
            for (int j = 0; j < 8; j++) k[j] = (const float *)(k_rows[i + j] + head_offset);
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int d = 0; d < head_dim; d += 8) {
                const __m256 qd = _mm256_loadu_ps(qr + d);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + d), acc[j]);
            }
            _mm256_storeu_ps(row_scores + i, _mm256_mul_ps(sum8x8(acc), scaled));
        }
        for (; i < tile; i++) {
            const float *k = (const float *)(k_rows[i] + head_offset);
            __m256 acc = _mm256_setzero_ps();
            for (int d = 0; d < head_dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(k + d), acc);
            row_scores[i] = sum8(acc) * scale;
        }
    }
}

/* o += p . V over one tile of float32 V rows, 64 output dims at a time (eight accumulators). */
static inline __attribute__((always_inline)) void weighted_values_f32x8(
    const float *scores, const char **v_rows, int tile, int rows, int group, int head_dim, int64_t n, int t0,
    float *o) {
    for (int r = 0; r < rows; r++) {
        const size_t head_offset = (size_t)(r / group) * head_dim * sizeof(float);
        const float *p = scores + (int64_t)r * n + t0;
        float *orow = o + (size_t)r * head_dim;
        for (int d0 = 0; d0 < head_dim; d0 += 64) {
            const int width = head_dim - d0 < 64 ? head_dim - d0 : 64;
            __m256 acc[8];
            for (int c = 0; c < width / 8; c++) acc[c] = _mm256_loadu_ps(orow + d0 + 8 * c);
            for (int i = 0; i < tile; i++) {
                const __m256 weight = _mm256_set1_ps(p[i]);
                const float *v = (const float *)(v_rows[i] + head_offset) + d0;
                for (int c = 0; c < width / 8; c++) acc[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * c), acc[c]);
            }
            for (int c = 0; c < width / 8; c++) _mm256_storeu_ps(orow + d0 + 8 * c, acc[c]);
        }
    }
}
#endif

/* `v_factor`: what each output row is multiplied by at the end (an FP8 cache's V scale; 1 for the
 * others); an FP8 cache's K factor is in `scale` already. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, const void *k_cache, const void *v_cache, int format, int bf16_dots, const void *tables,
    const int32_t *table, int n, int num_kv_heads, int group, int chunks, int block_size, float scale,
    float v_factor, int h0, int h1, float *scores, float *widened, float *o) {
    const int head_dim = chunks * 16;
    const int rows = (h1 - h0) * group;
    const char *k_rows[TILE], *v_rows[TILE];
    memset(o, 0, sizeof(float) * (size_t)rows * (size_t)head_dim);
    if (n <= 0) return;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int tile = n - t0 < TILE ? n - t0 : TILE;
        tile_rows(k_cache, format, bf16_dots, tables, table, t0, tile, n, block_size, num_kv_heads, head_dim, h0, h1,
                  widened, k_rows);
#if defined(KVSCALE_BF16_DOTS)
        if (bf16_dots) {
            scores_bf16(q, k_rows, tile, rows, group, head_dim, scale, scores, n, t0);
            continue;
        }
#endif
#if defined(KVSCALE_AVX2_F32)
        scores_f32x8(q, k_rows, tile, rows, group, head_dim, scale, scores, n, t0);
        continue;
#endif
        for (int r = 0; r < rows; r++) {
            const size_t head_offset = (size_t)(r / group) * head_dim * sizeof(float);
            vfloat16 qv[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) memcpy(&qv[c], q + (size_t)r * head_dim + c * 16, 64);
            for (int i = 0; i < tile; i++) {
                const char *k = k_rows[i] + head_offset;
                vfloat16 acc = qv[0] * load16(k, 0);
                for (int c = 1; c < chunks; c++) acc += qv[c] * load16(k, c);
                scores[(int64_t)r * n + t0 + i] = sum16(acc) * scale;
            }
        }
    }
    softmax_rows(scores, rows, n);
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int tile = n - t0 < TILE ? n - t0 : TILE;
        tile_rows(v_cache, format, bf16_dots, tables, table, t0, tile, n, block_size, num_kv_heads, head_dim, h0, h1,
                  widened, v_rows);
#if defined(KVSCALE_BF16_DOTS)
        if (bf16_dots) {
            weighted_values_bf16(scores, v_rows, tile, rows, group, head_dim, n, t0, o);
            continue;
        }
#endif
#if defined(KVSCALE_AVX2_F32)
        weighted_values_f32x8(scores, v_rows, tile, rows, group, head_dim, n, t0, o);
        continue;
#endif
        for (int r = 0; r < rows; r++) {
            const size_t head_offset = (size_t)(r / group) * head_dim * sizeof(float);
            const float *p = scores + (int64_t)r * n + t0;
            float *orow = o + (size_t)r * head_dim;
            vfloat16 ov[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) memcpy(&ov[c], orow + c * 16, 64);
            for (int i = 0; i < tile; i++) {
                const char *v = v_rows[i] + head_offset;
                for (int c = 0; c < chunks; c++) ov[c] += p[i] * load16(v, c);
            }
            for (int c = 0; c < chunks; c++) memcpy(orow + c * 16, &ov[c], 64);
        }
    }
    if (v_factor != 1.0f) {
        #pragma omp simd
        for (size_t i = 0; i < (size_t)rows * (size_t)head_dim; i++) o[i] *= v_factor;
    }
}

/* Returns 0 on success; before touching anything, KVSCALE_BAD_TABLE if a context needs more
 * blocks than its table row has or a used entry is not a block of the cache (an out-of-range read
 * would crash the process instead of raising), KVSCALE_BAD_FORMAT for an unknown cache format;
 * KVSCALE_NO_MEMORY if a score buffer failed. */
enum { KVSCALE_OK = 0, KVSCALE_NO_MEMORY = 1, KVSCALE_BAD_TABLE = 2, KVSCALE_BAD_FORMAT = 3 };

/* With io_bf16, `query` and `out` are bfloat16 arrays (the model's own q and attention output,
 * each task's rows widened and rounded back here instead of by two tensor casts per layer);
 * otherwise float32. query_is_bf16 says the query's values are bfloat16 ones (always so with
 * io_bf16). */
int kvscale_paged_decode_attention(
    const void *query, const void *k_cache, const void *v_cache, int cache_format, int query_is_bf16,
    int64_t num_blocks, const int32_t *block_tables, int64_t table_stride,
    const int32_t *context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, float k_scale, float v_scale, void *out, int io_bf16, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int cache_is_fp8 = cache_format >= KVSCALE_E4M3;
    const int bf16_dots = bf16_dots_apply(cache_format, query_is_bf16, head_dim);
    /* The FP8 factors out of the elements (see the top of the file): the scales, and 2^8 where
     * e4m3 is widened to float32 through half precision; other caches have none. */
    const float unit = bf16_dots ? 1.0f : fp8_unit(cache_format);
    const float k_factor = cache_is_fp8 ? k_scale * unit : 1.0f;
    const float v_factor = cache_is_fp8 ? v_scale * unit : 1.0f;
    const float score_scale = scale * k_factor;
#if defined(KVSCALE_FP8_LOOKUP)
    fp8_tables fp8_lookup;
    const void *tables = NULL;
    if (bf16_dots && cache_is_fp8) {
        fp8_lookup = make_fp8_tables(cache_format);
        tables = &fp8_lookup;
    }
#else
    const void *tables = NULL;
#endif
    if (cache_format < KVSCALE_F32 || cache_format > KVSCALE_E5M2) return KVSCALE_BAD_FORMAT;
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
#if defined(KVSCALE_DECODE_AMX)
    const int use_amx = decode_amx_applies(bf16_dots, block_size, group, head_dim);
#endif

    /* Whole sequences (all KV heads: one contiguous sweep over each block) when there are enough
     * of them to share out; otherwise one task per (sequence, KV head) to keep every thread busy. */
    const int heads_per_task = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
    const int tasks_per_seq = num_kv_heads / heads_per_task;

    #pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const size_t rows = (size_t)heads_per_task * (size_t)group;
        float *scores = malloc(sizeof(float) * rows * (size_t)(max_len > 0 ? max_len : 1));
        float *widened = malloc(sizeof(float) * TILE * (size_t)heads_per_task * (size_t)head_dim);
        float *rows_io = io_bf16 ? malloc(sizeof(float) * 2 * rows * (size_t)head_dim) : NULL;
        if (scores == NULL || widened == NULL || (io_bf16 && rows_io == NULL)) failed = KVSCALE_NO_MEMORY;
#if defined(KVSCALE_DECODE_AMX)
        if (use_amx) configure_tiles();
#endif

        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)num_seqs * tasks_per_seq; task++) {
            if (failed != KVSCALE_OK) continue;
            const int s = (int)(task / tasks_per_seq);
            const int h0 = (int)(task % tasks_per_seq) * heads_per_task;
            const int64_t first_row = (int64_t)s * num_heads + (int64_t)h0 * group;
            const size_t task_elems = rows * (size_t)head_dim;
            const float *q = (const float *)query + first_row * head_dim;
            float *o = (float *)out + first_row * head_dim;
            if (io_bf16) {
                const uint16_t *src = (const uint16_t *)query + first_row * head_dim;
                float *widened_q = rows_io;
                for (size_t i = 0; i < task_elems; i++) widened_q[i] = bf16_to_float(src[i]);
                q = widened_q;
                o = rows_io + task_elems;
            }
            const int32_t *table = block_tables + (int64_t)s * table_stride;
            const int n = context_lens[s];
            const int h1 = h0 + heads_per_task;
            /* Constant chunk counts and formats for the common head sizes let the compiler unroll
             * fully and drop the other formats' branches. */
#define ATTEND(format, dots, chunks) attend_rows(q, k_cache, v_cache, format, dots, tables, table, n, num_kv_heads, group, \
                                                 chunks, block_size, score_scale, v_factor, h0, h1, scores, widened, o)
/* Every (format, bf16 dots) pair for one constant chunk count; FP8 without bf16 dots (a float32
 * query) and float32 go through the float32 path. */
#define ATTEND_ANY_FORMAT(chunks)                                                                        \
    do {                                                                                                 \
        if (cache_format == KVSCALE_BF16 && bf16_dots) ATTEND(KVSCALE_BF16, 1, chunks);                  \
        else if (cache_format == KVSCALE_BF16) ATTEND(KVSCALE_BF16, 0, chunks);                          \
        else if (cache_format == KVSCALE_E4M3 && bf16_dots) ATTEND(KVSCALE_E4M3, 1, chunks);             \
        else if (cache_format == KVSCALE_E5M2 && bf16_dots) ATTEND(KVSCALE_E5M2, 1, chunks);             \
        else if (cache_format == KVSCALE_E4M3) ATTEND(KVSCALE_E4M3, 0, chunks);                          \
        else if (cache_format == KVSCALE_E5M2) ATTEND(KVSCALE_E5M2, 0, chunks);                          \
        else ATTEND(KVSCALE_F32, 0, chunks);                                                             \
    } while (0)
#if defined(KVSCALE_DECODE_AMX)
            if (use_amx)
                attend_rows_amx(q, k_cache, v_cache, cache_format, tables, table, n, num_kv_heads, group, head_dim,
                                block_size, score_scale, v_factor, h0, h1, scores, o);
            else
#endif
            if (head_dim == 64) ATTEND_ANY_FORMAT(4);
            else if (head_dim == 128) ATTEND_ANY_FORMAT(8);
            else ATTEND(cache_format, bf16_dots, head_dim / 16);
#undef ATTEND_ANY_FORMAT
#undef ATTEND
            if (io_bf16) {
                uint16_t *dst = (uint16_t *)out + first_row * head_dim;
                for (size_t i = 0; i < task_elems; i++) dst[i] = float_to_bf16(o[i]);
            }
        }
#if defined(KVSCALE_DECODE_AMX)
        if (use_amx) _tile_release();
#endif
        free(scores);
        free(widened);
        free(rows_io);
    }
    return failed;
}

/* Whether a call with these shapes runs on AMX tiles (attend_rows_amx) here. */
int kvscale_decode_attention_on_amx(int cache_format, int query_is_bf16, int block_size, int num_heads,
                                    int num_kv_heads, int head_dim) {
#if defined(KVSCALE_DECODE_AMX)
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0
           && decode_amx_applies(bf16_dots_apply(cache_format, query_is_bf16, head_dim), block_size,
                                 num_heads / num_kv_heads, head_dim);
#else
    (void)cache_format, (void)query_is_bf16, (void)block_size, (void)num_heads, (void)num_kv_heads, (void)head_dim;
    return 0;
#endif
}
