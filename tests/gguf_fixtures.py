"""GGUFs made for tests: the bundled model with identity or random orthogonal rotations."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from oscar_gguf.gguf_io import Rotations, convert, read_model_info

PROMPT = ("The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the "
          "children played near the old fountain while their parents talked about the weather. ")


def random_orthogonal(d: int, rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def rotations_for(model: Path, kind: str, seed: int = 1, clip_k: float = 0.96, clip_v: float = 0.92) -> Rotations:
    info = read_model_info(model)
    L, dk, dv = info.n_layer, info.head_dim_k, info.head_dim_v
    rng = np.random.default_rng(seed)
    if kind == "identity":
        mk, mv = (lambda: np.eye(dk, dtype=np.float32)), (lambda: np.eye(dv, dtype=np.float32))
    else:
        mk, mv = (lambda: random_orthogonal(dk, rng)), (lambda: random_orthogonal(dv, rng))
    return Rotations({i: mk() for i in range(L)}, {i: mv() for i in range(L)}, [clip_k] * L, [clip_v] * L,
                     info.arch, L, dk, 64 if dk % 128 else 128, {"method": f"test-{kind}"})


def with_rotations(model: Path, out: Path, kind: str, **kw) -> Path:
    if not out.exists():
        convert(model, out, rotations_for(model, kind, **kw))
    return out
