// ops.cuh: the host entry of each op file, for the dispatch (oscar2-cuda.cu) and the fusion
// planner. (The fused launches' own entries are in fusion-plan.cuh, the decode attention's
// kernel launches in attn-common.cuh.)
#pragma once

#include "oscar2-common.cuh"

// set-rows.cu: set_rows (src1: the row indices) or cpy (src1 null) of src0 (f32|f16) into dst
// (oscar2), quantized with clip ratio clip
void oscar2_cuda_quantize(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip, cudaStream_t stream);

// get-rows.cu: get_rows (idx: the row indices) or cpy (idx null) of src0 (oscar2) into dst (f32|f16)
void oscar2_cuda_dequantize(const ggml_tensor * src0, const ggml_tensor * idx, const ggml_tensor * dst, cudaStream_t stream);

// attn-decode.cu: the (K, V) row types of head size D our attention reads
bool oscar2_cuda_fa_types_ok(ggml_type kt, ggml_type vt, int64_t D);
// attn-decode.cu: whether the split-KV decode path takes flash attention node dst
bool oscar2_cuda_fa_decode_ok(const ggml_tensor * dst);
// attn-decode.cu: dst by the split-KV decode path; unrot: the un-rotation node its combine also
// computes (fusion-plan.cu), or null
void oscar2_cuda_fa_decode(ggml_backend_cuda_context & ctx, ggml_tensor * dst, const ggml_tensor * unrot);

// attn-prefill.cu: whether upstream's kernels take op's f16 equivalent on device
bool oscar2_cuda_fa_prefill_supported(int device, const ggml_tensor * op);
// attn-prefill.cu: dst through its f16 equivalent and upstream's kernels
void oscar2_cuda_fa_prefill(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// rotate.cu: dst is a rotation (GGML_HINT_SRC0_IS_OSCAR_ROTATION) our kernels take (f32, contiguous, head size 64/128/256,
// at most 256 vectors)
bool oscar2_cuda_rotation_ok(const ggml_tensor * dst);
// rotate.cu: dst = A x for a rotation dst (oscar2_cuda_rotation_ok)
void oscar2_cuda_rotate_cols(const ggml_tensor * dst, cudaStream_t stream);
