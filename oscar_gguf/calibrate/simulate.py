"""Simulated oscar2 KV cache in a transformers model: next-token KL and attention error.

Each attention call of the model is replaced (through the same registry tap as the
calibration) by an exact eager attention that reads K and V the way the runtime does:
rotated by the layer's R, quantized and dequantized with the bit-exact oscar2 reference
(fakequant.py), un-rotated by Rᵀ -- except for the high-precision window: the first
`sink` keys and, for a query at position i, the keys after i − `recent` are read
unquantized (decode semantics: the window slides with the query).

Next-token KL is KL(p_ref ‖ p_quant) against the same model with an unquantized cache,
over the second half of each chunk (as llama-perplexity scores it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..quant import DEFAULT_CLIP_K, DEFAULT_CLIP_V
from .artifact import RotationArtifact
from .capture_hf import AttentionCall, attention_tap, mask_to_bool
from .fakequant import fake_quantize
from .fit import hadamard


@dataclass
class KVConfig:
    """How one simulated run stores K and V. Rotations act on the HF head-dim order."""
    name: str
    k_rot: dict[int, np.ndarray] | None      # None: no rotation
    v_rot: dict[int, np.ndarray] | None
    clip_k: np.ndarray                        # [n_layers], or [n_layers, H_kv] per head (study only)
    clip_v: np.ndarray
    group: int
    window: tuple[int, int] = (0, 0)          # (sink, recent) kept unquantized
    quantize: bool = True
    layers: set[int] | None = None            # None: every layer with attention
    k_transform: dict[int, tuple[np.ndarray, np.ndarray]] | None = None   # (A, A⁻ᵀ): store k·A, read q·A⁻ᵀ
    quantizer: object = None                  # callable(x, group, clip) -> x̂; default fakequant
    quantize_k: bool = True                   # False: K read exactly (diagnostics)
    quantize_v: bool = True

    @property
    def label(self) -> str:
        w = f"window {self.window[0]}/{self.window[1]}" if self.window != (0, 0) else "no window"
        return f"{self.name} [{w}]"


@dataclass
class RunStats:
    kl_sum: float = 0.0
    top1_same: int = 0
    positions: int = 0
    attn_err: dict[int, list[float]] = field(default_factory=dict)   # layer -> [Σ‖ΔO‖², Σ‖O‖²]
    chunk_kl: list[float] = field(default_factory=list)              # mean KL of each chunk (paired tests)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(1, self.positions)

    @property
    def same_top1(self) -> float:
        return self.top1_same / max(1, self.positions)

    def layer_errors(self) -> dict[int, float]:
        return {i: e / max(o, 1e-30) for i, (e, o) in sorted(self.attn_err.items())}


def _rot(r: dict[int, np.ndarray] | None, layer: int, dev) -> torch.Tensor | None:
    if r is None or layer not in r:
        return None
    return torch.as_tensor(np.asarray(r[layer], dtype=np.float32), device=dev)


def _fq_heads(x: torch.Tensor, group: int, clip, quantizer) -> torch.Tensor:
    """Fake-quantize x [B, H, T, d] with one clip, or one clip per head (an array [H])."""
    fq = quantizer or fake_quantize
    c = np.asarray(clip, dtype=np.float64)
    if c.ndim == 0:
        return fq(x, group, float(c))
    return torch.stack([fq(x[:, h], group, float(c[h])) for h in range(x.shape[1])], dim=1)


def _store(x: torch.Tensor, r: torch.Tensor | None, group: int, clip, quantizer) -> torch.Tensor:
    """What attention reads back for x [B, H, T, d]: (FQ(x R)) Rᵀ."""
    if r is None:
        return _fq_heads(x, group, clip, quantizer)
    return _fq_heads(x @ r, group, clip, quantizer) @ r.T


def simulated_attention(call: AttentionCall, cfg: KVConfig, stats: RunStats | None) -> torch.Tensor:
    q, k, v = call.query.float(), call.key.float(), call.value.float()
    b, h_q, t, d = q.shape
    g = h_q // k.shape[1]
    layer, dev = call.layer, q.device
    use = cfg.quantize and (cfg.layers is None or layer in cfg.layers)
    allowed = mask_to_bool(call.mask, t, k.shape[2], dev)                     # [B|1, 1, T, T]
    kx = k.repeat_interleave(g, dim=1)
    vx = v.repeat_interleave(g, dim=1)
    s_exact = (q @ kx.transpose(-1, -2)) * call.scaling
    softcap = call.kwargs.get("softcap")
    if use:
        ck, cv = cfg.clip_k[layer], cfg.clip_v[layer]        # a ratio, or one per KV head
        if cfg.k_transform is not None and layer in cfg.k_transform:
            a, a_inv_t = (torch.as_tensor(np.asarray(m, np.float32), device=dev) for m in cfg.k_transform[layer])
            kq = _fq_heads(k @ a, cfg.group, ck, cfg.quantizer)
            s_q = ((q @ a_inv_t) @ kq.repeat_interleave(g, dim=1).transpose(-1, -2)) * call.scaling
        else:
            kq = _store(k, _rot(cfg.k_rot, layer, dev), cfg.group, ck, cfg.quantizer)
            s_q = (q @ kq.repeat_interleave(g, dim=1).transpose(-1, -2)) * call.scaling
        if not cfg.quantize_k:
            s_q = s_exact
        vq = _store(v, _rot(cfg.v_rot, layer, dev), cfg.group, cv, cfg.quantizer) if cfg.quantize_v else v
        vq = vq.repeat_interleave(g, dim=1)
        i = torch.arange(t, device=dev)[:, None]
        j = torch.arange(k.shape[2], device=dev)[None, :]
        sink, recent = cfg.window
        hp = (j < sink) | (i - j < recent)                                      # read unquantized
        s = torch.where(hp, s_exact, s_q)
    else:
        s = s_exact
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    if use:
        hpf = hp.to(p.dtype)
        out = (p * hpf) @ vx + (p * (1 - hpf)) @ vq
        if stats is not None:
            se = s_exact if not softcap else torch.tanh(s_exact / softcap) * softcap
            ref = torch.softmax(se.masked_fill(~allowed, float("-inf")), dim=-1) @ vx
            acc = stats.attn_err.setdefault(layer, [0.0, 0.0])
            acc[0] += float((out - ref).double().pow(2).sum())
            acc[1] += float(ref.double().pow(2).sum())
    else:
        out = p @ vx
    return out.to(call.query.dtype).transpose(1, 2).contiguous()


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, int]:
    """Σ over positions of KL(p_ref ‖ p) and the count of equal argmax tokens."""
    lp_ref = torch.log_softmax(ref_logits.double(), dim=-1)
    lp = torch.log_softmax(logits.double(), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    same = (ref_logits.argmax(-1) == logits.argmax(-1)).sum()
    return float(kl.sum()), int(same)


@torch.no_grad()
def run_simulation(model: torch.nn.Module, chunks: np.ndarray, configs: list[KVConfig], progress=None,
                   score_from: float = 0.5, deadline: float | None = None) -> dict[str, RunStats]:
    """Mean next-token KL (and per-layer attention error) of every config on the chunks.

    With a deadline (time.monotonic() value), stops after the chunk during which it passed;
    every config has then seen the same chunks."""
    import time

    dev = next(model.parameters()).device
    results = {c.label: RunStats() for c in configs}
    cur: dict = {}

    def handler(call: AttentionCall):
        return simulated_attention(call, cur["cfg"], cur["stats"])

    for chunk in chunks:
        ids = torch.as_tensor(np.asarray(chunk), dtype=torch.long, device=dev)[None]
        t = ids.shape[1]
        lo = int(math.floor(t * score_from))
        ref = model(ids, use_cache=False).logits[0, lo:].float()
        for cfg in configs:
            cur["cfg"], cur["stats"] = cfg, results[cfg.label]
            with attention_tap(model, handler):
                logits = model(ids, use_cache=False).logits[0, lo:].float()
            kl, same = kl_and_top1(ref, logits)
            st = results[cfg.label]
            st.kl_sum += kl
            st.top1_same += same
            st.positions += ref.shape[0]
            st.chunk_kl.append(kl / ref.shape[0])
            if progress is not None:
                progress.update(1)
        if deadline is not None and time.monotonic() > deadline:
            break
    return results


def standard_configs(art: RotationArtifact, window: tuple[int, int] = (64, 256)) -> list[KVConfig]:
    """The comparison of issue 4 for an artifact ROT: no rotation, Hadamard, Hadamard with
    ROT's clips, ROT's rotations with the fixed clips and with ROT's own clips; each without
    and with the high-precision window. ROT's rows are named after its recipe ("oscar" for
    DESIGN's rotation, "learned", ...)."""
    hf = art.to_hf_layout()
    n, d = hf.n_layers, hf.head_dim
    from ..quant import GROUP_SIZE, type_for_head_dim
    group = GROUP_SIZE[type_for_head_dim(d)]
    ones = np.ones(n, dtype=np.float32)
    fixed_k = np.full(n, DEFAULT_CLIP_K, np.float32)
    fixed_v = np.full(n, DEFAULT_CLIP_V, np.float32)
    h = hadamard(d).astype(np.float32)
    had = {i: h for i in hf.layers}
    clips = "searched" if hf.extra.get("clip_mode") == "search" else "its"
    recipe = hf.extra.get("rotation", "oscar")
    name = "OSCAR" if recipe == "oscar" else f"ROT ({recipe})"
    base = [
        KVConfig("no rotation, clip 1.0", None, None, ones, ones, group),
        KVConfig("Hadamard, clip 1.0", had, had, ones, ones, group),
        KVConfig("Hadamard, clips .96/.92", had, had, fixed_k, fixed_v, group),
        KVConfig(f"Hadamard, ROT's {clips} clips", had, had, hf.clip_k, hf.clip_v, group),
        KVConfig(f"{name}, clip 1.0", hf.k_rot, hf.v_rot, ones, ones, group),
        KVConfig(f"{name}, clips .96/.92", hf.k_rot, hf.v_rot, fixed_k, fixed_v, group),
        KVConfig(f"{name}, {clips} clips", hf.k_rot, hf.v_rot, hf.clip_k, hf.clip_v, group),
    ]
    out = []
    for w in ((0, 0), tuple(window)):
        for c in base:
            out.append(KVConfig(c.name, c.k_rot, c.v_rot, c.clip_k, c.clip_v, c.group, window=w))
    return out
