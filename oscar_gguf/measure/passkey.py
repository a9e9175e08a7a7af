"""`oscar eval --passkey`: needle-in-a-haystack passkey retrieval at long context.

A five-digit pass key is hidden at a chosen depth in filler text of a chosen length, and
the model is asked to repeat it. Greedy decoding through llama-server (one server per KV
setting, loopback only), so every setting answers the same prompts and the differences
come from the KV cache alone. Accuracy is reported per context length and depth.
"""
from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..atomic import write_text_atomic
from ..runtime import LlamaServer
from .kv_memory import kv_total_mib
from .plots import accuracy_heatmaps
from .settings import VERBOSE_LOG, KVSetting, resolve_settings
from .tool_runs import EvalError, last_error_line, load_model_info, machine_description, output_folder

PASSKEY_SETTINGS = ("f16", "q4_0", "int2-hadamard", "oscar")
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)

# our own wording; the filler is deliberately dull so that the key is the only fact in it
INTRO = ("A pass key is hidden somewhere in the long, repetitive text below. "
         "Read carefully, find the pass key and remember it: you will be asked for it at the end.\n\n")
FILLER = "The lake is still. The road is long. The clouds drift slowly east. Nothing new happens today.\n"
NEEDLE = "\nThe pass key is {key}. Remember it: {key} is the pass key.\n\n"
QUESTION = "\nWhat is the pass key? The pass key is"
N_PREDICT = 10  # a space and five digits are at most 6 tokens; room for a period


def default_lengths(n_ctx_train: int, count: int = 4, smallest: int = 512) -> list[int]:
    """Context lengths from n_ctx_train down by halves, at most `count`, none below `smallest`."""
    out, n = [], n_ctx_train
    while len(out) < count and n >= smallest:
        out.append(n)
        n //= 2
    return sorted(out) or [n_ctx_train]


@dataclass
class Trial:
    setting: str
    length: int
    depth: float
    trial: int
    passkey: str
    prompt_tokens: int
    answer: str
    correct: bool


@dataclass
class PasskeyResult:
    lengths: list[int]
    depths: list[float]
    trials: list[Trial] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)      # setting name -> why it has no results
    kv_mib: dict[str, float | None] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def accuracy(self, setting: str) -> list[list[float | None]]:
        grid = []
        for L in self.lengths:
            row = []
            for d in self.depths:
                ts = [t for t in self.trials if t.setting == setting and t.length == L and t.depth == d]
                row.append(sum(t.correct for t in ts) / len(ts) if ts else None)
            grid.append(row)
        return grid

    def settings(self) -> list[str]:
        seen = dict.fromkeys([t.setting for t in self.trials] + list(self.notes))
        return list(seen)

    def to_text(self) -> str:
        out = []
        head = "length".rjust(8) + "".join(f"{d:>8.0%}" for d in self.depths) + "     all"
        for name in self.settings():
            if name in self.notes and not any(t.setting == name for t in self.trials):
                out += [f"{name}: {self.notes[name]}", ""]
                continue
            out += [f"{name}  (accuracy by needle depth)", head]
            for L, row in zip(self.lengths, self.accuracy(name)):
                ts = [t for t in self.trials if t.setting == name and t.length == L]
                allv = sum(t.correct for t in ts) / len(ts) if ts else None
                cells = "".join(f"{'—' if v is None else f'{v:.0%}':>8}" for v in row)
                out.append(f"{L:>8}{cells}{'—' if allv is None else f'{allv:.0%}':>8}")
            if self.notes.get(name):
                out.append(f"  note: {self.notes[name]}")
            out.append("")
        return "\n".join(out).rstrip()

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["setting", "length", "depth", "trials", "correct", "accuracy"])
        for name in self.settings():
            for L in self.lengths:
                for d in self.depths:
                    ts = [t for t in self.trials if t.setting == name and t.length == L and t.depth == d]
                    if ts:
                        c = sum(t.correct for t in ts)
                        w.writerow([name, L, d, len(ts), c, f"{c / len(ts):.4f}"])
        return buf.getvalue()

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "lengths": self.lengths, "depths": self.depths,
                           "notes": self.notes, "kv_mib": self.kv_mib,
                           "trials": [asdict(t) for t in self.trials]}, indent=2)


class _Prompter:
    """Builds prompts of an exact token budget with the server's own tokenizer."""

    def __init__(self, server: LlamaServer):
        self.server = server
        self._cache: dict[str, int] = {}

    def count(self, text: str) -> int:
        if text not in self._cache:
            r = self.server.post("/tokenize", {"content": text, "add_special": False})
            self._cache[text] = len(r["tokens"])
        return self._cache[text]

    def build(self, length: int, depth: float, key: str) -> tuple[str, int]:
        """A prompt of at most length - N_PREDICT tokens with the needle at `depth`."""
        budget = length - N_PREDICT - 2  # room for BOS and the answer
        fixed = self.count(INTRO) + self.count(NEEDLE.format(key=key)) + self.count(QUESTION)
        n_units = max(1, (budget - fixed) // max(1, self.count(FILLER)))
        while True:
            before = round(depth * n_units)
            prompt = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n_units - before) + QUESTION
            n = self.count(prompt)
            if n <= budget or n_units <= 1:
                return prompt, n
            n_units -= max(1, (n - budget) // max(1, self.count(FILLER)) + 1)


def _answer_digits(text: str) -> str:
    m = re.search(r"\d[\d,]*", text)
    return m.group(0).replace(",", "") if m else ""


def run_passkey(model: str | Path, lengths: Sequence[int] | None = None,
                depths: Sequence[float] = DEFAULT_DEPTHS, trials: int = 2,
                settings: Sequence[KVSetting | str] | None = PASSKEY_SETTINGS,
                out_dir: str | Path = "oscar-eval", n_threads: int | None = None,
                extra_args: Sequence[str] = (), seed: int = 1234, progress: bool = True,
                start_timeout: float = 300, request_timeout: float = 1800, command: str | None = None,
                log: Callable[[str], None] | None = None) -> PasskeyResult:
    """Passkey accuracy per setting, context length and depth; writes passkey.csv, .json,
    .txt and passkey.png into out_dir. Lengths default to halvings of n_ctx_train."""
    model, info = load_model_info(model)
    lengths = sorted(set(lengths or default_lengths(info.n_ctx_train)))
    if lengths[0] < 64:
        raise EvalError(f"passkey lengths must be at least 64 tokens, got {lengths[0]}")
    if lengths[-1] > info.n_ctx_train:
        raise EvalError(f"passkey length {lengths[-1]} exceeds the model's trained context {info.n_ctx_train}")
    depths = [float(d) for d in depths]
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise EvalError("passkey depths must lie in [0, 1]")
    if trials < 1:
        raise EvalError("--trials must be at least 1")
    chosen = resolve_settings(settings)
    out_dir = output_folder(out_dir)
    say = log or (lambda m: print(m, file=sys.stderr))

    # the same keys for every setting, so results pair up trial by trial
    rng = np.random.default_rng(seed)
    keys = {(L, d, i): str(int(rng.integers(10000, 100000))) for L in lengths for d in depths for i in range(trials)}
    res = PasskeyResult(lengths=lengths, depths=depths)
    n_ctx = lengths[-1] + 16
    threads = ["-t", str(n_threads), "-tb", str(n_threads)] if n_threads else []

    server_args = ["-c", str(n_ctx), "-np", "1", "--no-webui", *threads, *VERBOSE_LOG]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(chosen) * len(keys), unit="prompt", file=sys.stderr, dynamic_ncols=True)
    t_start = time.monotonic()
    try:
        for s in chosen:
            if s.needs_rotations and not info.has_rotations:
                res.notes[s.name] = "skipped: needs OSCAR rotations in the GGUF (run oscar-convert first)"
            elif s.env:
                # LlamaServer passes our environment through unchanged; a setting that needs
                # its own variables would silently run without them
                res.notes[s.name] = "skipped: needs environment variables that the server helper cannot set"
            else:
                if bar:
                    bar.set_description(s.name[:24])
                log_path = out_dir / "logs" / f"passkey-{s.key}.log"
                args = [*server_args, *s.tool_args(), *extra_args]
                try:
                    _ask(model, args, log_path, start_timeout, s, keys, seed, request_timeout, res, bar)
                except Exception as e:  # a setting the tools cannot run is a note, not a crash
                    logtxt = log_path.read_text(errors="replace") if log_path.exists() else ""
                    why = last_error_line(logtxt) if logtxt.strip() else str(e)
                    res.notes[s.name] = f"failed: {why}"
                    say(f"[oscar eval --passkey] {s.name}: {why} (log: {log_path})")
                if log_path.exists():
                    res.kv_mib[s.name] = kv_total_mib(log_path.read_text(errors="replace"))[0]
            if bar:  # the prompts a skipped or failed setting did not answer
                bar.update(len(keys) - sum(1 for t in res.trials if t.setting == s.name))
    finally:
        if bar:
            bar.close()

    res.meta = {"model": str(model), "n_ctx_train": info.n_ctx_train, "server_ctx": n_ctx,
                "trials_per_cell": trials, "seed": seed, "settings": [s.name for s in chosen],
                "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": machine_description(), "command": command,
                "seconds": round(time.monotonic() - t_start, 1)}
    save_passkey(res, out_dir)
    return res


def _ask(model: Path, args: list[str], log_path: Path, start_timeout: float, s: KVSetting, keys: dict, seed: int,
         request_timeout: float, res: PasskeyResult, bar) -> None:
    """Every prompt of one setting through one llama-server, greedy."""
    with LlamaServer(model, args, start_timeout=start_timeout, log_path=log_path) as srv:
        prompter = _Prompter(srv)
        for (L, d, i), key in keys.items():
            prompt, n_tok = prompter.build(L, d, key)
            r = srv.post("/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                                         "top_k": 1, "seed": seed, "cache_prompt": False}, timeout=request_timeout)
            answer = r.get("content", "")
            res.trials.append(Trial(s.name, L, d, i, key, n_tok, answer.strip()[:40], _answer_digits(answer) == key))
            if bar:
                bar.update(1)


def save_passkey(res: PasskeyResult, out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    paths = {"csv": write_text_atomic(out_dir / "passkey.csv", res.to_csv()),
             "json": write_text_atomic(out_dir / "passkey.json", res.to_json()),
             "txt": write_text_atomic(out_dir / "passkey.txt", res.to_text() + "\n")}
    grids = {name: res.accuracy(name) for name in res.settings()
             if any(t.setting == name for t in res.trials)}
    if grids:
        title = (f"{Path(res.meta.get('model', '')).name}: passkey retrieval, "
                 f"{res.meta.get('trials_per_cell')} trial(s) per cell, greedy")
        paths["png"] = accuracy_heatmaps(grids, res.lengths, res.depths, out_dir / "passkey.png", title)
    return paths
