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
