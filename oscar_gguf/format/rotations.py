"""Rotations: the per-layer K/V matrices and clip ratios a GGUF carries, and the one check of a
rotation matrix that every reader and writer applies.

A rotation acts on row vectors, x_rot = x @ R (numpy row-major, f32 [d, d]). It is accepted
when it is square of the model's head_dim, finite, and orthogonal: the largest entry of
|RᵀR − I|, computed in float64, is at most ORTHOGONALITY_LIMIT. The patched llama.cpp applies
the same norm and limit when it loads a model (llama_oscar_validate_rotations in
ggml-oscar/llama/llama-oscar.cpp); float32 rounding of an orthogonal matrix stays near 1e-6.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_read import GGUFError, ModelInfo

ORTHOGONALITY_LIMIT = 1e-4


def orthogonality_error(r: np.ndarray) -> float:
    """The largest entry of |RᵀR − I| in float64; inf when r is not a non-empty square matrix."""
    r = np.asarray(r, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] != r.shape[1] or r.size == 0:
        return float("inf")
    with np.errstate(all="ignore"):
        return float(np.abs(r.T @ r - np.eye(r.shape[0])).max())


def rotation_problem(r: np.ndarray, d: int | None = None) -> str | None:
    """Why r is not a rotation of head_dim d (or of any size, for d None), as the end of a
    sentence ("has shape ...", "has non-finite values", "is not orthogonal ..."); None when it is."""
    r = np.asarray(r)
    if r.ndim != 2 or r.shape[0] != r.shape[1] or (d is not None and r.shape != (d, d)):
        return f"has shape {r.shape}, expected " + (f"({d}, {d})" if d is not None else "a square matrix")
    if not np.all(np.isfinite(r)):
        return "has non-finite values"
    err = orthogonality_error(r)
    if err > ORTHOGONALITY_LIMIT:
        return f"is not orthogonal (max |R^T R - I| = {err:.2e} > {ORTHOGONALITY_LIMIT:g})"
    return None


def random_rotation(d: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random orthogonal [d, d] matrix in float32 (QR of a Gaussian, signs fixed)."""
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


@dataclass
class Rotations:
    """What goes into a GGUF, already in llama.cpp's head-dim order."""
    k_rot: dict[int, np.ndarray]
    v_rot: dict[int, np.ndarray]
    clip_k: list[float]
    clip_v: list[float]
    arch: str | None
    n_layers: int
    head_dim: int | None
    group_size: int
    provenance: dict[str, str]
    f16_k_layers: tuple[int, ...] = ()   # the precision plan: these layers keep an f16 K cache

    def validate(self, model: ModelInfo | None = None) -> "Rotations":
        """Raise GGUFError naming the first problem; with a model, also that they do not fit it."""
        if model is not None:
            self._check_fits(model)
        n = model.n_layer if model is not None else self.n_layers
        for what, mats, d in (("K", self.k_rot, model and model.head_dim_k), ("V", self.v_rot, model and model.head_dim_v)):
            for il, r in mats.items():
                if not (0 <= il < n):
                    raise GGUFError(f"{what} rotation for layer {il}, but the model has layers 0..{n - 1}")
                problem = rotation_problem(r, d)
                if problem:
                    raise GGUFError(f"{what} rotation of layer {il} {problem}")
        for what, clips in (("K", self.clip_k), ("V", self.clip_v)):
            if len(clips) != n:
                raise GGUFError(f"{len(clips)} {what} clip ratios for {n} layers")
            bad = [c for c in clips if not (np.isfinite(c) and 0 < c <= 1)]
            if bad:
                raise GGUFError(f"{what} clip ratio {bad[0]} is not in (0, 1]")
        keep = list(self.f16_k_layers)
        if len(set(keep)) != len(keep) or any(not 0 <= i < n for i in keep):
            raise GGUFError(f"f16 K layers {keep} must be distinct layers of 0..{n - 1}")
        return self

    def _check_fits(self, model: ModelInfo) -> None:
        if model.latent_attention:
            raise GGUFError(f"architecture '{model.arch}' uses latent (MLA) or custom attention outside the "
                            "KV-cache path that applies rotations; llama.cpp would refuse the converted file")
        if self.arch and self.arch != model.arch:
            raise GGUFError(f"the rotations were calibrated for architecture '{self.arch}', the model is '{model.arch}'")
        if self.n_layers != model.n_layer:
            raise GGUFError(f"the rotations have {self.n_layers} layers, the model has {model.n_layer}")
        if self.head_dim is not None and self.head_dim != model.head_dim_k:
            raise GGUFError(f"the rotations are for head_dim {self.head_dim}, the model has {model.head_dim_k}")
        if model.head_dim_k % 64 or model.head_dim_v % 64:
            raise GGUFError(f"head_dim {model.head_dim_k}/{model.head_dim_v} is not supported by oscar2 "
                            "(needs a multiple of 64)")
