"""Names every part agrees on: GGUF keys and tensor names, the runtime's defaults for what
the keys do not say, and the patched tools' flags.

The patched llama.cpp reads the same names (ggml-oscar/llama/llama-oscar.cpp) and applies the
same defaults; change them in both places or nowhere.
"""
from __future__ import annotations

FORMAT_VERSION = 1

# --- tensors: f32 [head_dim, head_dim], numpy row-major R with x_rot = x @ R ---------------
K_ROT = "blk.{}.attn_k_rot"
V_ROT = "blk.{}.attn_v_rot"

# --- metadata ---------------------------------------------------------------------------------
KEY_FORMAT_VERSION = "oscar.format_version"    # uint32
KEY_GROUP_SIZE = "oscar.group_size"            # uint32, the group the clips were chosen for
KEY_CLIP_K = "oscar.clip_k"                    # f32 array [n_layer]; 1.0 = no clipping
KEY_CLIP_V = "oscar.clip_v"                    # f32 array [n_layer]
KEY_F16_K_LAYERS = "oscar.f16_k_layers"        # uint32 array: layers whose K cache stays f16 under
                                               # an oscar2 cache type (the calibration's precision plan)
KEY_SINK = "oscar.window.sink"                 # uint32, default sink tokens kept in f16
KEY_RECENT = "oscar.window.recent"             # uint32, default recent tokens kept in f16
KEY_ROPE_LAYOUT = "oscar.rope_layout"          # string, always "llama.cpp" inside a GGUF
KEY_CALIB_PREFIX = "oscar.calibration."        # strings: model, corpus, tokens, method, date, tool
OSCAR_PREFIX = "oscar."

# --- the runtime's defaults, for a GGUF whose oscar.* keys do not set them --------------------
DEFAULT_CLIP_K = 0.96   # the OSCAR paper's pair, as OSCAR2_DEFAULT_CLIP_K / _V in ggml-oscar/oscar2.h
DEFAULT_CLIP_V = 0.92
DEFAULT_SINK = 64       # the f16 window: the first and the most recent tokens of each sequence,
DEFAULT_RECENT = 256    # as llama_hparams' oscar_sink / oscar_recent (the patched llama-hparams.h)
DEFAULT_WINDOW = (DEFAULT_SINK, DEFAULT_RECENT)

# --- command-line flags of the patched tools (llama-cli/server/perplexity/bench) ------------
FLAG_SINK = "--oscar-sink"          # N tokens at the start of each sequence in f16 (0 = none)
FLAG_RECENT = "--oscar-recent"      # N most recent tokens of each sequence in f16 (0 = none)
FLAG_WINDOW_TYPE = "--oscar-window-type"  # f16 | bf16
FLAG_ROT = "--oscar-rot"            # gguf (default) | hadamard | none
FLAG_CLIP_K = "--oscar-clip-k"      # override every layer's K clip ratio (1 = no clipping)
FLAG_CLIP_V = "--oscar-clip-v"      # override every layer's V clip ratio
FLAG_STRICT = "--oscar-strict"      # oscar2 on a GGUF without rotations is an error, not a warning


def parse_rotation_name(name: str) -> tuple[str, str] | None:
    """("k" | "v", the layer part) of blk.{i}.attn_k_rot / attn_v_rot, whatever text the layer
    part holds; None for any other name."""
    for kind, fmt in (("k", K_ROT), ("v", V_ROT)):
        prefix, suffix = fmt.split("{}")
        if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix):
            return kind, name[len(prefix):len(name) - len(suffix)]
    return None
