// oscar2-cuda.cuh: the CUDA side of the oscar2 KV cache, as upstream's ggml-cuda sees it.
//
// Hooked into ggml-cuda.cu by one call in the op dispatch, one in supports_op and one in the
// graph loop's fusion step (the patch "ggml-cuda: hooks for the oscar2 kernels"), so that the
// upstream sources only learn that these ops exist. The ops, one file each (this folder):
//   SET_ROWS  f32|f16 -> oscar2      cache writes, with the layer's clip ratio; bit-identical to
//   CPY       f32|f16 -> oscar2      the CPU reference (oscar2.h)                   set-rows.cu
//   GET_ROWS  oscar2 -> f32, CPY oscar2 -> f32|f16 (the K shift's dequantize)       get-rows.cu
//   FLASH_ATTN_EXT with oscar2 K and/or V, and/or the high-precision window rows (oscar2-ops.h):
//             few query columns (decode, multi-sequence decode, small speculative batches) run
//             the split-KV kernels that read INT2 rows as INT2 and the window rows in f16,
//             merged exactly by their log-sum-exp                                   attn-decode.cu
//               on tensor cores, with the window's chunks in the same launch        attn-mma.cu,
//                                                                                   attn-window.cuh
//               on CUDA cores                                                       attn-vec.cu
//               the merge of the partials (and the output's un-rotation)            attn-combine.cu
//             many query columns (prefill) dequantize cache and window rows side by side into
//             one f16 K/V and run upstream's tensor-core kernels with the same mask attn-prefill.cu
//   MUL_MAT   the graph's OSCAR rotations (hinted) of a few vectors                 rotate.cu
//             at decode, fused with the set_rows nodes that store the rotated k and v into the
//             cache and the window                                                  rotate-store.cu,
//                                                                                   fusion-plan.cu
// Shared: oscar2-common.cuh (block layout, launches), quantize-group.cuh (the quantizer of one
// group), attn-common.cuh (the attention's partials); ops.cuh declares each file's entry.
#pragma once

#include "../../ggml-cuda/common.cuh"

// true when dst was ours and has been computed
bool ggml_cuda_oscar2_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// -1: not ours, ask upstream; 0 or 1: whether this device runs it
int ggml_cuda_oscar2_supports_op(int device, const ggml_tensor * op);

// ggml_cuda_try_fuse, at node i of cgraph: plan which later nodes the launch of node i also does
// (they are then skipped); the plan is kept in ctx.oscar2_fusion (fusion-plan.cuh)
void ggml_cuda_oscar2_plan_fusion(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);
