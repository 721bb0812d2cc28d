/* Projections on AMX tiles, the weight streamed once per call: y = x W^T (+ bias), in bfloat16,
 * or in int8 (``--quantization int8``: weights per output channel, activations per row).
 *
 * Why: a batched decode step's projections read the whole model's weights (270 MB for the
 * bundled model in bfloat16) for a few dozen rows of activations. oneDNN's packed GEMM ran them
 * from memory at about half of what this VM's memory delivers (docs/benchmarks.md, "Projections
 * on AMX"). Here the weight is laid out once, at load, in the exact order the kernel reads it:
 * for every 32 output columns, their K/32 pairs of B tiles back to back, so each thread walks
 * one contiguous stretch of memory with software prefetch ahead of it, and the activations (a
 * few hundred KB at most) stay in L2.
 *
 * Layouts:
 *   weight  [n, k] bfloat16 (as uint16), row-major, as nn.Linear holds it (packing only)
 *   packed  n * k bfloat16: block (nb, kb) of output columns 32*nb.. and inputs 32*kb.. is
 *           1024 values at ((nb * k/32) + kb) * 1024: two B tiles of 16 rows (input pairs) by
 *           16 columns, each row the 16 columns' (even, odd) input pairs (AMX's VNNI layout)
 *   x       [m, k] bfloat16, rows `x_stride` elements apart; out [m, n] bfloat16, contiguous
 *   bias    [n] float32 or NULL
 * n and k are multiples of 32. Products accumulate in float32 over the whole of k, then the
 * bias is added and each value rounded to nearest even once, as oneDNN's bf16 GEMM does.
 *
 * int8: the same walk over blocks of 32 output columns by 64 inputs (two B tiles of 16 rows of
 * input quads, AMX's int8 layout), the weight int8 [n, k] (k a multiple of 64), the activations
 * each row's int8 values stored +128 as uint8 (cpu_quantize.c) with their float32 scale. Sums
 * are exact in int32; the +128 comes off as 128 times each column's weight sum (computed at
 * packing), then y = sum * w_scale[col] * x_scale[row] + bias[col] in float32, rounded once to
 * the output's dtype.
 * Without AMX in the build (-march=native on a CPU without it) or without the OS's leave to use
 * it, the calls return UNSUPPORTED and the caller keeps oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVSCALE_LINEAR_OK 0
#define KVSCALE_LINEAR_UNSUPPORTED 1
#define KVSCALE_LINEAR_NO_MEMORY 3

#define INT8_DEPTH 64  /* int8 inputs per block: one tile's 16 rows of quads */

#define COLS 32       /* output columns per block: two B tiles */
#define DEPTH 32      /* inputs per block: one tile's 16 rows of pairs */
#define BLOCK (COLS * DEPTH)
#define ROWS_PER_PASS 32  /* activation rows per pass over a block: two A tiles */
#define M_CHUNK 256   /* activation rows kept in L2 while the weight is streamed once for them */
#define PREFETCH_AHEAD 4  /* blocks (8 KB) ahead of the one being multiplied, into L1 */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_permitted(void) {
    static int state; /* 0 unknown, 1 granted, -1 refused; a racing second ask is harmless */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tmm0-3 the accumulators (A tile 0 or 1 by B tile 0 or 1), tmm4/5 the A tiles (16 rows of
 * 32 inputs), tmm6/7 the B tiles; all 16 rows of 64 bytes. */
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

int kvscale_linear_amx_available(void) { return amx_permitted(); }

void kvscale_linear_amx_pack(const uint16_t *weight, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t k_blocks = k / DEPTH;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / COLS; nb++) {
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            uint16_t *block = packed + (nb * k_blocks + kb) * BLOCK;
            for (int half = 0; half < 2; half++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        for (int p = 0; p < 2; p++)
                            block[half * 512 + r * 32 + c * 2 + p] =
                                weight[(nb * COLS + half * 16 + c) * k + kb * DEPTH + 2 * r + p];
        }
    }
}

/* Rows [row0, row0 + rows) of the padded activations (rows <= 32) times one column block. */
static void block_product(const uint16_t *xs, int64_t k, int64_t row0, int rows, const uint16_t *blocks,
                          int64_t k_blocks, float *acc /* [32][32] */) {
    const int two = rows > 16;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < k_blocks; kb++) {
        const uint16_t *block = blocks + kb * BLOCK;
        const char *ahead = (const char *)(block + PREFETCH_AHEAD * BLOCK);
        for (int line = 0; line < BLOCK * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        _tile_loadd(6, block, 64);
        _tile_loadd(7, block + 512, 64);
        _tile_loadd(4, xs + row0 * k + kb * DEPTH, k * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xs + (row0 + 16) * k + kb * DEPTH, k * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, COLS * 4);
    _tile_stored(1, acc + 16, COLS * 4);
    if (two) {
        _tile_stored(2, acc + 16 * COLS, COLS * 4);
        _tile_stored(3, acc + 16 * COLS + 16, COLS * 4);
    }
}

int kvscale_linear_amx(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int num_threads) {
    if (!amx_permitted()) return KVSCALE_LINEAR_UNSUPPORTED;
    const int64_t k_blocks = k / DEPTH, col_blocks = n / COLS;
    const int64_t chunk_rows = m < M_CHUNK ? m : M_CHUNK;
    /* The activations with their rows padded to a whole A tile (zeros: they add nothing). */
    const int64_t padded_rows = (chunk_rows + 15) / 16 * 16;
    uint16_t *xs = aligned_alloc(64, (size_t)(padded_rows * k * 2 + 63) / 64 * 64);
    if (xs == NULL) return KVSCALE_LINEAR_NO_MEMORY;
    for (int64_t m0 = 0; m0 < m; m0 += M_CHUNK) {
        const int64_t rows = m - m0 < M_CHUNK ? m - m0 : M_CHUNK;
        const int64_t rows_padded = (rows + 15) / 16 * 16;
        for (int64_t r = 0; r < rows; r++) memcpy(xs + r * k, x + (m0 + r) * x_stride, (size_t)k * 2);
        memset(xs + rows * k, 0, (size_t)((rows_padded - rows) * k * 2));
#pragma omp parallel num_threads(num_threads)
        {
            configure_tiles();
            float acc[16 * 2 * COLS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < col_blocks; nb++) {
                const uint16_t *blocks = packed + nb * k_blocks * BLOCK;
                for (int64_t row0 = 0; row0 < rows_padded; row0 += ROWS_PER_PASS) {
                    const int tile_rows = rows_padded - row0 < ROWS_PER_PASS ? (int)(rows_padded - row0) : ROWS_PER_PASS;
                    block_product(xs, k, row0, tile_rows, blocks, k_blocks, acc);
                    const int live = rows - row0 < tile_rows ? (int)(rows - row0) : tile_rows;
                    const __m512 bias_lo = bias ? _mm512_loadu_ps(bias + nb * COLS) : _mm512_setzero_ps();
                    const __m512 bias_hi = bias ? _mm512_loadu_ps(bias + nb * COLS + 16) : _mm512_setzero_ps();
                    for (int r = 0; r < live; r++) {
                        const __m512 lo = _mm512_add_ps(_mm512_load_ps(acc + r * COLS), bias_lo);
                        const __m512 hi = _mm512_add_ps(_mm512_load_ps(acc + r * COLS + 16), bias_hi);
                        const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
                        _mm512_storeu_si512(out + (m0 + row0 + r) * n + nb * COLS, (__m512i)both);
                    }
                }
            }
            _tile_release();
        }
    }
    free(xs);
    return KVSCALE_LINEAR_OK;
}

void kvscale_linear_amx_int8_pack(const int8_t *weight, int64_t n, int64_t k, int8_t *packed, int32_t *column_sums) {
    const int64_t k_blocks = k / INT8_DEPTH;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / COLS; nb++) {
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            int8_t *block = packed + (nb * k_blocks + kb) * (COLS * INT8_DEPTH);
            for (int half = 0; half < 2; half++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        for (int p = 0; p < 4; p++)
                            block[half * 1024 + r * 64 + c * 4 + p] =
                                weight[(nb * COLS + half * 16 + c) * k + kb * INT8_DEPTH + 4 * r + p];
        }
        for (int c = 0; c < COLS; c++) {
            int32_t sum = 0;
            for (int64_t i = 0; i < k; i++) sum += weight[(nb * COLS + c) * k + i];
            column_sums[nb * COLS + c] = sum;
        }
    }
}

/* Rows [row0, row0 + rows) of the padded uint8 activations (rows <= 32) times one column block. */
static void block_product_int8(const uint8_t *xs, int64_t k, int64_t row0, int rows, const int8_t *blocks,
                               int64_t k_blocks, int32_t *acc /* [32][32] */) {
    const int two = rows > 16;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < k_blocks; kb++) {
        const int8_t *block = blocks + kb * (COLS * INT8_DEPTH);
        const char *ahead = (const char *)(block + PREFETCH_AHEAD * COLS * INT8_DEPTH);
        for (int line = 0; line < COLS * INT8_DEPTH; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
        _tile_loadd(6, block, 64);
        _tile_loadd(7, block + 1024, 64);
        _tile_loadd(4, xs + row0 * k + kb * INT8_DEPTH, k);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        if (two) {
            _tile_loadd(5, xs + (row0 + 16) * k + kb * INT8_DEPTH, k);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, acc, COLS * 4);
    _tile_stored(1, acc + 16, COLS * 4);
    if (two) {
        _tile_stored(2, acc + 16 * COLS, COLS * 4);
        _tile_stored(3, acc + 16 * COLS + 16, COLS * 4);
    }
}

int kvscale_linear_amx_int8(const uint8_t *x, const float *x_scales, const int8_t *packed, const int32_t *column_sums,
                            const float *w_scales, const float *bias, int64_t m, int64_t n, int64_t k, void *out,
                            int out_bf16, int num_threads) {
    if (!amx_permitted()) return KVSCALE_LINEAR_UNSUPPORTED;
    const int64_t k_blocks = k / INT8_DEPTH, col_blocks = n / COLS;
    const int64_t chunk_rows = m < M_CHUNK ? m : M_CHUNK;
    const int64_t padded_rows = (chunk_rows + 15) / 16 * 16;
    uint8_t *xs = aligned_alloc(64, (size_t)(padded_rows * k + 63) / 64 * 64);
    if (xs == NULL) return KVSCALE_LINEAR_NO_MEMORY;
    for (int64_t m0 = 0; m0 < m; m0 += M_CHUNK) {
        const int64_t rows = m - m0 < M_CHUNK ? m - m0 : M_CHUNK;
        const int64_t rows_padded = (rows + 15) / 16 * 16;
        memcpy(xs, x + m0 * k, (size_t)(rows * k));
        /* Padding rows of 128 (zero once the +128 is taken off): never stored anyway. */
        memset(xs + rows * k, 128, (size_t)((rows_padded - rows) * k));
#pragma omp parallel num_threads(num_threads)
        {
            configure_tiles();
            int32_t acc[16 * 2 * COLS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < col_blocks; nb++) {
                const int8_t *blocks = packed + nb * k_blocks * (COLS * INT8_DEPTH);
                const __m512i offset_lo = _mm512_mullo_epi32(_mm512_loadu_si512(column_sums + nb * COLS), _mm512_set1_epi32(128));
                const __m512i offset_hi = _mm512_mullo_epi32(_mm512_loadu_si512(column_sums + nb * COLS + 16), _mm512_set1_epi32(128));
                const __m512 scale_lo = _mm512_loadu_ps(w_scales + nb * COLS), scale_hi = _mm512_loadu_ps(w_scales + nb * COLS + 16);
                const __m512 bias_lo = bias ? _mm512_loadu_ps(bias + nb * COLS) : _mm512_setzero_ps();
                const __m512 bias_hi = bias ? _mm512_loadu_ps(bias + nb * COLS + 16) : _mm512_setzero_ps();
                for (int64_t row0 = 0; row0 < rows_padded; row0 += ROWS_PER_PASS) {
                    const int tile_rows = rows_padded - row0 < ROWS_PER_PASS ? (int)(rows_padded - row0) : ROWS_PER_PASS;
                    block_product_int8(xs, k, row0, tile_rows, blocks, k_blocks, acc);
                    const int live = rows - row0 < tile_rows ? (int)(rows - row0) : tile_rows;
                    for (int r = 0; r < live; r++) {
                        const int64_t row = m0 + row0 + r;
                        const __m512 row_scale = _mm512_set1_ps(x_scales[row]);
                        const __m512i sum_lo = _mm512_sub_epi32(_mm512_load_si512(acc + r * COLS), offset_lo);
                        const __m512i sum_hi = _mm512_sub_epi32(_mm512_load_si512(acc + r * COLS + 16), offset_hi);
                        const __m512 lo = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum_lo), scale_lo), row_scale, bias_lo);
                        const __m512 hi = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum_hi), scale_hi), row_scale, bias_hi);
                        if (out_bf16) {
                            _mm512_storeu_si512((uint16_t *)out + row * n + nb * COLS, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                        } else {
                            _mm512_storeu_ps((float *)out + row * n + nb * COLS, lo);
                            _mm512_storeu_ps((float *)out + row * n + nb * COLS + 16, hi);
                        }
                    }
                }
            }
            _tile_release();
        }
    }
    free(xs);
    return KVSCALE_LINEAR_OK;
}

#else

int kvscale_linear_amx_available(void) { return 0; }

void kvscale_linear_amx_pack(const uint16_t *weight, int64_t n, int64_t k, uint16_t *packed) {
    (void)weight, (void)n, (void)k, (void)packed;
}

int kvscale_linear_amx(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)out, (void)num_threads;
    return KVSCALE_LINEAR_UNSUPPORTED;
}

void kvscale_linear_amx_int8_pack(const int8_t *weight, int64_t n, int64_t k, int8_t *packed, int32_t *column_sums) {
    (void)weight, (void)n, (void)k, (void)packed, (void)column_sums;
}

int kvscale_linear_amx_int8(const uint8_t *x, const float *x_scales, const int8_t *packed, const int32_t *column_sums,
                            const float *w_scales, const float *bias, int64_t m, int64_t n, int64_t k, void *out,
                            int out_bf16, int num_threads) {
    (void)x, (void)x_scales, (void)packed, (void)column_sums, (void)w_scales, (void)bias, (void)m, (void)n, (void)k;
    (void)out, (void)out_bf16, (void)num_threads;
    return KVSCALE_LINEAR_UNSUPPORTED;
}

#endif
