"""A torch port of oscar_gguf.format.oscar2.fake_quantize, bit-exact with it (tests check).

The calibration and the simulation quantize millions of vectors for every candidate
clip ratio; numpy's partition per call is the bottleneck there, so this port sorts the
magnitudes once and reuses them for every clip of a grid. Same rules as format/oscar2.py: non-finite
inputs read as 0, clip at the k-th smallest |x| (k = floor(c·G) in float32), min/max with
fp16 scale and minimum, codes by comparing against m + (i + 0.5)·d.
"""
from __future__ import annotations

import torch

from ..format.oscar2 import FP16_MAX, clip_index

_FP16_MAX = float(FP16_MAX)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group size {group}")
    v = x.to(torch.float32).reshape(-1, group)
    v = torch.where(torch.isfinite(v), v, torch.zeros((), dtype=torch.float32, device=v.device))
    return v + 0.0  # -0 -> +0, as the C reference does


def _quantize_clipped(v: torch.Tensor, tau: torch.Tensor | None) -> torch.Tensor:
    """Quantize+dequantize groups v [n, G], already sanitised, clipped at tau [n, 1] if given."""
    if tau is not None:
        v = torch.where(v > tau, tau, torch.where(v < -tau, -tau, v)) + 0.0
    mn = v.amin(dim=1)
    mx = v.amax(dim=1)
    d = (mx - mn) / 3.0
    d = torch.where(d <= _FP16_MAX, d, torch.full_like(d, _FP16_MAX))
    mn = mn.clamp(-_FP16_MAX, _FP16_MAX)
    df = d.to(torch.float16).to(torch.float32)[:, None]
    mf = mn.to(torch.float16).to(torch.float32)[:, None]
    t1 = mf + 0.5 * df
    t2 = mf + 1.5 * df
    t3 = mf + 2.5 * df
    codes = (v >= t1).to(torch.float32) + (v >= t2).to(torch.float32) + (v >= t3).to(torch.float32)
    return mf + codes * df


def fake_quantize(x: torch.Tensor, group: int, clip: float = 1.0) -> torch.Tensor:
    """Quantize then dequantize x (last dim a multiple of group), float32, same shape."""
    v = _groups(x, group)
    k = clip_index(clip, group)
    tau = None
    if k is not None:
        tau = torch.kthvalue(v.abs(), k + 1, dim=1, keepdim=True).values
    return _quantize_clipped(v, tau).reshape(x.shape)


class GroupQuantizer:
    """Fake-quantizes the same x at many clip ratios, sorting |x| once."""

    def __init__(self, x: torch.Tensor, group: int):
        self.shape = x.shape
        self.group = group
        self.v = _groups(x, group)
        self._sorted = None

    def __call__(self, clip: float) -> torch.Tensor:
        k = clip_index(clip, self.group)
        tau = None
        if k is not None:
            if self._sorted is None:
                self._sorted = self.v.abs().sort(dim=1).values
            tau = self._sorted[:, k:k + 1]
        return _quantize_clipped(self.v, tau).reshape(self.shape)
