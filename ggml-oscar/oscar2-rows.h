// oscar2-rows.h: the inner loops of oscar2 attention on the CPU, one cache row at a time, read
// straight from the 2-bit codes (oscar2.h) without a dequantized copy.
//
//   dot      K.q:  sum_j value_j * y_j over one row of n values (n/G blocks of group size G)
//   mad      P.V:  acc_j = fma(value_j, w, acc_j)
//   to_f32   y_j = value_j (the prefill's tiles)
//
// P.V of a block of rows already widened to f32 (the row-by-row flash attention's blocks):
//
//   acc      acc_j = fma(t_rj, w_r, acc_j) for r = 0 .. n_rows-1 in turn, over rows t_r of n floats
//
// and, for the high-precision window's f16 rows (K.q and the row as f32 for P.V and the tiles):
//
//   f16_dot      sum_j k_j * y_j
//   f16_to_f32   y_j = k_j
//
// with value_j = m + code_j*d of its block. Each loop exists as the plain reference
// (oscar2-rows-scalar.c) and per ISA (oscar2-rows-avx2.c, oscar2-rows-neon.c); oscar2_rows_*
// below picks the one the compiler targets. mad and to_f32 are bit-exact against the reference
// (m + code*d is exact before its one rounding, and all paths fuse the multiply-add), as is
// f16_to_f32 (the conversion is exact) and acc (the same fmas in the same order); dot and f16_dot
// differ only by the order of their float sums. tests/c/oscar2_rows_check.c checks each vector path against
// the reference (natively and, for NEON, under qemu-aarch64), tests/test_oscar2_rows.py the built
// library. Nothing here depends on ggml, so that the check compiles on its own.
#pragma once

#include "oscar2.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

float oscar2_rows_dot_scalar   (const void * x, const float * y, int64_t n, int G);
void  oscar2_rows_mad_scalar   (const void * x, float w, float * acc, int64_t n, int G);
void  oscar2_rows_to_f32_scalar(const void * x, float * y, int64_t n, int G);
void  oscar2_rows_acc_scalar   (const float * t, const float * w, int n_rows, float * acc, int64_t n);
float oscar2_rows_f16_dot_scalar   (const uint16_t * k, const float * y, int64_t n);
void  oscar2_rows_f16_to_f32_scalar(const uint16_t * k, float * y, int64_t n);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OSCAR2_ROWS_AVX2 1
float oscar2_rows_dot_avx2   (const void * x, const float * y, int64_t n, int G);
void  oscar2_rows_mad_avx2   (const void * x, float w, float * acc, int64_t n, int G);
void  oscar2_rows_to_f32_avx2(const void * x, float * y, int64_t n, int G);
void  oscar2_rows_acc_avx2   (const float * t, const float * w, int n_rows, float * acc, int64_t n);
float oscar2_rows_f16_dot_avx2   (const uint16_t * k, const float * y, int64_t n);
void  oscar2_rows_f16_to_f32_avx2(const uint16_t * k, float * y, int64_t n);
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define OSCAR2_ROWS_NEON 1
float oscar2_rows_dot_neon   (const void * x, const float * y, int64_t n, int G);
void  oscar2_rows_mad_neon   (const void * x, float w, float * acc, int64_t n, int G);
void  oscar2_rows_to_f32_neon(const void * x, float * y, int64_t n, int G);
void  oscar2_rows_acc_neon   (const float * t, const float * w, int n_rows, float * acc, int64_t n);
float oscar2_rows_f16_dot_neon   (const uint16_t * k, const float * y, int64_t n);
void  oscar2_rows_f16_to_f32_neon(const uint16_t * k, float * y, int64_t n);
#endif

// the fastest path this compilation targets
static inline float oscar2_rows_dot(const void * x, const float * y, int64_t n, int G) {
#if defined(OSCAR2_ROWS_AVX2)
    return oscar2_rows_dot_avx2(x, y, n, G);
#elif defined(OSCAR2_ROWS_NEON)
    return oscar2_rows_dot_neon(x, y, n, G);
#else
    return oscar2_rows_dot_scalar(x, y, n, G);
#endif
}

static inline void oscar2_rows_mad(const void * x, float w, float * acc, int64_t n, int G) {
#if defined(OSCAR2_ROWS_AVX2)
    oscar2_rows_mad_avx2(x, w, acc, n, G);
#elif defined(OSCAR2_ROWS_NEON)
    oscar2_rows_mad_neon(x, w, acc, n, G);
#else
    oscar2_rows_mad_scalar(x, w, acc, n, G);
#endif
}

static inline void oscar2_rows_to_f32(const void * x, float * y, int64_t n, int G) {
#if defined(OSCAR2_ROWS_AVX2)
    oscar2_rows_to_f32_avx2(x, y, n, G);
#elif defined(OSCAR2_ROWS_NEON)
    oscar2_rows_to_f32_neon(x, y, n, G);
#else
    oscar2_rows_to_f32_scalar(x, y, n, G);
#endif
}

static inline void oscar2_rows_acc(const float * t, const float * w, int n_rows, float * acc, int64_t n) {
#if defined(OSCAR2_ROWS_AVX2)
    oscar2_rows_acc_avx2(t, w, n_rows, acc, n);
#elif defined(OSCAR2_ROWS_NEON)
    oscar2_rows_acc_neon(t, w, n_rows, acc, n);
#else
    oscar2_rows_acc_scalar(t, w, n_rows, acc, n);
#endif
}

static inline float oscar2_rows_f16_dot(const uint16_t * k, const float * y, int64_t n) {
#if defined(OSCAR2_ROWS_AVX2)
    return oscar2_rows_f16_dot_avx2(k, y, n);
#elif defined(OSCAR2_ROWS_NEON)
    return oscar2_rows_f16_dot_neon(k, y, n);
#else
    return oscar2_rows_f16_dot_scalar(k, y, n);
#endif
}

static inline void oscar2_rows_f16_to_f32(const uint16_t * k, float * y, int64_t n) {
#if defined(OSCAR2_ROWS_AVX2)
    oscar2_rows_f16_to_f32_avx2(k, y, n);
#elif defined(OSCAR2_ROWS_NEON)
    oscar2_rows_f16_to_f32_neon(k, y, n);
#else
    oscar2_rows_f16_to_f32_scalar(k, y, n);
#endif
}

#ifdef __cplusplus
}
#endif
