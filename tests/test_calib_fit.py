"""OSCAR fit: Hadamard, bit reversal, rotation, covariances and weights against brute force."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar_gguf.calibrate.oscar_rotation import (bit_reversal_permutation, bit_reverse, canonical_eigh, hadamard,
                                      oscar_rotation)
from oscar_gguf.format.rotations import orthogonality_error
from oscar_gguf.calibrate.stats import AttentionShape, LayerStats, group_queries


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_cov(d, rng):
    a = rng.standard_normal((4 * d, d)) * rng.exponential(1.0, d)
    return a.T @ a / (4 * d)


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128, 256])
def test_hadamard_is_normalised_sylvester(d):
    h = hadamard(d)
    assert h.shape == (d, d)
    assert np.allclose(np.abs(h), 1 / np.sqrt(d))
    assert np.allclose(h, h.T)
    assert np.allclose(h @ h.T, np.eye(d), atol=1e-12)
    # Sylvester order: entry (i, j) = (-1)^popcount(i & j) / sqrt(d)
    i, j = np.meshgrid(np.arange(d), np.arange(d), indexing="ij")
    pop = np.vectorize(lambda x: bin(x).count("1"))(i & j)
    assert np.array_equal(np.sign(h), (-1.0) ** pop)


def test_bit_reverse_brute_force():
    for bits in range(1, 9):
        for i in range(1 << bits):
            s = format(i, f"0{bits}b")
            assert bit_reverse(i, bits) == int(s[::-1], 2)


@pytest.mark.parametrize("d", [4, 64, 128])
def test_bit_reversal_permutation(d):
    rng = np.random.default_rng(d)
    lam = rng.standard_normal(d)
    perm = bit_reversal_permutation(lam)
    s = np.argsort(-lam)
    bits = d.bit_length() - 1
    for i in range(d):
        assert perm[int(format(i, f"0{bits}b")[::-1], 2)] == s[i]
    assert sorted(perm) == list(range(d))
    # position 0 holds the largest eigen-direction, position d/2 the second (bit-reversed 1)
    assert perm[0] == s[0] and perm[d // 2] == s[1]


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_rotation_is_u_h_pbr_and_orthogonal(d):
    rng = np.random.default_rng(d)
    sigma = _random_cov(d, rng)
    r, lam = oscar_rotation(sigma)
    lam_ref, u = np.linalg.eigh(sigma)
    assert np.allclose(lam, lam_ref)
    # brute force: canonical signs, then R = U · H · I[:, perm]
    pivot = np.argmax(np.abs(u), axis=0)
    u = u * np.sign(u[pivot, np.arange(d)])
    p_br = np.eye(d)[:, bit_reversal_permutation(lam_ref)]
    assert np.allclose(r, u @ hadamard(d) @ p_br, atol=1e-10)
    assert orthogonality_error(r) <= 1e-5
    assert orthogonality_error(r.astype(np.float32)) <= 1e-5
    # R diagonalises Σ up to the Hadamard mixing: Rᵀ Σ R = P_brᵀ H Λ H P_br
    lam_mat = hadamard(d) @ np.diag(lam_ref) @ hadamard(d)
    assert np.allclose(r.T @ sigma @ r, p_br.T @ lam_mat @ p_br, atol=1e-8)


def test_rotation_refuses_bad_input():
    with pytest.raises(ValueError):
        oscar_rotation(np.eye(48))          # not a power of two
    with pytest.raises(ValueError):
        oscar_rotation(np.full((8, 8), np.nan))
    with pytest.raises(ValueError):
        oscar_rotation(np.ones((4, 8)))


def test_canonical_sign_is_permutation_invariant():
    rng = np.random.default_rng(1)
    sigma = _random_cov(32, rng)
    p = rng.permutation(32)
    _, u = canonical_eigh(sigma)
    _, up = canonical_eigh(sigma[p][:, p])
    assert np.allclose(up, u[p], atol=1e-10)


# ---- statistics --------------------------------------------------------------------------

def _brute_stats(q, k, v, n_head, n_kv):
    """docs/design.md §1, literally, with python loops over heads and tokens."""
    t, _, d = q.shape
    g = n_head // n_kv
    c = []
    for h in range(n_kv):
        qh = np.concatenate([q[:, j, :] for j in range(n_head) if j // g == h], axis=0)   # [T*g, d]
        c.append(qh.T @ qh / (t * g))
    sigma_k = np.mean(c, axis=0)
    s = []
    for h in range(n_kv):
        w = np.array([k[i, h] @ c[h] @ k[i, h] for i in range(t)])
        w = w / w.mean()
        s.append(sum(w[i] * np.outer(v[i, h], v[i, h]) for i in range(t)) / t)
    sigma_v = np.mean(s, axis=0)
    return c, sigma_k, sigma_v, w


@pytest.mark.parametrize("n_head,n_kv", [(4, 4), (6, 2), (8, 1)])
def test_streaming_stats_match_brute_force(n_head, n_kv):
    rng = np.random.default_rng(n_head * 10 + n_kv)
    t, d = 37, 8
    q = rng.standard_normal((t, n_head, d)) * rng.exponential(1, d)
    k = rng.standard_normal((t, n_kv, d)) + 0.5
    v = rng.standard_normal((t, n_kv, d)) * rng.exponential(1, d)
    c, sigma_k, sigma_v, _ = _brute_stats(q, k, v, n_head, n_kv)
    st = LayerStats(AttentionShape(n_head, n_kv, d))
    cuts = [0, 5, 6, 20, t]                    # uneven pieces: the sums must not care
    for a, b in zip(cuts, cuts[1:]):
        st.add_queries(torch.from_numpy(q[a:b]))
    for a, b in zip(cuts, cuts[1:]):
        st.add_values(torch.from_numpy(k[a:b]), torch.from_numpy(v[a:b]))
    assert np.allclose(st.query_covariances().numpy(), np.array(c), rtol=1e-12, atol=1e-12)
    assert np.allclose(st.k_covariance(), sigma_k, rtol=1e-12, atol=1e-12)
    assert np.allclose(st.v_covariance(), sigma_v, rtol=1e-12, atol=1e-12)
    assert np.allclose(st.v_covariance(), st.v_covariance().T)


def test_token_weights_brute_force_and_scale_invariance():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((20, 4, 8))
    k = rng.standard_normal((20, 2, 8))
    v = rng.standard_normal((20, 2, 8))
    st = LayerStats(AttentionShape(4, 2, 8))
    st.add_queries(torch.from_numpy(q))
    w = st.token_weights(torch.from_numpy(k)).numpy()
    c = st.query_covariances().numpy()
    for i in range(20):
        for h in range(2):
            assert np.isclose(w[i, h], k[i, h] @ c[h] @ k[i, h])
    assert np.all(w >= 0)
    # the weights are normalised, so scaling the queries leaves Σ_V unchanged
    st.add_values(torch.from_numpy(k), torch.from_numpy(v))
    st2 = LayerStats(AttentionShape(4, 2, 8))
    st2.add_queries(torch.from_numpy(q * 7.0))
    st2.add_values(torch.from_numpy(k), torch.from_numpy(v))
    assert np.allclose(st.v_covariance(), st2.v_covariance())


def test_gqa_grouping_follows_query_head_to_kv_head_rule():
    n_head, n_kv, d, t = 6, 2, 3, 2
    q = torch.zeros(t, n_head, d)
    for j in range(n_head):
        q[:, j, :] = j
    grouped = group_queries(q, AttentionShape(n_head, n_kv, d))
    g = n_head // n_kv
    for h in range(n_kv):
        assert set(grouped[h, :, 0].tolist()) == {float(j) for j in range(n_head) if j // g == h}


def test_shape_and_pass_errors():
    with pytest.raises(ValueError):
        AttentionShape(6, 4, 8)
    st = LayerStats(AttentionShape(2, 1, 4))
    with pytest.raises(RuntimeError):
        st.add_values(torch.zeros(3, 1, 4), torch.zeros(3, 1, 4))   # no queries yet
