"""Cross-compile C for aarch64 and run it under qemu, with tools from the package registries only.

The C cross compiler is zig (`python -m ziglang cc`, PyPI wheel `ziglang`, pinned below); the
emulator is `qemu-aarch64-static` from Debian's `qemu-user-static` package (`apt-get download`,
unpacked with `dpkg-deb -x`: no root install). Both are unpacked once into
<cache>/tools (~/.cache/oscar-gguf/tools, beside the build) and reused; zig's own cache (the
musl libc it builds for the target, about a minute the first time on 2 cores) lives there too.

Debian keeps one version of a package per release, so qemu is taken as the release has it; the
version unpacked is the folder's name.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fetch

ZIGLANG_VERSION = "0.14.1"
QEMU_PACKAGE = "qemu-user-static"
QEMU_BINARY = "qemu-aarch64-static"

# what pip and apt print when the registry cannot be reached (as opposed to any other failure)
_UNREACHABLE = re.compile(r"NewConnectionError|ConnectTimeout|ReadTimeout|Temporary failure in name resolution|"
                          r"Could not resolve|Network is unreachable|Failed to fetch|ProxyError|Connection refused|"
                          r"Connection timed out|No route to host")


class RegistryUnreachable(RuntimeError):
    """PyPI or Debian's archive could not be reached: the callers skip, with this message."""


def tools_dir() -> Path:
    return fetch.default_cache() / "tools"


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        out = (r.stdout + r.stderr).strip()
        last = out.splitlines()[-1] if out else f"exit {r.returncode}"
        if _UNREACHABLE.search(out):
            raise RegistryUnreachable(f"{what}: registry unreachable ({last})")
        raise RuntimeError(f"{what} failed: {last}")
    return r


def ziglang_home() -> Path:
    """The folder holding the pinned `ziglang` package (run as `python -m ziglang`), fetched once."""
    home = tools_dir() / f"ziglang-{ZIGLANG_VERSION}"
    if not (home / "ziglang").is_dir():
        partial = home.with_name(home.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
              "--target", str(partial), f"ziglang=={ZIGLANG_VERSION}"], f"pip install ziglang=={ZIGLANG_VERSION}")
        partial.rename(home)
    return home


def qemu_aarch64() -> Path:
    """The path of qemu-aarch64-static, from Debian's package, fetched and unpacked once."""
    base = tools_dir() / QEMU_PACKAGE
    found = sorted(base.glob(f"*/usr/bin/{QEMU_BINARY}"))
    if found:
        return found[-1]
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RuntimeError("apt-get and dpkg-deb are needed to fetch qemu-user-static (a Debian machine)")
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        try:
            _run(["apt-get", "download", "-q", QEMU_PACKAGE], f"apt-get download {QEMU_PACKAGE}", cwd=Path(tmp))
        except RuntimeError as e:
            if isinstance(e, RegistryUnreachable):
                raise
            # no package lists yet (a fresh machine): read them once, then try again
            _run(["apt-get", "update", "-q"], "apt-get update")
            _run(["apt-get", "download", "-q", QEMU_PACKAGE], f"apt-get download {QEMU_PACKAGE}", cwd=Path(tmp))
        deb = next(Path(tmp).glob("*.deb"))
        version = _run(["dpkg-deb", "-f", str(deb), "Version"], "dpkg-deb -f").stdout.strip()
        dest = base / version.replace(":", "_")
        unpack = Path(tmp) / "root"
        _run(["dpkg-deb", "-x", str(deb), str(unpack)], "dpkg-deb -x")
        shutil.rmtree(dest, ignore_errors=True)
        unpack.rename(dest)
    return dest / "usr" / "bin" / QEMU_BINARY


def build_aarch64(sources: list[Path], includes: list[Path], exe: Path) -> Path:
    """A static aarch64 Linux binary (musl) from C sources, once per source content."""
    if not exe.exists():
        cache = str(tools_dir() / "zig-cache")
        env = dict(os.environ, PYTHONPATH=str(ziglang_home()), ZIG_GLOBAL_CACHE_DIR=cache, ZIG_LOCAL_CACHE_DIR=cache)
        cmd = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl", "-static", "-O2", "-std=c11",
               *[f"-I{i}" for i in includes], "-o", str(exe), *map(str, sources), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"zig cc for aarch64 failed:\n{r.stderr[-3000:]}")
    return exe
