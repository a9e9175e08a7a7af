// attn_plan_check.cpp: the CUDA decode attention's plan (ggml-oscar/cuda/attn-plan.h), checked on
// the CPU: over a grid of shapes, every plan covers every query and every row exactly as its
// kernels read them; and on the H100's 132 SMs, the plans that the README and the planner's
// comments describe. Prints one line per failure and "plans ok N" at the end; exit status 1 on any
// failure. Built and run by tests/test_attn_plan.py.

#include "attn-plan.h"

#include <cstdio>

static int n_fail = 0;

#define CHECK(cond, ...) do { if (!(cond)) { ++n_fail; if (n_fail <= 20) { printf("FAIL %s: ", #cond); printf(__VA_ARGS__); printf("\n"); } } } while (0)

static decode_shape shape(int n_sm, int D, int gqa, int n_head_kv, int n_q, int n_streams, int n_rows, int n_win, bool mask,
        int seq_tokens, bool mma_arch, bool mma_types, bool int2_types) {
    decode_shape s = {};
    s.n_sm = n_sm; s.D = D; s.gqa = gqa; s.n_head_kv = n_head_kv; s.n_q = n_q; s.n_streams = n_streams;
    s.n_rows = n_rows; s.n_win = n_win; s.mask = mask; s.seq_tokens = seq_tokens;
    s.mma_arch = mma_arch; s.mma_types = mma_types; s.int2_types = int2_types;
    return s;
}

// an H100's 132 SMs, the 8B shape (head size 128, 8 KV heads of 4 query heads), oscar2 with an f16 window
static decode_shape h100_8b(int n_q, int n_streams, int n_rows, int n_win, int seq_tokens) {
    return shape(132, 128, 4, 8, n_q, n_streams, n_rows, n_win, true, seq_tokens, true, true, true);
}

// what every plan must hold: the kernels read rows [r0, r1) of each split as attn-mma.cu and
// attn-vec.cu compute them from these numbers
static void check_invariants(const decode_shape & s, const char * what) {
    const decode_plan p = plan_decode(s);
    CHECK(p.nqb >= 1 && p.tokens_per_block >= 1, "%s", what);
    CHECK(p.tokens_per_block*p.n_groups >= s.n_q && (p.n_groups - 1)*p.tokens_per_block < s.n_q, "%s: groups", what);
    CHECK(!p.mma || (s.mma_arch && p.nqb <= OSCAR_MMA_MAX_QUERIES), "%s: mma", what);
    CHECK(!p.lists || (p.mma && s.mask && s.n_q > 1), "%s: lists", what);
    CHECK(!p.win_lists || (p.mma && s.mask && s.n_win > 0), "%s: window lists", what);
    CHECK(p.ns_main >= 1 && p.rps_main % OSCAR_FA_WARPS == 0 && p.rps_lite % OSCAR_FA_WARPS == 0, "%s: splits", what);
    // the cache's rows: the first n_lite splits (those riding with a window chunk) take rps_lite
    const int n_lite = p.mma && s.n_win > 0 && p.ns_win < p.ns_main ? p.ns_win : 0;
    const int64_t covered = (int64_t) n_lite*p.rps_lite + (int64_t) (p.ns_main - n_lite)*p.rps_main;
    CHECK(covered >= s.n_rows, "%s: cache rows %lld of %d", what, (long long) covered, s.n_rows);
    CHECK(n_lite > 0 || (int64_t) (p.ns_main - 1)*p.rps_main < s.n_rows, "%s: an empty last split", what);
    // the window's rows: shares of its live-chunk list, one per cache split, or chunks of rows
    if (s.n_win == 0) {
        CHECK(p.ns_win == 0, "%s: window chunks without a window", what);
    } else if (p.win_lists) {
        CHECK(p.ns_win == p.ns_main && p.rps_win == 0, "%s: window shares", what);
    } else {
        CHECK(p.ns_win >= 1 && (int64_t) p.ns_win*p.rps_win >= s.n_win && (int64_t) (p.ns_win - 1)*p.rps_win < s.n_win,
              "%s: window rows %d in %d x %d", what, s.n_win, p.ns_win, p.rps_win);
        CHECK(!p.mma || (p.rps_win % (OSCAR_FA_WARPS*OSCAR_LIVE_ROWS) == 0 && p.rps_win <= OSCAR_WIN_MAX_ROWS),
              "%s: window chunks of whole steps", what);
    }
}

int main() {
    long n = 0;
    char what[256];
    for (int n_sm : {46, 132}) for (int D : {64, 128, 256}) for (int gqa : {1, 4, 8}) for (int n_head_kv : {1, 8})
    for (int n_q : {1, 3, 4, 16, 64}) for (int n_streams : {1, 8, 39}) for (int n_rows : {32, 1000, 16384, 131072})
    for (int n_win : {0, 320, 832, 3072}) for (int mask : {0, 1}) for (int seq_tokens : {0, 1, 4}) for (int mma_arch : {0, 1})
    for (int mma_types : {0, 1}) {
        snprintf(what, sizeof(what), "sm %d D %d gqa %d kv %d q %d streams %d rows %d win %d mask %d seq %d arch %d mma %d",
                 n_sm, D, gqa, n_head_kv, n_q, n_streams, n_rows, n_win, mask, seq_tokens, mma_arch, mma_types);
        check_invariants(shape(n_sm, D, gqa, n_head_kv, n_q, n_streams, n_rows, n_win, mask, seq_tokens, mma_arch, mma_types,
                               mma_types), what);
        ++n;
    }

    // the plans that the README and attn-plan.h's comments describe (an H100, the 8B shape)
    {
        // 39 streams of 16384, one token each (the equal-memory point): 312 blocks would fill one
        // wave of 396 79%, so 5 splits a stream (3.9 waves), and the window by lists
        const decode_plan p = plan_decode(h100_8b(1, 39, 16384, 832, 1));
        CHECK(p.mma && !p.lists && p.win_lists && p.ns_main == 5 && p.ns_win == 5, "39 streams: %d splits", p.ns_main);
    }
    for (int n_streams : {8, 41}) {
        const decode_plan p = plan_decode(h100_8b(1, n_streams, 16384, 832, 1));
        CHECK(p.win_lists && p.ns_main == 6, "%d streams of 16384: %d splits", n_streams, p.ns_main);
    }
    {
        const decode_plan p = plan_decode(h100_8b(1, 64, 4096, 832, 1));
        CHECK(p.win_lists && p.ns_main == 3, "64 streams of 4096: %d splits", p.ns_main);
    }
    {
        // one sequence at 2048: 16 splits, and the window's 7 chunks of 128 rows ride with the
        // first 7, which give their cache rows to the others
        const decode_plan p = plan_decode(h100_8b(1, 1, 2048, 832, 0));
        CHECK(!p.lists && !p.win_lists && p.ns_main == 16 && p.ns_win == 7 && p.rps_win == 128 && p.rps_lite == 0,
              "one sequence at 2048: %d splits, %d chunks of %d, lite %d", p.ns_main, p.ns_win, p.rps_win, p.rps_lite);
    }
    {
        // one sequence at 131072: one wave of 49 splits, the 7 riding with a chunk 512 rows lighter
        const decode_plan p = plan_decode(h100_8b(1, 1, 131072, 832, 0));
        CHECK(p.ns_main == 49 && p.ns_win == 7 && p.rps_lite + OSCAR_WIN_LITE_ROWS <= p.rps_main + OSCAR_FA_WARPS,
              "one sequence at 131072: %d splits, lite %d, main %d", p.ns_main, p.rps_lite, p.rps_main);
    }
    {
        // a unified step of 8 sequences, one token each: a block holds one sequence's 4 queries,
        // and the cache and the window go by lists
        const decode_plan p = plan_decode(h100_8b(8, 1, 131584, 3072, 1));
        CHECK(p.nqb == 4 && p.n_groups == 8 && p.lists && p.win_lists, "unified 8: nqb %d groups %d", p.nqb, p.n_groups);
    }
    {
        // one stream, 16 query tokens of one sequence (a speculative batch): 8 queries a block
        const decode_plan p = plan_decode(h100_8b(16, 1, 16384, 832, 16));
        CHECK(p.nqb == OSCAR_MMA_MAX_QUERIES && p.n_groups == 8 && p.lists, "speculative 16: nqb %d groups %d", p.nqb, p.n_groups);
    }
    {
        // no tensor-core code, or types the tensor-core kernel does not take: no lists
        const decode_plan a = plan_decode(shape(132, 128, 4, 8, 4, 1, 16384, 832, true, 1, false, true, true));
        const decode_plan b = plan_decode(shape(132, 128, 4, 8, 4, 1, 16384, 832, true, 1, true, false, false));
        CHECK(!a.mma && !a.lists && !a.win_lists && !b.mma && !b.lists && !b.win_lists, "CUDA-core kernels");
    }

    printf("plans ok %ld%s\n", n, n_fail ? " (with failures)" : "");
    return n_fail ? 1 : 0;
}
