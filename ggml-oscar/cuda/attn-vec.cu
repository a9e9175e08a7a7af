// attn-vec.cu: the decode attention's split-KV kernels on CUDA cores: k_fa_int2 (oscar2 K and V
// of one type, up to 4 queries a block: the INT2 codes used as integers) and k_fa_partial (any
// pair of our row types: oscar2, f16, bf16; also the window rows when the tensor-core kernel is
// not taken). Each writes the partials that k_fa_combine merges (attn-common.cuh).
//
// Reference: the CPU flash attention, as for every attention file (attn-common.cuh); checked by
// test-backend-ops FLASH_ATTN_EXT (../tests/oscar2-backend-ops.inc: head sizes 64/128/256,
// GQA 1/4/8, mixed K/V pairs, window rows) and tests/test_oscar2_ops.py on CUDA0.

#include "attn-common.cuh"

// ---- k_fa_partial: one row per warp ------------------------------------------------------------
//
// Grid (n_head_kv*ne3, n_split, n_query_groups), 4 warps. A block takes the g query heads of one
// KV head and up to NT query tokens (NQ = g*NT queries), and rows [r0, r1) of one source: the
// oscar2 cache or the window. Lane t of a warp owns head dims t, t+32, ...: for oscar2 rows
// that is one byte of codes per 128 values, since byte b holds values b, b+32, b+64, b+96.
// A warp walks rows w, w+4, ...; per row it dots K with every query (warp sum), updates each
// query's running (max, sum, acc) and adds the row's V. The warps merge in shared memory and the
// block writes one partial (max, sum, acc) per query.

template <int D, ggml_type T>
static __device__ __forceinline__ void load_row(const char * __restrict__ row, float * __restrict__ out) {
    constexpr int EPL = D/WARP_SIZE;
    const int t = threadIdx.x;
    if constexpr (T == GGML_TYPE_F16) {
        const half * r = (const half *) row;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            out[i] = __half2float(r[t + WARP_SIZE*i]);
        }
    } else if constexpr (T == GGML_TYPE_BF16) {
        const nv_bfloat16 * r = (const nv_bfloat16 *) row;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            out[i] = __bfloat162float(r[t + WARP_SIZE*i]);
        }
    } else {
        constexpr int G     = group_of(T);
        constexpr int NB    = G/4;
        constexpr int BYTES = 4 + G/4;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int e   = t + WARP_SIZE*i;
            const int blk = e / G;
            const int o   = e % G;
            const uint8_t * bp = (const uint8_t *) row + blk*BYTES;
            const float d = group_d(bp);
            const float m = group_m(bp);
            const int q = (bp[4 + o % NB] >> (2*(o / NB))) & 3;
            out[i] = m + (float) q * d;
        }
    }
}

// one block's partial over rows [r0, r1) of src, written as partial number `part` (k_fa_partial's
// body; k_fa_int2_mma takes its f16 window rows with fa_window_rows_f16 instead)
template <int D, ggml_type KT, ggml_type VT, int NQ>
static __device__ __forceinline__ void fa_partial_rows(const fa_source & src, const fa_params & p, const int r0, const int r1, const int part) {
    constexpr int EPL = D/WARP_SIZE;
    const int t    = threadIdx.x;
    const int w    = threadIdx.y;
    const int hkv  = blockIdx.x % p.n_head_kv;
    const int s3   = blockIdx.x / p.n_head_kv;
    const int NT   = NQ / p.gqa > 0 ? NQ / p.gqa : 1;      // tokens this block could take
    const int tok0 = blockIdx.z*NT;
    const int nq   = min(NT, p.n_q - tok0)*p.gqa;            // real queries of this block

    // queries: j = tok*gqa + hh, head = hkv*gqa + hh, pre-scaled
    float q[NQ][EPL];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        const int tok = tok0 + j / p.gqa;
        const int head = hkv*p.gqa + j % p.gqa;
        const float * qp = (const float *) (p.Q + tok*p.nbq1 + head*p.nbq2 + s3*p.nbq3);
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            q[j][i] = j < nq ? qp[t + WARP_SIZE*i]*p.scale : 0.0f;
        }
    }

    float M[NQ], L[NQ], acc[NQ][EPL];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        M[j] = -INFINITY;
        L[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            acc[j][i] = 0.0f;
        }
    }

    const half * mask = src.mask ? src.mask + (s3 % p.mask_ne3)*p.mask_nb3 : nullptr;
    const char * Kh = src.K + hkv*src.nbk2 + s3*src.nbk3;
    const char * Vh = src.V + hkv*src.nbv2 + s3*src.nbv3;

    // tiles of U consecutive rows per warp: the loads of a tile are in flight together, and the
    // running max is rescaled once per tile instead of once per row
    constexpr int U = 4;
    for (int rb = r0 + w*U; rb < r1; rb += OSCAR_FA_WARPS*U) {
        float mv[U][NQ];
        bool any = false;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r = rb + u;
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                const int tok = tok0 + j / p.gqa;
                mv[u][j] = (j < nq && r < r1) ? (mask ? __half2float(mask[tok*p.mask_nb1 + r]) : 0.0f) : -INFINITY;
                any = any || mv[u][j] != -INFINITY;
            }
        }
        if (!any) {
            continue; // rows nobody sees (in the window, padding, other sequences) cost no bandwidth
        }
        float k[U][EPL], v[U][EPL];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (rb + u < r1) {
                load_row<D, KT>(Kh + (int64_t) (rb + u)*src.nbk1, k[u]);
                load_row<D, VT>(Vh + (int64_t) (rb + u)*src.nbv1, v[u]);
            } else {
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    k[u][i] = 0.0f;
                    v[u][i] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            float s[U];
            float smax = -INFINITY;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float x = 0.0f;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    x += q[j][i]*k[u][i];
                }
                x = warp_reduce_sum(x);
                x = __shfl_sync(0xffffffff, x, 0); // the same bits in every lane: one softmax state
                if (p.softcap != 0.0f) {
                    x = p.softcap*tanhf(x);
                }
                // a masked row may hold anything (free or retired window rows): -inf whatever x is
                s[u] = mv[u][j] == -INFINITY ? -INFINITY : x + mv[u][j];
                smax = fmaxf(smax, s[u]);
            }
            if (smax == -INFINITY) {
                continue;
            }
            const float Mn = fmaxf(M[j], smax);
            const float c  = expf(M[j] - Mn);
            L[j] *= c;
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                acc[j][i] *= c;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (s[u] == -INFINITY) {
                    continue; // keeps the bytes of masked rows out of the sums (0 * inf = NaN)
                }
                const float e = expf(s[u] - Mn);
                L[j] += e;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    acc[j][i] += e*v[u][i];
                }
            }
            M[j] = Mn;
        }
    }

    // merge the warps
    __shared__ float sh_ml[OSCAR_FA_WARPS][NQ][2];
    __shared__ float sh_acc[OSCAR_FA_WARPS][NQ][D];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        if (t == 0) {
            sh_ml[w][j][0] = M[j];
            sh_ml[w][j][1] = L[j];
        }
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            sh_acc[w][j][t + WARP_SIZE*i] = acc[j][i];
        }
    }
    __syncthreads();
    store_block_partial<D, NQ, OSCAR_FA_WARPS>(sh_ml, sh_acc, p, nq, tok0, hkv, s3, part);
}

template <int D, ggml_type KT, ggml_type VT, int NQ>
__launch_bounds__(OSCAR_FA_WARPS*WARP_SIZE, 1)
static __global__ void k_fa_partial(const fa_source src, const fa_params p, const int rows_per_split) {
    const int r0 = blockIdx.y*rows_per_split;
    fa_partial_rows<D, KT, VT, NQ>(src, p, r0, min(src.n_rows, r0 + rows_per_split), p.part0 + blockIdx.y);
}

// ---- k_fa_int2: the INT2 rows as integers (oscar2 K and V of one type, up to 4 queries) --------
//
// Taken where the tensor-core kernel (k_fa_int2_mma, attn-mma.cu) is not: before sm_80, for head
// size 256, or with a window that is not f16. Compared with k_fa_partial, a row is not spread
// over the whole warp: a team of L = D/16 lanes takes one row, each lane one 4-byte word of codes
// (16 values of one group) and that group's header, so a warp reads 32/L rows per step with no
// per-row warp reduction. Because every value of a lane's word shares one (d, m),
//   K.q = sum_lanes (d * sum_e q_e c_e + m * sum_e q_e)   and   V: acc_e += p d c_e, am += p m,
// so the codes are used as small integers and m costs one FMA per row. Each lane keeps its own
// online-softmax state for its 16 values; teams and warps merge once, at the end.

#define OSCAR_INT2_UNROLL 2

// a byte (0..255) of `w` as a float, exactly: the byte goes into the mantissa of 2^23
static __device__ __forceinline__ float byte_as_float(uint32_t w, int j) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 + j)) - 8388608.0f;
}

template <int D, ggml_type T, int NQ>
__launch_bounds__(OSCAR_FA_WARPS*WARP_SIZE, OSCAR_INT2_BLOCKS_PER_SM)
static __global__ void k_fa_int2(const fa_source src, const fa_params p, const int rows_per_split) {
    constexpr int G   = group_of(T);
    constexpr int CB  = G/4;               // code bytes per group
    constexpr int BY  = 4 + CB;            // bytes per group
    constexpr int L   = D/16;              // lanes per row: one 4-byte word of codes each
    constexpr int RPW = WARP_SIZE/L;       // rows per warp and step
    constexpr int U   = OSCAR_INT2_UNROLL;
    static_assert(CB % 4 == 0 && WARP_SIZE % L == 0, "word layout");

    const int t    = threadIdx.x;
    const int w    = threadIdx.y;
    const int team = t / L;
    const int l    = t % L;
    const int hkv  = blockIdx.x % p.n_head_kv;
    const int s3   = blockIdx.x / p.n_head_kv;
    const int NT   = NQ / p.gqa > 0 ? NQ / p.gqa : 1;
    const int tok0 = blockIdx.z*NT;
    const int nq   = min(NT, p.n_q - tok0)*p.gqa;
    const int r0   = blockIdx.y*rows_per_split;
    const int r1   = min(src.n_rows, r0 + rows_per_split);

    // this lane's word: group blk, code bytes bb0..bb0+3 of it; value (j, s) is element
    // blk*G + bb0 + j + s*CB and sits at bits 8j + 2s of the word, so (word >> 2s) & 0x03030303
    // holds the codes of the values (0..3, s) as four bytes
    const int blk = (4*l) / CB;
    const int bb0 = (4*l) % CB;
    const int off_hdr  = blk*BY;
    const int off_word = blk*BY + 4 + bb0;

    // the query as int16 with one scale per lane and query, packed in pairs like the codes: K.q
    // of a lane is then eight dp2a (int16 x int8) on integers, exact, instead of 16 float FMAs and
    // 16 code conversions. The rounding of q to 1/32767 of its largest value costs ~3e-5 of the
    // output (measured against float64 on the test cases); int8 (llama.cpp's q8_1) cost ~1e-2.
    // qs keeps the exact float sum for the min term.
    int qlo[NQ][4], qhi[NQ][4]; // (q(0,s), q(1,s)) and (q(2,s), q(3,s)) as int16 pairs
    float qd[NQ], qs[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        const int tok  = tok0 + j / p.gqa;
        const int head = hkv*p.gqa + j % p.gqa;
        const float * qptr = (const float *) (p.Q + tok*p.nbq1 + head*p.nbq2 + s3*p.nbq3);
        float x[16], amax = 0.0f;
        qs[j] = 0.0f;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                x[4*jj + s] = j < nq ? qptr[blk*G + bb0 + jj + s*CB]*p.scale : 0.0f;
                qs[j] += x[4*jj + s];
                amax = fmaxf(amax, fabsf(x[4*jj + s]));
            }
        }
        qd[j] = amax/32767.0f;
        const float inv = amax > 0.0f ? 32767.0f/amax : 0.0f;
        auto i16 = [&](int i) { return (uint32_t) (__float2int_rn(x[i]*inv) & 0xffff); };
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            qlo[j][s] = (int) (i16(0*4 + s) | i16(1*4 + s) << 16);
            qhi[j][s] = (int) (i16(2*4 + s) | i16(3*4 + s) << 16);
        }
    }

    float M[NQ], S[NQ], am[NQ], acc[NQ][16];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        M[j] = -INFINITY;
        S[j] = 0.0f;
        am[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            acc[j][i] = 0.0f;
        }
    }

    const half * mask = src.mask ? src.mask + (s3 % p.mask_ne3)*p.mask_nb3 : nullptr;
    const char * Kh = src.K + hkv*src.nbk2 + s3*src.nbk3;
    const char * Vh = src.V + hkv*src.nbv2 + s3*src.nbv3;

    // one tile = U rows per team; the next tile's loads are issued before this tile's math, and
    // the mask is loaded beside K and V (not before them), so a step waits for one round trip
    struct tile {
        uint32_t kw[U], vw[U];
        half2 kdm[U], vdm[U];
        half mk[U][NQ];
    };
    auto load_tile = [&](tile & tl, const int rb) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r  = rb + u*RPW + team;
            const bool in = r < r1;
            const int rr = in ? r : r0; // an in-range row: its bytes are loaded and then ignored
            const char * kr = Kh + (int64_t) rr*src.nbk1;
            const char * vr = Vh + (int64_t) rr*src.nbv1;
            tl.kw[u]  = *(const uint32_t *) (kr + off_word);
            tl.vw[u]  = *(const uint32_t *) (vr + off_word);
            tl.kdm[u] = *(const half2 *) (kr + off_hdr);
            tl.vdm[u] = *(const half2 *) (vr + off_hdr);
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                const int tok = tok0 + j / p.gqa;
                tl.mk[u][j] = (j < nq && in) ? (mask ? mask[tok*p.mask_nb1 + rr] : __float2half(0.0f)) : __float2half(-INFINITY);
            }
        }
    };

    constexpr int STEP = OSCAR_FA_WARPS*RPW*U;
    tile cur, nxt;
    int rb = r0 + w*RPW*U;
    if (rb < r1) {
        load_tile(cur, rb);
    }
    for (; rb < r1; rb += STEP) {
        if (rb + STEP < r1) {
            load_tile(nxt, rb + STEP);
        }
        float sc[U][NQ];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float2 dm = __half22float2(cur.kdm[u]);
            int kc[4];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                kc[s] = (int) ((cur.kw[u] >> (2*s)) & 0x03030303u);
            }
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                int isum = 0;
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    isum = __dp2a_lo(qlo[j][s], kc[s], isum); // codes (0, s), (1, s)
                    isum = __dp2a_hi(qhi[j][s], kc[s], isum); // codes (2, s), (3, s)
                }
                float x = dm.x*(qd[j]*(float) isum) + dm.y*qs[j];
                // a butterfly: every lane of the team ends with the same sum, bit for bit, since
                // each step adds the same two values on both lanes (a + b == b + a)
#pragma unroll
                for (int off = L/2; off > 0; off >>= 1) {
                    x += __shfl_xor_sync(0xffffffff, x, off, WARP_SIZE);
                }
                if (p.softcap != 0.0f) {
                    x = p.softcap*tanhf(x);
                }
                const float mk = __half2float(cur.mk[u][j]);
                // a masked row may hold anything (unused cells): its score is -inf whatever x is
                sc[u][j] = mk == -INFINITY ? -INFINITY : mk + x;
            }
        }
        // the V codes of the tile as floats, shared by all queries
        float cv[U][16];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const uint32_t b = (cur.vw[u] >> (2*s)) & 0x03030303u;
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    cv[u][4*jj + s] = byte_as_float(b, jj);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            float smax = -INFINITY;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                smax = fmaxf(smax, sc[u][j]);
            }
            if (smax > M[j]) {
                // rescale only when the maximum grows: after the first rows that is rare
                const float cf = expf(M[j] - smax);
                S[j]  *= cf;
                am[j] *= cf;
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    acc[j][i] *= cf;
                }
                M[j] = smax;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (sc[u][j] == -INFINITY) {
                    continue; // keeps the bytes of masked rows out of the sums
                }
                const float e = expf(sc[u][j] - M[j]);
                const float2 dm = __half22float2(cur.vdm[u]);
                const float pd = e*dm.x;
                S[j]  += e;
                am[j] += e*dm.y;
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    acc[j][i] += pd*cv[u][i];
                }
            }
        }
        cur = nxt;
    }

    // merge the RPW teams of every warp, then the warps: one (M, S, acc) per query for the block
    constexpr int NP = OSCAR_FA_WARPS*RPW;
    __shared__ float sh_ml[NP][NQ][2];
    __shared__ float sh_acc[NP][NQ][D];
    const int pi = w*RPW + team;
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        if (l == 0) {
            sh_ml[pi][j][0] = M[j];
            sh_ml[pi][j][1] = S[j];
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                sh_acc[pi][j][blk*G + bb0 + jj + s*CB] = acc[j][4*jj + s] + am[j];
            }
        }
    }
    __syncthreads();
    store_block_partial<D, NQ, NP>(sh_ml, sh_acc, p, nq, tok0, hkv, s3, p.part0 + blockIdx.y);
}

template <int D, ggml_type KT, ggml_type VT, int NQ>
static void launch_partial_nq(const fa_source & src, const fa_params & p, int n_split, int rows_per_split, int n_groups, cudaStream_t stream) {
    const dim3 grid(p.n_head_kv*p.ne3, n_split, n_groups);
    const dim3 block(WARP_SIZE, OSCAR_FA_WARPS, 1);
    if constexpr (uses_int2_kernel(KT, VT, NQ)) {
        k_fa_int2<D, KT, NQ><<<grid, block, 0, stream>>>(src, p, rows_per_split);
    } else {
        k_fa_partial<D, KT, VT, NQ><<<grid, block, 0, stream>>>(src, p, rows_per_split);
    }
    CUDA_CHECK(cudaGetLastError());
}

template <int D, ggml_type KT, ggml_type VT>
static void launch_partial(const fa_source & src, const fa_params & p, int nqb, int n_split, int rows_per_split, int n_groups, cudaStream_t stream) {
    switch (nqb) {
        case  1: launch_partial_nq<D, KT, VT,  1>(src, p, n_split, rows_per_split, n_groups, stream); break;
        case  2: launch_partial_nq<D, KT, VT,  2>(src, p, n_split, rows_per_split, n_groups, stream); break;
        case  4: launch_partial_nq<D, KT, VT,  4>(src, p, n_split, rows_per_split, n_groups, stream); break;
        case  8: launch_partial_nq<D, KT, VT,  8>(src, p, n_split, rows_per_split, n_groups, stream); break;
        default:
            if constexpr (D <= 128) {
                launch_partial_nq<D, KT, VT, 16>(src, p, n_split, rows_per_split, n_groups, stream);
            } else {
                GGML_ABORT("oscar2 attention: too many queries per block for D = %d", D);
            }
            break;
    }
}

// the (K, V) type pairs we instantiate: the oscar2 pairs, their mixes with f16, and the window
template <int D>
static bool launch_partial_types(ggml_type kt, ggml_type vt, const fa_source & src, const fa_params & p, int nqb,
        int n_split, int rows_per_split, int n_groups, cudaStream_t stream) {
#define OSCAR_FA_CASE(KT_, VT_) \
    if (kt == KT_ && vt == VT_) { launch_partial<D, KT_, VT_>(src, p, nqb, n_split, rows_per_split, n_groups, stream); return true; }
    if constexpr (D % QK_OSCAR2 == 0) {
        OSCAR_FA_CASE(GGML_TYPE_OSCAR2, GGML_TYPE_OSCAR2)
        OSCAR_FA_CASE(GGML_TYPE_OSCAR2, GGML_TYPE_F16)
        OSCAR_FA_CASE(GGML_TYPE_F16,    GGML_TYPE_OSCAR2)
    }
    OSCAR_FA_CASE(GGML_TYPE_OSCAR2_64, GGML_TYPE_OSCAR2_64)
    OSCAR_FA_CASE(GGML_TYPE_OSCAR2_64, GGML_TYPE_F16)
    OSCAR_FA_CASE(GGML_TYPE_F16,       GGML_TYPE_OSCAR2_64)
    OSCAR_FA_CASE(GGML_TYPE_F16,       GGML_TYPE_F16)
    OSCAR_FA_CASE(GGML_TYPE_BF16,      GGML_TYPE_BF16)
#undef OSCAR_FA_CASE
    return false;
}

bool oscar2_cuda_fa_partials(int D, ggml_type kt, ggml_type vt, const fa_source & src, const fa_params & p, int nqb,
        int n_split, int rows_per_split, int n_groups, cudaStream_t stream) {
    switch (D) {
        case  64: return launch_partial_types< 64>(kt, vt, src, p, nqb, n_split, rows_per_split, n_groups, stream);
        case 128: return launch_partial_types<128>(kt, vt, src, p, nqb, n_split, rows_per_split, n_groups, stream);
        case 256: return launch_partial_types<256>(kt, vt, src, p, nqb, n_split, rows_per_split, n_groups, stream);
        default:  return false;
    }
}
