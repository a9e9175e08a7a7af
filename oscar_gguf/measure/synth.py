"""`oscar synth`: random-weight GGUFs with the shapes of real models, for speed work.

Real weights cannot travel to the GPU machine, and speed does not depend on their values.
So the tensors here are random but well-formed: quantized tensors are raw ggml blocks
with sane fp16 scales and random codes (no real quantization, which would take minutes),
the tokenizer is copied from a vocab-only GGUF of the pinned llama.cpp tree, and OSCAR
rotations, when asked for, are random orthogonal matrices with the `oscar.*` metadata.

The file is written as a stream, one tensor at a time, from small pools of random blocks,
so an 8B shape costs about the time the disk needs to take its bytes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..format import gguf_keys, oscar2
from ..format.gguf_read import GGUFArray, GGUFError, decode_array, read_gguf_metadata
from ..format.gguf_write import add_keys, new_gguf, oscar_keys
from ..format.rotations import random_rotation

# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str               # llama.cpp architecture name: llama, qwen2, qwen3 or gemma3
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
    sliding_window: int = 0  # gemma3: tokens of the sliding window of 5 layers in 6 (0: none)


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
    # one tiny shape per architecture that oscar2 claims, for the runtime-vs-simulation checks
    ModelShape("tiny-qwen2", "qwen2", 2, 256, 4, 2, 64, 512, 4096, 1000000.0, 1e-6,
               "ggml-vocab-llama-spm.gguf", True, "test shape, head_dim 64, Q/K/V biases"),
    ModelShape("tiny-mistral", "llama", 2, 512, 8, 2, 128, 512, 4096, 1000000.0, 1e-5,
               "ggml-vocab-llama-spm.gguf", True, "test shape, head_dim 128, GQA 4 (Mistral GGUFs are llama)"),
    ModelShape("tiny-gemma3", "gemma3", 6, 256, 4, 1, 256, 512, 4096, 1000000.0, 1e-6,
               "ggml-vocab-llama-spm.gguf", True, "test shape, head_dim 256, QK-norm, 5 of 6 layers with "
               "a 16-token sliding window", sliding_window=16),
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
        if s.arch == "qwen2":
            plan += [(b + "attn_q.bias", (q_dim,), False),
                     (b + "attn_k.bias", (kv_dim,), False),
                     (b + "attn_v.bias", (kv_dim,), False)]
        if s.arch in ("qwen3", "gemma3"):
            plan += [(b + "attn_q_norm.weight", (s.head_dim,), False),
                     (b + "attn_k_norm.weight", (s.head_dim,), False)]
        if s.arch == "gemma3":
            plan += [(b + "post_attention_norm.weight", (s.n_embd,), False),
                     (b + "post_ffw_norm.weight", (s.n_embd,), False)]
        plan += [(b + "ffn_norm.weight", (s.n_embd,), False),
                 (b + "ffn_gate.weight", (s.n_ff, s.n_embd), True),
                 (b + "ffn_up.weight", (s.n_ff, s.n_embd), True),
                 (b + "ffn_down.weight", (s.n_embd, s.n_ff), True)]
    return plan


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
    except GGUFError as e:
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


def _resolve_vocab(shape: ModelShape, vocab: str | Path | None, progress: bool) -> Path:
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
    return vocab_path


def write_synthetic(shape: str | ModelShape, weights: str, path: str | Path, rotations: bool = False,
                    seed: int = 0, vocab: str | Path | None = None, overwrite: bool = False,
                    progress: bool = False) -> Path:
    """Write a random-weight GGUF of a model shape; returns its path.

    shape: a name in SHAPES or a ModelShape; weights: f16 | q8_0 | q4_0 | q4_k.
    rotations: add random orthogonal blk.{i}.attn_k_rot/attn_v_rot and the oscar.* keys.
    The file appears atomically; an existing file is refused unless overwrite.
    """
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
    vocab_path = _resolve_vocab(shape, vocab, progress)
    if path.exists() and path.resolve() == vocab_path.resolve():
        raise SynthError(f"the output {path} is the vocab file it copies from; choose another name")
    n_vocab = read_vocab_size(vocab_path)
    check_shape_fits(shape, weights, n_vocab)
    if rotations and shape.head_dim % 64:
        raise SynthError(f"oscar2 needs head_dim to be a multiple of 64, {shape.name} has {shape.head_dim}")
    t0 = time.monotonic()
    with new_gguf(path, shape.arch) as w:
        _write_tensors(w, shape, weights, vocab_path, n_vocab, rotations, np.random.default_rng(seed), progress)
    if progress:
        size = path.stat().st_size
        print(f"wrote {path} ({size / 2**30:.2f} GiB, {shape.description or shape.name}, "
              f"{weights}{', random OSCAR rotations' if rotations else ''}) in {time.monotonic() - t0:.1f} s")
    return path


def _write_tensors(w, shape: ModelShape, weights: str, vocab_path: Path, n_vocab: int, rotations: bool,
                   rng: np.random.Generator, progress: bool) -> None:
    """Keys, tensor infos, then the tensors' data as a stream of random blocks."""
    import gguf

    _add_model_keys(w, shape, weights, n_vocab)
    for key, val, vtype, etype in tokenizer_keys(vocab_path):
        w.add_key_value(key, val, gguf.GGUFValueType(vtype), sub_type=None if etype is None else gguf.GGUFValueType(etype))
    if rotations:
        n = shape.n_layer
        add_keys(w, oscar_keys(oscar2.group_size(shape.head_dim), [gguf_keys.DEFAULT_CLIP_K] * n,
                               [gguf_keys.DEFAULT_CLIP_V] * n, gguf_keys.DEFAULT_SINK, gguf_keys.DEFAULT_RECENT,
                               {"method": "random orthogonal (oscar synth), not calibrated", "tool": "oscar synth",
                                "model": shape.name}))
    infos = []
    for name, nshape, is_matrix in tensor_plan(shape, n_vocab):
        gtype, nbytes = _tensor_nbytes(nshape, weights, is_matrix)
        # the shape is given in elements; a non-uint8 dtype keeps gguf-py from reading it
        # as a byte shape
        w.add_tensor_info(name, nshape, np.dtype(np.float32), nbytes, raw_dtype=gguf.GGMLQuantizationType(gtype))
        infos.append((name, nshape, is_matrix, nbytes))
    rot_layers = range(shape.n_layer) if rotations else range(0)
    d = shape.head_dim
    for i in rot_layers:
        for tmpl in (gguf_keys.K_ROT, gguf_keys.V_ROT):
            w.add_tensor_info(tmpl.format(i), (d, d), np.dtype(np.float32), 4 * d * d,
                              raw_dtype=gguf.GGMLQuantizationType.F32)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(i[3] for i in infos), unit="B", unit_scale=True, desc=f"synth {shape.name} {weights}")
    pools: dict[int, np.ndarray] = {}
    for name, nshape, is_matrix, nbytes in infos:
        _pad(fout, w.data_alignment)
        if not is_matrix:
            fout.write(_vector(name, nshape, rng).tobytes())
        else:
            fan_in = nshape[-1]
            pool = pools.get(fan_in)
            if pool is None:
                pool = pools[fan_in] = random_blocks(weights, fan_in, POOL_BYTES, rng)
            _write_from_pool(fout, pool, nbytes, WEIGHT_TYPES[weights][2], rng)
        if bar is not None:
            bar.update(nbytes)
    for i in rot_layers:
        for _ in (gguf_keys.K_ROT, gguf_keys.V_ROT):
            _pad(fout, w.data_alignment)
            fout.write(random_rotation(d, rng).tobytes())
    _pad(fout, w.data_alignment)
    if bar is not None:
        bar.close()


def _vector(name: str, nshape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A norm's weights near 1, or a bias of about unit size: distinct per channel, so that a
    norm or bias applied to the wrong tensor or channel order shows in the runtime checks."""
    noise = rng.standard_normal(nshape, dtype=np.float32)
    return (0.5 * noise) if name.endswith(".bias") else (1.0 + 0.1 * noise).astype(np.float32)


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
    if shape.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", shape.sliding_window)
