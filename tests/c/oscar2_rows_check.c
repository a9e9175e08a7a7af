// oscar2_rows_check.c: the vector row loops of ggml-oscar/oscar2-rows.h (whichever ISA this is
// compiled for: AVX2, NEON, or none) against their scalar reference, on random blocks made by the
// reference quantizer. Built without ggml from oscar2.c and the oscar2-rows-*.c files, natively and
// cross-compiled for aarch64 (run under qemu-aarch64) by tests/test_oscar2_rows.py.
//
// mad and to_f32 must match bit for bit; dot within 1e-5 of sum |value|*|y| (float summation
// order); acc (P.V of a block of f32 rows) bit for bit; scores (K.q of a block of rows for several
// heads) bit for bit, and the reference's within 1e-5 of the dequantized rows' dot products. The same for the window's f16 rows (f16_to_f32 bit for bit, f16_dot within 1e-5), on
// random finite half-precision bit patterns (subnormals included) of lengths that leave tails.
// Prints the ISA and "N passed, N failed"; exits 1 on any failure.

#include "oscar2-rows.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float uniform(void) {           // [0, 1)
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (float) (rng_state >> 40) / 16777216.0f;
}

static float gauss(void) {
    const float u = uniform() + 1e-7f, v = uniform();
    return sqrtf(-2.0f*logf(u)) * cosf(6.2831853f*v);
}

static const char * isa(void) {
#if defined(OSCAR2_ROWS_AVX2)
    return "avx2";
#elif defined(OSCAR2_ROWS_NEON)
    return "neon";
#else
    return "scalar";
#endif
}

#define MAXN 1024

static int passed = 0, failed = 0;

// a vector dot product against the reference: within 1e-5 of sum |value_j * y_j|
static int dot_close(const float * vals, const float * y, int n, float d_ref, float d_vec) {
    double mag = 1e-30;
    for (int j = 0; j < n; ++j) {
        mag += fabs((double) vals[j]*y[j]);
    }
    return fabs((double) d_ref - d_vec)/mag < 1e-5;
}

static void tally(int ok, const char * what, int n, int trial, float d_ref, float d_vec) {
    if (ok) {
        ++passed;
    } else if (++failed <= 5) {
        fprintf(stderr, "mismatch: %s n=%d trial=%d dot %.9g vs %.9g\n", what, n, trial, d_ref, d_vec);
    }
}

int main(void) {
    static float x[MAXN], y[MAXN], vals[MAXN], a_ref[MAXN], a_vec[MAXN], t_ref[MAXN], t_vec[MAXN];
    static uint8_t blocks[MAXN/64*20 + 64];
    const int groups[2] = { QK_OSCAR2_64, QK_OSCAR2 };
    const float scales[4] = { 1e-3f, 1.0f, 37.0f, 3e3f };
    for (int gi = 0; gi < 2; ++gi) {
        const int G = groups[gi];
        for (int trial = 0; trial < 200; ++trial) {
            const int n = G * (1 + trial % (MAXN/G));
            const float sc = scales[trial % 4];
            for (int j = 0; j < n; ++j) {
                x[j] = gauss()*sc + (trial % 3 == 0 ? 5.0f*sc : 0.0f);
                y[j] = gauss();
                a_ref[j] = a_vec[j] = gauss();
            }
            oscar2_quantize_row_g(x, blocks, n, G, trial % 2 ? 0.96f : 1.0f);

            oscar2_rows_to_f32_scalar(blocks, t_ref, n, G);
            oscar2_rows_to_f32(blocks, t_vec, n, G);
            int ok = memcmp(t_ref, t_vec, n*sizeof(float)) == 0;

            const float w = gauss();
            oscar2_rows_mad_scalar(blocks, w, a_ref, n, G);
            oscar2_rows_mad(blocks, w, a_vec, n, G);
            ok = ok && memcmp(a_ref, a_vec, n*sizeof(float)) == 0;

            oscar2_dequantize_row_g(blocks, vals, n, G);
            const float d_ref = oscar2_rows_dot_scalar(blocks, y, n, G);
            const float d_vec = oscar2_rows_dot(blocks, y, n, G);
            tally(ok && dot_close(vals, y, n, d_ref, d_vec), G == QK_OSCAR2 ? "G=128" : "G=64", n, trial, d_ref, d_vec);
        }
    }
    static uint16_t h[MAXN];
    for (int trial = 0; trial < 200; ++trial) {
        const int n = 1 + (int) (uniform()*MAXN);
        for (int j = 0; j < n; ++j) {
            const uint16_t sign = uniform() < 0.5f ? 0x8000 : 0;
            const uint16_t expo = (uint16_t) (uniform()*31) << 10;     // 0..30: finite
            h[j] = sign | expo | (uint16_t) (uniform()*1024);
            y[j] = gauss();
        }
        oscar2_rows_f16_to_f32_scalar(h, t_ref, n);
        oscar2_rows_f16_to_f32(h, t_vec, n);
        const int ok = memcmp(t_ref, t_vec, n*sizeof(float)) == 0;
        const float d_ref = oscar2_rows_f16_dot_scalar(h, y, n);
        const float d_vec = oscar2_rows_f16_dot(h, y, n);
        tally(ok && dot_close(t_ref, y, n, d_ref, d_vec), "f16", n, trial, d_ref, d_vec);
    }
    // acc: blocks of 1..64 f32 rows of widths that leave tails, bit for bit
    static float tile[64*MAXN/4], wts[64];
    for (int trial = 0; trial < 200; ++trial) {
        const int n      = 1 + (int) (uniform()*(MAXN/4));
        const int n_rows = 1 + trial % 64;
        for (int i = 0; i < n_rows*n; ++i) {
            tile[i] = gauss()*(trial % 5 ? 1.0f : 1e3f);
        }
        for (int r = 0; r < n_rows; ++r) {
            wts[r] = uniform();
        }
        for (int j = 0; j < n; ++j) {
            a_ref[j] = a_vec[j] = gauss();
        }
        oscar2_rows_acc_scalar(tile, wts, n_rows, a_ref, n);
        oscar2_rows_acc(tile, wts, n_rows, a_vec, n);
        tally(memcmp(a_ref, a_vec, n*sizeof(float)) == 0, "acc", n, trial, a_ref[0], a_vec[0]);
    }
    // scores: 1..64 rows of 1..8 blocks, 1..8 heads, bit for bit; the reference against the
    // dequantized rows within float summation order
    static uint8_t rows[64][MAXN/64*20 + 64];
    static float qv[8][MAXN], s_ref[8*64], s_vec[8*64], rv[MAXN];
    for (int trial = 0; trial < 200; ++trial) {
        const int G = groups[trial % 2];
        const int n = G * (1 + (trial/2) % 4), nh = 1 + trial % 8, n_rows = 1 + (trial*7) % 64;
        const float sc = scales[trial % 4];
        const uint8_t * xr[64];
        for (int r = 0; r < n_rows; ++r) {
            for (int j = 0; j < n; ++j) {
                x[j] = gauss()*sc + (trial % 3 == 0 ? 5.0f*sc : 0.0f);
            }
            oscar2_quantize_row_g(x, rows[r], n, G, trial % 2 ? 0.96f : 1.0f);
            xr[r] = rows[r];
        }
        const float * qp[8];
        for (int h = 0; h < nh; ++h) {
            for (int j = 0; j < n; ++j) {
                qv[h][j] = gauss();
            }
            qp[h] = qv[h];
        }
        oscar2_rows_scores_scalar(xr, n_rows, qp, nh, n, G, s_ref, 64);
        oscar2_rows_scores(xr, n_rows, qp, nh, n, G, s_vec, 64);
        int ok = 1;
        for (int h = 0; h < nh && ok; ++h) {
            ok = memcmp(s_ref + h*64, s_vec + h*64, n_rows*sizeof(float)) == 0;
            for (int r = 0; r < n_rows && ok; ++r) {
                oscar2_dequantize_row_g(xr[r], rv, n, G);
                float dot = 0.0f;
                for (int j = 0; j < n; ++j) {
                    dot += rv[j]*qv[h][j];
                }
                ok = dot_close(rv, qv[h], n, dot, s_ref[h*64 + r]);
            }
        }
        tally(ok, "scores", n, trial, s_ref[0], s_vec[0]);
    }
    printf("isa: %s\n", isa());
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
