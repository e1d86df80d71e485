/* SwiGLU's gate (Shazeer 2020, https://arxiv.org/abs/2002.05202; vLLM's SiluAndMul), fp32 on the CPU:
 *     out[r, i] = silu(gate_up[r, i]) * gate_up[r, d + i],   silu(g) = g / (1 + e^-g)
 * from the fused gate/up GEMM's output in one pass, where torch's eager path takes a silu and a mul (two
 * passes and an allocation). silu is vec16.h's silu16, 16 lanes at a time (a tail under 16 zero-padded),
 * as the skinny kernel's gated GEMM applies it in its epilogue (skinny_linear.c): the two agree to the bit.
 *
 * Layouts: gate_up [rows, 2 d] contiguous; out [rows, d] contiguous. Rows are split over `num_threads`
 * OpenMP threads when there are at least PARALLEL_MIN floats. Returns 0. */
#include <stdint.h>
#include <string.h>

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
            store16(o + i, silu16(gv) * load16(u + i));
        }
        if (i < d) { /* the last d % 16 lanes, zero-padded: every lane is silu16's */
            float gl[16] = {0}, ul[16] = {0}, ol[16];
            memcpy(gl, g + i, (size_t)(d - i) * sizeof(float));
            memcpy(ul, u + i, (size_t)(d - i) * sizeof(float));
            store16(ol, silu16(load16(gl)) * load16(ul));
            memcpy(o + i, ol, (size_t)(d - i) * sizeof(float));
        }
    }
    return 0;
}
