"""The torch oscar2 fake quantizer must equal quant.fake_quantize bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar_gguf.calibrate.clip import clip_grid
from oscar_gguf.calibrate.fakequant import GroupQuantizer, fake_quantize
from oscar_gguf.format.oscar2 import clip_index
from oscar_gguf.format.oscar2 import fake_quantize as reference


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cases(rng):
    x = rng.standard_normal((300, 256)).astype(np.float32) * rng.exponential(3, (300, 1)).astype(np.float32)
    x[0, :6] = [np.inf, -np.inf, np.nan, -0.0, 1e6, -1e-30]
    x[1] = 0.0
    x[2] = 1.0                                   # constant group: scale 0
    x[3] = np.float32(70000.0)                   # beyond fp16: min clamps to 65504
    x[4] = np.round(x[4] * 2) / 2                # many ties at the thresholds
    x[5, ::2] = 3e4
    x[5, 1::2] = -3e4                            # range overflows fp16: scale clamps
    x[6] = np.linspace(-1, 1, 256, dtype=np.float32)
    return x


@pytest.mark.parametrize("group", [64, 128])
def test_bit_exact_against_quant_py(group):
    x = _cases(np.random.default_rng(group))
    gq = GroupQuantizer(torch.from_numpy(x), group)
    for c in sorted(set([1.0, 0.99, 0.96, 0.92, 0.5, 0.0, 1.5, float("nan")] + clip_grid(group))):
        want = reference(x, group, c)
        got = fake_quantize(torch.from_numpy(x), group, c).numpy()
        assert want.tobytes() == got.tobytes(), f"clip {c}"
        assert want.tobytes() == gq(c).numpy().tobytes(), f"clip {c} (grid quantizer)"


def test_clip_grid_hits_every_index_once():
    for g in (64, 128):
        grid = clip_grid(g)
        assert grid[0] == 1.0 and clip_index(1.0, g) is None
        idx = [clip_index(c, g) for c in grid[1:]]
        assert idx == list(range(g - 1, g - 1 - len(idx), -1))


def test_shape_preserved_and_group_checked():
    x = torch.randn(2, 3, 128)
    assert fake_quantize(x, 64, 0.9).shape == x.shape
    with pytest.raises(ValueError):
        fake_quantize(torch.randn(4, 48), 64)
