"""OSCAR calibration: per-layer K/V rotations and clip ratios for the oscar2 KV cache.

Python API, in the spirit of optimum-quanto's calibration context:

    from oscar_gguf.calibrate import calibrate, Calibrator, save_artifact

    art = calibrate("SmolLM2-135M-Instruct.Q4_1.gguf", tokens=32768)       # file, folder or Hub id
    art = calibrate(hf_model, tokenizer=tok, text="my_corpus/")            # a loaded transformers model

    cal = Calibrator(hf_model, clip="search")                              # your own forward passes
    while cal.pass_name:                    # "queries", "values", then "clips" (held-out text)
        with cal:
            for ids in batches:
                hf_model(ids)
    save_artifact("rot.safetensors", cal.result())

Method: docs/design.md §1 (K covariance "qqt", V covariance "sst", R = U·H_d·P_br).
"""
from __future__ import annotations

import os

from ..format.gguf_keys import DEFAULT_WINDOW
from .artifact import RotationArtifact, load_artifact, save_artifact
from .oscar_rotation import hadamard, oscar_rotation
from .rotationzoo import import_rotationzoo

_LAZY = {"Calibrator": "calibrator", "CalibrationState": "calibrator", "ArtifactSource": "calibrator",
         "FIXED_CLIPS": "clip", "clip_grid": "clip"}


def __getattr__(name):
    # torch-backed parts load on first use, so that `oscar version` and the artifact API
    # work without the calibration extra installed
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["calibrate", "Calibrator", "CalibrationState", "ArtifactSource", "RotationArtifact", "load_artifact",
           "save_artifact", "import_rotationzoo", "oscar_rotation", "hadamard", "clip_grid",
           "DEFAULT_WINDOW", "FIXED_CLIPS"]


def calibrate(model, *, text=None, tokens: int = 32768, seq_len: int | None = None, device: str = "auto",
              clip: str = "search", backend: str = "auto", tokenizer=None, rotation: str = "key-eigen-dc",
              window: tuple[int, int] = DEFAULT_WINDOW, progress: bool = True,
              out: str | os.PathLike | None = None) -> RotationArtifact:
    """Calibrate a model and return (and optionally save) its RotationArtifact.

    model: a local HF model folder, a Hub id, a GGUF file, or a loaded transformers model
    (then pass its `tokenizer`). text: FILE | DIR | JSONL path, a list of strings, or None
    for the bundled corpus. clip: "search" (per-layer, on held-out chunks) or "fixed"
    (0.96 / 0.92). window: the (sink, recent) tokens the runtime keeps in f16, which the clip
    search leaves out of its objectives. rotation: "key-eigen-dc" (default), "learned",
    "hadamard" or "oscar" (docs/design.md §1 exactly); see rotations.py for what each is and
    what it measured.
    """
    if isinstance(model, (str, os.PathLike)):
        from .pipeline import calibrate_file
        art = calibrate_file(str(model), text=text, tokens=tokens, seq_len=seq_len, device=device, clip=clip,
                             backend=backend, window=window, progress=progress, rotation=rotation).artifact
    else:
        if tokenizer is None:
            raise ValueError("calibrating a loaded model needs its tokenizer: calibrate(model, tokenizer=tok, ...)")
        from .models import hf_bos_prefix, hf_encode
        from .pipeline import calibrate_hf_model
        art = calibrate_hf_model(model, hf_encode(tokenizer), hf_bos_prefix(tokenizer), text=text, tokens=tokens,
                                 seq_len=seq_len, clip=clip, window=window, progress=progress, rotation=rotation)
    if out is not None:
        save_artifact(out, art)
    return art
