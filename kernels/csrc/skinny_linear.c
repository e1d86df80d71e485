/* y = x @ w.T (+ residual) for a few rows of x (fp32, CPU): the GEMMs of a decode step.
 *
 * A decode step of B sequences multiplies B rows by every weight of the model once: for B <= 8 the step is
 * bound by reading the weights, not by FLOPs (2 B FLOP per 4-byte weight). Blocked GEMM libraries tuned
 * for many rows leave bandwidth unused there: on an Intel Xeon host oneDNN's prepacked GEMM read
 * SmolLM2's weights at 16 GB/s for 8 rows on two threads where a copy reaches 26 GB/s
 * (engine/linear.py). This kernel streams each weight row once, straight from the weight as loaded
 * ([out_features, in_features], HF's layout), and multiplies it by every row of x while it is in
 * registers: two weight rows at a time, 16 floats at a time (GCC vector extensions: one zmm with
 * AVX-512), one accumulator per (weight row, x row), so x's rows (at most 8 x 1536 floats: L1-resident)
 * are loaded once per two weight rows. The 2 x rows accumulators are reduced together at the end of the
 * row pair (`sum_lanes16`: 15 shuffle-adds for 16 sums, as in paged_decode_attention.c). OpenMP threads
 * take contiguous ranges of weight rows.
 *
 * Layouts (row-major fp32): x [rows, k], rows x_stride floats apart; w [n, k] contiguous; residual NULL or
 * [rows, n] contiguous; out [rows, n] contiguous. Returns 0; -2 when rows is not in 1..8 or k is not a
 * multiple of 16.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_ROWS 8
#ifndef PREFETCH
#define PREFETCH 2048
#endif
#define BLOCK 16 /* weight rows per tile: one 64-byte line of out per x row */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Lane t of the result = the sum of x[t]'s 16 lanes (see paged_decode_attention.c). */
static inline v16 sum_lanes16(const v16 x[16]) {
    v16 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = __builtin_shuffle(x[2 * j], x[2 * j + 1], (i16){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23})
             + __builtin_shuffle(x[2 * j], x[2 * j + 1], (i16){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shuffle(a[2 * j], a[2 * j + 1], (i16){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27})
             + __builtin_shuffle(a[2 * j], a[2 * j + 1], (i16){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shuffle(b[2 * j], b[2 * j + 1], (i16){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29})
             + __builtin_shuffle(b[2 * j], b[2 * j + 1], (i16){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    const v16 d = __builtin_shuffle(c[0], c[1], (i16){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30})
                + __builtin_shuffle(c[0], c[1], (i16){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
    return __builtin_shuffle(d, (i16){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}

/* Weight rows [n0, n1) against `rows` rows of x (a constant where the caller is specialised, so the
 * accumulators stay in registers), BLOCK weight rows at a time: their sums are kept in a tile and written
 * as one cache line per row of out, not two floats at a time (gate/up's 8 x 3072-float out is bigger than
 * L1: line by line it was read back for every pair and ran at 0.8x oneDNN). */
static inline __attribute__((always_inline)) void rows_range(
    const int64_t rows, const float *x, int64_t x_stride, const float *w, int64_t n, int64_t k,
    const float *residual, float *out, int64_t n0, int64_t n1) {
    for (int64_t jb = n0; jb < n1; jb += BLOCK) {
        const int64_t width = n1 - jb < BLOCK ? n1 - jb : BLOCK;
        float tile[MAX_ROWS][BLOCK];
        for (int64_t j = 0; j < width; j += 2) {
            const int64_t pair = j + 1 < width ? 2 : 1;
            const float *w0 = w + (jb + j) * k, *w1 = w0 + (pair - 1) * k; /* a lone last row is read twice */
            v16 acc[2 * MAX_ROWS] = {0};
            for (int64_t i = 0; i < k; i += 16) {
                __builtin_prefetch(w0 + i + PREFETCH);
                __builtin_prefetch(w1 + i + PREFETCH);
                const v16 a = load16(w0 + i), b = load16(w1 + i);
                for (int64_t m = 0; m < rows; m++) {
                    const v16 xv = load16(x + m * x_stride + i);
                    acc[m] += a * xv;
                    acc[MAX_ROWS + m] += b * xv;
                }
            }
            float sums[16];
            const v16 s = sum_lanes16(acc);
            memcpy(sums, &s, sizeof sums);
            for (int64_t m = 0; m < rows; m++) {
                tile[m][j] = sums[m];
                tile[m][j + 1] = sums[MAX_ROWS + m];
            }
        }
        for (int64_t m = 0; m < rows; m++)
            for (int64_t q = 0; q < width; q++)
                out[m * n + jb + q] = (residual != NULL ? residual[m * n + jb + q] : 0.0f) + tile[m][q];
    }
}

int skinny_linear(const float *x, int64_t x_stride, const float *w, int64_t n, int64_t k,
                  const float *residual, float *out, int64_t rows, int num_threads) {
    if (rows < 1 || rows > MAX_ROWS || k % 16) return -2;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t n0 = BLOCK * (blocks * t / nt), end = BLOCK * (blocks * (t + 1) / nt);
        const int64_t n1 = end < n ? end : n;
        switch (rows) { /* specialised: the accumulators of every row count in registers */
            case 1: rows_range(1, x, x_stride, w, n, k, residual, out, n0, n1); break;
            case 2: rows_range(2, x, x_stride, w, n, k, residual, out, n0, n1); break;
            case 3: rows_range(3, x, x_stride, w, n, k, residual, out, n0, n1); break;
            case 4: rows_range(4, x, x_stride, w, n, k, residual, out, n0, n1); break;
            case 5: rows_range(5, x, x_stride, w, n, k, residual, out, n0, n1); break;
            case 6: rows_range(6, x, x_stride, w, n, k, residual, out, n0, n1); break;
            case 7: rows_range(7, x, x_stride, w, n, k, residual, out, n0, n1); break;
            default: rows_range(8, x, x_stride, w, n, k, residual, out, n0, n1); break;
        }
    }
    return 0;
}
