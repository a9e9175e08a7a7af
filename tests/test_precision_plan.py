"""The precision plan (oscar.f16_k_layers): chosen by the calibration, carried by the artifact
and the GGUF, and applied by llama.cpp, which keeps those layers' K caches in f16."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from gguf_fixtures import PROMPT, rotations_for
from oscar_gguf.calibrate.artifact import RotationArtifact, load_artifact, save_artifact
from oscar_gguf.calibrate.clip import ClipSearch
from oscar_gguf.calibrate.plan import added_bits, plan_f16_keys
from oscar_gguf.convert import convert, inspect_report
from oscar_gguf.convert import main as convert_main
from oscar_gguf.format import gguf_keys, oscar2
from oscar_gguf.format.gguf_read import GGUFError, read_model_info
from oscar_gguf.format.rotations import random_rotation
from oscar_gguf.llama_context import Context, LlamaError, Model
from oscar_gguf.measure.cache_rows import runtime_settings
from oscar_gguf.runtime import run_tool


# ---- the choice --------------------------------------------------------------------------------

def test_plan_takes_the_worst_layers_above_the_threshold_within_the_budget():
    errors = {0: 0.02, 1: 0.30, 2: 0.15, 3: 0.05, 4: 0.12}
    step = added_bits(len(errors), 64)                  # (16 - 2.5) / 10 = 1.35 bits per layer
    assert step == pytest.approx(1.35)
    assert plan_f16_keys(errors, 64, threshold=0.1, budget=10) == (1, 2, 4)
    assert plan_f16_keys(errors, 64, threshold=0.1, budget=2 * step) == (1, 2)   # worst first
    assert plan_f16_keys(errors, 64, threshold=0.2, budget=10) == (1,)
    assert plan_f16_keys(errors, 64, threshold=0.1, budget=0) == ()
    assert plan_f16_keys({}, 64) == ()


def test_k_output_error_ranks_a_layer_with_outlier_keys_and_skips_sliding_layers():
    """Layer 1's keys carry one huge channel that the clip must cut: its K-only output error
    is far above layer 0's. Layer 2 has a banded (sliding-window) mask."""
    d, t, h = 64, 96, 2
    rng = np.random.default_rng(0)
    rot = {i: (random_rotation(d, rng), random_rotation(d, rng)) for i in range(3)}
    cq = {i: torch.eye(d, dtype=torch.float64).expand(h, d, d).clone() for i in range(3)}
    search = ClipSearch(rot, cq, group=64, window=(4, 8), max_queries=32)
    gen = torch.Generator().manual_seed(0)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    band = causal & ~torch.ones(t, t, dtype=torch.bool).tril(-33)
    for layer in range(3):
        q = torch.randn(t, h, d, generator=gen)
        k = torch.randn(t, h, d, generator=gen)
        v = torch.randn(t, h, d, generator=gen)
        if layer == 1:
            k[:, :, 5] += 40 * torch.randn(t, h, generator=gen)
            q[:, :, 5] *= 3
        search.observe(layer, q, k, v, scaling=d ** -0.5, allowed=band if layer == 2 else causal)
    e0, e1 = (search.k_output_error(i, 1.0) for i in (0, 1))
    assert e1 > 2 * e0 > 0
    assert search.sliding == {2}


# ---- artifact and GGUF ---------------------------------------------------------------------------

def _artifact(n_layers=2, d=64, plan=()) -> RotationArtifact:
    rng = np.random.default_rng(1)
    r = {i: random_rotation(d, rng) for i in range(n_layers)}
    lam = {i: np.arange(d, dtype=np.float32) for i in range(n_layers)}
    return RotationArtifact("llama", n_layers, d, 4, 2, "hf", r, dict(r), lam, dict(lam),
                            np.ones(n_layers, np.float32), np.ones(n_layers, np.float32), f16_k_layers=plan)


def test_artifact_round_trip_and_refusals(tmp_path):
    p = save_artifact(tmp_path / "a.safetensors", _artifact(plan=(1,)))
    assert load_artifact(p).f16_k_layers == (1,)
    assert load_artifact(save_artifact(tmp_path / "b.safetensors", _artifact())).f16_k_layers == ()
    for bad in ((2,), (0, 0), (-1,)):
        with pytest.raises(ValueError, match="f16_k_layers"):
            _artifact(plan=bad).validate()


@pytest.fixture(scope="module")
def planned(bundled_model, tmp_path_factory):
    """The bundled model with random rotations, without a plan, with f16 keys in layers 0 and 7,
    and with f16 keys in every layer."""
    d = tmp_path_factory.mktemp("plan")
    n = read_model_info(bundled_model).n_layer
    out = {}
    for name, plan in (("none", ()), ("two", (0, 7)), ("all", tuple(range(n)))):
        rot = replace(rotations_for(bundled_model, "random"), f16_k_layers=plan)
        out[name] = d / f"{name}.gguf"
        convert(bundled_model, out[name], rot)
    return out


def test_convert_writes_the_plan_and_inspect_shows_it(planned, tmp_path):
    assert runtime_settings(planned["two"]).f16_k_layers == {0, 7}
    assert runtime_settings(planned["none"]).f16_k_layers == frozenset()
    assert "precision plan: the K cache of layers 0, 7 stays f16" in inspect_report(planned["two"])
    assert "precision plan" not in inspect_report(planned["none"])
    n = read_model_info(planned["two"]).n_layer
    with pytest.raises(GGUFError, match="f16 K layers"):
        convert(planned["none"], tmp_path / "x.gguf", replace(rotations_for(planned["none"], "random"),
                                                              f16_k_layers=(n,)), replace=True)
    assert not (tmp_path / "x.gguf").exists()


def test_convert_drops_the_plan_on_request(bundled_model, tmp_path):
    art = _artifact()
    info = read_model_info(bundled_model)
    rng = np.random.default_rng(2)
    r = {i: random_rotation(info.head_dim_k, rng) for i in range(info.n_layer)}
    lam = {i: np.arange(info.head_dim_k, dtype=np.float32) for i in range(info.n_layer)}
    art = RotationArtifact(info.arch, info.n_layer, info.head_dim_k, info.n_head, info.n_head_kv, "llama.cpp",
                           r, dict(r), lam, dict(lam), np.ones(info.n_layer, np.float32),
                           np.ones(info.n_layer, np.float32), f16_k_layers=(3,))
    a = save_artifact(tmp_path / "rot.safetensors", art)
    assert convert_main([str(bundled_model), "--rotations", str(a), "-o", str(tmp_path / "with.gguf")]) == 0
    assert convert_main([str(bundled_model), "--rotations", str(a), "-o", str(tmp_path / "without.gguf"),
                         "--no-f16-k"]) == 0
    assert runtime_settings(tmp_path / "with.gguf").f16_k_layers == {3}
    assert runtime_settings(tmp_path / "without.gguf").f16_k_layers == frozenset()


# ---- llama.cpp ------------------------------------------------------------------------------------

def _k_cache_mib(model, n_threads, n_ctx=512) -> float:
    r = run_tool("llama-cli", ["-m", model, "-p", "Hi", "-n", "1", "-c", n_ctx, "-ctk", "oscar2", "-ctv", "oscar2",
                               "-fa", "on", "-st", "-lv", "4", "-t", n_threads], timeout=300, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    m = re.search(r"K \(oscar2\w*\):\s*([0-9.]+) MiB", log)
    assert m, log[-2000:]
    return float(m.group(1))


def test_planned_layers_hold_f16_keys(planned, n_threads):
    info = read_model_info(planned["none"])
    n_ctx, g = 512, oscar2.group_size(info.head_dim_k)
    row_f16 = info.n_head_kv * info.head_dim_k * 2
    row_int2 = info.n_head_kv * info.head_dim_k // g * oscar2.block_bytes(g)
    plain, two = (_k_cache_mib(planned[k], n_threads, n_ctx) for k in ("none", "two"))
    assert plain == pytest.approx(n_ctx * info.n_layer * row_int2 / 2**20, abs=0.006)
    assert two - plain == pytest.approx(2 * n_ctx * (row_f16 - row_int2) / 2**20, abs=0.011)


def test_f16_keys_everywhere_is_an_f16_k_cache(planned, n_threads):
    """With every layer in the plan, an oscar2 K request runs exactly as -ctk f16 -ctv oscar2:
    the same caches, no K rotation, the same window."""
    with Model(planned["all"]) as m:
        toks = m.tokenize(PROMPT * 3)
        out = {}
        for tk in ("oscar2", "f16"):
            with Context(m, n_ctx=512, type_k=tk, type_v="oscar2", n_threads=n_threads) as c:
                out[tk] = c.decode(toks, logits="all")
    assert np.array_equal(out["oscar2"], out["f16"])
    with Model(planned["none"]) as m, Context(m, n_ctx=512, type_k="oscar2", type_v="oscar2", n_threads=n_threads) as c:
        assert not np.array_equal(c.decode(toks, logits="all"), out["f16"])


def test_loader_refuses_a_plan_outside_the_model(planned, tmp_path):
    from oscar_gguf.format.gguf_write import copy_with_additions
    from gguf import GGUFValueType as T

    bad = tmp_path / "bad.gguf"
    n = read_model_info(planned["none"]).n_layer
    copy_with_additions(planned["none"], bad, [(gguf_keys.KEY_F16_K_LAYERS, T.ARRAY, [n], T.UINT32)], [])
    with pytest.raises(LlamaError):
        Model(bad)
    r = run_tool("llama-cli", ["-m", bad, "-p", "Hi", "-n", "1", "-st"], timeout=120, check=False)
    assert r.returncode != 0
    assert f"oscar.f16_k_layers names layer {n}" in r.stdout + r.stderr
