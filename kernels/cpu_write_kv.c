/* The KV write for CPUs: each new token's K and V rows copied into their cache slots.
 *
 * Why: PyTorch's index_copy_ into a [slots, kv_heads, head_dim] view costs ~60 us per call for a
 * 64-token decode step (an indexed element-wise loop plus the casts and checks around it), twice
 * per layer: ~5 % of a bfloat16 decode step. Here a call is two memcpy per token.
 *
 * key/value rows are `row` = num_kv_heads * head_dim contiguous elements of `elem` bytes, tokens
 * `key_stride` / `value_stride` elements apart (views into the fused qkv output); the caches are
 * contiguous [num_slots, row]. A slot of -1 is not written; any other slot outside the cache
 * makes the call write nothing and return 2.
 */
#include <stdint.h>
#include <string.h>

int kvscale_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                     void *k_cache, void *v_cache, int64_t num_slots, const int64_t *slots,
                     int64_t num_tokens, int64_t row, int64_t elem) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return 2;
    const size_t bytes = (size_t)(row * elem);
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * bytes, (const char *)key + t * key_stride * elem, bytes);
        memcpy((char *)v_cache + slots[t] * bytes, (const char *)value + t * value_stride * elem, bytes);
    }
    return 0;
}

/* The FP8 KV cache (kernels/fp8.py has the semantics): each K/V element divided by its scale,
 * rounded to the nearest even FP8 value and saturated, bit for bit as torch's
 * `(x.float() / scale).clamp(-max, max).to(torch.float8_*)`. Built without -ffast-math
 * (cpu_build.FILE_CFLAGS): the division must be a true one, not a product with 1/scale (torch
 * divides), and the NaN test and the rounding additions must be kept as written.
 *
 * Both formats round on the float32 bits: a normal value's mantissa is cut to 3 (e4m3) or 2
 * (e5m2) bits by adding half an ulp less one, plus the kept bit's parity (ties to even), a carry
 * moving into the exponent; below the smallest normal value (2^-6, 2^-14) the result is a
 * multiple of the smallest subnormal (2^-9, 2^-16), rounded by float32 addition of 2^23. */
enum { KVSCALE_E4M3 = 2, KVSCALE_E5M2 = 3 };

static inline uint32_t f32_bits(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    return v.u;
}

static inline float bits_f32(uint32_t u) {
    union { uint32_t u; float f; } v = { .u = u };
    return v.f;
}

/* One format's rounding: `largest` and `smallest_normal` as float32 bits, the float32 mantissa
 * bits cut off (20 for e4m3, 21 for e5m2), the exponent rebias in the result's bit positions,
 * and 1 / the smallest subnormal. */
static inline uint8_t to_fp8(float x, uint32_t largest, uint32_t smallest_normal, int cut, uint32_t rebias,
                             float per_subnormal) {
    const uint32_t u = f32_bits(x), sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu); /* NaN */
    if (a > largest) a = largest;                        /* saturate, infinities too */
    if (a < smallest_normal)
        return (uint8_t)(sign | (f32_bits(bits_f32(a) * per_subnormal + 8388608.0f) - 0x4b000000u));
    return (uint8_t)(sign | (((a + ((1u << (cut - 1)) - 1u) + ((a >> cut) & 1u)) >> cut) - rebias));
}

/* e4m3: largest 448, smallest normal 2^-6, subnormals 2^-9 apart, bias 7 (127 - 120). */
static inline uint8_t to_e4m3(float x) { return to_fp8(x, 0x43e00000u, 0x3c800000u, 20, 120u << 3, 512.0f); }

/* e5m2: largest 57344, smallest normal 2^-14, subnormals 2^-16 apart, bias 15 (127 - 112). */
static inline uint8_t to_e5m2(float x) { return to_fp8(x, 0x47600000u, 0x38800000u, 21, 112u << 2, 65536.0f); }

static void quantize_row(const void *src, int is_bf16, int64_t row, float scale, int format, uint8_t *dst) {
    float widened[row];
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src;
        #pragma omp simd
        for (int64_t i = 0; i < row; i++) widened[i] = bits_f32((uint32_t)s[i] << 16) / scale;
    } else {
        const float *s = (const float *)src;
        #pragma omp simd
        for (int64_t i = 0; i < row; i++) widened[i] = s[i] / scale;
    }
    if (format == KVSCALE_E4M3) {
        #pragma omp simd
        for (int64_t i = 0; i < row; i++) dst[i] = to_e4m3(widened[i]);
    } else {
        #pragma omp simd
        for (int64_t i = 0; i < row; i++) dst[i] = to_e5m2(widened[i]);
    }
}

/* As kvscale_write_kv, into a cache of `format` (KVSCALE_E4M3 / KVSCALE_E5M2) from float32 or
 * (is_bf16) bfloat16 rows; returns 2 (nothing written) for a slot outside the cache, 3 for an
 * unknown format. */
int kvscale_write_kv_fp8(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                         void *k_cache, void *v_cache, int64_t num_slots, const int64_t *slots,
                         int64_t num_tokens, int64_t row, int is_bf16, int format, float k_scale, float v_scale) {
    if (format != KVSCALE_E4M3 && format != KVSCALE_E5M2) return 3;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return 2;
    const int64_t elem = is_bf16 ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        quantize_row((const char *)key + t * key_stride * elem, is_bf16, row, k_scale, format,
                     (uint8_t *)k_cache + slots[t] * row);
        quantize_row((const char *)value + t * value_stride * elem, is_bf16, row, v_scale, format,
                     (uint8_t *)v_cache + slots[t] * row);
    }
    return 0;
}
