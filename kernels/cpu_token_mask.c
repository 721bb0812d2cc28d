/* A structured-output step's token bitmask applied to its logits in place: -inf wherever a
 * token's bit is 0, on the rows that carry a grammar.
 *
 * Why: the PyTorch path unpacks the bits to one byte per token, gathers the rows, fills through a
 * boolean mask and scatters them back, ~4 ms for 32 bfloat16 rows of a 49,152-token vocabulary
 * on a 2-core Xeon: several percent of a decode step, on every constrained step. Here each group
 * of 16 tokens is one masked store of -inf, ~0.1 ms.
 *
 * Layouts: logits [*, row_stride] float32 or bfloat16 (as uint16); rows[i] the logits row of
 * bitmask row i; bitmask [num_rows, words] int32, bit j of word w = token 32w + j (xgrammar's and
 * llguidance's layout). Tokens at or past words * 32 (ids the tokenizer does not know) are
 * always masked.
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

#define BF16_NEG_INF 0xFF80u

static uint32_t allowed_bits(const int32_t *bits, int64_t words, int64_t token) {
    return token / 32 < words ? (uint32_t)bits[token / 32] : 0u;
}

void kvscale_apply_token_bitmask(void *logits, int64_t row_stride, int is_bf16, const int64_t *rows, int64_t num_rows,
                                 const int32_t *bitmask, int64_t words, int64_t vocab, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; i++) {
        const int32_t *bits = bitmask + i * words;
        int64_t token = 0;
        if (is_bf16) {
            uint16_t *row = (uint16_t *)logits + rows[i] * row_stride;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
            const __m512i neg_inf = _mm512_set1_epi16((short)BF16_NEG_INF);
            for (; token + 32 <= vocab; token += 32)
                _mm512_mask_storeu_epi16(row + token, (__mmask32)~allowed_bits(bits, words, token), neg_inf);
#endif
            for (; token < vocab; token++)
                if (!((allowed_bits(bits, words, token) >> (token % 32)) & 1u)) row[token] = BF16_NEG_INF;
        } else {
            float *row = (float *)logits + rows[i] * row_stride;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
            const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
            for (; token + 32 <= vocab; token += 32) {
                const uint32_t masked = ~allowed_bits(bits, words, token);
                _mm512_mask_storeu_ps(row + token, (__mmask16)(masked & 0xFFFFu), neg_inf);
                _mm512_mask_storeu_ps(row + token + 16, (__mmask16)(masked >> 16), neg_inf);
            }
#endif
            for (; token < vocab; token++)
                if (!((allowed_bits(bits, words, token) >> (token % 32)) & 1u)) row[token] = -__builtin_inff();
        }
    }
}
