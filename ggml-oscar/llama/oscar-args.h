// oscar-args.h: the --oscar-* command-line options, shared by common/arg.cpp (llama-cli,
// llama-server, llama-perplexity, ...) and llama-bench, so that every tool accepts and
// documents them the same way. Header-only: the tools include it through the patches.
#pragma once

#include "llama.h"

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

struct llama_oscar_args {
    int32_t   sink        = -1;            // < 0: the GGUF's default (64 when it has none)
    int32_t   recent      = -1;            // < 0: the GGUF's default (256 when it has none)
    ggml_type window_type = GGML_TYPE_F16;
    int32_t   rot         = 0;             // 0 gguf, 1 hadamard, 2 none
    float     clip_k      = 0.0f;          // <= 0: the GGUF's
    float     clip_v      = 0.0f;
    bool      strict      = false;

    void apply(llama_context_params & p) const {
        p.oscar_sink        = sink;
        p.oscar_recent      = recent;
        p.oscar_window_type = window_type;
        p.oscar_rot         = rot;
        p.oscar_clip_k      = clip_k;
        p.oscar_clip_v      = clip_v;
        p.oscar_strict      = strict;
    }
};

struct llama_oscar_option {
    const char * name;
    const char * value; // nullptr for a flag
    const char * help;
};

static const llama_oscar_option LLAMA_OSCAR_OPTIONS[] = {
    { "--oscar-sink",        "N",    "oscar2 KV cache: first N tokens of each sequence kept in high precision (default: from the GGUF, else 64; 0 = none)" },
    { "--oscar-recent",      "N",    "oscar2 KV cache: last N tokens of each sequence kept in high precision (default: from the GGUF, else 256; 0 = none)" },
    { "--oscar-window-type", "TYPE", "oscar2 KV cache: type of the high-precision window, f16 or bf16 (default: f16)" },
    { "--oscar-rot",         "MODE", "oscar2 KV cache: rotation source: gguf (calibrated, default), hadamard (built-in), none" },
    { "--oscar-clip-k",      "F",    "oscar2 KV cache: clip ratio in (0, 1] for the K of every layer (default: from the GGUF, else 0.96; 1 = no clipping)" },
    { "--oscar-clip-v",      "F",    "oscar2 KV cache: clip ratio in (0, 1] for the V of every layer (default: from the GGUF, else 0.92; 1 = no clipping)" },
    { "--oscar-strict",      nullptr, "oscar2 KV cache: refuse a GGUF without OSCAR rotations instead of falling back to the Hadamard" },
};

static inline int32_t llama_oscar_parse_window(const char * name, const std::string & v) {
    char * end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || n < 0 || n > (1L << 24)) {
        throw std::invalid_argument(std::string(name) + " must be a token count between 0 and 16777216, got '" + v + "'");
    }
    return (int32_t) n;
}

static inline float llama_oscar_parse_clip(const char * name, const std::string & v) {
    char * end = nullptr;
    const float c = std::strtof(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || !std::isfinite(c) || c <= 0.0f || c > 1.0f) {
        throw std::invalid_argument(std::string(name) + " must be a clip ratio in (0, 1], got '" + v + "'");
    }
    return c;
}

// Set one option (name as in LLAMA_OSCAR_OPTIONS; value ignored for flags). Throws
// std::invalid_argument with a one-line message on a bad value.
static inline void llama_oscar_set_option(llama_oscar_args & a, const std::string & name, const std::string & v) {
    if (name == "--oscar-sink") {
        a.sink = llama_oscar_parse_window("--oscar-sink", v);
    } else if (name == "--oscar-recent") {
        a.recent = llama_oscar_parse_window("--oscar-recent", v);
    } else if (name == "--oscar-window-type") {
        if (v == "f16") {
            a.window_type = GGML_TYPE_F16;
        } else if (v == "bf16") {
            a.window_type = GGML_TYPE_BF16;
        } else {
            throw std::invalid_argument("--oscar-window-type must be f16 or bf16, got '" + v + "'");
        }
    } else if (name == "--oscar-rot") {
        if (v == "gguf") {
            a.rot = 0;
        } else if (v == "hadamard") {
            a.rot = 1;
        } else if (v == "none") {
            a.rot = 2;
        } else {
            throw std::invalid_argument("--oscar-rot must be gguf, hadamard or none, got '" + v + "'");
        }
    } else if (name == "--oscar-clip-k") {
        a.clip_k = llama_oscar_parse_clip("--oscar-clip-k", v);
    } else if (name == "--oscar-clip-v") {
        a.clip_v = llama_oscar_parse_clip("--oscar-clip-v", v);
    } else if (name == "--oscar-strict") {
        a.strict = true;
    } else {
        throw std::invalid_argument("unknown oscar option " + name);
    }
}

// For tools with their own argv loop (llama-bench): consume argv[i] (and its value) if it is
// one of ours. Returns false if argv[i] is not an oscar option.
static inline bool llama_oscar_parse_argv(llama_oscar_args & a, int argc, char ** argv, int & i) {
    const std::string arg = argv[i];
    for (const auto & opt : LLAMA_OSCAR_OPTIONS) {
        if (arg != opt.name) {
            continue;
        }
        if (opt.value == nullptr) {
            llama_oscar_set_option(a, arg, "");
        } else {
            if (i + 1 >= argc) {
                throw std::invalid_argument(arg + " needs a value (" + opt.value + ")");
            }
            llama_oscar_set_option(a, arg, argv[++i]);
        }
        return true;
    }
    return false;
}
