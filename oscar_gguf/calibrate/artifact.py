"""The rotations artifact: a safetensors file of per-layer K/V rotations and clip ratios.

Tensors (numpy row-major, x_rot = x @ R):
    layers.{i}.k_rot, layers.{i}.v_rot                f32 [d, d]
    layers.{i}.k_eigenvalues, layers.{i}.v_eigenvalues f32 [d]   (ascending, eigh order)
    clip_k, clip_v                                    f32 [n_layers] (1.0 = no clipping)
    f16_k_layers                                      i32 [n] (optional): the layers whose K cache
                                                      stays f16 (the calibration's precision plan)
Metadata (strings): format_version, architecture (GGUF name), n_layers, head_dim, n_head,
n_head_kv, rope_layout ("hf" | "llama.cpp"), model, model_sha256, corpus, tokens, method,
date, tool; any other string keys are kept in ``extra``. Layers without attention may be
absent (their clip entries are 1.0).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import atomic_path
from ..format.rotations import rotation_problem
from . import layout

FORMAT_VERSION = "1"
ROPE_LAYOUTS = ("hf", "llama.cpp")
REQUIRED_META = ("format_version", "architecture", "n_layers", "head_dim", "n_head", "n_head_kv",
                 "rope_layout", "model", "model_sha256", "corpus", "tokens", "method", "date", "tool")
_INT_META = ("n_layers", "head_dim", "n_head", "n_head_kv", "tokens")


@dataclass
class RotationArtifact:
    architecture: str
    n_layers: int
    head_dim: int
    n_head: int
    n_head_kv: int
    rope_layout: str
    k_rot: dict[int, np.ndarray]
    v_rot: dict[int, np.ndarray]
    k_eigenvalues: dict[int, np.ndarray]
    v_eigenvalues: dict[int, np.ndarray]
    clip_k: np.ndarray
    clip_v: np.ndarray
    model: str = ""
    model_sha256: str = ""
    corpus: str = ""
    tokens: int = 0
    method: str = ""
    date: str = ""
    tool: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    f16_k_layers: tuple[int, ...] = ()

    @property
    def layers(self) -> list[int]:
        return sorted(self.k_rot)

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> "RotationArtifact":
        """Raise ValueError naming the first problem; return self when all is well."""
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        for name in ("n_layers", "head_dim", "n_head", "n_head_kv"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        d = self.head_dim
        sets = {"k_rot": set(self.k_rot), "v_rot": set(self.v_rot),
                "k_eigenvalues": set(self.k_eigenvalues), "v_eigenvalues": set(self.v_eigenvalues)}
        for name, s in sets.items():
            if s != sets["k_rot"]:
                missing = sorted(sets["k_rot"] ^ s)
                raise ValueError(f"layers {missing} have k_rot but not {name} (or the reverse)")
        if not self.k_rot:
            raise ValueError("the artifact holds no layers")
        bad = [i for i in self.k_rot if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"layer indices {bad} are outside 0..{self.n_layers - 1}")
        for i in self.layers:
            for kind in ("k", "v"):
                problem = rotation_problem(getattr(self, f"{kind}_rot")[i], d)
                if problem:
                    raise ValueError(f"layers.{i}.{kind}_rot {problem}")
                lam = np.asarray(getattr(self, f"{kind}_eigenvalues")[i])
                if lam.shape != (d,):
                    raise ValueError(f"layers.{i}.{kind}_eigenvalues has shape {lam.shape}, expected ({d},)")
                if not np.all(np.isfinite(lam)):
                    raise ValueError(f"layers.{i}.{kind}_eigenvalues hold non-finite values")
        for name in ("clip_k", "clip_v"):
            c = np.asarray(getattr(self, name))
            if c.shape != (self.n_layers,):
                raise ValueError(f"{name} has shape {c.shape}, expected ({self.n_layers},)")
            if not np.all(np.isfinite(c)) or np.any(c <= 0) or np.any(c > 1):
                raise ValueError(f"{name} must hold ratios in (0, 1], got {c.tolist()}")
        keep = list(self.f16_k_layers)
        if len(set(keep)) != len(keep) or any(not 0 <= int(i) < self.n_layers for i in keep):
            raise ValueError(f"f16_k_layers must name distinct layers in 0..{self.n_layers - 1}, got {keep}")
        return self

    # -- layouts ---------------------------------------------------------------------------
    def to_llama_cpp_layout(self) -> "RotationArtifact":
        """A copy whose K rotations act on llama.cpp's head-dim order (see layout.py)."""
        out = copy.deepcopy(self)
        if self.rope_layout == "hf":
            if layout.needs_qk_permutation(self.architecture):
                out.k_rot = {i: layout.rotation_hf_to_llama(r) for i, r in self.k_rot.items()}
            out.rope_layout = "llama.cpp"
        return out

    def to_hf_layout(self) -> "RotationArtifact":
        """A copy whose K rotations act on the HF head-dim order (for the HF simulation)."""
        out = copy.deepcopy(self)
        if self.rope_layout == "llama.cpp":
            if layout.needs_qk_permutation(self.architecture):
                out.k_rot = {i: layout.rotation_llama_to_hf(r) for i, r in self.k_rot.items()}
            out.rope_layout = "hf"
        return out

    # -- (de)serialisation -----------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        meta = {str(k): str(v) for k, v in self.extra.items()}
        meta.update(format_version=FORMAT_VERSION, architecture=self.architecture,
                    n_layers=str(self.n_layers), head_dim=str(self.head_dim), n_head=str(self.n_head),
                    n_head_kv=str(self.n_head_kv), rope_layout=self.rope_layout, model=self.model,
                    model_sha256=self.model_sha256, corpus=self.corpus, tokens=str(self.tokens),
                    method=self.method, date=self.date, tool=self.tool)
        return meta

    def tensors(self) -> dict[str, np.ndarray]:
        t: dict[str, np.ndarray] = {}
        for i in self.layers:
            t[f"layers.{i}.k_rot"] = np.ascontiguousarray(self.k_rot[i], dtype=np.float32)
            t[f"layers.{i}.v_rot"] = np.ascontiguousarray(self.v_rot[i], dtype=np.float32)
            t[f"layers.{i}.k_eigenvalues"] = np.ascontiguousarray(self.k_eigenvalues[i], dtype=np.float32)
            t[f"layers.{i}.v_eigenvalues"] = np.ascontiguousarray(self.v_eigenvalues[i], dtype=np.float32)
        t["clip_k"] = np.ascontiguousarray(self.clip_k, dtype=np.float32)
        t["clip_v"] = np.ascontiguousarray(self.clip_v, dtype=np.float32)
        if self.f16_k_layers:
            t["f16_k_layers"] = np.asarray(sorted(self.f16_k_layers), dtype=np.int32)
        return t


def save_artifact(path: str | os.PathLike, art: RotationArtifact) -> Path:
    """Validate and write atomically (temp file in the same folder, then rename)."""
    from safetensors.numpy import save_file

    art.validate()
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(art.tensors(), str(tmp), metadata=art.metadata())
    return path


def load_artifact(path: str | os.PathLike) -> RotationArtifact:
    """Read and validate an artifact; ValueError says what is wrong with it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"rotations artifact {path} does not exist")
    try:
        with safe_open(str(path), framework="np") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"{path}: metadata keys missing: {', '.join(missing)}")
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {meta['format_version']!r} is not supported "
                         f"(this oscar-gguf reads {FORMAT_VERSION!r})")
    ints = {}
    for k in _INT_META:
        try:
            ints[k] = int(meta[k])
        except ValueError:
            raise ValueError(f"{path}: metadata {k}={meta[k]!r} is not an integer") from None
    for k in ("clip_k", "clip_v"):
        if k not in tensors:
            raise ValueError(f"{path}: tensor {k} is missing")
    per_layer: dict[str, dict[int, np.ndarray]] = {s: {} for s in
                                                    ("k_rot", "v_rot", "k_eigenvalues", "v_eigenvalues")}
    for name, t in tensors.items():
        if name in ("clip_k", "clip_v", "f16_k_layers"):
            continue
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers" or not (parts[1].isascii() and parts[1].isdigit()) or parts[2] not in per_layer:
            raise ValueError(f"{path}: unexpected tensor {name!r}")
        per_layer[parts[2]][int(parts[1])] = t
    extra = {k: v for k, v in meta.items() if k not in REQUIRED_META}
    art = RotationArtifact(
        architecture=meta["architecture"], n_layers=ints["n_layers"], head_dim=ints["head_dim"],
        n_head=ints["n_head"], n_head_kv=ints["n_head_kv"], rope_layout=meta["rope_layout"],
        k_rot=per_layer["k_rot"], v_rot=per_layer["v_rot"],
        k_eigenvalues=per_layer["k_eigenvalues"], v_eigenvalues=per_layer["v_eigenvalues"],
        clip_k=tensors["clip_k"], clip_v=tensors["clip_v"], model=meta["model"],
        model_sha256=meta["model_sha256"], corpus=meta["corpus"], tokens=ints["tokens"],
        method=meta["method"], date=meta["date"], tool=meta["tool"], extra=extra,
        f16_k_layers=tuple(int(i) for i in np.asarray(tensors.get("f16_k_layers", ()), dtype=np.int64).reshape(-1)))
    try:
        return art.validate()
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
