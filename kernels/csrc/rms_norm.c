/* RMSNorm over the last dimension (fp32, CPU): out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), the
 * order of HF's LlamaRMSNorm (normalise, then scale). One pass to sum the squares and one to write, where
 * torch's eager path takes six ops (pow, mean, add, rsqrt, two muls), each a pass and an allocation: for a
 * decode step's few rows the per-op cost is the whole cost.
 *
 * Layouts: x [rows, dim], rows x_stride floats apart, each row contiguous; weight [dim]; out [rows, dim]
 * contiguous. Rows are split over `num_threads` OpenMP threads when there are at least PARALLEL_MIN floats
 * (under that a team's wake-up costs more than the work). Returns 0. */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN 32768

int rms_norm(const float *restrict x, int64_t x_stride, const float *restrict weight, float *restrict out,
             int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        float squares = 0.0f;
        for (int64_t i = 0; i < dim; i++)
            squares += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            o[i] = weight[i] * (xr[i] * scale);
    }
    return 0;
}
