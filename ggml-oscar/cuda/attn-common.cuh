// attn-common.cuh: what the decode attention's kernels share (attn-vec.cu, attn-mma.cu,
// attn-combine.cu) and the planner that launches them (attn-decode.cu).
//
// The decode attention is split-KV: blocks take rows [r0, r1) of one source, the oscar2 cache or
// the high-precision window, and write one partial online-softmax state (max, sum, acc) per
// query; k_fa_combine merges the partials of all splits of all sources by their log-sum-exp,
// which is the same softmax as one pass. Reference: the CPU flash attention (upstream's
// ggml-cpu/ops.cpp: online softmax over the cache rows, then the window rows, which it reads
// through oscar2_cpu_window_kq/_v in ../oscar2-cpu.c). Checked against it by test-backend-ops
// FLASH_ATTN_EXT and OSCAR_ROTATE_STORE (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh
// test`) and by tests/test_oscar2_ops.py on CUDA0.
#pragma once

#include "oscar2-common.cuh"
#include "attn-plan.h" // OSCAR_FA_WARPS, the blocks per SM, the queries per block: the plan's numbers

// one source of rows: the cache or the window (K, V with byte strides, and its mask columns)
struct fa_source {
    const char * K; int64_t nbk1, nbk2, nbk3;
    const char * V; int64_t nbv1, nbv2, nbv3;
    const half * mask;   // first mask column of this source
    int n_rows;
    // or null: the OSCAR_LIVE_ROWS-row chunks that some query of a group of blocks sees, in
    // order (attn-live.cu); list (mask stream s, group z) starts at live + (s*n_groups + z)*live_stride
    // and holds live_count[s*n_groups + z] chunks. Only k_fa_int2_mma reads it.
    const int * live; const int * live_count; int live_stride;
};

struct fa_params {
    const char * Q; int64_t nbq1, nbq2, nbq3;
    int64_t mask_nb1, mask_nb3; int mask_ne3; // in half elements
    int n_q, n_head, n_head_kv, gqa, ne3;
    float scale, softcap;
    float * part_acc; float2 * part_ml;
    int n_part;   // splits over all sources
    int part0;    // first split of this launch
};

// the output's un-rotation, fused into the combine: y = U o per query, U the D x D matrix of the
// the rotation node after the attention that undoes V's rotation (llama_oscar_unrotate_out; fusion-plan.cu)
struct fa_unrot {
    const float * U = nullptr; // null: no un-rotation
    float *       y = nullptr; // [D, queries], as the attention output
};

// which (K, V) types k_fa_int2 takes (attn-vec.cu), and with how many queries per block (more,
// or other types: k_fa_partial)
static constexpr __host__ __device__ bool int2_types(ggml_type kt, ggml_type vt) {
    return kt == vt && (kt == GGML_TYPE_OSCAR2 || kt == GGML_TYPE_OSCAR2_64);
}
static constexpr __host__ __device__ bool uses_int2_kernel(ggml_type kt, ggml_type vt, int nq) {
    return int2_types(kt, vt) && nq <= OSCAR_INT2_MAX_QUERIES;
}

// which (K, V, head dim, window type) k_fa_int2_mma takes (attn-mma.cu), and with how many
// queries per block
static constexpr __host__ __device__ bool int2_mma_types(ggml_type kt, ggml_type vt, int D, ggml_type wt) {
    return int2_types(kt, vt) && (D == 64 || D == 128) && D % group_of(kt) == 0 &&
           (wt == GGML_TYPE_COUNT || wt == GGML_TYPE_F16);
}
static constexpr __host__ __device__ bool uses_int2_mma(ggml_type kt, ggml_type vt, int D, int nqb, ggml_type wt) {
    return int2_mma_types(kt, vt, D, wt) && nqb <= OSCAR_MMA_MAX_QUERIES;
}

// a flash attention we compute: oscar2 K or V, or window rows (ggml_flash_attn_ext_add_window)
static bool fa_is_ours(const ggml_tensor * op) {
    return op->op == GGML_OP_FLASH_ATTN_EXT &&
        (oscar2_is_type(op->src[1]->type) || oscar2_is_type(op->src[2]->type) || ggml_flash_attn_ext_window_rows(op) > 0);
}

// the row of p.part_acc and p.part_ml that holds head `head` of token `tok` in stream s3
static __device__ __forceinline__ int64_t fa_query_row(const fa_params & p, const int s3, const int tok, const int head) {
    return ((int64_t) s3*p.n_q + tok)*p.n_head + head;
}

// The block's partial: merge the NP online-softmax states (max, sum, acc) its warps (or teams)
// left in shared memory, one per query, and write it as partial number `part` of each query.
template <int D, int NQ, int NP>
static __device__ __forceinline__ void store_block_partial(const float (&sh_ml)[NP][NQ][2], const float (&sh_acc)[NP][NQ][D],
        const fa_params & p, const int nq, const int tok0, const int hkv, const int s3, const int part) {
    const int tid = threadIdx.y*WARP_SIZE + threadIdx.x;
    for (int jd = tid; jd < nq*D; jd += OSCAR_FA_WARPS*WARP_SIZE) {
        const int j = jd / D;
        const int d = jd % D;
        float Mx = -INFINITY;
#pragma unroll
        for (int pp = 0; pp < NP; ++pp) {
            Mx = fmaxf(Mx, sh_ml[pp][j][0]);
        }
        float a = 0.0f, l = 0.0f;
        if (Mx != -INFINITY) {
#pragma unroll
            for (int pp = 0; pp < NP; ++pp) {
                const float f = expf(sh_ml[pp][j][0] - Mx);
                a += f*sh_acc[pp][j][d];
                l += f*sh_ml[pp][j][1];
            }
        }
        const int64_t qi = fa_query_row(p, s3, tok0 + j / p.gqa, hkv*p.gqa + j % p.gqa);
        p.part_acc[(qi*p.n_part + part)*D + d] = a;
        if (d == 0) {
            p.part_ml[qi*p.n_part + part] = make_float2(Mx, l);
        }
    }
}

// A partial of no rows: (max, sum) = (-inf, 0) for the block's nq queries, which the combine
// weighs 0 without reading its vector.
static __device__ __forceinline__ void store_empty_partial(const fa_params & p, const int nq, const int tok0, const int hkv,
        const int s3, const int part) {
    for (int j = threadIdx.y*WARP_SIZE + threadIdx.x; j < nq; j += OSCAR_FA_WARPS*WARP_SIZE) {
        p.part_ml[fa_query_row(p, s3, tok0 + j / p.gqa, hkv*p.gqa + j % p.gqa)*p.n_part + part] = make_float2(-INFINITY, 0.0f);
    }
}

// ---- the launches (host) ---------------------------------------------------------------------

// attn-vec.cu: partials [p.part0, p.part0 + n_split) of src on the CUDA cores (k_fa_int2 for
// oscar2 K and V of one type and up to 4 queries a block, k_fa_partial for the rest). Grid
// (n_head_kv*ne3, n_split, n_groups). false: no kernel for these types.
bool oscar2_cuda_fa_partials(int D, ggml_type kt, ggml_type vt, const fa_source & src, const fa_params & p, int nqb,
        int n_split, int rows_per_split, int n_groups, cudaStream_t stream);

// attn-mma.cu: the cache's ns_main partials on tensor cores, with the window's ns_win chunks of
// type wt (GGML_TYPE_COUNT: none) in the same launch (k_fa_int2_mma; the grid is in its header)
void oscar2_cuda_fa_int2_mma(ggml_type t, ggml_type wt, int D, int nqb, const fa_source & src, const fa_source & win,
        const fa_params & p, int ns_main, int rps_main, int ns_win, int rps_win, int rps_lite, int n_groups, cudaStream_t stream);

// attn-live.cu: src's live-chunk list (fa_source::live) for groups of tokens_per_group query
// tokens, from the mask; live: mask_ne3*n_groups*live_stride ints, count: mask_ne3*n_groups
void oscar2_cuda_fa_live_chunks(const fa_source & src, const fa_params & p, int tokens_per_group, int n_groups,
        int * live, int * count, int live_stride, cudaStream_t stream);

// attn-combine.cu: the partials of p merged into dst, and with un.U the output's un-rotation into un.y
void oscar2_cuda_fa_combine(int D, const fa_params & p, const float * sinks, float * dst, int64_t n_queries,
        const fa_unrot & un, cudaStream_t stream);
