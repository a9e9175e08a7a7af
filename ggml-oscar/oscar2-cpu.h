// oscar2-cpu.h: CPU entry points of the oscar2 types, hooked into ggml-cpu's trait table
// (ggml-cpu.c), into set_rows / cpy and into flash attention (ops.cpp) by llama.cpp/patches.
#pragma once

#include "ggml.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ggml_vec_dot_t with vec_dot_type F32
void oscar2_cpu_vec_dot_f32   (int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc);
void oscar2_64_cpu_vec_dot_f32(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc);
// plain reference of the two above (tests)
void oscar2_cpu_vec_dot_f32_ref(int G, int n, float * s, const void * x, const float * y);

// ggml_from_float_t (no clip)
void oscar2_cpu_from_float   (const float * x, void * y, int64_t k);
void oscar2_64_cpu_from_float(const float * x, void * y, int64_t k);

// one row of a cache write (set_rows, cpy) into dst: quantized by from_float (dst's type's), or,
// into oscar2, by the oscar2 quantizer with the clip ratio of the node (ggml_oscar2_get_clip)
void oscar2_cpu_write_row(const struct ggml_tensor * dst, ggml_from_float_t from_float, const float * x, void * y, int64_t k);

// flash attention over the high-precision window rows (f16/bf16, widened to f32):
// the K.Q of one row with the f32 query, and one V row widened into out
float oscar2_cpu_window_kq(const void * k_row, int type, const float * q, int64_t dk);
void  oscar2_cpu_window_v (const void * v_row, int type, float * out, int64_t dv);

#ifdef __cplusplus
}
#endif
