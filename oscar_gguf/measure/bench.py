"""`oscar bench`: decode and prefill speed per KV type and context depth, and a roofline.

llama-bench runs once per KV type (its -ctk/-ctv lists would cross every K type with every
V type), with flash attention on and the same depths, prompt and generation lengths, so
the rows compare like with like. Results are read from its JSON output; ratios are taken
against f16 at the same depth. With rounds > 1 every type runs once per round, the order of
the types reversed every other round, and each row is the median of its rounds: on a shared
or small machine the speed drifts over minutes, and one type run after another would carry
that drift into the ratios.

The roofline says what decode could reach if it were bound by memory bandwidth alone:
per generated token it reads the weights once plus K and V of every cached token. With a
copy bandwidth measured on the machine (given by the user), bytes / bandwidth bounds the
time per token from below.
"""
from __future__ import annotations

import datetime as _dt
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..atomic import write_text_atomic
from ..format import gguf_keys as K
from ..format.gguf_read import ModelInfo, read_gguf_metadata
from .csv_rows import dataclass_rows_csv
from .kv_memory import kv_bytes_at_depth, storage_bits, window_from_args
from .plots import rate_vs_depth
from .tool_runs import EvalError, last_error_line, load_model_info, machine_description, output_folder, stream_tool

DEFAULT_TYPES = ("f16", "q8_0", "q4_0", "oscar2")
DEFAULT_DEPTHS = (0, 4096, 16384, 32768)
DEFAULT_PROMPT, DEFAULT_GEN = 512, 64
# `oscar bench --cpu`: attention on the CPU (-ngl 0), where a 2-bit cache should pay off at depth
CPU_DEPTHS = (0, 4096, 16384)
CPU_GEN = 32



@dataclass
class BenchRow:
    kv_type: str
    test: str          # "pp512", "tg64", as llama-bench names them
    depth: int
    n_prompt: int
    n_gen: int
    tokens_per_s: float
    stddev: float
    ratio_vs_f16: float | None = None
    rounds: str = ""   # with rounds > 1: each round's tokens/s, ";"-separated (tokens_per_s is their median)


@dataclass
class BenchResult:
    rows: list[BenchRow] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)   # kv type -> why it has no rows
    meta: dict = field(default_factory=dict)
    roofline: list[dict] = field(default_factory=list)

    def tests(self) -> list[str]:
        return list(dict.fromkeys(r.test for r in self.rows))

    def types(self) -> list[str]:
        return list(dict.fromkeys([r.kv_type for r in self.rows] + list(self.notes)))

    def get(self, kv_type: str, test: str, depth: int) -> BenchRow | None:
        return next((r for r in self.rows if r.kv_type == kv_type and r.test == test and r.depth == depth), None)

    def to_text(self) -> str:
        out = []
        types = [t for t in self.types() if any(r.kv_type == t for r in self.rows)]
        for test in self.tests():
            depths = sorted({r.depth for r in self.rows if r.test == test})
            out.append(f"{test}: tokens/s (ratio to f16)")
            out.append("depth".rjust(8) + "".join(t.rjust(20) for t in types))
            for d in depths:
                cells = []
                for t in types:
                    r = self.get(t, test, d)
                    if r is None:
                        cells.append("—".rjust(20))
                    else:
                        ratio = f" ({r.ratio_vs_f16:.2f}x)" if r.ratio_vs_f16 is not None else ""
                        cells.append(f"{r.tokens_per_s:.2f}{ratio}".rjust(20))
                out.append(f"{d:>8}" + "".join(cells))
            out.append("")
        for t, note in self.notes.items():
            out.append(f"{t}: {note}")
        return "\n".join(out).rstrip()

    def to_csv(self) -> str:
        return dataclass_rows_csv(self.rows, BenchRow)

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "notes": self.notes, "rows": [asdict(r) for r in self.rows],
                           "roofline": self.roofline}, indent=2)


def parse_bench_json(stdout: str) -> list[dict]:
    """The test records of `llama-bench -o json` (stdout holds only the JSON array)."""
    start = stdout.find("[")
    end = stdout.rfind("]")
    if start < 0 or end < start:
        raise ValueError("llama-bench printed no JSON array")
    return json.loads(stdout[start:end + 1])


def rows_from_records(records: list[dict], kv_type: str) -> list[BenchRow]:
    rows = []
    for rec in records:
        n_p, n_g = int(rec.get("n_prompt", 0)), int(rec.get("n_gen", 0))
        test = f"pp{n_p}" if n_g == 0 else (f"tg{n_g}" if n_p == 0 else f"pp{n_p}+tg{n_g}")
        rows.append(BenchRow(kv_type=kv_type, test=test, depth=int(rec.get("n_depth", 0)),
                             n_prompt=n_p, n_gen=n_g, tokens_per_s=float(rec["avg_ts"]),
                             stddev=float(rec.get("stddev_ts", 0.0))))
    return rows


def _add_ratios(rows: list[BenchRow]) -> None:
    base = {(r.test, r.depth): r.tokens_per_s for r in rows if r.kv_type == "f16"}
    for r in rows:
        b = base.get((r.test, r.depth))
        r.ratio_vs_f16 = r.tokens_per_s / b if b else None


def run_bench(model: str | Path, kv_types: Sequence[str] = DEFAULT_TYPES,
              depths: Sequence[int] = DEFAULT_DEPTHS, n_prompt: int = DEFAULT_PROMPT, n_gen: int = DEFAULT_GEN,
              ngl: int | None = 99, reps: int | None = None, n_threads: int | None = None,
              extra_args: Sequence[str] = (), oscar_args: Sequence[str] = (),
              out_dir: str | Path = "oscar-bench", bandwidth_gbs: float | None = None,
              progress: bool = True, timeout_per_type: float = 3600, command: str | None = None,
              plot: bool = True, log: Callable[[str], None] | None = None,
              tool: Sequence[str] | None = None, machine: str | None = None, rounds: int = 1) -> BenchResult:
    """llama-bench for each KV type at each depth; writes bench.csv/.json/.txt and bench.png.

    oscar_args go to the oscar2 runs only (e.g. --oscar-sink 0 --oscar-recent 0). A type
    that llama-bench cannot run becomes a note. With bandwidth_gbs the roofline is added.
    `tool` runs in place of the installed llama-bench (benchmarks/arm_bench.py: qemu and an
    aarch64 build), and `machine` then describes where it ran. rounds > 1: see the module's
    docstring.
    """
    model, info = load_model_info(model)
    if not kv_types:
        raise EvalError("no KV types given")
    for t in kv_types:
        storage_bits(t, info)  # unknown types fail here, before any run
    depths = sorted({int(d) for d in depths})
    if any(d < 0 for d in depths):
        raise EvalError("depths must be >= 0")
    if n_prompt < 0 or n_gen < 0 or (n_prompt == 0 and n_gen == 0):
        raise EvalError("need -p or -n above 0")
    if rounds < 1:
        raise EvalError("rounds must be >= 1")
    out_dir = output_folder(out_dir)
    say = log or (lambda m: print(m, file=sys.stderr))
    if depths[-1] + n_prompt + n_gen > info.n_ctx_train:
        say(f"note: depth {depths[-1]} goes past the model's trained context ({info.n_ctx_train})")

    common = _bench_args(model, depths, n_prompt, n_gen, ngl, reps, n_threads, extra_args)
    per_type = len(depths) * ((n_prompt > 0) + (n_gen > 0))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=per_type * len(kv_types) * rounds, unit="test", file=sys.stderr, dynamic_ncols=True)
    res = BenchResult()
    per_round: dict[str, list[list[BenchRow]]] = {t: [] for t in kv_types}
    t0 = time.monotonic()
    try:
        for rnd in range(rounds):
            for t in (kv_types if rnd % 2 == 0 else list(reversed(kv_types))):
                if t in res.notes:  # failed in an earlier round: not run again
                    if bar:
                        bar.update(per_type)
                    continue
                args = [*common, "-ctk", t, "-ctv", t, *(oscar_args if t.startswith("oscar2") else ())]
                log_name = f"bench-{t}.log" if rounds == 1 else f"bench-{t}-round{rnd + 1}.log"
                records, note = _bench_type(t, args, out_dir / "logs" / log_name, timeout_per_type, bar, per_type, tool)
                if note:
                    res.notes[t] = note
                    say(f"[oscar bench] {t}: {note} (log: {out_dir / 'logs' / log_name})")
                    continue
                per_round[t].append(rows_from_records(records, t))
    finally:
        if bar:
            bar.close()
    for t in kv_types:
        if t not in res.notes:
            res.rows += median_of_rounds(per_round[t])
    _add_ratios(res.rows)
    res.meta = {"model": str(model), "arch": info.arch, "n_layer": info.n_layer, "n_head_kv": info.n_head_kv,
                "head_dim": info.head_dim_k, "has_rotations": info.has_rotations, "kv_types": list(kv_types),
                "depths": depths, "n_prompt": n_prompt, "n_gen": n_gen, "ngl": ngl,
                "extra_args": list(extra_args), "oscar_args": list(oscar_args), "rounds": rounds,
                "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": machine or machine_description(), "command": command,
                "seconds": round(time.monotonic() - t0, 1)}
    if bandwidth_gbs:
        res.roofline = roofline(info, kv_types, depths, bandwidth_gbs, measured=res,
                                window=window_from_args(info, oscar_args))
    save_bench(res, out_dir, plot=plot)
    return res


def _bench_args(model: Path, depths: list[int], n_prompt: int, n_gen: int, ngl: int | None, reps: int | None,
                n_threads: int | None, extra_args: Sequence[str]) -> list[str]:
    """The llama-bench flags every KV type runs with."""
    args = ["-m", str(model), "-fa", "1", "-d", ",".join(map(str, depths)), "-o", "json", "--progress",
            "-p", str(n_prompt) if n_prompt else "0", "-n", str(n_gen)]
    if ngl is not None:
        args += ["-ngl", str(ngl)]
    if reps:
        args += ["-r", str(reps)]
    if n_threads:
        args += ["-t", str(n_threads)]
    return args + list(extra_args)


def median_of_rounds(rounds: list[list[BenchRow]]) -> list[BenchRow]:
    """One KV type's rows from its rounds: per test and depth the median tokens/s (of an even
    count, the mean of the middle two), the spread of the rounds as stddev, and every round's
    value in `rounds`. A single round is returned as it is."""
    if len(rounds) <= 1:
        return rounds[0] if rounds else []
    out = []
    for first in rounds[0]:
        same = [r for rows in rounds for r in rows if (r.test, r.depth) == (first.test, first.depth)]
        vals = [r.tokens_per_s for r in same]
        out.append(BenchRow(kv_type=first.kv_type, test=first.test, depth=first.depth, n_prompt=first.n_prompt,
                            n_gen=first.n_gen, tokens_per_s=statistics.median(vals),
                            stddev=statistics.stdev(vals) if len(vals) > 1 else first.stddev,
                            rounds=";".join(f"{v:.3f}" for v in vals)))
    return out


def _bench_type(kv_type: str, args: list[str], log_path: Path, timeout: float, bar, per_type: int,
                tool: Sequence[str] | None = None) -> tuple[list, str]:
    """(llama-bench's test records, a note when it failed) of one KV type."""
    if bar:
        bar.set_description(kv_type)
    seen = {"n": 0}

    def on_out(text: str) -> None:
        # "llama-bench: benchmark i/N: ..." is printed as each test starts
        for m in re.finditer(r"benchmark (\d+)/(\d+): (?:prompt|generation) run", text):
            i = int(m[1])
            if bar and i - 1 > seen["n"]:
                bar.update(i - 1 - seen["n"])
                seen["n"] = i - 1

    stdout: list[str] = []
    code, out = stream_tool("llama-bench", args, on_out, timeout=timeout, log_path=log_path,
                            stdout_only=stdout, command=tool)
    try:
        records = parse_bench_json(stdout[0]) if code == 0 else []
    except (ValueError, json.JSONDecodeError):
        records = []
    if bar:
        bar.update(per_type - seen["n"])
    return records, "" if code == 0 and records else f"failed (exit {code}): {last_error_line(out)}"


def save_bench(res: BenchResult, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    out_dir = Path(out_dir)
    text = res.to_text()
    if res.roofline:
        text += "\n\n" + roofline_text(res.roofline, res.meta.get("n_gen"))
    paths = {"csv": write_text_atomic(out_dir / "bench.csv", res.to_csv()),
             "json": write_text_atomic(out_dir / "bench.json", res.to_json()),
             "txt": write_text_atomic(out_dir / "bench.txt", text + "\n")}
    if plot and res.rows:
        panels = {test: {t: [(r.depth, r.tokens_per_s) for r in res.rows if r.kv_type == t and r.test == test]
                         for t in res.types()} for test in res.tests()}
        title = f"{Path(res.meta.get('model', '')).name}: llama-bench -fa 1, {res.meta.get('machine', '')}"
        paths["png"] = rate_vs_depth(panels, out_dir / "bench.png", title)
    return paths


# ---------------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------------


def weight_bytes_per_token(model: str | Path) -> int:
    """Bytes of weights a decode step reads: every tensor except the token embedding, of
    which one row is read (the output matrix, tied or not, is read in full)."""
    import gguf
    meta = read_gguf_metadata(model)
    total = 0
    tied = "output.weight" not in meta.tensors
    for t in meta.tensors.values():
        try:
            per_block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        except (ValueError, KeyError):
            continue
        n = 1
        for x in t.ne:
            n *= x
        nbytes = n // per_block * block_bytes
        if t.name == "token_embd.weight":
            nbytes = nbytes if tied else nbytes // max(t.ne[-1], 1)
        if t.name.endswith(("attn_k_rot", "attn_v_rot")):
            continue  # [d, d] per layer: a few KiB, and cached
        total += nbytes
    return total


def roofline(info: ModelInfo, kv_types: Sequence[str], depths: Sequence[int], bandwidth_gbs: float,
             measured: BenchResult | None = None, window: int = sum(K.DEFAULT_WINDOW),
             weights_bytes: int | None = None) -> list[dict]:
    """Per KV type and depth: bytes read per generated token (weights, attention) and the
    decode rate they allow at bandwidth_gbs (GB/s, 1e9 bytes), next to a measured tg rate."""
    if bandwidth_gbs <= 0:
        raise EvalError("--bandwidth must be positive (GB/s)")
    wb = weight_bytes_per_token(info.path) if weights_bytes is None else weights_bytes
    out = []
    for t in kv_types:
        for d in depths:
            attn = kv_bytes_at_depth(info, t, d, window)
            bound = bandwidth_gbs * 1e9 / (wb + attn)
            row = {"kv_type": t, "depth": d, "weights_mib": wb / 2**20, "attention_mib": attn / 2**20,
                   "bound_tokens_per_s": bound, "measured_tg": None, "share_of_bound": None}
            if measured:
                tg = [r for r in measured.rows if r.kv_type == t and r.depth == d and r.n_prompt == 0]
                if tg:
                    row["measured_tg"] = tg[0].tokens_per_s
                    row["share_of_bound"] = tg[0].tokens_per_s / bound
            out.append(row)
    return out


def roofline_text(rows: list[dict], n_gen: int | None = None) -> str:
    """The roofline as a table. The measured tg averages over its n_gen tokens, which start
    at the depth; the bound is taken at the depth itself."""
    out = ["roofline (decode, memory-bound): bytes read per generated token and the rate they allow",
           f"{'KV type':>8} {'depth':>8} {'weights MiB':>12} {'attn MiB':>10} {'bound t/s':>10}"
           f" {'measured tg':>12} {'of bound':>9}"]
    for r in rows:
        meas = "—" if r["measured_tg"] is None else f"{r['measured_tg']:.2f}"
        share = "—" if r["share_of_bound"] is None else f"{r['share_of_bound']:.0%}"
        out.append(f"{r['kv_type']:>8} {r['depth']:>8} {r['weights_mib']:>12.1f} {r['attention_mib']:>10.2f}"
                   f" {r['bound_tokens_per_s']:>10.1f} {meas:>12} {share:>9}")
    return "\n".join(out)
