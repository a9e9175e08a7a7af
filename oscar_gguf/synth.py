"""`oscar synth`: random-weight GGUFs with the shapes of real models, for speed work.

Real weights cannot travel to the GPU machine, and speed does not depend on their values.
So the tensors here are random but well-formed: quantized tensors are raw ggml blocks
with sane fp16 scales and random codes (no real quantization, which would take minutes),
the tokenizer is copied from a vocab-only GGUF of the pinned llama.cpp tree, and OSCAR
rotations, when asked for, are random orthogonal matrices with the `oscar.*` metadata.

The file is written as a stream, one tensor at a time, from small pools of random blocks,
so an 8B shape costs about the time the disk needs to take its bytes.

This module also holds `read_gguf_metadata`, a small header reader that the measuring
tools share: gguf-py's GGUFReader decodes every tokenizer entry into numpy and takes
seconds on a 2-core box, while the tools only need a few scalars and the tensor list.
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import gguf_keys as K

# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str               # llama.cpp architecture name: "llama" or "qwen3"
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    vocab_file: str         # vocab-only GGUF in the pinned tree's models/ folder
    tied_embeddings: bool   # no output.weight: llama.cpp then reuses token_embd
    description: str = ""


SHAPES: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape("llama3-8b", "llama", 32, 4096, 32, 8, 128, 14336, 131072, 500000.0, 1e-5,
               "ggml-vocab-llama-bpe.gguf", False, "Llama-3.1-8B"),
    ModelShape("qwen3-8b", "qwen3", 36, 4096, 32, 8, 128, 12288, 40960, 1000000.0, 1e-6,
               "ggml-vocab-qwen2.gguf", False, "Qwen3-8B"),
    ModelShape("qwen3-4b", "qwen3", 36, 2560, 32, 8, 128, 9728, 40960, 1000000.0, 1e-6,
               "ggml-vocab-qwen2.gguf", True, "Qwen3-4B"),
    ModelShape("llama3-1b", "llama", 16, 2048, 32, 8, 64, 8192, 131072, 500000.0, 1e-5,
               "ggml-vocab-llama-bpe.gguf", True, "Llama-3.2-1B (head_dim 64)"),
    # test shapes: a 32k-token vocab keeps the file at a few MB; dims are multiples of 256
    # so that every weight type (q4_k included) can hold them
    ModelShape("tiny-llama", "llama", 2, 256, 4, 2, 64, 512, 4096, 10000.0, 1e-5,
               "ggml-vocab-llama-spm.gguf", True, "test shape, head_dim 64"),
    ModelShape("tiny-qwen3", "qwen3", 2, 256, 4, 2, 128, 512, 4096, 1000000.0, 1e-6,
               "ggml-vocab-llama-spm.gguf", True, "test shape, head_dim 128, QK-norm"),
]}

# ggml type ids and block layouts of the weight types we can fake (see ggml-common.h)
WEIGHT_TYPES = {
    #        ggml type, elements per block, bytes per block, llama file type
    "f16":  (1, 1, 2, 1),
    "q8_0": (8, 32, 34, 7),
    "q4_0": (2, 32, 18, 2),
    "q4_k": (12, 256, 144, 15),
}
GGML_F32 = 0
FALLBACK_VOCAB = "ggml-vocab-llama-bpe.gguf"


class SynthError(ValueError):
    """Bad input for `oscar synth`; the message is meant for the user."""


def tensor_plan(shape: ModelShape, n_vocab: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is_weight_matrix) of every tensor, in file order.

    numpy shape is (rows, cols) = (ne1, ne0): a matmul weight's rows are its outputs.
    """
    s = shape
    q_dim = s.n_head * s.head_dim
    kv_dim = s.n_head_kv * s.head_dim
    plan = [("token_embd.weight", (n_vocab, s.n_embd), True),
            ("output_norm.weight", (s.n_embd,), False)]
    if not s.tied_embeddings:
        plan.append(("output.weight", (n_vocab, s.n_embd), True))
    for i in range(s.n_layer):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (s.n_embd,), False),
                 (b + "attn_q.weight", (q_dim, s.n_embd), True),
                 (b + "attn_k.weight", (kv_dim, s.n_embd), True),
                 (b + "attn_v.weight", (kv_dim, s.n_embd), True),
                 (b + "attn_output.weight", (s.n_embd, q_dim), True)]
        if s.arch == "qwen3":
            plan += [(b + "attn_q_norm.weight", (s.head_dim,), False),
                     (b + "attn_k_norm.weight", (s.head_dim,), False)]
        plan += [(b + "ffn_norm.weight", (s.n_embd,), False),
                 (b + "ffn_gate.weight", (s.n_ff, s.n_embd), True),
                 (b + "ffn_up.weight", (s.n_ff, s.n_embd), True),
                 (b + "ffn_down.weight", (s.n_embd, s.n_ff), True)]
    return plan


# ---------------------------------------------------------------------------------------------
# Reading GGUF headers quickly
# ---------------------------------------------------------------------------------------------

# GGUF value types (gguf.GGUFValueType) -> struct format of one scalar
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 65536  # numeric arrays up to this length are decoded; longer ones are skipped


@dataclass
class GGUFArray:
    """An array value kept as a reference into the file (decoded on request)."""
    elem_type: int
    count: int
    offset: int  # of the first element


@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]     # ggml order: ne[0] is the contiguous dimension
    ggml_type: int
    offset: int


@dataclass
class GGUFMeta:
    path: Path
    version: int
    kv: dict = field(default_factory=dict)        # key -> scalar, str, list or GGUFArray
    kv_types: dict = field(default_factory=dict)  # key -> (value type, array element type)
    tensors: dict = field(default_factory=dict)   # name -> TensorInfo

    def get(self, key: str, default=None):
        return self.kv.get(key, default)


def _read_string(buf, off: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    off += 8
    return bytes(buf[off:off + n]), off + n


def _skip_or_read_array(buf, off: int) -> tuple[object, int, int]:
    elem_type, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    start = off
    if elem_type == _STRING:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", buf, off)
            off += 8 + n
        val = GGUFArray(elem_type, count, start)
        if count <= 64:
            val = decode_array(buf, val)
        return val, elem_type, off
    if elem_type not in _SCALAR_FMT:
        raise ValueError(f"unsupported GGUF array element type {elem_type}")
    size = struct.calcsize(_SCALAR_FMT[elem_type])
    val = GGUFArray(elem_type, count, start)
    if count <= _SMALL_ARRAY:
        val = decode_array(buf, val)
    return val, elem_type, off + size * count


def decode_array(buf, arr: GGUFArray) -> list:
    """All elements of an array value (strings as str, or bytes when not valid UTF-8)."""
    if arr.elem_type == _STRING:
        out, off = [], arr.offset
        for _ in range(arr.count):
            s, off = _read_string(buf, off)
            try:
                out.append(s.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(s)
        return out
    fmt = _SCALAR_FMT[arr.elem_type]
    return np.frombuffer(buf, dtype=np.dtype(fmt), count=arr.count, offset=arr.offset).tolist()


def read_gguf_metadata(path: str | Path, keep_open: bool = False):
    """Keys and tensor infos of a GGUF without touching tensor data.

    With keep_open the mmap is returned too, for decode_array on skipped arrays.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise ValueError(f"{path} is empty, not a GGUF file") from None
    try:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        meta = GGUFMeta(path=path, version=version)
        off = 24
        for _ in range(n_kv):
            key, off = _read_string(buf, off)
            key = key.decode("utf-8", "replace")
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            if vtype == _STRING:
                raw, off = _read_string(buf, off)
                val, etype = raw.decode("utf-8", "replace"), None
            elif vtype == _ARRAY:
                val, etype, off = _skip_or_read_array(buf, off)
            elif vtype in _SCALAR_FMT:
                (val,) = struct.unpack_from(_SCALAR_FMT[vtype], buf, off)
                off += struct.calcsize(_SCALAR_FMT[vtype])
                etype = None
            else:
                raise ValueError(f"{path}: unknown GGUF value type {vtype} for key {key}")
            meta.kv[key] = val
            meta.kv_types[key] = (vtype, etype)
        for _ in range(n_tensors):
            name, off = _read_string(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            off += 4
            ne = struct.unpack_from(f"<{n_dims}Q", buf, off)
            off += 8 * n_dims
            ttype, toff = struct.unpack_from("<IQ", buf, off)
            off += 12
            nm = name.decode("utf-8", "replace")
            meta.tensors[nm] = TensorInfo(nm, tuple(ne), ttype, toff)
    except (struct.error, IndexError):
        buf.close()
        raise ValueError(f"{path} is truncated or not a valid GGUF file") from None
    except Exception:
        buf.close()
        raise
    if keep_open:
        return meta, buf
    buf.close()
    return meta


@dataclass(frozen=True)
class ModelInfo:
    """What the measuring tools need to know about a model GGUF."""
    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_vocab: int
    file_size: int
    has_rotations: bool
    window_sink: int | None      # from oscar.* metadata, None when absent
    window_recent: int | None

    def kv_bytes_per_token(self, bits_per_element: float) -> float:
        """K plus V bytes of one token over all layers at a given bits/element."""
        return self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * bits_per_element / 8


def _first_int(v) -> int:
    """Per-layer keys may be arrays (e.g. head_count_kv of hybrid models): take the first."""
    if isinstance(v, list):
        return int(v[0])
    return int(v)


def model_info(path: str | Path) -> ModelInfo:
    """ModelInfo of a model GGUF; ValueError with a clear message if it is not one."""
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if not arch:
        raise ValueError(f"{path} has no general.architecture: not a model GGUF")

    def key(name, default=None):
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ValueError(f"{path} lacks {arch}.{name}")
        return v

    n_embd = int(key("embedding_length"))
    n_head = _first_int(key("attention.head_count"))
    n_head_kv = _first_int(key("attention.head_count_kv", n_head))
    hd_k = int(meta.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    hd_v = int(meta.get(f"{arch}.attention.value_length", hd_k))
    tok = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(meta.get(f"{arch}.vocab_size", tok.count if isinstance(tok, GGUFArray) else len(tok or [])))
    has_rot = K.K_ROT.format(0) in meta.tensors or K.KEY_FORMAT_VERSION in meta.kv
    sink = meta.get(K.KEY_SINK)
    recent = meta.get(K.KEY_RECENT)
    if has_rot:  # a rotated GGUF without explicit window keys gets the runtime defaults
        sink = K.DEFAULT_SINK if sink is None else int(sink)
        recent = K.DEFAULT_RECENT if recent is None else int(recent)
    return ModelInfo(path=Path(path), arch=arch, n_layer=int(key("block_count")), n_embd=n_embd,
                     n_head=n_head, n_head_kv=n_head_kv, head_dim_k=hd_k, head_dim_v=hd_v,
                     n_ctx_train=int(key("context_length")), n_vocab=n_vocab,
                     file_size=Path(path).stat().st_size, has_rotations=has_rot,
                     window_sink=sink, window_recent=recent)


# ---------------------------------------------------------------------------------------------
# Vocab
# ---------------------------------------------------------------------------------------------


def vocab_search_dirs() -> list[Path]:
    """Folders that may hold llama.cpp's vocab-only GGUFs: $OSCAR_VOCAB_DIR, then the
    pinned upstream tree that llama.cpp/fetch.py unpacks into the build cache."""
    dirs = []
    if os.environ.get("OSCAR_VOCAB_DIR"):
        dirs.append(Path(os.environ["OSCAR_VOCAB_DIR"]))
    cache = Path(os.environ.get("OSCAR_CACHE_DIR", Path.home() / ".cache" / "oscar-gguf"))
    dirs += sorted((cache / "src").glob("*/vendor/llama.cpp/models"))
    return dirs


def find_vocab(name: str) -> Path:
    for d in vocab_search_dirs():
        if (d / name).is_file():
            return d / name
    where = ", ".join(str(d) for d in vocab_search_dirs()) or "(no pinned tree in the build cache)"
    raise SynthError(f"vocab file {name} not found in {where}; run the build once "
                     f"(it unpacks the pinned llama.cpp tree) or pass --vocab FILE")


def read_vocab_size(vocab: Path) -> int:
    try:
        tok = read_gguf_metadata(vocab).get("tokenizer.ggml.tokens")
    except ValueError as e:
        raise SynthError(str(e)) from None
    if tok is None:
        raise SynthError(f"{vocab} has no tokenizer.ggml.tokens")
    return tok.count if isinstance(tok, GGUFArray) else len(tok)


def tokenizer_keys(vocab: Path) -> list[tuple[str, object, int, int | None]]:
    """(key, value, value type, array element type) of every tokenizer.* key of a vocab GGUF."""
    meta, buf = read_gguf_metadata(vocab, keep_open=True)
    try:
        out = []
        for k, v in meta.kv.items():
            if not k.startswith("tokenizer."):
                continue
            if isinstance(v, GGUFArray):
                v = decode_array(buf, v)
            vtype, etype = meta.kv_types[k]
            out.append((k, v, vtype, etype))
        return out
    finally:
        buf.close()


# ---------------------------------------------------------------------------------------------
# Random blocks
# ---------------------------------------------------------------------------------------------

POOL_BYTES = 16 << 20  # per (type, fan-in): big enough that repeats are far apart


def random_blocks(weights: str, fan_in: int, n_bytes: int, rng: np.random.Generator) -> np.ndarray:
    """n_bytes (rounded down to whole blocks) of valid random blocks whose values have a
    standard deviation near 1/sqrt(fan_in), so activations stay finite through the layers."""
    gtype, per_block, block_bytes, _ = WEIGHT_TYPES[weights]
    n_blocks = max(1, n_bytes // block_bytes)
    target_std = 1.0 / np.sqrt(fan_in)
    if weights == "f16":
        return (rng.standard_normal(n_blocks, dtype=np.float32) * target_std).astype(np.float16).view(np.uint8)
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, size=n_blocks).astype(np.float32)
    if weights == "q4_0":    # fp16 d, 16 bytes of nibbles; value = d * (q - 8), std(q - 8) ~ 4.6
        d = (target_std / 4.6 * jitter).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    elif weights == "q8_0":  # fp16 d, 32 int8; value = d * q, std(q) ~ 73.6
        d = (target_std / 73.6 * jitter).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    elif weights == "q4_k":  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
        # value = d*sc*q - dmin*m with sc, m in 0..63 and q in 0..15: std ~ 140 d, and
        # dmin = 7.5 d centres the values on zero on average
        d = (target_std / 140.0 * jitter).astype(np.float32)
        blocks[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = (d * 7.5).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def random_rotation(d: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random orthogonal [d, d] matrix in float32 (QR of a Gaussian, signs fixed)."""
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    q *= np.sign(np.diag(r))
    return q.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _tensor_nbytes(numpy_shape: tuple[int, ...], weights: str, is_matrix: bool) -> tuple[int, int]:
    """(ggml type, bytes) of one tensor."""
    n = int(np.prod(numpy_shape))
    if not is_matrix:
        return GGML_F32, 4 * n
    gtype, per_block, block_bytes, _ = WEIGHT_TYPES[weights]
    return gtype, n // per_block * block_bytes


def check_shape_fits(shape: ModelShape, weights: str, n_vocab: int) -> None:
    per_block = WEIGHT_TYPES[weights][1]
    for name, nshape, is_matrix in tensor_plan(shape, n_vocab):
        if is_matrix and nshape[-1] % per_block:
            raise SynthError(f"{shape.name}: {name} has rows of {nshape[-1]} elements, "
                             f"not a multiple of the {weights} block ({per_block})")


def _atomic_target(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_synthetic(shape: str | ModelShape, weights: str, path: str | Path, rotations: bool = False,
                    seed: int = 0, vocab: str | Path | None = None, overwrite: bool = False,
                    progress: bool = False) -> Path:
    """Write a random-weight GGUF of a model shape; returns its path.

    shape: a name in SHAPES or a ModelShape; weights: f16 | q8_0 | q4_0 | q4_k.
    rotations: add random orthogonal blk.{i}.attn_k_rot/attn_v_rot and the oscar.* keys.
    The file appears atomically; an existing file is refused unless overwrite.
    """
    import gguf

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise SynthError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    if weights not in WEIGHT_TYPES:
        raise SynthError(f"unknown weight type {weights!r}; one of {', '.join(WEIGHT_TYPES)}")
    path = Path(path)
    if path.exists() and not overwrite:
        raise SynthError(f"{path} exists; pass --force to replace it")
    if not path.parent.is_dir():
        raise SynthError(f"output folder {path.parent} does not exist")
    if vocab:
        vocab_path = Path(vocab)
    else:
        try:
            vocab_path = find_vocab(shape.vocab_file)
        except SynthError:
            # any BPE vocab gives the right speed; the shape's own is only more faithful
            vocab_path = find_vocab(FALLBACK_VOCAB)
            if progress:
                print(f"note: {shape.vocab_file} not found, using {FALLBACK_VOCAB}")
    if not vocab_path.is_file():
        raise SynthError(f"vocab file {vocab_path} not found")
    if path.exists() and path.resolve() == vocab_path.resolve():
        raise SynthError(f"the output {path} is the vocab file it copies from; choose another name")
    n_vocab = read_vocab_size(vocab_path)
    check_shape_fits(shape, weights, n_vocab)
    if rotations and shape.head_dim % 64:
        raise SynthError(f"oscar2 needs head_dim to be a multiple of 64, {shape.name} has {shape.head_dim}")

    rng = np.random.default_rng(seed)
    t0 = time.monotonic()
    tmp = _atomic_target(path)
    w = gguf.GGUFWriter(tmp, shape.arch)
    try:
        _add_model_keys(w, shape, weights, n_vocab)
        for key, val, vtype, etype in tokenizer_keys(vocab_path):
            if vtype == _ARRAY:
                w.add_key_value(key, val, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(etype))
            else:
                w.add_key_value(key, val, gguf.GGUFValueType(vtype))
        if rotations:
            _add_oscar_keys(w, shape)

        infos = []
        for name, nshape, is_matrix in tensor_plan(shape, n_vocab):
            gtype, nbytes = _tensor_nbytes(nshape, weights, is_matrix)
            # the shape is given in elements; a non-uint8 dtype keeps gguf-py from reading it
            # as a byte shape
            w.add_tensor_info(name, nshape, np.dtype(np.float32), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(gtype))
            infos.append((name, nshape, is_matrix, nbytes))
        rot_layers = range(shape.n_layer) if rotations else range(0)
        for i in rot_layers:
            for tmpl in (K.K_ROT, K.V_ROT):
                d = shape.head_dim
                w.add_tensor_info(tmpl.format(i), (d, d), np.dtype(np.float32), 4 * d * d,
                                  raw_dtype=gguf.GGMLQuantizationType.F32)

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        total = sum(i[3] for i in infos)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"synth {shape.name} {weights}")
        pools: dict[int, np.ndarray] = {}
        for name, nshape, is_matrix, nbytes in infos:
            _pad(fout, w.data_alignment)
            if not is_matrix:
                fout.write(np.ones(nshape, dtype=np.float32).tobytes())
            else:
                fan_in = nshape[-1]
                pool = pools.get(fan_in)
                if pool is None:
                    pool = pools[fan_in] = random_blocks(weights, fan_in, POOL_BYTES, rng)
                _write_from_pool(fout, pool, nbytes, WEIGHT_TYPES[weights][2], rng)
            if bar is not None:
                bar.update(nbytes)
        for i in rot_layers:
            for _ in (K.K_ROT, K.V_ROT):
                _pad(fout, w.data_alignment)
                fout.write(random_rotation(shape.head_dim, rng).tobytes())
        _pad(fout, w.data_alignment)
        if bar is not None:
            bar.close()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    if progress:
        size = path.stat().st_size
        print(f"wrote {path} ({size / 2**30:.2f} GiB, {shape.description or shape.name}, "
              f"{weights}{', random OSCAR rotations' if rotations else ''}) in {time.monotonic() - t0:.1f} s")
    return path


def _pad(fout, align: int) -> None:
    pad = (-fout.tell()) % align
    if pad:
        fout.write(b"\0" * pad)


def _write_from_pool(fout, pool: np.ndarray, nbytes: int, block_bytes: int, rng: np.random.Generator) -> None:
    """Write nbytes of blocks cycling through the pool from a random block."""
    n_pool_blocks = pool.size // block_bytes
    mv = memoryview(pool)
    start = int(rng.integers(0, n_pool_blocks)) * block_bytes
    left = nbytes
    while left > 0:
        take = min(left, pool.size - start)
        fout.write(mv[start:start + take])
        left -= take
        start = 0


def _add_model_keys(w, shape: ModelShape, weights: str, n_vocab: int) -> None:
    a = shape.arch
    w.add_string("general.name", f"oscar-synth {shape.name} {weights}")
    w.add_string("general.description", "random weights with a real model's shapes, written by `oscar synth`; "
                                        "for speed measurements only")
    w.add_uint32("general.file_type", WEIGHT_TYPES[weights][3])
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{a}.block_count", shape.n_layer)
    w.add_uint32(f"{a}.context_length", shape.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", shape.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", shape.n_ff)
    w.add_uint32(f"{a}.attention.head_count", shape.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", shape.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", shape.head_dim)
    w.add_uint32(f"{a}.attention.value_length", shape.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", shape.head_dim)
    w.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", shape.rms_eps)
    w.add_uint32(f"{a}.vocab_size", n_vocab)


def _add_oscar_keys(w, shape: ModelShape) -> None:
    import gguf
    from .quant import GROUP_SIZE, type_for_head_dim
    n = shape.n_layer
    w.add_uint32(K.KEY_FORMAT_VERSION, K.FORMAT_VERSION)
    w.add_uint32(K.KEY_GROUP_SIZE, GROUP_SIZE[type_for_head_dim(shape.head_dim)])
    w.add_key_value(K.KEY_CLIP_K, [K.DEFAULT_CLIP_K] * n, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_key_value(K.KEY_CLIP_V, [K.DEFAULT_CLIP_V] * n, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_uint32(K.KEY_SINK, K.DEFAULT_SINK)
    w.add_uint32(K.KEY_RECENT, K.DEFAULT_RECENT)
    w.add_string(K.KEY_ROPE_LAYOUT, "llama.cpp")
    w.add_string(K.KEY_CALIB_PREFIX + "method", "random orthogonal (oscar synth), not calibrated")
    w.add_string(K.KEY_CALIB_PREFIX + "tool", "oscar synth")
    w.add_string(K.KEY_CALIB_PREFIX + "model", shape.name)
