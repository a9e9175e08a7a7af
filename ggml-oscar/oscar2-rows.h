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
// K.q of a block of rows for the heads that share them (GQA), straight from the codes:
//
//   scores   s[h*ld + r] = sum_j value_rj * q_hj, for rows x[r] and queries q[h]
//
// in one order that every path keeps, so that all agree bit for bit. Lane l (of eight) of a row
// takes A_l = fma(value_j, q_j, A_l) over its elements j = b*G + s*G/4 + c + l: blocks b in turn,
// within a block c = 0, 8, .. below G/4, within that s = 0..3; from A_l = 0. Then
// score = ((A0+A1)+(A2+A3)) + ((A4+A5)+(A6+A7)). AVX2 takes a block's values from a permute of its
// four levels by the code bytes (no conversion), for two rows at a time, and sums eight rows' lanes
// at once by a transpose (hadd); NEON converts the codes and sums four rows' lanes by pairwise
// adds. No row takes a horizontal sum of its own, and a row's codes are read once for up to four
// heads.
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
// f16_to_f32 (the conversion is exact), acc and scores (the same fmas and sums in the same order);
// dot and f16_dot differ only by the order of their float sums. tests/c/oscar2_rows_check.c checks each vector path against
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
void  oscar2_rows_scores_scalar(const uint8_t * const * x, int n_rows, const float * const * q, int nh,
                                int64_t n, int G, float * s, int ld);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define OSCAR2_ROWS_AVX2 1
float oscar2_rows_dot_avx2   (const void * x, const float * y, int64_t n, int G);
void  oscar2_rows_mad_avx2   (const void * x, float w, float * acc, int64_t n, int G);
void  oscar2_rows_to_f32_avx2(const void * x, float * y, int64_t n, int G);
void  oscar2_rows_acc_avx2   (const float * t, const float * w, int n_rows, float * acc, int64_t n);
float oscar2_rows_f16_dot_avx2   (const uint16_t * k, const float * y, int64_t n);
void  oscar2_rows_f16_to_f32_avx2(const uint16_t * k, float * y, int64_t n);
void  oscar2_rows_scores_avx2(const uint8_t * const * x, int n_rows, const float * const * q, int nh,
                              int64_t n, int G, float * s, int ld);
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define OSCAR2_ROWS_NEON 1
float oscar2_rows_dot_neon   (const void * x, const float * y, int64_t n, int G);
void  oscar2_rows_mad_neon   (const void * x, float w, float * acc, int64_t n, int G);
void  oscar2_rows_to_f32_neon(const void * x, float * y, int64_t n, int G);
void  oscar2_rows_acc_neon   (const float * t, const float * w, int n_rows, float * acc, int64_t n);
float oscar2_rows_f16_dot_neon   (const uint16_t * k, const float * y, int64_t n);
void  oscar2_rows_f16_to_f32_neon(const uint16_t * k, float * y, int64_t n);
void  oscar2_rows_scores_neon(const uint8_t * const * x, int n_rows, const float * const * q, int nh,
                              int64_t n, int G, float * s, int ld);
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

// x: n_rows row pointers (n values each); q: nh queries of n floats; s: head h's scores at s + h*ld
static inline void oscar2_rows_scores(const uint8_t * const * x, int n_rows, const float * const * q, int nh,
                                      int64_t n, int G, float * s, int ld) {
#if defined(OSCAR2_ROWS_AVX2)
    oscar2_rows_scores_avx2(x, n_rows, q, nh, n, G, s, ld);
#elif defined(OSCAR2_ROWS_NEON)
    oscar2_rows_scores_neon(x, n_rows, q, nh, n, G, s, ld);
#else
    oscar2_rows_scores_scalar(x, n_rows, q, nh, n, G, s, ld);
#endif
}

#ifdef __cplusplus
}
#endif
