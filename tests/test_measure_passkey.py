"""Issue 8: `oscar eval --passkey` (needle in a haystack through llama-server)."""
from __future__ import annotations

import json

import pytest

from oscar_gguf.measure import passkey as pk
from oscar_gguf.measure.cli import main as cli


class FakeServer:
    """Counts one token per whitespace-separated word, like a very plain tokenizer."""

    def post(self, path, body, timeout=0):
        assert path == "/tokenize"
        return {"tokens": body["content"].split()}


@pytest.mark.parametrize("length,depth", [(256, 0.0), (1024, 0.5), (4096, 1.0)])
def test_prompt_fits_the_length_and_places_the_needle(length, depth):
    prompt, n = pk._Prompter(FakeServer()).build(length, depth, "12345")
    assert n == len(prompt.split()) <= length - pk.N_PREDICT - 2
    assert n > 0.8 * (length - pk.N_PREDICT)
    haystack = len(prompt) - len(pk.INTRO) - len(pk.QUESTION)
    where = (prompt.index("12345") - len(pk.INTRO)) / haystack
    assert abs(where - depth) < 0.1
    assert prompt.endswith(pk.QUESTION)


def test_default_lengths_stay_within_training_context():
    assert pk.default_lengths(8192) == [1024, 2048, 4096, 8192]
    assert pk.default_lengths(131072, count=3) == [32768, 65536, 131072]
    assert pk._answer_digits(" 12,345. The pass key") == "12345"


def test_passkey_end_to_end(bundled_model, tmp_path, capsys):
    out = tmp_path / "pk"
    code = cli(["eval", str(bundled_model), "--passkey", "--lengths", "256", "--depths", "0.5", "--trials", "1",
                "--settings", "f16,oscar", "-t", "2", "--no-progress", "-o", str(out)])
    assert code == 0
    data = json.loads((out / "passkey.json").read_text())
    assert len(data["trials"]) == 1 and data["trials"][0]["prompt_tokens"] <= 256
    assert "OSCAR + window" in data["notes"]  # skipped: the bundled model has no rotations
    assert data["kv_mib"]["f16"] > 0
    assert (out / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "f16  (accuracy by needle depth)" in capsys.readouterr().out
    assert cli(["eval", str(bundled_model), "--passkey", "--lengths", "100000", "--no-progress",
                "-o", str(out)]) == 2
