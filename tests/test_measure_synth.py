"""Issue 8: `oscar synth` writes random-weight GGUFs with real shapes that llama.cpp loads."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from oscar_gguf.format import gguf_keys as K
from oscar_gguf.measure.cli import main as cli
from oscar_gguf.runtime import run_tool
from oscar_gguf.format.gguf_read import model_info, read_gguf_metadata
from oscar_gguf.measure.synth import SHAPES, SynthError, write_synthetic


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    t0 = time.monotonic()
    plain = write_synthetic("tiny-llama", "q4_0", d / "tiny-llama-q4_0.gguf")
    rotated = write_synthetic("tiny-qwen3", "q4_k", d / "tiny-qwen3-q4_k-rot.gguf", rotations=True)
    return {"plain": plain, "rotated": rotated, "seconds": time.monotonic() - t0}


def test_writes_fast(tiny_models):
    assert tiny_models["seconds"] < 10


@pytest.mark.parametrize("which,shape_name,ggml_type", [("plain", "tiny-llama", "Q4_0"),
                                                         ("rotated", "tiny-qwen3", "Q4_K")])
def test_shapes_read_back_with_gguf_py(tiny_models, which, shape_name, ggml_type):
    import gguf
    s = SHAPES[shape_name]
    r = gguf.GGUFReader(tiny_models[which])
    t = {x.name: x for x in r.tensors}
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    # gguf-py lists shapes in ggml order: ne[0] (the input dimension of a matmul) first
    assert t["token_embd.weight"].shape.tolist() == [s.n_embd, n_vocab]
    assert t["blk.0.attn_q.weight"].shape.tolist() == [s.n_embd, s.n_head * s.head_dim]
    assert t["blk.0.attn_k.weight"].shape.tolist() == [s.n_embd, s.n_head_kv * s.head_dim]
    assert t["blk.1.ffn_down.weight"].shape.tolist() == [s.n_ff, s.n_embd]
    assert t["blk.1.attn_norm.weight"].tensor_type.name == "F32"
    assert t["blk.1.ffn_up.weight"].tensor_type.name == ggml_type
    assert r.fields[f"{s.arch}.block_count"].contents() == s.n_layer
    assert r.fields[f"{s.arch}.attention.head_count_kv"].contents() == s.n_head_kv
    assert r.fields["general.architecture"].contents() == s.arch
    # no tensor beyond the model's, plus the rotations when asked for
    n_rot = 2 * s.n_layer if which == "rotated" else 0
    per_layer = 11 if s.arch == "qwen3" else 9
    assert len(t) == 2 + per_layer * s.n_layer + n_rot + (0 if s.tied_embeddings else 1)


def test_rotations_and_oscar_metadata(tiny_models):
    import gguf
    s = SHAPES["tiny-qwen3"]
    r = gguf.GGUFReader(tiny_models["rotated"])
    t = {x.name: x for x in r.tensors}
    for i in range(s.n_layer):
        for name in (K.K_ROT.format(i), K.V_ROT.format(i)):
            R = np.asarray(t[name].data, dtype=np.float64)
            assert R.shape == (s.head_dim, s.head_dim) and t[name].tensor_type.name == "F32"
            assert np.abs(R.T @ R - np.eye(s.head_dim)).max() < 1e-5
    assert not np.allclose(np.asarray(t[K.K_ROT.format(0)].data), np.asarray(t[K.V_ROT.format(0)].data))
    assert r.fields[K.KEY_FORMAT_VERSION].contents() == K.FORMAT_VERSION
    assert r.fields[K.KEY_GROUP_SIZE].contents() == 128
    assert r.fields[K.KEY_CLIP_K].contents() == pytest.approx([K.DEFAULT_CLIP_K] * s.n_layer)
    assert r.fields[K.KEY_CLIP_V].contents() == pytest.approx([K.DEFAULT_CLIP_V] * s.n_layer)
    assert r.fields[K.KEY_SINK].contents() == K.DEFAULT_SINK
    assert r.fields[K.KEY_RECENT].contents() == K.DEFAULT_RECENT
    info = model_info(tiny_models["rotated"])
    assert info.has_rotations and info.head_dim_k == 128 and info.n_layer == s.n_layer
    assert not model_info(tiny_models["plain"]).has_rotations


def test_fast_reader_agrees_with_gguf_py(tiny_models):
    import gguf
    for p in (tiny_models["plain"], tiny_models["rotated"]):
        mine = read_gguf_metadata(p)
        r = gguf.GGUFReader(p)
        assert {x.name: (tuple(int(v) for v in x.shape), int(x.tensor_type)) for x in r.tensors} == \
               {n: (ti.ne, ti.ggml_type) for n, ti in mine.tensors.items()}
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                                 "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
                continue
            want = f.contents()
            got = mine.kv[key]
            assert got == pytest.approx(want) if isinstance(want, (float, list)) else got == want, key


def _load_and_eval_one_token(path):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=8, n_threads=2, verbose=False)
    try:
        llm.eval([1])
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()
        return llm.n_vocab(), logits
    finally:
        llm.close()


def test_plain_synth_model_runs_in_llama_cpp(tiny_models):
    n_vocab, logits = _load_and_eval_one_token(tiny_models["plain"])
    assert n_vocab == model_info(tiny_models["plain"]).n_vocab
    assert np.isfinite(logits).all() and logits.std() > 0


def test_rotated_synth_model_runs_in_llama_cpp(tiny_models):
    # needs the patched loader to claim blk.*.attn_k_rot / attn_v_rot (issue 5)
    n_vocab, logits = _load_and_eval_one_token(tiny_models["rotated"])
    assert np.isfinite(logits).all()


def test_synth_model_runs_in_the_tools(tiny_models):
    r = run_tool("llama-bench", ["-m", tiny_models["plain"], "-p", "8", "-n", "1", "-r", "1", "-t", "2",
                                 "-o", "json"], timeout=120)
    rec = json.loads(r.stdout)
    assert rec and all(x["avg_ts"] > 0 for x in rec)


def test_cli_refuses_bad_input_without_touching_files(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"user data")
    assert cli(["synth", "--shape", "tiny-llama", "-o", str(out), "--no-progress"]) == 2
    assert out.read_bytes() == b"user data"
    err = capsys.readouterr().err.strip()
    assert err.startswith("oscar synth: error:") and "--force" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        cli(["synth", "--shape", "no-such-model", "-o", str(tmp_path / "x.gguf")])
    assert e.value.code == 2
    assert cli(["synth", "--shape", "tiny-llama", "-o", str(tmp_path / "missing" / "x.gguf")]) == 2
    assert cli(["synth", "--shape", "tiny-llama", "--vocab", str(out), "-o", str(tmp_path / "y.gguf")]) == 2
    assert not (tmp_path / "y.gguf").exists()
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file may be left behind"
    assert cli(["synth", "--shape", "tiny-llama", "--weights", "f16", "-o", str(out), "--force",
                "--no-progress"]) == 0
    assert model_info(out).n_layer == SHAPES["tiny-llama"].n_layer


def test_weight_types_and_real_shapes_fit():
    from oscar_gguf.measure.synth import check_shape_fits
    for name in SHAPES:
        for w in ("f16", "q8_0", "q4_0", "q4_k"):
            check_shape_fits(SHAPES[name], w, 128256)
    with pytest.raises(SynthError):
        write_synthetic("tiny-llama", "q3_k", "/tmp/never-written.gguf")
