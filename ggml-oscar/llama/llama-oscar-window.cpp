// llama-oscar-window.cpp: the high-precision sink + recent window of the KV cache.
// (placeholder until the window lands; see issue 6)

#include "llama-oscar-kv.h"

#include "llama-cparams.h"

void llama_oscar_window_configure(llama_kv_cache & kv, const llama_model & model, const llama_cparams & cparams) {
    (void) kv; (void) model; (void) cparams;
}
