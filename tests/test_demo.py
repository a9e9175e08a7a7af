"""Issue 8: `oscar demo` end to end on the bundled model, in its CI size (--quick).

No mocks: calibration captures through the patched libllama, the evaluation runs the
patched llama-perplexity and the generation runs llama_cpp.Llama with an oscar2 cache.
One module-scoped run feeds the tests; a second run checks the cache.
"""
from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from oscar_gguf.cli import main as cli
from oscar_gguf.measure.settings import SETTINGS
from oscar_gguf.format.gguf_read import model_info


def _run(out: Path, *extra: str) -> tuple[int, float]:
    t0 = time.monotonic()
    rc = cli(["demo", "--quick", "--no-progress", "--out", str(out), *extra])
    return rc, time.monotonic() - t0


@pytest.fixture(scope="module")
def demo(tmp_path_factory, bundled_model):
    out = tmp_path_factory.mktemp("demo") / "oscar-demo"
    rc, seconds = _run(out)
    assert rc == 0, "oscar demo --quick failed"
    summary = json.loads((out / "demo.json").read_text())
    return {"out": out, "seconds": seconds, "summary": summary, "model": bundled_model}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_files_and_converted_gguf(demo):
    s = demo["summary"]
    rot = Path(s["calibration"]["artifact"])
    assert rot.is_file() and rot.parent.parent == demo["out"]
    gguf = Path(s["converted"])
    assert gguf.is_file() and gguf.parent == demo["out"]
    src, conv = model_info(demo["model"]), model_info(gguf)
    assert not src.has_rotations and conv.has_rotations
    assert (conv.n_layer, conv.head_dim_k) == (src.n_layer, src.head_dim_k)
    assert s["calibration"]["layers"] == src.n_layer and s["calibration"]["tokens"] >= 512
    ev = Path(s["eval"]["dir"])
    for name in ("eval.csv", "eval.json", "eval.md"):
        assert (ev / name).stat().st_size > 0
    w, h = png_size(ev / "eval.png")
    assert w > 100 and h > 100
    md = (demo["out"] / "demo.md").read_text()
    assert md.startswith("`oscar demo ") and "--quick" in md.split("`")[1]
    assert "OSCAR + window" in md and "128K" in md


def test_table_has_every_setting_with_finite_numbers(demo):
    rows = {r["key"]: r for r in demo["summary"]["eval"]["rows"]}
    assert list(rows) == [x.key for x in SETTINGS]
    for key, r in rows.items():
        assert r["status"] in ("ok", "reference"), f"{key}: {r['status']} {r['note']}"
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1, key
        assert math.isfinite(r["mean_kld"]) and r["mean_kld"] >= 0, key
        assert r["kv_mib"] and r["kv_mib"] > 0, key
    assert rows["f16"]["mean_kld"] == 0
    # real properties of the method, not just of the plumbing: 8-bit KV is nearly lossless,
    # and the calibrated rotations beat plain INT2 by far
    assert rows["q8_0"]["mean_kld"] < rows["oscar"]["mean_kld"] < rows["int2"]["mean_kld"]
    assert rows["oscar"]["mean_kld"] < 0.5 * rows["int2"]["mean_kld"]
    # the oscar2 cache is allocated smaller than q4_0 at the same context, window included
    assert rows["oscar-nowin"]["kv_mib"] < rows["q4_0"]["kv_mib"] < rows["f16"]["kv_mib"]


def test_the_claim_states_the_bits_it_cost(demo, capsys):
    """The demo compares OSCAR + window with q4_0 next to the bits per element each cost in the
    run: at the demo's short context the f16 window makes oscar2 cost more than q4_0."""
    from oscar_gguf.measure.demo import quality_claim
    from oscar_gguf.measure.eval_table import EvalRow, Table

    rows = [EvalRow(**r) for r in demo["summary"]["eval"]["rows"]]
    table = Table(rows=rows, meta=demo["summary"]["eval"]["meta"])
    claim = quality_claim(table)
    o, q = table.row("oscar"), table.row("q4_0")
    assert f"{o.bits_per_element:.2f} bits/elem" in claim and f"{q.bits_per_element:.2f} bits/elem" in claim
    assert o.bits_per_element > q.bits_per_element and "more bits" in claim
    assert abs(16 * o.kv_mib / table.row("f16").kv_mib - o.bits_per_element) < 0.01
    assert claim in (demo["out"] / "demo.md").read_text()


def test_kv_memory_at_long_context(demo):
    km = demo["summary"]["kv_memory"]
    info = model_info(demo["model"])
    assert 131072 in km["contexts"] and info.n_ctx_train in km["contexts"]
    at = {r["setting"]: r for r in km["rows"] if r["n_ctx"] == 131072}
    f16 = info.n_layer * info.n_head_kv * (info.head_dim_k + info.head_dim_v) * 2 * 131072
    assert at["f16"]["bytes"] == f16
    assert at["q4_0"]["bytes"] == f16 * 18 // 64             # 18 B per 32 elements
    # oscar2: 20 B per 64 elements at head_dim 64 (36 B per 128 from head_dim 128 on)
    per = 20 / 64 if info.head_dim_k % 128 else 36 / 128
    assert at["oscar2 (INT2 only)"]["bytes"] == f16 / 2 * per
    ratio = at["oscar2 + f16 window"]["vs_f16"]
    assert at["oscar2 + f16 window"]["window_bytes"] > 0
    # about 7x less than f16: 2.5 bits + window at head_dim 64 gives 6.3x, 2.25 bits gives 7.0x
    assert 6.0 < ratio < 16 / (8 * per), ratio
    # the formula matches what llama.cpp allocated during the evaluation
    checks = {c["setting"]: c for c in km["checks"]}
    assert set(checks) == {"f16", "q4_0", "OSCAR + window"}
    for c in checks.values():
        assert c["rel_diff"] < 0.02, c


def test_generation_is_text(demo):
    g = demo["summary"]["generation"]
    conv = model_info(Path(demo["summary"]["converted"]))
    # longer than the converted model's f16 window, so that INT2 rows are read
    assert g["prompt_tokens"] > conv.window_sink + conv.window_recent, g["prompt_tokens"]
    for kv in ("oscar2", "f16"):
        assert 0 < len(g[kv + "_tokens"]) <= g["n_gen"], kv
        assert any(c.isalpha() for c in g[kv]), kv
    # the reported agreement with f16 KV is the two generations' common prefix
    common = 0
    while common < min(len(g["oscar2_tokens"]), len(g["f16_tokens"])) and \
            g["oscar2_tokens"][common] == g["f16_tokens"][common]:
        common += 1
    assert g["same_prefix"] == common


def test_second_run_reuses_the_cache(demo, capsys):
    out = demo["out"]
    rot = Path(demo["summary"]["calibration"]["artifact"])
    mtime = rot.stat().st_mtime_ns
    capsys.readouterr()
    rc, seconds = _run(out)
    text = capsys.readouterr().out
    assert rc == 0
    assert text.count("(cached)") >= 4, text
    assert rot.stat().st_mtime_ns == mtime
    assert seconds < max(20.0, demo["seconds"] / 4), (seconds, demo["seconds"])
    again = json.loads((out / "demo.json").read_text())
    assert again["eval"]["rows"] == demo["summary"]["eval"]["rows"]
    assert again["generation"]["oscar2"] == demo["summary"]["generation"]["oscar2"]
