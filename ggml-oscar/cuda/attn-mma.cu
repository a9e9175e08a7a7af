// attn-mma.cu: the decode attention over an INT2 cache on tensor cores (k_fa_int2_mma): oscar2 K
// and V of one type, head size 64 or 128, up to 8 queries a block, sm_80 and newer; the f16
// window's chunks in the same launch (attn-window.cuh). The long-context decode's hot loop.
//
// Reference: the CPU flash attention (attn-common.cuh); checked by test-backend-ops
// FLASH_ATTN_EXT and OSCAR_ROTATE_STORE (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh
// test`) and by tests/test_oscar2_ops.py on CUDA0, whose tolerance (1e-4 of the largest output)
// the number formats below are chosen to meet.
//
// Why: k_fa_int2 spends about 50 warp instructions per cache row (D = 128, 4 queries) on CUDA
// cores; at long context it runs far below the memory roofline. Here both products of a row go
// through tensor cores:
//   scores  S[q][r] = dK_r qd_q (Q8_q . C_r) + mK_r qsum_q          (mma m16n8k32 s8 x s8 -> s32:
//                                                                    A = queries, B = K codes)
//   output  O[q][e] = sum_r CV_r[e] P'_qr + sum_r p_qr mV_r         (mma m16n8k16 f16 x f16 -> f32:
//                                                                    A = V codes, B = P' = p dV)
// The query (per group) is an integer of 15 bits split into two int8 parts (x = 256 hi + lo), so
// the score's product is exact in s32. P' goes in as two f16 parts, hi = f16(P') and lo =
// f16(P' - hi): 22 bits. A V code c enters the f16 product as the subnormal c 2^-16: the code
// in mantissa bits 8 and 9 with a zero exponent (a shift and a mask, no conversion), so the V
// product is 2^-16 C, with no offset to take off.
// Why not the code where it lies (bits 2s, 2s+1 of the low byte, c 4^s 2^-24: no shift): the
// H100's tensor cores multiply such subnormals exactly one by one, but apparently sum them with
// fewer bits (they sit up to 8 bits below the smallest normal): 1.6e-4 of the largest output at
// 300 rows, over the tests' 1e-4. And why not 1 + c/4 (bits 8 and 9 of 1.0): C = 4 (acc -
// sum_r P'_r), and that subtraction amplifies the f32 sum's rounding to 6e-5 of the largest
// output at 32768 rows (numpy emulation). P' as one f16 part alone was 6e-5 to 2e-4 there.
// Why an f16 V product rather than int8: int8 needs P' in three int8 parts of a 23-bit integer,
// 24 mma, 64 integer multiplies and 32 I2F per 32-row step for D = 128; f16 needs 32 HMMA and no
// conversions.
//
// No A row is wasted in the K product: it stacks the query's hi parts (rows 0..7) over its lo
// parts (rows 8..15); the V product puts 16 head dims in A's rows. Details above the kernel.

#include "attn-window.cuh"

#include <climits>

#define OSCAR_MMA_ROWS 32         // rows per warp and step
#define OSCAR_MMA_QMAX 32512      // the query: 15-bit integers, 127*256, so hi = (x + 128) >> 8 fits int8
#define OSCAR_CODE_UNSCALE 65536.0f // 2^16: a V product over codes_f16x2 back to the codes' sum

// The kernel's helpers, for sm_80 and newer only, where k_fa_int2_mma has its body (the
// tensor-core instructions exist from sm_80 on)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE

// four integers in [-128, 127] as the bytes of one register, first in the low byte
static __device__ __forceinline__ int pack_s8(const int x0, const int x1, const int x2, const int x3) {
    return (int) __byte_perm(__byte_perm(x0, x1, 0x0040), __byte_perm(x2, x3, 0x0040), 0x5410);
}

// x (|x| <= OSCAR_MMA_QMAX) = 256 hi + lo with hi in [-127, 127] and lo in [-128, 127]
static __device__ __forceinline__ void split_s15(const int x, int & hi, int & lo) {
    hi = (x + 128) >> 8;
    lo = x - 256*hi;
}

static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1, WARP_SIZE));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2, WARP_SIZE));
}

static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1, WARP_SIZE);
    return x + __shfl_xor_sync(0xffffffff, x, 2, WARP_SIZE);
}

// 16 bytes of shared memory as one ld.shared.v4, volatile so that the loop reads them each time
// instead of keeping them in registers (the reason they live in shared memory)
static __device__ __forceinline__ void lds_v4(const int * ptr, int & x0, int & x1, int & x2, int & x3) {
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "r"((unsigned) __cvta_generic_to_shared(ptr)));
}

// C[16x8] += A[16x32] B[32x8] in s8 -> s32
static __device__ __forceinline__ void mma_s8(int c[4], const int a0, const int a1, const int a2, const int a3,
        const int b0, const int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// C[16x8] += A[16x16] B[16x8] in f16 -> f32 (A row-major, B column-major)
static __device__ __forceinline__ void mma_f16(float c[4], const uint32_t a0, const uint32_t a1, const uint32_t a2, const uint32_t a3,
        const uint32_t b0, const uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the f16 pair (c_x 2^-16, c_y 2^-16), subnormals, of the 2-bit codes at bit 2s of byte 1 and
// byte 3 of x
static __device__ __forceinline__ uint32_t codes_f16x2(const uint32_t x, const int s) {
    return (x >> (2*s)) & 0x03000300u;
}

#endif // sm_80 and newer

// Grid (n_head_kv*ne3, max(ns_main, win0 + ns_win), n_query_groups), 4 warps. Block y runs window
// chunk y - win0 (rows_per_win_split rows of type WT; GGML_TYPE_COUNT: no window) through
// fa_window_rows_f16 if that is one of the ns_win, then cache split y if that is one of the
// ns_main: rows_lite rows for the splits that took a window chunk (win0 = 0, y < ns_win),
// rows_per_split for the others. Partials: cache splits first, then the window's. Why the window
// shares the cache's blocks (win0 = 0) at depth: as blocks of their own they either push part of
// the cache's blocks into a second wave (scheduled first) or end after them (scheduled last),
// with most SMs idle meanwhile; a few window rows more in some blocks cost far less than that.
// With fewer cache splits than window chunks (small depths, or many streams) the window's blocks
// are their own (win0 = ns_main) and come after the cache's: at small depths all fit in one
// wave; with many streams the cache's blocks, each far longer than a chunk, fill the waves and
// the chunks fill in behind them, rather than delaying every cache block by a chunk.
// With live-chunk lists (attn-live.cu; ns_win = ns_main, win0 = 0) block y takes the y-th share of
// its group's live window chunks (win.live), then (LIST: src.live) the y-th share of its group's
// live cache chunks.
//
// A step of a warp is 32 rows. Lane (g, qq) owns rows 8t + 2qq + e (t = 0..3, e = 0, 1; own row
// i = 2t + e) of it: they are the C entries of its query g in the K product (K tile t is rows
// 8t..8t+7, column n the row 8t + n), and the k positions of its B (P') and A (V codes)
// fragments in the V product (k16 step h: own rows 4h..4h+3 at k = 2qq, 2qq+1, 2qq+8, 2qq+9).
// So nothing moves between lanes but the per-query scales.
//   K product: A = [query hi parts (rows 0..7); query lo parts (rows 8..15)], B = K codes, so one
//              mma gives both halves: score = 256 C[g] + C[g + 8].
//   V product: O^T = V^T P'^T: A = V codes (16 head dims x 16 rows), B = P' (16 rows x 8 queries,
//              f16), two k16 steps. Lane (g, qq) loads one code word of each own row and pairs
//              the bytes of two rows (prmt); its A rows g and g+8 of V tile mt are head dims
//              vdim(g, mt, 0) and vdim(g, mt, 1) (see below). C gives it those dims of queries
//              2qq and 2qq + 1.
// Packed (PK: at most 4 queries a block, as one token of a GQA-4 model). Only A rows 0..3 and
// 8..11 of the K product hold a query, so the lanes of queries 4..7 would score nothing. Instead
// lane (g, qq) scores query g % 4 on the rows of k16 step u = g / 4 (tiles 2u, 2u+1: 4 own rows,
// not 8): lanes g >= 4 get the integer products of tiles 2 and 3 from lane ^ 16 (4 shuffles a
// group). The V product's B columns are the hi parts of queries 0..3 (columns 0..3) and their
// lo parts (4..7), so one mma per V tile and k16 step takes both parts (16 HMMA a step, not 32);
// a lane's B fragment of the other step comes from lane ^ 16, and the two columns of a query are
// summed at the end. Same products, half the per-row work: for 8B models' decode (GQA 4).
template <int D, ggml_type T, ggml_type WT, int NQB, bool LIST>
__launch_bounds__(OSCAR_FA_WARPS*WARP_SIZE, OSCAR_MMA_BLOCKS_PER_SM)
static __global__ void k_fa_int2_mma(const fa_source src, const fa_source win, const fa_params p, const int win0,
        const int ns_main, const int rows_per_split, const int ns_win, const int rows_per_win_split, const int rows_lite) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    // the combine after this launch may be scheduled now (it waits for this grid's end before it
    // reads anything): its blocks fit an SM only beside fewer than OSCAR_MMA_BLOCKS_PER_SM of
    // these, so they start as this grid's last blocks finish
    ggml_cuda_pdl_lc();
    // launched as a programmatic dependent (oscar2-common.cuh): q and the cache rows come from the
    // kernels before; every block waits, those that have no rows too
    ggml_cuda_pdl_sync();
    const int hkv   = blockIdx.x % p.n_head_kv;
    const int s3    = blockIdx.x / p.n_head_kv;
    const int NT    = NQB / p.gqa > 0 ? NQB / p.gqa : 1;
    const int tok0  = blockIdx.z*NT;
    const int nq    = min(NT, p.n_q - tok0)*p.gqa;
    // share k of n_share of this group's live-chunk list of s (attn-live.cu): entries [i0, i1),
    // the shares' sizes differing by one at most
    auto list_share = [&](const fa_source & s, const int n_share, const int k, int & i0, int & i1) {
        const int gl  = (s3 % p.mask_ne3)*(int) gridDim.z + (int) blockIdx.z;
        const int n   = s.live_count[gl];
        i0 = k*n/n_share;
        i1 = (k + 1)*n/n_share;
        return s.live + (int64_t) gl*s.live_stride;
    };
    if constexpr (WT != GGML_TYPE_COUNT) {
        static_assert(WT == GGML_TYPE_F16, "the window's rows: f16 (uses_int2_mma)");
        const int chunk = (int) blockIdx.y - win0;
        if (chunk >= 0 && chunk < ns_win) {
            // rows [r0, r1) of the window, or (with the window's lists: win0 = 0) the block's
            // share [r0, r1) of its group's live window chunks (attn-decode.cu). One call of the
            // window's code either way (it is large, and fetched cold each layer in the model).
            int r0 = chunk*rows_per_win_split, r1 = min(win.n_rows, r0 + rows_per_win_split);
            const int * list = nullptr;
            if (win.live) {
                list = list_share(win, ns_win, chunk, r0, r1);
                if (r0 >= r1) {
                    store_empty_partial(p, nq, tok0, hkv, s3, ns_main + chunk);
                }
            }
            // (its shared memory is its own: no barrier is needed before the cache's part)
            if (r0 < r1) {
                fa_window_rows_f16<D, NQB>(win, p, r0, r1, ns_main + chunk, list);
            }
        }
    }
    const int split = (int) blockIdx.y;
    if (split < 0 || split >= ns_main) {
        return;
    }
    constexpr int G   = group_of(T);
    constexpr int CB  = G/4;       // code bytes per group
    constexpr int BY  = 4 + CB;    // bytes per group: f16 d, f16 m, codes
    constexpr int NG  = D/G;       // groups per row
    constexpr int KB  = CB/4;      // code bytes of a group a lane takes for K (one quarter)
    constexpr int NW  = KB/4;      // ... as words: 2 (G = 128) or 1 (G = 64)
    constexpr int NC  = G/32;      // k32 steps per group
    constexpr int NTV = G/16;      // V tiles (16 head dims each) per group
    static_assert(NW >= 1 && 2*NC == 4*NW && NG >= 1, "group layout");

    const int lane  = threadIdx.x;
    const int w     = threadIdx.y;
    const int g     = lane / 4;    // the lane's query, its K tile column, its V tile rows g and g+8
    const int qq    = lane % 4;    // the lane's quarter of a group (K), its own rows 4qq + i, 16 + 4qq + i
    // the splits that also took a window chunk (win0 = 0: splits 0 .. ns_win-1) have rows_lite rows
    const int n_lite = win0 == 0 ? min(ns_win, ns_main) : 0;
    const int r0    = split < n_lite ? split*rows_lite : n_lite*rows_lite + (split - n_lite)*rows_per_split;
    const int r1    = min(src.n_rows, r0 + (split < n_lite ? rows_lite : rows_per_split));
    // LIST: the block takes its share [i0, i1) of its group's live chunks instead (attn-live.cu)
    const int * live = nullptr;
    int i0 = 0, i1 = 0;
    if constexpr (LIST) {
        live = list_share(src, ns_main, split, i0, i1);
    }
    // no rows (a split that took a window chunk and left its cache rows to the others, or an
    // empty share of a live list): an empty partial, without the query's preparation and the
    // partial's merge, most of such a block's time after its chunk
    if (LIST ? i0 >= i1 : r0 >= r1) {
        store_empty_partial(p, nq, tok0, hkv, s3, split);
        return;
    }
    const bool qok  = g < nq;      // the lane's A rows (query g) hold a query
    const int tok   = tok0 + g / p.gqa;
    const int head  = hkv*p.gqa + g % p.gqa;
    // PK (at most 4 queries): the query whose scores the lane takes, and which half of the rows
    // (tiles 2u and 2u+1: k16 step u of the V product); see "Packed" above the kernel
    constexpr bool PK = NQB <= 4;
    constexpr int  NO = PK ? 4 : 8; // own rows per lane and step
    const int u     = PK ? g / 4 : 0;
    const int gq    = PK ? g % 4 : g;
    const bool sok  = gq < nq;
    const int stok  = tok0 + gq / p.gqa;

    // K element of the lane's register li (0..2NC-1) of a group, byte i: register li is word
    // li % NW of the lane's quarter shifted by 2*(li / NW); k32 step c uses registers 2c and 2c+1
    auto k_elem = [&](int li, int i) { return qq*KB + (li % NW)*4 + i + (li / NW)*CB; };
    // V: code byte b of a group holds head dims b + s*G/4 (s = 0..3). For tile mt the lane takes
    // byte jv(mt) of its word and shifts sv(mt) (A row g) and sv(mt) + 1 (A row g + 8)
    const int vword = G == 128 ? g : g % 4; // the V code word of a row this lane loads
    auto jv = [&](int mt) { return G == 128 ? mt % 4 : mt; };
    auto sv = [&](int mt) { return G == 128 ? 2*(mt / 4) : 2*(g / 4); };

    // the query of this lane (g), per group: 15-bit integers x = 256 hi + lo, as the A fragment
    // {hi, lo, hi, lo} of each k32 step (A rows g and g + 8). In shared memory, read volatile:
    // 16 registers fewer is what lets OSCAR_MMA_BLOCKS_PER_SM blocks fit without spilling.
    __shared__ int4 sh_aq[OSCAR_FA_WARPS][NG][NC][WARP_SIZE];
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
            for (int c = 0; c < NC; ++c) {
                int h[2][4], l[2][4];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        split_s15(__float2int_rn(x[2*c + k][i]*inv), h[k][i], l[k][i]);
                    }
                }
                sh_aq[w][gi][c][lane] = make_int4(pack_s8(h[0][0], h[0][1], h[0][2], h[0][3]), pack_s8(l[0][0], l[0][1], l[0][2], l[0][3]),
                                                  pack_s8(h[1][0], h[1][1], h[1][2], h[1][3]), pack_s8(l[1][0], l[1][1], l[1][2], l[1][3]));
            }
        }
    }
    __syncwarp();
    if constexpr (PK) {
        // the upper lanes score the query of the lane 16 below them
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) {
            const float d = __shfl_xor_sync(0xffffffff, qd[gi], 16, WARP_SIZE);
            const float s = __shfl_xor_sync(0xffffffff, qs[gi], 16, WARP_SIZE);
            qd[gi] = u ? d : qd[gi];
            qs[gi] = u ? s : qs[gi];
        }
    }

    // online softmax state of query g (M, S, am: sum of p mV per group, in the lanes of query g);
    // acc[gi][mt][k]: C entry k of V tile mt, i.e. queries 2qq (k even) and 2qq + 1, dims vdim:
    // sum of c 2^-16 P'
    float M = -INFINITY, S = 0.0f, am[NG], acc[NG][NTV][4];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
        am[gi] = 0.0f;
#pragma unroll
        for (int mt = 0; mt < NTV; ++mt) {
            acc[gi][mt][0] = acc[gi][mt][1] = acc[gi][mt][2] = acc[gi][mt][3] = 0.0f;
        }
    }

    const half * mask = src.mask ? src.mask + (s3 % p.mask_ne3)*p.mask_nb3 : nullptr;
    const char * Kh = src.K + hkv*src.nbk2 + s3*src.nbk3;
    const char * Vh = src.V + hkv*src.nbv2 + s3*src.nbv3;
    // row addresses as base + (u64) row * stride with both 32-bit unsigned (mad.wide.u32): as
    // (int64) row * stride the multiply is 64-bit, 5 to 7 instructions an address, and a step
    // has 20 addresses. (Fewer instructions gain little: the loop waits on its dependent chains
    // more than on issue.) The loads through these addresses are __ldg, global loads (plain ones
    // through an address from PTX would be generic).
    const uint32_t nbk1 = (uint32_t) src.nbk1, nbv1 = (uint32_t) src.nbv1;
    auto row_ptr = [](const char * base, const int r, const uint32_t nb1) {
        uint64_t a;
        asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(a) : "r"((uint32_t) r), "r"(nb1), "l"((uint64_t) base));
        return (const char *) a;
    };
    // the code words' bases, with the lane's offset in the row folded in (not one 64-bit add a load)
    const char * Kc = Kh + 4 + qq*KB;
    const char * Vc = Vh + 4 + 4*vword;
    // the warp's k-th step: its first row (past the end: none), and its last row in range (rows
    // past it read that row and are masked): rows [r0, r1) in steps of STEP, or (LIST) one live
    // chunk of the list after another
    constexpr int STEP = OSCAR_FA_WARPS*OSCAR_MMA_ROWS;
    auto step_row = [&](const int k) {
        if constexpr (LIST) {
            const int i = i0 + w + k*OSCAR_FA_WARPS;
            return i < i1 ? OSCAR_LIVE_ROWS*__ldg(live + i) : INT_MAX;
        } else {
            return r0 + w*OSCAR_MMA_ROWS + k*STEP;
        }
    };
    auto step_last = [&](const int rb) { return LIST ? min(src.n_rows - OSCAR_LIVE_ROWS, rb) + OSCAR_LIVE_ROWS - 1 : r1 - 1; };
    auto in_range  = [&](const int rb) { return LIST ? rb < src.n_rows : rb < r1; };
    static_assert(!LIST || OSCAR_LIVE_ROWS == OSCAR_MMA_ROWS, "a live chunk is one warp step");

    // one step's code words, headers and mask, loaded a step ahead. Own row i (0..7) is
    // rb + 8(i/2) + 2qq + i%2. (Loading the headers and the mask at the start of the step that
    // uses them would take fewer registers, but then the long-context decode waits a full memory
    // latency every step; a step ahead, the variants with 8 queries a block and oscar2_64 spill
    // a little.)
    struct step {
        uint32_t kw[4][NG][NW]; // K codes: tile t, row rb + 8t + g
        uint32_t vw[8][NG];     // V codes of own rows
        half2 kdm[NO][NG], vdm[NO][NG]; // the (d, m) headers of the scored rows
        half mk[NO];                    // their mask entries (0 without a mask)
    };
    // the int8 codes of K register li of a lane (see k_elem)
    auto kcodes = [&](const uint32_t * kw, int li) { return (int) ((kw[li % NW] >> (2*(li / NW))) & 0x03030303u); };
    // fragment row i (0..7) of the V product's A: rb + 8(i/2) + 2qq + i%2; own row i (scores) is
    // fragment row 4u + i
    auto frag_row = [&](int rb, int i, int last) { return min(rb + 8*(i/2) + 2*qq + i%2, last); };
    const half * mask_q = mask && sok ? mask + stok*p.mask_nb1 : nullptr;
    auto load_step = [&](step & st, const int rb, const int last) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const char * kr = row_ptr(Kc, min(rb + 8*t + g, last), nbk1);
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
#pragma unroll
                for (int wi = 0; wi < NW; ++wi) {
                    st.kw[t][gi][wi] = __ldg((const unsigned int *) (kr + gi*BY + 4*wi));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const char * vr = row_ptr(Vc, frag_row(rb, i, last), nbv1);
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                st.vw[i][gi] = __ldg((const unsigned int *) (vr + gi*BY));
            }
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            const int r = frag_row(rb, 4*u + i, last);
            st.mk[i] = mask_q ? mask_q[(uint32_t) r] : __float2half(0.0f);
            const char * kr = row_ptr(Kh, r, nbk1);
            const char * vr = row_ptr(Vh, r, nbv1);
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                st.kdm[i][gi] = __ldg((const half2 *) (kr + gi*BY));
                st.vdm[i][gi] = __ldg((const half2 *) (vr + gi*BY));
            }
        }
    };

    step cur, nxt;
    int rb = step_row(0), last = step_last(rb), rn, ln;
    if (in_range(rb)) {
        load_step(cur, rb, last);
    }
    for (int k = 1; in_range(rb); ++k, rb = rn, last = ln) {
        rn = step_row(k);
        ln = step_last(rn);
        if (in_range(rn)) {
            load_step(nxt, rn, ln);
        }
        // the mask of the own rows (rows past the end: -inf)
        float mk[NO];
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            const int r = rb + 8*(2*u + i/2) + 2*qq + i%2;
            mk[i] = (sok && r <= last) ? __half2float(cur.mk[i]) : -INFINITY;
        }
        // a step that no query of the block sees (other sequences' cells in a unified cache)
        // changes nothing below: skipped, exactly
        bool seen = false;
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            seen = seen || mk[i] != -INFINITY;
        }
        if (!__any_sync(0xffffffff, seen)) {
            cur = nxt;
            continue;
        }
        const auto & kdm = cur.kdm;
        const auto & vdm = cur.vdm;
        float sc[NO];
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            sc[i] = 0.0f;
        }
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) {
            int cc[4][4];
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                cc[t][0] = cc[t][1] = cc[t][2] = cc[t][3] = 0;
            }
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                int a0, a1, a2, a3;
                lds_v4(&sh_aq[w][gi][c][lane].x, a0, a1, a2, a3);
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    mma_s8(cc[t], a0, a1, a2, a3, kcodes(cur.kw[t][gi], 2*c), kcodes(cur.kw[t][gi], 2*c + 1));
                }
            }
            // the product is at most 32512*3*G in magnitude: 256 hi + lo is far from 2^31
#pragma unroll
            for (int i = 0; i < NO; ++i) {
                const int e = i % 2;
                int x;
                if constexpr (PK) {
                    // tiles 2 and 3 go to the upper lane of the query (its lanes hold zeros there)
                    const int t = i / 2;
                    const int x_lo = 256*cc[t][e] + cc[t][2 + e];
                    const int x_hi = __shfl_xor_sync(0xffffffff, 256*cc[t + 2][e] + cc[t + 2][2 + e], 16, WARP_SIZE);
                    x = u ? x_hi : x_lo;
                } else {
                    x = 256*cc[i/2][e] + cc[i/2][2 + e];
                }
                const float2 dm = __half22float2(kdm[i][gi]);
                sc[i] += dm.x*(qd[gi]*(float) x) + dm.y*qs[gi];
            }
        }
        float cmax = -INFINITY;
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            float x = sc[i];
            if (p.softcap != 0.0f) {
                x = p.softcap*tanhf(x);
            }
            // a masked row may hold anything (unused cells): its score is -inf whatever x is
            sc[i] = mk[i] == -INFINITY ? -INFINITY : mk[i] + x;
            cmax = fmaxf(cmax, sc[i]);
        }
        cmax = quad_max(cmax); // the 4 lanes of query g hold its 32 rows (PK: with the 4 lanes 16 above)
        if constexpr (PK) {
            cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffff, cmax, 16, WARP_SIZE));
        }
        const bool grow = cmax > M;
        if (__any_sync(0xffffffff, grow)) {
            // the output entries of output columns 2qq and 2qq + 1 live in this lane: their factors
            // (PK: columns c and c + 4 both belong to query c % 4)
            const float cf  = grow ? expf(M - cmax) : 1.0f;
            const int   ql  = PK ? 8*(qq % 2) : 8*qq;
            const float cfa = __shfl_sync(0xffffffff, cf, ql,     WARP_SIZE);
            const float cfb = __shfl_sync(0xffffffff, cf, ql + 4, WARP_SIZE);
            S *= cf;
#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                am[gi] *= cf;
#pragma unroll
                for (int mt = 0; mt < NTV; ++mt) {
                    acc[gi][mt][0] *= cfa; acc[gi][mt][2] *= cfa;
                    acc[gi][mt][1] *= cfb; acc[gi][mt][3] *= cfb;
                }
            }
            M = grow ? cmax : M;
        }
        float pr[NO];
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            pr[i] = sc[i] == -INFINITY ? 0.0f : expf(sc[i] - M);
            S += pr[i];
        }
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) {
            // P' = p dV as two f16 parts, hi + lo (P' - hi), per pair of own rows (2k, 2k+1)
            uint32_t pbh[NO/2], pbl[NO/2];
#pragma unroll
            for (int k = 0; k < NO/2; ++k) {
                float pv[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int i = 2*k + e;
                    const float2 dm = __half22float2(vdm[i][gi]);
                    pv[e] = pr[i] > 0.0f ? pr[i]*dm.x : 0.0f; // 0 * (bytes of a masked row) could be NaN
                    am[gi] += pr[i] > 0.0f ? pr[i]*dm.y : 0.0f;
                }
                const half2  hi = __floats2half2_rn(pv[0], pv[1]);
                const float2 hf = __half22float2(hi);
                const half2  lo = __floats2half2_rn(pv[0] - hf.x, pv[1] - hf.y);
                pbh[k] = *(const uint32_t *) &hi;
                pbl[k] = *(const uint32_t *) &lo;
            }
            // the B fragments (P') of the two k16 steps: b[h][0] own rows (4h, 4h+1) at k = 2qq, 2qq+1,
            // b[h][1] own rows (4h+2, 4h+3) at k = 2qq+8, 2qq+9; PK: one fragment a step, B column g
            // (hi parts of query g < 4, lo parts of query g - 4), from this lane (step u) and its partner
            uint32_t bh[2][2], bl[2][2];
            if constexpr (PK) {
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const uint32_t keep = u ? pbl[k] : pbh[k];
                    const uint32_t got  = __shfl_xor_sync(0xffffffff, u ? pbh[k] : pbl[k], 16, WARP_SIZE);
                    bh[0][k] = u ? got : keep; // (selects: an index by u would put bh in local memory)
                    bh[1][k] = u ? keep : got;
                }
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        bh[h][k] = pbh[2*h + k];
                        bl[h][k] = pbl[2*h + k];
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // x[j] (y[j]): byte j of the code words of fragment rows 4h, 4h+1 (4h+2, 4h+3) in bytes 1 and 3
                uint32_t x[4], y[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t sel = j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12);
                    x[j] = __byte_perm(cur.vw[4*h][gi],     cur.vw[4*h + 1][gi], sel);
                    y[j] = __byte_perm(cur.vw[4*h + 2][gi], cur.vw[4*h + 3][gi], sel);
                }
#pragma unroll
                for (int mt = 0; mt < NTV; ++mt) {
                    const int j = jv(mt), s = sv(mt);
                    // A rows g (shift s) and g+8 (shift s+1); k = 2qq, 2qq+1 (x) and 2qq+8, 2qq+9 (y)
                    const uint32_t a0 = codes_f16x2(x[j], s), a1 = codes_f16x2(x[j], s + 1);
                    const uint32_t a2 = codes_f16x2(y[j], s), a3 = codes_f16x2(y[j], s + 1);
                    mma_f16(acc[gi][mt], a0, a1, a2, a3, bh[h][0], bh[h][1]);
                    if constexpr (!PK) {
                        mma_f16(acc[gi][mt], a0, a1, a2, a3, bl[h][0], bl[h][1]);
                    }
                }
            }
        }
        cur = nxt;
    }

    // C entry k of V tile mt: column 2qq + k%2, head dim gi*G + vdim(mt, k/2) with
    //   (G = 128) 4g + mt%4 + 32(2(mt/4) + k/2)     (G = 64) 4(g%4) + mt + 16(2(g/4) + k/2)
    // Column c is query c; PK: query c % 4, hi parts (c < 4) or lo parts, summed here. The sums
    // of the lanes of a query: its quad (PK: and the quad 16 lanes above).
    auto query_sum = [&](float x) {
        x = quad_sum(x);
        return PK ? x + __shfl_xor_sync(0xffffffff, x, 16, WARP_SIZE) : x;
    };
    S = query_sum(S);
    __shared__ float sh_ml[OSCAR_FA_WARPS][8][2];
    __shared__ float sh_acc[OSCAR_FA_WARPS][8][D];
    const int ql = PK ? 8*(qq % 2) : 8*qq; // the first lane of query 2qq (PK: 2(qq % 2))
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
        am[gi] = query_sum(am[gi]);
        const float ama = __shfl_sync(0xffffffff, am[gi], ql,     WARP_SIZE);
        const float amb = __shfl_sync(0xffffffff, am[gi], ql + 4, WARP_SIZE);
#pragma unroll
        for (int mt = 0; mt < NTV; ++mt) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float a = acc[gi][mt][k];
                if constexpr (PK) {
                    a += __shfl_xor_sync(0xffffffff, a, 2, WARP_SIZE); // + the lo column (qq + 2)
                }
                const int d = (G == 128 ? 4*g : 4*(g % 4)) + jv(mt) + (G/4)*(sv(mt) + k/2);
                if (!PK || qq < 2) {
                    sh_acc[w][2*(PK ? qq % 2 : qq) + k%2][gi*G + d] = a*OSCAR_CODE_UNSCALE + (k % 2 ? amb : ama);
                }
            }
        }
    }
    if (qq == 0 && (!PK || u == 0)) {
        sh_ml[w][g][0] = M;
        sh_ml[w][g][1] = S;
    }
    __syncthreads();
    store_block_partial<D, 8, OSCAR_FA_WARPS>(sh_ml, sh_acc, p, nq, tok0, hkv, s3, split);
#else
    GGML_UNUSED(src); GGML_UNUSED(win); GGML_UNUSED(p); GGML_UNUSED(win0); GGML_UNUSED(ns_main); GGML_UNUSED(rows_per_split); GGML_UNUSED(ns_win); GGML_UNUSED(rows_lite);
    GGML_UNUSED(rows_per_win_split);
    NO_DEVICE_CODE;
#endif
}

// k_fa_int2_mma for (cache type, window type, D, queries per block); grid as in its header
template <int D, ggml_type T, ggml_type WT>
static void launch_int2_mma_t(int nqb, const fa_source & src, const fa_source & win, const fa_params & p,
        int ns_main, int rps_main, int ns_win, int rps_win, int rps_lite, int n_groups, cudaStream_t stream) {
    // the window's blocks are their own, after the cache's, when there are more of them than cache splits
    const int win0 = ns_win > ns_main ? ns_main : 0;
    const dim3 grid(p.n_head_kv*p.ne3, std::max(ns_main, win0 + ns_win), n_groups);
    const dim3 block(WARP_SIZE, OSCAR_FA_WARPS, 1);
    // (one query a block is one token: no list; see attn-live.cu)
#define OSCAR_MMA_CASE(N_) case N_: \
        if (src.live) launch_dependent(k_fa_int2_mma<D, T, WT, N_, (N_ > 1)>, grid, block, 0, stream, \
            src, win, p, win0, ns_main, rps_main, ns_win, rps_win, rps_lite); \
        else launch_dependent(k_fa_int2_mma<D, T, WT, N_, false>, grid, block, 0, stream, \
            src, win, p, win0, ns_main, rps_main, ns_win, rps_win, rps_lite); \
        break;
    switch (nqb) {
        OSCAR_MMA_CASE(1)
        OSCAR_MMA_CASE(2)
        OSCAR_MMA_CASE(4)
        OSCAR_MMA_CASE(8)
        default: GGML_ABORT("oscar2 attention: %d queries per block on the mma kernel", nqb);
    }
#undef OSCAR_MMA_CASE
}

template <int D, ggml_type T>
static void launch_int2_mma_w(ggml_type wt, int nqb, const fa_source & src, const fa_source & win, const fa_params & p,
        int ns_main, int rps_main, int ns_win, int rps_win, int rps_lite, int n_groups, cudaStream_t stream) {
    if (wt == GGML_TYPE_F16) {
        launch_int2_mma_t<D, T, GGML_TYPE_F16>(nqb, src, win, p, ns_main, rps_main, ns_win, rps_win, rps_lite, n_groups, stream);
    } else {
        launch_int2_mma_t<D, T, GGML_TYPE_COUNT>(nqb, src, win, p, ns_main, rps_main, 0, 0, rps_main, n_groups, stream);
    }
}

void oscar2_cuda_fa_int2_mma(ggml_type t, ggml_type wt, int D, int nqb, const fa_source & src, const fa_source & win,
        const fa_params & p, int ns_main, int rps_main, int ns_win, int rps_win, int rps_lite, int n_groups, cudaStream_t stream) {
    if (D == 128 && t == GGML_TYPE_OSCAR2) {
        launch_int2_mma_w<128, GGML_TYPE_OSCAR2>(wt, nqb, src, win, p, ns_main, rps_main, ns_win, rps_win, rps_lite, n_groups, stream);
    } else if (D == 128 && t == GGML_TYPE_OSCAR2_64) {
        launch_int2_mma_w<128, GGML_TYPE_OSCAR2_64>(wt, nqb, src, win, p, ns_main, rps_main, ns_win, rps_win, rps_lite, n_groups, stream);
    } else if (D == 64 && t == GGML_TYPE_OSCAR2_64) {
        launch_int2_mma_w<64, GGML_TYPE_OSCAR2_64>(wt, nqb, src, win, p, ns_main, rps_main, ns_win, rps_win, rps_lite, n_groups, stream);
    } else {
        GGML_ABORT("oscar2 attention: no mma kernel for D = %d", D);
    }
}
