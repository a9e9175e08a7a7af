// llama-oscar.h: libllama-internal entry points of oscar-gguf.
//
// The patches in llama.cpp/patches call these from llama-context.cpp, llama-kv-cache.cpp,
// llama-graph.cpp and llama-model.cpp; the logic lives in llama-oscar.cpp.
#pragma once

#include "llama.h"
#include "ggml.h"

#include <cstdint>

struct llama_model;

// oscar2 in --cache-type-k/v: check flash attention (turn it on when it is "auto", refuse
// when it is off) and pick the group size per model: oscar2 (G=128) when every layer's head
// size is a multiple of 128, oscar2_64 when they are multiples of 64. Logs one line and
// returns false on anything we cannot serve.
bool llama_oscar_resolve_cache_types(const llama_model & model, llama_context_params & params);

// Clip ratio for writes of layer il into an oscar2 K (v = false) or V (v = true) cache.
float llama_oscar_layer_clip(const llama_model & model, int32_t il, bool v);

// Tag a set_rows / cpy node that writes into an oscar2 tensor with its clip ratio
// (op_params[0]; no backend reads set_rows or cpy params otherwise). Other types pass through.
ggml_tensor * llama_oscar_tag_clip(ggml_tensor * node, float clip);
