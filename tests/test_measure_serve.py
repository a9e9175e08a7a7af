"""Issue 29: `oscar bench --serve` (llama-server per KV type under concurrent streaming clients)."""
from __future__ import annotations

import json

import pytest

from oscar_gguf.measure.cli import main as cli
from oscar_gguf.measure.serve import _Prompts, server_error_line
from oscar_gguf.measure.serve_client import ClientError, ClientRun, percentile, round_stats

TYPES = ("f16", "q8_0", "q4_0", "oscar2")
CLIENTS, PROMPT, GEN = 2, 64, 8


def test_percentile_and_round_figures():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    assert percentile(range(101), 99) == 99
    # two clients sent at 0 s; the first streams every 100 ms, the second every 200 ms
    a = ClientRun(0, 10, t_send=0.0, token_times=[1.0, 1.1, 1.2, 1.3])
    b = ClientRun(1, 10, t_send=0.0, token_times=[1.05, 1.25, 1.45, 1.65])
    s = round_stats([a, b], 4)
    assert s.decode_tokens_per_s == pytest.approx(6 / 0.65)  # 3 + 3 tokens after the first ones
    assert (s.ttft_p50_ms, s.ttft_max_ms, s.wall_ms) == pytest.approx((1025, 1050, 1650))
    assert (s.itl_p50_ms, s.itl_p99_ms) == pytest.approx((150, 200))
    assert s.client_tokens == [4, 4]
    with pytest.raises(ClientError, match="client 1 received 4 of 5"):
        round_stats([ClientRun(0, 10, 0.0, [1, 2, 3, 4, 5]), b], 5)


def test_prompts_are_whole_and_start_apart():
    p = _Prompts(longest=40, total=6)
    p.use(list(range(100)))
    slices = p.take(4, 40) + p.take(2, 3)
    assert [len(s) for s in slices] == [40, 40, 40, 40, 3, 3]
    assert len({s[0] for s in slices}) == 6  # no two share a prefix
    p = _Prompts(longest=8, total=4)
    p.use(list(range(5)))  # shorter than one prompt: repeated until every slice fits
    slices = p.take(2, 8) + p.take(2, 3)
    assert [len(s) for s in slices] == [8, 8, 3, 3] and len({s[0] for s in slices}) == 4
    with pytest.raises(ValueError, match="fewer than"):
        _Prompts(longest=8, total=6).use(list(range(5)))


def test_server_error_line_is_the_cause():
    log = ("0.00.011 I srv    load_model: loading model 'm.gguf'\n"
           "0.00.234 E llama_init_from_model: failed to initialize the context: oscar: window too large\n"
           "0.00.402 E srv  llama_server: exiting due to model loading error\n")
    assert server_error_line(log) == "llama_init_from_model: failed to initialize the context: oscar: window too large"
    assert server_error_line("0.00.011 I srv  all fine\n") == ""


@pytest.fixture(scope="module")
def served(bundled_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "out"
    # a small window in a 256-token context, so that most of the prompt is read from INT2
    code = cli(["bench", str(bundled_model), "--serve", "--types", ",".join(TYPES), "-np", str(CLIENTS),
                "--prompt-tokens", str(PROMPT), "--gen-tokens", str(GEN), "-t", "1", "-ngl", "0", "--no-progress",
                "--oscar-args", "--oscar-sink 4 --oscar-recent 16", "-o", str(out)])
    return code, out


def test_serve_on_the_bundled_model(served, capsys):
    code, out = served
    assert code == 0
    data = json.loads((out / "serve.json").read_text())
    rows = data["rows"]
    assert {(r["kv_type"], r["slots"], r["clients"]) for r in rows} == {
        (t, slots, CLIENTS) for t in TYPES for slots in (f"-np {CLIENTS}", "default")}
    for r in rows:
        assert r["client_tokens"] == [GEN] * CLIENTS, r
        assert r["decode_tokens_per_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_max_ms"] <= r["wall_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        # the layout as the server itself logged it
        if r["slots"] == "default":
            assert (r["n_slots"], r["kv_unified"]) == (4, True)
        else:
            assert (r["n_slots"], r["kv_unified"]) == (CLIENTS, False)
        f16 = next(b for b in rows if b["kv_type"] == "f16" and b["slots"] == r["slots"])
        assert r["ratio_vs_f16"] == pytest.approx(r["decode_tokens_per_s"] / f16["decode_tokens_per_s"])
    assert data["meta"]["prompt_tokens"] == PROMPT and data["meta"]["ctx_per_slot"] == 256
    md = (out / "serve.md").read_text()
    assert "| slots | KV cache | clients | KV type | decode t/s |" in md and md.count("| oscar2 |") == 2
    assert "unified" in (out / "serve.txt").read_text()


def test_serve_bad_input(bundled_model, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["bench", str(bundled_model), "--serve", "--types", "f16", "--prompt-tokens", "16", "--gen-tokens", "4",
            "-t", "1", "-ngl", "0", "--no-progress", "-o", str(out)]
    assert cli(["bench", str(tmp_path / "missing.gguf"), "--serve"]) == 2
    assert cli(base + ["-np", "0"]) == 2
    assert cli(base + ["-np", "2", "-p", "128"]) == 2          # a llama-bench option
    assert cli(["bench", str(bundled_model), "-np", "2"]) == 2  # a serving option without --serve
    assert cli(base + ["--llama-args=-c 512"]) == 2             # a flag the tool sets itself
    assert cli(base + ["--llama-args=--no-such-flag"]) == 2     # the server does not start
    errs = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(errs) == 6 and all(ln.startswith("oscar bench: error:") for ln in errs), errs
    assert "invalid argument: --no-such-flag" in errs[-1] and "serve-f16-np1.log" in errs[-1]
    assert not (out / "serve.json").exists()
