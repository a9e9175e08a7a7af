"""transformers backend: see every attention call's post-RoPE Q, K and V.

How. transformers dispatches attention through a registry (``ALL_ATTENTION_FUNCTIONS``)
keyed by ``config._attn_implementation``. We register one more implementation,
"oscar_tap", switch the model to it while a tap is open, and switch back afterwards. Our
function receives exactly what the model's own attention would: Q after RoPE and after
QK-norm (qwen3, gemma3), K after RoPE, V, and the model's mask. It reports them to the
open tap and either returns the tap's own output (the simulation) or falls through to
transformers' SDPA. No model code is forked or patched.

The mask for "oscar_tap" comes from the same registry as SDPA's (a boolean mask, or None
for plain causal attention), so sliding-window layers (gemma3) keep their windows.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

TAP_NAME = "oscar_tap"

# HF model_type -> GGUF architecture name (llama.cpp's), for the artifact and the layout.
HF_TO_GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",     # Mistral GGUFs use the llama architecture (and its Q/K permutation)
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
}


class UnsupportedModelError(ValueError):
    """The model cannot be calibrated by this backend; the message says why."""


@dataclass
class AttentionCall:
    """One attention call: tensors as the model's attention sees them."""
    layer: int
    query: torch.Tensor          # [B, H_q, T, d] post-RoPE, post-QK-norm
    key: torch.Tensor            # [B, H_kv, T, d] post-RoPE
    value: torch.Tensor          # [B, H_kv, T, d]
    mask: torch.Tensor | None    # boolean [B, 1, T, T] (True = attend), float additive, or None = causal
    scaling: float
    module: torch.nn.Module
    kwargs: dict


# A handler returns None (let SDPA compute the output) or the attention output [B, T, H_q, d].
Handler = Callable[[AttentionCall], "torch.Tensor | None"]

_lock = threading.Lock()
_active: dict[int, tuple[Handler, dict[int, int]]] = {}   # id(tap) -> (handler, id(module) -> layer)
_registered = False


def _tap_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for handler, modules in list(_active.values()):
        layer = modules.get(id(module))
        if layer is None:
            continue
        call = AttentionCall(layer, query, key, value, attention_mask,
                             float(scaling if scaling is not None else query.shape[-1] ** -0.5), module, kwargs)
        out = handler(call)
        if out is not None:
            return out, None
        break
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(TAP_NAME, _tap_attention)
    AttentionMaskInterface.register(TAP_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _registered = True


def attention_modules(model: torch.nn.Module) -> dict[int, int]:
    """id(module) -> layer index for every self-attention module (those with a layer_idx
    and q/k/v projections)."""
    out = {}
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "v_proj"):
            out[id(m)] = int(m.layer_idx)
    return out


def _configs(model: torch.nn.Module):
    seen = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            yield cfg


@contextlib.contextmanager
def attention_tap(model: torch.nn.Module, handler: Handler):
    """While open, every attention call of `model` goes through `handler`."""
    modules = attention_modules(model)
    if not modules:
        raise UnsupportedModelError(f"{type(model).__name__} has no attention modules this backend knows "
                                    f"(expected q_proj/k_proj/v_proj with a layer_idx)")
    with _lock:
        _register()
        saved = [(cfg, cfg._attn_implementation) for cfg in _configs(model)]
        for cfg, _ in saved:
            cfg._attn_implementation = TAP_NAME
        key = id(handler)
        _active[key] = (handler, modules)
    try:
        yield
    finally:
        with _lock:
            _active.pop(key, None)
            for cfg, impl in saved:
                cfg._attn_implementation = impl


def gguf_architecture(config) -> str:
    """GGUF architecture name for an HF config, or UnsupportedModelError."""
    mt = getattr(config, "model_type", None)
    if mt not in HF_TO_GGUF_ARCH:
        raise UnsupportedModelError(
            f"model type {mt!r} is not supported by the transformers backend "
            f"(supported: {', '.join(sorted(HF_TO_GGUF_ARCH))}); for a GGUF file try --backend llama")
    return HF_TO_GGUF_ARCH[mt]


def text_config(config):
    """The decoder config (gemma3 multimodal checkpoints nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The base decoder (no LM head): calibration needs no logits, and skipping the head saves
    a [T, vocab] activation."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return base if isinstance(base, torch.nn.Module) else model


def mask_to_bool(mask: torch.Tensor | None, t_q: int, t_k: int, device) -> torch.Tensor:
    """[B or 1, 1, T_q, T_k] boolean allowed-pairs mask from whatever the model passed."""
    if mask is None:
        causal = torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)
        return causal[None, None]
    if mask.dtype == torch.bool:
        return mask[..., :t_q, :t_k]
    return mask[..., :t_q, :t_k] > torch.finfo(mask.dtype).min / 2
