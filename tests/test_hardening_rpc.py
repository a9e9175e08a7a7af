"""Issue 9: oscar2, rotations and the window across llama.cpp's RPC backend, on loopback.

Two `ggml-rpc-server` processes (CPU backend, 127.0.0.1, distinct ports) hold the bundled model's
layers; llama-server is the client (`--rpc a,b -ngl 99`). Greedy answers must equal the
single-process run for f16, oscar2 without the window, and oscar2 with rotations + window.

What travels: the bytes per generated token are read from the kernel's per-socket counters
(`ss -ti`: bytes_sent/bytes_received of the rpc-servers' sockets), as the difference between two
requests that differ only in n_predict. The window's rows are stored in the buffer of the layer's
cache and attended where the layer is (an RPC device takes FLASH_ATTN_EXT with window rows,
ggml_oscar_backend_reads_window), so with the window only activations, small index inputs and the
graph cross the network, as without it.
"""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gguf_fixtures import with_rotations
from hardening_figures import record
from oscar_gguf.paths import MissingComponentError, tool_path
from oscar_gguf.runtime import LlamaServer, free_port, run_tool

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
N_SHORT, N_LONG = 4, 20
CONFIGS = {
    "f16": ["-fa", "on"],
    "oscar2": ["-fa", "on", "-ctk", "oscar2", "-ctv", "oscar2", "--oscar-sink", "0", "--oscar-recent", "0"],
    "oscar2+window": ["-fa", "on", "-ctk", "oscar2", "-ctv", "oscar2", "--oscar-sink", "16", "--oscar-recent", "64"],
}


def rpc_server_binary() -> Path:
    try:
        return tool_path("ggml-rpc-server")
    except MissingComponentError as e:
        pytest.skip(f"no RPC build: {e}")


class RpcServers:
    """n ggml-rpc-server processes on 127.0.0.1, stopped on exit."""

    def __init__(self, n: int = 2, threads: int = 1):
        self.exe = rpc_server_binary()
        self.ports = [free_port() for _ in range(n)]
        self.threads = threads
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        try:
            for p in self.ports:
                self.procs.append(subprocess.Popen([str(self.exe), "-H", "127.0.0.1", "-p", str(p), "-t", str(self.threads)],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for p in self.ports:
                self._wait_port(p, 30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_port(self, port: int, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(pr.poll() is not None for pr in self.procs):
                raise RuntimeError("an rpc-server exited during start")
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"rpc-server on port {port} did not listen in {timeout} s")

    def __exit__(self, *exc):
        for pr in self.procs:
            if pr.poll() is None:
                pr.terminate()
        for pr in self.procs:
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait(timeout=10)

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def socket_bytes(self) -> tuple[int, int] | None:
        """(sent by the rpc-servers, received by them), summed over their TCP sockets."""
        if shutil.which("ss") is None:
            return None
        flt = " or ".join(f"sport = :{p}" for p in self.ports)
        out = subprocess.run(["ss", "-tin", "state", "established", f"( {flt} )"], capture_output=True,
                             text=True, timeout=10).stdout
        return (sum(int(x) for x in re.findall(r"bytes_sent:(\d+)", out)),
                sum(int(x) for x in re.findall(r"bytes_received:(\d+)", out)))


@pytest.fixture(scope="module")
def model(bundled_model, tmp_path_factory):
    rpc_server_binary()
    return with_rotations(bundled_model, tmp_path_factory.mktemp("rpc") / "random.gguf", "random")


def complete(srv, prompt, n):
    return srv.post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False,
                                    "ignore_eos": True}, timeout=300)


def test_rpc_split_matches_single_process(model, tmp_path):
    base = ["-c", "512", "-np", "1", "-t", "1", "--no-warmup"]
    figures = {}
    with RpcServers(2) as rpc:
        for name, extra in CONFIGS.items():
            with LlamaServer(model, base + extra, start_timeout=180) as srv:
                local = [complete(srv, p, N_LONG)["content"] for p in PROMPTS]
            log = tmp_path / f"{name}.log"
            with LlamaServer(model, base + extra + ["--rpc", rpc.endpoints, "-ngl", "99", "-lv", "4"], start_timeout=180,
                             log_path=log) as srv:
                remote = [complete(srv, p, N_LONG)["content"] for p in PROMPTS]
                # bytes per token: two requests that differ only in the number of generated tokens
                b0 = rpc.socket_bytes()
                r_short = complete(srv, PROMPTS[1], N_SHORT)
                b1 = rpc.socket_bytes()
                r_long = complete(srv, PROMPTS[1], N_LONG)
                b2 = rpc.socket_bytes()
            text = log.read_text(errors="replace")
            # the layers really are split: model and KV buffers on both endpoints
            for p in rpc.ports:
                assert re.search(rf"127\.0\.0\.1:{p}\] model buffer size", text), f"no model buffer on :{p}"
                assert re.search(rf"127\.0\.0\.1:{p}\] KV buffer size", text), f"no KV buffer on :{p}"
            if name == "oscar2+window":
                assert "oscar window buffer size" in text
            assert remote == local, f"{name}: RPC answers differ from the single process"
            fig = {"equal": True}
            if b0 is not None:
                dn = r_long["tokens_predicted"] - r_short["tokens_predicted"]
                fig["down_bytes_per_token"] = round(((b2[0] - b1[0]) - (b1[0] - b0[0])) / dn)
                fig["up_bytes_per_token"] = round(((b2[1] - b1[1]) - (b1[1] - b0[1])) / dn)
                fig["tokens_per_s"] = round(r_long["timings"]["predicted_per_second"], 1)
            figures[name] = fig
    record("rpc_loopback", figures)
    if all("down_bytes_per_token" in f for f in figures.values()):
        # attention where the layer is: the window adds index inputs, not the caches' rows (which
        # would be megabytes per token here)
        assert figures["oscar2+window"]["down_bytes_per_token"] < 2 * figures["oscar2"]["down_bytes_per_token"]
        assert figures["oscar2+window"]["up_bytes_per_token"] < 2 * figures["oscar2"]["up_bytes_per_token"]


def test_rpc_attention_placement_with_the_window(model):
    """The scheduler's own split list (GGML_SCHED_DEBUG=1): with the window, no split on the client's
    CPU is fed with a layer's cache or window rows; the layers' splits run on both servers and take
    the window's index inputs there."""
    with RpcServers(2) as rpc:
        r = run_tool("llama-cli", ["-m", model, "--rpc", rpc.endpoints, "-ngl", "99", "-p", "Hello", "-n", "2",
                                   "-c", "512", "-st", "-t", "1", *CONFIGS["oscar2+window"], "-v"],
                     timeout=300, check=False, env={"GGML_SCHED_DEBUG": "1"})
        endpoints = rpc.endpoints.split(",")
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    log = r.stdout + r.stderr
    splits = re.findall(r"## SPLIT #\d+: (\S+) # \d+ inputs(.*)", log)
    assert splits, "no scheduler debug output"
    assert not [dev for dev, s in splits if re.search(r"cache_[kv]_l\d+|oscar_window_[kv]_l\d+", s)], \
        "a split pulls cache or window rows"
    for ep in endpoints:
        assert any(dev == f"RPC0[{ep}]" and "oscar_window_idxs" in s for dev, s in splits), f"no window split on {ep}"
