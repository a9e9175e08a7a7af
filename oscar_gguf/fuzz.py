"""`oscar fuzz`: bounded fuzzing of everything that parses OSCAR inputs.

Targets (each case is one generated input, driven through every consumer of that format):

  gguf      a tiny, fully valid llama GGUF with OSCAR rotations, mutated (oscar.* metadata,
            blk.{i}.attn_{k,v}_rot tensors, model keys, tensor table, truncation, bit flips),
            then fed to the patched llama.cpp loader (model load + oscar2 context + decode),
            `oscar inspect` and `oscar-convert --replace`
  artifact  a valid calibration artifact (.safetensors), mutated at the byte, header and
            tensor level, then read by `load_artifact` and converted into the tiny GGUF
  zoo       a valid RotationZoo .pt pair, mutated in structure, dtypes, shapes and bytes, then
            imported by `import_rotationzoo` (through oscar-convert's own path) and converted

Every case must end in a clear refusal or a correct result:
  * no crash: the worker process never dies by a signal (abort, segfault), and Python code
    raises only our own errors (ConvertError; the readers' documented ValueError, raised by a
    `raise` statement of ours, never a stray int()/index error) with a one-line message;
  * no hang: every case runs under a timeout in a worker process that is killed past it;
  * no partial output: the output folder holds the finished file or nothing;
  * inputs unchanged: sha256 of every input file before and after;
  * correct results: what oscar-convert writes must load in llama.cpp, and the loader's
    verdict must match an independent model of the rules (the oracle below) wherever the
    rules are definite (a NaN rotation is refused, a permuted one is accepted, ...).

Inputs are generated with hypothesis (structured strategies, no shrinking: a failing case is
saved with its inputs for replay), in chunks until the time budget is spent. Workers are
long-lived subprocesses (`python -m oscar_gguf.fuzz --worker ...`) that take one JSON request a
line, so a crash or hang costs one case and a restart, not the run.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import io
import json
import math
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_keys as K

# ============================================================================================
# GGUF: an in-memory document that can also be written malformed
# ============================================================================================

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


def _vocab_kvs() -> list[KV]:
    """A self-contained SentencePiece ("llama") vocabulary: control tokens, the 256 byte
    tokens (which any text falls back to) and a few words."""
    toks = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    toks += [("\u2581" + w).encode() for w in _WORDS]
    types = [2, 3, 3] + [6] * 256 + [1] * len(_WORDS)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(_WORDS))]
    return [KV(b"tokenizer.ggml.model", STRING, b"llama"),
            KV(b"tokenizer.ggml.tokens", ARRAY, toks, STRING),
            KV(b"tokenizer.ggml.scores", ARRAY, scores, F32),
            KV(b"tokenizer.ggml.token_type", ARRAY, types, I32),
            KV(b"tokenizer.ggml.bos_token_id", U32, 1),
            KV(b"tokenizer.ggml.eos_token_id", U32, 2),
            KV(b"tokenizer.ggml.unknown_token_id", U32, 0),
            KV(b"tokenizer.ggml.add_bos_token", BOOL, True)]


def random_orthogonal(d: int, rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def _f32_tensor(name: str, arr: np.ndarray) -> Tensor:
    a = np.ascontiguousarray(arr, dtype="<f4")
    return Tensor(name.encode(), list(a.shape[::-1]), GGML_F32, a.tobytes())


def tiny_model(shape: TinyShape = TINY, rotations: bool = True, seed: int = 0) -> GGUFDoc:
    """A valid llama GGUF with f32 random weights and (optionally) OSCAR rotations + keys."""
    s, a = shape, shape.arch
    rng = np.random.default_rng(seed)
    vocab = _vocab_kvs()
    n_vocab = len(vocab[1].value)
    kvs = [KV(b"general.architecture", STRING, a.encode()),
           KV(b"general.name", STRING, b"oscar-fuzz tiny"),
           KV(f"{a}.block_count".encode(), U32, s.n_layer),
           KV(f"{a}.context_length".encode(), U32, 512),
           KV(f"{a}.embedding_length".encode(), U32, s.n_embd),
           KV(f"{a}.feed_forward_length".encode(), U32, s.n_ff),
           KV(f"{a}.attention.head_count".encode(), U32, s.n_head),
           KV(f"{a}.attention.head_count_kv".encode(), U32, s.n_head_kv),
           KV(f"{a}.attention.key_length".encode(), U32, s.head_dim),
           KV(f"{a}.attention.value_length".encode(), U32, s.head_dim),
           KV(f"{a}.rope.dimension_count".encode(), U32, s.head_dim),
           KV(f"{a}.rope.freq_base".encode(), F32, 10000.0),
           KV(f"{a}.attention.layer_norm_rms_epsilon".encode(), F32, 1e-5)] + vocab

    def w(rows, cols):
        return rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)

    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    tensors = [_f32_tensor("token_embd.weight", w(n_vocab, s.n_embd)),
               _f32_tensor("output_norm.weight", np.ones(s.n_embd))]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        tensors += [_f32_tensor(b + "attn_norm.weight", np.ones(s.n_embd)),
                    _f32_tensor(b + "attn_q.weight", w(q_dim, s.n_embd)),
                    _f32_tensor(b + "attn_k.weight", w(kv_dim, s.n_embd)),
                    _f32_tensor(b + "attn_v.weight", w(kv_dim, s.n_embd)),
                    _f32_tensor(b + "attn_output.weight", w(s.n_embd, q_dim)),
                    _f32_tensor(b + "ffn_norm.weight", np.ones(s.n_embd)),
                    _f32_tensor(b + "ffn_gate.weight", w(s.n_ff, s.n_embd)),
                    _f32_tensor(b + "ffn_up.weight", w(s.n_ff, s.n_embd)),
                    _f32_tensor(b + "ffn_down.weight", w(s.n_embd, s.n_ff))]
    doc = GGUFDoc(kvs, tensors)
    if rotations:
        for i in range(s.n_layer):
            doc.tensors.append(_f32_tensor(K.K_ROT.format(i), random_orthogonal(s.head_dim, rng)))
            doc.tensors.append(_f32_tensor(K.V_ROT.format(i), random_orthogonal(s.head_dim, rng)))
        doc.kvs += [KV(K.KEY_FORMAT_VERSION.encode(), U32, K.FORMAT_VERSION),
                    KV(K.KEY_GROUP_SIZE.encode(), U32, 64),
                    KV(K.KEY_CLIP_K.encode(), ARRAY, [K.DEFAULT_CLIP_K] * s.n_layer, F32),
                    KV(K.KEY_CLIP_V.encode(), ARRAY, [K.DEFAULT_CLIP_V] * s.n_layer, F32),
                    KV(K.KEY_SINK.encode(), U32, K.DEFAULT_SINK),
                    KV(K.KEY_RECENT.encode(), U32, K.DEFAULT_RECENT),
                    KV(K.KEY_ROPE_LAYOUT.encode(), STRING, b"llama.cpp"),
                    KV((K.KEY_CALIB_PREFIX + "method").encode(), STRING, b"oscar fuzz: random orthogonal")]
    return doc


def tiny_mla_model(seed: int = 0, rotations: bool = False) -> GGUFDoc:
    """A valid 1-layer deepseek2 GGUF with multi-head latent attention (MLA): its KV cache holds
    one 128-wide latent row per token (kv_lora_rank 64 + RoPE 64), not per-head keys and values,
    so oscar2 and the rotations must refuse it. The layer is dense (leading_dense_block_count 1),
    so no expert tensors are needed."""
    a, n_embd, n_head, n_ff = "deepseek2", 128, 2, 256
    kv_lora, rope, nope, v_head = 64, 64, 64, 64
    rng = np.random.default_rng(seed)
    vocab = _vocab_kvs()
    n_vocab = len(vocab[1].value)
    u32 = lambda k, v: KV(f"{a}.{k}".encode(), U32, v)
    kvs = [KV(b"general.architecture", STRING, a.encode()),
           KV(b"general.name", STRING, b"oscar-fuzz tiny mla"),
           u32("block_count", 1), u32("context_length", 512), u32("embedding_length", n_embd),
           u32("feed_forward_length", n_ff), u32("attention.head_count", n_head), u32("attention.head_count_kv", 1),
           u32("attention.key_length", kv_lora + rope), u32("attention.value_length", kv_lora),
           u32("attention.key_length_mla", nope + rope), u32("attention.value_length_mla", v_head),
           u32("attention.q_lora_rank", 0), u32("attention.kv_lora_rank", kv_lora),
           u32("rope.dimension_count", rope), u32("leading_dense_block_count", 1),
           u32("expert_feed_forward_length", 64), u32("expert_shared_count", 1),
           KV(f"{a}.rope.freq_base".encode(), F32, 10000.0),
           KV(f"{a}.attention.layer_norm_rms_epsilon".encode(), F32, 1e-5)] + vocab

    def w(*shape):  # numpy order, i.e. ggml's ne reversed
        return rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])

    b = "blk.0."
    tensors = [_f32_tensor("token_embd.weight", w(n_vocab, n_embd)),
               _f32_tensor("output_norm.weight", np.ones(n_embd)),
               _f32_tensor(b + "attn_norm.weight", np.ones(n_embd)),
               _f32_tensor(b + "attn_q.weight", w(n_head * (nope + rope), n_embd)),
               _f32_tensor(b + "attn_kv_a_mqa.weight", w(kv_lora + rope, n_embd)),
               _f32_tensor(b + "attn_kv_a_norm.weight", np.ones(kv_lora)),
               _f32_tensor(b + "attn_k_b.weight", w(n_head, kv_lora, nope)),
               _f32_tensor(b + "attn_v_b.weight", w(n_head, v_head, kv_lora)),
               _f32_tensor(b + "attn_output.weight", w(n_embd, n_head * v_head)),
               _f32_tensor(b + "ffn_norm.weight", np.ones(n_embd)),
               _f32_tensor(b + "ffn_gate.weight", w(n_ff, n_embd)),
               _f32_tensor(b + "ffn_up.weight", w(n_ff, n_embd)),
               _f32_tensor(b + "ffn_down.weight", w(n_embd, n_ff))]
    if rotations:  # orthogonal and of the cache's row sizes: refused for the architecture, not the values
        tensors += [_f32_tensor(K.K_ROT.format(0), random_orthogonal(kv_lora + rope, rng)),
                    _f32_tensor(K.V_ROT.format(0), random_orthogonal(kv_lora, rng))]
    return GGUFDoc(kvs, tensors)


def write_tiny_mla_model(path: str | Path, seed: int = 0, rotations: bool = False) -> Path:
    path = Path(path)
    path.write_bytes(serialize(tiny_mla_model(seed, rotations))[0])
    return path


def write_tiny_model(path: str | Path, shape: TinyShape = TINY, rotations: bool = False, seed: int = 0) -> Path:
    """Write the tiny model (used by the tests for synthetic shapes, e.g. head_dim 80)."""
    path = Path(path)
    path.write_bytes(serialize(tiny_model(shape, rotations, seed))[0])
    return path


# ============================================================================================
# Value specs: JSON-friendly descriptions of strings and arrays (a 1 MiB string stays small)
# ============================================================================================

def _spec_bytes(spec) -> bytes:
    """{"s": text} | {"rep": text, "n": count} | {"hex": "ff00"} -> bytes."""
    if "s" in spec:
        return spec["s"].encode("utf-8", "surrogatepass")
    if "rep" in spec:
        return (spec["rep"] * spec["n"]).encode()
    return bytes.fromhex(spec["hex"])


def _spec_text(spec) -> str:
    return _spec_bytes(spec).decode("utf-8", "replace")


# ============================================================================================
# Hypothesis strategies
# ============================================================================================

NAN, INF = float("nan"), float("inf")
OSCAR_U32_KEYS = [K.KEY_FORMAT_VERSION, K.KEY_SINK, K.KEY_RECENT]
OSCAR_CLIP_KEYS = [K.KEY_CLIP_K, K.KEY_CLIP_V]
OSCAR_FREE_KEYS = [K.KEY_GROUP_SIZE, K.KEY_ROPE_LAYOUT, K.KEY_CALIB_PREFIX + "method"]
# model keys we delete, and whether llama.cpp must then refuse the tiny model
MODEL_KEY_DELETIONS = {"general.architecture": "refuse", "llama.block_count": "refuse",
                       "llama.embedding_length": "refuse", "llama.attention.head_count": "refuse",
                       "llama.attention.key_length": "accept", "tokenizer.ggml.tokens": "refuse"}
# tensor names that llama.cpp does not know (or that gguf_io might half-know)
ODD_TENSOR_NAMES = ["blk.2.attn_k_rot", "blk.999.attn_v_rot", "blk.-1.attn_k_rot", "blk.\u00b2.attn_k_rot",
                    "blk.\u0663.attn_v_rot", "blk.00.attn_k_rot", "blk.0.attn_K_rot", "blk.0.attn_k_rot.x",
                    "blk. 0.attn_k_rot", "blk.0.attn_k_rot" + "x" * 60, "blk.0.attn_q_rot"]
ROT_VALUE_OPS = {  # op -> what llama.cpp must do with the tensor
    "nan": "refuse", "inf": "refuse", "neg_inf": "refuse", "zero": "refuse", "scale_big": "refuse",
    "half": "refuse", "huge": "refuse", "perturb_big": "refuse",
    "scale_tiny": "accept", "perm": "accept", "neg": "accept", "transpose": "accept", "identity": "accept",
    "subnormal": "accept"}
ROT_SHAPES = [[64, 63], [63, 64], [128, 128], [32, 32], [64], [64, 64, 1], [64, 64, 2], [4096], [0, 64],
              [64, 64, 1, 1], [1, 64, 64]]
ROT_DTYPES = [1, 30, 8, 26, 28, 100, 101, 200, 4, 24]


def _strategies():
    """Built lazily: hypothesis is only needed when fuzzing."""
    from hypothesis import strategies as st

    text_spec = st.one_of(
        st.sampled_from(["", "1", "llama.cpp", "hf", "x", "\u00b2", "-1", "nan"]).map(lambda s: {"s": s}),
        st.text(max_size=40).map(lambda s: {"s": s}),
        st.sampled_from([1 << 10, 1 << 16, 1 << 20]).map(lambda n: {"rep": "H", "n": n}),
        st.binary(min_size=1, max_size=8).map(lambda b: {"hex": (b + b"\xff").hex()}))
    u32_vals = st.sampled_from([0, 1, 2, 63, 64, 256, 1 << 20, (1 << 20) + 1, 1 << 31, (1 << 32) - 1])
    f32_elems = st.sampled_from([0.96, 0.92, 1.0, 0.5, 0.0, -1.0, 1.5, NAN, INF, -INF, 1e-45, 1.0000001])

    def typed_value(for_clip: bool):
        arrays = st.tuples(st.sampled_from([0, 1, 2, 3, 1000]), f32_elems, st.booleans()).map(
            lambda x: {"t": ARRAY, "et": F32, "n": x[0], "fill": x[1], "vary": x[2]})
        other = st.one_of(
            u32_vals.map(lambda v: {"t": U32, "v": v}),
            st.sampled_from([-1, -(1 << 31), 0, 1, 64]).map(lambda v: {"t": I32, "v": v}),
            st.sampled_from([1, 1 << 63]).map(lambda v: {"t": U64, "v": v}),
            st.sampled_from([1.0, NAN, INF, 0.5]).map(lambda v: {"t": F32, "v": v}),
            st.booleans().map(lambda v: {"t": BOOL, "v": v}),
            text_spec.map(lambda s: {"t": STRING, "v": s}),
            st.sampled_from([I32, F64, STRING, U8]).map(lambda et: {"t": ARRAY, "et": et, "n": 2}),
            st.just({"t": 13, "v": 0}))  # an invalid type id
        return st.one_of(arrays, arrays, other) if for_clip else st.one_of(other, other, arrays)

    meta_set = st.one_of(
        st.tuples(st.sampled_from(OSCAR_U32_KEYS), typed_value(False)),
        st.tuples(st.sampled_from(OSCAR_CLIP_KEYS), typed_value(True)),
        st.tuples(st.sampled_from(OSCAR_FREE_KEYS), typed_value(False)),
    ).map(lambda x: {"op": "meta_set", "key": x[0], "value": x[1]})
    meta_del = st.sampled_from(OSCAR_U32_KEYS + OSCAR_CLIP_KEYS + OSCAR_FREE_KEYS).map(
        lambda k: {"op": "meta_del", "key": k})
    meta_dup = st.sampled_from(OSCAR_U32_KEYS + OSCAR_CLIP_KEYS).map(lambda k: {"op": "meta_dup", "key": k})
    model_del = st.sampled_from(sorted(MODEL_KEY_DELETIONS)).map(lambda k: {"op": "model_del", "key": k})
    block_count = st.sampled_from([0, 1, 3, 512, 513, 100000, (1 << 32) - 1]).map(
        lambda v: {"op": "block_count", "value": v})
    key_name = st.one_of(
        st.sampled_from([1 << 10, 1 << 16]).map(lambda n: {"rep": "k", "n": n}),
        st.just({"hex": "6f736361722eff"}), st.just({"s": ""}), st.just({"s": "oscar."}),
    ).map(lambda s: {"op": "odd_key", "name": s})
    which = st.sampled_from(["k", "v"])
    layer = st.sampled_from([0, 1])
    rot_values = st.tuples(which, layer, st.sampled_from(sorted(ROT_VALUE_OPS)), st.integers(0, 4095)).map(
        lambda x: {"op": "rot_values", "which": x[0], "layer": x[1], "how": x[2], "at": x[3]})
    rot_dtype = st.tuples(which, layer, st.sampled_from(ROT_DTYPES)).map(
        lambda x: {"op": "rot_dtype", "which": x[0], "layer": x[1], "ttype": x[2]})
    rot_shape = st.tuples(which, layer, st.sampled_from(ROT_SHAPES)).map(
        lambda x: {"op": "rot_shape", "which": x[0], "layer": x[1], "ne": x[2]})
    rot_del = st.tuples(which, layer).map(lambda x: {"op": "rot_del", "which": x[0], "layer": x[1]})
    rot_name = st.tuples(st.sampled_from(ODD_TENSOR_NAMES), st.booleans(), which, layer).map(
        lambda x: {"op": "rot_name", "name": x[0], "rename": x[1], "which": x[2], "layer": x[3]})
    rot_dup = st.tuples(which, layer).map(lambda x: {"op": "rot_dup", "which": x[0], "layer": x[1]})
    offset = st.tuples(st.integers(0, 30), st.sampled_from(["misalign", "beyond", "previous"])).map(
        lambda x: {"op": "offset", "index": x[0], "how": x[1]})
    ndims = st.tuples(which, layer, st.sampled_from([0, 5, 1 << 31])).map(
        lambda x: {"op": "ndims", "which": x[0], "layer": x[1], "n": x[2]})
    lie = st.tuples(st.sampled_from(OSCAR_CLIP_KEYS + ["tokenizer.ggml.tokens"]),
                    st.sampled_from([1, 1 << 20, 1 << 40])).map(lambda x: {"op": "array_lie", "key": x[0], "extra": x[1]})
    counts = st.tuples(st.sampled_from(["n_tensors", "n_kv"]), st.sampled_from([1, 1 << 40, (1 << 64) - 1])).map(
        lambda x: {"op": "counts", "field": x[0], "delta": x[1]})
    version = st.sampled_from([0, 1, 2, 4, (1 << 32) - 1]).map(lambda v: {"op": "version", "value": v})
    trunc = st.tuples(st.sampled_from(["header", "kv", "ti", "data", "any"]), st.floats(0, 1)).map(
        lambda x: {"op": "truncate", "region": x[0], "frac": x[1]})
    flip = st.tuples(st.sampled_from(["kv", "ti", "data", "any"]), st.integers(1, 8), st.integers(0, 1 << 30)).map(
        lambda x: {"op": "flip", "region": x[0], "n": x[1], "seed": x[2]})
    valid = st.sampled_from(["noop", "drop_all_oscar", "strip_rotations", "window_zero"]).map(
        lambda v: {"op": "valid", "how": v})

    gguf_mut = st.one_of(meta_set, meta_set, meta_del, meta_dup, model_del, block_count, key_name,
                         rot_values, rot_values, rot_dtype, rot_shape, rot_del, rot_name, rot_dup,
                         offset, ndims, lie, counts, version, trunc, flip, valid)
    gguf_case = st.lists(gguf_mut, min_size=1, max_size=3).map(lambda m: {"target": "gguf", "mutations": m})

    # -- calibration artifact (safetensors) -------------------------------------------------
    from .calibrate.artifact import REQUIRED_META
    art_names = ["layers.0.k_rot", "layers.1.v_rot", "layers.0.k_eigenvalues", "layers.1.v_eigenvalues",
                 "clip_k", "clip_v"]
    art_meta_vals = st.one_of(
        st.sampled_from(["", "0", "-1", "1", "2", "64", "1e3", "abc", " 2", "\u00b2", "\u0663",
                         "99999999999999999999", "hf", "llama.cpp", "llama", "qwen3", "nan"]).map(lambda s: {"s": s}),
        st.just({"rep": "m", "n": 1 << 20}), st.text(max_size=20).map(lambda s: {"s": s}))
    art_mut = st.one_of(
        st.sampled_from(REQUIRED_META).map(lambda k: {"op": "meta_del", "key": k}),
        st.tuples(st.sampled_from(REQUIRED_META), art_meta_vals).map(
            lambda x: {"op": "meta_set", "key": x[0], "value": x[1]}),
        st.tuples(st.sampled_from(REQUIRED_META), st.sampled_from([1, None, [1], {"a": 1}, True])).map(
            lambda x: {"op": "meta_raw", "key": x[0], "value": x[1]}),
        st.tuples(st.sampled_from(art_names), st.sampled_from(["F16", "BF16", "F64", "I32", "I64", "U8", "BOOL"])).map(
            lambda x: {"op": "dtype", "name": x[0], "dtype": x[1]}),
        st.tuples(st.sampled_from(art_names), st.sampled_from(["nan", "inf", "scale", "zero", "perm", "neg",
                                                               "identity", "big"])).map(
            lambda x: {"op": "values", "name": x[0], "how": x[1]}),
        st.tuples(st.sampled_from(art_names), st.sampled_from([[], [1], [64], [64, 32], [32, 64], [128, 128],
                                                               [2, 64, 64], [0, 64], [3], [2, 2]])).map(
            lambda x: {"op": "shape", "name": x[0], "shape": x[1]}),
        st.sampled_from(art_names).map(lambda n: {"op": "del", "name": n}),
        st.sampled_from(["layers.2.k_rot", "layers.\u00b2.k_rot", "layers.-1.k_rot", "layers.0.q_rot", "foo",
                         "layers.99999999999999999999.k_rot", "layers.0.k_rot.x", "layers..k_rot"]).map(
            lambda n: {"op": "add", "name": n}),
        st.tuples(st.sampled_from(art_names), st.sampled_from(["beyond", "reverse", "overlap", "short"])).map(
            lambda x: {"op": "offsets", "name": x[0], "how": x[1]}),
        st.sampled_from(["invalid_json", "not_object", "huge_len", "zero_len", "len_beyond", "empty_file",
                         "trailing_garbage"]).map(lambda h: {"op": "raw", "how": h}),
        st.floats(0, 1).map(lambda f: {"op": "truncate", "frac": f}),
        st.tuples(st.integers(1, 8), st.integers(0, 1 << 30)).map(lambda x: {"op": "flip", "n": x[0], "seed": x[1]}),
        st.just({"op": "noop"}))
    art_case = st.lists(art_mut, min_size=1, max_size=3).map(lambda m: {"target": "artifact", "mutations": m})

    # -- RotationZoo .pt pair ----------------------------------------------------------------
    zoo_file = st.sampled_from(["k", "v", "both"])
    zoo_mut = st.one_of(
        st.sampled_from(["absent", 1, 2, "1", "x", None, 1.5, [1], True, 10 ** 30]).map(
            lambda v: {"op": "format_version", "value": v}),
        st.sampled_from(["absent", "qqt", 123, None, {"rep": "o", "n": 1 << 16}]).map(
            lambda v: {"op": "objective", "value": v}),
        st.sampled_from(["list", "none", "absent", "tensor", "str", "empty"]).map(
            lambda v: {"op": "layers", "value": v}),
        st.tuples(layer, st.sampled_from(["0", "a", -1, 10 ** 12, True, 1.5, None, "\u00b2", " 1"])).map(
            lambda x: {"op": "layer_key", "layer": x[0], "key": x[1]}),
        st.tuples(layer, st.sampled_from(["rotation", "eigenvalues"])).map(
            lambda x: {"op": "entry_drop", "layer": x[0], "field": x[1]}),
        st.tuples(layer, st.sampled_from(["list", "float", "str", "none", "dict", "nested_list"])).map(
            lambda x: {"op": "entry_kind", "layer": x[0], "kind": x[1]}),
        st.tuples(layer, st.sampled_from(["rotation", "eigenvalues"]),
                  st.sampled_from(["list", "float", "str", "none", "int"])).map(
            lambda x: {"op": "field_kind", "layer": x[0], "field": x[1], "kind": x[2]}),
        st.tuples(layer, st.sampled_from([[], [64], [1, 64, 64], [64, 32], [128, 128], [0], [0, 0]])).map(
            lambda x: {"op": "rot_shape", "layer": x[0], "shape": x[1]}),
        st.tuples(layer, st.sampled_from(["float64", "float16", "bfloat16", "int32", "bool", "complex64",
                                          "uint8"])).map(lambda x: {"op": "rot_dtype", "layer": x[0], "dtype": x[1]}),
        st.tuples(layer, st.sampled_from(["nan", "inf", "zero", "scale", "perm", "neg"])).map(
            lambda x: {"op": "rot_values", "layer": x[0], "how": x[1]}),
        st.tuples(layer, st.sampled_from([[32], [8, 8], [], [0], [64, 1]]), st.booleans()).map(
            lambda x: {"op": "eig", "layer": x[0], "shape": x[1], "nan": x[2]}),
        st.just({"op": "v_fewer_layers"}),
        st.sampled_from(["empty", "garbage", "not_weights_only", "zip_garbage"]).map(lambda h: {"op": "raw", "how": h}),
        st.floats(0, 1).map(lambda f: {"op": "truncate", "frac": f}),
        st.tuples(st.integers(1, 8), st.integers(0, 1 << 30)).map(lambda x: {"op": "flip", "n": x[0], "seed": x[1]}),
        st.just({"op": "noop"}))
    zoo_case = st.tuples(zoo_file, st.lists(zoo_mut, min_size=1, max_size=3)).map(
        lambda x: {"target": "zoo", "file": x[0], "mutations": x[1]})
    return {"gguf": gguf_case, "artifact": art_case, "zoo": zoo_case}


# ============================================================================================
# GGUF mutations and the loader oracle
# ============================================================================================

def _typed(value_spec: dict, n_layer: int) -> tuple[int, Any, int | None]:
    t = value_spec["t"]
    if t == ARRAY:
        et, n = value_spec["et"], value_spec["n"]
        if et == F32:
            fill = value_spec["fill"]
            vals = [fill] * n
            if value_spec.get("vary") and n:
                vals[0] = 0.96  # one good entry among bad ones (the check must look at all)
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
    n_layer = TINY.n_layer
    byte_muts = []
    deltas: dict[str, int] = {}
    for m in muts:
        op = m["op"]
        if op == "meta_set":
            doc.set(m["key"], *_typed(m["value"], n_layer))
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
        elif op in ("rot_values", "rot_dtype", "rot_shape", "rot_del", "rot_dup", "ndims"):
            name = _rot_name(m["which"], m["layer"])
            t = doc.tensor(name)
            if t is None:
                continue
            if op == "rot_values":
                if t.ttype != GGML_F32 or len(t.data) != 4 * 64 * 64:
                    continue
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
                rng = np.random.default_rng(n)
                t.data = (rng.standard_normal(n).astype("<f4") / 8).tobytes()
            elif op == "rot_del":
                doc.tensors.remove(t)
            elif op == "rot_dup":
                doc.tensors.append(Tensor(t.name, list(t.ne), t.ttype, t.data))
            elif op == "ndims":
                if m["n"] <= 8:
                    t.ne = [64] * m["n"]
                else:  # a dimension count the reader must not trust
                    t.n_dims = m["n"]
                    facts["damage"].append("ndims")
        elif op == "rot_name":
            new = m["name"].encode()
            t = doc.tensor(_rot_name(m["which"], m["layer"]))
            if m["rename"] and t is not None:
                t.name = new
            else:
                doc.tensors.append(_f32_tensor(m["name"], np.eye(64)))
        elif op == "offset":
            if m["index"] < len(doc.tensors):
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
                    continue
                facts["damage"].append("offset")
        elif op == "array_lie":
            kv = doc.find(m["key"])
            if kv is not None and kv.vtype == ARRAY:
                kv.count = len(kv.value) + m["extra"]  # the file ends long before
        elif op == "counts":  # applied to the final counts below (later ops may add or remove entries)
            deltas[m["field"]] = (deltas.get(m["field"], 0) + m["delta"]) % (1 << 64)
        elif op == "version":  # judged on the final value below (a later op may set it again)
            doc.version = m["value"]
        elif op == "valid":
            if m["how"] == "drop_all_oscar":
                doc.kvs = [kv for kv in doc.kvs if not kv.key.startswith(b"oscar.")]
            elif m["how"] == "strip_rotations":
                doc.tensors = [t for t in doc.tensors if not t.name.endswith(b"_rot")]
            elif m["how"] == "window_zero":
                doc.set(K.KEY_SINK, U32, 0)
                doc.set(K.KEY_RECENT, U32, 0)
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
            rng = np.random.default_rng(m["seed"])
            buf = bytearray(data)
            for _ in range(m["n"]):
                p = int(rng.integers(lo, hi))
                buf[p] ^= 1 << int(rng.integers(0, 8))
            data = bytes(buf)
            facts["uncertain"].append(f"flip in {m.get('region', 'any')}")
    return data, facts


_ROT_NAMES = {(K.K_ROT if w == "k" else K.V_ROT).format(i).encode() for w in "kv" for i in range(TINY.n_layer)}


def _valid_u32(kv: KV | None) -> int | None:
    """The value the loader reads for an unsigned-int oscar key, or None if it must refuse."""
    if kv.vtype == U32:
        return kv.value
    if kv.vtype == I32 and kv.value >= 0:
        return kv.value
    return None


def _rotation_problem(t: Tensor, d: int) -> str | None:
    """Why llama.cpp must refuse this rotation tensor ("" if borderline), None if it is fine."""
    if t.ttype != GGML_F32:
        return "type"
    if len(t.ne) > GGML_MAX_DIMS or list(t.ne) + [1] * (GGML_MAX_DIMS - len(t.ne)) != [d, d, 1, 1]:
        return "shape"
    r = np.frombuffer(t.data, dtype="<f4")[: d * d].reshape(d, d).astype(np.float64)
    if not np.all(np.isfinite(r)):
        return "non-finite"
    with np.errstate(all="ignore"):
        err = float(np.abs(r.T @ r - np.eye(d)).max())
    if err > 2e-3:
        return "not orthogonal"
    if err > 5e-4:
        return ""  # within rounding of the loader's 1e-3 tolerance: either outcome is right
    return None


def expect_loader(doc: GGUFDoc, facts: dict) -> tuple[str, str]:
    """('refuse' | 'accept' | 'either', why): what the patched llama.cpp must do with the file,
    from the rules in llama-oscar.cpp, gguf.cpp and the model loader, modelled independently."""
    if facts["damage"]:
        return "refuse", f"damaged file ({', '.join(facts['damage'])})"
    refuse: list[str] = []
    keys = [kv.key for kv in doc.kvs]
    if len(set(keys)) != len(keys):
        refuse.append("duplicate key")
    if any(kv.vtype > F64 for kv in doc.kvs):
        refuse.append("invalid value type")
    names = [t.name for t in doc.tensors]
    if len(set(names)) != len(names):
        refuse.append("duplicate tensor")
    for t in doc.tensors:
        if len(t.name) >= GGML_MAX_NAME:
            refuse.append("tensor name too long")
        if len(t.ne) > GGML_MAX_DIMS or any(n <= 0 for n in t.ne):
            refuse.append("tensor dims")
        if t.ttype not in _TYPE_SIZE or (t.ne and t.ne[0] % _TYPE_SIZE[t.ttype][0]):
            refuse.append("tensor type or block size")
    for k in facts["deleted_model_keys"]:
        if MODEL_KEY_DELETIONS[k] == "refuse":
            refuse.append(f"no {k}")
    bc = doc.find("llama.block_count")
    if bc is None or bc.vtype != U32 or bc.value != TINY.n_layer:
        refuse.append("block_count does not match the tensors")
    known = {t.name for t in tiny_model(rotations=False).tensors}
    known |= {_rot_name(w, i).encode() for w in "kv" for i in range(TINY.n_layer)}
    if any(n not in known for n in names):
        refuse.append("unknown tensor")
    uncertain = list(facts["uncertain"])
    for t in doc.tensors:
        if t.name in known and t.name.endswith(b"_rot"):
            p = _rotation_problem(t, TINY.head_dim)
            if p:
                refuse.append(f"rotation {p}")
            elif p == "":
                uncertain.append("rotation at the tolerance")
    fv = doc.find(K.KEY_FORMAT_VERSION)
    if fv is not None:  # without it the loader ignores every other oscar.* key (by design)
        if _valid_u32(fv) != K.FORMAT_VERSION:
            refuse.append("format_version")
        for key in (K.KEY_SINK, K.KEY_RECENT):
            kv = doc.find(key)
            if kv is not None:
                v = _valid_u32(kv)
                if v is None or v > (1 << 20):
                    refuse.append(key)
        for key in OSCAR_CLIP_KEYS:
            kv = doc.find(key)
            if kv is None:
                continue
            if kv.vtype != ARRAY or kv.etype != F32 or len(kv.value) != TINY.n_layer:
                refuse.append(key)
                continue
            v = np.asarray(kv.value, dtype=np.float32)
            if not (np.all(np.isfinite(v)) and np.all(v > 0) and np.all(v <= 1)):
                refuse.append(key)
    if refuse:
        return "refuse", "; ".join(sorted(set(refuse)))
    if uncertain:
        return "either", "; ".join(uncertain)
    return "accept", "valid"


# ============================================================================================
# Calibration artifact (safetensors) mutations
# ============================================================================================

_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I32": "<i4", "I64": "<i8", "U8": "u1", "BOOL": "?"}


def tiny_artifact(seed: int = 0):
    """A valid RotationArtifact for the tiny model."""
    from .calibrate.artifact import RotationArtifact
    rng = np.random.default_rng(seed)
    L, d = TINY.n_layer, TINY.head_dim
    return RotationArtifact(
        architecture=TINY.arch, n_layers=L, head_dim=d, n_head=TINY.n_head, n_head_kv=TINY.n_head_kv,
        rope_layout="hf", k_rot={i: random_orthogonal(d, rng) for i in range(L)},
        v_rot={i: random_orthogonal(d, rng) for i in range(L)},
        k_eigenvalues={i: np.sort(rng.random(d)).astype(np.float32) for i in range(L)},
        v_eigenvalues={i: np.sort(rng.random(d)).astype(np.float32) for i in range(L)},
        clip_k=np.full(L, 0.96, np.float32), clip_v=np.full(L, 0.92, np.float32),
        model="tiny", model_sha256="0" * 64, corpus="fuzz", tokens=1, method="fuzz", date="2026-01-01",
        tool="oscar fuzz")


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
        if m["op"] == "truncate":
            data = data[:int(m["frac"] * (len(data) - 1))]
        elif m["op"] == "flip":
            if data:
                rng = np.random.default_rng(m["seed"])
                buf = bytearray(data)
                for _ in range(m["n"]):
                    p = int(rng.integers(0, len(buf)))
                    buf[p] ^= 1 << int(rng.integers(0, 8))
                data = bytes(buf)
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


# ============================================================================================
# RotationZoo mutations (built with torch in the parent; the worker only reads)
# ============================================================================================

def _zoo_object(kind: str, muts: list[dict], seed: int):
    import torch
    rng = np.random.default_rng(seed)
    d = TINY.head_dim
    layers: Any = {i: {"rotation": torch.from_numpy(random_orthogonal(d, rng)),
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
        if m["op"] == "truncate":
            data = data[:int(m["frac"] * (len(data) - 1))]
        elif m["op"] == "flip":
            if data:
                r = np.random.default_rng(m["seed"])
                b = bytearray(data)
                for _ in range(m["n"]):
                    p = int(r.integers(0, len(b)))
                    b[p] ^= 1 << int(r.integers(0, 8))
                data = bytes(b)
        elif m["how"] == "empty":
            data = b""
        elif m["how"] == "garbage":
            data = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        elif m["how"] == "zip_garbage":
            data = b"PK\x03\x04" + data[4:64] + b"\0" * 256
    return data


# ============================================================================================
# Workers: one request a line on stdin, one JSON answer a line on stdout
# ============================================================================================

def _error_is_ours(exc: BaseException) -> tuple[bool, str]:
    """A Python exception is a clean refusal when it is our error type, or the documented
    ValueError raised by a `raise` statement in our own code, with a one-line message."""
    from .gguf_io import ConvertError
    tb = traceback.extract_tb(exc.__traceback__)
    last = tb[-1] if tb else None
    where = f"{Path(last.filename).name}:{last.lineno} `{(last.line or '').strip()}`" if last else "?"
    msg = str(exc)
    if "\n" in msg.strip():
        return False, f"{where} (a multi-line message)"
    if isinstance(exc, ConvertError):
        return True, where
    ours = last is not None and "oscar_gguf" in last.filename
    if isinstance(exc, ValueError) and ours and (last.line or "").lstrip().startswith("raise"):
        return True, where
    return False, where


_LOG = None


class _RawLog:
    """llama.cpp log lines to fd 2 as raw bytes: the bindings' own callback decodes UTF-8 and
    would choke on the fuzzed (non-UTF-8) key names the loader prints."""

    def __init__(self):
        import llama_cpp
        self.cb = llama_cpp.llama_log_callback(self._write)
        llama_cpp.llama_log_set(self.cb, ctypes.c_void_p(0))

    @staticmethod
    def _write(level, text, user):
        try:
            os.write(2, text or b"")
        except OSError:
            pass


def _log_error_line() -> str:
    """The loader's error message from this worker's own log (fd 2 is a file)."""
    try:
        os.lseek(2, 0, os.SEEK_SET)
        data = os.read(2, 1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""
    keys = ("error", "failed", "oscar:", "invalid", "refus", "not supported")
    lines = [ln.strip() for ln in data.splitlines() if any(k in ln.lower() for k in keys)]
    return lines[0][:300] if lines else ""


def _work_loader(req: dict) -> dict:
    from .lowlevel import Context, LlamaError, Model
    try:
        model = Model(req["path"])
    except LlamaError:
        return {"outcome": "refused", "detail": _log_error_line() or "model load failed"}
    try:
        try:
            ctx = Context(model, n_ctx=64, n_batch=64, n_ubatch=64, type_k="oscar2", type_v="oscar2",
                          n_threads=1)
        except LlamaError:
            return {"outcome": "refused", "detail": _log_error_line() or "context creation failed"}
        try:
            toks = model.tokenize("the cat sat on the mat")
            logits = ctx.decode(toks)
            if not np.all(np.isfinite(logits)):
                return {"outcome": "ok", "detail": "non-finite logits", "finite": False}
            return {"outcome": "ok", "detail": f"{len(toks)} tokens decoded", "finite": True}
        finally:
            ctx.close()
    finally:
        model.close()


def _python_call(fn) -> dict:
    try:
        detail = fn()
        return {"outcome": "ok", "detail": str(detail)[:300]}
    except Exception as e:  # noqa: BLE001 - classifying is the point
        clean, where = _error_is_ours(e)
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        if clean:
            return {"outcome": "refused", "detail": msg}
        return {"outcome": "bug", "detail": f"{msg} at {where}"}


def _work_python(req: dict) -> dict:
    from . import convert_cli
    from .gguf_io import convert, inspect_report
    kind = req["kind"]
    if kind == "inspect":
        return _python_call(lambda: inspect_report(req["path"]).count("\n"))
    if kind == "convert":
        # the model side: a fuzzed GGUF gets valid rotations (its own oscar data replaced)
        def run():
            rot = convert_cli.rotations_from_artifact(tiny_artifact(1))
            convert(req["path"], req["out"], rot, replace=True)
            return "written"
        return _python_call(run)
    # the rotation side: a fuzzed artifact or RotationZoo pair, through oscar-convert's own path
    ns = argparse.Namespace(rotations=req.get("rotations"), k_rot=req.get("k_rot"), v_rot=req.get("v_rot"),
                            clip_k=None, clip_v=None)

    def run():
        rot = convert_cli.load_rotations(ns, Path(req["model"]))
        convert(req["model"], req["out"], rot)
        return "written"
    return _python_call(run)


def worker_main(kind: str) -> int:
    """The worker loop; stderr is a file the parent gave us (truncated before each case)."""
    if kind == "loader":
        global _LOG  # the C side keeps calling it: it must outlive the loop
        _LOG = _RawLog()
    # answers go through a private copy of stdout; fd 1 itself joins the log, since C code
    # (llama.cpp, ggml) may print to stdout and must not corrupt the answer channel
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            os.ftruncate(2, 0)
            os.lseek(2, 0, os.SEEK_SET)
        except OSError:
            pass
        if req.get("op") == "ping":
            res = {"outcome": "ok"}
        elif req.get("op") == "sleep":  # the harness's own hang detection is tested with this
            time.sleep(float(req["s"]))
            res = {"outcome": "ok"}
        elif req.get("op") == "abort":  # ... and its crash detection with this (SIGABRT, as an assert)
            os.abort()
        elif kind == "loader":
            res = _work_loader(req)
        else:
            res = _work_python(req)
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


class Worker:
    """A long-lived worker subprocess with a per-request timeout."""

    def __init__(self, kind: str, log_path: Path, mem_limit: int = 2 << 30):
        self.kind, self.log_path, self.mem_limit = kind, log_path, mem_limit
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def _start(self):
        log = open(self.log_path, "w+b")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}

        def limits():
            import resource
            os.setsid()
            resource.setrlimit(resource.RLIMIT_AS, (self.mem_limit, self.mem_limit))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash is reported, not dumped

        self.proc = subprocess.Popen([sys.executable, "-m", "oscar_gguf.fuzz", "--worker", self.kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     env=env, preexec_fn=limits)
        log.close()
        self._buf = b""

    def request(self, req: dict, timeout: float) -> dict:
        """{"outcome": ok|refused|bug|crash|hang, "detail": ...}."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return {"outcome": "hang", "detail": f"no answer in {timeout:.0f} s; log: {self._log_tail()}"}
            r, _, _ = select.select([fd], [], [], min(left, 1.0))
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return self._died()
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            self.kill()
            return {"outcome": "crash", "detail": f"garbled answer {line[:100]!r}; log: {self._log_tail()}"}

    def _died(self) -> dict:
        rc = self.proc.wait(timeout=30)
        self.restarts += 1
        self.proc = None
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        return {"outcome": "crash", "detail": f"worker died ({how}); log: {self._log_tail()}"}

    def _log_tail(self) -> str:
        """The lines that say why (an assert, an error), else the last few."""
        try:
            lines = Path(self.log_path).read_bytes().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        why = [ln for ln in lines if any(k in ln for k in ("GGML_ASSERT", "GGML_ABORT", "error", "Error", "terminate"))]
        return " | ".join((why[:3] or lines[-4:]))[-600:]

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None
        self.restarts += 1

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.proc = None


# ============================================================================================
# The runner
# ============================================================================================

def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _signature(consumer: str, kind: str, detail: str, case: dict) -> str:
    """What makes two failures the same bug: where it happened, not the input."""
    import re
    m = re.search(r" at (\S+:\d+)", detail) or re.search(r"(\S+\.(?:cpp|c|h):\d+): (GGML_\w+)", detail)
    if m:
        return f"{consumer}/{kind}: {m.group(0).strip()}"
    if kind in ("hang", "converted file refused", "partial output", "input changed"):
        ops = sorted({mm.get("op", "?") for mm in case.get("mutations", [])})
        return f"{consumer}/{kind}: {'+'.join(ops)}"
    return f"{consumer}/{kind}: {detail[:80]}"


# Bugs found by this fuzzer that are not fixed yet, each with where it is and what to do. A
# failure whose signature/detail matches one is counted under `known` (shown in the summary),
# not under `failures`; each has a strict-xfail regression test in tests/test_hardening_fuzz.py,
# so the entry must go when the bug is fixed. (regex over "signature detail", description)
KNOWN_ISSUES = [
]


def known_issue(signature: str, detail: str) -> str | None:
    import re
    text = f"{signature} {detail}"
    return next((desc for rx, desc in KNOWN_ISSUES if re.search(rx, text)), None)


@dataclass
class FuzzReport:
    seconds_budget: float
    seed: int
    elapsed: float = 0.0
    cases: collections.Counter = field(default_factory=collections.Counter)       # per target
    outcomes: dict[str, collections.Counter] = field(default_factory=dict)         # target -> outcome -> n
    expectations: collections.Counter = field(default_factory=collections.Counter)  # loader oracle verdicts
    refusals: collections.Counter = field(default_factory=collections.Counter)      # message -> n
    failures: list[dict] = field(default_factory=list)
    known: collections.Counter = field(default_factory=collections.Counter)          # known issue -> n
    worker_restarts: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (seconds, case), worst 5
    garbage_in: int = 0   # converted files refused because the input model itself was broken

    @property
    def total_cases(self) -> int:
        return sum(self.cases.values())

    def count(self, consumer: str, outcome: str):
        self.outcomes.setdefault(consumer, collections.Counter())[outcome] += 1

    def to_json(self) -> dict:
        return {"seconds_budget": self.seconds_budget, "seed": self.seed, "elapsed_s": round(self.elapsed, 1),
                "total_cases": self.total_cases, "cases": dict(self.cases),
                "outcomes": {k: dict(v) for k, v in self.outcomes.items()},
                "loader_oracle": dict(self.expectations), "worker_restarts": self.worker_restarts,
                "converted_refused_broken_input": self.garbage_in,
                "slowest_cases": [[round(t, 2), c] for t, c in self.slowest],
                "top_refusals": self.refusals.most_common(25),
                "known_issues_hit": self.known.most_common(),
                "distinct_failures": collections.Counter(f["signature"] for f in self.failures).most_common(),
                "failures": self.failures}

    def summary(self) -> str:
        lines = [f"oscar fuzz: {self.total_cases} cases in {self.elapsed:.1f} s (budget {self.seconds_budget:g} s, "
                 f"seed {self.seed}): {len(self.failures)} failures"]
        for t, n in sorted(self.cases.items()):
            lines.append(f"  {t:9s} {n:6d} cases")
        for c, oc in sorted(self.outcomes.items()):
            lines.append(f"    {c:18s} " + ", ".join(f"{k} {v}" for k, v in sorted(oc.items())))
        lines.append("  loader oracle: " + ", ".join(f"{k} {v}" for k, v in sorted(self.expectations.items())))
        for desc, n in self.known.most_common():
            lines.append(f"  known issue x{n}: {desc[:150]}")
        sigs = collections.Counter(f.get("signature", f["kind"]) for f in self.failures)
        if sigs:
            lines.append(f"  {len(sigs)} distinct failures:")
        for sig, n in sigs.most_common():
            first = next(f for f in self.failures if f.get("signature", f["kind"]) == sig)
            lines.append(f"  FAIL x{n} {sig}\n       {first['detail'][:300]}\n       repro: {first.get('repro', '')}")
        return "\n".join(lines)


class Fuzzer:
    def __init__(self, seconds: float, seed: int = 0, targets=("gguf", "artifact", "zoo"),
                 workdir: Path | None = None, failures_dir: Path | None = None, case_timeout: float = 20,
                 chunk: int = 8, log=None):
        self.seconds, self.seed, self.targets = seconds, seed, list(targets)
        self.case_timeout, self.chunk, self.log = case_timeout, chunk, log
        self._own_tmp = workdir is None
        self.work = Path(workdir or tempfile.mkdtemp(prefix="oscar-fuzz-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.failures_dir = Path(failures_dir) if failures_dir else self.work / "failures"
        self.report = FuzzReport(seconds, seed)
        self.loader = Worker("loader", self.work / "loader.log")
        self.python = Worker("python", self.work / "python.log")
        self._n = 0

    # -- fixed inputs ---------------------------------------------------------------------------
    def _prepare(self):
        from .calibrate.artifact import save_artifact
        self.base_doc_bytes = serialize(tiny_model())[0]
        self.model_path = self.work / "tiny-plain.gguf"   # the model the rotation side converts
        self.model_path.write_bytes(serialize(tiny_model(rotations=False))[0])
        self.model_sha = _sha(self.model_path)
        p = save_artifact(self.work / "base-artifact.safetensors", tiny_artifact())
        self.base_artifact = p.read_bytes()

    # -- bookkeeping ----------------------------------------------------------------------------
    def _fail(self, target: str, consumer: str, kind: str, detail: str, files: dict[str, Path], case: dict):
        sig = _signature(consumer, kind, detail, case)
        known = known_issue(sig, detail)
        if known is not None:
            self.report.known[known] += 1
            return
        d = self.failures_dir / f"case-{self._n:05d}-{consumer}"
        d.mkdir(parents=True, exist_ok=True)
        for role, p in files.items():
            if p.exists():
                shutil.copy(p, d / f"{role}{p.suffix}")
        (d / "case.json").write_text(json.dumps({"case": case, "consumer": consumer, "kind": kind,
                                                 "detail": detail}, indent=1, default=str))
        self.report.failures.append({"target": target, "consumer": consumer, "kind": kind,
                                     "detail": detail, "repro": str(d), "signature": sig})

    def _check_dir(self, case_dir: Path, allowed: set[str]) -> list[str]:
        return sorted(p.name for p in case_dir.iterdir() if p.name not in allowed)

    def _run_consumer(self, target, consumer, worker, req, inputs: dict[str, Path], case, out: Path | None):
        hashes = {r: _sha(p) for r, p in inputs.items() if p.exists()}
        res = worker.request(req, self.case_timeout)
        oc = res["outcome"]
        self.report.count(consumer, oc)
        if oc in ("crash", "hang", "bug"):
            self._fail(target, consumer, oc, res["detail"], inputs, case)
        elif oc == "refused":
            self.report.refusals[f"{consumer}: {res['detail'][:160]}"] += 1
        for r, p in inputs.items():
            if r in hashes and (not p.exists() or _sha(p) != hashes[r]):
                self._fail(target, consumer, "input changed", f"{r} {p.name} was modified", inputs, case)
        if out is not None:
            case_dir = out.parent
            allowed = {p.name for p in inputs.values()} | ({out.name} if oc == "ok" else set())
            extra = self._check_dir(case_dir, allowed)
            if extra:
                self._fail(target, consumer, "partial output", f"left behind: {extra}", inputs, case)
            if oc == "ok" and not out.exists():
                self._fail(target, consumer, "no output", "reported success but wrote nothing", inputs, case)
        return res

    def _converted_must_load(self, target, out: Path, inputs, case, input_sound: bool = True):
        """What oscar-convert writes must load in llama.cpp when its input model was sound: it
        copies the model byte for byte and validated the rotations it adds."""
        res = self._run_consumer(target, "loader(converted)", self.loader, {"path": str(out)},
                                 {"converted": out}, case, None)
        if res["outcome"] == "refused" and not input_sound:
            self.report.garbage_in += 1  # a broken model in, the same broken model out
        elif res["outcome"] == "refused":
            self._fail(target, "loader(converted)", "converted file refused",
                       f"oscar-convert wrote a GGUF llama.cpp refuses: {res['detail']}", {**inputs, "converted": out}, case)
        elif res["outcome"] == "ok" and not res.get("finite", True) and input_sound:
            self._fail(target, "loader(converted)", "non-finite logits", res["detail"], {**inputs, "converted": out}, case)

    # -- one case per target ----------------------------------------------------------------------
    def run_case(self, case: dict):
        self._n += 1
        target = case["target"]
        self.report.cases[target] += 1
        d = self.work / f"c{self._n}"
        d.mkdir()
        t0 = time.monotonic()
        try:
            getattr(self, f"_case_{target}")(case, d)
        except Exception as e:  # noqa: BLE001 - a bug of this harness must not end the run
            self.report.failures.append({"target": target, "consumer": "harness", "kind": "harness error",
                                         "detail": f"{type(e).__name__}: {e}", "repro": json.dumps(case)[:500]})
        finally:
            shutil.rmtree(d, ignore_errors=True)
            dt = time.monotonic() - t0
            self.report.slowest = sorted(self.report.slowest + [(dt, json.dumps(case)[:300])], reverse=True)[:5]

    def _case_gguf(self, case, d: Path):
        doc = tiny_model()
        data, facts = apply_gguf_mutations(doc, case["mutations"])
        p = d / "model.gguf"
        p.write_bytes(data)
        inputs = {"model": p}
        expect, why = expect_loader(doc, facts)
        self.report.expectations[expect] += 1
        res = self._run_consumer("gguf", "loader", self.loader, {"path": str(p)}, inputs, case, None)
        got = {"ok": "accept", "refused": "refuse"}.get(res["outcome"])
        if got and expect != "either" and got != expect:
            self._fail("gguf", "loader", f"expected {expect}, got {got}",
                       f"oracle: {why}; loader: {res['detail']}", inputs, case)
        if got == "accept" and not res.get("finite", True) and not facts["uncertain"]:
            self._fail("gguf", "loader", "non-finite logits", res["detail"], inputs, case)
        self._run_consumer("gguf", "inspect", self.python, {"kind": "inspect", "path": str(p)}, inputs, case, None)
        out = d / "out.gguf"
        res = self._run_consumer("gguf", "convert", self.python, {"kind": "convert", "path": str(p), "out": str(out)},
                                 inputs, case, out)
        if res["outcome"] == "ok" and out.exists():
            # convert --replace swaps every oscar key and rotation tensor: the rest must be sound
            stripped = GGUFDoc([kv for kv in doc.kvs if not kv.key.startswith(b"oscar.")],
                               [t for t in doc.tensors if t.name not in _ROT_NAMES], doc.version,
                               doc.n_tensors, doc.n_kv)
            sound = expect_loader(stripped, facts)[0] == "accept"
            self._converted_must_load("gguf", out, inputs, case, input_sound=sound)

    def _rotation_side(self, target, case, d: Path, req: dict, inputs: dict[str, Path]):
        out = d / "out.gguf"
        req = {**req, "kind": target, "model": str(self.model_path), "out": str(out)}
        res = self._run_consumer(target, "convert", self.python, req, inputs, case, out)
        if _sha(self.model_path) != self.model_sha:
            self._fail(target, "convert", "input changed", "the model file was modified", inputs, case)
            self.model_path.write_bytes(serialize(tiny_model(rotations=False))[0])
        if res["outcome"] == "ok" and out.exists():
            self._converted_must_load(target, out, inputs, case)

    def _case_artifact(self, case, d: Path):
        p = d / "rot.safetensors"
        p.write_bytes(build_artifact_bytes(self.base_artifact, case["mutations"]))
        self._rotation_side("artifact", case, d, {"rotations": str(p)}, {"artifact": p})

    def _case_zoo(self, case, d: Path):
        seed = self._n
        kp, vp = d / "k_rotation_qqt_r_h_pbr.pt", d / "v_rotation_sst_r_h_pbr.pt"
        muts = case["mutations"]
        kp.write_bytes(build_zoo_bytes("k", muts if case["file"] in ("k", "both") else [], seed))
        vp.write_bytes(build_zoo_bytes("v", muts if case["file"] in ("v", "both") else [], seed + 1))
        self._rotation_side("zoo", case, d, {"k_rot": str(kp), "v_rot": str(vp)}, {"k": kp, "v": vp})

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> FuzzReport:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hseed
        t0 = time.monotonic()
        deadline = t0 + self.seconds
        try:
            self._prepare()
            # start the workers (imports of llama_cpp / torch) before the clock matters
            self.loader.request({"op": "ping"}, 120)
            self.python.request({"op": "ping"}, 120)
            strategies = _strategies()

            def body(case):
                if time.monotonic() < deadline:
                    self.run_case(case)

            chunk_no = 0
            while time.monotonic() < deadline:
                target = self.targets[chunk_no % len(self.targets)]
                run = hseed(self.seed * 100003 + chunk_no)(settings(
                    max_examples=self.chunk, database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck), derandomize=False)(given(strategies[target])(body)))
                run()
                chunk_no += 1
                if self.log:
                    self.log(f"[{time.monotonic() - t0:6.1f} s] {self.report.total_cases} cases, "
                             f"{len(self.report.failures)} failures")
        finally:
            self.loader.close()
            self.python.close()
            self.report.worker_restarts = self.loader.restarts + self.python.restarts
            self.report.elapsed = time.monotonic() - t0
        return self.report

    def replay(self, case: dict) -> FuzzReport:
        """Run one saved case (failures/<case>/case.json) again."""
        self._prepare()
        try:
            self.run_case(case)
        finally:
            self.loader.close()
            self.python.close()
        return self.report

    def cleanup(self):
        if self._own_tmp and not self.report.failures:
            shutil.rmtree(self.work, ignore_errors=True)


def run_fuzz(seconds: float, seed: int = 0, targets=("gguf", "artifact", "zoo"), workdir=None,
             failures_dir=None, case_timeout: float = 20, log=None) -> FuzzReport:
    fz = Fuzzer(seconds, seed, targets, workdir, failures_dir, case_timeout, log=log)
    try:
        return fz.run()
    finally:
        fz.cleanup()


# ============================================================================================
# Command line: `oscar fuzz` (register) and `python -m oscar_gguf.fuzz`
# ============================================================================================

def _add_args(ap: argparse.ArgumentParser):
    ap.add_argument("--seconds", type=float, default=60, help="time budget for the whole run (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated cases (default 0)")
    ap.add_argument("--targets", default="gguf,artifact,zoo", help="comma list of gguf, artifact, zoo")
    ap.add_argument("--case-timeout", type=float, default=20, help="seconds before a case counts as a hang (default 20)")
    ap.add_argument("--failures", type=Path, help="folder for failing cases (default: a temp folder)")
    ap.add_argument("--json", type=Path, help="write the report as JSON here")
    ap.add_argument("--replay", type=Path, help="run one saved case again (its case.json)")
    ap.add_argument("-q", "--quiet", action="store_true")


def _cmd(args) -> int:
    targets = [t for t in args.targets.split(",") if t]
    bad = [t for t in targets if t not in ("gguf", "artifact", "zoo")]
    if bad:
        print(f"oscar fuzz: error: unknown target {bad[0]!r}", file=sys.stderr)
        return 2
    if args.replay:
        case = json.loads(Path(args.replay).read_text())["case"]
        fz = Fuzzer(0, args.seed, targets, failures_dir=args.failures)
        rep = fz.replay(case)
    else:
        rep = run_fuzz(args.seconds, args.seed, targets, failures_dir=args.failures,
                       case_timeout=args.case_timeout, log=None if args.quiet else print)
    print(rep.summary())
    if args.json:
        args.json.write_text(json.dumps(rep.to_json(), indent=1, default=str))
    return 1 if rep.failures else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("fuzz", help="fuzz the GGUF/artifact/RotationZoo readers and the llama.cpp loader")
    _add_args(p)
    p.set_defaults(func=_cmd)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1])
    ap = argparse.ArgumentParser(prog="oscar fuzz", description=__doc__.split("\n\n")[0])
    _add_args(ap)
    return _cmd(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
