// fusion-plan.cuh: the plan by which one launch does the work of several nodes of a decode
// graph: a rotation with the cache writes of its result (rotate-store.cu), and an attention
// with the un-rotation of its output (attn-combine.cu); and the live-chunk lists that the
// attentions of a pass share (attn-decode.cu). Made in fusion-plan.cu.
//
// Where it lives: in the backend context that computes the graph (ggml_backend_cuda_context::
// oscar2_fusion, added by the ggml-cuda hooks patch), made node by node in upstream's fusion step
// (ggml_cuda_oscar2_plan_fusion, called from ggml_cuda_try_fuse) and used when the nodes are
// computed (ggml_cuda_oscar2_compute_forward, oscar2-cuda.cu), which receive that context. It
// holds one graph's plan: a new pass over a graph starts it afresh (but for the memory of the
// kept lists), and nothing is planned across graphs. No plan (upstream's fusion turned off:
// GGML_CUDA_DISABLE_FUSION=1): every node is computed by itself.
#pragma once

#include "oscar2-common.cuh"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#define OSCAR_FUSED_STORES 2  // the INT2 cache and the window
#define OSCAR_FUSED_JOBS   3  // k with its stores, q (k's matrix, no stores), v with its stores

// a rotation of a fused launch, and the set_rows nodes storing its result that the launch does too
struct planned_rot {
    const ggml_tensor * rot = nullptr;
    const ggml_tensor * stores[OSCAR_FUSED_STORES] = {};
    int n_stores = 0;
};

// the rotations one launch does, each with the set_rows nodes it does (jobs[0] is the node that
// launches, the others move up to it)
struct planned_launch {
    planned_rot jobs[OSCAR_FUSED_JOBS];
    int n_jobs = 0;
    int64_t span = 0; // values per block of k_rotate_store (fused_span of every store)
};

// ---- live-chunk lists kept through a pass ---------------------------------------------------
// Every layer of a decode step over many sequences reads the same mask, and the lists of the cache
// and window chunks each group of query tokens sees (attn-live.cu: two launches that read the
// whole mask, for the cache's columns and for the window's) are
// the same for every layer. The first decode attention of a pass makes them into memory the plan
// keeps; a later one with the same mask and groups reads them, unless a node between them wrote
// the mask's bytes (checked node by node as the plan reaches each attention).

#define OSCAR_KEPT_LISTS 4 // lists kept per pass: the cache's and the window's of a mask; an iSWA model reads two masks

// what a pass's lists depend on besides the mask's bytes
struct live_lists_key {
    const void * mask = nullptr;
    int64_t nb1 = 0, nb3 = 0;
    int mask_ne3 = 0, n_rows = 0, n_q = 0, tokens_per_group = 0, n_groups = 0, stride = 0;

    bool operator==(const live_lists_key & o) const {
        return mask == o.mask && nb1 == o.nb1 && nb3 == o.nb3 && mask_ne3 == o.mask_ne3 && n_rows == o.n_rows &&
            n_q == o.n_q && tokens_per_group == o.tokens_per_group && n_groups == o.n_groups && stride == o.stride;
    }
};

struct kept_live_lists {
    live_lists_key key;
    const ggml_tensor * mask = nullptr; // the mask read (its bytes: what a node between may write)
    int checked_i = -1;                 // no node up to this one has written the mask since the lists were made
    int * live  = nullptr;              // mask_ne3*n_groups lists of stride ints, and their counts
    int * count = nullptr;
};

// device memory of the kept lists. It grows and frees nothing before the context ends: a CUDA
// graph captured with a block may be replayed after the lists have moved to a larger one.
struct live_arena {
    int device = -1;
    std::vector<std::pair<char *, size_t>> blocks; // the last one is in use
    size_t used = 0;                               // bytes of it taken in this pass

    // n ints of the current block (a new block when they do not fit)
    int * take(size_t n);
    ~live_arena();
};

struct ggml_cuda_oscar2_fusion {
    const ggml_cgraph * graph = nullptr; // the graph planned, and its last node planned
    int last_i = -1;
    planned_launch launch;               // the next rotate-store launch (n_jobs = 0: none)
    const ggml_tensor * fa    = nullptr; // an attention node whose combine also does
    const ggml_tensor * unrot = nullptr; // the un-rotation of its output
    std::vector<const ggml_tensor *> done; // set_rows and rotations done by a fused launch, not yet reached
    bool keep_lists = false;             // the pass may keep live-chunk lists (one stream: nodes in order)
    kept_live_lists lists[OSCAR_KEPT_LISTS];
    int n_lists = 0;
    std::shared_ptr<live_arena> arena;   // (outlives the pass)
};

// values per block of k_rotate_store for head size d and destination type t
static int64_t fused_span(int64_t d, ggml_type t) {
    return oscar2_is_type(t) ? std::max<int64_t>(d, group_of(t)) : d;
}

// fusion-plan.cu: node n (a set_rows or a rotation) was done by a fused launch before it; it is
// taken off the plan (plan may be null: no plan)
bool oscar2_fusion_done(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * n);

// fusion-plan.cu: the un-rotation node planned for attention node fa (null: none), which the
// caller's combine then does: it is marked done
const ggml_tensor * oscar2_fusion_take_unrot(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * fa);

// fusion-plan.cu: the live-chunk lists that decode attention fa, the node being computed, reads
// from its mask with key, kept by an attention before it in this pass (null: none; plan may be null)
const kept_live_lists * oscar2_fusion_find_lists(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * fa, const live_lists_key & key);
// fusion-plan.cu: memory for fa's lists (key) that the pass keeps for the attentions after it,
// which fa then fills (null: not kept; the caller makes them for fa alone)
const kept_live_lists * oscar2_fusion_keep_lists(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * fa, const live_lists_key & key,
        int device);

// rotate-store.cu: the planned rotations with their stores, in one launch, when rot is the node
// that launches them (false: it is not, or there is no plan)
bool oscar2_cuda_rotate_store(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * rot, cudaStream_t stream);
