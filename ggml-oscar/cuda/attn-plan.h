// attn-plan.h: how a decode attention's query columns and rows are split into blocks, before
// any launch (attn-decode.cu launches what plan_decode returns). Plain C++, no CUDA: the same
// arithmetic is checked on the CPU by tests/c/attn_plan_check.cpp (tests/test_attn_plan.py).
//
// The decode attention is split-KV (attn-common.cuh): queries go in groups of nqb per block,
// each group's blocks take the cache's rows in ns_main splits and the window's in ns_win chunks,
// and a combine merges one partial per split and chunk.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#define OSCAR_FA_WARPS 4           // warps per block of every attention kernel
#define OSCAR_LIVE_ROWS 32         // rows per chunk of a live-chunk list (one warp step of k_fa_int2_mma)
#define OSCAR_INT2_BLOCKS_PER_SM 3 // k_fa_int2's launch bounds; the plan sizes its splits by it
#define OSCAR_MMA_BLOCKS_PER_SM 3  // k_fa_int2_mma's launch bounds (12 warps per SM: with 8 the kernel
                                   // waits on latency); the plan sizes its splits by it

#define OSCAR_MMA_MAX_QUERIES 8  // queries per block of k_fa_int2_mma, at most
#define OSCAR_INT2_MAX_QUERIES 4 // queries per block of k_fa_int2, at most (more: k_fa_partial)

#define OSCAR_WIN_LITE_ROWS 512  // k_fa_int2_mma: cache rows fewer for a split that takes a window chunk
#define OSCAR_WIN_MAX_ROWS 1024  // k_fa_int2_mma: the most window rows of a chunk (one block's share)
#define OSCAR_WAVE_MIN_ROWS 1024 // k_fa_int2_mma: the fewest cache rows of a split where it takes several waves

// the attention to plan, and the device
struct decode_shape {
    int n_sm;        // the device's SMs
    int D;           // head size
    int gqa;         // query heads per KV head
    int n_head_kv;
    int n_q;         // query tokens per stream
    int n_streams;   // streams (ne[3])
    int n_rows;      // cache rows per stream
    int n_win;       // window rows per stream (0: no window)
    bool mask;
    int seq_tokens;  // query rows per sequence (ggml_flash_attn_ext_get_seq_tokens; 0: unknown)
    bool mma_arch;   // the binary has tensor-core code for the device
    bool mma_types;  // k_fa_int2_mma takes the K, V and window types and the head size (int2_mma_types)
    bool int2_types; // k_fa_int2 takes the K and V types (int2_types), else k_fa_partial
};

struct decode_plan {
    int nqb;              // queries per block
    int tokens_per_block; // query tokens per block (at least one token's heads)
    int n_groups;         // groups of blocks, one per tokens_per_block tokens
    bool mma;             // k_fa_int2_mma, in one launch; else k_fa_int2 or k_fa_partial, a launch a source
    bool lists;           // the cache's chunks by live-chunk list (attn-live.cu)
    bool win_lists;       // the window's chunks by live-chunk list: each cache split takes a share
    int ns_main, rps_main; // cache splits, and rows per split
    int ns_win, rps_win;   // window chunks and rows per chunk (win_lists: shares of the list, no rows)
    int rps_lite;          // cache rows of the splits that also take a window chunk (mma, ns_win < ns_main)
};

// queries per block, rounded up to the kernel's compile-time sizes (at least one token's heads)
static inline int nq_bucket(int nq, int D) {
    const int cap = D == 256 ? 8 : 16;
    int b = 1;
    while (b < nq && b < cap) {
        b *= 2;
    }
    return b;
}

static inline decode_plan plan_decode(const decode_shape & s) {
    decode_plan pl = {};
    auto mma_takes = [&](int nqb) { return s.mma_types && nqb <= OSCAR_MMA_MAX_QUERIES; };

    // Queries per block. Where the tensor-core kernel takes the types, a step with more queries
    // than its OSCAR_MMA_MAX_QUERIES (several sequences, or a speculative batch) gets more groups of blocks, each
    // reading the cache again, rather than the CUDA-core kernel, which costs far more per row
    // than the reads save.
    int nqb = nq_bucket(s.gqa*s.n_q, s.D);
    if (nqb > OSCAR_MMA_MAX_QUERIES && s.gqa <= OSCAR_MMA_MAX_QUERIES && s.mma_arch && mma_takes(OSCAR_MMA_MAX_QUERIES)) {
        nqb = OSCAR_MMA_MAX_QUERIES;
    }
    // ... and, with the tokens of several sequences (in one stream), a block holds the tokens of
    // one sequence where that still leaves it 4 queries or more: each cache chunk is then read by
    // the one group whose queries all see it, not by a group of two sequences whose queries of the
    // other sequence are masked there (a block of 4 queries also takes twice the rows per product,
    // attn-mma.cu's packed layout)
    if (s.n_q > 1 && s.seq_tokens > 0 && s.mask && s.mma_arch) {
        const int nqb_seq = nq_bucket(s.gqa*s.seq_tokens, s.D);
        if (nqb_seq >= 4 && nqb_seq < nqb && mma_takes(nqb_seq)) {
            nqb = nqb_seq;
        }
    }
    pl.nqb = nqb;
    pl.tokens_per_block = std::max(1, nqb/s.gqa);
    pl.n_groups = (s.n_q + pl.tokens_per_block - 1)/pl.tokens_per_block;

    // splits. The INT2 kernels run a fixed number of blocks per SM and each block walks its rows
    // in a dependent chain, so the cache gets exactly one full wave of blocks: a second, partly
    // empty wave costs as much as the first. The other kernels keep about 4 blocks per SM, in
    // splits of at least 128 rows. (How rows are split changes only the order of float sums.
    // Greedy text against the CPU is no test of that on the small models we can carry: it parts
    // even with an f16 cache; see gpu/run.sh e2e.)
    const int base = s.n_head_kv*s.n_streams*pl.n_groups;
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
        const int n_max = std::min(8*n_split, std::max(1, n_rows/pl.n_groups/OSCAR_WAVE_MIN_ROWS));
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
    pl.mma = s.mma_arch && mma_takes(nqb);
    // several query tokens (sequences of a unified cache, or a speculative batch): each group of
    // blocks takes only the cache chunks its tokens see, and the window chunks (attn-live.cu)
    pl.lists = pl.mma && s.mask && s.n_q > 1;
    // ... and one token in each of several streams (one stream per sequence): lists of the
    // window's live chunks alone. Its cache rows are all its own, and a cache split walking its
    // rows in order reads them faster than by list (41 streams of 16384 rows: 10% faster).
    pl.win_lists = pl.mma && s.mask && s.n_win > 0 && (pl.lists || s.n_streams > 1);
    if (pl.mma) {
        // one launch: the cache's splits fill one full wave of OSCAR_MMA_BLOCKS_PER_SM blocks per
        // SM (or several, split_waves), and the first blocks also take a chunk of the window each
        // (see k_fa_int2_mma), or with fewer cache splits than window chunks (small depths, many
        // streams) the window's chunks are blocks of their own, after the cache's (attn-mma.cu).
        // A chunk is one 32-row step of each warp (fa_window_rows_f16): its rows cost about what
        // one step costs, so smaller chunks would only add partials. Most window rows are masked
        // (the view spans every slot a prefill's ubatch used, 832 rows after a 512-token ubatch,
        // of which sink + recent are live) and cost only their mask.
        split(s.n_rows, 128, OSCAR_MMA_BLOCKS_PER_SM*s.n_sm, pl.ns_main, pl.rps_main);
        split_waves(s.n_rows, OSCAR_MMA_BLOCKS_PER_SM*s.n_sm, pl.ns_main, pl.rps_main);
        if (pl.win_lists) {
            // each cache split also takes its share of its group's live window chunks. Why not
            // chunks of the window's rows: a unified cache's window holds every sequence's sink
            // and recent rows, so a group's rows (its sequences' 320 or so) sat in one or two
            // chunks, whose blocks ended last, and the other chunks were read for their mask
            // alone (8 sequences of 16384: 3072 rows, 6 chunks a group, 11 us a layer more than
            // with one stream per sequence). With one stream per sequence a stream has few cache
            // splits (on an H100: 3 at 64 streams of 4096 rows, 6 at 8 or 41 of 16384), and
            // the window view 7 chunks of 128 rows, the live ones (sink and recent) in the first
            // 3: with as many chunks as splits those 3 blocks end last, and with more, the chunks
            // are blocks of their own after the cache's, mostly masked (64 x 4096: 8.5% slower).
            pl.ns_win = pl.ns_main;
        } else if (s.n_win > 0) {
            // without lists, one group (one sequence) takes chunks of one step: larger ones, taken
            // by a few of the cache's splits, leave those splits' rows to the others, whose blocks
            // then end last. Several groups with no mask take every chunk each, and the partials,
            // which the combine reads back, grow with groups x chunks: the chunks then grow to
            // fill one wave of blocks, up to OSCAR_WIN_MAX_ROWS.
            const int one = OSCAR_FA_WARPS*OSCAR_LIVE_ROWS;
            const int fit = pl.n_groups > 1 ? std::max(1, OSCAR_MMA_BLOCKS_PER_SM*s.n_sm/base) : INT_MAX;
            pl.ns_win  = std::max((s.n_win + OSCAR_WIN_MAX_ROWS - 1)/OSCAR_WIN_MAX_ROWS, std::min((s.n_win + one - 1)/one, fit));
            pl.rps_win = ((s.n_win + pl.ns_win - 1)/pl.ns_win + one - 1)/one*one;
            pl.ns_win  = (s.n_win + pl.rps_win - 1)/pl.rps_win;
        }
        pl.rps_lite = pl.rps_main;
        if (s.n_win > 0 && pl.ns_win < pl.ns_main) {
            // the splits that take a window chunk first get OSCAR_WIN_LITE_ROWS fewer cache rows,
            // and the others share them, so that every block ends together. A live chunk costs
            // about four 128-row steps of the cache in the model's decode, where its rows and code
            // come cold; with two steps' worth (256 rows, as a warm benchmark loop suggests) the
            // chunk's blocks end last and the whole decode is slower.
            pl.rps_lite = std::max(0, pl.rps_main - OSCAR_WIN_LITE_ROWS)/OSCAR_FA_WARPS*OSCAR_FA_WARPS;
            const int rest = std::max(0, s.n_rows - pl.ns_win*pl.rps_lite);
            pl.rps_main = ((rest + (pl.ns_main - pl.ns_win) - 1)/(pl.ns_main - pl.ns_win) + OSCAR_FA_WARPS - 1)/OSCAR_FA_WARPS*OSCAR_FA_WARPS;
        }
    } else {
        const bool int2 = s.int2_types && nqb <= OSCAR_INT2_MAX_QUERIES;
        split(s.n_rows, 128, int2 ? OSCAR_INT2_BLOCKS_PER_SM*s.n_sm : 4*s.n_sm + base - 1,
              pl.ns_main, pl.rps_main);
        if (s.n_win > 0) {
            split(s.n_win, 128, 4*s.n_sm + base - 1, pl.ns_win, pl.rps_win);
        }
    }
    return pl;
}
