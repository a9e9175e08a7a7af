// oscar2-cuda.cu: CUDA kernels of the oscar2 KV cache (entry points in oscar2-cuda.cuh).
//
// Each kernel follows its plain reference in ../oscar2.c (quantize, dequantize) or the CPU
// flash attention in ggml-cpu/ops.cpp (online softmax over cache rows, then window rows).
// ggml-cuda compiles with -use_fast_math, so every rounding the format defines is spelled out
// with an explicit intrinsic (__fdiv_rn, __float2half_rn); the code thresholds are exact
// products, so FMA contraction cannot change them (see oscar2.h).

#include "oscar2-cuda.cuh"

#include "../../ggml-cuda/fattn.cuh"
#include "../../ggml-cuda/fattn-common.cuh" // FATTN_KQ_STRIDE
#include "../oscar2.h"

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstring>
#include <type_traits>
#include <vector>

static constexpr __host__ __device__ int group_of(ggml_type t) {
    return t == GGML_TYPE_OSCAR2 ? QK_OSCAR2 : QK_OSCAR2_64;
}

// ---- launches as programmatic dependents ---------------------------------------------------
//
// Upstream's kernels let the next launch start early (ggml_cuda_pdl_lc) and wait for their
// inputs (ggml_cuda_pdl_sync). A plain launch of ours between two of them was a full stop: its
// blocks were scheduled only after the kernel before had ended, and the next kernel's only after
// ours. Our decode kernels (rotate-store, attention, combine) are launched the same way, and each
// of them follows one rule: before ggml_cuda_pdl_sync it reads only weights (rotation matrices),
// and it writes nothing. Part of the rule: what earlier kernels write is not read through a
// `const __restrict__` pointer. nvcc makes such loads non-coherent (LDG.CONSTANT) and may hoist
// them above the wait, whose memory clobber does not hold them (the combine's partials were, and
// it read them unwritten, 2026-11-24). The attention's explicit __ldg loads of the cache come
// after the wait in its SASS (sm_90, nvcc 13): check there after changing it. Every block runs
// ggml_cuda_pdl_sync, early exits included, so a kernel ends only after the one before it: a
// later kernel's wait covers all earlier ones. Which of them let the next launch start early
// (ggml_cuda_pdl_lc) is chosen per kernel: the attention and the combine do, the rotate-store
// does not (see there).
// GGML_CUDA_PDL=0 turns it off for all kernels, GGML_CUDA_OSCAR_PDL for ours alone, as a mask of
// the oscar_pdl bits (default all; 0: none), to time each apart.
enum oscar_pdl : unsigned {
    OSCAR_PDL_ROTATE     = 1, // the rotate-store waits in place of a full stop after the kernel before
    OSCAR_PDL_ATTENTION  = 2, // the attention likewise after the rotate-store
    OSCAR_PDL_COMBINE    = 4, // the combine likewise, started when the attention's blocks start
    OSCAR_PDL_AFTER_COMB = 8, // the kernel after the combine started when the combine's blocks start
};

static bool env_flag(const char * name, bool dflt) {
    const char * v = getenv(name);
    return v ? atoi(v) != 0 : dflt;
}

static bool oscar_pdl_on(const unsigned bit) {
    static const char * env = getenv("GGML_CUDA_OSCAR_PDL");
    static const unsigned mask = env ? (unsigned) strtoul(env, nullptr, 0) : 15u;
    return env_flag("GGML_CUDA_PDL", true) && (mask & bit) != 0;
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent where the build, the
// kernel's code and the environment (oscar_pdl bit) allow it
template <typename... KArgs, typename... Args>
static void launch_dependent(void (*kernel)(KArgs...), unsigned bit, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
        Args &&... args) {
    cudaLaunchAttribute attr[1] = {};
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
#if defined(GGML_CUDA_USE_PDL)
    // (a kernel built from pre-Hopper code has no wait in it: upstream's check of its PTX version)
    if (oscar_pdl_on(bit) && ggml_cuda_kernel_can_use_pdl((const void *) kernel)) {
        attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
        cfg.numAttrs++;
    }
#endif
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// ---- quantization: one team of G/4 lanes per group --------------------------------------------
//
// Lane b of a team owns byte b of qs and the four values b + s*G/4 (s = 0..3) that it packs.

template <int G>
static __device__ __forceinline__ float team_max(float v) {
#pragma unroll
    for (int off = G/8; off > 0; off >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, off, G/4));
    }
    return v;
}

template <int G>
static __device__ __forceinline__ float team_min(float v) {
#pragma unroll
    for (int off = G/8; off > 0; off >>= 1) {
        v = fminf(v, __shfl_xor_sync(0xffffffff, v, off, G/4));
    }
    return v;
}

static __device__ __forceinline__ float sanitize(float x) {
    // non-finite and fp32-subnormal values become +0 (oscar2.h step 0); bit tests, because
    // -use_fast_math may assume away NaNs
    const uint32_t u = __float_as_uint(x) & 0x7fffffffu;
    return (u >= 0x7f800000u || u < 0x00800000u) ? 0.0f : __fadd_rn(x, 0.0f);
}

template <typename T> static __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<half>(half x) { return __half2float(x); }

// the k-th smallest (0-based) of the team's G values a >= 0 (finite: sanitize ran), as every
// lane of the team sees it. The CPU reference takes the value of rank k with ties broken by
// element index; the value is the same whichever tie is taken, so any exact selection agrees.
// sm_80+: a radix select on the bit patterns (non-negative floats order like their bits), two
// bits a step; the pairwise ranking below it was 128 shuffles and 512 compares per lane, about
// half of the cache write's 6 us at decode (ncu, H100, 2026-11-23).
template <int G>
static __device__ __forceinline__ float kth_smallest(const float a[4], const int k, const int b) {
    constexpr int TEAM = G/4;
    static_assert(TEAM == 16 || TEAM == 32, "teams of half or all of a warp");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    // Two bits a step (bits 31 and 30 first; bit 31 is 0 in every value). A lane counts its values
    // under the prefix whose digit is < 1, < 2, < 3, and all of them under the prefix, as the bytes
    // of one word (0x01010101 << 8 digit adds 1 to exactly those), so one warp reduction gives
    // the team's four counts (<= 128 each, a byte): with two teams per warp (G = 64) each team's
    // word is two words of two counts in its 16-bit half (<= 64 each). A step ends the select
    // early once the k-th value is the only one under the new prefix (every team of the warp):
    // its bits are then the team's max over the values under that prefix. The three counts as
    // three reductions and 16 steps every time were about 1000 instructions a warp, most of the
    // rotate-store's 6 us a layer (ncu and CUPTI, H100, 2026-11-24).
    uint32_t u[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        u[s] = __float_as_uint(a[s]);
    }
    const int shift = TEAM == 16 ? 16*((threadIdx.x % WARP_SIZE) / 16) : 0;
    uint32_t prefix = 0;
    int want = k;
#pragma unroll 1
    for (int bit = 30; bit >= 0; bit -= 2) {
        const uint32_t above = bit == 30 ? 0u : ~((4u << bit) - 1u);
        uint32_t c = 0; // bytes: digit < 1, < 2, < 3, any digit (values under the prefix)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const uint32_t dg = (u[s] >> bit) & 3u;
            c += (u[s] & above) == prefix ? 0x01010101u << (8*dg) : 0u;
        }
        int n1, n2, n3, nin;
        if constexpr (TEAM == 32) {
            const uint32_t t = __reduce_add_sync(0xffffffff, c);
            n1 = t & 0xff; n2 = (t >> 8) & 0xff; n3 = (t >> 16) & 0xff; nin = t >> 24;
        } else {
            const uint32_t lo = __reduce_add_sync(0xffffffff, (c & 0x0000ffffu) << shift) >> shift;
            const uint32_t hi = __reduce_add_sync(0xffffffff, (c >> 16) << shift) >> shift;
            n1 = lo & 0xff; n2 = (lo >> 8) & 0xff; n3 = hi & 0xff; nin = (hi >> 8) & 0xff;
        }
        // the k-th value's digit: the first count above want
        const uint32_t dg = want < n1 ? 0u : want < n2 ? 1u : want < n3 ? 2u : 3u;
        const int below = dg == 0u ? 0 : dg == 1u ? n1 : dg == 2u ? n2 : n3;
        const int upto  = dg == 0u ? n1 : dg == 1u ? n2 : dg == 2u ? n3 : nin;
        want -= below;
        prefix |= dg << bit;
        if (bit > 0 && __all_sync(0xffffffff, upto - below == 1)) {
            const uint32_t under = ~((1u << bit) - 1u);
            uint32_t x = 0;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                x = (u[s] & under) == prefix ? u[s] : x;
            }
#pragma unroll
            for (int off = TEAM/2; off > 0; off >>= 1) {
                x = max(x, __shfl_xor_sync(0xffffffff, x, off, TEAM));
            }
            prefix = x;
            break;
        }
    }
    GGML_UNUSED(b);
    return __uint_as_float(prefix);
#else
    // rank of each a among the G values (ties by element index): the one of rank k
    int rank[4] = {0, 0, 0, 0};
    for (int l = 0; l < TEAM; ++l) {
#pragma unroll
        for (int s2 = 0; s2 < 4; ++s2) {
            const float aj = __shfl_sync(0xffffffff, a[s2], l, TEAM);
            const int   ej = l + s2*TEAM;
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const int e = b + s*TEAM;
                rank[s] += (aj < a[s]) || (aj == a[s] && ej < e);
            }
        }
    }
    float cand = -1.0f;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        cand = rank[s] == k ? a[s] : cand;
    }
    return team_max<G>(cand);
#endif
}

// one group: values v[4] of this lane -> the byte of codes, plus the bits of d and m
// (results in registers: the caller stores them, so a team past the end can run the shuffles
// without any store)
template <int G>
static __device__ __forceinline__ uint8_t quantize_group(float v[4], float clip, int b, uint16_t & dbits, uint16_t & mbits) {
    if (clip > 0.0f && clip < 1.0f) {
        const int k = (int) floorf(__fmul_rn(clip, (float) G));
        if (k < G) {
            float a[4];
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                a[s] = fabsf(v[s]);
            }
            const float tau = kth_smallest<G>(a, k, b);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const float c = v[s] > tau ? tau : (v[s] < -tau ? -tau : v[s]);
                v[s] = __fadd_rn(c, 0.0f);
            }
        }
    }
    float mn = fminf(fminf(v[0], v[1]), fminf(v[2], v[3]));
    float mx = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
    mn = team_min<G>(mn);
    mx = team_max<G>(mx);
    float d = __fdiv_rn(__fsub_rn(mx, mn), 3.0f);
    if (!(d <= 65504.0f)) d = 65504.0f;
    mn = fminf(fmaxf(mn, -65504.0f), 65504.0f);
    const half dh = __float2half_rn(d);
    const half mh = __float2half_rn(mn);
    const float df = __half2float(dh);
    const float mf = __half2float(mh);
    const float t1 = __fadd_rn(mf, __fmul_rn(0.5f, df));
    const float t2 = __fadd_rn(mf, __fmul_rn(1.5f, df));
    const float t3 = __fadd_rn(mf, __fmul_rn(2.5f, df));
    uint8_t byte = 0;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int q = (v[s] >= t1) + (v[s] >= t2) + (v[s] >= t3);
        byte |= (uint8_t) (q << (2*s));
    }
    dbits = __half_as_ushort(dh);
    mbits = __half_as_ushort(mh);
    return byte;
}

// Rows of src (f32/f16, [ne00, ne01, ne02, ne03] with byte strides) into oscar2 rows of dst.
// idx: set_rows indices (i32/i64, [ne01, ne11, ne12]) or null for a plain copy (dst row = i01).
template <int G, typename src_t, typename idx_t>
static __global__ void k_oscar2_quantize(const char * __restrict__ src, const idx_t * __restrict__ idx, char * __restrict__ dst,
        const int64_t n_groups, const int64_t ne00, const int64_t ne01, const int64_t ne02,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t ne11, const int64_t ne12, const int64_t s10, const int64_t s11, const int64_t s12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3, const float clip) {
    constexpr int TEAM  = G/4;
    constexpr int BYTES = 4 + G/4;
    const int lane = threadIdx.x % WARP_SIZE;
    const int b    = lane % TEAM;
    const int64_t g = ((int64_t) blockIdx.x*blockDim.x + threadIdx.x) / TEAM;
    // whole teams run together (shuffles): a team past the end still participates
    const bool active = g < n_groups;
    const int64_t gg = active ? g : 0;

    const int64_t ngr = ne00/G;
    const int64_t i00 = (gg % ngr)*G;
    int64_t rest = gg / ngr;
    const int64_t i01 = rest % ne01; rest /= ne01;
    const int64_t i02 = rest % ne02;
    const int64_t i03 = rest / ne02;

    const src_t * x = (const src_t *) (src + i01*nb01 + i02*nb02 + i03*nb03) + i00;
    float v[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        v[s] = sanitize(to_f32<src_t>(x[b + s*TEAM]));
    }
    const int64_t row = idx ? (int64_t) idx[i01*s10 + (i02 % ne11)*s11 + (i03 % ne12)*s12] : i01;
    uint8_t * blk = (uint8_t *) (dst + row*nb1 + i02*nb2 + i03*nb3) + (i00/G)*BYTES;
    uint16_t dbits, mbits;
    const uint8_t byte = quantize_group<G>(v, clip, b, dbits, mbits);
    if (active) {
        blk[4 + b] = byte;
        if (b == 0) {
            // the header is two fp16 bit patterns, d then m (block_oscar2 in oscar2.h)
            blk[0] = (uint8_t) (dbits & 0xff); blk[1] = (uint8_t) (dbits >> 8);
            blk[2] = (uint8_t) (mbits & 0xff); blk[3] = (uint8_t) (mbits >> 8);
        }
    }
}

template <int G, typename src_t, typename idx_t>
static void launch_quantize(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip, cudaStream_t stream) {
    const int64_t n_groups = ggml_nelements(src0)/G;
    if (n_groups == 0) {
        return;
    }
    const int threads = 128;
    const int64_t teams_per_block = threads/(G/4);
    const int64_t blocks = (n_groups + teams_per_block - 1)/teams_per_block;
    const idx_t * idx = src1 ? (const idx_t *) src1->data : nullptr;
    const int64_t s10 = src1 ? src1->nb[0]/sizeof(idx_t) : 0;
    const int64_t s11 = src1 ? src1->nb[1]/sizeof(idx_t) : 0;
    const int64_t s12 = src1 ? src1->nb[2]/sizeof(idx_t) : 0;
    const int64_t ne11 = src1 ? src1->ne[1] : 1;
    const int64_t ne12 = src1 ? src1->ne[2] : 1;
    k_oscar2_quantize<G, src_t, idx_t><<<blocks, threads, 0, stream>>>(
        (const char *) src0->data, idx, (char *) dst->data, n_groups,
        src0->ne[0], src0->ne[1], src0->ne[2], src0->nb[1], src0->nb[2], src0->nb[3],
        ne11, ne12, s10, s11, s12, dst->nb[1], dst->nb[2], dst->nb[3], clip);
    CUDA_CHECK(cudaGetLastError());
}

template <int G, typename src_t>
static void dispatch_quantize_idx(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip, cudaStream_t stream) {
    if (src1 == nullptr || src1->type == GGML_TYPE_I64) {
        launch_quantize<G, src_t, int64_t>(src0, src1, dst, clip, stream);
    } else {
        launch_quantize<G, src_t, int32_t>(src0, src1, dst, clip, stream);
    }
}

// set_rows (src1 = indices) or cpy (src1 = null) of src0 into dst (an oscar2 tensor)
static void oscar2_quantize(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, float clip, cudaStream_t stream) {
    const bool f16 = src0->type == GGML_TYPE_F16;
    if (dst->type == GGML_TYPE_OSCAR2) {
        f16 ? dispatch_quantize_idx<QK_OSCAR2, half>(src0, src1, dst, clip, stream)
            : dispatch_quantize_idx<QK_OSCAR2, float>(src0, src1, dst, clip, stream);
    } else {
        f16 ? dispatch_quantize_idx<QK_OSCAR2_64, half>(src0, src1, dst, clip, stream)
            : dispatch_quantize_idx<QK_OSCAR2_64, float>(src0, src1, dst, clip, stream);
    }
}

// ---- dequantization: one thread per byte of codes ----------------------------------------------

template <typename dst_t> static __device__ __forceinline__ dst_t from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ half  from_f32<half>(float x)  { return __float2half_rn(x); }

// rows of src ([ne00 in groups of G, ne01, ne02, ne03], byte strides) -> dst rows; idx (i32, for
// get_rows: dst row r of batch (i11, i12) comes from src row idx[r, i11, i12]) or null (copy)
template <int G, typename dst_t>
static __global__ void k_oscar2_dequantize(const char * __restrict__ src, const int32_t * __restrict__ idx, char * __restrict__ dst,
        const int64_t n_bytes, const int64_t ne00, const int64_t ne01, const int64_t ne02,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t s10, const int64_t s11, const int64_t s12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    constexpr int NB    = G/4;
    constexpr int BYTES = 4 + G/4;
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= n_bytes) {
        return;
    }
    const int64_t bytes_per_row = ne00/4;
    const int64_t ib  = i % bytes_per_row;   // byte of the row
    int64_t rest = i / bytes_per_row;
    const int64_t i1 = rest % ne01; rest /= ne01;
    const int64_t i2 = rest % ne02;
    const int64_t i3 = rest / ne02;
    const int64_t src_row = idx ? (int64_t) idx[i1*s10 + i2*s11 + i3*s12] : i1;
    const int64_t blk_i = ib / NB;
    const int     b     = ib % NB;
    // get_rows: src0 batch dims broadcast over idx batch dims i2 -> src0 dim 2 is i2 (ne02 == ne11)
    const uint8_t * blk = (const uint8_t *) (src + src_row*nb01 + i2*nb02 + i3*nb03) + blk_i*BYTES;
    const float d = __half2float(__ushort_as_half(*(const uint16_t *) (blk + 0)));
    const float m = __half2float(__ushort_as_half(*(const uint16_t *) (blk + 2)));
    const uint8_t q = blk[4 + b];
    dst_t * y = (dst_t *) (dst + i1*nb1 + i2*nb2 + i3*nb3) + blk_i*G;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        y[b + s*NB] = from_f32<dst_t>(__fadd_rn(m, __fmul_rn((float) ((q >> (2*s)) & 3), d)));
    }
}

template <int G, typename dst_t>
static void launch_dequantize(const ggml_tensor * src0, const ggml_tensor * idx, const ggml_tensor * dst, cudaStream_t stream) {
    // shape of the result: dst's
    const int64_t n_bytes = ggml_nelements(dst)/4;
    if (n_bytes == 0) {
        return;
    }
    const int threads = 256;
    const int64_t blocks = (n_bytes + threads - 1)/threads;
    k_oscar2_dequantize<G, dst_t><<<blocks, threads, 0, stream>>>(
        (const char *) src0->data, idx ? (const int32_t *) idx->data : nullptr, (char *) dst->data, n_bytes,
        dst->ne[0], dst->ne[1], dst->ne[2], src0->nb[1], src0->nb[2], src0->nb[3],
        idx ? idx->nb[0]/4 : 0, idx ? idx->nb[1]/4 : 0, idx ? idx->nb[2]/4 : 0,
        dst->nb[1], dst->nb[2], dst->nb[3]);
    CUDA_CHECK(cudaGetLastError());
}

static void oscar2_dequantize(const ggml_tensor * src0, const ggml_tensor * idx, const ggml_tensor * dst, cudaStream_t stream) {
    const bool f16 = dst->type == GGML_TYPE_F16;
    if (src0->type == GGML_TYPE_OSCAR2) {
        f16 ? launch_dequantize<QK_OSCAR2, half>(src0, idx, dst, stream) : launch_dequantize<QK_OSCAR2, float>(src0, idx, dst, stream);
    } else {
        f16 ? launch_dequantize<QK_OSCAR2_64, half>(src0, idx, dst, stream) : launch_dequantize<QK_OSCAR2_64, float>(src0, idx, dst, stream);
    }
}

// ---- flash attention: split-KV decode kernel ---------------------------------------------------
//
// Grid (n_head_kv*ne3, n_split, n_query_groups), 4 warps. A block takes the g query heads of one
// KV head and up to NT query tokens (NQ = g*NT queries), and rows [r0, r1) of one source: the
// oscar2 cache or the window. Lane t of a warp owns head dims t, t+32, ...: for oscar2 rows
// that is one byte of codes per 128 values, since byte b holds values b, b+32, b+64, b+96.
// A warp walks rows w, w+4, ...; per row it dots K with every query (warp sum), updates each
// query's running (max, sum, acc) and adds the row's V. The warps merge in shared memory and the
// block writes one partial (max, sum, acc) per query; k_fa_combine merges the partials of all
// splits of all sources by their log-sum-exp, which is the same softmax as one pass.

#define OSCAR_FA_WARPS 4
#define OSCAR_WIN_LITE_ROWS 512 // k_fa_int2_mma: cache rows fewer for a split that takes a window chunk (fa_vec)

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
            const float d = __half2float(__ushort_as_half(*(const uint16_t *) (bp + 0)));
            const float m = __half2float(__ushort_as_half(*(const uint16_t *) (bp + 2)));
            const int q = (bp[4 + o % NB] >> (2*(o / NB))) & 3;
            out[i] = m + (float) q * d;
        }
    }
}

struct fa_source {
    const char * K; int64_t nbk1, nbk2, nbk3;
    const char * V; int64_t nbv1, nbv2, nbv3;
    const half * mask;   // first mask column of this source
    int n_rows;
};

struct fa_params {
    const char * Q; int64_t nbq1, nbq2, nbq3;
    int64_t mask_nb1, mask_nb3; int mask_ne3; // in half elements
    int n_q, n_head, n_head_kv, gqa, ne3;
    float scale, softcap;
    float * part_acc; float2 * part_ml;
    int n_part;   // splits over all sources
    int part0;    // first split of this launch
};

// The block's partial: merge the NP online-softmax states (max, sum, acc) its warps (or teams)
// left in shared memory, one per query, and write it as partial number `part` of each query.
template <int D, int NQ, int NP>
static __device__ __forceinline__ void store_block_partial(const float (&sh_ml)[NP][NQ][2], const float (&sh_acc)[NP][NQ][D],
        const fa_params & p, const int nq, const int tok0, const int hkv, const int s3, const int part) {
    const int tid = threadIdx.y*WARP_SIZE + threadIdx.x;
    for (int jd = tid; jd < nq*D; jd += OSCAR_FA_WARPS*WARP_SIZE) {
        const int j = jd / D;
        const int d = jd % D;
        float Mx = -INFINITY;
#pragma unroll
        for (int pp = 0; pp < NP; ++pp) {
            Mx = fmaxf(Mx, sh_ml[pp][j][0]);
        }
        float a = 0.0f, l = 0.0f;
        if (Mx != -INFINITY) {
#pragma unroll
            for (int pp = 0; pp < NP; ++pp) {
                const float f = expf(sh_ml[pp][j][0] - Mx);
                a += f*sh_acc[pp][j][d];
                l += f*sh_ml[pp][j][1];
            }
        }
        const int tok  = tok0 + j / p.gqa;
        const int head = hkv*p.gqa + j % p.gqa;
        const int64_t qi = ((int64_t) s3*p.n_q + tok)*p.n_head + head;
        p.part_acc[(qi*p.n_part + part)*D + d] = a;
        if (d == 0) {
            p.part_ml[qi*p.n_part + part] = make_float2(Mx, l);
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

// ---- flash attention: the INT2 decode kernel (oscar2 K and V of one type, up to 4 queries) ----
//
// The hot loop of long-context decoding. Compared with k_fa_partial, a row is not spread over
// the whole warp: a team of L = D/16 lanes takes one row, each lane one 4-byte word of codes
// (16 values of one group) and that group's header, so a warp reads 32/L rows per step with
// no per-row warp reduction. Because every value of a lane's word shares one (d, m),
//   K.q = sum_lanes (d * sum_e q_e c_e + m * sum_e q_e)   and   V: acc_e += p d c_e, am += p m,
// so the codes are used as small integers and m costs one FMA per row. Each lane keeps its own
// online-softmax state for its 16 values; teams and warps merge once, at the end.

#define OSCAR_INT2_UNROLL 2
#define OSCAR_INT2_BLOCKS_PER_SM 3 // launch bounds; fa_vec sizes its splits by it

// which (K, V, queries per block) take k_fa_int2 rather than k_fa_partial
static constexpr __host__ __device__ bool uses_int2_kernel(ggml_type kt, ggml_type vt, int nq) {
    return kt == vt && (kt == GGML_TYPE_OSCAR2 || kt == GGML_TYPE_OSCAR2_64) && nq <= 4;
}

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

#include "oscar2-fa-mma.cuh"

// out[q][d] = sum_s e^(M_s - M) acc_s[d] / (sum_s e^(M_s - M) L_s [+ e^(sink - M)])
//
// Grid (queries, D/32): a block takes 32 head dims of one query. The first version had one
// block of D threads per query, each walking all partials three times in loops of dependent
// loads: with the 69-113 partials of a long cache (the cache's splits plus the window's) it took
// 29.5 us a call at 32k rows, more than the attention itself (27.6 us; ncu, H100, 2026-11-23),
// and 4.9 us at depth 0. Here a block finds M and the weights once, in parallel over the
// partials (shared memory), and the accumulation is spread over slices of the partials, so each
// thread has a few independent loads in flight. (One block per query, 128 dims, took 17 us with
// 272 partials at 32k rows: 32 queries leave most SMs idle; this grid took 7 us there.)
#define OSCAR_COMBINE_THREADS 256
#define OSCAR_COMBINE_DIMS 32 // head dims per block

// the output's un-rotation, fused into the combine (UNROT): y = U o per query, U the D x D
// matrix of the tagged rotation node after the attention (llama_oscar_unrotate_out)
struct fa_unrot {
    const float * U = nullptr; // null: no un-rotation
    float *       y = nullptr; // [D, queries], as the attention output
};

// Grid (queries, D/OSCAR_COMBINE_DIMS): block y forms dims 32y..32y+31 of query blockIdx.x.
// UNROT: block y sums all D dims of o (each of the query's D/32 blocks the same), and forms rows
// 32y..32y+31 of U o and dims 32y..32y+31 of o. Why all of o in every block: with 32 dims per
// block, the D/32 blocks of a query were a thread-block cluster that exchanged their dims through
// distributed shared memory, and its two cluster barriers (each arrival a MEMBAR.ALL.GPU in the
// SASS) made the un-rotation 1.9-5.0 us after the sums (per-block timeline, H100, 2026-11-24, 32k
// rows): every block waited for the slowest of its cluster. Each block now reads D/32 times the
// partials (from L2: the attention has just written them), in float4, as many loads a thread as
// before. Why fused at all: as a launch of its own (k_rotate_cols) the un-rotation cost 3.4 us a
// layer at decode, mostly fixed cost (CUPTI trace, H100, Llama-8B shape); one block per query,
// to have all of o in one place, made the combine 4 times fewer blocks and slower at depth
// (branch experiment/unrotate-in-combine).
template <int D, bool UNROT>
__launch_bounds__(OSCAR_COMBINE_THREADS)
static __global__ void k_fa_combine(const float * part_acc, const float2 * part_ml,
        const float * __restrict__ sinks, float * __restrict__ dst, const int n_part, const int n_head, const fa_unrot un,
        const bool early_next) {
    constexpr int NT = OSCAR_COMBINE_THREADS;
    constexpr int NW = NT/WARP_SIZE;
    constexpr int TD = OSCAR_COMBINE_DIMS;   // the block's dims (of o, and with UNROT rows of U)
    constexpr int VW = UNROT ? 4 : 1;        // dims a thread sums: a float4 of all D, or one of the block's
    constexpr int CD = UNROT ? D/4 : TD;     // threads along the dims
    constexpr int PS = NT/CD;                // slices of the partials
    static_assert(D % TD == 0 && NT % CD == 0, "head dims per block");
    typedef typename std::conditional<UNROT, float4, float>::type vec_t;
    extern __shared__ float sh_w[];       // [n_part]: e^(M_s - M), 0 for an empty partial
    __shared__ float sh_red[NW];
    __shared__ vec_t sh_acc[PS][CD];
    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int64_t qi = blockIdx.x;
    const float2 * ml = part_ml + qi*n_part;
    if (early_next) {
        ggml_cuda_pdl_lc(); // the kernel after us may be scheduled (it waits for our end)
    }

    // UNROT: this block's 32 rows of U, loaded first (they do not depend on the partials) into
    // registers, and put into shared memory only after the combine: stores right after the loads
    // would wait for them, and the partials' loads behind them
    constexpr int UP = D + 1; // padded rows: the row-per-8-lanes reads below hit distinct banks
    constexpr int UL = UNROT ? TD*D/4/NT : 1; // float4 of U per thread
    __shared__ float sh_u[UNROT ? TD*UP : 1];
    __shared__ float sh_o[UNROT ? D : 1];  // the whole combined o of the query
    float4 ur[UL];
    if constexpr (UNROT) {
        static_assert(TD*D/4 % NT == 0, "U in whole float4 per thread");
        const float4 * u4 = (const float4 *) (un.U + (int64_t) blockIdx.y*TD*D);
#pragma unroll
        for (int k = 0; k < UL; ++k) {
            ur[k] = u4[tid + k*NT];
        }
    }
    // launched as a programmatic dependent of the attention (launch_combine): everything above
    // overlaps its last blocks; the partials are read only after it has finished
    ggml_cuda_pdl_sync();

    // this thread's first NPR partials of its dims, loaded now with the (max, sum) pairs below:
    // one round trip to memory instead of two (the weights need the max first). (part_acc and
    // part_ml are not __restrict__, by the rule above launch_dependent: so qualified, these loads
    // went above the wait, and test-backend-ops OSCAR_ROTATE_STORE failed 5 of 76 cases, H100)
    constexpr int NPR = 8;
    const int td = tid % CD, ps = tid / CD;
    const int d  = UNROT ? VW*td : blockIdx.y*TD + td; // the thread's (first) dim
    const vec_t * pa = (const vec_t *) (part_acc + qi*n_part*D + d);
    constexpr int VS = D/VW; // a partial's stride in vec_t
    vec_t xr[NPR];
#pragma unroll
    for (int i = 0; i < NPR; ++i) {
        const int s = ps + i*PS;
        xr[i] = s < n_part ? pa[(int64_t) s*VS] : vec_t{};
    }

    float Mx = -INFINITY;
    for (int s = tid; s < n_part; s += NT) {
        Mx = fmaxf(Mx, ml[s].x);
    }
    Mx = warp_reduce_max(Mx);
    if (lane == 0) {
        sh_red[warp] = Mx;
    }
    __syncthreads();
    Mx = sh_red[0];
#pragma unroll
    for (int i = 1; i < NW; ++i) {
        Mx = fmaxf(Mx, sh_red[i]);
    }
    const float sink = sinks ? sinks[qi % n_head] : -INFINITY;
    Mx = fmaxf(Mx, sink);
    __syncthreads(); // sh_red is reused

    float l = 0.0f;
    for (int s = tid; s < n_part; s += NT) {
        const float2 v = ml[s];
        const float w = v.x == -INFINITY ? 0.0f : expf(v.x - Mx); // an empty partial weighs 0 (also when Mx is -inf)
        sh_w[s] = w;
        l += w*v.y;
    }
    l = warp_reduce_sum(l);
    if (lane == 0) {
        sh_red[warp] = l;
    }
    __syncthreads();
    l = 0.0f;
#pragma unroll
    for (int i = 0; i < NW; ++i) {
        l += sh_red[i];
    }
    if (sinks && Mx != -INFINITY) {
        l += expf(sink - Mx);
    }
    const float inv = l > 0.0f ? 1.0f/l : 0.0f;

    // a += w x, component by component; an empty partial's bytes stay out of the sum
    auto add = [](vec_t & a, const float w, const vec_t & x) {
        const float * xf = (const float *) &x;
        float * af = (float *) &a;
#pragma unroll
        for (int c = 0; c < VW; ++c) {
            af[c] += w != 0.0f ? w*xf[c] : 0.0f;
        }
    };
    vec_t a = vec_t{};
#pragma unroll
    for (int i = 0; i < NPR; ++i) {
        const int s = ps + i*PS;
        if (s < n_part) {
            add(a, sh_w[s], xr[i]);
        }
    }
#pragma unroll 4
    for (int s = ps + NPR*PS; s < n_part; s += PS) {
        add(a, sh_w[s], pa[(int64_t) s*VS]);
    }
    sh_acc[ps][td] = a;
    if constexpr (UNROT) {
#pragma unroll
        for (int k = 0; k < UL; ++k) {
            const int e = tid + k*NT;
            float * row = sh_u + (e / (D/4))*UP + 4*(e % (D/4));
            row[0] = ur[k].x; row[1] = ur[k].y; row[2] = ur[k].z; row[3] = ur[k].w;
        }
    }
    __syncthreads();
    // dim e of o: the sum over the slices, in slice order
    auto o_dim = [&](const int e) {
        float x = 0.0f;
#pragma unroll
        for (int i = 0; i < PS; ++i) {
            x += ((const float *) sh_acc[i])[e];
        }
        return x*inv;
    };
    if constexpr (!UNROT) {
        if (tid < TD) {
            dst[qi*D + d] = o_dim(tid);
        }
    } else {
        for (int e = tid; e < D; e += NT) {
            const float x = o_dim(e);
            sh_o[e] = x;
            if (e / TD == (int) blockIdx.y) {
                dst[qi*D + e] = x;
            }
        }
        __syncthreads(); // sh_o complete
        // row r = tid/8 of this block's rows, its 8 lanes split the D products
        constexpr int LPR = NT/TD;
        const int r = tid / LPR, part = tid % LPR;
        float acc = 0.0f;
#pragma unroll
        for (int k = part; k < D; k += LPR) {
            acc += sh_u[r*UP + k]*sh_o[k];
        }
#pragma unroll
        for (int off = LPR/2; off > 0; off >>= 1) {
            acc += __shfl_xor_sync(0xffffffff, acc, off, WARP_SIZE);
        }
        if (part == 0) {
            un.y[qi*D + blockIdx.y*TD + r] = acc;
        }
    }
}

// the combine of the partials into dst, and with un.U the output's un-rotation into un.y
static void launch_combine(int D, const fa_params & p, const float * sinks, float * dst, int64_t n_queries,
        const fa_unrot & un, cudaStream_t stream) {
    const size_t smem = (size_t) p.n_part*sizeof(float);
    const dim3 grid(n_queries, D/OSCAR_COMBINE_DIMS);
    const dim3 block(OSCAR_COMBINE_THREADS);
    // its blocks may start as the attention's blocks end, load U, and wait (ggml_cuda_pdl_sync)
    const bool early_next = oscar_pdl_on(OSCAR_PDL_AFTER_COMB);
#define OSCAR_COMBINE_CASE(D_) case D_: launch_dependent(un.U ? k_fa_combine<D_, true> : k_fa_combine<D_, false>, \
        OSCAR_PDL_COMBINE, grid, block, smem, stream, p.part_acc, p.part_ml, sinks, dst, p.n_part, p.n_head, un, \
        early_next); break;
    switch (D) {
        OSCAR_COMBINE_CASE(64)
        OSCAR_COMBINE_CASE(128)
        OSCAR_COMBINE_CASE(256)
        default: GGML_ABORT("oscar2 attention: no combine for D = %d", D);
    }
#undef OSCAR_COMBINE_CASE
}

// queries per block, rounded up to the kernel's compile-time sizes (at least one token's heads)
static int nq_bucket(int nq, int D) {
    const int cap = D == 256 ? 8 : 16;
    int b = 1;
    while (b < nq && b < cap) {
        b *= 2;
    }
    return b;
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

// k_fa_int2_mma for (cache type, window type, D, queries per block); grid as in its header
template <int D, ggml_type T, ggml_type WT>
static void launch_int2_mma_t(int nqb, const fa_source & src, const fa_source & win, const fa_params & p,
        int ns_main, int rps_main, int ns_win, int rps_win, int rps_lite, int n_groups, cudaStream_t stream) {
    // the window's blocks are their own when there are more of them than cache splits
    const int main0 = ns_win > ns_main ? ns_win : 0;
    const dim3 grid(p.n_head_kv*p.ne3, std::max(main0 + ns_main, ns_win), n_groups);
    const dim3 block(WARP_SIZE, OSCAR_FA_WARPS, 1);
#define OSCAR_MMA_CASE(N_) case N_: launch_dependent(k_fa_int2_mma<D, T, WT, N_>, OSCAR_PDL_ATTENTION, grid, block, 0, stream, \
        src, win, p, main0, ns_main, rps_main, ns_win, rps_win, rps_lite); break;
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

static void launch_int2_mma(ggml_type t, ggml_type wt, int D, int nqb, const fa_source & src, const fa_source & win,
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

static bool vec_types_ok(ggml_type kt, ggml_type vt, int64_t D) {
    auto ok = [&](ggml_type t) {
        return t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || (t == GGML_TYPE_OSCAR2 && D % 128 == 0) || t == GGML_TYPE_OSCAR2_64;
    };
    return (D == 64 || D == 128 || D == 256) && ok(kt) && ok(vt) && (kt == vt || kt == GGML_TYPE_F16 || vt == GGML_TYPE_F16);
}

// the most query tokens per flash-attention call that take the split-KV kernel
static const int OSCAR_VEC_MAX_TOKENS = 16;

static bool vec_path_ok(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0], * K = dst->src[1], * V = dst->src[2], * mask = dst->src[3];
    float max_bias;
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    const int64_t gqa = Q->ne[2] / K->ne[2];
    return Q->type == GGML_TYPE_F32 && K->ne[0] == V->ne[0] && vec_types_ok(K->type, V->type, K->ne[0]) &&
        max_bias == 0.0f && Q->ne[1] <= OSCAR_VEC_MAX_TOKENS && gqa <= (K->ne[0] == 256 ? 8 : 16) &&
        (!mask || mask->type == GGML_TYPE_F16) &&
        (!dst->src[5] || vec_types_ok(dst->src[5]->type, dst->src[6]->type, K->ne[0]));
}

static fa_unrot take_unrot(const ggml_tensor * fa); // (the fusion plan, below)

static void fa_vec(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0], * K = dst->src[1], * V = dst->src[2], * mask = dst->src[3];
    const ggml_tensor * sinks = dst->src[4], * Kw = dst->src[5], * Vw = dst->src[6];
    cudaStream_t stream = ctx.stream();
    const int D = (int) K->ne[0];
    const int gqa = (int) (Q->ne[2]/K->ne[2]);

    fa_params p = {};
    p.Q = (const char *) Q->data; p.nbq1 = Q->nb[1]; p.nbq2 = Q->nb[2]; p.nbq3 = Q->nb[3];
    p.mask_nb1 = mask ? mask->nb[1]/sizeof(half) : 0;
    p.mask_nb3 = mask ? mask->nb[3]/sizeof(half) : 0;
    p.mask_ne3 = mask ? (int) mask->ne[3] : 1;
    p.n_q = (int) Q->ne[1]; p.n_head = (int) Q->ne[2]; p.n_head_kv = (int) K->ne[2]; p.gqa = gqa; p.ne3 = (int) Q->ne[3];
    memcpy(&p.scale,   (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&p.softcap, (const float *) dst->op_params + 2, sizeof(float));
    if (p.softcap != 0.0f) {
        p.scale /= p.softcap;
    }

    const int nqb = nq_bucket(gqa*(int) Q->ne[1], D);
    const int tokens_per_block = std::max(1, nqb/gqa);
    const int n_groups = (int) ((Q->ne[1] + tokens_per_block - 1)/tokens_per_block);

    // splits. The INT2 kernels run a fixed number of blocks per SM and each block walks its rows
    // in a dependent chain, so the cache gets exactly one full wave of blocks: a second, partly
    // empty wave costs as much as the first (ncu at 32k rows: 1.33 waves, 85 us). The other
    // kernels keep about 4 blocks per SM, in splits of at least 128 rows. (How rows are split
    // changes only the order of float sums. Greedy text against the CPU is no test of that on
    // the small models we can carry: it parts even with an f16 cache; see gpu/run.sh e2e.)
    const int n_sm = ggml_cuda_info().devices[ctx.device].nsm;
    const int base = p.n_head_kv*p.ne3*n_groups;
    auto split = [&](int n_rows, int min_rows, int slots, int & n_split, int & rps) {
        n_split = std::max(1, std::min(std::max(1, slots/base), (n_rows + min_rows - 1)/min_rows));
        rps = (n_rows + n_split - 1)/n_split;
        rps = (rps + OSCAR_FA_WARPS - 1)/OSCAR_FA_WARPS*OSCAR_FA_WARPS;
        n_split = std::max(1, (n_rows + rps - 1)/rps);
    };
    int ns_main, rps_main, ns_win = 0, rps_win = 0, rps_lite = 0;
    // the window's type for the mma kernel: COUNT = no window; F32 = K and V differ (not taken)
    // (and F32 too when its K rows are not 16-byte aligned: fa_window_rows_f16 reads them as uint4)
    auto aligned16 = [](const ggml_tensor * t) {
        return (uintptr_t) t->data % 16 == 0 && t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0;
    };
    const ggml_type wt = !Kw ? GGML_TYPE_COUNT : Kw->type == Vw->type && aligned16(Kw) && aligned16(Vw) ? Kw->type : GGML_TYPE_F32;
    // (the arch the binary holds code for, not only the device's: a build for sm_75 has no mma body)
    const bool mma = uses_int2_mma(K->type, V->type, D, nqb, wt) && ampere_mma_available(ggml_cuda_info().devices[ctx.device].cc);
    if (mma) {
        // one launch: the cache's splits fill one full wave of OSCAR_MMA_BLOCKS_PER_SM blocks per
        // SM, and the first blocks also take a chunk of the window each (see k_fa_int2_mma), or
        // at small depths, with fewer cache splits than window chunks, the window's chunks are
        // blocks of their own (launch_int2_mma_t). A chunk is one 32-row step of each warp
        // (fa_window_rows_f16): its rows cost about what one step costs, so smaller chunks would
        // only add partials. Most window rows are masked (the view spans every slot a prefill's
        // ubatch used, 1024 rows after a 512-token ubatch, of which sink + recent are live) and
        // cost only their mask.
        split((int) K->ne[1], 128, OSCAR_MMA_BLOCKS_PER_SM*n_sm, ns_main, rps_main);
        if (Kw) {
            rps_win = OSCAR_FA_WARPS*WARP_SIZE;
            ns_win  = (int) ((Kw->ne[1] + rps_win - 1)/rps_win);
        }
        rps_lite = rps_main;
        if (Kw && ns_win < ns_main) {
            // the splits that take a window chunk first get OSCAR_WIN_LITE_ROWS fewer cache rows,
            // and the others share them, so that every block ends together. A live chunk costs
            // about four 128-row steps of the cache in the model's decode, where its rows and code
            // come cold: with 256 rows (two steps, as test-backend-ops perf suggested, whose loop
            // runs warm) the chunk's blocks were the last to end, 4 us after the median block
            // (per-block timeline, gpu/run.sh timeline), and tg64 at 32768 rows ran 247.7 tok/s
            // against 251.7-252.1 with 512 or 640 (H200, Llama-8B shape, 2026-11-24)
            const int n_rows = (int) K->ne[1];
            rps_lite = std::max(0, rps_main - OSCAR_WIN_LITE_ROWS)/OSCAR_FA_WARPS*OSCAR_FA_WARPS;
            const int rest = std::max(0, n_rows - ns_win*rps_lite);
            rps_main = ((rest + (ns_main - ns_win) - 1)/(ns_main - ns_win) + OSCAR_FA_WARPS - 1)/OSCAR_FA_WARPS*OSCAR_FA_WARPS;
        }
    } else {
        split((int) K->ne[1], 128, uses_int2_kernel(K->type, V->type, nqb) ? OSCAR_INT2_BLOCKS_PER_SM*n_sm : 4*n_sm + base - 1,
              ns_main, rps_main);
        if (Kw) {
            split((int) Kw->ne[1], 128, 4*n_sm + base - 1, ns_win, rps_win);
        }
    }
    p.n_part = ns_main + ns_win;

    const int64_t n_queries = Q->ne[1]*Q->ne[2]*Q->ne[3];
    ggml_cuda_pool_alloc<float>  acc(ctx.pool(), n_queries*p.n_part*D);
    ggml_cuda_pool_alloc<float2> ml(ctx.pool(), n_queries*p.n_part);
    p.part_acc = acc.get();
    p.part_ml  = ml.get();

    fa_source sm = { (const char *) K->data, (int64_t) K->nb[1], (int64_t) K->nb[2], (int64_t) K->nb[3],
                     (const char *) V->data, (int64_t) V->nb[1], (int64_t) V->nb[2], (int64_t) V->nb[3],
                     mask ? (const half *) mask->data : nullptr, (int) K->ne[1] };
    fa_source sw = {};
    if (Kw) {
        // the window's mask columns follow the cache's
        sw = { (const char *) Kw->data, (int64_t) Kw->nb[1], (int64_t) Kw->nb[2], (int64_t) Kw->nb[3],
               (const char *) Vw->data, (int64_t) Vw->nb[1], (int64_t) Vw->nb[2], (int64_t) Vw->nb[3],
               mask ? (const half *) mask->data + K->ne[1] : nullptr, (int) Kw->ne[1] };
    }
    p.part0 = 0;
    if (mma) {
        launch_int2_mma(K->type, wt, D, nqb, sm, sw, p, ns_main, rps_main, ns_win, rps_win, rps_lite, n_groups, stream);
    }
    bool ok = mma;
    if (!mma) {
        switch (D) {
            case  64: ok = launch_partial_types< 64>(K->type, V->type, sm, p, nqb, ns_main, rps_main, n_groups, stream); break;
            case 128: ok = launch_partial_types<128>(K->type, V->type, sm, p, nqb, ns_main, rps_main, n_groups, stream); break;
            case 256: ok = launch_partial_types<256>(K->type, V->type, sm, p, nqb, ns_main, rps_main, n_groups, stream); break;
        }
    }
    GGML_ASSERT(ok && "oscar2 attention: no kernel for these types");
    if (Kw && !mma) {
        p.part0 = ns_main;
        switch (D) {
            case  64: ok = launch_partial_types< 64>(Kw->type, Vw->type, sw, p, nqb, ns_win, rps_win, n_groups, stream); break;
            case 128: ok = launch_partial_types<128>(Kw->type, Vw->type, sw, p, nqb, ns_win, rps_win, n_groups, stream); break;
            case 256: ok = launch_partial_types<256>(Kw->type, Vw->type, sw, p, nqb, ns_win, rps_win, n_groups, stream); break;
        }
        GGML_ASSERT(ok && "oscar2 attention: no kernel for the window types");
    }
    launch_combine(D, p, sinks ? (const float *) sinks->data : nullptr, (float *) dst->data, n_queries, take_unrot(dst), stream);
    CUDA_CHECK(cudaGetLastError());
}

// ---- flash attention: many queries -> one f16 K/V (cache rows, then window rows) ---------------

// rows [D, n_rows, n_head_kv, ns] of any of our types (byte strides) -> f16 rows at row offset r_off
// of a contiguous [D, n_total, n_head_kv, ns] buffer.
// Grid (rows*D/8 / 256 rounded up, n_head_kv, ns): a thread takes 8 consecutive values of a row
// (one 16-byte store). Why: the first version took 4 values a thread and found row, head and
// sequence by 64-bit divisions, about 400 instructions a thread for 4 values (SASS, sm_90); a
// prefill ubatch at depth 16k converts 33M values a layer.
template <ggml_type T>
static __global__ void k_rows_to_f16(const char * __restrict__ src, int64_t nb1, int64_t nb2, int64_t nb3,
        half * __restrict__ dst, int D, int n_rows, int n_total, int r_off) {
    const int i  = blockIdx.x*blockDim.x + threadIdx.x; // 8-value chunk of this head's rows
    const int per_row = D/8;
    if (i >= n_rows*per_row) {
        return;
    }
    const int r  = i / per_row;
    const int e0 = 8*(i - r*per_row);
    const int h  = blockIdx.y, s3 = blockIdx.z;
    const char * row = src + r*nb1 + h*nb2 + s3*nb3;
    float x[8];
    if constexpr (T == GGML_TYPE_F16) {
#pragma unroll
        for (int u = 0; u < 8; u += 2) {
            const float2 f = __half22float2(*(const half2 *) ((const half *) row + e0 + u));
            x[u] = f.x;
            x[u + 1] = f.y;
        }
    } else if constexpr (T == GGML_TYPE_BF16) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            x[u] = __bfloat162float(((const nv_bfloat16 *) row)[e0 + u]);
        }
    } else if constexpr (T == GGML_TYPE_F32) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            x[u] = ((const float *) row)[e0 + u];
        }
    } else {
        // values e0..e0+7 of a group are code bytes o..o+7 (o = e0 % NB) at one shift: G/4 is a
        // multiple of 8, so they never straddle a byte block; the bytes are 4-byte aligned
        constexpr int G = group_of(T), NB = G/4, BYTES = 4 + G/4;
        const uint8_t * bp = (const uint8_t *) row + (e0 / G)*BYTES;
        const float d = __half2float(__ushort_as_half(*(const uint16_t *) (bp + 0)));
        const float m = __half2float(__ushort_as_half(*(const uint16_t *) (bp + 2)));
        const int o = e0 % G;
        const uint32_t * q = (const uint32_t *) (bp + 4 + o % NB);
        const uint32_t q0 = q[0] >> (2*(o / NB)), q1 = q[1] >> (2*(o / NB));
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const uint32_t c = ((u < 4 ? q0 : q1) >> (8*(u % 4))) & 3;
            x[u] = __fadd_rn(m, __fmul_rn((float) c, d));
        }
    }
    half2 y[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        y[u] = __halves2half2(__float2half_rn(x[2*u]), __float2half_rn(x[2*u + 1]));
    }
    half * out = dst + (((int64_t) s3*gridDim.y + h)*n_total + r_off + r)*D + e0;
    *(int4 *) out = *(const int4 *) y;
}

static void rows_to_f16(const ggml_tensor * src, half * dst, int n_total, int r_off, cudaStream_t stream) {
    const int D = (int) src->ne[0];
    const int64_t n = (int64_t) D/8*src->ne[1];
    if (n == 0 || src->ne[2] == 0 || src->ne[3] == 0) {
        return;
    }
    GGML_ASSERT(D % 8 == 0 && n < INT_MAX);
    const int threads = 256;
    const dim3 grid((unsigned) ((n + threads - 1)/threads), (unsigned) src->ne[2], (unsigned) src->ne[3]);
#define ROWS_CASE(T_) case T_: k_rows_to_f16<T_><<<grid, threads, 0, stream>>>((const char *) src->data, src->nb[1], src->nb[2], src->nb[3], \
        dst, D, (int) src->ne[1], n_total, r_off); break;
    switch (src->type) {
        ROWS_CASE(GGML_TYPE_F16)
        ROWS_CASE(GGML_TYPE_BF16)
        ROWS_CASE(GGML_TYPE_F32)
        ROWS_CASE(GGML_TYPE_OSCAR2)
        ROWS_CASE(GGML_TYPE_OSCAR2_64)
        default: GGML_ABORT("oscar2 attention: unexpected type %s", ggml_type_name(src->type));
    }
#undef ROWS_CASE
    CUDA_CHECK(cudaGetLastError());
}

// t: a contiguous f16 tensor shaped like `like`, with n elements along dimension dim (K/V rows: 1)
static void make_f16_view(ggml_tensor & t, const ggml_tensor * like, half * data, int64_t n, int dim = 1) {
    t = *like;
    t.type  = GGML_TYPE_F16;
    t.data  = data;
    t.ne[dim] = n;
    t.nb[0] = sizeof(half);
    t.nb[1] = t.nb[0]*t.ne[0];
    t.nb[2] = t.nb[1]*t.ne[1];
    t.nb[3] = t.nb[2]*t.ne[2];
    t.view_src  = nullptr;
    t.view_offs = 0;
    t.op = GGML_OP_NONE;
    for (auto & s : t.src) {
        s = nullptr;
    }
}

// rows [n_total, n_pad) of each head of a contiguous [D, n_pad, n_head_kv, ns] f16 buffer -> 0
// (masked columns still meet V: 0 * garbage could be NaN)
static __global__ void k_zero_pad_rows(half * __restrict__ dst, int D, int n_total, int n_pad, int64_t n) {
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const int per_head = (n_pad - n_total)*D;
    const int64_t h = i / per_head;
    dst[(h*n_pad + n_total)*D + i % per_head] = __float2half(0.0f);
}

// the mask [>= n_total, ne1, ne2, ne3] (byte strides) -> a contiguous f16 mask of n_pad columns,
// the columns past n_total at -inf. Grid (n_pad/256 rounded up, ne1, ne2*ne3): no 64-bit division
// per element (the first version's: about 150 instructions for each of the 9M columns of a
// 512-token ubatch at depth 16k, every layer)
static __global__ void k_widen_mask(const char * __restrict__ src, int64_t nb1, int64_t nb2, int64_t nb3, int ne2,
        half * __restrict__ dst, int n_total, int n_pad) {
    const int c = blockIdx.x*blockDim.x + threadIdx.x;
    if (c >= n_pad) {
        return;
    }
    const int i1 = blockIdx.y, i2 = blockIdx.z % ne2, i3 = blockIdx.z / ne2;
    const int64_t row = ((int64_t) blockIdx.z*gridDim.y + i1)*n_pad;
    dst[row + c] = c < n_total ? *(const half *) (src + i1*nb1 + i2*nb2 + i3*nb3 + c*sizeof(half)) : __float2half(-INFINITY);
}

// K/V rows of the f16 equivalent: cache rows and window rows, rounded up to the upstream kernels'
// KV stride when an f16 mask can hide the extra rows. Why: with a ragged row count (a 320-row
// window) upstream turns off its GQA batching and its mask-based skipping, which cost prefill at
// 32k about a fifth of its speed (measured 2026-11-23, H100).
static int64_t f16_rows(const ggml_tensor * op) {
    const ggml_tensor * mask = op->src[3];
    const int64_t n = op->src[1]->ne[1] + (op->src[5] ? op->src[5]->ne[1] : 0);
    return mask && mask->type == GGML_TYPE_F16 && mask->ne[0] >= n ? GGML_PAD(n, FATTN_KQ_STRIDE) : n;
}

// the same attention with K and V as plain f16 tensors: [cache rows | window rows | zero rows],
// the zero rows masked
static ggml_tensor f16_equivalent(ggml_backend_cuda_context & ctx, ggml_tensor * dst, ggml_cuda_pool_alloc<half> & kbuf,
        ggml_cuda_pool_alloc<half> & vbuf, ggml_cuda_pool_alloc<half> & mbuf, ggml_tensor & K2, ggml_tensor & V2, ggml_tensor & M2) {
    const ggml_tensor * K = dst->src[1], * V = dst->src[2], * mask = dst->src[3], * Kw = dst->src[5], * Vw = dst->src[6];
    cudaStream_t stream = ctx.stream();
    const int64_t n_w = Kw ? Kw->ne[1] : 0;
    const int64_t n_total = K->ne[1] + n_w;
    const int64_t n_pad = f16_rows(dst);
    kbuf.alloc(ctx.pool(), K->ne[0]*n_pad*K->ne[2]*K->ne[3]);
    vbuf.alloc(ctx.pool(), V->ne[0]*n_pad*V->ne[2]*V->ne[3]);
    rows_to_f16(K, kbuf.get(), (int) n_pad, 0, stream);
    rows_to_f16(V, vbuf.get(), (int) n_pad, 0, stream);
    if (Kw) {
        rows_to_f16(Kw, kbuf.get(), (int) n_pad, (int) K->ne[1], stream);
        rows_to_f16(Vw, vbuf.get(), (int) n_pad, (int) V->ne[1], stream);
    }
    make_f16_view(K2, K, kbuf.get(), n_pad);
    make_f16_view(V2, V, vbuf.get(), n_pad);
    ggml_tensor d2 = *dst;
    d2.src[1] = &K2;
    d2.src[2] = &V2;
    d2.src[5] = nullptr;
    d2.src[6] = nullptr;
    if (n_pad > n_total) {
        const int threads = 256;
        for (const ggml_tensor * t : {&K2, &V2}) {
            const int64_t n = (n_pad - n_total)*t->ne[0]*t->ne[2]*t->ne[3];
            k_zero_pad_rows<<<(n + threads - 1)/threads, threads, 0, stream>>>((half *) t->data, (int) t->ne[0], (int) n_total,
                (int) n_pad, n);
        }
        mbuf.alloc(ctx.pool(), n_pad*mask->ne[1]*mask->ne[2]*mask->ne[3]);
        const dim3 grid((unsigned) ((n_pad + threads - 1)/threads), (unsigned) mask->ne[1], (unsigned) (mask->ne[2]*mask->ne[3]));
        k_widen_mask<<<grid, threads, 0, stream>>>((const char *) mask->data, mask->nb[1], mask->nb[2], mask->nb[3],
            (int) mask->ne[2], mbuf.get(), (int) n_total, (int) n_pad);
        CUDA_CHECK(cudaGetLastError());
        make_f16_view(M2, mask, mbuf.get(), n_pad, 0);
        d2.src[3] = &M2;
    }
    return d2;
}

static bool fa_is_ours(const ggml_tensor * op) {
    return op->op == GGML_OP_FLASH_ATTN_EXT &&
        (oscar2_is_type(op->src[1]->type) || oscar2_is_type(op->src[2]->type) || op->src[5] != nullptr);
}

static bool f16_path_supported(int device, const ggml_tensor * op) {
    ggml_tensor K2, V2;
    make_f16_view(K2, op->src[1], nullptr, f16_rows(op));
    make_f16_view(V2, op->src[2], nullptr, f16_rows(op));
    ggml_tensor d2 = *op;
    d2.src[1] = &K2;
    d2.src[2] = &V2;
    d2.src[5] = nullptr;
    d2.src[6] = nullptr;
    return ggml_cuda_flash_attn_ext_supported(device, &d2);
}

static void flash_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (vec_path_ok(dst)) {
        fa_vec(ctx, dst);
        return;
    }
    ggml_cuda_pool_alloc<half> kbuf, vbuf, mbuf;
    ggml_tensor K2, V2, M2;
    ggml_tensor d2 = f16_equivalent(ctx, dst, kbuf, vbuf, mbuf, K2, V2, M2);
    ggml_cuda_flash_attn_ext(ctx, &d2);
}

// ---- OSCAR rotations of a few vectors ----------------------------------------------------------
//
// The graph rotates q, k and v and un-rotates the attention output with ggml_mul_mat(A, x),
// A a d x d f32 matrix (R or R^T). At decode x is one token's heads: 8 to 64 vectors. Upstream
// sends such products to cuBLAS or its tensor-core f32 kernel, 5-8 us each (ncu, H100,
// 2026-11-23), four per layer: 0.8 ms of every decoded token of an 8B model. Here a block takes
// 32 rows of A and 8 vectors: it loads both into shared memory with every load in flight at once
// (A comes from DRAM: a first version that walked A's rows in a loop waited for DRAM eight times
// and was slower than cuBLAS), then each thread forms two outputs.
// Reference: ggml's mul_mat, dst[i + j*d] = sum_k A[k + i*d] x[k + j*d].

#define OSCAR_ROT_ROWS     32   // rows of A (outputs per vector) per block
#define OSCAR_ROT_COLS     8    // vectors per block
#define OSCAR_ROT_THREADS  128  // = OSCAR_ROT_ROWS*OSCAR_ROT_COLS/2: two outputs per thread
#define OSCAR_ROT_MAX_COLS 256  // more (prefill) go to upstream's GEMM, built for that

template <int D>
static __global__ void k_rotate_cols(const float * __restrict__ A, const float * __restrict__ x, float * __restrict__ dst, const int n_cols) {
    constexpr int D4 = D/4, P4 = D4 + 1; // rows padded by one float4: no bank conflicts below
    __shared__ float4 sa[OSCAR_ROT_ROWS*P4];
    __shared__ float4 sx[OSCAR_ROT_COLS][D4];
    const int t  = threadIdx.x;
    const int i0 = blockIdx.x*OSCAR_ROT_ROWS;
    const int j0 = blockIdx.y*OSCAR_ROT_COLS;
    const int nc = min(OSCAR_ROT_COLS, n_cols - j0);
    const float4 * a4 = (const float4 *) (A + (int64_t) i0*D);
    const float4 * x4 = (const float4 *) (x + (int64_t) j0*D);
#pragma unroll
    for (int e = t; e < OSCAR_ROT_ROWS*D4; e += OSCAR_ROT_THREADS) {
        sa[(e / D4)*P4 + e % D4] = a4[e];
    }
#pragma unroll
    for (int e = t; e < OSCAR_ROT_COLS*D4; e += OSCAR_ROT_THREADS) {
        sx[e / D4][e % D4] = e / D4 < nc ? x4[e] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();
    const int r = t % OSCAR_ROT_ROWS;       // the output row of this thread
    const int c = 2*(t / OSCAR_ROT_ROWS);   // its two vectors (one per warp pair: broadcast reads)
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 8
    for (int k4 = 0; k4 < D4; ++k4) {
        const float4 av = sa[r*P4 + k4], x0 = sx[c][k4], x1 = sx[c + 1][k4];
        acc0 += av.x*x0.x + av.y*x0.y + av.z*x0.z + av.w*x0.w;
        acc1 += av.x*x1.x + av.y*x1.y + av.z*x1.z + av.w*x1.w;
    }
    if (c < nc) {
        dst[(int64_t) (j0 + c)*D + i0 + r] = acc0;
    }
    if (c + 1 < nc) {
        dst[(int64_t) (j0 + c + 1)*D + i0 + r] = acc1;
    }
}

// a tagged rotation this kernel takes: both operands f32 and contiguous, A square of a head size
static bool rotation_ok(const ggml_tensor * dst) {
    int32_t tag;
    memcpy(&tag, dst->op_params, sizeof(tag));
    const ggml_tensor * A = dst->src[0], * x = dst->src[1];
    const int64_t d = A->ne[0];
    return tag == OSCAR2_ROTATION_TAG && A->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
        (d == 64 || d == 128 || d == 256) && A->ne[1] == d && ggml_nrows(A) == d && x->ne[0] == d &&
        ggml_nrows(x) <= OSCAR_ROT_MAX_COLS && ggml_is_contiguous(A) && ggml_is_contiguous(x) && ggml_is_contiguous(dst);
}

// ... and one a fused launch may take: those read the matrix before they wait for the kernels
// before them (launch_dependent), so it must be a leaf of the graph (a model tensor, or a view
// of one), written before the graph runs
static bool rotation_fusable(const ggml_tensor * dst) {
    const ggml_tensor * A = dst->src[0];
    return rotation_ok(dst) && (A->view_src ? A->view_src : A)->op == GGML_OP_NONE;
}

static void rotate_cols(const ggml_tensor * dst, cudaStream_t stream) {
    const ggml_tensor * A = dst->src[0], * x = dst->src[1];
    const int n = (int) ggml_nrows(x);
    const int d = (int) A->ne[0];
    const dim3 grid(d/OSCAR_ROT_ROWS, (n + OSCAR_ROT_COLS - 1)/OSCAR_ROT_COLS);
    const float * a = (const float *) A->data, * xs = (const float *) x->data;
    float * y = (float *) dst->data;
    switch (d) {
        case  64: k_rotate_cols< 64><<<grid, OSCAR_ROT_THREADS, 0, stream>>>(a, xs, y, n); break;
        case 128: k_rotate_cols<128><<<grid, OSCAR_ROT_THREADS, 0, stream>>>(a, xs, y, n); break;
        case 256: k_rotate_cols<256><<<grid, OSCAR_ROT_THREADS, 0, stream>>>(a, xs, y, n); break;
    }
    CUDA_CHECK(cudaGetLastError());
}

// the clip ratio a set_rows / cpy into oscar2 carries (llama_oscar_tag_clip)
static float op_clip(const ggml_tensor * t) {
    float c;
    memcpy(&c, t->op_params, sizeof(float));
    return c;
}

static bool rows_contiguous(const ggml_tensor * t) {
    return t->nb[0] == ggml_type_size(t->type) && t->nb[1] >= (size_t) ggml_row_size(t->type, t->ne[0]);
}

// ---- a rotation fused with the cache writes of its result ------------------------------------
//
// At decode a layer's graph rotates v, k and q (one token's heads each) and then stores k and v
// twice: into the INT2 cache (set_rows, quantized) and into the high-precision window (set_rows,
// f16). Each of those seven nodes is a launch of a few microseconds, mostly fixed cost, where an
// f16 cache has two (its K write is even fused into RoPE): about 1 ms of every decoded token of
// an 8B model (2026-11-23, H100). When the set_rows nodes that store a rotation's result come
// after it in the graph, the rotation's launch does their work and they become no-ops. The
// rotations built right after k's join k's launch (find_job): q's, by the same matrix, and
// v's with its own stores: one launch a layer instead of seven (H100, Llama-8B
// shape, tg64 with the set_rows fused: +2.9% at depth 0, +1.8% at 32768,
// gpu/results/2026-11-24-decode-fixed-costs; with q too: 32 launches of k_rotate_cols a token
// fewer, gpu/results/2026-11-24-packed-int2; with v too: gpu/results/2026-11-24-one-launch).
//
// The plan is made in upstream's ggml_cuda_try_fuse (so GGML_CUDA_DISABLE_FUSION=1 turns it
// off, and GGML_CUDA_OSCAR_NO_FUSION=1 turns off only this one): a set_rows node may move up to
// its rotation only if no node in between reads or writes the rows it writes (checked by byte
// ranges). The fused launch happens when the rotation node is computed; the set_rows nodes and
// the rotation it did are then skipped. Nothing is planned across graphs.
//
// Block: S = max(D, G) consecutive values of one token's row (S/D heads, S/G groups) of one job
// (a rotation and its stores), S threads. Each warp forms 32 of the values
// y_i = sum_k A[(i%D)*D + k] x[k + its head's offset], as ggml's mul_mat (and k_rotate_cols)
// define it (warp_rows_matvec), and writes them to the rotation's output; each store target then
// takes the block's values: converted (window) or quantized by teams exactly as
// k_oscar2_quantize does (the same sanitize and quantize_group on the same f32 values).

#define OSCAR_FUSED_STORES 2  // the INT2 cache and the window
#define OSCAR_FUSE_SCAN    32 // graph nodes after a rotation searched for its set_rows
#define OSCAR_FUSED_JOBS   3  // k with its stores, q (k's matrix, no stores), v with its stores

struct rot_store {
    char *       dst;   // the set_rows destination (a row-major view of the cache or window)
    int64_t      nb1;   // its row stride in bytes
    const void * idx;   // its row of each token (i64 or i32, element stride idx_s)
    int64_t      idx_s;
    bool         idx64;
    ggml_type    type;
    float        clip;  // oscar2 destinations: the layer's clip ratio (op_params of the set_rows)
};

struct rot_stores {
    rot_store s[OSCAR_FUSED_STORES];
    int n;
};

// one rotation of a fused launch and the cache writes of its result
struct rot_job {
    const float * A;  // D x D f32, row-major
    const float * x;  // [E, tokens] f32, contiguous
    float *       y;
    int64_t       E;  // values per token, a multiple of the launch's S
    rot_stores    st; // (n = 0: none)
};

struct rot_jobs {
    rot_job j[OSCAR_FUSED_JOBS];
    int n;
};

// the block's S values (shared memory) quantized into groups of G of the oscar2 row drow
template <int G, int S>
static __device__ __forceinline__ void store_int2_groups(const float * sy, char * drow, const int64_t e0, const float clip) {
    constexpr int TEAM  = G/4;
    constexpr int BYTES = 4 + G/4;
    constexpr int LANES = S/4;  // S/G teams of G/4 lanes
    const int i = threadIdx.x;
    if (i >= (LANES + WARP_SIZE - 1)/WARP_SIZE*WARP_SIZE) {
        return; // warps with no lane of a team (whole warps take part in the shuffles)
    }
    const bool active = i < LANES;
    const int g = active ? i / TEAM : 0;
    const int b = i % TEAM;
    float v[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        v[s] = sanitize(sy[g*G + b + s*TEAM]);
    }
    uint16_t dbits, mbits;
    const uint8_t byte = quantize_group<G>(v, clip, b, dbits, mbits);
    if (active) {
        uint8_t * blk = (uint8_t *) drow + (e0/G + g)*BYTES;
        blk[4 + b] = byte;
        if (b == 0) {
            blk[0] = (uint8_t) (dbits & 0xff); blk[1] = (uint8_t) (dbits >> 8);
            blk[2] = (uint8_t) (mbits & 0xff); blk[3] = (uint8_t) (mbits >> 8);
        }
    }
}

// one step of the halving exchanges below: lanes l and l ^ H swap halves of their 2H partials
// (a template per step: with a loop over H the partials were indexed at run time, in local memory)
template <int H>
static __device__ __forceinline__ void halving_sums(float * pj, const int l) {
    const bool hi = l & H;
#pragma unroll
    for (int j = 0; j < H; ++j) {
        const float send = hi ? pj[j] : pj[j + H];
        const float keep = hi ? pj[j + H] : pj[j];
        pj[j] = keep + __shfl_xor_sync(0xffffffff, send, H, WARP_SIZE);
    }
    if constexpr (H > 1) {
        halving_sums<H/2>(pj, l);
    }
}

// Rows r0 .. r0+31 of A (D x D f32, row-major) times x (shared memory), by one warp: load()
// then dot(), which returns the lane's row (r0 + row_off) of the product. Why not a row per
// thread: 32 threads reading 32 rows make every warp load touch 32 cache lines; here a warp load
// is 512 contiguous bytes (LPR lanes per row, RPL rows per load). Each lane dots its columns of
// the 32 rows, and the 32 partial vectors are summed across lanes by halving exchanges: at each
// step a lane keeps half of its partials, sends the other half to its partner and adds what
// comes back (31 shuffles for 32 lanes), which leaves lane l with partial number l % LPR, summed.
// load() holds A's part in registers (up to 32 float4; D = 256 loads in dot()), so that the
// caller can issue it before it waits for x: A usually comes from DRAM, x from L2.
template <int D>
struct warp_rows_matvec {
    static constexpr int D4  = D/4;
    static constexpr int LPR = D4 < WARP_SIZE ? D4 : WARP_SIZE; // lanes per row
    static constexpr int RPL = WARP_SIZE/LPR;                   // rows per warp load
    static constexpr int NJ  = WARP_SIZE/RPL;                   // partials per lane (= LPR)
    static constexpr int CPL = D4/LPR;                          // float4 loads per row and lane
    static constexpr bool PRE = NJ*CPL <= 32;                   // load() keeps A in registers

    const float * A;
    int r0;
    float4 a[PRE ? NJ : 1][PRE ? CPL : 1];

    __device__ __forceinline__ const float4 * row(const int j) const {
        const int l = threadIdx.x % WARP_SIZE;
        return (const float4 *) (A + (int64_t) (r0 + j*RPL + l / LPR)*D);
    }
    __device__ __forceinline__ void load(const float * __restrict__ A_, const int r0_) {
        A = A_;
        r0 = r0_;
        if constexpr (PRE) {
            const int c = threadIdx.x % WARP_SIZE % LPR;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
#pragma unroll
                for (int cc = 0; cc < CPL; ++cc) {
                    // volatile and coherent: ptxas sank plain and .nc loads past the caller's barrier
                    float4 & v = a[j][cc];
                    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(row(j) + c + cc*LPR));
                }
            }
        }
    }
    __device__ __forceinline__ float dot(const float4 * x4, int & row_off) const {
        const int l = threadIdx.x % WARP_SIZE, sub = l / LPR, c = l % LPR;
        float pj[NJ];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            float acc = 0.0f;
#pragma unroll
            for (int cc = 0; cc < CPL; ++cc) {
                const float4 av = PRE ? a[PRE ? j : 0][PRE ? cc : 0] : row(j)[c + cc*LPR], xv = x4[c + cc*LPR];
                acc += av.x*xv.x + av.y*xv.y + av.z*xv.z + av.w*xv.w;
            }
            pj[j] = acc;
        }
        halving_sums<NJ/2>(pj, l);
        row_off = c*RPL + sub;
        return pj[0];
    }
};

// Block e0/S of token t of job J
template <int D, int S>
static __device__ __forceinline__ void rotate_store_block(const rot_job & J, const int64_t e0, const int64_t t,
        float4 * sx4, float * sy) {
    const int i = threadIdx.x;
    const int64_t base = t*J.E + e0;
    const int v0 = (i / WARP_SIZE)*WARP_SIZE; // the warp's first value: head v0/D, rows v0%D..
    warp_rows_matvec<D> mv;
    mv.load(J.A, v0 % D);                      // in flight while x arrives (A: a weight)
    ggml_cuda_pdl_sync();                      // x, and the cache rows we write, belong to earlier kernels
    ((float *) sx4)[i] = J.x[base + i];
    __syncthreads();
    {
        int off;
        const float v = mv.dot(sx4 + (v0 / D)*(D/4), off);
        J.y[base + v0 + off] = v;
        sy[v0 + off] = v;
    }
    if (J.st.n == 0) {
        return; // (the whole block)
    }
    __syncthreads();
    const float acc = sy[i];
#pragma unroll 1
    for (int j = 0; j < OSCAR_FUSED_STORES; ++j) {
        if (j >= J.st.n) {
            break;
        }
        const rot_store & s = J.st.s[j];
        const int64_t row = s.idx64 ? ((const int64_t *) s.idx)[t*s.idx_s] : (int64_t) ((const int32_t *) s.idx)[t*s.idx_s];
        char * drow = s.dst + row*s.nb1;
        switch (s.type) {
            case GGML_TYPE_F16:       ((half *)        drow)[e0 + i] = __float2half_rn(acc);     break;
            case GGML_TYPE_BF16:      ((nv_bfloat16 *) drow)[e0 + i] = __float2bfloat16_rn(acc); break;
            case GGML_TYPE_F32:       ((float *)       drow)[e0 + i] = acc;                      break;
            case GGML_TYPE_OSCAR2:    store_int2_groups<QK_OSCAR2,    S>(sy, drow, e0, s.clip);  break;
            case GGML_TYPE_OSCAR2_64: store_int2_groups<QK_OSCAR2_64, S>(sy, drow, e0, s.clip);  break;
            default: break;
        }
    }
}

// Grid (sum of E/S over the jobs, tokens): the first E_0/S blocks take job 0, the next job 1, ...
// The job is indexed at run time in the parameters themselves (OSCAR_GRID_CONSTANT: no copy to
// local memory), so the block's code is there once, not once per job: with a constant index
// per job and both stores unrolled the kernel was 7224 SASS instructions (113 KB, sm_90, D =
// 128), and in the model's decode, where its code comes cold, k's blocks ended 6.7 us after the
// start, v's 3.4 and q's (no stores) 1.5 (per-block timeline, H200, Llama-8B shape, 2026-11-24).
// Now 1544 instructions (24 KB): the last block ends at 3.7-4.0 us, and the attention's first
// starts about 3 us earlier.
// (__grid_constant__ needs CUDA 11.7 and compute_70: nvcc rejects it in a pass for an older
// arch, which a CUDA 12 build for Pascal has; there the run-time index copies the jobs to local
// memory, correct and slower)
#if !defined(GGML_USE_HIP) && defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7)) && \
    (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700)
#define OSCAR_GRID_CONSTANT __grid_constant__
#else
#define OSCAR_GRID_CONSTANT
#endif
template <int D, int S>
static __global__ void k_rotate_store(const OSCAR_GRID_CONSTANT rot_jobs jobs) {
    static_assert(S % WARP_SIZE == 0 && D % WARP_SIZE == 0, "whole warps of rows");
    __shared__ float4 sx4[S/4];
    __shared__ float  sy[S];
    // (no early ggml_cuda_pdl_lc here: the attention's blocks would become resident beside ours
    // and wait, and on an SM that holds one of ours fewer of them fit, while its grid is sized to
    // fill every SM in one wave. Measured twice, neither time a gain: tg32 at 131072 was 162.66 /
    // 170.28 tok/s with this trigger and 170.91 / 166.01 without (H100); tg64 at 32768, four
    // rounds alternating in one session, 250.9 with and 252.6 without (H200, 2026-11-24), though
    // the per-block timeline shows the attention's first block 1.3 us after our last one ends.
    // Llama-8B shape; between runs the spread is 3-5%)
    const int64_t t = blockIdx.y;
    const int b0 = (int) (jobs.j[0].E/S), b1 = b0 + (jobs.n > 1 ? (int) (jobs.j[1].E/S) : 0);
    const int b = blockIdx.x;
    const int jb = b < b0 ? 0 : b < b1 ? 1 : 2;
    rotate_store_block<D, S>(jobs.j[jb], (int64_t) (b - (jb == 0 ? 0 : jb == 1 ? b0 : b1))*S, t, sx4, sy);
}

// the plan: the rotations one launch does, each with the set_rows nodes it does (jobs[0] is the
// node that launches, the others move up to it); the nodes done and not yet reached by the graph
// loop. Per thread: a backend's graph is computed by one thread.
struct planned_rot {
    const ggml_tensor * rot = nullptr;
    const ggml_tensor * stores[OSCAR_FUSED_STORES] = {};
    int n_stores = 0;
};
struct fuse_plan {
    const ggml_cgraph * graph = nullptr;
    int last_i = -1;
    planned_rot jobs[OSCAR_FUSED_JOBS];
    int n_jobs = 0;
    int64_t span = 0; // values per block of k_rotate_store (fused_span of every store)
    const ggml_tensor * fa    = nullptr; // an attention node whose combine also does
    const ggml_tensor * unrot = nullptr; // the un-rotation of its output
    std::vector<const ggml_tensor *> done; // set_rows and rotations done by a fused launch
};
static thread_local fuse_plan g_fuse;

static bool is_noop(const ggml_tensor * t) {
    return ggml_is_empty(t) || t->op == GGML_OP_NONE || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_VIEW ||
        t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE;
}

static bool bytes_overlap(const ggml_tensor * a, const ggml_tensor * b) {
    if (!a || !b || !a->data || !b->data) {
        return false;
    }
    const char * a0 = (const char *) a->data, * b0 = (const char *) b->data;
    return a0 < b0 + ggml_nbytes(b) && b0 < a0 + ggml_nbytes(a);
}

// node mid writes t's bytes or reads them
static bool node_touches(const ggml_tensor * mid, const ggml_tensor * t) {
    if (bytes_overlap(mid, t)) {
        return true;
    }
    for (int s = 0; s < GGML_MAX_SRC; ++s) {
        if (bytes_overlap(mid->src[s], t)) {
            return true;
        }
    }
    return false;
}

// values per block of k_rotate_store for head size d and destination type t
static int64_t fused_span(int64_t d, ggml_type t) {
    return oscar2_is_type(t) ? std::max<int64_t>(d, group_of(t)) : d;
}

// sr stores (a contiguous 2-D view of) the whole result of rotation rot, in a form the kernel writes
static bool fusable_store(const ggml_tensor * rot, const ggml_tensor * sr) {
    if (sr->op != GGML_OP_SET_ROWS || (sr->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
        return false;
    }
    const ggml_tensor * src = sr->src[0], * idx = sr->src[1];
    const ggml_tensor * root = src->view_src ? src->view_src : src;
    if (root != rot || src->data != rot->data || src->type != GGML_TYPE_F32 || !ggml_is_contiguous(src) ||
        src->ne[2] != 1 || src->ne[3] != 1 || src->ne[0]*src->ne[1] != ggml_nelements(rot)) {
        return false;
    }
    if ((idx->type != GGML_TYPE_I64 && idx->type != GGML_TYPE_I32) || idx->ne[0] != src->ne[1] ||
        idx->nb[0] != ggml_type_size(idx->type)) {
        return false;
    }
    const ggml_type t = sr->type;
    const bool type_ok = oscar2_is_type(t) || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_F32;
    return type_ok && sr->ne[0] == src->ne[0] && sr->ne[2] == 1 && sr->ne[3] == 1 && rows_contiguous(sr) &&
        src->ne[0] % fused_span(rot->src[0]->ne[0], t) == 0;
}

// node n is one of the plan's rotations or stores
static bool is_planned(const fuse_plan & p, const ggml_tensor * n) {
    for (int j = 0; j < p.n_jobs; ++j) {
        const planned_rot & r = p.jobs[j];
        if (r.rot == n || std::find(r.stores, r.stores + r.n_stores, n) != r.stores + r.n_stores) {
            return true;
        }
    }
    return false;
}

// whether node t (a rotation or a set_rows after the launch node) may be done by the launch:
// no node between them, other than those the launch also does, reads or writes its output or
// writes its input
static bool may_move_up(const ggml_cgraph * cgraph, int i, const ggml_tensor * t, const fuse_plan & p) {
    for (int k = i + 1; k < cgraph->n_nodes && cgraph->nodes[k] != t; ++k) {
        const ggml_tensor * mid = cgraph->nodes[k];
        if (is_noop(mid) || is_planned(p, mid)) {
            continue;
        }
        if (node_touches(mid, t) || (t->op == GGML_OP_MUL_MAT && bytes_overlap(mid, t->src[1]))) {
            return false;
        }
    }
    return true;
}

// whether out (and in, when given) share no bytes with what the planned jobs read or write:
// the jobs of a launch run side by side
static bool apart_from_jobs(const ggml_tensor * out, const ggml_tensor * in, const fuse_plan & p) {
    for (int k = 0; k < p.n_jobs; ++k) {
        const planned_rot & r = p.jobs[k];
        if (bytes_overlap(out, r.rot) || bytes_overlap(out, r.rot->src[1]) || bytes_overlap(in, r.rot)) {
            return false;
        }
        for (int s = 0; s < r.n_stores; ++s) {
            if (bytes_overlap(out, r.stores[s]) || bytes_overlap(in, r.stores[s])) {
                return false;
            }
        }
    }
    return true;
}

// the set_rows after node r (within end) that store the whole result of job's rotation (a job
// of plan p, counted in it) and may be done by the launch at node i, into job's stores; widens
// span to what they need
static void find_stores(const ggml_cgraph * cgraph, int i, int r, int end, const fuse_plan & p, planned_rot & job,
        int64_t & span) {
    job.n_stores = 0;
    for (int j = r + 1; j < end && job.n_stores < OSCAR_FUSED_STORES; ++j) {
        const ggml_tensor * sr = cgraph->nodes[j];
        if (is_noop(sr) || !fusable_store(job.rot, sr)) {
            continue;
        }
        // (the stores found so far are done by the launch too; the rows it writes are apart
        // from every job's operands and stores, its own rotation's included)
        if (may_move_up(cgraph, i, sr, p) && apart_from_jobs(sr, nullptr, p)) {
            job.stores[job.n_stores++] = sr;
            span = std::max(span, fused_span(job.rot->src[0]->ne[0], sr->type));
        }
    }
}

// A rotation after node i (within end) that the launch of node i can do too: T tokens of whole
// blocks of `span` values, of the same head size, sharing no bytes with what the launch already
// does, and free to move up to node i. same_matrix: by node i's matrix (q's rotation: no stores
// of its own), else by another (v's, with its stores). The graph builds both right after k's
// rotation (patch 0017: llama_oscar_rotate_q, and v's rotation expanded after it), so that k's
// launch takes them: one launch a layer instead of three. (Built after k's cache writes, q's
// result shared memory with k's, freed by then: it was taken in 1 layer of 32.)
static int find_job(const ggml_cgraph * cgraph, int i, int end, int64_t T, int64_t span, bool same_matrix, const fuse_plan & p) {
    const ggml_tensor * rot = cgraph->nodes[i];
    for (int j = i + 1; j < end; ++j) {
        const ggml_tensor * sb = cgraph->nodes[j];
        if (sb->op != GGML_OP_MUL_MAT || (sb->flags & GGML_TENSOR_FLAG_COMPUTE) == 0 || !rotation_fusable(sb) ||
            (sb->src[0]->data == rot->src[0]->data) != same_matrix || !ggml_are_same_shape(sb->src[0], rot->src[0])) {
            continue;
        }
        if (is_planned(p, sb)) {
            continue;
        }
        if (T <= 0 || ggml_nelements(sb) % T != 0 || (ggml_nelements(sb)/T) % span != 0) {
            return -1;
        }
        return apart_from_jobs(sb, sb->src[1], p) && may_move_up(cgraph, i, sb, p) ? j : -1;
    }
    return -1;
}

// The output's un-rotation after attention node i (llama_oscar_unrotate_out: a tagged rotation of
// the whole output, through views only), for the combine to do (k_fa_combine, UNROT): when the
// attention is ours, the device is sm_90 or newer and no node in between is in the way. (The
// combine no longer uses clusters, so older archs could take it too; not yet run on one.)
// Taken by fa_vec only (the split-KV decode); the f16 prefill path leaves it to its own node.
static void plan_unrot(const ggml_cgraph * cgraph, int i, int end, int cc) {
    fuse_plan & p = g_fuse;
    const ggml_tensor * fa = cgraph->nodes[i];
    p.fa = nullptr;
    p.unrot = nullptr;
    if (!fa_is_ours(fa) || !GGML_CUDA_CC_IS_NVIDIA(cc) || ggml_cuda_highest_compiled_arch(cc) < GGML_CUDA_CC_HOPPER ||
        fa->type != GGML_TYPE_F32 || !ggml_is_contiguous(fa)) {
        return;
    }
    const int64_t D = fa->ne[0];
    for (int j = i + 1; j < end; ++j) {
        const ggml_tensor * u = cgraph->nodes[j];
        if (u->op != GGML_OP_MUL_MAT || !rotation_fusable(u) || (u->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            continue;
        }
        if (u->src[1]->data != fa->data || ggml_nelements(u->src[1]) != ggml_nelements(fa) || u->src[0]->ne[0] != D ||
            bytes_overlap(u, fa)) {
            return;
        }
        for (int k = i + 1; k < j; ++k) {
            const ggml_tensor * mid = cgraph->nodes[k];
            if (!is_noop(mid) && (node_touches(mid, u) || bytes_overlap(mid, fa))) {
                return;
            }
        }
        p.fa = fa;
        p.unrot = u;
        return;
    }
}

static fa_unrot take_unrot(const ggml_tensor * fa) {
    fuse_plan & p = g_fuse;
    fa_unrot un;
    if (p.fa == fa && p.unrot) {
        un.U = (const float *) p.unrot->src[0]->data;
        un.y = (float *) p.unrot->data;
        p.done.push_back(p.unrot);
    }
    p.fa = nullptr;
    p.unrot = nullptr;
    return un;
}

void ggml_cuda_oscar2_plan_fusion(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    fuse_plan & p = g_fuse;
    if (cgraph != p.graph || i <= p.last_i) {
        p = fuse_plan(); // a new pass over a graph: nothing of the last one carries over
        p.graph = cgraph;
    }
    p.last_i = i;
    // GGML_CUDA_OSCAR_NO_FUSION=1: this fusion alone off (upstream's stay on), for A/B timing
    static const bool off = env_flag("GGML_CUDA_OSCAR_NO_FUSION", false);
    const ggml_tensor * rot = cgraph->nodes[i];
    if (off) {
        return;
    }
    // upstream's concurrent streams reorder nodes; leave those graphs alone
    if (!ctx.stream_context().concurrent_events.empty()) {
        return;
    }
    const int end = std::min(cgraph->n_nodes, i + 1 + OSCAR_FUSE_SCAN);
    if (rot->op == GGML_OP_FLASH_ATTN_EXT) {
        // GGML_CUDA_OSCAR_NO_UNROT=1: the un-rotation in its own launch again, for A/B timing
        static const bool no_unrot = env_flag("GGML_CUDA_OSCAR_NO_UNROT", false);
        if (!no_unrot) {
            plan_unrot(cgraph, i, end, ggml_cuda_info().devices[ctx.device].cc);
        }
        return;
    }
    if (rot->op != GGML_OP_MUL_MAT || !rotation_fusable(rot)) {
        return;
    }
    fuse_plan plan; // built here, adopted only whole
    plan.n_jobs = 1;
    plan.jobs[0].rot = rot;
    int64_t span = rot->src[0]->ne[0];
    find_stores(cgraph, i, i, end, plan, plan.jobs[0], span);
    if (plan.jobs[0].n_stores == 0) {
        return;
    }
    const int64_t T = plan.jobs[0].stores[0]->src[0]->ne[1];
    // q's rotation (k's matrix), then v's with its stores, each if it fits this launch
    for (bool same : { true, false }) {
        const int j = find_job(cgraph, i, end, T, span, same, plan);
        if (j < 0) {
            continue;
        }
        planned_rot & r = plan.jobs[plan.n_jobs];
        r.rot = cgraph->nodes[j];
        plan.n_jobs++;
        int64_t span2 = span;
        if (!same) {
            find_stores(cgraph, i, j, end, plan, r, span2);
        }
        if (span2 != span || (r.n_stores > 0 && r.stores[0]->src[0]->ne[1] != T)) {
            plan.n_jobs--; // (its blocks would differ from the launch's)
            r = planned_rot();
        }
    }
    // every store's row must split into whole blocks of the common span
    for (int k = 0; k < plan.n_jobs; ++k) {
        for (int s = 0; s < plan.jobs[k].n_stores; ++s) {
            if (plan.jobs[k].stores[s]->ne[0] % span != 0) {
                return;
            }
        }
    }
    p.n_jobs = plan.n_jobs;
    std::copy(plan.jobs, plan.jobs + plan.n_jobs, p.jobs);
    p.span = span;
}

template <int D>
static void launch_rotate_store(const rot_jobs & jobs, int64_t T, int S, cudaStream_t stream) {
    int64_t blocks = 0;
    for (int j = 0; j < jobs.n; ++j) {
        blocks += jobs.j[j].E/S;
    }
    const dim3 grid((unsigned) blocks, (unsigned) T);
    if (S == D) {
        launch_dependent(k_rotate_store<D, D>, OSCAR_PDL_ROTATE, grid, dim3(D), 0, stream, jobs);
    } else if (S == 2*D && D <= 128) {
        launch_dependent(k_rotate_store<D, (D <= 128 ? 2*D : D)>, OSCAR_PDL_ROTATE, grid, dim3(2*D), 0, stream, jobs);
    } else {
        GGML_ABORT("oscar2: no fused rotation of head size %d in blocks of %d values", D, S);
    }
}

// the planned rotations with their stores, in one launch (false: rot is not the planned one)
static bool rotate_store(const ggml_tensor * rot, cudaStream_t stream) {
    fuse_plan & p = g_fuse;
    if (p.n_jobs == 0 || p.jobs[0].rot != rot) {
        return false;
    }
    const int64_t D = rot->src[0]->ne[0];
    const int64_t T = p.jobs[0].stores[0]->src[0]->ne[1];
    rot_jobs jobs = {};
    for (int k = 0; k < p.n_jobs; ++k) {
        const planned_rot & r = p.jobs[k];
        rot_job & J = jobs.j[k];
        J = { (const float *) r.rot->src[0]->data, (const float *) r.rot->src[1]->data, (float *) r.rot->data,
              ggml_nelements(r.rot)/T, {} };
        for (int s = 0; s < r.n_stores; ++s) {
            const ggml_tensor * sr = r.stores[s], * idx = sr->src[1];
            J.st.s[s] = { (char *) sr->data, (int64_t) sr->nb[1], idx->data, 1, idx->type == GGML_TYPE_I64, sr->type,
                          oscar2_is_type(sr->type) ? op_clip(sr) : 0.0f };
            p.done.push_back(sr);
        }
        J.st.n = r.n_stores;
        if (k > 0) {
            p.done.push_back(r.rot);
        }
    }
    jobs.n = p.n_jobs;
    const int S = (int) p.span;
    switch (D) {
        case  64: launch_rotate_store< 64>(jobs, T, S, stream); break;
        case 128: launch_rotate_store<128>(jobs, T, S, stream); break;
        case 256: launch_rotate_store<256>(jobs, T, S, stream); break;
    }
    p.n_jobs = 0;
    return true;
}

// a set_rows or rotation node that a fused rotation launch already did
static bool fused_done(const ggml_tensor * sr) {
    auto & done = g_fuse.done;
    const auto it = std::find(done.begin(), done.end(), sr);
    if (it == done.end()) {
        return false;
    }
    done.erase(it);
    return true;
}

// ---- dispatch -----------------------------------------------------------------------------

bool ggml_cuda_oscar2_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    switch (dst->op) {
        case GGML_OP_SET_ROWS:
            if (fused_done(dst)) {
                return true; // written by the fused rotation before it (window rows too)
            }
            if (!oscar2_is_type(dst->type)) {
                return false;
            }
            oscar2_quantize(dst->src[0], dst->src[1], dst, op_clip(dst), ctx.stream());
            return true;
        case GGML_OP_CPY: {
            const ggml_tensor * src = dst->src[0];
            ggml_tensor * to = dst->src[1];
            if (oscar2_is_type(to->type)) {
                oscar2_quantize(src, nullptr, to, op_clip(dst), ctx.stream());
                return true;
            }
            if (oscar2_is_type(src->type)) {
                oscar2_dequantize(src, nullptr, to, ctx.stream());
                return true;
            }
            return false;
        }
        case GGML_OP_GET_ROWS:
            if (!oscar2_is_type(dst->src[0]->type)) {
                return false;
            }
            oscar2_dequantize(dst->src[0], dst->src[1], dst, ctx.stream());
            return true;
        case GGML_OP_FLASH_ATTN_EXT:
            if (!fa_is_ours(dst)) {
                return false;
            }
            flash_attn(ctx, dst);
            return true;
        case GGML_OP_MUL_MAT:
            if (!rotation_ok(dst)) {
                return false;
            }
            if (fused_done(dst)) {
                return true; // q or v, rotated by the launch of k's rotation before it (or the output's
                             // un-rotation, done by the attention's combine)
            }
            if (!rotate_store(dst, ctx.stream())) {
                rotate_cols(dst, ctx.stream());
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
            return vec_types_ok(op->src[1]->type, op->src[2]->type, op->src[1]->ne[0]) && f16_path_supported(device, op);
        default:
            return -1;
    }
}
