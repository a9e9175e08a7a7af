"""End-to-end drivers behind `oscar calibrate`, `oscar simulate` and calibrate()."""
from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

from ..format.gguf_keys import DEFAULT_WINDOW
from .calibrator import DEFAULT_RECIPE, ArtifactSource, CalibrationState, Calibrator
from .plan import DEFAULT_BUDGET, DEFAULT_THRESHOLD
from .corpus import ChunkPlan, describe_source, make_chunks, plan_chunks
from .models import (ModelError, ModelRef, fingerprint, gguf_architecture, hf_bos_prefix, hf_encode,
                     load_hf, pick_device, resolve_model)

DEFAULT_TOKENS = 32768
DEFAULT_SEQ_LEN = 2048
BACKENDS = ("auto", "hf", "llama")


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024 if sys.platform != "darwin" else r / 2**20


def _progress(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="tok", unit_scale=True, desc=desc, disable=not enabled, dynamic_ncols=True,
                file=sys.stderr)


def llama_backend_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except Exception:
        return False


def choose_backend(ref: ModelRef, backend: str) -> str:
    if backend not in BACKENDS:
        raise ModelError(f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if ref.kind == "hf":
        if backend == "llama":
            raise ModelError(f"the llama backend reads GGUF files and {ref.name} is a Hugging Face model; "
                             f"use --backend hf (or convert it to GGUF first)")
        return "hf"
    if backend == "auto":
        return "llama" if llama_backend_available() else "hf"
    return backend


@dataclass
class CalibrationRun:
    artifact: object
    backend: str
    peak_rss_mib: float
    tokens: int
    seconds: float


def calibrate_file(model: str, *, text: str | None = None, tokens: int = DEFAULT_TOKENS,
                   seq_len: int | None = None, device: str = "auto", clip: str = "search",
                   backend: str = "auto", window: tuple[int, int] = DEFAULT_WINDOW,
                   progress: bool = True, hash_model: bool = True, rotation: str = DEFAULT_RECIPE,
                   threads: int | None = None, f16_k_budget: float = DEFAULT_BUDGET,
                   f16_k_threshold: float = DEFAULT_THRESHOLD) -> CalibrationRun:
    """Calibrate MODEL (HF folder, Hub id or GGUF) and return the artifact with run facts."""
    import time

    t0 = time.monotonic()
    ref = resolve_model(model)
    which = choose_backend(ref, backend)
    dev = pick_device(device)
    # hashed after the text is chunked, so that bad text is reported before a long hash
    sha = (lambda: fingerprint(ref)) if hash_model else (lambda: "")
    precision = {"f16_k_budget": f16_k_budget, "f16_k_threshold": f16_k_threshold}
    if which == "llama":
        art, n = _calibrate_llama(ref, text, tokens, seq_len, dev, clip, window, progress, sha, rotation, threads,
                                  precision)
    else:
        art, n = _calibrate_hf(ref, text, tokens, seq_len, dev, clip, window, progress, sha, rotation, precision)
    art.extra["backend"] = which
    return CalibrationRun(art, which, peak_rss_mib(), n, time.monotonic() - t0)


def _calibrate_hf(ref, text, tokens, seq_len, dev, clip, window, progress, sha, rotation, precision):
    model, tok, arch = load_hf(ref, dev)
    from .capture_hf import text_config
    cfg = text_config(model.config)
    source = ArtifactSource(architecture=arch, n_layers=int(cfg.num_hidden_layers), rope_layout="hf",
                            model=ref.name)
    art = calibrate_hf_model(model, hf_encode(tok), hf_bos_prefix(tok), text=text, tokens=tokens,
                             seq_len=seq_len, clip=clip, window=window, progress=progress, source=source,
                             rotation=rotation, **precision)
    art.model_sha256 = sha()
    return art, art.tokens


def default_seq_len(max_ctx: int | None) -> int:
    return min(DEFAULT_SEQ_LEN, int(max_ctx)) if max_ctx else DEFAULT_SEQ_LEN


def calibrate_hf_model(model, encode, prefix: list[int], *, text=None, tokens: int = DEFAULT_TOKENS,
                       seq_len: int | None = None, clip: str = "search", window=DEFAULT_WINDOW,
                       progress: bool = True, source: ArtifactSource | None = None, rotation: str = DEFAULT_RECIPE,
                       f16_k_budget: float = DEFAULT_BUDGET, f16_k_threshold: float = DEFAULT_THRESHOLD):
    """Run the passes of a Calibrator over chunks of text with a loaded transformers model."""
    import torch

    from .capture_hf import decoder, text_config

    cfg = text_config(model.config)
    seq_len = seq_len or default_seq_len(getattr(cfg, "max_position_embeddings", None))
    plan = plan_chunks(tokens, seq_len, clip == "search")
    stat, held = make_chunks(text, encode, prefix, plan)
    cal = Calibrator(model, clip=clip, window=window, source=source, rotation=rotation,
                     f16_k_budget=f16_k_budget, f16_k_threshold=f16_k_threshold)
    base = decoder(model)
    dev = next(model.parameters()).device
    bar = _progress((2 * len(stat) + len(held)) * seq_len, progress, "calibrate")
    with bar:
        while cal.pass_name:
            bar.set_postfix_str(cal.pass_name)
            with cal:
                for chunk in (held if cal.pass_name == "clips" else stat):
                    base(torch.as_tensor(chunk, dtype=torch.long, device=dev)[None], use_cache=False)
                    bar.update(seq_len)
    return cal.result(corpus=describe_source(text))


def _calibrate_llama(ref, text, tokens, seq_len, dev, clip, window, progress, sha, rotation, threads=None,
                     precision=None):
    from .capture_llama import LlamaCppCapture

    from ..format.gguf_read import read_gguf_metadata, takes_no_rotations

    meta = read_gguf_metadata(ref.path)
    arch = gguf_architecture(ref.path, meta)
    if takes_no_rotations(arch, meta.get(f"{arch}.attention.kv_lora_rank")):
        raise ModelError(f"architecture {arch!r} uses latent (MLA) or custom attention outside the KV-cache path "
                         "that OSCAR rotates; it cannot be calibrated or run with oscar2")
    ctx_train = meta.get(f"{arch}.context_length")
    seq_len = seq_len or default_seq_len(ctx_train)
    plan = plan_chunks(tokens, seq_len, clip == "search")
    with LlamaCppCapture(ref.path, seq_len, device=dev, n_threads=threads) as cap:
        stat, held = make_chunks(text, cap.encode, cap.bos_prefix(), plan)
        model_sha = sha()
        state = CalibrationState(clip=clip, window=window, rotation=rotation, **(precision or {}))
        bar = _progress((2 * len(stat) + len(held)) * seq_len, progress, "calibrate")

        def handler(layer, q, k, v, scale, allowed):
            state.observe(layer, q, k, v, scale, allowed)

        with bar:
            while state.pass_name:
                bar.set_postfix_str(state.pass_name)
                for chunk in (held if state.pass_name == "clips" else stat):
                    cap.run(chunk, handler)
                    bar.update(seq_len)
                if state.pass_name == "values":
                    bar.set_postfix_str(f"fitting {rotation} rotations")
                state.end_pass()
        source = ArtifactSource(architecture=arch, n_layers=cap.n_layers, rope_layout="llama.cpp",
                                model=ref.name, model_sha256=model_sha)
        art = state.result(source, corpus=describe_source(text))
    return art, art.tokens


# -- simulate ------------------------------------------------------------------------------

def simulate_file(model: str, rotations: str, *, text: str, tokens: int = 16384, seq_len: int = 1024,
                  device: str = "auto", window: tuple[int, int] = DEFAULT_WINDOW, progress: bool = True):
    """Load MODEL with transformers and run the standard comparison on held-out text."""
    from .artifact import load_artifact
    from .simulate import run_simulation, runtime_quantized_layers, standard_configs

    art = load_artifact(rotations)
    ref = resolve_model(model)
    dev = pick_device(device)
    model_, tok, arch = load_hf(ref, dev)
    if arch != art.architecture:
        raise ModelError(f"{rotations} is for architecture {art.architecture!r}, but {ref.name} is {arch!r}")
    plan = ChunkPlan(seq_len, max(1, tokens // seq_len), 0)
    chunks, _ = make_chunks(text, hf_encode(tok), hf_bos_prefix(tok), plan)
    configs = standard_configs(art, window, runtime_quantized_layers(model_))
    bar = _progress(len(chunks) * len(configs), progress, "simulate")
    bar.unit = "run"
    with bar:
        results = run_simulation(model_, chunks, configs, bar)
    return results, configs, len(chunks) * seq_len
