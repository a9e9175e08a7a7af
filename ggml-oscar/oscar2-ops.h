// oscar2-ops.h: graph-level additions for the oscar2 KV cache (see oscar2-ops.c).
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// Give a flash-attention node the high-precision window rows: k_hp [DK, n_hp, n_head_kv, ns]
// and v_hp [DV, n_hp, n_head_kv, ns] (f16 or bf16). The mask must carry n_kv + n_hp columns.
GGML_API void ggml_flash_attn_ext_add_window(struct ggml_tensor * a, struct ggml_tensor * k_hp, struct ggml_tensor * v_hp);

// Whether the backend device of this name reads the window sources of flash attention.
GGML_API bool ggml_oscar_backend_reads_window(const char * dev_name);

#ifdef __cplusplus
}
#endif
