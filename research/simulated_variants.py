"""Variants measured in simulation only: each would need a change of the runtime (a second K
matrix, a smarter encoder in set_rows, one clip per KV head) or is a baseline. The recipes
that fit the runtime live in oscar_gguf/calibrate/rotations.py.

StudyClipSearch and StudyKVConfig extend the product's clip search and simulated cache with
what these variants need.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from oscar_gguf.calibrate.clip import ClipSearch, covariance_in_frame
from oscar_gguf.calibrate.oscar_rotation import hadamard
from oscar_gguf.calibrate.simulate import KVConfig
from oscar_gguf.format.oscar2 import FP16_MAX, clip_index


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
    from oscar_gguf.calibrate.fakequant import _groups, _quantize_clipped

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
    from oscar_gguf.calibrate.layout import hf_to_llama_perm

    return np.eye(d)[:, hf_to_llama_perm(d)] @ hadamard(d)


def random_sign_hadamard(d: int, seed: int) -> np.ndarray:
    """D·H with a random ±1 diagonal D (QuaRot's randomised Hadamard)."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=d)
    return signs[:, None] * hadamard(d)


class StudyClipSearch(ClipSearch):
    """The clip search with another encoder (quantizer(x, group, clip) -> x̂), and for a
    non-orthogonal K transform A the score error of (q·A⁻ᵀ)·ε: pass A⁻ᵀ per layer in k_score."""

    def __init__(self, rotations, query_covariances, group, grid=None, window=(64, 256), max_queries=128,
                 quantizer=None, k_score: dict[int, np.ndarray] | None = None):
        super().__init__(rotations, query_covariances, group, grid, window, max_queries)
        self.quantizer = quantizer
        if k_score is not None:
            self.cq = {i: covariance_in_frame(c, k_score[i]) for i, c in query_covariances.items()}

    def _quantizer(self, x: torch.Tensor):
        if self.quantizer is None:
            return super()._quantizer(x)
        return lambda c: self.quantizer(x, self.group, c)

    def min_errors(self) -> dict[int, tuple[float, float]]:
        """Per layer, the K and V error at the best clip of each (for comparing rotations)."""
        return {i: (float(self.err_k[i].sum(1).min()), float(self.err_v[i].sum(1).min())) for i in self.err_k}

    def best_per_head(self, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """[n_layers, H_kv] clips, one per KV head."""
        n_kv = next(iter(self.err_k.values())).shape[1]
        ck = np.ones((n_layers, n_kv), dtype=np.float32)
        cv = np.ones((n_layers, n_kv), dtype=np.float32)
        for i in self.err_k:
            ck[i] = np.asarray(self.grid)[np.argmin(self.err_k[i], axis=0)]
            cv[i] = np.asarray(self.grid)[np.argmin(self.err_v[i], axis=0)]
        return ck, cv


@dataclass
class StudyKVConfig(KVConfig):
    """A simulated cache with the variants: clips of shape [n_layers, H_kv] (one per KV head),
    another encoder, a non-orthogonal K transform (store k·A, read q·A⁻ᵀ), or K or V read exactly."""
    k_transform: dict[int, tuple[np.ndarray, np.ndarray]] | None = None   # layer -> (A, A⁻ᵀ)
    quantizer: object = None                  # callable(x, group, clip) -> x̂; None: the runtime's
    quantize_k: bool = True                   # False: K read exactly (where the loss is)
    quantize_v: bool = True

    def fake_quantize(self, x: torch.Tensor, clip) -> torch.Tensor:
        fq = self.quantizer or (lambda y, group, c: KVConfig.fake_quantize(self, y, c))
        c = np.asarray(clip, dtype=np.float64)
        if c.ndim == 0:
            return fq(x, self.group, float(c))
        return torch.stack([fq(x[:, h], self.group, float(c[h])) for h in range(x.shape[1])], dim=1)

    def quantized_scores(self, q, k, layer, scaling):
        g = q.shape[1] // k.shape[1]
        if not self.quantize_k:
            return (q @ k.repeat_interleave(g, dim=1).transpose(-1, -2)) * scaling
        if self.k_transform is None or layer not in self.k_transform:
            return super().quantized_scores(q, k, layer, scaling)
        a, a_inv_t = (torch.as_tensor(np.asarray(m, np.float32), device=q.device) for m in self.k_transform[layer])
        kq = self.fake_quantize(k @ a, self.clip_k[layer])
        return ((q @ a_inv_t) @ kq.repeat_interleave(g, dim=1).transpose(-1, -2)) * scaling

    def quantized_values(self, v, layer):
        return super().quantized_values(v, layer) if self.quantize_v else v
