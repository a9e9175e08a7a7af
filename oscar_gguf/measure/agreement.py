"""Runtime = simulation: llama.cpp's oscar2 cache and `oscar simulate`'s model of it, on one input.

`oscar agreement MODEL-oscar.gguf` measures the mean next-token KL against an f16 cache twice, on
the same chunks of the same tokens, with the same rotations, clip ratios and window:

- runtime: `llama-perplexity --kl-divergence` with `-ctk oscar2 -ctv oscar2` (f16 reference from the
  same GGUF: rotations are applied only where the cache quantizes);
- simulation: the transformers model of the GGUF with the bit-exact quantizer in its attention
  (calibrate/simulate.py), scoring the positions llama-perplexity scores (the second half of each
  chunk, without its last token).

The two differ only by floating-point rounding (llama.cpp quantizes activations for its quantized
weights, transformers runs them dequantized in f32), which moves a few 2-bit codes; a larger gap is
a runtime bug for that architecture, or a simulation that does not model it. The tolerance says how
far the ratio may move from 1.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..format import gguf_keys, oscar2
from .cache_rows import runtime_settings
from .perplexity_log import parse_kld_output
from .tool_runs import EvalError, last_error_line, stream_tool

DEFAULT_TOLERANCE = 0.25


@dataclass
class Agreement:
    model: str
    ctx: int
    chunks: int
    window: tuple[int, int]
    runtime_kl: float
    simulated_kl: float

    @property
    def ratio(self) -> float:
        return self.runtime_kl / max(self.simulated_kl, 1e-30)

    def within(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        return abs(self.ratio - 1.0) <= tolerance

    def line(self) -> str:
        return (f"{Path(self.model).name}: ctx {self.ctx}, {self.chunks} chunk(s), window {self.window[0]}+"
                f"{self.window[1]}: llama.cpp mean KLD {self.runtime_kl:.5f}, simulation {self.simulated_kl:.5f}, "
                f"ratio {self.ratio:.3f}")


def perplexity_chunks(gguf: Path, text: str, ctx: int, n_chunks: int) -> np.ndarray:
    """The token chunks llama-perplexity evaluates: the text tokenized with BOS, cut into ctx-token
    chunks, each starting with BOS when the vocab adds one."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        toks = llm.tokenize(text.encode(), add_bos=True, special=False)
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(llm._model.vocab))
        bos = llm.token_bos()
    finally:
        llm.close()
    if len(toks) < ctx * n_chunks:
        raise EvalError(f"the text has {len(toks)} tokens, fewer than {n_chunks} chunk(s) of {ctx}")
    out = np.array([toks[i * ctx:(i + 1) * ctx] for i in range(n_chunks)], dtype=np.int64)
    if add_bos:
        out[:, 0] = bos
    return out


def runtime_kl(gguf: Path, text_file: Path, ctx: int, n_chunks: int, window: tuple[int, int],
               threads: int, workdir: Path) -> float:
    """llama-perplexity's mean KLD of the oscar2 cache against the f16 cache."""
    base = workdir / "base.kld"
    common = ["-m", gguf, "-f", text_file, "-c", ctx, "-b", ctx, "--chunks", n_chunks, "-fa", "on", "-t", threads,
              "--kl-divergence-base", base]
    code, log = stream_tool("llama-perplexity", common)
    if code != 0:
        raise EvalError(f"llama-perplexity (f16 reference) failed: {last_error_line(log)}")
    code, log = stream_tool("llama-perplexity", [*common, "--kl-divergence", "-ctk", "oscar2", "-ctv", "oscar2",
                                                 gguf_keys.FLAG_SINK, window[0], gguf_keys.FLAG_RECENT, window[1]])
    stats = parse_kld_output(log) if code == 0 else None
    if stats is None or stats.mean_kld is None:
        raise EvalError(f"llama-perplexity (oscar2) failed: {last_error_line(log)}")
    return stats.mean_kld


def simulated_kl(gguf: Path, chunks: np.ndarray, window: tuple[int, int], model=None) -> float:
    """The simulation's mean KL with the GGUF's own rotations and clip ratios."""
    from ..calibrate.models import load_hf, resolve_model
    from ..calibrate.simulate import KVConfig, run_simulation, runtime_quantized_layers

    settings = runtime_settings(gguf)
    if not settings.rotations:
        raise EvalError(f"{gguf} carries no OSCAR rotations: convert it with oscar-convert first")
    k_rot = settings.k_rotations_hf()
    v_rot = {i: v for i, (_, v) in settings.rotations.items()}
    head_dim = next(iter(k_rot.values())).shape[0]
    if model is None:
        model = load_hf(resolve_model(str(gguf)), "cpu")[0]
    cfg = KVConfig("oscar2", k_rot, v_rot, settings.clip_k, settings.clip_v, oscar2.group_size(head_dim),
                   window=tuple(window), quantized_layers=runtime_quantized_layers(model),
                   f16_k_layers=settings.f16_k_layers)
    return run_simulation(model, chunks, [cfg], score_last=False)[cfg.label].mean_kl


def measure_agreement(gguf: str | Path, text_file: str | Path, ctx: int = 1024, n_chunks: int = 1,
                      window: tuple[int, int] = gguf_keys.DEFAULT_WINDOW, threads: int = 2,
                      model=None) -> Agreement:
    gguf, text_file = Path(gguf), Path(text_file)
    if not gguf.is_file():
        raise EvalError(f"model {gguf} not found")
    if not text_file.is_file():
        raise EvalError(f"text {text_file} not found")
    chunks = perplexity_chunks(gguf, text_file.read_text(encoding="utf-8", errors="replace"), ctx, n_chunks)
    with tempfile.TemporaryDirectory(prefix="oscar-agreement-") as tmp:
        rt = runtime_kl(gguf, text_file, ctx, n_chunks, window, threads, Path(tmp))
    sim = simulated_kl(gguf, chunks, window, model)
    return Agreement(str(gguf), ctx, n_chunks, tuple(window), rt, sim)
