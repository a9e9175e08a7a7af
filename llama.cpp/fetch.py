#!/usr/bin/env python3
"""Fetch, verify and patch the pinned upstream (llama-cpp-python sdist with llama.cpp inside).

    python llama.cpp/fetch.py [--cache DIR] [--sdist FILE] [--patches DIR] [--dest DIR]

Steps, each skipped when its result is already there:
  1. download the sdist named in UPSTREAM.toml from the package registry with pip
     (or take --sdist FILE / $OSCAR_SDIST);
  2. verify its sha256 against UPSTREAM.toml and stop loudly on a mismatch;
  3. unpack it into a staging folder and apply llama.cpp/patches/*.patch in order,
     stopping loudly on the first patch that does not apply;
  4. sync the staged tree into the destination, touching only files whose content
     changed, so that an incremental build recompiles only what the patches touched;
  5. mirror ggml-oscar/ into <dest>/vendor/llama.cpp/ggml/src/ggml-oscar/ (again by
     content), so that our sources sit at a stable path inside the upstream tree.

A stamp file records the sdist hash and the hash of every patch; when it matches, steps
1-4 do nothing. The destination path is printed on the last line of stdout.

No upstream file is ever written into this repository: the default destination is
under $OSCAR_CACHE_DIR (default ~/.cache/oscar-gguf), outside any clone, so that
several clones and CI runs share one patched tree and one build folder.
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STAMP = ".oscar-upstream-stamp.json"
OSCAR_SUBDIR = Path("vendor/llama.cpp/ggml/src/ggml-oscar")


class FetchError(RuntimeError):
    """A failure the user must act on; printed as one clear line."""


def read_pin(path: Path = HERE / "UPSTREAM.toml") -> dict:
    text = path.read_text()
    if tomllib is not None:
        return tomllib.loads(text)
    # tiny fallback parser for the flat [section] key = "value" file we keep
    pin: dict = {}
    section = pin
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            section = pin.setdefault(line.strip("[]"), {})
        else:
            k, v = (s.strip() for s in line.split("=", 1))
            section[k] = v.strip('"')
    return pin


def default_cache() -> Path:
    return Path(os.environ.get("OSCAR_CACHE_DIR", Path.home() / ".cache" / "oscar-gguf"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist(pin: dict, dl_dir: Path) -> Path:
    """Download the pinned sdist with pip; reuse a previous download."""
    sd = pin["sdist"]
    target = dl_dir / sd["filename"]
    if target.exists():
        return target
    dl_dir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", sd["package"],
            f"{sd['package']}=={sd['version']}", "-d", str(dl_dir), "-q"]
    # pip prepares the sdist's metadata; without build isolation that needs only
    # scikit-build-core here, which avoids pip building cmake from source.
    try:
        import scikit_build_core  # noqa: F401
        cmd = base + ["--no-build-isolation"]
    except ImportError:
        cmd = base
    print(f"fetch: downloading {sd['package']}=={sd['version']} (sdist) with pip", file=sys.stderr)
    r = subprocess.run(cmd)
    if r.returncode != 0 or not target.exists():
        raise FetchError(f"could not download {sd['package']}=={sd['version']} from the package "
                         f"registry (pip exit {r.returncode}); pass --sdist FILE to use a local copy")
    return target


def verify_sdist(pin: dict, sdist: Path) -> str:
    want = pin["sdist"]["sha256"]
    got = sha256_file(sdist)
    if got != want:
        raise FetchError(f"sha256 mismatch for {sdist}: expected {want}, got {got}. "
                         f"The file is not the pinned upstream; delete it and fetch again.")
    return got


def patch_list(patches_dir: Path) -> list[Path]:
    return sorted(patches_dir.glob("*.patch"))


def stamp_for(sdist_sha: str, patches: list[Path]) -> dict:
    return {"sdist_sha256": sdist_sha,
            "patches": [[p.name, sha256_file(p)] for p in patches]}


def strip_vcs(tree: Path) -> None:
    """The sdist carries llama-cpp-python's .git (39 MB) and a submodule link; drop them so
    that `git apply` patches plain files instead of refusing paths inside a submodule."""
    for root, dirs, files in os.walk(tree):
        for name in list(dirs):
            if name == ".git":
                shutil.rmtree(Path(root) / name)
                dirs.remove(name)
        for name in files:
            if name == ".git":
                (Path(root) / name).unlink()


def apply_patches(tree: Path, patches: list[Path]) -> None:
    # never let git find a repository above the staging folder
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    for p in patches:
        check = subprocess.run(["git", "apply", "--check", "-p1", str(p)], cwd=tree, env=env,
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise FetchError(f"patch {p.name} does not apply to the pinned upstream:\n"
                             f"{check.stderr.strip()}\n"
                             f"Rebase it (README: 'Rebasing the patches') or fix the patch.")
        subprocess.run(["git", "apply", "-p1", str(p)], cwd=tree, env=env, check=True)


def sync_tree(src: Path, dst: Path, keep: tuple[Path, ...] = ()) -> int:
    """Make dst equal to src, copying only changed files. Returns the number of writes."""
    changed = 0
    dst.mkdir(parents=True, exist_ok=True)
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            s, d = Path(root) / name, dst / rel / name
            if d.is_symlink() or (d.exists() and not filecmp.cmp(s, d, shallow=False)):
                d.unlink()
            if not d.exists():
                # a fresh mtime (not the archive's) so that ninja rebuilds what changed,
                # also when a file reverts to an older content
                shutil.copyfile(s, d)
                shutil.copymode(s, d)
                changed += 1
    # remove files that are gone from src (but never the kept subtrees)
    for root, dirs, files in os.walk(dst, topdown=True):
        rel = Path(root).relative_to(dst)
        if any(rel == k or k in rel.parents for k in keep):
            dirs[:] = []
            continue
        for name in files:
            if name == STAMP and rel == Path("."):
                continue
            if not (src / rel / name).exists():
                (Path(root) / name).unlink()
                changed += 1
    return changed


def tree_dir(cache: Path | None = None) -> Path:
    """Where the patched upstream tree lives (default destination of prepare)."""
    sd = read_pin()["sdist"]
    return (cache or default_cache()) / "src" / f"{sd['package']}-{sd['version']}"


def prepare(cache: Path, sdist: Path | None, patches_dir: Path, dest: Path | None,
            oscar_src: Path | None = REPO / "ggml-oscar") -> Path:
    pin = read_pin()
    sd = pin["sdist"]
    dest = dest or tree_dir(cache)
    patches = patch_list(patches_dir)

    stamp_path = dest / STAMP
    current = None
    if stamp_path.exists():
        try:
            current = json.loads(stamp_path.read_text())
        except (OSError, ValueError):
            current = None

    # cheap check first: if the stamp names the pinned hash and the same patches, we are done
    if current is not None and current.get("sdist_sha256") == sd["sha256"] and \
            current.get("patches") == stamp_for(sd["sha256"], patches)["patches"] and \
            (dest / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        print("fetch: upstream tree up to date", file=sys.stderr)
    else:
        sdist = sdist or (Path(os.environ["OSCAR_SDIST"]) if os.environ.get("OSCAR_SDIST") else None)
        sdist = sdist or download_sdist(pin, cache / "downloads")
        sha = verify_sdist(pin, sdist)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".stage-") as tmp:
            with tarfile.open(sdist) as tf:
                try:
                    tf.extractall(tmp, filter="data")
                except TypeError:  # Python without extraction filters
                    tf.extractall(tmp)
            top = Path(tmp) / sd["filename"].removesuffix(".tar.gz")
            if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
                raise FetchError(f"{sdist} does not carry vendor/llama.cpp; wrong sdist?")
            strip_vcs(top)
            apply_patches(top, patches)
            n = sync_tree(top, dest, keep=(OSCAR_SUBDIR,))
        stamp_path.write_text(json.dumps(stamp_for(sha, patches), indent=1))
        print(f"fetch: upstream tree patched ({len(patches)} patches, {n} files written)",
              file=sys.stderr)

    if oscar_src is not None and oscar_src.exists():
        n = sync_tree(oscar_src, dest / OSCAR_SUBDIR)
        if n:
            print(f"fetch: ggml-oscar synced ({n} files)", file=sys.stderr)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=None, help="cache root (default $OSCAR_CACHE_DIR or ~/.cache/oscar-gguf)")
    ap.add_argument("--sdist", type=Path, default=None, help="use this local sdist instead of downloading")
    ap.add_argument("--patches", type=Path, default=HERE / "patches", help="patch directory")
    ap.add_argument("--dest", type=Path, default=None, help="where the patched tree goes")
    ap.add_argument("--no-oscar-sync", action="store_true", help="do not mirror ggml-oscar/")
    args = ap.parse_args(argv)
    try:
        dest = prepare(args.cache or default_cache(), args.sdist, args.patches, args.dest,
                       None if args.no_oscar_sync else REPO / "ggml-oscar")
    except FetchError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 2
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
