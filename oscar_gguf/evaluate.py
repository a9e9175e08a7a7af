"""`oscar eval`: KV-cache quality against f16, the way DESIGN.md section 5 fixes it.

One `llama-perplexity --kl-divergence-base` run with f16 KV stores the reference
log-probabilities of held-out text; then one `--kl-divergence` run per KV setting reads
them back and reports PPL, mean KLD, the 99th percentile of KLD and how often the top
token agrees. The KV size of each setting comes from llama.cpp's own log line.

The settings are data (SETTINGS), so the demo, the passkey test and the CLI share them.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import selectors
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from . import gguf_keys as K
from .paths import tool_path
from .quant import GROUP_SIZE, bits_per_element, type_for_head_dim
from .runtime import parse_kv_size
from .synth import ModelInfo, model_info, read_gguf_metadata
from .plots import dataclass_rows_csv, atomic_output, kld_vs_bits, write_text_atomic

DATA_DIR = Path(__file__).resolve().parent / "data"
EVAL_TEXT = DATA_DIR / "eval" / "botchan.txt"
CALIB_DIR = DATA_DIR / "calib"


class EvalError(RuntimeError):
    """A problem the user can fix (bad input, missing tool); the message says how."""


# ---------------------------------------------------------------------------------------------
# KV settings
# ---------------------------------------------------------------------------------------------

_FIXED_INT2 = (K.FLAG_CLIP_K, "1", K.FLAG_CLIP_V, "1", K.FLAG_SINK, "0", K.FLAG_RECENT, "0")


@dataclass(frozen=True)
class KVSetting:
    key: str                          # short id for the command line ("oscar", "q4_0", ...)
    name: str                         # as shown in tables
    cache_type: str                   # -ctk / -ctv
    args: tuple[str, ...] = ()        # extra flags of the patched tools
    env: tuple[tuple[str, str], ...] = ()
    needs_rotations: bool = False     # only meaningful on a GGUF that carries OSCAR rotations
    window: bool = False              # keeps the GGUF's sink + recent tokens in f16

    def tool_args(self) -> list[str]:
        return ["-ctk", self.cache_type, "-ctv", self.cache_type, "-fa", "on", *self.args]


SETTINGS: tuple[KVSetting, ...] = (
    KVSetting("f16", "f16", "f16"),
    KVSetting("q8_0", "q8_0", "q8_0"),
    KVSetting("q4_0", "q4_0", "q4_0"),
    # the env var turns off upstream's built-in Hadamard; --oscar-rot none also keeps a
    # rotated GGUF's own matrices out, so the row is plain INT2 on any model
    KVSetting("int2", "INT2, no rotation", "oscar2", (K.FLAG_ROT, "none", *_FIXED_INT2),
              env=(("LLAMA_ATTN_ROT_DISABLE", "1"),)),
    KVSetting("int2-hadamard", "INT2 + Hadamard", "oscar2", (K.FLAG_ROT, "hadamard", *_FIXED_INT2)),
    # the honest ablation of the rotation itself: OSCAR's clips and window, Hadamard's rotation
    KVSetting("hadamard-oscar", "Hadamard + OSCAR clips + window", "oscar2", (K.FLAG_ROT, "hadamard"),
              needs_rotations=True, window=True),
    KVSetting("oscar-nowin", "OSCAR, no window", "oscar2", (K.FLAG_SINK, "0", K.FLAG_RECENT, "0"),
              needs_rotations=True),
    KVSetting("oscar", "OSCAR + window", "oscar2", needs_rotations=True, window=True),
)
SETTINGS_BY_KEY = {s.key: s for s in SETTINGS}
BASE_SETTING = SETTINGS_BY_KEY["f16"]
VERBOSE_LOG = ("-lv", "4")  # makes libllama print the "llama_kv_cache: size = ..." line


def resolve_settings(settings: Sequence[KVSetting | str] | None) -> list[KVSetting]:
    """KVSetting objects from a mix of settings and keys; None means all."""
    if settings is None:
        return list(SETTINGS)
    keys = [s for s in settings if isinstance(s, str)]
    select_settings(keys)  # a clear error for unknown keys
    return [SETTINGS_BY_KEY[s] if isinstance(s, str) else s for s in settings]


def select_settings(keys: Iterable[str] | None) -> list[KVSetting]:
    """Settings by key, in the order of SETTINGS; None means all."""
    if keys is None:
        return list(SETTINGS)
    keys = list(keys)
    unknown = [k for k in keys if k not in SETTINGS_BY_KEY]
    if unknown:
        raise EvalError(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS_BY_KEY)}")
    return [s for s in SETTINGS if s.key in keys]


_FIXED_BITS = {"f16": 16.0, "bf16": 16.0, "f32": 32.0, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0,
               "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5}


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


def storage_bits(cache_type: str, info: ModelInfo) -> float:
    """Bits per element of a KV type as llama.cpp stores it for this model."""
    if cache_type in _FIXED_BITS:
        return _FIXED_BITS[cache_type]
    if cache_type.startswith("oscar2"):
        # the group follows head_dim (128 when it allows, else 64); K and V may differ
        bk = bits_per_element(GROUP_SIZE[type_for_head_dim(info.head_dim_k)])
        bv = bits_per_element(GROUP_SIZE[type_for_head_dim(info.head_dim_v)])
        return (bk * info.head_dim_k + bv * info.head_dim_v) / (info.head_dim_k + info.head_dim_v)
    raise EvalError(f"no bits/element known for KV type {cache_type}")


def _window_size(info: ModelInfo) -> int:
    """Sink + recent tokens of the model's default window (the runtime's defaults if the
    GGUF does not say)."""
    sink = info.window_sink if info.window_sink is not None else K.DEFAULT_SINK
    recent = info.window_recent if info.window_recent is not None else K.DEFAULT_RECENT
    return sink + recent


def window_tokens(setting: KVSetting, info: ModelInfo, n_ctx: int) -> int:
    """Tokens of one sequence of n_ctx that the setting keeps in f16."""
    if not setting.window:
        return 0
    return min(n_ctx, _window_size(info))


def effective_bits(setting: KVSetting, info: ModelInfo, n_ctx: int) -> float:
    """Bits per element over a full sequence of n_ctx: window tokens count at 16 bits."""
    b = storage_bits(setting.cache_type, info)
    w = window_tokens(setting, info, n_ctx)
    return (w * 16.0 + (n_ctx - w) * b) / n_ctx


# ---------------------------------------------------------------------------------------------
# Running a tool with live output
# ---------------------------------------------------------------------------------------------


def stream_tool(name: str, args: Sequence[str], on_output: Callable[[str], None] | None = None,
                env: dict | None = None, timeout: float | None = None, log_path: Path | None = None,
                stdout_only: list | None = None) -> tuple[int, str]:
    """Run an installed llama.cpp tool, calling on_output with each new piece of its output
    (unbuffered: llama-perplexity prints its progress without newlines).

    Returns (exit code, stdout and stderr as they came). If stdout_only is a list, stdout
    alone is appended to it too (llama-bench's JSON must not mix with its stderr).
    A timeout kills the tool and returns code 124.
    """
    cmd = [str(tool_path(name)), *map(str, args)]
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


# ---------------------------------------------------------------------------------------------
# Parsing llama-perplexity
# ---------------------------------------------------------------------------------------------

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)"
_PM = r"\s*(?:±|\+/-)\s*"
_RE_MEAN_PPL = re.compile(r"Mean PPL\(Q\)\s*:\s*" + _NUM + _PM + _NUM)
_RE_BASE_PPL = re.compile(r"Mean PPL\(base\)\s*:\s*" + _NUM + _PM + _NUM)
_RE_MEAN_KLD = re.compile(r"Mean\s+KLD:\s*" + _NUM + _PM + _NUM)
_RE_KLD_99 = re.compile(r"99\.0%\s+KLD:\s*" + _NUM)
_RE_SAME_TOP = re.compile(r"Same top p:\s*" + _NUM + _PM + _NUM + r"\s*%")
_RE_FINAL = re.compile(r"Final estimate: PPL = " + _NUM + _PM + _NUM)
_RE_CHUNKS = re.compile(r"(?:calculating perplexity|computing) over (\d+) chunks")
_RE_TOKENS = re.compile(r"tokenizes to only (\d+) tokens")
_RE_KLD_CHUNK = re.compile(r"^\s*(\d+)\s+" + _NUM + _PM + _NUM + r"\s+" + _NUM + _PM + _NUM + r"\s+" + _NUM
                           + _PM + _NUM + r"\s+" + _NUM + _PM + _NUM + r"\s*%\s+" + _NUM + _PM + _NUM + r"\s*%",
                           re.M)
_RE_PPL_CHUNK = re.compile(r"\[(\d+)\]" + _NUM + ",")


_RE_WINDOW = re.compile(r"oscar window: sink (\d+) \+ recent (\d+) tokens per sequence in (\w+), "
                        r"(\d+) slots(?: \((\d+) rows\))? x (\d+) stream\(s\), ([\d.]+) MiB")


def parse_window_mib(log: str) -> float | None:
    """MiB of the oscar2 high-precision window store (sink + recent tokens), if it has one.

    It is allocated apart from the main cache and logged on its own line, so it is added to
    the KV size here; it holds n_seq x (S + R + n_ubatch) slots, more than S + R alone."""
    m = _RE_WINDOW.search(log)
    return float(m[7]) if m else None


def kv_total_mib(log: str) -> tuple[float | None, float | None]:
    """(main cache + window MiB, window MiB) from a tool's log."""
    kv = parse_kv_size(log)
    win = parse_window_mib(log)
    if kv is None:
        return None, win
    return round(kv.total_mib + (win or 0.0), 2), win


@dataclass
class KLDStats:
    ppl: float | None = None
    ppl_err: float | None = None
    ppl_base: float | None = None
    mean_kld: float | None = None
    mean_kld_err: float | None = None
    kld_99: float | None = None
    same_top_p: float | None = None  # percent
    same_top_p_err: float | None = None


def parse_kld_output(log: str) -> KLDStats | None:
    """Statistics of a `--kl-divergence` run, or None if it printed none.

    llama-perplexity prints its final statistics only from 100 scored tokens on; below
    that the last per-chunk line still gives PPL, mean KLD and same-top-p (no 99% KLD).
    """
    s = KLDStats()
    if m := _RE_MEAN_PPL.search(log):
        s.ppl, s.ppl_err = float(m[1]), float(m[2])
    if m := _RE_BASE_PPL.search(log):
        s.ppl_base = float(m[1])
    if m := _RE_MEAN_KLD.search(log):
        s.mean_kld, s.mean_kld_err = float(m[1]), float(m[2])
    if m := _RE_KLD_99.search(log):
        s.kld_99 = float(m[1])
    if m := _RE_SAME_TOP.search(log):
        s.same_top_p, s.same_top_p_err = float(m[1]), float(m[2])
    if s.mean_kld is None:
        rows = _RE_KLD_CHUNK.findall(log)
        if not rows:
            return None
        r = rows[-1]
        s.ppl, s.ppl_err = float(r[1]), float(r[2])
        s.mean_kld, s.mean_kld_err = float(r[5]), float(r[6])
        s.same_top_p, s.same_top_p_err = float(r[9]), float(r[10])
    return s


def parse_base_output(log: str) -> tuple[float | None, float | None, int | None]:
    """(PPL, its uncertainty, chunks) of a `--kl-divergence-base` run."""
    ppl = err = chunks = None
    if m := _RE_FINAL.search(log):
        ppl, err = float(m[1]), float(m[2])
    if m := _RE_CHUNKS.search(log):
        chunks = int(m[1])
    return ppl, err, chunks


# ---------------------------------------------------------------------------------------------
# Held-out text
# ---------------------------------------------------------------------------------------------


def _normalized_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _shingles(words: list[str], n: int = 8) -> set[int]:
    return {hash(tuple(words[i:i + n])) for i in range(0, max(0, len(words) - n + 1))}


def read_text_file(p: Path) -> str:
    import bz2
    import gzip
    import lzma
    opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}.get(p.suffix, open)
    with opener(p, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def calibration_texts(calib_dir: Path = CALIB_DIR) -> dict[str, str]:
    """The calibration corpus shipped with the package, file name -> text."""
    out = {}
    if not calib_dir.is_dir():
        return out
    for p in sorted(calib_dir.rglob("*")):
        if not p.is_file() or p.name.upper().startswith(("SOURCES", "LICENSE", "README")):
            continue
        if p.suffix in (".txt", ".gz", ".xz", ".bz2") or p.name.endswith(".txt"):
            try:
                out[str(p.relative_to(calib_dir))] = read_text_file(p)
            except OSError:
                continue
    return out


def calibration_overlap(text: str, calib: dict[str, str] | None = None, n: int = 8) -> tuple[float, str | None]:
    """Share of the text's word 8-grams that also occur in the calibration corpus, and the
    calibration file it overlaps most. Case, punctuation and line breaks are ignored, so a
    re-wrapped or re-encoded copy of the calibration text is still caught."""
    calib = calibration_texts() if calib is None else calib
    words = _normalized_words(text)
    mine = _shingles(words, n)
    if not mine:
        return 0.0, None
    best, best_name = 0.0, None
    for name, ctext in calib.items():
        share = len(mine & _shingles(_normalized_words(ctext), n)) / len(mine)
        if share > best:
            best, best_name = share, name
    return best, best_name


def overlap_warning(text_path: Path, text: str, info_calib_corpus: str | None = None,
                    threshold: float = 0.05) -> str | None:
    """A warning when the evaluation text is (part of) the calibration text, else None."""
    share, name = calibration_overlap(text)
    if share >= threshold:
        return (f"WARNING: {share:.0%} of {text_path.name} also occurs in the calibration corpus "
                f"({name}); KLD on calibration text overstates OSCAR's quality. Use held-out text.")
    if info_calib_corpus:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if text_path.name in info_calib_corpus or digest[:16] in info_calib_corpus:
            return (f"WARNING: the model's calibration provenance ({info_calib_corpus!r}) names "
                    f"{text_path.name}; evaluate on held-out text instead.")
    return None


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


@dataclass
class EvalRow:
    key: str
    setting: str
    cache_type: str
    bits_per_element: float | None = None
    kv_mib: float | None = None      # main cache + high-precision window
    ppl: float | None = None
    ppl_err: float | None = None
    mean_kld: float | None = None
    mean_kld_err: float | None = None
    kld_99: float | None = None
    same_top_p: float | None = None
    seconds: float | None = None
    status: str = "ok"       # ok | reference | skipped | failed
    note: str = ""
    window_mib: float | None = None  # the window's share of kv_mib


COLUMNS = [("setting", "setting"), ("bits/elem", "bits_per_element"), ("KV MiB", "kv_mib"),
           ("PPL", "ppl"), ("mean KLD", "mean_kld"), ("99% KLD", "kld_99"), ("same top-p %", "same_top_p")]


def _fmt(attr: str, v) -> str:
    if v is None:
        return "—"
    if attr == "bits_per_element":
        return f"{v:.3g}" if v < 10 else f"{v:.1f}"
    if attr == "kv_mib":
        return f"{v:.2f}"
    if attr == "ppl":
        return f"{v:.4f}"
    if attr in ("mean_kld", "kld_99"):
        return f"{v:.5f}"
    if attr == "same_top_p":
        return f"{v:.2f}"
    return str(v)


@dataclass
class Table:
    rows: list[EvalRow]
    meta: dict = field(default_factory=dict)

    def row(self, key: str) -> EvalRow | None:
        return next((r for r in self.rows if r.key == key), None)

    def _cells(self) -> list[list[str]]:
        return [[_fmt(a, getattr(r, a)) if a != "setting" else r.setting for _, a in COLUMNS] for r in self.rows]

    def notes(self) -> list[str]:
        return [f"{r.setting}: {r.status}{' – ' + r.note if r.note else ''}"
                for r in self.rows if r.status != "ok"]

    def to_text(self) -> str:
        heads = [h for h, _ in COLUMNS]
        cells = self._cells()
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
        line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))
        out = [line(heads), "  ".join("-" * w for w in widths), *(line(c) for c in cells)]
        if self.notes():
            out += ["", "notes:", *("  " + n for n in self.notes())]
        return "\n".join(out)

    def to_markdown(self) -> str:
        heads = [h for h, _ in COLUMNS]
        out = ["| " + " | ".join(heads) + " |", "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
        out += ["| " + " | ".join(c) + " |" for c in self._cells()]
        if self.notes():
            out += [""] + [f"- {n}" for n in self.notes()]
        return "\n".join(out)

    def to_csv(self) -> str:
        return dataclass_rows_csv(self.rows, EvalRow)

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "rows": [asdict(r) for r in self.rows]}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Table":
        d = json.loads(text)
        return cls(rows=[EvalRow(**r) for r in d["rows"]], meta=d.get("meta", {}))


# ---------------------------------------------------------------------------------------------
# Running the evaluation
# ---------------------------------------------------------------------------------------------


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


def _file_identity(p: Path) -> str:
    st = p.stat()
    return f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"


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
    text_path = Path(text) if text else EVAL_TEXT
    if not text_path.is_file():
        raise EvalError(f"evaluation text {text_path} not found")
    body = read_text_file(text_path)
    if not body.strip():
        raise EvalError(f"evaluation text {text_path} is empty")
    if ctx < 16:
        raise EvalError(f"--ctx must be at least 16, got {ctx}")
    if chunks is not None and chunks < 1:
        raise EvalError(f"--chunks must be at least 1, got {chunks}")
    chosen = resolve_settings(settings)
    say = log or (lambda m: print(m, file=sys.stderr))
    tool_path("llama-perplexity")  # a missing tool is a clear error before any work
    out_dir = output_folder(out_dir)

    calib_note = None
    provenance = read_gguf_metadata(model).get(K.KEY_CALIB_PREFIX + "corpus")
    warn = overlap_warning(text_path, body, provenance if isinstance(provenance, str) else None)
    if warn:
        say(warn)
        calib_note = warn

    # tools read the text as a file; a compressed or foreign path is materialized once
    tool_text = text_path
    if text_path.suffix in (".gz", ".xz", ".bz2"):
        tool_text = out_dir / "cache" / (text_path.stem + ".txt")
        tool_text.parent.mkdir(exist_ok=True)
        write_text_atomic(tool_text, body)

    threads = ["-t", str(n_threads)] if n_threads else []
    # -b ctx keeps llama-perplexity at one sequence per pass, so the KV cache is ctx cells
    # and its logged size is the size "at this context"; libllama logs that size only from
    # verbosity 4 (trace) on
    run_args = ["-c", str(ctx), "-b", str(ctx), *threads, *VERBOSE_LOG, *extra_args]
    common = ["-m", str(model), *run_args]

    runnable = [s for s in chosen if s.key != "f16" and not (s.needs_rotations and not info.has_rotations)]
    est_chunks = chunks or 8
    prog = _Progress(total=est_chunks * (1 + len(runnable)), enabled=progress)
    rows: list[EvalRow] = []
    t_start = time.monotonic()
    try:
        base = _base_run(model, text_path, tool_text, body, ctx, chunks, run_args, out_dir, reuse_base,
                         timeout_per_run, prog)
        n_chunks = base["chunks"]
        prog.set_total(n_chunks * (1 + len(runnable)))
        for s in chosen:
            row = EvalRow(key=s.key, setting=s.name, cache_type=s.cache_type,
                          bits_per_element=effective_bits(s, info, ctx))
            rows.append(row)
            if s.key == "f16":
                row.status, row.note = "reference", "f16 KV is the reference run (KLD 0 by definition)"
                row.kv_mib, row.ppl, row.ppl_err = base["kv_mib"], base["ppl"], base["ppl_err"]
                row.mean_kld, row.kld_99, row.same_top_p = 0.0, 0.0, 100.0
                row.seconds = base["seconds"]
                continue
            if s.needs_rotations and not info.has_rotations:
                row.status = "skipped"
                row.note = "needs OSCAR rotations in the GGUF (run oscar-convert first)"
                row.bits_per_element = None
                continue
            if s.window and _window_size(info) > ctx:
                # the runtime refuses a window larger than the context; say why up front
                row.status, row.bits_per_element = "skipped", None
                row.note = (f"the window (sink + recent = {_window_size(info)} tokens) is larger than "
                            f"--ctx {ctx}; use a larger --ctx")
                counter = _chunk_counter(_RE_KLD_CHUNK, prog)
                counter.finish(n_chunks)
                continue
            prog.stage(s.name)
            t0 = time.monotonic()
            args = ["--kl-divergence", "--kl-divergence-base", str(base["logits"]), *common, *s.tool_args()]
            counter = _chunk_counter(_RE_KLD_CHUNK, prog)
            code, out = stream_tool("llama-perplexity", args, counter, env=dict(s.env), timeout=timeout_per_run,
                                    log_path=out_dir / "logs" / f"{s.key}.log")
            counter.finish(n_chunks)
            row.seconds = round(time.monotonic() - t0, 1)
            stats = parse_kld_output(out) if code == 0 else None
            kv = parse_kv_size(out)
            row.kv_mib, row.window_mib = kv_total_mib(out)
            if stats is None:
                row.status = "failed"
                row.note = f"exit {code}: {last_error_line(out)}"
                prog.write(f"[oscar eval] {s.name}: {row.note} (log: {out_dir / 'logs' / (s.key + '.log')})")
                continue
            row.ppl, row.ppl_err = stats.ppl, stats.ppl_err
            row.mean_kld, row.mean_kld_err = stats.mean_kld, stats.mean_kld_err
            row.kld_99, row.same_top_p = stats.kld_99, stats.same_top_p
            if kv and kv.k_type != s.cache_type and not kv.k_type.startswith(s.cache_type):
                row.note = f"llama.cpp used K type {kv.k_type}"
    finally:
        prog.close()

    table = Table(rows=rows, meta={
        "model": str(model), "model_arch": info.arch, "n_layer": info.n_layer,
        "head_dim": info.head_dim_k, "has_rotations": info.has_rotations,
        "text": str(text_path), "text_sha256": hashlib.sha256(body.encode()).hexdigest(),
        "ctx": ctx, "chunks": n_chunks, "scored_tokens_per_chunk": ctx - 1 - ctx // 2,
        "threads": n_threads, "extra_args": list(extra_args),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(), "command": command,
        "seconds": round(time.monotonic() - t_start, 1),
        "calibration_overlap_warning": calib_note,
    })
    save_table(table, out_dir, plot=plot)
    return table


def _base_run(model: Path, text_path: Path, tool_text: Path, body: str, ctx: int, chunks: int | None,
              run_args: list[str], out_dir: Path, reuse: bool, timeout: float, prog: _Progress) -> dict:
    """The f16 reference run, cached in out_dir/cache by model, text, ctx, chunks and args."""
    common = ["-m", str(model), *run_args]
    key_src = "|".join([_file_identity(model), hashlib.sha256(body.encode()).hexdigest(), str(ctx),
                        str(chunks), " ".join(run_args)])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = out_dir / "cache"
    cache.mkdir(exist_ok=True)
    logits = cache / f"base-f16-{key}.kld"
    sidecar = cache / f"base-f16-{key}.json"
    if reuse and logits.is_file() and sidecar.is_file():
        info = json.loads(sidecar.read_text())
        info["logits"] = logits
        prog.stage("f16 reference (cached)")
        prog.advance(info["chunks"])
        return info
    prog.stage("f16 reference")
    t0 = time.monotonic()
    with atomic_output(logits) as tmp:
        args = ["--kl-divergence-base", str(tmp), "-f", str(tool_text), *common, *BASE_SETTING.tool_args()]
        if chunks:
            args += ["--chunks", str(chunks)]
        code, out = stream_tool("llama-perplexity", args, _chunk_counter(_RE_PPL_CHUNK, prog),
                                timeout=timeout, log_path=out_dir / "logs" / "f16-base.log")
        ppl, err, n_chunks = parse_base_output(out)
        if code != 0 or ppl is None or not n_chunks:
            if m := _RE_TOKENS.search(out):
                raise EvalError(f"{text_path} has only {m[1]} tokens for this model; --ctx {ctx} needs "
                                f"at least {2 * ctx}: use a longer text or a smaller --ctx")
            raise EvalError(f"the f16 reference run failed (exit {code}): {last_error_line(out)} "
                            f"(log: {out_dir / 'logs' / 'f16-base.log'})")
    kv = parse_kv_size(out)
    info = {"ppl": ppl, "ppl_err": err, "chunks": n_chunks, "kv_mib": kv.total_mib if kv else None,
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


# ---------------------------------------------------------------------------------------------
# KV memory at a long context
# ---------------------------------------------------------------------------------------------


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
    from .runtime import LlamaServer
    model = Path(model)
    try:
        info = model_info(model)
    except (ValueError, OSError) as e:
        raise EvalError(str(e)) from None
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
            import tempfile
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
