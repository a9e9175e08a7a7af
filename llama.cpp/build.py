#!/usr/bin/env python3
"""Build and install the patched llama.cpp, the tools and the bindings into this venv.

    python llama.cpp/build.py [--force] [--clean]

Does nothing when the last install was made from the same inputs (the pin, the patches,
ggml-oscar/, the build files and CMAKE_ARGS). Otherwise it runs an editable
`pip install` through scikit-build-core with a persistent build folder, so that a
rebuild only recompiles what changed.

The build folder lives outside the clone, in $OSCAR_BUILD_DIR or
$OSCAR_CACHE_DIR/build/<variant> (default ~/.cache/oscar-gguf/build/cpu), so that a
fresh clone on a machine that built before reuses it. A folder configured from another
clone is re-pointed here: its CMake cache is dropped, its objects and ninja logs are
kept, and ninja then recompiles nothing whose command did not change. ccache is used
when it is installed. None of this is needed for correctness.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch  # noqa: E402

REPO = fetch.REPO
# what a rebuild depends on; Python sources are editable-installed and need none
BUILD_INPUTS = ["CMakeLists.txt", "pyproject.toml", "llama.cpp/UPSTREAM.toml",
                "llama.cpp/patches", "ggml-oscar"]


def inputs_hash() -> str:
    h = hashlib.sha256()
    for rel in BUILD_INPUTS:
        p = REPO / rel
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(REPO)).encode())
            h.update(f.read_bytes())
    h.update(os.environ.get("CMAKE_ARGS", "").encode())
    h.update(sys.executable.encode())
    return h.hexdigest()


def build_dir() -> Path:
    if os.environ.get("OSCAR_BUILD_DIR"):
        return Path(os.environ["OSCAR_BUILD_DIR"])
    variant = "cuda" if "GGML_CUDA=ON" in os.environ.get("CMAKE_ARGS", "").upper() else "cpu"
    return fetch.default_cache() / "build" / variant


def repoint_build_dir(bdir: Path) -> None:
    """Drop a CMake cache written for another source folder (another clone)."""
    cache = bdir / "CMakeCache.txt"
    if not cache.exists():
        return
    home = None
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:INTERNAL="):
            home = line.split("=", 1)[1]
    if home and Path(home).resolve() != REPO.resolve():
        print(f"build: build folder {bdir} was configured for {home}; re-pointing it here",
              file=sys.stderr)
        cache.unlink()
        shutil.rmtree(bdir / "CMakeFiles", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="reinstall even if nothing changed")
    ap.add_argument("--clean", action="store_true", help="delete the build folder first")
    args = ap.parse_args(argv)

    bdir = build_dir()
    stamp = Path(sys.prefix) / ".oscar-build-stamp"
    if args.clean:
        shutil.rmtree(bdir, ignore_errors=True)
        stamp.unlink(missing_ok=True)

    # the fetch step is cheap when up to date and also mirrors ggml-oscar/
    try:
        fetch.prepare(fetch.default_cache(), None, fetch.HERE / "patches", None)
    except fetch.FetchError as e:
        print(f"build: error: {e}", file=sys.stderr)
        return 2

    want = inputs_hash()
    if not args.force and stamp.exists() and stamp.read_text().strip() == want:
        print("build: up to date", file=sys.stderr)
        return 0

    bdir.mkdir(parents=True, exist_ok=True)
    repoint_build_dir(bdir)
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=jobs)
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
           "-e", str(REPO),
           "-C", f"build-dir={bdir}",
           "-C", "editable.rebuild=false"]
    print(f"build: building into {bdir} (-j{jobs}); this takes about 15 minutes on 2 cores "
          f"the first time", file=sys.stderr)
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0:
        print("build: error: pip install of the patched build failed (see above)", file=sys.stderr)
        return r.returncode
    stamp.write_text(want + "\n")
    print("build: installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
