/* Write new tokens' K and V into their slots of one layer's paged KV pool (fp32, CPU): vLLM's
 * `reshape_and_cache` for pdserve's layout. A token's K and V of every KV head are two copies of
 * num_kv_heads * head_dim floats each, into one contiguous row of the pool. torch's index_put (`rows[slots,
 * K] = k`) took 150 us a layer for a 128-token prefill on two threads of an AMD EPYC host (60 on one),
 * a loop of copies ~10: a 2 x 98 KiB copy does not pay for waking a second thread.
 *
 * Layouts (row-major fp32): kv one layer's pool [num_blocks, block_size, 2, num_kv_heads, head_dim] (K at
 * index 0 of dim 2, V at 1), i.e. num_slots rows of 2 * row floats, row = num_kv_heads * head_dim; slots
 * [num_tokens] int64, slot = block_id * block_size + offset; k, v [num_tokens, num_kv_heads, head_dim],
 * tokens k_stride / v_stride floats apart, a token's heads contiguous. Returns 0; -2 (nothing written)
 * when a slot is outside [0, num_slots). */
#include <stdint.h>
#include <string.h>

int store_kv(float *kv, int64_t num_slots, const int64_t *slots, int64_t num_tokens, const float *k,
             int64_t k_stride, const float *v, int64_t v_stride, int64_t row) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -2;
    const size_t bytes = (size_t)row * sizeof(float);
    for (int64_t t = 0; t < num_tokens; t++) {
        float *dst = kv + slots[t] * 2 * row;
        memcpy(dst, k + t * k_stride, bytes);
        memcpy(dst + row, v + t * v_stride, bytes);
    }
    return 0;
}
