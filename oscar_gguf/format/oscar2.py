"""The oscar2 KV-cache block format: type ids, group sizes and its bit-exact numpy twin.

ggml-oscar/oscar2.h defines the format and its exact rounding rules, and ggml-oscar/oscar2.c
is its C reference; this module mirrors both, and the tests compare them byte for byte
through ctypes, the way gguf-py's quant classes mirror ggml-quants.c.

Two ggml types share the format and differ in the group size G:
``oscar2`` (G=128, 36 bytes a block, 2.25 bits/element) and ``oscar2_64`` (G=64, 20 bytes,
2.5 bits/element). Users ask for ``oscar2``; the variant follows from head_dim.
"""
from __future__ import annotations

import numpy as np

# far above mainline's ids, so that a stock build refuses our data instead of misreading it
OSCAR2_TYPE_ID = 100
OSCAR2_64_TYPE_ID = 101
TYPE_NAMES = {OSCAR2_TYPE_ID: "oscar2", OSCAR2_64_TYPE_ID: "oscar2_64"}
GROUP_SIZE = {OSCAR2_TYPE_ID: 128, OSCAR2_64_TYPE_ID: 64}
FP16_MAX = np.float32(65504.0)


def block_bytes(group: int) -> int:
    """Bytes of one block: fp16 scale + fp16 min + group/4 bytes of codes."""
    return 4 + group // 4


def bits_per_element(group: int) -> float:
    return 8.0 * block_bytes(group) / group


def type_for_head_dim(head_dim: int) -> int:
    """The oscar2 variant llama.cpp picks for a layer: G=128 when head_dim allows it."""
    if head_dim % 128 == 0:
        return OSCAR2_TYPE_ID
    if head_dim % 64 == 0:
        return OSCAR2_64_TYPE_ID
    raise ValueError(f"oscar2 needs head_dim to be a multiple of 64, got {head_dim}")


def group_size(head_dim: int) -> int:
    """The group size G of the variant llama.cpp picks for head_dim (128, or 64)."""
    return GROUP_SIZE[type_for_head_dim(head_dim)]


def clip_index(clip: float, group: int) -> int | None:
    """Index of the clip threshold in the sorted magnitudes, or None for no clipping."""
    c = np.float32(clip)
    if not (c > 0 and c < 1):  # also NaN
        return None
    k = int(np.floor(c * np.float32(group)))
    return k if k < group else None


FLT_MIN = np.float32(1.17549435e-38)


def _sanitize(v: np.ndarray) -> np.ndarray:
    """Non-finite -> 0, fp32 subnormals -> 0, -0 -> +0 (see ggml-oscar/oscar2.h step 0)."""
    with np.errstate(invalid="ignore"):
        keep = np.isfinite(v) & (np.abs(v) >= FLT_MIN)
    v = np.where(keep, v, np.float32(0))
    return (v + np.float32(0)).astype(np.float32)  # -0 -> +0


def quantize_groups(x: np.ndarray, group: int, clip: float = 1.0):
    """Quantize x (any shape whose last dim is a multiple of group).

    Returns (codes uint8 [..., G] in 0..3, d float16 [...], m float16 [...]) per group,
    before packing.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group size {group}")
    v = _sanitize(x.reshape(-1, group))
    k = clip_index(clip, group)
    if k is not None:
        tau = np.partition(np.abs(v), k, axis=1)[:, k:k + 1]
        v = np.where(v > tau, tau, np.where(v < -tau, -tau, v))
        v = (v + np.float32(0)).astype(np.float32)
    mn = v.min(axis=1)
    mx = v.max(axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        d = (mx - mn) / np.float32(3)
    d = np.where(d <= FP16_MAX, d, FP16_MAX).astype(np.float32)
    mn = np.clip(mn, -FP16_MAX, FP16_MAX).astype(np.float32)
    dh = d.astype(np.float16)
    mh = mn.astype(np.float16)
    df = dh.astype(np.float32)[:, None]
    mf = mh.astype(np.float32)[:, None]
    t1 = mf + np.float32(0.5) * df
    t2 = mf + np.float32(1.5) * df
    t3 = mf + np.float32(2.5) * df
    codes = ((v >= t1).astype(np.uint8) + (v >= t2) + (v >= t3)).astype(np.uint8)
    lead = x.shape[:-1] + (x.shape[-1] // group,)
    return codes.reshape(lead + (group,)), dh.reshape(lead), mh.reshape(lead)


def pack(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> bytes:
    """Lay groups out as ggml blocks (see ggml-oscar/oscar2.h)."""
    group = codes.shape[-1]
    nb = group // 4
    c = codes.reshape(-1, 4, nb).astype(np.uint8)  # element j = s*nb + b -> byte b, shift 2s
    qs = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
    rec = np.zeros(c.shape[0], dtype=[("d", "<u2"), ("m", "<u2"), ("qs", "u1", (nb,))])
    rec["d"] = d.reshape(-1).view(np.uint16)
    rec["m"] = m.reshape(-1).view(np.uint16)
    rec["qs"] = qs
    return rec.tobytes()


def unpack(data: bytes, group: int):
    """Inverse of pack: (codes [n, G], d float16 [n], m float16 [n])."""
    nb = group // 4
    rec = np.frombuffer(data, dtype=[("d", "<u2"), ("m", "<u2"), ("qs", "u1", (nb,))])
    qs = rec["qs"]
    codes = np.stack([(qs >> (2 * s)) & 3 for s in range(4)], axis=1).reshape(-1, group)
    return codes.astype(np.uint8), rec["d"].view(np.float16), rec["m"].view(np.float16)


def quantize_row(x: np.ndarray, group: int, clip: float = 1.0) -> bytes:
    """Quantize rows exactly as the C reference oscar2_quantize_row_g does."""
    return pack(*quantize_groups(x, group, clip))


def dequantize_row(data: bytes, group: int) -> np.ndarray:
    """Values of packed blocks, float32, flattened."""
    codes, d, m = unpack(data, group)
    df = d.astype(np.float32)[:, None]
    mf = m.astype(np.float32)[:, None]
    return (mf + codes.astype(np.float32) * df).reshape(-1).astype(np.float32)


def fake_quantize(x: np.ndarray, group: int, clip: float = 1.0) -> np.ndarray:
    """Quantize then dequantize, keeping the shape: what attention reads back."""
    x = np.asarray(x, dtype=np.float32)
    codes, d, m = quantize_groups(x, group, clip)
    y = m.astype(np.float32)[..., None] + codes.astype(np.float32) * d.astype(np.float32)[..., None]
    return y.reshape(x.shape).astype(np.float32)
