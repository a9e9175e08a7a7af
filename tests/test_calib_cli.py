"""`oscar calibrate` / `oscar simulate`: bad input stops with one line and exit code 2;
a small real calibration of the bundled model through the llama.cpp backend."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from oscar_gguf.calibrate.cli import main


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(argv, capsys):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(err: str) -> bool:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    return len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err


def test_missing_model(tmp_path, capsys):
    rc, _, err = run(["calibrate", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "r.safetensors")], capsys)
    assert rc == 2 and one_line_error(err) and "not found" in err


def test_not_a_model(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    rc, _, err = run(["calibrate", str(f), "--out", str(tmp_path / "r.safetensors")], capsys)
    assert rc == 2 and one_line_error(err) and "not a GGUF" in err
    d = tmp_path / "folder"
    d.mkdir()
    rc, _, err = run(["calibrate", str(d), "--out", str(tmp_path / "r.safetensors")], capsys)
    assert rc == 2 and one_line_error(err) and "config.json" in err


def test_unsupported_architecture(tmp_path, capsys):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    rc, _, err = run(["calibrate", str(d), "--out", str(tmp_path / "r.safetensors"), "--device", "cpu"], capsys)
    assert rc == 2 and one_line_error(err) and "not supported" in err
    rc, _, err = run(["calibrate", str(d), "--out", str(tmp_path / "r.safetensors"), "--backend", "llama"], capsys)
    assert rc == 2 and one_line_error(err) and "--backend hf" in err


def test_mla_gguf_is_refused(tmp_path, capsys):
    from gguf_fixtures import write_tiny_mla_model
    model = write_tiny_mla_model(tmp_path / "mla.gguf")
    rc, _, err = run(["calibrate", str(model), "--out", str(tmp_path / "r.safetensors"), "--backend", "llama",
                      "--tokens", "256", "--seq-len", "128", "--quiet"], capsys)
    assert rc == 2 and one_line_error(err) and "latent (MLA)" in err
    assert not (tmp_path / "r.safetensors").exists()


def test_never_overwrites_inputs(tmp_path, capsys, bundled_model):
    before = bundled_model.stat().st_mtime_ns
    rc, _, err = run(["calibrate", str(bundled_model), "--out", str(bundled_model)], capsys)
    assert rc == 2 and one_line_error(err) and "inputs" in err
    fake = tmp_path / "other.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 28)
    rc, _, err = run(["calibrate", str(bundled_model), "--out", str(fake)], capsys)
    assert rc == 2 and "refusing to overwrite" in err
    assert bundled_model.stat().st_mtime_ns == before and fake.read_bytes()[:4] == b"GGUF"


def test_hub_id_offline_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "oscar_gguf.calibrate.cli", "calibrate", "no-such-org/no-such-model",
                        "--out", str(tmp_path / "r.safetensors")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and one_line_error(r.stderr) and "Hub" in r.stderr


def test_simulate_bad_rotations(tmp_path, capsys, bundled_model):
    text = tmp_path / "held.txt"
    text.write_text("x")
    rc, _, err = run(["simulate", str(bundled_model), str(tmp_path / "missing.safetensors"), "--text", str(text)],
                     capsys)
    assert rc == 2 and one_line_error(err) and "does not exist" in err


llama_cpp = pytest.importorskip("llama_cpp", exc_type=ImportError)


def test_too_little_text(tmp_path, capsys, bundled_model):
    text = tmp_path / "tiny.txt"
    text.write_text("Only a few words here.")
    rc, _, err = run(["calibrate", str(bundled_model), "--out", str(tmp_path / "r.safetensors"), "--text", str(text),
                      "--backend", "llama", "--quiet"], capsys)
    assert rc == 2 and one_line_error(err) and "--text" in err
    assert not (tmp_path / "r.safetensors").exists()


def test_small_calibration_with_llama_backend(tmp_path, capsys, bundled_model):
    from oscar_gguf.calibrate.artifact import load_artifact

    out = tmp_path / "rot.safetensors"
    rc, stdout, err = run(["calibrate", str(bundled_model), "--out", str(out), "--backend", "llama", "--tokens", "256",
                           "--seq-len", "128", "--window", "8,16", "--threads", "1", "--quiet"], capsys)
    assert rc == 0, err
    assert "wrote" in stdout and "peak RSS" in stdout
    art = load_artifact(out)
    assert art.architecture == "llama" and art.rope_layout == "llama.cpp"
    assert (art.n_layers, art.head_dim, art.n_head, art.n_head_kv) == (30, 64, 9, 3)
    assert art.layers == list(range(30)) and art.tokens == 256
    # the default recipe (calibrator.DEFAULT_RECIPE) names itself in the artifact
    from oscar_gguf.calibrate.calibrator import DEFAULT_RECIPE, METHODS
    assert art.method == f"{METHODS[DEFAULT_RECIPE]}/clip-search" and len(art.model_sha256) == 64
    assert art.extra["backend"] == "llama" and art.extra["group_size"] == "64"
    assert "default corpus" in art.corpus
