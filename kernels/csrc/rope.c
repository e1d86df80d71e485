/* Rotary position embedding (RoFormer) in HF's layout, out of place (fp32, CPU): dimension i of a head is
 * paired with i + head_dim/2 (`rotate_half`), so
 *     out[i]        = x[i] * cos[i]        - x[i + half] * sin[i]
 *     out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half]        (i < half)
 * — x * cos + rotate_half(x) * sin in one pass, where torch's eager path takes a cat, a neg, two muls and
 * an add.
 *
 * Layouts: x [rows, heads, head_dim], rows x_stride floats apart, a row's heads contiguous (a slice of the
 * fused QKV output); cos, sin [rows, head_dim] contiguous (the tables' rows at each token's position);
 * out [rows, heads, head_dim] contiguous. Tokens are split over `num_threads` OpenMP threads when there
 * are at least PARALLEL_MIN floats. Returns 0; -2 when head_dim is odd. */
#include <stdint.h>

#include "vec16.h"

#define PARALLEL_MIN 32768

int rope(const float *restrict x, int64_t x_stride, const float *restrict cos, const float *restrict sin,
         float *restrict out, int64_t rows, int64_t heads, int64_t head_dim, int num_threads) {
    if (head_dim % 2)
        return -2;
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * x_stride + h * head_dim;
            float *o = out + (r * heads + h) * head_dim;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) { /* 16 pairs at a time (GCC left the plain loop scalar) */
                const v16 a = load16(xh + i), b = load16(xh + i + half);
                store16(o + i, a * load16(c + i) - b * load16(s + i));
                store16(o + i + half, b * load16(c + i + half) + a * load16(s + i + half));
            }
            for (; i < half; i++) {
                o[i] = xh[i] * c[i] - xh[i + half] * s[i];
                o[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
            }
        }
    }
    return 0;
}
