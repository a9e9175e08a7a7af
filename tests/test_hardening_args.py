"""Issue 9: run-time argument errors give a one-line error, a non-zero exit and no crash.

The models are the fuzzer's tiny synthetic llama GGUFs (tests/gguf_fixtures.py: write_tiny_model): they
load in milliseconds, so every refusal below costs a process start, not a model load. A head_dim
of 80 or 96 is made the same way (oscar2 needs a multiple of 64).
"""
from __future__ import annotations

import signal

import pytest

from gguf_fixtures import TinyShape, write_tiny_mla_model, write_tiny_model
from oscar_gguf.runtime import run_tool

OSCAR = ["-ctk", "oscar2", "-ctv", "oscar2"]
CRASH_MARKS = ("GGML_ASSERT", "GGML_ABORT", "Segmentation fault", "Aborted", "core dumped", "terminate called")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("args")
    return {"rot": write_tiny_model(d / "rot.gguf", rotations=True),
            "hd80": write_tiny_model(d / "hd80.gguf", TinyShape(n_embd=160, head_dim=80)),
            "hd96": write_tiny_model(d / "hd96.gguf", TinyShape(n_embd=192, head_dim=96)),
            "mla": write_tiny_mla_model(d / "mla.gguf"),
            "mla_rot": write_tiny_mla_model(d / "mla_rot.gguf", rotations=True)}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("txt") / "t.txt"
    p.write_text("the cat sat on the mat. " * 200)
    return p


def refused(tool: str, args: list, message: str, timeout: float = 120) -> str:
    """Run the tool; it must exit non-zero on its own (no signal), say `message` on one line, and
    show no sign of a crash. Returns the line."""
    r = run_tool(tool, [*map(str, args)], timeout=timeout, check=False)
    log = r.stdout + r.stderr
    assert r.returncode > 0, f"{tool} exited with {r.returncode} " + (
        f"({signal.Signals(-r.returncode).name})" if r.returncode < 0 else "(expected a refusal)")
    assert r.returncode not in (128 + signal.SIGABRT, 128 + signal.SIGSEGV), f"{tool} died: {log[-800:]}"
    assert not any(m in log for m in CRASH_MARKS), log[-1500:]
    lines = [ln for ln in log.splitlines() if message in ln]
    assert lines, f"{tool}: no line says {message!r}:\n{log[-1500:]}"
    return lines[0]


def cli(model, *extra):
    return ["-m", model, "-p", "hi", "-n", "1", "-st", "-t", "1", "-c", "256", *extra]


# ---- oscar2 without flash attention ---------------------------------------------------------------

FA_MSG = "the oscar2 KV cache requires flash attention"


def test_oscar2_without_flash_attention_cli_server_perplexity(models, text_file):
    refused("llama-cli", cli(models["rot"], *OSCAR, "-fa", "off"), FA_MSG)
    refused("llama-server", ["-m", models["rot"], "-t", "1", "-c", "256", "--host", "127.0.0.1", "--port", "0",
                             *OSCAR, "-fa", "off"], FA_MSG)
    refused("llama-perplexity", ["-m", models["rot"], "-t", "1", "-c", "128", "-f", text_file, *OSCAR, "-fa", "off"],
            FA_MSG)


def test_oscar2_without_flash_attention_bench_exits_cleanly(models):
    refused("llama-bench", ["-m", models["rot"], "-t", "1", "-p", "8", "-n", "1", *OSCAR, "-fa", "0"],
            "failed to create context")


def test_bench_says_why_it_refuses(models):
    """llama-bench drops llama.cpp's log unless -v; our patch lets error lines through."""
    refused("llama-bench", ["-m", models["rot"], "-t", "1", "-p", "8", "-n", "1", *OSCAR, "-fa", "0"], FA_MSG)


# ---- unsupported head sizes ---------------------------------------------------------------------

@pytest.mark.parametrize("which,d", [("hd80", 80), ("hd96", 96)])
def test_unsupported_head_dim(models, text_file, which, d):
    msg = f"needs a head size that is a multiple of 64, but layer 0 has {d}"
    refused("llama-cli", cli(models[which], *OSCAR, "-fa", "on"), msg)
    refused("llama-perplexity", ["-m", models[which], "-t", "1", "-c", "128", "-f", text_file, *OSCAR, "-fa", "on"], msg)


def test_unsupported_head_dim_still_runs_with_f16(models):
    """The refusal is about oscar2, not the model: the same GGUF runs with an f16 cache."""
    r = run_tool("llama-cli", cli(models["hd80"], "-fa", "on"), timeout=120, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-1500:]


# ---- MLA (DeepSeek-style latent attention) -----------------------------------------------------

MLA_MSG = "the oscar2 KV cache is not supported for architecture deepseek2"


def test_mla_model_is_refused(models, text_file):
    """An MLA cache holds one latent row per token and no V tensors; oscar2 refuses it by name in
    every tool (before the fix, configuring the cache read the missing V tensor and crashed)."""
    refused("llama-cli", cli(models["mla"], *OSCAR, "-fa", "on"), MLA_MSG)
    refused("llama-cli", cli(models["mla"], "-ctk", "oscar2", "-fa", "on"), MLA_MSG)
    refused("llama-perplexity", ["-m", models["mla"], "-t", "1", "-c", "128", "-f", text_file, *OSCAR, "-fa", "on"],
            MLA_MSG)
    refused("llama-bench", ["-m", models["mla"], "-t", "1", "-p", "8", "-n", "1", *OSCAR, "-fa", "1"], MLA_MSG)


def test_mla_model_with_rotations_is_refused_at_load(models):
    refused("llama-cli", cli(models["mla_rot"], "-fa", "on"),
            "this GGUF carries KV rotations, but architecture deepseek2 builds its attention outside")


def test_mla_model_still_runs_with_f16(models):
    r = run_tool("llama-cli", cli(models["mla"], "-fa", "on"), timeout=120, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-1500:]


@pytest.mark.parametrize("n_layer", [0, 100000])
def test_absurd_layer_count_is_refused_not_aborted(tmp_path, n_layer):
    """block_count 0 or above LLAMA_MAX_LAYERS was an upstream GGML_ASSERT (an abort) in
    llama-model.cpp's load_hparams; the fixes patch makes it a load error with a one-line reason."""
    from oscar_gguf.fuzz.inputs import U32, serialize, tiny_model
    doc = tiny_model()
    doc.set("llama.block_count", U32, n_layer)
    p = tmp_path / f"layers{n_layer}.gguf"
    p.write_bytes(serialize(doc)[0])
    refused("llama-cli", cli(p, "-fa", "on"), "block_count")


# ---- window sizes -------------------------------------------------------------------------------

WINDOW_MSG = "is larger than the context"


def test_window_larger_than_the_context(models):
    line = refused("llama-cli", cli(models["rot"], *OSCAR, "-fa", "on", "--oscar-sink", "200", "--oscar-recent", "200"),
                   WINDOW_MSG)
    assert "sink 200 + recent 200" in line and "256 cells" in line
    refused("llama-server", ["-m", models["rot"], "-t", "1", "-c", "256", "--host", "127.0.0.1", "--port", "0",
                             *OSCAR, "--oscar-sink", "300"], WINDOW_MSG)


@pytest.mark.parametrize("flag,value", [("--oscar-sink", "-1"), ("--oscar-recent", "-256"),
                                        ("--oscar-recent", "99999999999"), ("--oscar-sink", "16777217"),
                                        ("--oscar-sink", "abc"), ("--oscar-recent", "1e3"), ("--oscar-sink", "")])
def test_negative_or_absurd_window_sizes(models, flag, value):
    refused("llama-cli", cli(models["rot"], *OSCAR, "-fa", "on", flag, value),
            f"{flag} must be a token count between 0 and 16777216")


def test_bench_checks_window_sizes_too(models):
    refused("llama-bench", ["-m", models["rot"], "-t", "1", "-p", "8", "-n", "1", *OSCAR, "-fa", "1",
                            "--oscar-sink", "-5"], "--oscar-sink must be a token count")


# ---- rotation, clip and window-type values ---------------------------------------------------------

@pytest.mark.parametrize("flag,value,msg", [
    ("--oscar-rot", "foo", "--oscar-rot must be gguf, hadamard or none"),
    ("--oscar-rot", "", "--oscar-rot must be gguf, hadamard or none"),
    ("--oscar-clip-k", "0", "--oscar-clip-k must be a clip ratio in (0, 1]"),
    ("--oscar-clip-k", "1.5", "--oscar-clip-k must be a clip ratio in (0, 1]"),
    ("--oscar-clip-v", "nan", "--oscar-clip-v must be a clip ratio in (0, 1]"),
    ("--oscar-clip-v", "-0.5", "--oscar-clip-v must be a clip ratio in (0, 1]"),
    ("--oscar-clip-k", "inf", "--oscar-clip-k must be a clip ratio in (0, 1]"),
    ("--oscar-window-type", "q4_0", "--oscar-window-type must be f16 or bf16"),
])
def test_bad_rotation_clip_and_window_type_values(models, flag, value, msg):
    refused("llama-cli", cli(models["rot"], *OSCAR, "-fa", "on", flag, value), msg)


def test_bad_values_in_bench_and_server(models):
    refused("llama-bench", ["-m", models["rot"], "-t", "1", "-p", "8", "-n", "1", *OSCAR, "-fa", "1",
                            "--oscar-rot", "bad"], "--oscar-rot must be gguf, hadamard or none")
    refused("llama-server", ["-m", models["rot"], "-t", "1", "-c", "256", "--host", "127.0.0.1", "--port", "0",
                             *OSCAR, "--oscar-clip-k", "2"], "--oscar-clip-k must be a clip ratio in (0, 1]")


def test_strict_refuses_a_gguf_without_rotations(tmp_path):
    plain = write_tiny_model(tmp_path / "plain.gguf")
    refused("llama-cli", cli(plain, *OSCAR, "-fa", "on", "--oscar-strict"), "--oscar-strict")
