// oscar2-cuda.cuh: the CUDA side of the oscar2 KV cache (kernels in oscar2-cuda.cu).
//
// Hooked into ggml-cuda.cu by one call in the op dispatch, one in supports_op and one in the
// graph loop's fusion step, so that the upstream sources only learn that these ops exist:
//   SET_ROWS  f32|f16 -> oscar2      cache writes, with the layer's clip ratio (op_params[0]);
//                                    bit-identical to the CPU reference (oscar2.h)
//   CPY       f32|f16 <-> oscar2     K shift: dequantize, and requantize with the clip ratio
//   GET_ROWS  oscar2 -> f32
//   FLASH_ATTN_EXT with oscar2 K and/or V, and/or the high-precision window rows
//             (src[5], src[6]): few query columns (decode, multi-sequence decode, small
//             speculative batches) run our split-KV kernel that reads INT2 rows as INT2 and the
//             window rows in f16, merged exactly by their log-sum-exp; many query columns
//             (prefill) dequantize cache and window rows side by side into one f16 K/V and run
//             upstream's tensor-core kernels with the same wide mask.
//   MUL_MAT   the graph's tagged OSCAR rotations of a few vectors; at decode, fused with the
//             set_rows nodes that store the rotated k or v into the cache and the window
#pragma once

#include "../../ggml-cuda/common.cuh"

// true when dst was ours and has been computed
bool ggml_cuda_oscar2_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// -1: not ours, ask upstream; 0 or 1: whether this device runs it
int ggml_cuda_oscar2_supports_op(int device, const ggml_tensor * op);

// ggml_cuda_try_fuse, at node i of cgraph: when it is a rotation whose result later set_rows
// nodes store, plan to do them in the rotation's launch (they are then skipped)
void ggml_cuda_oscar2_plan_fusion(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);
