/* y = x @ w.T (+ residual) for the rows of x (fp32, CPU): the GEMMs of a decode step and of a short prefill.
 *
 * A decode step of B sequences multiplies B rows by every weight of the model once: for B <= 8 the step is
 * bound by reading the weights (2 B FLOP per 4-byte weight), and blocked GEMM libraries tuned for many rows
 * leave bandwidth unused there (oneDNN's prepacked GEMM: 16 GB/s for 8 rows on an Intel Xeon host's two
 * threads where a copy reaches 26; engine/linear.py).
 *
 * The weight is read from its own packed copy (`skinny_pack`, once at load): panels of NR consecutive
 * output features, each panel [k][NR], i.e. the panel's NR weight rows transposed, the last panel
 * zero-padded. For each k a panel gives NR weights of one input feature side by side; each row m of x
 * contributes x[m][k] times them to NR accumulators (a broadcast and NV fused multiply-adds), so the
 * accumulators hold whole outputs at the end of the panel: no horizontal sums, x's rows (at most 8 x 1536
 * floats, 48 KiB) read a float at a time from L1 / L2, and the weight one linear stream that the hardware
 * prefetchers keep ahead of (a panel of SmolLM2's is 72-192 KiB). This is the inner kernel of the
 * GotoBLAS / BLIS GEMM (K. Goto and R. van de Geijn, "Anatomy of high-performance matrix multiplication",
 * ACM TOMS 34(3), 2008) with the x panel left in place, as a few rows need no packing.
 *
 * NR is two vectors (32 floats with AVX-512, 16 with AVX2 alone), and a panel is read against GROUP rows of x
 * at a time: 8 with AVX-512 (16 accumulators, 19 of its 32 registers with the two weight vectors and the
 * broadcast), 4 with AVX2 (8 + 3 of its 16; more rows re-read the panel from L1 / L2). Measured on an AMD
 * EPYC host (AVX-512, all of SmolLM2's weights, two threads): 28.9 / 29.1 / 28.1 GB/s for 1 / 4 / 8 rows,
 * where the kernel this replaced (each weight row in HF's layout dotted with every row of x, reduced
 * across lanes at the end of the row) read 30.9 / 24.8 / 21.3; one thread 25.8 / 26.4 / 22.0 against
 * 25.4 / 20.8 / 11.9 (oneDNN, two threads, in the first run of the same loop: 22.9 / 25.3 / 21.9 against
 * its 31.9 / 31.5 / 30.7); an 8-sequence decode step of the engine 48 -> 31 ms. The AVX2 build, run on the
 * same host: 20.8 GB/s for 8 rows on two threads, the kernel it replaced 20.5.
 *
 * While the groups of rows read one panel, the next panel of the thread's range is prefetched
 * (`__builtin_prefetch`), its lines shared among the groups: a step reads the weights from memory (30
 * layers of SmolLM2 are 425 MB), and a core's hardware prefetcher follows the panel being read, not the
 * next one, so without it every panel's first pass waited on memory. Measured on an Intel Xeon host
 * (AVX-512; a pass over SmolLM2's 30 layers' GEMMs, weights from memory, best of 4): two threads 24.8 /
 * 26.5 / 88.8 ms for 8 / 16 / 128 rows where oneDNN took 29.8 / 34.8 / 105.2; one thread 47.2 / 49.0 / 159
 * where the kernel without the prefetch took 55.6 / 60.8 / 172 (oneDNN 49.6 / 58.7 / 182). A lone group
 * (up to 8 rows) streams one panel after the next, and there the next panel's lines prefetched into L1
 * held the core's few line-fill buffers; prefetching 16 KiB ahead of its reads into L2 (prefetcht1)
 * instead, the same host, the two builds in turn twice: 8 rows 24.6 / 24.5 -> 22.4 / 22.2 ms on two
 * threads, 48.0 / 46.7 -> 41.9 / 42.1 on one; 4 rows 22.4 / 23.0 -> 20.7 / 20.4 on two (4 / 8 / 16 / 64
 * KiB ahead measured alike, within ~1 ms). A lone group of fewer than GROUP / 2 rows prefetches nothing:
 * for one row the loads alone bound the loop (38.5 ms with a prefetch, 34.6 without, on one thread).
 * Past ~256 rows x outgrows L2 and is re-read from L3 for every panel: oneDNN's blocking wins there
 * (engine/linear.py takes it).
 *
 * SwiGLU's gate and up projections (a Llama MLP's first GEMM, then silu(gate) * up) run as one gated GEMM:
 * `skinny_pack_gated` puts gate features j .. j + NR/2 and up features j .. j + NR/2 side by side in one
 * panel, so a panel's accumulators hold both halves of NR/2 outputs and its epilogue writes silu(gate) * up
 * (vec16.h's silu16, as silu_and_mul.c) instead of the 2 d-wide product: the activation's pass
 * over the product, which had left the GEMM's output for L2 and L3, is gone (SmolLM2, 128-token prefill,
 * one thread: the 30 layers' silu_and_mul calls took 7.4-7.8 ms of a 260 ms step on an Intel Xeon host).
 * Measured there: the gate/up GEMM and its silu 12% faster at 128-256 rows, a 128- or 256-token prefill
 * 3% (one and two threads, in turn in one process).
 *
 * Layouts (row-major fp32): x [rows, k], rows x_stride floats apart; w [n, k] contiguous (gated: [2 d, k],
 * gate's d rows then up's); panels [ceil(n / NR), k, NR] (gated: [ceil(d / (NR / 2)), k, NR]); residual
 * NULL or [rows, n] contiguous; out [rows, n] contiguous (gated: [rows, d]). skinny_linear and
 * skinny_gated_linear return 0, or -2 when rows < 1. OpenMP threads take contiguous ranges of panels.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec16.h"

#ifdef __AVX512F__
#define LANES 16
#define GROUP 8
typedef v16 vec;
#else
#define LANES 8
#define GROUP 4
typedef float vec __attribute__((vector_size(32)));
#endif
#define NV 2
#define NR (NV * LANES) /* output features per panel */
#define STREAM_AHEAD 4096 /* floats (16 KiB): how far ahead of its reads a lone group prefetches */

static inline vec loadv(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }

/* The output features a panel holds (NR), for the caller to size the packed copy. */
int skinny_panel_width(void) { return NR; }

/* panels[p][kk][j] = w[p * NR + j][kk], zero where p * NR + j >= n. */
int skinny_pack(const float *w, int64_t n, int64_t k, float *panels, int num_threads) {
    const int64_t count = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1)
    for (int64_t p = 0; p < count; p++)
        for (int64_t j = 0; j < NR; j++) {
            const int64_t row = p * NR + j;
            float *dst = panels + p * k * NR + j;
            for (int64_t kk = 0; kk < k; kk++) dst[kk * NR] = row < n ? w[row * k + kk] : 0.0f;
        }
    return 0;
}

/* w [2 d, k] (gate's rows, then up's): panels[p][kk][j] = gate row p * NR/2 + j for j < NR/2, up row
 * p * NR/2 + j - NR/2 after, zero where that row is past d. */
int skinny_pack_gated(const float *w, int64_t d, int64_t k, float *panels, int num_threads) {
    const int64_t half = NR / 2, count = (d + half - 1) / half;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1)
    for (int64_t p = 0; p < count; p++)
        for (int64_t j = 0; j < NR; j++) {
            const int64_t feature = p * half + j % half, row = j < half ? feature : d + feature;
            float *dst = panels + p * k * NR + j;
            for (int64_t kk = 0; kk < k; kk++) dst[kk * NR] = feature < d ? w[row * k + kk] : 0.0f;
        }
    return 0;
}

/* silu(gate) * up of a gated panel's NR/2 outputs, from its accumulators (vector 0: gate's, vector 1: up's),
 * in the first NR/2 lanes, as silu_and_mul.c computes it. With AVX-512 the two vectors are taken as they
 * are: through a copy on the stack the gated GEMM was 18% slower than the plain one at 128 rows. */
static inline v16 swiglu_half(const vec acc[NV]) {
#ifdef __AVX512F__
    return silu16(acc[0]) * acc[1];
#else
    float g[16] = {0}, u[16] = {0};
    memcpy(g, &acc[0], sizeof acc[0]);
    memcpy(u, &acc[1], sizeof acc[1]);
    return silu16(load16(g)) * load16(u);
#endif
}

/* Rows [m0, m0 + group) of x against panel w (output features j0 .. j0 + width of out's n; `gated`: the
 * panel's two halves are gate and up of those features), `group` a constant where the caller is
 * specialised, so the accumulators stay in registers. Meanwhile (none when `pf` is NULL) the lines
 * STREAM_AHEAD floats ahead of those read are prefetched into L2 when `pf_every` is 0, else one line of
 * the next panel from `pf` on every `pf_every` (a power of 2) k. */
static inline __attribute__((always_inline)) void panel_rows(
    const int64_t group, const float *xg, int64_t x_stride, const float *w, int64_t n, int64_t k,
    const float *residual, float *out, int64_t m0, int64_t j0, int64_t width, const float *pf,
    int64_t pf_every, int gated) {
    vec acc[GROUP][NV] = {{0}};
#pragma GCC unroll 4 /* measured: one row of x 21 -> 26 GB/s on one thread, four 24 -> 26 */
    for (int64_t kk = 0; kk < k; kk++) {
        if (pf != NULL && pf_every == 0) {
            __builtin_prefetch(w + kk * NR + STREAM_AHEAD, 0, 2);
            __builtin_prefetch(w + kk * NR + STREAM_AHEAD + 16, 0, 2);
        } else if (pf != NULL && (kk & (pf_every - 1)) == 0) {
            __builtin_prefetch(pf + (kk / pf_every) * 16, 0, 3);
        }
        vec wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = loadv(w + kk * NR + v * LANES);
        for (int64_t m = 0; m < group; m++) {
            const float xm = xg[m * x_stride + kk];
            for (int v = 0; v < NV; v++) acc[m][v] += wv[v] * xm;
        }
    }
    for (int64_t m = 0; m < group; m++) {
        const int64_t row = (m0 + m) * n + j0;
        if (gated) {
            const v16 act = swiglu_half(acc[m]);
            if (width == 16)
                store16(out + row, act);
            else
                memcpy(out + row, &act, (size_t)width * sizeof(float));
            continue;
        }
        float sums[NR];
        memcpy(sums, acc[m], sizeof sums);
        for (int64_t q = 0; q < width; q++)
            out[row + q] = (residual != NULL ? residual[row + q] : 0.0f) + sums[q];
    }
}

/* Panels [p0, p1) against all `rows` rows of x, GROUP rows at a time over each panel (the panel stays in
 * L1 / L2 while every group reads it), the next panel of the range prefetched meanwhile: its lines shared
 * by the groups, one every `every` k each; a lone group (a decode step) prefetches its own stream 16 KiB
 * ahead into L2 instead, if it has GROUP / 2 rows or more (for one row the loads alone bound the loop:
 * measured slower with a prefetch). */
static inline __attribute__((always_inline)) void panels_range(
    const int64_t rows, const float *x, int64_t x_stride, const float *panels, int64_t n, int64_t k,
    const float *residual, float *out, int64_t p0, int64_t p1, const int gated) {
    const int64_t per_panel = gated ? NR / 2 : NR; /* output features a panel gives */
    const int64_t groups = (rows + GROUP - 1) / GROUP, lines = k * NR / 16;
    int64_t every = 1;
    while (every * 4 <= groups) every *= 2;
    const int64_t share = groups > 1 ? (k + every - 1) / every : lines, pf_every = groups > 1 ? every : 0;
    const int prefetch = groups > 1 || 2 * rows >= GROUP;
    for (int64_t p = p0; p < p1; p++) {
        const float *w = panels + p * k * NR, *next = prefetch && p + 1 < p1 ? w + k * NR : NULL;
        const int64_t j0 = p * per_panel, width = n - j0 < per_panel ? n - j0 : per_panel;
        for (int64_t g = 0, m0 = 0; m0 < rows; g++, m0 += GROUP) {
            const float *xg = x + m0 * x_stride;
            const float *pf = next != NULL && g * share < lines ? next + g * share * 16 : NULL;
#define ROWS(G) panel_rows(G, xg, x_stride, w, n, k, residual, out, m0, j0, width, pf, pf_every, gated)
            switch (rows - m0 < GROUP ? rows - m0 : GROUP) { /* specialised: accumulators in registers */
                case 1: ROWS(1); break;
                case 2: ROWS(2); break;
                case 3: ROWS(3); break;
#if GROUP > 4
                case 4: ROWS(4); break;
                case 5: ROWS(5); break;
                case 6: ROWS(6); break;
                case 7: ROWS(7); break;
#endif
                default: ROWS(GROUP); break;
            }
#undef ROWS
        }
    }
}

static int run_panels(const float *x, int64_t x_stride, const float *panels, int64_t n, int64_t k,
                      const float *residual, float *out, int64_t rows, int num_threads, int gated) {
    if (rows < 1) return -2;
    const int64_t per_panel = gated ? NR / 2 : NR, count = (n + per_panel - 1) / per_panel;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t p0 = count * t / nt, p1 = count * (t + 1) / nt;
        if (gated) /* each a copy of its own, `gated` a constant in it */
            panels_range(rows, x, x_stride, panels, n, k, NULL, out, p0, p1, 1);
        else
            panels_range(rows, x, x_stride, panels, n, k, residual, out, p0, p1, 0);
    }
    return 0;
}

int skinny_linear(const float *x, int64_t x_stride, const float *panels, int64_t n, int64_t k,
                  const float *residual, float *out, int64_t rows, int num_threads) {
    return run_panels(x, x_stride, panels, n, k, residual, out, rows, num_threads, 0);
}

/* out [rows, d] = silu(x Wgate^T) * (x Wup^T), panels from skinny_pack_gated. */
int skinny_gated_linear(const float *x, int64_t x_stride, const float *panels, int64_t d, int64_t k,
                        float *out, int64_t rows, int num_threads) {
    return run_panels(x, x_stride, panels, d, k, NULL, out, rows, num_threads, 1);
}
