"""How the fuzz harness damages its inputs: each case's mutations applied to the tiny GGUF (as a
GGUFDoc, then as bytes), to the tiny calibration artifact (safetensors) and to a RotationZoo
.pt pair. Every mutation is deterministic in the case, so a saved case replays exactly.
"""
from __future__ import annotations

import io
import json
import struct
import warnings
from typing import Any

import numpy as np

from ..format import gguf_keys as K
from ..format.gguf_keys import DEFAULT_CLIP_K
from ..format.rotations import random_rotation
from .inputs import (_TYPE_SIZE, ALIGN, ARRAY, F32, GGML_F16, GGML_F32, GGML_F64, KV, STRING, TINY, U32, GGUFDoc,
                     Tensor, _f32_tensor, _spec_bytes, _spec_text, serialize, tensor_bytes)


# ---- the GGUF --------------------------------------------------------------------------------

def _typed(value_spec: dict, n_layer: int) -> tuple[int, Any, int | None]:
    t = value_spec["t"]
    if t == ARRAY and "vals" in value_spec:  # given elements (the precision plan's layer indices)
        return ARRAY, list(value_spec["vals"]), value_spec["et"]
    if t == ARRAY:
        et, n = value_spec["et"], value_spec["n"]
        if et == F32:
            fill = value_spec["fill"]
            vals = [fill] * n
            if value_spec.get("vary") and n:
                vals[0] = DEFAULT_CLIP_K  # one good entry among bad ones (the check must look at all)
            return ARRAY, vals, F32
        if et == STRING:
            return ARRAY, [b"0.9"] * n, STRING
        return ARRAY, [1] * n, et
    if t == STRING:
        return STRING, _spec_bytes(value_spec["v"]), None
    return t, value_spec["v"], None


def _rot_name(which: str, layer: int) -> str:
    return (K.K_ROT if which == "k" else K.V_ROT).format(layer)


def _mutate_rotation(r: np.ndarray, how: str, at: int) -> np.ndarray:
    r = r.astype(np.float32).copy()
    i, j = divmod(at % r.size, r.shape[1])
    if how == "nan":
        r[i, j] = np.nan
    elif how == "inf":
        r[i, j] = np.inf
    elif how == "neg_inf":
        r[i, j] = -np.inf
    elif how == "zero":
        r[:] = 0
    elif how == "scale_big":
        r *= 1.01
    elif how == "half":
        r *= 0.5
    elif how == "huge":
        r[i, j] = 1e30
    elif how == "perturb_big":
        r[i, j] += 0.1
    elif how == "scale_tiny":
        r *= np.float32(1 + 1e-6)
    elif how == "perm":
        r = r[np.random.default_rng(at).permutation(r.shape[0])]
    elif how == "neg":
        r = -r
    elif how == "transpose":
        r = np.ascontiguousarray(r.T)
    elif how == "identity":
        r = np.eye(r.shape[0], dtype=np.float32)
    elif how == "subnormal":
        r += np.float32(1e-40)
    return r


def apply_gguf_mutations(doc: GGUFDoc, muts: list[dict]) -> tuple[bytes, dict]:
    """Apply the structured mutations to doc, serialize, then apply the byte-level ones.

    Returns the file bytes and `facts`: what the oracle needs to know beyond the final doc
    (damage done at the byte level, deleted model keys, ...)."""
    facts: dict[str, Any] = {"damage": [], "uncertain": [], "deleted_model_keys": []}
    byte_muts = []
    deltas: dict[str, int] = {}
    for m in muts:
        op = m["op"]
        if op in _KEY_OPS:
            _mutate_keys(doc, m, facts)
        elif op in _TENSOR_OPS:
            _mutate_tensors(doc, m, facts)
        elif op == "counts":  # applied to the final counts below (later ops may add or remove entries)
            deltas[m["field"]] = (deltas.get(m["field"], 0) + m["delta"]) % (1 << 64)
        elif op == "version":  # judged on the final value below (a later op may set it again)
            doc.version = m["value"]
        elif op in ("truncate", "flip"):
            byte_muts.append(m)
    # damage judged on the final document: a lie about an entry that a later op removed is gone
    if any(kv.count is not None and kv.count != len(kv.value) for kv in doc.kvs):
        facts["damage"].append("array_lie")
    if doc.version == 2:
        facts["uncertain"].append("version 2")
    elif doc.version != 3:
        facts["damage"].append("version")
    for fld, delta in deltas.items():
        if delta:
            real = len(doc.tensors) if fld == "n_tensors" else len(doc.kvs)
            setattr(doc, fld, (real + delta) % (1 << 64))
            facts["damage"].append("counts")
    data, regions = serialize(doc)
    for m in byte_muts:
        lo, hi = (0, len(data)) if m.get("region", "any") == "any" else regions[m["region"]]
        if m["op"] == "truncate":
            # cut strictly inside the file: any cut must be refused
            cut = min(len(data) - 1, lo + int(m["frac"] * max(0, hi - lo)))
            data = data[:cut]
            facts["damage"].append("truncate")
            regions = {k: (min(a, cut), min(b, cut)) for k, (a, b) in regions.items()}
        elif m["op"] == "flip" and hi > lo:
            data = flip_bits(data, m["n"], m["seed"], lo, hi)
            facts["uncertain"].append(f"flip in {m.get('region', 'any')}")
    return data, facts


_KEY_OPS = ("meta_set", "meta_del", "meta_dup", "model_del", "block_count", "odd_key", "array_lie", "valid")
_TENSOR_OPS = ("rot_values", "rot_dtype", "rot_shape", "rot_del", "rot_dup", "ndims", "rot_name", "offset")


def _mutate_keys(doc: GGUFDoc, m: dict, facts: dict) -> None:
    op = m["op"]
    if op == "meta_set":
        doc.set(m["key"], *_typed(m["value"], TINY.n_layer))
    elif op == "meta_del":
        doc.remove(m["key"])
    elif op == "meta_dup":
        kv = doc.find(m["key"])
        if kv is not None:
            doc.kvs.append(KV(kv.key, kv.vtype, kv.value, kv.etype))
    elif op == "model_del":
        if doc.find(m["key"]) is not None:
            facts["deleted_model_keys"].append(m["key"])
        doc.remove(m["key"])
    elif op == "block_count":
        doc.set("llama.block_count", U32, m["value"])
    elif op == "odd_key":
        doc.kvs.append(KV(_spec_bytes(m["name"]), STRING, b"odd key"))
        facts["uncertain"].append("odd key name")  # gguf does not define what a key may hold
    elif op == "array_lie":
        kv = doc.find(m["key"])
        if kv is not None and kv.vtype == ARRAY:
            kv.count = len(kv.value) + m["extra"]  # the file ends long before
    elif m["how"] == "drop_all_oscar":  # op "valid"
        doc.kvs = [kv for kv in doc.kvs if not kv.key.startswith(K.OSCAR_PREFIX.encode())]
    elif m["how"] == "strip_rotations":
        doc.tensors = [t for t in doc.tensors if not t.name.endswith(b"_rot")]
    elif m["how"] == "window_zero":
        doc.set(K.KEY_SINK, U32, 0)
        doc.set(K.KEY_RECENT, U32, 0)


def _mutate_tensors(doc: GGUFDoc, m: dict, facts: dict) -> None:
    op = m["op"]
    if op == "rot_name":
        t = doc.tensor(_rot_name(m["which"], m["layer"]))
        if m["rename"] and t is not None:
            t.name = m["name"].encode()
        else:
            doc.tensors.append(_f32_tensor(m["name"], np.eye(64)))
    elif op == "offset":
        _move_offset(doc, m, facts)
    else:
        t = doc.tensor(_rot_name(m["which"], m["layer"]))
        if t is not None:
            _mutate_rotation_tensor(doc, t, m, facts)


def _move_offset(doc: GGUFDoc, m: dict, facts: dict) -> None:
    if m["index"] >= len(doc.tensors):
        return
    t = doc.tensors[m["index"]]
    # offsets of the tensors before it, as serialize() lays them out
    run = sum(len(x.data) + (-len(x.data)) % ALIGN for x in doc.tensors[:m["index"]])
    if m["how"] == "misalign":
        t.offset = run + 1
    elif m["how"] == "beyond":
        t.offset = 1 << 40
    elif m["index"] > 0:
        t.offset = 0  # "previous": overlap the first tensor
    else:
        return
    facts["damage"].append("offset")


def _mutate_rotation_tensor(doc: GGUFDoc, t: Tensor, m: dict, facts: dict) -> None:
    op = m["op"]
    if op == "rot_values":
        if t.ttype == GGML_F32 and len(t.data) == 4 * 64 * 64:
            r = np.frombuffer(t.data, dtype="<f4").reshape(64, 64)
            t.data = _mutate_rotation(r, m["how"], m["at"]).astype("<f4").tobytes()
    elif op == "rot_dtype":
        r = np.frombuffer(t.data, dtype="<f4")
        t.ttype = m["ttype"]
        if t.ttype == GGML_F16:  # a real f16 copy of the rotation: the likeliest user error
            t.data = r.astype("<f2").tobytes()
        elif t.ttype == GGML_F64:
            t.data = r.astype("<f8").tobytes()
        else:  # random blocks of the right size (unknown types keep the f32 size)
            n = tensor_bytes(t.ttype, t.ne) if t.ttype in _TYPE_SIZE else len(t.data)
            t.data = np.random.default_rng(t.ttype).integers(0, 256, n, dtype=np.uint8).tobytes()
    elif op == "rot_shape":
        t.ne = list(m["ne"])
        n = int(np.prod(t.ne)) if t.ne else 1
        t.data = (np.random.default_rng(n).standard_normal(n).astype("<f4") / 8).tobytes()
    elif op == "rot_del":
        doc.tensors.remove(t)
    elif op == "rot_dup":
        doc.tensors.append(Tensor(t.name, list(t.ne), t.ttype, t.data))
    elif m["n"] <= 8:  # op "ndims"
        t.ne = [64] * m["n"]
    else:  # a dimension count the reader must not trust
        t.n_dims = m["n"]
        facts["damage"].append("ndims")


def flip_bits(data: bytes, n: int, seed: int, lo: int = 0, hi: int | None = None) -> bytes:
    """data with n random bits flipped between byte lo and byte hi."""
    hi = len(data) if hi is None else hi
    rng = np.random.default_rng(seed)
    buf = bytearray(data)
    for _ in range(n):
        p = int(rng.integers(lo, hi))
        buf[p] ^= 1 << int(rng.integers(0, 8))
    return bytes(buf)


def damage_bytes(data: bytes, m: dict) -> bytes:
    """A file's bytes cut at a fraction of their length ("truncate"), or with bits flipped ("flip")."""
    if m["op"] == "truncate":
        return data[:int(m["frac"] * (len(data) - 1))]
    return flip_bits(data, m["n"], m["seed"]) if data else data


# ---- the calibration artifact (safetensors) ---------------------------------------------

_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I32": "<i4", "I64": "<i8", "U8": "u1", "BOOL": "?"}


def _st_parse(raw: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        tensors[name] = np.frombuffer(data[a:b], dtype=_ST_DTYPES[info["dtype"]]).reshape(info["shape"]).copy()
    return meta, tensors


def _bf16_bytes(a: np.ndarray) -> bytes:
    return (np.asarray(a, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()


def _st_serialize(meta: dict, tensors: dict[str, tuple[str, list[int], bytes]],
                  offsets: dict[str, list[int]] | None = None) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    blob = bytearray()
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    for name, off in (offsets or {}).items():
        if name in header:
            header[name]["data_offsets"] = off
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(blob)


def _artifact_values(a: np.ndarray, how: str) -> np.ndarray:
    a = a.astype(np.float32).copy()
    flat = a.reshape(-1)
    if how == "nan" and flat.size:
        flat[0] = np.nan
    elif how == "inf" and flat.size:
        flat[-1] = np.inf
    elif how == "scale":
        a *= 1.01
    elif how == "zero":
        a[:] = 0
    elif how == "perm" and a.ndim == 2:
        a = a[::-1].copy()
    elif how == "neg":
        a = -a
    elif how == "identity" and a.ndim == 2 and a.shape[0] == a.shape[1]:
        a = np.eye(a.shape[0], dtype=np.float32)
    elif how == "big":
        a = a + 1.0
    return a


def build_artifact_bytes(base: bytes, muts: list[dict]) -> bytes:
    meta, arrays = _st_parse(base)
    tensors = {n: ("F32", list(a.shape), np.ascontiguousarray(a, "<f4").tobytes()) for n, a in arrays.items()}
    offsets: dict[str, list[int]] = {}
    raw_ops = []
    for m in muts:
        op = m["op"]
        if op == "meta_del":
            meta.pop(m["key"], None)
        elif op == "meta_set":
            meta[m["key"]] = _spec_text(m["value"])
        elif op == "meta_raw":
            meta[m["key"]] = m["value"]
        elif op == "dtype" and m["name"] in tensors:
            a = arrays[m["name"]]
            if m["dtype"] == "BF16":
                tensors[m["name"]] = ("BF16", list(a.shape), _bf16_bytes(a))
            else:
                tensors[m["name"]] = (m["dtype"], list(a.shape), a.astype(_ST_DTYPES[m["dtype"]]).tobytes())
        elif op == "values" and m["name"] in tensors:
            arrays[m["name"]] = _artifact_values(arrays[m["name"]], m["how"])
            a = arrays[m["name"]]
            tensors[m["name"]] = ("F32", list(a.shape), a.astype("<f4").tobytes())
        elif op == "shape" and m["name"] in tensors:
            n = int(np.prod(m["shape"])) if m["shape"] else 1
            a = np.random.default_rng(n).standard_normal(n).astype("<f4") * 0.1
            tensors[m["name"]] = ("F32", list(m["shape"]), a.tobytes())
        elif op == "del":
            tensors.pop(m["name"], None)
        elif op == "add":
            tensors[m["name"]] = ("F32", [64, 64], np.eye(64, dtype="<f4").tobytes())
        elif op == "offsets" and m["name"] in tensors:
            size = len(tensors[m["name"]][2])
            offsets[m["name"]] = {"beyond": [0, size + (1 << 30)], "reverse": [size, 0],
                                  "overlap": [0, size], "short": [0, max(0, size - 4)]}[m["how"]]
        elif op in ("raw", "truncate", "flip"):
            raw_ops.append(m)
    # safetensors requires string metadata; json.dumps of anything else still makes a file
    data = _st_serialize(meta, tensors, offsets)
    for m in raw_ops:
        if m["op"] in ("truncate", "flip"):
            data = damage_bytes(data, m)
        elif m["how"] == "invalid_json":
            data = struct.pack("<Q", 8) + b"{not js}" + data[8:]
        elif m["how"] == "not_object":
            h = b"[1,2,3] "
            data = struct.pack("<Q", len(h)) + h
        elif m["how"] == "huge_len":
            data = struct.pack("<Q", (1 << 63) - 1) + data[8:]
        elif m["how"] == "zero_len":
            data = struct.pack("<Q", 0) + data[8:]
        elif m["how"] == "len_beyond":
            data = struct.pack("<Q", len(data)) + data[8:]
        elif m["how"] == "empty_file":
            data = b""
        elif m["how"] == "trailing_garbage":
            data = data + b"\xde\xad\xbe\xef" * 3
    return data


# ---- RotationZoo .pt pairs (built with torch in the parent; the worker only reads) ------------

def _zoo_object(kind: str, muts: list[dict], seed: int):
    import torch
    rng = np.random.default_rng(seed)
    d = TINY.head_dim
    layers: Any = {i: {"rotation": torch.from_numpy(random_rotation(d, rng)),
                       "eigenvalues": torch.from_numpy(np.sort(rng.random(d)).astype(np.float32))}
                   for i in range(TINY.n_layer)}
    obj: dict[str, Any] = {"format_version": 1, "objective": "qqt" if kind == "k" else "sst", "layers": layers}
    odd_kinds = {"list": [1.0, 2.0], "float": 1.0, "str": "rotation", "none": None, "dict": {"a": 1},
                 "nested_list": [[1.0] * 4] * 4, "int": 7}
    for m in muts:
        op = m["op"]
        if op == "format_version" or op == "objective":
            v = m["value"]
            if v == "absent":
                obj.pop(op, None)
            else:
                obj[op] = ("o" * v["n"]) if isinstance(v, dict) else v
        elif op == "layers":
            v = m["value"]
            if v == "absent":
                obj.pop("layers", None)
            elif v == "list":
                obj["layers"] = list(layers.values()) if isinstance(layers, dict) else layers
            else:
                obj["layers"] = {"none": None, "tensor": torch.zeros(2), "str": "layers", "empty": {}}[v]
        elif not isinstance(obj.get("layers"), dict):
            continue
        elif op == "layer_key":
            lay = obj["layers"]
            if m["layer"] in lay:
                lay[m["key"]] = lay.pop(m["layer"])
        elif op in ("entry_drop", "entry_kind", "field_kind", "rot_shape", "rot_dtype", "rot_values", "eig"):
            entry = obj["layers"].get(m["layer"])
            if not isinstance(entry, dict):
                continue
            if op == "entry_drop":
                entry.pop(m["field"], None)
            elif op == "entry_kind":
                obj["layers"][m["layer"]] = odd_kinds[m["kind"]]
            elif op == "field_kind":
                entry[m["field"]] = odd_kinds[m["kind"]]
            elif op == "rot_shape":
                n = int(np.prod(m["shape"])) if m["shape"] else 1
                entry["rotation"] = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).reshape(m["shape"])
            elif op == "rot_dtype" and isinstance(entry.get("rotation"), torch.Tensor):
                # a complex rotation (an earlier mutation) cast to a real dtype drops its imaginary
                # part on purpose: torch's warning about that is noise in the test output
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    entry["rotation"] = entry["rotation"].to(getattr(torch, m["dtype"]))
            elif op == "rot_values" and isinstance(entry.get("rotation"), torch.Tensor):
                r = entry["rotation"].clone().float()
                if m["how"] == "nan":
                    r.view(-1)[0] = float("nan")
                elif m["how"] == "inf":
                    r.view(-1)[-1] = float("inf")
                elif m["how"] == "zero":
                    r.zero_()
                elif m["how"] == "scale":
                    r *= 1.01
                elif m["how"] == "perm":
                    r = r.flip(0)
                else:
                    r = -r
                entry["rotation"] = r
            elif op == "eig":
                n = int(np.prod(m["shape"])) if m["shape"] else 1
                e = torch.ones(n).reshape(m["shape"])
                if m["nan"] and n:
                    e.view(-1)[0] = float("nan")
                entry["eigenvalues"] = e
        elif op == "v_fewer_layers" and kind == "v":
            obj["layers"].pop(TINY.n_layer - 1, None)
    return obj


def build_zoo_bytes(kind: str, muts: list[dict], seed: int) -> bytes:
    import datetime
    import torch
    raw = [m for m in muts if m["op"] in ("raw", "truncate", "flip")]
    obj = _zoo_object(kind, [m for m in muts if m not in raw], seed)
    for m in raw:
        if m["op"] == "raw" and m["how"] == "not_weights_only":
            obj["when"] = datetime.date(2026, 1, 1)  # a pickled object weights_only refuses
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    for m in raw:
        if m["op"] in ("truncate", "flip"):
            data = damage_bytes(data, m)
        elif m["how"] == "empty":
            data = b""
        elif m["how"] == "garbage":
            data = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        elif m["how"] == "zip_garbage":
            data = b"PK\x03\x04" + data[4:64] + b"\0" * 256
    return data
