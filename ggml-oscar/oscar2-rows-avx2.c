// oscar2-rows-avx2.c: the row loops of oscar2-rows.h with AVX2, FMA and F16C (x86-64).
// Tested against oscar2-rows-scalar.c: mad, to_f32, acc and scores bit for bit, dot within float
// summation order (tests/c/oscar2_rows_check.c, tests/test_oscar2_rows.py).
//
// A block's G/4 code bytes are read 8 at a time, widened to eight 32-bit lanes; shifting those by
// 2s gives the codes of elements s*G/4 + c .. +7 (byte b holds elements b, b+G/4, b+G/2, b+3G/4).
// Where the values are wanted (mad, to_f32, scores), a permute of the block's four levels by those
// lanes gives eight values at once, with no convert and no multiply; dot converts the codes and
// applies d and m per block. The window's f16 rows are converted 8 values at a time by F16C.

#include "oscar2-rows.h"

#if defined(OSCAR2_ROWS_AVX2)
#include <immintrin.h>
#include <math.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline __m256i bytes8(const uint8_t * p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) p));
}

float oscar2_rows_dot_avx2(const void * x, const float * y, int64_t n, int G) {
    const size_t bs = oscar2_block_bytes(G);
    const int q4 = G/4;
    const __m256i three = _mm256_set1_epi32(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const block_oscar2 * b = (const block_oscar2 *) ((const uint8_t *) x + ib*bs);
        const float * yb = y + ib*G;
        __m256 sq0 = _mm256_setzero_ps(), sq1 = _mm256_setzero_ps();
        __m256 sy0 = _mm256_setzero_ps(), sy1 = _mm256_setzero_ps();
        for (int c = 0; c < q4; c += 8) {
            const __m256i raw = bytes8(b->qs + c);
            const __m256 y0 = _mm256_loadu_ps(yb + 0*q4 + c);
            const __m256 y1 = _mm256_loadu_ps(yb + 1*q4 + c);
            const __m256 y2 = _mm256_loadu_ps(yb + 2*q4 + c);
            const __m256 y3 = _mm256_loadu_ps(yb + 3*q4 + c);
            sq0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(raw, three)),                         y0, sq0);
            sq1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 2), three)), y1, sq1);
            sq0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 4), three)), y2, sq0);
            sq1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 6)),                           y3, sq1);
            sy0 = _mm256_add_ps(sy0, _mm256_add_ps(y0, y1));
            sy1 = _mm256_add_ps(sy1, _mm256_add_ps(y2, y3));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(b->d)), _mm256_add_ps(sq0, sq1), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(b->m)), _mm256_add_ps(sy0, sy1), acc);
    }
    return hsum(acc);
}

// a block's four levels, twice: lane i holds fma(i & 3, d, m), so that a permute by a lane whose low
// two bits are a code gives its value (vpermps reads the low three bits of each index)
static inline __m256 levels(const block_oscar2 * b) {
    return _mm256_fmadd_ps(_mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3), _mm256_set1_ps(_cvtsh_ss(b->d)), _mm256_set1_ps(_cvtsh_ss(b->m)));
}

// value = fma(code, d, m): code*d is exact, so this is m + code*d with its one rounding.
// accumulate: out = fma(value, w, out) (mad), else out = value (to_f32); inlined with a constant.
static inline void values(const void * x, float w, float * out, int64_t n, int G, int accumulate) {
    const size_t bs = oscar2_block_bytes(G);
    const int q4 = G/4;
    const __m256 wv = _mm256_set1_ps(w);
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const block_oscar2 * b = (const block_oscar2 *) ((const uint8_t *) x + ib*bs);
        const __m256 lv = levels(b);
        float * ob = out + ib*G;
        for (int c = 0; c < q4; c += 8) {
            __m256i raw = bytes8(b->qs + c);
            for (int s = 0; s < 4; ++s) {
                const __m256 v = _mm256_permutevar8x32_ps(lv, raw);
                float * o = ob + s*q4 + c;
                _mm256_storeu_ps(o, accumulate ? _mm256_fmadd_ps(v, wv, _mm256_loadu_ps(o)) : v);
                raw = _mm256_srli_epi32(raw, 2);
            }
        }
    }
}

void oscar2_rows_mad_avx2(const void * x, float w, float * acc, int64_t n, int G) {
    values(x, w, acc, n, G, 1);
}

void oscar2_rows_to_f32_avx2(const void * x, float * y, int64_t n, int G) {
    values(x, 0.0f, y, n, G, 0);
}

// 32 columns of acc at a time held in four registers across the rows; the tail as the reference
void oscar2_rows_acc_avx2(const float * t, const float * w, int n_rows, float * acc, int64_t n) {
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + j),      a1 = _mm256_loadu_ps(acc + j + 8);
        __m256 a2 = _mm256_loadu_ps(acc + j + 16), a3 = _mm256_loadu_ps(acc + j + 24);
        for (int r = 0; r < n_rows; ++r) {
            const __m256 wr = _mm256_set1_ps(w[r]);
            const float * tr = t + r*n + j;
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(tr),      wr, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(tr + 8),  wr, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(tr + 16), wr, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(tr + 24), wr, a3);
        }
        _mm256_storeu_ps(acc + j, a0);      _mm256_storeu_ps(acc + j + 8, a1);
        _mm256_storeu_ps(acc + j + 16, a2); _mm256_storeu_ps(acc + j + 24, a3);
    }
    for (; j < n; ++j) {
        float a = acc[j];
        for (int r = 0; r < n_rows; ++r) {
            a = fmaf(t[r*n + j], w[r], a);
        }
        acc[j] = a;
    }
}

static inline __m256 halves8(const uint16_t * k) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) k));
}

float oscar2_rows_f16_dot_avx2(const uint16_t * k, const float * y, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        acc0 = _mm256_fmadd_ps(halves8(k + j),     _mm256_loadu_ps(y + j),     acc0);
        acc1 = _mm256_fmadd_ps(halves8(k + j + 8), _mm256_loadu_ps(y + j + 8), acc1);
    }
    float sum = hsum(_mm256_add_ps(acc0, acc1));
    for (; j < n; ++j) {
        sum += _cvtsh_ss(k[j])*y[j];
    }
    return sum;
}

void oscar2_rows_f16_to_f32_avx2(const uint16_t * k, float * y, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        _mm256_storeu_ps(y + j, halves8(k + j));
    }
    for (; j < n; ++j) {
        y[j] = _cvtsh_ss(k[j]);
    }
}

// ---- scores: two rows at a time for up to four heads, then eight rows' lanes summed together ----

// the lanes of rows x[0..R) for heads q[0..NH), group size G, into t + h*64 + r*8; R (1, 2), NH
// (1..4) and G (64, 128) are constants once inlined. Two rows give each head two chains of fmas.
static inline __attribute__((always_inline)) void score_lanes(const uint8_t * const * x, const int R, const float * const * q,
                                                             const int NH, int64_t n, const int G, float * t) {
    const size_t bs = oscar2_block_bytes(G);
    const int q4 = G/4;
    __m256 A[2][4];
    for (int r = 0; r < R; ++r) {
        for (int h = 0; h < NH; ++h) {
            A[r][h] = _mm256_setzero_ps();
        }
    }
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const block_oscar2 * b[2];
        __m256 lv[2];
        for (int r = 0; r < R; ++r) {
            b[r]  = (const block_oscar2 *) (x[r] + ib*bs);
            lv[r] = levels(b[r]);
        }
        for (int c = 0; c < q4; c += 8) {
            __m256i raw[2];
            for (int r = 0; r < R; ++r) {
                raw[r] = bytes8(b[r]->qs + c);
            }
            for (int s = 0; s < 4; ++s) {
                __m256 v[2];
                for (int r = 0; r < R; ++r) {
                    v[r]   = _mm256_permutevar8x32_ps(lv[r], raw[r]);
                    raw[r] = _mm256_srli_epi32(raw[r], 2);
                }
                for (int h = 0; h < NH; ++h) {
                    const __m256 qv = _mm256_loadu_ps(q[h] + ib*G + s*q4 + c);
                    for (int r = 0; r < R; ++r) {
                        A[r][h] = _mm256_fmadd_ps(v[r], qv, A[r][h]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int h = 0; h < NH; ++h) {
            _mm256_storeu_ps(t + h*64 + r*8, A[r][h]);
        }
    }
}

#define SCORES_T_ROW 8 // the eight lanes

static inline void zero_lanes(float * t) {
    _mm256_storeu_ps(t, _mm256_setzero_ps());
}

// out = the lane sums ((A0+A1)+(A2+A3)) + ((A4+A5)+(A6+A7)) of eight rows' lanes t[r*8 + l]
static inline void lane_sums8(const float * t, float * out) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_loadu_ps(t +  0), _mm256_loadu_ps(t +  8));
    const __m256 t1 = _mm256_hadd_ps(_mm256_loadu_ps(t + 16), _mm256_loadu_ps(t + 24));
    const __m256 t2 = _mm256_hadd_ps(_mm256_loadu_ps(t + 32), _mm256_loadu_ps(t + 40));
    const __m256 t3 = _mm256_hadd_ps(_mm256_loadu_ps(t + 48), _mm256_loadu_ps(t + 56));
    const __m256 u0 = _mm256_hadd_ps(t0, t1); // rows 0-3: lanes 0-3 summed, then lanes 4-7 summed
    const __m256 u1 = _mm256_hadd_ps(t2, t3); // rows 4-7
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

#define SCORES_NAME oscar2_rows_scores_avx2
#include "oscar2-rows-scores.inc"
#endif
