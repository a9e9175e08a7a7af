// llama-oscar-window-graph.cpp: the high-precision window in the graph (design in
// llama-oscar-window.h): its graph inputs, the writes of the sink and recent tokens into it, the
// rows flash attention reads, the mask's window columns, and the K shift of its keys. The slots
// and the state live in llama-oscar-window.cpp.

#include "llama-oscar-window.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-graph.h"
#include "llama-model.h"
#include "llama-cparams.h"

#include "../oscar2-ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

// ---- rows read -----------------------------------------------------------------------------------

// The window rows a graph built for mctx reads (and its mask's extra columns). A reserve graph
// (the whole cache, no ubatch) takes every row the window can hold, not the rows in use now:
// the buffers are sized by the reserve, and a graph larger than it makes the scheduler reallocate
// them when it runs. Sized by the rows in use (none in a fresh context), every prefill that
// fills the window further would reallocate them: on CUDA about 20 ms for the pinned input buffer
// alone, a quarter of a 512-token ubatch at depth 16384.
static uint32_t graph_rows(const llama_oscar_window & w, const llama_kv_cache_context & mctx) {
    return mctx.is_full_reserve() ? w.n_pad : w.n_hp_cur;
}

uint32_t llama_oscar_window_n_hp(const llama_kv_cache_context * mctx) {
    if (!mctx || !mctx->get_kv()) {
        return 0;
    }
    const llama_oscar_window * w = llama_oscar_window_of(*mctx->get_kv());
    return w ? graph_rows(*w, *mctx) : 0;
}

// ---- graph: inputs, writes, views -------------------------------------------------------------

struct llama_oscar_window_inputs {
    const llama_kv_cache_context * mctx = nullptr;
    ggml_tensor * idxs = nullptr; // I64 [n_tokens]: global window row of each token (or the trash row)
};

std::shared_ptr<llama_oscar_window_inputs> llama_oscar_window_build_inputs(ggml_context * ctx,
        const llama_kv_cache_context * mctx, const llama_ubatch & ubatch) {
    if (!mctx || !mctx->get_kv() || !llama_oscar_window_of(*mctx->get_kv())) {
        return nullptr;
    }
    auto inp = std::make_shared<llama_oscar_window_inputs>();
    inp->mctx = mctx;
    inp->idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, ubatch.n_tokens);
    ggml_set_input(inp->idxs);
    ggml_set_name(inp->idxs, "oscar_window_idxs");
    return inp;
}

void llama_oscar_window_set_inputs(llama_oscar_window_inputs * inp, const llama_kv_cache_context * mctx, const llama_ubatch * ubatch) {
    if (!inp || !inp->idxs || !inp->idxs->buffer) {
        return;
    }
    inp->mctx = mctx;
    const llama_oscar_window * w = llama_oscar_window_of(*mctx->get_kv());
    GGML_ASSERT(w && ggml_backend_buffer_is_host(inp->idxs->buffer));
    const auto & sinfo = mctx->get_sinfo();
    GGML_ASSERT((int64_t) ubatch->n_tokens == (int64_t) sinfo.size()*sinfo.n_stream());
    int64_t * data = (int64_t *) inp->idxs->data;
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const uint32_t strm = sinfo.strm[s];
        const auto & st = w->streams[strm];
        for (uint32_t i = 0; i < sinfo.size(); ++i) {
            const int32_t slot = st.cell_slot[sinfo.idxs[s][i]];
            data[s*sinfo.size() + i] = (int64_t) strm*w->n_rows() + (slot >= 0 ? (uint32_t) slot : w->trash());
        }
    }
}

bool llama_oscar_window_can_reuse(const llama_oscar_window_inputs * inp, const llama_ubatch & ubatch) {
    return !inp || (inp->idxs && inp->idxs->ne[0] == ubatch.n_tokens);
}

static ggml_tensor * store_one(ggml_context * ctx, ggml_tensor * dst, ggml_tensor * cur, ggml_tensor * idxs) {
    const int64_t n_embd_gqa = cur->ne[0]*cur->ne[1];
    const int64_t n_tokens   = cur->ne[2];
    if (!ggml_is_contiguous(cur)) {
        cur = ggml_cont(ctx, cur);
    }
    cur = ggml_reshape_2d(ctx, cur, n_embd_gqa, n_tokens);
    GGML_ASSERT(n_embd_gqa <= dst->ne[0]);
    ggml_tensor * dst2 = ggml_view_2d(ctx, dst, n_embd_gqa, dst->ne[1]*dst->ne[2], dst->nb[1], 0);
    return ggml_set_rows(ctx, dst2, cur, idxs);
}

void llama_oscar_window_store(ggml_context * ctx, ggml_cgraph * gf, const llama_kv_cache_context * mctx,
        const llama_oscar_window_inputs * inp, ggml_tensor * k_cur, ggml_tensor * v_cur, int32_t il) {
    if (!inp || !mctx) {
        return;
    }
    const llama_kv_cache & kv = *mctx->get_kv();
    const llama_oscar_window * w = llama_oscar_window_of(kv);
    if (!w) {
        return;
    }
    const int32_t ikv = llama_oscar_kv_access::map_layer_ids(kv).at(il);
    if (k_cur) {
        ggml_build_forward_expand(gf, store_one(ctx, w->k[ikv], k_cur, inp->idxs));
    }
    if (v_cur) {
        ggml_build_forward_expand(gf, store_one(ctx, w->v[ikv], v_cur, inp->idxs));
    }
}

llama_oscar_fa_window llama_oscar_window_views(ggml_context * ctx, ggml_cgraph * gf, const llama_kv_cache_context * mctx, int32_t il) {
    llama_oscar_fa_window res;
    if (!mctx || !mctx->get_kv()) {
        return res;
    }
    const llama_kv_cache & kv = *mctx->get_kv();
    const llama_oscar_window * w = llama_oscar_window_of(kv);
    const uint32_t n_hp = w ? graph_rows(*w, *mctx) : 0;
    if (n_hp == 0) {
        return res;
    }
    const auto & hp = llama_oscar_kv_access::model(kv).hparams;
    const int32_t ikv = llama_oscar_kv_access::map_layer_ids(kv).at(il);
    const auto & sinfo = mctx->get_sinfo();
    const uint32_t ns = sinfo.s1 - sinfo.s0 + 1;
    auto view = [&](ggml_tensor * t, int64_t d, int64_t n_head) {
        return ggml_view_4d(ctx, t, d, n_hp, n_head, ns,
                t->nb[1], ggml_row_size(t->type, d), t->nb[2], t->nb[2]*sinfo.s0);
    };
    res.k = view(w->k[ikv], hp.n_embd_head_k(il), hp.n_head_kv(il));
    res.v = view(w->v[ikv], hp.n_embd_head_v(il), hp.n_head_kv(il));
    // in the graph before the attention node, so that the scheduler sees them as its inputs
    ggml_build_forward_expand(gf, res.k);
    ggml_build_forward_expand(gf, res.v);
    return res;
}

void llama_oscar_window_attach(ggml_tensor * fa, const llama_oscar_fa_window & w) {
    if (fa && w.k && w.v) {
        ggml_flash_attn_ext_add_window(fa, w.k, w.v);
    }
}

// ---- mask ---------------------------------------------------------------------------------------

// The mask of the cache was built by llama.cpp into the first n_kv columns of each row of dst
// (rows of W = n_kv + n_hp columns: the window patch gives it the row stride); the window's columns
// are filled in here: a cache column whose position is read from the window is dropped, and the
// window column of its slot takes its value. Only cells that own a window slot can change
// (slot_cell and cell_slot change only as pairs, in alloc_slot/free_slot), so they are listed
// once per run of a sequence's tokens and each row gets a few hundred patches (per element work made a 512-token
// prefill at 32k cells ~50 ms slower). Why the stride: rows of n_kv built apart and then moved to
// their place would take a second pass over the whole mask (36 MB at 16k cells and 512 tokens).
// Why per sequence: llama.cpp's row of a token already holds -inf at every cell without the
// token's sequence (its seq_id[0], as here), where a patch would change nothing; in a unified
// cache each row would otherwise walk the slots of every sequence (16 sequences: 16 times the
// slots a token can see, on the host, before every step). A run of a sequence's tokens takes the
// cells it may read from the window out of the sequence's cells by position (its sink, and the
// positions from R before its first token on), each with its slot (cell_slot). Where the stream
// holds one sequence (one stream per sequence), every slot in use is of that sequence, and the
// stream's slots are scanned instead: an array in slot order, where the sequence's cells by
// position are nodes of a tree (39 streams a step: 36 ns an entry, most of the window's host time).
// A run of one token (every sequence's at decode) reads every cell found, so its row is patched as
// they are found, with no list.
template <typename T>
static void fill_mask(const llama_kv_cache & kv, const llama_oscar_window & w, const llama_ubatch * ubatch,
        int64_t n_kv, ggml_tensor * dst) {
    const auto & v_cells       = llama_oscar_kv_access::cells(kv);
    const auto & seq_to_stream = llama_oscar_kv_access::seq_to_stream(kv);
    const int64_t W    = dst->ne[0];
    const int64_t n_hp = W - n_kv;
    T * data = (T *) dst->data;
    const T drop = llama_cast<T>(-INFINITY);

    struct owner { int64_t k; int64_t c; llama_pos pos; }; // window slot k, its cell c
    // the token's row reads cell c from window slot k: its value moves to the slot's column
    auto to_window = [&](T * row, int64_t k, int64_t c) {
        row[n_kv + k] = row[c];
        row[c] = drop;
    };
    std::vector<owner> list;
    const int64_t n_k = std::min<int64_t>(n_hp, w.n_slots); // padding rows are never visible
    const bool one_seq_per_stream = llama_oscar_kv_access::n_stream(kv) > 1;
    const int64_t n_tokens = ubatch->n_tokens;
    for (int64_t i0 = 0; i0 < n_tokens; ) {
        // a run of tokens of one sequence, and the least of their positions
        const llama_seq_id seq = ubatch->seq_id[i0][0];
        llama_pos q_min = ubatch->pos[i0];
        int64_t i1 = i0 + 1;
        for (; i1 < n_tokens && ubatch->seq_id[i1][0] == seq; ++i1) {
            q_min = std::min(q_min, ubatch->pos[i1]);
        }
        // the cells of the sequence that own a slot and that some token of the run may read from
        // it: positions in the sink, and past q_min - R (llama_oscar_window_reads)
        const uint32_t strm  = seq_to_stream[seq];
        const auto &   cells = v_cells[strm];
        const auto &   st    = w.streams[strm];
        const auto &   by_pos = cells.seq_pos_get(seq);
        const llama_pos sink = (llama_pos) w.sink;
        const llama_pos from = w.recent > 0 ? (llama_pos) std::max<int64_t>(sink, (int64_t) q_min - (int64_t) w.recent + 1)
                                            : std::numeric_limits<llama_pos>::max();
        // each cell found (slot k, cell c at position p) goes to the list, or where the run is one
        // token (a decode step), which reads every cell found, straight into its row
        T * const row1 = i1 == i0 + 1 ? data + i0*W : nullptr;
        if (row1) {
            std::fill(row1 + n_kv, row1 + W, drop);
        }
        list.clear();
        auto found = [&](int64_t k, int64_t c, llama_pos p) {
            if (row1) {
                to_window(row1, k, c);
            } else {
                list.push_back({ k, c, p });
            }
        };
        if (one_seq_per_stream) {
            for (int64_t k = 0; k < std::min<int64_t>(n_k, st.high); ++k) {
                const int32_t c = st.slot_cell[k];
                if (c >= 0 && c < n_kv && !cells.is_empty(c)) {
                    const llama_pos p = cells.pos_get(c);
                    if (p < sink || p >= from) {
                        found(k, c, p);
                    }
                }
            }
        } else {
            auto take = [&](auto it, auto end) {
                for (; it != end; ++it) {
                    const int64_t c = it->second;
                    const int32_t k = c < n_kv ? st.cell_slot[c] : -1;
                    if (k >= 0 && k < n_k) {
                        found(k, c, it->first);
                    }
                }
            };
            take(by_pos.begin(), by_pos.lower_bound({ sink, 0 }));
            take(by_pos.lower_bound({ from, 0 }), by_pos.end());
        }
        for (int64_t i = i0; i < i1 && !row1; ++i) {
            const llama_pos q = ubatch->pos[i];
            T * row = data + i*W;
            std::fill(row + n_kv, row + W, drop);
            for (const owner & e : list) {
                if (llama_oscar_window_reads(w, e.pos, q)) {
                    to_window(row, e.k, e.c);
                }
            }
        }
        i0 = i1;
    }
}

int64_t llama_oscar_window_mask_cols(const llama_kv_cache & kv, const ggml_tensor * dst) {
    const llama_oscar_window * w = llama_oscar_window_of(kv);
    if (!w || w->n_hp_cur == 0) {
        return 0;
    }
    GGML_ASSERT(dst->ne[0] > (int64_t) w->n_hp_cur);
    return w->n_hp_cur;
}

void llama_oscar_window_fill_mask(const llama_kv_cache & kv, ggml_tensor * dst, const llama_ubatch * ubatch, int64_t n_kv) {
    const llama_oscar_window * w = llama_oscar_window_of(kv);
    GGML_ASSERT(w);
    if (dst->type == GGML_TYPE_F16) {
        fill_mask<ggml_fp16_t>(kv, *w, ubatch, n_kv, dst);
    } else {
        fill_mask<float>(kv, *w, ubatch, n_kv, dst);
    }
}

// ---- K shift ------------------------------------------------------------------------------------

// per window row: the RoPE shift of the cell that owns it (0 for free and trash rows)
class llama_oscar_window_shift_input : public llm_graph_input_i {
public:
    llama_oscar_window_shift_input(const llama_kv_cache & kv) : kv(kv) {}
    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        const llama_oscar_window * w = llama_oscar_window_of(kv);
        GGML_ASSERT(ggml_backend_buffer_is_host(shift->buffer));
        int32_t * data = (int32_t *) shift->data;
        const auto & v_cells = llama_oscar_kv_access::cells(kv);
        for (uint32_t s = 0; s < w->streams.size(); ++s) {
            const auto & st = w->streams[s];
            for (uint32_t r = 0; r < w->n_rows(); ++r) {
                const int32_t c = r < w->n_slots ? st.slot_cell[r] : -1;
                data[s*w->n_rows() + r] = (c >= 0 && !v_cells[s].is_empty(c)) ? v_cells[s].get_shift(c) : 0;
            }
        }
    }
    ggml_tensor * shift = nullptr; // I32 [n_rows*n_stream]
    const llama_kv_cache & kv;
};

void llama_oscar_window_build_shift(ggml_context * ctx, ggml_cgraph * gf, llm_graph_result * res, const llama_kv_cache & kv,
        const llama_cparams & cparams, ggml_tensor * k_rot) {
    const llama_oscar_window * w = llama_oscar_window_of(kv);
    if (!w) {
        return;
    }
    const llama_model & model = llama_oscar_kv_access::model(kv);
    const auto & hp = model.hparams;
    auto inp = std::make_unique<llama_oscar_window_shift_input>(kv);
    inp->shift = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) w->n_rows()*w->streams.size());
    ggml_set_input(inp->shift);

    const auto & layers = llama_oscar_kv_access::layers(kv);
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const uint32_t il = layers[ikv].il;
        if (!hp.has_rope(il)) {
            continue;
        }
        ggml_tensor * t = w->k[ikv];
        const int64_t d = hp.n_embd_head_k(il);
        // whole heads: the rows are stored rotated, so the shift un-rotates, ropes and re-rotates
        ggml_tensor * k = ggml_view_3d(ctx, t, d, hp.n_head_kv(il), t->ne[1]*t->ne[2],
                ggml_row_size(t->type, d), t->nb[1], 0);
        ggml_tensor * cur = llama_oscar_kv_access::rope_shift(kv, cparams, ctx, k, inp->shift, k_rot,
                model.get_rope_factors(cparams, il), model.get_rope_freq_base(cparams, il),
                model.get_rope_freq_scale(cparams, il), il);
        ggml_build_forward_expand(gf, cur);
    }
    res->add_input(std::move(inp));
}
