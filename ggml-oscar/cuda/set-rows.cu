// set-rows.cu: cache writes into oscar2 on the GPU: SET_ROWS f32|f16 -> oscar2 (the KV cache's
// store, with the layer's clip ratio) and CPY f32|f16 -> oscar2 (the K shift's requantize).
//
// Reference: oscar2_quantize_row_g in ../oscar2.c (through the CPU backend's set_rows and cpy,
// ../oscar2-cpu.c), bit for bit; the numpy twin is oscar_gguf/format/oscar2.py. Checked against the CPU
// by test-backend-ops SET_ROWS and CPY (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh test`)
// and byte for byte by tests/test_oscar2_ops.py on CUDA0.

#include "ops.cuh"
#include "quantize-group.cuh"

template <typename T> static __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<half>(half x) { return __half2float(x); }

// Rows of src (f32/f16, [ne00, ne01, ne02, ne03] with byte strides) into oscar2 rows of dst.
// idx: set_rows indices (i32/i64, [ne01, ne11, ne12]) or null for a plain copy (dst row = i01).
// One team of G/4 lanes per group (quantize-group.cuh).
template <int G, typename src_t, typename idx_t>
static __global__ void k_oscar2_quantize(const char * __restrict__ src, const idx_t * __restrict__ idx, char * __restrict__ dst,
        const int64_t n_groups, const int64_t ne00, const int64_t ne01, const int64_t ne02,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t ne11, const int64_t ne12, const int64_t s10, const int64_t s11, const int64_t s12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3, const float clip) {
    constexpr int TEAM  = G/4;
    constexpr int BYTES = 4 + G/4;
    const int lane = threadIdx.x % WARP_SIZE;
    const int b    = lane % TEAM;
    const int64_t g = ((int64_t) blockIdx.x*blockDim.x + threadIdx.x) / TEAM;
    // whole teams run together (shuffles): a team past the end still participates
    const bool active = g < n_groups;
    const int64_t gg = active ? g : 0;

    const int64_t ngr = ne00/G;
    const int64_t i00 = (gg % ngr)*G;
    int64_t rest = gg / ngr;
    const int64_t i01 = rest % ne01; rest /= ne01;
    const int64_t i02 = rest % ne02;
    const int64_t i03 = rest / ne02;

    const src_t * x = (const src_t *) (src + i01*nb01 + i02*nb02 + i03*nb03) + i00;
    float v[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        v[s] = sanitize(to_f32<src_t>(x[b + s*TEAM]));
    }
    const int64_t row = idx ? (int64_t) idx[i01*s10 + (i02 % ne11)*s11 + (i03 % ne12)*s12] : i01;
    uint8_t * blk = (uint8_t *) (dst + row*nb1 + i02*nb2 + i03*nb3) + (i00/G)*BYTES;
    uint16_t dbits, mbits;
    const uint8_t byte = quantize_group<G>(v, clip, b, dbits, mbits);
    if (active) {
        store_group(blk, b, byte, dbits, mbits);
    }
}

template <int G, typename src_t, typename idx_t>
static void launch_quantize(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip, cudaStream_t stream) {
    const int64_t n_groups = ggml_nelements(src0)/G;
    if (n_groups == 0) {
        return;
    }
    const int threads = 128;
    const int64_t teams_per_block = threads/(G/4);
    const int64_t blocks = (n_groups + teams_per_block - 1)/teams_per_block;
    const idx_t * idx = src1 ? (const idx_t *) src1->data : nullptr;
    const int64_t s10 = src1 ? src1->nb[0]/sizeof(idx_t) : 0;
    const int64_t s11 = src1 ? src1->nb[1]/sizeof(idx_t) : 0;
    const int64_t s12 = src1 ? src1->nb[2]/sizeof(idx_t) : 0;
    const int64_t ne11 = src1 ? src1->ne[1] : 1;
    const int64_t ne12 = src1 ? src1->ne[2] : 1;
    k_oscar2_quantize<G, src_t, idx_t><<<blocks, threads, 0, stream>>>(
        (const char *) src0->data, idx, (char *) dst->data, n_groups,
        src0->ne[0], src0->ne[1], src0->ne[2], src0->nb[1], src0->nb[2], src0->nb[3],
        ne11, ne12, s10, s11, s12, dst->nb[1], dst->nb[2], dst->nb[3], clip);
    CUDA_CHECK(cudaGetLastError());
}

template <int G, typename src_t>
static void dispatch_quantize_idx(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip, cudaStream_t stream) {
    if (src1 == nullptr || src1->type == GGML_TYPE_I64) {
        launch_quantize<G, src_t, int64_t>(src0, src1, dst, clip, stream);
    } else {
        launch_quantize<G, src_t, int32_t>(src0, src1, dst, clip, stream);
    }
}

void oscar2_cuda_quantize(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip, cudaStream_t stream) {
    const bool f16 = src0->type == GGML_TYPE_F16;
    if (dst->type == GGML_TYPE_OSCAR2) {
        f16 ? dispatch_quantize_idx<QK_OSCAR2, half>(src0, src1, dst, clip, stream)
            : dispatch_quantize_idx<QK_OSCAR2, float>(src0, src1, dst, clip, stream);
    } else {
        f16 ? dispatch_quantize_idx<QK_OSCAR2_64, half>(src0, src1, dst, clip, stream)
            : dispatch_quantize_idx<QK_OSCAR2_64, float>(src0, src1, dst, clip, stream);
    }
}
