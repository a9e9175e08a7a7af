"""Issue 27: the vector row loops of the CPU flash attention (ggml-oscar/oscar2-rows*.c) against their
scalar reference: AVX2 natively and in the built library, NEON cross-compiled and run under
qemu-aarch64. mad and to_f32 bit for bit, dot within 1e-5 of sum |value*y| (float summation order);
the same for the window's f16 rows.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import pytest

import arm_tools
from oscar_gguf.format import oscar2 as quant
from oscar_gguf.ggml_ctypes import GGML

REPO = Path(__file__).resolve().parents[1]
OSCAR = REPO / "ggml-oscar"
CHECK = REPO / "tests" / "c" / "oscar2_rows_check.c"
SOURCES = [CHECK, OSCAR / "oscar2.c", OSCAR / "oscar2-rows-scalar.c", OSCAR / "oscar2-rows-avx2.c",
           OSCAR / "oscar2-rows-neon.c"]


def sources_key() -> str:
    h = hashlib.sha256()
    for p in [*SOURCES, OSCAR / "oscar2.h", OSCAR / "oscar2-rows.h", OSCAR / "oscar2-rows-scores.inc"]:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def check_output(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failed" in r.stdout and "1000 passed" in r.stdout, r.stdout
    return r.stdout


def test_rows_native_vector_path_matches_reference(tmp_path):
    # -march=native: AVX2 on the x86 machines we run on (the check prints which ISA it tested)
    exe = tmp_path / "rows_check"
    subprocess.run(["cc", "-O2", "-march=native", "-std=c11", f"-I{OSCAR}", "-o", str(exe), *map(str, SOURCES), "-lm"],
                   check=True)
    out = check_output([str(exe)])
    if "avx2" in open("/proc/cpuinfo").read().split():
        assert "isa: avx2" in out


def test_rows_neon_under_qemu():
    try:
        qemu = arm_tools.qemu_aarch64()
        out_dir = arm_tools.tools_dir() / "bin"
        out_dir.mkdir(parents=True, exist_ok=True)
        exe = arm_tools.build_aarch64(SOURCES, [OSCAR], out_dir / f"oscar2_rows_check-aarch64-{sources_key()}")
    except arm_tools.RegistryUnreachable as e:
        pytest.skip(str(e))
    out = check_output([str(qemu), str(exe)])
    assert "isa: neon" in out


@pytest.mark.parametrize("group,type_id", [(128, quant.OSCAR2_TYPE_ID), (64, quant.OSCAR2_64_TYPE_ID)])
def test_built_v_mad_is_bit_exact(group, type_id):
    # the P.V step the built flash attention runs (vector where built so) against the reference
    ggml = GGML()
    rng = np.random.default_rng(group)
    for n_blocks in (1, 2, 4):
        x = (rng.standard_normal(n_blocks * group) * 3 + 1).astype(np.float32)
        data = quant.quantize_row(x, group, 0.92)
        acc = rng.standard_normal(x.size).astype(np.float32)
        w = float(rng.random())
        fast = ggml.oscar2_v_mad(type_id, data, w, acc)
        ref = ggml.oscar2_v_mad(type_id, data, w, acc, reference=True)
        assert np.array_equal(fast, ref)
        exact = acc.astype(np.float64) + w * quant.dequantize_row(data, group).astype(np.float64)
        assert np.abs(fast - exact).max() <= 1e-6 * (np.abs(exact).max() + 1)
