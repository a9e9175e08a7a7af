"""The fuzz harness's runner: generates cases until the time budget is spent, drives every
consumer of each input through the workers, and checks what each must do.

Every case must end in a clear refusal or a correct result: no crash, no hang, no partial output,
inputs unchanged, and what oscar-convert writes loads in llama.cpp; the loader's verdict must
match the oracle wherever the rules are definite. Failures are saved with their inputs for replay.
"""
from __future__ import annotations

import collections
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..format import gguf_keys as K
from .inputs import GGUFDoc, tiny_artifact, tiny_model, write_tiny_model
from .mutations import apply_gguf_mutations, build_artifact_bytes, build_zoo_bytes
from .oracle import _ROT_NAMES, expect_loader
from .strategies import strategies
from .workers import Worker

def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _signature(consumer: str, kind: str, detail: str, case: dict) -> str:
    """What makes two failures the same bug: where it happened, not the input."""
    import re
    m = re.search(r" at (\S+:\d+)", detail) or re.search(r"(\S+\.(?:cpp|c|h):\d+): (GGML_\w+)", detail)
    if m:
        return f"{consumer}/{kind}: {m.group(0).strip()}"
    if kind in ("hang", "converted file refused", "partial output", "input changed"):
        ops = sorted({mm.get("op", "?") for mm in case.get("mutations", [])})
        return f"{consumer}/{kind}: {'+'.join(ops)}"
    return f"{consumer}/{kind}: {detail[:80]}"


# Bugs found by this fuzzer that are not fixed yet, each with where it is and what to do. A
# failure whose signature/detail matches one is counted under `known` (shown in the summary),
# not under `failures`; each has a strict-xfail regression test in tests/test_hardening_fuzz.py,
# so the entry must go when the bug is fixed. (regex over "signature detail", description)
KNOWN_ISSUES = [
]


def known_issue(signature: str, detail: str) -> str | None:
    import re
    text = f"{signature} {detail}"
    return next((desc for rx, desc in KNOWN_ISSUES if re.search(rx, text)), None)


@dataclass
class FuzzReport:
    seconds_budget: float
    seed: int
    elapsed: float = 0.0
    cases: collections.Counter = field(default_factory=collections.Counter)       # per target
    outcomes: dict[str, collections.Counter] = field(default_factory=dict)         # target -> outcome -> n
    expectations: collections.Counter = field(default_factory=collections.Counter)  # loader oracle verdicts
    refusals: collections.Counter = field(default_factory=collections.Counter)      # message -> n
    failures: list[dict] = field(default_factory=list)
    known: collections.Counter = field(default_factory=collections.Counter)          # known issue -> n
    worker_restarts: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (seconds, case), worst 5
    garbage_in: int = 0   # converted files refused because the input model itself was broken

    @property
    def total_cases(self) -> int:
        return sum(self.cases.values())

    def count(self, consumer: str, outcome: str):
        self.outcomes.setdefault(consumer, collections.Counter())[outcome] += 1

    def to_json(self) -> dict:
        return {"seconds_budget": self.seconds_budget, "seed": self.seed, "elapsed_s": round(self.elapsed, 1),
                "total_cases": self.total_cases, "cases": dict(self.cases),
                "outcomes": {k: dict(v) for k, v in self.outcomes.items()},
                "loader_oracle": dict(self.expectations), "worker_restarts": self.worker_restarts,
                "converted_refused_broken_input": self.garbage_in,
                "slowest_cases": [[round(t, 2), c] for t, c in self.slowest],
                "top_refusals": self.refusals.most_common(25),
                "known_issues_hit": self.known.most_common(),
                "distinct_failures": collections.Counter(f["signature"] for f in self.failures).most_common(),
                "failures": self.failures}

    def summary(self) -> str:
        lines = [f"oscar fuzz: {self.total_cases} cases in {self.elapsed:.1f} s (budget {self.seconds_budget:g} s, "
                 f"seed {self.seed}): {len(self.failures)} failures"]
        for t, n in sorted(self.cases.items()):
            lines.append(f"  {t:9s} {n:6d} cases")
        for c, oc in sorted(self.outcomes.items()):
            lines.append(f"    {c:18s} " + ", ".join(f"{k} {v}" for k, v in sorted(oc.items())))
        lines.append("  loader oracle: " + ", ".join(f"{k} {v}" for k, v in sorted(self.expectations.items())))
        for desc, n in self.known.most_common():
            lines.append(f"  known issue x{n}: {desc[:150]}")
        sigs = collections.Counter(f.get("signature", f["kind"]) for f in self.failures)
        if sigs:
            lines.append(f"  {len(sigs)} distinct failures:")
        for sig, n in sigs.most_common():
            first = next(f for f in self.failures if f.get("signature", f["kind"]) == sig)
            lines.append(f"  FAIL x{n} {sig}\n       {first['detail'][:300]}\n       repro: {first.get('repro', '')}")
        return "\n".join(lines)


class Fuzzer:
    def __init__(self, seconds: float, seed: int = 0, targets=("gguf", "artifact", "zoo"),
                 workdir: Path | None = None, failures_dir: Path | None = None, case_timeout: float = 20,
                 chunk: int = 8, log=None):
        self.seconds, self.seed, self.targets = seconds, seed, list(targets)
        self.case_timeout, self.chunk, self.log = case_timeout, chunk, log
        self._own_tmp = workdir is None
        self.work = Path(workdir or tempfile.mkdtemp(prefix="oscar-fuzz-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.failures_dir = Path(failures_dir) if failures_dir else self.work / "failures"
        self.report = FuzzReport(seconds, seed)
        self.loader = Worker("loader", self.work / "loader.log")
        self.python = Worker("python", self.work / "python.log")
        self._n = 0

    # -- fixed inputs ---------------------------------------------------------------------------
    def _prepare(self):
        from ..calibrate.artifact import save_artifact
        self.model_path = write_tiny_model(self.work / "tiny-plain.gguf")   # the model the rotation side converts
        self.model_sha = _sha(self.model_path)
        p = save_artifact(self.work / "base-artifact.safetensors", tiny_artifact())
        self.base_artifact = p.read_bytes()

    # -- bookkeeping ----------------------------------------------------------------------------
    def _fail(self, target: str, consumer: str, kind: str, detail: str, files: dict[str, Path], case: dict):
        sig = _signature(consumer, kind, detail, case)
        known = known_issue(sig, detail)
        if known is not None:
            self.report.known[known] += 1
            return
        d = self.failures_dir / f"case-{self._n:05d}-{consumer}"
        d.mkdir(parents=True, exist_ok=True)
        for role, p in files.items():
            if p.exists():
                shutil.copy(p, d / f"{role}{p.suffix}")
        (d / "case.json").write_text(json.dumps({"case": case, "consumer": consumer, "kind": kind,
                                                 "detail": detail}, indent=1, default=str))
        self.report.failures.append({"target": target, "consumer": consumer, "kind": kind,
                                     "detail": detail, "repro": str(d), "signature": sig})

    def _check_dir(self, case_dir: Path, allowed: set[str]) -> list[str]:
        return sorted(p.name for p in case_dir.iterdir() if p.name not in allowed)

    def _run_consumer(self, target, consumer, worker, req, inputs: dict[str, Path], case, out: Path | None):
        hashes = {r: _sha(p) for r, p in inputs.items() if p.exists()}
        res = worker.request(req, self.case_timeout)
        oc = res["outcome"]
        self.report.count(consumer, oc)
        if oc in ("crash", "hang", "bug"):
            self._fail(target, consumer, oc, res["detail"], inputs, case)
        elif oc == "refused":
            self.report.refusals[f"{consumer}: {res['detail'][:160]}"] += 1
        for r, p in inputs.items():
            if r in hashes and (not p.exists() or _sha(p) != hashes[r]):
                self._fail(target, consumer, "input changed", f"{r} {p.name} was modified", inputs, case)
        if out is not None:
            case_dir = out.parent
            allowed = {p.name for p in inputs.values()} | ({out.name} if oc == "ok" else set())
            extra = self._check_dir(case_dir, allowed)
            if extra:
                self._fail(target, consumer, "partial output", f"left behind: {extra}", inputs, case)
            if oc == "ok" and not out.exists():
                self._fail(target, consumer, "no output", "reported success but wrote nothing", inputs, case)
        return res

    def _converted_must_load(self, target, out: Path, inputs, case, input_sound: bool = True):
        """What oscar-convert writes must load in llama.cpp when its input model was sound: it
        copies the model byte for byte and validated the rotations it adds."""
        res = self._run_consumer(target, "loader(converted)", self.loader, {"path": str(out)},
                                 {"converted": out}, case, None)
        if res["outcome"] == "refused" and not input_sound:
            self.report.garbage_in += 1  # a broken model in, the same broken model out
        elif res["outcome"] == "refused":
            self._fail(target, "loader(converted)", "converted file refused",
                       f"oscar-convert wrote a GGUF llama.cpp refuses: {res['detail']}", {**inputs, "converted": out}, case)
        elif res["outcome"] == "ok" and not res.get("finite", True) and input_sound:
            self._fail(target, "loader(converted)", "non-finite logits", res["detail"], {**inputs, "converted": out}, case)

    # -- one case per target ----------------------------------------------------------------------
    def run_case(self, case: dict):
        self._n += 1
        target = case["target"]
        self.report.cases[target] += 1
        d = self.work / f"c{self._n}"
        d.mkdir()
        t0 = time.monotonic()
        try:
            getattr(self, f"_case_{target}")(case, d)
        except Exception as e:  # noqa: BLE001 - a bug of this harness must not end the run
            self.report.failures.append({"target": target, "consumer": "harness", "kind": "harness error",
                                         "detail": f"{type(e).__name__}: {e}", "repro": json.dumps(case)[:500]})
        finally:
            shutil.rmtree(d, ignore_errors=True)
            dt = time.monotonic() - t0
            self.report.slowest = sorted(self.report.slowest + [(dt, json.dumps(case)[:300])], reverse=True)[:5]

    def _case_gguf(self, case, d: Path):
        doc = tiny_model()
        data, facts = apply_gguf_mutations(doc, case["mutations"])
        p = d / "model.gguf"
        p.write_bytes(data)
        inputs = {"model": p}
        expect, why = expect_loader(doc, facts)
        self.report.expectations[expect] += 1
        res = self._run_consumer("gguf", "loader", self.loader, {"path": str(p)}, inputs, case, None)
        got = {"ok": "accept", "refused": "refuse"}.get(res["outcome"])
        if got and expect != "either" and got != expect:
            self._fail("gguf", "loader", f"expected {expect}, got {got}",
                       f"oracle: {why}; loader: {res['detail']}", inputs, case)
        if got == "accept" and not res.get("finite", True) and not facts["uncertain"]:
            self._fail("gguf", "loader", "non-finite logits", res["detail"], inputs, case)
        self._run_consumer("gguf", "inspect", self.python, {"kind": "inspect", "path": str(p)}, inputs, case, None)
        out = d / "out.gguf"
        res = self._run_consumer("gguf", "convert", self.python, {"kind": "convert", "path": str(p), "out": str(out)},
                                 inputs, case, out)
        if res["outcome"] == "ok" and out.exists():
            # convert --replace swaps every oscar key and rotation tensor: the rest must be sound
            stripped = GGUFDoc([kv for kv in doc.kvs if not kv.key.startswith(K.OSCAR_PREFIX.encode())],
                               [t for t in doc.tensors if t.name not in _ROT_NAMES], doc.version,
                               doc.n_tensors, doc.n_kv)
            sound = expect_loader(stripped, facts)[0] == "accept"
            self._converted_must_load("gguf", out, inputs, case, input_sound=sound)

    def _rotation_side(self, target, case, d: Path, req: dict, inputs: dict[str, Path]):
        out = d / "out.gguf"
        req = {**req, "kind": target, "model": str(self.model_path), "out": str(out)}
        res = self._run_consumer(target, "convert", self.python, req, inputs, case, out)
        if _sha(self.model_path) != self.model_sha:
            self._fail(target, "convert", "input changed", "the model file was modified", inputs, case)
            write_tiny_model(self.model_path)
        if res["outcome"] == "ok" and out.exists():
            self._converted_must_load(target, out, inputs, case)

    def _case_artifact(self, case, d: Path):
        p = d / "rot.safetensors"
        p.write_bytes(build_artifact_bytes(self.base_artifact, case["mutations"]))
        self._rotation_side("artifact", case, d, {"rotations": str(p)}, {"artifact": p})

    def _case_zoo(self, case, d: Path):
        seed = self._n
        kp, vp = d / "k_rotation_qqt_r_h_pbr.pt", d / "v_rotation_sst_r_h_pbr.pt"
        muts = case["mutations"]
        kp.write_bytes(build_zoo_bytes("k", muts if case["file"] in ("k", "both") else [], seed))
        vp.write_bytes(build_zoo_bytes("v", muts if case["file"] in ("v", "both") else [], seed + 1))
        self._rotation_side("zoo", case, d, {"k_rot": str(kp), "v_rot": str(vp)}, {"k": kp, "v": vp})

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> FuzzReport:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hseed
        t0 = time.monotonic()
        deadline = t0 + self.seconds
        try:
            self._prepare()
            # start the workers (imports of llama_cpp / torch) before the clock matters
            self.loader.request({"op": "ping"}, 120)
            self.python.request({"op": "ping"}, 120)
            cases = strategies()

            def body(case):
                if time.monotonic() < deadline:
                    self.run_case(case)

            chunk_no = 0
            while time.monotonic() < deadline:
                target = self.targets[chunk_no % len(self.targets)]
                run = hseed(self.seed * 100003 + chunk_no)(settings(
                    max_examples=self.chunk, database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck), derandomize=False)(given(cases[target])(body)))
                run()
                chunk_no += 1
                if self.log:
                    self.log(f"[{time.monotonic() - t0:6.1f} s] {self.report.total_cases} cases, "
                             f"{len(self.report.failures)} failures")
        finally:
            self.loader.close()
            self.python.close()
            self.report.worker_restarts = self.loader.restarts + self.python.restarts
            self.report.elapsed = time.monotonic() - t0
        return self.report

    def replay(self, case: dict) -> FuzzReport:
        """Run one saved case (failures/<case>/case.json) again."""
        self._prepare()
        try:
            self.run_case(case)
        finally:
            self.loader.close()
            self.python.close()
        return self.report

    def cleanup(self):
        if self._own_tmp and not self.report.failures:
            shutil.rmtree(self.work, ignore_errors=True)


def run_fuzz(seconds: float, seed: int = 0, targets=("gguf", "artifact", "zoo"), workdir=None,
             failures_dir=None, case_timeout: float = 20, log=None) -> FuzzReport:
    fz = Fuzzer(seconds, seed, targets, workdir, failures_dir, case_timeout, log=log)
    try:
        return fz.run()
    finally:
        fz.cleanup()
