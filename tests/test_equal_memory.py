"""`oscar bench --equal-memory`: the sequences each KV type fits under one budget, as llama.cpp
allocates them, filled and decoded together by the real llama-batched-bench."""
import json
from pathlib import Path

import pytest

from oscar_gguf.cli import main as cli
from oscar_gguf.format.gguf_read import ModelInfo
from oscar_gguf.measure import equal_memory as eq


def _llama8b() -> ModelInfo:
    return ModelInfo(Path("x.gguf"), "llama", n_layer=32, n_head=32, n_head_kv=8, head_dim_k=128, head_dim_v=128)


def test_the_plan_counts_caches_and_window_stores():
    info = _llama8b()
    gib = 2**30
    # f16: 32 layers x 8 heads x (K + V) 256 bytes x 16384 cells = 2 GiB a sequence
    assert eq.kv_bytes_for(info, "f16", 16384, 1, 0, unified=False) == 2 * gib
    assert eq.max_sequences(info, "f16", 16 * gib, 16384, 0, unified=False) == 8
    # oscar2 (group 128: 36 bytes a row of K or V) with a 320-token window: per stream 320 + 512 slots,
    # padded to a multiple of 64 (832) plus one row; unified, one store of n x 320 + 512 slots
    per_tok = 32 * 8 * 2 * 36
    per_row_f16 = 32 * 8 * 2 * 256
    assert eq.kv_bytes_for(info, "oscar2", 16384, 3, 320, unified=False) == 3 * (per_tok * 16384 + per_row_f16 * 833)
    assert eq.kv_bytes_for(info, "oscar2", 16384, 3, 320, unified=True) == 3 * per_tok * 16384 + per_row_f16 * 1473
    n_split = eq.max_sequences(info, "oscar2", 16 * gib, 16384, 320, unified=False)
    n_unified = eq.max_sequences(info, "oscar2", 16 * gib, 16384, 320, unified=True)
    assert 8 * 4 < n_split < n_unified <= eq.LLAMA_MAX_SEQ
    assert eq.kv_bytes_for(info, "oscar2", 16384, n_unified + 1, 320, unified=True) > 16 * gib


def test_equal_memory_runs_and_matches_the_allocation(bundled_model, tmp_path):
    out = tmp_path / "eq"
    # a small window, so that at 512 tokens a sequence oscar2's f16 store does not dominate
    code = cli(["bench", str(bundled_model), "--equal-memory", "0.025", "--seq-ctx", "512", "--equal-gen", "4",
                "-t", "2", "--types", "f16,oscar2", "--oscar-args", "--oscar-sink 16 --oscar-recent 48",
                "-o", str(out), "--no-progress"])
    assert code == 0
    rows = json.loads((out / "equal_memory.json").read_text())["rows"]
    by = {(r["kv_type"], r["layout"]): r for r in rows}
    assert set(by) == {(t, x) for t in ("f16", "oscar2") for x in eq.LAYOUTS}
    for r in rows:
        # the plan is what llama.cpp allocated (its log gives MiB to two decimals, per cache and store)
        assert r["allocated_gib"] * 1024 == pytest.approx(r["planned_gib"] * 1024, abs=0.02), r
        assert r["allocated_gib"] <= 0.025 and not r["note"]
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
    # SmolLM2: 22.5 MiB of f16 a sequence of 512; oscar2 in one unified cache fits twice as many
    assert by[("f16", "per-seq")]["n_seq"] == 2
    assert by[("oscar2", "unified")]["n_seq"] == 4
    assert (out / "equal_memory.md").read_text().count("\n| ") == 5


def test_equal_memory_refusals(bundled_model, tmp_path, capsys):
    m = str(bundled_model)
    assert cli(["bench", m, "--equal-memory", "1", "--serve"]) == 2
    assert cli(["bench", m, "--equal-memory", "1", "-np", "4"]) == 2
    assert cli(["bench", m, "--seq-ctx", "512"]) == 2
    assert cli(["bench", m, "--equal-memory", "1", "--layouts", "diagonal", "-o", str(tmp_path / "o")]) == 2
    assert cli(["bench", m, "--equal-memory", "1", "--seq-ctx", "8", "--equal-gen", "8", "-o", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
    errs = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(errs) == 5 and all(ln.startswith("oscar bench: error:") for ln in errs), errs
    assert "--serve" in errs[0] and "-np" in errs[1] and "--seq-ctx" in errs[2] and "diagonal" in errs[3]
    with pytest.raises(SystemExit) as e:
        cli(["bench", m, "--equal-memory", "0"])
    assert e.value.code == 2
