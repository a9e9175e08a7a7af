// llama-oscar.cpp: the libllama side of oscar-gguf (see llama-oscar.h for the entry points).
//
// Where things happen:
//   model load      llama_oscar_load_hparams        oscar.* metadata -> hparams
//                   (llama-model.cpp, generic pass) blk.{i}.attn_{k,v}_rot -> llama_layer
//                   llama_oscar_validate_rotations  finite and orthogonal, once, after load
//   context         llama_oscar_resolve_cache_types oscar2 -> group size, flash attention
//                   llama_oscar_configure_memory    clip ratios, rotation source, window
//   graph           llama_oscar_rotate_k / rotate_q / rotate_v / unrotate_out  (build_attn)
//                   llama_oscar_k_rot + llama_oscar_rotate (K shift: un-rotate, RoPE, re-rotate)
//                   llama_oscar_with_clip           the layer's clip ratio on set_rows / cpy

#include "llama-oscar.h"
#include "llama-oscar-kv.h"

#include "llama-impl.h"
#include "llama-model.h"
#include "llama-cparams.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-batch.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-hybrid-iswa.h"

#include "gguf.h"
#include "ggml-backend.h"

#include "../oscar2.h"
#include "../oscar2-ops.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

// Version of the oscar-gguf patch set compiled into this libllama. Tests call it
// through ctypes to prove that the tools and the Python bindings load our patched
// build and not a stock one.
const char * llama_oscar_patchset_version(void) {
    return "oscar-gguf-patches/1";
}

int32_t llama_oscar_context_params_echo(struct llama_context_params p, char * buf, size_t size) {
    return snprintf(buf, size, "sink=%d recent=%d window_type=%d rot=%d clip_k=%g clip_v=%g strict=%d rot_float=%d n_ctx=%u type_k=%d",
            p.oscar_sink, p.oscar_recent, (int) p.oscar_window_type, p.oscar_rot, p.oscar_clip_k, p.oscar_clip_v,
            (int) p.oscar_strict, (int) p.oscar_rot_float, p.n_ctx, (int) p.type_k);
}

// ---- model load -----------------------------------------------------------------------------

static const char * KEY_FORMAT_VERSION = "oscar.format_version";
static const char * KEY_CLIP_K         = "oscar.clip_k";
static const char * KEY_CLIP_V         = "oscar.clip_v";
static const char * KEY_SINK           = "oscar.window.sink";
static const char * KEY_RECENT         = "oscar.window.recent";
static const char * KEY_F16_K_LAYERS   = "oscar.f16_k_layers";
static const uint32_t FORMAT_VERSION   = 1;

static uint32_t read_u32(const gguf_context * meta, const char * key, uint32_t def) {
    const int64_t id = gguf_find_key(meta, key);
    if (id < 0) {
        return def;
    }
    switch (gguf_get_kv_type(meta, id)) {
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(meta, id);
        case GGUF_TYPE_INT32: {
            const int32_t v = gguf_get_val_i32(meta, id);
            if (v < 0) {
                throw std::runtime_error(std::string("oscar: metadata ") + key + " is negative");
            }
            return (uint32_t) v;
        }
        default:
            throw std::runtime_error(std::string("oscar: metadata ") + key + " must be an unsigned integer");
    }
}

static void read_clips(const gguf_context * meta, const char * key, uint32_t n_layer,
        std::array<float, LLAMA_MAX_LAYERS> & dst) {
    const int64_t id = gguf_find_key(meta, key);
    if (id < 0) {
        return;
    }
    if (gguf_get_kv_type(meta, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(meta, id) != GGUF_TYPE_FLOAT32) {
        throw std::runtime_error(std::string("oscar: metadata ") + key + " must be an array of float32");
    }
    const size_t n = gguf_get_arr_n(meta, id);
    if (n != n_layer) {
        throw std::runtime_error(std::string("oscar: metadata ") + key + " has " + std::to_string(n) +
                " entries but the model has " + std::to_string(n_layer) + " layers");
    }
    const float * v = (const float *) gguf_get_arr_data(meta, id);
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(v[i]) || v[i] <= 0.0f || v[i] > 1.0f) {
            throw std::runtime_error(std::string("oscar: metadata ") + key + "[" + std::to_string(i) +
                    "] = " + std::to_string(v[i]) + " is not a clip ratio in (0, 1]");
        }
        dst[i] = v[i];
    }
}

// the precision plan: the layers whose K cache stays f16 under an oscar2 cache type
static void read_f16_k_layers(const gguf_context * meta, uint32_t n_layer, std::array<bool, LLAMA_MAX_LAYERS> & dst) {
    const int64_t id = gguf_find_key(meta, KEY_F16_K_LAYERS);
    if (id < 0) {
        return;
    }
    if (gguf_get_kv_type(meta, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(meta, id) != GGUF_TYPE_UINT32) {
        throw std::runtime_error(std::string("oscar: metadata ") + KEY_F16_K_LAYERS + " must be an array of uint32");
    }
    const size_t n = gguf_get_arr_n(meta, id);
    const uint32_t * v = (const uint32_t *) gguf_get_arr_data(meta, id);
    for (size_t i = 0; i < n; ++i) {
        if (v[i] >= n_layer) {
            throw std::runtime_error(std::string("oscar: metadata ") + KEY_F16_K_LAYERS + " names layer " +
                    std::to_string(v[i]) + " but the model has " + std::to_string(n_layer) + " layers");
        }
        dst[v[i]] = true;
    }
}

void llama_oscar_load_hparams(const gguf_context * meta, llama_hparams & hparams) {
    hparams.oscar_clip_k.fill(OSCAR2_DEFAULT_CLIP_K);
    hparams.oscar_clip_v.fill(OSCAR2_DEFAULT_CLIP_V);

    const int64_t id = gguf_find_key(meta, KEY_FORMAT_VERSION);
    if (id < 0) {
        hparams.oscar_meta = false;
        return;
    }
    const uint32_t version = read_u32(meta, KEY_FORMAT_VERSION, 0);
    if (version != FORMAT_VERSION) {
        throw std::runtime_error("oscar: this GGUF has oscar metadata format " + std::to_string(version) +
                ", this build reads format " + std::to_string(FORMAT_VERSION) + "; reconvert it with this oscar-convert");
    }
    hparams.oscar_meta   = true;
    hparams.oscar_sink   = read_u32(meta, KEY_SINK,   hparams.oscar_sink);
    hparams.oscar_recent = read_u32(meta, KEY_RECENT, hparams.oscar_recent);
    if (hparams.oscar_sink > (1u << 20) || hparams.oscar_recent > (1u << 20)) {
        throw std::runtime_error("oscar: metadata window sizes are absurd (sink " + std::to_string(hparams.oscar_sink) +
                ", recent " + std::to_string(hparams.oscar_recent) + ")");
    }
    read_clips(meta, KEY_CLIP_K, hparams.n_layer_all, hparams.oscar_clip_k);
    read_clips(meta, KEY_CLIP_V, hparams.n_layer_all, hparams.oscar_clip_v);
    read_f16_k_layers(meta, hparams.n_layer_all, hparams.oscar_f16_k);
}

ggml_type llama_oscar_layer_type_k(const llama_hparams & hparams, uint32_t il, ggml_type type_k) {
    return oscar2_is_type(type_k) && il < LLAMA_MAX_LAYERS && hparams.oscar_f16_k[il] ? GGML_TYPE_F16 : type_k;
}

bool llama_oscar_arch_takes_rotations(const llama_model & model) {
    // MLA caches hold a compressed latent, not per-head keys; these architectures also build
    // their attention outside the generic path that applies the rotations
    if (model.hparams.is_mla()) {
        return false;
    }
    switch (model.arch) {
        case LLM_ARCH_DEEPSEEK2:
        case LLM_ARCH_DEEPSEEK32:
        case LLM_ARCH_DEEPSEEK4:
        case LLM_ARCH_GLM_DSA:
        case LLM_ARCH_MINIMAX_M3:
        case LLM_ARCH_T5:
        case LLM_ARCH_T5ENCODER:
            return false;
        default:
            return true;
    }
}

// the largest entry of |R^T R - I| a rotation may have; oscar_gguf/format/rotations.py applies the
// same norm and limit before it writes one (float32 rounding of an orthogonal matrix stays near 1e-6)
static const double OSCAR_ORTHOGONALITY_LIMIT = 1e-4;

static void check_rotation(const ggml_tensor * t) {
    const int64_t d = t->ne[0];
    std::vector<float> r(d*d);
    ggml_backend_tensor_get(t, r.data(), 0, ggml_nbytes(t));
    double err = 0.0;
    for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j < d; ++j) {
            if (!std::isfinite(r[i*d + j])) {
                throw std::runtime_error(std::string("oscar: rotation ") + ggml_get_name(t) + " has non-finite values");
            }
        }
    }
    // || R^T R - I ||_max
    for (int64_t a = 0; a < d; ++a) {
        for (int64_t b = a; b < d; ++b) {
            double s = 0.0;
            for (int64_t i = 0; i < d; ++i) {
                s += (double) r[i*d + a] * (double) r[i*d + b];
            }
            err = std::max(err, std::fabs(s - (a == b ? 1.0 : 0.0)));
        }
    }
    if (err > OSCAR_ORTHOGONALITY_LIMIT) {
        throw std::runtime_error(std::string("oscar: rotation ") + ggml_get_name(t) +
                " is not orthogonal (max |R^T R - I| = " + std::to_string(err) + " > 1e-4)");
    }
}

void llama_oscar_validate_rotations(const llama_model & model) {
    int n = 0;
    for (const auto & layer : model.layers) {
        for (const ggml_tensor * t : { layer.attn_k_rot, layer.attn_v_rot }) {
            if (t) {
                if (t->type != GGML_TYPE_F32 || t->ne[0] != t->ne[1]) {
                    throw std::runtime_error(std::string("oscar: rotation ") + ggml_get_name(t) + " must be a square f32 matrix");
                }
                check_rotation(t);
                n++;
            }
        }
    }
    if (n > 0) {
        LLAMA_LOG_INFO("%s: %d OSCAR rotation matrices loaded and checked (finite, orthogonal)\n", __func__, n);
    }
}

// ---- context creation ----------------------------------------------------------------------

// oscar2 -> the variant whose group divides every layer's head size
static bool pick_variant(const llama_model & model, ggml_type & t, bool v) {
    if (!oscar2_is_type(t)) {
        return true;
    }
    const auto & hp = model.hparams;
    bool all128 = true;
    uint32_t d_first = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        const uint32_t d = v ? hp.n_embd_head_v(il) : hp.n_embd_head_k(il);
        if (d == 0) {
            continue;
        }
        d_first = d_first ? d_first : d;
        if (d % QK_OSCAR2_64 != 0) {
            LLAMA_LOG_ERROR("%s: the oscar2 %s cache needs a head size that is a multiple of 64, but layer %u has %u\n",
                    __func__, v ? "V" : "K", il, d);
            return false;
        }
        all128 = all128 && (d % QK_OSCAR2 == 0);
    }
    const ggml_type want = all128 && t == GGML_TYPE_OSCAR2 ? GGML_TYPE_OSCAR2 : GGML_TYPE_OSCAR2_64;
    if (want != t) {
        LLAMA_LOG_INFO("%s: %s cache: head size %u is not a multiple of 128, using %s (group 64, 2.5 bits/value)\n",
                __func__, v ? "V" : "K", d_first, ggml_type_name(want));
    }
    t = want;
    return true;
}

bool llama_oscar_resolve_cache_types(const llama_model & model, llama_context_params & params) {
    if (params.oscar_rot < 0 || params.oscar_rot > 2) {
        LLAMA_LOG_ERROR("%s: oscar_rot must be 0 (gguf), 1 (hadamard) or 2 (none), got %d\n", __func__, params.oscar_rot);
        return false;
    }
    for (float c : { params.oscar_clip_k, params.oscar_clip_v }) {
        if (!std::isfinite(c) || c > 1.0f) {
            LLAMA_LOG_ERROR("%s: a clip ratio must be in (0, 1] (or <= 0 for the model's own), got %g\n", __func__, c);
            return false;
        }
    }
    if (!oscar2_is_type(params.type_k) && !oscar2_is_type(params.type_v)) {
        return true;
    }
    if (!llama_oscar_arch_takes_rotations(model)) {
        LLAMA_LOG_ERROR("%s: the oscar2 KV cache is not supported for architecture %s (its attention bypasses the KV-cache path oscar2 needs)\n",
                __func__, llm_arch_name(model.arch));
        return false;
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

void llama_oscar_copy_cparams(const llama_context_params & params, llama_cparams & cparams) {
    cparams.oscar_sink        = params.oscar_sink;
    cparams.oscar_recent      = params.oscar_recent;
    cparams.oscar_window_type = params.oscar_window_type;
    cparams.oscar_rot         = params.oscar_rot;
    cparams.oscar_clip_k      = params.oscar_clip_k;
    cparams.oscar_clip_v      = params.oscar_clip_v;
    cparams.oscar_strict      = params.oscar_strict;
    cparams.oscar_rot_float   = params.oscar_rot_float;
}

static bool model_has_rotations(const llama_model & model) {
    for (const auto & layer : model.layers) {
        if (layer.attn_k_rot || layer.attn_v_rot) {
            return true;
        }
    }
    return false;
}

// whether model layer il keeps its K (or V) in a quantized type in this cache
static bool layer_quantized(const llama_kv_cache & kv, int32_t il, bool v) {
    const auto & ids = llama_oscar_kv_access::map_layer_ids(kv);
    const auto it = ids.find(il);
    if (it == ids.end()) {
        return false;
    }
    const auto & layer = llama_oscar_kv_access::layers(kv).at(it->second);
    const ggml_tensor * t = v ? layer.v : layer.k;
    return t && ggml_is_quantized(t->type);
}

// R^T of the f32 layer rotations this cache applies (its quantized layers, or all of its layers
// with rot_float), in the rotation's own buffer type (its device)
static void make_transposed_rotations(llama_oscar_kv & oscar, const llama_kv_cache & kv, const llama_model & model) {
    const size_t n_layer = model.layers.size();
    oscar.rot_t_k.assign(n_layer, nullptr);
    oscar.rot_t_v.assign(n_layer, nullptr);
    const auto & ids = llama_oscar_kv_access::map_layer_ids(kv);
    // no data: a model loaded without weights (the tools' memory-fitting dry run); the graph
    // then transposes as it goes
    auto usable = [&](const ggml_tensor * r, size_t il, bool v) {
        const bool applied = oscar.rot_float ? ids.count((int32_t) il) > 0 : layer_quantized(kv, (int32_t) il, v);
        return applied && r && r->type == GGML_TYPE_F32 && r->buffer && r->data && ggml_is_contiguous(r) && r->ne[0] == r->ne[1];
    };
    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> ctxs;
    for (size_t il = 0; il < n_layer; ++il) {
        for (bool v : { false, true }) {
            const ggml_tensor * r = v ? model.layers[il].attn_v_rot : model.layers[il].attn_k_rot;
            if (!usable(r, il, v)) {
                continue;
            }
            ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(r->buffer);
            auto it = ctxs.find(buft);
            if (it == ctxs.end()) {
                ggml_init_params params = { 2*n_layer*ggml_tensor_overhead(), nullptr, true };
                it = ctxs.emplace(buft, ggml_context_ptr(ggml_init(params))).first;
            }
            ggml_tensor * rt = ggml_new_tensor_2d(it->second.get(), GGML_TYPE_F32, r->ne[0], r->ne[1]);
            ggml_format_name(rt, "oscar_%s_rot_t-%zu", v ? "v" : "k", il);
            (v ? oscar.rot_t_v : oscar.rot_t_k)[il] = rt;
        }
    }
    for (auto & [buft, ctx] : ctxs) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (!buf) {
            throw std::runtime_error("oscar: failed to allocate the transposed rotations");
        }
        oscar.rot_t_bufs.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }
    std::vector<float> a, b;
    for (size_t il = 0; il < n_layer; ++il) {
        for (bool v : { false, true }) {
            ggml_tensor * rt = (v ? oscar.rot_t_v : oscar.rot_t_k)[il];
            if (!rt) {
                continue;
            }
            const ggml_tensor * r = v ? model.layers[il].attn_v_rot : model.layers[il].attn_k_rot;
            const int64_t d = r->ne[0];
            a.resize(d*d);
            b.resize(d*d);
            ggml_backend_tensor_get(r, a.data(), 0, ggml_nbytes(r));
            for (int64_t i = 0; i < d; ++i) {
                for (int64_t j = 0; j < d; ++j) {
                    b[j*d + i] = a[i*d + j];
                }
            }
            ggml_backend_tensor_set(rt, b.data(), 0, ggml_nbytes(rt));
        }
    }
}

static void configure_cache(llama_kv_cache & kv, const llama_model & model, const llama_cparams & cparams) {
    auto oscar = std::make_shared<llama_oscar_kv>();
    const auto & hp = model.hparams;

    oscar->rot_mode  = (llama_oscar_rot_mode) cparams.oscar_rot;
    oscar->rot_float = cparams.oscar_rot_float;
    oscar->clip_k.resize(hp.n_layer_all);
    oscar->clip_v.resize(hp.n_layer_all);
    for (uint32_t il = 0; il < hp.n_layer_all; ++il) {
        oscar->clip_k[il] = cparams.oscar_clip_k > 0.0f ? cparams.oscar_clip_k : hp.oscar_clip_k[il];
        oscar->clip_v[il] = cparams.oscar_clip_v > 0.0f ? cparams.oscar_clip_v : hp.oscar_clip_v[il];
    }

    if (oscar->rot_mode == LLAMA_OSCAR_ROT_GGUF) {
        make_transposed_rotations(*oscar, kv, model);
    }
    if (oscar->rot_mode == LLAMA_OSCAR_ROT_NONE) {
        // like LLAMA_ATTN_ROT_DISABLE: no calibrated rotation and no Hadamard
        llama_oscar_kv_access::attn_rot(kv, false, false);
    }

    llama_oscar_kv_access::set(kv, oscar);
    llama_oscar_window_configure(kv, model, cparams);
}

void llama_oscar_configure_memory(llama_memory_i * memory, const llama_model & model, const llama_cparams & cparams) {
    if (memory == nullptr) {
        return;
    }
    std::vector<llama_kv_cache *> caches;
    if (auto * kv = dynamic_cast<llama_kv_cache *>(memory)) {
        caches.push_back(kv);
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(memory)) {
        caches.push_back(iswa->get_base());
        caches.push_back(iswa->get_swa());
    } else if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(memory)) {
        caches.push_back(hyb->get_mem_attn());
    } else if (auto * hyb_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(memory)) {
        caches.push_back(hyb_iswa->get_mem_attn()->get_base());
        caches.push_back(hyb_iswa->get_mem_attn()->get_swa());
    }

    bool any_oscar2 = false;
    for (auto * kv : caches) {
        if (kv) {
            any_oscar2 = any_oscar2 || llama_oscar_cache_is_oscar2(*kv);
            configure_cache(*kv, model, cparams);
        }
    }

    const bool has_rot = model_has_rotations(model);
    if (any_oscar2 && cparams.oscar_rot == LLAMA_OSCAR_ROT_GGUF && !has_rot) {
        if (cparams.oscar_strict) {
            throw std::runtime_error("oscar: the oscar2 KV cache was requested with --oscar-strict, but this GGUF "
                    "carries no OSCAR rotations; add them with oscar-convert");
        }
        LLAMA_LOG_WARN("%s: this GGUF carries no OSCAR rotations: oscar2 falls back to the built-in Hadamard rotation "
                "(quality is lower; add rotations with oscar-convert, or pass --oscar-strict to make this an error)\n", __func__);
    }
    if (has_rot && cparams.oscar_rot == LLAMA_OSCAR_ROT_GGUF) {
        LLAMA_LOG_INFO("%s: applying the OSCAR rotations of this GGUF to the KV cache\n", __func__);
    }
}

// ---- cache writes ------------------------------------------------------------------------

float llama_oscar_layer_clip(const llama_kv_cache & kv, int32_t il, bool v) {
    const auto & oscar = llama_oscar_kv_access::get(kv);
    if (oscar && il >= 0 && (size_t) il < oscar->clip_k.size()) {
        return v ? oscar->clip_v[il] : oscar->clip_k[il];
    }
    return v ? OSCAR2_DEFAULT_CLIP_V : OSCAR2_DEFAULT_CLIP_K;
}

ggml_tensor * llama_oscar_with_clip(ggml_tensor * node, float clip) {
    if (node && oscar2_is_type(node->type)) {
        ggml_oscar2_set_clip(node, clip);
    }
    return node;
}

// ---- rotations in the graph ------------------------------------------------------------------

static llama_oscar_rot layer_rot(const llama_kv_cache & kv, int32_t il, ggml_tensor * had, bool v) {
    llama_oscar_rot rot;
    const auto & oscar = llama_oscar_kv_access::get(kv);
    const llama_oscar_rot_mode mode = oscar ? oscar->rot_mode : LLAMA_OSCAR_ROT_GGUF;
    // like upstream's Hadamard: a rotation only where the cache quantizes; for f16/bf16/f32 it
    // would change nothing but the time (scores and outputs are the same in any orthonormal basis)
    if (mode == LLAMA_OSCAR_ROT_NONE || (!(oscar && oscar->rot_float) && !layer_quantized(kv, il, v))) {
        return rot;
    }
    if (mode == LLAMA_OSCAR_ROT_GGUF) {
        const auto & model = llama_oscar_kv_access::model(kv);
        if (il >= 0 && (size_t) il < model.layers.size()) {
            rot.r = v ? model.layers[il].attn_v_rot : model.layers[il].attn_k_rot;
            if (oscar) {
                const auto & rt = v ? oscar->rot_t_v : oscar->rot_t_k;
                rot.rt = (size_t) il < rt.size() ? rt[il] : nullptr;
            }
        }
    }
    if (!rot.r) {
        rot.had = had;
    }
    return rot;
}

llama_oscar_rot llama_oscar_k_rot(const llama_kv_cache & kv, int32_t il, ggml_tensor * had) {
    return layer_rot(kv, il, had, false);
}

llama_oscar_rot llama_oscar_v_rot(const llama_kv_cache & kv, int32_t il, ggml_tensor * had) {
    return layer_rot(kv, il, had, true);
}

ggml_tensor * llama_oscar_rotate(ggml_context * ctx, ggml_tensor * x, const llama_oscar_rot & rot, bool inverse) {
    if (!rot.r) {
        // upstream's Hadamard: symmetric and its own inverse, applied with its fast-transform hint
        return rot.had ? llama_mul_mat_hadamard(ctx, x, rot.had) : x;
    }
    const int64_t d = rot.r->ne[0];
    GGML_ASSERT(x->ne[0] == d && "OSCAR rotation size must equal the head size");
    ggml_tensor * x2 = ggml_is_contiguous(x) ? ggml_reshape_2d(ctx, x, d, ggml_nelements(x)/d)
                                             : ggml_cont_2d(ctx, x, d, ggml_nelements(x)/d);
    // ggml_mul_mat(A, x) = x @ A^T for A stored row-major: with A = R this is x @ R^T (the
    // inverse); for x @ R we multiply by R^T, made once per context (or here, when there is none)
    ggml_tensor * a = inverse ? rot.r : rot.rt ? rot.rt : ggml_cont(ctx, ggml_transpose(ctx, rot.r));
    ggml_tensor * y = ggml_mul_mat(ctx, a, x2);
    // a plain matmul to any backend; the CUDA one takes it with its rotation kernels
    ggml_mul_mat_set_hint(y, GGML_HINT_SRC0_IS_OSCAR_ROTATION);
    return ggml_reshape_4d(ctx, y, x->ne[0], x->ne[1], x->ne[2], x->ne[3]);
}

ggml_tensor * llama_oscar_rotate_k(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_k, ggml_tensor * k) {
    const llama_oscar_rot rk = llama_oscar_k_rot(*mctx->get_kv(), il, had_k);
    return rk && k ? llama_oscar_rotate(ctx, k, rk, false) : k;
}

ggml_tensor * llama_oscar_rotate_q(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_k, ggml_tensor * q) {
    const llama_oscar_rot rk = llama_oscar_k_rot(*mctx->get_kv(), il, had_k);
    // scores are unchanged: (q R)(k R)^T = q k^T for an orthogonal R
    return rk ? llama_oscar_rotate(ctx, q, rk, false) : q;
}

ggml_tensor * llama_oscar_rotate_v(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_v, ggml_tensor * v) {
    const llama_oscar_rot rv = llama_oscar_v_rot(*mctx->get_kv(), il, had_v);
    return rv && v ? llama_oscar_rotate(ctx, v, rv, false) : v;
}

ggml_tensor * llama_oscar_unrotate_out(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_v, ggml_tensor * cur) {
    const llama_oscar_rot rv = llama_oscar_v_rot(*mctx->get_kv(), il, had_v);
    if (!rv) {
        return cur;
    }
    // the output is a mix of rotated values: sum_t a_t (v_t R) = (sum_t a_t v_t) R, so R^T undoes it;
    // cur is [d*n_head, n_tokens]: view it per head
    const int64_t d = rv.r ? rv.r->ne[0] : rv.had->ne[0];
    ggml_tensor * per_head = ggml_reshape_3d(ctx, cur, d, cur->ne[0]/d, ggml_nelements(cur)/cur->ne[0]);
    ggml_tensor * y = llama_oscar_rotate(ctx, per_head, rv, true);
    y = ggml_reshape_2d(ctx, y, cur->ne[0], cur->ne[1]);
    ggml_format_name(y, "kqv_out_unrot-%d", il); // the attention output back in the model's basis
    return y;
}

void llama_oscar_fa_seq_tokens(ggml_tensor * fa, const llama_ubatch & ubatch) {
    // from the counts that llm_graph_params::allow_reuse compares, so a reused graph keeps it right
    if (fa && ubatch.n_seqs_unq > 0) {
        ggml_flash_attn_ext_set_seq_tokens(fa, (int32_t) ((ubatch.n_tokens + ubatch.n_seqs_unq - 1)/ubatch.n_seqs_unq));
    }
}
