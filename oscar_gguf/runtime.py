"""Running the patched llama.cpp: library checks, tools, log parsing and a server helper."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .paths import tool_path
from .format.oscar2 import OSCAR2_64_TYPE_ID, OSCAR2_TYPE_ID

# ggml type ids of the KV-cache types people pass to --cache-type-k/v
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
            "iq4_nl": 20, "bf16": 30, "oscar2": OSCAR2_TYPE_ID, "oscar2_64": OSCAR2_64_TYPE_ID}
GGML_TYPE_OSCAR2 = OSCAR2_TYPE_ID
GGML_TYPE_OSCAR2_64 = OSCAR2_64_TYPE_ID


def kv_type(name_or_id: str | int) -> int:
    """ggml type id of a KV-cache type name ("oscar2", "q4_0", ...)."""
    if isinstance(name_or_id, int):
        return name_or_id
    try:
        return KV_TYPES[name_or_id]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name_or_id!r}; one of {', '.join(KV_TYPES)}") from None


def patchset_version() -> str:
    """The oscar-gguf patch-set marker of the libllama that llama_cpp loaded."""
    import llama_cpp
    return llama_cpp.llama_oscar_patchset_version().decode()


def linked_libllama(binary: Path) -> Path | None:
    """The libllama a tool binary resolves at run time (via ldd)."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*libllama\.so[^\s]*\s*=>\s*(\S+)", line)
        if m:
            return Path(m.group(1)).resolve()
    return None


# ---- llama.cpp log lines -------------------------------------------------------------------

@dataclass
class KVSize:
    total_mib: float
    k_type: str
    k_mib: float
    v_type: str
    v_mib: float
    cells: int


_KV_RE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells.*K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")


def _kv_size(m: re.Match) -> KVSize:
    return KVSize(total_mib=float(m.group(1)), cells=int(m.group(2)), k_type=m.group(3),
                  k_mib=float(m.group(4)), v_type=m.group(5), v_mib=float(m.group(6)))


def parse_kv_size(log: str) -> KVSize | None:
    """The first KV-cache size line that llama.cpp logs when it creates a context."""
    m = _KV_RE.search(log)
    return _kv_size(m) if m else None


def parse_kv_sizes(log: str) -> list[KVSize]:
    """Every KV-cache size line: one per cache (an iSWA model logs its full-attention cache and
    its sliding-window cache)."""
    return [_kv_size(m) for m in _KV_RE.finditer(log)]


# ---- tools -----------------------------------------------------------------------------------

def run_tool(name: str, args: list[str], timeout: float = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run an installed llama.cpp tool, returning its completed process (text output)."""
    cmd = [str(tool_path(name)), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
        raise RuntimeError(f"{name} exited with {r.returncode}:\n{tail}")
    return r


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer(contextlib.AbstractContextManager):
    """llama-server on 127.0.0.1 and a free port, for tests and tools; always stopped on exit."""

    def __init__(self, model: str | Path, args: list[str] = (), start_timeout: float = 120,
                 log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(tool_path("llama-server")), "-m", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), *map(str, args)]
        self.start_timeout = start_timeout
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} during start")
            try:
                if self.get("/health").get("status") == "ok":
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"llama-server did not become healthy in {self.start_timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 20) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=timeout)

    def get(self, path: str, timeout: float = 10) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
