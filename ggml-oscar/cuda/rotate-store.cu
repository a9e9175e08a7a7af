// rotate-store.cu: a decode layer's rotations and the cache writes of their results in one
// launch (k_rotate_store), as the fusion plan (fusion-plan.cu) lays them out.
//
// At decode a layer's graph rotates k, q and v (one token's heads each) and then stores k and v
// twice: into the INT2 cache (set_rows, quantized) and into the high-precision window (set_rows,
// f16). Each of those seven nodes alone is a launch of a few microseconds, mostly fixed cost,
// where an f16 cache has two (its K write is even fused into RoPE). Here one launch does them
// all: k's rotation with its stores, q's (by k's matrix, no stores) and v's with its stores.
//
// Block: S = max(D, G) consecutive values of one token's row (S/D heads, S/G groups) of one job
// (a rotation and its stores), S threads. Each warp forms 32 of the values
// y_i = sum_k A[(i%D)*D + k] x[k + its head's offset], as ggml's mul_mat (and k_rotate_cols)
// define it (warp_rows_matvec), and writes them to the rotation's output; each store target then
// takes the block's values: converted (window) or quantized by teams exactly as
// k_oscar2_quantize does (the same sanitize and quantize_group on the same f32 values).
//
// Reference: the same nodes computed one by one: ggml's mul_mat, and set_rows through
// oscar2_quantize_row_g (../oscar2.c) or a plain conversion. Checked against the CPU by
// test-backend-ops OSCAR_ROTATE_STORE (the rotations, the four stored tensors, the attention and
// its un-rotation, in three node orders; ../tests/oscar2-backend-ops.inc, `bash gpu/run.sh test`).

#include "fusion-plan.cuh"
#include "quantize-group.cuh"

struct rot_store {
    char *       dst;   // the set_rows destination (a row-major view of the cache or window)
    int64_t      nb1;   // its row stride in bytes
    const void * idx;   // its row of each token (i64 or i32, element stride idx_s)
    int64_t      idx_s;
    bool         idx64;
    ggml_type    type;
    float        clip;  // oscar2 destinations: the layer's clip ratio (ggml_oscar2_get_clip of the set_rows)
};

struct rot_stores {
    rot_store s[OSCAR_FUSED_STORES];
    int n;
};

// one rotation of a fused launch and the cache writes of its result
struct rot_job {
    const float * A;  // D x D f32, row-major
    const float * x;  // [E, tokens] f32, contiguous
    float *       y;
    int64_t       E;  // values per token, a multiple of the launch's S
    rot_stores    st; // (n = 0: none)
};

struct rot_jobs {
    rot_job j[OSCAR_FUSED_JOBS];
    int n;
};

// the block's S values (shared memory) quantized into groups of G of the oscar2 row drow
template <int G, int S>
static __device__ __forceinline__ void store_int2_groups(const float * sy, char * drow, const int64_t e0, const float clip) {
    constexpr int TEAM  = G/4;
    constexpr int BYTES = 4 + G/4;
    constexpr int LANES = S/4;  // S/G teams of G/4 lanes
    const int i = threadIdx.x;
    if (i >= (LANES + WARP_SIZE - 1)/WARP_SIZE*WARP_SIZE) {
        return; // warps with no lane of a team (whole warps take part in the shuffles)
    }
    const bool active = i < LANES;
    const int g = active ? i / TEAM : 0;
    const int b = i % TEAM;
    float v[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        v[s] = sanitize(sy[g*G + b + s*TEAM]);
    }
    uint16_t dbits, mbits;
    const uint8_t byte = quantize_group<G>(v, clip, b, dbits, mbits);
    if (active) {
        store_group((uint8_t *) drow + (e0/G + g)*BYTES, b, byte, dbits, mbits);
    }
}

// one step of the halving exchanges below: lanes l and l ^ H swap halves of their 2H partials
// (a template per step: with a loop over H the partials would be indexed at run time, in local memory)
template <int H>
static __device__ __forceinline__ void halving_sums(float * pj, const int l) {
    const bool hi = l & H;
#pragma unroll
    for (int j = 0; j < H; ++j) {
        const float send = hi ? pj[j] : pj[j + H];
        const float keep = hi ? pj[j + H] : pj[j];
        pj[j] = keep + __shfl_xor_sync(0xffffffff, send, H, WARP_SIZE);
    }
    if constexpr (H > 1) {
        halving_sums<H/2>(pj, l);
    }
}

// Rows r0 .. r0+31 of A (D x D f32, row-major) times x (shared memory), by one warp: load()
// then dot(), which returns the lane's row (r0 + row_off) of the product. Why not a row per
// thread: 32 threads reading 32 rows make every warp load touch 32 cache lines; here a warp load
// is 512 contiguous bytes (LPR lanes per row, RPL rows per load). Each lane dots its columns of
// the 32 rows, and the 32 partial vectors are summed across lanes by halving exchanges: at each
// step a lane keeps half of its partials, sends the other half to its partner and adds what
// comes back (31 shuffles for 32 lanes), which leaves lane l with partial number l % LPR, summed.
// load() holds A's part in registers (up to 32 float4; D = 256 loads in dot()), so that the
// caller can issue it before it waits for x: A usually comes from DRAM, x from L2.
template <int D>
struct warp_rows_matvec {
    static constexpr int D4  = D/4;
    static constexpr int LPR = D4 < WARP_SIZE ? D4 : WARP_SIZE; // lanes per row
    static constexpr int RPL = WARP_SIZE/LPR;                   // rows per warp load
    static constexpr int NJ  = WARP_SIZE/RPL;                   // partials per lane (= LPR)
    static constexpr int CPL = D4/LPR;                          // float4 loads per row and lane
    static constexpr bool PRE = NJ*CPL <= 32;                   // load() keeps A in registers

    const float * A;
    int r0;
    float4 a[PRE ? NJ : 1][PRE ? CPL : 1];

    __device__ __forceinline__ const float4 * row(const int j) const {
        const int l = threadIdx.x % WARP_SIZE;
        return (const float4 *) (A + (int64_t) (r0 + j*RPL + l / LPR)*D);
    }
    __device__ __forceinline__ void load(const float * __restrict__ A_, const int r0_) {
        A = A_;
        r0 = r0_;
        if constexpr (PRE) {
            const int c = threadIdx.x % WARP_SIZE % LPR;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
#pragma unroll
                for (int cc = 0; cc < CPL; ++cc) {
                    // volatile and coherent: ptxas sinks plain and .nc loads past the caller's barrier
                    float4 & v = a[j][cc];
                    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(row(j) + c + cc*LPR));
                }
            }
        }
    }
    __device__ __forceinline__ float dot(const float4 * x4, int & row_off) const {
        const int l = threadIdx.x % WARP_SIZE, sub = l / LPR, c = l % LPR;
        float pj[NJ];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            float acc = 0.0f;
#pragma unroll
            for (int cc = 0; cc < CPL; ++cc) {
                const float4 av = PRE ? a[PRE ? j : 0][PRE ? cc : 0] : row(j)[c + cc*LPR], xv = x4[c + cc*LPR];
                acc += av.x*xv.x + av.y*xv.y + av.z*xv.z + av.w*xv.w;
            }
            pj[j] = acc;
        }
        halving_sums<NJ/2>(pj, l);
        row_off = c*RPL + sub;
        return pj[0];
    }
};

// Block e0/S of token t of job J
template <int D, int S>
static __device__ __forceinline__ void rotate_store_block(const rot_job & J, const int64_t e0, const int64_t t,
        float4 * sx4, float * sy) {
    const int i = threadIdx.x;
    const int64_t base = t*J.E + e0;
    const int v0 = (i / WARP_SIZE)*WARP_SIZE; // the warp's first value: head v0/D, rows v0%D..
    warp_rows_matvec<D> mv;
    mv.load(J.A, v0 % D);                      // in flight while x arrives (A: a weight)
    ggml_cuda_pdl_sync();                      // x, and the cache rows we write, belong to earlier kernels
    ((float *) sx4)[i] = J.x[base + i];
    __syncthreads();
    {
        int off;
        const float v = mv.dot(sx4 + (v0 / D)*(D/4), off);
        J.y[base + v0 + off] = v;
        sy[v0 + off] = v;
    }
    if (J.st.n == 0) {
        return; // (the whole block)
    }
    __syncthreads();
    const float acc = sy[i];
#pragma unroll 1
    for (int j = 0; j < OSCAR_FUSED_STORES; ++j) {
        if (j >= J.st.n) {
            break;
        }
        const rot_store & s = J.st.s[j];
        const int64_t row = s.idx64 ? ((const int64_t *) s.idx)[t*s.idx_s] : (int64_t) ((const int32_t *) s.idx)[t*s.idx_s];
        char * drow = s.dst + row*s.nb1;
        switch (s.type) {
            case GGML_TYPE_F16:       ((half *)        drow)[e0 + i] = __float2half_rn(acc);     break;
            case GGML_TYPE_BF16:      ((nv_bfloat16 *) drow)[e0 + i] = __float2bfloat16_rn(acc); break;
            case GGML_TYPE_F32:       ((float *)       drow)[e0 + i] = acc;                      break;
            case GGML_TYPE_OSCAR2:    store_int2_groups<QK_OSCAR2,    S>(sy, drow, e0, s.clip);  break;
            case GGML_TYPE_OSCAR2_64: store_int2_groups<QK_OSCAR2_64, S>(sy, drow, e0, s.clip);  break;
            default: break;
        }
    }
}

// Grid (sum of E/S over the jobs, tokens): the first E_0/S blocks take job 0, the next job 1, ...
// The job is indexed at run time in the parameters themselves (OSCAR_GRID_CONSTANT: no copy to
// local memory), so the block's code is there once, not once per job. Why: with a constant index
// per job and both stores unrolled the kernel is about five times larger, and in the model's
// decode, where its code comes cold, the blocks of the jobs with stores end several microseconds
// later, and the attention after them starts that much later.
template <int D, int S>
static __global__ void k_rotate_store(const OSCAR_GRID_CONSTANT rot_jobs jobs) {
    static_assert(S % WARP_SIZE == 0 && D % WARP_SIZE == 0, "whole warps of rows");
    __shared__ float4 sx4[S/4];
    __shared__ float  sy[S];
    // (no early ggml_cuda_pdl_lc here: the attention's blocks would become resident beside ours
    // and wait, and on an SM that holds one of ours fewer of them fit, while its grid is sized to
    // fill every SM in one wave. End to end the trigger gained nothing, though the attention's
    // first block could start earlier.)
    const int64_t t = blockIdx.y;
    const int b0 = (int) (jobs.j[0].E/S), b1 = b0 + (jobs.n > 1 ? (int) (jobs.j[1].E/S) : 0);
    const int b = blockIdx.x;
    const int jb = b < b0 ? 0 : b < b1 ? 1 : 2;
    rotate_store_block<D, S>(jobs.j[jb], (int64_t) (b - (jb == 0 ? 0 : jb == 1 ? b0 : b1))*S, t, sx4, sy);
}

template <int D>
static void launch_rotate_store(const rot_jobs & jobs, int64_t T, int S, cudaStream_t stream) {
    int64_t blocks = 0;
    for (int j = 0; j < jobs.n; ++j) {
        blocks += jobs.j[j].E/S;
    }
    const dim3 grid((unsigned) blocks, (unsigned) T);
    if (S == D) {
        launch_dependent(k_rotate_store<D, D>, grid, dim3(D), 0, stream, jobs);
    } else if (S == 2*D && D <= 128) {
        launch_dependent(k_rotate_store<D, (D <= 128 ? 2*D : D)>, grid, dim3(2*D), 0, stream, jobs);
    } else {
        GGML_ABORT("oscar2: no fused rotation of head size %d in blocks of %d values", D, S);
    }
}

bool oscar2_cuda_rotate_store(ggml_cuda_oscar2_fusion * plan, const ggml_tensor * rot, cudaStream_t stream) {
    if (plan == nullptr || plan->launch.n_jobs == 0 || plan->launch.jobs[0].rot != rot) {
        return false;
    }
    const planned_launch & L = plan->launch;
    const int64_t D = rot->src[0]->ne[0];
    const int64_t T = L.jobs[0].stores[0]->src[0]->ne[1];
    rot_jobs jobs = {};
    for (int k = 0; k < L.n_jobs; ++k) {
        const planned_rot & r = L.jobs[k];
        rot_job & J = jobs.j[k];
        J = { (const float *) r.rot->src[0]->data, (const float *) r.rot->src[1]->data, (float *) r.rot->data,
              ggml_nelements(r.rot)/T, {} };
        for (int s = 0; s < r.n_stores; ++s) {
            const ggml_tensor * sr = r.stores[s], * idx = sr->src[1];
            J.st.s[s] = { (char *) sr->data, (int64_t) sr->nb[1], idx->data, 1, idx->type == GGML_TYPE_I64, sr->type,
                          oscar2_is_type(sr->type) ? ggml_oscar2_get_clip(sr) : 0.0f };
            plan->done.push_back(sr);
        }
        J.st.n = r.n_stores;
        if (k > 0) {
            plan->done.push_back(r.rot);
        }
    }
    jobs.n = L.n_jobs;
    const int S = (int) L.span;
    switch (D) {
        case  64: launch_rotate_store< 64>(jobs, T, S, stream); break;
        case 128: launch_rotate_store<128>(jobs, T, S, stream); break;
        case 256: launch_rotate_store<256>(jobs, T, S, stream); break;
    }
    plan->launch.n_jobs = 0;
    return true;
}
