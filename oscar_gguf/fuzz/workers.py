"""The fuzz harness's workers: long-lived subprocesses (`python -m oscar_gguf.fuzz --worker
loader|python`) that take one JSON request a line on stdin and answer one JSON line on stdout,
so that a crash or a hang costs one case and a restart, not the run.

The "loader" worker drives the patched llama.cpp (model load, an oscar2 context, a decode); the
"python" worker drives `oscar inspect`, oscar-convert and the calibration readers, and tells a
clean refusal (our own one-line error) from a bug (any other exception).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from .inputs import tiny_artifact

def _error_is_ours(exc: BaseException) -> tuple[bool, str]:
    """A Python exception is a clean refusal when it is our error type, or the documented
    ValueError raised by a `raise` statement in our own code, with a one-line message."""
    from ..format.gguf_read import GGUFError
    tb = traceback.extract_tb(exc.__traceback__)
    last = tb[-1] if tb else None
    where = f"{Path(last.filename).name}:{last.lineno} `{(last.line or '').strip()}`" if last else "?"
    msg = str(exc)
    if "\n" in msg.strip():
        return False, f"{where} (a multi-line message)"
    if isinstance(exc, GGUFError):
        return True, where
    ours = last is not None and "oscar_gguf" in last.filename
    if isinstance(exc, ValueError) and ours and (last.line or "").lstrip().startswith("raise"):
        return True, where
    return False, where


_LOG = None


class _RawLog:
    """llama.cpp log lines to fd 2 as raw bytes: the bindings' own callback decodes UTF-8 and
    would choke on the fuzzed (non-UTF-8) key names the loader prints."""

    def __init__(self):
        import llama_cpp
        self.cb = llama_cpp.llama_log_callback(self._write)
        llama_cpp.llama_log_set(self.cb, ctypes.c_void_p(0))

    @staticmethod
    def _write(level, text, user):
        try:
            os.write(2, text or b"")
        except OSError:
            pass


def _log_error_line() -> str:
    """The loader's error message from this worker's own log (fd 2 is a file)."""
    try:
        os.lseek(2, 0, os.SEEK_SET)
        data = os.read(2, 1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""
    keys = ("error", "failed", "oscar:", "invalid", "refus", "not supported")
    lines = [ln.strip() for ln in data.splitlines() if any(k in ln.lower() for k in keys)]
    return lines[0][:300] if lines else ""


def _work_loader(req: dict) -> dict:
    from ..llama_context import Context, LlamaError, Model
    try:
        model = Model(req["path"])
    except LlamaError:
        return {"outcome": "refused", "detail": _log_error_line() or "model load failed"}
    try:
        try:
            ctx = Context(model, n_ctx=64, n_batch=64, n_ubatch=64, type_k="oscar2", type_v="oscar2",
                          n_threads=1)
        except LlamaError:
            return {"outcome": "refused", "detail": _log_error_line() or "context creation failed"}
        try:
            toks = model.tokenize("the cat sat on the mat")
            logits = ctx.decode(toks)
            if not np.all(np.isfinite(logits)):
                return {"outcome": "ok", "detail": "non-finite logits", "finite": False}
            return {"outcome": "ok", "detail": f"{len(toks)} tokens decoded", "finite": True}
        finally:
            ctx.close()
    finally:
        model.close()


def _python_call(fn) -> dict:
    try:
        detail = fn()
        return {"outcome": "ok", "detail": str(detail)[:300]}
    except Exception as e:  # noqa: BLE001 - classifying is the point
        clean, where = _error_is_ours(e)
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        if clean:
            return {"outcome": "refused", "detail": msg}
        return {"outcome": "bug", "detail": f"{msg} at {where}"}


def _work_python(req: dict) -> dict:
    from ..convert import convert, inspect_report, load_rotations, rotations_from_artifact
    kind = req["kind"]
    if kind == "inspect":
        return _python_call(lambda: inspect_report(req["path"]).count("\n"))
    if kind == "convert":
        # the model side: a fuzzed GGUF gets valid rotations (its own oscar data replaced)
        def run():
            rot = rotations_from_artifact(tiny_artifact(1))
            convert(req["path"], req["out"], rot, replace=True)
            return "written"
        return _python_call(run)
    # the rotation side: a fuzzed artifact or RotationZoo pair, through oscar-convert's own path
    ns = argparse.Namespace(rotations=req.get("rotations"), k_rot=req.get("k_rot"), v_rot=req.get("v_rot"),
                            clip_k=None, clip_v=None, no_f16_k=False)

    def run():
        rot = load_rotations(ns, Path(req["model"]))
        convert(req["model"], req["out"], rot)
        return "written"
    return _python_call(run)


def worker_main(kind: str) -> int:
    """The worker loop; stderr is a file the parent gave us (truncated before each case)."""
    if kind == "loader":
        global _LOG  # the C side keeps calling it: it must outlive the loop
        _LOG = _RawLog()
    # answers go through a private copy of stdout; fd 1 itself joins the log, since C code
    # (llama.cpp, ggml) may print to stdout and must not corrupt the answer channel
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            os.ftruncate(2, 0)
            os.lseek(2, 0, os.SEEK_SET)
        except OSError:
            pass
        if req.get("op") == "ping":
            res = {"outcome": "ok"}
        elif req.get("op") == "sleep":  # the harness's own hang detection is tested with this
            time.sleep(float(req["s"]))
            res = {"outcome": "ok"}
        elif req.get("op") == "abort":  # ... and its crash detection with this (SIGABRT, as an assert)
            os.abort()
        elif kind == "loader":
            res = _work_loader(req)
        else:
            res = _work_python(req)
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


class Worker:
    """A long-lived worker subprocess with a per-request timeout."""

    def __init__(self, kind: str, log_path: Path, mem_limit: int = 2 << 30):
        self.kind, self.log_path, self.mem_limit = kind, log_path, mem_limit
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def _start(self):
        log = open(self.log_path, "w+b")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}

        def limits():
            import resource
            os.setsid()
            resource.setrlimit(resource.RLIMIT_AS, (self.mem_limit, self.mem_limit))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash is reported, not dumped

        self.proc = subprocess.Popen([sys.executable, "-m", "oscar_gguf.fuzz", "--worker", self.kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     env=env, preexec_fn=limits)
        log.close()
        self._buf = b""

    def request(self, req: dict, timeout: float) -> dict:
        """{"outcome": ok|refused|bug|crash|hang, "detail": ...}."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return {"outcome": "hang", "detail": f"no answer in {timeout:.0f} s; log: {self._log_tail()}"}
            r, _, _ = select.select([fd], [], [], min(left, 1.0))
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return self._died()
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            self.kill()
            return {"outcome": "crash", "detail": f"garbled answer {line[:100]!r}; log: {self._log_tail()}"}

    def _died(self) -> dict:
        rc = self.proc.wait(timeout=30)
        self.restarts += 1
        self.proc = None
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        return {"outcome": "crash", "detail": f"worker died ({how}); log: {self._log_tail()}"}

    def _log_tail(self) -> str:
        """The lines that say why (an assert, an error), else the last few."""
        try:
            lines = Path(self.log_path).read_bytes().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        why = [ln for ln in lines if any(k in ln for k in ("GGML_ASSERT", "GGML_ABORT", "error", "Error", "terminate"))]
        return " | ".join((why[:3] or lines[-4:]))[-600:]

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None
        self.restarts += 1

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.proc = None
