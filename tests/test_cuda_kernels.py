"""The CUDA kernels that the plain ops of test_oscar2_ops.py do not isolate: the fused
rotate-store, the INT2 decode attention on tensor cores (k_fa_int2_mma) and the programmatic
dependent launches (PDL) between our kernels.

Upstream's test-backend-ops runs the oscar cases (ggml-oscar/tests/oscar2-backend-ops.inc) on
CUDA0 against the CPU backend, the set that `gpu/run.sh test` runs; every case must pass, and
each group must have cases that ran. The attention and rotate-store cases run again for PDL,
whose mistakes show in some runs only.

Skipped without a CUDA build and a GPU (conftest), and without test-backend-ops: `gpu/run.sh
build` makes it next to the libraries, a pip build with -DOSCAR_BUILD_TESTS=ON installs it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from oscar_gguf.paths import MissingComponentError, library_dir, tool_path

pytestmark = pytest.mark.gpu

OPS = "SET_ROWS,GET_ROWS,CPY,FLASH_ATTN_EXT,MUL_MAT,OSCAR_ROTATE_STORE"
INT2_TYPES = ("oscar2", "oscar2_64")
# "  OP(params): status"; a failed case's line starts with the failed check's message instead
# ("[OP] ERR = 0.9 > 0.0005   OP(params): FAIL")
CASE_LINE = re.compile(r"(?:^|\s)([A-Z][A-Z0-9_]*)\(([^()]*)\): (\S.*)$")


def backend_ops_tool() -> Path:
    """test-backend-ops of the patched build: next to the libraries in gpu/run.sh's build
    folder (LLAMA_CPP_LIB_PATH), or installed with the tools."""
    beside = library_dir() / "test-backend-ops"
    if beside.is_file():
        return beside
    try:
        return tool_path("test-backend-ops")
    except MissingComponentError:
        pytest.skip("no test-backend-ops in this build (gpu/run.sh build, or CMAKE_ARGS=-DOSCAR_BUILD_TESTS=ON)")


def compute_capability() -> float:
    """CUDA0's compute capability, e.g. 9.0 for an H100."""
    r = subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=60)
    try:
        return float(r.stdout.split()[0])
    except (IndexError, ValueError):
        pytest.skip(f"nvidia-smi gives no compute capability: {r.stdout.strip()} {r.stderr.strip()}")


def parse_cases(log: str) -> list[tuple[str, dict[str, str], str]]:
    """(op, parameters, status) of every case line; status is OK, FAIL or not supported."""
    cases = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        m = CASE_LINE.search(line)
        if not m:
            continue
        op, params, result = m.groups()
        status = "not supported" if result.startswith("not supported") else result.split()[-1] if result.split() else ""
        cases.append((op, dict(re.findall(r"(\w+)=(\[[^\]]*\]|[^,]*)", params)), status))
    return cases


def run_backend_ops(ops: str) -> tuple[int, list, str]:
    """The oscar cases of ops on CUDA0 against the CPU, with PDL on (upstream's switch; on by
    default): exit code, parsed cases, output."""
    r = subprocess.run([str(backend_ops_tool()), "test", "-b", "CUDA0", "-o", ops, "-p", "oscar"], capture_output=True,
                       text=True, env=dict(os.environ, GGML_CUDA_PDL="1"), timeout=900)
    return r.returncode, parse_cases(r.stdout), r.stdout + r.stderr


@pytest.fixture(scope="module")
def backend_ops():
    return run_backend_ops(OPS)


def _counts(cases) -> dict[str, int]:
    out = {"OK": 0, "FAIL": 0, "not supported": 0}
    for *_, status in cases:
        out[status] = out.get(status, 0) + 1
    return out


def _failed(cases) -> list[str]:
    return [f"{op}({','.join(f'{k}={v}' for k, v in p.items())})" for op, p, s in cases if s != "OK" and
            s != "not supported"]


def test_every_oscar_case_passes(backend_ops):
    rc, cases, log = backend_ops
    # every case that ran was read: the tool's own count agrees
    passed, ran = map(int, re.search(r"(\d+)/(\d+) tests passed", log).groups())
    counts = _counts(cases)
    assert (counts["OK"], counts["OK"] + len(_failed(cases))) == (passed, ran), (counts, passed, ran)
    assert not _failed(cases) and rc == 0, (_failed(cases), log[-3000:])
    ops = {op for op, _, s in cases if s == "OK"}
    assert ops == set(OPS.split(",")), f"ops with no passing case: {set(OPS.split(',')) - ops}"


def test_fused_rotate_store(backend_ops):
    """A layer's rotations with their cache and window writes in one launch (decode, up to
    OSCAR_ROT_MAX_COLS vectors), and too wide to fuse (40 tokens), in every node order."""
    cases = [c for c in backend_ops[1] if c[0] == "OSCAR_ROTATE_STORE"]
    counts = _counts(cases)
    assert counts["OK"] > 0 and not _failed(cases), (counts, _failed(cases))
    fused = {(p["hs"], p["order"]) for _, p, s in cases if s == "OK" and p["nt"] == "1"}
    assert {hs for hs, _ in fused} == {"64", "128", "256"} and len({o for _, o in fused}) == 3, sorted(fused)


def _takes_int2_mma(p: dict[str, str]) -> bool:
    # one query token with INT2 K and V at head size 64 or 128, no window or an f16 one: the
    # cases that uses_int2_mma (ggml-oscar/cuda) sends to k_fa_int2_mma on sm_80 and later
    d = p.get("hsk", p.get("hs"))
    return p.get("type_K") in INT2_TYPES and p.get("type_K") == p.get("type_V") and d in ("64", "128") and \
        p.get("nb") == "1" and p.get("type_W", "f16") == "f16"


def test_int2_tensor_core_decode(backend_ops):
    """k_fa_int2_mma's cases (head sizes 64 and 128, both INT2 types, with and without the
    window) all run and pass, and so does decode of 2 to 16 query tokens (several sequences),
    which the split-KV kernels take."""
    if compute_capability() < 8.0:
        pytest.skip("k_fa_int2_mma needs sm_80 or later")
    cases = [c for c in backend_ops[1] if c[0] == "FLASH_ATTN_EXT" and _takes_int2_mma(c[1])]
    counts = _counts(cases)
    assert not _failed(cases) and counts["not supported"] == 0, (counts, _failed(cases))
    heads = {(c[1].get("hsk", c[1].get("hs")), c[1]["type_K"]) for c in cases if c[2] == "OK"}
    assert heads == {("64", "oscar2_64"), ("128", "oscar2"), ("128", "oscar2_64")}, heads
    assert any("type_W" in p for _, p, _ in cases) and any("type_W" not in p for _, p, _ in cases)
    many = [c for c in backend_ops[1] if c[0] == "FLASH_ATTN_EXT" and c[1].get("type_K") in INT2_TYPES and
            1 < int(c[1]["nb"]) <= 16]
    assert _counts(many)["OK"] > 0 and not _failed(many), _failed(many)


PDL_RUNS = 2  # beyond the module's run: a read before the wait shows in some runs only


def test_programmatic_dependent_launches():
    """With PDL a kernel of ours starts while the one before it runs and waits for it in place
    (ggml_cuda_pdl_sync): the attention after the rotate-store, the combine while the attention's
    last blocks run. An input read before that wait sees it unfinished in some runs, so the
    attention and rotate-store cases run again, with PDL on, and must pass every time."""
    if compute_capability() < 9.0:
        pytest.skip("programmatic dependent launches need sm_90 or later")
    for i in range(PDL_RUNS):
        rc, cases, log = run_backend_ops("FLASH_ATTN_EXT,OSCAR_ROTATE_STORE")
        assert _counts(cases)["OK"] > 0 and not _failed(cases) and rc == 0, (i, _failed(cases), log[-2000:])
