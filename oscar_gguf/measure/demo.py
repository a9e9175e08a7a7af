"""`oscar demo`: the whole job in one command, on the bundled model (or --model).

    oscar demo                      # SmolLM2-135M, default sizes (sized for ~15 minutes on 2 CPU cores)
    oscar demo --quick              # CI sizes (about 3 minutes)
    oscar demo --model m.gguf --out runs/m

Five steps, each cached in the output folder (default ./oscar-demo) under a key made of
its inputs, so a second run skips what is done (--force redoes everything):

1. calibrate   per-layer K/V rotations and clip ratios, captured with llama.cpp straight
               from the GGUF, on the calibration corpus bundled with the package;
2. convert     the GGUF plus its rotations (what `oscar-convert` writes);
3. evaluate    `oscar eval`: PPL and KLD against f16 KV for every KV setting, on held-out
               text (never the calibration text), with a table and a PNG;
4. KV memory   at the trained context and at 128K, from the model's real shapes and the
               real block sizes, checked against the sizes llama.cpp logged in step 3;
5. generate    a short greedy continuation with the oscar2 KV cache (next to f16 KV),
               from a prompt longer than the f16 window so that INT2 is really read.

The summary goes to the terminal and to demo.md / demo.json in the output folder.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import __version__
from ..atomic import write_text_atomic
from ..format import gguf_keys as K
from ..format.gguf_read import model_info
from . import evaluate as ev
from .kv_memory import kv_bytes, kv_memory_rows, kv_memory_text, window_of, window_rows
from .texts import CALIB_DIR, EVAL_TEXT, read_text_file
from .tool_runs import machine_description

DEFAULT_OUT = "oscar-demo"
LONG_CONTEXT = 131072


@dataclass(frozen=True)
class Sizes:
    """Every size the demo uses; --quick and the options pick them."""
    tokens: int          # calibration tokens for the statistics
    seq_len: int         # calibration chunk length
    rotation: str        # calibration recipe (see oscar_gguf/calibrate/rotations.py)
    ctx: int             # evaluation context per chunk
    chunks: int          # evaluation chunks
    prompt_tokens: int   # generation prompt (longer than the f16 window, so INT2 is read)
    gen_tokens: int      # generated tokens


# Chosen for the 2-core CPU machine with the bundled SmolLM2-135M, where llama.cpp runs it at
# only about 30-70 tokens/s per core: ctx 2048 x 2 chunks took 28 minutes of evaluation alone
# there (under load), so the default evaluates at ctx 1024 (the window is then 31% of the
# context; step 4 shows the long-context sizes). --quick is the CI size.
# Rotation recipe "key-eigen-dc": the best of the recipes whose fit costs seconds (measured
# mean KL on SmolLM2: oscar 0.047, hadamard 0.036, key-eigen-dc 0.027, learned 0.020); the
# "learned" recipe fits by gradient descent, which took more than 8 CPU-minutes on its own
# there, so it is an option (--rotation learned), not the default.
FULL = Sizes(tokens=4096, seq_len=1024, rotation="key-eigen-dc", ctx=1024, chunks=2, prompt_tokens=768,
             gen_tokens=32)
QUICK = Sizes(tokens=512, seq_len=512, rotation="key-eigen-dc", ctx=512, chunks=1, prompt_tokens=400,
              gen_tokens=16)


class DemoError(RuntimeError):
    """A problem the user can fix; the message says how."""


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def quality_claim(table) -> str | None:
    """OSCAR + window against q4_0, each with the bits per element it cost in this run: the f16
    window is a large share of a short context, so the comparison is only fair with the bits."""
    o, q = table.row("oscar"), table.row("q4_0")
    if o is None or q is None or o.mean_kld is None or q.mean_kld is None or not o.bits_per_element:
        return None
    verdict = "lower" if o.mean_kld < q.mean_kld else "higher"
    cost = "more" if o.bits_per_element > q.bits_per_element else "fewer"
    return (f"OSCAR + window: mean KLD {o.mean_kld:.4f} at {o.bits_per_element:.2f} bits/elem, {verdict} than "
            f"q4_0's {q.mean_kld:.4f} at {q.bits_per_element:.2f} bits/elem ({cost} bits: at ctx "
            f"{table.meta.get('ctx')} the f16 window and its micro-batch of rows are "
            f"{'a large' if o.bits_per_element > 4 else 'a small'} share of the cache)")


def _fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s < 90 else f"{int(s // 60)} min {s % 60:.0f} s"


def cpu_seconds() -> float:
    """User + system CPU time of this process and of the tools it ran (finished children)."""
    import resource
    t = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        t += r.ru_utime + r.ru_stime
    return t


def _digest(*parts) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:12]


def file_fingerprint(p: Path, edge: int = 1 << 20) -> str:
    """Content fingerprint of a (possibly large) file: its size and the sha256 of its first
    and last MiB. Cheap on a multi-GiB GGUF, and unlike a modification time it survives a copy."""
    p = Path(p)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        h.update(f.read(edge))
        if size > edge:
            f.seek(max(edge, size - edge))
            h.update(f.read(edge))
    return h.hexdigest()[:16]


def corpus_fingerprint() -> str:
    """The bundled calibration corpus (oscar_gguf/data/calib), by content."""
    h = hashlib.sha256()
    for p in sorted(CALIB_DIR.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


class Step:
    """Prints a header, times the body and records it in the summary."""

    def __init__(self, demo: "Demo", n: int, name: str, title: str):
        self.demo, self.n, self.name, self.title = demo, n, name, title
        self.cached = False

    def __enter__(self) -> "Step":
        self.t0 = time.monotonic()
        self.c0 = cpu_seconds()
        _say()
        head = f"{self.name}: {self.title}"
        _say(f"== [{self.n}/5] {head} " + "=" * max(3, 70 - len(head)))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        dt = time.monotonic() - self.t0
        cpu = cpu_seconds() - self.c0
        if exc_type is None:
            tag = " (cached)" if self.cached else ""
            _say(f"-- step {self.n} done in {_fmt_s(dt)} (CPU time {_fmt_s(cpu)}){tag}")
            self.demo.steps.append({"step": self.n, "name": self.name, "title": self.title, "seconds": round(dt, 1),
                                    "cpu_seconds": round(cpu, 1), "cached": self.cached})


# ---------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------


@dataclass
class Demo:
    model: Path
    out: Path
    sizes: Sizes
    text: Path | None = None
    threads: int | None = None
    force: bool = False
    progress: bool = True
    long_ctx: int = LONG_CONTEXT
    command: str = ""
    steps: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    # -- 1 ----------------------------------------------------------------------------------
    def calibrate(self) -> Path:
        s = self.sizes
        key = _digest("calib", self.model_fp, corpus_fingerprint(), s.tokens, s.seq_len, s.rotation, "search",
                      "llama", K.DEFAULT_SINK, K.DEFAULT_RECENT, __version__)
        rot = self.out / "calibration" / f"rot-{key}.safetensors"
        facts_path = rot.with_suffix(".json")
        with Step(self, 1, "calibrate", "K/V rotations and clip ratios (llama.cpp capture)") as st:
            _say(f"model {self.model}")
            _say(f"corpus: the bundled calibration corpus (oscar_gguf/data/calib); {s.tokens} tokens in chunks "
                 f"of {s.seq_len}, rotation recipe '{s.rotation}', per-layer clip search")
            if rot.is_file() and facts_path.is_file() and not self.force:
                st.cached = True
                facts = json.loads(facts_path.read_text())
            else:
                from ..calibrate import calibrate, save_artifact
                t0 = time.monotonic()
                try:
                    art = calibrate(str(self.model), tokens=s.tokens, seq_len=s.seq_len, clip="search",
                                    backend="llama", rotation=s.rotation, progress=self.progress)
                finally:
                    _restore_llama_log()
                save_artifact(rot, art)
                facts = {"seconds": round(time.monotonic() - t0, 1), "tokens": int(art.tokens),
                         "method": art.method, "layers": len(art.layers), "head_dim": int(art.head_dim),
                         "clip_k": [round(float(c), 4) for c in art.clip_k],
                         "clip_v": [round(float(c), 4) for c in art.clip_v], "corpus": art.corpus}
                write_text_atomic(facts_path, json.dumps(facts, indent=1))
            ck, cv = facts["clip_k"], facts["clip_v"]
            _say(f"artifact {rot}")
            _say(f"  {facts['layers']} layers, head_dim {facts['head_dim']}, {facts['tokens']} tokens, "
                 f"{facts['method']}; clip K {min(ck):.2f}-{max(ck):.2f}, V {min(cv):.2f}-{max(cv):.2f}")
        self.summary["calibration"] = {"artifact": str(rot), **facts}
        self.rot_key = key
        return rot

    # -- 2 ----------------------------------------------------------------------------------
    def convert(self, rot: Path) -> Path:
        key = _digest("convert", self.model_fp, self.rot_key, file_fingerprint(rot), K.FORMAT_VERSION)
        dst = self.out / f"{self.model.stem}-oscar-{key}.gguf"
        with Step(self, 2, "convert", "write the rotations into the GGUF") as st:
            if dst.is_file() and not self.force:
                st.cached = True
            else:
                from ..calibrate import load_artifact
                from ..convert import convert, rotations_from_artifact
                from ..format.gguf_read import GGUFError
                try:  # the output appears whole or not at all
                    convert(self.model, dst, rotations_from_artifact(load_artifact(rot)), force=True,
                            replace=self.info.has_rotations)
                except GGUFError as e:
                    raise DemoError(f"conversion failed: {e}") from None
            _say(f"wrote {dst} ({dst.stat().st_size / 2**20:.1f} MiB)")
            _say(f"  same as: oscar-convert {shlex.quote(str(self.model))} --rotations {shlex.quote(str(rot))} "
                 f"-o {shlex.quote(str(dst))}")
        self.summary["converted"] = str(dst)
        self.conv_key = key
        return dst

    # -- 3 ----------------------------------------------------------------------------------
    def evaluate(self, gguf: Path):
        s = self.sizes
        text = Path(self.text) if self.text else EVAL_TEXT
        if not text.is_file():
            raise DemoError(f"evaluation text {text} not found")
        key = _digest("eval", self.conv_key, file_fingerprint(text), s.ctx, s.chunks,
                      ",".join(x.key for x in ev.SETTINGS), __version__)
        out = self.out / f"eval-{key}"
        with Step(self, 3, "evaluate", "PPL and KLD against f16 KV on held-out text (llama-perplexity)") as st:
            _say(f"held-out text {text} ({'the shipped held-out corpus' if not self.text else 'given'}; "
                 f"never the calibration corpus); ctx {s.ctx}, {s.chunks} chunks, {len(ev.SETTINGS)} settings")
            if (out / "eval.json").is_file() and not self.force:
                st.cached = True
                table = ev.Table.from_json((out / "eval.json").read_text())
            else:
                table = ev.run_eval(gguf, text=text, ctx=s.ctx, chunks=s.chunks, out_dir=out,
                                    n_threads=self.threads, progress=self.progress, reuse_base=not self.force,
                                    command=self.command)
            m = table.meta
            _say(f"{Path(m['model']).name}, ctx {m['ctx']}, {m['chunks']} chunks of {Path(m['text']).name} "
                 f"({m['scored_tokens_per_chunk']} scored tokens each), {m['date']}")
            _say(table.to_text())
            claim = quality_claim(table)
            if claim:
                _say(claim)
            _say(f"wrote {out}/eval.csv, eval.json, eval.md, eval.png")
        self.summary["eval"] = {"dir": str(out), "png": str(out / "eval.png"), "meta": table.meta,
                                "rows": [asdict(r) for r in table.rows]}
        self.table = table
        return table

    # -- 4 ----------------------------------------------------------------------------------
    def kv_memory(self):
        info = self.conv_info
        contexts = sorted({info.n_ctx_train, self.long_ctx})
        sink, recent = window_of(info)
        with Step(self, 4, "KV memory", "at long context (one sequence, from the model's shapes)"):
            _say(f"{info.arch}: {info.n_layer} layers x {info.n_head_kv} KV heads x head_dim {info.head_dim_k}; "
                 f"trained context {info.n_ctx_train}")
            g = "64 (20 B per 64 elements)" if info.head_dim_k % 128 else "128 (36 B per 128 elements)"
            _say(f"blocks: f16 2 B/elem; q8_0 34 B per 32; q4_0 18 B per 32; oscar2 group {g}; window: sink "
                 f"{sink} + recent {recent} tokens in f16 (llama.cpp allocates {window_rows(sink + recent, contexts[-1])} "
                 f"rows: one micro-batch more, padded)")
            rows = kv_memory_rows(info, contexts)
            _say(kv_memory_text(rows, contexts))
            checks = self._check_against_llama(info)
            for c in checks:
                _say(c["text"])
        self.summary["kv_memory"] = {"contexts": contexts, "rows": rows, "checks": checks,
                                     "markdown": kv_memory_text(rows, contexts, md=True)}
        return rows

    def _check_against_llama(self, info) -> list[dict]:
        """The formula against the KV sizes llama.cpp logged during the evaluation."""
        out = []
        ctx = self.sizes.ctx
        sink, recent = window_of(info)
        for key, ct, win in (("f16", "f16", 0), ("q4_0", "q4_0", 0), ("oscar", "oscar2", sink + recent)):
            r = self.table.row(key)
            if r is None or r.kv_mib is None:
                continue
            pred = kv_bytes(info, ct, ctx, win)["total"] / 2**20
            rel = abs(pred - r.kv_mib) / max(r.kv_mib, 1e-9)
            out.append({"setting": r.setting, "n_ctx": ctx, "llama_mib": r.kv_mib, "formula_mib": round(pred, 2),
                        "rel_diff": rel,
                        "text": f"check at ctx {ctx}: {r.setting} llama.cpp allocated {r.kv_mib:.2f} MiB, "
                                f"formula {pred:.2f} MiB" + ("" if rel < 0.02 else f"  (differs by {rel:.1%})")})
        return out

    # -- 5 ----------------------------------------------------------------------------------
    def generate(self, gguf: Path) -> dict:
        s = self.sizes
        key = _digest("gen", self.conv_key, s.prompt_tokens, s.gen_tokens, __version__)
        path = self.out / f"generation-{key}.json"
        sink, recent = window_of(self.conv_info)
        with Step(self, 5, "generate", "greedy continuation with the oscar2 KV cache") as st:
            if path.is_file() and not self.force:
                st.cached = True
                res = json.loads(path.read_text())
            else:
                res = greedy_generations(gguf, EVAL_TEXT, s.prompt_tokens, s.gen_tokens, self.threads)
                write_text_atomic(path, json.dumps(res, indent=1))
            n_int2 = max(0, res["prompt_tokens"] - sink - recent)
            _say(f"prompt: {res['prompt_tokens']} tokens of held-out text; with oscar2 the first {sink} and the last "
                 f"{recent} stay in f16, the {n_int2} between are read from INT2")
            _say(f"prompt ends: ...{_one_line(res['prompt_tail'])}")
            _say(f"oscar2 KV: {_one_line(res['oscar2'])}")
            _say(f"f16 KV:    {_one_line(res['f16'])}")
            _say(f"the first {res['same_prefix']} of {res['n_gen']} generated tokens agree with f16 KV")
        self.summary["generation"] = res
        return res

    # -- all --------------------------------------------------------------------------------
    def run(self) -> int:
        t0, c0 = time.monotonic(), cpu_seconds()
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self.info = model_info(self.model)
        except (ValueError, OSError) as e:
            raise DemoError(str(e)) from None
        self.model_fp = file_fingerprint(self.model)
        s = self.sizes
        _say(f"oscar demo {__version__}: calibrate -> convert -> evaluate -> KV memory -> generate")
        _say(f"output folder {self.out.resolve()} (cached steps are reused; --force redoes them)")
        _say(f"sizes: calibration {s.tokens} tokens ({s.rotation}), evaluation ctx {s.ctx} x {s.chunks} chunks, "
             f"generation {s.prompt_tokens} + {s.gen_tokens} tokens")
        rot = self.calibrate()
        gguf = self.convert(rot)
        self.conv_info = model_info(gguf)
        table = self.evaluate(gguf)
        self.kv_memory()
        self.generate(gguf)
        total = time.monotonic() - t0
        self.summary["cpu_seconds"] = round(cpu_seconds() - c0, 1)
        self._write_summary(total)
        _say()
        _say("== summary " + "=" * 66)
        for st in self.steps:
            _say(f"  {st['step']}. {st['name']:10s} {_fmt_s(st['seconds']):>14s}   CPU "
                 f"{_fmt_s(st['cpu_seconds']):>14s}" + ("  (cached)" if st["cached"] else ""))
        _say(f"  total      {_fmt_s(total):>14s}   CPU {_fmt_s(self.summary['cpu_seconds']):>14s}  "
             f"({os.cpu_count()} CPU threads, load average {os.getloadavg()[0]:.1f})")
        _say(f"wrote {self.out / 'demo.md'} and {self.out / 'demo.json'}; plot {self.summary['eval']['png']}")
        failed = [r for r in table.rows if r.status == "failed"]
        if failed:
            _say(f"oscar demo: {len(failed)} evaluation setting(s) failed: " + "; ".join(
                f"{r.setting}: {r.note}" for r in failed))
            return 1
        return 0

    def _write_summary(self, total: float) -> None:
        self.summary.update({
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_description(), "command": self.command, "model": str(self.model),
            "sizes": asdict(self.sizes), "threads": self.threads, "steps": self.steps,
            "seconds": round(total, 1), "version": __version__})
        write_text_atomic(self.out / "demo.json", json.dumps(self.summary, indent=1, default=str))
        write_text_atomic(self.out / "demo.md", self.markdown())

    def markdown(self) -> str:
        s, sm = self.sizes, self.summary
        m = sm["eval"]["meta"]
        gen = sm["generation"]
        t = ev.Table.from_json(json.dumps({"meta": m, "rows": sm["eval"]["rows"]}))
        steps = ", ".join(f"{st['name']} {_fmt_s(st['seconds'])}" + (" (cached)" if st["cached"] else "")
                          for st in self.steps)
        return "\n".join([
            f"`{sm['command']}` on {sm['machine']}, {sm['date']}; total {_fmt_s(sm['seconds'])} ({steps}).",
            "",
            f"Model {Path(sm['model']).name}; calibration: {sm['calibration']['tokens']} tokens of the bundled "
            f"corpus, {sm['calibration']['method']}. Evaluation on held-out {Path(m['text']).name}: "
            f"ctx {m['ctx']}, {m['chunks']} chunks, KLD against f16 KV.",
            "",
            t.to_markdown(),
            "",
            quality_claim(t) or "",
            "",
            f"KV memory of one sequence ({self.conv_info.n_layer} layers x {self.conv_info.n_head_kv} KV heads x "
            f"head_dim {self.conv_info.head_dim_k}):",
            "",
            sm["kv_memory"]["markdown"],
            "",
            f"Greedy continuation of {gen['prompt_tokens']} held-out tokens with oscar2 KV:",
            "",
            "> " + _one_line(gen["oscar2"]),
            "",
            f"({gen['same_prefix']} of {gen['n_gen']} tokens as with f16 KV.)",
            ""])


def _restore_llama_log() -> None:
    """Point libllama's log back at llama-cpp-python's own callback.

    The llama.cpp capture of the calibration installs a log callback that lives only as long
    as its capture object; libllama keeps calling it afterwards, so a later Llama(...) in
    the same process would call freed memory (it crashed the generation step)."""
    import ctypes

    import llama_cpp
    from llama_cpp import _logger
    llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _one_line(s: str) -> str:
    return " ".join(s.split())


def greedy_generations(model: Path, text_path: Path, prompt_tokens: int, n_gen: int,
                       n_threads: int | None) -> dict:
    """Greedy continuations of a held-out passage with oscar2 and with f16 KV (llama_cpp.Llama)."""
    import llama_cpp

    body = read_text_file(text_path)
    # a passage from the middle of the text, starting at a paragraph
    start = body.find("\n\n", len(body) // 2) + 2
    passage = body[start:start + 12 * prompt_tokens]
    out = {"prompt_tokens": 0, "n_gen": n_gen}
    toks = None
    for name, ct in (("oscar2", llama_cpp.GGML_TYPE_OSCAR2), ("f16", llama_cpp.GGML_TYPE_F16)):
        llm = llama_cpp.Llama(str(model), n_ctx=prompt_tokens + n_gen + 64, n_batch=512, type_k=ct, type_v=ct,
                              flash_attn=True, n_threads=n_threads, n_threads_batch=n_threads, verbose=False,
                              seed=1234)
        try:
            if toks is None:
                toks = llm.tokenize(passage.encode(), add_bos=True)[:prompt_tokens]
                out["prompt_tokens"] = len(toks)
                out["prompt_tail"] = llm.detokenize(toks[-40:]).decode("utf-8", "replace")
            gen = []
            for t in llm.generate(toks, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                gen.append(int(t))
                if len(gen) >= n_gen or t == llm.token_eos():
                    break
            out[name + "_tokens"] = gen
            out[name] = llm.detokenize(gen).decode("utf-8", "replace")
        finally:
            llm.close()
    same = 0
    for a, b in zip(out["oscar2_tokens"], out["f16_tokens"]):
        if a != b:
            break
        same += 1
    out["same_prefix"] = same
    return out


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


_FLAGS = (("model", "--model"), ("out", "--out"), ("quick", "--quick"), ("force", "--force"), ("tokens", "--tokens"),
          ("seq_len", "--seq-len"), ("rotation", "--rotation"), ("ctx", "--ctx"), ("chunks", "--chunks"),
          ("text", "--text"), ("long_ctx", "--long-ctx"), ("prompt_tokens", "--prompt-tokens"),
          ("gen_tokens", "--gen-tokens"), ("threads", "--threads"))


def command_line(args) -> str:
    """The command as a user would type it, from the parsed options (defaults left out)."""
    parts = ["oscar", "demo"]
    for attr, flag in _FLAGS:
        v = getattr(args, attr, None)
        if v is None or v is False or (attr == "out" and v == DEFAULT_OUT):
            continue
        parts += [flag] if v is True else [flag, shlex.quote(str(v))]
    return " ".join(parts)


def run_demo(args) -> int:
    from ..paths import MissingComponentError, bundled_model_path

    base = QUICK if getattr(args, "quick", False) else FULL
    pick = lambda name: getattr(args, name, None) if getattr(args, name, None) is not None else getattr(base, name)
    try:
        sizes = Sizes(tokens=pick("tokens"), seq_len=pick("seq_len"), rotation=pick("rotation"), ctx=pick("ctx"),
                      chunks=pick("chunks"), prompt_tokens=pick("prompt_tokens"), gen_tokens=pick("gen_tokens"))
        if sizes.tokens < sizes.seq_len:
            raise DemoError(f"--tokens {sizes.tokens} is less than one calibration chunk of {sizes.seq_len}")
        model = Path(args.model) if args.model else bundled_model_path()
        if not model.is_file():
            raise DemoError(f"model {model} not found")
        demo = Demo(model=model, out=Path(getattr(args, "out", None) or DEFAULT_OUT), sizes=sizes,
                    text=getattr(args, "text", None), threads=getattr(args, "threads", None),
                    force=bool(getattr(args, "force", False)), progress=not getattr(args, "no_progress", False),
                    long_ctx=getattr(args, "long_ctx", None) or LONG_CONTEXT,
                    command=command_line(args))
        return demo.run()
    except (DemoError, ev.EvalError, MissingComponentError, ValueError, FileNotFoundError) as e:
        if os.environ.get("OSCAR_DEBUG"):
            raise
        print(f"oscar demo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("oscar demo: interrupted (finished steps stay cached)", file=sys.stderr)
        return 130
