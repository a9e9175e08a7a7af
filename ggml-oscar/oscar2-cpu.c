// oscar2-cpu.c: CPU kernels for the oscar2 KV-cache types.
//
//   oscar2_cpu_vec_dot_*   dot product of an oscar2 row with an f32 row; the CPU flash
//                          attention uses it for K.Q (vec_dot_type of oscar2 is F32, so the
//                          query is never re-quantized).
//   oscar2_cpu_write_row   quantization for set_rows / cpy into the cache, with the clip
//                          ratio the node carries (ggml_oscar2_get_clip, oscar2-ops.h).
//   oscar2_cpu_window_kq / _v  the f16/bf16 window rows in the CPU flash attention: K.Q
//                          and V as f32.
//
// Each fast path sits beside its plain reference (`*_scalar`), and the AVX2 path is only
// compiled where the compiler targets AVX2. The value of an element is m + code*d
// (oscar2.h); a block's dot product with y is therefore d * sum(code*y) + m * sum(y).

#include "oscar2.h"
#include "oscar2-cpu.h"
#include "oscar2-ops.h"

#include "ggml.h"

#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define OSCAR2_AVX2 1
#endif

static inline float fp16_to_fp32(uint16_t h) {
#if defined(OSCAR2_AVX2)
    return _cvtsh_ss(h);
#else
    // same conversion as oscar2.c, kept local so this file stands alone
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    const uint32_t exp  = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    uint32_t u;
    float f;
    if (exp == 0) {
        f = (float) mant * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    u = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112u) << 23) | (mant << 13));
    memcpy(&f, &u, 4);
    return f;
#endif
}

// ---- reference: scalar dot of one oscar2 row with an f32 row ------------------------------

static float vec_dot_scalar(int n, const uint16_t * d_m_qs_base, size_t block_bytes, int G, const float * y) {
    const int nb = G/4;
    float sum = 0.0f;
    for (int ib = 0; ib < n/G; ++ib) {
        const uint8_t  * blk = (const uint8_t *) d_m_qs_base + (size_t) ib*block_bytes;
        uint16_t dh, mh;
        memcpy(&dh, blk + 0, 2);
        memcpy(&mh, blk + 2, 2);
        const uint8_t * qs = blk + 4;
        const float   * yb = y + ib*G;
        float sq = 0.0f, sy = 0.0f;
        for (int j = 0; j < G; ++j) {
            const int q = (qs[j % nb] >> (2*(j / nb))) & 3;
            sq += (float) q * yb[j];
            sy += yb[j];
        }
        sum += fp16_to_fp32(dh)*sq + fp16_to_fp32(mh)*sy;
    }
    return sum;
}

#if defined(OSCAR2_AVX2)
static inline __m256 codes8(__m128i bytes8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
}

// G = 128: 32 code bytes; shift s gives the codes of elements 32s .. 32s+31
static float vec_dot_avx2_128(int n, const block_oscar2 * x, const float * y) {
    __m256 acc = _mm256_setzero_ps();
    const __m128i three = _mm_set1_epi8(3);
    for (int ib = 0; ib < n/QK_OSCAR2; ++ib) {
        const float * yb = y + ib*QK_OSCAR2;
        const __m128i lo = _mm_loadu_si128((const __m128i *) (x[ib].qs +  0));
        const __m128i hi = _mm_loadu_si128((const __m128i *) (x[ib].qs + 16));
        __m256 sq = _mm256_setzero_ps();
        __m256 sy = _mm256_setzero_ps();
        for (int s = 0; s < 4; ++s) {
            const __m128i c0 = _mm_and_si128(_mm_srli_epi16(lo, 2*s), three); // elements 32s + 0..15
            const __m128i c1 = _mm_and_si128(_mm_srli_epi16(hi, 2*s), three); // elements 32s + 16..31
            const float * ys = yb + 32*s;
            const __m256 y0 = _mm256_loadu_ps(ys +  0);
            const __m256 y1 = _mm256_loadu_ps(ys +  8);
            const __m256 y2 = _mm256_loadu_ps(ys + 16);
            const __m256 y3 = _mm256_loadu_ps(ys + 24);
            sq = _mm256_fmadd_ps(codes8(c0),                    y0, sq);
            sq = _mm256_fmadd_ps(codes8(_mm_srli_si128(c0, 8)), y1, sq);
            sq = _mm256_fmadd_ps(codes8(c1),                    y2, sq);
            sq = _mm256_fmadd_ps(codes8(_mm_srli_si128(c1, 8)), y3, sq);
            sy = _mm256_add_ps(sy, _mm256_add_ps(_mm256_add_ps(y0, y1), _mm256_add_ps(y2, y3)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_fp32(x[ib].d)), sq, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_fp32(x[ib].m)), sy, acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// G = 64: 16 code bytes; shift s gives the codes of elements 16s .. 16s+15
static float vec_dot_avx2_64(int n, const block_oscar2_64 * x, const float * y) {
    __m256 acc = _mm256_setzero_ps();
    const __m128i three = _mm_set1_epi8(3);
    for (int ib = 0; ib < n/QK_OSCAR2_64; ++ib) {
        const float * yb = y + ib*QK_OSCAR2_64;
        const __m128i raw = _mm_loadu_si128((const __m128i *) x[ib].qs);
        __m256 sq = _mm256_setzero_ps();
        __m256 sy = _mm256_setzero_ps();
        for (int s = 0; s < 4; ++s) {
            const __m128i c = _mm_and_si128(_mm_srli_epi16(raw, 2*s), three);
            const __m256 y0 = _mm256_loadu_ps(yb + 16*s + 0);
            const __m256 y1 = _mm256_loadu_ps(yb + 16*s + 8);
            sq = _mm256_fmadd_ps(codes8(c),                    y0, sq);
            sq = _mm256_fmadd_ps(codes8(_mm_srli_si128(c, 8)), y1, sq);
            sy = _mm256_add_ps(sy, _mm256_add_ps(y0, y1));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_fp32(x[ib].d)), sq, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_fp32(x[ib].m)), sy, acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}
#endif

// ggml_vec_dot_t: (n, s, bs, x, bx, y, by, nrc); nrc is always 1 for our types
void oscar2_cpu_vec_dot_f32(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
#if defined(OSCAR2_AVX2)
    *s = vec_dot_avx2_128(n, (const block_oscar2 *) x, (const float *) y);
#else
    *s = vec_dot_scalar(n, (const uint16_t *) x, sizeof(block_oscar2), QK_OSCAR2, (const float *) y);
#endif
}

void oscar2_64_cpu_vec_dot_f32(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
#if defined(OSCAR2_AVX2)
    *s = vec_dot_avx2_64(n, (const block_oscar2_64 *) x, (const float *) y);
#else
    *s = vec_dot_scalar(n, (const uint16_t *) x, sizeof(block_oscar2_64), QK_OSCAR2_64, (const float *) y);
#endif
}

// The plain reference of both, exported for the tests (fast path vs reference).
void oscar2_cpu_vec_dot_f32_ref(int G, int n, float * s, const void * x, const float * y) {
    *s = vec_dot_scalar(n, (const uint16_t *) x, G == QK_OSCAR2 ? sizeof(block_oscar2) : sizeof(block_oscar2_64), G, y);
}

// ---- quantization into the cache --------------------------------------------------------

void oscar2_cpu_write_row(const struct ggml_tensor * dst, ggml_from_float_t from_float, const float * x, void * y, int64_t k) {
    const float clip = oscar2_is_type(dst->type) ? ggml_oscar2_get_clip(dst) : 0.0f;
    if (clip != 0.0f) {
        oscar2_quantize_row_g(x, y, k, oscar2_group_size(dst->type), clip);
    } else {
        from_float(x, y, k);
    }
}

void oscar2_cpu_from_float(const float * x, void * y, int64_t k) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2, 1.0f);
}

void oscar2_64_cpu_from_float(const float * x, void * y, int64_t k) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2_64, 1.0f);
}

// ---- high-precision window rows in the CPU flash attention -------------------------------
//
// The window's rows are f16 or bf16 (--oscar-window-type). Converted row by row through the
// type's to_float into a buffer (ggml-base's f16 row conversion is a scalar loop) and then dotted
// by a scalar loop, they take about half of a CPU decode at small depth (perf of llama-bench,
// bundled model, one thread, tg32 at depth 1024). With F16C the f16 rows are converted 8 values
// at a time and K is dotted in the same pass, which makes that decode about 1.5x faster. The
// scalar path stays the reference and serves bf16.

#if defined(OSCAR2_AVX2)
static float window_kq_f16_avx2(const ggml_fp16_t * k, const float * q, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps();
    __m256 acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (k + i)));
        const __m256 k1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (k + i + 8)));
        acc0 = _mm256_fmadd_ps(k0, _mm256_loadu_ps(q + i),     acc0);
        acc1 = _mm256_fmadd_ps(k1, _mm256_loadu_ps(q + i + 8), acc1);
    }
    const __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    float s = _mm_cvtss_f32(r);
    for (; i < n; ++i) {
        s += fp16_to_fp32(k[i])*q[i];
    }
    return s;
}

static void window_v_f16_avx2(const ggml_fp16_t * v, float * out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (v + i))));
    }
    for (; i < n; ++i) {
        out[i] = fp16_to_fp32(v[i]);
    }
}
#endif

float oscar2_cpu_window_kq(const void * k_row, int type, const float * q, int64_t dk) {
#if defined(OSCAR2_AVX2)
    if (type == GGML_TYPE_F16) {
        return window_kq_f16_avx2((const ggml_fp16_t *) k_row, q, dk);
    }
#endif
    float k32[1024];
    GGML_ASSERT(dk <= 1024);
    ggml_get_type_traits((enum ggml_type) type)->to_float(k_row, k32, dk);
    float s = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
        s += k32[i]*q[i];
    }
    return s;
}

void oscar2_cpu_window_v(const void * v_row, int type, float * out, int64_t dv) {
#if defined(OSCAR2_AVX2)
    if (type == GGML_TYPE_F16) {
        window_v_f16_avx2((const ggml_fp16_t *) v_row, out, dv);
        return;
    }
#endif
    ggml_get_type_traits((enum ggml_type) type)->to_float(v_row, out, dv);
}
