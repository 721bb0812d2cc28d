/* A mixture-of-experts block's experts on CPUs in one call: every (row, expert) pair of a batch
 * through its expert's gated MLP, scaled by its routing weight, and each row's pairs summed
 * (server/worker/moe.py; the contract is kernels/moe.py's).
 *
 *   for each pair p of row r and expert e, routing weight w_p:
 *     g, u = (W13_e x_r)[:I], (W13_e x_r)[I:]     each rounded to the dtype
 *     a    = silu(g) * u                          rounded
 *     y_p  = (W2_e a) * w_p                       the product rounded, then the scaled one
 *   out_r = y of r's pairs summed in ascending expert order, rounded after each addition
 *
 * Why: PyTorch runs an expert as a handful of calls (a gather, two GEMMs, SiLU, a scale, a
 * scatter-add), so a 16-row decode step, whose rows reach most experts with one or two rows each,
 * made some 250 calls per layer, each costing more in dispatch than its few rows' multiply-adds.
 * Here each expert's two matrices are read once for all its rows, in one parallel region.
 *
 * The pairs are sorted by expert (a counting sort: within an expert by row, as a stable argsort
 * orders them) and cut into tiles of at most TILE_ROWS pairs of one expert. Weights are the
 * experts' stacked [experts, 2I, hidden] and [experts, hidden, I], row-major. Three phases, a
 * barrier after each: (tile, block of I) items into a scratch of the activations, (tile, block
 * of hidden) items into y at each pair's (row, rank of its expert among the row's) place, and
 * (row, block of hidden) items summing a row's ranks into out. float32 or bfloat16 (as uint16)
 * tensors, float32 sums, bf16 rounded (to nearest even) where PyTorch's ops round. Portable C,
 * vectorised by gcc for the machine it builds for (-march=native), the dtype a literal in each
 * loop (cpu_lora.c says why), and the CPU's bf16 dot products where it has them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define KVSCALE_MOE_OK 0
#define KVSCALE_MOE_NO_MEMORY 2

#define TILE_ROWS 16
#define GROUP_ROWS 4
#define GATE_BLOCK 16
#define DOWN_BLOCK 32

static inline __attribute__((always_inline)) float moe_get(const void *base, int64_t i, int is_bf16) {
    if (!is_bf16) return ((const float *)base)[i];
    union { uint32_t u; float f; } value = { .u = (uint32_t)((const uint16_t *)base)[i] << 16 };
    return value.f;
}

static inline uint16_t moe_to_bf16(float f) {
    union { float f; uint32_t u; } value = { .f = f };
    return (uint16_t)((value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) float moe_round(float f, int is_bf16) {
    if (!is_bf16) return f;
    union { uint32_t u; float f; } value = { .u = (uint32_t)moe_to_bf16(f) << 16 };
    return value.f;
}

/* Sums of one weight row (n elements, the dtype) with `rows` (a literal, 1 to 4) vectors (the
 * dtype where `v_dtype`, else float32). */
static inline __attribute__((always_inline)) void dot_portable(const void *w, const void *const v[GROUP_ROWS],
                                                               int64_t n, float s[GROUP_ROWS], int rows,
                                                               int is_bf16, int v_dtype) {
    const int v_bf16 = is_bf16 && v_dtype;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < n; k++) {
        const float a = moe_get(w, k, is_bf16);
        s0 += a * moe_get(v[0], k, v_bf16);
        if (rows > 1) s1 += a * moe_get(v[1], k, v_bf16);
        if (rows > 2) s2 += a * moe_get(v[2], k, v_bf16);
        if (rows > 3) s3 += a * moe_get(v[3], k, v_bf16);
    }
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

#if defined(__AVX512BF16__)
/* The same in bfloat16 on both sides with the CPU's bf16 dot products (VDPBF16PS: pairs of exact
 * products into float32 lanes, as oneDNN's bf16 GEMM makes them), 32 elements a step. */
static inline __attribute__((always_inline)) void dot_bf16(const uint16_t *w, const void *const v[GROUP_ROWS],
                                                           int64_t n, float s[GROUP_ROWS], int rows) {
    /* Two chains a row (even and odd 32-element steps): one chain would wait on the previous
     * VDPBF16PS's latency at every step when a group has one or two rows. */
    __m512 a[GROUP_ROWS], b[GROUP_ROWS];
    const uint16_t *vr[GROUP_ROWS];
    for (int j = 0; j < GROUP_ROWS; j++) a[j] = b[j] = _mm512_setzero_ps(), vr[j] = v[j];
    int64_t k = 0;
    for (; k + 64 <= n; k += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int j = 0; j < rows; j++) {
            a[j] = _mm512_dpbf16_ps(a[j], w0, (__m512bh)_mm512_loadu_si512(vr[j] + k));
            b[j] = _mm512_dpbf16_ps(b[j], w1, (__m512bh)_mm512_loadu_si512(vr[j] + k + 32));
        }
    }
    for (; k + 32 <= n; k += 32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
        for (int j = 0; j < rows; j++) a[j] = _mm512_dpbf16_ps(a[j], w0, (__m512bh)_mm512_loadu_si512(vr[j] + k));
    }
    for (int j = 0; j < rows; j++) {
        float t = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
        for (int64_t i = k; i < n; i++) t += moe_get(w, i, 1) * moe_get(vr[j], i, 1);
        s[j] = t;
    }
}
#endif

/* dot_portable, or dot_bf16 where both sides are bfloat16 and the CPU has its dot products. */
static inline __attribute__((always_inline)) void dot_rows(const void *w, const void *const v[GROUP_ROWS], int64_t n,
                                                           float s[GROUP_ROWS], int rows, int is_bf16, int v_dtype) {
#if defined(__AVX512BF16__)
    if (is_bf16 && v_dtype) {
        dot_bf16((const uint16_t *)w, v, n, s, rows);
        return;
    }
#endif
    dot_portable(w, v, n, s, rows, is_bf16, v_dtype);
}

/* dot_rows with the group's row count made a literal in each branch. */
static inline __attribute__((always_inline)) void dot4(const void *w, const void *const v[GROUP_ROWS], int64_t n,
                                                       float s[GROUP_ROWS], int64_t rows, int is_bf16, int v_dtype) {
    switch (rows) {
    case 1: dot_rows(w, v, n, s, 1, is_bf16, v_dtype); break;
    case 2: dot_rows(w, v, n, s, 2, is_bf16, v_dtype); break;
    case 3: dot_rows(w, v, n, s, 3, is_bf16, v_dtype); break;
    default: dot_rows(w, v, n, s, 4, is_bf16, v_dtype); break;
    }
}

/* Activations a[p][i0 .. i0 + n) of a tile's pairs (rows of x at rows[]), into the scratch `act`
 * (the dtype, row stride inter: already rounded to it, so nothing is lost). A short group's
 * missing rows point at its first (neither multiplied nor stored). */
static inline __attribute__((always_inline)) void gate_block(
    const void *x, int64_t x_stride, const int64_t *rows, int64_t count, const void *w13, int64_t hidden,
    int64_t inter, int64_t i0, int64_t n, void *act, int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    for (int64_t g = 0; g < count; g += GROUP_ROWS) {
        const void *xr[GROUP_ROWS];
        for (int j = 0; j < GROUP_ROWS; j++)
            xr[j] = (const char *)x + rows[g + j < count ? g + j : g] * x_stride * elem;
        const int64_t rows_here = count - g < GROUP_ROWS ? count - g : GROUP_ROWS;
        for (int64_t i = i0; i < i0 + n; i++) {
            float gate[GROUP_ROWS], up[GROUP_ROWS];
            dot4((const char *)w13 + i * hidden * elem, xr, hidden, gate, rows_here, is_bf16, 1);
            dot4((const char *)w13 + (inter + i) * hidden * elem, xr, hidden, up, rows_here, is_bf16, 1);
            for (int j = 0; j < GROUP_ROWS && g + j < count; j++) {
                const float gv = moe_round(gate[j], is_bf16);
                const float a = gv / (1.0f + expf(-gv)) * moe_round(up[j], is_bf16);
                if (is_bf16) ((uint16_t *)act)[(g + j) * inter + i] = moe_to_bf16(a);
                else ((float *)act)[(g + j) * inter + i] = a;
            }
        }
    }
}

/* y[dest[p]][c0 .. c0 + n) of a tile's pairs from their activations (rows of `act`). */
static inline __attribute__((always_inline)) void down_block(
    const void *act, int64_t count, const void *w2, int64_t hidden, int64_t inter, int64_t c0, int64_t n,
    const float *weights, const int64_t *dest, void *y, int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    for (int64_t g = 0; g < count; g += GROUP_ROWS) {
        const void *ar[GROUP_ROWS];
        for (int j = 0; j < GROUP_ROWS; j++) ar[j] = (const char *)act + (g + j < count ? g + j : g) * inter * elem;
        const int64_t rows_here = count - g < GROUP_ROWS ? count - g : GROUP_ROWS;
        for (int64_t c = c0; c < c0 + n; c++) {
            float s[GROUP_ROWS];
            dot4((const char *)w2 + c * inter * elem, ar, inter, s, rows_here, is_bf16, 1);
            for (int j = 0; j < GROUP_ROWS && g + j < count; j++) {
                const float v = moe_round(moe_round(s[j], is_bf16) * weights[g + j], is_bf16);
                const int64_t at = dest[g + j] * hidden + c;
                if (is_bf16) ((uint16_t *)y)[at] = moe_to_bf16(v);
                else ((float *)y)[at] = v;
            }
        }
    }
}

/* out[r][c0 .. c0 + n) = y[r][0] + y[r][1] + ... in the dtype, rounded after each addition. */
static inline __attribute__((always_inline)) void sum_block(const void *y, int64_t k, int64_t hidden, int64_t r,
                                                            int64_t c0, int64_t n, void *out, int is_bf16) {
    float acc[DOWN_BLOCK];
    for (int64_t c = 0; c < n; c++) acc[c] = moe_get(y, (r * k) * hidden + c0 + c, is_bf16);
    for (int64_t j = 1; j < k; j++)
        for (int64_t c = 0; c < n; c++)
            acc[c] = moe_round(acc[c] + moe_get(y, (r * k + j) * hidden + c0 + c, is_bf16), is_bf16);
    for (int64_t c = 0; c < n; c++) {
        if (is_bf16) ((uint16_t *)out)[r * hidden + c0 + c] = moe_to_bf16(acc[c]);
        else ((float *)out)[r * hidden + c0 + c] = acc[c];
    }
}

static void block(const void *x, int64_t x_stride, int64_t rows, int64_t k, const int64_t *sorted_rows,
                  const float *weights, const int64_t *dest, const int64_t *tiles, int64_t num_tiles, const void *w13,
                  const void *w2, int64_t hidden, int64_t inter, char *act, void *y, void *out, int is_bf16,
                  int threads) {
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t gate_blocks = (inter + GATE_BLOCK - 1) / GATE_BLOCK;
    const int64_t down_blocks = (hidden + DOWN_BLOCK - 1) / DOWN_BLOCK;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_tiles * gate_blocks; item++) {
            const int64_t *tile = tiles + 3 * (item / gate_blocks);
            const int64_t i0 = (item % gate_blocks) * GATE_BLOCK;
            const int64_t n = inter - i0 < GATE_BLOCK ? inter - i0 : GATE_BLOCK;
            const char *w = (const char *)w13 + tile[0] * 2 * inter * hidden * elem;
            if (is_bf16)
                gate_block(x, x_stride, sorted_rows + tile[1], tile[2], w, hidden, inter, i0, n,
                           act + tile[1] * inter * elem, 1);
            else
                gate_block(x, x_stride, sorted_rows + tile[1], tile[2], w, hidden, inter, i0, n,
                           act + tile[1] * inter * elem, 0);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_tiles * down_blocks; item++) {
            const int64_t *tile = tiles + 3 * (item / down_blocks);
            const int64_t c0 = (item % down_blocks) * DOWN_BLOCK;
            const int64_t n = hidden - c0 < DOWN_BLOCK ? hidden - c0 : DOWN_BLOCK;
            const char *w = (const char *)w2 + tile[0] * hidden * inter * elem;
            if (is_bf16)
                down_block(act + tile[1] * inter * elem, tile[2], w, hidden, inter, c0, n, weights + tile[1],
                           dest + tile[1], y, 1);
            else
                down_block(act + tile[1] * inter * elem, tile[2], w, hidden, inter, c0, n, weights + tile[1],
                           dest + tile[1], y, 0);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * down_blocks; item++) {
            const int64_t r = item / down_blocks, c0 = (item % down_blocks) * DOWN_BLOCK;
            const int64_t n = hidden - c0 < DOWN_BLOCK ? hidden - c0 : DOWN_BLOCK;
            if (is_bf16) sum_block(y, k, hidden, r, c0, n, out, 1);
            else sum_block(y, k, hidden, r, c0, n, out, 0);
        }
    }
}

/* x [rows, hidden] (row stride x_stride elements); topk_ids and topk_weights [rows, k]: each
 * row's k distinct experts, each below num_experts, and their weights; w13 [num_experts,
 * 2 * inter, hidden], w2 [num_experts, hidden, inter]; out [rows, hidden]. Returns
 * KVSCALE_MOE_NO_MEMORY where the scratch could not be allocated. */
int kvscale_moe_block(const void *x, int64_t x_stride, const int64_t *topk_ids, const float *topk_weights,
                      int64_t rows, int64_t k, int64_t num_experts, const void *w13, const void *w2, int64_t hidden,
                      int64_t inter, void *out, int32_t is_bf16, int32_t threads) {
    const int64_t pairs = rows * k, elem = is_bf16 ? 2 : 4;
    if (pairs == 0) return KVSCALE_MOE_OK;
    int64_t *starts = calloc((size_t)num_experts + 1, sizeof(int64_t));
    int64_t *plan = malloc((size_t)(3 * pairs) * sizeof(int64_t));  /* sorted rows, dest, tiles */
    float *weights = malloc((size_t)pairs * sizeof(float));
    char *act = malloc((size_t)(pairs * inter * elem));
    char *y = malloc((size_t)(pairs * hidden * elem));
    if (starts == NULL || plan == NULL || weights == NULL || act == NULL || y == NULL) {
        free(starts), free(plan), free(weights), free(act), free(y);
        return KVSCALE_MOE_NO_MEMORY;
    }
    int64_t *sorted_rows = plan, *dest = plan + pairs;
    for (int64_t p = 0; p < pairs; p++) starts[topk_ids[p] + 1]++;
    for (int64_t e = 0; e < num_experts; e++) starts[e + 1] += starts[e];
    int64_t num_tiles = 0;
    for (int64_t e = 0; e < num_experts; e++) num_tiles += (starts[e + 1] - starts[e] + TILE_ROWS - 1) / TILE_ROWS;
    int64_t *tiles = num_tiles * 3 <= pairs ? plan + 2 * pairs : malloc((size_t)(3 * num_tiles) * sizeof(int64_t));
    if (tiles == NULL) {
        free(starts), free(plan), free(weights), free(act), free(y);
        return KVSCALE_MOE_NO_MEMORY;
    }
    int64_t t = 0;
    for (int64_t e = 0; e < num_experts; e++)
        for (int64_t first = starts[e]; first < starts[e + 1]; first += TILE_ROWS, t++) {
            tiles[3 * t] = e;
            tiles[3 * t + 1] = first;
            tiles[3 * t + 2] = starts[e + 1] - first < TILE_ROWS ? starts[e + 1] - first : TILE_ROWS;
        }
    for (int64_t p = 0; p < pairs; p++) {  /* row by row: each expert's pairs in row order */
        const int64_t r = p / k, e = topk_ids[p];
        int64_t rank = 0;
        for (int64_t j = 0; j < k; j++) rank += topk_ids[r * k + j] < e;
        const int64_t at = starts[e]++;
        sorted_rows[at] = r;
        dest[at] = r * k + rank;
        weights[at] = topk_weights[p];
    }
    block(x, x_stride, rows, k, sorted_rows, weights, dest, tiles, num_tiles, w13, w2, hidden, inter, act, y, out,
          is_bf16, threads);
    if (tiles != plan + 2 * pairs) free(tiles);
    free(starts), free(plan), free(weights), free(act), free(y);
    return KVSCALE_MOE_OK;
}
