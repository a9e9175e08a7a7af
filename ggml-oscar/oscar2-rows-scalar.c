// oscar2-rows-scalar.c: the plain reference of the row loops of oscar2-rows.h, in the order the
// format defines them (oscar2.h): per block, d * sum(code*y) + m * sum(y) for the dot product,
// and the four levels m + code*d for mad and to_f32; a block of f32 rows added in row order;
// the window's f16 rows in element order.
// Every vector path is tested against these.

#include "oscar2-rows.h"

#include <math.h>

// code of element j of a block: byte j % (G/4), bits 2*(j / (G/4)) (oscar2.h)
static inline int code_at(const uint8_t * qs, int G, int j) {
    return (qs[j % (G/4)] >> (2*(j / (G/4)))) & 3;
}

float oscar2_rows_dot_scalar(const void * x, const float * y, int64_t n, int G) {
    const size_t bs = oscar2_block_bytes(G);
    float sum = 0.0f;
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const uint8_t * blk = (const uint8_t *) x + ib*bs;
        const block_oscar2 * b = (const block_oscar2 *) blk; // d and m sit at the same place in both
        const float * yb = y + ib*G;
        float sq = 0.0f, sy = 0.0f;
        for (int j = 0; j < G; ++j) {
            sq += (float) code_at(b->qs, G, j) * yb[j];
            sy += yb[j];
        }
        sum += oscar2_fp16_to_fp32(b->d)*sq + oscar2_fp16_to_fp32(b->m)*sy;
    }
    return sum;
}

void oscar2_rows_mad_scalar(const void * x, float w, float * acc, int64_t n, int G) {
    const size_t bs = oscar2_block_bytes(G);
    for (int64_t ib = 0; ib < n/G; ++ib) {
        const block_oscar2 * b = (const block_oscar2 *) ((const uint8_t *) x + ib*bs);
        const float d = oscar2_fp16_to_fp32(b->d);
        const float m = oscar2_fp16_to_fp32(b->m);
        const float lv[4] = { m + 0.0f*d, m + 1.0f*d, m + 2.0f*d, m + 3.0f*d };
        float * ab = acc + ib*G;
        for (int j = 0; j < G; ++j) {
            ab[j] = fmaf(lv[code_at(b->qs, G, j)], w, ab[j]);
        }
    }
}

void oscar2_rows_to_f32_scalar(const void * x, float * y, int64_t n, int G) {
    oscar2_dequantize_row_g(x, y, n, G);
}

void oscar2_rows_acc_scalar(const float * t, const float * w, int n_rows, float * acc, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
        float a = acc[j];
        for (int r = 0; r < n_rows; ++r) {
            a = fmaf(t[r*n + j], w[r], a);
        }
        acc[j] = a;
    }
}

float oscar2_rows_f16_dot_scalar(const uint16_t * k, const float * y, int64_t n) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
        sum += oscar2_fp16_to_fp32(k[j])*y[j];
    }
    return sum;
}

void oscar2_rows_f16_to_f32_scalar(const uint16_t * k, float * y, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
        y[j] = oscar2_fp16_to_fp32(k[j]);
    }
}

void oscar2_rows_scores_scalar(const uint8_t * const * x, int n_rows, const float * const * q, int nh,
                               int64_t n, int G, float * s, int ld) {
    const size_t bs = oscar2_block_bytes(G);
    const int q4 = G/4;
    for (int h = 0; h < nh; ++h) {
        for (int r = 0; r < n_rows; ++r) {
            float A[8] = { 0 };
            for (int64_t ib = 0; ib < n/G; ++ib) {
                const block_oscar2 * b = (const block_oscar2 *) (x[r] + ib*bs);
                const float d = oscar2_fp16_to_fp32(b->d), m = oscar2_fp16_to_fp32(b->m);
                const float * qb = q[h] + ib*G;
                for (int c = 0; c < q4; c += 8) {
                    for (int sh = 0; sh < 4; ++sh) {
                        for (int l = 0; l < 8; ++l) {
                            const float value = fmaf((float) ((b->qs[c + l] >> (2*sh)) & 3), d, m);
                            A[l] = fmaf(value, qb[sh*q4 + c + l], A[l]);
                        }
                    }
                }
            }
            s[h*ld + r] = ((A[0] + A[1]) + (A[2] + A[3])) + ((A[4] + A[5]) + (A[6] + A[7]));
        }
    }
}
