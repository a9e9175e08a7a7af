"""What the fuzz harness feeds the readers: GGUF documents that can be written malformed on
purpose, the tiny models they start from, and the tiny calibration artifact.

A GGUFDoc is a GGUF as a list of entries whose every count, type and offset may lie; serialize()
writes it byte by byte, lies included. The valid starting points are defined once, as keys and
tensors (tiny_model_parts), and written either through the format contract's writer (a valid file)
or into a GGUFDoc (to be damaged).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..format import gguf_keys, oscar2
from ..format import gguf_keys as K
from ..format.gguf_write import Key, oscar_keys, write_gguf
from ..format.rotations import random_rotation

# GGUF value types (gguf.h)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
# ggml types: (elements per block, bytes per block); enough to size the data we write
GGML_F32, GGML_F16, GGML_Q8_0, GGML_I32, GGML_F64, GGML_BF16 = 0, 1, 8, 26, 28, 30
_TYPE_SIZE = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144), 24: (1, 1),
              26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2), 100: (128, 36), 101: (64, 20)}
GGML_MAX_NAME = 64
GGML_MAX_DIMS = 4
ALIGN = 32


@dataclass
class KV:
    key: bytes
    vtype: int
    value: Any                  # python value; bytes for strings; list for arrays
    etype: int | None = None    # element type of an array
    count: int | None = None    # array count written in the file (None: the real length)


@dataclass
class Tensor:
    name: bytes
    ne: list[int]
    ttype: int
    data: bytes
    offset: int | None = None   # None: the running, aligned offset
    n_dims: int | None = None   # dimension count written in the file (None: len(ne))


@dataclass
class GGUFDoc:
    kvs: list[KV]
    tensors: list[Tensor]
    version: int = 3
    n_tensors: int | None = None  # header counts; None: the real ones
    n_kv: int | None = None

    def find(self, key: str) -> KV | None:
        kb = key.encode()
        return next((kv for kv in self.kvs if kv.key == kb), None)

    def remove(self, key: str) -> None:
        kb = key.encode()
        self.kvs = [kv for kv in self.kvs if kv.key != kb]

    def set(self, key: str, vtype: int, value, etype: int | None = None) -> None:
        kv = self.find(key)
        if kv is None:
            self.kvs.append(KV(key.encode(), vtype, value, etype))
        else:
            kv.vtype, kv.value, kv.etype, kv.count = vtype, value, etype, None

    def tensor(self, name: str) -> Tensor | None:
        nb = name.encode()
        return next((t for t in self.tensors if t.name == nb), None)


def _enc_str(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def _enc_value(vtype: int, value, etype: int | None = None, count: int | None = None) -> bytes:
    if vtype in _SCALAR:
        return struct.pack(_SCALAR[vtype], value)
    if vtype == STRING:
        return _enc_str(value)
    if vtype == ARRAY:
        n = len(value) if count is None else count
        head = struct.pack("<IQ", etype, n)
        if etype in _SCALAR and etype not in (BOOL,):
            return head + np.asarray(value, dtype=np.dtype(_SCALAR[etype])).tobytes()
        return head + b"".join(_enc_value(etype, v) for v in value)
    # an invalid type id: write it with a few bytes so that the reader has to refuse it
    return b"\0" * 8


def serialize(doc: GGUFDoc) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file bytes and the byte range of each region (for targeted damage)."""
    out = bytearray(b"GGUF")
    n_t = len(doc.tensors) if doc.n_tensors is None else doc.n_tensors
    n_kv = len(doc.kvs) if doc.n_kv is None else doc.n_kv
    out += struct.pack("<IQQ", doc.version, n_t, n_kv)
    kv0 = len(out)
    for kv in doc.kvs:
        out += _enc_str(kv.key) + struct.pack("<I", kv.vtype) + _enc_value(kv.vtype, kv.value, kv.etype, kv.count)
    ti0 = len(out)
    offset = 0
    for t in doc.tensors:
        off = offset if t.offset is None else t.offset
        n_dims = len(t.ne) if t.n_dims is None else t.n_dims
        out += _enc_str(t.name) + struct.pack("<I", n_dims) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
        out += struct.pack("<IQ", t.ttype, off)
        offset += len(t.data) + (-len(t.data)) % ALIGN
    out += b"\0" * ((-len(out)) % ALIGN)
    d0 = len(out)
    for t in doc.tensors:
        out += t.data + b"\0" * ((-len(t.data)) % ALIGN)
    return bytes(out), {"header": (0, kv0), "kv": (kv0, ti0), "ti": (ti0, d0), "data": (d0, len(out))}


def tensor_bytes(ttype: int, ne: list[int]) -> int:
    blk, size = _TYPE_SIZE.get(ttype, (1, 4))
    n = int(np.prod(ne)) if ne else 1
    return max(0, n // blk * size)


# ---- the tiny model --------------------------------------------------------------------------

@dataclass(frozen=True)
class TinyShape:
    """A 2-layer llama small enough that loading it costs milliseconds."""
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 64
    n_ff: int = 256
    arch: str = "llama"


TINY = TinyShape()
_WORDS = ["the", "a", "cat", "dog", "is", "and", "of", "to", "in", "on", "sat", "mat", "sun", "day"]
Tensors = list[tuple[str, np.ndarray]]


def tiny_vocab_keys() -> list[Key]:
    """A self-contained SentencePiece ("llama") vocabulary: control tokens, the 256 byte
    tokens (which any text falls back to) and a few words."""
    toks = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    toks += [("\u2581" + w).encode() for w in _WORDS]
    types = [2, 3, 3] + [6] * 256 + [1] * len(_WORDS)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(_WORDS))]
    return [("tokenizer.ggml.model", STRING, b"llama", None),
            ("tokenizer.ggml.tokens", ARRAY, toks, STRING),
            ("tokenizer.ggml.scores", ARRAY, scores, F32),
            ("tokenizer.ggml.token_type", ARRAY, types, I32),
            ("tokenizer.ggml.bos_token_id", U32, 1, None),
            ("tokenizer.ggml.eos_token_id", U32, 2, None),
            ("tokenizer.ggml.unknown_token_id", U32, 0, None),
            ("tokenizer.ggml.add_bos_token", BOOL, True, None)]


def scaled_normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random f32 weights of a matrix whose rows have shape[-1] inputs (numpy order)."""
    return (rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])).astype(np.float32)


def tiny_model_parts(shape: TinyShape = TINY, rotations: bool = True, seed: int = 0) -> tuple[str, list[Key], Tensors]:
    """(architecture, keys, tensors) of a valid llama GGUF with f32 random weights and
    (optionally) OSCAR rotations and keys."""
    s, a = shape, shape.arch
    rng = np.random.default_rng(seed)
    vocab = tiny_vocab_keys()
    n_vocab = len(vocab[1][2])
    keys = [("general.name", STRING, b"oscar-fuzz tiny", None)]
    keys += [(f"{a}.{k}", U32, v, None) for k, v in (
        ("block_count", s.n_layer), ("context_length", 512), ("embedding_length", s.n_embd),
        ("feed_forward_length", s.n_ff), ("attention.head_count", s.n_head), ("attention.head_count_kv", s.n_head_kv),
        ("attention.key_length", s.head_dim), ("attention.value_length", s.head_dim),
        ("rope.dimension_count", s.head_dim))]
    keys += [(f"{a}.rope.freq_base", F32, 10000.0, None),
             (f"{a}.attention.layer_norm_rms_epsilon", F32, 1e-5, None)] + vocab
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    ones = np.ones(s.n_embd, np.float32)
    tensors = [("token_embd.weight", scaled_normal(rng, n_vocab, s.n_embd)), ("output_norm.weight", ones)]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", ones),
                    (b + "attn_q.weight", scaled_normal(rng, q_dim, s.n_embd)),
                    (b + "attn_k.weight", scaled_normal(rng, kv_dim, s.n_embd)),
                    (b + "attn_v.weight", scaled_normal(rng, kv_dim, s.n_embd)),
                    (b + "attn_output.weight", scaled_normal(rng, s.n_embd, q_dim)),
                    (b + "ffn_norm.weight", ones),
                    (b + "ffn_gate.weight", scaled_normal(rng, s.n_ff, s.n_embd)),
                    (b + "ffn_up.weight", scaled_normal(rng, s.n_ff, s.n_embd)),
                    (b + "ffn_down.weight", scaled_normal(rng, s.n_embd, s.n_ff))]
    if rotations:
        for i in range(s.n_layer):
            tensors += [(K.K_ROT.format(i), random_rotation(s.head_dim, rng)),
                        (K.V_ROT.format(i), random_rotation(s.head_dim, rng))]
        n = s.n_layer
        keys += oscar_keys(oscar2.group_size(s.head_dim), [gguf_keys.DEFAULT_CLIP_K] * n, [gguf_keys.DEFAULT_CLIP_V] * n,
                           gguf_keys.DEFAULT_SINK, gguf_keys.DEFAULT_RECENT, {"method": "oscar fuzz: random orthogonal"})
    return a, keys, tensors


def doc_of(arch: str, keys: list[Key], tensors: Tensors) -> GGUFDoc:
    """The GGUFDoc of a valid model: general.architecture first, then the keys, strings as bytes."""
    def as_bytes(v):
        return v.encode() if isinstance(v, str) else v

    kvs = [KV(b"general.architecture", STRING, arch.encode())]
    for key, vtype, value, etype in keys:
        value = [as_bytes(x) for x in value] if vtype == ARRAY else as_bytes(value)
        kvs.append(KV(key.encode(), int(vtype), value, None if etype is None else int(etype)))
    return GGUFDoc(kvs, [_f32_tensor(name, arr) for name, arr in tensors])


def tiny_model(shape: TinyShape = TINY, rotations: bool = True, seed: int = 0) -> GGUFDoc:
    """The tiny model as a GGUFDoc, to be damaged."""
    return doc_of(*tiny_model_parts(shape, rotations, seed))


def write_tiny_model(path: str | Path, shape: TinyShape = TINY, rotations: bool = False, seed: int = 0) -> Path:
    """The tiny model as a valid file, through the format contract's writer."""
    return write_gguf(Path(path), *tiny_model_parts(shape, rotations, seed))


def _f32_tensor(name: str, arr: np.ndarray) -> Tensor:
    a = np.ascontiguousarray(arr, dtype="<f4")
    return Tensor(name.encode(), list(a.shape[::-1]), GGML_F32, a.tobytes())


# ---- value specs: JSON-friendly descriptions of strings (a 1 MiB string stays small) ----------

def _spec_bytes(spec) -> bytes:
    """{"s": text} | {"rep": text, "n": count} | {"hex": "ff00"} -> bytes."""
    if "s" in spec:
        return spec["s"].encode("utf-8", "surrogatepass")
    if "rep" in spec:
        return (spec["rep"] * spec["n"]).encode()
    return bytes.fromhex(spec["hex"])


def _spec_text(spec) -> str:
    return _spec_bytes(spec).decode("utf-8", "replace")


# ---- the tiny calibration artifact ----------------------------------------------------------

def tiny_artifact(seed: int = 0):
    """A valid RotationArtifact for the tiny model."""
    from ..calibrate.artifact import RotationArtifact
    rng = np.random.default_rng(seed)
    L, d = TINY.n_layer, TINY.head_dim
    return RotationArtifact(
        architecture=TINY.arch, n_layers=L, head_dim=d, n_head=TINY.n_head, n_head_kv=TINY.n_head_kv,
        rope_layout="hf", k_rot={i: random_rotation(d, rng) for i in range(L)},
        v_rot={i: random_rotation(d, rng) for i in range(L)},
        k_eigenvalues={i: np.sort(rng.random(d)).astype(np.float32) for i in range(L)},
        v_eigenvalues={i: np.sort(rng.random(d)).astype(np.float32) for i in range(L)},
        clip_k=np.full(L, gguf_keys.DEFAULT_CLIP_K, np.float32),
        clip_v=np.full(L, gguf_keys.DEFAULT_CLIP_V, np.float32),
        model="tiny", model_sha256="0" * 64, corpus="fuzz", tokens=1, method="fuzz", date="2026-01-01",
        tool="oscar fuzz")
