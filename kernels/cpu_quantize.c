/* The two passes around an int8 projection (`--quantization int8`, server/worker/quantization.py).
 *
 * Why: in PyTorch, quantizing a row of activations is seven ops (cast, abs, max, divide, round,
 * clamp, cast), each a pass with its own buffer, and rescaling the int32 sums is three more. At a
 * decode batch those passes took as long as the int8 GEMM they feed (~70 us per projection at 64
 * rows, 121 projections a step). Here each is one read and one write per row.
 *
 * Quantization is symmetric per row: scale = max|x| / 127, q = round(x / scale) in [-127, 127],
 * stored with +128 as uint8 because oneDNN's int8 GEMM takes unsigned activations with a zero
 * point (its VNNI and AMX instructions multiply u8 by s8). Rounding is to nearest even, as
 * torch.round's. The divisions are real divisions (this file is built with
 * -fno-unsafe-math-optimizations, cpu_build.FILE_CFLAGS; -fno-reciprocal-math alone still left
 * the loop's division a product): as products with the reciprocal, which -ffast-math allows, values on a
 * rounding boundary moved one code from torch's quantize_per_row, and that alone moved the bundled
 * model's int8 perplexity ratio (tests/server/worker/test_precision_accuracy.py) from 1.022 to 1.034.
 * Rows are contiguous, float32 or bfloat16 (as uint16). gcc still vectorises both loops.
 */
#include <math.h>
#include <stdint.h>

static inline float bf16_bits_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

static inline uint16_t float_to_bf16_bits(float f) {
    union { float f; uint32_t u; } value = { .f = f };
    return (uint16_t)((value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) float load(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_bits_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* q[r, :] = round(x[r, :] / scales[r]) + 128, scales[r] = max|x[r, :]| / 127 (an all-zero row
 * gets the smallest scale torch's reference uses, so it quantizes to 128s and rescales to 0). */
static inline __attribute__((always_inline)) void quantize_rows(
    const void *x, int64_t rows, int64_t width, int is_bf16, uint8_t *q, float *scales, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * width;
        float peak = 0.0f;
        #pragma omp simd reduction(max:peak)
        for (int64_t i = 0; i < width; i++) peak = fmaxf(peak, fabsf(load(x, base + i, is_bf16)));
        const float scale = fmaxf(peak, 1e-12f) / 127.0f;
        scales[r] = scale;
        #pragma omp simd
        for (int64_t i = 0; i < width; i++) {
            float v = nearbyintf(load(x, base + i, is_bf16) / scale);
            v = fminf(fmaxf(v, -127.0f), 127.0f);
            q[base + i] = (uint8_t)((int32_t)v + 128);
        }
    }
}

void kvscale_quantize_rows_u8(const void *x, int64_t rows, int64_t width, int is_bf16, uint8_t *q,
                              float *scales, int num_threads) {
    if (is_bf16) quantize_rows(x, rows, width, 1, q, scales, num_threads);
    else quantize_rows(x, rows, width, 0, q, scales, num_threads);
}

/* out[r, :] = y[r, :] * scales[r] (+ bias): the per-row activation scale the GEMM could not apply
 * (it takes one scale for the whole input). y is float32 or bfloat16 (the GEMM's output in the
 * model's dtype, rounded once already), out float32 or bfloat16, and may be y itself. */
static inline __attribute__((always_inline)) void rescale_rows(
    const void *y, int y_bf16, const float *scales, const float *bias, int64_t rows, int64_t width, void *out,
    int out_bf16, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * width > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * width;
        const float scale = scales[r];
        #pragma omp simd
        for (int64_t i = 0; i < width; i++) {
            const float v = load(y, base + i, y_bf16) * scale + (bias ? bias[i] : 0.0f);
            if (out_bf16) ((uint16_t *)out)[base + i] = float_to_bf16_bits(v);
            else ((float *)out)[base + i] = v;
        }
    }
}

void kvscale_rescale_rows(const void *y, int y_bf16, const float *scales, const float *bias, int64_t rows,
                          int64_t width, void *out, int out_bf16, int num_threads) {
    if (y_bf16 && out_bf16) rescale_rows(y, 1, scales, bias, rows, width, out, 1, num_threads);
    else if (out_bf16) rescale_rows(y, 0, scales, bias, rows, width, out, 1, num_threads);
    else if (y_bf16) rescale_rows(y, 1, scales, bias, rows, width, out, 0, num_threads);
    else rescale_rows(y, 0, scales, bias, rows, width, out, 0, num_threads);
}
