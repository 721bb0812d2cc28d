/* Projections on AMX tiles, the weight streamed once per call: y = x W^T (+ bias), in bfloat16,
 * or in int8 (``--quantization int8``: weights per output channel, activations per row).
 *
 * Why: a batched decode step's projections read the whole model's weights (270 MB for the
 * bundled model in bfloat16) for a few dozen rows of activations. oneDNN's packed GEMM ran them
 * from memory at about half of what this VM's memory delivers (docs/engine.md, "A
 * step", step 3). Here the weight is laid out once, at load, in the exact order the kernel reads it:
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && defined(__linux__)
#include "cpu_amx.h"
#include "cpu_silu.h"
#include <omp.h>

#define COLS 32           /* output columns per block: two B tiles of 16 */
#define BLOCK_BYTES 2048  /* a block: 32 columns by 32 bf16 or 64 int8 inputs, two 1 KB B tiles */
#define ROWS_PER_PASS 32  /* activation rows per pass over a block: two A tiles */
#define ROWS_PER_GROUP 64 /* rows whose two passes take turns over each chunk of a column block */
#define K_CHUNK 4         /* blocks (8 KB) of a column block both passes multiply before the next */
#define M_CHUNK 256       /* activation rows kept in L2 while the weight is streamed once for them */
#define PREFETCH_AHEAD 4  /* blocks (8 KB) ahead of the one being multiplied, into L1 */

int kvscale_linear_amx_available(void) { return amx_permitted(); }

/* Block (nb, kb) of ``weight`` [n, k] (elements of ``size`` bytes, ``group`` of them per tile
 * row: 2 bf16 or 4 int8) into AMX's B-tile layout at packed + (nb * k_blocks + kb) * 2 KB. */
static void pack_blocks(const uint8_t *weight, int64_t n, int64_t k, int size, int group, uint8_t *packed) {
    const int depth = BLOCK_BYTES / COLS / size; /* inputs per block */
    const int64_t k_blocks = k / depth;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / COLS; nb++)
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            uint8_t *block = packed + (nb * k_blocks + kb) * BLOCK_BYTES;
            for (int half = 0; half < 2; half++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        for (int p = 0; p < group; p++) {
                            uint8_t *to = block + half * 1024 + r * 64 + (c * group + p) * size;
                            const uint8_t *from = weight + ((nb * COLS + half * 16 + c) * k + kb * depth + group * r + p) * size;
                            to[0] = from[0];
                            if (size == 2) to[1] = from[1];
                        }
        }
}

void kvscale_linear_amx_pack(const uint16_t *weight, int64_t n, int64_t k, uint16_t *packed) {
    pack_blocks((const uint8_t *)weight, n, k, 2, 2, (uint8_t *)packed);
}

void kvscale_linear_amx_int8_pack(const int8_t *weight, int64_t n, int64_t k, int8_t *packed, int32_t *column_sums) {
    pack_blocks((const uint8_t *)weight, n, k, 1, 4, (uint8_t *)packed);
    for (int64_t col = 0; col < n; col++) {
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) sum += weight[col * k + i];
        column_sums[col] = sum;
    }
}

/* The sums of up to 32 rows by a block's 32 columns live in tiles 0-3 (tiles 2 and 3 hold rows
 * 16-31, used when `two`): zeroed, or resumed from acc [32][32] where a chunk left them. */
static inline void start_sums(const int32_t *acc, int two, int resume) {
    if (resume) {
        _tile_loadd(0, acc, COLS * 4);
        _tile_loadd(1, acc + 16, COLS * 4);
        if (two) {
            _tile_loadd(2, acc + 16 * COLS, COLS * 4);
            _tile_loadd(3, acc + 16 * COLS + 16, COLS * 4);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
    }
}

static inline void store_sums(int32_t *acc, int two) {
    _tile_stored(0, acc, COLS * 4);
    _tile_stored(1, acc + 16, COLS * 4);
    if (two) {
        _tile_stored(2, acc + 16 * COLS, COLS * 4);
        _tile_stored(3, acc + 16 * COLS + 16, COLS * 4);
    }
}

/* The sums += rows `a` (16, or 32 when `two`, `row_bytes` apart) times one block (32 inputs by
 * 32 columns: float32 sums of bf16, or int32 sums of u8 x s8). */
static inline void multiply_block(const uint8_t *block, const uint8_t *a, int64_t row_bytes, int two, int int8) {
    _tile_loadd(6, block, 64);
    _tile_loadd(7, block + 1024, 64);
    _tile_loadd(4, a, row_bytes);
    if (int8) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
    } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (two) {
        _tile_loadd(5, a + 16 * row_bytes, row_bytes);
        if (int8) {
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        } else {
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* Up to 32 rows of the padded activations (`row_bytes` apart) times one column block, into acc
 * [32][32]: one pass over the block's k_blocks, each prefetched into L1 a few blocks ahead. */
static void block_product(const uint8_t *xs, int64_t row_bytes, int rows, const uint8_t *blocks, int64_t k_blocks,
                          int32_t *acc, int int8) {
    const int two = rows > 16;
    start_sums(acc, two, 0);
    for (int64_t kb = 0; kb < k_blocks; kb++) {
        const uint8_t *block = blocks + kb * BLOCK_BYTES;
        for (int line = 0; line < BLOCK_BYTES; line += 64)
            _mm_prefetch((const char *)block + PREFETCH_AHEAD * BLOCK_BYTES + line, _MM_HINT_T0);
        multiply_block(block, xs + kb * 64, row_bytes, two, int8);
    }
    store_sums(acc, two);
}

/* 33 to 64 rows times one column block, into acc [64][32]. Two whole passes would leave memory
 * idle during the second (it multiplies what the first fetched: a third of the projection's time
 * at 64 rows; docs/engine.md, "Measured and not kept"). So both passes take turns over each chunk of K_CHUNK blocks,
 * their sums parked in acc between turns, while each turn prefetches its half of the next chunk:
 * the weight keeps streaming in while the tiles multiply what is already in L1. Parking sums in
 * float32 or int32 loses nothing, so the result is the same bits as two whole passes. */
static void block_product_pair(const uint8_t *xs, int64_t row_bytes, int rows, const uint8_t *blocks,
                               int64_t k_blocks, int32_t *acc, int int8) {
    for (int64_t kb0 = 0; kb0 < k_blocks; kb0 += K_CHUNK) {
        const int64_t kb1 = kb0 + K_CHUNK < k_blocks ? kb0 + K_CHUNK : k_blocks;
        const uint8_t *next_chunk = blocks + kb1 * BLOCK_BYTES; /* past the last: the next column block's */
        for (int pass = 0; pass < 2; pass++) {
            const int two = pass == 0 || rows > ROWS_PER_PASS + 16;
            int32_t *sums = acc + pass * ROWS_PER_PASS * COLS;
            const uint8_t *a = xs + pass * ROWS_PER_PASS * row_bytes;
            start_sums(sums, two, kb0 > 0);
            for (int64_t kb = kb0; kb < kb1; kb++) {
                /* Each turn's step prefetches 1 KB: the two turns together, the next chunk. */
                const char *ahead = (const char *)next_chunk + ((kb - kb0) * 2 + pass) * (BLOCK_BYTES / 2);
                for (int line = 0; line < BLOCK_BYTES / 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
                multiply_block(blocks + kb * BLOCK_BYTES, a + kb * 64, row_bytes, two, int8);
            }
            store_sums(sums, two);
        }
    }
}

/* What turns a block's sums into output values (the bf16 or the int8 projection). */
typedef struct {
    int int8;
    const float *bias;          /* [n] or NULL */
    const int32_t *column_sums; /* int8: [n] */
    const float *w_scales;      /* int8: [n] */
    const float *x_scales;      /* int8: [m] */
    int out_bf16;
    int silu_mul;               /* the n columns are gate|up: out [m, n / 2] = silu(gate) * up */
    void *out;                  /* [m, n], or [m, n / 2] */
} epilogue;

/* A row's 32 output values of a block as float32, before their rounding to the output's dtype. */
static inline void row_values(const epilogue *e, const void *acc_row, int64_t row, int64_t col0, __m512 value[2]) {
    for (int h = 0; h < 2; h++) {
        const int64_t col = col0 + 16 * h;
        if (e->int8) {
            const __m512i zero_point = _mm512_mullo_epi32(_mm512_loadu_si512(e->column_sums + col), _mm512_set1_epi32(128));
            const __m512i sum = _mm512_sub_epi32(_mm512_load_si512((const int32_t *)acc_row + 16 * h), zero_point);
            __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(e->w_scales + col));
            /* This order of the two products wherever the values go (-ffast-math may reassociate
             * them, differently in store_row and store_silu_row). */
            __asm__("" : "+v"(scaled));
            value[h] = _mm512_mul_ps(scaled, _mm512_set1_ps(e->x_scales[row]));
        } else {
            value[h] = _mm512_load_ps((const float *)acc_row + 16 * h);
        }
        if (e->bias) value[h] = _mm512_add_ps(value[h], _mm512_loadu_ps(e->bias + col));
    }
}

static void store_row(const epilogue *e, const void *acc_row, int64_t row, int64_t n, int64_t col0) {
    __m512 value[2];
    row_values(e, acc_row, row, col0, value);
    if (e->out_bf16) {
        _mm512_storeu_si512((uint16_t *)e->out + row * n + col0, (__m512i)_mm512_cvtne2ps_pbh(value[1], value[0]));
    } else {
        _mm512_storeu_ps((float *)e->out + row * n + col0, value[0]);
        _mm512_storeu_ps((float *)e->out + row * n + col0 + 16, value[1]);
    }
}

/* 16 float32 values as store_row leaves them in a bfloat16 output, widened back. */
static inline __m512 as_stored_bf16(__m512 value) {
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(value);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* out[row, col0:col0 + 32] = silu(gate) * up from a gate block's and the matching up block's sums
 * (`width` = n / 2 output columns): gate and up rounded as store_row would store them, then
 * kvscale_silu_and_mul's arithmetic and rounding (cpu_silu.h), so the result is the same bits as
 * the projection followed by that op. */
static void store_silu_row(const epilogue *e, const void *gate_row, const void *up_row, int64_t row, int64_t width,
                           int64_t col0) {
    __m512 gate[2], up[2];
    row_values(e, gate_row, row, col0, gate);
    row_values(e, up_row, row, width + col0, up);
    for (int h = 0; h < 2; h++) {
        /* Opaque to the optimiser, as a store and a load would be: -ffast-math would otherwise fuse
         * the scaling's last multiply into SiLU's first operations and round differently. */
        __asm__("" : "+v"(gate[h]), "+v"(up[h]));
        if (e->out_bf16) {
            gate[h] = as_stored_bf16(gate[h]);
            up[h] = as_stored_bf16(up[h]);
        }
        store16(e->out, row * width + col0 + 16 * h, silu_mul16(gate[h], up[h], e->out_bf16, 0, 1), e->out_bf16);
    }
}

/* y = x W^T for rows of `row_bytes` (k inputs), the weight's blocks streamed once per 256 rows. */
static int run(const uint8_t *x, int64_t x_stride_bytes, int64_t row_bytes, uint8_t pad, const uint8_t *packed,
               int64_t m, int64_t n, const epilogue *e, int num_threads) {
    if (!amx_permitted()) return KVSCALE_LINEAR_UNSUPPORTED;
    const int64_t k_blocks = row_bytes / 64, col_blocks = n / COLS;
    /* silu_mul: block nb of the gate and block nb of the up half go out together as one. */
    if (e->silu_mul && n % (2 * COLS)) return KVSCALE_LINEAR_UNSUPPORTED;
    const int64_t out_blocks = e->silu_mul ? col_blocks / 2 : col_blocks;
    const int64_t padded_rows = ((m < M_CHUNK ? m : M_CHUNK) + 15) / 16 * 16;
    /* The activations with their rows padded to a whole A tile, by values that add nothing. */
    uint8_t *xs = aligned_alloc(64, (size_t)(padded_rows * row_bytes + 63) / 64 * 64);
    if (xs == NULL) return KVSCALE_LINEAR_NO_MEMORY;
    for (int64_t m0 = 0; m0 < m; m0 += M_CHUNK) {
        const int64_t rows = m - m0 < M_CHUNK ? m - m0 : M_CHUNK;
        const int64_t rows_padded = (rows + 15) / 16 * 16;
        for (int64_t r = 0; r < rows; r++) memcpy(xs + r * row_bytes, x + (m0 + r) * x_stride_bytes, (size_t)row_bytes);
        memset(xs + rows * row_bytes, pad, (size_t)((rows_padded - rows) * row_bytes));
#pragma omp parallel num_threads(num_threads)
        {
            configure_tiles();
            int32_t acc[ROWS_PER_GROUP * COLS] __attribute__((aligned(64)));
            int32_t up_acc[ROWS_PER_GROUP * COLS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < out_blocks; nb++) {
                const uint8_t *blocks = packed + nb * k_blocks * BLOCK_BYTES;
                const uint8_t *up_blocks = packed + (nb + out_blocks) * k_blocks * BLOCK_BYTES;
                for (int64_t row0 = 0; row0 < rows_padded; row0 += ROWS_PER_GROUP) {
                    const int tile_rows = rows_padded - row0 < ROWS_PER_GROUP ? (int)(rows_padded - row0) : ROWS_PER_GROUP;
                    void (*product)(const uint8_t *, int64_t, int, const uint8_t *, int64_t, int32_t *, int) =
                        tile_rows > ROWS_PER_PASS ? block_product_pair : block_product;
                    const uint8_t *rows_x = xs + row0 * row_bytes;
                    product(rows_x, row_bytes, tile_rows, blocks, k_blocks, acc, e->int8);
                    if (e->silu_mul) product(rows_x, row_bytes, tile_rows, up_blocks, k_blocks, up_acc, e->int8);
                    const int live = rows - row0 < tile_rows ? (int)(rows - row0) : tile_rows;
                    for (int r = 0; r < live; r++) {
                        if (e->silu_mul)
                            store_silu_row(e, acc + r * COLS, up_acc + r * COLS, m0 + row0 + r, n / 2, nb * COLS);
                        else
                            store_row(e, acc + r * COLS, m0 + row0 + r, n, nb * COLS);
                    }
                }
            }
            _tile_release();
        }
    }
    free(xs);
    return KVSCALE_LINEAR_OK;
}

int kvscale_linear_amx(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int silu_mul, int num_threads) {
    const epilogue e = {.int8 = 0, .bias = bias, .out_bf16 = 1, .silu_mul = silu_mul, .out = out};
    return run((const uint8_t *)x, x_stride * 2, k * 2, 0, (const uint8_t *)packed, m, n, &e, num_threads);
}

int kvscale_linear_amx_int8(const uint8_t *x, const float *x_scales, const int8_t *packed, const int32_t *column_sums,
                            const float *w_scales, const float *bias, int64_t m, int64_t n, int64_t k, void *out,
                            int out_bf16, int silu_mul, int num_threads) {
    const epilogue e = {.int8 = 1, .bias = bias, .column_sums = column_sums, .w_scales = w_scales,
                        .x_scales = x_scales, .out_bf16 = out_bf16, .silu_mul = silu_mul, .out = out};
    /* Padding rows of 128: zero once the +128 is taken off (and never stored anyway). */
    return run(x, k, k, 128, (const uint8_t *)packed, m, n, &e, num_threads);
}

#else

int kvscale_linear_amx_available(void) { return 0; }

void kvscale_linear_amx_pack(const uint16_t *weight, int64_t n, int64_t k, uint16_t *packed) {
    (void)weight, (void)n, (void)k, (void)packed;
}

int kvscale_linear_amx(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const float *bias, int64_t m,
                       int64_t n, int64_t k, uint16_t *out, int silu_mul, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)out, (void)silu_mul;
    (void)num_threads;
    return KVSCALE_LINEAR_UNSUPPORTED;
}

void kvscale_linear_amx_int8_pack(const int8_t *weight, int64_t n, int64_t k, int8_t *packed, int32_t *column_sums) {
    (void)weight, (void)n, (void)k, (void)packed, (void)column_sums;
}

int kvscale_linear_amx_int8(const uint8_t *x, const float *x_scales, const int8_t *packed, const int32_t *column_sums,
                            const float *w_scales, const float *bias, int64_t m, int64_t n, int64_t k, void *out,
                            int out_bf16, int silu_mul, int num_threads) {
    (void)x, (void)x_scales, (void)packed, (void)column_sums, (void)w_scales, (void)bias, (void)m, (void)n, (void)k;
    (void)out, (void)out_bf16, (void)silu_mul, (void)num_threads;
    return KVSCALE_LINEAR_UNSUPPORTED;
}

#endif
