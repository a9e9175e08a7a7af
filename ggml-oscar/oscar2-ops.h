// oscar2-ops.h: the graph parameters of the oscar2 KV cache, each declared here once with its
// meaning and read by the backends only through these functions (see oscar2-ops.c).
//
//   ggml_oscar2_set_clip / get_clip         the clip ratio of a cache write (SET_ROWS, CPY)
//   ggml_flash_attn_ext_add_window / get_*  the high-precision window rows of flash attention
//   ggml_flash_attn_ext_set_seq_tokens      query rows per sequence of a flash attention (a kernel choice)
//   GGML_HINT_SRC0_IS_OSCAR_ROTATION        (ggml.h) a MUL_MAT that applies an OSCAR rotation,
//                                           set with upstream's ggml_mul_mat_set_hint
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// ---- cache writes ------------------------------------------------------------------------

// The clip ratio (oscar2.h, step 1) with which a GGML_OP_SET_ROWS or GGML_OP_CPY node quantizes
// into an oscar2 destination: the layer's calibrated ratio. 0, the value of a new node, quantizes
// without clipping, as the type's from_float does. Other destination types ignore it.
GGML_API void  ggml_oscar2_set_clip(struct ggml_tensor * a, float clip);
// 0 for a node of any other op
GGML_API float ggml_oscar2_get_clip(const struct ggml_tensor * a);

// ---- flash attention over the high-precision window ----------------------------------------

// Give a flash-attention node the high-precision window rows: k_hp [DK, n_hp, n_head_kv, ns]
// and v_hp [DV, n_hp, n_head_kv, ns] (f16 or bf16). They follow the n_kv cache rows of K and V
// in the same online softmax, so the mask must carry n_kv + n_hp columns. NULL, NULL removes
// them. (Like upstream's ggml_flash_attn_ext_add_sinks, they are sources of the node, src[5]
// and src[6], so that the scheduler allocates and moves them as any other input.)
GGML_API void ggml_flash_attn_ext_add_window(struct ggml_tensor * a, struct ggml_tensor * k_hp, struct ggml_tensor * v_hp);

// the window rows of a flash-attention node (NULL: none)
GGML_API struct ggml_tensor * ggml_flash_attn_ext_get_window_k(const struct ggml_tensor * a);
GGML_API struct ggml_tensor * ggml_flash_attn_ext_get_window_v(const struct ggml_tensor * a);
// their number (0: none)
GGML_API int64_t ggml_flash_attn_ext_window_rows(const struct ggml_tensor * a);

// ---- flash attention over many sequences ------------------------------------------------

// The query rows of a flash-attention node per sequence of its batch: n_tokens / n_sequences,
// rounded up (llama.cpp reuses a graph only for a batch with the same two counts). Where the
// mask hides each sequence's cells from the others, a batch of many sequences with a few rows
// each reads the cache as a decode does, not as a prefill. It only picks kernels: the result
// is the same whatever its value. 0, the value of a new node: unknown (one sequence).
GGML_API void    ggml_flash_attn_ext_set_seq_tokens(struct ggml_tensor * a, int32_t n);
GGML_API int32_t ggml_flash_attn_ext_get_seq_tokens(const struct ggml_tensor * a);

// Whether the backend device of this name reads the window rows of flash attention; any other
// device must refuse a node that has them, or it would silently attend without the window.
GGML_API bool ggml_oscar_backend_reads_window(const char * dev_name);

#ifdef __cplusplus
}
#endif
