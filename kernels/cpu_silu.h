/* SiLU-and-multiply on 16 float32 lanes, and the bfloat16 rounding it needs: shared by the layer
 * ops (cpu_layer_ops.c, its own pass over the gate|up rows) and the AMX projection
 * (cpu_linear_amx.c, applied as the gate|up projection stores its rows), so both give the same
 * bits. AVX-512 only; the includer checks for it. */
#ifndef KVSCALE_CPU_SILU_H
#define KVSCALE_CPU_SILU_H

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>


/* float_to_bf16's rounding (to nearest even), 16 lanes at once, the bf16 left in each lane's top
 * 16 bits: + 0x7FFF, + 0x8000 where the kept part is odd (a bit test, not a shift: vector shifts
 * share one port with much of the rest). Not VCVTNEPS2BF16: that one flushes subnormal inputs to
 * zero and quiets NaNs. */
static inline __attribute__((always_inline)) __m512i bf16_round16(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __mmask16 odd = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x10000));
    return _mm512_mask_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd, bits,
                                 _mm512_set1_epi32(0x8000));
}

/* 16 float32 values stored as float32, or as bfloat16 with bf16_round16's rounding. */
static inline __attribute__((always_inline)) void store16(void *base, int64_t i, __m512 f, int is_bf16) {
    if (!is_bf16) _mm512_storeu_ps((float *)base + i, f);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)base + i),
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round16(f), 16)));
}

/* round_to for 16 lanes. */
static inline __attribute__((always_inline)) __m512 round16_to(__m512 f, int is_bf16) {
    if (!is_bf16) return f;
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_round16(f), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* expf of 16 lanes by the algorithm and constants of glibc's AVX-512 vector expf (libmvec's
 * _ZGVeN16v_expf, which gcc called for the portable loop), so the results are the same bits, here
 * inlined: no call, no spills. x = n ln2 + r, exp(x) = 2^n p(r) with p of degree 5; 2^n p by
 * VSCALEFPS, one rounding of the same exact product glibc's multiply by 2^n's bits makes. Lanes
 * with |x| > 87.33654 (overflow, underflow, NaN) take the scalar expf, as glibc's does; `check` 0:
 * the caller knows there are none; `outside`: those lanes. */
#define EXP16_LIMIT 0x42AEAC4F /* 87.33654f */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x, int check, __mmask16 *outside) {
    const __m512 shifter = _mm512_set1_ps(0x1.8p23f);  /* n lands in the low mantissa bits */
    const __m512 shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), shifter);  /* log2(e) */
    const __m512 n = _mm512_sub_ps(shifted, shifter);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x);  /* ln2, high bits */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f), r);  /* ln2, the rest */
    __m512 p = _mm512_set1_ps(0x1.0fb3fcp-7f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.570724p-5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.555958p-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.fffe68p-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.fffffcp-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512 result = _mm512_scalef_ps(p, n);
    const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 special = check ? _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(EXP16_LIMIT)) : 0;
    *outside = special;
    if (__builtin_expect(special != 0, 0)) {
        float lanes[16], results[16];
        _mm512_storeu_ps(lanes, x);
        _mm512_storeu_ps(results, result);
        for (; special; special &= special - 1) {
            const int lane = __builtin_ctz(special);
            results[lane] = expf(lanes[lane]);
        }
        result = _mm512_loadu_ps(results);
    }
    /* Opaque to the optimiser: glibc's result was a call's, so -ffast-math never fused its last
     * multiply into the caller's 1 + exp (an FMA would round once where the call rounded twice). */
    __asm__("" : "+v"(result));
    return result;
}

/* silu(gate) * up for 16 lanes, before the store's rounding. gate / (1 + e) compiles
 * (-ffast-math) to a reciprocal estimate and a Newton step, as the portable loop's vectorised
 * division did: VRCP14PS in its 32-value main loop, and, in its 16-value epilogue
 * (width % 32 >= 16), the 12-bit VRCPPS on two 8-lane halves, which `halves` reproduces. */
static inline __attribute__((always_inline)) __m512 silu_mul16(
    __m512 gate, __m512 up, int is_bf16, int halves, int check) {
    __mmask16 outside;
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate), check, &outside);
    /* silu_and_mul_one's cap at FLT_MAX (only these lanes can overflow). */
    if (__builtin_expect(outside != 0, 0)) e = _mm512_min_ps(e, _mm512_set1_ps(FLT_MAX));
    const __m512 y = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    const __m512 silu = !halves ? _mm512_div_ps(gate, y) : _mm512_insertf32x8(
        _mm512_castps256_ps512(_mm256_div_ps(_mm512_castps512_ps256(gate), _mm512_castps512_ps256(y))),
        _mm256_div_ps(_mm512_extractf32x8_ps(gate, 1), _mm512_extractf32x8_ps(y, 1)), 1);
    return _mm512_mul_ps(round16_to(silu, is_bf16), up);
}

#endif
