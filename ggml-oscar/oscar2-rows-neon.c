// oscar2-rows-neon.c: the row loops of oscar2-rows.h with Arm NEON (AArch64, float arithmetic).
// Tested against oscar2-rows-scalar.c: mad, to_f32, acc and scores bit for bit, dot within float summation
// order, by tests/c/oscar2_rows_check.c cross-compiled for aarch64 and run under qemu-aarch64
// (tests/test_oscar2_rows.py).
//
// The query stays f32, so the dot product is float FMAs: the int8 dot-product instructions would
// need a quantized query, which would change the scores beyond summation order.
//
// A block's code bytes are read 16 at a time; shifting them by 2s gives the codes of elements
// s*G/4 + 16h .. +15 (byte b holds elements b, b+G/4, b+G/2, b+3G/4), widened to four float32x4.

#include "oscar2-rows.h"

#if defined(OSCAR2_ROWS_NEON)
#include <arm_neon.h>
#include <math.h>
#include <string.h>

static inline float half_to_f32(uint16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

// the 16 codes of c (one per byte, 0..3) as four float32x4, elements 0-3, 4-7, 8-11, 12-15
static inline void codes16(uint8x16_t c, float32x4_t out[4]) {
    const uint16x8_t lo = vmovl_u8(vget_low_u8(c));
    const uint16x8_t hi = vmovl_high_u8(c);
    out[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
    out[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
    out[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
    out[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
}

float oscar2_rows_dot_neon(const void * x, const float * y, int64_t n, int G) {
    const size_t bs = oscar2_block_bytes(G);
    const int q4 = G/4;
    const uint8x16_t three = vdupq_n_u8(3);
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const block_oscar2 * b = (const block_oscar2 *) ((const uint8_t *) x + ib*bs);
        const float * yb = y + ib*G;
        float32x4_t sq[4] = { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) };
        float32x4_t sy[4] = { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) };
        for (int h = 0; h < q4; h += 16) {
            uint8x16_t raw = vld1q_u8(b->qs + h);
            for (int s = 0; s < 4; ++s) {
                float32x4_t c[4];
                codes16(vandq_u8(raw, three), c);
                const float * ys = yb + s*q4 + h;
                for (int i = 0; i < 4; ++i) {
                    const float32x4_t yv = vld1q_f32(ys + 4*i);
                    sq[i] = vfmaq_f32(sq[i], c[i], yv);
                    sy[i] = vaddq_f32(sy[i], yv);
                }
                raw = vshrq_n_u8(raw, 2);
            }
        }
        const float32x4_t q = vaddq_f32(vaddq_f32(sq[0], sq[1]), vaddq_f32(sq[2], sq[3]));
        const float32x4_t s = vaddq_f32(vaddq_f32(sy[0], sy[1]), vaddq_f32(sy[2], sy[3]));
        acc = vfmaq_n_f32(acc, q, half_to_f32(b->d));
        acc = vfmaq_n_f32(acc, s, half_to_f32(b->m));
    }
    return vaddvq_f32(acc);
}

// value = fma(code, d, m): code*d is exact, so this is m + code*d with its one rounding.
// accumulate: out = fma(value, w, out) (mad), else out = value (to_f32); inlined with a constant.
static inline void values(const void * x, float w, float * out, int64_t n, int G, int accumulate) {
    const size_t bs = oscar2_block_bytes(G);
    const int q4 = G/4;
    const uint8x16_t three = vdupq_n_u8(3);
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const block_oscar2 * b = (const block_oscar2 *) ((const uint8_t *) x + ib*bs);
        const float32x4_t d = vdupq_n_f32(half_to_f32(b->d));
        const float32x4_t m = vdupq_n_f32(half_to_f32(b->m));
        float * ob = out + ib*G;
        for (int h = 0; h < q4; h += 16) {
            uint8x16_t raw = vld1q_u8(b->qs + h);
            for (int s = 0; s < 4; ++s) {
                float32x4_t c[4];
                codes16(vandq_u8(raw, three), c);
                for (int i = 0; i < 4; ++i) {
                    float * o = ob + s*q4 + h + 4*i;
                    const float32x4_t v = vfmaq_f32(m, c[i], d);
                    vst1q_f32(o, accumulate ? vfmaq_n_f32(vld1q_f32(o), v, w) : v);
                }
                raw = vshrq_n_u8(raw, 2);
            }
        }
    }
}

void oscar2_rows_mad_neon(const void * x, float w, float * acc, int64_t n, int G) {
    values(x, w, acc, n, G, 1);
}

void oscar2_rows_to_f32_neon(const void * x, float * y, int64_t n, int G) {
    values(x, 0.0f, y, n, G, 0);
}

// 32 columns of acc at a time held in eight registers across the rows; the tail as the reference
void oscar2_rows_acc_neon(const float * t, const float * w, int n_rows, float * acc, int64_t n) {
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        float32x4_t a[8];
        for (int i = 0; i < 8; ++i) {
            a[i] = vld1q_f32(acc + j + 4*i);
        }
        for (int r = 0; r < n_rows; ++r) {
            const float * tr = t + r*n + j;
            for (int i = 0; i < 8; ++i) {
                a[i] = vfmaq_n_f32(a[i], vld1q_f32(tr + 4*i), w[r]);
            }
        }
        for (int i = 0; i < 8; ++i) {
            vst1q_f32(acc + j + 4*i, a[i]);
        }
    }
    for (; j < n; ++j) {
        float a = acc[j];
        for (int r = 0; r < n_rows; ++r) {
            a = fmaf(t[r*n + j], w[r], a);
        }
        acc[j] = a;
    }
}

static inline float32x4_t halves4(const uint16_t * k) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(k)));
}

float oscar2_rows_f16_dot_neon(const uint16_t * k, const float * y, int64_t n) {
    float32x4_t acc[4] = { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) };
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        for (int i = 0; i < 4; ++i) {
            acc[i] = vfmaq_f32(acc[i], halves4(k + j + 4*i), vld1q_f32(y + j + 4*i));
        }
    }
    float sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    for (; j < n; ++j) {
        sum += half_to_f32(k[j])*y[j];
    }
    return sum;
}

void oscar2_rows_f16_to_f32_neon(const uint16_t * k, float * y, int64_t n) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        vst1q_f32(y + j, halves4(k + j));
    }
    for (; j < n; ++j) {
        y[j] = half_to_f32(k[j]);
    }
}

// ---- scores: two rows at a time for up to four heads, then four rows' lanes summed together ----
// Eight lanes are two float32x4 (lo: lanes 0-3, hi: 4-7), so that the order is AVX2's and the reference's.

// the lanes of rows x[0..R) for heads q[0..NH), group size G, pairwise summed: t + h*32 + r*4 gets
// (A0+A1, A2+A3, A4+A5, A6+A7); R (1, 2), NH (1..4) and G (64, 128) are constants once inlined
static inline __attribute__((always_inline)) void score_lanes(const uint8_t * const * x, const int R, const float * const * q,
                                                             const int NH, int64_t n, const int G, float * t) {
    const size_t bs = oscar2_block_bytes(G);
    const int q4 = G/4;
    const uint8x8_t three = vdup_n_u8(3);
    float32x4_t Alo[2][4], Ahi[2][4];
    for (int r = 0; r < R; ++r) {
        for (int h = 0; h < NH; ++h) {
            Alo[r][h] = Ahi[r][h] = vdupq_n_f32(0.0f);
        }
    }
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const block_oscar2 * b[2];
        float32x4_t d[2], m[2];
        for (int r = 0; r < R; ++r) {
            b[r] = (const block_oscar2 *) (x[r] + ib*bs);
            d[r] = vdupq_n_f32(half_to_f32(b[r]->d));
            m[r] = vdupq_n_f32(half_to_f32(b[r]->m));
        }
        for (int c = 0; c < q4; c += 8) {
            uint8x8_t raw[2];
            for (int r = 0; r < R; ++r) {
                raw[r] = vld1_u8(b[r]->qs + c);
            }
            for (int s = 0; s < 4; ++s) {
                float32x4_t vlo[2], vhi[2];
                for (int r = 0; r < R; ++r) { // value = fma(code, d, m)
                    const uint16x8_t w = vmovl_u8(vand_u8(raw[r], three));
                    vlo[r] = vfmaq_f32(m[r], vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), d[r]);
                    vhi[r] = vfmaq_f32(m[r], vcvtq_f32_u32(vmovl_high_u16(w)), d[r]);
                    raw[r] = vshr_n_u8(raw[r], 2);
                }
                for (int h = 0; h < NH; ++h) {
                    const float * qv = q[h] + ib*G + s*q4 + c;
                    const float32x4_t qlo = vld1q_f32(qv), qhi = vld1q_f32(qv + 4);
                    for (int r = 0; r < R; ++r) {
                        Alo[r][h] = vfmaq_f32(Alo[r][h], vlo[r], qlo);
                        Ahi[r][h] = vfmaq_f32(Ahi[r][h], vhi[r], qhi);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int h = 0; h < NH; ++h) {
            vst1q_f32(t + h*32 + r*4, vpaddq_f32(Alo[r][h], Ahi[r][h]));
        }
    }
}

#define SCORES_T_ROW 4 // the pairwise sums

static inline void zero_lanes(float * t) {
    vst1q_f32(t, vdupq_n_f32(0.0f));
}

// out = the scores of eight rows from their pairwise sums t[r*4 + i]: rows r, r+1 give
// (A0+A1)+(A2+A3) and (A4+A5)+(A6+A7) of each, then rows r..r+3 the sums of those
static inline void lane_sums8(const float * t, float * out) {
    const float32x4_t p01 = vpaddq_f32(vld1q_f32(t +  0), vld1q_f32(t +  4));
    const float32x4_t p23 = vpaddq_f32(vld1q_f32(t +  8), vld1q_f32(t + 12));
    const float32x4_t p45 = vpaddq_f32(vld1q_f32(t + 16), vld1q_f32(t + 20));
    const float32x4_t p67 = vpaddq_f32(vld1q_f32(t + 24), vld1q_f32(t + 28));
    vst1q_f32(out,     vpaddq_f32(p01, p23));
    vst1q_f32(out + 4, vpaddq_f32(p45, p67));
}

#define SCORES_NAME oscar2_rows_scores_neon
#include "oscar2-rows-scores.inc"
#endif
