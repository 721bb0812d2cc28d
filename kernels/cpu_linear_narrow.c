/* Projections on a decode step's few rows with a narrow weight (bfloat16, or int8 codes) on CPUs
 * with AVX2 and FMA but no bf16 or int8 dot products:
 *
 *   out[r][n] = sum_k x[r][k] * w[n][k]      x float32, w widened to float32 in registers
 *
 * Why: there, oneDNN has no bf16 or VNNI kernels. Larger row counts widen the weight a block at a
 * time into memory for float32's GEMM (server/worker/cpu_linear.py, `widened_matmul`), but on a few rows
 * that copy costs more than the GEMM it feeds, since the step is bound by reading the weight.
 * Widened as it is loaded, the weight is read once at its own width: half float32's bytes for
 * bf16, a quarter for int8.
 *
 * Up to 64 rows (a decode batch) it also beats the widened GEMM with the weight in cache: 6.8
 * against 10.7 ms for a layer's projections on 64 rows (AVX2 EPYC, two threads).
 *
 * A bf16 value is the upper half of a float32, so widening it is exact, and so is an int8 code's;
 * each product and the float32 sums are those of a bf16 GEMM accumulating in float32 (for int8
 * codes, exact integers while a sum stays below 2^24).
 *
 * Per pair of output channels and group of up to 4 rows: 8 accumulators over 8-wide chunks of k,
 * each weight chunk widened once for the group's rows; k past the last whole chunk in scalars.
 * Output pairs are split over the threads.
 *
 * Layouts: x [rows, k_in] float32, rows `x_stride` elements apart; w [n_out, k_in] contiguous;
 * out [rows, n_out] float32, contiguous. Built without AVX2 and FMA, the call returns
 * UNSUPPORTED and the caller widens into memory instead.
 */
#include <stdint.h>

#define KVSCALE_NARROW_OK 0
#define KVSCALE_NARROW_UNSUPPORTED 1

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define GROUP_ROWS 4

static inline __m256 widen8(const void *w, int int8_codes) {
    if (int8_codes)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
    __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
}

static inline float widen1(const void *w, int64_t k, int int8_codes) {
    if (int8_codes)
        return (float)((const int8_t *)w)[k];
    union { uint32_t bits; float value; } u = {.bits = (uint32_t)((const uint16_t *)w)[k] << 16};
    return u.value;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Output channels n0 and n1 (the same channel twice for an odd last one: only n0 is stored
 * then) for `rows` rows (a compile-time constant where it is inlined). */
static inline __attribute__((always_inline)) void pair_group(
    const float *x, int64_t x_stride, const uint8_t *w0, const uint8_t *w1, int64_t elem,
    int int8_codes, int64_t k_in, int rows, float *out, int64_t n_out, int64_t n0, int store_n1) {
    __m256 acc0[GROUP_ROWS], acc1[GROUP_ROWS];
    for (int r = 0; r < rows; r++) {
        acc0[r] = _mm256_setzero_ps();
        acc1[r] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 8 <= k_in; k += 8) {
        __m256 a = widen8(w0 + k * elem, int8_codes), b = widen8(w1 + k * elem, int8_codes);
        for (int r = 0; r < rows; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);
            acc0[r] = _mm256_fmadd_ps(a, xv, acc0[r]);
            acc1[r] = _mm256_fmadd_ps(b, xv, acc1[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float s0 = hsum(acc0[r]), s1 = hsum(acc1[r]);
        for (int64_t t = k; t < k_in; t++) {
            float xv = x[r * x_stride + t];
            s0 += xv * widen1(w0, t, int8_codes);
            s1 += xv * widen1(w1, t, int8_codes);
        }
        out[r * n_out + n0] = s0;
        if (store_n1)
            out[r * n_out + n0 + 1] = s1;
    }
}

static void pair_all_rows(const float *x, int64_t rows, int64_t x_stride, const uint8_t *w, int int8_codes,
                          int64_t n_out, int64_t k_in, float *out, int64_t n0) {
    int64_t elem = int8_codes ? 1 : 2;
    int store_n1 = n0 + 1 < n_out;
    const uint8_t *w0 = w + n0 * k_in * elem, *w1 = store_n1 ? w0 + k_in * elem : w0;
    for (int64_t r0 = 0; r0 < rows; r0 += GROUP_ROWS) {
        const float *xr = x + r0 * x_stride;
        float *o = out + r0 * n_out;
        switch (rows - r0 < GROUP_ROWS ? rows - r0 : GROUP_ROWS) {
        case 1: pair_group(xr, x_stride, w0, w1, elem, int8_codes, k_in, 1, o, n_out, n0, store_n1); break;
        case 2: pair_group(xr, x_stride, w0, w1, elem, int8_codes, k_in, 2, o, n_out, n0, store_n1); break;
        case 3: pair_group(xr, x_stride, w0, w1, elem, int8_codes, k_in, 3, o, n_out, n0, store_n1); break;
        default: pair_group(xr, x_stride, w0, w1, elem, int8_codes, k_in, 4, o, n_out, n0, store_n1); break;
        }
    }
}

int kvscale_linear_narrow_available(void) { return 1; }

int kvscale_linear_narrow(const float *x, int64_t rows, int64_t x_stride, const void *w, int32_t int8_codes,
                          int64_t n_out, int64_t k_in, float *out, int32_t threads) {
    int64_t pairs = (n_out + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        pair_all_rows(x, rows, x_stride, (const uint8_t *)w, int8_codes, n_out, k_in, out, 2 * p);
    return KVSCALE_NARROW_OK;
}

#else

int kvscale_linear_narrow_available(void) { return 0; }

int kvscale_linear_narrow(const float *x, int64_t rows, int64_t x_stride, const void *w, int32_t int8_codes,
                          int64_t n_out, int64_t k_in, float *out, int32_t threads) {
    (void)x; (void)rows; (void)x_stride; (void)w; (void)int8_codes; (void)n_out; (void)k_in; (void)out;
    (void)threads;
    return KVSCALE_NARROW_UNSUPPORTED;
}

#endif
