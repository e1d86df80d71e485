/* Decode attention over a paged KV cache, read in place (fp32, CPU).
 *
 * One query token per sequence attends over its context's keys, found through its block table: no gather
 * of the blocks into a contiguous copy first (what the torch path in paged_attention.py must do). The
 * algorithm is vLLM's PagedAttention for decode (Kwon et al. 2023, https://arxiv.org/abs/2309.06180) with
 * the online softmax of Milakov & Gimelshein 2018 (https://arxiv.org/abs/1805.02867): one pass over the
 * context, a block of tokens at a time, so each token's row of the pool (its K and V of every KV head,
 * contiguous) is read once, while it is in cache. This file is pdserve's own, built and loaded by
 * native.py. Per sequence (one work item; OpenMP threads take sequences):
 *   for each block: s_ht = q_h . k_t * scale for every query head h and token t of the block;
 *   m_h' = max(m_h, max_t s_ht); acc_h = acc_h * e^(m_h - m_h') + sum_t e^(s_ht - m_h') v_t;
 *   l_h likewise; at the end out_h = acc_h / l_h.
 *
 * Layouts (row-major, fp32 unless said):
 *   q            [batch, num_heads, head_dim], rows q_row_stride floats apart, heads contiguous
 *   kv           one layer's pool [num_blocks, block_size, 2, num_kv_heads, head_dim], K at index 0 of
 *                dim 2, V at 1 (paged_attention.K_INDEX / V_INDEX)
 *   block_tables [batch, table_stride] int64 block ids in sequence order
 *   context_lens [batch] int64, >= 1
 *   out          [batch, num_heads, head_dim], contiguous
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA, HF's repeat_kv order).
 * Returns 0; -1 when a scratch allocation fails; -2 when head_dim > MAX_HEAD_DIM or
 * num_heads > MAX_HEADS.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_HEADS 128

static void prefetch_block(const float *block, int64_t floats) {
    for (int64_t byte = 0; byte < floats * (int64_t)sizeof(float); byte += 64)
        __builtin_prefetch((const char *)block + byte);
}

/* One sequence's attention; `next_first`: the first block a following work item reads (prefetched while
 * this one's last block computes), or NULL. */
static int attend_sequence(const float *q, const float *kv, const int64_t *table, int64_t context_len,
                           const float *next_first, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = 2 * num_kv_heads * head_dim; /* one token's K and V of every KV head */
    const int64_t v_offset = num_kv_heads * head_dim;
    /* scores [num_heads, block_size], then acc [num_heads, head_dim] */
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * (block_size + head_dim)));
    if (scores == NULL) return -1;
    float *acc = scores + num_heads * block_size;
    float max_score[MAX_HEADS], sum[MAX_HEADS];
    int64_t kv_head_of[MAX_HEADS]; /* no division in the loops: a 64-bit divide per head and token cost
                                      more than the attention's arithmetic */
    for (int64_t h = 0; h < num_heads; h++) {
        kv_head_of[h] = h / group;
        max_score[h] = -FLT_MAX;
        sum[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(num_heads * head_dim));
    for (int64_t n = 0, b = 0; n < context_len; b++) {
        const int64_t rows = context_len - n < block_size ? context_len - n : block_size;
        const float *block = kv + table[b] * block_size * token_stride;
        /* the next block's rows are fetched while this one computes: a block is one contiguous region,
           but the hardware prefetchers stop at page boundaries and the block table jumps anywhere */
        const float *next = n + rows < context_len ? kv + table[b + 1] * block_size * token_stride : next_first;
        if (next != NULL) prefetch_block(next, block_size * token_stride);
        for (int64_t t = 0; t < rows; t++) {
            const float *k = block + t * token_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const float *restrict qh = q + h * head_dim, *restrict kh = k + kv_head_of[h] * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                scores[h * block_size + t] = dot * scale;
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            float *s = scores + h * block_size, block_max = max_score[h];
            for (int64_t t = 0; t < rows; t++) block_max = s[t] > block_max ? s[t] : block_max;
            const float rescale = expf(max_score[h] - block_max);
            float block_sum = 0.0f;
            for (int64_t t = 0; t < rows; t++) {
                s[t] = expf(s[t] - block_max);
                block_sum += s[t];
            }
            sum[h] = sum[h] * rescale + block_sum;
            max_score[h] = block_max;
            if (rescale != 1.0f) {
                float *a = acc + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) a[d] *= rescale;
            }
        }
        for (int64_t t = 0; t < rows; t++) {
            const float *v = block + t * token_stride + v_offset;
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * block_size + t], *restrict vh = v + kv_head_of[h] * head_dim;
                float *restrict a = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
            }
        }
        n += rows;
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t d = 0; d < head_dim; d++) out[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
    free(scores);
    return 0;
}

int paged_decode_attention(const float *q, int64_t q_row_stride, const float *kv,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_heads > MAX_HEADS) return -2;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1) \
    reduction(| : failed)
    for (int64_t b = 0; b < batch; b++) {
        const float *next_first = b + 1 < batch ? kv + block_tables[(b + 1) * table_stride] * block_size
                                                         * 2 * num_kv_heads * head_dim
                                                : NULL;
        failed |= attend_sequence(q + b * q_row_stride, kv, block_tables + b * table_stride, context_lens[b],
                                  next_first, out + b * num_heads * head_dim, num_heads, num_kv_heads, head_dim,
                                  block_size, scale);
    }
    return failed ? -1 : 0;
}
