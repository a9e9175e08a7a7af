// fusion-plan.cu: which nodes of a decode graph one launch may do together, decided node by node
// as upstream's graph loop reaches them (ggml_cuda_try_fuse calls ggml_cuda_oscar2_plan_fusion):
//   - at a rotation (a MUL_MAT hinted as one): the set_rows nodes after it that store its result (the
//     INT2 cache and the window), and the rotations built right after it, q's (same matrix, no
//     stores) and v's with its own stores: one k_rotate_store launch instead of seven
//     (rotate-store.cu);
//   - at an attention of ours: the un-rotation of its output, done by the combine
//     (attn-combine.cu); and which live-chunk lists kept by an attention before it in the pass
//     are still valid for it (no node between wrote their mask's bytes), so that it reads them
//     instead of making its own (attn-decode.cu).
// A node may move up to the launch only if no node in between reads or writes what it writes,
// or writes what it reads (checked by byte ranges). The fused launch happens when the first node
// is computed; the nodes it did are then skipped. The plan lives in the backend context
// (fusion-plan.cuh); upstream's concurrent streams reorder nodes, so their graphs get none.
//
// Reference: the same graph with every node computed alone, as the CPU does. test-backend-ops
// OSCAR_ROTATE_STORE builds a layer's nodes in three orders, the model's and two that fuse less
// (../tests/oscar2-backend-ops.inc), and checks every output against the CPU. For an A/B timing
// the fusion is turned off by gpu/ab/no-fusion.patch (gpu/run.sh ab).

#include "fusion-plan.cuh"
#include "attn-common.cuh" // fa_is_ours
#include "ops.cuh"
#include "oscar2-cuda.cuh"

#define OSCAR_FUSE_SCAN 32 // graph nodes after a rotation searched for its set_rows

// a rotation a fused launch may take: those read the matrix before they wait for the
// kernels before them (oscar2-common.cuh), so it must be a leaf of the graph (a model tensor, or
// a view of one), written before the graph runs
static bool rotation_fusable(const ggml_tensor * dst) {
    const ggml_tensor * A = dst->src[0];
    return oscar2_cuda_rotation_ok(dst) && (A->view_src ? A->view_src : A)->op == GGML_OP_NONE;
}

static bool is_noop(const ggml_tensor * t) {
    return ggml_is_empty(t) || t->op == GGML_OP_NONE || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_VIEW ||
        t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE;
}

static bool bytes_overlap(const ggml_tensor * a, const ggml_tensor * b) {
    if (!a || !b || !a->data || !b->data) {
        return false;
    }
    const char * a0 = (const char *) a->data, * b0 = (const char *) b->data;
    return a0 < b0 + ggml_nbytes(b) && b0 < a0 + ggml_nbytes(a);
}

// node mid writes t's bytes or reads them
static bool node_touches(const ggml_tensor * mid, const ggml_tensor * t) {
    if (bytes_overlap(mid, t)) {
        return true;
    }
    for (int s = 0; s < GGML_MAX_SRC; ++s) {
        if (bytes_overlap(mid->src[s], t)) {
            return true;
        }
    }
    return false;
}

// sr stores (a contiguous 2-D view of) the whole result of rotation rot, in a form the kernel writes
static bool fusable_store(const ggml_tensor * rot, const ggml_tensor * sr) {
    if (sr->op != GGML_OP_SET_ROWS || (sr->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
        return false;
    }
    const ggml_tensor * src = sr->src[0], * idx = sr->src[1];
    const ggml_tensor * root = src->view_src ? src->view_src : src;
    if (root != rot || src->data != rot->data || src->type != GGML_TYPE_F32 || !ggml_is_contiguous(src) ||
        src->ne[2] != 1 || src->ne[3] != 1 || src->ne[0]*src->ne[1] != ggml_nelements(rot)) {
        return false;
    }
    if ((idx->type != GGML_TYPE_I64 && idx->type != GGML_TYPE_I32) || idx->ne[0] != src->ne[1] ||
        idx->nb[0] != ggml_type_size(idx->type)) {
        return false;
    }
    const ggml_type t = sr->type;
    const bool type_ok = oscar2_is_type(t) || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_F32;
    return type_ok && sr->ne[0] == src->ne[0] && sr->ne[2] == 1 && sr->ne[3] == 1 && rows_contiguous(sr) &&
        src->ne[0] % fused_span(rot->src[0]->ne[0], t) == 0;
}

// node n is one of the plan's rotations or stores
static bool is_planned(const planned_launch & p, const ggml_tensor * n) {
    for (int j = 0; j < p.n_jobs; ++j) {
        const planned_rot & r = p.jobs[j];
        if (r.rot == n || std::find(r.stores, r.stores + r.n_stores, n) != r.stores + r.n_stores) {
            return true;
        }
    }
    return false;
}

// whether node t (a rotation or a set_rows after the launch node) may be done by the launch:
// no node between them, other than those the launch also does, reads or writes its output or
// writes its input
static bool may_move_up(const ggml_cgraph * cgraph, int i, const ggml_tensor * t, const planned_launch & p) {
    for (int k = i + 1; k < cgraph->n_nodes && cgraph->nodes[k] != t; ++k) {
        const ggml_tensor * mid = cgraph->nodes[k];
        if (is_noop(mid) || is_planned(p, mid)) {
            continue;
        }
        if (node_touches(mid, t) || (t->op == GGML_OP_MUL_MAT && bytes_overlap(mid, t->src[1]))) {
            return false;
        }
    }
    return true;
}

// whether out (and in, when given) share no bytes with what the planned jobs read or write:
// the jobs of a launch run side by side
static bool apart_from_jobs(const ggml_tensor * out, const ggml_tensor * in, const planned_launch & p) {
    for (int k = 0; k < p.n_jobs; ++k) {
        const planned_rot & r = p.jobs[k];
        if (bytes_overlap(out, r.rot) || bytes_overlap(out, r.rot->src[1]) || bytes_overlap(in, r.rot)) {
            return false;
        }
        for (int s = 0; s < r.n_stores; ++s) {
            if (bytes_overlap(out, r.stores[s]) || bytes_overlap(in, r.stores[s])) {
                return false;
            }
        }
    }
    return true;
}

// the set_rows after node r (within end) that store the whole result of job's rotation (a job
// of plan p, counted in it) and may be done by the launch at node i, into job's stores; widens
// span to what they need
static void find_stores(const ggml_cgraph * cgraph, int i, int r, int end, const planned_launch & p, planned_rot & job,
        int64_t & span) {
    job.n_stores = 0;
    for (int j = r + 1; j < end && job.n_stores < OSCAR_FUSED_STORES; ++j) {
        const ggml_tensor * sr = cgraph->nodes[j];
        if (is_noop(sr) || !fusable_store(job.rot, sr)) {
            continue;
        }
        // (the stores found so far are done by the launch too; the rows it writes are apart
        // from every job's operands and stores, its own rotation's included)
        if (may_move_up(cgraph, i, sr, p) && apart_from_jobs(sr, nullptr, p)) {
            job.stores[job.n_stores++] = sr;
            span = std::max(span, fused_span(job.rot->src[0]->ne[0], sr->type));
        }
    }
}

// A rotation after node i (within end) that the launch of node i can do too: T tokens of whole
// blocks of `span` values, of the same head size, sharing no bytes with what the launch already
// does, and free to move up to node i. same_matrix: by node i's matrix (q's rotation: no stores
// of its own), else by another (v's, with its stores). The graph builds both right after k's
// rotation (build_attn: llama_oscar_rotate_q, and v's rotation expanded after it), so that k's
// launch takes them: one launch a layer instead of three. (Were q's rotation built after k's
// cache writes, its result could share memory with k's, freed by then, and it could not move.)
static int find_job(const ggml_cgraph * cgraph, int i, int end, int64_t T, int64_t span, bool same_matrix, const planned_launch & p) {
    const ggml_tensor * rot = cgraph->nodes[i];
    for (int j = i + 1; j < end; ++j) {
        const ggml_tensor * sb = cgraph->nodes[j];
        if (sb->op != GGML_OP_MUL_MAT || (sb->flags & GGML_TENSOR_FLAG_COMPUTE) == 0 || !rotation_fusable(sb) ||
            (sb->src[0]->data == rot->src[0]->data) != same_matrix || !ggml_are_same_shape(sb->src[0], rot->src[0])) {
            continue;
        }
        if (is_planned(p, sb)) {
            continue;
        }
        if (T <= 0 || ggml_nelements(sb) % T != 0 || (ggml_nelements(sb)/T) % span != 0) {
            return -1;
        }
        return apart_from_jobs(sb, sb->src[1], p) && may_move_up(cgraph, i, sb, p) ? j : -1;
    }
    return -1;
}

// The output's un-rotation after attention node i (llama_oscar_unrotate_out: a rotation of
// the whole output, through views only), for the combine to do (k_fa_combine, UNROT): when the
// attention is ours, the device is sm_90 or newer (the archs it is tested on; the combine itself
// needs nothing newer than its other code) and no node in between is in the way. Only the
// decode attention takes it (attn-decode.cu); the f16 prefill path leaves it to its own node.
static void plan_unrot(ggml_cuda_oscar2_fusion & p, const ggml_cgraph * cgraph, int i, int end, int cc) {
    const ggml_tensor * fa = cgraph->nodes[i];
    p.fa = nullptr;
    p.unrot = nullptr;
    if (!fa_is_ours(fa) || !GGML_CUDA_CC_IS_NVIDIA(cc) || ggml_cuda_highest_compiled_arch(cc) < GGML_CUDA_CC_HOPPER ||
        fa->type != GGML_TYPE_F32 || !ggml_is_contiguous(fa)) {
        return;
    }
    const int64_t D = fa->ne[0];
    for (int j = i + 1; j < end; ++j) {
        const ggml_tensor * u = cgraph->nodes[j];
        if (u->op != GGML_OP_MUL_MAT || !rotation_fusable(u) || (u->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            continue;
        }
        if (u->src[1]->data != fa->data || ggml_nelements(u->src[1]) != ggml_nelements(fa) || u->src[0]->ne[0] != D ||
            bytes_overlap(u, fa)) {
            return;
        }
        for (int k = i + 1; k < j; ++k) {
            const ggml_tensor * mid = cgraph->nodes[k];
            if (!is_noop(mid) && (node_touches(mid, u) || bytes_overlap(mid, fa))) {
                return;
            }
        }
        p.fa = fa;
        p.unrot = u;
        return;
    }
}

// at rotation node i: the launch of it, its stores, and the rotations and stores that may join
static void plan_rotate_store(ggml_cuda_oscar2_fusion & p, const ggml_cgraph * cgraph, int i, int end) {
    const ggml_tensor * rot = cgraph->nodes[i];
    planned_launch plan; // built here, adopted only whole
    plan.n_jobs = 1;
    plan.jobs[0].rot = rot;
    int64_t span = rot->src[0]->ne[0];
    find_stores(cgraph, i, i, end, plan, plan.jobs[0], span);
    if (plan.jobs[0].n_stores == 0) {
        return;
    }
    const int64_t T = plan.jobs[0].stores[0]->src[0]->ne[1];
    // q's rotation (k's matrix), then v's with its stores, each if it fits this launch
    for (bool same : { true, false }) {
        const int j = find_job(cgraph, i, end, T, span, same, plan);
        if (j < 0) {
            continue;
        }
        planned_rot & r = plan.jobs[plan.n_jobs];
        r.rot = cgraph->nodes[j];
        plan.n_jobs++;
        int64_t span2 = span;
        if (!same) {
            find_stores(cgraph, i, j, end, plan, r, span2);
        }
        if (span2 != span || (r.n_stores > 0 && r.stores[0]->src[0]->ne[1] != T)) {
            plan.n_jobs--; // (its blocks would differ from the launch's)
            r = planned_rot();
        }
    }
    // every store's row must split into whole blocks of the common span
    for (int k = 0; k < plan.n_jobs; ++k) {
        for (int s = 0; s < plan.jobs[k].n_stores; ++s) {
            if (plan.jobs[k].stores[s]->ne[0] % span != 0) {
                return;
            }
        }
    }
    plan.span = span;
    p.launch = plan;
}

// ---- live-chunk lists kept through a pass --------------------------------------------------

int * live_arena::take(size_t n) {
    const size_t bytes = GGML_PAD(n*sizeof(int), 256);
    if (blocks.empty() || used + bytes > blocks.back().second) {
        const size_t size = std::max<size_t>(bytes, blocks.empty() ? (size_t) 1 << 20 : 2*blocks.back().second);
        char * ptr = nullptr;
        if (cudaMalloc((void **) &ptr, size) != cudaSuccess) {
            (void) cudaGetLastError();
            return nullptr;
        }
        blocks.emplace_back(ptr, size);
        used = 0;
    }
    int * out = (int *) (blocks.back().first + used);
    used += bytes;
    return out;
}

live_arena::~live_arena() {
    if (!blocks.empty()) {
        ggml_cuda_set_device(device);
        for (auto & b : blocks) {
            (void) cudaFree(b.first);
        }
    }
}

// at attention node i: the kept lists whose mask no node since their last check wrote stay
// valid up to i
static void check_kept_lists(ggml_cuda_oscar2_fusion & p, const ggml_cgraph * cgraph, int i) {
    int n = 0;
    for (int l = 0; l < p.n_lists; ++l) {
        kept_live_lists & k = p.lists[l];
        bool written = false;
        for (int j = k.checked_i + 1; j < i && !written; ++j) {
            const ggml_tensor * mid = cgraph->nodes[j];
            written = !is_noop(mid) && bytes_overlap(mid, k.mask);
        }
        if (!written) {
            k.checked_i = i;
            p.lists[n++] = k;
        }
    }
    p.n_lists = n;
}

// fa is the node last planned: the one being computed (no plan, or another node: its lists are
// not the plan's business)
static bool planned_last(const ggml_cuda_oscar2_fusion * plan, const ggml_tensor * fa) {
    return plan != nullptr && plan->graph != nullptr && plan->last_i >= 0 && plan->graph->nodes[plan->last_i] == fa;
}

const kept_live_lists * oscar2_fusion_find_lists(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * fa, const live_lists_key & key) {
    if (!planned_last(plan, fa)) {
        return nullptr;
    }
    for (int l = 0; l < plan->n_lists; ++l) {
        if (plan->lists[l].key == key && plan->lists[l].checked_i == plan->last_i) {
            return &plan->lists[l];
        }
    }
    return nullptr;
}

const kept_live_lists * oscar2_fusion_keep_lists(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * fa, const live_lists_key & key,
        int device) {
    if (!planned_last(plan, fa) || !plan->keep_lists || plan->n_lists == OSCAR_KEPT_LISTS) {
        return nullptr;
    }
    if (!plan->arena) {
        plan->arena = std::make_shared<live_arena>();
        plan->arena->device = device;
    }
    const size_t n_lists = (size_t) key.mask_ne3*key.n_groups;
    int * mem = plan->arena->take(n_lists*key.stride + n_lists);
    if (mem == nullptr) {
        return nullptr;
    }
    kept_live_lists & k = plan->lists[plan->n_lists++];
    k.key       = key;
    k.mask      = fa->src[3];
    k.checked_i = plan->last_i;
    k.live      = mem;
    k.count     = mem + n_lists*key.stride;
    return &k;
}

// ---- the plan, node by node -------------------------------------------------------------------

void ggml_cuda_oscar2_plan_fusion(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    if (!ctx.oscar2_fusion) {
        ctx.oscar2_fusion = std::make_shared<ggml_cuda_oscar2_fusion>();
    }
    ggml_cuda_oscar2_fusion & p = *ctx.oscar2_fusion;
    if (cgraph != p.graph || i <= p.last_i) {
        // a new pass over a graph: nothing of the last one carries over but the lists' memory
        std::shared_ptr<live_arena> arena = std::move(p.arena);
        p = ggml_cuda_oscar2_fusion();
        p.graph = cgraph;
        p.arena = std::move(arena);
        if (p.arena) {
            p.arena->used = 0;
        }
    }
    p.last_i = i;
    // upstream's concurrent streams reorder nodes; leave those graphs alone
    if (!ctx.stream_context().concurrent_events.empty()) {
        p.keep_lists = false;
        p.n_lists = 0;
        return;
    }
    p.keep_lists = true;
    const int end = std::min(cgraph->n_nodes, i + 1 + OSCAR_FUSE_SCAN);
    const ggml_tensor * node = cgraph->nodes[i];
    if (node->op == GGML_OP_FLASH_ATTN_EXT) {
        check_kept_lists(p, cgraph, i);
        plan_unrot(p, cgraph, i, end, ggml_cuda_info().devices[ctx.device].cc);
    } else if (node->op == GGML_OP_MUL_MAT && rotation_fusable(node)) {
        plan_rotate_store(p, cgraph, i, end);
    }
}

const ggml_tensor * oscar2_fusion_take_unrot(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * fa) {
    if (plan == nullptr) {
        return nullptr;
    }
    const ggml_tensor * u = plan->fa == fa ? plan->unrot : nullptr;
    if (u) {
        plan->done.push_back(u);
    }
    plan->fa = nullptr;
    plan->unrot = nullptr;
    return u;
}

bool oscar2_fusion_done(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * n) {
    if (plan == nullptr) {
        return false;
    }
    auto & done = plan->done;
    const auto it = std::find(done.begin(), done.end(), n);
    if (it == done.end()) {
        return false;
    }
    done.erase(it);
    return true;
}
