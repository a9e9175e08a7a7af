// fusion-plan.cuh: the plan by which one launch does the work of several nodes of a decode
// graph: a rotation with the cache writes of its result (rotate-store.cu), and an attention
// with the un-rotation of its output (attn-combine.cu). Made in fusion-plan.cu.
//
// Where it lives: in the backend context that computes the graph (ggml_backend_cuda_context::
// oscar2_fusion, added by the ggml-cuda hooks patch), made node by node in upstream's fusion step
// (ggml_cuda_oscar2_plan_fusion, called from ggml_cuda_try_fuse) and used when the nodes are
// computed (ggml_cuda_oscar2_compute_forward, oscar2-cuda.cu), which receive that context. It
// holds one graph's plan: a new pass over a graph starts it afresh, and nothing is planned
// across graphs. No plan (upstream's fusion turned off: GGML_CUDA_DISABLE_FUSION=1): every node
// is computed by itself.
#pragma once

#include "oscar2-common.cuh"

#include <algorithm>
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

struct ggml_cuda_oscar2_fusion {
    const ggml_cgraph * graph = nullptr; // the graph planned, and its last node planned
    int last_i = -1;
    planned_launch launch;               // the next rotate-store launch (n_jobs = 0: none)
    const ggml_tensor * fa    = nullptr; // an attention node whose combine also does
    const ggml_tensor * unrot = nullptr; // the un-rotation of its output
    std::vector<const ggml_tensor *> done; // set_rows and rotations done by a fused launch, not yet reached
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

// rotate-store.cu: the planned rotations with their stores, in one launch, when rot is the node
// that launches them (false: it is not, or there is no plan)
bool oscar2_cuda_rotate_store(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * rot, cudaStream_t stream);
