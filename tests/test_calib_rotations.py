"""Runtime-compatible rotation recipes (rotations.py): DC slots, learned rotation, samples."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar_gguf.calibrate.fakequant import fake_quantize
from oscar_gguf.calibrate.oscar_rotation import hadamard
from oscar_gguf.format.rotations import orthogonality_error
from oscar_gguf.calibrate.rotations import (SampleStore, dc_rotation, learn_rotation, sst_token_weights,
                                            target_clip)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("d,group", [(64, 64), (128, 128), (256, 128)])
def test_dc_rotation_puts_top_directions_on_group_constant_rows(d, group):
    rng = np.random.default_rng(d)
    a = rng.standard_normal((4 * d, d)) * rng.exponential(1, d)
    sigma = a.T @ a
    r, lam = dc_rotation(sigma, group)
    assert orthogonality_error(r) <= 1e-10
    w, u = np.linalg.eigh(sigma)
    for j in range(d // group):                        # the d/G largest directions
        y = u[:, -1 - j] @ r                           # where that direction lands after rotation
        for g in range(d // group):
            block = y[g * group:(g + 1) * group]
            assert np.ptp(block) < 1e-10               # constant within every group: stored exactly
    # and a vector along them quantizes with no error at all
    x = (3.0 * u[:, -1])[None, :].astype(np.float32)
    y = torch.from_numpy(x @ r.astype(np.float32))
    assert torch.allclose(fake_quantize(y, group, 1.0), y, atol=1e-3)


def test_learned_rotation_lowers_the_quantization_error():
    torch.manual_seed(0)
    x = torch.randn(3000, 64) * torch.linspace(0.2, 3, 64) + 2 * torch.randn(3000, 1)
    h = hadamard(64)

    def err(r):
        y = x @ torch.as_tensor(r, dtype=torch.float32)
        return float((fake_quantize(y, 64, 0.9) - y).pow(2).sum(1).mean())

    for batch in (None, 512):
        r = learn_rotation(x, None, 64, 0.9, h, steps=30, lr=5e-3, batch=batch)
        assert orthogonality_error(r) <= 1e-6
        assert err(r) < 0.9 * err(h)
    # zero steps returns the initial rotation
    assert np.allclose(learn_rotation(x, None, 64, 0.9, h, steps=0), h, atol=1e-6)


def test_sample_store_is_bounded_and_skips_the_sink():
    s = SampleStore(max_tokens=10, skip=4)
    k = torch.arange(8 * 2 * 3, dtype=torch.float32).reshape(8, 2, 3)
    s.add(0, k, k)
    s.add(0, k, k)
    s.add(0, k, k)
    kk, vv = s.get(0)
    assert kk.shape == (10, 2, 3) and s.count[0] == 10
    assert torch.equal(kk[:4], k[4:])                 # positions 0..3 (the sink) skipped
    with pytest.raises(ValueError):
        s.get(1)


def test_sst_weights_and_target_clip():
    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((50, 2, 8)))
    c = torch.from_numpy(np.stack([np.eye(8), 2 * np.eye(8)]))
    w = sst_token_weights(k, c)
    assert torch.allclose(w.mean(0), torch.ones(2, dtype=w.dtype))
    assert torch.allclose(w[:, 0], (k[:, 0] ** 2).sum(1) / (k[:, 0] ** 2).sum(1).mean())
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((500, 64))          # heavy tails: clipping pays
    grid = [1.0, 0.95, 0.9, 0.8, 0.7]
    r = np.linalg.qr(np.random.default_rng(1).standard_normal((64, 64)))[0]
    brute = [float((((fake_quantize(x @ torch.tensor(r, dtype=torch.float32), 64, c)
                      - x @ torch.tensor(r, dtype=torch.float32))) ** 2).sum()) for c in grid]
    c_best = target_clip(x, r, 64, grid)
    assert c_best == grid[int(np.argmin(brute))] and c_best < 1.0
