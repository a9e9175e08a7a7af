#!/usr/bin/env python3
"""Work on the patch series as git commits, then export them back.

    python llama.cpp/patchdev.py init DIR      # pristine upstream + one commit per patch
    (edit, commit, `git rebase -i`, ... inside DIR/vendor/llama.cpp or DIR)
    python llama.cpp/patchdev.py export DIR    # rewrite llama.cpp/patches/*.patch

`init` unpacks the pinned sdist (verified as in fetch.py), commits it as "pristine",
and applies every patch with `git am`, so each patch becomes one commit. `export`
writes each commit after "pristine" as NNNN-<subject>.patch, deterministic (no
commit hashes, no signature) so that unchanged patches give empty diffs.

Rebasing onto a new upstream: bump UPSTREAM.toml, `init` a tree with the new sdist
(`--sdist`), resolve what `git am` rejects, commit, and `export`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch  # noqa: E402

GIT_ID = ["-c", "user.name=oscar-gguf", "-c", "user.email=dev@oscar-gguf.invalid"]


def git(cwd: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent))
    return subprocess.run(["git", *GIT_ID, *args], cwd=cwd, env=env, check=True, **kw)


def init(dest: Path, sdist: Path | None) -> None:
    pin = fetch.read_pin()
    sdist = sdist or fetch.download_sdist(pin, fetch.default_cache() / "downloads")
    fetch.verify_sdist(pin, sdist)
    dest.mkdir(parents=True, exist_ok=False)
    with tarfile.open(sdist) as tf:
        tf.extractall(dest, filter="data")
    top = dest / pin["sdist"]["filename"].removesuffix(".tar.gz")
    for p in top.iterdir():
        p.rename(dest / p.name)
    top.rmdir()
    fetch.strip_vcs(dest)
    git(dest, "init", "-q")
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-qm", "pristine")
    git(dest, "tag", "pristine")
    for p in fetch.patch_list(fetch.HERE / "patches"):
        git(dest, "am", "-q", "--keep-cr", str(p))
    print(f"{dest}: pristine + {len(fetch.patch_list(fetch.HERE / 'patches'))} patch commits")


def export(src: Path) -> None:
    out = fetch.HERE / "patches"
    for p in out.glob("*.patch"):
        p.unlink()
    git(src, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat", "--no-numbered",
        "-o", str(out), "pristine..HEAD")
    for p in sorted(out.glob("*.patch")):
        print(p.name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("init")
    a.add_argument("dir", type=Path)
    a.add_argument("--sdist", type=Path)
    b = sub.add_parser("export")
    b.add_argument("dir", type=Path)
    args = ap.parse_args()
    if args.cmd == "init":
        init(args.dir, args.sdist)
    else:
        export(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
