"""`oscar bench --serve`: llama-server under concurrent streaming clients, per KV type.

For each KV type and each client count N, llama-server starts with -np N (one KV stream
per slot, as llama-server lays out an explicit -np) and N clients ask it at once; then it
starts once more without -np, as it starts when not told otherwise (4 slots on one unified
KV cache), and serves each N in turn. Every type runs with flash attention on (oscar2 needs it) and the
same prompts, generation length and context per slot, so the rows compare like with like.

Prompts are token slices of the shipped held-out text, each starting at its own offset, so
no two requests share a prefix the server could reuse (cache_prompt is off as well). Each
round follows a short warm-up round of the same width, which leaves graph allocation and
first-touch costs out of the figures. How tokens are timed: serve_client.py.
"""
from __future__ import annotations

import datetime as _dt
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..atomic import write_text_atomic
from ..runtime import LlamaServer
from .bench import DEFAULT_TYPES
from .kv_memory import storage_bits
from .result_tables import ResultTable
from .serve_client import ClientError, RoundStats, round_stats, run_clients
from .texts import EVAL_TEXT
from .tool_runs import EvalError, last_error_line, load_model_info, machine_description, output_folder

DEFAULT_CLIENTS = (1, 4)
DEFAULT_PROMPT, DEFAULT_GEN = 512, 64
DEFAULT_SLOTS = 4      # llama-server without -np: n_parallel = -1 becomes 4 slots, kv_unified = true
CTX_PAD = 256          # the context per slot is rounded up to llama.cpp's KV padding
WARMUP_PROMPT, WARMUP_GEN = 16, 4
START_TIMEOUT_S = 300  # loading an 8B model onto a GPU
# flags this tool sets itself; passed again through the extra arguments they would disagree
OWNED_FLAGS = ("-m", "--model", "-np", "--parallel", "-c", "--ctx-size", "-ctk", "--cache-type-k",
               "-ctv", "--cache-type-v", "-fa", "--flash-attn", "-kvu", "--kv-unified", "-no-kvu",
               "--no-kv-unified", "--host", "--port")
_ERROR_LINE_RE = re.compile(r"^\s*[\d.]+ E (.+)$", re.M)  # llama.cpp's log: time, level, text
_SLOTS_RE = re.compile(r"n_slots = (\d+), n_ctx_slot = \d+, kv_unified = '(\w+)'")


@dataclass
class ServeRow(RoundStats):
    """One round's figures, and the server and clients that gave them."""
    kv_type: str
    slots: str                 # "-np 4", or "default" (no -np)
    n_slots: int | None        # as the server logged them
    kv_unified: bool | None
    clients: int
    prompt_tokens: int
    gen_tokens: int
    ratio_vs_f16: float | None = None
    itl_p99_vs_f16: float | None = None


_COLUMNS = ("slots", "KV cache", "clients", "KV type", "decode t/s", "vs f16", "TTFT p50 ms", "TTFT max ms",
            "ITL p50 ms", "ITL p99 ms", "p99 vs f16")


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _cells(r: ServeRow) -> list[str]:
    cache = "?" if r.kv_unified is None else ("unified" if r.kv_unified else "per sequence")
    slots = f"default ({r.n_slots})" if r.slots == "default" and r.n_slots else r.slots
    return [slots, cache, str(r.clients), r.kv_type, f"{r.decode_tokens_per_s:.1f}", _ratio(r.ratio_vs_f16),
            f"{r.ttft_p50_ms:.1f}", f"{r.ttft_max_ms:.1f}", f"{r.itl_p50_ms:.2f}", f"{r.itl_p99_ms:.2f}",
            _ratio(r.itl_p99_vs_f16)]


class ServeResult(ResultTable):
    TITLE, N_LEFT = "oscar bench --serve", 4

    def caption(self) -> str:
        m = self.meta
        return (f"llama-server -fa on, {m.get('prompt_tokens')} prompt tokens and {m.get('gen_tokens')} generated "
                f"tokens per client, context {m.get('ctx_per_slot')} per slot")

    def table(self) -> list[list[str]]:
        return [list(_COLUMNS)] + [_cells(r) for r in self.rows]


def _add_ratios(rows: list[ServeRow]) -> None:
    base = {(r.slots, r.clients): r for r in rows if r.kv_type == "f16"}
    for r in rows:
        b = base.get((r.slots, r.clients))
        r.ratio_vs_f16 = r.decode_tokens_per_s / b.decode_tokens_per_s if b else None
        r.itl_p99_vs_f16 = r.itl_p99_ms / b.itl_p99_ms if b and b.itl_p99_ms > 0 else None


class _Prompts:
    """Token slices of the held-out text, each from its own offset, for `total` requests."""

    def __init__(self, longest: int, total: int):
        self.longest, self.total = longest, total
        self.tokens: list[int] = []
        self.used = 0

    def load(self, srv: LlamaServer) -> None:
        """The held-out text, tokenized by the server's model (once per run)."""
        if not self.tokens:
            text = EVAL_TEXT.read_text(encoding="utf-8", errors="replace")
            self.use(srv.post("/tokenize", {"content": text})["tokens"])

    def use(self, tokens: list[int]) -> None:
        """Offsets a stride apart within one copy of the text, so that even where the text is
        repeated to fit the longest prompt, no two of them land on the same place of it."""
        if len(tokens) < self.total:
            raise ValueError(f"the text has {len(tokens)} tokens, fewer than the {self.total} prompts")
        self.stride = min(self.longest, len(tokens) // self.total)
        self.tokens = tokens * (1 + -(-self.longest // len(tokens)))

    def take(self, n: int, length: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            at = self.used * self.stride
            out.append(self.tokens[at:at + length])
            self.used += 1
        return out


def _check_args(info, kv_types: Sequence[str], clients: Sequence[int], prompt_tokens: int, gen_tokens: int,
                extra_args: Sequence[str]) -> None:
    if not kv_types:
        raise EvalError("no KV types given")
    for t in kv_types:
        storage_bits(t, info)  # unknown types fail here, before any server starts
    if not clients or any(n < 1 for n in clients):
        raise EvalError("-np needs client counts of at least 1")
    if prompt_tokens < 1 or gen_tokens < 2:
        raise EvalError("need --prompt-tokens >= 1 and --gen-tokens >= 2")
    owned = [a for a in extra_args if a.split("=")[0] in OWNED_FLAGS]
    if owned:
        raise EvalError(f"{owned[0]} is set by oscar bench --serve itself; leave it out of the extra arguments")


def context_per_slot(prompt_tokens: int, gen_tokens: int, ctx: int | None) -> int:
    """The context each slot gets: room for the prompt and every generated token (the server
    stops a slot one token before its context is full), rounded up to the KV padding."""
    need = prompt_tokens + gen_tokens + 1
    if ctx is None:
        return -(-need // CTX_PAD) * CTX_PAD
    if ctx < need:
        raise EvalError(f"--ctx {ctx} cannot hold {prompt_tokens} prompt + {gen_tokens} generated tokens")
    return ctx


def run_serve(model: str | Path, kv_types: Sequence[str] = DEFAULT_TYPES, clients: Sequence[int] = DEFAULT_CLIENTS,
              prompt_tokens: int = DEFAULT_PROMPT, gen_tokens: int = DEFAULT_GEN, ctx: int | None = None,
              ngl: int | None = 99, n_threads: int | None = None, extra_args: Sequence[str] = (),
              oscar_args: Sequence[str] = (),
              out_dir: str | Path = "oscar-bench", progress: bool = True, command: str | None = None,
              log: Callable[[str], None] | None = None) -> ServeResult:
    """Every KV type under each client count, with -np N and with the default slots; writes
    serve.json, serve.md and serve.txt. A server that fails or a client that gets fewer tokens
    than asked is an EvalError naming the reason and the server's log."""
    model, info = load_model_info(model)
    _check_args(info, kv_types, clients, prompt_tokens, gen_tokens, extra_args)
    kv_types, clients = list(dict.fromkeys(kv_types)), list(dict.fromkeys(clients))
    per_slot = context_per_slot(prompt_tokens, gen_tokens, ctx)
    out_dir = output_folder(out_dir)
    say = log or (lambda m: print(m, file=sys.stderr))
    if prompt_tokens + gen_tokens > info.n_ctx_train:
        say(f"note: {prompt_tokens + gen_tokens} tokens per client go past the model's trained context "
            f"({info.n_ctx_train})")
    if any(t.startswith("oscar2") for t in kv_types) and not info.has_rotations:
        say("note: the model has no OSCAR rotations; oscar2 runs with the Hadamard fallback "
            "(the same speed, lower quality)")

    common = ["-fa", "on", "--no-webui", *(["-ngl", str(ngl)] if ngl is not None else []),
              *(["-t", str(n_threads), "-tb", str(n_threads)] if n_threads else []), *extra_args]
    prompts = _Prompts(prompt_tokens, total=len(kv_types) * 4 * sum(clients))
    res = ServeResult()
    t0 = time.monotonic()
    for t in kv_types:
        type_args = [*common, "-ctk", t, "-ctv", t, *(oscar_args if t.startswith("oscar2") else ())]
        layouts = [(f"-np {n}", ["-np", str(n), "-c", str(n * per_slot)], [n]) for n in clients]
        layouts.append(("default", ["-c", str(DEFAULT_SLOTS * per_slot)], clients))
        for label, layout_args, rounds in layouts:
            log_path = out_dir / "logs" / f"serve-{t}-{label.replace(' ', '').lstrip('-')}.log"
            for n, stats, (n_slots, unified) in _serve(model, [*type_args, *layout_args], rounds, log_path,
                                                        prompts, prompt_tokens, gen_tokens, f"{t}, {label}"):
                res.rows.append(ServeRow(**asdict(stats), kv_type=t, slots=label, n_slots=n_slots,
                                         kv_unified=unified, clients=n, prompt_tokens=prompt_tokens,
                                         gen_tokens=gen_tokens))
                if progress:
                    say(f"[oscar bench --serve] {t}, {label}, {n} clients: {stats.decode_tokens_per_s:.1f} tokens/s, "
                        f"TTFT p50 {stats.ttft_p50_ms:.0f} ms, ITL p99 {stats.itl_p99_ms:.1f} ms")
    order = {t: i for i, t in enumerate(kv_types)}
    res.rows.sort(key=lambda r: (r.slots == "default", r.clients, order[r.kv_type]))
    _add_ratios(res.rows)
    res.meta = {"model": str(model), "arch": info.arch, "n_layer": info.n_layer, "has_rotations": info.has_rotations,
                "kv_types": list(kv_types), "clients": clients, "prompt_tokens": prompt_tokens,
                "gen_tokens": gen_tokens, "ctx_per_slot": per_slot, "default_slots": DEFAULT_SLOTS,
                "text": EVAL_TEXT.name, "ngl": ngl, "threads": n_threads, "extra_args": list(extra_args),
                "oscar_args": list(oscar_args),
                "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": machine_description(), "command": command, "seconds": round(time.monotonic() - t0, 1)}
    save_serve(res, out_dir)
    return res


def _serve(model: Path, args: list[str], rounds: Sequence[int], log_path: Path, prompts: _Prompts,
           prompt_tokens: int, gen_tokens: int, what: str) -> list[tuple[int, RoundStats, tuple]]:
    """One llama-server: a warm-up and a measured round for each client count in rounds;
    (clients, figures, (slots, unified cache) as the server logged them) of each."""
    out = []
    try:
        with LlamaServer(model, args, start_timeout=START_TIMEOUT_S, log_path=log_path) as srv:
            prompts.load(srv)
            for n in rounds:
                run_clients(srv.port, prompts.take(n, WARMUP_PROMPT), WARMUP_GEN)
                runs = run_clients(srv.port, prompts.take(n, prompt_tokens), gen_tokens)
                out.append((n, round_stats(runs, gen_tokens)))
    except (RuntimeError, OSError, ValueError) as e:  # ClientError is a RuntimeError, TimeoutError an OSError
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        cause = server_error_line(text)
        if isinstance(e, (ClientError, ValueError)):
            why = f"{what}: {e}" + (f"; the server logged: {cause}" if cause else "")
        else:
            why = f"llama-server ({what}) failed: {cause or (last_error_line(text) if text.strip() else e)}"
        raise EvalError(f"{why} (log: {log_path})") from None
    m = _SLOTS_RE.search(log_path.read_text(errors="replace"))
    layout = (int(m[1]), m[2] == "true") if m else (None, None)
    return [(n, stats, layout) for n, stats in out]


def server_error_line(log: str) -> str:
    """The first line llama-server logged at error level, without its time: the cause (the
    lines after it tell its consequences, down to "exiting due to model loading error")."""
    m = _ERROR_LINE_RE.search(log)
    return m[1].strip()[:240] if m else ""


def save_serve(res: ServeResult, out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    return {"json": write_text_atomic(out_dir / "serve.json", res.to_json()),
            "md": write_text_atomic(out_dir / "serve.md", res.to_markdown() + "\n"),
            "txt": write_text_atomic(out_dir / "serve.txt", res.to_text() + "\n")}
