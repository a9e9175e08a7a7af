// oscar2-cuda.cu: the dispatch of the oscar2 ops (entry points in oscar2-cuda.cuh): which node
// is ours, which file's kernels compute it, and which of them a device supports. The kernels and
// the plain reference each is tested against are in the op files (see oscar2-cuda.cuh).

#include "oscar2-cuda.cuh"
#include "attn-common.cuh"
#include "fusion-plan.cuh"
#include "ops.cuh"

bool ggml_cuda_oscar2_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    ggml_cuda_oscar2_fusion * plan = ctx.oscar2_fusion.get();
    switch (dst->op) {
        case GGML_OP_SET_ROWS:
            if (oscar2_fusion_done(plan, dst)) {
                return true; // written by the fused rotation before it (window rows too)
            }
            if (!oscar2_is_type(dst->type)) {
                return false;
            }
            oscar2_cuda_quantize(dst->src[0], dst->src[1], dst, ggml_oscar2_get_clip(dst), ctx.stream());
            return true;
        case GGML_OP_CPY: {
            const ggml_tensor * src = dst->src[0];
            ggml_tensor * to = dst->src[1];
            if (oscar2_is_type(to->type)) {
                oscar2_cuda_quantize(src, nullptr, to, ggml_oscar2_get_clip(dst), ctx.stream());
                return true;
            }
            if (oscar2_is_type(src->type)) {
                oscar2_cuda_dequantize(src, nullptr, to, ctx.stream());
                return true;
            }
            return false;
        }
        case GGML_OP_GET_ROWS:
            if (!oscar2_is_type(dst->src[0]->type)) {
                return false;
            }
            oscar2_cuda_dequantize(dst->src[0], dst->src[1], dst, ctx.stream());
            return true;
        case GGML_OP_FLASH_ATTN_EXT:
            if (!fa_is_ours(dst)) {
                return false;
            }
            if (oscar2_cuda_fa_decode_ok(dst)) {
                oscar2_cuda_fa_decode(ctx, dst, oscar2_fusion_take_unrot(plan, dst));
            } else {
                oscar2_cuda_fa_prefill(ctx, dst);
            }
            return true;
        case GGML_OP_MUL_MAT:
            if (!oscar2_cuda_rotation_ok(dst)) {
                return false;
            }
            if (oscar2_fusion_done(plan, dst)) {
                return true; // q or v, rotated by the launch of k's rotation before it (or the output's
                             // un-rotation, done by the attention's combine)
            }
            if (!oscar2_cuda_rotate_store(plan, dst, ctx.stream())) {
                oscar2_cuda_rotate_cols(dst, ctx.stream());
            }
            return true;
        default:
            return false;
    }
}

int ggml_cuda_oscar2_supports_op(int device, const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_SET_ROWS:
            if (!oscar2_is_type(op->type)) {
                return -1;
            }
            return (op->src[0]->type == GGML_TYPE_F32 || op->src[0]->type == GGML_TYPE_F16) &&
                   (op->src[1]->type == GGML_TYPE_I64 || op->src[1]->type == GGML_TYPE_I32) &&
                   op->src[0]->ne[0] % group_of(op->type) == 0 && rows_contiguous(op->src[0]);
        case GGML_OP_CPY: {
            const ggml_tensor * a = op->src[0], * b = op->src[1];
            if (!oscar2_is_type(a->type) && !oscar2_is_type(b->type)) {
                return -1;
            }
            if (oscar2_is_type(b->type)) {
                return (a->type == GGML_TYPE_F32 || a->type == GGML_TYPE_F16) && ggml_are_same_shape(a, b) &&
                       a->ne[0] % group_of(b->type) == 0 && rows_contiguous(a) && rows_contiguous(b);
            }
            return (b->type == GGML_TYPE_F32 || b->type == GGML_TYPE_F16) && ggml_are_same_shape(a, b) &&
                   rows_contiguous(a) && rows_contiguous(b);
        }
        case GGML_OP_GET_ROWS:
            if (!oscar2_is_type(op->src[0]->type)) {
                return -1;
            }
            return op->type == GGML_TYPE_F32 && op->src[1]->type == GGML_TYPE_I32 && op->src[0]->ne[2] == op->src[1]->ne[1];
        case GGML_OP_FLASH_ATTN_EXT:
            if (!fa_is_ours(op)) {
                return -1;
            }
            // any batch size must run: small ones on our kernel, large ones through f16
            return oscar2_cuda_fa_types_ok(op->src[1]->type, op->src[2]->type, op->src[1]->ne[0]) &&
                   oscar2_cuda_fa_prefill_supported(device, op);
        default:
            return -1;
    }
}
