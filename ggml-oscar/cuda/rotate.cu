// rotate.cu: the OSCAR rotations of a few vectors (MUL_MAT nodes with the hint
// GGML_HINT_SRC0_IS_OSCAR_ROTATION).
//
// The graph rotates q, k and v and un-rotates the attention output with ggml_mul_mat(A, x),
// A a d x d f32 matrix (R or R^T). At decode x is one token's heads: 8 to 64 vectors. Upstream
// sends such products to cuBLAS or its tensor-core f32 kernel, several microseconds each, mostly
// fixed cost, four per layer. Here a block takes 32 rows of A and 8 vectors: it loads both into
// shared memory with every load in flight at once (A comes from DRAM: walking A's rows in a loop
// would wait for DRAM eight times, slower than cuBLAS), then each thread forms two outputs. At
// decode most rotations do not come here but go with their cache writes into one launch
// (rotate-store.cu, fusion-plan.cu).
//
// Reference: ggml's mul_mat, dst[i + j*d] = sum_k A[k + i*d] x[k + j*d]; checked against the
// CPU's by test-backend-ops MUL_MAT (test_oscar_rotation, ../tests/oscar2-backend-ops.inc;
// `bash gpu/run.sh test`).

#include "ops.cuh"

#define OSCAR_ROT_ROWS     32   // rows of A (outputs per vector) per block
#define OSCAR_ROT_COLS     8    // vectors per block
#define OSCAR_ROT_THREADS  128  // = OSCAR_ROT_ROWS*OSCAR_ROT_COLS/2: two outputs per thread
#define OSCAR_ROT_MAX_COLS 256  // more (prefill) go to upstream's GEMM, built for that

template <int D>
static __global__ void k_rotate_cols(const float * __restrict__ A, const float * __restrict__ x, float * __restrict__ dst, const int n_cols) {
    constexpr int D4 = D/4, P4 = D4 + 1; // rows padded by one float4: no bank conflicts below
    __shared__ float4 sa[OSCAR_ROT_ROWS*P4];
    __shared__ float4 sx[OSCAR_ROT_COLS][D4];
    const int t  = threadIdx.x;
    const int i0 = blockIdx.x*OSCAR_ROT_ROWS;
    const int j0 = blockIdx.y*OSCAR_ROT_COLS;
    const int nc = min(OSCAR_ROT_COLS, n_cols - j0);
    const float4 * a4 = (const float4 *) (A + (int64_t) i0*D);
    const float4 * x4 = (const float4 *) (x + (int64_t) j0*D);
#pragma unroll
    for (int e = t; e < OSCAR_ROT_ROWS*D4; e += OSCAR_ROT_THREADS) {
        sa[(e / D4)*P4 + e % D4] = a4[e];
    }
#pragma unroll
    for (int e = t; e < OSCAR_ROT_COLS*D4; e += OSCAR_ROT_THREADS) {
        sx[e / D4][e % D4] = e / D4 < nc ? x4[e] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();
    const int r = t % OSCAR_ROT_ROWS;       // the output row of this thread
    const int c = 2*(t / OSCAR_ROT_ROWS);   // its two vectors (one per warp pair: broadcast reads)
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 8
    for (int k4 = 0; k4 < D4; ++k4) {
        const float4 av = sa[r*P4 + k4], x0 = sx[c][k4], x1 = sx[c + 1][k4];
        acc0 += av.x*x0.x + av.y*x0.y + av.z*x0.z + av.w*x0.w;
        acc1 += av.x*x1.x + av.y*x1.y + av.z*x1.z + av.w*x1.w;
    }
    if (c < nc) {
        dst[(int64_t) (j0 + c)*D + i0 + r] = acc0;
    }
    if (c + 1 < nc) {
        dst[(int64_t) (j0 + c + 1)*D + i0 + r] = acc1;
    }
}

// a rotation (GGML_HINT_SRC0_IS_OSCAR_ROTATION) this kernel takes: both operands f32 and
// contiguous, A square of a head size
bool oscar2_cuda_rotation_ok(const ggml_tensor * dst) {
    if (dst->op != GGML_OP_MUL_MAT || ggml_get_op_params_i32(dst, 1) != GGML_HINT_SRC0_IS_OSCAR_ROTATION) {
        return false;
    }
    const ggml_tensor * A = dst->src[0], * x = dst->src[1];
    const int64_t d = A->ne[0];
    return A->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
        (d == 64 || d == 128 || d == 256) && A->ne[1] == d && ggml_nrows(A) == d && x->ne[0] == d &&
        ggml_nrows(x) <= OSCAR_ROT_MAX_COLS && ggml_is_contiguous(A) && ggml_is_contiguous(x) && ggml_is_contiguous(dst);
}

void oscar2_cuda_rotate_cols(const ggml_tensor * dst, cudaStream_t stream) {
    const ggml_tensor * A = dst->src[0], * x = dst->src[1];
    const int n = (int) ggml_nrows(x);
    const int d = (int) A->ne[0];
    const dim3 grid(d/OSCAR_ROT_ROWS, (n + OSCAR_ROT_COLS - 1)/OSCAR_ROT_COLS);
    const float * a = (const float *) A->data, * xs = (const float *) x->data;
    float * y = (float *) dst->data;
    switch (d) {
        case  64: k_rotate_cols< 64><<<grid, OSCAR_ROT_THREADS, 0, stream>>>(a, xs, y, n); break;
        case 128: k_rotate_cols<128><<<grid, OSCAR_ROT_THREADS, 0, stream>>>(a, xs, y, n); break;
        case 256: k_rotate_cols<256><<<grid, OSCAR_ROT_THREADS, 0, stream>>>(a, xs, y, n); break;
    }
    CUDA_CHECK(cudaGetLastError());
}
