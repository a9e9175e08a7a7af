"""The CUDA decode attention's plan (ggml-oscar/cuda/attn-plan.h: queries per block, splits of the
cache's and the window's rows, live-chunk lists) is plain C++; tests/c/attn_plan_check.cpp checks
it on the CPU, so a change to the planner is checked in CI, not only on the GPU machine."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_attn_plan(tmp_path):
    exe = tmp_path / "attn_plan_check"
    subprocess.run(["c++", "-O1", "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'ggml-oscar' / 'cuda'}",
                    "-o", str(exe), str(REPO / "tests" / "c" / "attn_plan_check.cpp")], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("plans ok ") and int(r.stdout.split()[2]) > 100_000
