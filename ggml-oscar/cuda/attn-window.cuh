// attn-window.cuh: the high-precision window's f16 rows inside the tensor-core decode kernel
// (k_fa_int2_mma, attn-mma.cu, includes it): the first blocks of its launch take a chunk of the
// window each before their INT2 rows, so the window costs no launch of its own.
//
// Reference: the CPU flash attention's window rows (oscar2_cpu_window_kq/_v in ../oscar2-cpu.c,
// called from upstream's ggml-cpu/ops.cpp); checked by test-backend-ops FLASH_ATTN_EXT with the
// window cases (test_flash_attn_ext_oscar_window, ../tests/oscar2-backend-ops.inc) and
// OSCAR_ROTATE_STORE, and by tests/test_oscar2_ops.py on CUDA0.
#pragma once

#include "attn-common.cuh"

#define OSCAR_WIN_VG 8 // V rows loaded and summed per group

// The window's f16 rows for k_fa_int2_mma's blocks, as partial number `part`: rows [r0, r1), or
// (list != nullptr) the OSCAR_LIVE_ROWS-row chunks list[r0 .. r1) of a live-chunk list (attn-live.cu).
// Lane l of warp w takes row rb + l of each 32-row step (rb = r0 + 32 w, then + 128; with a
// list, the first row of entry r0 + w, then r0 + w + 4): it dots its whole K
// row with every query (the queries in shared memory, read as broadcasts), so a score needs no
// sum across lanes. The warp's max per query and the lanes' weights follow, then V is added row
// by row, each lane owning D/32 head dims and taking a row's weights by shuffles; rows that no
// query sees are skipped by ballot, so a masked step costs its mask alone.
// Why not fa_partial_rows (attn-vec.cu): it spreads a row over the lanes and sums each dot
// product across them, a chain of shuffles per row and query, 4 rows at a time; there the
// window's chunks took about a third of an 8B layer's decode attention at 32k rows.
template <int D, int NQ>
static __device__ __forceinline__ void fa_window_rows_f16(const fa_source & src, const fa_params & p, const int r0, const int r1,
        const int part, const int * list = nullptr) {
    static_assert(D % 64 == 0, "dims 64k + 2 lane, + 1 per lane");
    constexpr int NV = D/64; // half2 of V per lane and row
    const int lane = threadIdx.x;
    const int w    = threadIdx.y;
    const int hkv  = blockIdx.x % p.n_head_kv;
    const int s3   = blockIdx.x / p.n_head_kv;
    const int NT   = NQ / p.gqa > 0 ? NQ / p.gqa : 1;
    const int tok0 = blockIdx.z*NT;
    const int nq   = min(NT, p.n_q - tok0)*p.gqa;

    // query j = tok*gqa + hh is head hkv*gqa + hh of token tok0 + jt[j], hh = jh[j]: counted up,
    // not divided (a division by the run-time gqa is about 20 instructions, and the loops below
    // took one per element and query)
    int jt[NQ], jh[NQ];
    {
        int t = 0, h = 0;
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            jt[j] = t;
            jh[j] = h;
            if (++h == p.gqa) {
                h = 0;
                ++t;
            }
        }
    }
    const half * mask = src.mask ? src.mask + (s3 % p.mask_ne3)*p.mask_nb3 : nullptr;
    const char * Kh = src.K + hkv*src.nbk2 + s3*src.nbk3;
    const char * Vh = src.V + hkv*src.nbv2 + s3*src.nbv3;
    // rows past r_end are not the window's (with a list, every chunk is whole but the last)
    const int r_end = list ? src.n_rows : r1;
    // row r's mask entries mk[j] (-inf for a query past nq or a row past r_end; a query of the same
    // token as the one before it has that one's entry), and whether some query sees the row
    auto mask_row = [&](const int r, float (&mk)[NQ]) {
        bool live = false;
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            if (j >= nq || r >= r_end) {
                mk[j] = -INFINITY;
            } else if (!mask) {
                mk[j] = 0.0f;
            } else if (jh[j] != 0) {
                mk[j] = mk[j - 1]; // (jh[0] == 0: j > 0 here)
            } else {
                mk[j] = __half2float(mask[(tok0 + jt[j])*p.mask_nb1 + r]);
            }
            live = live || mk[j] != -INFINITY;
        }
        return live;
    };
    // the first row of the warp's k-th step (INT_MAX: none; a step is warp-uniform)
    auto step_row = [&](const int k) {
        const int i = (list ? r0 + w : r0 + w*WARP_SIZE) + k*(list ? OSCAR_FA_WARPS : OSCAR_FA_WARPS*WARP_SIZE);
        if (list) {
            return i < r1 ? OSCAR_LIVE_ROWS*__ldg(list + i) : INT_MAX;
        }
        return i < r1 ? i : INT_MAX;
    };
    // the queries' values this thread puts in shared memory (below), loaded first: their loads
    // are in flight while the prefetch loop waits for the mask
    constexpr int QD = (D + OSCAR_FA_WARPS*WARP_SIZE - 1)/(OSCAR_FA_WARPS*WARP_SIZE);
    float qv[NQ][QD];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        const float * qp = (const float *) (p.Q + (tok0 + jt[j])*p.nbq1 + (hkv*p.gqa + jh[j])*p.nbq2 + s3*p.nbq3);
#pragma unroll
        for (int i = 0; i < QD; ++i) {
            const int d = i*OSCAR_FA_WARPS*WARP_SIZE + w*WARP_SIZE + lane;
            qv[j][i] = j < nq && d < D ? qp[d]*p.scale : 0.0f;
        }
    }
    // The live rows' K and V into L2 first (each lane its row of each of the warp's steps): in
    // the model the window's rows come from memory cold, and the step below loads K and V in
    // chunks one ahead, so that each chunk would wait a full memory latency. (Whole rows:
    // lines of 128 bytes, D/64 of them per row of f16.)
    for (int st = 0, rb; (rb = step_row(st)) != INT_MAX; ++st) {
        const int r = rb + lane;
        float mk[NQ];
        if (mask_row(r, mk)) {
#pragma unroll
            for (int c = 0; c < D*2; c += 128) {
                asm volatile("prefetch.global.L2 [%0];" :: "l"(Kh + (int64_t) r*src.nbk1 + c));
                asm volatile("prefetch.global.L2 [%0];" :: "l"(Vh + (int64_t) r*src.nbv1 + c));
            }
        }
    }

    // the queries, pre-scaled; 0 past nq
    __shared__ float sh_q[NQ][D];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
#pragma unroll
        for (int i = 0; i < QD; ++i) {
            const int d = i*OSCAR_FA_WARPS*WARP_SIZE + w*WARP_SIZE + lane;
            if (d < D) {
                sh_q[j][d] = qv[j][i];
            }
        }
    }
    __syncthreads();

    // per query: the warp's running max (the same in every lane), this lane's share of the sum,
    // and the lane's dims 64k + 2 lane (acc[j][2k]) and 64k + 2 lane + 1 (acc[j][2k + 1])
    float M[NQ], L[NQ], acc[NQ][2*NV];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        M[j] = -INFINITY;
        L[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < 2*NV; ++e) {
            acc[j][e] = 0.0f;
        }
    }

    for (int st = 0, rb; (rb = step_row(st)) != INT_MAX; ++st) {
        const int r = rb + lane;
        float mk[NQ];
        const bool live = mask_row(r, mk);
        const uint32_t lm = __ballot_sync(0xffffffff, live);
        if (lm == 0) {
            continue; // rows nobody sees (retired or unused window cells, other sequences)
        }
        // V in groups of OSCAR_WIN_VG rows (lane: its dims of each row; 0 for a row nobody sees),
        // the next group loaded while this one is summed, and K likewise in chunks. Why loops
        // that are not unrolled: with all 32 rows' V and the whole K row in registers, the
        // products unroll over every row, chunk and query, and the window part becomes more
        // than half of the attention's code (sm_90, D = 128, 4 queries), run by one warp per
        // step and, in the model, fetched cold each layer.
        auto load_v = [&](half2 (&v)[OSCAR_WIN_VG][NV], const int k0, const uint32_t bits) {
#pragma unroll
            for (int k = 0; k < OSCAR_WIN_VG; ++k) {
                const half2 * vr = (const half2 *) (Vh + (int64_t) (rb + k0 + k)*src.nbv1) + lane;
#pragma unroll
                for (int kk = 0; kk < NV; ++kk) {
                    v[k][kk] = (bits >> k) & 1u ? vr[WARP_SIZE*kk] : __float2half2_rn(0.0f);
                }
            }
        };
        half2 vc[OSCAR_WIN_VG][NV];
        load_v(vc, 0, lm);
        // the scores: the lane's K row in chunks of 4 x 16 bytes, the next chunk loaded while
        // this one is dotted with every query (the first in flight with V's first group)
        constexpr int KC = 4;
        static_assert((D/8) % KC == 0, "K in whole chunks");
        const uint4 * kr = (const uint4 *) (Kh + (int64_t) r*src.nbk1);
        auto load_k = [&](uint4 (&k)[KC], const int c0, const bool ok) {
#pragma unroll
            for (int c = 0; c < KC; ++c) {
                k[c] = ok ? kr[c0 + c] : make_uint4(0u, 0u, 0u, 0u);
            }
        };
        uint4 kc[KC];
        load_k(kc, 0, live);
        float sc[NQ];
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            sc[j] = 0.0f;
        }
#pragma unroll 1
        for (int c0 = 0; c0 < D/8; c0 += KC) {
            uint4 kn[KC];
            load_k(kn, c0 + KC, live && c0 + KC < D/8);
#pragma unroll
            for (int c = 0; c < KC; ++c) {
                const float2 k0 = __half22float2(*(const half2 *) &kc[c].x), k1 = __half22float2(*(const half2 *) &kc[c].y);
                const float2 k2 = __half22float2(*(const half2 *) &kc[c].z), k3 = __half22float2(*(const half2 *) &kc[c].w);
#pragma unroll
                for (int j = 0; j < NQ; ++j) {
                    const float4 qa = *(const float4 *) &sh_q[j][8*(c0 + c)];
                    const float4 qb = *(const float4 *) &sh_q[j][8*(c0 + c) + 4];
                    sc[j] += qa.x*k0.x + qa.y*k0.y + qa.z*k1.x + qa.w*k1.y + qb.x*k2.x + qb.y*k2.y + qb.z*k3.x + qb.w*k3.y;
                }
            }
#pragma unroll
            for (int c = 0; c < KC; ++c) {
                kc[c] = kn[c];
            }
        }
        float pr[NQ];
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            float x = sc[j];
            if (p.softcap != 0.0f) {
                x = p.softcap*tanhf(x);
            }
            // a masked row may hold anything (free or retired window cells): -inf whatever x is
            x = mk[j] == -INFINITY ? -INFINITY : x + mk[j];
            const float Mn = fmaxf(M[j], warp_reduce_max(x));
            const float cf = Mn == -INFINITY ? 1.0f : expf(M[j] - Mn);
            pr[j] = x == -INFINITY ? 0.0f : expf(x - Mn);
            L[j] = L[j]*cf + pr[j];
#pragma unroll
            for (int e = 0; e < 2*NV; ++e) {
                acc[j][e] *= cf;
            }
            M[j] = Mn;
        }
        // (a row some query sees holds a real token's bytes: a weight of 0 adds 0)
#pragma unroll 1
        for (int k0 = 0; k0 < WARP_SIZE; k0 += OSCAR_WIN_VG) {
            half2 vn[OSCAR_WIN_VG][NV];
            load_v(vn, k0 + OSCAR_WIN_VG, k0 + OSCAR_WIN_VG < WARP_SIZE ? lm >> (k0 + OSCAR_WIN_VG) : 0u);
#pragma unroll
            for (int k = 0; k < OSCAR_WIN_VG; ++k) {
#pragma unroll
                for (int j = 0; j < NQ; ++j) {
                    const float pk = __shfl_sync(0xffffffff, pr[j], k0 + k, WARP_SIZE);
#pragma unroll
                    for (int kk = 0; kk < NV; ++kk) {
                        const float2 vf = __half22float2(vc[k][kk]);
                        acc[j][2*kk]     += pk*vf.x;
                        acc[j][2*kk + 1] += pk*vf.y;
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < OSCAR_WIN_VG; ++k) {
#pragma unroll
                for (int kk = 0; kk < NV; ++kk) {
                    vc[k][kk] = vn[k][kk];
                }
            }
        }
    }

    // merge the warps
    __shared__ float sh_ml[OSCAR_FA_WARPS][NQ][2];
    __shared__ float sh_acc[OSCAR_FA_WARPS][NQ][D];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        const float l = warp_reduce_sum(L[j]);
        if (lane == 0) {
            sh_ml[w][j][0] = M[j];
            sh_ml[w][j][1] = l;
        }
#pragma unroll
        for (int kk = 0; kk < NV; ++kk) {
            sh_acc[w][j][64*kk + 2*lane]     = acc[j][2*kk];
            sh_acc[w][j][64*kk + 2*lane + 1] = acc[j][2*kk + 1];
        }
    }
    __syncthreads();
    store_block_partial<D, NQ, OSCAR_FA_WARPS>(sh_ml, sh_acc, p, nq, tok0, hkv, s3, part);
}
