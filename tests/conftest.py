"""Shared fixtures. Tests run against the patched build installed by `make test`."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "llama.cpp"))  # fetch.py / build.py / arm_tools.py


def have_cuda_build() -> bool:
    """True when the installed ggml has a CUDA backend and a GPU is visible."""
    try:
        from oscar_gguf.paths import library_dir
        lib = library_dir()
    except Exception:
        return False
    return (lib / "libggml-cuda.so").exists() and shutil.which("nvidia-smi") is not None


def pytest_collection_modifyitems(config, items):
    if have_cuda_build():
        return
    skip = pytest.mark.skip(reason="needs a CUDA build and a GPU (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    from oscar_gguf import bundled_model_path
    return bundled_model_path()


@pytest.fixture(scope="session")
def n_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: one torch thread is as fast, and immune to OpenMP spin-waits on a busy
    2-core CI box. Modules opt in with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
