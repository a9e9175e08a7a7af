"""The fuzz harness's oracle: what the patched llama.cpp must do with a GGUF, from the rules of
llama-oscar.cpp, gguf.cpp and the model loader, modelled independently of them.

A rotation is judged with the same norm and limit as the loader and oscar-convert
(format/rotations.py: the largest entry of |RᵀR − I| against ORTHOGONALITY_LIMIT), computed
here on its own, with a band around the limit where either verdict is right.
"""
from __future__ import annotations

import numpy as np

from ..format import gguf_keys as K
from ..format.rotations import ORTHOGONALITY_LIMIT
from .inputs import (_TYPE_SIZE, ARRAY, F32, F64, GGML_F32, GGML_MAX_DIMS, GGML_MAX_NAME, I32, KV, TINY, U32,
                     GGUFDoc, Tensor, tiny_model)
from .mutations import _rot_name
from .strategies import MODEL_KEY_DELETIONS, OSCAR_CLIP_KEYS

_ROT_NAMES = {(K.K_ROT if w == "k" else K.V_ROT).format(i).encode() for w in "kv" for i in range(TINY.n_layer)}


def _valid_u32(kv: KV | None) -> int | None:
    """The value the loader reads for an unsigned-int oscar key, or None if it must refuse."""
    if kv.vtype == U32:
        return kv.value
    if kv.vtype == I32 and kv.value >= 0:
        return kv.value
    return None


def _rotation_problem(t: Tensor, d: int) -> str | None:
    """Why llama.cpp must refuse this rotation tensor ("" if borderline), None if it is fine."""
    if t.ttype != GGML_F32:
        return "type"
    if len(t.ne) > GGML_MAX_DIMS or list(t.ne) + [1] * (GGML_MAX_DIMS - len(t.ne)) != [d, d, 1, 1]:
        return "shape"
    r = np.frombuffer(t.data, dtype="<f4")[: d * d].reshape(d, d).astype(np.float64)
    if not np.all(np.isfinite(r)):
        return "non-finite"
    with np.errstate(all="ignore"):
        err = float(np.abs(r.T @ r - np.eye(d)).max())
    if err > 2 * ORTHOGONALITY_LIMIT:
        return "not orthogonal"
    if err > ORTHOGONALITY_LIMIT / 2:
        return ""  # within rounding of the loader's limit: either outcome is right
    return None


def expect_loader(doc: GGUFDoc, facts: dict) -> tuple[str, str]:
    """('refuse' | 'accept' | 'either', why): what the patched llama.cpp must do with the file,
    from the rules in llama-oscar.cpp, gguf.cpp and the model loader, modelled independently."""
    if facts["damage"]:
        return "refuse", f"damaged file ({', '.join(facts['damage'])})"
    refuse: list[str] = []
    keys = [kv.key for kv in doc.kvs]
    if len(set(keys)) != len(keys):
        refuse.append("duplicate key")
    if any(kv.vtype > F64 for kv in doc.kvs):
        refuse.append("invalid value type")
    names = [t.name for t in doc.tensors]
    if len(set(names)) != len(names):
        refuse.append("duplicate tensor")
    for t in doc.tensors:
        if len(t.name) >= GGML_MAX_NAME:
            refuse.append("tensor name too long")
        if len(t.ne) > GGML_MAX_DIMS or any(n <= 0 for n in t.ne):
            refuse.append("tensor dims")
        if t.ttype not in _TYPE_SIZE or (t.ne and t.ne[0] % _TYPE_SIZE[t.ttype][0]):
            refuse.append("tensor type or block size")
    for k in facts["deleted_model_keys"]:
        if MODEL_KEY_DELETIONS[k] == "refuse":
            refuse.append(f"no {k}")
    bc = doc.find("llama.block_count")
    if bc is None or bc.vtype != U32 or bc.value != TINY.n_layer:
        refuse.append("block_count does not match the tensors")
    known = {t.name for t in tiny_model(rotations=False).tensors}
    known |= {_rot_name(w, i).encode() for w in "kv" for i in range(TINY.n_layer)}
    if any(n not in known for n in names):
        refuse.append("unknown tensor")
    uncertain = list(facts["uncertain"])
    for t in doc.tensors:
        if t.name in known and t.name.endswith(b"_rot"):
            p = _rotation_problem(t, TINY.head_dim)
            if p:
                refuse.append(f"rotation {p}")
            elif p == "":
                uncertain.append("rotation at the tolerance")
    fv = doc.find(K.KEY_FORMAT_VERSION)
    if fv is not None:  # without it the loader ignores every other oscar.* key (by design)
        if _valid_u32(fv) != K.FORMAT_VERSION:
            refuse.append("format_version")
        for key in (K.KEY_SINK, K.KEY_RECENT):
            kv = doc.find(key)
            if kv is not None:
                v = _valid_u32(kv)
                if v is None or v > (1 << 20):
                    refuse.append(key)
        for key in OSCAR_CLIP_KEYS:
            kv = doc.find(key)
            if kv is None:
                continue
            if kv.vtype != ARRAY or kv.etype != F32 or len(kv.value) != TINY.n_layer:
                refuse.append(key)
                continue
            v = np.asarray(kv.value, dtype=np.float32)
            if not (np.all(np.isfinite(v)) and np.all(v > 0) and np.all(v <= 1)):
                refuse.append(key)
        plan = doc.find(K.KEY_F16_K_LAYERS)
        if plan is not None and (plan.vtype != ARRAY or plan.etype != U32 or any(v >= TINY.n_layer for v in plan.value)):
            refuse.append(K.KEY_F16_K_LAYERS)
    if refuse:
        return "refuse", "; ".join(sorted(set(refuse)))
    if uncertain:
        return "either", "; ".join(uncertain)
    return "accept", "valid"
