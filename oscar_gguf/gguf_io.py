"""GGUF in, GGUF with OSCAR rotations out (the engine behind `oscar-convert` and `oscar inspect`).

The copy is byte for byte: every key/value entry of the input is written back from its raw
bytes (so no re-encoding can change a value), every tensor's data is copied unchanged, and only
our own entries are appended: the tensors blk.{i}.attn_k_rot / attn_v_rot (f32 [d, d], the
row-major R with x_rot = x @ R) and the oscar.* keys (oscar_gguf/gguf_keys.py).

Writing is atomic (a temporary file in the destination folder, renamed at the end), never
touches the input, and refuses to overwrite anything unless asked.
"""
from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import gguf_keys as K

GGUF_MAGIC = b"GGUF"
# GGUFValueType ids (gguf.h)
T_UINT32, T_INT32, T_FLOAT32, T_STRING, T_ARRAY = 4, 5, 6, 8, 9
GGML_TYPE_F32 = 0
ORTHO_TOL = 1e-4


class ConvertError(Exception):
    """Refusal with a one-line message for the user; nothing was written."""


# ---- reading --------------------------------------------------------------------------------

# fixed sizes of the GGUF scalar value types (gguf.h); 8 (string) and 9 (array) are walked
_GGUF_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _check_gguf_bounds(path: Path) -> None:
    """Walk the header and key/value section with bounds checks before gguf-py parses it.

    gguf-py trusts every count it reads: a string or array length beyond the end of the file
    makes it loop for minutes (reads past the end yield empty views). Refuse such files here,
    in time proportional to the file's real size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != GGUF_MAGIC:
            return  # gguf-py's own error says what is wrong
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
        if n_kv > size or n_tensors > size:
            raise ConvertError(f"{path}: not a readable GGUF file (header claims {n_kv} keys and "
                               f"{n_tensors} tensors in {size} bytes)")
        pos = 24

        def need(n: int, what: str) -> None:
            if n < 0 or pos + n > size:
                raise ConvertError(f"{path}: not a readable GGUF file ({what} runs past the end of the file)")

        def u(fmt: str, what: str):
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n, what)
            f.seek(pos)
            pos += n
            return struct.unpack(fmt, f.read(n))[0]

        def skip_value(vtype: int, what: str, depth: int = 0) -> None:
            nonlocal pos
            if vtype in _GGUF_SCALAR_SIZE:
                need(_GGUF_SCALAR_SIZE[vtype], what)
                pos += _GGUF_SCALAR_SIZE[vtype]
            elif vtype == 8:
                n = u("<Q", what)
                need(n, what)
                pos += n
            elif vtype == 9 and depth == 0:
                etype, count = u("<I", what), u("<Q", what)
                if etype in _GGUF_SCALAR_SIZE:
                    need(count * _GGUF_SCALAR_SIZE[etype], what)
                    pos += count * _GGUF_SCALAR_SIZE[etype]
                elif etype in (8, 9):
                    need(count * 8, what)  # every element takes at least 8 bytes
                    for _ in range(count):
                        skip_value(etype, what, depth + 1)
                else:
                    raise ConvertError(f"{path}: not a readable GGUF file ({what} has invalid element type {etype})")
            else:
                raise ConvertError(f"{path}: not a readable GGUF file ({what} has invalid value type {vtype})")

        for i in range(n_kv):
            n = u("<Q", f"key {i}")
            need(n, f"key {i}")
            pos += n
            skip_value(u("<I", f"key {i}"), f"the value of key {i}")


def _reader(path: Path):
    from gguf import GGUFReader
    try:
        if path.is_file():
            _check_gguf_bounds(path)
        r = GGUFReader(str(path), "r")
        for t in r.tensors:  # llama.cpp refuses these; a copy would launder them into a valid file
            rel = int(t.data_offset) - int(r.data_offset)
            if rel % int(r.alignment) or int(t.data_offset) + int(t.n_bytes) > path.stat().st_size:
                raise ConvertError(f"{path}: not a readable GGUF file (tensor {t.name} has offset {rel}, "
                                   f"misaligned or past the end of the file)")
        return r
    except FileNotFoundError:
        raise ConvertError(f"{path}: no such file") from None
    except ConvertError:
        raise
    except Exception as e:  # truncated or not a GGUF: gguf-py raises assorted errors
        raise ConvertError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _contents(f):
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise ConvertError(f"GGUF key {f.name} holds a string that is not valid UTF-8") from None


def _field(reader, key: str, default=None):
    f = reader.get_field(key)
    if f is None:
        return default
    return _contents(f)


@dataclass
class ModelInfo:
    path: Path
    arch: str
    n_layer: int
    n_head: list[int]
    n_head_kv: list[int]
    head_dim_k: int
    head_dim_v: int
    k_rot: dict[int, np.ndarray] = field(default_factory=dict)
    v_rot: dict[int, np.ndarray] = field(default_factory=dict)
    oscar: dict[str, object] = field(default_factory=dict)
    latent_attention: bool = False  # MLA: the cache holds a compressed latent, not per-head K/V

    @property
    def has_rotations(self) -> bool:
        return bool(self.k_rot or self.v_rot)


def _per_layer(v, n: int) -> list[int]:
    if v is None:
        return [0] * n
    if isinstance(v, list):
        if len(v) != n:
            raise ConvertError(f"per-layer value has {len(v)} entries for {n} layers")
        return [int(x) for x in v]
    return [int(v)] * n


def _rotation_layer(name: str) -> str | None:
    """The layer part of blk.{i}.attn_k_rot / attn_v_rot (any text between the dots), else None."""
    for fmt in (K.K_ROT, K.V_ROT):
        prefix, suffix = fmt.split("{}")
        if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix):
            return name[len(prefix):len(name) - len(suffix)]
    return None


def read_model_info(path: str | Path, reader=None) -> ModelInfo:
    path = Path(path)
    r = reader or _reader(path)
    arch = _field(r, "general.architecture")
    if not isinstance(arch, str):
        raise ConvertError(f"{path}: no general.architecture key; is this a model GGUF?")
    n_layer = _field(r, f"{arch}.block_count")
    if not isinstance(n_layer, int) or not (0 < n_layer <= 4096):
        raise ConvertError(f"{path}: {arch}.block_count is missing or invalid ({n_layer!r})")
    n_head = _per_layer(_field(r, f"{arch}.attention.head_count"), n_layer)
    n_head_kv = _per_layer(_field(r, f"{arch}.attention.head_count_kv", None) or n_head, n_layer)
    n_embd = _field(r, f"{arch}.embedding_length")
    dk = _field(r, f"{arch}.attention.key_length")
    dv = _field(r, f"{arch}.attention.value_length")
    heads = max(n_head) if n_head else 0
    if dk is None:
        if not n_embd or not heads:
            raise ConvertError(f"{path}: cannot tell the head size (no key_length, embedding_length or head_count)")
        dk = n_embd // heads
    dv = dv if dv is not None else dk
    info = ModelInfo(path, arch, n_layer, n_head, n_head_kv, int(dk), int(dv))
    info.latent_attention = takes_no_rotations(arch, _field(r, f"{arch}.attention.kv_lora_rank", None))
    for t in r.tensors:
        for fmt, dst in ((K.K_ROT, info.k_rot), (K.V_ROT, info.v_rot)):
            prefix, suffix = fmt.split("{}")
            if t.name.startswith(prefix) and t.name.endswith(suffix):
                idx = t.name[len(prefix):len(t.name) - len(suffix)]
                if idx.isascii() and idx.isdigit() and t.tensor_type == GGML_TYPE_F32 and len(t.shape) == 2:
                    d0, d1 = int(t.shape[0]), int(t.shape[1])
                    dst[int(idx)] = np.asarray(t.data, dtype=np.float32).reshape(d1, d0)
    for f in r.fields.values():
        if f.name.startswith("oscar."):
            info.oscar[f.name] = _contents(f)
    return info


def orthogonality_error(r: np.ndarray) -> float:
    r = np.asarray(r, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] != r.shape[1] or r.size == 0:
        return float("inf")  # not a rotation at all
    return float(np.abs(r.T @ r - np.eye(r.shape[0])).max())


# ---- writing --------------------------------------------------------------------------------

def _enc_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _enc_kv(key: str, vtype: int, value) -> bytes:
    out = _enc_str(key) + struct.pack("<I", vtype)
    if vtype == T_UINT32:
        return out + struct.pack("<I", int(value))
    if vtype == T_FLOAT32:
        return out + struct.pack("<f", float(value))
    if vtype == T_STRING:
        return out + _enc_str(str(value))
    if vtype == T_ARRAY:
        arr = np.asarray(value, dtype=np.float32)
        return out + struct.pack("<IQ", T_FLOAT32, arr.size) + arr.astype("<f4").tobytes()
    raise ValueError(vtype)


def _pad(n: int, align: int) -> int:
    return (align - n % align) % align


def write_gguf(src: Path, dst: Path, extra_kv: list[tuple[str, int, object]],
               extra_tensors: list[tuple[str, np.ndarray]], drop_prefixes: tuple[str, ...] = (),
               drop_tensors: set[str] = frozenset(), reader=None) -> None:
    """Copy src to dst adding entries; drop keys starting with drop_prefixes and named tensors."""
    r = reader or _reader(src)
    align = _field(r, "general.alignment", 32) or 32
    kv_blobs = []
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name.startswith(drop_prefixes):
            continue  # GGUF.* are the reader's view of the header, rewritten below
        kv_blobs.append(b"".join(np.asarray(p).tobytes() for p in f.parts))
    kv_blobs += [_enc_kv(k, t, v) for k, t, v in extra_kv]

    tensors = []  # (name, ne list, ggml type, raw bytes source)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        tensors.append((t.name, [int(x) for x in t.shape], int(t.tensor_type), t.data, int(t.n_bytes)))
    for name, arr in extra_tensors:
        a = np.ascontiguousarray(arr, dtype="<f4")
        tensors.append((name, [a.shape[1], a.shape[0]], GGML_TYPE_F32, a, a.nbytes))

    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kv_blobs)))
            for b in kv_blobs:
                f.write(b)
            offset = 0
            for name, ne, ttype, _, nbytes in tensors:
                f.write(_enc_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne))
                f.write(struct.pack("<IQ", ttype, offset))
                offset += nbytes + _pad(nbytes, align)
            f.write(b"\0" * _pad(f.tell(), align))
            for _, _, _, data, nbytes in tensors:
                raw = np.asarray(data).reshape(-1).view(np.uint8)
                if raw.size != nbytes:
                    raise ConvertError(f"tensor data size mismatch while copying ({raw.size} != {nbytes})")
                f.write(memoryview(raw))
                f.write(b"\0" * _pad(nbytes, align))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---- oscar-convert ----------------------------------------------------------------------------

@dataclass
class Rotations:
    """What goes into the GGUF, already in llama.cpp's head-dim order."""
    k_rot: dict[int, np.ndarray]
    v_rot: dict[int, np.ndarray]
    clip_k: list[float]
    clip_v: list[float]
    arch: str | None
    n_layers: int
    head_dim: int | None
    group_size: int
    provenance: dict[str, str]


# architectures whose attention bypasses the KV-cache path that applies the rotations (the list
# of llama_oscar_arch_takes_rotations in ggml-oscar/llama/llama-oscar.cpp, by GGUF name)
NO_ROTATION_ARCHS = {"deepseek2", "deepseek32", "deepseek4", "glm-dsa", "minimax-m3", "t5", "t5encoder"}


def takes_no_rotations(arch: str, kv_lora_rank) -> bool:
    """An architecture on the list, or any model with a latent (MLA) KV cache."""
    return arch in NO_ROTATION_ARCHS or kv_lora_rank is not None


def check_rotations(rot: Rotations, info: ModelInfo) -> None:
    """Everything oscar-convert refuses, as ConvertError with a one-line message."""
    if info.latent_attention:
        raise ConvertError(f"architecture '{info.arch}' uses latent (MLA) or custom attention outside the KV-cache path "
                           "that applies rotations; llama.cpp would refuse the converted file")
    if rot.arch and rot.arch != info.arch:
        raise ConvertError(f"the rotations were calibrated for architecture '{rot.arch}', the model is '{info.arch}'")
    if rot.n_layers != info.n_layer:
        raise ConvertError(f"the rotations have {rot.n_layers} layers, the model has {info.n_layer}")
    if rot.head_dim is not None and rot.head_dim != info.head_dim_k:
        raise ConvertError(f"the rotations are for head_dim {rot.head_dim}, the model has {info.head_dim_k}")
    if info.head_dim_k % 64 or info.head_dim_v % 64:
        raise ConvertError(f"head_dim {info.head_dim_k}/{info.head_dim_v} is not supported by oscar2 (needs a multiple of 64)")
    for what, mats, d in (("K", rot.k_rot, info.head_dim_k), ("V", rot.v_rot, info.head_dim_v)):
        for il, r in mats.items():
            if not (0 <= il < info.n_layer):
                raise ConvertError(f"{what} rotation for layer {il}, but the model has layers 0..{info.n_layer - 1}")
            if r.shape != (d, d):
                raise ConvertError(f"{what} rotation of layer {il} has shape {r.shape}, the model needs ({d}, {d})")
            if not np.all(np.isfinite(r)):
                raise ConvertError(f"{what} rotation of layer {il} has non-finite values")
            err = orthogonality_error(r)
            if err > ORTHO_TOL:
                raise ConvertError(f"{what} rotation of layer {il} is not orthogonal (|R^T R - I| = {err:.2e} > {ORTHO_TOL:g})")
    for what, clips in (("K", rot.clip_k), ("V", rot.clip_v)):
        if len(clips) != info.n_layer:
            raise ConvertError(f"{len(clips)} {what} clip ratios for {info.n_layer} layers")
        bad = [c for c in clips if not (np.isfinite(c) and 0 < c <= 1)]
        if bad:
            raise ConvertError(f"{what} clip ratio {bad[0]} is not in (0, 1]")


def convert(src: str | Path, dst: str | Path, rot: Rotations, *, sink: int = K.DEFAULT_SINK,
            recent: int = K.DEFAULT_RECENT, force: bool = False, replace: bool = False) -> ModelInfo:
    """Write dst = src + rotations. Raises ConvertError before writing anything on bad input."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise ConvertError(f"{src}: no such file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ConvertError("the output would overwrite the input model; choose another -o")
    if dst.exists() and not force:
        raise ConvertError(f"{dst} exists; pass --force to overwrite it")
    if not (0 <= sink <= 1 << 20 and 0 <= recent <= 1 << 20):
        raise ConvertError(f"window sizes must be between 0 and {1 << 20} (got sink {sink}, recent {recent})")
    reader = _reader(src)
    info = read_model_info(src, reader)
    # every tensor named like a rotation, whatever its type or shape (read_model_info keeps only
    # the f32 [d, d] ones): --replace must drop them all, or the output holds a duplicate name
    old = {t.name for t in reader.tensors if _rotation_layer(t.name) is not None}
    if (info.has_rotations or info.oscar or old) and not replace:
        raise ConvertError(f"{src} already carries OSCAR rotations or metadata; pass --replace to swap them")
    check_rotations(rot, info)

    kv = [(K.KEY_FORMAT_VERSION, T_UINT32, K.FORMAT_VERSION),
          (K.KEY_GROUP_SIZE, T_UINT32, rot.group_size),
          (K.KEY_CLIP_K, T_ARRAY, rot.clip_k),
          (K.KEY_CLIP_V, T_ARRAY, rot.clip_v),
          (K.KEY_SINK, T_UINT32, sink),
          (K.KEY_RECENT, T_UINT32, recent),
          (K.KEY_ROPE_LAYOUT, T_STRING, "llama.cpp")]
    kv += [(K.KEY_CALIB_PREFIX + k, T_STRING, str(v)) for k, v in sorted(rot.provenance.items())]
    tensors = [(K.K_ROT.format(il), r) for il, r in sorted(rot.k_rot.items())]
    tensors += [(K.V_ROT.format(il), r) for il, r in sorted(rot.v_rot.items())]
    write_gguf(src, dst, kv, tensors, drop_prefixes=("oscar.",) if replace else (), drop_tensors=old, reader=reader)
    return info


# ---- oscar inspect ----------------------------------------------------------------------------

def inspect_report(path: str | Path) -> str:
    info = read_model_info(path)
    lines = [f"{info.path}",
             f"  architecture {info.arch}, {info.n_layer} layers, head_dim K {info.head_dim_k} / V {info.head_dim_v}, "
             f"heads {max(info.n_head)} / KV heads {max(info.n_head_kv)}"]
    if not info.oscar and not info.has_rotations:
        lines.append("  no OSCAR rotations or metadata: oscar2 would fall back to the built-in Hadamard rotation")
        return "\n".join(lines)
    for k in (K.KEY_FORMAT_VERSION, K.KEY_GROUP_SIZE, K.KEY_SINK, K.KEY_RECENT, K.KEY_ROPE_LAYOUT):
        if k in info.oscar:
            lines.append(f"  {k} = {info.oscar[k]}")
    for k, v in sorted(info.oscar.items()):
        if k.startswith(K.KEY_CALIB_PREFIX):
            lines.append(f"  {k} = {v}")
    ck = info.oscar.get(K.KEY_CLIP_K)
    cv = info.oscar.get(K.KEY_CLIP_V)
    ck = ck if isinstance(ck, list) else []  # a scalar or string where an array belongs: shown as "-"
    cv = cv if isinstance(cv, list) else []
    lines.append("  layer  K |RtR-I|   V |RtR-I|   clip K  clip V")
    worst = 0.0
    for il in range(info.n_layer):
        ek = orthogonality_error(info.k_rot[il]) if il in info.k_rot else None
        ev = orthogonality_error(info.v_rot[il]) if il in info.v_rot else None
        worst = max([worst] + [e for e in (ek, ev) if e is not None])
        fmt = lambda e: "      -   " if e is None else f"{e:10.2e}"  # noqa: E731
        c_k = f"{ck[il]:.3f}" if il < len(ck) and isinstance(ck[il], (int, float)) else "  -  "
        c_v = f"{cv[il]:.3f}" if il < len(cv) and isinstance(cv[il], (int, float)) else "  -  "
        lines.append(f"  {il:5d} {fmt(ek)}  {fmt(ev)}   {c_k}   {c_v}")
    verdict = "ok" if worst <= ORTHO_TOL else "NOT ORTHOGONAL"
    lines.append(f"  rotations: {len(info.k_rot)} K + {len(info.v_rot)} V, worst |R^T R - I| = {worst:.2e} ({verdict})")
    return "\n".join(lines)
