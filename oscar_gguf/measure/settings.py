"""The KV-cache settings the measuring tools compare, as data: `oscar eval`, `oscar eval
--passkey` and `oscar demo` run the same ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..format import gguf_keys as K
from .tool_runs import EvalError

_FIXED_INT2 = (K.FLAG_CLIP_K, "1", K.FLAG_CLIP_V, "1", K.FLAG_SINK, "0", K.FLAG_RECENT, "0")


@dataclass(frozen=True)
class KVSetting:
    key: str                          # short id for the command line ("oscar", "q4_0", ...)
    name: str                         # as shown in tables
    cache_type: str                   # -ctk / -ctv
    args: tuple[str, ...] = ()        # extra flags of the patched tools
    env: tuple[tuple[str, str], ...] = ()
    needs_rotations: bool = False     # only meaningful on a GGUF that carries OSCAR rotations
    window: bool = False              # keeps the GGUF's sink + recent tokens in f16

    def tool_args(self) -> list[str]:
        return ["-ctk", self.cache_type, "-ctv", self.cache_type, "-fa", "on", *self.args]


SETTINGS: tuple[KVSetting, ...] = (
    KVSetting("f16", "f16", "f16"),
    KVSetting("q8_0", "q8_0", "q8_0"),
    KVSetting("q4_0", "q4_0", "q4_0"),
    # the env var turns off upstream's built-in Hadamard; --oscar-rot none also keeps a
    # rotated GGUF's own matrices out, so the row is plain INT2 on any model
    KVSetting("int2", "INT2, no rotation", "oscar2", (K.FLAG_ROT, "none", *_FIXED_INT2),
              env=(("LLAMA_ATTN_ROT_DISABLE", "1"),)),
    KVSetting("int2-hadamard", "INT2 + Hadamard", "oscar2", (K.FLAG_ROT, "hadamard", *_FIXED_INT2)),
    # the honest ablation of the rotation itself: OSCAR's clips and window, Hadamard's rotation
    KVSetting("hadamard-oscar", "Hadamard + OSCAR clips + window", "oscar2", (K.FLAG_ROT, "hadamard"),
              needs_rotations=True, window=True),
    KVSetting("oscar-nowin", "OSCAR, no window", "oscar2", (K.FLAG_SINK, "0", K.FLAG_RECENT, "0"),
              needs_rotations=True),
    KVSetting("oscar", "OSCAR + window", "oscar2", needs_rotations=True, window=True),
)
SETTINGS_BY_KEY = {s.key: s for s in SETTINGS}
BASE_SETTING = SETTINGS_BY_KEY["f16"]
VERBOSE_LOG = ("-lv", "4")  # makes libllama print the "llama_kv_cache: size = ..." line


def resolve_settings(settings: Sequence[KVSetting | str] | None) -> list[KVSetting]:
    """KVSetting objects from a mix of settings and keys; None means all."""
    if settings is None:
        return list(SETTINGS)
    keys = [s for s in settings if isinstance(s, str)]
    select_settings(keys)  # a clear error for unknown keys
    return [SETTINGS_BY_KEY[s] if isinstance(s, str) else s for s in settings]


def select_settings(keys: Iterable[str] | None) -> list[KVSetting]:
    """Settings by key, in the order of SETTINGS; None means all."""
    if keys is None:
        return list(SETTINGS)
    keys = list(keys)
    unknown = [k for k in keys if k not in SETTINGS_BY_KEY]
    if unknown:
        raise EvalError(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS_BY_KEY)}")
    return [s for s in SETTINGS if s.key in keys]
