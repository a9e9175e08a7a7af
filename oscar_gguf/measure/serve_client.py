"""The client side of `oscar bench --serve`: concurrent streaming completions against a
llama-server, the time each token reached its client, and the figures made from those times.

Each client is a thread with its own HTTP connection, opened before a barrier releases them
all at once, so that connecting is not timed. A client posts to /completion with
"stream": true and reads the server-sent events as they come; an event's tokens_predicted
(the server's count of tokens generated so far) says how many tokens it brought. An event
that brings k tokens (a character split over tokens is held back until it is whole) counts
as k arrivals at its own time, which the inter-token figures spread evenly over its wait.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

REQUEST_TIMEOUT_S = 600.0  # longest wait for one event: a long prompt on a slow machine


class ClientError(RuntimeError):
    """A completion that failed or ended early; the message says which client and why."""


@dataclass
class ClientRun:
    """One client's request: when it was sent and when each generated token arrived
    (time.perf_counter seconds)."""
    index: int
    prompt_tokens: int
    t_send: float = 0.0
    token_times: list[float] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.t_send

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RoundStats:
    """What one round of concurrent clients measured; times in milliseconds."""
    decode_tokens_per_s: float
    ttft_p50_ms: float
    ttft_max_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    wall_ms: float
    client_tokens: list[int]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the two nearest ranks."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stream_completion(port: int, prompt: list[int], n_predict: int, run: ClientRun,
                      start: threading.Barrier, timeout: float = REQUEST_TIMEOUT_S) -> None:
    """Post one streaming, greedy completion of exactly n_predict tokens and fill in run."""
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "stream": True, "temperature": 0,
                       "ignore_eos": True, "cache_prompt": False})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.connect()
        start.wait()
        run.t_send = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ClientError(f"client {run.index}: HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}")
        seen = 0
        while True:
            line = resp.readline()
            now = time.perf_counter()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise ClientError(f"client {run.index}: {event['error']}")
            got = int(event.get("tokens_predicted", seen))
            if got > seen:
                prev = run.token_times[-1] if run.token_times else now
                k = got - seen
                run.token_times += [prev + (now - prev) * (i + 1) / k for i in range(k)]
                seen = got
            if event.get("stop"):
                break
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise ClientError(f"client {run.index}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()


def run_clients(port: int, prompts: Sequence[list[int]], n_predict: int,
                timeout: float = REQUEST_TIMEOUT_S) -> list[ClientRun]:
    """One streaming completion per prompt, all sent at once; every client's run, or the
    first client's error once all have ended."""
    runs = [ClientRun(i, len(p)) for i, p in enumerate(prompts)]
    start = threading.Barrier(len(prompts))
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            stream_completion(port, prompts[i], n_predict, runs[i], start, timeout)
        except BaseException as e:  # reported by the caller; a broken barrier frees the others
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return runs


def round_stats(runs: Sequence[ClientRun], n_predict: int) -> RoundStats:
    """Aggregate decode rate, time to first token and inter-token latency of one round.

    Decode tokens/s: the tokens after each client's first (the first comes out of the
    prefill), over the time from the earliest first token to the latest last token.
    Raises ClientError when a client received fewer or more tokens than asked for.
    """
    for r in runs:
        if r.n_tokens != n_predict:
            raise ClientError(f"client {r.index} received {r.n_tokens} of {n_predict} tokens")
    decode_s = max(r.token_times[-1] for r in runs) - min(r.token_times[0] for r in runs)
    if n_predict < 2 or decode_s <= 0:
        raise ValueError("a decode rate needs at least 2 tokens per client, streamed apart")
    decoded = sum(r.n_tokens - 1 for r in runs)
    ttfts = [r.ttft * 1e3 for r in runs]
    gaps = [g * 1e3 for r in runs for g in r.gaps()]
    wall = max(r.token_times[-1] for r in runs) - min(r.t_send for r in runs)
    return RoundStats(decode_tokens_per_s=decoded / decode_s,
                      ttft_p50_ms=percentile(ttfts, 50), ttft_max_ms=max(ttfts),
                      itl_p50_ms=percentile(gaps, 50), itl_p99_ms=percentile(gaps, 99),
                      wall_ms=wall * 1e3, client_tokens=[r.n_tokens for r in runs])
