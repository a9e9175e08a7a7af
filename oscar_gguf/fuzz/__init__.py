"""`oscar fuzz`: bounded fuzzing of everything that parses OSCAR inputs.

Targets (each case is one generated input, driven through every consumer of that format):

  gguf      a tiny, fully valid llama GGUF with OSCAR rotations, mutated (oscar.* metadata,
            blk.{i}.attn_{k,v}_rot tensors, model keys, tensor table, truncation, bit flips),
            then fed to the patched llama.cpp loader (model load + oscar2 context + decode),
            `oscar inspect` and `oscar-convert --replace`
  artifact  a valid calibration artifact (.safetensors), mutated at the byte, header and
            tensor level, then read by `load_artifact` and converted into the tiny GGUF
  zoo       a valid RotationZoo .pt pair, mutated in structure, dtypes, shapes and bytes, then
            imported by `import_rotationzoo` (through oscar-convert's own path) and converted

Every case must end in a clear refusal or a correct result:
  * no crash: the worker process never dies by a signal (abort, segfault), and Python code
    raises only our own errors (GGUFError; the readers' documented ValueError, raised by a
    `raise` statement of ours, never a stray int()/index error) with a one-line message;
  * no hang: every case runs under a timeout in a worker process that is killed past it;
  * no partial output: the output folder holds the finished file or nothing;
  * inputs unchanged: sha256 of every input file before and after;
  * correct results: what oscar-convert writes must load in llama.cpp, and the loader's
    verdict must match an independent model of the rules (oracle.py) wherever the rules are
    definite (a NaN rotation is refused, a permuted one is accepted, ...).

Inputs are generated with hypothesis (structured strategies, no shrinking: a failing case is
saved with its inputs for replay), in chunks until the time budget is spent.

    inputs.py      the tiny model and artifact, and GGUFDoc: a GGUF that can be written malformed
    strategies.py  the cases, as hypothesis strategies
    mutations.py   applying a case to the GGUF, the artifact or a RotationZoo pair
    oracle.py      what llama.cpp must do with a GGUF, modelled independently
    workers.py     the subprocesses that run each consumer, one JSON request a line
    runner.py      the loop, the checks and the report
    cli.py         `oscar fuzz` and `python -m oscar_gguf.fuzz --worker ...`

The names below are the parts that scripts and tests drive one by one.
"""
from ..format import gguf_keys as K
from .inputs import ARRAY, I32, STRING, U32, serialize, tiny_artifact, tiny_model
from .mutations import apply_gguf_mutations, build_artifact_bytes, build_zoo_bytes
from .oracle import expect_loader
from .runner import KNOWN_ISSUES, Fuzzer, FuzzReport, run_fuzz
from .workers import Worker, _python_call

__all__ = ["K", "ARRAY", "I32", "STRING", "U32", "serialize", "tiny_artifact", "tiny_model", "apply_gguf_mutations",
           "build_artifact_bytes", "build_zoo_bytes", "expect_loader", "KNOWN_ISSUES", "Fuzzer", "FuzzReport",
           "run_fuzz", "Worker", "_python_call"]
