/* Projections on a few bfloat16 rows with the CPU's bf16 dot products (AVX-512 BF16, no AMX):
 * y = x W^T (+ bias), the weight streamed once per call.
 *
 * Why: on a CPU with AVX-512 BF16 but no AMX tiles (AMD Zen 4 and 5), a single stream's decode
 * step and speculative decoding's verify step (1 to K + 1 rows) ran their projections on
 * oneDNN's packed GEMM, one call from Python per projection, and the decoder layers one module
 * at a time: with this kernel the layers run in one C call (cpu_step_layers.c), as on AMX.
 *
 * Layouts:
 *   weight  [n, k] bfloat16 (as uint16), row-major, as nn.Linear holds it (packing only)
 *   packed  n * k bfloat16: for every COLS output columns (block nb), for every input pair p,
 *           the block's columns' (even, odd) inputs 2p, 2p + 1: 64 values, one vector, at
 *           ((nb * k/2) + p) * 64; each block's pairs back to back, so a thread walks one
 *           contiguous stretch of memory
 *   x       [m, k] bfloat16, rows `x_stride` elements apart; out [m, n] bfloat16, contiguous
 *   bias    [n] float32 or NULL
 * n is a multiple of COLS (with silu_mul, of 2 * COLS), k even. A VDPBF16PS adds one input
 * pair's two exact products to each column's float32 sum, the pairs in order over the whole of
 * k, one sum per (row, column): a row's result does not depend on the other rows of the call, so
 * a verify step's rows are each bit for bit a one-row decode step's. Then the bias is added and
 * each value rounded to bfloat16 once, as the AMX kernel stores it (cpu_linear_amx.c), and with
 * silu_mul the gate|up halves go through cpu_silu.h's SiLU-and-multiply as they are stored.
 * Without AVX-512 BF16 in the build, the calls return UNSUPPORTED.
 */
#include <stdint.h>
#include <string.h>

#define KVSCALE_DOT_OK 0
#define KVSCALE_DOT_UNSUPPORTED 1

#if defined(__AVX512BF16__)
#include "cpu_silu.h"
#include <immintrin.h>

#define COLS 64         /* output columns per block: four vectors of 16 */
#define ROWS_PER_PASS 6 /* rows multiplied together: 24 float32 sums in registers */
#define PREFETCH_PAIRS 16 /* input pairs (256 bytes each) ahead of the one being multiplied */

int kvscale_linear_dot_available(void) { return 1; }

void kvscale_linear_dot_pack(const uint16_t *weight, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t pairs = k / 2;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / COLS; nb++)
        for (int64_t p = 0; p < pairs; p++)
            for (int c = 0; c < COLS; c++)
                for (int j = 0; j < 2; j++)
                    packed[((nb * pairs + p) * COLS + c) * 2 + j] = weight[(nb * COLS + c) * k + 2 * p + j];
}

/* Sums [rows][COLS] of `rows` (a literal, 1 to ROWS_PER_PASS) rows of x by one column block. */
static inline __attribute__((always_inline)) void block_sums(const uint16_t *x, int64_t x_stride,
                                                             const uint16_t *block, int64_t pairs, int rows,
                                                             float *sums) {
    __m512 acc[ROWS_PER_PASS][4];
    for (int r = 0; r < ROWS_PER_PASS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *w = block + p * 2 * COLS;
        /* The four lines PREFETCH_PAIRS pairs ahead, into L1. */
        for (int line = 0; line < 4; line++)
            _mm_prefetch((const char *)(w + PREFETCH_PAIRS * 2 * COLS + 32 * line), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xr);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xr);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(sums + r * COLS + 16 * c, acc[r][c]);
}

/* block_sums with the row count made a literal in each branch. */
static void block_sums_any(const uint16_t *x, int64_t x_stride, const uint16_t *block, int64_t pairs, int rows,
                           float *sums) {
    switch (rows) {
    case 1: block_sums(x, x_stride, block, pairs, 1, sums); break;
    case 2: block_sums(x, x_stride, block, pairs, 2, sums); break;
    case 3: block_sums(x, x_stride, block, pairs, 3, sums); break;
    case 4: block_sums(x, x_stride, block, pairs, 4, sums); break;
    case 5: block_sums(x, x_stride, block, pairs, 5, sums); break;
    default: block_sums(x, x_stride, block, pairs, ROWS_PER_PASS, sums); break;
    }
}

/* 16 sums plus the bias, as cpu_linear_amx.c's store_row rounds them (VCVTNEPS2BF16), widened back. */
static inline __m512 rounded16(const float *sums, const float *bias, int64_t col) {
    __m512 value = _mm512_loadu_ps(sums);
    if (bias) value = _mm512_add_ps(value, _mm512_loadu_ps(bias + col));
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(value);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

int kvscale_linear_dot(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int silu_mul, int num_threads) {
    if (n % COLS || k % 2 || (silu_mul && n % (2 * COLS))) return KVSCALE_DOT_UNSUPPORTED;
    const int64_t pairs = k / 2, col_blocks = n / COLS;
    /* silu_mul: block nb of the gate and block nb of the up half go out together as one. */
    const int64_t out_blocks = silu_mul ? col_blocks / 2 : col_blocks, width = silu_mul ? n / 2 : n;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t nb = 0; nb < out_blocks; nb++) {
        float sums[ROWS_PER_PASS * COLS], up_sums[ROWS_PER_PASS * COLS];
        const uint16_t *block = packed + nb * pairs * 2 * COLS;
        const uint16_t *up_block = packed + (nb + out_blocks) * pairs * 2 * COLS;
        for (int64_t row0 = 0; row0 < m; row0 += ROWS_PER_PASS) {
            const int rows = m - row0 < ROWS_PER_PASS ? (int)(m - row0) : ROWS_PER_PASS;
            const uint16_t *xs = x + row0 * x_stride;
            block_sums_any(xs, x_stride, block, pairs, rows, sums);
            if (silu_mul) block_sums_any(xs, x_stride, up_block, pairs, rows, up_sums);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < COLS; c += 16) {
                    const int64_t col = nb * COLS + c, at = (row0 + r) * width + col;
                    __m512 value = rounded16(sums + r * COLS + c, bias, col);
                    if (silu_mul) {
                        __m512 up = rounded16(up_sums + r * COLS + c, bias, width + col);
                        /* Opaque to the optimiser, as a store and a load would be (cpu_linear_amx.c). */
                        __asm__("" : "+v"(value), "+v"(up));
                        value = silu_mul16(value, up, 1, 0, 1);
                        store16(out, at, value, 1);
                    } else {
                        _mm256_storeu_si256((__m256i *)(out + at), (__m256i)_mm512_cvtneps_pbh(value));
                    }
                }
        }
    }
    return KVSCALE_DOT_OK;
}

#else

int kvscale_linear_dot_available(void) { return 0; }

void kvscale_linear_dot_pack(const uint16_t *weight, int64_t n, int64_t k, uint16_t *packed) {
    (void)weight, (void)n, (void)k, (void)packed;
}

int kvscale_linear_dot(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int silu_mul, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)out, (void)silu_mul;
    (void)num_threads;
    return KVSCALE_DOT_UNSUPPORTED;
}

#endif
