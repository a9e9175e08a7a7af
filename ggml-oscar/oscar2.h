// oscar2.h: the OSCAR 2-bit KV-cache block format (reference, backend independent).
//
// Two ggml types share one format and differ only in the group size G:
//
//   type               id    G     block bytes   bits/element   used for head_dim
//   GGML_TYPE_OSCAR2   100   128   36            2.25           multiples of 128 (128, 256, ...)
//   GGML_TYPE_OSCAR2_64 101  64    20            2.50           64, 192, ... (not a multiple of 128)
//
// The user always asks for "oscar2"; llama.cpp picks oscar2_64 per layer when the
// head size is not a multiple of 128. The ids sit far above mainline's last id
// (GGML_TYPE_Q2_0 = 42) so that a future mainline type cannot take them, and a
// mainline build refuses (id >= its GGML_TYPE_COUNT) instead of misreading our data.
//
// Block layout (little endian), one block = one group of G consecutive values along
// head_dim:
//
//   offset 0   uint16  d      scale, IEEE fp16
//   offset 2   uint16  m      minimum, IEEE fp16
//   offset 4   uint8   qs[G/4] 2-bit codes: element j sits in byte j % (G/4),
//                             bits 2*(j / (G/4)) .. +1. So byte b holds the elements
//                             b, b+G/4, b+G/2, b+3G/4 (one shift gives G/4 neighbours).
//
// Value of element j: m + code_j * d (fp16 fields widened to fp32; code_j*d is exact in
// fp32, so the sum has one rounding whether or not the compiler fuses it).
//
// Quantization of a group x[0..G) with clip ratio c (docs/design.md §1), exactly:
//   0. sanitize: a NaN or +-inf becomes 0, and -0 becomes +0. One bad value therefore
//      damages only its own group, never the softmax of every later query. fp32 subnormals
//      (|x| < 2^-126) also become 0, as they would on a GPU that flushes them.
//   1. clip: k = floor(c*G) in fp32. If 0 < c < 1 and k < G, tau = the k-th smallest
//      (0-based) |x|, and x is clamped to [-tau, tau]. Any other c (1, 0 = "unset",
//      negative, NaN) means no clipping.
//   2. mn = min x, mx = max x, d = (mx - mn)/3 (fp32 division), both saturated to the
//      fp16 range; m = fp16(mn), dh = fp16(d) with round-to-nearest-even.
//   3. code = number of k in {1,2,3} with x >= m + (k - 0.5)*dh, all in fp32 with the
//      stored m and dh: round-half-up to the nearest stored level. (k-0.5)*dh is exact
//      in fp32, so every threshold has a single rounding and CPU, CUDA and numpy agree
//      bit for bit even where a compiler contracts to FMA.
//
// oscar_gguf/format/oscar2.py is the numpy twin of this file; tests compare them byte for byte.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define OSCAR2_TYPE_ID     100
#define OSCAR2_64_TYPE_ID  101

#define QK_OSCAR2     128
#define QK_OSCAR2_64   64

typedef struct {
    uint16_t d;                  // fp16 scale
    uint16_t m;                  // fp16 minimum
    uint8_t  qs[QK_OSCAR2/4];    // 2-bit codes
} block_oscar2;

typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t  qs[QK_OSCAR2_64/4];
} block_oscar2_64;

#ifdef __cplusplus
static_assert(sizeof(block_oscar2)    == 36, "block_oscar2 must be 36 bytes");
static_assert(sizeof(block_oscar2_64) == 20, "block_oscar2_64 must be 20 bytes");
#else
_Static_assert(sizeof(block_oscar2)    == 36, "block_oscar2 must be 36 bytes");
_Static_assert(sizeof(block_oscar2_64) == 20, "block_oscar2_64 must be 20 bytes");
#endif

// default clip ratios of the OSCAR paper, used when a model carries none
#define OSCAR2_DEFAULT_CLIP_K 0.96f
#define OSCAR2_DEFAULT_CLIP_V 0.92f

// --- reference (scalar, portable) -----------------------------------------------------
// k = number of values (a multiple of the group size), clip as described above.
void oscar2_quantize_row_ref   (const float * x, void * y, int64_t k, float clip);
void oscar2_64_quantize_row_ref(const float * x, void * y, int64_t k, float clip);
void oscar2_dequantize_row     (const void * x, float * y, int64_t k);
void oscar2_64_dequantize_row  (const void * x, float * y, int64_t k);

// ggml trait signatures (no clip: c = 1)
void oscar2_from_float_ref   (const float * x, void * y, int64_t k);
void oscar2_64_from_float_ref(const float * x, void * y, int64_t k);

// ggml_quantize_chunk entry (no importance matrix; clip 1). Returns bytes written.
size_t oscar2_quantize   (const float * src, void * dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
size_t oscar2_64_quantize(const float * src, void * dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

// group-size generic entry points used by the backends: G is 64 or 128
void oscar2_quantize_row_g  (const float * x, void * y, int64_t k, int G, float clip);
void oscar2_dequantize_row_g(const void * x, float * y, int64_t k, int G);

// fp16 bits -> fp32, exact (the conversion the reference uses, independent of the host's F16C)
float oscar2_fp16_to_fp32(uint16_t h);

// bytes of one block of group size G (64 or 128)
static inline size_t oscar2_block_bytes(int G) {
    return G == QK_OSCAR2 ? sizeof(block_oscar2) : sizeof(block_oscar2_64);
}

// true for both oscar2 variants (by type id, so usable without ggml.h)
static inline int oscar2_is_type(int type) {
    return type == OSCAR2_TYPE_ID || type == OSCAR2_64_TYPE_ID;
}
static inline int oscar2_group_size(int type) {
    return type == OSCAR2_TYPE_ID ? QK_OSCAR2 : type == OSCAR2_64_TYPE_ID ? QK_OSCAR2_64 : 0;
}

#ifdef __cplusplus
}
#endif
