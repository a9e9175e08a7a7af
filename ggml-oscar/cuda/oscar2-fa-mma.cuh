// oscar2-fa-mma.cuh: the INT2 decode attention on int8 tensor cores (included by oscar2-cuda.cu,
// after fa_source, fa_params and fa_partial_rows).
//
// Why: k_fa_int2 spends about 50 warp instructions per cache row (D = 128, 4 queries) on CUDA
// cores; at long context it runs far below the memory roofline. Here both products of a row go
// through mma.sync m16n8k32 (s8 x s8 -> s32), where the 2-bit codes are already small integers:
//   scores  S[q][r] = dK_r qd_q (Q8_q . C_r) + mK_r qsum_q         (A = queries, B = K codes)
//   output  O[q][e] = sum_r P'_qr CV_r[e] + sum_r p_qr mV_r        (A = P' = p dV, B = V codes)
// The query (per group) is an integer of 15 bits split into two int8 parts (x = 256 hi + lo), and
// P' (per 32 rows and group) one of 23 bits in three parts, so each product is two or three mma
// and exact in s32. The only roundings are those two quantizations. Emulated in numpy on the test
// cases: the query's costs 3-8e-5 of the output (as k_fa_int2's int16 query), P''s 2-5e-7; P' in
// 15 bits would have cost 1.3e-4, over the tests' 1e-4.
//
// Layout. A warp takes 32 rows per step: four K tiles of 8 rows. Lane (g = lane/4, qq = lane%4)
// is query g of the block (A rows g < 8; rows 8..15 are zero) and, in the C fragments, owns rows
// 8t + 2qq + e (t = 0..3, e = 0..1) of the step: their scores, softmax weights and headers. The
// same 8 rows are its k positions of the V product, so P' needs no shuffle; for V the lane loads
// one code word of each of those rows and transposes the bytes (prmt), so that 4 consecutive k
// (rows) of one output column (head dim) sit in one register. Code byte b of a group holds
// values b + s*G/4, s = 0..3, so a shift by 2s and a mask give 4 int8 codes of one s.
// The window's f16 rows, when there is a window, are blocks of the same launch (fa_partial_rows,
// scheduled first), so they overlap with the INT2 rows instead of costing a second launch.

#define OSCAR_MMA_BLOCKS_PER_SM 3 // launch bounds (12 warps per SM; ncu: 8 left the kernel latency-bound); fa_vec sizes its splits by it
#define OSCAR_MMA_ROWS 32         // rows per warp and step
#define OSCAR_MMA_QMAX 32512      // the query: 15-bit integers, 127*256, so hi = (x + 128) >> 8 fits int8
#define OSCAR_MMA_PMAX 8323072    // P': 23-bit integers, 127*65536, three int8 parts

// which (K, V, head dim, queries per block, window type) take k_fa_int2_mma
static constexpr __host__ __device__ bool uses_int2_mma(ggml_type kt, ggml_type vt, int D, int nqb, ggml_type wt) {
    return kt == vt && (kt == GGML_TYPE_OSCAR2 || kt == GGML_TYPE_OSCAR2_64) && (D == 64 || D == 128) &&
           D % group_of(kt) == 0 && nqb <= 8 && (wt == GGML_TYPE_COUNT || wt == GGML_TYPE_F16);
}

// C[16x8] += A[16x32] B[32x8] in s8 -> s32; A rows 8..15 are zero here (a1 = a3 = 0)
static __device__ __forceinline__ void mma_s8(int c[4], const int a0, const int a2, const int b0, const int b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(0), "r"(a2), "r"(0), "r"(b0), "r"(b1));
#else
    GGML_UNUSED(c); GGML_UNUSED(a0); GGML_UNUSED(a2); GGML_UNUSED(b0); GGML_UNUSED(b1);
    NO_DEVICE_CODE;
#endif
}

// four integers in [-128, 127] as the bytes of one register, first in the low byte
static __device__ __forceinline__ int pack_s8(const int x0, const int x1, const int x2, const int x3) {
    return (int) __byte_perm(__byte_perm(x0, x1, 0x0040), __byte_perm(x2, x3, 0x0040), 0x5410);
}

// x (|x| <= OSCAR_MMA_QMAX) = 256 hi + lo with hi in [-127, 127] and lo in [-128, 127]
static __device__ __forceinline__ void split_s15(const int x, int & hi, int & lo) {
    hi = (x + 128) >> 8;
    lo = x - 256*hi;
}

// x (|x| <= OSCAR_MMA_PMAX) = 65536 hi + 256 mid + lo, each in [-128, 127] (hi in [-127, 127])
static __device__ __forceinline__ void split_s23(const int x, int & hi, int & mid, int & lo) {
    int y;
    split_s15(x, y, lo); // |y| <= 32512
    split_s15(y, hi, mid);
}

// the byte transpose of four words: x[j] holds byte j of v0, v1, v2, v3 (in that order)
static __device__ __forceinline__ void transpose_bytes(const uint32_t v0, const uint32_t v1, const uint32_t v2, const uint32_t v3,
        uint32_t x[4]) {
    const uint32_t a = __byte_perm(v0, v1, 0x5140), b = __byte_perm(v0, v1, 0x7362);
    const uint32_t c = __byte_perm(v2, v3, 0x5140), d = __byte_perm(v2, v3, 0x7362);
    x[0] = __byte_perm(a, c, 0x5410);
    x[1] = __byte_perm(a, c, 0x7632);
    x[2] = __byte_perm(b, d, 0x5410);
    x[3] = __byte_perm(b, d, 0x7632);
}

static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1, WARP_SIZE));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2, WARP_SIZE));
}

static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1, WARP_SIZE);
    return x + __shfl_xor_sync(0xffffffff, x, 2, WARP_SIZE);
}

// Grid (n_head_kv*ne3, n_win_split + n_split, n_query_groups), 4 warps. Blocks y < ns_win run the
// window's rows (type WT; GGML_TYPE_COUNT: no window) through fa_partial_rows; the others take
// rows_per_split cache rows each. Partials: cache splits first, then the window's.
template <int D, ggml_type T, ggml_type WT, int NQB>
__launch_bounds__(OSCAR_FA_WARPS*WARP_SIZE, OSCAR_MMA_BLOCKS_PER_SM)
static __global__ void k_fa_int2_mma(const fa_source src, const fa_source win, const fa_params p, const int rows_per_split,
        const int ns_win, const int rows_per_win_split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    const int ns_main = gridDim.y - ns_win;
    if constexpr (WT != GGML_TYPE_COUNT) {
        if ((int) blockIdx.y < ns_win) {
            const int r0 = blockIdx.y*rows_per_win_split;
            fa_partial_rows<D, WT, WT, NQB>(win, p, r0, min(win.n_rows, r0 + rows_per_win_split), ns_main + blockIdx.y);
            return;
        }
    }
    constexpr int G   = group_of(T);
    constexpr int CB  = G/4;       // code bytes per group
    constexpr int BY  = 4 + CB;    // bytes per group: f16 d, f16 m, codes
    constexpr int NG  = D/G;       // groups per row
    constexpr int KB  = CB/4;      // code bytes of a group a lane takes for K (one quarter)
    constexpr int NW  = KB/4;      // ... as words: 2 (G = 128) or 1 (G = 64)
    constexpr int NC  = G/32;      // k32 steps per group
    constexpr int NTV = G/8;       // V tiles (8 head dims each) per group
    constexpr int R   = OSCAR_MMA_ROWS;
    static_assert(NW >= 1 && 2*NC == 4*NW && NG >= 1, "group layout");

    const int lane  = threadIdx.x;
    const int w     = threadIdx.y;
    const int g     = lane / 4;    // the lane's query, and its K row within a tile
    const int qq    = lane % 4;    // the lane's quarter of a group (K), its rows 2qq, 2qq+1 of a tile
    const int hkv   = blockIdx.x % p.n_head_kv;
    const int s3    = blockIdx.x / p.n_head_kv;
    const int NT    = NQB / p.gqa > 0 ? NQB / p.gqa : 1;
    const int tok0  = blockIdx.z*NT;
    const int nq    = min(NT, p.n_q - tok0)*p.gqa;
    const int split = blockIdx.y - (WT != GGML_TYPE_COUNT ? ns_win : 0);
    const int r0    = split*rows_per_split;
    const int r1    = min(src.n_rows, r0 + rows_per_split);
    const bool qok  = g < nq;
    const int tok   = tok0 + g / p.gqa;
    const int head  = hkv*p.gqa + g % p.gqa;

    // K element of the lane's register li (0..2NC-1) of a group, byte i: register li is word
    // li % NW of the lane's quarter shifted by 2*(li / NW); k32 step c uses registers 2c and 2c+1
    auto k_elem = [&](int li, int i) { return qq*KB + (li % NW)*4 + i + (li / NW)*CB; };

    // the query of this lane (g), per group: 15-bit integers split into int8 halves in A layout.
    // They stay in shared memory (read volatile, so not hoisted back into registers): 16 registers
    // fewer is what lets OSCAR_MMA_BLOCKS_PER_SM blocks fit without spilling the loop's state.
    __shared__ int sh_aq[OSCAR_FA_WARPS][NG][NC][2][2][WARP_SIZE]; // [w][gi][c][a0|a2][hi|lo][lane]
    volatile int * aq = &sh_aq[w][0][0][0][0][lane];
    auto aq_at = [&](int gi, int c, int k, int part) { return aq[(((gi*NC + c)*2 + k)*2 + part)*WARP_SIZE]; };
    float qd[NG], qs[NG];
    {
        const float * qptr = (const float *) (p.Q + (qok ? tok : tok0)*p.nbq1 + (qok ? head : hkv*p.gqa)*p.nbq2 + s3*p.nbq3);
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) {
            float x[2*NC][4], amax = 0.0f, sum = 0.0f;
#pragma unroll
            for (int li = 0; li < 2*NC; ++li) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    x[li][i] = qok ? qptr[gi*G + k_elem(li, i)]*p.scale : 0.0f;
                    sum += x[li][i];
                    amax = fmaxf(amax, fabsf(x[li][i]));
                }
            }
            amax = quad_max(amax);
            qs[gi] = quad_sum(sum);
            qd[gi] = amax/OSCAR_MMA_QMAX;
            const float inv = amax > 0.0f ? OSCAR_MMA_QMAX/amax : 0.0f;
#pragma unroll
            for (int li = 0; li < 2*NC; ++li) {
                int h[4], l[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    split_s15(__float2int_rn(x[li][i]*inv), h[i], l[i]);
                }
                aq[(((gi*NC + li/2)*2 + li%2)*2 + 0)*WARP_SIZE] = pack_s8(h[0], h[1], h[2], h[3]);
                aq[(((gi*NC + li/2)*2 + li%2)*2 + 1)*WARP_SIZE] = pack_s8(l[0], l[1], l[2], l[3]);
            }
        }
    }

    // online softmax state of query g; acc holds the lane's output columns (see the end)
    float M = -INFINITY, S = 0.0f, am[NG], acc[NG][NTV][2];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
        am[gi] = 0.0f;
#pragma unroll
        for (int tv = 0; tv < NTV; ++tv) {
            acc[gi][tv][0] = acc[gi][tv][1] = 0.0f;
        }
    }

    const half * mask = src.mask ? src.mask + (s3 % p.mask_ne3)*p.mask_nb3 : nullptr;
    const char * Kh = src.K + hkv*src.nbk2 + s3*src.nbk3;
    const char * Vh = src.V + hkv*src.nbv2 + s3*src.nbv3;
    const int vword = G == 128 ? g : g % 4; // the V code word of a row this lane loads
    const int nbk1 = (int) src.nbk1, nbv1 = (int) src.nbv1; // row strides: (int64) r*nb1 is one IMAD.WIDE

    // one step's code words, loaded a step ahead. Own rows i = 0..7 are rb + 8*(i/2) + 2qq + i%2
    // (t = i/2, e = i%2). The headers and the mask are read when the step is used: the code loads
    // have brought the headers' lines into L1 (the warp's code loads cover all 32 rows).
    struct step {
        uint32_t kw[4][NG][NW]; // K codes: tile t, row rb + 8t + g
        uint32_t vw[8][NG];     // V codes of own rows
    };
    // the int8 codes of K register li of a lane (see k_elem)
    auto kcodes = [&](const uint32_t * kw, int li) { return (int) ((kw[li % NW] >> (2*(li / NW))) & 0x03030303u); };
    auto own_row = [&](int rb, int i) {
        const int r = rb + 8*(i/2) + 2*qq + i%2;
        return r < r1 ? r : r0; // rows past the end: an in-range row, loaded and then masked
    };
    auto load_step = [&](step & st, const int rb) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int r = rb + 8*t + g;
            const char * kr = Kh + (int64_t) (r < r1 ? r : r0)*nbk1;
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
#pragma unroll
                for (int wi = 0; wi < NW; ++wi) {
                    st.kw[t][gi][wi] = *(const uint32_t *) (kr + gi*BY + 4 + qq*KB + 4*wi);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const char * vr = Vh + (int64_t) own_row(rb, i)*nbv1;
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                st.vw[i][gi] = *(const uint32_t *) (vr + gi*BY + 4 + 4*vword);
            }
        }
    };
    const half * mask_q = mask && qok ? mask + tok*p.mask_nb1 : nullptr;

    constexpr int STEP = OSCAR_FA_WARPS*R;
    step cur, nxt;
    int rb = r0 + w*R;
    if (rb < r1) {
        load_step(cur, rb);
    }
    for (; rb < r1; rb += STEP) {
        if (rb + STEP < r1) {
            load_step(nxt, rb + STEP);
        }
        // the mask of the own rows, issued first; then their scores
        float mk[8], sc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = rb + 8*(i/2) + 2*qq + i%2;
            mk[i] = (qok && r < r1) ? (mask_q ? __half2float(mask_q[r]) : 0.0f) : -INFINITY;
            sc[i] = 0.0f;
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                // the hi products, times 256, then the lo ones into the same accumulator:
                // one live C fragment (the product is at most 32512*3*G, far from 2^31)
                int cc[4] = {0, 0, 0, 0};
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    mma_s8(cc, aq_at(gi, c, 0, 0), aq_at(gi, c, 1, 0), kcodes(cur.kw[t][gi], 2*c), kcodes(cur.kw[t][gi], 2*c + 1));
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    cc[e] *= 256;
                }
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    mma_s8(cc, aq_at(gi, c, 0, 1), aq_at(gi, c, 1, 1), kcodes(cur.kw[t][gi], 2*c), kcodes(cur.kw[t][gi], 2*c + 1));
                }
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const char * kr = Kh + (int64_t) own_row(rb, 2*t + e)*nbk1;
                    const float2 dm = __half22float2(*(const half2 *) (kr + gi*BY));
                    sc[2*t + e] += dm.x*(qd[gi]*(float) cc[e]) + dm.y*qs[gi];
                }
            }
        }
        float cmax = -INFINITY;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float x = sc[i];
            if (p.softcap != 0.0f) {
                x = p.softcap*tanhf(x);
            }
            // a masked row may hold anything (unused cells): its score is -inf whatever x is
            sc[i] = mk[i] == -INFINITY ? -INFINITY : mk[i] + x;
            cmax = fmaxf(cmax, sc[i]);
        }
        cmax = quad_max(cmax); // the 4 lanes of query g hold its 32 rows
        if (cmax > M) {
            const float cf = expf(M - cmax);
            S *= cf;
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                am[gi] *= cf;
#pragma unroll
                for (int tv = 0; tv < NTV; ++tv) {
                    acc[gi][tv][0] *= cf;
                    acc[gi][tv][1] *= cf;
                }
            }
            M = cmax;
        }
        float pr[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            pr[i] = sc[i] == -INFINITY ? 0.0f : expf(sc[i] - M);
            S += pr[i];
        }
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) {
            // P' = p dV as 23-bit integers of one scale per query and step
            float pv[8], pmax = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const char * vr = Vh + (int64_t) own_row(rb, i)*nbv1;
                const float2 dm = __half22float2(*(const half2 *) (vr + gi*BY));
                pv[i] = pr[i] > 0.0f ? pr[i]*dm.x : 0.0f; // 0 * (bytes of a masked row) could be NaN
                am[gi] += pr[i] > 0.0f ? pr[i]*dm.y : 0.0f;
                pmax = fmaxf(pmax, fabsf(pv[i]));
            }
            pmax = quad_max(pmax);
            const float inv = pmax > 0.0f ? OSCAR_MMA_PMAX/pmax : 0.0f;
            const float psc = pmax/OSCAR_MMA_PMAX;
            int h[8], m[8], l[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                split_s23(__float2int_rn(pv[i]*inv), h[i], m[i], l[i]);
            }
            const int a0h = pack_s8(h[0], h[1], h[2], h[3]), a2h = pack_s8(h[4], h[5], h[6], h[7]);
            const int a0m = pack_s8(m[0], m[1], m[2], m[3]), a2m = pack_s8(m[4], m[5], m[6], m[7]);
            const int a0l = pack_s8(l[0], l[1], l[2], l[3]), a2l = pack_s8(l[4], l[5], l[6], l[7]);
            // V codes: k = own rows 0..3 (b0) and 4..7 (b1) of output column g
            uint32_t x0[4], x1[4];
            transpose_bytes(cur.vw[0][gi], cur.vw[1][gi], cur.vw[2][gi], cur.vw[3][gi], x0);
            transpose_bytes(cur.vw[4][gi], cur.vw[5][gi], cur.vw[6][gi], cur.vw[7][gi], x1);
#pragma unroll
            for (int tv = 0; tv < NTV; ++tv) {
                // tile tv is code byte j, shift s of the lane's word: G = 128 all four bytes;
                // G = 64 (4 words per group) bytes g/4 and 2 + g/4, so 8 lanes cover 8 columns
                const int s = G == 128 ? tv / 4 : tv / 2;
                uint32_t y0, y1;
                if constexpr (G == 128) {
                    y0 = x0[tv % 4];
                    y1 = x1[tv % 4];
                } else {
                    y0 = g < 4 ? x0[2*(tv % 2)] : x0[2*(tv % 2) + 1];
                    y1 = g < 4 ? x1[2*(tv % 2)] : x1[2*(tv % 2) + 1];
                }
                const int b0 = (int) ((y0 >> (2*s)) & 0x03030303u);
                const int b1 = (int) ((y1 >> (2*s)) & 0x03030303u);
                // hi, *256, mid, *256, lo in one accumulator (at most 8323072*3*32 < 2^31)
                int cc[4] = {0, 0, 0, 0};
                mma_s8(cc, a0h, a2h, b0, b1);
                cc[0] *= 256; cc[1] *= 256;
                mma_s8(cc, a0m, a2m, b0, b1);
                cc[0] *= 256; cc[1] *= 256;
                mma_s8(cc, a0l, a2l, b0, b1);
                acc[gi][tv][0] += psc*(float) cc[0];
                acc[gi][tv][1] += psc*(float) cc[1];
            }
        }
        cur = nxt;
    }

    // the lane's output columns: C column n = 2qq + e of tile tv is the column that lane g' = n
    // supplied as B, i.e. head dim gi*G + (G = 128) 4n + tv%4 + 32(tv/4)
    //                                   (G =  64) 4(n%4) + 2(tv%2) + n/4 + 16(tv/2)
    S = quad_sum(S);
    __shared__ float sh_ml[OSCAR_FA_WARPS][8][2];
    __shared__ float sh_acc[OSCAR_FA_WARPS][8][D];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
        am[gi] = quad_sum(am[gi]);
#pragma unroll
        for (int tv = 0; tv < NTV; ++tv) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int n = 2*qq + e;
                const int d = G == 128 ? 4*n + tv % 4 + 32*(tv / 4) : 4*(n % 4) + 2*(tv % 2) + n / 4 + 16*(tv / 2);
                sh_acc[w][g][gi*G + d] = acc[gi][tv][e] + am[gi];
            }
        }
    }
    if (qq == 0) {
        sh_ml[w][g][0] = M;
        sh_ml[w][g][1] = S;
    }
    __syncthreads();
    store_block_partial<D, 8, OSCAR_FA_WARPS>(sh_ml, sh_acc, p, nq, tok0, hkv, s3, split);
#else
    GGML_UNUSED(src); GGML_UNUSED(win); GGML_UNUSED(p); GGML_UNUSED(rows_per_split); GGML_UNUSED(ns_win);
    GGML_UNUSED(rows_per_win_split);
    NO_DEVICE_CODE;
#endif
}
