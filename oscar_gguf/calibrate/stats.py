"""Streaming float64 statistics for the OSCAR covariances (docs/design.md §1).

Memory is bounded by the sums, not by the text: per layer and KV head two d×d float64
matrices. The V statistics weight each token by w_t = k_t C_h k_tᵀ, which needs the
finished query covariance C_h, so they are accumulated in a second pass over the text.

Normalising the weights to mean 1 per KV head makes S_h = Σ_t w_t v_tᵀv_t / Σ_t w_t,
so the normalisation is exact while streaming: we keep Σ w v vᵀ and Σ w.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .oscar_rotation import symmetrize


@dataclass(frozen=True)
class AttentionShape:
    """Geometry of one attention layer: H_q query heads, H_kv KV heads, head_dim d."""
    n_head: int
    n_head_kv: int
    head_dim: int

    def __post_init__(self):
        if self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise ValueError(f"{self.n_head} query heads cannot be grouped over {self.n_head_kv} KV heads")

    @property
    def group(self) -> int:
        """g = H_q / H_kv; query head j belongs to KV head j // g."""
        return self.n_head // self.n_head_kv


def group_queries(q: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """[N, H_q, d] -> [H_kv, N*g, d]: the queries that read each KV head (GQA grouping)."""
    n = q.shape[0]
    q = q.reshape(n, shape.n_head_kv, shape.group, shape.head_dim)
    return q.permute(1, 0, 2, 3).reshape(shape.n_head_kv, n * shape.group, shape.head_dim)


class LayerStats:
    """Sums for one layer. Feed add_queries over the whole text, then add_values."""

    def __init__(self, shape: AttentionShape):
        self.shape = shape
        self.q_sum: torch.Tensor | None = None      # [H_kv, d, d] Σ Q_hᵀQ_h
        self.q_rows = 0                             # rows per KV head: tokens · g
        self.vw_sum: torch.Tensor | None = None     # [H_kv, d, d] Σ_t w_t v_tᵀv_t
        self.w_sum: torch.Tensor | None = None      # [H_kv] Σ_t w_t
        self.k_sum: torch.Tensor | None = None      # [H_kv, d, d] Σ k_tᵀk_t (studies of K transforms)
        self.v_rows = 0
        self._c_cache: torch.Tensor | None = None

    # -- pass 1 --------------------------------------------------------------------------
    def add_queries(self, q: torch.Tensor) -> None:
        """q: [..., H_q, d] post-RoPE (post-QK-norm) queries of any number of tokens."""
        s = self.shape
        q = q.detach().reshape(-1, s.n_head, s.head_dim).to(torch.float64)
        qg = group_queries(q, s)
        part = qg.transpose(1, 2) @ qg
        self.q_sum = part if self.q_sum is None else self.q_sum + part
        self.q_rows += qg.shape[1]
        self._c_cache = None

    def query_covariances(self) -> torch.Tensor:
        """C_h = Q_hᵀQ_h / (T·g), [H_kv, d, d] float64."""
        if self.q_sum is None or self.q_rows == 0:
            raise RuntimeError("no queries were observed for this layer")
        if self._c_cache is None:
            self._c_cache = self.q_sum / self.q_rows
        return self._c_cache

    # -- pass 2 --------------------------------------------------------------------------
    def token_weights(self, k: torch.Tensor) -> torch.Tensor:
        """w[n, h] = k_{n,h} C_h k_{n,h}ᵀ for k: [N, H_kv, d] (unnormalised)."""
        c = self.query_covariances().to(k.device)
        return torch.einsum("nhd,hde,nhe->nh", k, c, k)

    def add_values(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [..., H_kv, d]; needs add_queries to be complete."""
        s = self.shape
        k = k.detach().reshape(-1, s.n_head_kv, s.head_dim).to(torch.float64)
        v = v.detach().reshape(-1, s.n_head_kv, s.head_dim).to(torch.float64)
        w = self.token_weights(k)
        vt = v.permute(1, 0, 2)                       # [H_kv, N, d]
        part = (vt * w.T[:, :, None]).transpose(1, 2) @ vt
        self.vw_sum = part if self.vw_sum is None else self.vw_sum + part
        ws = w.sum(0)
        self.w_sum = ws if self.w_sum is None else self.w_sum + ws
        kt = k.permute(1, 0, 2)
        ks = kt.transpose(1, 2) @ kt
        self.k_sum = ks if self.k_sum is None else self.k_sum + ks
        self.v_rows += v.shape[0]

    # -- results -------------------------------------------------------------------------
    def k_covariance(self) -> np.ndarray:
        """Σ_K = mean_h C_h, symmetrised ("qqt")."""
        return symmetrize(self.query_covariances().mean(0).cpu().numpy())

    def v_head_covariances(self) -> np.ndarray:
        if self.vw_sum is None or self.v_rows == 0:
            raise RuntimeError("no values were observed for this layer")
        w = self.w_sum.cpu().numpy()
        if not np.all(w > 0):
            raise ValueError("the V weights sum to zero for a KV head (all-zero keys or queries?)")
        return self.vw_sum.cpu().numpy() / w[:, None, None]

    def key_covariance(self) -> np.ndarray:
        """mean_h E[kᵀk]: the keys' own second moment (not used by OSCAR, which fits K on queries)."""
        if self.k_sum is None:
            raise RuntimeError("no keys were observed for this layer")
        return symmetrize(self.k_sum.mean(0).cpu().numpy() / self.v_rows)

    def v_covariance(self) -> np.ndarray:
        """Σ_V = mean_h S_h, S_h = Σ_t ŵ_t v_tᵀv_t / T with ŵ normalised to mean 1 ("sst")."""
        return symmetrize(self.v_head_covariances().mean(0))


class ModelStats:
    """LayerStats for every attention layer of a model, keyed by layer index."""

    def __init__(self, shapes: dict[int, AttentionShape]):
        self.layers = {i: LayerStats(s) for i, s in shapes.items()}

    def __getitem__(self, layer: int) -> LayerStats:
        return self.layers[layer]

    def tokens_seen(self) -> int:
        counts = {s.q_rows // s.shape.group for s in self.layers.values()}
        return max(counts) if counts else 0
