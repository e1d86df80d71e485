/* Decode attention over a paged KV cache, read in place (fp32, CPU).
 *
 * One query token per sequence attends over its context's keys, found through its block table: no gather
 * of the blocks into a contiguous copy first (what the torch path in paged_attention.py must do). The
 * algorithm is vLLM's PagedAttention for decode (Kwon et al. 2023, https://arxiv.org/abs/2309.06180) with
 * the online softmax of Milakov & Gimelshein 2018 (https://arxiv.org/abs/1805.02867): one pass over the
 * context, a block of tokens at a time, so each token's row of the pool (its K and V of every KV head,
 * contiguous) is read once, while it is in cache. This file is pdserve's own, built and loaded by
 * native.py. Per sequence (one work item; OpenMP threads take sequences):
 *   for each block, up to 16 tokens at a time, for each KV head and each query head h reading it:
 *   s_ht = q_h . k_t * scale; m_h' = max(m_h, max_t s_ht);
 *   acc_h = acc_h * e^(m_h - m_h') + sum_t e^(s_ht - m_h') v_t; l_h likewise; at the end out_h = acc_h / l_h.
 * Vectors are 16 floats (GCC vector extensions: one zmm with AVX-512); the 16 dot products of a chunk
 * are reduced together (`sum_lanes16`) rather than one horizontal sum each, and rows of 64 and 128 floats
 * (the common head sizes) are specialised so a row lives in registers: against a scalar loop over heads
 * and tokens, 0.61 -> 0.37 of the torch path's time on 8 sequences of 150 keys, two threads, 30 layers'
 * pools (a decode step's cold KV).
 *
 * Layouts (row-major, fp32 unless said):
 *   q            [batch, num_heads, head_dim], rows q_row_stride floats apart, heads contiguous
 *   kv           one layer's pool [num_blocks, block_size, 2, num_kv_heads, head_dim], K at index 0 of
 *                dim 2, V at 1 (paged_attention.K_INDEX / V_INDEX)
 *   block_tables [batch, table_stride] int64 block ids in sequence order
 *   context_lens [batch] int64, >= 1
 *   out          [batch, num_heads, head_dim], contiguous
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA, HF's repeat_kv order).
 * Returns 0; -1 when a scratch allocation fails; -2 when head_dim is not a multiple of 16 or exceeds
 * MAX_HEAD_DIM, or num_heads > MAX_HEADS.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define MAX_HEAD_DIM 256
#define MAX_HEADS 128

/* The next block's lines, prefetched into L2 a few at a time while the current block computes (`step`
 * lines per token of every query head), so the fetch overlaps the compute. Prefetching a whole 24 KiB
 * block into L1 at once (what this kernel did) measured hardly faster than no prefetch at all: the burst
 * waits on the core's few outstanding-miss slots, and the block it fetches evicts the one being read
 * from a 32 KiB L1. On an AMD EPYC host (AVX-512; SmolLM2's heads, 8 sequences of 300 keys, 30 layers'
 * pools read cold) a call took 540 -> 360 us on one thread, 300-410 -> 200-220 us on two. */
typedef struct {
    const char *next, *end;
    int64_t step;
} prefetch_cursor;

static inline __attribute__((always_inline)) void prefetch_some(prefetch_cursor *pf) {
    for (int64_t j = 0; j < pf->step && pf->next < pf->end; j++, pf->next += 64)
        __builtin_prefetch(pf->next, 0, 2); /* prefetcht1: into L2 */
}

/* Up to 16 tokens of one KV head against its `group` query heads: scores, online-softmax update of each
 * query head's (max, sum, acc). `dv` = head_dim / 16 (a constant where the caller is specialised, so the
 * vectors of a row stay in registers). rows: tokens at token_stride floats apart from k (K) and v (V). */
static inline __attribute__((always_inline)) void attend_chunk(
    const int64_t dv, const float *q, const float *k, const float *v, int64_t rows, int64_t token_stride,
    int64_t group, float scale, float *max_score, float *sum, float *acc, prefetch_cursor *pf) {
    const int64_t head_dim = dv * 16;
    for (int64_t g = 0; g < group; g++) {
        v16 qg[MAX_HEAD_DIM / 16], part[16];
        for (int64_t i = 0; i < dv; i++) qg[i] = load16(q + g * head_dim + 16 * i);
        for (int64_t t = 0; t < 16; t++) {
            prefetch_some(pf);
            v16 dot = {0};
            if (t < rows)
                for (int64_t i = 0; i < dv; i++) dot += qg[i] * load16(k + t * token_stride + 16 * i);
            part[t] = dot;
        }
        const i16 seen = (i16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < (i16){0} + (int32_t)rows;
        const v16 s = select16(seen, sum_lanes16(part) * scale, (v16){0} - FLT_MAX);
        const float chunk_max = hmax16(max16(s, (v16){0} + max_score[g]))[0];
        const float rescale = exp16((v16){0} + (max_score[g] - chunk_max))[0];
        const v16 e = select16(seen, exp16(s - chunk_max), (v16){0});
        float p[16];
        store16(p, e);
        sum[g] = sum[g] * rescale + hsum16(e)[0];
        max_score[g] = chunk_max;
        v16 a[MAX_HEAD_DIM / 16];
        for (int64_t i = 0; i < dv; i++) a[i] = load16(acc + g * head_dim + 16 * i) * rescale;
        for (int64_t t = 0; t < rows; t++)
            for (int64_t i = 0; i < dv; i++) a[i] += p[t] * load16(v + t * token_stride + 16 * i);
        for (int64_t i = 0; i < dv; i++) store16(acc + g * head_dim + 16 * i, a[i]);
    }
}

/* One sequence's attention; `next_first`: the first block a following work item reads (prefetched while
 * this one's last block computes), or NULL. head_dim is a multiple of 16. */
static int attend_sequence(const float *q, const float *kv, const int64_t *table, int64_t context_len,
                           const float *next_first, float *out, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = 2 * num_kv_heads * head_dim; /* one token's K and V of every KV head */
    const int64_t v_offset = num_kv_heads * head_dim;
    float *acc = calloc((size_t)(num_heads * head_dim), sizeof(float));
    if (acc == NULL) return -1;
    float max_score[MAX_HEADS], sum[MAX_HEADS];
    for (int64_t h = 0; h < num_heads; h++) {
        max_score[h] = -FLT_MAX;
        sum[h] = 0.0f;
    }
    for (int64_t n = 0, b = 0; n < context_len; b++) {
        const int64_t rows = context_len - n < block_size ? context_len - n : block_size;
        const float *block = kv + table[b] * block_size * token_stride;
        /* the next block's rows are fetched while this one computes: a block is one contiguous region,
           but the hardware prefetchers stop at page boundaries and the block table jumps anywhere */
        const float *next = n + rows < context_len ? kv + table[b + 1] * block_size * token_stride : next_first;
        const int64_t lines = block_size * token_stride * (int64_t)sizeof(float) / 64;
        const int64_t iterations = (rows + 15) / 16 * num_heads * 16; /* prefetch_some calls this block */
        prefetch_cursor pf = {(const char *)next, next != NULL ? (const char *)(next + block_size * token_stride)
                                                               : NULL, (lines + iterations - 1) / iterations};
        for (int64_t t0 = 0; t0 < rows; t0 += 16) {
            const int64_t chunk = rows - t0 < 16 ? rows - t0 : 16;
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const float *k = block + t0 * token_stride + h * head_dim, *v = k + v_offset;
                const int64_t first = h * group;
                float *a = acc + first * head_dim;
                switch (head_dim) { /* specialised for the common head sizes: the row in registers */
                    case 64:
                        attend_chunk(4, q + first * 64, k, v, chunk, token_stride, group, scale,
                                     max_score + first, sum + first, a, &pf);
                        break;
                    case 128:
                        attend_chunk(8, q + first * 128, k, v, chunk, token_stride, group, scale,
                                     max_score + first, sum + first, a, &pf);
                        break;
                    default:
                        attend_chunk(head_dim / 16, q + first * head_dim, k, v, chunk, token_stride, group,
                                     scale, max_score + first, sum + first, a, &pf);
                }
            }
        }
        n += rows;
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t d = 0; d < head_dim; d++) out[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
    free(acc);
    return 0;
}

int paged_decode_attention(const float *q, int64_t q_row_stride, const float *kv,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens,
                           float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 16 || num_heads > MAX_HEADS) return -2;
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
