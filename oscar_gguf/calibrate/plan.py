"""The precision plan: the few layers whose keys INT2 cannot hold keep an f16 K cache.

Most layers lose little when their keys are read from INT2; a few (outlier channels that the
clip must cut, as in gemma-3's global layers) carry most of the loss. The calibration measures,
per layer, the relative change of the attention output when only the keys are read from INT2
(clip.py, `ClipSearch.k_output_error`, at the layer's chosen clip, with the window). A layer keeps
f16 keys when that error exceeds `threshold`, worst first, while the added bits stay within
`budget` bits per cached element (counted over the K and V caches of the layers that the runtime
stores in oscar2). The plan travels in the GGUF as oscar.f16_k_layers; llama.cpp then creates
those layers' K caches in f16 (ggml-oscar/llama: llama_oscar_layer_type_k), and the simulation
reads their keys exactly.
"""
from __future__ import annotations

from ..format.oscar2 import bits_per_element

F16_BITS = 16.0
DEFAULT_THRESHOLD = 0.2   # relative squared error of the attention output from INT2 keys alone
DEFAULT_BUDGET = 2.5      # added bits per cached element, at most


def added_bits(n_layers: int, group: int) -> float:
    """Bits per cached element that one layer's f16 K cache adds, over n_layers oscar2 layers
    (each with a K and a V cache)."""
    return (F16_BITS - bits_per_element(group)) / (2 * n_layers)


def plan_f16_keys(errors: dict[int, float], group: int, threshold: float = DEFAULT_THRESHOLD,
                  budget: float = DEFAULT_BUDGET) -> tuple[int, ...]:
    """The layers (of those in `errors`, the runtime's oscar2 layers) that keep f16 keys, sorted."""
    if not errors or budget <= 0:
        return ()
    step = added_bits(len(errors), group)
    chosen: list[int] = []
    for layer, err in sorted(errors.items(), key=lambda kv: (-kv[1], kv[0])):
        if err <= threshold or (len(chosen) + 1) * step > budget + 1e-9:
            break
        chosen.append(layer)
    return tuple(sorted(chosen))
