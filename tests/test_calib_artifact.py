"""Rotations artifact: round trip, atomic write and every refusal; RotationZoo import."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from oscar_gguf.calibrate.artifact import RotationArtifact, load_artifact, save_artifact
from oscar_gguf.calibrate.oscar_rotation import oscar_rotation
from oscar_gguf.calibrate.rotationzoo import import_rotationzoo


pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, L = 64, 4


def make_artifact(n_layers=L, layers=(0, 1, 3)):
    rng = np.random.default_rng(0)
    rots, lams = {}, {}
    for i in layers:
        a = rng.standard_normal((D, D))
        rots[i], lams[i] = oscar_rotation(a @ a.T)
    f32 = lambda m: {i: v.astype(np.float32) for i, v in m.items()}
    return RotationArtifact(
        architecture="llama", n_layers=n_layers, head_dim=D, n_head=9, n_head_kv=3, rope_layout="llama.cpp",
        k_rot=f32(rots), v_rot={i: r.T.copy().astype(np.float32) for i, r in rots.items()},
        k_eigenvalues=f32(lams), v_eigenvalues=f32(lams),
        clip_k=np.linspace(0.8, 1.0, n_layers, dtype=np.float32), clip_v=np.full(n_layers, 0.92, np.float32),
        model="m.gguf", model_sha256="ab" * 32, corpus="c", tokens=123, method="oscar-qqt-sst/clip-search",
        date="2026-11-22", tool="oscar-gguf 0.1.0", extra={"group_size": "64"})


def test_round_trip(tmp_path):
    a = make_artifact()
    p = save_artifact(tmp_path / "sub" / "rot.safetensors", a)
    b = load_artifact(p)
    assert b.layers == [0, 1, 3]
    for i in a.layers:
        for name in ("k_rot", "v_rot", "k_eigenvalues", "v_eigenvalues"):
            assert np.array_equal(getattr(a, name)[i], getattr(b, name)[i])
    assert np.array_equal(a.clip_k, b.clip_k) and np.array_equal(a.clip_v, b.clip_v)
    assert b.metadata() == a.metadata()
    assert b.extra == {"group_size": "64"}
    assert [x.name for x in p.parent.iterdir()] == ["rot.safetensors"]     # no temp files left
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask                      # not mkstemp's 0600


def _write_raw(path, tensors: dict, meta: dict):
    from safetensors.numpy import save_file
    save_file(tensors, str(path), metadata=meta)


def _tensors_meta():
    a = make_artifact()
    return a.tensors(), a.metadata()


@pytest.mark.parametrize("mutate,message", [
    (lambda t, m: m.pop("head_dim"), "metadata keys missing: head_dim"),
    (lambda t, m: m.update(format_version="2"), "format_version"),
    (lambda t, m: m.update(n_layers="four"), "not an integer"),
    (lambda t, m: m.update(rope_layout="neox"), "rope_layout"),
    (lambda t, m: t.pop("layers.1.v_rot"), "layers [1]"),
    (lambda t, m: t.pop("clip_v"), "clip_v is missing"),
    (lambda t, m: t.update({"layers.1.k_rot": np.eye(32, dtype=np.float32)}), "shape (32, 32)"),
    (lambda t, m: t.update({"layers.0.k_eigenvalues": np.ones(8, np.float32)}), "eigenvalues has shape"),
    (lambda t, m: t["layers.0.v_rot"].__setitem__((3, 3), np.nan), "non-finite"),
    (lambda t, m: t.update({"layers.0.k_rot": t["layers.0.k_rot"] * np.float32(1.001)}), "not orthogonal"),
    (lambda t, m: t.update({"clip_k": np.ones(3, np.float32)}), "clip_k has shape"),
    (lambda t, m: t.update({"clip_v": np.full(L, 1.5, np.float32)}), "ratios in (0, 1]"),
    (lambda t, m: m.update(n_layers="2"), "outside 0..1"),
    (lambda t, m: t.update({"layers.0.q_rot": np.eye(D, dtype=np.float32)}), "unexpected tensor"),
])
def test_refusals(tmp_path, mutate, message):
    t, m = _tensors_meta()
    t = {k: v.copy() for k, v in t.items()}
    mutate(t, m)
    p = tmp_path / "bad.safetensors"
    _write_raw(p, t, m)
    with pytest.raises(ValueError) as e:
        load_artifact(p)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_refuses_files_that_are_not_artifacts(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_artifact(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_artifact(junk)
    # a header that claims more data than the file has
    hdr = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr)
    with pytest.raises(ValueError):
        load_artifact(tmp_path / "short.safetensors")


def test_save_refuses_invalid_and_keeps_old_file(tmp_path):
    p = tmp_path / "rot.safetensors"
    save_artifact(p, make_artifact())
    before = p.read_bytes()
    bad = make_artifact()
    bad.k_rot[0] = bad.k_rot[0] * 2
    with pytest.raises(ValueError, match="not orthogonal"):
        save_artifact(p, bad)
    assert p.read_bytes() == before


def _write_zoo(path, rots, objective):
    torch.save({"format_version": 1, "objective": objective,
                "layers": {i: {"rotation": torch.from_numpy(r.astype(np.float32)),
                               "eigenvalues": torch.from_numpy(l.astype(np.float32))}
                           for i, (r, l) in rots.items()}}, str(path))


def test_rotationzoo_import(tmp_path):
    a = make_artifact(layers=(0, 1, 2, 3))
    k = {i: (a.k_rot[i], a.k_eigenvalues[i]) for i in a.layers}
    v = {i: (a.v_rot[i], a.v_eigenvalues[i]) for i in a.layers}
    _write_zoo(tmp_path / "k_rotation_qqt_r_h_pbr.pt", k, "qqt")
    _write_zoo(tmp_path / "v_rotation_sst_r_h_pbr.pt", v, "sst")
    art = import_rotationzoo(tmp_path / "k_rotation_qqt_r_h_pbr.pt", tmp_path / "v_rotation_sst_r_h_pbr.pt",
                             architecture="qwen3", n_head=9, n_head_kv=3)
    assert art.rope_layout == "hf" and art.n_layers == 4 and art.head_dim == D
    assert np.array_equal(art.k_rot[2], a.k_rot[2]) and np.array_equal(art.v_eigenvalues[1], a.v_eigenvalues[1])
    assert np.allclose(art.clip_k, 0.96) and np.allclose(art.clip_v, 0.92)
    assert "qqt" in art.method and "sst" in art.method
    save_artifact(tmp_path / "zoo.safetensors", art)
    assert load_artifact(tmp_path / "zoo.safetensors").layers == [0, 1, 2, 3]


def test_rotationzoo_refusals(tmp_path):
    a = make_artifact(layers=(0, 1))
    good = {i: (a.k_rot[i], a.k_eigenvalues[i]) for i in a.layers}
    _write_zoo(tmp_path / "k.pt", good, "qqt")
    _write_zoo(tmp_path / "v1.pt", {0: good[0]}, "sst")
    with pytest.raises(ValueError, match="different layers"):
        import_rotationzoo(tmp_path / "k.pt", tmp_path / "v1.pt", architecture="llama", n_head=4, n_head_kv=2)
    torch.save({"layers": {0: {"rotation": torch.eye(D)}}}, str(tmp_path / "noeig.pt"))
    with pytest.raises(ValueError, match="eigenvalues"):
        import_rotationzoo(tmp_path / "k.pt", tmp_path / "noeig.pt", architecture="llama", n_head=4, n_head_kv=2)
    torch.save([1, 2], str(tmp_path / "list.pt"))
    with pytest.raises(ValueError, match="not a RotationZoo file"):
        import_rotationzoo(tmp_path / "list.pt", tmp_path / "k.pt", architecture="llama", n_head=4, n_head_kv=2)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable torch file"):
        import_rotationzoo(tmp_path / "junk.pt", tmp_path / "k.pt", architecture="llama", n_head=4, n_head_kv=2)
    bad = {0: (good[0][0] * 3, good[0][1]), 1: good[1]}
    _write_zoo(tmp_path / "bad.pt", bad, "sst")
    with pytest.raises(ValueError, match="not orthogonal"):
        import_rotationzoo(tmp_path / "k.pt", tmp_path / "bad.pt", architecture="llama", n_head=4, n_head_kv=2)
