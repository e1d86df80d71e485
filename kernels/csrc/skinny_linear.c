/* y = x @ w.T (+ residual) for a few rows of x (fp32, CPU): the GEMMs of a decode step.
 *
 * A decode step of B sequences multiplies B rows by every weight of the model once: for B <= 8 the step is
 * bound by reading the weights, not by FLOPs (2 B FLOP per 4-byte weight). Blocked GEMM libraries tuned
 * for many rows leave bandwidth unused there: on an Intel Xeon host oneDNN's prepacked GEMM read
 * SmolLM2's weights at 16 GB/s for 8 rows on two threads where a copy reaches 26 GB/s
 * (engine/linear.py). This kernel streams each weight row once, straight from the weight as loaded
 * ([out_features, in_features], HF's layout), and multiplies it by every row of x while it is in
 * registers: two weight rows at a time, LANES floats at a time, one accumulator per (weight row,
 * x row), so x's rows (at most 8 x 1536 floats, 48 KiB: L1 or L2) are loaded once per two weight rows. The
 * hardware prefetchers stop at page boundaries, so the weight is prefetched PREFETCH floats (8 KiB) ahead
 * in software: without it the kernel read 14 GB/s for 8 rows, with it 20 (the Intel host above). The
 * 2 x rows accumulators are reduced together at the end of the row pair (`sum_lanes`: LANES - 1
 * shuffle-adds for LANES sums) into a tile of BLOCK outputs per row of x, written out a cache line at a
 * time. OpenMP threads take contiguous ranges of BLOCK weight rows.
 *
 * LANES is 16 (one zmm, vec16.h's v16) with AVX-512 and 8 (one ymm) without: with AVX2 alone a v16 is two
 * ymm, and 16 accumulators of two would not fit AVX2's 16 registers. Measured on an AMD EPYC host with
 * AVX2 only (Zen 1, one thread, all of SmolLM2's weights), one row at a time: 7.7 / 6.0 / 4.7 GB/s for
 * 1 / 4 / 8 rows of x with 8 lanes against 4.1 / 1.6 / 0.7 with v16 (a plain sum: 9.4).
 *
 * That is `row_pairs` = 1. With `row_pairs` = 0 the weight rows are read one at a time instead, with no
 * software prefetch: the weight is then one linear stream, left to the hardware prefetchers (page
 * boundaries and all, they kept up with one stream where they did not with two on the host below), at
 * the cost of loading x's rows once per weight row rather than once per two.
 * Which is faster depends on the CPU and the row count (an AMD EPYC host, two threads, SmolLM2's weights:
 * one row at a time read 31 / 26 / 19 GB/s for 1 / 4 / 8 rows of x, row pairs 24 / 22 / 21, a plain sum
 * of the same weights 29), so engine/linear.py times both per row count (`calibrate_paths`).
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

#include "vec16.h"

/* The vector of the dot products, LANES floats (the header says why 16 or 8). */
#ifdef __AVX512F__
#define LANES 16
typedef v16 vec;
static inline vec loadv(const float *p) { return load16(p); }
static inline vec sum_lanes(const vec x[16]) { return sum_lanes16(x); }
#else
#define LANES 8
typedef float vec __attribute__((vector_size(32)));
typedef int32_t ivec __attribute__((vector_size(32)));
static inline vec loadv(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
/* lane t = the sum of x[t]'s 8 lanes (sum_lanes16's folding, three rounds) */
static inline vec sum_lanes(const vec x[8]) {
    vec a[4], b[2];
    for (int j = 0; j < 4; j++)
        a[j] = __builtin_shuffle(x[2 * j], x[2 * j + 1], (ivec){0, 1, 2, 3, 8, 9, 10, 11})
             + __builtin_shuffle(x[2 * j], x[2 * j + 1], (ivec){4, 5, 6, 7, 12, 13, 14, 15});
    for (int j = 0; j < 2; j++)
        b[j] = __builtin_shuffle(a[2 * j], a[2 * j + 1], (ivec){0, 1, 8, 9, 4, 5, 12, 13})
             + __builtin_shuffle(a[2 * j], a[2 * j + 1], (ivec){2, 3, 10, 11, 6, 7, 14, 15});
    const vec c = __builtin_shuffle(b[0], b[1], (ivec){0, 8, 2, 10, 4, 12, 6, 14})
                + __builtin_shuffle(b[0], b[1], (ivec){1, 9, 3, 11, 5, 13, 7, 15});
    return __builtin_shuffle(c, (ivec){0, 4, 2, 6, 1, 5, 3, 7});
}
#endif

#define MAX_ROWS 8
#define PREFETCH 2048 /* floats ahead of the row being read: 8 KiB (2, 4 and 16 KiB measured slower) */
#define BLOCK 16 /* weight rows per tile: one 64-byte line of out per x row */

/* Weight rows [n0, n1) against `rows` rows of x (`rows` and `pairs` constants where the caller is
 * specialised, so the accumulators stay in registers), BLOCK weight rows at a time: their sums are kept in
 * a tile and written as one cache line per row of out. `pairs`: two weight rows at a time, prefetched in
 * software; else one, left to the hardware prefetchers. */
static inline __attribute__((always_inline)) void rows_range(
    const int64_t rows, const int pairs, const float *x, int64_t x_stride, const float *w, int64_t n,
    int64_t k, const float *residual, float *out, int64_t n0, int64_t n1) {
    for (int64_t jb = n0; jb < n1; jb += BLOCK) {
        const int64_t width = n1 - jb < BLOCK ? n1 - jb : BLOCK;
        float tile[MAX_ROWS][BLOCK];
        for (int64_t j = 0; j < width; j += pairs ? 2 : 1) {
            const int64_t pair = pairs && j + 1 < width ? 2 : 1;
            const float *w0 = w + (jb + j) * k, *w1 = w0 + (pair - 1) * k; /* a lone last row is read twice */
            vec acc[2 * MAX_ROWS] = {0};
            for (int64_t i = 0; i < k; i += LANES) {
                const vec a = loadv(w0 + i);
                if (pairs) {
                    __builtin_prefetch(w0 + i + PREFETCH);
                    __builtin_prefetch(w1 + i + PREFETCH);
                    const vec b = loadv(w1 + i);
                    for (int64_t m = 0; m < rows; m++) {
                        const vec xv = loadv(x + m * x_stride + i);
                        acc[m] += a * xv;
                        acc[MAX_ROWS + m] += b * xv;
                    }
                } else {
                    for (int64_t m = 0; m < rows; m++) acc[m] += a * loadv(x + m * x_stride + i);
                }
            }
            float sums[2 * MAX_ROWS];
            for (int g = 0; g < 2 * MAX_ROWS; g += LANES) {
                const vec s = sum_lanes(acc + g);
                memcpy(sums + g, &s, sizeof s);
            }
            for (int64_t m = 0; m < rows; m++) {
                tile[m][j] = sums[m];
                if (pairs) tile[m][j + 1] = sums[MAX_ROWS + m];
            }
        }
        for (int64_t m = 0; m < rows; m++)
            for (int64_t q = 0; q < width; q++)
                out[m * n + jb + q] = (residual != NULL ? residual[m * n + jb + q] : 0.0f) + tile[m][q];
    }
}

/* rows_range with `rows` and `pairs` as constants. */
#define RANGE(R, P) rows_range(R, P, x, x_stride, w, n, k, residual, out, n0, n1)
#define BY_ROWS(P)                                      \
    switch (rows) {                                     \
        case 1: RANGE(1, P); break;                     \
        case 2: RANGE(2, P); break;                     \
        case 3: RANGE(3, P); break;                     \
        case 4: RANGE(4, P); break;                     \
        case 5: RANGE(5, P); break;                     \
        case 6: RANGE(6, P); break;                     \
        case 7: RANGE(7, P); break;                     \
        default: RANGE(8, P); break;                    \
    }

int skinny_linear(const float *x, int64_t x_stride, const float *w, int64_t n, int64_t k,
                  const float *residual, float *out, int64_t rows, int row_pairs, int num_threads) {
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
        if (row_pairs) /* specialised: the accumulators of every row count in registers */
            BY_ROWS(1)
        else
            BY_ROWS(0)
    }
    return 0;
}
