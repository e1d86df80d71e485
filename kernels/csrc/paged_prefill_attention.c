/* Prefill attention over a paged KV cache, read in place (fp32, CPU).
 *
 * One sequence's new tokens (a prompt, or a chunk of one) attend causally over its context, found through
 * its block table: no gather of the blocks into a contiguous copy first. The algorithm is FlashAttention's
 * (Dao et al. 2022, https://arxiv.org/abs/2205.14135) as a CPU loop: the online softmax of Milakov &
 * Gimelshein 2018 (https://arxiv.org/abs/1805.02867) over the keys, KC = 32 at a time, so the scores are
 * never materialised. This file is pdserve's own, built and loaded by native.py.
 *
 * A work item (OpenMP threads take them, longest first) is TILE query tokens and the `group` query heads
 * that read one KV head (GQA): their TILE * group rows share every key and value they load. Before the
 * work items, every chunk of KC keys of each KV head is transposed once into `kt` [head_dim][KC] (each
 * work item used to transpose every chunk it read, so a key was transposed once per tile after it: at
 * 2048 tokens 0.91x the time, one thread), so a row's KC scores are head_dim broadcast-FMAs into two
 * vectors (eight rows at a time, sharing each load of kt: 16 independent FMA chains). The chunk's values
 * are added into four rows' accumulators at a time, a row's whole head_dim of 64 in registers, so each
 * value row loaded serves four rows. Chunks of 32 keys rather than 16 halve the online softmax's
 * per-chunk work (a row's max, sum and rescale): 0.87x / 0.85x the time at 512 / 2048 tokens on an Intel
 * Xeon host (docs/architecture.md §12). Keys past a row's position are masked (causal: query i of n new tokens sits at position context_len - n + i and sees keys 0..that position).
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

/* The K rows of keys [c0, c0 + n) of KV head h (rows[j]: token j's row of the pool, K of every head then
 * V), transposed into kt [head_dim][KC], lanes past n zero. */
static void transpose_chunk(const float *const *rows, int64_t h, int64_t head_dim, int64_t c0, int64_t n,
                            float *kt) {
    for (int64_t t = 0; t < KC; t++) {
        const float *k = t < n ? rows[c0 + t] + h * head_dim : NULL;
        for (int64_t d = 0; d < head_dim; d++) kt[d * KC + t] = k != NULL ? k[d] : 0.0f;
    }
}

/* nr <= RB rows of a work item against one chunk of n keys from c0 (kt: transpose_chunk's, v: the keys'
 * V rows): scores, causal masking, the online-softmax update of each row's (max_score, sum, acc [nr][head_dim]). Row r's
 * query is q[r] (head_dim floats), its position pos[r] >= c0. */
static inline __attribute__((always_inline)) void attend_rows(
    const int64_t dv, const float *const q[RB], int64_t nr, const int64_t pos[RB], const float *kt,
    const float *const *v, int64_t c0, int64_t n, float scale, float *max_score, float *sum, float *acc) {
    const int64_t head_dim = dv * 16;
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
    }
    /* acc = acc * rescale + P V, PV_ROWS rows at a time with a row's whole head_dim in registers (4 rows
     * of 64: 16 accumulators), so each value row loaded serves PV_ROWS rows and each weight p one
     * broadcast serves dv fused multiply-adds. */
    const int64_t pv_rows = dv <= 4 ? 4 : dv <= 8 ? 2 : 1;
    for (int64_t r0 = 0; r0 < nr; r0 += pv_rows) {
        const int64_t m = nr - r0 < pv_rows ? nr - r0 : pv_rows;
        v16 a[4][MAX_HEAD_DIM / 16];
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < dv; i++) a[r][i] = load16(acc + (r0 + r) * head_dim + 16 * i) * rescale[r0 + r];
        for (int64_t t = 0; t < n; t++) {
            v16 x[MAX_HEAD_DIM / 16];
            for (int64_t i = 0; i < dv; i++) x[i] = load16(v[t] + 16 * i);
            for (int64_t r = 0; r < pv_rows; r++)
                if (r < m)
                    for (int64_t i = 0; i < dv; i++) a[r][i] += p[r0 + r][t] * x[i];
        }
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < dv; i++) store16(acc + (r0 + r) * head_dim + 16 * i, a[r][i]);
    }
}

/* Query tokens [t0, t0 + nt) of KV head h's group; kt: that head's keys, transposed by chunk
 * ([chunks][head_dim][KC]); rows: every token's row of the pool; v_offset: floats from a row to its V. */
static int attend_tile(const float *kt, const float *const *rows, int64_t v_offset, int64_t head_dim,
                       const float *q, int64_t q_row_stride, float *out, int64_t t0, int64_t nt, int64_t past,
                       int64_t h, int64_t group, int64_t num_heads, float scale) {
    const int64_t rows_q = nt * group;
    float *scratch = calloc((size_t)(rows_q * (head_dim + 2)), sizeof(float));
    if (scratch == NULL) return -1;
    float *acc = scratch, *max_score = acc + rows_q * head_dim, *sum = max_score + rows_q;
    const float *v[KC];
    for (int64_t r = 0; r < rows_q; r++) max_score[r] = -FLT_MAX;
    const int64_t num_keys = past + t0 + nt;
    for (int64_t c0 = 0; c0 < num_keys; c0 += KC) {
        const int64_t n = num_keys - c0 < KC ? num_keys - c0 : KC;
        const float *kt_chunk = kt + c0 * head_dim; /* chunk c0 / KC of KC * head_dim floats */
        for (int64_t t = 0; t < n; t++) v[t] = rows[c0 + t] + v_offset + h * head_dim;
        /* the first row whose position reaches this chunk: rows before it see none of its keys */
        const int64_t first_token = c0 > past + t0 ? c0 - past - t0 : 0;
        for (int64_t r0 = first_token * group; r0 < rows_q; r0 += RB) {
            const int64_t nr = rows_q - r0 < RB ? rows_q - r0 : RB;
            const float *qr[RB];
            int64_t pos[RB];
            for (int64_t r = 0; r < nr; r++) {
                const int64_t t = t0 + (r0 + r) / group, head = h * group + (r0 + r) % group;
                qr[r] = q + t * q_row_stride + head * head_dim;
                pos[r] = past + t;
            }
            float *m = max_score + r0, *l = sum + r0, *a = acc + r0 * head_dim;
            /* constants where they can be (the full row count, the common head sizes), so the rows'
               vectors stay in registers */
            if (nr == RB && head_dim == 64)
                attend_rows(4, qr, RB, pos, kt_chunk, v, c0, n, scale, m, l, a);
            else if (nr == RB && head_dim == 128)
                attend_rows(8, qr, RB, pos, kt_chunk, v, c0, n, scale, m, l, a);
            else
                attend_rows(head_dim / 16, qr, nr, pos, kt_chunk, v, c0, n, scale, m, l, a);
        }
    }
    for (int64_t r = 0; r < rows_q; r++) {
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
    const int64_t group = num_heads / num_kv_heads, past = context_len - num_tokens;
    const int64_t tiles = (num_tokens + TILE - 1) / TILE, chunks = (context_len + KC - 1) / KC;
    const int64_t token_stride = 2 * num_kv_heads * head_dim, head_keys = chunks * KC * head_dim;
    const float **rows = malloc((size_t)context_len * sizeof *rows);
    float *kt = malloc((size_t)(num_kv_heads * head_keys) * sizeof(float));
    int failed = rows == NULL || kt == NULL;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && !failed)
    if (!failed) {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < context_len; j++)
            rows[j] = kv + (block_table[j / block_size] * block_size + j % block_size) * token_stride;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_kv_heads * chunks; item++) {
            const int64_t h = item / chunks, c0 = item % chunks * KC;
            transpose_chunk(rows, h, head_dim, c0, context_len - c0 < KC ? context_len - c0 : KC,
                            kt + h * head_keys + c0 * head_dim);
        }
#pragma omp for schedule(dynamic, 1) reduction(| : failed)
        for (int64_t item = 0; item < tiles * num_kv_heads; item++) {
            const int64_t tile = tiles - 1 - item / num_kv_heads; /* the last tiles see the most keys: first */
            const int64_t t0 = tile * TILE, nt = num_tokens - t0 < TILE ? num_tokens - t0 : TILE;
            const int64_t h = item % num_kv_heads;
            failed |= attend_tile(kt + h * head_keys, rows, num_kv_heads * head_dim, head_dim, q, q_row_stride,
                                  out, t0, nt, past, h, group, num_heads, scale);
        }
    }
    free(rows);
    free(kt);
    return failed ? -1 : 0;
}
