"""KV-cache memory: what each cache type stores per element and per token, what the f16 window
adds, what attention reads at a depth, and what llama.cpp logged it allocated.

Block sizes come from gguf-py (the ggml types) and from format/oscar2.py (oscar2, whose group
follows head_dim: 128 where it divides head_dim, else 64).
"""
from __future__ import annotations

import re
from typing import Sequence

from ..format import gguf_keys as K
from ..format import oscar2
from ..format.gguf_read import ModelInfo
from ..runtime import KV_TYPES, parse_kv_sizes
from .settings import KVSetting
from .tool_runs import EvalError

N_UBATCH = 512    # llama.cpp's default micro-batch, for which the window store keeps spare slots
WINDOW_PAD = 64  # llama.cpp's window store rounds its rows up to this (plus one trash row; HP_PAD)


def _block(cache_type: str) -> tuple[int, int]:
    """(elements, bytes) of one block of a ggml cache type."""
    import gguf
    if cache_type not in KV_TYPES:
        raise EvalError(f"no bits/element known for KV type {cache_type}")
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(KV_TYPES[cache_type])]


def row_bytes(cache_type: str, head_dim: int) -> int:
    """Bytes llama.cpp stores for one head's K or V vector of head_dim elements."""
    if cache_type.startswith("oscar2"):
        g = oscar2.group_size(head_dim)
        return head_dim // g * oscar2.block_bytes(g)
    per, nbytes = _block(cache_type)
    if head_dim % per:
        raise ValueError(f"{cache_type} needs head_dim to be a multiple of {per}, got {head_dim}")
    return head_dim // per * nbytes


def storage_bits(cache_type: str, info: ModelInfo) -> float:
    """Bits per element of a KV type as llama.cpp stores it for this model."""
    if cache_type.startswith("oscar2"):
        # the group follows head_dim; K and V may differ
        bk = oscar2.bits_per_element(oscar2.group_size(info.head_dim_k))
        bv = oscar2.bits_per_element(oscar2.group_size(info.head_dim_v))
        return (bk * info.head_dim_k + bv * info.head_dim_v) / (info.head_dim_k + info.head_dim_v)
    per, nbytes = _block(cache_type)
    return 8.0 * nbytes / per


def window_of(info: ModelInfo) -> tuple[int, int]:
    """(sink, recent) tokens of the model's default f16 window (the runtime's defaults if the
    GGUF does not say)."""
    return (info.window_sink if info.window_sink is not None else K.DEFAULT_SINK,
            info.window_recent if info.window_recent is not None else K.DEFAULT_RECENT)


def window_tokens(setting: KVSetting, info: ModelInfo, n_ctx: int) -> int:
    """Tokens of one sequence of n_ctx that the setting keeps in f16."""
    if not setting.window:
        return 0
    return min(n_ctx, sum(window_of(info)))


def effective_bits(setting: KVSetting, info: ModelInfo, n_ctx: int) -> float:
    """Bits per element over a full sequence of n_ctx: window tokens count at 16 bits."""
    b = storage_bits(setting.cache_type, info)
    w = window_tokens(setting, info, n_ctx)
    return (w * 16.0 + (n_ctx - w) * b) / n_ctx


def kv_bytes_per_token(info: ModelInfo, bits_per_element: float) -> float:
    """K plus V bytes of one token over all layers at a given bits/element."""
    return info.n_layer * info.n_head_kv * (info.head_dim_k + info.head_dim_v) * bits_per_element / 8


def kv_bytes_at_depth(info: ModelInfo, kv_type: str, depth: int, window: int = 0) -> float:
    """K + V bytes attention reads for one new token after `depth` cached tokens.

    For oscar2 the window tokens are read from the f16 store instead of INT2."""
    if kv_type.startswith("oscar2") and window:
        w = min(depth, window)
        return (kv_bytes_per_token(info, storage_bits(kv_type, info)) * (depth - w)
                + kv_bytes_per_token(info, 16.0) * w)
    return kv_bytes_per_token(info, storage_bits(kv_type, info)) * depth


def window_from_args(info: ModelInfo, oscar_args: Sequence[str]) -> int:
    """Sink + recent tokens in f16 for oscar2 runs: the flags if given, else the GGUF's
    defaults (the runtime uses the same defaults on a GGUF without oscar.* keys)."""
    sink, recent = window_of(info)
    a = list(oscar_args)
    for flag, name in ((K.FLAG_SINK, "sink"), (K.FLAG_RECENT, "recent")):
        if flag in a and a.index(flag) + 1 < len(a):
            v = int(a[a.index(flag) + 1])
            sink, recent = (v, recent) if name == "sink" else (sink, v)
    return sink + recent


# ---- the f16 window store and a whole sequence --------------------------------------------------

def padded_window_rows(slots: int) -> int:
    """Window slots as the rows llama.cpp stores and attends over: rounded up to WINDOW_PAD."""
    return -(-slots // WINDOW_PAD) * WINDOW_PAD


def window_rows(window_tokens: int, n_ctx: int, n_ubatch: int = N_UBATCH) -> int:
    """Rows of llama.cpp's f16 window store for one sequence: sink + recent slots plus one
    micro-batch more, at most n_ctx, padded to WINDOW_PAD, plus one trash row."""
    return padded_window_rows(min(n_ctx, window_tokens + n_ubatch)) + 1


def kv_bytes(info: ModelInfo, cache_type: str, n_ctx: int, window_tokens: int = 0) -> dict:
    """K+V bytes of one sequence of n_ctx tokens: the main cache, and for oscar2 with a
    window the f16 store as llama.cpp allocates it (see window_rows)."""
    per_tok = info.n_layer * info.n_head_kv * (row_bytes(cache_type, info.head_dim_k)
                                               + row_bytes(cache_type, info.head_dim_v))
    main = per_tok * n_ctx
    win = 0
    if window_tokens:
        win = info.n_layer * info.n_head_kv * (row_bytes("f16", info.head_dim_k)
                                               + row_bytes("f16", info.head_dim_v)) * window_rows(window_tokens, n_ctx)
    total = main + win
    n_elem = info.n_layer * info.n_head_kv * (info.head_dim_k + info.head_dim_v) * n_ctx
    return {"main": main, "window": win, "total": total, "bits_per_element": 8 * total / n_elem}


MEM_SETTINGS = (("f16", "f16", False), ("q8_0", "q8_0", False), ("q4_0", "q4_0", False),
                ("oscar2 (INT2 only)", "oscar2", False), ("oscar2 + f16 window", "oscar2", True))


def kv_memory_rows(info: ModelInfo, contexts: list[int]) -> list[dict]:
    """The KV memory of one sequence at each context, per cache type."""
    window = sum(window_of(info))
    rows = []
    for name, ct, win in MEM_SETTINGS:
        for n in contexts:
            b = kv_bytes(info, ct, n, window if win else 0)
            f16 = kv_bytes(info, "f16", n)["total"]
            rows.append({"setting": name, "cache_type": ct, "window": win, "n_ctx": n, "bytes": b["total"],
                         "window_bytes": b["window"], "mib": b["total"] / 2**20,
                         "bits_per_element": b["bits_per_element"], "vs_f16": f16 / b["total"]})
    return rows


def _fmt_size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def kv_memory_text(rows: list[dict], contexts: list[int], md: bool = False) -> str:
    """kv_memory_rows as a table: aligned text, or Markdown."""
    heads = ["KV cache", "bits/elem"] + [f"at {_ctx_label(n)}" for n in contexts] + ["vs f16"]
    table = []
    for name, _, _ in MEM_SETTINGS:
        mine = {r["n_ctx"]: r for r in rows if r["setting"] == name}
        last = mine[contexts[-1]]
        table.append([name, f"{last['bits_per_element']:.3g}"] + [_fmt_size(mine[n]["bytes"]) for n in contexts]
                     + [f"{last['vs_f16']:.2f}x less" if name != "f16" else "1x"])
    if md:
        out = ["| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 1)]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in table])
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(heads)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(heads), "  ".join("-" * w for w in widths), *(line(r) for r in table)])


# ---- what llama.cpp logged ------------------------------------------------------------------------

_RE_WINDOW = re.compile(r"oscar window: sink (\d+) \+ recent (\d+) tokens per sequence in (\w+), "
                        r"(\d+) slots(?: \((\d+) rows\))? x (\d+) stream\(s\), ([\d.]+) MiB")


def parse_window_mib(log: str) -> float | None:
    """MiB of the oscar2 high-precision window stores (sink + recent tokens), if there are any.

    Each is allocated apart from its cache and logged on its own line (an iSWA model has one for
    its full-attention cache and one for its sliding-window cache), so they are added to the KV
    size here; a store holds n_seq x (S + R) + n_ubatch slots, more than S + R alone."""
    sizes = [float(m[7]) for m in _RE_WINDOW.finditer(log)]
    return round(sum(sizes), 2) if sizes else None


def kv_total_mib(log: str) -> tuple[float | None, float | None]:
    """(every cache + every window MiB, window MiB) from a tool's log that made one context."""
    caches = parse_kv_sizes(log)
    win = parse_window_mib(log)
    if not caches:
        return None, win
    return round(sum(c.total_mib for c in caches) + (win or 0.0), 2), win


def f16_equivalent_bits(kv_mib: float | None, f16_kv_mib: float | None) -> float | None:
    """16 x a setting's KV memory over f16's in the same context: the bits per element it costs,
    window, padding and sliding-window caches included, as llama.cpp allocated them."""
    if not kv_mib or not f16_kv_mib:
        return None
    return 16.0 * kv_mib / f16_kv_mib
