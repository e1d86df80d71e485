/* SwiGLU's gate (Shazeer 2020, https://arxiv.org/abs/2002.05202; vLLM's SiluAndMul), fp32 on the CPU:
 *     out[r, i] = silu(gate_up[r, i]) * gate_up[r, d + i],   silu(g) = g / (1 + e^-g)
 * from the fused gate/up GEMM's output in one pass, where torch's eager path takes a silu and a mul (two
 * passes and an allocation). e^x is vec16.h's exp16, 16 lanes at a time; a tail under 16 takes libm's.
 *
 * Layouts: gate_up [rows, 2 d] contiguous; out [rows, d] contiguous. Rows are split over `num_threads`
 * OpenMP threads when there are at least PARALLEL_MIN floats. Returns 0. */
#include <math.h>
#include <stdint.h>

#include "vec16.h"

#define PARALLEL_MIN 32768

int silu_and_mul(const float *restrict gate_up, float *restrict out, int64_t rows, int64_t d, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * d, *u = g + d;
        float *o = out + r * d;
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) {
            const v16 gv = load16(g + i);
            store16(o + i, gv / (1.0f + exp16(-gv)) * load16(u + i));
        }
        for (; i < d; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}
