"""Issue 5: rotations inside the GGUF (oscar-convert, loading, applying them in llama.cpp).

Comparisons read the attention output of layer 0 through the eval callback: its inputs are the
same in every run, so it shows the rotation wiring free of the noise that the Q4_1 model's 8-bit
activation quantization adds in later layers (a 1e-7 difference there can flip a rounding and
grow to ~1 logit by layer 30, which would hide a real bug behind a loose tolerance).
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gguf_fixtures import PROMPT, rotations_for, with_rotations
from oscar_gguf.convert import convert, inspect_report
from oscar_gguf.format.gguf_read import GGUFError as ConvertError
from oscar_gguf.format.gguf_read import read_model_info
from oscar_gguf.format.gguf_write import copy_with_additions as write_gguf
from oscar_gguf.format.rotations import Rotations
from oscar_gguf.format.rotations import random_rotation as random_orthogonal
from oscar_gguf.llama_context import Context, LlamaError, Model
from oscar_gguf.runtime import run_tool

ATTN0 = "kqv_out-0"             # attention output of layer 0, in the cache's basis
ATTN0_UNROT = "kqv_out_unrot-0"  # the same after the V rotation is undone


# The wiring tests below rotate f16/f32 caches, where a rotation changes nothing but can be
# checked exactly; by default only quantized caches are rotated (test_float_cache_skips_rotations).
ROT_FLOAT = dict(oscar_rot_float=True)


@pytest.fixture(scope="module")
def models(bundled_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("rot")
    return {"plain": bundled_model,
            "identity": with_rotations(bundled_model, d / "identity.gguf", "identity"),
            "random": with_rotations(bundled_model, d / "random.gguf", "random")}


@pytest.fixture(scope="module")
def tokens(bundled_model):
    with Model(bundled_model) as m:
        return m.tokenize(PROMPT * 2)


def attn0(path, tokens, name, **kw):
    kw = {**ROT_FLOAT, **kw}
    with Model(path) as m, Context(m, n_ctx=256, capture=[name], **kw) as c:
        c.decode(tokens)
        return c.captured[name][-1]


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---- invariance -------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_identity_rotation_changes_nothing(models, tokens, kv):
    a = attn0(models["plain"], tokens, ATTN0, type_k=kv, type_v=kv)
    b = attn0(models["identity"], tokens, ATTN0_UNROT, type_k=kv, type_v=kv)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_random_orthogonal_rotation_is_invariant(models, tokens, kv):
    """Q and K turn by the same R_k, V by R_v and the output back by R_v^T: the attention output
    equals the plain model's up to the f16 rounding of flash attention (measured 3.1e-4)."""
    plain = attn0(models["plain"], tokens, ATTN0, type_k=kv, type_v=kv)
    back = attn0(models["random"], tokens, ATTN0_UNROT, type_k=kv, type_v=kv)
    still_rotated = attn0(models["random"], tokens, ATTN0, type_k=kv, type_v=kv)
    assert rel(back, plain) < 2e-3
    assert rel(still_rotated, plain) > 0.3, "the rotation must really be applied"


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_float_cache_skips_rotations(models, tokens, kv):
    """By default a float cache is not rotated (it would only cost time): the rotated model's
    layer-0 attention is bit-identical to the plain model's, with no un-rotation node."""
    plain = attn0(models["plain"], tokens, ATTN0, type_k=kv, type_v=kv, oscar_rot_float=False)
    rotated = attn0(models["random"], tokens, ATTN0, type_k=kv, type_v=kv, oscar_rot_float=False)
    assert np.array_equal(plain, rotated)
    with Model(models["random"]) as m, Context(m, n_ctx=256, capture=[ATTN0_UNROT], type_k=kv, type_v=kv) as c:
        c.decode(tokens)
        assert not c.captured.get(ATTN0_UNROT)


def test_rotated_model_generates_like_the_plain_one(models, tokens):
    with Model(models["plain"]) as m, Context(m, n_ctx=256, **ROT_FLOAT) as c:
        a = c.greedy(tokens[:20], 12)
    with Model(models["random"]) as m, Context(m, n_ctx=256, **ROT_FLOAT) as c:
        b = c.greedy(tokens[:20], 12)
    assert sum(x == y for x, y in zip(a, b)) >= 10


# ---- context shift: un-rotate with R^T, RoPE, re-rotate with R ---------------------------------

@pytest.mark.parametrize("which", ["plain", "random"])
def test_k_shift_with_a_non_symmetric_rotation(models, tokens, which):
    """A cache shifted by +17 positions must attend like one built at the shifted positions."""
    name = ATTN0 if which == "plain" else ATTN0_UNROT
    kw = dict(type_k="f32", type_v="f32", n_ctx=256, **ROT_FLOAT)
    with Model(models[which]) as m:
        with Context(m, capture=[name], **kw) as c:
            c.decode(tokens[:60])
            c.seq_add(0, 0, -1, 17)
            c.decode(tokens[60:61], 77)
            shifted = c.captured[name][-1]
        with Context(m, capture=[name], **kw) as c:
            c.decode(tokens[:60], 17)
            c.decode(tokens[60:61], 77)
            fresh = c.captured[name][-1]
        with Context(m, capture=[name], **kw) as c:
            c.decode(tokens[:60], 0)
            c.decode(tokens[60:61], 60)
            unshifted = c.captured[name][-1]
    # measured: shifted vs fresh 6.5e-6 (random R), 5.3e-5 (plain); positions alone move it 3e-4..7e-4
    assert rel(shifted, fresh) < rel(unshifted, fresh) / 5


def test_generation_past_the_context_with_oscar2_and_rotations(models, n_threads):
    """llama-cli with a 128-token context and context shift generates 300 tokens without trouble."""
    r = run_tool("llama-cli", ["-m", models["random"], "-p", "Tell me a long story about a dragon.",
                               "-n", "300", "-c", "128", "--context-shift", "-ctk", "oscar2", "-ctv", "oscar2",
                               "-fa", "on", "--oscar-sink", "8", "--oscar-recent", "32", "--temp", "0",
                               "-st", "-t", str(n_threads)], timeout=600, check=False)
    out = r.stdout
    assert r.returncode == 0, r.stderr[-2000:]
    words = out.split()
    assert len(words) > 100, out[-500:]
    assert len(set(words)) > 20, "degenerate output"


# ---- clip ratios and the no-rotation fallback ------------------------------------------------

def test_oscar2_without_rotations_warns_and_strict_refuses(bundled_model, n_threads):
    args = ["-m", bundled_model, "-p", "Hello", "-n", "2", "-c", "512", "-ctk", "oscar2", "-ctv", "oscar2",
            "-fa", "on", "-st", "-lv", "3", "-t", str(n_threads)]
    ok = run_tool("llama-cli", args, timeout=300, check=False)
    assert ok.returncode == 0
    assert "carries no OSCAR rotations" in ok.stdout + ok.stderr
    strict = run_tool("llama-cli", args + ["--oscar-strict"], timeout=300, check=False)
    assert strict.returncode != 0
    assert "--oscar-strict" in strict.stdout + strict.stderr


def test_oscar2_needs_flash_attention(bundled_model):
    r = run_tool("llama-cli", ["-m", bundled_model, "-p", "Hello", "-n", "2", "-ctk", "oscar2", "-ctv", "oscar2",
                               "-fa", "off", "-st"], timeout=300, check=False)
    assert r.returncode != 0
    assert "requires flash attention" in r.stdout + r.stderr


# ---- oscar-convert and oscar inspect ----------------------------------------------------------

def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_convert_copies_everything_byte_for_byte(models):
    from gguf import GGUFReader
    src, dst = GGUFReader(str(models["plain"])), GGUFReader(str(models["random"]))
    for t in src.tensors:
        u = dst.get_tensor([x.name for x in dst.tensors].index(t.name))
        assert u.tensor_type == t.tensor_type and list(u.shape) == list(t.shape)
        assert np.array_equal(np.asarray(u.data).view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
    for k, f in src.fields.items():
        if k.startswith("GGUF."):
            continue
        g = dst.get_field(k)
        assert g is not None and b"".join(p.tobytes() for p in g.parts) == b"".join(p.tobytes() for p in f.parts), k
    info = read_model_info(models["random"])
    assert sorted(info.k_rot) == list(range(info.n_layer)) and sorted(info.v_rot) == list(range(info.n_layer))
    assert info.oscar["oscar.format_version"] == 1
    report = inspect_report(models["random"])
    assert "worst |R^T R - I|" in report and "(ok)" in report


@pytest.fixture()
def src_copy(bundled_model, tmp_path):
    p = tmp_path / "model.gguf"
    shutil.copy(bundled_model, p)
    return p


def refused(src, dst, rot, match, **kw):
    before = sha(src)
    with pytest.raises(ConvertError, match=match):
        convert(src, dst, rot, **kw)
    assert sha(src) == before, "the input must never change"


def test_convert_refusals(src_copy, tmp_path):
    out = tmp_path / "out.gguf"
    good = rotations_for(src_copy, "random")
    d = good.head_dim

    bad = rotations_for(src_copy, "random"); bad.arch = "qwen3"
    refused(src_copy, out, bad, "architecture")
    bad = rotations_for(src_copy, "random"); bad.n_layers = 12
    refused(src_copy, out, bad, "layers")
    bad = rotations_for(src_copy, "random"); bad.head_dim = 128
    refused(src_copy, out, bad, "head_dim")
    bad = rotations_for(src_copy, "random"); bad.k_rot[3] = bad.k_rot[3].copy(); bad.k_rot[3][1, 2] = np.nan
    refused(src_copy, out, bad, "non-finite")
    bad = rotations_for(src_copy, "random"); bad.v_rot[5] = bad.v_rot[5] * 1.001
    refused(src_copy, out, bad, "not orthogonal")
    bad = rotations_for(src_copy, "random"); bad.k_rot[0] = np.eye(d + 64, dtype=np.float32)
    refused(src_copy, out, bad, "shape")
    bad = rotations_for(src_copy, "random"); bad.clip_k[2] = 1.5
    refused(src_copy, out, bad, "clip ratio")
    assert not out.exists()

    refused(src_copy, src_copy, good, "overwrite the input", force=True)
    convert(src_copy, out, good)
    refused(src_copy, out, good, "exists")
    convert(src_copy, out, good, force=True)
    refused(out, tmp_path / "again.gguf", good, "already carries")
    convert(out, tmp_path / "again.gguf", rotations_for(src_copy, "identity"), replace=True)
    assert read_model_info(tmp_path / "again.gguf").oscar["oscar.calibration.method"] == "test-identity"


def test_convert_refuses_an_mla_model(tmp_path):
    """DeepSeek-style latent attention: llama.cpp would refuse the rotations at load, so
    oscar-convert refuses first, even with orthogonal rotations of the cache's row sizes."""
    from gguf_fixtures import write_tiny_mla_model
    src = write_tiny_mla_model(tmp_path / "mla.gguf")
    info = read_model_info(src)
    assert info.latent_attention and info.arch == "deepseek2"
    rng = np.random.default_rng(0)
    rot = Rotations(k_rot={0: random_orthogonal(info.head_dim_k, rng)}, v_rot={0: random_orthogonal(info.head_dim_v, rng)},
                    clip_k=[0.96], clip_v=[0.92], arch="deepseek2", n_layers=1, head_dim=info.head_dim_k,
                    group_size=64, provenance={})
    refused(src, tmp_path / "o.gguf", rot, "latent \\(MLA\\)")
    assert not (tmp_path / "o.gguf").exists()


def test_convert_refuses_a_truncated_file(src_copy, tmp_path):
    data = src_copy.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 3])
    refused(cut, tmp_path / "o.gguf", rotations_for(src_copy, "random"), "GGUF")


def test_oscar_convert_cli_one_line_errors(src_copy, tmp_path):
    exe = Path(sys.executable).parent / "oscar-convert"
    r = subprocess.run([str(exe), str(src_copy), "--rotations", str(tmp_path / "missing.safetensors"),
                        "-o", str(tmp_path / "o.gguf")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("oscar-convert: error:") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr


# ---- what the loader refuses ---------------------------------------------------------------

def _raw_gguf(src, dst, k_rot_0):
    """A GGUF that carries one given blk.0.attn_k_rot (bypassing oscar-convert's checks)."""
    write_gguf(src, dst, [("oscar.format_version", 4, 1)], [("blk.0.attn_k_rot", k_rot_0)])


def test_loader_refuses_a_wrong_shape(bundled_model, tmp_path):
    p = tmp_path / "shape.gguf"
    _raw_gguf(bundled_model, p, np.eye(96, dtype=np.float32))
    with pytest.raises(LlamaError):
        Model(p)
    r = run_tool("llama-cli", ["-m", p, "-p", "x", "-n", "1", "-st"], timeout=120, check=False)
    assert r.returncode != 0 and "attn_k_rot" in r.stdout + r.stderr and "shape" in r.stdout + r.stderr


def test_loader_refuses_a_non_orthogonal_rotation(bundled_model, tmp_path):
    p = tmp_path / "ortho.gguf"
    r0 = random_orthogonal(64, np.random.default_rng(0)) * 1.5
    _raw_gguf(bundled_model, p, r0)
    r = run_tool("llama-cli", ["-m", p, "-p", "x", "-n", "1", "-st"], timeout=120, check=False)
    assert r.returncode != 0 and "not orthogonal" in r.stdout + r.stderr


def test_loader_refuses_malformed_clip_metadata(bundled_model, tmp_path):
    p = tmp_path / "clip.gguf"
    write_gguf(bundled_model, p, [("oscar.format_version", 4, 1), ("oscar.clip_k", 9, [0.9] * 7)], [])
    r = run_tool("llama-cli", ["-m", p, "-p", "x", "-n", "1", "-st"], timeout=120, check=False)
    assert r.returncode != 0 and "oscar.clip_k" in r.stdout + r.stderr
