// oscar2.c: reference quantize / dequantize of the oscar2 block format.
//
// Plain C, no SIMD: this is the definition the CPU fast paths, the CUDA kernels and the
// numpy reference (oscar_gguf/format/oscar2.py) are tested against. The format and the exact
// rounding rules are documented in oscar2.h.

#include "oscar2.h"

#include <math.h>
#include <string.h>

// ---- fp16 <-> fp32, round to nearest even, independent of the host's F16C ----------------

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float    bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// Caller guarantees |f| <= 65504 and f is finite (we saturate before converting).
static uint16_t oscar_fp32_to_fp16(float f) {
    const uint32_t x    = f32_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax   = x & 0x7fffffffu;
    if (ax < 0x38800000u) {
        // below the smallest normal fp16 (2^-14): a subnormal or zero. Adding 0.5 makes the
        // FPU round the mantissa to a multiple of 2^-24 with ties to even.
        const float r = bits_f32(ax) + 0.5f;
        return (uint16_t) (sign | (f32_bits(r) - 0x3f000000u));
    }
    // normal: drop 13 mantissa bits with round to nearest even
    const uint32_t mant_odd = (ax >> 13) & 1u;
    const uint32_t rounded  = ax + 0xc8000fffu + mant_odd; // rebias exponent (-112<<23) and round
    return (uint16_t) (sign | (rounded >> 13));
}

static float oscar_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    const uint32_t exp  = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        // zero or subnormal: mant * 2^-24, exact in fp32
        const float v = (float) mant * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 31) {
        return bits_f32(sign | 0x7f800000u | (mant << 13));
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

float oscar2_fp16_to_fp32(uint16_t h) {
    return oscar_fp16_to_fp32(h);
}

// ---- k-th smallest of n non-negative finite floats (in place) -----------------------------

#define OSCAR_TOP_MAX 16 // kth_smallest keeps the largest values in a list up to this many

// The k-th smallest (from 0) of a[0..n). With a clip ratio near 1, the usual case, only
// m = n - k values lie at or above it: the m largest are then kept in a list, largest first,
// in one pass, and the answer is the list's last. Otherwise quickselect, which reorders a.
// Both give the same value; for a few kept values one pass with a short list costs far less than
// quickselect's partitions of the whole group.
static float kth_smallest(float * a, int n, int k) {
    const int m = n - k;
    if (m <= OSCAR_TOP_MAX) {
        float top[OSCAR_TOP_MAX];
        int c = 0;
        for (int i = 0; i < n; ++i) {
            const float x = a[i];
            if (c == m && !(x > top[m - 1])) {
                continue;
            }
            int j = c < m ? c++ : m - 1;
            for (; j > 0 && top[j - 1] < x; --j) {
                top[j] = top[j - 1];
            }
            top[j] = x;
        }
        return top[m - 1];
    }
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = a[(lo + hi) >> 1];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                const float t = a[i]; a[i] = a[j]; a[j] = t;
                i++; j--;
            }
        }
        if (k <= j) {
            hi = j;
        } else if (k >= i) {
            lo = i;
        } else {
            return a[k];
        }
    }
    return a[k];
}

#define OSCAR_FP16_MAX 65504.0f

// One group of G values -> d, m, qs[G/4].
static void quantize_group(const float * x, int G, float clip, uint16_t * d_out, uint16_t * m_out, uint8_t * qs) {
    float v[QK_OSCAR2];
    float a[QK_OSCAR2];

    // 0. sanitize (also flushing fp32 subnormals, so that a GPU running with flush-to-zero
    //    quantizes exactly the same values)
    for (int i = 0; i < G; ++i) {
        const float xi = x[i];
        v[i] = (isfinite(xi) && fabsf(xi) >= 1.17549435e-38f) ? xi + 0.0f : 0.0f; // + 0.0f turns -0 into +0
    }

    // 1. clip to the k-th smallest magnitude
    if (clip > 0.0f && clip < 1.0f) {
        const int k = (int) floorf(clip * (float) G);
        if (k < G) {
            for (int i = 0; i < G; ++i) {
                a[i] = fabsf(v[i]);
            }
            const float tau = kth_smallest(a, G, k);
            for (int i = 0; i < G; ++i) {
                const float c = v[i] > tau ? tau : (v[i] < -tau ? -tau : v[i]);
                v[i] = c + 0.0f;
            }
        }
    }

    // 2. range, saturated to fp16 (four running minima and maxima, not one chain of compares:
    //    exact in any order, as no value is NaN or -0 here; G is a multiple of 4)
    float mn4[4] = { v[0], v[1], v[2], v[3] }, mx4[4] = { v[0], v[1], v[2], v[3] };
    for (int i = 4; i < G; i += 4) {
        for (int e = 0; e < 4; ++e) {
            mn4[e] = v[i + e] < mn4[e] ? v[i + e] : mn4[e];
            mx4[e] = v[i + e] > mx4[e] ? v[i + e] : mx4[e];
        }
    }
    float mn = fminf(fminf(mn4[0], mn4[1]), fminf(mn4[2], mn4[3]));
    float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
    float d = (mx - mn) / 3.0f;
    if (!(d <= OSCAR_FP16_MAX)) d = OSCAR_FP16_MAX; // also catches inf from mx - mn overflow
    if (mn < -OSCAR_FP16_MAX) mn = -OSCAR_FP16_MAX;
    if (mn >  OSCAR_FP16_MAX) mn =  OSCAR_FP16_MAX;

    const uint16_t dh = oscar_fp32_to_fp16(d);
    const uint16_t mh = oscar_fp32_to_fp16(mn);
    const float    df = oscar_fp16_to_fp32(dh);
    const float    mf = oscar_fp16_to_fp32(mh);

    // 3. codes: round half up to the nearest stored level
    const float t1 = mf + 0.5f*df;
    const float t2 = mf + 1.5f*df;
    const float t3 = mf + 2.5f*df;

    // value i = s*nb + j goes to bits 2s, 2s+1 of byte j (by quarters: no division per value)
    const int nb = G/4;
    memset(qs, 0, (size_t) nb);
    for (int s = 0; s < 4; ++s) {
        const float * vs = v + s*nb;
        for (int j = 0; j < nb; ++j) {
            const uint8_t q = (uint8_t) ((vs[j] >= t1) + (vs[j] >= t2) + (vs[j] >= t3));
            qs[j] |= (uint8_t) (q << (2*s));
        }
    }
    *d_out = dh;
    *m_out = mh;
}

static void dequantize_group(const uint16_t dh, const uint16_t mh, const uint8_t * qs, int G, float * y) {
    const float d = oscar_fp16_to_fp32(dh);
    const float m = oscar_fp16_to_fp32(mh);
    // the four levels, each computed as m + q*d exactly as the format defines
    const float lv[4] = { m + 0.0f*d, m + 1.0f*d, m + 2.0f*d, m + 3.0f*d };
    const int nb = G/4;
    for (int s = 0; s < 4; ++s) {
        for (int b = 0; b < nb; ++b) {
            y[s*nb + b] = lv[(qs[b] >> (2*s)) & 3];
        }
    }
}

// ---- row entry points ------------------------------------------------------------------

void oscar2_quantize_row_g(const float * x, void * y, int64_t k, int G, float clip) {
    const int64_t nb = k / G;
    if (G == QK_OSCAR2) {
        block_oscar2 * b = (block_oscar2 *) y;
        for (int64_t i = 0; i < nb; ++i) {
            quantize_group(x + i*G, G, clip, &b[i].d, &b[i].m, b[i].qs);
        }
    } else {
        block_oscar2_64 * b = (block_oscar2_64 *) y;
        for (int64_t i = 0; i < nb; ++i) {
            quantize_group(x + i*G, G, clip, &b[i].d, &b[i].m, b[i].qs);
        }
    }
}

void oscar2_dequantize_row_g(const void * x, float * y, int64_t k, int G) {
    const int64_t nb = k / G;
    if (G == QK_OSCAR2) {
        const block_oscar2 * b = (const block_oscar2 *) x;
        for (int64_t i = 0; i < nb; ++i) {
            dequantize_group(b[i].d, b[i].m, b[i].qs, G, y + i*G);
        }
    } else {
        const block_oscar2_64 * b = (const block_oscar2_64 *) x;
        for (int64_t i = 0; i < nb; ++i) {
            dequantize_group(b[i].d, b[i].m, b[i].qs, G, y + i*G);
        }
    }
}

void oscar2_quantize_row_ref(const float * x, void * y, int64_t k, float clip) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2, clip);
}
void oscar2_64_quantize_row_ref(const float * x, void * y, int64_t k, float clip) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2_64, clip);
}
void oscar2_dequantize_row(const void * x, float * y, int64_t k) {
    oscar2_dequantize_row_g(x, y, k, QK_OSCAR2);
}
void oscar2_64_dequantize_row(const void * x, float * y, int64_t k) {
    oscar2_dequantize_row_g(x, y, k, QK_OSCAR2_64);
}
void oscar2_from_float_ref(const float * x, void * y, int64_t k) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2, 1.0f);
}
void oscar2_64_from_float_ref(const float * x, void * y, int64_t k) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2_64, 1.0f);
}

size_t oscar2_quantize(const float * src, void * dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    (void) imatrix;
    const size_t row_size = (size_t) (n_per_row / QK_OSCAR2) * sizeof(block_oscar2);
    for (int64_t r = 0; r < nrows; ++r) {
        oscar2_quantize_row_g(src + r*n_per_row, (char *) dst + r*row_size, n_per_row, QK_OSCAR2, 1.0f);
    }
    return (size_t) nrows * row_size;
}

size_t oscar2_64_quantize(const float * src, void * dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    (void) imatrix;
    const size_t row_size = (size_t) (n_per_row / QK_OSCAR2_64) * sizeof(block_oscar2_64);
    for (int64_t r = 0; r < nrows; ++r) {
        oscar2_quantize_row_g(src + r*n_per_row, (char *) dst + r*row_size, n_per_row, QK_OSCAR2_64, 1.0f);
    }
    return (size_t) nrows * row_size;
}
