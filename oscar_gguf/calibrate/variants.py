"""Variants measured in simulation only (experiments.py, study.py): each would need a change
of the runtime (a second K matrix, a smarter encoder in set_rows) or is a baseline.
The runtime-compatible recipes live in rotations.py.
"""
from __future__ import annotations

import numpy as np
import torch

from ..quant import FP16_MAX, clip_index
from .fit import hadamard
from .rotations import dc_rotation, learn_rotation  # noqa: F401  (re-exported for the studies)


def whitening_k_transform(s_k: np.ndarray, c_q: np.ndarray, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Attention-aware, non-orthogonal K transform (study only; the runtime needs two matrices).

    Store k·A and score with q·A⁻ᵀ (q·k is unchanged). With white quantization noise of a
    variance proportional to tr(Aᵀ S A) (the stored keys' energy), the expected score error
    is ∝ tr(Aᵀ S A) · tr(A⁻¹ C A⁻ᵀ); A = S^{-1/2} M^{1/4} with M = S^{1/2} C S^{1/2} reaches
    its minimum (tr M^{1/2})², against tr S · tr C for any orthogonal A. A final Hadamard
    spreads the energy over the coordinates. Returns (A, A⁻ᵀ).
    """
    def sym_pow(m, p):
        w, v = np.linalg.eigh(0.5 * (m + m.T))
        w = np.maximum(w, eps * w.max())
        return (v * w ** p) @ v.T

    s_half, s_mhalf = sym_pow(s_k, 0.5), sym_pow(s_k, -0.5)
    m = s_half @ c_q @ s_half
    a = s_mhalf @ sym_pow(m, 0.25) @ hadamard(len(s_k))
    return a, np.linalg.inv(a).T


def predicted_k_transform_gain(s_k: np.ndarray, c_q: np.ndarray) -> float:
    """tr S · tr C / (tr (S^{1/2} C S^{1/2})^{1/2})²: the white-noise model's error ratio."""
    w, v = np.linalg.eigh(s_k)
    s_half = (v * np.sqrt(np.maximum(w, 0))) @ v.T
    mw = np.linalg.eigvalsh(s_half @ c_q @ s_half)
    return float(np.trace(s_k) * np.trace(c_q) / np.sum(np.sqrt(np.maximum(mw, 0))) ** 2)


def fake_quantize_refit(x: torch.Tensor, group: int, clip: float = 1.0, iters: int = 2) -> torch.Tensor:
    """Same 2-bit format (m + q·d, fp16 m and d), smarter encoder: after the min/max codes,
    refit (m, d) by least squares against the unclipped x and re-assign codes, `iters` times.
    Decoding is unchanged, only set_rows' quantizer would differ (study only)."""
    from .fakequant import _groups, _quantize_clipped

    v = _groups(x, group)
    k = clip_index(clip, group)
    tau = None if k is None else torch.kthvalue(v.abs(), k + 1, dim=1, keepdim=True).values
    y = _quantize_clipped(v, tau)
    mn = y.amin(dim=1, keepdim=True)
    d = (y.amax(dim=1, keepdim=True) - mn) / 3
    for _ in range(iters):
        q = torch.where(d > 0, torch.round((v - mn) / torch.where(d > 0, d, torch.ones_like(d))),
                        torch.zeros_like(v)).clamp(0, 3)
        qm = q.mean(1, keepdim=True)
        xm = v.mean(1, keepdim=True)
        var = ((q - qm) ** 2).sum(1, keepdim=True)
        d_new = torch.where(var > 0, ((q - qm) * (v - xm)).sum(1, keepdim=True) / torch.where(var > 0, var, 1.0), d)
        d_new = d_new.clamp(min=0)
        mn = (xm - d_new * qm)
        d = d_new
    fmax = float(FP16_MAX)
    dh = d.clamp(max=fmax).to(torch.float16).to(torch.float32)
    mh = mn.clamp(-fmax, fmax).to(torch.float16).to(torch.float32)
    q = torch.where(dh > 0, torch.round((v - mh) / torch.where(dh > 0, dh, torch.ones_like(dh))),
                    torch.zeros_like(v)).clamp(0, 3)
    return (mh + q * dh).reshape(x.shape)


def hadamard_llama_order(d: int) -> np.ndarray:
    """The runtime's built-in Hadamard on llama.cpp's head-dim order, written in HF coordinates
    (x_llama·H = x_hf·P·H): what `--oscar-rot hadamard` does to the keys of a llama GGUF."""
    from .layout import hf_to_llama_perm

    return np.eye(d)[:, hf_to_llama_perm(d)] @ hadamard(d)


def random_sign_hadamard(d: int, seed: int) -> np.ndarray:
    """D·H with a random ±1 diagonal D (QuaRot's randomised Hadamard)."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=d)
    return signs[:, None] * hadamard(d)





