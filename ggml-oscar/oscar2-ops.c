// oscar2-ops.c: the graph parameters of the oscar2 KV cache (declared in oscar2-ops.h; compiled
// into ggml-base).
//
// The high-precision window: flash attention over an oscar2 cache can also read a small
// f16/bf16 store that holds the sink and recent tokens (llama-oscar-window.cpp). Its rows follow
// the cache rows, and its mask columns the n_kv cache columns; attention then reads every
// position once, from whichever store the mask leaves visible, inside one online softmax.

#include "oscar2-ops.h"

#include <string.h>

// the sources of GGML_OP_FLASH_ATTN_EXT that hold the window rows (upstream uses 0..4)
enum { FA_SRC_WINDOW_K = 5, FA_SRC_WINDOW_V = 6 };
// the op_params slot of GGML_OP_FLASH_ATTN_EXT that holds the query rows per sequence (upstream
// uses 0..4: scale, max_bias, softcap, precision, n_kv_max)
enum { FA_PARAM_SEQ_TOKENS = 8 };

static bool is_cache_write(const struct ggml_tensor * a) {
    return a->op == GGML_OP_SET_ROWS || a->op == GGML_OP_CPY;
}

// the clip ratio lives in op_params[0], which neither op uses otherwise
void ggml_oscar2_set_clip(struct ggml_tensor * a, float clip) {
    GGML_ASSERT(is_cache_write(a));
    memcpy(a->op_params, &clip, sizeof(clip));
}

float ggml_oscar2_get_clip(const struct ggml_tensor * a) {
    float clip = 0.0f;
    if (is_cache_write(a)) {
        memcpy(&clip, a->op_params, sizeof(clip));
    }
    return clip;
}

void ggml_flash_attn_ext_add_window(struct ggml_tensor * a, struct ggml_tensor * k_hp, struct ggml_tensor * v_hp) {
    GGML_ASSERT(a->op == GGML_OP_FLASH_ATTN_EXT);
    if (!k_hp && !v_hp) {
        a->src[FA_SRC_WINDOW_K] = NULL;
        a->src[FA_SRC_WINDOW_V] = NULL;
        return;
    }
    GGML_ASSERT(a->src[FA_SRC_WINDOW_K] == NULL && a->src[FA_SRC_WINDOW_V] == NULL);
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
    a->src[FA_SRC_WINDOW_K] = k_hp;
    a->src[FA_SRC_WINDOW_V] = v_hp;
}

struct ggml_tensor * ggml_flash_attn_ext_get_window_k(const struct ggml_tensor * a) {
    return a->op == GGML_OP_FLASH_ATTN_EXT ? a->src[FA_SRC_WINDOW_K] : NULL;
}

struct ggml_tensor * ggml_flash_attn_ext_get_window_v(const struct ggml_tensor * a) {
    return a->op == GGML_OP_FLASH_ATTN_EXT ? a->src[FA_SRC_WINDOW_V] : NULL;
}

int64_t ggml_flash_attn_ext_window_rows(const struct ggml_tensor * a) {
    const struct ggml_tensor * k_hp = ggml_flash_attn_ext_get_window_k(a);
    return k_hp ? k_hp->ne[1] : 0;
}

void ggml_flash_attn_ext_set_seq_tokens(struct ggml_tensor * a, int32_t n) {
    GGML_ASSERT(a->op == GGML_OP_FLASH_ATTN_EXT && n >= 0);
    memcpy(a->op_params + FA_PARAM_SEQ_TOKENS, &n, sizeof(n));
}

int32_t ggml_flash_attn_ext_get_seq_tokens(const struct ggml_tensor * a) {
    int32_t n = 0;
    if (a->op == GGML_OP_FLASH_ATTN_EXT) {
        memcpy(&n, a->op_params + FA_PARAM_SEQ_TOKENS, sizeof(n));
    }
    return n;
}

bool ggml_oscar_backend_reads_window(const char * dev_name) {
    // backends whose flash attention reads the window rows (CPU: ggml-cpu/ops.cpp; CUDA:
    // ggml-oscar/cuda/attn-decode.cu, attn-prefill.cu). An RPC device ("RPC0[host:port]", ...)
    // sends the node, window sources included, to a server that holds oscar2 buffers, so one built
    // from these sources, and only the two backends above have flash attention over oscar2 at all.
    return dev_name != NULL && (strcmp(dev_name, "CPU") == 0 || strncmp(dev_name, "CUDA", 4) == 0 ||
                                strncmp(dev_name, "RPC", 3) == 0);
}
