"""Issue 9: llama-server with oscar2 + the window under load and under faults (loopback, bounded).

Load: -np 8, a bounded concurrent client (OSCAR_LOAD_REQUESTS requests, default 32, 8 at a time),
mixed prompt lengths, every 8th request streamed and dropped after two chunks. Everything must
complete, every finished greedy answer must keep to the same request sent alone (up to a near-tie,
see TIE_NATS), the server must end idle, and its RSS must stay flat from the first round to the
second.

Faults: a client that disconnects mid-generation, a request larger than the context, a full KV
cache with context shift disabled, SIGTERM during generation, and a saved slot restored under a
mismatching setting.

Figures (throughput, latency percentiles, RSS) are printed and, when $OSCAR_HARDENING_OUT names a
file, merged into it as JSON (docs/hardening.md quotes them).
"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest

from gguf_fixtures import with_rotations
from hardening_figures import record
from oscar_gguf.runtime import LlamaServer

THREADS = "1"  # one thread: robust when the 2 cores are shared (ggml threads spin at barriers)
N_REQUESTS = int(os.environ.get("OSCAR_LOAD_REQUESTS", "32"))  # 64 for the figures in docs/hardening.md
CONCURRENCY = 8
N_PREDICT = int(os.environ.get("OSCAR_LOAD_PREDICT", "12"))
RSS_TOLERANCE_MIB = 24.0  # growth allowed from the end of round 1 to the end of round 2
HTTP_TIMEOUT = 300.0
OSCAR_WINDOW = ["-ctk", "oscar2", "-ctv", "oscar2", "-fa", "on", "--oscar-sink", "16", "--oscar-recent", "64"]

# mixed prompt lengths: a few words, a paragraph, a page (about 8, 60 and 240 tokens)
_PARA = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
         "and listening to the waves that broke against the rocks below. ")
PROMPTS = [
    "The capital of France is", "List three colors:", "Water boils at", "Once upon a time,",
    "In mathematics, a prime number is" + "", "The best way to learn to cook is",
    _PARA, _PARA + "One night he saw", _PARA * 2 + "Then", "Dear diary, today I",
    _PARA * 6 + "At dawn,", _PARA * 5 + "The ship", "Recipe for bread:", _PARA * 3,
    "Q: What is the largest planet?\nA:", _PARA * 4 + "Suddenly",
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def body(prompt: str, n: int = N_PREDICT, **kw) -> dict:
    # cache_prompt off: every comparison here is fresh vs fresh; the prompt cache has its own
    # test (test_prompt_cache_reuse_is_exact_or_starts_over)
    return {"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 1, "cache_prompt": False, **kw}


LONG = dict(ignore_eos=True)  # a generation that does not end before the test acts on it
GREEDY = dict(n_probs=5)      # each step's top five tokens, for keeps_to

# A request sent beside others may reach the model in other ubatches than when sent alone (the
# server splits and batches the prompts of its slots as they come), and llama.cpp's CPU flash
# attention sums differently by ubatch: 64 query rows or more take its tiled path, fewer the
# row-by-row one, for an f16 cache as well (which parts from its sequential answers too). So a
# greedy answer keeps to its sequential run up to a step where it takes a token that the run
# rated within TIE_NATS of its own choice, a near-tie: twice the largest change of a top token's
# log-probability between the ubatch shapes (0.37 nats: these prompts sent alone with ubatches of
# 512 and of 16 tokens, on the steps before any parting; 0.14 with an f16 cache:
# benchmarks/server_partings.py).
TIE_NATS = 0.75


def steps(r: dict) -> list[tuple[int, dict[int, float]]]:
    """Per generated token: its id and the log-probabilities of the step's top tokens."""
    return [(p["id"], {t["id"]: t["logprob"] for t in p["top_logprobs"]}) for p in r.get("completion_probabilities", [])]


def parting(alone: list[tuple[int, dict[int, float]]], beside: list[tuple[int, dict[int, float]]]):
    """The first step where `beside` takes another token than `alone`, as (step, alone's token,
    beside's token, by how much alone's choice led it in alone's top tokens), or None."""
    for i, ((a, top), (b, _)) in enumerate(zip(alone, beside)):
        if a != b:
            return i, a, b, top[a] - top[b] if b in top else float("inf")
    return None


def keeps_to(alone: list[tuple[int, dict[int, float]]], beside: list[tuple[int, dict[int, float]]]) -> str | None:
    """None where `beside` is `alone`, or parts from it at a near-tie; else how it parts."""
    p = parting(alone, beside)
    if p is not None:
        i, a, b, lead = p
        return None if lead < TIE_NATS else f"step {i}: token {b} where alone {a} led it by {lead:.3f} nats"
    return None if len(alone) == len(beside) else f"{len(beside)} tokens where alone {len(alone)}"


def post(port: int, path: str, payload: dict, timeout: float = HTTP_TIMEOUT) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def stream_and_drop(port: int, payload: dict, after_chunks: int = 2, timeout: float = HTTP_TIMEOUT) -> int:
    """Stream a completion, read `after_chunks` content events, then close the connection."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/completion", json.dumps({**payload, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        got = 0
        while got < after_chunks:
            line = r.fp.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                got += 1
        return got
    finally:
        c.close()  # the disconnect: the server must notice and free the slot


def wait_idle(srv: LlamaServer, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not any(s.get("is_processing") for s in srv.get("/slots")):
                return True
        except OSError:
            pass
        time.sleep(0.25)
    return False


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


@pytest.fixture(scope="module")
def model(bundled_model, tmp_path_factory):
    return with_rotations(bundled_model, tmp_path_factory.mktemp("srv") / "random.gguf", "random")


# ---- load ------------------------------------------------------------------------------------------

def run_round(port: int, jobs: list[tuple[int, bool]]) -> dict:
    """jobs: (prompt index, cancel?). Returns per-request results and the round's wall time."""
    results: dict[int, dict] = {}

    def one(i: int, pi: int, cancel: bool):
        t0 = time.monotonic()
        if cancel:
            got = stream_and_drop(port, body(PROMPTS[pi], n=200, **LONG))
            return i, {"cancelled": True, "chunks": got, "latency": time.monotonic() - t0}
        status, r = post(port, "/completion", body(PROMPTS[pi], **GREEDY))
        return i, {"status": status, "content": r.get("content"), "steps": steps(r), "n": r.get("tokens_predicted", 0),
                   "latency": time.monotonic() - t0, "prompt": pi}

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(CONCURRENCY) as ex:
        futs = [ex.submit(one, i, pi, c) for i, (pi, c) in enumerate(jobs)]
        for f in cf.as_completed(futs, timeout=HTTP_TIMEOUT * 2):
            i, r = f.result()
            results[i] = r
    return {"results": results, "wall": time.monotonic() - t0}


def test_server_under_load(model):
    args = ["-c", "4096", "-np", str(CONCURRENCY), "-t", THREADS, "--no-warmup", *OSCAR_WINDOW]
    jobs = [(i % len(PROMPTS), i % 8 == 7) for i in range(N_REQUESTS)]
    with LlamaServer(model, args, start_timeout=180) as srv:
        alone = {}
        for pi in sorted({pi for pi, c in jobs if not c}):
            status, r = post(srv.port, "/completion", body(PROMPTS[pi], **GREEDY))
            assert status == 200, r
            alone[pi] = (r["content"], steps(r))
        rss = [rss_mib(srv.proc.pid)]
        rounds = []
        for _ in range(2):
            rd = run_round(srv.port, jobs)
            assert wait_idle(srv), "slots still busy after the round (a dropped stream was not freed?)"
            rss.append(rss_mib(srv.proc.pid))
            rounds.append(rd)
        assert srv.get("/health")["status"] == "ok"

    figures = {"requests_per_round": N_REQUESTS, "concurrency": CONCURRENCY, "n_predict": N_PREDICT,
               "threads": int(THREADS), "rss_mib": [round(x, 1) for x in rss]}
    mismatches, at_ties = [], 0
    for k, rd in enumerate(rounds):
        res = rd["results"]
        assert len(res) == N_REQUESTS, "every request must complete"
        done = [r for r in res.values() if not r.get("cancelled")]
        cancelled = [r for r in res.values() if r.get("cancelled")]
        assert all(r["status"] == 200 for r in done)
        assert all(r["chunks"] >= 1 for r in cancelled), "a streamed request produced nothing before the drop"
        for r in done:
            text, st = alone[r["prompt"]]
            if r["content"] != text:
                how = keeps_to(st, r["steps"])
                if how is None:
                    at_ties += 1
                else:
                    mismatches.append((r["prompt"], how, r["content"], text))
        lat = [r["latency"] for r in done]
        toks = sum(r["n"] for r in done)
        figures[f"round{k + 1}"] = {"wall_s": round(rd["wall"], 2), "completed": len(done), "cancelled": len(cancelled),
                                    "generated_tokens": toks, "tokens_per_s": round(toks / rd["wall"], 1),
                                    "requests_per_s": round(len(done) / rd["wall"], 2),
                                    "latency_p50_s": round(statistics.median(lat), 2),
                                    "latency_p90_s": round(percentile(lat, 0.90), 2),
                                    "latency_p99_s": round(percentile(lat, 0.99), 2)}
    figures["greedy_mismatches"] = len(mismatches)
    figures["greedy_partings_at_near_ties"] = at_ties
    record("server_load", figures)
    assert not mismatches, f"{len(mismatches)} answers part from the sequential run other than at a near-tie, e.g. {mismatches[0]}"
    growth = rss[2] - rss[1]
    assert growth <= RSS_TOLERANCE_MIB, f"RSS grew by {growth:.1f} MiB from round 1 to round 2 ({rss})"


# ---- faults ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_server(model, tmp_path_factory):
    """One slot, 256 cells, no context shift, slots saved under a folder; ubatches of 32, so that
    the window's slot pool (sink + recent + one ubatch) is smaller than the cache."""
    slots = tmp_path_factory.mktemp("slots")
    args = ["-c", "256", "-np", "1", "-ub", "32", "-t", THREADS, "--no-warmup", "--no-context-shift",
            "--slot-save-path", str(slots), *OSCAR_WINDOW]
    with LlamaServer(model, args, start_timeout=180, log_path=slots.parent / "small-server.log") as srv:
        srv.slots = slots
        yield srv


def test_client_disconnect_mid_generation(small_server):
    srv = small_server
    _, before = post(srv.port, "/completion", body("The capital of France is", 8))
    t0 = time.monotonic()
    assert stream_and_drop(srv.port, body("Tell me a long story about a dragon.", 150, **LONG), after_chunks=3) == 3
    assert wait_idle(srv, 60), "the slot kept generating for a client that left"
    freed_s = time.monotonic() - t0
    status, after = post(srv.port, "/completion", body("The capital of France is", 8))
    assert status == 200 and after["content"] == before["content"]
    record("fault_disconnect", {"slot_idle_after_s": round(freed_s, 2)})


def test_request_larger_than_the_context(small_server):
    status, r = post(small_server.port, "/completion", body("word " * 400, 4))
    assert status == 400
    assert r["error"]["type"] == "exceed_context_size_error" and "exceeds the available context size" in r["error"]["message"]
    assert small_server.get("/health")["status"] == "ok"


def test_full_kv_cache_without_context_shift_stops_cleanly(small_server):
    """The slot fills (prompt + generated = 256 cells): generation stops with stop_type "limit" and
    truncated=true, the text is the model's own continuation up to that point, and the slot serves
    the next request normally."""
    prompt = "The history of the city of Paris begins " * 16
    status, r = post(small_server.port, "/completion", body(prompt, 400, **LONG))
    assert status == 200, r
    assert r["stop"] is True and r["stop_type"] == "limit" and r["truncated"] is True
    assert r["tokens_evaluated"] + r["tokens_predicted"] <= 256
    assert r["tokens_predicted"] > 0 and "\ufffd" not in r["content"]
    # the same prompt with a budget that fits: the answer is a prefix of what the full run made
    status, short = post(small_server.port, "/completion", body(prompt, 8))
    assert status == 200 and r["content"].startswith(short["content"])


def test_slot_restore_under_mismatching_settings_is_refused(model, small_server, tmp_path):
    srv = small_server
    status, r = post(srv.port, "/completion", body("The capital of France is", 8))
    assert status == 200
    status, saved = post(srv.port, "/slots/0?action=save", {"filename": "s.bin"})
    assert status == 200 and saved["n_saved"] > 0
    # same settings: restores
    status, ok = post(srv.port, "/slots/0?action=restore", {"filename": "s.bin"})
    assert status == 200 and ok["n_restored"] == saved["n_saved"]
    for name, extra in [("no window", ["-ctk", "oscar2", "-ctv", "oscar2", "-fa", "on", "--oscar-sink", "0",
                                       "--oscar-recent", "0"]),
                        ("f16 cache", ["-fa", "on"])]:
        log = tmp_path / f"{name.replace(' ', '_')}.log"
        with LlamaServer(model, ["-c", "256", "-np", "1", "-t", THREADS, "--no-warmup", "--slot-save-path",
                                 str(srv.slots), *extra], start_timeout=180, log_path=log) as other:
            status, r = post(other.port, "/slots/0?action=restore", {"filename": "s.bin"})
            assert status == 400, (name, r)
            assert "Unable to restore slot" in r["error"]["message"]
            assert other.get("/health")["status"] == "ok"
        text = log.read_text(errors="replace")
        if name == "no window":  # our own section says exactly what does not match
            assert "the saved state carries a high-precision window, but this context has none" in text


def test_sigterm_during_generation_exits_cleanly(model):
    """SIGTERM while a client streams and keeps its connection open: the server ends the stream
    and exits 0 (patch 0015; upstream's handler otherwise waits for the client to leave, which on
    a loaded machine it does not before the test's timeout)."""
    args = ["-c", "512", "-np", "2", "-t", THREADS, "--no-warmup", *OSCAR_WINDOW]
    srv = LlamaServer(model, args, start_timeout=180)
    with srv:
        got = {}

        def long_request():
            try:
                got["chunks"] = stream_and_drop(srv.port, body("Tell me a long story.", 400, **LONG), after_chunks=10 ** 6,
                                                timeout=120)
            except (OSError, http.client.HTTPException) as e:
                got["error"] = type(e).__name__

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(s.get("is_processing") for s in srv.get("/slots")):
            time.sleep(0.1)
        time.sleep(0.5)  # well inside the generation
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(timeout=60)
        exit_s = time.monotonic() - t0
        t.join(timeout=60)
    assert not t.is_alive(), "the client hung after the server stopped"
    assert rc == 0, f"llama-server exited with {rc} on SIGTERM"
    record("fault_sigterm", {"exit_code": rc, "exit_s": round(exit_s, 2), "client": got})


def test_prompt_cache_reuse_is_exact_or_starts_over(small_server):
    """llama-server's prompt cache with the window: the same prompt again continues from its last
    token, whose window reaches back into tokens that left the recent window while the previous
    answer was generated. After a short answer their rows are still retired in the pool and the
    reuse is exact; after a long one the pool has reused them, the cache refuses the truncation,
    and the server processes the prompt again, which it says in its log. Either way the answer
    equals a fresh one."""
    srv = small_server
    prompt = "The history of the city of Paris begins " * 16   # ~130 tokens: beyond 16 + 64
    _, fresh = post(srv.port, "/completion", body(prompt, 8))
    post(srv.port, "/completion", body(prompt, 8, cache_prompt=True))
    _, short = post(srv.port, "/completion", body(prompt, 8, cache_prompt=True))
    assert short["timings"]["cache_n"] > 100, short["timings"]
    assert short["content"] == fresh["content"]
    post(srv.port, "/completion", body(prompt, 90, cache_prompt=True, **LONG))
    _, long = post(srv.port, "/completion", body(prompt, 8, cache_prompt=True))
    assert long["timings"]["cache_n"] == 0, long["timings"]
    assert long["content"] == fresh["content"]
    assert "cannot continue exactly" in srv.log_path.read_text()
