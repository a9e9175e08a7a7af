// llama-oscar-window.cpp: the high-precision sink + recent window (design in
// llama-oscar-window.h): its configuration, its slots, truncation, stream copy and state. Its part
// of the graph is in llama-oscar-window-graph.cpp.

#include "llama-oscar-window.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-batch.h"
#include "llama-cparams.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

// the window's rows (those attention reads, and the store's) are padded to this: a whole number of
// the decode kernels' 32-row steps, and changes of the rows in use, each a new graph, stay rare.
// Not more: every padding row is memory of each stream's store (at the 8B shape, 256 rows of one
// stream are 32 MiB, which at equal memory decides how many sequences fit) and a masked row that
// each decode step scans. (The f16 prefill path pads [cache | window] to its own multiple.)
static const uint32_t HP_PAD = 64;

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
    // A sliding-window cache is oscar2 only when it is full-size (--swa-full, see
    // llama_oscar_swa_cache_type). It keeps the same sink and recent as the other layers, so that
    // every layer reads the same positions in f16 (what `oscar simulate` models), and the mask of its
    // cache columns carries the sliding window over to the window columns.
    const bool swa = llama_oscar_kv_access::swa_type(kv) != LLAMA_SWA_TYPE_NONE;
    if (!swa && (uint64_t) sink + recent > kv_size) {
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
    w->n_keep  = w->n_slots - std::min<uint64_t>(w->n_slots, (uint64_t) n_seq_str*(sink + recent));

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

// a sequence of a stream and the earliest query position of it that attention will still run:
// its first token in the ubatch being applied, else the position after its last one
struct seq_query {
    llama_seq_id seq;
    llama_pos    first_q;
};

// whether cell c is read from the window by a query still to come. Only the sequences of the
// cell's stream are asked: with one stream per sequence that is one, where asking every sequence
// the context holds made each step's apply cost streams x slots x sequences. With one sequence
// in the stream (one_seq), every cell in use is of it, and the cell's sequence set (32 bytes, a
// cache miss per slot at many streams) is not read.
static bool needs_slot(const llama_oscar_window & w, const llama_kv_cells & cells, uint32_t c,
        const std::vector<seq_query> & queries, bool one_seq) {
    if (cells.is_empty(c)) {
        return false;
    }
    const llama_pos p = cells.pos_get(c);
    for (const seq_query & q : queries) {
        // a cell is needed while some query at first_q or later reads it: p > first_q - R
        if (llama_oscar_window_reads(w, p, q.first_q) && (one_seq || cells.seq_has(c, q.seq))) {
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

// the lowest free slot, else the oldest retired one; -1 when every slot is in use. Also the
// oldest retired one where the lowest free slot would raise the rows in use while more than
// n_keep slots are retired: a pool sized for more sequences than are running would otherwise
// fill up with retired rows, which every query of the stream scans (masked) at each step.
static int32_t alloc_slot(const llama_oscar_window & w, llama_oscar_window::stream_slots & st, uint32_t c) {
    const bool grows = st.free.empty() || *st.free.begin() >= st.high;
    if (st.free.empty() || (grows && st.retired.size() > w.n_keep)) {
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

        // the stream's sequences (those with cells in it; the ubatch's are in the cells already)
        // and the earliest query of each: its first token in this ubatch, else the next one
        std::vector<seq_query> queries;
        for (llama_seq_id q = 0; q < (llama_seq_id) n_seq; ++q) {
            const llama_pos last = cells.seq_pos_max(q);
            if (last >= 0) {
                queries.push_back({ q, last + 1 });
            }
        }
        const bool one_seq = queries.size() == 1;
        for (uint32_t c : sinfo.idxs[s]) {
            if (!cells.is_empty(c)) {
                for (seq_query & q : queries) {
                    if (cells.seq_has(c, q.seq)) {
                        q.first_q = std::min(q.first_q, cells.pos_get(c));
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
            } else if (needs_slot(*w, cells, (uint32_t) c, queries, one_seq)) {
                unretire(st, slot);
            } else {
                retire(st, slot);
            }
        }
        // the tokens of this ubatch: a slot if a query of this ubatch or a later one reads them
        for (uint32_t c : sinfo.idxs[s]) {
            const bool need = needs_slot(*w, cells, c, queries, one_seq);
            if (need && st.cell_slot[c] >= 0) {
                unretire(st, (uint32_t) st.cell_slot[c]); // the cell's previous token's slot: rewritten now
            } else if (need) {
                if (alloc_slot(*w, st, c) < 0 && !w->warned_full) {
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

ggml_type llama_oscar_swa_cache_type(ggml_type type, bool swa_full) {
    const bool oscar2 = type == GGML_TYPE_OSCAR2 || type == GGML_TYPE_OSCAR2_64;
    return oscar2 && !swa_full ? GGML_TYPE_F16 : type;
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
            if (pos >= p0 || !llama_oscar_window_reads(*w, pos, p0)) {
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
// copy: row by row, a GPU window would cost one device copy of about 2 KB per row, layer and kind
// (53,386 of them, about 0.75 s, for llama-bench's state at depth 16384 on an H100)
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
            slot = alloc_slot(*w, st, c);
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
