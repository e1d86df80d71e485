/* Prefill attention over a paged KV cache, read in place (fp32, CPU).
 *
 * One sequence's new tokens (a prompt, or a chunk of one) attend causally over its context, found through
 * its block table: no gather of the blocks into a contiguous copy first. The algorithm is FlashAttention's
 * (Dao et al. 2022, https://arxiv.org/abs/2205.14135) as a CPU loop: the online softmax of Milakov &
 * Gimelshein 2018 (https://arxiv.org/abs/1805.02867) over the keys, KC = 32 at a time, so the scores are
 * never materialised. This file is pdserve's own, built and loaded by native.py.
 *
 * A work item (OpenMP threads take them, longest first) is TILE query tokens and the `group` query heads
 * that read one KV head (GQA): their TILE * group rows share every key and value they load. Per chunk of
 * KC keys, the keys are transposed once into `kt` [head_dim][KC], so a row's KC scores are head_dim
 * broadcast-FMAs into two vectors (eight rows at a time, sharing each load of kt: 16 independent FMA
 * chains), and the chunk's values are added into eight rows' accumulators at a time the same way. Chunks
 * of 32 keys rather than 16 halve the online softmax's per-chunk work (a row's max, sum and rescale):
 * 0.87x / 0.85x the time at 512 / 2048 tokens on an Intel Xeon host (docs/architecture.md §12). Keys past a row's position are masked
 * (causal: query i of n new tokens sits at position context_len - n + i and sees keys 0..that position).
 *
 * Layouts (row-major, fp32 unless said):
 *   q            [num_tokens, num_heads, head_dim], rows q_row_stride floats apart, heads contiguous
 *   kv           one layer's pool [num_blocks, block_size, 2, num_kv_heads, head_dim], K at index 0 of
 *                dim 2, V at 1 (paged_attention.K_INDEX / V_INDEX)
 *   block_table  [>= ceil(context_len / block_size)] int64 block ids in sequence order
 *   out          [num_tokens, num_heads, head_dim], contiguous
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA, HF's repeat_kv order).
 * Returns 0; -1 when a scratch allocation fails; -2 when head_dim is not a multiple of 16 or exceeds
 * MAX_HEAD_DIM, or num_tokens > context_len.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

#define MAX_HEAD_DIM 256
#define TILE 32 /* query tokens per work item */
#define RB 8   /* rows that share each load of a key or value */
#define NV 2   /* 16-key vectors per chunk: 16 score accumulators for RB rows */
#define KC (16 * NV) /* keys per chunk */

typedef struct {
    const float *kv;
    const int64_t *table;
    int64_t block_size, token_stride, v_offset, head_dim;
} Paged;

/* The K rows of keys [c0, c0 + n) of KV head h, transposed into kt [head_dim][KC] (lanes past n zero),
 * and pointers to their V rows. */
static void load_chunk(const Paged *p, int64_t h, int64_t c0, int64_t n, float *kt, const float **v) {
    for (int64_t t = 0; t < KC; t++) {
        if (t >= n) {
            for (int64_t d = 0; d < p->head_dim; d++) kt[d * KC + t] = 0.0f;
            continue;
        }
        const int64_t j = c0 + t;
        const float *k = p->kv + (p->table[j / p->block_size] * p->block_size + j % p->block_size)
                                     * p->token_stride + h * p->head_dim;
        for (int64_t d = 0; d < p->head_dim; d++) kt[d * KC + t] = k[d];
        v[t] = k + p->v_offset;
    }
}

/* nr <= RB rows of a work item against one chunk of n keys from c0 (kt, v: load_chunk's): scores,
 * causal masking, the online-softmax update of each row's (max_score, sum, acc [nr][head_dim]). Row r's
 * query is q[r] (head_dim floats), its position pos[r] >= c0. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *const q[RB], int64_t nr, const int64_t pos[RB], const float *kt, const float *const *v,
    int64_t c0, int64_t n, int64_t head_dim, float scale, float *max_score, float *sum, float *acc) {
    v16 s[RB][NV] = {{{0}}};
    for (int64_t d = 0; d < head_dim; d++) {
        v16 k[NV];
        for (int j = 0; j < NV; j++) k[j] = load16(kt + d * KC + 16 * j);
        for (int64_t r = 0; r < RB; r++)
            if (r < nr)
                for (int j = 0; j < NV; j++) s[r][j] += q[r][d] * k[j];
    }
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16 score[RB][NV], old_max = {0}, new_max = {0}; /* lane r: row r's running max before / after */
    i16 seen[RB][NV];
    for (int64_t r = 0; r < nr; r++) {
        /* >= 1: the caller skips rows that see no key of this chunk */
        const int64_t visible = pos[r] - c0 + 1 < n ? pos[r] - c0 + 1 : n;
        v16 m = (v16){0} + max_score[r];
        for (int j = 0; j < NV; j++) {
            seen[r][j] = lane < (i16){0} + (int32_t)(visible - 16 * j);
            score[r][j] = select16(seen[r][j], s[r][j] * scale, (v16){0} - FLT_MAX);
            m = max16(m, score[r][j]);
        }
        old_max[r] = max_score[r];
        new_max[r] = hmax16(m)[0];
    }
    const v16 rescale = exp16(old_max - new_max);
    float p[RB][KC];
    for (int64_t r = 0; r < nr; r++) {
        v16 total = {0};
        for (int j = 0; j < NV; j++) {
            const v16 e = select16(seen[r][j], exp16(score[r][j] - new_max[r]), (v16){0});
            store16(p[r] + 16 * j, e);
            total += e;
        }
        sum[r] = sum[r] * rescale[r] + hsum16(total)[0];
        max_score[r] = new_max[r];
        if (rescale[r] != 1.0f)
            for (int64_t d = 0; d < head_dim; d += 16)
                store16(acc + r * head_dim + d, load16(acc + r * head_dim + d) * rescale[r]);
    }
    for (int64_t d = 0; d < head_dim; d += 16) {
        v16 a[RB];
        for (int64_t r = 0; r < nr; r++) a[r] = load16(acc + r * head_dim + d);
        for (int64_t t = 0; t < n; t++) {
            const v16 x = load16(v[t] + d);
            for (int64_t r = 0; r < RB; r++)
                if (r < nr) a[r] += p[r][t] * x;
        }
        for (int64_t r = 0; r < nr; r++) store16(acc + r * head_dim + d, a[r]);
    }
}

/* Query tokens [t0, t0 + nt) of KV head h's group. */
static int attend_tile(const Paged *p, const float *q, int64_t q_row_stride, float *out, int64_t t0, int64_t nt,
                       int64_t past, int64_t h, int64_t group, int64_t num_heads, float scale) {
    const int64_t head_dim = p->head_dim, rows = nt * group;
    float *scratch = calloc((size_t)(rows * (head_dim + 2) + head_dim * KC), sizeof(float));
    if (scratch == NULL) return -1;
    float *acc = scratch, *max_score = acc + rows * head_dim, *sum = max_score + rows, *kt = sum + rows;
    const float *v[KC];
    for (int64_t r = 0; r < rows; r++) max_score[r] = -FLT_MAX;
    const int64_t num_keys = past + t0 + nt;
    for (int64_t c0 = 0; c0 < num_keys; c0 += KC) {
        const int64_t n = num_keys - c0 < KC ? num_keys - c0 : KC;
        load_chunk(p, h, c0, n, kt, v);
        /* the first row whose position reaches this chunk: rows before it see none of its keys */
        const int64_t first_token = c0 > past + t0 ? c0 - past - t0 : 0;
        for (int64_t r0 = first_token * group; r0 < rows; r0 += RB) {
            const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
            const float *qr[RB];
            int64_t pos[RB];
            for (int64_t r = 0; r < nr; r++) {
                const int64_t t = t0 + (r0 + r) / group, head = h * group + (r0 + r) % group;
                qr[r] = q + t * q_row_stride + head * head_dim;
                pos[r] = past + t;
            }
            if (nr == RB) /* a constant row count: the rows' vectors stay in registers */
                attend_rows(qr, RB, pos, kt, v, c0, n, head_dim, scale, max_score + r0, sum + r0,
                            acc + r0 * head_dim);
            else
                attend_rows(qr, nr, pos, kt, v, c0, n, head_dim, scale, max_score + r0, sum + r0,
                            acc + r0 * head_dim);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = t0 + r / group, head = h * group + r % group;
        const float inv = 1.0f / sum[r];
        float *o = out + (t * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = acc[r * head_dim + d] * inv;
    }
    free(scratch);
    return 0;
}

int paged_prefill_attention(const float *q, int64_t q_row_stride, const float *kv, const int64_t *block_table,
                            int64_t num_tokens, int64_t context_len, float *out, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                            int num_threads) {
    if (head_dim > MAX_HEAD_DIM || head_dim % 16 || num_tokens > context_len) return -2;
    const Paged p = {kv, block_table, block_size, 2 * num_kv_heads * head_dim, num_kv_heads * head_dim,
                     head_dim};
    const int64_t group = num_heads / num_kv_heads, past = context_len - num_tokens;
    const int64_t tiles = (num_tokens + TILE - 1) / TILE;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1) \
    reduction(| : failed)
    for (int64_t item = 0; item < tiles * num_kv_heads; item++) {
        const int64_t tile = tiles - 1 - item / num_kv_heads; /* the last tiles see the most keys: first */
        const int64_t t0 = tile * TILE, nt = num_tokens - t0 < TILE ? num_tokens - t0 : TILE;
        failed |= attend_tile(&p, q, q_row_stride, out, t0, nt, past, item % num_kv_heads, group, num_heads,
                              scale);
    }
    return failed ? -1 : 0;
}
