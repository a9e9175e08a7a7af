"""Issue 8: `oscar bench` (llama-bench per KV type, ratios, plot) and the decode roofline."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from oscar_gguf.measure import bench
from oscar_gguf.measure.cli import main as cli
from oscar_gguf.format.gguf_read import ModelInfo, model_info
from oscar_gguf.measure.synth import write_synthetic

BENCH_JSON = """[
  {
    "build_commit": "abc", "model_type": "qwen3 ?B Q4_0", "n_prompt": 16, "n_gen": 0, "n_depth": 64,
    "type_k": "q4_0", "type_v": "q4_0", "avg_ts": 560.5, "stddev_ts": 3.5, "samples_ts": [557, 564]
  },
  {
    "build_commit": "abc", "model_type": "qwen3 ?B Q4_0", "n_prompt": 0, "n_gen": 4, "n_depth": 64,
    "type_k": "q4_0", "type_v": "q4_0", "avg_ts": 823.2, "stddev_ts": 1.0, "samples_ts": [822, 824]
  }
]
"""


def test_parse_llama_bench_json():
    rows = bench.rows_from_records(bench.parse_bench_json(BENCH_JSON), "q4_0")
    assert [(r.test, r.depth, r.tokens_per_s) for r in rows] == [("pp16", 64, 560.5), ("tg4", 64, 823.2)]
    with pytest.raises(ValueError):
        bench.parse_bench_json("llama_bench: error: failed to load model")


def _info(head_dim=128):
    return ModelInfo(path=Path("m.gguf"), arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                     head_dim_k=head_dim, head_dim_v=head_dim, n_ctx_train=4096, n_vocab=32000, file_size=1,
                     has_rotations=True, window_sink=64, window_recent=256)


def test_attention_bytes_per_token():
    info = _info(128)
    per_tok_f16 = 2 * 2 * (128 + 128) * 2  # layers * kv heads * (K + V) * bytes
    assert bench.kv_bytes_at_depth(info, "f16", 1000) == per_tok_f16 * 1000
    assert bench.kv_bytes_at_depth(info, "q4_0", 1000) == per_tok_f16 * 1000 * 4.5 / 16
    # oscar2: window tokens come from the f16 store, the rest at 2.25 bits
    assert bench.kv_bytes_at_depth(info, "oscar2", 1000, window=320) == pytest.approx(
        per_tok_f16 * (680 * 2.25 / 16 + 320))
    assert bench.kv_bytes_at_depth(_info(64), "oscar2", 1000, window=0) == pytest.approx(
        2 * 2 * 128 * 1000 * 2.5 / 8)
    rows = bench.roofline(info, ["f16", "oscar2"], [0, 1000], 100.0, weights_bytes=10_000_000, window=0)
    assert rows[0]["bound_tokens_per_s"] == pytest.approx(100e9 / 10_000_000)
    assert rows[1]["bound_tokens_per_s"] < rows[0]["bound_tokens_per_s"]
    assert rows[3]["bound_tokens_per_s"] > rows[1]["bound_tokens_per_s"]
    with pytest.raises(Exception):
        bench.roofline(info, ["f16"], [0], 0.0, weights_bytes=1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_synthetic("tiny-qwen3", "q4_0", tmp_path_factory.mktemp("bench") / "tiny-qwen3.gguf")


def test_bench_on_a_tiny_synth_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    # the runtime refuses a window larger than the context (here 84 tokens):
    # a small one, passed to the oscar2 runs only, keeps the window path in the test
    code = cli(["bench", str(tiny_model), "--types", "f16,q4_0,oscar2", "-d", "0,64", "-p", "16", "-n", "4",
                "-r", "1", "-t", "2", "-ngl", "0", "--bandwidth", "20", "--no-progress", "-o", str(out),
                "--oscar-args", "--oscar-sink 8 --oscar-recent 16"])
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"]
    assert {(r["kv_type"], r["test"], r["depth"]) for r in rows} == {
        (t, test, d) for t in ("f16", "q4_0", "oscar2") for test in ("pp16", "tg4") for d in (0, 64)}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["ratio_vs_f16"] == 1.0 for r in rows if r["kv_type"] == "f16")
    assert "tg4: tokens/s (ratio to f16)" in printed and "roofline" in printed
    assert len(data["roofline"]) == 6 and all(r["measured_tg"] for r in data["roofline"])
    assert "--oscar-sink 8" in (out / "logs" / "bench-oscar2.log").read_text()
    assert "--oscar-sink" not in (out / "logs" / "bench-q4_0.log").read_text()
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and min(struct.unpack(">II", png[16:24])) > 100
    assert (out / "bench.csv").read_text().startswith("kv_type,test,depth")


def test_bench_cli_errors_and_roofline_only(tiny_model, capsys):
    assert cli(["bench", str(tiny_model), "--roofline-only", "--bandwidth", "50", "-d", "0,1024"]) == 0
    assert "bound t/s" in capsys.readouterr().out
    assert cli(["bench", str(tiny_model), "--roofline-only"]) == 2
    assert cli(["bench", str(tiny_model), "--types", "f16,q3_x", "--no-progress"]) == 2
    assert cli(["bench", "/nonexistent.gguf", "--no-progress"]) == 2
    errs = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(errs) == 3 and all(ln.startswith("oscar bench: error:") for ln in errs), errs


def test_weights_read_per_token(tiny_model):
    info = model_info(tiny_model)
    wb = bench.weight_bytes_per_token(tiny_model)
    # tied embeddings: the output matrix is the embedding, read whole; a bit under the file
    assert 0.8 * info.file_size < wb < info.file_size


def test_bench_cpu_preset(tiny_model, tmp_path, capsys):
    # --cpu: attention on the CPU (-ngl 0) for the four KV types in one run, ratios to f16
    out = tmp_path / "out"
    code = cli(["bench", "--cpu", str(tiny_model), "-d", "0,64", "-p", "16", "-n", "4", "-r", "1", "-t", "2",
                "--no-progress", "-o", str(out), "--oscar-args", "--oscar-sink 8 --oscar-recent 16"])
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["ngl"] == 0 and data["meta"]["kv_types"] == list(bench.DEFAULT_TYPES)
    assert {(r["kv_type"], r["test"]) for r in data["rows"]} == {
        (t, test) for t in bench.DEFAULT_TYPES for test in ("pp16", "tg4")}
    assert all(r["ratio_vs_f16"] > 0 for r in data["rows"])
    assert "-ngl 0" in (out / "logs" / "bench-oscar2.log").read_text()
    assert "pp16: tokens/s (ratio to f16)" in printed
    assert cli(["bench", "--cpu", "--serve", str(tiny_model)]) == 2
    assert cli(["bench", "--no-progress"]) == 2
    errs = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(errs) == 2 and all(ln.startswith("oscar bench: error:") for ln in errs), errs


def test_bench_through_another_command(tiny_model, tmp_path):
    # tool=: llama-bench started by another command (benchmarks/arm_bench.py: qemu and an aarch64
    # build); here a launcher script that records its arguments and runs the installed llama-bench
    from oscar_gguf.paths import tool_path
    seen = tmp_path / "launched.txt"
    launcher = tmp_path / "launcher.sh"
    launcher.write_text(f'#!/bin/sh\necho "$@" >> "{seen}"\nexec "$@"\n')
    launcher.chmod(0o755)
    res = bench.run_bench(tiny_model, kv_types=["f16", "oscar2"], depths=[0], n_prompt=16, n_gen=4, ngl=0, reps=1,
                          n_threads=2, out_dir=tmp_path / "out", progress=False, plot=False,
                          oscar_args=["--oscar-sink", "8", "--oscar-recent", "16"],
                          tool=[str(launcher), str(tool_path("llama-bench"))], machine="a launcher")
    assert not res.notes
    assert {(r.kv_type, r.test) for r in res.rows} == {(t, x) for t in ("f16", "oscar2") for x in ("pp16", "tg4")}
    lines = seen.read_text().splitlines()
    assert len(lines) == 2 and all(ln.startswith(str(tool_path("llama-bench"))) for ln in lines)
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["meta"]["machine"] == "a launcher"


def test_median_of_rounds():
    def row(t, v):
        return bench.BenchRow(kv_type="oscar2", test=t, depth=0, n_prompt=0, n_gen=4, tokens_per_s=v, stddev=0.1)
    rounds = [[row("tg4", 10.0), row("pp16", 1.0)], [row("tg4", 30.0), row("pp16", 2.0)],
              [row("tg4", 11.0), row("pp16", 9.0)], [row("tg4", 12.0), row("pp16", 3.0)]]
    tg, pp = bench.median_of_rounds(rounds)
    assert (tg.test, tg.tokens_per_s, tg.rounds) == ("tg4", 11.5, "10.000;30.000;11.000;12.000")
    assert (pp.test, pp.tokens_per_s) == ("pp16", 2.5) and pp.stddev > 3
    assert bench.median_of_rounds(rounds[:1]) == rounds[0]


def test_bench_rounds_alternate_the_order(tiny_model, tmp_path):
    # rounds=3: every type once per round, the order reversed every other round; rows are medians
    from oscar_gguf.paths import tool_path
    seen = tmp_path / "launched.txt"
    launcher = tmp_path / "launcher.sh"
    launcher.write_text(f'#!/bin/sh\necho "$@" >> "{seen}"\nexec "$@"\n')
    launcher.chmod(0o755)
    out = tmp_path / "out"
    res = bench.run_bench(tiny_model, kv_types=["f16", "oscar2"], depths=[0], n_prompt=16, n_gen=4, ngl=0, reps=1,
                          n_threads=2, out_dir=out, progress=False, plot=False, rounds=3,
                          tool=[str(launcher), str(tool_path("llama-bench"))], machine="a launcher")
    assert not res.notes and res.meta["rounds"] == 3
    order = [ln.split("-ctk ")[1].split()[0] for ln in seen.read_text().splitlines()]
    assert order == ["f16", "oscar2", "oscar2", "f16", "f16", "oscar2"]
    for r in res.rows:
        vals = sorted(float(v) for v in r.rounds.split(";"))
        assert len(vals) == 3 and abs(r.tokens_per_s - vals[1]) < 1e-3 * vals[1]
    assert sorted(p.name for p in (out / "logs").iterdir()) == [
        f"bench-{t}-round{i}.log" for t in ("f16", "oscar2") for i in (1, 2, 3)]
    assert "rounds" in (out / "bench.csv").read_text().splitlines()[0]
    assert cli(["bench", "--serve", str(tiny_model), "--rounds", "2"]) == 2
