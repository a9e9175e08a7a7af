// llama-oscar.cpp: the libllama side of oscar-gguf.
//
// Everything the patched libllama needs from us lives here and is hooked in by
// llama.cpp/patches; the patches themselves only add declarations and calls.

#include "llama-oscar.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "../oscar2.h"

#include <cstring>

// Version of the oscar-gguf patch set compiled into this libllama. Tests call it
// through ctypes to prove that the tools and the Python bindings load our patched
// build and not a stock one.
const char * llama_oscar_patchset_version(void) {
    return "oscar-gguf-patches/1";
}

static bool is_oscar2(ggml_type t) {
    return t == GGML_TYPE_OSCAR2 || t == GGML_TYPE_OSCAR2_64;
}

// oscar2 -> the variant whose group divides every layer's head size
static bool pick_variant(const llama_model & model, ggml_type & t, bool v) {
    if (!is_oscar2(t)) {
        return true;
    }
    const auto & hp = model.hparams;
    bool all128 = true;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        const uint32_t d = v ? hp.n_embd_head_v(il) : hp.n_embd_head_k(il);
        if (d == 0) {
            continue;
        }
        if (d % QK_OSCAR2_64 != 0) {
            LLAMA_LOG_ERROR("%s: oscar2 %s cache needs a head size that is a multiple of 64, but layer %u has %u\n",
                    __func__, v ? "V" : "K", il, d);
            return false;
        }
        all128 = all128 && (d % QK_OSCAR2 == 0);
    }
    const ggml_type want = all128 && t == GGML_TYPE_OSCAR2 ? GGML_TYPE_OSCAR2 : GGML_TYPE_OSCAR2_64;
    if (want != t) {
        LLAMA_LOG_INFO("%s: %s cache: head size %u is not a multiple of 128, using %s (group 64, 2.5 bits/value)\n",
                __func__, v ? "V" : "K", v ? hp.n_embd_head_v(0) : hp.n_embd_head_k(0), ggml_type_name(want));
    }
    t = want;
    return true;
}

bool llama_oscar_resolve_cache_types(const llama_model & model, llama_context_params & params) {
    if (!is_oscar2(params.type_k) && !is_oscar2(params.type_v)) {
        return true;
    }
    if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED) {
        LLAMA_LOG_ERROR("%s: the oscar2 KV cache requires flash attention: use -fa on (or leave it on auto)\n", __func__);
        return false;
    }
    if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_AUTO) {
        LLAMA_LOG_INFO("%s: enabling flash_attn since the oscar2 KV cache requires it\n", __func__);
        params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    }
    return pick_variant(model, params.type_k, false) && pick_variant(model, params.type_v, true);
}

float llama_oscar_layer_clip(const llama_model & model, int32_t il, bool v) {
    GGML_UNUSED(model);
    GGML_UNUSED(il);
    return v ? OSCAR2_DEFAULT_CLIP_V : OSCAR2_DEFAULT_CLIP_K;
}

ggml_tensor * llama_oscar_tag_clip(ggml_tensor * node, float clip) {
    if (node && is_oscar2(node->type)) {
        // op_params[0] as float; 0 would mean "no clipping"
        memcpy(node->op_params, &clip, sizeof(float));
    }
    return node;
}
