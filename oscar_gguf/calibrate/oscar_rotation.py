"""The OSCAR rotation from a covariance: R = U · H_d · P_br (docs/design.md §1).

Everything here is float64 numpy; rotations are stored as float32 by the artifact.
Vectors are rows and a rotation acts as ``x_rot = x @ R``.
"""
from __future__ import annotations

import numpy as np


def _check_power_of_two(d: int) -> int:
    if d < 1 or d & (d - 1):
        raise ValueError(f"the OSCAR rotation needs head_dim to be a power of two, got {d}")
    return d.bit_length() - 1


def hadamard(d: int) -> np.ndarray:
    """Normalised Sylvester Hadamard matrix of order d (symmetric, orthogonal)."""
    _check_power_of_two(d)
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def bit_reverse(i: int, bits: int) -> int:
    """i with its lowest `bits` bits in reverse order."""
    out = 0
    for _ in range(bits):
        out = (out << 1) | (i & 1)
        i >>= 1
    return out


def bit_reversal_permutation(eigenvalues: np.ndarray) -> np.ndarray:
    """perm with perm[br(i)] = s[i], s = indices of the eigenvalues in descending order.

    P_br = I[:, perm]. The largest eigen-directions land on bit-reversed, i.e. maximally
    spread, positions, so that each quantization group smaller than d gets a fair share.
    """
    lam = np.asarray(eigenvalues, dtype=np.float64)
    d = lam.shape[0]
    bits = _check_power_of_two(d)
    s = np.argsort(-lam, kind="stable")
    perm = np.empty(d, dtype=np.int64)
    for i in range(d):
        perm[bit_reverse(i, bits)] = s[i]
    return perm


def symmetrize(a: np.ndarray) -> np.ndarray:
    return 0.5 * (a + a.T)


def canonical_eigh(sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """eigh in float64 with a deterministic sign per eigenvector.

    Each eigenvector is flipped so that its entry of largest magnitude is positive (ties:
    the first such entry). The sign is a free choice of eigh; fixing it makes rotations
    reproducible and comparable between backends, and the rule is invariant under a
    permutation of the coordinates (layout.py relies on that).
    """
    lam, u = np.linalg.eigh(symmetrize(np.asarray(sigma, dtype=np.float64)))
    pivot = np.argmax(np.abs(u), axis=0)
    signs = np.sign(u[pivot, np.arange(u.shape[1])])
    signs[signs == 0] = 1.0
    return lam, u * signs


def oscar_rotation(sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, eigenvalues) for one covariance: R = U · H_d · P_br, eigenvalues ascending (eigh order)."""
    sigma = np.asarray(sigma, dtype=np.float64)
    if sigma.ndim != 2 or sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"covariance must be square, got shape {sigma.shape}")
    if not np.all(np.isfinite(sigma)):
        raise ValueError("covariance has non-finite entries (did the model produce NaN/inf activations?)")
    lam, u = canonical_eigh(sigma)
    d = sigma.shape[0]
    perm = bit_reversal_permutation(lam)
    r = u @ hadamard(d)
    return r[:, perm], lam

