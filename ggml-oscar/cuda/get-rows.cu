// get-rows.cu: reads of oscar2 rows on the GPU: GET_ROWS oscar2 -> f32 and CPY oscar2 -> f32|f16
// (the K shift's dequantize). Every value is m + code*d, rounded once (oscar2.h).
//
// Reference: oscar2_dequantize_row_g in ../oscar2.c (the CPU backend's get_rows and cpy); the
// numpy twin is oscar_gguf/format/oscar2.py. Checked against the CPU by test-backend-ops GET_ROWS and CPY
// (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh test`).

#include "ops.cuh"

template <typename T> static __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ half  from_f32<half>(float x)  { return __float2half_rn(x); }

// rows of src ([ne00 in groups of G, ne01, ne02, ne03], byte strides) -> dst rows; idx (i32, for
// get_rows: dst row r of batch (i11, i12) comes from src row idx[r, i11, i12]) or null (copy).
// One thread per byte of codes.
template <int G, typename dst_t>
static __global__ void k_oscar2_dequantize(const char * __restrict__ src, const int32_t * __restrict__ idx, char * __restrict__ dst,
        const int64_t n_bytes, const int64_t ne00, const int64_t ne01, const int64_t ne02,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t s10, const int64_t s11, const int64_t s12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    constexpr int NB    = G/4;
    constexpr int BYTES = 4 + G/4;
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= n_bytes) {
        return;
    }
    const int64_t bytes_per_row = ne00/4;
    const int64_t ib  = i % bytes_per_row;   // byte of the row
    int64_t rest = i / bytes_per_row;
    const int64_t i1 = rest % ne01; rest /= ne01;
    const int64_t i2 = rest % ne02;
    const int64_t i3 = rest / ne02;
    const int64_t src_row = idx ? (int64_t) idx[i1*s10 + i2*s11 + i3*s12] : i1;
    const int64_t blk_i = ib / NB;
    const int     b     = ib % NB;
    // get_rows: src0 batch dims broadcast over idx batch dims i2 -> src0 dim 2 is i2 (ne02 == ne11)
    const uint8_t * blk = (const uint8_t *) (src + src_row*nb01 + i2*nb02 + i3*nb03) + blk_i*BYTES;
    const float d = group_d(blk);
    const float m = group_m(blk);
    const uint8_t q = blk[4 + b];
    dst_t * y = (dst_t *) (dst + i1*nb1 + i2*nb2 + i3*nb3) + blk_i*G;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        y[b + s*NB] = from_f32<dst_t>(__fadd_rn(m, __fmul_rn((float) ((q >> (2*s)) & 3), d)));
    }
}

template <int G, typename dst_t>
static void launch_dequantize(const ggml_tensor * src0, const ggml_tensor * idx, const ggml_tensor * dst, cudaStream_t stream) {
    // shape of the result: dst's
    const int64_t n_bytes = ggml_nelements(dst)/4;
    if (n_bytes == 0) {
        return;
    }
    const int threads = 256;
    const int64_t blocks = (n_bytes + threads - 1)/threads;
    k_oscar2_dequantize<G, dst_t><<<blocks, threads, 0, stream>>>(
        (const char *) src0->data, idx ? (const int32_t *) idx->data : nullptr, (char *) dst->data, n_bytes,
        dst->ne[0], dst->ne[1], dst->ne[2], src0->nb[1], src0->nb[2], src0->nb[3],
        idx ? idx->nb[0]/4 : 0, idx ? idx->nb[1]/4 : 0, idx ? idx->nb[2]/4 : 0,
        dst->nb[1], dst->nb[2], dst->nb[3]);
    CUDA_CHECK(cudaGetLastError());
}

void oscar2_cuda_dequantize(const ggml_tensor * src0, const ggml_tensor * idx, const ggml_tensor * dst, cudaStream_t stream) {
    const bool f16 = dst->type == GGML_TYPE_F16;
    if (src0->type == GGML_TYPE_OSCAR2) {
        f16 ? launch_dequantize<QK_OSCAR2, half>(src0, idx, dst, stream) : launch_dequantize<QK_OSCAR2, float>(src0, idx, dst, stream);
    } else {
        f16 ? launch_dequantize<QK_OSCAR2_64, half>(src0, idx, dst, stream) : launch_dequantize<QK_OSCAR2_64, float>(src0, idx, dst, stream);
    }
}
