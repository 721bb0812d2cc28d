/* Batched LoRA on CPUs, row by row with each row's own adapter slot only (Punica's SGMV, in C):
 * the contract of kernels/lora.py for a decode step's few rows of several adapters.
 *
 *   for each row i of slot s (r_s its rank per slice, n fused slices):
 *     h = A_s x_i                                  [n * r_s], rounded to the dtype
 *     out_i[slice j] += B_s,j h[j * r_s .. (j + 1) * r_s]   the product rounded, then the sum
 *
 * Why: PyTorch's forms either multiply every row by every resident slot's matrices in 2 + n calls
 * (kernels/lora_dense.py: 8 slots, 8 times the work) or make four calls per slot present (a
 * gather, two matmuls, a scatter); on a 16-row decode step each projection's calls and extra
 * multiply-adds cost more than its base GEMM's half. Here it is one call, each row multiplied by
 * its own slot's matrices once, each slot's matrices read once for all its rows.
 *
 * Rows come grouped as kernels/lora.py plans them: `sorted_rows` (the rows with a slot, slot by
 * slot) cut into `tiles` of (slot, start in sorted_rows, rows), all rows of a tile one slot's.
 * A slot is (A's address, B^T's address, rank per slice; rank 0: the adapter leaves the
 * projection alone, and its rows are not touched). A [n * r, in] row-major, as the adapter holds
 * it. B^T is laid out once per slot set (kernels/lora_cpu.py): slice j's block of B transposed,
 * [r, width_j], at element r * first_j, so the zero blocks of a fused projection's block-diagonal
 * B are neither stored nor multiplied and the expand runs along contiguous output columns.
 *
 * Two phases in one parallel region: the shrink over (tile, row of A) items, each A row read once
 * and dotted with the tile's rows 4 at a time, into a float32 scratch h; then the expand over
 * (tile, slice, 256-column chunk) items. float32 or bfloat16 tensors (bf16 as uint16), float32
 * accumulation; bf16 rounded (to nearest even) where PyTorch's matmuls round: h, the delta, the
 * sum. Portable C throughout: gcc vectorises the loops for the machine it builds for (-march=native,
 * AVX-512 or AVX2), the dtype a compile-time constant in each loop.
 */
#include <stdint.h>
#include <stdlib.h>

#define KVSCALE_LORA_OK 0
#define KVSCALE_LORA_NO_MEMORY 2

#define GROUP_ROWS 4
#define CHUNK 256
#define BLOCK 64

static inline __attribute__((always_inline)) float lora_get(const void *base, int64_t i, int is_bf16) {
    if (!is_bf16) return ((const float *)base)[i];
    union { uint32_t u; float f; } value = { .u = (uint32_t)((const uint16_t *)base)[i] << 16 };
    return value.f;
}

static inline uint16_t lora_to_bf16(float f) {
    union { float f; uint32_t u; } value = { .f = f };
    return (uint16_t)((value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) float lora_round(float f, int is_bf16) {
    if (!is_bf16) return f;
    union { uint32_t u; float f; } value = { .u = (uint32_t)lora_to_bf16(f) << 16 };
    return value.f;
}

/* h[p][t] for the tile's rows p (their x rows at xs[]) and one row t of A: up to 4 rows a pass,
 * a short group padded with its first row (computed, not stored). */
static inline __attribute__((always_inline)) void shrink_row(
    const void *x, int64_t x_stride, const int64_t *rows, int64_t count, const void *a_row, int64_t in,
    float *h, int64_t h_stride, int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    for (int64_t g = 0; g < count; g += GROUP_ROWS) {
        const char *xr[GROUP_ROWS];
        for (int i = 0; i < GROUP_ROWS; i++)
            xr[i] = (const char *)x + rows[g + i < count ? g + i : g] * x_stride * elem;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t k = 0; k < in; k++) {
            const float a = lora_get(a_row, k, is_bf16);
            s0 += a * lora_get(xr[0], k, is_bf16);
            s1 += a * lora_get(xr[1], k, is_bf16);
            s2 += a * lora_get(xr[2], k, is_bf16);
            s3 += a * lora_get(xr[3], k, is_bf16);
        }
        const float s[GROUP_ROWS] = {s0, s1, s2, s3};
        for (int i = 0; i < GROUP_ROWS && g + i < count; i++)
            h[(g + i) * h_stride] = lora_round(s[i], is_bf16);
    }
}

/* out[row][column .. column + width) += h_row[0..r) . bt[0..r)[0 .. width), row by row, BLOCK
 * output columns at a time: the block's sums stay in registers over the r products (a constant
 * trip count gcc vectorises whole), the last width % BLOCK columns one by one. */
static inline __attribute__((always_inline)) void expand_block(
    void *out, int64_t o, const float *hp, const void *bt, int64_t bt_stride, int64_t r, int64_t c0, int64_t n,
    int is_bf16) {
    float sum[BLOCK] = {0.0f};
    if (n == BLOCK) {
        for (int64_t t = 0; t < r; t++) {
            const float v = hp[t];
            for (int c = 0; c < BLOCK; c++) sum[c] += v * lora_get(bt, t * bt_stride + c0 + c, is_bf16);
        }
    } else {
        for (int64_t t = 0; t < r; t++)
            for (int64_t c = 0; c < n; c++) sum[c] += hp[t] * lora_get(bt, t * bt_stride + c0 + c, is_bf16);
    }
    if (is_bf16) {
        uint16_t *dst = (uint16_t *)out + o + c0;
        for (int64_t c = 0; c < n; c++) dst[c] = lora_to_bf16(lora_get(dst, c, 1) + lora_round(sum[c], 1));
    } else {
        float *dst = (float *)out + o + c0;
        for (int64_t c = 0; c < n; c++) dst[c] += sum[c];
    }
}

static inline __attribute__((always_inline)) void expand_chunk(
    void *out, int64_t out_stride, const int64_t *rows, int64_t count, const float *h, int64_t h_stride,
    const void *bt, int64_t bt_stride, int64_t r, int64_t column, int64_t width, int is_bf16) {
    for (int64_t p = 0; p < count; p++) {
        const int64_t o = rows[p] * out_stride + column;
        for (int64_t c0 = 0; c0 < width; c0 += BLOCK)
            expand_block(out, o, h + p * h_stride, bt, bt_stride, r, c0, width - c0 < BLOCK ? width - c0 : BLOCK,
                         is_bf16);
    }
}

/* A slice's chunks: item q of a tile's chunks as (slice, first column within the slice). */
static inline void chunk_of(const int64_t *slices, int32_t num_slices, int64_t q, int64_t *j, int64_t *c0) {
    for (int32_t s = 0; s < num_slices; s++) {
        const int64_t chunks = (slices[2 * s + 1] + CHUNK - 1) / CHUNK;
        if (q < chunks) {
            *j = s;
            *c0 = q * CHUNK;
            return;
        }
        q -= chunks;
    }
    *j = num_slices;  /* not reached: q is below the slices' total */
    *c0 = 0;
}

/* The dtype is tested inside the parallel region, each branch calling the loops with it as a
 * literal: the region's outlined body would otherwise see it as a runtime value, and gcc leaves
 * loops branching on one unvectorised where it has no AVX-512 masks (cpu_layer_ops.c). */
static void sgmv(const void *x, int64_t x_stride, void *out, int64_t out_stride, const int64_t *sorted_rows,
                 const int64_t *tiles, int64_t num_tiles, const int64_t *slot_table, const int64_t *slices,
                 int32_t num_slices, int64_t in, float *h, int64_t h_stride, int64_t chunks, int is_bf16,
                 int threads) {
    const int64_t shrink_items = num_tiles * h_stride, elem = is_bf16 ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < shrink_items; item++) {
            const int64_t *tile = tiles + 3 * (item / h_stride);
            const int64_t t = item % h_stride;
            const int64_t *slot = slot_table + 3 * tile[0];
            if (t >= num_slices * slot[2]) continue;  /* past this slot's rank (or no adapter) */
            const char *a_row = (const char *)(uintptr_t)slot[0] + t * in * elem;
            float *ht = h + tile[1] * h_stride + t;
            if (is_bf16) shrink_row(x, x_stride, sorted_rows + tile[1], tile[2], a_row, in, ht, h_stride, 1);
            else shrink_row(x, x_stride, sorted_rows + tile[1], tile[2], a_row, in, ht, h_stride, 0);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_tiles * chunks; item++) {
            const int64_t *tile = tiles + 3 * (item / chunks);
            const int64_t *slot = slot_table + 3 * tile[0];
            const int64_t r = slot[2];
            if (r == 0) continue;
            int64_t j, c0;
            chunk_of(slices, num_slices, item % chunks, &j, &c0);
            const int64_t first = slices[2 * j], width = slices[2 * j + 1];
            const int64_t span = width - c0 < CHUNK ? width - c0 : CHUNK;
            const char *bt = (const char *)(uintptr_t)slot[1] + (r * first + c0) * elem;
            const float *hj = h + tile[1] * h_stride + j * r;
            if (is_bf16)
                expand_chunk(out, out_stride, sorted_rows + tile[1], tile[2], hj, h_stride, bt, width, r, first + c0,
                             span, 1);
            else
                expand_chunk(out, out_stride, sorted_rows + tile[1], tile[2], hj, h_stride, bt, width, r, first + c0,
                             span, 0);
        }
    }
}

/* x [rows, in] and out [rows, out] (row strides in elements, unit column stride); slot_table
 * [slots, 3] of (A address, B^T address, rank per slice); slices [num_slices, 2] of (first output
 * column, width). Returns KVSCALE_LORA_NO_MEMORY where the scratch could not be allocated. */
int kvscale_lora_sgmv(const void *x, int64_t x_stride, void *out, int64_t out_stride, const int64_t *sorted_rows,
                      int64_t num_sorted, const int64_t *tiles, int64_t num_tiles, const int64_t *slot_table,
                      int64_t num_slots, const int64_t *slices, int32_t num_slices, int64_t in, int32_t is_bf16,
                      int32_t threads) {
    int64_t max_rank = 0, chunks = 0;
    for (int64_t s = 0; s < num_slots; s++)
        if (slot_table[3 * s + 2] > max_rank) max_rank = slot_table[3 * s + 2];
    for (int32_t j = 0; j < num_slices; j++) chunks += (slices[2 * j + 1] + CHUNK - 1) / CHUNK;
    const int64_t h_stride = num_slices * max_rank;
    if (h_stride == 0 || num_tiles == 0) return KVSCALE_LORA_OK;
    float *h = malloc((size_t)(num_sorted * h_stride) * sizeof(float));
    if (h == NULL) return KVSCALE_LORA_NO_MEMORY;
    sgmv(x, x_stride, out, out_stride, sorted_rows, tiles, num_tiles, slot_table, slices, num_slices, in, h,
         h_stride, chunks, is_bf16, threads);
    free(h);
    return KVSCALE_LORA_OK;
}
