"""The HF <-> llama.cpp head-dim mapping (calibrate/layout.py), checked against RoPE itself
and against transformers' GGUF un-permutation."""
from __future__ import annotations

import numpy as np
import pytest

from oscar_gguf.calibrate import layout
from oscar_gguf.calibrate.artifact import RotationArtifact
from oscar_gguf.calibrate.oscar_rotation import oscar_rotation


def _rope_half(x, pos, theta=10000.0):
    """HF rotate_half RoPE on [..., d]: pairs (j, j + d/2)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos * inv
    cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rot * sin


def _rope_norm(x, pos, theta=10000.0):
    """llama.cpp RoPE mode NORM on [..., d]: adjacent pairs (2j, 2j + 1)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def _convert_permute(w, n_head):
    """convert_hf_to_gguf's Q/K row permutation (HF -> GGUF), written from its definition."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("d", [64, 128])
def test_mapping_commutes_with_rope(d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((5, d))
    perm = layout.hf_to_llama_perm(d)
    for pos in (0, 1, 17, 1000):
        assert np.allclose(_rope_norm(x[..., perm], pos), _rope_half(x, pos)[..., perm])
        # and a wrong mapping (identity) does not
        if pos:
            assert not np.allclose(_rope_norm(x, pos), _rope_half(x, pos))


def test_mapping_matches_gguf_weight_permutation():
    rng = np.random.default_rng(0)
    n_head, d, n_in = 3, 64, 16
    w_hf = rng.standard_normal((n_head * d, n_in))
    w_gguf = _convert_permute(w_hf, n_head)
    x = rng.standard_normal((4, n_in))
    q_hf = (x @ w_hf.T).reshape(4, n_head, d)
    q_llama = (x @ w_gguf.T).reshape(4, n_head, d)
    assert np.allclose(q_llama, layout.vectors_hf_to_llama(q_hf))
    # transformers' loader undoes exactly this permutation
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    back = LlamaTensorProcessor(config={"num_attention_heads": n_head, "num_key_value_heads": n_head}) \
        ._reverse_permute_weights(w_gguf, n_head, n_head)
    assert np.allclose(back, w_hf)


def test_inverse_and_rotation_mapping():
    rng = np.random.default_rng(1)
    d = 64
    p, inv = layout.hf_to_llama_perm(d), layout.llama_to_hf_perm(d)
    assert np.array_equal(p[inv], np.arange(d))
    a = rng.standard_normal((d, d))
    sigma_hf = a @ a.T
    r_hf, lam = oscar_rotation(sigma_hf)
    r_l = layout.rotation_hf_to_llama(r_hf)
    x_hf = rng.standard_normal((7, d))
    x_l = layout.vectors_hf_to_llama(x_hf)
    assert np.allclose(x_l @ r_l, x_hf @ r_hf)             # same rotated vector: same quantization
    assert np.allclose(layout.rotation_llama_to_hf(r_l), r_hf)
    # fitting on the llama-ordered covariance gives the mapped rotation (canonical signs)
    r_fit_l, lam_l = oscar_rotation(layout.covariance_hf_to_llama(sigma_hf))
    assert np.allclose(lam_l, lam)
    assert np.allclose(r_fit_l, r_l, atol=1e-8)


def _artifact(arch, layout_name):
    d = 64
    rng = np.random.default_rng(2)
    r = {i: np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32) for i in range(2)}
    lam = {i: np.arange(d, dtype=np.float32) for i in range(2)}
    return RotationArtifact(arch, 2, d, 4, 2, layout_name, dict(r), dict(r), lam, dict(lam),
                            np.ones(2, np.float32), np.ones(2, np.float32))


def test_artifact_layout_conversion():
    a = _artifact("llama", "hf")
    b = a.to_llama_cpp_layout()
    assert b.rope_layout == "llama.cpp" and a.rope_layout == "hf"
    perm = layout.hf_to_llama_perm(64)
    for i in a.layers:
        assert np.array_equal(b.k_rot[i], a.k_rot[i][perm])
        assert np.array_equal(b.v_rot[i], a.v_rot[i])          # V is never permuted
    assert all(np.array_equal(b.to_hf_layout().k_rot[i], a.k_rot[i]) for i in a.layers)
    assert b.to_llama_cpp_layout().k_rot[0] is not None
    # NEOX architectures keep the HF order
    q = _artifact("qwen3", "hf").to_llama_cpp_layout()
    assert q.rope_layout == "llama.cpp"
    assert np.array_equal(q.k_rot[0], _artifact("qwen3", "hf").k_rot[0])
    assert layout.needs_qk_permutation("llama") and not layout.needs_qk_permutation("qwen2")
    assert not layout.needs_qk_permutation("gemma3")
