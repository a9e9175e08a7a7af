"""Build the small C programs in tests/c against the installed patched ggml."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import fetch
from oscar_gguf.paths import library_dir

C_DIR = Path(__file__).resolve().parent / "c"


def build_c_tool(name: str, out_dir: Path, libs=("ggml", "ggml-base", "ggml-cpu")) -> Path:
    """Compile tests/c/<name>.c once per source/library version; returns the binary."""
    src = C_DIR / f"{name}.c"
    ggml = fetch.tree_dir() / "vendor" / "llama.cpp" / "ggml"
    lib = library_dir()
    key = hashlib.sha256(src.read_bytes() + str(lib).encode()).hexdigest()[:12]
    exe = out_dir / f"{name}-{key}"
    if not exe.exists():
        # ggml/src for our own ggml API (ggml-oscar/oscar2-ops.h), beside the public headers
        cmd = ["cc", "-O2", "-std=c11", "-o", str(exe), str(src), f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-L{lib}",
               *[f"-l{l}" for l in libs], f"-Wl,-rpath,{lib}", "-lm"]
        subprocess.run(cmd, check=True)
    return exe
