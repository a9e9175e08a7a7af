// quantize-group.cuh: one group of an oscar2 row quantized by a team of G/4 lanes, on the GPU.
//
// The device twin of oscar2_quantize_row_g in ../oscar2.c (steps 0-4 of oscar2.h: sanitize,
// clip to the k-th smallest |x|, min and scale, thresholds), and of the numpy twin
// oscar_gguf/format/oscar2.py. It must give the same bytes: the cache writes that use it (set-rows.cu,
// rotate-store.cu) are checked bit for bit against the CPU by tests/test_oscar2_ops.py and by
// NMSE in test-backend-ops (SET_ROWS, CPY, OSCAR_ROTATE_STORE; ../tests/oscar2-backend-ops.inc).
//
// Lane b of a team owns byte b of qs and the four values b + s*G/4 (s = 0..3) that it packs.
#pragma once

#include "oscar2-common.cuh"

struct fmaxf_op { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct fminf_op { __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); } };

// op over the G/4 lanes of the team (every lane gets the result)
template <int G, typename Op>
static __device__ __forceinline__ float team_reduce(float v, const Op op) {
#pragma unroll
    for (int off = G/8; off > 0; off >>= 1) {
        v = op(v, __shfl_xor_sync(0xffffffff, v, off, G/4));
    }
    return v;
}
template <int G> static __device__ __forceinline__ float team_max(float v) { return team_reduce<G>(v, fmaxf_op()); }
template <int G> static __device__ __forceinline__ float team_min(float v) { return team_reduce<G>(v, fminf_op()); }

static __device__ __forceinline__ float sanitize(float x) {
    // non-finite and fp32-subnormal values become +0 (oscar2.h step 0); bit tests, because
    // -use_fast_math may assume away NaNs
    const uint32_t u = __float_as_uint(x) & 0x7fffffffu;
    return (u >= 0x7f800000u || u < 0x00800000u) ? 0.0f : __fadd_rn(x, 0.0f);
}

// the k-th smallest (0-based) of the team's G values a >= 0 (finite: sanitize ran), as every
// lane of the team sees it. The CPU reference takes the value of rank k with ties broken by
// element index; the value is the same whichever tie is taken, so any exact selection agrees.
// sm_80+: a radix select on the bit patterns (non-negative floats order like their bits), two
// bits a step. Below sm_80 (no __reduce_add_sync): a pairwise ranking, 128 shuffles and 512
// compares per lane, which on newer GPUs would be about half of a decode cache write.
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
    // its bits are then the team's max over the values under that prefix. Why: three counts as
    // three reductions and all 16 steps every time would be about 1000 instructions a warp, most of
    // the fused rotate-store's time at decode.
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

// lane b's part of the group at blk: its byte of codes, and (lane 0) the header, d then m
static __device__ __forceinline__ void store_group(uint8_t * blk, const int b, const uint8_t byte, const uint16_t dbits,
        const uint16_t mbits) {
    blk[4 + b] = byte;
    if (b == 0) {
        blk[0] = (uint8_t) (dbits & 0xff); blk[1] = (uint8_t) (dbits >> 8);
        blk[2] = (uint8_t) (mbits & 0xff); blk[3] = (uint8_t) (mbits >> 8);
    }
}
