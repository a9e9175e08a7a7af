"""The patches that the GPU sessions apply to ggml-oscar still apply to it.

`gpu/run.sh timeline` builds gpu/trace/decode-timeline.patch in (a per-block timeline of the
decode kernels), `gpu/run.sh perf` the candidates in gpu/candidates/, and `gpu/run.sh ab` the A/B
variants in gpu/ab/ (the kernels with one optimisation switched off). The GPU machine is a
scarce budget: a patch that stopped applying after a kernel change is found here, on the CPU,
not in a paid GPU call. (A candidate that is not worth rebasing is deleted, with its numbers in
gpu/results/.)
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMELINE = ROOT / "gpu" / "trace" / "decode-timeline.patch"
PATCHES = sorted([TIMELINE, *(ROOT / "gpu" / "candidates").glob("*.patch"), *(ROOT / "gpu" / "ab").glob("*.patch")])


def _in_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == "true"


def test_the_timeline_patch_is_the_one_run_sh_applies_and_patches_ggml_oscar():
    """`gpu/run.sh timeline` applies this file, and it changes only files of ggml-oscar/ that
    exist, so that test_patch_applies_to_ggml_oscar checks it against the code it patches."""
    assert f"apply_patch {TIMELINE.relative_to(ROOT)}" in (ROOT / "gpu" / "run.sh").read_text()
    files = re.findall(r"^\+\+\+ b/(\S+)$", TIMELINE.read_text(), re.M)
    assert files and all(f.startswith("ggml-oscar/") and (ROOT / f).is_file() for f in files), files


@pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout of the repository")
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_ggml_oscar(patch):
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.relative_to(ROOT)} no longer applies (rebase or delete it):\n{r.stderr}"
