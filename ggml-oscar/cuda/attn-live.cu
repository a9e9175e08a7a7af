// attn-live.cu: the live chunks of a decode step over many query tokens (k_fa_live_flags, then
// k_fa_live_compact).
//
// With several sequences in one unified cache, each query sees only its own sequence's cells;
// the rest of its mask row is -inf. A group of blocks of k_fa_int2_mma (a few tokens, usually of
// one or two sequences) would otherwise read every row of the cache and mask most of them. This
// lists, per group of tokens and mask stream, the OSCAR_LIVE_ROWS-row chunks of the cache that
// some token of the group sees (some mask entry above -inf), in increasing order, and counts
// them; the group's splits then share only those chunks. A chunk left out is one whose every
// row gets probability 0 for every query of the group, so the result is the same.
//
// Two passes, because the list runs once per layer and step, on the attention's critical path:
// 1. k_fa_live_flags: a warp per chunk and group, lane r reading row r of the chunk for each
//    token of the group (one coalesced 64-byte read a token), the whole grid at once: the mask
//    is read at memory speed. (A thread per chunk walking its rows one after another took one
//    memory latency per row, on one SM per group.)
// 2. k_fa_live_compact: a block per group turns the flags into the ordered list in place (a list
//    entry is never written past the flag it comes from, and each round reads its flags before
//    it writes).
//
// Reference: the mask itself. Checked by test-backend-ops FLASH_ATTN_EXT with block-sparse masks
// of many sequences (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh test`): the attention,
// CUDA against CPU.

#include "attn-common.cuh"

#define OSCAR_LIVE_FLAG_WARPS 8   // chunks per block of k_fa_live_flags
#define OSCAR_LIVE_THREADS    1024

static_assert(OSCAR_LIVE_ROWS == WARP_SIZE, "a lane per row of a chunk");

// grid (ceil(n_chunks/OSCAR_LIVE_FLAG_WARPS), n_groups, mask_ne3), OSCAR_LIVE_FLAG_WARPS warps:
// flag[c] of list (stream, group) = 1 if some token of the group sees some row of chunk c
static __global__ void k_fa_live_flags(const half * mask, const int64_t mask_nb1, const int64_t mask_nb3, const int n_q,
        const int tokens_per_group, const int n_rows, int * live, const int live_stride) {
    const int c    = blockIdx.x*OSCAR_LIVE_FLAG_WARPS + threadIdx.y;
    const int n_chunks = (n_rows + OSCAR_LIVE_ROWS - 1)/OSCAR_LIVE_ROWS;
    if (c >= n_chunks) {
        return;
    }
    const int t0 = blockIdx.y*tokens_per_group;
    const int t1 = min(n_q, t0 + tokens_per_group);
    const int r  = c*OSCAR_LIVE_ROWS + threadIdx.x;
    const half * m = mask + blockIdx.z*mask_nb3;
    bool seen = false;
    if (r < n_rows) {
        for (int t = t0; t < t1; ++t) {
            seen = seen || __half2float(m[t*mask_nb1 + r]) != -INFINITY;
        }
    }
    const bool any = __any_sync(0xffffffff, seen);
    if (threadIdx.x == 0) {
        live[(int64_t) (blockIdx.z*gridDim.y + blockIdx.y)*live_stride + c] = any;
    }
}

// grid (n_groups, mask_ne3), OSCAR_LIVE_THREADS threads: a thread a chunk, in rounds; the live
// chunks of a round are written in order at the list's end by a prefix sum over the warps
static __global__ void k_fa_live_compact(const int n_rows, int * live, int * count, const int live_stride) {
    constexpr int NW = OSCAR_LIVE_THREADS/WARP_SIZE;
    __shared__ int sh_warp[NW];
    __shared__ int sh_base, sh_next;
    const int gl   = blockIdx.y*gridDim.x + blockIdx.x;
    const int lane = threadIdx.x % WARP_SIZE;
    const int wid  = threadIdx.x / WARP_SIZE;
    const int n_chunks = (n_rows + OSCAR_LIVE_ROWS - 1)/OSCAR_LIVE_ROWS;
    int * list = live + (int64_t) gl*live_stride;
    if (threadIdx.x == 0) {
        sh_base = 0;
    }
    for (int c0 = 0; c0 < n_chunks; c0 += OSCAR_LIVE_THREADS) {
        const int c = c0 + threadIdx.x;
        const bool seen = c < n_chunks && list[c] != 0;
        const unsigned b = __ballot_sync(0xffffffff, seen);
        if (lane == 0) {
            sh_warp[wid] = __popc(b);
        }
        __syncthreads(); // (also: every flag of the round is read before any entry is written)
        if (wid == 0) {
            // exclusive prefix of the warps' counts, and the round's total
            const int v = lane < NW ? sh_warp[lane] : 0;
            int x = v;
#pragma unroll
            for (int o = 1; o < WARP_SIZE; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffff, x, o, WARP_SIZE);
                x += lane >= o ? y : 0;
            }
            if (lane < NW) {
                sh_warp[lane] = x - v;
            }
            if (lane == WARP_SIZE - 1) {
                sh_next = sh_base + x;
            }
        }
        __syncthreads();
        if (seen) {
            list[sh_base + sh_warp[wid] + __popc(b & ((1u << lane) - 1))] = c;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            sh_base = sh_next;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        count[gl] = sh_base;
    }
}

void oscar2_cuda_fa_live_chunks(const fa_source & src, const fa_params & p, int tokens_per_group, int n_groups,
        int * live, int * count, int live_stride, cudaStream_t stream) {
    const int n_chunks = (src.n_rows + OSCAR_LIVE_ROWS - 1)/OSCAR_LIVE_ROWS;
    GGML_ASSERT(src.mask && live_stride >= n_chunks);
    const dim3 grid_flags((n_chunks + OSCAR_LIVE_FLAG_WARPS - 1)/OSCAR_LIVE_FLAG_WARPS, n_groups, p.mask_ne3);
    k_fa_live_flags<<<grid_flags, dim3(WARP_SIZE, OSCAR_LIVE_FLAG_WARPS, 1), 0, stream>>>(src.mask, p.mask_nb1, p.mask_nb3,
        p.n_q, tokens_per_group, src.n_rows, live, live_stride);
    k_fa_live_compact<<<dim3(n_groups, p.mask_ne3, 1), OSCAR_LIVE_THREADS, 0, stream>>>(src.n_rows, live, count, live_stride);
}
