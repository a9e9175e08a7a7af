"""Issue 6: the high-precision sink + recent window (CPU).

Like test_rotations.py, the exact comparisons read layer 0's attention output (after the V
rotation is undone) through the eval callback; the kernel-level store split is tested on hand-made
data in test_oscar2_cpu.py::test_cpu_flash_attention_store_split.
"""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from gguf_fixtures import PROMPT, with_rotations
from oscar_gguf.format.gguf_read import model_info
from oscar_gguf.llama_context import Context, LlamaError, Model
from oscar_gguf.measure.kv_memory import padded_window_rows, window_rows
from oscar_gguf.runtime import LlamaServer, run_tool

ATTN0 = "kqv_out_unrot-0"
ATTN0_F16 = "kqv_out-0"  # an f16 cache is not rotated: its output has no un-rotation node
CAPTURE = [ATTN0, ATTN0_F16]
OSCAR = dict(type_k="oscar2", type_v="oscar2")


@pytest.fixture(scope="module")
def model(bundled_model, tmp_path_factory):
    return with_rotations(bundled_model, tmp_path_factory.mktemp("win") / "random.gguf", "random")


@pytest.fixture(scope="module")
def tokens(bundled_model):
    with Model(bundled_model) as m:
        return m.tokenize(PROMPT * 8)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def last_attn(ctx) -> np.ndarray:
    name = ATTN0 if ctx.captured.get(ATTN0) else ATTN0_F16
    return ctx.captured[name][-1][..., -1, :].reshape(-1)


def test_window_covering_the_whole_context_equals_f16(model, tokens):
    toks = tokens[:100]
    with Model(model) as m:
        with Context(m, n_ctx=256, capture=CAPTURE) as c:
            c.decode(toks)
            f16 = last_attn(c)
        with Context(m, n_ctx=256, capture=CAPTURE, oscar_sink=16, oscar_recent=100, **OSCAR) as c:
            c.decode(toks)
            win = last_attn(c)
        with Context(m, n_ctx=256, capture=CAPTURE, oscar_sink=0, oscar_recent=0, **OSCAR) as c:
            c.decode(toks)
            int2 = last_attn(c)
    assert rel(win, f16) < 2e-3          # f16 window rows vs f16 cache: the same values
    assert rel(int2, f16) > 0.05         # and the INT2 cache alone is clearly different


def test_prefill_larger_than_the_window_in_one_or_many_ubatches(model, tokens):
    """After the same tokens the cache holds the same INT2 rows and the same window, whatever the
    ubatch size, so the next token attends identically."""
    toks = tokens[:150]
    outs = []
    for n_ubatch in (512, 32):
        with Model(model) as m, Context(m, n_ctx=512, n_batch=512, n_ubatch=n_ubatch, capture=CAPTURE,
                                        oscar_sink=4, oscar_recent=24, **OSCAR) as c:
            c.decode(toks)
            c.decode(tokens[150:151], 150)
            outs.append(last_attn(c))
    assert rel(outs[0], outs[1]) < 1e-4


def all_attn(ctx) -> np.ndarray:
    """Layer 0's attention output of every token decoded so far, [n_tokens, n_embd]."""
    return np.concatenate([a.reshape(-1, a.shape[-2], a.shape[-1])[0] for a in ctx.captured[ATTN0]])


def test_every_prompt_token_attends_the_same_in_any_ubatch_split(model, tokens):
    """The window is the query's own (the sink and the R positions up to it), so every token of a
    prompt longer than the window reads the same stores whether the prompt comes in one ubatch,
    in small ones, or one token at a time (a per-sequence window would read a mid-prompt
    query's recent positions from INT2 in a big ubatch and from f16 in a small one)."""
    toks = tokens[:120]
    outs = {}
    for n_ubatch in (512, 16, 1):
        with Model(model) as m, Context(m, n_ctx=256, n_batch=512, n_ubatch=n_ubatch, capture=CAPTURE,
                                        oscar_sink=4, oscar_recent=24, **OSCAR) as c:
            if n_ubatch == 1:
                for i, t in enumerate(toks):
                    c.decode([t], i)
            else:
                c.decode(toks)
            outs[n_ubatch] = all_attn(c)
    assert outs[512].shape == outs[1].shape == (120, outs[512].shape[1])
    assert rel(outs[16], outs[512]) < 1e-4
    assert rel(outs[1], outs[512]) < 1e-4


def test_sequences_give_the_same_results_as_alone(model, tokens):
    lens = {0: 40, 1: 90, 2: 25}
    win = dict(oscar_sink=4, oscar_recent=16, **OSCAR)
    alone = {}
    with Model(model) as m:
        for s, n in lens.items():
            if s == 1:
                continue
            with Context(m, n_ctx=256, capture=CAPTURE, **win) as c:
                c.decode(tokens[:n])
                c.decode([tokens[n]], n)
                c.decode([tokens[n + 1]], n + 1)
                alone[s] = last_attn(c)
        for unified in (True, False):
            with Context(m, n_ctx=768, n_seq_max=3, kv_unified=unified, capture=CAPTURE, **win) as c:
                # seq 2 starts at a different offset of the text so that the sequences differ
                c.decode_multi([(s, tokens[:n], 0) for s, n in lens.items()])
                assert c.seq_rm(1, -1, -1)  # drop a whole sequence in the middle
                for step in range(2):
                    for s in (0, 2):
                        c.decode([tokens[lens[s] + step]], lens[s] + step, seq=s)
                        if step == 1:
                            assert rel(last_attn(c), alone[s]) < 1e-4, (unified, s)


def test_seq_cp_keep_add_div(model, tokens):
    win = dict(oscar_sink=4, oscar_recent=16, **OSCAR)
    with Model(model) as m:
        with Context(m, n_ctx=256, capture=CAPTURE, **win) as c:
            c.decode(tokens[:50])
            c.decode([tokens[60]], 50)
            ref = last_attn(c)
        with Context(m, n_ctx=512, n_seq_max=2, capture=CAPTURE, **win) as c:
            c.decode(tokens[:50])
            c.seq_cp(0, 1)           # shared prefix
            c.decode([tokens[55]], 50, seq=0)
            c.decode([tokens[60]], 50, seq=1)
            assert rel(last_attn(c), ref) < 1e-4
            c.seq_keep(1)
            assert c.seq_pos_max(0) == -1
            c.seq_add(1, 10, -1, 5)   # positions 10.. move by +5 (K shift, window keys too)
            c.seq_div(1, 0, 10, 2)
            lg = c.decode([tokens[61]], 56, seq=1)
            assert np.all(np.isfinite(lg))


def test_window_rows_follow_the_running_sequences_not_the_pool(model, tokens):
    """A unified cache sized for 32 sequences keeps 32 x (S + R) + n_ubatch slots (928 here). With one
    sequence running, retired rows beyond the spare (one ubatch) are reused before the rows in use
    grow: in the last 100 of 400 tokens attention reads at most the rows in use (S + R + one
    ubatch) plus the spare of retired ones, padded (padded_window_rows), where keeping every retired row
    would have raised them to about 400. A pool for one sequence has S + R + one ubatch slots in
    all. The output is what that pool gives."""
    view = "oscar_window_k_l0 (view)"
    win = dict(oscar_sink=4, oscar_recent=24, n_ubatch=32, **OSCAR)
    outs, rows = [], []
    with Model(model) as m:
        for n_seq in (1, 32):
            with Context(m, n_ctx=2048, n_seq_max=n_seq, kv_unified=True, capture=[view, ATTN0], **win) as c:
                c.decode(tokens[:80])
                for i, t in enumerate(tokens[80:400]):
                    c.decode([t], 80 + i)
                # the attention's view [n_stream, n_head_kv, rows, head_dim] (not the store's 2-D one)
                rows.append(max(a.shape[-2] for a in c.captured[view][-200:] if a.shape[-3] == 3))
                outs.append(last_attn(c))
    assert rows[0] == padded_window_rows(4 + 24 + 32) and rows[1] <= padded_window_rows(4 + 24 + 2 * 32)
    assert rel(outs[1], outs[0]) < 1e-4


def test_truncating_a_sequence_continues_exactly_or_is_refused(model, tokens):
    """A caller that truncates a sequence (a prompt cache, a regenerate) continues from an earlier
    position, whose window reaches back to tokens that had left the recent window. Their rows are
    retired, not dropped, so a continuation soon after reads exactly what a fresh run reads. Once
    the pool has reused them, seq_rm refuses (removing nothing) instead of letting the
    continuation read them from INT2; removing the whole sequence always works."""
    win = dict(oscar_sink=4, oscar_recent=24, n_ubatch=32, **OSCAR)  # 4 + 24 + 32 slots: 32 spare
    prompt, p = tokens[:80], 80
    with Model(model) as m:
        with Context(m, n_ctx=256, capture=CAPTURE, **win) as c:
            fresh_logits = c.decode(prompt)
            fresh = last_attn(c)
        for n_gen, exact in ((6, True), (120, False)):
            with Context(m, n_ctx=256, capture=CAPTURE, **win) as c:
                c.decode(prompt)
                for i, t in enumerate(tokens[p:p + n_gen]):
                    c.decode([t], p + i)
                assert c.seq_rm(0, p - 1, -1) is exact, n_gen
                if not exact:
                    assert c.seq_pos_max(0) == p + n_gen - 1   # refused: nothing was removed
                    assert c.seq_rm(0, -1, -1)
                    lg = c.decode(prompt)
                else:
                    lg = c.decode(prompt[-1:], p - 1)      # only the last prompt token again
                assert rel(last_attn(c), fresh) < 1e-4, n_gen
                assert int(np.argmax(lg)) == int(np.argmax(fresh_logits))
    # cuts inside a sequence (context shift) and no-op removals are not judged
    with Model(model) as m, Context(m, n_ctx=256, **win) as c:
        c.decode(prompt)
        for i, t in enumerate(tokens[p:p + 120]):
            c.decode([t], p + i)
        assert c.seq_rm(0, p + 120, -1)
        assert c.seq_rm(0, 10, 20)


def test_llama_prefix_reuse_is_exact_or_starts_over(model, tokens, capfd):
    """llama-cpp-python's Llama.generate reuses the longest cached prefix through seq_rm and starts
    over when seq_rm refuses: the same prompt after a short answer is reused, after a long one it
    is evaluated again, and both continue like a fresh Llama."""
    import llama_cpp

    kw = dict(n_ctx=256, n_batch=256, n_ubatch=32, type_k=llama_cpp.GGML_TYPE_OSCAR2, type_v=llama_cpp.GGML_TYPE_OSCAR2,
              flash_attn=True, oscar_sink=4, oscar_recent=24, n_threads=2, seed=1)
    prompt = tokens[:80]

    def greedy(llm, n):
        out = []
        for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(t))
            if len(out) == n:
                return out

    fresh = greedy(llama_cpp.Llama(str(model), verbose=False, **kw), 8)
    llm = llama_cpp.Llama(str(model), verbose=True, **kw)
    try:
        for n_first, reused in ((6, True), (120, False)):
            greedy(llm, n_first)
            capfd.readouterr()
            assert greedy(llm, 8) == fresh, n_first
            err = capfd.readouterr().err
            assert ("prefix-match hit" in err) is reused and ("re-evaluating full prompt" in err) is not reused, err[-500:]
    finally:
        llm.close()


def test_k_shift_moves_the_window_keys(model, tokens):
    """Context shift (seq_add) re-ropes the window's f16 keys with their cells. Half of a sequence
    moves by +17; with every position in the window, attention then matches an f16 cache shifted
    the same way (upstream's K shift), far closer than the unshifted cache does. (RoPE is
    relative, so only a partial shift is observable.)"""
    def attn(m, shift, **kw):
        with Context(m, n_ctx=256, capture=CAPTURE, **kw) as c:
            c.decode(tokens[:60])
            if shift:
                c.seq_add(0, 30, -1, 17)
            c.decode(tokens[60:61], 77 if shift else 60)
            return last_attn(c)
    win = dict(oscar_sink=4, oscar_recent=128, **OSCAR)
    with Model(model) as m:
        f16 = attn(m, True)
        shifted = attn(m, True, **win)
        unshifted = attn(m, False, **win)
    # measured: 3.4e-4 against 0.055
    assert rel(shifted, f16) < rel(unshifted, f16) / 20, (rel(shifted, f16), rel(unshifted, f16))


def test_session_save_and_restore_continue_identically(model, tokens):
    win = dict(oscar_sink=4, oscar_recent=16, **OSCAR)
    with Model(model) as m:
        with Context(m, n_ctx=256, **win) as c:
            c.decode(tokens[:60])
            state = c.state_get()
            cont = [c.decode([t], 60 + i) for i, t in enumerate(tokens[60:64])]
        with Context(m, n_ctx=256, **win) as c:
            assert c.state_set(state) == len(state)
            again = [c.decode([t], 60 + i) for i, t in enumerate(tokens[60:64])]
        for a, b in zip(cont, again):
            assert np.array_equal(a, b)
        # a context without the window cannot take the saved window: a clear refusal, not garbage
        with Context(m, n_ctx=256, oscar_sink=0, oscar_recent=0, **OSCAR) as c:
            assert c.state_set(state) == 0


def test_sequence_state_restores_beside_another_sequence(model, tokens):
    """A slot save (one sequence's state) taken while two sequences interleave their window slots,
    restored into a context where the slots free for it are scattered among another sequence's.
    The state's rows are written in slot order and copied by runs of consecutive slots, on both
    sides; every row must still land on its cell, and the other sequence must stay untouched."""
    win = dict(oscar_sink=4, oscar_recent=16, **OSCAR)

    def interleave(c, a, b, n_batch):
        # a and b = (seq, first token index): n_batch tokens each in one batch, then single
        # tokens up to 38 each, alternating, so that their window slots alternate too
        if n_batch:
            c.decode_multi([(s, tokens[t0:t0 + n_batch], 0) for s, t0 in (a, b)])
        for i in range(n_batch, 38):
            for s, t0 in (a, b):
                c.decode([tokens[t0 + i]], i, seq=s)

    def cont(c, s, t0, n=4):
        return [c.decode([tokens[t0 + 38 + i]], 38 + i, seq=s) for i in range(n)]

    with Model(model) as m:
        with Context(m, n_ctx=768, n_seq_max=3, kv_unified=True, **win) as c:
            interleave(c, (0, 0), (1, 100), 30)  # the saved rows: slots in a few runs
            state = c.seq_state_get(0)
            first = cont(c, 0, 0)
        with Context(m, n_ctx=768, n_seq_max=3, kv_unified=True, **win) as c:
            interleave(c, (1, 100), (2, 200), 0)
            assert c.seq_rm(2, -1, -1)  # its slots, every other one, are free for the restore
            assert c.seq_state_set(state, 0) == len(state)
            beside = cont(c, 1, 100, 1)
            again = cont(c, 0, 0)
        with Context(m, n_ctx=768, n_seq_max=3, kv_unified=True, **win) as c:
            interleave(c, (1, 100), (2, 200), 0)
            assert c.seq_rm(2, -1, -1)
            c.decode(tokens[:38], seq=0)  # seq 0 from scratch, in the same cells as the restore
            scratch = cont(c, 1, 100, 1)
    # (not bit-exact: with other sequences' cells the attention reads more cells, all masked for
    # this one, and the CPU kernel may then split its sums differently)
    for a, b in zip(first, again):
        assert rel(b, a) < 1e-4
    # the restore wrote none of seq 1's rows. The reference holds seq 0 in the same cells: without
    # it, seq 1's next token lands in another cell and the order of the sums alone moves its
    # logits by about 1% (see the next test)
    assert rel(beside[0], scratch[0]) < 1e-4


def test_restored_sequence_leaves_the_other_one_alone(model, tokens):
    """A sequence restored beside another one (the same positions, in the holes a removed third
    sequence left) and then decoded must leave the other's results exactly as the same sequence
    decoded there from scratch does. The reference is that, not the other sequence alone: alone,
    its new tokens land in other cells (the holes), and the order of the attention's sums over
    the cells then moves its logits by 1.5-3% here, with a plain f16 cache as well (the CPU
    kernel even accumulates f16 V in f16): a third sequence at far positions, which no query of it
    sees, moves them just as much."""
    win = dict(oscar_sink=4, oscar_recent=16, **OSCAR)

    def build(c, restore):
        for i in range(38):
            for s, t0 in ((1, 100), (2, 200)):
                c.decode([tokens[t0 + i]], i, seq=s)
        assert c.seq_rm(2, -1, -1)
        if restore:
            assert c.seq_state_set(restore, 0) == len(restore)
        else:
            c.decode(tokens[:38], seq=0)  # the same tokens in the same cells, from scratch
        for i in range(4):
            c.decode([tokens[38 + i]], 38 + i, seq=0)
        return [c.decode([tokens[138 + i]], 38 + i, seq=1) for i in range(4)]

    with Model(model) as m:
        with Context(m, n_ctx=768, n_seq_max=3, kv_unified=True, **win) as c:
            c.decode(tokens[:38], seq=0)
            state = c.seq_state_get(0)
        with Context(m, n_ctx=768, n_seq_max=3, kv_unified=True, **win) as c:
            beside = build(c, state)
        with Context(m, n_ctx=768, n_seq_max=3, kv_unified=True, **win) as c:
            fresh = build(c, None)
    for a, b in zip(fresh, beside):
        assert rel(b, a) < 1e-6


def test_window_settings_are_checked(model):
    with Model(model) as m:
        with pytest.raises(LlamaError):
            Context(m, n_ctx=256, oscar_sink=200, oscar_recent=200, **OSCAR)  # larger than the context


def test_window_memory_is_in_the_kv_log(model, n_threads):
    n_ctx, n_ubatch = 1024, 512
    r = run_tool("llama-cli", ["-m", model, "-p", "Hi", "-n", "1", "-c", n_ctx, "-ub", n_ubatch, "-ctk", "oscar2",
                               "-ctv", "oscar2", "-fa", "on", "-st", "-lv", "4", "-t", n_threads],
                 timeout=300, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    # the model's default window; S + R slots per sequence plus one ubatch (a prefill query reads
    # the R positions before it from f16 too), stored as rows padded to WINDOW_PAD plus one
    # trash row, per layer a K and a V row of n_head_kv x head_dim f16 values
    info = model_info(model)
    sink, recent = info.window_sink, info.window_recent
    slots = min(n_ctx, sink + recent + n_ubatch)
    rows = window_rows(sink + recent, n_ctx, n_ubatch)
    mib = rows * info.n_layer * info.n_head_kv * (info.head_dim_k + info.head_dim_v) * 2 / 2**20
    m = re.search(r"oscar window: sink (\d+) \+ recent (\d+) tokens per sequence in f16, (\d+) slots \((\d+) rows\) "
                  r"x 1 stream\(s\), ([0-9.]+) MiB", log)
    assert m, log[-2000:]
    assert tuple(map(int, m.groups()[:4])) == (sink, recent, slots, rows)
    assert float(m.group(5)) == pytest.approx(mib, abs=0.005)
    buffers = re.findall(r"oscar window buffer size =\s*([0-9.]+) MiB", log)
    assert buffers and sum(map(float, buffers)) == pytest.approx(mib, abs=0.01)


def test_compute_buffers_are_reserved_for_a_full_window(model, n_threads):
    """The graph reserved when the context is made must read every window row a later graph
    can: sized by the rows in use then (none), the buffers were reallocated each time a prefill
    filled the window further (20 ms of a 512-token ubatch at depth 16k for the pinned input
    buffer alone on an H100; gpu/run.sh test aborts on such a reallocation)."""
    def compute_mib(extra):
        r = run_tool("llama-cli", ["-m", model, "-p", "Hi", "-n", "1", "-c", "2048", "-ub", "512", "-ctk", "oscar2",
                                   "-ctv", "oscar2", "-fa", "on", "-st", "-lv", "4", "-t", n_threads, *extra],
                     timeout=300, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        sizes = re.findall(r"CPU compute buffer size =\s*([0-9.]+) MiB", r.stdout + r.stderr)
        assert sizes
        return float(sizes[-1])
    with_window = compute_mib([])
    without = compute_mib(["--oscar-sink", "0", "--oscar-recent", "0"])
    # the mask's window columns alone: 512 tokens x 832 rows (832 slots, padded) x f16
    assert with_window - without >= 0.99*512*832*2/2**20


PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "List three colors:", "Water boils at a temperature of"]


def test_server_parallel_requests_match_sequential(model, n_threads):
    args = ["-c", "2048", "-np", "4", "-ctk", "oscar2", "-ctv", "oscar2", "-fa", "on", "--oscar-sink", "8",
            "--oscar-recent", "32", "-t", n_threads, "--kv-unified"]
    body = lambda p: {"prompt": p, "n_predict": 24, "temperature": 0, "cache_prompt": False, "seed": 1}
    with LlamaServer(model, args) as srv:
        alone = [srv.post("/completion", body(p))["content"] for p in PROMPTS]
        together = [None] * len(PROMPTS)

        def ask(i):
            together[i] = srv.post("/completion", body(PROMPTS[i]))["content"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert all(isinstance(t, str) and t for t in together)
    assert together == alone
