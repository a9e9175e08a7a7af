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

#include <climits>

// rows [D, n_rows, n_head_kv, ns] of any of our types (byte strides) -> f16 rows at row offset r_off
// of a contiguous [D, n_total, n_head_kv, ns] buffer.
// Grid (rows*D/8 / 256 rounded up, n_head_kv, ns): a thread takes 8 consecutive values of a row
// (one 16-byte store), and finds its row by a 32-bit division, its head and sequence in the
// grid. Why: with 4 values a thread and 64-bit divisions for row, head and sequence, a thread
// spent about 400 instructions on 4 values, and a prefill ubatch at depth 16k converts 33M
// values a layer.
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

// the mask [n_c + n_w, ne1, ne2, ne3] (byte strides; the cache's columns, then the window's) ->
// a contiguous f16 mask of n_pad columns in the f16 equivalent's order: the window's n_w, the
// cache's n_c, then -inf. Grid (n_pad/256 rounded up, ne1, ne2*ne3): no 64-bit division per
// element (about 150 instructions each, for each of the 9M columns of a 512-token ubatch at
// depth 16k, every layer)
static __global__ void k_f16_mask(const char * __restrict__ src, int64_t nb1, int64_t nb2, int64_t nb3, int ne2,
        half * __restrict__ dst, int n_c, int n_w, int n_pad) {
    const int c = blockIdx.x*blockDim.x + threadIdx.x;
    if (c >= n_pad) {
        return;
    }
    const int i1 = blockIdx.y, i2 = blockIdx.z % ne2, i3 = blockIdx.z / ne2;
    const int64_t row = ((int64_t) blockIdx.z*gridDim.y + i1)*n_pad;
    const int sc = c < n_w ? n_c + c : c - n_w; // the source column
    dst[row + c] = c < n_c + n_w ? *(const half *) (src + i1*nb1 + i2*nb2 + i3*nb3 + sc*sizeof(half)) : __float2half(-INFINITY);
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
    if (Kw) {
        rows_to_f16(Kw, kbuf.get(), (int) n_pad, 0, stream);
        rows_to_f16(Vw, vbuf.get(), (int) n_pad, 0, stream);
    }
    rows_to_f16(K, kbuf.get(), (int) n_pad, (int) n_w, stream);
    rows_to_f16(V, vbuf.get(), (int) n_pad, (int) n_w, stream);
    ggml_tensor d2 = with_f16_kv(dst, K2, V2, kbuf.get(), vbuf.get());
    const int threads = 256;
    if (n_pad > n_total) {
        for (const ggml_tensor * t : {&K2, &V2}) {
            const int64_t n = (n_pad - n_total)*t->ne[0]*t->ne[2]*t->ne[3];
            k_zero_pad_rows<<<(n + threads - 1)/threads, threads, 0, stream>>>((half *) t->data, (int) t->ne[0], (int) n_total,
                (int) n_pad, n);
        }
    }
    if (mask && (n_pad > n_total || n_w > 0)) {
        mbuf.alloc(ctx.pool(), n_pad*mask->ne[1]*mask->ne[2]*mask->ne[3]);
        const dim3 grid((unsigned) ((n_pad + threads - 1)/threads), (unsigned) mask->ne[1], (unsigned) (mask->ne[2]*mask->ne[3]));
        k_f16_mask<<<grid, threads, 0, stream>>>((const char *) mask->data, mask->nb[1], mask->nb[2], mask->nb[3],
            (int) mask->ne[2], mbuf.get(), (int) K->ne[1], (int) n_w, (int) n_pad);
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
