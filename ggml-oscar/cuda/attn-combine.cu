// attn-combine.cu: the decode attention's last step: the partials of all splits of all sources
// (cache and window) merged into the output by their log-sum-exp, with the sinks; and, when the
// fusion plan gave it one (fusion-plan.cu), the un-rotation of the output that follows in the
// graph (llama_oscar_unrotate_out), so that it costs no launch of its own.
//
// out[q][d] = sum_s e^(M_s - M) acc_s[d] / (sum_s e^(M_s - M) L_s [+ e^(sink - M)])
//
// Reference: the CPU flash attention (attn-common.cuh) and ggml's mul_mat for the un-rotation;
// checked by test-backend-ops FLASH_ATTN_EXT (with sinks) and OSCAR_ROTATE_STORE (the attention
// output and its un-rotation; ../tests/oscar2-backend-ops.inc, `bash gpu/run.sh test`).
//
// Grid (queries, D/32): a block takes 32 head dims of one query. It finds M and the weights once,
// in parallel over the partials (shared memory), and spreads the accumulation over slices of
// the partials, so each thread has a few independent loads in flight. Why: a long cache has
// about a hundred partials a query (the cache's splits plus the window's); one block of D
// threads per query, each walking all partials in loops of dependent loads, took longer than
// the attention itself, and one block per query leaves most SMs idle at decode (a few dozen
// queries).

#include "attn-common.cuh"

#include <type_traits>

#define OSCAR_COMBINE_THREADS 256
#define OSCAR_COMBINE_DIMS 32 // head dims per block

// Grid (queries, D/OSCAR_COMBINE_DIMS): block y forms dims 32y..32y+31 of query blockIdx.x.
// UNROT: block y sums all D dims of o (each of the query's D/32 blocks the same), and forms rows
// 32y..32y+31 of U o and dims 32y..32y+31 of o. Why all of o in every block: with 32 dims per
// block, the D/32 blocks of a query would need to exchange their dims, as a thread-block cluster
// through distributed shared memory, and the cluster barriers (each arrival a MEMBAR.ALL.GPU)
// make every block wait for the slowest of its cluster. Each block instead reads D/32 times the
// partials (from L2: the attention has just written them), in float4, as many loads a thread as
// without the un-rotation. Why fused at all: as a launch of its own (k_rotate_cols) the
// un-rotation is mostly fixed cost, a few microseconds a layer at decode; one block per query,
// to have all of o in one place, would make the combine 4 times fewer blocks and slower at
// depth.
template <int D, bool UNROT>
__launch_bounds__(OSCAR_COMBINE_THREADS)
static __global__ void k_fa_combine(const float * part_acc, const float2 * part_ml,
        const float * __restrict__ sinks, float * __restrict__ dst, const int n_part, const int n_head, const fa_unrot un) {
    constexpr int NT = OSCAR_COMBINE_THREADS;
    constexpr int NW = NT/WARP_SIZE;
    constexpr int TD = OSCAR_COMBINE_DIMS;   // the block's dims (of o, and with UNROT rows of U)
    constexpr int VW = UNROT ? 4 : 1;        // dims a thread sums: a float4 of all D, or one of the block's
    constexpr int CD = UNROT ? D/4 : TD;     // threads along the dims
    constexpr int PS = NT/CD;                // slices of the partials
    static_assert(D % TD == 0 && NT % CD == 0, "head dims per block");
    typedef typename std::conditional<UNROT, float4, float>::type vec_t;
    extern __shared__ float sh_w[];       // [n_part]: e^(M_s - M), 0 for an empty partial
    __shared__ float sh_red[NW];
    __shared__ vec_t sh_acc[PS][CD];
    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int64_t qi = blockIdx.x;
    const float2 * ml = part_ml + qi*n_part;
    ggml_cuda_pdl_lc(); // the kernel after us may be scheduled (it waits for our end)

    // UNROT: this block's 32 rows of U, loaded first (they do not depend on the partials) into
    // registers, and put into shared memory only after the combine: stores right after the loads
    // would wait for them, and the partials' loads behind them
    constexpr int UP = D + 1; // padded rows: the row-per-8-lanes reads below hit distinct banks
    constexpr int UL = UNROT ? TD*D/4/NT : 1; // float4 of U per thread
    __shared__ float sh_u[UNROT ? TD*UP : 1];
    __shared__ float sh_o[UNROT ? D : 1];  // the whole combined o of the query
    float4 ur[UL];
    if constexpr (UNROT) {
        static_assert(TD*D/4 % NT == 0, "U in whole float4 per thread");
        const float4 * u4 = (const float4 *) (un.U + (int64_t) blockIdx.y*TD*D);
#pragma unroll
        for (int k = 0; k < UL; ++k) {
            ur[k] = u4[tid + k*NT];
        }
    }
    // launched as a programmatic dependent of the attention (oscar2_cuda_fa_combine): everything above
    // overlaps its last blocks; the partials are read only after it has finished
    ggml_cuda_pdl_sync();

    // this thread's first NPR partials of its dims, loaded now with the (max, sum) pairs below:
    // one round trip to memory instead of two (the weights need the max first). (part_acc and
    // part_ml are not __restrict__, by the rule in oscar2-common.cuh: so qualified, these loads
    // may go above the wait and read partials not yet written)
    constexpr int NPR = 8;
    const int td = tid % CD, ps = tid / CD;
    const int d  = UNROT ? VW*td : blockIdx.y*TD + td; // the thread's (first) dim
    const vec_t * pa = (const vec_t *) (part_acc + qi*n_part*D + d);
    constexpr int VS = D/VW; // a partial's stride in vec_t
    vec_t xr[NPR];
#pragma unroll
    for (int i = 0; i < NPR; ++i) {
        const int s = ps + i*PS;
        xr[i] = s < n_part ? pa[(int64_t) s*VS] : vec_t{};
    }

    float Mx = -INFINITY;
    for (int s = tid; s < n_part; s += NT) {
        Mx = fmaxf(Mx, ml[s].x);
    }
    Mx = warp_reduce_max(Mx);
    if (lane == 0) {
        sh_red[warp] = Mx;
    }
    __syncthreads();
    Mx = sh_red[0];
#pragma unroll
    for (int i = 1; i < NW; ++i) {
        Mx = fmaxf(Mx, sh_red[i]);
    }
    const float sink = sinks ? sinks[qi % n_head] : -INFINITY;
    Mx = fmaxf(Mx, sink);
    __syncthreads(); // sh_red is reused

    float l = 0.0f;
    for (int s = tid; s < n_part; s += NT) {
        const float2 v = ml[s];
        const float w = v.x == -INFINITY ? 0.0f : expf(v.x - Mx); // an empty partial weighs 0 (also when Mx is -inf)
        sh_w[s] = w;
        l += w*v.y;
    }
    l = warp_reduce_sum(l);
    if (lane == 0) {
        sh_red[warp] = l;
    }
    __syncthreads();
    l = 0.0f;
#pragma unroll
    for (int i = 0; i < NW; ++i) {
        l += sh_red[i];
    }
    if (sinks && Mx != -INFINITY) {
        l += expf(sink - Mx);
    }
    const float inv = l > 0.0f ? 1.0f/l : 0.0f;

    // a += w x, component by component; an empty partial's bytes stay out of the sum
    auto add = [](vec_t & a, const float w, const vec_t & x) {
        const float * xf = (const float *) &x;
        float * af = (float *) &a;
#pragma unroll
        for (int c = 0; c < VW; ++c) {
            af[c] += w != 0.0f ? w*xf[c] : 0.0f;
        }
    };
    vec_t a = vec_t{};
#pragma unroll
    for (int i = 0; i < NPR; ++i) {
        const int s = ps + i*PS;
        if (s < n_part) {
            add(a, sh_w[s], xr[i]);
        }
    }
#pragma unroll 4
    for (int s = ps + NPR*PS; s < n_part; s += PS) {
        add(a, sh_w[s], pa[(int64_t) s*VS]);
    }
    sh_acc[ps][td] = a;
    if constexpr (UNROT) {
#pragma unroll
        for (int k = 0; k < UL; ++k) {
            const int e = tid + k*NT;
            float * row = sh_u + (e / (D/4))*UP + 4*(e % (D/4));
            row[0] = ur[k].x; row[1] = ur[k].y; row[2] = ur[k].z; row[3] = ur[k].w;
        }
    }
    __syncthreads();
    // dim e of o: the sum over the slices, in slice order
    auto o_dim = [&](const int e) {
        float x = 0.0f;
#pragma unroll
        for (int i = 0; i < PS; ++i) {
            x += ((const float *) sh_acc[i])[e];
        }
        return x*inv;
    };
    if constexpr (!UNROT) {
        if (tid < TD) {
            dst[qi*D + d] = o_dim(tid);
        }
    } else {
        for (int e = tid; e < D; e += NT) {
            const float x = o_dim(e);
            sh_o[e] = x;
            if (e / TD == (int) blockIdx.y) {
                dst[qi*D + e] = x;
            }
        }
        __syncthreads(); // sh_o complete
        // row r = tid/8 of this block's rows, its 8 lanes split the D products
        constexpr int LPR = NT/TD;
        const int r = tid / LPR, part = tid % LPR;
        float acc = 0.0f;
#pragma unroll
        for (int k = part; k < D; k += LPR) {
            acc += sh_u[r*UP + k]*sh_o[k];
        }
#pragma unroll
        for (int off = LPR/2; off > 0; off >>= 1) {
            acc += __shfl_xor_sync(0xffffffff, acc, off, WARP_SIZE);
        }
        if (part == 0) {
            un.y[qi*D + blockIdx.y*TD + r] = acc;
        }
    }
}

void oscar2_cuda_fa_combine(int D, const fa_params & p, const float * sinks, float * dst, int64_t n_queries,
        const fa_unrot & un, cudaStream_t stream) {
    const size_t smem = (size_t) p.n_part*sizeof(float);
    const dim3 grid(n_queries, D/OSCAR_COMBINE_DIMS);
    const dim3 block(OSCAR_COMBINE_THREADS);
    // its blocks may start as the attention's blocks end, load U, and wait (ggml_cuda_pdl_sync)
#define OSCAR_COMBINE_CASE(D_) case D_: launch_dependent(un.U ? k_fa_combine<D_, true> : k_fa_combine<D_, false>, \
        grid, block, smem, stream, p.part_acc, p.part_ml, sinks, dst, p.n_part, p.n_head, un); break;
    switch (D) {
        OSCAR_COMBINE_CASE(64)
        OSCAR_COMBINE_CASE(128)
        OSCAR_COMBINE_CASE(256)
        default: GGML_ABORT("oscar2 attention: no combine for D = %d", D);
    }
#undef OSCAR_COMBINE_CASE
}
