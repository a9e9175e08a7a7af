"""The cases the fuzz harness generates, as hypothesis strategies: each case is JSON (a target
and a list of mutations), so a failing one is saved and replayed as it is.

The constants name what the mutations may touch and, where the rules are definite, what
llama.cpp must do with the result (oracle.py reads them).
"""
from __future__ import annotations

from ..format import gguf_keys as K
from .inputs import ARRAY, BOOL, F32, F64, I32, STRING, TINY, U8, U32, U64

NAN, INF = float("nan"), float("inf")
OSCAR_U32_KEYS = [K.KEY_FORMAT_VERSION, K.KEY_SINK, K.KEY_RECENT]
OSCAR_CLIP_KEYS = [K.KEY_CLIP_K, K.KEY_CLIP_V]
OSCAR_FREE_KEYS = [K.KEY_GROUP_SIZE, K.KEY_ROPE_LAYOUT, K.KEY_CALIB_PREFIX + "method"]
# the precision plan: layer indices, valid below the tiny model's layer count
PLAN_LAYERS = [0, 1, TINY.n_layer - 1, TINY.n_layer, TINY.n_layer + 1, 1 << 31, (1 << 32) - 1]
# model keys we delete, and whether llama.cpp must then refuse the tiny model
MODEL_KEY_DELETIONS = {"general.architecture": "refuse", "llama.block_count": "refuse",
                       "llama.embedding_length": "refuse", "llama.attention.head_count": "refuse",
                       "llama.attention.key_length": "accept", "tokenizer.ggml.tokens": "refuse"}
# tensor names that llama.cpp does not know (or that the GGUF readers might half-know)
ODD_TENSOR_NAMES = ["blk.2.attn_k_rot", "blk.999.attn_v_rot", "blk.-1.attn_k_rot", "blk.\u00b2.attn_k_rot",
                    "blk.\u0663.attn_v_rot", "blk.00.attn_k_rot", "blk.0.attn_K_rot", "blk.0.attn_k_rot.x",
                    "blk. 0.attn_k_rot", "blk.0.attn_k_rot" + "x" * 60, "blk.0.attn_q_rot"]
ROT_VALUE_OPS = {  # op -> what llama.cpp must do with the tensor
    "nan": "refuse", "inf": "refuse", "neg_inf": "refuse", "zero": "refuse", "scale_big": "refuse",
    "half": "refuse", "huge": "refuse", "perturb_big": "refuse",
    "scale_tiny": "accept", "perm": "accept", "neg": "accept", "transpose": "accept", "identity": "accept",
    "subnormal": "accept"}
ROT_SHAPES = [[64, 63], [63, 64], [128, 128], [32, 32], [64], [64, 64, 1], [64, 64, 2], [4096], [0, 64],
              [64, 64, 1, 1], [1, 64, 64]]
ROT_DTYPES = [1, 30, 8, 26, 28, 100, 101, 200, 4, 24]


def strategies() -> dict:
    """target -> strategy of cases; built lazily, since hypothesis is only needed when fuzzing."""
    from hypothesis import strategies as st
    return {"gguf": _gguf_cases(st), "artifact": _artifact_cases(st), "zoo": _zoo_cases(st)}


def _gguf_cases(st):
    """The tiny GGUF: its oscar.* keys, rotation tensors, model keys, tensor table and bytes."""
    text_spec = st.one_of(
        st.sampled_from(["", "1", "llama.cpp", "hf", "x", "\u00b2", "-1", "nan"]).map(lambda s: {"s": s}),
        st.text(max_size=40).map(lambda s: {"s": s}),
        st.sampled_from([1 << 10, 1 << 16, 1 << 20]).map(lambda n: {"rep": "H", "n": n}),
        st.binary(min_size=1, max_size=8).map(lambda b: {"hex": (b + b"\xff").hex()}))
    u32_vals = st.sampled_from([0, 1, 2, 63, 64, 256, 1 << 20, (1 << 20) + 1, 1 << 31, (1 << 32) - 1])
    f32_elems = st.sampled_from([0.96, 0.92, 1.0, 0.5, 0.0, -1.0, 1.5, NAN, INF, -INF, 1e-45, 1.0000001])

    def typed_value(for_clip: bool):
        arrays = st.tuples(st.sampled_from([0, 1, 2, 3, 1000]), f32_elems, st.booleans()).map(
            lambda x: {"t": ARRAY, "et": F32, "n": x[0], "fill": x[1], "vary": x[2]})
        other = st.one_of(
            u32_vals.map(lambda v: {"t": U32, "v": v}),
            st.sampled_from([-1, -(1 << 31), 0, 1, 64]).map(lambda v: {"t": I32, "v": v}),
            st.sampled_from([1, 1 << 63]).map(lambda v: {"t": U64, "v": v}),
            st.sampled_from([1.0, NAN, INF, 0.5]).map(lambda v: {"t": F32, "v": v}),
            st.booleans().map(lambda v: {"t": BOOL, "v": v}),
            text_spec.map(lambda s: {"t": STRING, "v": s}),
            st.sampled_from([I32, F64, STRING, U8]).map(lambda et: {"t": ARRAY, "et": et, "n": 2}),
            st.just({"t": 13, "v": 0}))  # an invalid type id
        return st.one_of(arrays, arrays, other) if for_clip else st.one_of(other, other, arrays)

    plan_value = st.one_of(
        st.lists(st.sampled_from(PLAN_LAYERS), max_size=4).map(lambda v: {"t": ARRAY, "et": U32, "vals": v}),
        st.lists(st.sampled_from(PLAN_LAYERS[:3]), max_size=4).map(lambda v: {"t": ARRAY, "et": U32, "vals": v}),
        typed_value(False))
    meta_set = st.one_of(
        st.tuples(st.sampled_from(OSCAR_U32_KEYS), typed_value(False)),
        st.tuples(st.sampled_from(OSCAR_CLIP_KEYS), typed_value(True)),
        st.tuples(st.sampled_from(OSCAR_FREE_KEYS), typed_value(False)),
        st.tuples(st.just(K.KEY_F16_K_LAYERS), plan_value),
    ).map(lambda x: {"op": "meta_set", "key": x[0], "value": x[1]})
    meta_del = st.sampled_from(OSCAR_U32_KEYS + OSCAR_CLIP_KEYS + OSCAR_FREE_KEYS + [K.KEY_F16_K_LAYERS]).map(
        lambda k: {"op": "meta_del", "key": k})
    meta_dup = st.sampled_from(OSCAR_U32_KEYS + OSCAR_CLIP_KEYS + [K.KEY_F16_K_LAYERS]).map(
        lambda k: {"op": "meta_dup", "key": k})
    model_del = st.sampled_from(sorted(MODEL_KEY_DELETIONS)).map(lambda k: {"op": "model_del", "key": k})
    block_count = st.sampled_from([0, 1, 3, 512, 513, 100000, (1 << 32) - 1]).map(
        lambda v: {"op": "block_count", "value": v})
    key_name = st.one_of(
        st.sampled_from([1 << 10, 1 << 16]).map(lambda n: {"rep": "k", "n": n}),
        st.just({"hex": "6f736361722eff"}), st.just({"s": ""}), st.just({"s": "oscar."}),
    ).map(lambda s: {"op": "odd_key", "name": s})
    which = st.sampled_from(["k", "v"])
    layer = st.sampled_from([0, 1])
    rot_values = st.tuples(which, layer, st.sampled_from(sorted(ROT_VALUE_OPS)), st.integers(0, 4095)).map(
        lambda x: {"op": "rot_values", "which": x[0], "layer": x[1], "how": x[2], "at": x[3]})
    rot_dtype = st.tuples(which, layer, st.sampled_from(ROT_DTYPES)).map(
        lambda x: {"op": "rot_dtype", "which": x[0], "layer": x[1], "ttype": x[2]})
    rot_shape = st.tuples(which, layer, st.sampled_from(ROT_SHAPES)).map(
        lambda x: {"op": "rot_shape", "which": x[0], "layer": x[1], "ne": x[2]})
    rot_del = st.tuples(which, layer).map(lambda x: {"op": "rot_del", "which": x[0], "layer": x[1]})
    rot_name = st.tuples(st.sampled_from(ODD_TENSOR_NAMES), st.booleans(), which, layer).map(
        lambda x: {"op": "rot_name", "name": x[0], "rename": x[1], "which": x[2], "layer": x[3]})
    rot_dup = st.tuples(which, layer).map(lambda x: {"op": "rot_dup", "which": x[0], "layer": x[1]})
    offset = st.tuples(st.integers(0, 30), st.sampled_from(["misalign", "beyond", "previous"])).map(
        lambda x: {"op": "offset", "index": x[0], "how": x[1]})
    ndims = st.tuples(which, layer, st.sampled_from([0, 5, 1 << 31])).map(
        lambda x: {"op": "ndims", "which": x[0], "layer": x[1], "n": x[2]})
    lie = st.tuples(st.sampled_from(OSCAR_CLIP_KEYS + [K.KEY_F16_K_LAYERS, "tokenizer.ggml.tokens"]),
                    st.sampled_from([1, 1 << 20, 1 << 40])).map(lambda x: {"op": "array_lie", "key": x[0], "extra": x[1]})
    counts = st.tuples(st.sampled_from(["n_tensors", "n_kv"]), st.sampled_from([1, 1 << 40, (1 << 64) - 1])).map(
        lambda x: {"op": "counts", "field": x[0], "delta": x[1]})
    version = st.sampled_from([0, 1, 2, 4, (1 << 32) - 1]).map(lambda v: {"op": "version", "value": v})
    trunc = st.tuples(st.sampled_from(["header", "kv", "ti", "data", "any"]), st.floats(0, 1)).map(
        lambda x: {"op": "truncate", "region": x[0], "frac": x[1]})
    flip = st.tuples(st.sampled_from(["kv", "ti", "data", "any"]), st.integers(1, 8), st.integers(0, 1 << 30)).map(
        lambda x: {"op": "flip", "region": x[0], "n": x[1], "seed": x[2]})
    valid = st.sampled_from(["noop", "drop_all_oscar", "strip_rotations", "window_zero"]).map(
        lambda v: {"op": "valid", "how": v})

    gguf_mut = st.one_of(meta_set, meta_set, meta_del, meta_dup, model_del, block_count, key_name,
                         rot_values, rot_values, rot_dtype, rot_shape, rot_del, rot_name, rot_dup,
                         offset, ndims, lie, counts, version, trunc, flip, valid)
    gguf_case = st.lists(gguf_mut, min_size=1, max_size=3).map(lambda m: {"target": "gguf", "mutations": m})
    return gguf_case


def _artifact_cases(st):
    """A calibration artifact (safetensors): metadata, tensors, header and bytes."""
    from ..calibrate.artifact import REQUIRED_META
    art_names = ["layers.0.k_rot", "layers.1.v_rot", "layers.0.k_eigenvalues", "layers.1.v_eigenvalues",
                 "clip_k", "clip_v"]
    art_meta_vals = st.one_of(
        st.sampled_from(["", "0", "-1", "1", "2", "64", "1e3", "abc", " 2", "\u00b2", "\u0663",
                         "99999999999999999999", "hf", "llama.cpp", "llama", "qwen3", "nan"]).map(lambda s: {"s": s}),
        st.just({"rep": "m", "n": 1 << 20}), st.text(max_size=20).map(lambda s: {"s": s}))
    art_mut = st.one_of(
        st.sampled_from(REQUIRED_META).map(lambda k: {"op": "meta_del", "key": k}),
        st.tuples(st.sampled_from(REQUIRED_META), art_meta_vals).map(
            lambda x: {"op": "meta_set", "key": x[0], "value": x[1]}),
        st.tuples(st.sampled_from(REQUIRED_META), st.sampled_from([1, None, [1], {"a": 1}, True])).map(
            lambda x: {"op": "meta_raw", "key": x[0], "value": x[1]}),
        st.tuples(st.sampled_from(art_names), st.sampled_from(["F16", "BF16", "F64", "I32", "I64", "U8", "BOOL"])).map(
            lambda x: {"op": "dtype", "name": x[0], "dtype": x[1]}),
        st.tuples(st.sampled_from(art_names), st.sampled_from(["nan", "inf", "scale", "zero", "perm", "neg",
                                                               "identity", "big"])).map(
            lambda x: {"op": "values", "name": x[0], "how": x[1]}),
        st.tuples(st.sampled_from(art_names), st.sampled_from([[], [1], [64], [64, 32], [32, 64], [128, 128],
                                                               [2, 64, 64], [0, 64], [3], [2, 2]])).map(
            lambda x: {"op": "shape", "name": x[0], "shape": x[1]}),
        st.sampled_from(art_names).map(lambda n: {"op": "del", "name": n}),
        st.sampled_from(["layers.2.k_rot", "layers.\u00b2.k_rot", "layers.-1.k_rot", "layers.0.q_rot", "foo",
                         "layers.99999999999999999999.k_rot", "layers.0.k_rot.x", "layers..k_rot"]).map(
            lambda n: {"op": "add", "name": n}),
        st.tuples(st.sampled_from(art_names), st.sampled_from(["beyond", "reverse", "overlap", "short"])).map(
            lambda x: {"op": "offsets", "name": x[0], "how": x[1]}),
        st.sampled_from(["invalid_json", "not_object", "huge_len", "zero_len", "len_beyond", "empty_file",
                         "trailing_garbage"]).map(lambda h: {"op": "raw", "how": h}),
        st.floats(0, 1).map(lambda f: {"op": "truncate", "frac": f}),
        st.tuples(st.integers(1, 8), st.integers(0, 1 << 30)).map(lambda x: {"op": "flip", "n": x[0], "seed": x[1]}),
        st.just({"op": "noop"}))
    art_case = st.lists(art_mut, min_size=1, max_size=3).map(lambda m: {"target": "artifact", "mutations": m})
    return art_case


def _zoo_cases(st):
    """A RotationZoo .pt pair: its structure, dtypes, shapes and bytes."""
    layer = st.sampled_from([0, 1])
    zoo_file = st.sampled_from(["k", "v", "both"])
    zoo_mut = st.one_of(
        st.sampled_from(["absent", 1, 2, "1", "x", None, 1.5, [1], True, 10 ** 30]).map(
            lambda v: {"op": "format_version", "value": v}),
        st.sampled_from(["absent", "qqt", 123, None, {"rep": "o", "n": 1 << 16}]).map(
            lambda v: {"op": "objective", "value": v}),
        st.sampled_from(["list", "none", "absent", "tensor", "str", "empty"]).map(
            lambda v: {"op": "layers", "value": v}),
        st.tuples(layer, st.sampled_from(["0", "a", -1, 10 ** 12, True, 1.5, None, "\u00b2", " 1"])).map(
            lambda x: {"op": "layer_key", "layer": x[0], "key": x[1]}),
        st.tuples(layer, st.sampled_from(["rotation", "eigenvalues"])).map(
            lambda x: {"op": "entry_drop", "layer": x[0], "field": x[1]}),
        st.tuples(layer, st.sampled_from(["list", "float", "str", "none", "dict", "nested_list"])).map(
            lambda x: {"op": "entry_kind", "layer": x[0], "kind": x[1]}),
        st.tuples(layer, st.sampled_from(["rotation", "eigenvalues"]),
                  st.sampled_from(["list", "float", "str", "none", "int"])).map(
            lambda x: {"op": "field_kind", "layer": x[0], "field": x[1], "kind": x[2]}),
        st.tuples(layer, st.sampled_from([[], [64], [1, 64, 64], [64, 32], [128, 128], [0], [0, 0]])).map(
            lambda x: {"op": "rot_shape", "layer": x[0], "shape": x[1]}),
        st.tuples(layer, st.sampled_from(["float64", "float16", "bfloat16", "int32", "bool", "complex64",
                                          "uint8"])).map(lambda x: {"op": "rot_dtype", "layer": x[0], "dtype": x[1]}),
        st.tuples(layer, st.sampled_from(["nan", "inf", "zero", "scale", "perm", "neg"])).map(
            lambda x: {"op": "rot_values", "layer": x[0], "how": x[1]}),
        st.tuples(layer, st.sampled_from([[32], [8, 8], [], [0], [64, 1]]), st.booleans()).map(
            lambda x: {"op": "eig", "layer": x[0], "shape": x[1], "nan": x[2]}),
        st.just({"op": "v_fewer_layers"}),
        st.sampled_from(["empty", "garbage", "not_weights_only", "zip_garbage"]).map(lambda h: {"op": "raw", "how": h}),
        st.floats(0, 1).map(lambda f: {"op": "truncate", "frac": f}),
        st.tuples(st.integers(1, 8), st.integers(0, 1 << 30)).map(lambda x: {"op": "flip", "n": x[0], "seed": x[1]}),
        st.just({"op": "noop"}))
    zoo_case = st.tuples(zoo_file, st.lists(zoo_mut, min_size=1, max_size=3)).map(
        lambda x: {"target": "zoo", "file": x[0], "mutations": x[1]})
    return zoo_case
