// llama-oscar-window.h: the high-precision sink + recent window of an oscar2 KV cache.
//
// What it is. For every sequence, the first S positions (the sink) and the last R positions
// (the recent window) are read from a small f16/bf16 store; every other position is read
// from the oscar2 cache. Every token is always written to the oscar2 cache as well, so a token
// that leaves the window needs no copy: its slot is freed and the mask starts showing its
// INT2 cell instead.
//
// Store. Per cache layer one tensor K [n_embd_k_gqa, n_rows, n_stream] and one V, n_rows =
// n_slots + 1 (the last row is a trash row that takes the writes of tokens outside the
// window). A slot pool per stream maps slot <-> cell. Slots are assigned in the real apply()
// of a ubatch (never in prepare()'s simulation). A slot whose cell no longer needs it (outside
// the window of every sequence it belongs to) is *retired*, not freed: it keeps its cell and
// its row, and attention skips it (masked), until the pool runs out of free slots and the
// oldest retired one is taken. A slot of an emptied cell is freed.
//
// Why retire. A caller that truncates a sequence (the server's prompt cache, a regenerate,
// llama-cpp-python's prefix reuse) continues from an earlier position, whose recent window
// reaches back to tokens that had already left the window. Retired rows still hold them, so
// the continuation reads exactly what a fresh run would. When they are gone, seq_rm refuses
// the truncation (llama_oscar_window_can_truncate) and the caller starts the sequence over,
// as it does for caches that cannot remove part of a sequence.
//
// Reading. Flash attention gets the used slot range as extra rows (ggml_flash_attn_ext_add_window)
// and the mask grows by as many columns. A query at position q reads a cell from the window iff the
// cell has a slot and its position p is in the query's window (p < S, or q - R < p); then its
// cache column is -inf and its window column carries the cell's usual mask value. Otherwise
// the reverse. One online softmax, each position once, per query exact even when sequences
// share cells, and the same whether a prompt arrives in one ubatch, several, or token by token.
// A sequence holds slots for its sink, the R - 1 positions before its first query of the
// ubatch, and the ubatch's own tokens: n_slots = n_seq x (S + R) + n_ubatch per stream, and
// the slots left over at decode keep retired rows. While fewer sequences run than the pool is
// sized for, retired rows beyond that spare are reused before the rows in use grow, so that
// attention reads about as many window rows as the running sequences hold.
//
// Limits (documented): cells shifted into the sink range (context shift) are read from INT2.
// A full slot pool (only with unusual position layouts) leaves a token in INT2.
#pragma once

#include "llama-oscar-kv.h"

#include "ggml-cpp.h"

#include <set>
#include <utility>
#include <vector>

struct llama_ubatch;
struct llm_graph_result;
class  llama_io_write_i;
class  llama_io_read_i;

struct llama_oscar_window {
    uint32_t  sink   = 0;
    uint32_t  recent = 0;
    ggml_type type   = GGML_TYPE_F16;

    uint32_t n_slots = 0;                         // per stream
    uint32_t n_pad   = 0;                         // n_slots rounded up to HP_PAD: rows attention may read
    uint32_t n_keep  = 0;                         // retired slots kept before the rows in use grow (the spare)
    uint32_t n_rows() const { return n_pad + 1; }   // + the trash row
    uint32_t trash()  const { return n_pad; }

    struct stream_slots {
        std::vector<int32_t> slot_cell;   // [n_slots] owning cell, -1 = free
        std::vector<int32_t> cell_slot;   // [kv_size] slot, -1 = none
        std::set<uint32_t>   free;        // lowest first, so that the used range stays compact
        uint32_t             high = 0;    // 1 + highest used slot
        std::vector<uint64_t> retired_at; // [n_slots] retirement time, 0 = in use (or free)
        std::set<std::pair<uint64_t, uint32_t>> retired; // (time, slot), oldest first
        uint64_t             clock = 0;
    };
    std::vector<stream_slots> streams;

    // number of window rows flash attention reads for the current ubatch (padded high-water mark)
    uint32_t n_hp_cur = 0;

    std::vector<ggml_tensor *> k; // by cache layer index
    std::vector<ggml_tensor *> v;
    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> ctxs_bufs;

    bool warned_full = false;
};

// the window of a cache, or null
const llama_oscar_window * llama_oscar_window_of(const llama_kv_cache & kv);

// Whether a query at position q reads the cached position p from the window: p is in the
// sink, or among the R positions up to q. The window is the query's, not the sequence's, so
// a token sees the same stores whether the prompt came in one ubatch, several, or one token
// at a time (at decode the query is the sequence's last position, and both views agree).
inline bool llama_oscar_window_reads(const llama_oscar_window & w, llama_pos p, llama_pos q) {
    if (p < (llama_pos) w.sink) {
        return true;
    }
    return w.recent > 0 && (int64_t) p > (int64_t) q - (int64_t) w.recent;
}

