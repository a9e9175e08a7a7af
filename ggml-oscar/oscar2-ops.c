// oscar2-ops.c: graph-level additions for the oscar2 KV cache (compiled into ggml-base).
//
// The high-precision window: flash attention over an oscar2 cache can also read a small
// f16/bf16 store that holds the sink and recent tokens (llama-oscar-window.cpp). Those rows
// travel as src[5] (K) and src[6] (V) of GGML_OP_FLASH_ATTN_EXT, and the mask grows by as
// many columns, placed after the n_kv cache columns. Attention then reads every position once,
// from whichever store the mask leaves visible, inside one online softmax.

#include "oscar2-ops.h"

#include <string.h>

void ggml_flash_attn_ext_add_window(struct ggml_tensor * a, struct ggml_tensor * k_hp, struct ggml_tensor * v_hp) {
    GGML_ASSERT(a->op == GGML_OP_FLASH_ATTN_EXT);
    GGML_ASSERT(a->src[5] == NULL && a->src[6] == NULL);
    const struct ggml_tensor * k    = a->src[1];
    const struct ggml_tensor * v    = a->src[2];
    const struct ggml_tensor * mask = a->src[3];
    GGML_ASSERT(k_hp && v_hp && mask);
    GGML_ASSERT(k_hp->type == GGML_TYPE_F16 || k_hp->type == GGML_TYPE_BF16);
    GGML_ASSERT(v_hp->type == k_hp->type);
    GGML_ASSERT(k_hp->ne[0] == k->ne[0] && k_hp->ne[2] == k->ne[2] && k_hp->ne[3] == k->ne[3]);
    GGML_ASSERT(v_hp->ne[0] == v->ne[0] && v_hp->ne[2] == v->ne[2] && v_hp->ne[3] == v->ne[3]);
    GGML_ASSERT(v_hp->ne[1] == k_hp->ne[1]);
    GGML_ASSERT(mask->ne[0] >= k->ne[1] + k_hp->ne[1] && "the mask needs a column per window row");
    a->src[5] = k_hp;
    a->src[6] = v_hp;
}

bool ggml_oscar_backend_reads_window(const char * dev_name) {
    // backends whose flash attention reads src[5]/src[6] (CPU: ggml-cpu/ops.cpp; CUDA:
    // ggml-oscar/cuda/oscar2-cuda.cu); every other one must not take the op, or it would
    // silently attend without the window
    return dev_name != NULL && (strcmp(dev_name, "CPU") == 0 || strncmp(dev_name, "CUDA", 4) == 0);
}
