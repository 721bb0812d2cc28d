/* The decoder layer's elementwise steps for CPUs, each fused into one pass over its rows.
 *
 * Why: in PyTorch each of these is several ops, each a full pass over activations that do not fit
 * in cache (a 2048-token prefill's MLP activations are 12 MiB in float32), so a prefill step spent
 * 14 % (float32) to 34 % (bfloat16) of its time in them. Here each is one read and one write.
 *
 * Rows are contiguous, float32 or bfloat16 (as uint16, round-to-nearest-even on store). Numerics
 * follow transformers: RMSNorm in float32, the normalised row rounded to the model dtype before
 * the weight multiplies it (as `weight * x.to(dtype)`), SiLU in float32.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Explicit AVX-512 loops where gcc's own vectorisation of the portable loops falls short (SiLU:
 * a call and register spills per 16 values around glibc's vector expf; the float32 add + RMSNorm:
 * a scalar loop). They give bit-identical results to the portable loops as gcc builds those here
 * (-O3 -ffast-math with glibc's libmvec), which the tests check on odd widths by building this
 * file again with -DKVSCALE_PORTABLE. Other CPUs (and compilers) run the portable loops. */
#if defined(__AVX512F__) && !defined(KVSCALE_PORTABLE)
#define KVSCALE_AVX512 1
#include "cpu_silu.h"
#else
#define KVSCALE_AVX512 0
#endif

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } value = { .f = f };
    /* Round to nearest even; inputs here are finite activations (NaN handling not needed). */
    return (uint16_t)((value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) float get(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void put(void *base, int64_t i, float f, int is_bf16) {
    if (is_bf16) ((uint16_t *)base)[i] = float_to_bf16(f);
    else ((float *)base)[i] = f;
}

/* The model dtype's rounding of a float32 value (identity for float32). */
static inline __attribute__((always_inline)) float round_to(float f, int is_bf16) {
    return is_bf16 ? bf16_to_float(float_to_bf16(f)) : f;
}

/* out[o + i] = silu(gate) * up for gate_up[in + i] and gate_up[in + width + i]. */
static inline __attribute__((always_inline)) void silu_and_mul_one(
    const void *gate_up, void *out, int64_t in, int64_t o, int64_t width, int64_t i, int is_bf16) {
    const float gate = get(gate_up, in + i, is_bf16);
    const float up = get(gate_up, in + width + i, is_bf16);
    /* Below gate = -88.7 exp(-gate) overflows, and the vectorised division (a reciprocal estimate,
     * then a Newton step taking 0 * inf) made gate / inf NaN; with exp capped at FLT_MAX the
     * quotient is at most |gate| / FLT_MAX in size (torch: -0). Finite exp values pass unchanged. */
    const float e = fminf(expf(-gate), FLT_MAX);
    /* torch rounds silu(gate) to the dtype before multiplying by up. */
    put(out, o + i, round_to(gate / (1.0f + e), is_bf16) * up, is_bf16);
}

#if KVSCALE_AVX512
/* 16 float32 or bfloat16 values as float32 (bf16: the 16 bits moved to the top of a float). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t i, int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float *)base + i);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    const __m512i wide = _mm512_cvtepu16_epi32(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 32 bfloat16 values as two float32 vectors: the even-indexed values and the odd-indexed ones, one
 * instruction each (widening 16 in order takes two). Elementwise math does not mind the order, and
 * store32_bf16 interleaves the results back. */
static inline __attribute__((always_inline)) void load32_bf16(const uint16_t *p, __m512 *even, __m512 *odd) {
    const __m512i pairs = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline __attribute__((always_inline)) void store32_bf16(uint16_t *p, __m512 even, __m512 odd) {
    const __m512i low = _mm512_srli_epi32(bf16_round16(even), 16);
    _mm512_storeu_si512(p, _mm512_mask_blend_epi16(0xAAAAAAAAu, low, bf16_round16(odd)));
}

/* One row, 16 or 32 values a step (is_bf16 a constant here: each dtype gets its own loop). As the
 * portable loop splits a row: 32 values at a time, one 16-value step, then the last width % 16
 * values as scalar code (glibc's scalar expf, an exact division). */
static inline __attribute__((always_inline)) void silu_and_mul_row16(
    const void *gate_up, void *out, int64_t in, int64_t o, int64_t width, int is_bf16) {
    const int64_t pairs = width - width % 32, vectors = width - width % 16;
    for (int64_t i = 0; i < pairs; i += 32) {
        if (is_bf16) {
            const uint16_t *gate = (const uint16_t *)gate_up + in + i, *up = gate + width;
            __m512 gate_even, gate_odd, up_even, up_odd;
            load32_bf16(gate, &gate_even, &gate_odd);
            load32_bf16(up, &up_even, &up_odd);
            /* exp16's range test on the 32 bf16 values as they are (bits 0x42AE: 87.0), one
             * compare for both halves. */
            const __m512i magnitudes = _mm512_and_si512(_mm512_loadu_si512(gate), _mm512_set1_epi16(0x7FFF));
            if (!_mm512_cmpgt_epu16_mask(magnitudes, _mm512_set1_epi16(EXP16_LIMIT >> 16)))
                store32_bf16((uint16_t *)out + o + i, silu_mul16(gate_even, up_even, 1, 0, 0),
                             silu_mul16(gate_odd, up_odd, 1, 0, 0));
            else
                store32_bf16((uint16_t *)out + o + i, silu_mul16(gate_even, up_even, 1, 0, 1),
                             silu_mul16(gate_odd, up_odd, 1, 0, 1));
        } else {
            for (int64_t j = i; j < i + 32; j += 16) {
                const __m512 gate = load16(gate_up, in + j, 0), up = load16(gate_up, in + width + j, 0);
                store16(out, o + j, silu_mul16(gate, up, 0, 0, 1), 0);
            }
        }
    }
    if (vectors > pairs) {
        const __m512 gate = load16(gate_up, in + pairs, is_bf16);
        const __m512 up = load16(gate_up, in + width + pairs, is_bf16);
        store16(out, o + pairs, silu_mul16(gate, up, is_bf16, 1, 1), is_bf16);
    }
    for (int64_t i = vectors; i < width; i++) {
        __asm__ volatile("");  /* keeps gcc from vectorising these (with other expf and division) */
        silu_and_mul_one(gate_up, out, in, o, width, i, is_bf16);
    }
}
#endif

static inline __attribute__((always_inline)) void silu_and_mul_rows(
    const void *gate_up, void *out, int64_t rows, int64_t width, int is_bf16, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * width, o = r * width;
#if KVSCALE_AVX512
        if (is_bf16) silu_and_mul_row16(gate_up, out, in, o, width, 1);
        else silu_and_mul_row16(gate_up, out, in, o, width, 0);
#elif !defined(__AVX512F__)
        /* The dtype as a literal in each loop: inside the parallel region's outlined body the
         * argument is a runtime value, and without AVX-512's masks gcc leaves a loop branching on
         * it unvectorised (11 ms where torch took 2.6 on an AVX2 EPYC's [2048, 2 x 1536] float32,
         * bench.cpu_kernels). */
        if (is_bf16) {
            #pragma omp simd
            for (int64_t i = 0; i < width; i++) silu_and_mul_one(gate_up, out, in, o, width, i, 1);
        } else {
            #pragma omp simd
            for (int64_t i = 0; i < width; i++) silu_and_mul_one(gate_up, out, in, o, width, i, 0);
        }
#else
        /* KVSCALE_PORTABLE on an AVX-512 CPU: the loop as gcc vectorises it there with masks, which
         * the explicit loops above reproduce bit for bit (and the tests check). */
        #pragma omp simd
        for (int64_t i = 0; i < width; i++) silu_and_mul_one(gate_up, out, in, o, width, i, is_bf16);
#endif
    }
}

/* out[r] = silu(x[r, :width]) * x[r, width:] for x [rows, 2 * width] (the fused gate|up output). */
void kvscale_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int is_bf16,
                          int num_threads) {
    if (is_bf16) silu_and_mul_rows(gate_up, out, rows, width, 1, num_threads);
    else silu_and_mul_rows(gate_up, out, rows, width, 0, num_threads);
}

/* out[base:] = weight * the row normalised, from the row's sum of squares. */
static inline __attribute__((always_inline)) void normalize_row(
    const void *source, const void *weight, void *out, int64_t base, int64_t width, float squares,
    float eps, int is_bf16) {
    const float inv = 1.0f / sqrtf(squares / (float)width + eps);
    #pragma omp simd
    for (int64_t i = 0; i < width; i++) {
        const float normed = round_to(get(source, base + i, is_bf16) * inv, is_bf16);
        put(out, base + i, get(weight, i, is_bf16) * normed, is_bf16);
    }
}

#if KVSCALE_AVX512
/* float32 with a residual. gcc leaves the portable loop's sum of squares scalar: one fused
 * multiply-add chain per row in element order (fmaf, on every tuning), latency-bound (4 cycles a
 * value) and slower than the memory it reads. The same chains, for the same bits, run here up to
 * 16 rows at a time, one row per vector lane, each step gathering one value from every row; the
 * add before and the normalisation after are plain row loops. */
static void add_rms_norm_f32_rows(const float *x, float *residual, const float *weight, float *out,
                                  int64_t rows, int64_t width, float eps, int num_threads) {
    /* 16 rows a block, fewer where that leaves a thread without one (small decode batches). */
    int64_t block = (rows + num_threads - 1) / num_threads;
    block = block > 16 ? 16 : block < 1 ? 1 : block;
    const int64_t blocks = (rows + block - 1) / block;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * block, count = rows - first < block ? rows - first : block;
        for (int64_t r = first; r < first + count; r++) {
            #pragma omp simd
            for (int64_t i = 0; i < width; i++) residual[r * width + i] += x[r * width + i];
        }
        const __mmask16 lanes = (__mmask16)((1u << count) - 1u);
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i starts = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)width));  /* row offsets */
        const float *column = residual + first * width;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < width; i++) {
            const __m512 value = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, starts, column + i, 4);
            squares = _mm512_fmadd_ps(value, value, squares);
        }
        float sums[16];
        _mm512_storeu_ps(sums, squares);
        for (int64_t r = 0; r < count; r++)
            normalize_row(residual, weight, out, (first + r) * width, width, sums[r], eps, 0);
    }
}
#endif

static inline __attribute__((always_inline)) void add_rms_norm_rows(
    const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t width,
    float eps, int is_bf16, int num_threads) {
#if KVSCALE_AVX512
    if (!is_bf16 && residual != NULL) {
        add_rms_norm_f32_rows(x, residual, weight, out, rows, width, eps, num_threads);
        return;
    }
#endif
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * width;
        float squares = 0.0f;
        if (residual != NULL) {
            /* residual += x, rounded to the dtype as torch's add is, and normalised from there.
             * The square is added by an explicit fused multiply-add: whether gcc fuses `+= sum *
             * sum` depends on -mtune (its Zen tunings up to znver3, which gcc 12 also picks for
             * Zen 5, keep scalar and 256-bit chains unfused: --param avoid-fma-max-bits), and the
             * explicit AVX-512 loop's fused chain must give these bits on every CPU. */
            #pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < width; i++) {
                const float sum = round_to(get(x, base + i, is_bf16) + get(residual, base + i, is_bf16), is_bf16);
                put(residual, base + i, sum, is_bf16);
                squares = fmaf(sum, sum, squares);
            }
        } else {
            #pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < width; i++) {
                const float value = get(x, base + i, is_bf16);
                squares += value * value;
            }
        }
        normalize_row(residual != NULL ? residual : x, weight, out, base, width, squares, eps, is_bf16);
    }
}

/* out = RMSNorm(x) * weight, or with `residual` non-NULL: residual += x, out = RMSNorm(residual)
 * * weight (the add that closes one sublayer fused with the norm that opens the next). */
void kvscale_add_rms_norm(const void *x, void *residual, const void *weight, void *out,
                          int64_t rows, int64_t width, float eps, int is_bf16, int num_threads) {
    if (is_bf16) add_rms_norm_rows(x, residual, weight, out, rows, width, eps, 1, num_threads);
    else add_rms_norm_rows(x, residual, weight, out, rows, width, eps, 0, num_threads);
}

static inline __attribute__((always_inline)) void rope_rows(
    const void *x, int64_t row_stride, const int64_t *positions, const void *cos_table,
    const void *sin_table, int64_t table_stride, void *out, int64_t tokens, int64_t heads,
    int64_t head_dim, int is_bf16, int num_threads) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t table_row = (positions != NULL ? positions[t] : t) * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t in = t * row_stride + h * head_dim, o = (t * heads + h) * head_dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = get(x, in + i, is_bf16), x2 = get(x, in + half + i, is_bf16);
                const float cos1 = get(cos_table, table_row + i, is_bf16);
                const float sin1 = get(sin_table, table_row + i, is_bf16);
                const float cos2 = get(cos_table, table_row + half + i, is_bf16);
                const float sin2 = get(sin_table, table_row + half + i, is_bf16);
                put(out, o + i, x1 * cos1 - x2 * sin1, is_bf16);
                put(out, o + half + i, x2 * cos2 + x1 * sin2, is_bf16);
            }
        }
    }
}

/* Rotary embedding of `heads` heads per token (q and k heads side by side in the fused qkv row,
 * rows `row_stride` elements apart) into a contiguous [tokens, heads, head_dim] `out`, with cos
 * and sin rows looked up by position in [max_len, head_dim] tables, or, with `positions` NULL,
 * one row per token (rotate-half layout, as transformers builds them). */
void kvscale_rope(const void *x, int64_t row_stride, const int64_t *positions, const void *cos_table,
                  const void *sin_table, int64_t table_stride, void *out, int64_t tokens,
                  int64_t heads, int64_t head_dim, int is_bf16, int num_threads) {
    if (is_bf16)
        rope_rows(x, row_stride, positions, cos_table, sin_table, table_stride, out, tokens, heads,
                  head_dim, 1, num_threads);
    else
        rope_rows(x, row_stride, positions, cos_table, sin_table, table_stride, out, tokens, heads,
                  head_dim, 0, num_threads);
}
