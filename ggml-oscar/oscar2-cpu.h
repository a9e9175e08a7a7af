// oscar2-cpu.h: CPU entry points of the oscar2 types, hooked into ggml-cpu's trait table
// (ggml-cpu.c), into set_rows / cpy and into flash attention (ops.cpp) by llama.cpp/patches.
#pragma once

#include "ggml.h"
#include "oscar2.h" // oscar2_is_type, oscar2_group_size

#include <float.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ggml_vec_dot_t with vec_dot_type F32
void oscar2_cpu_vec_dot_f32   (int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc);
void oscar2_64_cpu_vec_dot_f32(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc);
// P.V of one oscar2 row in upstream's row-by-row loop (its use_ref path): acc = fma(value, w, acc), from the codes
void oscar2_cpu_v_mad(const void * v_row, int type, float * acc, float w, int64_t dv);

// the row-by-row flash attention over oscar2 K/V or a window cuts each query's rows (the cache's,
// then the window's) into parts that hold equal counts of the rows its mask lets through, at least
// OSCAR2_FA_PART_ROWS each and at most one per thread; a part is an online softmax of its own
// (a partial: M, S, VKQ[dv]) and the partials are folded in order. The parts depend only on the
// mask row and the thread count, so a query's sums are the same to the bit whether its parts run
// on several threads (a step of one token) or on one (a step of several), and wherever its
// sequence's cells sit in the cache.
#define OSCAR2_FA_PART_ROWS 512
#define OSCAR2_FA_MAX_PARTS 64
// the parts of a query over n_kv rows: returns their count n, bounds[0..n] (bounds[0] = 0,
// bounds[n] = n_kv); mask_row NULL: every row is seen
int  oscar2_cpu_fa_parts(const ggml_fp16_t * mask_row, int64_t n_kv, int n_threads, int64_t * bounds);
// the online softmax of query rows ir, ir + ne1, ... (nh heads of one token that share a K/V
// head and a mask row, at most OSCAR2_FA_MAX_GROUP) of a FLASH_ATTN_EXT node over its rows
// [ic0, ic1) (the cache's, then the window's), as partials [M, S, VKQ[dv]] at partial + h*pstride;
// a head's sink, if any, counts in the part that starts at row 0. A head's partial is the same
// whatever nh.
#define OSCAR2_FA_MAX_GROUP 8
void oscar2_cpu_fa_part(const struct ggml_tensor * dst, int64_t ir, int nh, int64_t ic0, int64_t ic1,
                        float * partial, int64_t pstride);
// A softmax weight (or rescale factor) below FLT_MIN, a subnormal, as 0, in the row-by-row and the
// tiled flash attention alike: a subnormal operand costs an x86 core a microcode assist in each
// product of the P.V, and scores far below the running maximum (a sink's beside the rest, a
// quantized row's) make many; a weight under 2^-126 moves the output by less than 2^-126 times a
// V value.
static inline float oscar2_cpu_fa_weight(float w) {
    return w < FLT_MIN ? 0.0f : w;
}
// oscar2_cpu_fa_weight of each of w[0..n)
void oscar2_cpu_fa_flush_weights(float * w, int64_t n);

// acc = acc then part (partials [M, S, VKQ[dv]]; acc starts at M -inf, S 0, VKQ 0)
void oscar2_cpu_fa_fold(float * acc, const float * part, int64_t dv);
// out = VKQ / S of a folded partial (0 where nothing was seen)
void oscar2_cpu_fa_finish(const float * acc, float * out, int64_t dv);

// the tiled flash attention (prefill) over oscar2 K and/or V (the other f16/f32), window included:
// whether it applies, and a tile of n_rows rows from row ic (the window's after the nek1 cache rows)
// as f32, K transposed (k_t[i*tile + r], tile = the tile's row stride) and V row-major
int  oscar2_cpu_fa_tiled(const struct ggml_tensor * k, const struct ggml_tensor * v);
void oscar2_cpu_fa_pack_k(const struct ggml_tensor * k, const struct ggml_tensor * k_hp, int64_t ic, int n_rows, int tile,
                          int64_t ik2, int64_t ik3, float * k_t);
void oscar2_cpu_fa_pack_v(const struct ggml_tensor * v, const struct ggml_tensor * v_hp, int64_t ic, int n_rows,
                          int64_t iv2, int64_t iv3, float * v_tile);

// ggml_from_float_t (no clip)
void oscar2_cpu_from_float   (const float * x, void * y, int64_t k);
void oscar2_64_cpu_from_float(const float * x, void * y, int64_t k);

// one row of a cache write (set_rows, cpy) into dst: quantized by from_float (dst's type's), or,
// into oscar2, by the oscar2 quantizer with the clip ratio of the node (ggml_oscar2_get_clip)
void oscar2_cpu_write_row(const struct ggml_tensor * dst, ggml_from_float_t from_float, const float * x, void * y, int64_t k);

// upstream's row-by-row loop over the high-precision window rows (f16/bf16, widened to f32):
// the K.Q of one row with the f32 query, and one V row widened into out
float oscar2_cpu_window_kq(const void * k_row, int type, const float * q, int64_t dk);
void  oscar2_cpu_window_v (const void * v_row, int type, float * out, int64_t dv);

#ifdef __cplusplus
}
#endif
