/* A decode step's decoder layers of a Llama in one call (fp32, CPU): for every layer, the kernels beside
 * this file in the order LlamaModel.forward (libs/pdserve/engine/model.py) calls them one by one —
 *   x = rms_norm(hidden); qkv = x Wqkv; q, k = rope(q, k); store_kv(k, v); a = attention(q, pool);
 *   hidden += a Wo; x = rms_norm(hidden); hidden += gated(x Wgate_up) Wdown
 * — on the same inputs, so the result is the same to the bit. The GEMMs are skinny_linear's (packed
 * weights; gate/up with SwiGLU's silu(gate) * up in its epilogue, skinny_gated_linear), the attention
 * paged_decode_attention's: this runs only where the forward would take those.
 *
 * Why one call: from Python, a decode step of SmolLM2 (30 layers) made ~300 kernel calls, each ~10-30 us of
 * interpreter, argument checks, ctypes and an output allocation around a few us of work (a 30-layer model
 * of SmolLM2's heads but hidden 192, where the work is nothing, took ~5-7 ms a decode step of 8 sequences
 * on an AMD EPYC host): a sixth of an 8-sequence step of SmolLM2, a quarter of a one-sequence step. This is
 * what CUDA graphs do for vLLM's decode on a GPU: the step's launches replayed without the host's per-op
 * cost.
 *
 * Layouts (row-major fp32 unless said; `rows` = sequences, one new token each):
 *   hidden       [rows, hidden] contiguous, updated in place (the residual stream after the last layer)
 *   cos, sin     [rows, head_dim] contiguous: the rope tables' rows at each token's position
 *   slots        [rows] int64 pool slots of the new tokens' K and V (block_id * block_size + offset)
 *   block_tables [rows, table_stride] int64, context_lens [rows] int64 (paged_decode_attention's)
 *   scratch      rows * (hidden + 3 q + 3 kv + intermediate) floats (llama_decode_scratch_floats), where q
 *                and kv are num_heads and num_kv_heads times head_dim
 *   layers[l]    its norms' weights [hidden], its four projections as skinny_pack panels (gate/up as
 *                skinny_pack_gated's), its KV pool
 * Returns 0; -3 (nothing written) when a slot is outside the pool; paged_decode_attention's -1 (scratch
 * not allocated) or -2 (heads or head_dim past its limits), after the layers before it were computed. */
#include <stdint.h>

int rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t dim,
             float eps, int num_threads);
int rope(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out, int64_t rows,
         int64_t heads, int64_t head_dim, int num_threads);
int store_kv(float *kv, int64_t num_slots, const int64_t *slots, int64_t num_tokens, const float *k,
             int64_t k_stride, const float *v, int64_t v_stride, int64_t row);
int paged_decode_attention(const float *q, int64_t q_row_stride, const float *kv, const int64_t *block_tables,
                           int64_t table_stride, const int64_t *context_lens, float *out, int64_t batch,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int num_threads);
int skinny_linear(const float *x, int64_t x_stride, const float *panels, int64_t n, int64_t k,
                  const float *residual, float *out, int64_t rows, int num_threads);
int skinny_gated_linear(const float *x, int64_t x_stride, const float *panels, int64_t d, int64_t k,
                        float *out, int64_t rows, int num_threads);

typedef struct {
    const float *input_norm, *post_norm;       /* [hidden] */
    const float *qkv, *o, *gate_up, *down;     /* skinny_pack panels of [out, in] weights (gate_up:
                                                  skinny_pack_gated's) */
    float *kv;                                 /* [num_blocks, block_size, 2, num_kv_heads, head_dim] */
} llama_layer;

typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, num_slots;
    float eps, scale; /* RMSNorm's epsilon; attention's 1 / sqrt(head_dim), as the forward passes it */
} llama_dims;

int64_t llama_decode_scratch_floats(const llama_dims *d, int64_t rows) {
    const int64_t q = d->num_heads * d->head_dim, kv = d->num_kv_heads * d->head_dim;
    return rows * (d->hidden + (q + 2 * kv) + (q + kv) + q + d->intermediate);
}

int llama_decode_layers(const llama_layer *layers, int64_t num_layers, const llama_dims *d, float *hidden,
                        int64_t rows, const float *cos, const float *sin, const int64_t *slots,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                        float *scratch, int num_threads) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < 0 || slots[t] >= d->num_slots) return -3;
    const int64_t h = d->hidden, inter = d->intermediate, hd = d->head_dim;
    const int64_t q_width = d->num_heads * hd, kv_width = d->num_kv_heads * hd;
    const int64_t qk_width = q_width + kv_width, qkv_width = qk_width + kv_width;
    float *x = scratch, *qkv = x + rows * h, *qk = qkv + rows * qkv_width, *attn = qk + rows * qk_width;
    float *act = attn + rows * q_width;
    for (int64_t l = 0; l < num_layers; l++) {
        const llama_layer *layer = layers + l;
        rms_norm(hidden, h, layer->input_norm, x, rows, h, d->eps, num_threads);
        skinny_linear(x, h, layer->qkv, qkv_width, h, 0, qkv, rows, num_threads);
        rope(qkv, qkv_width, cos, sin, qk, rows, d->num_heads + d->num_kv_heads, hd, num_threads);
        store_kv(layer->kv, d->num_slots, slots, rows, qk + q_width, qk_width, qkv + qk_width, qkv_width,
                 kv_width);
        const int status = paged_decode_attention(qk, qk_width, layer->kv, block_tables, table_stride,
                                                  context_lens, attn, rows, d->num_heads, d->num_kv_heads, hd,
                                                  d->block_size, d->scale, num_threads);
        if (status) return status;
        skinny_linear(attn, q_width, layer->o, h, q_width, hidden, hidden, rows, num_threads);
        rms_norm(hidden, h, layer->post_norm, x, rows, h, d->eps, num_threads);
        skinny_gated_linear(x, h, layer->gate_up, inter, h, act, rows, num_threads);
        skinny_linear(act, inter, layer->down, h, inter, hidden, hidden, rows, num_threads);
    }
    return 0;
}
