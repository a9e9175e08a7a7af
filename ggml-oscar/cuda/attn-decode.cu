// attn-decode.cu: the decode attention (few query columns: decode, multi-sequence decode, small
// speculative batches) over an oscar2 cache and the high-precision window: how the rows are
// split into blocks and which kernels take them: k_fa_int2_mma (attn-mma.cu) where it can,
// else k_fa_int2 or k_fa_partial (attn-vec.cu), then k_fa_combine (attn-combine.cu). Many query
// columns take the f16 path instead (attn-prefill.cu).
//
// Reference: the CPU flash attention (attn-common.cuh); checked by test-backend-ops
// FLASH_ATTN_EXT (batch sizes on both sides of OSCAR_VEC_MAX_TOKENS) and OSCAR_ROTATE_STORE
// (../tests/oscar2-backend-ops.inc; `bash gpu/run.sh test`), and by tests/test_oscar2_ops.py.

#include "attn-common.cuh"
#include "fusion-plan.cuh"
#include "ops.cuh"

#include <algorithm>
#include <climits>

#define OSCAR_WIN_LITE_ROWS 512 // k_fa_int2_mma: cache rows fewer for a split that takes a window chunk
#define OSCAR_WIN_MAX_ROWS 1024 // k_fa_int2_mma: the most window rows of a chunk (one block's share)
#define OSCAR_WAVE_MIN_ROWS 1024 // k_fa_int2_mma: the fewest cache rows of a split where it takes several waves

// the most query tokens per flash-attention call that take the split-KV kernels
static const int OSCAR_VEC_MAX_TOKENS = 16;
// ... and, in a batch of several sequences with at most OSCAR_VEC_MAX_TOKENS each
// (ggml_flash_attn_ext_set_seq_tokens), the most in all: the tensor-core kernel then reads, per
// group of 8 queries, only the cache chunks its queries see (attn-live.cu). Each window chunk
// still gets a partial per group, so the partials grow with tokens x window rows; past this the
// prefill path (one f16 copy of the cache) costs less.
static const int OSCAR_DECODE_MAX_TOKENS = 64;

// queries per block, rounded up to the kernel's compile-time sizes (at least one token's heads)
static int nq_bucket(int nq, int D) {
    const int cap = D == 256 ? 8 : 16;
    int b = 1;
    while (b < nq && b < cap) {
        b *= 2;
    }
    return b;
}

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
        mask && gqa <= 8 && uses_int2_mma(K->type, V->type, (int) K->ne[0], 8, Kw ? Kw->type : GGML_TYPE_COUNT) &&
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
    // (the arch the binary holds code for, not only the device's: a build for sm_75 has no mma body)
    const bool mma_arch = ampere_mma_available(ggml_cuda_info().devices[ctx.device].cc);

    // Queries per block. Where the tensor-core kernel takes the types, a step with more queries
    // than its 8 (several sequences, or a speculative batch) gets more groups of blocks, each
    // reading the cache again, rather than the CUDA-core kernel, which costs far more per row
    // than the reads save.
    int nqb = nq_bucket(gqa*(int) Q->ne[1], D);
    if (nqb > 8 && gqa <= 8 && mma_arch && uses_int2_mma(K->type, V->type, D, 8, wt)) {
        nqb = 8;
    }
    // ... and, with the tokens of several sequences (in one stream), a block holds the tokens of
    // one sequence where that still leaves it 4 queries or more: each cache chunk is then read by
    // the one group whose queries all see it, not by a group of two sequences whose queries of the
    // other sequence are masked there (a block of 4 queries also takes twice the rows per product,
    // attn-mma.cu's packed layout)
    const int seq_tokens = ggml_flash_attn_ext_get_seq_tokens(dst);
    if (Q->ne[1] > 1 && seq_tokens > 0 && mask && mma_arch) {
        const int nqb_seq = nq_bucket(gqa*seq_tokens, D);
        if (nqb_seq >= 4 && nqb_seq < nqb && uses_int2_mma(K->type, V->type, D, nqb_seq, wt)) {
            nqb = nqb_seq;
        }
    }
    const int tokens_per_block = std::max(1, nqb/gqa);
    const int n_groups = (int) ((Q->ne[1] + tokens_per_block - 1)/tokens_per_block);

    // splits. The INT2 kernels run a fixed number of blocks per SM and each block walks its rows
    // in a dependent chain, so the cache gets exactly one full wave of blocks: a second, partly
    // empty wave costs as much as the first. The other kernels keep about 4 blocks per SM, in splits of at least 128 rows. (How rows are split
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
    // ... unless the heads x streams x groups fill that one wave poorly (many streams: 39 streams
    // of 8 heads are 312 blocks of the 396 an H100 runs at once, one wave 79% full, each block a
    // whole stream's rows). Then several waves of shorter splits, as many as fill the waves best;
    // a split keeps at least OSCAR_WAVE_MIN_ROWS rows, so that its first step's memory latency,
    // which its loads one step ahead cannot hide, stays a small share (with several groups of
    // queries, of a group's share of the rows: in a unified cache each group sees its sequence's).
    auto split_waves = [&](int n_rows, int slots, int & n_split, int & rps) {
        auto fill = [&](int n) {
            const int64_t blocks = (int64_t) base*n;
            return (double) blocks/(double) (((blocks + slots - 1)/slots)*slots);
        };
        if (fill(n_split) >= 0.9) {
            return;
        }
        const int n_max = std::min(8*n_split, std::max(1, n_rows/n_groups/OSCAR_WAVE_MIN_ROWS));
        int best = n_split;
        for (int n = n_split + 1; n <= n_max; ++n) {
            if (fill(n) > fill(best) + 0.05) {
                best = n;
            }
        }
        if (best != n_split) {
            rps = ((n_rows + best - 1)/best + OSCAR_FA_WARPS - 1)/OSCAR_FA_WARPS*OSCAR_FA_WARPS;
            n_split = std::max(1, (n_rows + rps - 1)/rps);
        }
    };
    int ns_main, rps_main, ns_win = 0, rps_win = 0, rps_lite = 0;
    const bool mma = mma_arch && uses_int2_mma(K->type, V->type, D, nqb, wt);
    // several query tokens (sequences of a unified cache, or a speculative batch): each group of
    // blocks takes only the cache chunks its tokens see, and the window chunks (attn-live.cu)
    const bool lists = mma && mask && Q->ne[1] > 1;
    // ... and one token in each of several streams (one stream per sequence): lists of the
    // window's live chunks alone. Its cache rows are all its own, and a cache split walking its
    // rows in order reads them faster than by list (41 streams of 16384 rows: 10% faster).
    const bool win_lists = mma && mask && Kw && (lists || Q->ne[3] > 1);
    if (mma) {
        // one launch: the cache's splits fill one full wave of OSCAR_MMA_BLOCKS_PER_SM blocks per
        // SM (or several, split_waves), and the first blocks also take a chunk of the window each
        // (see k_fa_int2_mma), or with fewer cache splits than window chunks (small depths, many
        // streams) the window's chunks are blocks of their own, after the cache's (attn-mma.cu).
        // A chunk is one 32-row step of each warp (fa_window_rows_f16): its rows cost about what
        // one step costs, so smaller chunks would only add partials. Most window rows are masked
        // (the view spans every slot a prefill's ubatch used, 832 rows after a 512-token ubatch,
        // of which sink + recent are live) and cost only their mask.
        split((int) K->ne[1], 128, OSCAR_MMA_BLOCKS_PER_SM*n_sm, ns_main, rps_main);
        split_waves((int) K->ne[1], OSCAR_MMA_BLOCKS_PER_SM*n_sm, ns_main, rps_main);
        if (win_lists) {
            // each cache split also takes its share of its group's live window chunks. Why not
            // chunks of the window's rows: a unified cache's window holds every sequence's sink
            // and recent rows, so a group's rows (its sequences' 320 or so) sat in one or two
            // chunks, whose blocks ended last, and the other chunks were read for their mask
            // alone (8 sequences of 16384: 3072 rows, 6 chunks a group, 11 us a layer more than
            // with one stream per sequence). With one stream per sequence a stream has few cache
            // splits (on an H100: 3 at 64 streams of 4096 rows, 6 at 8 of 16384, 7 at 41), and
            // the window view 7 chunks of 128 rows, the live ones (sink and recent) in the first
            // 3: with as many chunks as splits those 3 blocks end last, and with more, the chunks
            // are blocks of their own after the cache's, mostly masked (64 x 4096: 8.5% slower).
            ns_win = ns_main;
        } else if (Kw) {
            // without lists, one group (one sequence) takes chunks of one step: larger ones, taken
            // by a few of the cache's splits, leave those splits' rows to the others, whose blocks
            // then end last. Several groups with no mask take every chunk each, and the partials,
            // which the combine reads back, grow with groups x chunks: the chunks then grow to
            // fill one wave of blocks, up to OSCAR_WIN_MAX_ROWS.
            const int n_win = (int) Kw->ne[1];
            const int one   = OSCAR_FA_WARPS*WARP_SIZE;
            const int fit   = n_groups > 1 ? std::max(1, OSCAR_MMA_BLOCKS_PER_SM*n_sm/base) : INT_MAX;
            ns_win  = std::max((n_win + OSCAR_WIN_MAX_ROWS - 1)/OSCAR_WIN_MAX_ROWS, std::min((n_win + one - 1)/one, fit));
            rps_win = ((n_win + ns_win - 1)/ns_win + one - 1)/one*one;
            ns_win  = (n_win + rps_win - 1)/rps_win;
        }
        rps_lite = rps_main;
        if (Kw && ns_win < ns_main) {
            // the splits that take a window chunk first get OSCAR_WIN_LITE_ROWS fewer cache rows,
            // and the others share them, so that every block ends together. A live chunk costs
            // about four 128-row steps of the cache in the model's decode, where its rows and code
            // come cold; with two steps' worth (256 rows, as a warm benchmark loop suggests) the
            // chunk's blocks end last and the whole decode is slower.
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
    // the lists (see `lists` above) of the cache's rows and of the window's. Every layer of a step
    // reads the same mask: the pass's first attention keeps its lists and the later ones read them
    // (fusion-plan.cuh).
    ggml_cuda_pool_alloc<int> live(ctx.pool()), live_count(ctx.pool()), live_w(ctx.pool()), live_count_w(ctx.pool());
    auto make_lists = [&](fa_source & s, ggml_cuda_pool_alloc<int> & l_mem, ggml_cuda_pool_alloc<int> & c_mem) {
        ggml_cuda_oscar2_fusion * plan = ctx.oscar2_fusion.get();
        const int stride = (s.n_rows + OSCAR_LIVE_ROWS - 1)/OSCAR_LIVE_ROWS;
        live_lists_key key;
        key.mask = s.mask; key.nb1 = mask->nb[1]; key.nb3 = mask->nb[3]; key.mask_ne3 = p.mask_ne3;
        key.n_rows = s.n_rows; key.n_q = p.n_q; key.tokens_per_group = tokens_per_block; key.n_groups = n_groups;
        key.stride = stride;
        if (const kept_live_lists * kept = oscar2_fusion_find_lists(plan, dst, key)) {
            s.live = kept->live;
            s.live_count = kept->count;
        } else {
            kept = oscar2_fusion_keep_lists(plan, dst, key, ctx.device);
            int * l = kept ? kept->live  : l_mem.alloc((size_t) p.mask_ne3*n_groups*stride);
            int * c = kept ? kept->count : c_mem.alloc((size_t) p.mask_ne3*n_groups);
            oscar2_cuda_fa_live_chunks(s, p, tokens_per_block, n_groups, l, c, stride, stream);
            s.live = l;
            s.live_count = c;
        }
        s.live_stride = stride;
    };
    if (lists) {
        make_lists(sm, live, live_count);
    }
    if (win_lists) {
        make_lists(sw, live_w, live_count_w);
    }
    p.part0 = 0;
    if (mma) {
        oscar2_cuda_fa_int2_mma(K->type, wt, D, nqb, sm, sw, p, ns_main, rps_main, ns_win, rps_win, rps_lite, n_groups, stream);
    } else {
        const bool ok = oscar2_cuda_fa_partials(D, K->type, V->type, sm, p, nqb, ns_main, rps_main, n_groups, stream);
        GGML_ASSERT(ok && "oscar2 attention: no kernel for these types");
        if (Kw) {
            p.part0 = ns_main;
            const bool ok_win = oscar2_cuda_fa_partials(D, Kw->type, Vw->type, sw, p, nqb, ns_win, rps_win, n_groups, stream);
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
