"""Reading GGUF files: what a model is, and what OSCAR data it carries.

Two readers over one walk of the header:

- ``read_gguf_metadata`` walks the header and the key/value section itself, bounds-checking
  every count against the file's size, and decodes only what is small. It takes
  milliseconds, where gguf-py's GGUFReader decodes every tokenizer entry and takes seconds;
  the measuring tools use it, through ``model_info``.
- ``open_gguf`` runs that walk first and then gguf-py's GGUFReader, which trusts every count
  it reads (a string or array length past the end of the file makes it loop for minutes).
  ``read_model_info`` reads a model with it, rotations and oscar.* keys included: what
  oscar-convert and `oscar inspect` need.

Both give a ``ModelInfo``; every refusal is a ``GGUFError`` with a one-line message.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import gguf_keys


class GGUFError(ValueError):
    """A GGUF, or OSCAR data meant for one, that cannot be used; the message is one line for
    the user, and nothing was written."""


# GGUF value types (gguf.GGUFValueType) -> struct format of one scalar
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 65536     # numeric arrays up to this length are decoded; longer ones are kept as references
_SMALL_STRING_ARRAY = 64
_GGUF_VERSIONS = (2, 3)  # those gguf-py and llama.cpp read
GGML_TYPE_F32 = 0


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
    offset: int             # from the start of the data section


@dataclass
class GGUFMeta:
    path: Path
    version: int
    kv: dict = field(default_factory=dict)        # key -> scalar, str, list or GGUFArray
    kv_types: dict = field(default_factory=dict)  # key -> (value type, array element type)
    tensors: dict = field(default_factory=dict)   # name -> TensorInfo

    def get(self, key: str, default=None):
        return self.kv.get(key, default)


class _Cursor:
    """A position in the file's bytes; every read is checked against the end of the file."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, why: str) -> GGUFError:
        return GGUFError(f"{self.path}: not a readable GGUF file ({why})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} runs past the end of the file")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", what)
        self.need(n, what)
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos])

    def array(self, what: str) -> tuple[object, int]:
        """(the value, its element type): decoded when small, else a GGUFArray."""
        etype, count = self.unpack("<I", what), self.unpack("<Q", what)
        start = self.pos
        if etype in _SCALAR_FMT:
            self.need(count * struct.calcsize(_SCALAR_FMT[etype]), what)
            self.pos += count * struct.calcsize(_SCALAR_FMT[etype])
            small = count <= _SMALL_ARRAY
        elif etype in (_STRING, _ARRAY):
            self.need(count * 8, what)  # every element takes at least 8 bytes
            for _ in range(count):
                if etype == _ARRAY:
                    raise self.fail(f"{what} is an array of arrays")
                self.string(what)
            small = count <= _SMALL_STRING_ARRAY
        else:
            raise self.fail(f"{what} has invalid element type {etype}")
        ref = GGUFArray(etype, count, start)
        return (decode_array(self.buf, ref) if small else ref), etype


def decode_array(buf, arr: GGUFArray) -> list:
    """All elements of an array value (strings as str, or bytes when not valid UTF-8)."""
    if arr.elem_type == _STRING:
        out, off = [], arr.offset
        for _ in range(arr.count):
            (n,) = struct.unpack_from("<Q", buf, off)
            s = bytes(buf[off + 8:off + 8 + n])
            off += 8 + n
            try:
                out.append(s.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(s)
        return out
    fmt = _SCALAR_FMT[arr.elem_type]
    return np.frombuffer(buf, dtype=np.dtype(fmt), count=arr.count, offset=arr.offset).tolist()


def _walk(buf, path: Path) -> GGUFMeta:
    c = _Cursor(buf, path)
    if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
        raise c.fail("no GGUF magic")
    c.pos = 4
    version, n_tensors, n_kv = (c.unpack(f, "the header") for f in ("<I", "<Q", "<Q"))
    if version not in _GGUF_VERSIONS:
        raise c.fail(f"GGUF version {version} is not supported")
    if n_kv > c.size or n_tensors > c.size:
        raise c.fail(f"header claims {n_kv} keys and {n_tensors} tensors in {c.size} bytes")
    meta = GGUFMeta(path=path, version=version)
    for i in range(n_kv):
        key = c.string(f"key {i}").decode("utf-8", "replace")
        what = f"the value of key {i}"
        vtype = c.unpack("<I", what)
        etype = None
        if vtype == _STRING:
            val = c.string(what).decode("utf-8", "replace")
        elif vtype == _ARRAY:
            val, etype = c.array(what)
        elif vtype in _SCALAR_FMT:
            val = c.unpack(_SCALAR_FMT[vtype], what)
        else:
            raise c.fail(f"{what} has invalid value type {vtype}")
        meta.kv[key] = val
        meta.kv_types[key] = (vtype, etype)
    for i in range(n_tensors):
        what = f"tensor info {i}"
        name = c.string(what).decode("utf-8", "replace")
        n_dims = c.unpack("<I", what)
        c.need(8 * n_dims, what)
        ne = struct.unpack_from(f"<{n_dims}Q", buf, c.pos)
        c.pos += 8 * n_dims
        ttype, offset = c.unpack("<I", what), c.unpack("<Q", what)
        meta.tensors[name] = TensorInfo(name, tuple(ne), ttype, offset)
    return meta


def read_gguf_metadata(path: str | Path, keep_open: bool = False):
    """Keys and tensor infos of a GGUF without touching tensor data; GGUFError if the header
    is not sound. With keep_open the mmap is returned too, for decode_array on large arrays."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFError(f"{path}: not a readable GGUF file (it is empty)") from None
    try:
        meta = _walk(buf, path)
    except BaseException:
        buf.close()
        raise
    if keep_open:
        return meta, buf
    buf.close()
    return meta


# ---- models -----------------------------------------------------------------------------------

# architectures whose attention bypasses the KV-cache path that applies the rotations (the list
# of llama_oscar_arch_takes_rotations in ggml-oscar/llama/llama-oscar.cpp, by GGUF name)
NO_ROTATION_ARCHS = {"deepseek2", "deepseek32", "deepseek4", "glm-dsa", "minimax-m3", "t5", "t5encoder"}


def takes_no_rotations(arch: str, kv_lora_rank) -> bool:
    """An architecture on the list, or any model with a latent (MLA) KV cache."""
    return arch in NO_ROTATION_ARCHS or kv_lora_rank is not None


@dataclass
class ModelInfo:
    """What the tools need to know about a model GGUF. Head counts are the largest per-layer
    value (hybrid models list one per layer)."""
    path: Path
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_embd: int = 0
    n_ctx_train: int = 0
    n_vocab: int = 0
    file_size: int = 0
    has_rotations: bool = False        # a rotation tensor or the oscar.format_version key
    window_sink: int | None = None     # the oscar.* window, the runtime's defaults when the GGUF
    window_recent: int | None = None   # has rotations but no window keys, None without rotations
    latent_attention: bool = False     # MLA: the cache holds a compressed latent, not per-head K/V
    oscar: dict = field(default_factory=dict)   # oscar.* keys (read_model_info only)
    k_rot: dict = field(default_factory=dict)   # layer -> f32 [d, d] (read_model_info only)
    v_rot: dict = field(default_factory=dict)


def _per_layer(v, n: int, path: Path) -> list[int]:
    if v is None:
        return [0] * n
    if isinstance(v, list):
        if len(v) != n:
            raise GGUFError(f"{path}: per-layer value has {len(v)} entries for {n} layers")
        return [int(x) for x in v]
    return [int(v)] * n


def _int_or(v, default):
    return int(v) if isinstance(v, int) else default


def _model_info(path: Path, get, tensor_names, n_tokens: int) -> ModelInfo:
    """The fields every reader fills, from get(key, default) over the GGUF's keys."""
    arch = get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: no general.architecture key; is this a model GGUF?")
    n_layer = get(f"{arch}.block_count")
    if not isinstance(n_layer, int) or not (0 < n_layer <= 4096):
        raise GGUFError(f"{path}: {arch}.block_count is missing or invalid ({n_layer!r})")
    n_head = _per_layer(get(f"{arch}.attention.head_count"), n_layer, path)
    n_head_kv = _per_layer(get(f"{arch}.attention.head_count_kv") or n_head, n_layer, path)
    n_embd = get(f"{arch}.embedding_length")
    dk, dv = get(f"{arch}.attention.key_length"), get(f"{arch}.attention.value_length")
    heads = max(n_head) if n_head else 0
    if dk is None:
        if not n_embd or not heads:
            raise GGUFError(f"{path}: cannot tell the head size (no key_length, embedding_length or head_count)")
        dk = n_embd // heads
    dv = dv if dv is not None else dk
    has_rot = get(gguf_keys.KEY_FORMAT_VERSION) is not None or any(
        gguf_keys.parse_rotation_name(t) for t in tensor_names)
    sink = recent = None
    if has_rot:  # a rotated GGUF without window keys gets the runtime's defaults
        sink = _int_or(get(gguf_keys.KEY_SINK), gguf_keys.DEFAULT_SINK)
        recent = _int_or(get(gguf_keys.KEY_RECENT), gguf_keys.DEFAULT_RECENT)
    return ModelInfo(path=path, arch=arch, n_layer=n_layer, n_head=heads, n_head_kv=max(n_head_kv),
                     head_dim_k=int(dk), head_dim_v=int(dv), n_embd=_int_or(n_embd, 0),
                     n_ctx_train=_int_or(get(f"{arch}.context_length"), 0),
                     n_vocab=_int_or(get(f"{arch}.vocab_size"), n_tokens), file_size=path.stat().st_size,
                     has_rotations=has_rot, window_sink=sink, window_recent=recent,
                     latent_attention=takes_no_rotations(arch, get(f"{arch}.attention.kv_lora_rank")))


def model_info(path: str | Path) -> ModelInfo:
    """ModelInfo from the header alone (no rotations, no oscar.* dict): the measuring tools'
    reader. GGUFError when it is not a model GGUF they can measure."""
    path = Path(path)
    meta = read_gguf_metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = tokens.count if isinstance(tokens, GGUFArray) else len(tokens or [])
    info = _model_info(path, meta.get, meta.tensors, n_tokens)
    for key in ("embedding_length", "attention.head_count", "context_length"):
        if meta.get(f"{info.arch}.{key}") is None:
            raise GGUFError(f"{path} lacks {info.arch}.{key}")
    return info


# ---- through gguf-py ---------------------------------------------------------------------------

def open_gguf(path: Path):
    """gguf-py's GGUFReader on a file whose header read_gguf_metadata found sound, and whose
    tensors are aligned and inside the file (llama.cpp refuses the others; a copy would
    launder them into a valid file)."""
    from gguf import GGUFReader
    try:
        if path.is_file():
            read_gguf_metadata(path)
        r = GGUFReader(str(path), "r")
        for t in r.tensors:
            rel = int(t.data_offset) - int(r.data_offset)
            if rel % int(r.alignment) or int(t.data_offset) + int(t.n_bytes) > path.stat().st_size:
                raise GGUFError(f"{path}: not a readable GGUF file (tensor {t.name} has offset {rel}, "
                                f"misaligned or past the end of the file)")
        return r
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except GGUFError:
        raise
    except Exception as e:  # truncated or not a GGUF: gguf-py raises assorted errors
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def field_value(reader, key: str, default=None):
    """A key's value through gguf-py, GGUFError for a string that is not valid UTF-8."""
    f = reader.get_field(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise GGUFError(f"GGUF key {f.name} holds a string that is not valid UTF-8") from None


def read_model_info(path: str | Path, reader=None) -> ModelInfo:
    """ModelInfo with the f32 [d, d] rotation tensors and every oscar.* key, through gguf-py."""
    path = Path(path)
    r = reader or open_gguf(path)
    tokens = r.get_field("tokenizer.ggml.tokens")
    info = _model_info(path, lambda key, default=None: field_value(r, key, default), [t.name for t in r.tensors],
                       len(tokens.data) if tokens is not None else 0)
    for t in r.tensors:
        parsed = gguf_keys.parse_rotation_name(t.name)
        if parsed is None or t.tensor_type != GGML_TYPE_F32 or len(t.shape) != 2:
            continue
        kind, layer = parsed
        if layer.isascii() and layer.isdigit():
            d0, d1 = int(t.shape[0]), int(t.shape[1])
            (info.k_rot if kind == "k" else info.v_rot)[int(layer)] = np.asarray(t.data, np.float32).reshape(d1, d0)
    for f in r.fields.values():
        if f.name.startswith(gguf_keys.OSCAR_PREFIX):
            info.oscar[f.name] = field_value(r, f.name)
    return info
