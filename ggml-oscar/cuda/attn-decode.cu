// attn-decode.cu: the decode attention (few query columns: decode, multi-sequence decode, small
// speculative batches) over an oscar2 cache and the high-precision window: the launches of the
// plan that attn-plan.h makes (queries per block, splits of the rows, live-chunk lists):
// k_fa_int2_mma (attn-mma.cu) where it can, else k_fa_int2 or k_fa_partial (attn-vec.cu), then
// k_fa_combine (attn-combine.cu). Many query columns take the f16 path instead (attn-prefill.cu).
//
// Reference: the CPU flash attention (attn-common.cuh); checked by test-backend-ops
// FLASH_ATTN_EXT (batch sizes on both sides of OSCAR_VEC_MAX_TOKENS) and OSCAR_ROTATE_STORE
// (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh test`), and by tests/test_oscar2_ops.py.

#include "attn-common.cuh"
#include "fusion-plan.cuh"
#include "ops.cuh"

// the most query tokens per flash-attention call that take the split-KV kernels
static const int OSCAR_VEC_MAX_TOKENS = 16;
// ... and, in a batch of several sequences with at most OSCAR_VEC_MAX_TOKENS each
// (ggml_flash_attn_ext_set_seq_tokens), the most in all: the tensor-core kernel then reads, per
// group of 8 queries, only the cache chunks its queries see (attn-live.cu). Each window chunk
// still gets a partial per group, so the partials grow with tokens x window rows; past this the
// prefill path (one f16 copy of the cache) costs less.
static const int OSCAR_DECODE_MAX_TOKENS = 64;

bool oscar2_cuda_fa_types_ok(ggml_type kt, ggml_type vt, int64_t D) {
    auto ok = [&](ggml_type t) {
        return t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || (t == GGML_TYPE_OSCAR2 && D % 128 == 0) || t == GGML_TYPE_OSCAR2_64;
    };
    return (D == 64 || D == 128 || D == 256) && ok(kt) && ok(vt) && (kt == vt || kt == GGML_TYPE_F16 || vt == GGML_TYPE_F16);
}

bool oscar2_cuda_fa_decode_ok(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0], * K = dst->src[1], * V = dst->src[2], * mask = dst->src[3];
    float max_bias;
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    const ggml_tensor * Kw = ggml_flash_attn_ext_get_window_k(dst), * Vw = ggml_flash_attn_ext_get_window_v(dst);
    const int64_t gqa = Q->ne[2] / K->ne[2];
    // many tokens: only of several sequences, and only where the tensor-core kernel with its
    // live-chunk lists takes them (the other kernels read every row for every group of queries)
    const int64_t seq_tokens = ggml_flash_attn_ext_get_seq_tokens(dst);
    const bool many_ok = seq_tokens > 0 && seq_tokens <= OSCAR_VEC_MAX_TOKENS && Q->ne[1] <= OSCAR_DECODE_MAX_TOKENS &&
        mask && gqa <= OSCAR_MMA_MAX_QUERIES &&
        uses_int2_mma(K->type, V->type, (int) K->ne[0], OSCAR_MMA_MAX_QUERIES, Kw ? Kw->type : GGML_TYPE_COUNT) &&
        ampere_mma_available(ggml_cuda_info().devices[ggml_cuda_get_device()].cc);
    return Q->type == GGML_TYPE_F32 && K->ne[0] == V->ne[0] && oscar2_cuda_fa_types_ok(K->type, V->type, K->ne[0]) &&
        max_bias == 0.0f && (Q->ne[1] <= OSCAR_VEC_MAX_TOKENS || many_ok) && gqa <= (K->ne[0] == 256 ? 8 : 16) &&
        (!mask || mask->type == GGML_TYPE_F16) &&
        (!Kw || oscar2_cuda_fa_types_ok(Kw->type, Vw->type, K->ne[0]));
}

void oscar2_cuda_fa_decode(ggml_backend_cuda_context & ctx, ggml_tensor * dst, const ggml_tensor * unrot) {
    const ggml_tensor * Q = dst->src[0], * K = dst->src[1], * V = dst->src[2], * mask = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];
    const ggml_tensor * Kw = ggml_flash_attn_ext_get_window_k(dst), * Vw = ggml_flash_attn_ext_get_window_v(dst);
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

    // the window's type for the mma kernel: COUNT = no window; F32 = K and V differ (not taken)
    // (and F32 too when its K rows are not 16-byte aligned: fa_window_rows_f16 reads them as uint4)
    auto aligned16 = [](const ggml_tensor * t) {
        return (uintptr_t) t->data % 16 == 0 && t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0;
    };
    const ggml_type wt = !Kw ? GGML_TYPE_COUNT : Kw->type == Vw->type && aligned16(Kw) && aligned16(Vw) ? Kw->type : GGML_TYPE_F32;

    decode_shape shape = {};
    shape.n_sm = ggml_cuda_info().devices[ctx.device].nsm;
    shape.D = D; shape.gqa = gqa; shape.n_head_kv = (int) K->ne[2];
    shape.n_q = (int) Q->ne[1]; shape.n_streams = (int) Q->ne[3];
    shape.n_rows = (int) K->ne[1]; shape.n_win = Kw ? (int) Kw->ne[1] : 0;
    shape.mask = mask != nullptr;
    shape.seq_tokens = ggml_flash_attn_ext_get_seq_tokens(dst);
    // (the arch the binary holds code for, not only the device's: a build for sm_75 has no mma body)
    shape.mma_arch = ampere_mma_available(ggml_cuda_info().devices[ctx.device].cc);
    shape.mma_types = int2_mma_types(K->type, V->type, D, wt);
    shape.int2_types = int2_types(K->type, V->type);
    const decode_plan pl = plan_decode(shape);
    p.n_part = pl.ns_main + pl.ns_win;

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
    // the live-chunk lists of the cache's rows and of the window's (decode_plan's lists, win_lists).
    // Every layer of a step reads the same mask: the pass's first attention keeps its lists and the
    // later ones read them (fusion-plan.cuh).
    ggml_cuda_pool_alloc<int> live(ctx.pool()), live_count(ctx.pool()), live_w(ctx.pool()), live_count_w(ctx.pool());
    auto make_lists = [&](fa_source & s, ggml_cuda_pool_alloc<int> & l_mem, ggml_cuda_pool_alloc<int> & c_mem) {
        ggml_cuda_oscar2_fusion * plan = ctx.oscar2_fusion.get();
        const int stride = (s.n_rows + OSCAR_LIVE_ROWS - 1)/OSCAR_LIVE_ROWS;
        live_lists_key key;
        key.mask = s.mask; key.nb1 = mask->nb[1]; key.nb3 = mask->nb[3]; key.mask_ne3 = p.mask_ne3;
        key.n_rows = s.n_rows; key.n_q = p.n_q; key.tokens_per_group = pl.tokens_per_block; key.n_groups = pl.n_groups;
        key.stride = stride;
        if (const kept_live_lists * kept = oscar2_fusion_find_lists(plan, dst, key)) {
            s.live = kept->live;
            s.live_count = kept->count;
        } else {
            kept = oscar2_fusion_keep_lists(plan, dst, key, ctx.device);
            int * l = kept ? kept->live  : l_mem.alloc((size_t) p.mask_ne3*pl.n_groups*stride);
            int * c = kept ? kept->count : c_mem.alloc((size_t) p.mask_ne3*pl.n_groups);
            oscar2_cuda_fa_live_chunks(s, p, pl.tokens_per_block, pl.n_groups, l, c, stride, stream);
            s.live = l;
            s.live_count = c;
        }
        s.live_stride = stride;
    };
    if (pl.lists) {
        make_lists(sm, live, live_count);
    }
    if (pl.win_lists) {
        make_lists(sw, live_w, live_count_w);
    }
    p.part0 = 0;
    if (pl.mma) {
        oscar2_cuda_fa_int2_mma(K->type, wt, D, pl.nqb, sm, sw, p, pl.ns_main, pl.rps_main, pl.ns_win, pl.rps_win, pl.rps_lite,
                                pl.n_groups, stream);
    } else {
        const bool ok = oscar2_cuda_fa_partials(D, K->type, V->type, sm, p, pl.nqb, pl.ns_main, pl.rps_main, pl.n_groups, stream);
        GGML_ASSERT(ok && "oscar2 attention: no kernel for these types");
        if (pl.ns_win > 0) {
            p.part0 = pl.ns_main;
            const bool ok_win = oscar2_cuda_fa_partials(D, Kw->type, Vw->type, sw, p, pl.nqb, pl.ns_win, pl.rps_win, pl.n_groups, stream);
            GGML_ASSERT(ok_win && "oscar2 attention: no kernel for the window types");
        }
    }
    fa_unrot un;
    if (unrot) {
        un.U = (const float *) unrot->src[0]->data;
        un.y = (float *) unrot->data;
    }
    oscar2_cuda_fa_combine(D, p, sinks ? (const float *) sinks->data : nullptr, (float *) dst->data, n_queries, un, stream);
    CUDA_CHECK(cudaGetLastError());
}
