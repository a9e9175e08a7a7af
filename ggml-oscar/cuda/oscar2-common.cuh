// oscar2-common.cuh: what the oscar2 CUDA files share: the block layout of oscar2.h as the
// kernels read it, the operands a cache write carries, and how our decode kernels are launched.
//
// ggml-cuda compiles with -use_fast_math, so every rounding the format defines is spelled out
// with an explicit intrinsic (__fdiv_rn, __float2half_rn); the code thresholds are exact
// products, so FMA contraction cannot change them (see oscar2.h).
#pragma once

#include "../../ggml-cuda/common.cuh"
#include "../oscar2.h"
#include "../oscar2-ops.h"

#include <utility>

// values per group: QK_OSCAR2 (block_oscar2) or QK_OSCAR2_64 (block_oscar2_64)
static constexpr __host__ __device__ int group_of(ggml_type t) {
    return t == GGML_TYPE_OSCAR2 ? QK_OSCAR2 : QK_OSCAR2_64;
}

// the header of a group at bp: two fp16 bit patterns, d then m (block_oscar2 in oscar2.h)
static __device__ __forceinline__ float group_d(const uint8_t * bp) {
    return __half2float(__ushort_as_half(*(const uint16_t *) (bp + 0)));
}
static __device__ __forceinline__ float group_m(const uint8_t * bp) {
    return __half2float(__ushort_as_half(*(const uint16_t *) (bp + 2)));
}

// rows of t are contiguous elements (its rows themselves may be strided)
static bool rows_contiguous(const ggml_tensor * t) {
    return t->nb[0] == ggml_type_size(t->type) && t->nb[1] >= (size_t) ggml_row_size(t->type, t->ne[0]);
}

// a kernel parameter that the kernel indexes at run time (an array of jobs or parts), read where
// it lies in the parameter space instead of copied to local memory first.
// (__grid_constant__ needs CUDA 11.7 and compute_70: nvcc rejects it in a pass for an older
// arch, which a CUDA 12 build for Pascal has; there the run-time index copies the parameter to
// local memory, correct and slower)
#if !defined(GGML_USE_HIP) && defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7)) && \
    (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700)
#define OSCAR_GRID_CONSTANT __grid_constant__
#else
#define OSCAR_GRID_CONSTANT
#endif

// ---- launches as programmatic dependents ---------------------------------------------------
//
// Upstream's kernels let the next launch start early (ggml_cuda_pdl_lc) and wait for their
// inputs (ggml_cuda_pdl_sync). A plain launch of ours between two of them would be a full stop:
// its blocks scheduled only after the kernel before had ended, and the next kernel's only after
// ours. So our decode kernels (rotate-store, attention, combine) are launched the same way, and
// each of them follows one rule: before ggml_cuda_pdl_sync it reads only weights (rotation
// matrices), and it writes nothing. Part of the rule: what earlier kernels write is not read
// through a `const __restrict__` pointer. nvcc makes such loads non-coherent (LDG.CONSTANT) and
// may hoist them above the wait, whose memory clobber does not hold them; the kernel then reads
// its inputs before they are written. (The attention's explicit __ldg loads of the cache come
// after the wait in its SASS: check there after changing it.) Every block runs
// ggml_cuda_pdl_sync, early exits included, so a kernel ends only after the one before it: a
// later kernel's wait covers all earlier ones. Which of them let the next launch start early
// (ggml_cuda_pdl_lc) is chosen per kernel: the attention and the combine do, the rotate-store
// does not (see there).

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent where the build and
// the kernel's code allow it (upstream's launch: GGML_CUDA_PDL=0 turns it off for every kernel)
template <typename Kernel, typename... Args>
static void launch_dependent(Kernel kernel, const dim3 grid, const dim3 block, const size_t smem, cudaStream_t stream,
        Args &&... args) {
    ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(grid, block, smem, stream), std::forward<Args>(args)...);
}
