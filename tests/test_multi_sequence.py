"""Several sequences decoded together give each sequence what it gets decoded alone (CPU).

B = 4 sequences with different prompts (slices of the held-out text, of one length) go through
one context, every step a batch of all four: the prompts together, then a speculative-style step
of SPEC tokens per sequence, then single-token steps. Each sequence's logits are compared with
the same sequence decoded alone, fed the same tokens, in both cache layouts. oscar2 K/V with a
small window (sink 4, recent 8) leaves most of every prompt in INT2.

The references and bounds:
- One stream per sequence: each sequence's cells are those it has alone (the prompts have one
  length, so the prefill's ubatch splits them alike), and an f16 cache gives bit-identical
  logits. oscar2 keeps them identical too until rows leave the window, where the window's slots
  differ from the alone run's and the sums' order with them: within the README's 3% for layout
  differences (Limits), and the greedy tokens identical.
- A unified cache: a sequence's tokens land in other cells than alone, and the order of the
  attention's sums moves its logits even with an f16 cache (README, Limits). The same comparison
  with f16 measures that on this very setup; oscar2's difference must be of its order: its mean
  over the sequences' steps at most UNIFIED_FACTOR times f16's, the same order of magnitude.
  (Measured: mean f16 2.1%, oscar2 11%: every INT2 code that such a perturbation moves across a
  threshold moves a value by a whole step, so oscar2 amplifies it. The largest single step is a
  tail of that noise, 25-35% for oscar2 with float sums of one order or another, so the bound
  is on the mean.)
  Greedy tokens are not compared here: the same layout noise flips the low-margin steps with f16.
"""
from __future__ import annotations

import numpy as np
import pytest

from oscar_gguf.llama_context import Context, Model
from oscar_gguf.measure.texts import EVAL_TEXT

B = 4
WINDOW = dict(oscar_sink=4, oscar_recent=8)
SPEC = 4      # tokens per sequence in the speculative-style step
N_GREEDY = 4  # single-token steps after it


@pytest.fixture(scope="module")
def model(bundled_model):
    # (the bundled GGUF has no rotations: oscar2 runs on the built-in Hadamard one, which changes
    # nothing here and spares a conversion)
    return bundled_model


@pytest.fixture(scope="module")
def prompts(bundled_model):
    """B prompts of one length from different parts of the held-out text, each followed by
    the SPEC tokens of its speculative step."""
    text = EVAL_TEXT.read_text(encoding="utf-8")
    with Model(bundled_model) as m:
        toks = m.tokenize(text[:20000])
    out = []
    for s in range(B):
        start, n = 1 + 900*s, 48
        out.append((toks[:1] + toks[start:start + n], toks[start + n:start + n + SPEC]))
    return out


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def alone(m, prompt, spec, **kv):
    """One sequence in a context of its own: its logits after the prompt, at each token of the
    speculative step, and at each greedy step, and its greedy tokens."""
    with Context(m, n_ctx=256, **kv) as c:
        logits = [c.decode(prompt)]
        logits += list(c.decode(spec, len(prompt), logits="all"))
        toks, pos = [], len(prompt) + len(spec)
        for _ in range(N_GREEDY):
            toks.append(int(np.argmax(logits[-1])))
            logits.append(c.decode(toks[-1:], pos))
            pos += 1
    return np.stack(logits), toks


def together(m, prompts, fed, unified, **kv):
    """All sequences in one context, every step one batch of all of them; the greedy steps are fed
    the tokens of each sequence's alone run (fed), so that the logits compare step by step, and
    the tokens greedy decoding would choose here are returned too."""
    with Context(m, n_ctx=256*B, n_seq_max=B, kv_unified=unified, **kv) as c:
        first = c.decode_multi([(s, p, 0) for s, (p, _) in enumerate(prompts)])
        logits = {s: [first[s]] for s in range(B)}
        spec = c.decode_multi([(s, sp, len(p)) for s, (p, sp) in enumerate(prompts)], logits="all")
        for s in range(B):
            logits[s] += list(spec[s])
        chosen = {s: [] for s in range(B)}
        for i in range(N_GREEDY):
            for s in range(B):
                chosen[s].append(int(np.argmax(logits[s][-1])))
            step = c.decode_multi([(s, [fed[s][i]], len(p) + SPEC + i) for s, (p, _) in enumerate(prompts)])
            for s in range(B):
                logits[s].append(step[s])
    return {s: np.stack(v) for s, v in logits.items()}, chosen


UNIFIED_FACTOR = 10
README_LAYOUT_TOL = 0.03  # README, Limits: layout differences move the logits by 1.5-3%
TYPES = {"f16": {}, "oscar2": dict(type_k="oscar2", type_v="oscar2", **WINDOW)}


@pytest.fixture(scope="module")
def runs(model, prompts):
    """Per cache type: every sequence alone, and all of them together in each layout."""
    out = {}
    with Model(model) as m:
        for name, kv in TYPES.items():
            ref = [alone(m, p, sp, **kv) for p, sp in prompts]
            fed = [toks for _, toks in ref]
            out[name] = dict(alone=ref, **{layout: together(m, prompts, fed, layout == "unified", **kv)
                                           for layout in ("unified", "streams")})
    return out


def max_rel(run, layout):
    got, _ = run[layout]
    return max(rel(got[s], run["alone"][s][0]) for s in range(B))


def test_one_stream_per_sequence_matches_alone(runs):
    f16, o2 = runs["f16"], runs["oscar2"]
    for s in range(B):
        assert np.array_equal(f16["streams"][0][s], f16["alone"][s][0]), s
    assert max_rel(o2, "streams") <= README_LAYOUT_TOL
    for run in (f16, o2):
        assert all(run["streams"][1][s] == run["alone"][s][1] for s in range(B))


def mean_rel(run, layout):
    got, _ = run[layout]
    return float(np.mean([rel(got[s][i], run["alone"][s][0][i]) for s in range(B) for i in range(len(got[s]))]))


def test_unified_cache_matches_alone_as_closely_as_f16(runs):
    d_f16, d_o2 = mean_rel(runs["f16"], "unified"), mean_rel(runs["oscar2"], "unified")
    assert d_f16 > 0  # the layout does move f16's logits here, so the bound below is not zero
    assert d_o2 <= UNIFIED_FACTOR*d_f16, (d_o2, d_f16)


# A unified step's mask, built for several sequences at once, against the same tokens sent one
# sequence per call. Both contexts hold the same cells (the same calls before the step, the step's
# tokens placed in the same order), so every token sees the same cells in the same order, and its
# logits must be bit-identical: llama.cpp builds the mask of the sequences with a few tokens in a
# step cell by cell, and of a lone sequence (each call below) row by row. Sequence 3's 20 tokens take
# the row-by-row build in the step too, and come last: the batch's rows after such a run go through
# other tiles of the weights' matrix products than alone, which moves their logits whatever the mask.
STEP = [(0, 1), (1, 1), (2, SPEC), (4, 1), (3, 20)]  # (sequence, tokens)


def step_two_ways(m, prompts, **kv):
    """The logits of STEP's tokens sent in one batch and sent one sequence per call, in two
    contexts with the same history: sequences 0-3 and 5 have prompts, and 4 shares 0's cells
    (after it shared 1's and left them: a cell's one sequence goes from several back to one)."""
    toks = [p + sp + p for p, sp in prompts]  # enough tokens for sequence 3's 20
    parts = [(s, toks[s % B][len(prompts[s % B][0]):][:n], len(prompts[s % B][0])) for s, n in STEP]
    out = []
    for one_batch in (True, False):
        with Context(m, n_ctx=256*B, n_seq_max=6, kv_unified=True, **kv) as c:
            c.decode_multi([(s, p, 0) for s, (p, _) in enumerate(prompts)])
            c.seq_cp(1, 4)
            c.seq_rm(4)
            c.seq_cp(0, 4)
            c.decode_multi([(5, prompts[0][0][::-1], 0)])  # idle in the step: its cells are hidden
            if one_batch:
                out.append(c.decode_multi(parts, logits="all"))
            else:
                out.append({s: c.decode_multi([(s, t, p0)], logits="all")[s] for s, t, p0 in parts})
    return out


@pytest.mark.parametrize("name", TYPES)
def test_unified_step_masks_many_sequences_as_one_at_a_time(model, prompts, name):
    with Model(model) as m:
        together_, one_by_one = step_two_ways(m, prompts, **TYPES[name])
    for s, n in STEP:
        assert together_[s].shape[0] == n
        assert np.array_equal(together_[s], one_by_one[s]), (name, s)
