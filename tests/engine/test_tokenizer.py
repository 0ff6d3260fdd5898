"""The incremental detokenizer (`Tokenizer.text_stream`) against decoding the whole sequence: the
demo model's byte-level BPE and a one-token-per-byte tokenizer, whose multi-byte characters
arrive over several tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_checkpoint import add_byte_tokenizer

from mambaserve.engine.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "mambaserve" / "assets" / "demo_model"
TEXT = "naïve café: 東京 🎉 déjà vu — ok.\n  spaces\tand tabs, 12345!"


@pytest.fixture(scope="module", params=["demo", "bytes"])
def tok(request, tmp_path_factory):
    if request.param == "demo":
        return Tokenizer(DEMO)
    return Tokenizer(add_byte_tokenizer(tmp_path_factory.mktemp("byte_tok")))


def _check_stream(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    stream, text = tok.text_stream(skip), ""
    for i in range(1, len(ids) + 1):
        text += stream.add(ids[:i])
        whole = tok.decode(ids[:i], skip)
        # what is shown so far is the whole decode without a character still incomplete
        assert whole.startswith(text), (i, whole, text)
        assert whole[len(text):].strip("\ufffd") == "", (i, whole, text)
    return text


def test_stream_equals_the_whole_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 20
    assert _check_stream(tok, ids, skip=True) == tok.decode(ids) == TEXT


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hello", add_special_tokens=False)
    eos = tok.eos_token_id
    seq = ids + [eos] + tok.encode(" world", add_special_tokens=False)
    assert _check_stream(tok, seq, skip=True) == tok.decode(seq, True)
    assert _check_stream(tok, seq, skip=False) == tok.decode(seq, False)
    eos_text = tok.token_text(eos)
    assert eos_text in tok.decode(seq, False) and eos_text not in tok.decode(seq, True)


def test_random_token_ids(tok):
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(60)]
        text = _check_stream(tok, ids, skip=True)
        assert tok.decode(ids).startswith(text)


class _Failing:
    """Stands in for a DecodeStream that raises, as tokenizers' does on some byte sequences."""

    def step(self, tok, token_id):
        raise Exception("Invalid prefix encountered")


def test_a_failing_stream_falls_back_to_whole_decodes(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stream, text = tok.text_stream(True), ""
    for i in range(len(ids)):
        if i == 7:
            stream._stream = _Failing()
        text += stream.add(ids[: i + 1])
        whole = tok.decode(ids[: i + 1])
        assert whole.startswith(text) and whole[len(text):].strip("\ufffd") == ""
    assert stream.fell_back and text == TEXT
