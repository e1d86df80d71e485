/* 16-float vectors for pdserve's C kernels (GCC vector extensions: one zmm with AVX-512, two ymm with
 * AVX2), shared by the kernels beside it; kernels/native.py hashes it into every kernel's cache key. */
#ifndef PDSERVE_VEC16_H
#define PDSERVE_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64))); /* one zmm with AVX-512, two ymm with AVX2 */
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Lane t of the result = the sum of x[t]'s 16 lanes: four rounds of folding pairs of vectors into one
 * (halves of each added, the two results side by side), then the lanes back in order (the rounds leave
 * vector t's sum in lane bitreverse4(t)). 15 shuffle pairs and adds for 16 dot products, instead of a
 * horizontal sum each. */
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

/* e^x in every lane, for x <= 88.7 (above: inf's neighbourhood is clamped to e^88.7); lanes under
 * -87.3 give 2^-126 (the least normal float, ~1e-38), not 0: callers that need an exact 0 (a masked
 * score) select it. Cephes' expf (S. Moshier, http://www.netlib.org/cephes/): x = n ln2 + r with
 * n = round(x log2 e) and ln2 split in two constants so r is exact, |r| <= ln2/2, e^r from a degree-7
 * polynomial, 2^n put into the exponent bits; within ~2 ulp of libm's expf over that range. GCC leaves
 * expf in a fully unrolled 16-lane loop as 16 scalar calls (the SLP vectoriser does not use libmvec). */
static inline v16 select16(i16 mask, v16 a, v16 b) { /* a where mask lanes are -1, else b */
    return (v16)(((i16)a & mask) | ((i16)b & ~mask));
}

static inline v16 max16(v16 a, v16 b) { return select16(a > b, a, b); }

static inline v16 min16(v16 a, v16 b) { return select16(a < b, a, b); }

/* Every lane of the result = the max (hmax16) or the sum (hsum16) of x's 16 lanes: four rounds of
 * combining x with itself rotated by 8, 4, 2, 1 lanes, rather than a 16-step scalar chain. */
static inline v16 hmax16(v16 x) {
    x = max16(x, __builtin_shuffle(x, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = max16(x, __builtin_shuffle(x, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    x = max16(x, __builtin_shuffle(x, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    return max16(x, __builtin_shuffle(x, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
}

static inline v16 hsum16(v16 x) {
    x += __builtin_shuffle(x, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    return x + __builtin_shuffle(x, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
}

static inline v16 exp16(v16 x) {
    const v16 top = (v16){0} + 88.7228317f, bottom = (v16){0} - 87.3365479f;
    x = select16(x > top, top, select16(x < bottom, bottom, x));
    const v16 fx = x * 1.44269504088896341f + 0.5f;
    i16 n = __builtin_convertvector(fx, i16);  /* truncated toward 0 */
    n += __builtin_convertvector(n, v16) > fx; /* -1 where that rounded up: floor */
    const v16 nf = __builtin_convertvector(n, v16);
    x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 y = 1.9875691500e-4f * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    return y * (v16)((n + 127) << 23);
}

/* silu(g) = g / (1 + e^-g) in every lane (SwiGLU's gate, vLLM's SiluAndMul), e^-g at most e^88: past that
 * 1 + e^-g is inf, and -ffast-math's reciprocal (an estimate refined by one Newton step, r (2 - d r))
 * turns inf * 0 into NaN where HF's silu gives -0 (g < -88.7: a large negative gate). Clamped, the
 * quotient is a denormal flushed to 0. One definition for every kernel that applies it, so they agree
 * to the bit. */
static inline v16 silu16(v16 g) { return g / (1.0f + exp16(min16(-g, (v16){0} + 88.0f))); }

#endif
