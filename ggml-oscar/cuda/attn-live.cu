// attn-live.cu: the live chunks of a decode step over many query tokens (k_fa_live_chunks).
//
// With several sequences in one unified cache, each query sees only its own sequence's cells;
// the rest of its mask row is -inf. A group of blocks of k_fa_int2_mma (a few tokens, usually of
// one or two sequences) would otherwise read every row of the cache and mask most of them. This
// lists, per group of tokens and mask stream, the OSCAR_LIVE_ROWS-row chunks of the cache that
// some token of the group sees (some mask entry above -inf), in increasing order, and counts
// them; the group's splits then share only those chunks. A chunk left out is one whose every
// row gets probability 0 for every query of the group, so the result is the same.
//
// Reference: the mask itself. Checked by test-backend-ops FLASH_ATTN_EXT with block-sparse masks
// of many sequences (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh test`): the attention,
// CUDA against CPU.

#include "attn-common.cuh"

#define OSCAR_LIVE_THREADS 1024

// grid (n_groups, mask_ne3), OSCAR_LIVE_THREADS threads: a thread a chunk, in rounds; the live
// chunks of a round are written in order at the list's end by a prefix sum over the warps
static __global__ void k_fa_live_chunks(const half * mask, const int64_t mask_nb1, const int64_t mask_nb3, const int n_q,
        const int tokens_per_group, const int n_rows, int * live, int * count, const int live_stride) {
    constexpr int NW = OSCAR_LIVE_THREADS/WARP_SIZE;
    __shared__ int sh_warp[NW];
    __shared__ int sh_base, sh_next;
    const int z    = blockIdx.x;
    const int gl   = blockIdx.y*gridDim.x + z;
    const int t0   = z*tokens_per_group;
    const int t1   = min(n_q, t0 + tokens_per_group);
    const int lane = threadIdx.x % WARP_SIZE;
    const int wid  = threadIdx.x / WARP_SIZE;
    const half * m = mask + blockIdx.y*mask_nb3;
    const int n_chunks = (n_rows + OSCAR_LIVE_ROWS - 1)/OSCAR_LIVE_ROWS;
    int * list = live + (int64_t) gl*live_stride;
    if (threadIdx.x == 0) {
        sh_base = 0;
    }
    for (int c0 = 0; c0 < n_chunks; c0 += OSCAR_LIVE_THREADS) {
        const int c = c0 + threadIdx.x;
        bool seen = false;
        if (c < n_chunks) {
            const int r1 = min(n_rows, (c + 1)*OSCAR_LIVE_ROWS);
            for (int t = t0; t < t1 && !seen; ++t) {
                const half * mt = m + t*mask_nb1;
                for (int r = c*OSCAR_LIVE_ROWS; r < r1 && !seen; ++r) {
                    seen = __half2float(mt[r]) != -INFINITY;
                }
            }
        }
        const unsigned b = __ballot_sync(0xffffffff, seen);
        if (lane == 0) {
            sh_warp[wid] = __popc(b);
        }
        __syncthreads();
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
    GGML_ASSERT(src.mask && live_stride >= (src.n_rows + OSCAR_LIVE_ROWS - 1)/OSCAR_LIVE_ROWS);
    const dim3 grid(n_groups, p.mask_ne3, 1);
    k_fa_live_chunks<<<grid, OSCAR_LIVE_THREADS, 0, stream>>>(src.mask, p.mask_nb1, p.mask_nb3, p.n_q, tokens_per_group,
        src.n_rows, live, count, live_stride);
}
