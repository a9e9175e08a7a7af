"""GGUFs made for tests: the bundled model with identity or random orthogonal rotations, the
fuzz harness's tiny llama in any shape, and a tiny model with latent attention (MLA).

Every file is written through the format contract (oscar_gguf/format/gguf_write.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType as T

from oscar_gguf.convert import convert
from oscar_gguf.format import gguf_keys, oscar2
from oscar_gguf.format.gguf_read import read_model_info
from oscar_gguf.format.gguf_write import write_gguf
from oscar_gguf.format.rotations import Rotations, random_rotation
from oscar_gguf.fuzz.inputs import TinyShape, scaled_normal, tiny_vocab_keys, write_tiny_model  # noqa: F401

PROMPT = ("The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the "
          "children played near the old fountain while their parents talked about the weather. ")


def rotations_for(model: Path, kind: str, seed: int = 1, clip_k: float = gguf_keys.DEFAULT_CLIP_K,
                  clip_v: float = gguf_keys.DEFAULT_CLIP_V) -> Rotations:
    info = read_model_info(model)
    L, dk, dv = info.n_layer, info.head_dim_k, info.head_dim_v
    rng = np.random.default_rng(seed)
    if kind == "identity":
        mk, mv = (lambda: np.eye(dk, dtype=np.float32)), (lambda: np.eye(dv, dtype=np.float32))
    else:
        mk, mv = (lambda: random_rotation(dk, rng)), (lambda: random_rotation(dv, rng))
    return Rotations({i: mk() for i in range(L)}, {i: mv() for i in range(L)}, [clip_k] * L, [clip_v] * L,
                     info.arch, L, dk, oscar2.group_size(dk), {"method": f"test-{kind}"})


def with_rotations(model: Path, out: Path, kind: str, **kw) -> Path:
    if not out.exists():
        convert(model, out, rotations_for(model, kind, **kw))
    return out


def write_tiny_mla_model(path: str | Path, seed: int = 0, rotations: bool = False) -> Path:
    """A valid 1-layer deepseek2 GGUF with multi-head latent attention (MLA): its KV cache holds
    one 128-wide latent row per token (kv_lora_rank 64 + RoPE 64), not per-head keys and values,
    so oscar2 and the rotations must refuse it. The layer is dense (leading_dense_block_count 1),
    so no expert tensors are needed. With rotations: orthogonal ones of the cache's row sizes,
    so that they are refused for the architecture, not for their values."""
    a, n_embd, n_head, n_ff = "deepseek2", 128, 2, 256
    kv_lora, rope, nope, v_head = 64, 64, 64, 64
    rng = np.random.default_rng(seed)
    vocab = tiny_vocab_keys()
    n_vocab = len(vocab[1][2])
    keys = [("general.name", T.STRING, "oscar-fuzz tiny mla", None)]
    keys += [(f"{a}.{k}", T.UINT32, v, None) for k, v in (
        ("block_count", 1), ("context_length", 512), ("embedding_length", n_embd), ("feed_forward_length", n_ff),
        ("attention.head_count", n_head), ("attention.head_count_kv", 1), ("attention.key_length", kv_lora + rope),
        ("attention.value_length", kv_lora), ("attention.key_length_mla", nope + rope),
        ("attention.value_length_mla", v_head), ("attention.q_lora_rank", 0), ("attention.kv_lora_rank", kv_lora),
        ("rope.dimension_count", rope), ("leading_dense_block_count", 1), ("expert_feed_forward_length", 64),
        ("expert_shared_count", 1))]
    keys += [(f"{a}.rope.freq_base", T.FLOAT32, 10000.0, None),
             (f"{a}.attention.layer_norm_rms_epsilon", T.FLOAT32, 1e-5, None)] + vocab

    def w(*shape):  # numpy order, i.e. ggml's ne reversed
        return scaled_normal(rng, *shape)

    def ones(n):
        return np.ones(n, np.float32)

    b = "blk.0."
    tensors = [("token_embd.weight", w(n_vocab, n_embd)), ("output_norm.weight", ones(n_embd)),
               (b + "attn_norm.weight", ones(n_embd)), (b + "attn_q.weight", w(n_head * (nope + rope), n_embd)),
               (b + "attn_kv_a_mqa.weight", w(kv_lora + rope, n_embd)), (b + "attn_kv_a_norm.weight", ones(kv_lora)),
               (b + "attn_k_b.weight", w(n_head, kv_lora, nope)), (b + "attn_v_b.weight", w(n_head, v_head, kv_lora)),
               (b + "attn_output.weight", w(n_embd, n_head * v_head)), (b + "ffn_norm.weight", ones(n_embd)),
               (b + "ffn_gate.weight", w(n_ff, n_embd)), (b + "ffn_up.weight", w(n_ff, n_embd)),
               (b + "ffn_down.weight", w(n_embd, n_ff))]
    if rotations:
        tensors += [(gguf_keys.K_ROT.format(0), random_rotation(kv_lora + rope, rng)),
                    (gguf_keys.V_ROT.format(0), random_rotation(kv_lora, rng))]
    return write_gguf(Path(path), a, keys, tensors)
