"""THE one place that maps head-dim order between Hugging Face and llama.cpp.

Why this exists. HF llama-family models apply RoPE to the pairs (j, j + d/2)
("rotate_half"). llama.cpp's RoPE mode NORM rotates adjacent pairs (2j, 2j + 1) instead,
so convert_hf_to_gguf.py permutes the rows of W_q and W_k of those architectures, and
transformers' GGUF loader un-permutes them again (LlamaTensorProcessor). The queries and
keys llama.cpp writes into its KV cache are therefore the HF ones with their head-dim
coordinates shuffled:

    x_llama[..., 2j + p] = x_hf[..., j + p·d/2]      for j < d/2, p ∈ {0, 1}

i.e. ``x_llama = x_hf[..., perm]`` with ``perm = hf_to_llama_perm(d)``. V is never
permuted, and architectures whose llama.cpp RoPE is NEOX (qwen2, qwen3, gemma3, ...)
keep the HF order.

A rotation must produce the same rotated vector in both orders (the quantizer sees only
x @ R), so with P = I[:, perm] (x_llama = x_hf · P):  x_llama · R_llama = x_hf · R_hf
gives R_llama = Pᵀ · R_hf = R_hf[perm, :] -- the rows move, the columns stay.
Covariances move as Σ_llama = Pᵀ Σ_hf P = Σ_hf[perm][:, perm].
"""
from __future__ import annotations

import numpy as np

# GGUF architectures whose llama.cpp RoPE type is NORM (interleaved pairs) while their HF
# model uses rotate_half: convert_hf_to_gguf permutes W_q/W_k for them. Only "llama" is
# exercised by the tests (Mistral GGUFs use the "llama" architecture too); the rest are
# listed from llama.cpp's llama_model_rope_type and its converters.
PERMUTED_QK_ARCHS = frozenset({"llama", "granite", "granitemoe", "smollm3", "arcee", "mistral3"})


def needs_qk_permutation(gguf_arch: str) -> bool:
    """True when llama.cpp's Q/K head-dim order differs from the HF order for this arch."""
    return gguf_arch in PERMUTED_QK_ARCHS


def hf_to_llama_perm(head_dim: int) -> np.ndarray:
    """perm with x_llama = x_hf[..., perm] (see the module docstring)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    perm = np.empty(head_dim, dtype=np.int64)
    perm[0::2] = np.arange(half)
    perm[1::2] = np.arange(half) + half
    return perm


def llama_to_hf_perm(head_dim: int) -> np.ndarray:
    """The inverse: x_hf = x_llama[..., inv]."""
    return np.argsort(hf_to_llama_perm(head_dim))


def vectors_hf_to_llama(x: np.ndarray) -> np.ndarray:
    """Q or K rows from HF head-dim order to llama.cpp's (permuted architectures only)."""
    return x[..., hf_to_llama_perm(x.shape[-1])]


def rotation_hf_to_llama(r: np.ndarray) -> np.ndarray:
    """R_llama = R_hf[perm, :] for a K rotation (x_llama @ R_llama == x_hf @ R_hf)."""
    return r[hf_to_llama_perm(r.shape[0]), :]


def rotation_llama_to_hf(r: np.ndarray) -> np.ndarray:
    return r[llama_to_hf_perm(r.shape[0]), :]


def covariance_hf_to_llama(sigma: np.ndarray) -> np.ndarray:
    p = hf_to_llama_perm(sigma.shape[-1])
    return sigma[..., p, :][..., :, p]
