"""`oscar eval`: KV-cache quality against f16, the way docs/design.md §4 fixes it.

One `llama-perplexity --kl-divergence-base` run with f16 KV stores the reference
log-probabilities of held-out text; then one `--kl-divergence` run per KV setting reads
them back and reports PPL, mean KLD, the 99th percentile of KLD and how often the top
token agrees. The KV size of each setting comes from llama.cpp's own log line.

The settings are data (settings.py), so the demo, the passkey test and the CLI share them;
this module is the face of `oscar eval`, and its __all__ names what it offers.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..atomic import atomic_path, write_text_atomic
from ..format import gguf_keys as K
from ..format.gguf_read import ModelInfo, read_gguf_metadata
from ..paths import tool_path
from ..runtime import LlamaServer, parse_kv_size
from .eval_table import EvalRow, Table
from .kv_memory import effective_bits, f16_equivalent_bits, kv_total_mib, window_of
from .perplexity_log import (RE_KLD_CHUNK, RE_PPL_CHUNK, RE_TOO_FEW_TOKENS, parse_base_output,
                             parse_kld_output)
from .plots import kld_vs_bits
from .settings import (BASE_SETTING, SETTINGS, SETTINGS_BY_KEY, VERBOSE_LOG, KVSetting, resolve_settings,
                       select_settings)
from .texts import EVAL_TEXT, calibration_overlap, overlap_warning, read_text_file
from .tool_runs import (EvalError, last_error_line, load_model_info, machine_description, output_folder,
                        stream_tool)

__all__ = ["run_eval", "save_table", "kv_memory", "KVMemory", "Table", "EvalRow", "EvalError", "KVSetting",
           "SETTINGS", "SETTINGS_BY_KEY", "select_settings", "EVAL_TEXT", "calibration_overlap", "effective_bits",
           "kv_total_mib", "parse_kld_output", "parse_base_output"]


class _Progress:
    """A tqdm bar over all chunks of all runs; ETA comes from tqdm's rate."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="chunk", dynamic_ncols=True, file=sys.stderr,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} chunks [{elapsed}<{remaining}]")

    def stage(self, name: str) -> None:
        if self.bar:
            self.bar.set_description(name[:34])

    def advance(self, n: int = 1) -> None:
        if self.bar and n > 0:
            self.bar.update(n)

    def set_total(self, total: int) -> None:
        if self.bar:
            self.bar.total = total
            self.bar.refresh()

    def write(self, msg: str) -> None:
        if self.bar:
            self.bar.write(msg)
        else:
            print(msg, file=sys.stderr)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _chunk_counter(pattern: re.Pattern, progress: _Progress) -> Callable[[str], None]:
    """on_output callback that advances the bar once per new chunk result in the output."""
    state = {"buf": "", "seen": 0}

    def feed(text: str) -> None:
        state["buf"] = (state["buf"] + text)[-4096:]
        nums = [int(m[0] if isinstance(m, tuple) else m) for m in pattern.findall(state["buf"])]
        top = max(nums, default=0)
        if top > state["seen"]:
            progress.advance(top - state["seen"])
            state["seen"] = top

    def finish(n_chunks: int) -> None:
        """Count what a run that stopped early did not report, so the ETA stays right."""
        progress.advance(n_chunks - state["seen"])
        state["seen"] = max(state["seen"], n_chunks)

    feed.finish = finish  # type: ignore[attr-defined]
    return feed


# ---- inputs ----------------------------------------------------------------------------------

def _eval_text(text: str | Path | None) -> tuple[Path, str]:
    text_path = Path(text) if text else EVAL_TEXT
    if not text_path.is_file():
        raise EvalError(f"evaluation text {text_path} not found")
    body = read_text_file(text_path)
    if not body.strip():
        raise EvalError(f"evaluation text {text_path} is empty")
    return text_path, body


def _tool_text(text_path: Path, body: str, out_dir: Path) -> Path:
    """The text as a file the tools read: a compressed one is materialized once."""
    if text_path.suffix not in (".gz", ".xz", ".bz2"):
        return text_path
    tool_text = out_dir / "cache" / (text_path.stem + ".txt")
    tool_text.parent.mkdir(exist_ok=True)
    write_text_atomic(tool_text, body)
    return tool_text


def _file_identity(p: Path) -> str:
    st = p.stat()
    return f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"


# ---- the runs --------------------------------------------------------------------------------

@dataclass
class _Runs:
    """What every llama-perplexity run of one evaluation shares."""
    model: Path
    info: ModelInfo
    ctx: int
    run_args: list[str]
    out_dir: Path
    timeout: float
    prog: _Progress

    @property
    def common(self) -> list[str]:
        return ["-m", str(self.model), *self.run_args]


def run_eval(model: str | Path, text: str | Path | None = None, ctx: int = 2048, chunks: int | None = 16,
             settings: Sequence[KVSetting | str] | None = None, out_dir: str | Path = "oscar-eval",
             n_threads: int | None = None, extra_args: Sequence[str] = (), progress: bool = True,
             reuse_base: bool = True, timeout_per_run: float = 3600, plot: bool = True,
             command: str | None = None, log: Callable[[str], None] | None = None) -> Table:
    """Measure every KV setting against f16 KV on held-out text; returns the Table and
    writes eval.csv, eval.json, eval.md and eval.png (plus logs/) into out_dir.

    chunks None means all chunks of the text. Settings that need OSCAR rotations are
    skipped with a note on a GGUF without them; a setting whose run fails (for example
    because the patched tools lack a flag) becomes a row with a note, not an exception.
    """
    model, info = load_model_info(model)
    text_path, body = _eval_text(text)
    if ctx < 16:
        raise EvalError(f"--ctx must be at least 16, got {ctx}")
    if chunks is not None and chunks < 1:
        raise EvalError(f"--chunks must be at least 1, got {chunks}")
    chosen = resolve_settings(settings)
    say = log or (lambda m: print(m, file=sys.stderr))
    tool_path("llama-perplexity")  # a missing tool is a clear error before any work
    out_dir = output_folder(out_dir)
    provenance = read_gguf_metadata(model).get(K.KEY_CALIB_PREFIX + "corpus")
    calib_note = overlap_warning(text_path, body, provenance if isinstance(provenance, str) else None)
    if calib_note:
        say(calib_note)
    tool_text = _tool_text(text_path, body, out_dir)

    threads = ["-t", str(n_threads)] if n_threads else []
    # -b ctx keeps llama-perplexity at one sequence per pass, so the KV cache is ctx cells
    # and its logged size is the size "at this context"; libllama logs that size only from
    # verbosity 4 (trace) on
    run_args = ["-c", str(ctx), "-b", str(ctx), *threads, *VERBOSE_LOG, *extra_args]
    runnable = [s for s in chosen if s.key != "f16" and not (s.needs_rotations and not info.has_rotations)]
    prog = _Progress(total=(chunks or 8) * (1 + len(runnable)), enabled=progress)
    runs = _Runs(model, info, ctx, run_args, out_dir, timeout_per_run, prog)
    t_start = time.monotonic()
    try:
        base = _base_run(runs, text_path, tool_text, body, chunks, reuse_base)
        prog.set_total(base["chunks"] * (1 + len(runnable)))
        rows = [_setting_row(runs, s, base) for s in chosen]
    finally:
        prog.close()

    table = Table(rows=rows, meta={
        "model": str(model), "model_arch": info.arch, "n_layer": info.n_layer,
        "head_dim": info.head_dim_k, "has_rotations": info.has_rotations,
        "text": str(text_path), "text_sha256": hashlib.sha256(body.encode()).hexdigest(),
        "ctx": ctx, "chunks": base["chunks"], "scored_tokens_per_chunk": ctx - 1 - ctx // 2,
        "threads": n_threads, "extra_args": list(extra_args),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(), "command": command,
        "seconds": round(time.monotonic() - t_start, 1),
        "calibration_overlap_warning": calib_note,
    })
    save_table(table, out_dir, plot=plot)
    return table


def _setting_row(runs: _Runs, s: KVSetting, base: dict) -> EvalRow:
    """One setting's row: the f16 reference, a skip with its reason, or a --kl-divergence run."""
    info, n_chunks = runs.info, base["chunks"]
    row = EvalRow(key=s.key, setting=s.name, cache_type=s.cache_type,
                  bits_per_element=effective_bits(s, info, runs.ctx))
    if s.key == "f16":
        row.status, row.note = "reference", "f16 KV is the reference run (KLD 0 by definition)"
        row.kv_mib, row.ppl, row.ppl_err = base["kv_mib"], base["ppl"], base["ppl_err"]
        row.mean_kld, row.kld_99, row.same_top_p = 0.0, 0.0, 100.0
        row.seconds = base["seconds"]
        return row
    if s.needs_rotations and not info.has_rotations:
        row.status, row.bits_per_element = "skipped", None
        row.note = "needs OSCAR rotations in the GGUF (run oscar-convert first)"
        return row
    window = sum(window_of(info))
    if s.window and window > runs.ctx:
        # the runtime refuses a window larger than the context; say why up front
        row.status, row.bits_per_element = "skipped", None
        row.note = f"the window (sink + recent = {window} tokens) is larger than --ctx {runs.ctx}; use a larger --ctx"
        _chunk_counter(RE_KLD_CHUNK, runs.prog).finish(n_chunks)
        return row
    runs.prog.stage(s.name)
    t0 = time.monotonic()
    args = ["--kl-divergence", "--kl-divergence-base", str(base["logits"]), *runs.common, *s.tool_args()]
    counter = _chunk_counter(RE_KLD_CHUNK, runs.prog)
    log_path = runs.out_dir / "logs" / f"{s.key}.log"
    code, out = stream_tool("llama-perplexity", args, counter, env=dict(s.env), timeout=runs.timeout,
                            log_path=log_path)
    counter.finish(n_chunks)
    row.seconds = round(time.monotonic() - t0, 1)
    stats = parse_kld_output(out) if code == 0 else None
    kv = parse_kv_size(out)
    row.kv_mib, row.window_mib = kv_total_mib(out)
    row.bits_per_element = f16_equivalent_bits(row.kv_mib, base["kv_mib"]) or row.bits_per_element
    if stats is None:
        row.status = "failed"
        row.note = f"exit {code}: {last_error_line(out)}"
        runs.prog.write(f"[oscar eval] {s.name}: {row.note} (log: {log_path})")
        return row
    row.ppl, row.ppl_err = stats.ppl, stats.ppl_err
    row.mean_kld, row.mean_kld_err = stats.mean_kld, stats.mean_kld_err
    row.kld_99, row.same_top_p = stats.kld_99, stats.same_top_p
    if kv and kv.k_type != s.cache_type and not kv.k_type.startswith(s.cache_type):
        row.note = f"llama.cpp used K type {kv.k_type}"
    return row


def _base_run(runs: _Runs, text_path: Path, tool_text: Path, body: str, chunks: int | None, reuse: bool) -> dict:
    """The f16 reference run, cached in out_dir/cache by model, text, ctx, chunks and args."""
    key_src = "|".join([_file_identity(runs.model), hashlib.sha256(body.encode()).hexdigest(), str(runs.ctx),
                        str(chunks), " ".join(runs.run_args)])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = runs.out_dir / "cache"
    cache.mkdir(exist_ok=True)
    logits = cache / f"base-f16-{key}.kld"
    sidecar = cache / f"base-f16-{key}.json"
    if reuse and logits.is_file() and sidecar.is_file():
        info = json.loads(sidecar.read_text())
        info["logits"] = logits
        runs.prog.stage("f16 reference (cached)")
        runs.prog.advance(info["chunks"])
        return info
    runs.prog.stage("f16 reference")
    t0 = time.monotonic()
    log_path = runs.out_dir / "logs" / "f16-base.log"
    with atomic_path(logits) as tmp:
        args = ["--kl-divergence-base", str(tmp), "-f", str(tool_text), *runs.common, *BASE_SETTING.tool_args()]
        if chunks:
            args += ["--chunks", str(chunks)]
        code, out = stream_tool("llama-perplexity", args, _chunk_counter(RE_PPL_CHUNK, runs.prog),
                                timeout=runs.timeout, log_path=log_path)
        ppl, err, n_chunks = parse_base_output(out)
        if code != 0 or ppl is None or not n_chunks:
            if m := RE_TOO_FEW_TOKENS.search(out):
                raise EvalError(f"{text_path} has only {m[1]} tokens for this model; --ctx {runs.ctx} needs "
                                f"at least {2 * runs.ctx}: use a longer text or a smaller --ctx")
            raise EvalError(f"the f16 reference run failed (exit {code}): {last_error_line(out)} (log: {log_path})")
    info = {"ppl": ppl, "ppl_err": err, "chunks": n_chunks, "kv_mib": kv_total_mib(out)[0],
            "seconds": round(time.monotonic() - t0, 1)}
    write_text_atomic(sidecar, json.dumps(info, indent=2))
    info["logits"] = logits
    return info


def save_table(table: Table, out_dir: str | Path, plot: bool = True, stem: str = "eval") -> dict[str, Path]:
    """Write the table as CSV, JSON and Markdown, and the KLD-vs-bits PNG; returns the paths."""
    out_dir = Path(out_dir)
    paths = {"csv": write_text_atomic(out_dir / f"{stem}.csv", table.to_csv()),
             "json": write_text_atomic(out_dir / f"{stem}.json", table.to_json()),
             "md": write_text_atomic(out_dir / f"{stem}.md", table.to_markdown() + "\n")}
    if plot:
        m = table.meta
        pts = [(r.setting, r.bits_per_element, r.mean_kld) for r in table.rows
               if r.status in ("ok", "reference") and r.mean_kld is not None]
        title = f"{Path(m.get('model', '')).name}: KV quality vs size (ctx {m.get('ctx')}, {m.get('chunks')} chunks)"
        paths["png"] = kld_vs_bits(pts, out_dir / f"{stem}.png", title,
                                   footnote=f"text: {Path(m.get('text', '')).name}; {m.get('date', '')}")
    return paths


# ---- KV memory at a long context, as llama.cpp allocates it -----------------------------------

@dataclass
class KVMemory:
    setting: str
    cache_type: str
    n_ctx: int
    kv_mib: float | None
    bits_per_element: float | None
    note: str = ""


def kv_memory(model: str | Path, settings: Sequence[KVSetting | str] = ("f16", "q4_0", "oscar"),
              n_ctx: int = 8192, n_threads: int | None = None, log_dir: str | Path | None = None,
              extra_args: Sequence[str] = (), start_timeout: float = 300) -> list[KVMemory]:
    """KV-cache size llama.cpp allocates for one sequence of n_ctx tokens, per setting.

    Starts llama-server with each setting just long enough to read its KV size log line;
    no tokens are processed, so this is cheap even at long contexts.
    """
    model, info = load_model_info(model)
    out = []
    for s in resolve_settings(settings):
        row = KVMemory(s.name, s.cache_type, n_ctx, None, effective_bits(s, info, n_ctx))
        out.append(row)
        if s.needs_rotations and not info.has_rotations:
            row.note, row.bits_per_element = "skipped: needs OSCAR rotations in the GGUF", None
            continue
        log_path = Path(log_dir) / f"kvmem-{s.key}-{n_ctx}.log" if log_dir else None
        tmp_log = None
        if log_path is None:
            fd, tmp_log = tempfile.mkstemp(suffix=".log")
            os.close(fd)
            log_path = Path(tmp_log)
        threads = ["-t", str(n_threads)] if n_threads else []
        args = ["-c", str(n_ctx), "-np", "1", "--no-webui", *threads, *VERBOSE_LOG, *s.tool_args(), *extra_args]
        try:
            with LlamaServer(model, args, start_timeout=start_timeout, log_path=log_path):
                pass
            row.kv_mib, _ = kv_total_mib(log_path.read_text(errors="replace"))
            if row.kv_mib is None:
                row.note = "no KV size line in the log"
        except Exception as e:  # a setting the tools cannot run is a note, not a crash
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            row.note = f"failed: {last_error_line(text) if text.strip() else e}"
        finally:
            if tmp_log:
                Path(tmp_log).unlink(missing_ok=True)
    return out
