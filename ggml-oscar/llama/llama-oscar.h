// llama-oscar.h: libllama-internal entry points of oscar-gguf.
//
// All the logic lives in llama-oscar.cpp (and llama-oscar-window.cpp, llama-oscar-window-graph.cpp
// for the high-precision window); the patches in llama.cpp/patches add only the calls below and
// the fields they need.
// Where upstream calls us (file: function -> entry point), by patch:
//
//   llama: the oscar2 KV cache
//     llama.h             declares llama_oscar_patchset_version, llama_oscar_context_params_echo
//                         (defined in llama-oscar.cpp) and the oscar_* context parameters
//     llama-context.cpp   llama_init_from_model   -> llama_oscar_resolve_cache_types
//                         llama_context()         -> llama_oscar_copy_cparams, llama_oscar_configure_memory
//     llama-model.cpp     load_hparams            -> llama_oscar_load_hparams
//     llama-kv-cache.cpp  cpy_k, cpy_v, build_rope_shift -> llama_oscar_with_clip, llama_oscar_layer_clip
//     llama-kv-cache.h    llama_kv_cache: member oscar, friend llama_oscar_kv_access (llama-oscar-kv.h)
//   llama: calibrated KV rotations
//     llama-model.cpp     load_tensors            -> llama_oscar_arch_takes_rotations,
//                                                    llama_oscar_validate_rotations
//     llama-graph.cpp     build_attn (kv, iswa)   -> llama_oscar_rotate_k, _q, _v, llama_oscar_unrotate_out
//     llama-kv-cache.cpp  build_rope_shift        -> llama_oscar_k_rot, llama_oscar_rotate
//                         build_graph_shift       -> llama_oscar_k_rot (a rotated cache shifts whole heads)
//   llama: high-precision window (llama_oscar_window_*)
//     llama-kv-cache.cpp  clear, seq_rm, update, set_input_kq_mask, build_graph_shift, state_write,
//                         state_read_sinfo, llama_kv_cache_context::apply
//                                                 -> _clear, _can_truncate, _copy_stream, _mask_cols and
//                                                    _fill_mask, _build_shift, _state_write, _state_read, _apply
//     llama-kv-cache-iswa.cpp, llama-memory-hybrid.cpp, llama-memory-hybrid-iswa.cpp
//                         seq_rm                  -> _can_truncate (asked before anything is removed)
//     llama-graph.cpp     build_attn_inp_kq_mask, can_reuse_kq_mask -> _n_hp (the mask's window columns)
//                         set_input, can_reuse of the attention inputs -> _set_inputs, _can_reuse
//                         build_attn_inp_kv_impl, build_attn_inp_kv_iswa, build_inp_mem_hybrid_iswa
//                                                 -> _build_inputs
//                         build_attn (kv, iswa)   -> _store, _views; build_attn_mha -> _attach
//   llama: the precision plan (oscar.f16_k_layers)
//     llama-kv-cache.cpp  llama_kv_cache()        -> llama_oscar_layer_type_k
//   llama: query rows per sequence of flash attention
//     llama-graph.cpp     build_attn_mha          -> llama_oscar_fa_seq_tokens
//   tools: common/arg.cpp, common/common.cpp, llama-bench.cpp -> oscar-args.h
// (The ggml patches' hooks are mapped in ../oscar2-ops.h, ../oscar2-cpu.h and ../cuda/oscar2-cuda.cuh.)
//
// Names shared with the Python side (oscar_gguf/format/gguf_keys.py):
//   tensors  blk.{i}.attn_k_rot, blk.{i}.attn_v_rot   f32 [d, d], row-major R, x_rot = x @ R
//   keys     oscar.format_version, oscar.group_size, oscar.clip_k, oscar.clip_v, oscar.f16_k_layers,
//            oscar.window.sink, oscar.window.recent, oscar.rope_layout
#pragma once

#include "llama.h"
#include "ggml.h"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

struct gguf_context;
struct ggml_cgraph;
struct llama_ubatch;
struct llm_graph_result;
class  llama_io_write_i;
class  llama_io_read_i;
struct llama_model;
struct llama_hparams;
struct llama_cparams;
struct llama_layer;
class  llama_kv_cache;
class  llama_kv_cache_context;
struct llama_memory_i;

// ---- model load -----------------------------------------------------------------------------

// Read the oscar.* metadata into hparams (clip ratios per layer, window defaults). Throws
// std::runtime_error with a clear message on malformed metadata.
void llama_oscar_load_hparams(const gguf_context * meta, llama_hparams & hparams);
// llama_kv_cache: the type of model layer il's K cache for the requested type: f16 where the
// GGUF's precision plan (oscar.f16_k_layers) keeps that layer's keys out of INT2, else type_k.
// Rotations, clips and the window then follow the layer's own type (layer_quantized).
ggml_type llama_oscar_layer_type_k(const llama_hparams & hparams, uint32_t il, ggml_type type_k);

// Whether this architecture builds its attention through the generic KV-cache path that
// applies per-layer rotations (MLA and custom-attention models do not).
bool llama_oscar_arch_takes_rotations(const llama_model & model);

// After the tensor data is loaded: check that every rotation is finite and orthogonal.
// Throws std::runtime_error naming the first bad tensor.
void llama_oscar_validate_rotations(const llama_model & model);

// ---- context creation ----------------------------------------------------------------------

// oscar2 in --cache-type-k/v: check flash attention (turn it on when it is "auto", refuse
// when it is off) and pick the group size per model: oscar2 (G=128) when every layer's head
// size is a multiple of 128, oscar2_64 when they are multiples of 64. Also validates the
// oscar_* context parameters. Logs one line and returns false on anything we cannot serve.
bool llama_oscar_resolve_cache_types(const llama_model & model, llama_context_params & params);

// Copy the oscar_* fields of the public parameters into the internal ones.
void llama_oscar_copy_cparams(const llama_context_params & params, llama_cparams & cparams);

// Attach the oscar settings (clip ratios, rotation source, window) to every KV cache of the
// memory module. Throws std::runtime_error (e.g. --oscar-strict without rotations).
void llama_oscar_configure_memory(llama_memory_i * memory, const llama_model & model, const llama_cparams & cparams);

// ---- cache writes ------------------------------------------------------------------------

// Clip ratio for writes of model layer il into an oscar2 K (v = false) or V (v = true) cache.
float llama_oscar_layer_clip(const llama_kv_cache & kv, int32_t il, bool v);

// node, a set_rows / cpy into the cache, with its clip ratio when it writes into an oscar2
// tensor (ggml_oscar2_set_clip); other types pass through unchanged
ggml_tensor * llama_oscar_with_clip(ggml_tensor * node, float clip);

// ---- rotations in the graph ------------------------------------------------------------------

// The rotation that maps a layer's keys (or values) into the cache's basis: the layer's own
// calibrated R from the GGUF, or upstream's Hadamard (its own inverse), or none.
struct llama_oscar_rot {
    ggml_tensor * r   = nullptr; // per-layer R, row-major as stored in the GGUF
    ggml_tensor * rt  = nullptr; // R^T made once per context (llama_oscar_kv::rot_t_*), or null
    ggml_tensor * had = nullptr; // upstream Hadamard graph input
    explicit operator bool() const { return r != nullptr || had != nullptr; }
};

llama_oscar_rot llama_oscar_k_rot(const llama_kv_cache & kv, int32_t il, ggml_tensor * had);
llama_oscar_rot llama_oscar_v_rot(const llama_kv_cache & kv, int32_t il, ggml_tensor * had);

// x @ R (inverse = false) or x @ R^T (inverse = true) on the last dimension of x
// (x: [d, ...]). A plain matmul: the Hadamard hint must not be set for a calibrated R.
ggml_tensor * llama_oscar_rotate(ggml_context * ctx, ggml_tensor * x, const llama_oscar_rot & rot, bool inverse);

// build_attn helpers: rotate k, q and v, in this order, into the cache basis of layer il, and
// the attention output back. mctx is the layer's KV cache context; had_k/had_v are upstream's
// Hadamard inputs. q's and v's rotations go into the graph right after k's (v's projection
// before k's, as upstream): the CUDA backend then does all three in the launch that rotates k
// and writes the caches (ggml-oscar/cuda, find_job).
ggml_tensor * llama_oscar_rotate_k(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_k, ggml_tensor * k);
ggml_tensor * llama_oscar_rotate_q(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_k, ggml_tensor * q);
ggml_tensor * llama_oscar_rotate_v(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_v, ggml_tensor * v);
ggml_tensor * llama_oscar_unrotate_out(ggml_context * ctx, const llama_kv_cache_context * mctx, int32_t il,
        ggml_tensor * had_v, ggml_tensor * cur);

// build_attn_mha: the flash-attention node's query rows per sequence of the batch
// (ggml_flash_attn_ext_set_seq_tokens; the CUDA backend picks its kernels by it)
void llama_oscar_fa_seq_tokens(ggml_tensor * fa, const llama_ubatch & ubatch);

// ---- per-cache state ---------------------------------------------------------------------

struct llama_oscar_kv; // owned by llama_kv_cache (shared_ptr member "oscar")

// ---- high-precision window (llama-oscar-window*.cpp; design in llama-oscar-window.h) --------

struct llama_oscar_window_inputs; // per graph: where each token of the ubatch goes in the window

// the window rows one attention node reads (none: both null)
struct llama_oscar_fa_window {
    ggml_tensor * k = nullptr;
    ggml_tensor * v = nullptr;
};

// llama_kv_cache_iswa: the type of its sliding-window cache for a requested type. That cache holds
// n_swa + n_ubatch cells per sequence, and the window (sink + recent + one ubatch) would cover most
// of them, so INT2 would save little memory and cost quality: next to oscar2 it stays f16. A
// full-size one (swa_full) grows with the context like the base cache and keeps the requested type.
ggml_type llama_oscar_swa_cache_type(ggml_type type, bool swa_full);

// llama_kv_cache_context::apply(): assign window slots for the ubatch just applied
void llama_oscar_window_apply(llama_kv_cache & kv, const llama_kv_cache_context & mctx);
// llama_kv_cache::clear()
void llama_oscar_window_clear(llama_kv_cache & kv);
// window rows attention reads for the current ubatch (0: no window); the mask has as many
// extra columns
uint32_t llama_oscar_window_n_hp(const llama_kv_cache_context * mctx);

// graph inputs of the window (null when the cache has none)
std::shared_ptr<llama_oscar_window_inputs> llama_oscar_window_build_inputs(ggml_context * ctx,
        const llama_kv_cache_context * mctx, const llama_ubatch & ubatch);
void llama_oscar_window_set_inputs(llama_oscar_window_inputs * inp, const llama_kv_cache_context * mctx, const llama_ubatch * ubatch);
bool llama_oscar_window_can_reuse(const llama_oscar_window_inputs * inp, const llama_ubatch & ubatch);

// build_attn: write k_cur/v_cur (already rotated) into the window, and the views attention reads
void llama_oscar_window_store(ggml_context * ctx, ggml_cgraph * gf, const llama_kv_cache_context * mctx,
        const llama_oscar_window_inputs * inp, ggml_tensor * k_cur, ggml_tensor * v_cur, int32_t il);
llama_oscar_fa_window llama_oscar_window_views(ggml_context * ctx, ggml_cgraph * gf, const llama_kv_cache_context * mctx, int32_t il);
// build_attn_mha: give the flash-attention node its window rows
void llama_oscar_window_attach(ggml_tensor * fa, const llama_oscar_fa_window & w);

// llama_kv_cache::set_input_kq_mask: the number of window columns of dst; then, once llama.cpp
// has written the cache's mask into the first n_kv columns of each row, the window's columns
int64_t llama_oscar_window_mask_cols(const llama_kv_cache & kv, const ggml_tensor * dst);
void    llama_oscar_window_fill_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch, int64_t n_kv);

// llama_kv_cache::build_graph_shift: shift the window's keys with their cells
void llama_oscar_window_build_shift(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res, const llama_kv_cache & kv,
        const llama_cparams & cparams, ggml_tensor * k_rot);
// llama_kv_cache::seq_rm: whether removing [p0, p1) of seq_id (-1: every sequence) leaves a
// sequence that can continue exactly. A truncation that cuts a sequence's tail moves its next
// query back to p0, whose window must still have every row in the f16 store; if one is gone
// the removal is refused (nothing is removed) and the caller starts the sequence over.
// Removals inside a sequence (context shift) are not judged: the shift that follows them
// changes the positions anyway.
bool llama_oscar_window_can_truncate(const llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
// llama_kv_cache::update(): a whole-stream copy takes the window along
void llama_oscar_window_copy_stream(llama_kv_cache & kv, uint32_t ssrc, uint32_t sdst);
// state save/load: the window rows of the given cells (in save order), after their cache data
void llama_oscar_window_state_write(const llama_kv_cache & kv, llama_io_write_i & io, uint32_t strm,
        const std::vector<std::pair<uint32_t, uint32_t>> & cell_ranges);
void llama_oscar_window_state_read(llama_kv_cache & kv, llama_io_read_i & io, uint32_t strm,
        const std::vector<uint32_t> & cells);
