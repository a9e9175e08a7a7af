"""Clip ratios: the paper's fixed pair, or a per-layer grid search on held-out chunks.

The search simulates the runtime exactly: the rotation of the layer, then the bit-exact
oscar2 quantizer (fakequant.py, tested against format/oscar2.py) at each clip of the grid.

- K minimises the attention-score error E_q ‖q (K̂ − K)ᵀ‖², the expectation over the
  calibration queries of the group that reads each KV head. With C_h the query second
  moment from pass 1 this is Σ_j e_j C_h e_jᵀ over the quantized keys j, computed in the
  rotated frame (e = FQ(kR) − kR, C' = Rᵀ C_h R).
- V minimises the attention-output error ‖P_q (V̂ − V)‖² where P_q is the attention of
  the real queries with the quantized (query, key) pairs kept. Only a spread-out sample
  of queries is used, which keeps the cost at O(samples · T · d) per clip candidate.

Beside the search, the K-only output error: the relative change ‖O_K̂ − O‖² / ‖O‖² of the
attention output of the same sampled queries when only the keys are read from INT2, at each
clip of the grid. It ranks the layers for the precision plan (plan.py): a layer whose keys INT2
cannot hold (outlier channels that the clip must cut) shows it here, whatever its score scale.

With a high-precision window (sink S, recent R) the runtime never quantizes the first S
keys nor, for a query at i, the keys after i − R; those pairs are left out of both
objectives, since their error is zero at run time whatever the clip.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..format.gguf_keys import DEFAULT_CLIP_K, DEFAULT_CLIP_V, DEFAULT_WINDOW
from .fakequant import GroupQuantizer
from .stats import AttentionShape, group_queries

FIXED_CLIPS = (DEFAULT_CLIP_K, DEFAULT_CLIP_V)


def clip_grid(group: int, lowest: float = 0.7) -> list[float]:
    """1.0 (no clipping), then k/G for k = G−1 down to ceil(lowest·G): every distinct
    clip index the kernel can realise in that range (floor(c·G) = k exactly)."""
    ks = range(group - 1, math.ceil(lowest * group) - 1, -1)
    return [1.0] + [k / group for k in ks]


def pair_mask(t: int, query_pos: torch.Tensor, allowed: torch.Tensor | None, window: tuple[int, int],
              device) -> torch.Tensor:
    """[S, T] True where query i attends key j and the runtime reads j from the INT2 cache."""
    sink, recent = window
    j = torch.arange(t, device=device)[None, :]
    i = query_pos[:, None]
    m = (j <= i) if allowed is None else allowed[query_pos]
    return m & (j >= sink) & (i - j >= recent)


def sample_queries(t: int, window: tuple[int, int], n: int, device) -> torch.Tensor:
    """Up to n query positions, evenly spread over those that read any INT2 key."""
    first = window[0] + window[1]
    if first >= t:
        return torch.empty(0, dtype=torch.long, device=device)
    pos = torch.linspace(first, t - 1, steps=min(n, t - first), device=device)
    return pos.round().long().unique()


def covariance_in_frame(c: torch.Tensor, r: np.ndarray) -> torch.Tensor:
    """Rᵀ C R in float64: the query second moment C [H, d, d] seen from the rotated frame."""
    rk = torch.from_numpy(np.asarray(r, np.float64))
    return rk.T @ c.cpu().to(torch.float64) @ rk


class ClipSearch:
    """Accumulates, per layer, the K and V error of every clip of the grid."""

    def __init__(self, rotations: dict[int, tuple[np.ndarray, np.ndarray]],
                 query_covariances: dict[int, torch.Tensor], group: int, grid: list[float] | None = None,
                 window: tuple[int, int] = DEFAULT_WINDOW, max_queries: int = 128):
        self.group = group
        self.grid = grid or clip_grid(group)
        self.window = tuple(int(w) for w in window)
        self.max_queries = max_queries
        self.rot = {i: (torch.from_numpy(np.asarray(rk, np.float32)), torch.from_numpy(np.asarray(rv, np.float32)))
                    for i, (rk, rv) in rotations.items()}
        self.cq = {i: covariance_in_frame(c, rotations[i][0]) for i, c in query_covariances.items()}  # C'_h
        # errors per grid value and KV head: [len(grid), H_kv], allocated on first sight
        self.err_k: dict[int, np.ndarray] = {}
        self.err_v: dict[int, np.ndarray] = {}
        # K-only output error per grid value [len(grid)], and the output's energy
        self.out_err_k: dict[int, np.ndarray] = {}
        self.out_energy: dict[int, float] = {}
        # layers whose mask hides causal pairs: sliding-window layers, whose runtime cache stays
        # f16 (llama_oscar_swa_cache_type) unless it is full-size
        self.sliding: set[int] = set()
        self.sequences = 0

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                allowed: torch.Tensor | None = None) -> None:
        """One sequence of one layer: q [T, H_q, d], k/v [T, H_kv, d]; allowed [T, T] bool
        (query, key) or None for causal."""
        if layer not in self.rot:
            return
        dev = k.device
        t, n_kv, d = k.shape
        shape = AttentionShape(q.shape[1], n_kv, d)
        rk, rv = (r.to(dev) for r in self.rot[layer])
        q, k, v = q.float(), k.float(), v.float()
        if layer == min(self.rot):
            self.sequences += 1
        if allowed is not None and bool((torch.ones_like(allowed).tril() & ~allowed).any()):
            self.sliding.add(layer)
        ek = self.err_k.setdefault(layer, np.zeros((len(self.grid), n_kv)))
        ev = self.err_v.setdefault(layer, np.zeros((len(self.grid), n_kv)))

        # K: Σ_h Σ_{j ≥ sink} e_j C'_h e_jᵀ
        kr = (k @ rk).transpose(0, 1)[:, self.window[0]:]            # [H_kv, T', d]
        gq = self._quantizer(kr) if kr.shape[1] else None
        if gq is not None:
            cq = self.cq[layer].to(dev)
            for n, c in enumerate(self.grid):
                e = (gq(c) - kr).double()
                ek[n] += torch.einsum("htd,hde,hte->h", e, cq, e).cpu().numpy()

        # V: ‖P_q (FQ(vR) − vR)‖² over sampled queries
        pos = sample_queries(t, self.window, self.max_queries, dev)
        if len(pos) == 0:
            return
        qs = group_queries(q[pos], shape).reshape(n_kv, shape.group, len(pos), d)
        logits = torch.einsum("hgsd,htd->hgst", qs, k.transpose(0, 1)) * scaling
        ok = (torch.arange(t, device=dev)[None, :] <= pos[:, None]) if allowed is None else allowed[pos]
        logits = logits.masked_fill(~ok, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        int2 = pair_mask(t, pos, allowed, self.window, dev)
        if gq is not None:
            self._observe_k_output(layer, qs, k, v, logits, p, int2, gq, rk, scaling)
        p = p * int2
        vr = (v @ rv).transpose(0, 1)                               # [H_kv, T, d]
        gv = self._quantizer(vr)
        for n, c in enumerate(self.grid):
            e = gv(c) - vr
            out = torch.einsum("hgst,htd->hgsd", p, e)
            ev[n] += out.double().pow(2).sum(dim=(1, 2, 3)).cpu().numpy()

    def _observe_k_output(self, layer: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          logits: torch.Tensor, p: torch.Tensor, int2: torch.Tensor, gq, rk: torch.Tensor,
                          scaling: float) -> None:
        """‖O_K̂ − O‖² at every clip (keys from INT2 where the runtime reads them, V exact)."""
        vt = v.transpose(0, 1)                                      # [H_kv, T, d]
        out = torch.einsum("hgst,htd->hgsd", p, vt)
        eo = self.out_err_k.setdefault(layer, np.zeros(len(self.grid)))
        self.out_energy[layer] = self.out_energy.get(layer, 0.0) + float(out.double().pow(2).sum())
        kt = k.transpose(0, 1)
        sink = self.window[0]
        for n, c in enumerate(self.grid):
            kd = torch.cat([kt[:, :sink], gq(c) @ rk.T], dim=1)      # the keys as attention reads them
            lq = torch.einsum("hgsd,htd->hgst", qs, kd) * scaling
            lq = torch.where(int2, lq, logits)                       # exact where the window holds them
            oq = torch.einsum("hgst,htd->hgsd", torch.softmax(lq, dim=-1), vt)
            eo[n] += float((oq - out).double().pow(2).sum())

    def k_output_error(self, layer: int, clip: float) -> float:
        """The relative K-only output error of a layer at one clip of the grid (0 if never seen)."""
        if layer not in self.out_err_k or self.out_energy.get(layer, 0.0) <= 0:
            return 0.0
        return float(self.out_err_k[layer][self.grid.index(clip)] / self.out_energy[layer])

    def _quantizer(self, x: torch.Tensor):
        """clip -> FQ(x), the runtime's encoder at every clip of the grid."""
        return GroupQuantizer(x, self.group)

    def best(self, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer argmin over the grid (ties go to the larger clip); 1.0 for layers never seen."""
        if self.sequences == 0:
            raise ValueError("the clip search saw no held-out sequence")
        ck = np.ones(n_layers, dtype=np.float32)
        cv = np.ones(n_layers, dtype=np.float32)
        for i in self.err_k:
            ck[i] = self.grid[int(np.argmin(self.err_k[i].sum(1)))]
            cv[i] = self.grid[int(np.argmin(self.err_v[i].sum(1)))]
        return ck, cv


def fixed_clips(n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    return (np.full(n_layers, FIXED_CLIPS[0], dtype=np.float32),
            np.full(n_layers, FIXED_CLIPS[1], dtype=np.float32))
