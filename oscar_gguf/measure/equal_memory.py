"""Equal-memory throughput: under one KV budget, the most sequences of n_ctx tokens that each KV
type fits, and the aggregate decode tokens/s of each at its own maximum.

This is the comparison a server operator makes: the GPU memory left for the KV cache is fixed,
and a smaller cache holds more sequences at once. Per type and cache layout (one stream per
sequence, as llama-server lays out an explicit -np, or one unified cache, its default) the
number of sequences comes from the bytes llama.cpp allocates (kv_memory: the main cache, and for
oscar2 the f16 window store: per stream, sink + recent slots plus one micro-batch), then
llama-batched-bench fills every sequence to n_ctx - ntg tokens and decodes ntg more for all of
them at once. The KV size llama.cpp logged is reported beside the planned one, and a row whose
allocation went over the budget says so.

The plan counts every layer's cache at the type's size: it does not model a precision plan
(oscar.f16_k_layers) or an iSWA model's sliding-window cache; the logged allocation shows them.
"""
from __future__ import annotations

import datetime as _dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..atomic import write_text_atomic
from ..format.gguf_read import ModelInfo
from .kv_memory import N_UBATCH, kv_total_mib, row_bytes, window_from_args, window_rows
from .result_tables import ResultTable
from .settings import VERBOSE_LOG
from .tool_runs import EvalError, last_error_line, load_model_info, machine_description, output_folder, stream_tool

LAYOUTS = ("per-seq", "unified")  # one KV stream per sequence (-np N), or one shared (-kvu)
DEFAULT_TYPES = ("f16", "oscar2")
DEFAULT_SEQ_CTX, DEFAULT_GEN = 16384, 32
LLAMA_MAX_SEQ = 256   # llama.cpp: the most sequences a context takes (src/llama-cparams.h)


def kv_bytes_for(info: ModelInfo, cache_type: str, n_ctx: int, n_seq: int, window_tokens: int, unified: bool,
                 n_ubatch: int = N_UBATCH) -> int:
    """Bytes llama.cpp allocates for n_seq sequences of n_ctx cells: the main cache, plus for
    oscar2 with a window the f16 store (one per stream; a unified cache has one stream whose
    slots are shared: n_seq x window + one micro-batch)."""
    per_tok = info.n_layer * info.n_head_kv * (row_bytes(cache_type, info.head_dim_k)
                                               + row_bytes(cache_type, info.head_dim_v))
    main = per_tok * n_ctx * n_seq
    if not (cache_type.startswith("oscar2") and window_tokens):
        return main
    per_row = info.n_layer * info.n_head_kv * (row_bytes("f16", info.head_dim_k) + row_bytes("f16", info.head_dim_v))
    if unified:
        rows = window_rows(n_seq * window_tokens, n_seq * n_ctx, n_ubatch)
    else:
        rows = n_seq * window_rows(window_tokens, n_ctx, n_ubatch)
    return main + per_row * rows


def max_sequences(info: ModelInfo, cache_type: str, budget_bytes: float, n_ctx: int, window_tokens: int,
                  unified: bool, limit: int = LLAMA_MAX_SEQ) -> int:
    """The most sequences of n_ctx cells whose KV cache fits budget_bytes (0 if not one does)."""
    n = 0
    while n < limit and kv_bytes_for(info, cache_type, n_ctx, n + 1, window_tokens, unified) <= budget_bytes:
        n += 1
    return n


@dataclass
class EqualMemoryRow:
    kv_type: str
    layout: str
    n_seq: int
    planned_gib: float
    allocated_gib: float | None = None   # what llama.cpp logged (caches and window stores)
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    vs_f16_best: float | None = None
    note: str = ""


class EqualMemoryResult(ResultTable):
    TITLE, N_LEFT = "Equal-memory throughput", 2

    def caption(self) -> str:
        m = self.meta
        return (f"KV budget {m.get('budget_gib')} GiB, sequences of {m.get('n_ctx')} tokens "
                f"({m.get('n_prompt')} prompt + {m.get('n_gen')} decoded), llama-batched-bench -fa on")

    def table(self) -> list[list[str]]:
        head = ["KV type", "layout", "sequences", "KV GiB planned", "KV GiB allocated", "prefill t/s",
                "decode t/s", "vs f16's best", "note"]
        fmt = lambda x, f: "—" if x is None else format(x, f)
        return [head] + [[r.kv_type, r.layout, str(r.n_seq), f"{r.planned_gib:.2f}", fmt(r.allocated_gib, ".2f"),
                          fmt(r.prefill_tokens_per_s, ".1f"), fmt(r.decode_tokens_per_s, ".1f"),
                          "—" if r.vs_f16_best is None else f"{r.vs_f16_best:.2f}x", r.note] for r in self.rows]


def parse_batched_jsonl(out: str) -> dict | None:
    """The result line of llama-batched-bench --output-format jsonl."""
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            return json.loads(line)
    return None


def run_equal_memory(model: str | Path, budget_gib: float, n_ctx: int = DEFAULT_SEQ_CTX, n_gen: int = DEFAULT_GEN,
                     kv_types: Sequence[str] = DEFAULT_TYPES, layouts: Sequence[str] = LAYOUTS,
                     ngl: int | None = 99, n_threads: int | None = None, extra_args: Sequence[str] = (),
                     oscar_args: Sequence[str] = (), out_dir: str | Path = "oscar-bench-equal-memory",
                     command: str | None = None, timeout: float | None = None,
                     log: Callable[[str], None] | None = None) -> EqualMemoryResult:
    """Each type and layout at its most sequences under the budget; writes equal_memory.json,
    .md and .txt into out_dir. A tool that fails is an EvalError naming its log."""
    model, info = load_model_info(model)
    say = log or (lambda m: print(m, file=sys.stderr))
    if budget_gib <= 0 or n_ctx < 2 or not 1 <= n_gen < n_ctx:
        raise EvalError("need a positive budget, and 1 <= decoded tokens < tokens per sequence")
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise EvalError(f"unknown layout {bad[0]!r} (known: {', '.join(LAYOUTS)})")
    window = window_from_args(info, oscar_args)
    budget = budget_gib * 2**30
    out_dir = output_folder(out_dir)
    res = EqualMemoryResult()
    for t in dict.fromkeys(kv_types):
        for layout in layouts:
            unified = layout == "unified"
            w = window if t.startswith("oscar2") else 0
            try:
                n = max_sequences(info, t, budget, n_ctx, w, unified)
            except (EvalError, ValueError) as e:
                raise EvalError(f"{t}: {e}") from None
            row = EqualMemoryRow(t, layout, n, kv_bytes_for(info, t, n_ctx, n, w, unified) / 2**30)
            res.rows.append(row)
            if n == 0:
                row.note = "not one sequence fits"
                continue
            args = ["-m", str(model), "-fa", "on", "-c", str(n * n_ctx), "-npp", str(n_ctx - n_gen),
                    "-ntg", str(n_gen), "-npl", str(n), "-ctk", t, "-ctv", t, "--output-format", "jsonl", *VERBOSE_LOG,
                    *(["-kvu"] if unified else []), *(["-ngl", str(ngl)] if ngl is not None else []),
                    *(["-t", str(n_threads), "-tb", str(n_threads)] if n_threads else []), *extra_args,
                    *(oscar_args if t.startswith("oscar2") else ())]
            log_path = out_dir / "logs" / f"batched-{t}-{layout}.log"
            say(f"[equal memory] {t}, {layout}: {n} sequences, {row.planned_gib:.2f} GiB planned")
            code, out = stream_tool("llama-batched-bench", args, timeout=timeout, log_path=log_path)
            r = parse_batched_jsonl(out) if code == 0 else None
            if r is None:
                raise EvalError(f"llama-batched-bench ({t}, {layout}) failed: {last_error_line(out)} (log: {log_path})")
            mib, _ = kv_total_mib(out)
            row.allocated_gib = None if mib is None else mib / 1024
            row.prefill_tokens_per_s, row.decode_tokens_per_s = r["speed_pp"], r["speed_tg"]
            if row.allocated_gib is not None and row.allocated_gib > budget_gib:
                row.note = "allocation over the budget"
            say(f"[equal memory] {t}, {layout}: decode {row.decode_tokens_per_s:.1f} tokens/s")
    best = max((r.decode_tokens_per_s for r in res.rows if r.kv_type == "f16" and r.decode_tokens_per_s), default=None)
    for r in res.rows:
        r.vs_f16_best = r.decode_tokens_per_s / best if best and r.decode_tokens_per_s else None
    res.meta = {"model": str(model), "arch": info.arch, "budget_gib": budget_gib, "n_ctx": n_ctx,
                "n_prompt": n_ctx - n_gen, "n_gen": n_gen, "window_tokens": window, "kv_types": list(kv_types),
                "layouts": list(layouts), "ngl": ngl, "threads": n_threads, "extra_args": list(extra_args),
                "oscar_args": list(oscar_args),
                "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": machine_description(), "command": command}
    write_text_atomic(out_dir / "equal_memory.json", res.to_json())
    write_text_atomic(out_dir / "equal_memory.md", res.to_markdown() + "\n")
    write_text_atomic(out_dir / "equal_memory.txt", res.to_text() + "\n")
    return res
