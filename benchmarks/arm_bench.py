#!/usr/bin/env python3
"""llama-bench on Arm under an emulator: f16, q8_0, q4_0 and oscar2 side by side, ratios to f16.

    .venv/bin/python benchmarks/arm_bench.py [-d 0,1024] [-p 128] [-n 16] [-t 2] [-o DIR] [MODEL]

A benchmark, not a test: it prints tokens/s and ratios, it asserts nothing. The patched
llama.cpp (the tree llama.cpp/fetch.py prepares, ggml-oscar included) is cross-compiled once
for aarch64-linux-musl with zig, CPU backend only, static, for a Cortex-A76 (armv8.2-a with
dotprod and fp16, as a Neoverse N1 or newer: Raspberry Pi 5, Graviton 2), into
<cache>/build/aarch64-bench; its llama-bench then runs under qemu-aarch64-static with
`oscar bench --cpu`'s flags and tables (the bundled model by default). zig comes from PyPI and
qemu from Debian's archive, as for tests/test_oscar2_rows.py (llama.cpp/arm_tools.py).

Emulated timing is indicative only: qemu translates every Arm instruction, NEON included, into
host code, so the ratios say which KV type does more work per token on an Arm core, not how
fast a real one runs. Why the ratios still mean something: every type runs the same translated
ggml, and the cache's share of the work is what they compare.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "llama.cpp"))

import arm_tools  # noqa: E402
import fetch  # noqa: E402
from oscar_gguf import bundled_model_path  # noqa: E402
from oscar_gguf.measure.bench import run_bench  # noqa: E402

TARGET = "aarch64-linux-musl"
# zig names CPUs its own way (-mcpu, not -march): a Cortex-A76 is armv8.2-a with dotprod and fp16
ZIG_CPU = "cortex_a76"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
    "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_EXE_LINKER_FLAGS=-static",
    "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", "-DGGML_RPC=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]


def compiler_wrappers(bdir: Path) -> tuple[Path, Path]:
    """Two scripts that run zig's C and C++ compilers for the target (CMake wants one path each)."""
    cache = arm_tools.tools_dir() / "zig-cache"
    out = []
    for name, mode in (("zig-cc", "cc"), ("zig-c++", "c++")):
        p = bdir / name
        p.write_text("#!/bin/sh\n"
                     f"PYTHONPATH='{arm_tools.ziglang_home()}' ZIG_GLOBAL_CACHE_DIR='{cache}' ZIG_LOCAL_CACHE_DIR='{cache}' "
                     f"exec '{sys.executable}' -m ziglang {mode} -target {TARGET} -mcpu={ZIG_CPU} \"$@\"\n")
        p.chmod(0o755)
        out.append(p)
    return out[0], out[1]


def build_llama_bench() -> Path:
    """llama-bench for aarch64 from the patched tree; ninja rebuilds only what changed."""
    r = subprocess.run([sys.executable, str(REPO / "llama.cpp" / "fetch.py")], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"arm_bench: llama.cpp/fetch.py failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    src = Path(r.stdout.strip().splitlines()[-1]) / "vendor" / "llama.cpp"
    bdir = fetch.default_cache() / "build" / "aarch64-bench"
    bdir.mkdir(parents=True, exist_ok=True)
    cc, cxx = compiler_wrappers(bdir)
    if not (bdir / "build.ninja").exists():
        subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja", f"-DCMAKE_C_COMPILER={cc}",
                        f"-DCMAKE_CXX_COMPILER={cxx}", *CMAKE_FLAGS], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["ninja", "-C", str(bdir), f"-j{os.cpu_count() or 2}", "llama-bench"], check=True,
                   stdout=subprocess.DEVNULL)
    return bdir / "bin" / "llama-bench"


def qemu_version(qemu: Path) -> str:
    out = subprocess.run([str(qemu), "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else "qemu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: the bundled model)")
    ap.add_argument("-d", "--depths", default="0,1024")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens of the pp test (default 128)")
    ap.add_argument("-n", type=int, default=16, help="generated tokens of the tg test (default 16)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0,q4_0,oscar2")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the types, medians reported (default 1)")
    ap.add_argument("-o", "--out", default="oscar-arm-bench")
    a = ap.parse_args()
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        print("arm_bench: cmake and ninja are needed (pip install cmake ninja)", file=sys.stderr)
        return 2
    exe = build_llama_bench()
    qemu = arm_tools.qemu_aarch64()
    machine = f"{qemu_version(qemu)}, {ZIG_CPU} code (emulated) on {os.cpu_count()} host CPU threads"
    cmd = f"benchmarks/arm_bench.py -d {a.depths} -p {a.p} -n {a.n} -t {a.threads} --types {a.types} --rounds {a.rounds}"
    res = run_bench(a.model or bundled_model_path(), kv_types=a.types.split(","),
                    depths=[int(x) for x in a.depths.split(",")], n_prompt=a.p, n_gen=a.n, ngl=0, reps=1,
                    n_threads=a.threads, out_dir=a.out, progress=False, command=cmd, plot=False,
                    tool=[str(qemu), str(exe)], machine=machine, rounds=a.rounds)
    print((Path(a.out) / "bench.txt").read_text())
    return 1 if res.notes else 0


if __name__ == "__main__":
    sys.exit(main())
