"""Calibration text: FILE | DIR | JSONL in, fixed-length token chunks out.

The default corpus ships in oscar_gguf/data/calib (see SOURCES.md there). Text is read
lazily and tokenized document by document, so a large folder is read only as far as the
requested number of tokens needs.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "calib"
TEXT_SUFFIXES = (".txt", ".md", ".text", ".jsonl")
DOC_SEPARATOR = "\n\n"


class CorpusError(ValueError):
    """Bad or insufficient calibration text; the message says what to do."""


@dataclass
class Document:
    name: str
    text: str


def _read_jsonl(path: Path) -> Iterator[Document]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be a JSON "
                                  f"object with a \"text\" field or a JSON string") from None
            if isinstance(obj, str):
                text = obj
            elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
                text = obj["text"]
            elif isinstance(obj, dict) and isinstance(obj.get("content"), str):
                text = obj["content"]
            else:
                raise CorpusError(f"{path}:{n}: expected a JSON object with a \"text\" string "
                                  f"(or a JSON string)")
            if text.strip():
                yield Document(f"{path.name}:{n}", text)


def _read_file(path: Path) -> Iterator[Document]:
    if path.suffix.lower() == ".jsonl":
        yield from _read_jsonl(path)
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CorpusError(f"{path} is not UTF-8 text; pass a text file, a folder of .txt/.md files "
                          f"or a JSONL file") from None
    if text.strip():
        yield Document(path.name, text)


def default_corpus_files() -> list[Path]:
    files = sorted(p for p in DEFAULT_CORPUS_DIR.glob("*.txt"))
    if not files:
        raise CorpusError(f"the bundled calibration corpus is missing from {DEFAULT_CORPUS_DIR}; "
                          f"reinstall oscar-gguf or pass --text")
    return files


def _sections(doc: Document, size: int) -> list[Document]:
    """Cut a document into pieces of about `size` characters at blank lines."""
    out, text, start, n = [], doc.text, 0, 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.find("\n\n", end)
            end = len(text) if cut < 0 else cut + 2
        out.append(Document(f"{doc.name}#{n}", text[start:end]))
        start, n = end, n + 1
    return out


def _interleaved_default(section_chars: int = 8000) -> Iterator[Document]:
    """The bundled files cut into sections and taken in turn, so that any prefix of the
    stream (e.g. 32k tokens) mixes the technical and the literary text."""
    queues = [_sections(d, section_chars) for p in default_corpus_files() for d in _read_file(p)]
    for i in range(max(len(q) for q in queues)):
        for q in queues:
            if i < len(q):
                yield q[i]


def iter_documents(source: str | Path | list[str] | None) -> Iterator[Document]:
    """Documents of a FILE, a DIR (its .txt/.md/.jsonl files, sorted, recursively) or JSONL.

    None means the bundled default corpus; a list or tuple holds the texts themselves.
    """
    if isinstance(source, (list, tuple)):
        for n, text in enumerate(source):
            if not isinstance(text, str):
                raise CorpusError(f"documents must be strings, item {n} is {type(text).__name__}")
            yield Document(f"document {n}", text)
        return
    if source is None:
        yield from _interleaved_default()
        return
    path = Path(source)
    if path.is_file():
        yield from _read_file(path)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise CorpusError(f"{path} holds no .txt, .md or .jsonl files")
        for p in files:
            yield from _read_file(p)
    else:
        raise CorpusError(f"calibration text {path} does not exist")


def describe_source(source: str | Path | None) -> str:
    """A short provenance string for the artifact metadata."""
    if source is None:
        return "oscar-gguf default corpus (" + ", ".join(p.name for p in default_corpus_files()) + ")"
    if isinstance(source, (list, tuple)):
        return f"{len(source)} documents given in Python"
    return str(Path(source).resolve())


def tokenize_stream(docs: Iterator[Document], encode: Callable[[str], list[int]], need: int,
                    piece_chars: int = 20000) -> np.ndarray:
    """Token ids of the documents joined by a blank line, stopping once `need` are there.

    Long documents are encoded in pieces cut at line breaks so that no single tokenizer call
    is huge; cutting at a newline changes tokenization only across that newline.
    """
    out: list[int] = []
    first = True
    for doc in docs:
        text = doc.text if first else DOC_SEPARATOR + doc.text
        first = False
        start = 0
        while start < len(text) and len(out) < need:
            end = min(len(text), start + piece_chars)
            if end < len(text):
                cut = text.rfind("\n", start + piece_chars // 2, end)
                end = cut + 1 if cut > 0 else end
            out.extend(encode(text[start:end]))
            start = end
        if len(out) >= need:
            break
    return np.asarray(out[:need], dtype=np.int64)


@dataclass
class ChunkPlan:
    seq_len: int
    n_stat_chunks: int      # chunks for the covariances (both passes)
    n_clip_chunks: int      # held-out calibration chunks for the clip search

    @property
    def tokens_needed(self) -> int:
        return (self.n_stat_chunks + self.n_clip_chunks) * self.seq_len


def plan_chunks(tokens: int, seq_len: int, clip_search: bool) -> ChunkPlan:
    """Statistics over ceil(tokens / seq_len) chunks; for the clip search 1/8 as many more
    (at least 1, at most 8) held-out chunks taken after them."""
    if seq_len < 16:
        raise CorpusError(f"--seq-len {seq_len} is too short; use at least 16 (e.g. 2048)")
    if tokens < seq_len:
        raise CorpusError(f"--tokens {tokens} is less than one chunk of --seq-len {seq_len}; "
                          f"raise --tokens or lower --seq-len")
    n_stat = math.ceil(tokens / seq_len)
    n_clip = min(8, max(1, math.ceil(n_stat / 8))) if clip_search else 0
    return ChunkPlan(seq_len, n_stat, n_clip)


def make_chunks(source: str | Path | None, encode: Callable[[str], list[int]], prefix: list[int],
                plan: ChunkPlan) -> tuple[np.ndarray, np.ndarray]:
    """(stat_chunks [n, L], clip_chunks [m, L]) of token ids; each chunk starts with `prefix`
    (the BOS the model's tokenizer adds, if any), then seq_len − len(prefix) text tokens."""
    body = plan.seq_len - len(prefix)
    if body <= 0:
        raise CorpusError(f"--seq-len {plan.seq_len} leaves no room after the BOS prefix")
    n_chunks = plan.n_stat_chunks + plan.n_clip_chunks
    ids = tokenize_stream(iter_documents(source), encode, n_chunks * body)
    have = len(ids) // body
    if have < n_chunks:
        what = ("the bundled corpus" if source is None else "the documents" if isinstance(source, (list, tuple))
                else str(source))
        raise CorpusError(
            f"{what} gives {len(ids)} tokens, but {n_chunks} chunks of {plan.seq_len} "
            f"({plan.n_stat_chunks} for statistics + {plan.n_clip_chunks} held out for the clip search) "
            f"need {n_chunks * body}; pass more text with --text or lower --tokens/--seq-len")
    chunks = ids[:n_chunks * body].reshape(n_chunks, body)
    if prefix:
        chunks = np.concatenate([np.tile(np.asarray(prefix, dtype=np.int64), (n_chunks, 1)), chunks], axis=1)
    return chunks[:plan.n_stat_chunks], chunks[plan.n_stat_chunks:]
