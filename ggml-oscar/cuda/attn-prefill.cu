// attn-prefill.cu: flash attention over an oscar2 cache and/or the window with many query
// columns (prefill): the window and cache rows dequantized side by side into one f16 K/V, with
// the mask's columns reordered to match, and upstream's tensor-core kernels run on that
// (ggml-cuda/fattn.cu).
//
// Reference: the CPU flash attention (attn-common.cuh) and get-rows.cu's dequantization (the
// same m + code*d, rounded to f16); checked by test-backend-ops FLASH_ATTN_EXT with batch sizes
// above the decode path's limit (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh test`).

#include "attn-common.cuh"
#include "ops.cuh"

#include "../../ggml-cuda/fattn.cuh"
#include "../../ggml-cuda/fattn-common.cuh" // FATTN_KQ_STRIDE

#include <algorithm>
#include <climits>

// one source of the f16 equivalent: rows [D, n_rows, n_head_kv, ns] of any of our types (byte
// strides), placed at row r0 of each head of the destination
struct f16_part {
    const char * data = nullptr;
    int64_t nb1 = 0, nb2 = 0, nb3 = 0;
    ggml_type type = GGML_TYPE_F16;
    int n_rows = 0, r0 = 0;
};

// the f16 equivalent's K (kv 0) and V (kv 1): two parts each (the window's and the cache's) into
// contiguous [D, n_pad, n_head_kv, ns] buffers, zero in the rows no part covers
struct f16_rows_job {
    f16_part part[2][2];
    half * dst[2];
    int D[2]; // head sizes of K and V
    int n_pad;
};

// values e0..e0+7 of an oscar2 row of groups of G: code bytes o..o+7 (o = e0 % (G/4)) of one
// group at one shift (G/4 is a multiple of 8, so they never straddle a byte block; the bytes are
// 4-byte aligned), m + code*d as get-rows.cu forms them
template <int G>
static __device__ __forceinline__ void load8_int2(const char * row, const int e0, float (&x)[8]) {
    constexpr int NB = G/4, BYTES = 4 + G/4;
    const uint8_t * bp = (const uint8_t *) row + (e0 / G)*BYTES;
    const float d = group_d(bp);
    const float m = group_m(bp);
    const int o = e0 % G;
    const uint32_t * q = (const uint32_t *) (bp + 4 + o % NB);
    const uint32_t q0 = q[0] >> (2*(o / NB)), q1 = q[1] >> (2*(o / NB));
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        const uint32_t c = ((u < 4 ? q0 : q1) >> (8*(u % 4))) & 3;
        x[u] = __fadd_rn(m, __fmul_rn((float) c, d));
    }
}

// values e0..e0+7 of a row of type t, as f32
static __device__ __forceinline__ void load8(const ggml_type t, const char * row, const int e0, float (&x)[8]) {
    switch (t) {
        case GGML_TYPE_F16:
#pragma unroll
            for (int u = 0; u < 8; u += 2) {
                const float2 f = __half22float2(*(const half2 *) ((const half *) row + e0 + u));
                x[u] = f.x;
                x[u + 1] = f.y;
            }
            break;
        case GGML_TYPE_BF16:
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                x[u] = __bfloat162float(((const nv_bfloat16 *) row)[e0 + u]);
            }
            break;
        case GGML_TYPE_F32:
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                x[u] = ((const float *) row)[e0 + u];
            }
            break;
        case GGML_TYPE_OSCAR2:    load8_int2<QK_OSCAR2>(row, e0, x);    break;
        case GGML_TYPE_OSCAR2_64: load8_int2<QK_OSCAR2_64>(row, e0, x); break;
        default: break; // (part_of takes no other type)
    }
}

// Grid (n_pad*max(D)/8 / 256 rounded up, n_head_kv, 2 ns): z = 2 s3 + kv. A thread takes 8
// consecutive values of one destination row (one 16-byte store): the part's row converted, or
// zeros (the pad rows: masked columns still meet V, and 0 * garbage could be NaN). It finds its
// row by a 32-bit division, its head, sequence and K or V in the grid. Why one launch for
// everything: a launch per part and per K and V, and one for the pad, would be six small
// launches in every layer of every prefill ubatch. Why 8 values and 32-bit arithmetic: with 4
// values a thread and 64-bit divisions for row, head and sequence, a thread spends about 400
// instructions on 4 values, and a ubatch at depth 16k converts 33M values a layer.
static __global__ void k_f16_rows(const OSCAR_GRID_CONSTANT f16_rows_job job) {
    const int kv = blockIdx.z % 2;
    const int D  = job.D[kv];
    const int i  = blockIdx.x*blockDim.x + threadIdx.x; // 8-value chunk of this head's rows
    const int per_row = D/8;
    if (i >= job.n_pad*per_row) {
        return;
    }
    const int r  = i / per_row;
    const int e0 = 8*(i - r*per_row);
    const int h  = blockIdx.y, s3 = blockIdx.z / 2;
    float x[8] = {};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const f16_part & pt = job.part[kv][k];
        const int rr = r - pt.r0;
        if (rr >= 0 && rr < pt.n_rows) {
            load8(pt.type, pt.data + rr*pt.nb1 + h*pt.nb2 + s3*pt.nb3, e0, x);
        }
    }
    half2 y[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        y[u] = __halves2half2(__float2half_rn(x[2*u]), __float2half_rn(x[2*u + 1]));
    }
    half * out = job.dst[kv] + (((int64_t) s3*gridDim.y + h)*job.n_pad + r)*D + e0;
    *(int4 *) out = *(const int4 *) y;
}

static f16_part part_of(const ggml_tensor * t, int r0) {
    f16_part pt;
    if (t) {
        switch (t->type) {
            case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_F32: case GGML_TYPE_OSCAR2: case GGML_TYPE_OSCAR2_64: break;
            default: GGML_ABORT("oscar2 attention: unexpected type %s", ggml_type_name(t->type));
        }
        pt.data = (const char *) t->data;
        pt.nb1 = t->nb[1]; pt.nb2 = t->nb[2]; pt.nb3 = t->nb[3];
        pt.type = t->type;
        pt.n_rows = (int) t->ne[1];
        pt.r0 = r0;
    }
    return pt;
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

// the mask [n_c + n_w, ne1, ne2, ne3] (byte strides; the cache's columns, then the window's) ->
// a contiguous f16 mask of n_pad columns in the f16 equivalent's order: the window's n_w, the
// cache's n_c, then -inf. Grid (n_pad/8 / 256 rounded up, ne1, ne2*ne3): a thread takes 8
// columns, as one 16-byte load and store where they lie in one part and 16-byte aligned (vec:
// n_c, n_w, n_pad, the mask's address and its strides multiples of 8 columns), else one by one.
// Why: it is made for every layer of a ubatch (the mask of a 512-token ubatch at depth 16k is 9M
// columns), and at 2 bytes a thread the copy runs under 1 TB/s.
static __global__ void k_f16_mask(const char * __restrict__ src, int64_t nb1, int64_t nb2, int64_t nb3, int ne2,
        half * __restrict__ dst, int n_c, int n_w, int n_pad, bool vec) {
    const int c0 = 8*(blockIdx.x*blockDim.x + threadIdx.x);
    if (c0 >= n_pad) {
        return;
    }
    const int i1 = blockIdx.y, i2 = blockIdx.z % ne2, i3 = blockIdx.z / ne2;
    const char * in = src + i1*nb1 + i2*nb2 + i3*nb3;
    half * out = dst + ((int64_t) blockIdx.z*gridDim.y + i1)*n_pad + c0;
    auto source_col = [&](int c) { return c < n_w ? n_c + c : c - n_w; };
    if (vec) {
        const int ninf2 = (int) 0xFC00FC00u; // two f16 -inf
        *(int4 *) out = c0 < n_c + n_w ? *(const int4 *) (in + source_col(c0)*sizeof(half)) : make_int4(ninf2, ninf2, ninf2, ninf2);
        return;
    }
    for (int c = c0; c < min(c0 + 8, n_pad); ++c) {
        out[c - c0] = c < n_c + n_w ? *(const half *) (in + source_col(c)*sizeof(half)) : __float2half(-INFINITY);
    }
}

// K/V rows of the f16 equivalent: window rows and cache rows, rounded up to the upstream kernels'
// KV stride when a mask can hide the extra rows. Why: with a ragged row count (a 320-row window)
// upstream turns off its GQA batching and its mask-based skipping, which costs prefill at 32k
// about a fifth of its speed.
static int64_t f16_rows(const ggml_tensor * op) {
    const ggml_tensor * mask = op->src[3];
    const int64_t n = op->src[1]->ne[1] + ggml_flash_attn_ext_window_rows(op);
    return mask && mask->type == GGML_TYPE_F16 ? GGML_PAD(n, FATTN_KQ_STRIDE) : n;
}

// op with K and V replaced by f16 tensors K2, V2 of f16_rows(op) rows at kdata, vdata, and no
// window (its rows are among theirs)
static ggml_tensor with_f16_kv(const ggml_tensor * op, ggml_tensor & K2, ggml_tensor & V2, half * kdata, half * vdata) {
    make_f16_view(K2, op->src[1], kdata, f16_rows(op));
    make_f16_view(V2, op->src[2], vdata, f16_rows(op));
    ggml_tensor d2 = *op;
    d2.src[1] = &K2;
    d2.src[2] = &V2;
    ggml_flash_attn_ext_add_window(&d2, nullptr, nullptr);
    return d2;
}

// The same attention with K and V as plain f16 tensors: [window rows | cache rows | zero rows],
// the zero rows masked. Why the window first: the cache's last rows are the ones the window holds
// (a prefill ubatch's own tokens, and the recent ones before them), which the cache's mask
// columns hide; after the window they are the trailing masked rows that upstream skips, per tile
// of queries, where it scans the mask (see as_two_streams). Before the window, every query tile
// read them: a 512-token ubatch read 768 rows more than an f16 cache's prefill does.
static ggml_tensor f16_equivalent(ggml_backend_cuda_context & ctx, ggml_tensor * dst, ggml_cuda_pool_alloc<half> & kbuf,
        ggml_cuda_pool_alloc<half> & vbuf, ggml_cuda_pool_alloc<half> & mbuf, ggml_tensor & K2, ggml_tensor & V2, ggml_tensor & M2) {
    const ggml_tensor * K = dst->src[1], * V = dst->src[2], * mask = dst->src[3];
    const ggml_tensor * Kw = ggml_flash_attn_ext_get_window_k(dst), * Vw = ggml_flash_attn_ext_get_window_v(dst);
    cudaStream_t stream = ctx.stream();
    const int64_t n_w = Kw ? Kw->ne[1] : 0;
    const int64_t n_total = K->ne[1] + n_w;
    const int64_t n_pad = f16_rows(dst);
    kbuf.alloc(ctx.pool(), K->ne[0]*n_pad*K->ne[2]*K->ne[3]);
    vbuf.alloc(ctx.pool(), V->ne[0]*n_pad*V->ne[2]*V->ne[3]);
    const int threads = 256;
    {
        f16_rows_job job;
        job.part[0][0] = part_of(Kw, 0);
        job.part[1][0] = part_of(Vw, 0);
        job.part[0][1] = part_of(K, (int) n_w);
        job.part[1][1] = part_of(V, (int) n_w);
        job.dst[0] = kbuf.get();
        job.dst[1] = vbuf.get();
        job.D[0] = (int) K->ne[0];
        job.D[1] = (int) V->ne[0];
        job.n_pad = (int) n_pad;
        const int64_t n = n_pad*(std::max(job.D[0], job.D[1])/8);
        GGML_ASSERT(job.D[0] % 8 == 0 && job.D[1] % 8 == 0 && n < INT_MAX && K->ne[2] == V->ne[2] && K->ne[3] == V->ne[3]);
        if (n > 0 && K->ne[2] > 0 && K->ne[3] > 0) {
            const dim3 grid((unsigned) ((n + threads - 1)/threads), (unsigned) K->ne[2], (unsigned) (2*K->ne[3]));
            k_f16_rows<<<grid, threads, 0, stream>>>(job);
        }
    }
    ggml_tensor d2 = with_f16_kv(dst, K2, V2, kbuf.get(), vbuf.get());
    if (mask && (n_pad > n_total || n_w > 0)) {
        mbuf.alloc(ctx.pool(), n_pad*mask->ne[1]*mask->ne[2]*mask->ne[3]);
        const int64_t n_c = K->ne[1];
        const bool vec = n_c % 8 == 0 && n_w % 8 == 0 && n_pad % 8 == 0 && (uintptr_t) mask->data % 16 == 0 &&
            mask->nb[1] % 16 == 0 && mask->nb[2] % 16 == 0 && mask->nb[3] % 16 == 0;
        const dim3 grid((unsigned) (((n_pad + 7)/8 + threads - 1)/threads), (unsigned) mask->ne[1], (unsigned) (mask->ne[2]*mask->ne[3]));
        k_f16_mask<<<grid, threads, 0, stream>>>((const char *) mask->data, mask->nb[1], mask->nb[2], mask->nb[3],
            (int) mask->ne[2], mbuf.get(), (int) n_c, (int) n_w, (int) n_pad, vec);
        make_f16_view(M2, mask, mbuf.get(), n_pad, 0);
        d2.src[3] = &M2;
    }
    CUDA_CHECK(cudaGetLastError());
    return d2;
}

// Upstream scans the mask for each query tile's last visible block of KV rows and skips the rows
// after it only with 1024 queries or more, or several streams (launch_fattn's KV_max). A prefill
// ubatch of one stream (512 tokens by default) is therefore passed as two streams of half its
// queries each, sharing K and V (stride 0 across streams): the same products, the mask scanned.
// d2 (from f16_equivalent), its K2, V2 and its mask M2 (or a view of the op's own mask) are
// changed in place, Q2 is the queries' view. False (nothing changed) where that does not apply.
static bool as_two_streams(ggml_tensor & d2, ggml_tensor & Q2, ggml_tensor & K2, ggml_tensor & V2, ggml_tensor & M2) {
    const ggml_tensor * Q = d2.src[0], * mask = d2.src[3];
    const int64_t n_q = Q->ne[1];
    if (!mask || Q->ne[3] != 1 || n_q >= 1024 || n_q < 64 || n_q % 2 != 0 || mask->ne[2] != 1 || mask->ne[3] != 1 ||
            d2.src[1]->ne[1] % FATTN_KQ_STRIDE != 0 || d2.ne[3] != 1) {
        return false;
    }
    Q2 = *Q;
    Q2.ne[1] = n_q/2;
    Q2.ne[3] = 2;
    Q2.nb[3] = Q->nb[1]*(n_q/2);
    if (mask != &M2) {
        M2 = *mask;
    }
    M2.ne[1] = n_q/2;
    M2.ne[3] = 2;
    M2.nb[3] = M2.nb[1]*(n_q/2);
    GGML_ASSERT(d2.src[1] == &K2 && d2.src[2] == &V2);
    for (ggml_tensor * t : {&K2, &V2}) {
        t->ne[3] = 2;
        t->nb[3] = 0;
    }
    d2.src[0] = &Q2;
    d2.src[3] = &M2;
    d2.ne[2] = n_q/2;
    d2.ne[3] = 2;
    d2.nb[3] = d2.nb[2]*(n_q/2);
    return true;
}

bool oscar2_cuda_fa_prefill_supported(int device, const ggml_tensor * op) {
    ggml_tensor K2, V2;
    const ggml_tensor d2 = with_f16_kv(op, K2, V2, nullptr, nullptr);
    return ggml_cuda_flash_attn_ext_supported(device, &d2);
}

void oscar2_cuda_fa_prefill(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    ggml_cuda_pool_alloc<half> kbuf, vbuf, mbuf;
    ggml_tensor K2, V2, M2, Q2;
    ggml_tensor d2 = f16_equivalent(ctx, dst, kbuf, vbuf, mbuf, K2, V2, M2);
    as_two_streams(d2, Q2, K2, V2, M2);
    ggml_cuda_flash_attn_ext(ctx, &d2);
}
