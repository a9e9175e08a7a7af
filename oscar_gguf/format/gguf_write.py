"""Writing GGUF files: our entries, a copy of a model with them added, and new files.

- ``oscar_keys`` lists the oscar.* keys of a set of rotations, with their GGUF value types;
- ``copy_with_additions`` copies a GGUF byte for byte (every key/value entry from its raw
  bytes as gguf-py's GGUFReader parsed them, every tensor's data unchanged) and appends our
  keys and f32 tensors: what oscar-convert writes, so that no re-encoding can change a value;
- ``new_gguf`` is gguf-py's GGUFWriter writing into a temporary file that is renamed onto
  the target only when the file is complete (``oscar synth``, the test models);
  ``write_gguf`` writes a small GGUF of given keys and tensors through it.

Every write is atomic and never touches its input.
"""
from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import numpy as np
from gguf import GGUF_MAGIC, GGUF_VERSION, GGMLQuantizationType, GGUFValueType

from ..atomic import atomic_path
from . import gguf_keys
from .gguf_read import GGUFError, field_value, open_gguf
from .rotations import Rotations

# (key, value type, value, array element type); copy_with_additions also takes (key, type, value)
# for a scalar, or for an array of FLOAT32 or UINT32
Key = tuple[str, GGUFValueType, object, "GGUFValueType | None"]


def oscar_keys(group_size: int, clip_k: list[float], clip_v: list[float], sink: int, recent: int,
               provenance: dict[str, str], f16_k_layers: tuple[int, ...] = ()) -> list[Key]:
    """The oscar.* keys of a GGUF with rotations (gguf_keys.py says what each means); the
    provenance becomes oscar.calibration.* strings, in the order given."""
    keys: list[Key] = [
        (gguf_keys.KEY_FORMAT_VERSION, GGUFValueType.UINT32, gguf_keys.FORMAT_VERSION, None),
        (gguf_keys.KEY_GROUP_SIZE, GGUFValueType.UINT32, group_size, None),
        (gguf_keys.KEY_CLIP_K, GGUFValueType.ARRAY, [float(c) for c in clip_k], GGUFValueType.FLOAT32),
        (gguf_keys.KEY_CLIP_V, GGUFValueType.ARRAY, [float(c) for c in clip_v], GGUFValueType.FLOAT32),
        (gguf_keys.KEY_SINK, GGUFValueType.UINT32, sink, None),
        (gguf_keys.KEY_RECENT, GGUFValueType.UINT32, recent, None),
        (gguf_keys.KEY_ROPE_LAYOUT, GGUFValueType.STRING, "llama.cpp", None)]
    if f16_k_layers:
        keys.append((gguf_keys.KEY_F16_K_LAYERS, GGUFValueType.ARRAY, sorted(int(i) for i in f16_k_layers),
                     GGUFValueType.UINT32))
    keys += [(gguf_keys.KEY_CALIB_PREFIX + k, GGUFValueType.STRING, str(v), None) for k, v in provenance.items()]
    return keys


def rotation_tensors(rot: Rotations) -> list[tuple[str, np.ndarray]]:
    """(tensor name, f32 [d, d]) of every rotation, K then V, by layer."""
    return ([(gguf_keys.K_ROT.format(il), r) for il, r in sorted(rot.k_rot.items())]
            + [(gguf_keys.V_ROT.format(il), r) for il, r in sorted(rot.v_rot.items())])


# ---- the byte-for-byte copy ----------------------------------------------------------------------

def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _encode_key(key: str, vtype: GGUFValueType, value, etype: GGUFValueType | None = GGUFValueType.FLOAT32) -> bytes:
    """One key/value entry of the types oscar_keys uses."""
    out = _string(key) + struct.pack("<I", vtype)
    if vtype == GGUFValueType.UINT32:
        return out + struct.pack("<I", int(value))
    if vtype == GGUFValueType.STRING:
        return out + _string(str(value))
    if vtype == GGUFValueType.ARRAY and etype in (GGUFValueType.FLOAT32, GGUFValueType.UINT32):
        arr = np.asarray(value, dtype="<f4" if etype == GGUFValueType.FLOAT32 else "<u4")
        return out + struct.pack("<IQ", etype, arr.size) + arr.tobytes()
    raise ValueError(f"no encoding for {key}: {vtype.name}")


def _pad(n: int, align: int) -> int:
    return (align - n % align) % align


def copy_with_additions(src: Path, dst: Path, extra_keys: list[Key], extra_tensors: list[tuple[str, np.ndarray]],
                        drop_prefixes: tuple[str, ...] = (), drop_tensors: set[str] = frozenset(),
                        reader=None) -> None:
    """Copy src to dst adding entries; drop keys starting with drop_prefixes and named tensors."""
    r = reader or open_gguf(src)
    align = field_value(r, "general.alignment", 32) or 32
    kv_blobs = [b"".join(np.asarray(p).tobytes() for p in f.parts) for f in r.fields.values()
                # GGUF.* are the reader's view of the header, written anew below
                if not f.name.startswith("GGUF.") and not f.name.startswith(drop_prefixes)]
    kv_blobs += [_encode_key(*k) for k in extra_keys]
    tensors = [(t.name, [int(x) for x in t.shape], int(t.tensor_type), t.data, int(t.n_bytes))
               for t in r.tensors if t.name not in drop_tensors]
    for name, arr in extra_tensors:
        a = np.ascontiguousarray(arr, dtype="<f4")
        tensors.append((name, [a.shape[1], a.shape[0]], int(GGMLQuantizationType.F32), a, a.nbytes))
    with atomic_path(dst) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<I", GGUF_MAGIC) + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kv_blobs)))
        for b in kv_blobs:
            f.write(b)
        offset = 0
        for name, ne, ttype, _, nbytes in tensors:
            f.write(_string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne))
            f.write(struct.pack("<IQ", ttype, offset))
            offset += nbytes + _pad(nbytes, align)
        f.write(b"\0" * _pad(f.tell(), align))
        for _, _, _, data, nbytes in tensors:
            raw = np.asarray(data).reshape(-1).view(np.uint8)
            if raw.size != nbytes:
                raise GGUFError(f"tensor data size mismatch while copying ({raw.size} != {nbytes})")
            f.write(memoryview(raw))
            f.write(b"\0" * _pad(nbytes, align))
        f.flush()
        os.fsync(f.fileno())


# ---- new files through gguf-py -------------------------------------------------------------------

@contextlib.contextmanager
def new_gguf(path: Path, arch: str):
    """gguf-py's GGUFWriter on a temporary file next to path, renamed onto it when the block
    ends without an error. The caller adds keys and tensors and writes the file's parts."""
    from gguf import GGUFWriter
    with atomic_path(path) as tmp:
        w = GGUFWriter(tmp, arch)
        try:
            yield w
        finally:
            w.close()


def add_keys(w, keys: list[Key]) -> None:
    for key, vtype, value, etype in keys:
        w.add_key_value(key, value, vtype, sub_type=etype)


def write_gguf(path: Path, arch: str, keys: list[Key], tensors: list[tuple[str, np.ndarray]]) -> Path:
    """A GGUF of the given keys (general.architecture comes from arch) and tensors, each written
    with its numpy dtype (float32 -> F32, float16 -> F16, ...) and shape (ggml's ne reversed)."""
    path = Path(path)
    with new_gguf(path, arch) as w:
        add_keys(w, keys)
        for name, a in tensors:
            w.add_tensor(name, np.ascontiguousarray(a))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return path
