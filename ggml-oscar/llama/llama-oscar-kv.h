// llama-oscar-kv.h: the oscar state a llama_kv_cache carries, and our access to the cache.
//
// llama_kv_cache (patched) holds `std::shared_ptr<llama_oscar_kv> oscar` and declares
// `friend struct llama_oscar_kv_access`, so that all oscar logic can live in ggml-oscar/
// while reading the cache's private layout (layers, cells, streams).
#pragma once

#include "llama-oscar.h"
#include "llama-kv-cache.h"
#include "../oscar2.h"

#include "ggml-cpp.h"

#include <memory>
#include <utility>
#include <vector>

enum llama_oscar_rot_mode {
    LLAMA_OSCAR_ROT_GGUF     = 0, // per-layer rotations of the GGUF, Hadamard where there are none
    LLAMA_OSCAR_ROT_HADAMARD = 1, // ignore the GGUF's rotations (ablation baseline)
    LLAMA_OSCAR_ROT_NONE     = 2, // no rotation at all
};

struct llama_oscar_window; // llama-oscar-window.h

struct llama_oscar_kv {
    llama_oscar_rot_mode rot_mode = LLAMA_OSCAR_ROT_GGUF;

    // rotations for f16/bf16/f32 layers too (llama_context_params::oscar_rot_float): no quality
    // change and slower, but it lets tests check the rotation wiring exactly, with no
    // quantization in between
    bool rot_float = false;

    // clip ratios by model layer index
    std::vector<float> clip_k;
    std::vector<float> clip_v;

    // high-precision sink + recent window; null when disabled
    std::shared_ptr<llama_oscar_window> window;

    // R^T of each layer's calibrated K and V rotation (by model layer; null where none), made
    // once when the context is created: x @ R is ggml_mul_mat(R^T, x), and a transpose in the
    // graph would cost one more kernel per rotation, layer and token
    std::vector<ggml_tensor *> rot_t_k;
    std::vector<ggml_tensor *> rot_t_v;
    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> rot_t_bufs;
};

struct llama_oscar_kv_access {
    static const std::shared_ptr<llama_oscar_kv> & get(const llama_kv_cache & kv) { return kv.oscar; }
    static void set(llama_kv_cache & kv, std::shared_ptr<llama_oscar_kv> o) { kv.oscar = std::move(o); }
    static const llama_model & model(const llama_kv_cache & kv) { return kv.model; }
    static void attn_rot(llama_kv_cache & kv, bool k, bool v) { kv.attn_rot_k = k; kv.attn_rot_v = v; }

    // layout the window store mirrors
    static const auto & layers(const llama_kv_cache & kv) { return kv.layers; }
    static const auto & map_layer_ids(const llama_kv_cache & kv) { return kv.map_layer_ids; }
    static const auto & cells(const llama_kv_cache & kv) { return kv.v_cells; }
    static const auto & seq_to_stream(const llama_kv_cache & kv) { return kv.seq_to_stream; }
    static uint32_t n_stream(const llama_kv_cache & kv) { return kv.n_stream; }
    static bool v_trans(const llama_kv_cache & kv) { return kv.v_trans; }
    static llama_swa_type swa_type(const llama_kv_cache & kv) { return kv.swa_type; }

    // the cache's own K-shift step (un-rotate, RoPE, re-rotate, store back)
    static ggml_tensor * rope_shift(const llama_kv_cache & kv, const llama_cparams & cparams, ggml_context * ctx,
            ggml_tensor * cur, ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
            float freq_base, float freq_scale, uint32_t il) {
        return kv.build_rope_shift(cparams, ctx, cur, shift, rot, factors, freq_base, freq_scale, il);
    }
};

// whether any K or V layer of the cache is oscar2. Not kv.type_k()/type_v(): those read layer 0,
// and an MLA cache has no V tensors at all (V is a view of the latent K).
inline bool llama_oscar_cache_is_oscar2(const llama_kv_cache & kv) {
    auto oscar2 = [](const ggml_tensor * t) { return t && oscar2_is_type(t->type); };
    for (const auto & layer : llama_oscar_kv_access::layers(kv)) {
        if (oscar2(layer.k) || oscar2(layer.v)) {
            return true;
        }
    }
    return false;
}

// window configuration (llama-oscar-window.cpp); a no-op when the window is disabled
void llama_oscar_window_configure(llama_kv_cache & kv, const llama_model & model, const llama_cparams & cparams);
