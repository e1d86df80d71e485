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

#endif
