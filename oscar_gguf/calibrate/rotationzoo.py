"""Import OSCAR's own rotation files (the "RotationZoo") into a RotationArtifact.

A RotationZoo file is a torch ``.pt`` dict (docs/design.md §1):
``{"format_version": 1, "objective": str, "layers": {i: {"rotation": [d, d] f32,
"eigenvalues": [d]}}}``, one file for K (k_rotation_qqt_r_h_pbr.pt) and one for V
(v_rotation_sst_r_h_pbr.pt). OSCAR works on Hugging Face models, so its rotations act on
the HF head-dim order (rope_layout "hf") with x_rot = x @ R.
"""
from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

import numpy as np

from .artifact import RotationArtifact
from ..format.gguf_keys import DEFAULT_CLIP_K, DEFAULT_CLIP_V


def _read_zoo(path: str | os.PathLike) -> tuple[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    import torch

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"RotationZoo file {path} does not exist")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        # torch's own message can span many lines; the first says what went wrong
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{path} is not a readable torch file ({type(e).__name__}: {first})") from None
    if not isinstance(obj, dict) or "layers" not in obj or not isinstance(obj["layers"], dict):
        raise ValueError(f"{path} is not a RotationZoo file: expected a dict with a 'layers' dict")
    version = obj.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version != 1:
        raise ValueError(f"{path}: RotationZoo format_version {obj.get('format_version')} is not supported")
    layers = {}
    for key, entry in obj["layers"].items():
        try:
            i = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: layer key {key!r} is not an integer") from None
        if not isinstance(entry, dict) or "rotation" not in entry or "eigenvalues" not in entry:
            raise ValueError(f"{path}: layer {i} needs 'rotation' and 'eigenvalues'")
        r, lam = entry["rotation"], entry["eigenvalues"]
        for name, t in (("rotation", r), ("eigenvalues", lam)):
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                raise ValueError(f"{path}: layer {i} {name} must be a real floating-point tensor, "
                                 f"got {type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' ' + str(t.dtype)}")
        if r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] == 0:
            raise ValueError(f"{path}: layer {i} rotation must be a square [d, d] matrix, got shape {list(r.shape)}")
        r = r.detach().to(torch.float64).cpu().numpy()
        lam = lam.detach().to(torch.float64).cpu().numpy().reshape(-1)
        layers[i] = (r, lam)
    if not layers:
        raise ValueError(f"{path} holds no layers")
    return str(obj.get("objective", "")), layers


def import_rotationzoo(k_pt: str | os.PathLike, v_pt: str | os.PathLike, *, architecture: str,
                       n_head: int, n_head_kv: int, n_layers: int | None = None,
                       clip_k: float | np.ndarray = DEFAULT_CLIP_K,
                       clip_v: float | np.ndarray = DEFAULT_CLIP_V,
                       rope_layout: str = "hf", model: str = "", model_sha256: str = "") -> RotationArtifact:
    """Read a K and a V RotationZoo file into a validated RotationArtifact.

    ``architecture`` is the GGUF architecture name the rotations are for (it decides the
    layout mapping); the head counts are the model's. Clips are one value for every layer
    or an array [n_layers]; the defaults are the paper's 0.96 / 0.92.
    """
    from .. import __version__

    k_obj, k_layers = _read_zoo(k_pt)
    v_obj, v_layers = _read_zoo(v_pt)
    if set(k_layers) != set(v_layers):
        raise ValueError(f"the K and V files cover different layers: {sorted(set(k_layers) ^ set(v_layers))}")
    d = next(iter(k_layers.values()))[0].shape[0]
    n = max(k_layers) + 1 if n_layers is None else int(n_layers)
    ck = np.broadcast_to(np.asarray(clip_k, dtype=np.float32), (n,)).copy()
    cv = np.broadcast_to(np.asarray(clip_v, dtype=np.float32), (n,)).copy()
    art = RotationArtifact(
        architecture=architecture, n_layers=n, head_dim=d, n_head=int(n_head), n_head_kv=int(n_head_kv),
        rope_layout=rope_layout,
        k_rot={i: r.astype(np.float32) for i, (r, _) in k_layers.items()},
        v_rot={i: r.astype(np.float32) for i, (r, _) in v_layers.items()},
        k_eigenvalues={i: lam.astype(np.float32) for i, (_, lam) in k_layers.items()},
        v_eigenvalues={i: lam.astype(np.float32) for i, (_, lam) in v_layers.items()},
        clip_k=ck, clip_v=cv, model=model, model_sha256=model_sha256,
        corpus=f"rotationzoo:{Path(k_pt).name},{Path(v_pt).name}", tokens=0,
        method=f"rotationzoo-{k_obj or 'k'}-{v_obj or 'v'}/clip-fixed",
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        tool=f"oscar-gguf {__version__}")
    try:
        return art.validate()
    except ValueError as e:
        raise ValueError(f"RotationZoo import: {e}") from None
