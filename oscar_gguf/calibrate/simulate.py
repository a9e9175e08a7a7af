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

from ..format.gguf_keys import DEFAULT_CLIP_K, DEFAULT_CLIP_V, DEFAULT_WINDOW
from ..format.oscar2 import group_size
from .artifact import RotationArtifact
from .capture_hf import AttentionCall, attention_tap, mask_to_bool
from .fakequant import fake_quantize
from .oscar_rotation import hadamard


@dataclass
class KVConfig:
    """How one simulated run stores K and V. Rotations act on the HF head-dim order."""
    name: str
    k_rot: dict[int, np.ndarray] | None      # None: no rotation
    v_rot: dict[int, np.ndarray] | None
    clip_k: np.ndarray                        # [n_layers]
    clip_v: np.ndarray
    group: int
    window: tuple[int, int] = (0, 0)          # (sink, recent) kept unquantized
    quantize: bool = True                     # False: every layer reads K and V exactly
    quantized_layers: frozenset[int] | None = None   # None: every layer (see runtime_quantized_layers)
    f16_k_layers: frozenset[int] = frozenset()       # the precision plan: K read exactly (plan.py)

    @property
    def label(self) -> str:
        w = f"window {self.window[0]}/{self.window[1]}" if self.window != (0, 0) else "no window"
        return f"{self.name} [{w}]"

    def fake_quantize(self, x: torch.Tensor, clip) -> torch.Tensor:
        """FQ(x) for x [B, H, T, d] at a layer's clip ratio."""
        return fake_quantize(x, self.group, float(clip))

    def stored(self, x: torch.Tensor, rotations: dict[int, np.ndarray] | None, layer: int, clip) -> torch.Tensor:
        """What attention reads back for x [B, H, T, d]: (FQ(x R)) Rᵀ."""
        r = _rot(rotations, layer, x.device)
        if r is None:
            return self.fake_quantize(x, clip)
        return self.fake_quantize(x @ r, clip) @ r.T

    def quantized_scores(self, q: torch.Tensor, k: torch.Tensor, layer: int, scaling: float) -> torch.Tensor:
        """q·K̂ᵀ with the keys as the cache returns them; k [B, H_kv, T, d] is repeated over the group."""
        kq = k if layer in self.f16_k_layers else self.stored(k, self.k_rot, layer, self.clip_k[layer])
        return (q @ kq.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2)) * scaling

    def quantized_values(self, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self.stored(v, self.v_rot, layer, self.clip_v[layer])


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


def runtime_quantized_layers(model: torch.nn.Module) -> frozenset[int] | None:
    """The layers whose cache llama.cpp stores in oscar2 for this model: all (None), except in a
    model with sliding-window layers, whose sliding-window cache holds only n_swa + n_ubatch
    tokens per sequence and stays in f16 (ggml-oscar/llama: llama_oscar_bounded_cache_type)."""
    from .capture_hf import text_config

    types = getattr(text_config(model.config), "layer_types", None) or []
    if "sliding_attention" not in types:
        return None
    return frozenset(i for i, t in enumerate(types) if t != "sliding_attention")


def _rot(r: dict[int, np.ndarray] | None, layer: int, dev) -> torch.Tensor | None:
    if r is None or layer not in r:
        return None
    return torch.as_tensor(np.asarray(r[layer], dtype=np.float32), device=dev)


def simulated_attention(call: AttentionCall, cfg: KVConfig, stats: RunStats | None) -> torch.Tensor:
    q, k, v = call.query.float(), call.key.float(), call.value.float()
    b, h_q, t, d = q.shape
    g = h_q // k.shape[1]
    layer, dev = call.layer, q.device
    allowed = mask_to_bool(call.mask, t, k.shape[2], dev)                     # [B|1, 1, T, T]
    kx = k.repeat_interleave(g, dim=1)
    vx = v.repeat_interleave(g, dim=1)
    s_exact = (q @ kx.transpose(-1, -2)) * call.scaling
    softcap = call.kwargs.get("softcap")
    quantize = cfg.quantize and (cfg.quantized_layers is None or layer in cfg.quantized_layers)
    if quantize:
        s_q = cfg.quantized_scores(q, k, layer, call.scaling)
        vq = cfg.quantized_values(v, layer).repeat_interleave(g, dim=1)
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
    if quantize:
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


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor, rows: int = 128) -> tuple[float, int]:
    """Σ over positions of KL(p_ref ‖ p) and the count of equal argmax tokens.

    In float64, `rows` positions at a time: a 256k-token vocabulary makes a block of a few hundred
    positions cost gigabytes."""
    kl_sum, same = 0.0, 0
    for i in range(0, ref_logits.shape[0], rows):
        r, q = ref_logits[i:i + rows], logits[i:i + rows]
        lp_ref = torch.log_softmax(r.double(), dim=-1)
        lp = torch.log_softmax(q.double(), dim=-1)
        kl_sum += float((lp_ref.exp() * (lp_ref - lp)).sum())
        same += int((r.argmax(-1) == q.argmax(-1)).sum())
    return kl_sum, same


def _scored_logits(model, ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Logits of positions lo..hi-1 only (the model skips the output projection of the others)."""
    t = ids.shape[1]
    out = model(ids, use_cache=False, logits_to_keep=t - lo).logits[0]
    return out[:hi - lo].float()


@torch.no_grad()
def run_simulation(model: torch.nn.Module, chunks: np.ndarray, configs: list[KVConfig], progress=None,
                   score_from: float = 0.5, deadline: float | None = None,
                   score_last: bool = True) -> dict[str, RunStats]:
    """Mean next-token KL (and per-layer attention error) of every config on the chunks.

    Positions from `score_from` of each chunk are scored; without `score_last`, the chunk's last
    position is left out, as llama-perplexity does (it has no next token to predict).

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
        hi = t if score_last else t - 1
        ref = _scored_logits(model, ids, lo, hi)
        for cfg in configs:
            cur["cfg"], cur["stats"] = cfg, results[cfg.label]
            with attention_tap(model, handler):
                logits = _scored_logits(model, ids, lo, hi)
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


def standard_configs(art: RotationArtifact, window: tuple[int, int] = DEFAULT_WINDOW,
                     quantized_layers: frozenset[int] | None = None) -> list[KVConfig]:
    """The standard comparison for an artifact ROT: no rotation, Hadamard, Hadamard with
    ROT's clips, ROT's rotations with the fixed clips and with ROT's own clips; each without
    and with the high-precision window. ROT's rows are named after its recipe ("oscar" for
    OSCAR's rotation, "learned", ...)."""
    hf = art.to_hf_layout()
    n, d = hf.n_layers, hf.head_dim
    group = group_size(d)
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
            out.append(KVConfig(c.name, c.k_rot, c.v_rot, c.clip_k, c.clip_v, c.group, window=w,
                                quantized_layers=quantized_layers))
    if hf.f16_k_layers:
        # the artifact's own row with its precision plan, as the runtime would run it
        out.append(KVConfig(f"{name}, {clips} clips, f16 K in {len(hf.f16_k_layers)} layer(s)", hf.k_rot, hf.v_rot,
                            hf.clip_k, hf.clip_v, group, window=tuple(window), quantized_layers=quantized_layers,
                            f16_k_layers=frozenset(hf.f16_k_layers)))
    return out
