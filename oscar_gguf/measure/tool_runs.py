"""What every measuring run shares: its error type, its model and output folder, the llama.cpp
tools it runs with live output, and a line naming the machine it ran on.
"""
from __future__ import annotations

import os
import platform
import re
import selectors
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

from ..atomic import write_text_atomic
from ..format.gguf_read import ModelInfo, model_info
from ..paths import tool_path


class EvalError(RuntimeError):
    """A problem the user can fix (bad input, missing tool); the message says how."""


def load_model_info(model: str | Path) -> tuple[Path, ModelInfo]:
    """The model's path and what the measuring tools need of its GGUF, or an EvalError."""
    model = Path(model)
    if not model.is_file():
        raise EvalError(f"model {model} not found")
    try:
        return model, model_info(model)
    except ValueError as e:
        raise EvalError(str(e)) from None


def output_folder(out_dir: str | Path) -> Path:
    """Create the output folder and its logs/ (refusing a file in the way)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise EvalError(f"output folder {out_dir} is a file")
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    return out_dir


def stream_tool(name: str, args: Sequence[str], on_output: Callable[[str], None] | None = None,
                env: dict | None = None, timeout: float | None = None, log_path: Path | None = None,
                stdout_only: list | None = None, command: Sequence[str] | None = None) -> tuple[int, str]:
    """Run an installed llama.cpp tool, calling on_output with each new piece of its output
    (unbuffered: llama-perplexity prints its progress without newlines).

    Returns (exit code, stdout and stderr as they came). If stdout_only is a list, stdout
    alone is appended to it too (llama-bench's JSON must not mix with its stderr).
    A timeout kills the tool and returns code 124. `command` runs in place of the installed
    tool (an emulator and a cross-built binary, say).
    """
    cmd = [*(map(str, command) if command else [str(tool_path(name))]), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None and proc.stderr is not None
    merged: list[str] = []
    out_parts: list[str] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    open_streams = 2
    code = None
    try:
        while open_streams:
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                code = 124
                merged.append(f"\n[oscar] {name} killed after {timeout:.0f} s\n")
                break
            for sk, _ in sel.select(timeout=0.5):
                data = os.read(sk.fileobj.fileno(), 65536)
                if not data:
                    sel.unregister(sk.fileobj)
                    open_streams -= 1
                    continue
                text = data.decode("utf-8", "replace")
                merged.append(text)
                if sk.data == "out":
                    out_parts.append(text)
                if on_output is not None:
                    on_output(text)
        if code is None:
            code = proc.wait()
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(merged)
    if stdout_only is not None:
        stdout_only.append("".join(out_parts))
    if log_path is not None:
        write_text_atomic(log_path, f"$ {' '.join(cmd)}\n{out}")
    return code, out


def last_error_line(log: str) -> str:
    """The most telling line of a failed tool's output, for a one-line note."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for pat in (r"\berror\b", r"invalid argument|unknown argument|failed|abort|assert"):
        hits = [ln for ln in lines if re.search(pat, ln, re.I)]
        if hits:
            return hits[-1][:160]
    return (lines[-1] if lines else "no output")[:160]


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} CPU threads"
    if shutil.which("nvidia-smi"):
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
            if gpu:
                desc += f", {len(gpu)}x {gpu[0]}"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return desc
