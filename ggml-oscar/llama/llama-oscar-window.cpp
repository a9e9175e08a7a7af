// llama-oscar-window.cpp: the high-precision sink + recent window (design in llama-oscar-window.h).

#include "llama-oscar-window.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-batch.h"
#include "llama-graph.h"
#include "llama-cparams.h"

#include "../oscar2-ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

// window rows read by attention are padded to this: with the cache's own padding of 256 cells, the
// rows of [cache | window] stay a multiple of 256, which the tensor-core kernels expect
static const uint32_t HP_PAD = 256;

const llama_oscar_window * llama_oscar_window_of(const llama_kv_cache & kv) {
    const auto & o = llama_oscar_kv_access::get(kv);
    return o ? o->window.get() : nullptr;
}

static llama_oscar_window * window_mut(const llama_kv_cache & kv) {
    const auto & o = llama_oscar_kv_access::get(kv);
    return o ? o->window.get() : nullptr;
}

// ---- configuration --------------------------------------------------------------------------

void llama_oscar_window_configure(llama_kv_cache & kv, const llama_model & model, const llama_cparams & cparams) {
    auto & oscar = llama_oscar_kv_access::get(kv);
    if (!oscar || !llama_oscar_cache_is_oscar2(kv)) {
        return; // the window only makes sense next to an INT2 cache
    }
    if (llama_oscar_kv_access::swa_type(kv) != LLAMA_SWA_TYPE_NONE) {
        return; // a sliding-window cache holds n_swa + n_ubatch cells: no room for a window
    }
    const auto & hp = model.hparams;
    const uint32_t sink0   = cparams.oscar_sink   >= 0 ? (uint32_t) cparams.oscar_sink   : hp.oscar_sink;
    const uint32_t recent0 = cparams.oscar_recent >= 0 ? (uint32_t) cparams.oscar_recent : hp.oscar_recent;
    const bool explicit_size = cparams.oscar_sink >= 0 || cparams.oscar_recent >= 0;
    if (sink0 == 0 && recent0 == 0) {
        LLAMA_LOG_INFO("%s: oscar window disabled (sink 0, recent 0): every token is read from INT2\n", __func__);
        return;
    }
    const uint32_t kv_size = kv.get_size();
    uint32_t sink   = sink0;
    uint32_t recent = recent0;
    if ((uint64_t) sink + recent > kv_size) {
        if (explicit_size) {
            throw std::runtime_error("oscar: the high-precision window (sink " + std::to_string(sink) + " + recent " +
                    std::to_string(recent) + " tokens) is larger than the context (" + std::to_string(kv_size) +
                    " cells): use a larger -c, a smaller --oscar-sink/--oscar-recent, or an f16 cache");
        }
        // the model's defaults do not fit a small context: keep their proportion
        sink   = (uint32_t) ((uint64_t) sink0*kv_size/(sink0 + recent0));
        recent = kv_size - sink;
        LLAMA_LOG_WARN("%s: the default oscar window %u + %u does not fit %u cells: using %u + %u\n",
                __func__, sink0, recent0, kv_size, sink, recent);
    }
    if (cparams.oscar_window_type != GGML_TYPE_F16 && cparams.oscar_window_type != GGML_TYPE_BF16) {
        throw std::runtime_error(std::string("oscar: the window type must be f16 or bf16, got ") + ggml_type_name(cparams.oscar_window_type));
    }

    auto w = std::make_shared<llama_oscar_window>();
    w->sink   = sink;
    w->recent = recent;
    w->type   = cparams.oscar_window_type;

    const uint32_t n_stream  = llama_oscar_kv_access::n_stream(kv);
    const uint32_t n_seq_str = n_stream == 1 ? kv.get_n_seq_max() : 1; // sequences sharing one stream
    // a sequence needs its sink, the R - 1 positions before its first token in the ubatch and
    // the ubatch's own tokens (each query reads the R positions before it from the window, so
    // a prefill batch needs f16 rows for its own tokens too); slots are freed before new ones
    // are taken, so S + R per sequence plus one ubatch is always enough
    w->n_slots = std::min<uint64_t>(kv_size, (uint64_t) n_seq_str*(sink + recent) + cparams.n_ubatch);
    w->n_pad   = GGML_PAD(w->n_slots, HP_PAD);

    w->streams.resize(n_stream);
    for (auto & st : w->streams) {
        st.slot_cell.assign(w->n_slots, -1);
        st.cell_slot.assign(kv_size, -1);
        st.retired_at.assign(w->n_slots, 0);
        for (uint32_t i = 0; i < w->n_slots; ++i) {
            st.free.insert(i);
        }
    }

    // one tensor per layer and kind, in the buffer type of the layer's cache
    const auto & layers = llama_oscar_kv_access::layers(kv);
    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> ctxs;
    auto ctx_for = [&](ggml_backend_buffer_type_t buft) -> ggml_context * {
        auto it = ctxs.find(buft);
        if (it == ctxs.end()) {
            ggml_init_params params = { 2*layers.size()*ggml_tensor_overhead(), nullptr, true };
            it = ctxs.emplace(buft, ggml_context_ptr(ggml_init(params))).first;
        }
        return it->second.get();
    };
    w->k.resize(layers.size());
    w->v.resize(layers.size());
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const auto & layer = layers[ikv];
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layer.k->buffer);
        ggml_context * ctx = ctx_for(buft);
        w->k[ikv] = ggml_new_tensor_3d(ctx, w->type, layer.k->ne[0], w->n_rows(), n_stream);
        w->v[ikv] = ggml_new_tensor_3d(ctx, w->type, layer.v->ne[0], w->n_rows(), n_stream);
        ggml_format_name(w->k[ikv], "oscar_window_k_l%d", layer.il);
        ggml_format_name(w->v[ikv], "oscar_window_v_l%d", layer.il);
    }
    size_t total = 0;
    for (auto & [buft, ctx] : ctxs) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
        if (!buf) {
            throw std::runtime_error("oscar: failed to allocate the high-precision window buffer");
        }
        ggml_backend_buffer_clear(buf, 0);
        total += ggml_backend_buffer_get_size(buf);
        LLAMA_LOG_INFO("%s: %10s oscar window buffer size = %8.2f MiB\n", __func__, ggml_backend_buffer_name(buf),
                ggml_backend_buffer_get_size(buf)/1024.0/1024.0);
        w->ctxs_bufs.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }
    LLAMA_LOG_INFO("%s: oscar window: sink %u + recent %u tokens per sequence in %s, %u slots (%u rows) x %u stream(s), %.2f MiB\n",
            __func__, sink, recent, ggml_type_name(w->type), w->n_slots, w->n_rows(), n_stream, total/1024.0/1024.0);

    oscar->window = std::move(w);
}

// ---- membership -------------------------------------------------------------------------

// Whether a query at position q reads the cached position p from the window: p is in the
// sink, or among the R positions up to q. The window is the query's, not the sequence's, so
// a token sees the same stores whether the prompt came in one ubatch, several, or one token
// at a time (at decode the query is the sequence's last position, and both views agree).
static bool in_window(const llama_oscar_window & w, llama_pos p, llama_pos q) {
    if (p < (llama_pos) w.sink) {
        return true;
    }
    return w.recent > 0 && (int64_t) p > (int64_t) q - (int64_t) w.recent;
}

// first_q[s]: the earliest query position of sequence s that attention will still run,
// i.e. its first token in the ubatch being applied, else the position after its last one
static bool needs_slot(const llama_oscar_window & w, const llama_kv_cells & cells, uint32_t c,
        const std::vector<llama_pos> & first_q) {
    if (cells.is_empty(c)) {
        return false;
    }
    const llama_pos p = cells.pos_get(c);
    for (llama_seq_id s = 0; s < (llama_seq_id) first_q.size(); ++s) {
        // a cell is needed while some query at first_q or later reads it: p > first_q - R
        if (cells.seq_has(c, s) && in_window(w, p, first_q[s])) {
            return true;
        }
    }
    return false;
}

static void unretire(llama_oscar_window::stream_slots & st, uint32_t slot) {
    if (st.retired_at[slot] != 0) {
        st.retired.erase({ st.retired_at[slot], slot });
        st.retired_at[slot] = 0;
    }
}

static void retire(llama_oscar_window::stream_slots & st, uint32_t slot) {
    if (st.retired_at[slot] == 0) {
        st.retired_at[slot] = ++st.clock;
        st.retired.insert({ st.retired_at[slot], slot });
    }
}

static void free_slot(llama_oscar_window::stream_slots & st, uint32_t slot) {
    const int32_t c = st.slot_cell[slot];
    if (c >= 0) {
        st.cell_slot[c] = -1;
    }
    unretire(st, slot);
    st.slot_cell[slot] = -1;
    st.free.insert(slot);
    while (st.high > 0 && st.slot_cell[st.high - 1] < 0) {
        st.high--;
    }
}

// a free slot, else the oldest retired one; -1 when every slot is in use
static int32_t alloc_slot(llama_oscar_window::stream_slots & st, uint32_t c) {
    if (st.free.empty()) {
        if (st.retired.empty()) {
            return -1;
        }
        free_slot(st, st.retired.begin()->second);
    }
    const uint32_t slot = *st.free.begin();
    st.free.erase(st.free.begin());
    st.slot_cell[slot] = (int32_t) c;
    st.cell_slot[c]    = (int32_t) slot;
    st.high = std::max(st.high, slot + 1);
    return (int32_t) slot;
}

static void update_n_hp(llama_oscar_window & w) {
    uint32_t high = 0;
    for (const auto & st : w.streams) {
        high = std::max(high, st.high);
    }
    w.n_hp_cur = high == 0 ? 0 : std::min(w.n_pad, GGML_PAD(high, HP_PAD));
}

void llama_oscar_window_apply(llama_kv_cache & kv, const llama_kv_cache_context & mctx) {
    llama_oscar_window * w = window_mut(kv);
    if (!w) {
        return;
    }
    const auto & sinfo = mctx.get_sinfo();
    const auto & v_cells  = llama_oscar_kv_access::cells(kv);
    const uint32_t n_seq  = kv.get_n_seq_max();
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const uint32_t strm = sinfo.strm[s];
        const auto & cells  = v_cells[strm];
        auto & st = w->streams[strm];

        // the earliest query of every sequence: its first token in this ubatch, else the next one
        std::vector<llama_pos> first_q(n_seq);
        for (llama_seq_id q = 0; q < (llama_seq_id) n_seq; ++q) {
            first_q[q] = cells.seq_pos_max(q) + 1;
        }
        for (uint32_t c : sinfo.idxs[s]) {
            if (!cells.is_empty(c)) {
                for (llama_seq_id q = 0; q < (llama_seq_id) n_seq; ++q) {
                    if (cells.seq_has(c, q)) {
                        first_q[q] = std::min(first_q[q], cells.pos_get(c));
                    }
                }
            }
        }

        // emptied cells give their slot back; tokens that left every window retire theirs (kept
        // for a truncation that brings them back); retired tokens a query needs again return
        for (uint32_t slot = 0; slot < st.high; ++slot) {
            const int32_t c = st.slot_cell[slot];
            if (c < 0) {
                continue;
            }
            if (cells.is_empty(c)) {
                free_slot(st, slot);
            } else if (needs_slot(*w, cells, (uint32_t) c, first_q)) {
                unretire(st, slot);
            } else {
                retire(st, slot);
            }
        }
        // the tokens of this ubatch: a slot if a query of this ubatch or a later one reads them
        for (uint32_t c : sinfo.idxs[s]) {
            const bool need = needs_slot(*w, cells, c, first_q);
            if (need && st.cell_slot[c] >= 0) {
                unretire(st, (uint32_t) st.cell_slot[c]); // the cell's previous token's slot: rewritten now
            } else if (need) {
                if (alloc_slot(st, c) < 0 && !w->warned_full) {
                    LLAMA_LOG_WARN("%s: oscar window full (%u slots): some window tokens are read from INT2\n", __func__, w->n_slots);
                    w->warned_full = true;
                }
            } else if (!need && st.cell_slot[c] >= 0) {
                free_slot(st, (uint32_t) st.cell_slot[c]); // a stale slot of the cell's previous token
            }
        }
    }
    update_n_hp(*w);
}

void llama_oscar_window_clear(llama_kv_cache & kv) {
    llama_oscar_window * w = window_mut(kv);
    if (!w) {
        return;
    }
    for (auto & st : w->streams) {
        std::fill(st.slot_cell.begin(), st.slot_cell.end(), -1);
        std::fill(st.cell_slot.begin(), st.cell_slot.end(), -1);
        std::fill(st.retired_at.begin(), st.retired_at.end(), 0);
        st.retired.clear();
        st.free.clear();
        for (uint32_t i = 0; i < w->n_slots; ++i) {
            st.free.insert(i);
        }
        st.high = 0;
    }
    w->n_hp_cur = 0;
}

// The window rows a graph built for mctx reads (and its mask's extra columns). A reserve graph
// (the whole cache, no ubatch) takes every row the window can hold, not the rows in use now:
// the buffers are sized by the reserve, and a graph larger than it makes the scheduler reallocate
// them when it runs. With the rows in use (none in a fresh context) every prefill that filled
// the window further did so: 20 ms a time for the pinned input buffer alone (CUPTI trace, H100,
// 512 tokens at depth 16384), a quarter of the ubatch.
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

bool llama_oscar_window_can_truncate(const llama_kv_cache & kv, llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    const llama_oscar_window * w = llama_oscar_window_of(kv);
    if (!w || p0 <= 0) {
        return true; // no window, or the whole sequence goes
    }
    const auto & v_cells = llama_oscar_kv_access::cells(kv);
    const uint32_t n_seq = kv.get_n_seq_max();
    std::vector<llama_seq_id> truncated; // sequences of this stream whose tail goes
    for (uint32_t strm = 0; strm < v_cells.size(); ++strm) {
        const auto & cells = v_cells[strm];
        const auto & st    = w->streams[strm];
        truncated.clear();
        for (llama_seq_id s = 0; s < (llama_seq_id) n_seq; ++s) {
            const llama_pos pmax = cells.seq_pos_max(s);
            // skipped: not this sequence, nothing of it removed, or a cut inside it (not a truncation)
            if ((seq_id < 0 || s == seq_id) && pmax >= p0 && !(p1 >= 0 && p1 <= pmax)) {
                truncated.push_back(s);
            }
        }
        if (truncated.empty()) {
            continue;
        }
        // one pass over the cells: the next query of a truncated sequence is p0, and every kept
        // position in its window needs its f16 row
        for (uint32_t c = 0; c < cells.size(); ++c) {
            if (cells.is_empty(c) || st.cell_slot[c] >= 0) {
                continue;
            }
            const llama_pos pos = cells.pos_get(c);
            if (pos >= p0 || !in_window(*w, pos, p0)) {
                continue;
            }
            for (llama_seq_id s : truncated) {
                if (cells.seq_has(c, s)) {
                    return false;
                }
            }
        }
    }
    return true;
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
// (rows of W = n_kv + n_hp columns: patch 0011 gives it the row stride); the window's columns
// are filled in here: a cache column whose position is read from the window is dropped, and the
// window column of its slot takes its value. Only cells that own a window slot can change
// (slot_cell and cell_slot change only as pairs, in alloc_slot/free_slot), so they are listed
// once per stream and each row gets a few hundred patches (per element work made a 512-token
// prefill at 32k cells ~50 ms slower). Why the stride: the first version built rows of n_kv and
// moved each to its place, a second pass over the whole mask (36 MB at 16k cells and 512 tokens).
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
    std::vector<std::vector<owner>> per_stream(v_cells.size());
    std::vector<bool> built(v_cells.size(), false);
    auto owners_of = [&](uint32_t strm) -> const std::vector<owner> & {
        if (!built[strm]) {
            const auto & cells = v_cells[strm];
            const auto & st    = w.streams[strm];
            const int64_t n_k = std::min<int64_t>(n_hp, w.n_slots); // padding rows are never visible
            for (int64_t k = 0; k < n_k; ++k) {
                const int32_t c = st.slot_cell[k];
                if (c >= 0 && c < n_kv && !cells.is_empty(c)) {
                    per_stream[strm].push_back({ k, c, cells.pos_get(c) });
                }
            }
            built[strm] = true;
        }
        return per_stream[strm];
    };

    for (int64_t i = 0; i < (int64_t) ubatch->n_tokens; ++i) {
        const llama_pos q = ubatch->pos[i];
        T * row = data + i*W;
        std::fill(row + n_kv, row + W, drop);
        for (const owner & e : owners_of(seq_to_stream[ubatch->seq_id[i][0]])) {
            if (in_window(w, e.pos, q)) {
                row[n_kv + e.k] = row[e.c];
                row[e.c] = drop;
            }
        }
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

// ---- stream copy (seq_cp across streams) ------------------------------------------------------

void llama_oscar_window_copy_stream(llama_kv_cache & kv, uint32_t ssrc, uint32_t sdst) {
    llama_oscar_window * w = window_mut(kv);
    if (!w) {
        return;
    }
    // the stream copy duplicates every cell, so the window follows whole: slots and rows
    w->streams[sdst] = w->streams[ssrc];
    for (size_t ikv = 0; ikv < w->k.size(); ++ikv) {
        for (ggml_tensor * t : { w->k[ikv], w->v[ikv] }) {
            const size_t nb = t->nb[2];
            std::vector<uint8_t> buf(nb);
            ggml_backend_tensor_get(t, buf.data(), nb*ssrc, nb);
            ggml_backend_tensor_set(t, buf.data(), nb*sdst, nb);
        }
    }
    update_n_hp(*w);
}

// ---- state save / load -----------------------------------------------------------------------

static const uint32_t WINDOW_STATE_MAGIC = 0x5743534f; // "OSCW"

// (first slot, count) runs of rows whose slots follow one another, so that each run is one tensor
// copy: row by row, a GPU window cost one device copy of about 2 KB per row, layer and kind
// (53,386 of them, about 0.75 s, for llama-bench's state at depth 16384 on the H100)
static std::vector<std::pair<uint32_t, uint32_t>> slot_runs(const std::vector<uint32_t> & slots) {
    std::vector<std::pair<uint32_t, uint32_t>> runs;
    for (uint32_t s : slots) {
        if (!runs.empty() && runs.back().first + runs.back().second == s) {
            runs.back().second++;
        } else {
            runs.push_back({ s, 1 });
        }
    }
    return runs;
}

void llama_oscar_window_state_write(const llama_kv_cache & kv, llama_io_write_i & io, uint32_t strm,
        const std::vector<std::pair<uint32_t, uint32_t>> & cell_ranges) {
    const llama_oscar_window * w = llama_oscar_window_of(kv);
    std::vector<uint32_t> cells;
    for (const auto & [c0, c1] : cell_ranges) {
        for (uint32_t c = c0; c < c1; ++c) {
            cells.push_back(c);
        }
    }
    const uint32_t magic = WINDOW_STATE_MAGIC;
    io.write(&magic, sizeof(magic));
    uint32_t n_rows = 0;
    std::vector<uint32_t> order; // positions in `cells` that hold a window row
    if (w) {
        const auto & st = w->streams[strm];
        for (uint32_t i = 0; i < cells.size(); ++i) {
            const int32_t slot = st.cell_slot[cells[i]];
            if (slot >= 0 && st.retired_at[slot] == 0) { // retired rows stay behind
                order.push_back(i);
            }
        }
        n_rows = order.size();
        // rows in slot order (the section names each row's cell, so any order reads back): the
        // slots in use are then a few runs, however the ring has mixed them over the cells
        std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
            return st.cell_slot[cells[a]] < st.cell_slot[cells[b]];
        });
    }
    const uint32_t type     = w ? (uint32_t) w->type : 0;
    const uint32_t n_layers = w ? (uint32_t) w->k.size() : 0;
    io.write(&n_rows,   sizeof(n_rows));
    io.write(&type,     sizeof(type));
    io.write(&n_layers, sizeof(n_layers));
    if (n_rows == 0) {
        return;
    }
    const auto & st = w->streams[strm];
    std::vector<uint32_t> slots;
    for (uint32_t i : order) {
        io.write(&i, sizeof(i));
        slots.push_back((uint32_t) st.cell_slot[cells[i]]);
    }
    const auto runs = slot_runs(slots);
    for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
        for (ggml_tensor * t : { w->k[ikv], w->v[ikv] }) {
            const uint64_t row = t->nb[1];
            io.write(&row, sizeof(row));
            for (const auto & [s0, n] : runs) {
                io.write_tensor(t, strm*t->nb[2] + s0*row, n*row);
            }
        }
    }
}

void llama_oscar_window_state_read(llama_kv_cache & kv, llama_io_read_i & io, uint32_t strm,
        const std::vector<uint32_t> & cells) {
    llama_oscar_window * w = window_mut(kv);
    uint32_t magic = 0, n_rows = 0, type = 0, n_layers = 0;
    io.read(&magic, sizeof(magic));
    if (magic != WINDOW_STATE_MAGIC) {
        throw std::runtime_error("oscar: the saved state has no oscar window section (saved by another build?)");
    }
    io.read(&n_rows,   sizeof(n_rows));
    io.read(&type,     sizeof(type));
    io.read(&n_layers, sizeof(n_layers));
    if (w) {
        // the restored cells hold new tokens: a slot left from their previous tokens is stale
        auto & st = w->streams[strm];
        for (uint32_t c : cells) {
            if (st.cell_slot[c] >= 0) {
                free_slot(st, (uint32_t) st.cell_slot[c]);
            }
        }
        update_n_hp(*w);
    }
    if (n_rows == 0) {
        return; // saved without window rows: the restored tokens are read from INT2
    }
    if (!w) {
        throw std::runtime_error("oscar: the saved state carries a high-precision window, but this context has none "
                "(load it with the same -ctk/-ctv oscar2 and --oscar-sink/--oscar-recent settings)");
    }
    if (type != (uint32_t) w->type || n_layers != w->k.size()) {
        throw std::runtime_error("oscar: the saved window was made with another window type or layer count");
    }
    auto & st = w->streams[strm];
    std::vector<uint32_t> slots(n_rows);
    for (uint32_t r = 0; r < n_rows; ++r) {
        uint32_t i = 0;
        io.read(&i, sizeof(i));
        if (i >= cells.size()) {
            throw std::runtime_error("oscar: corrupt window section in the saved state");
        }
        const uint32_t c = cells[i];
        int32_t slot = st.cell_slot[c];
        if (slot < 0) {
            slot = alloc_slot(st, c);
        }
        if (slot < 0) {
            throw std::runtime_error("oscar: the window of this context is too small for the saved state");
        }
        slots[r] = (uint32_t) slot;
    }
    const auto runs = slot_runs(slots); // (a fresh context hands out slots in order: one run)
    for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
        for (ggml_tensor * t : { w->k[ikv], w->v[ikv] }) {
            uint64_t row = 0;
            io.read(&row, sizeof(row));
            if (row != t->nb[1]) {
                throw std::runtime_error("oscar: the saved window rows have another size");
            }
            for (const auto & [s0, n] : runs) {
                io.read_tensor(t, strm*t->nb[2] + s0*row, n*row);
            }
        }
    }
    update_n_hp(*w);
}
