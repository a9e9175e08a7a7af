"""Issue 3: the oscar2 block format. numpy reference == C reference == ggml entry points, byte for byte."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from oscar_gguf.format import oscar2 as quant
from oscar_gguf.ggml_ctypes import GGML

# the reference pair, and ratios that leave 1, 16 and 17 values above the clip threshold of a
# group of 128 (0.999, 0.875, 0.8671875) or of 64 (0.75, 0.734375): the C reference finds the
# threshold by a list of the largest values up to 16 of them, by quickselect beyond
CLIPS = [1.0, 0.96, 0.92, 0.8, 0.999, 0.875, 0.8671875, 0.75, 0.734375]
GROUPS = [64, 128]


@pytest.fixture(scope="module")
def ggml():
    return GGML()


def cases(group: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Named test inputs: 32 groups each."""
    n = 32 * group
    out = {}
    for scale in (1e-5, 1e-2, 1.0, 37.0, 3e3):
        out[f"gauss_{scale:g}"] = (rng.standard_normal(n) * scale).astype(np.float32)
    out["uniform"] = rng.uniform(-2, 5, n).astype(np.float32)
    out["constant"] = np.full(n, 0.7, np.float32)
    out["zeros"] = np.zeros(n, np.float32)
    x = (rng.standard_normal(n) * 0.1).astype(np.float32)
    x[::group] = 50.0  # one outlier per group
    out["single_outlier"] = x
    out["near_fp16_max"] = rng.uniform(-65000, 65000, n).astype(np.float32)
    out["beyond_fp16"] = (rng.standard_normal(n) * 1e5).astype(np.float32)
    out["tiny_subnormal_scale"] = (rng.standard_normal(n) * 1e-7).astype(np.float32)
    out["signed_zeros"] = np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32)
    out["fp32_subnormals"] = (rng.standard_normal(n) * 1e-39).astype(np.float32)
    x = rng.integers(-2, 3, n).astype(np.float32)  # many ties at the thresholds
    out["ties"] = x
    return out


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("clip", CLIPS)
def test_numpy_reference_is_bit_exact_with_c(ggml, group, clip):
    rng = np.random.default_rng(group * 100 + int(clip * 100))
    for name, x in cases(group, rng).items():
        ref = quant.quantize_row(x, group, clip)
        got = ggml.oscar2_quantize(x, group, clip)
        assert got == ref, f"{name}: quantized bytes differ"
        y_c = ggml.oscar2_dequantize(got, group)
        y_np = quant.dequantize_row(ref, group)
        assert np.array_equal(y_c.view(np.uint32), y_np.view(np.uint32)), f"{name}: dequantized values differ"


@pytest.mark.parametrize("group,type_id", [(128, quant.OSCAR2_TYPE_ID), (64, quant.OSCAR2_64_TYPE_ID)])
def test_ggml_type_traits(ggml, group, type_id):
    assert ggml.type_name(type_id) == quant.TYPE_NAMES[type_id]
    assert ggml.row_size(type_id, group) == quant.block_bytes(group)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 4 * group)).astype(np.float32)
    ref = quant.quantize_row(x, group, 1.0)  # generic paths carry no clip
    assert ggml.quantize_chunk(type_id, x) == ref
    assert ggml.cpu_from_float(type_id, x) == ref
    y = ggml.to_float(type_id, ref, x.size)
    assert np.array_equal(y, quant.dequantize_row(ref, group))


def test_bits_per_element():
    assert quant.block_bytes(128) == 36 and quant.bits_per_element(128) == 2.25
    assert quant.block_bytes(64) == 20 and quant.bits_per_element(64) == 2.5
    assert quant.type_for_head_dim(64) == quant.OSCAR2_64_TYPE_ID
    assert quant.type_for_head_dim(128) == quant.OSCAR2_TYPE_ID
    assert quant.type_for_head_dim(256) == quant.OSCAR2_TYPE_ID
    with pytest.raises(ValueError):
        quant.type_for_head_dim(80)


@pytest.mark.parametrize("group", GROUPS)
def test_non_finite_values_stay_in_their_group(ggml, group):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(8 * group).astype(np.float32)
    clean = ggml.oscar2_dequantize(ggml.oscar2_quantize(x, group, 0.96), group)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[3 * group + 5] = bad
        data = ggml.oscar2_quantize(y, group, 0.96)
        assert data == quant.quantize_row(y, group, 0.96)
        deq = ggml.oscar2_dequantize(data, group)
        assert np.all(np.isfinite(deq)), "a non-finite input must not produce non-finite values"
        other = np.ones(deq.size, bool)
        other[3 * group:4 * group] = False
        assert np.array_equal(deq[other], clean[other]), "other groups must be untouched"
        # defined behaviour: the bad value is quantized as if it were 0
        z = x.copy()
        z[3 * group + 5] = 0.0
        assert data == ggml.oscar2_quantize(z, group, 0.96)


@pytest.mark.parametrize("group", GROUPS)
def test_clip_threshold_definition(group):
    # the k-th smallest |x| with k = floor(c*G): for c = 0.5 the median magnitude
    x = np.arange(1, group + 1, dtype=np.float32)
    codes, d, m = quant.quantize_groups(x, group, 0.5)
    tau = float(group // 2 + 1)  # 0-based index G/2 of 1..G
    assert float(m[0]) == 1.0
    assert np.isclose(float(d[0]), (tau - 1) / 3, rtol=1e-3)
    assert quant.clip_index(1.0, group) is None and quant.clip_index(0.0, group) is None
    assert quant.clip_index(0.96, group) == int(np.floor(np.float32(0.96) * group))


# Round-trip error on N(0,1), measured on this format (rms error / sigma):
# clip 1.0 -> 0.500, 0.96 -> 0.395, 0.92 -> 0.357 with G=128. Bounds carry a small margin.
@pytest.mark.parametrize("group,clip,bound", [(128, 1.0, 0.52), (128, 0.96, 0.41), (128, 0.92, 0.37),
                                              (64, 1.0, 0.49), (64, 0.96, 0.40), (64, 0.92, 0.37)])
def test_round_trip_error_on_gaussian(group, clip, bound):
    x = np.random.default_rng(3).standard_normal(group * 4000).astype(np.float32)
    y = quant.fake_quantize(x, group, clip)
    rms = float(np.sqrt(np.mean((x - y) ** 2)))
    assert rms < bound
    assert rms > bound - 0.06, "error suspiciously small: is the quantizer doing anything?"


@pytest.mark.parametrize("group,type_id", [(128, quant.OSCAR2_TYPE_ID), (64, quant.OSCAR2_64_TYPE_ID)])
def test_cpu_vec_dot_matches_reference(ggml, group, type_id):
    rng = np.random.default_rng(11)
    for n_blocks in (1, 3, 16):
        x = rng.standard_normal(n_blocks * group).astype(np.float32) * 3
        y = rng.standard_normal(n_blocks * group).astype(np.float32)
        data = quant.quantize_row(x, group, 0.96)
        exact = float(np.dot(quant.dequantize_row(data, group).astype(np.float64), y.astype(np.float64)))
        fast = ggml.vec_dot(type_id, data, y, y.size)       # AVX2 where built with it
        ref = ggml.oscar2_vec_dot_ref(data, y, group)        # plain C reference
        scale = float(np.abs(quant.dequantize_row(data, group)).dot(np.abs(y))) + 1e-6
        assert abs(fast - exact) / scale < 1e-5
        assert abs(ref - exact) / scale < 1e-5


@pytest.mark.parametrize("n", [64, 128, 136, 7])
def test_cpu_window_rows_match_float64(ggml, n):
    # the CPU flash attention's window rows: f16 (F16C path where built with it) and bf16 (the
    # type's to_float and a scalar dot); n = 136 and 7 take the vector loop's tails
    rng = np.random.default_rng(n)
    q = rng.standard_normal(n).astype(np.float32)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    k16 = x.astype(np.float16)
    bits = x.view(np.uint32) & np.uint32(0xFFFF0000)  # values that bf16 holds exactly
    k_bf = (bits >> 16).astype(np.uint16)
    # the window's types (--oscar-window-type)
    T = gguf.GGMLQuantizationType
    for t, row, values in ((T.F16, k16, k16.astype(np.float32)), (T.BF16, k_bf, bits.view(np.float32))):
        exact = float(np.dot(values.astype(np.float64), q.astype(np.float64)))
        scale = float(np.abs(values.astype(np.float64)).dot(np.abs(q))) + 1e-6
        assert abs(ggml.window_kq(t, row, q) - exact) / scale < 1e-6, t
        # V rows are converted, not summed: exact
        assert np.array_equal(ggml.window_v(t, row, n), values), t
