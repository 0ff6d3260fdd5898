"""structured/grammar.py: compile errors are one-line ValueErrors, compiled grammars are cached by
(kind, spec), a missing xgrammar names the extra, ids past the tokenizer's vocabulary are never
allowed, choices are matched literally (quotes, backslashes, newlines, non-ASCII), and a matcher
finishes on its stop token. Tokenizers: the tiny checkpoint's byte-level one (259 tokens for a
320-wide model) and the demo model's BPE."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("xgrammar")

from mambaserve.default_model import DEMO_MODEL_DIR
from mambaserve.engine.sampling_params import SamplingParams, StructuredOutput
from mambaserve.engine.tokenizer import Tokenizer
from mambaserve.layers.logits_processors import bitmask_words
from mambaserve.structured.grammar import EXTRA_HINT, GrammarCompiler

TINY_VOCAB, TINY_EOS = 320, 2


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return GrammarCompiler(tiny_ckpt / "tokenizer.json", TINY_VOCAB, [TINY_EOS]), \
        Tokenizer(tiny_ckpt)


@pytest.fixture(scope="module")
def demo():
    return GrammarCompiler(DEMO_MODEL_DIR / "tokenizer.json", 4096, [0])


def allowed(grammar, vocab: int) -> np.ndarray:
    mask = np.full((1, bitmask_words(vocab)), -1, dtype=np.int32)
    grammar.fill(mask, 0)
    return np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.mark.parametrize("so, words", [
    (StructuredOutput("regex", "[a-"), "Regex"),
    (StructuredOutput("grammar", "root ::= missing_rule"), "missing_rule"),
    (StructuredOutput("grammar", "root ::= ("), "EBNF"),
    (StructuredOutput("json_schema", '{"type": "flying"}'), "flying"),
    (StructuredOutput("json_schema", '{"type": '), "not valid JSON"),
    (StructuredOutput("json_schema", "[1, 2]"), "must be a JSON object"),
])
def test_bad_specs_are_one_line_value_errors(demo, so, words):
    with pytest.raises(ValueError) as e:
        demo.compile(so)
    msg = str(e.value)
    assert words in msg and so.kind in msg and "\n" not in msg and len(msg) <= 300, msg
    assert "/project/" not in msg and ".cc:" not in msg  # xgrammar's C++ location is cut


@pytest.mark.parametrize("so", [
    StructuredOutput("nonsense", "x"), StructuredOutput("choice", []),
    StructuredOutput("choice", ["a", ""]), StructuredOutput("regex", ""),
    StructuredOutput("json_schema", {"type": "object"}), StructuredOutput("json_object", "x"),
])
def test_bad_shapes_are_refused_by_sampling_params(so):
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output=so)


def test_compiled_grammars_are_cached_by_kind_and_spec(tiny_ckpt):
    c = GrammarCompiler(tiny_ckpt / "tokenizer.json", TINY_VOCAB, [TINY_EOS], cache_size=2)
    a = c.compile(StructuredOutput("choice", ["x", "y"]))
    assert c.compile(StructuredOutput("choice", ("x", "y"))) is a  # list or tuple: same key
    b = c.compile(StructuredOutput("regex", "[0-9]+"))
    assert b is not a
    c.compile(StructuredOutput("json_object"))  # evicts the least recently used (the choice)
    assert c.compile(StructuredOutput("regex", "[0-9]+")) is b
    assert c.compile(StructuredOutput("choice", ["x", "y"])) is not a


def test_missing_xgrammar_names_the_extra(tiny_ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    c = GrammarCompiler(tiny_ckpt / "tokenizer.json", TINY_VOCAB, [TINY_EOS])
    with pytest.raises(ValueError) as e:
        c.compile(StructuredOutput("json_object"))
    assert str(e.value) == EXTRA_HINT and 'pip install "mambaserve[structured]"' in EXTRA_HINT


def test_no_tokenizer_is_a_clear_error(tmp_path):
    c = GrammarCompiler(None, TINY_VOCAB, [TINY_EOS])
    with pytest.raises(ValueError, match="tokenizer"):
        c.compile(StructuredOutput("json_object"))


def test_special_and_padded_ids_are_never_allowed(tiny):
    """The tiny model's logits are 320 wide, its tokenizer has 259 tokens: 3 special ones
    (<pad>, <s>, </s> = EOS) and 256 bytes."""
    compiler, tok = tiny
    assert tok.vocab_size == 259
    g = compiler.matcher(StructuredOutput("json_object"))
    g.advance(tok.encode('{"'))  # inside a string: every byte that is valid here is allowed
    ok = allowed(g, TINY_VOCAB)
    text = [tok.token_text(i) for i in range(3, 259)]
    printable = [i + 3 for i, t in enumerate(text) if len(t) == 1 and " " <= t <= "~"]
    assert ok[printable].all() and len(printable) == 95  # printable ASCII, '"' and '\\' too
    assert not ok[:3].any()  # <pad>, <s> are not text; EOS cannot end an open string
    assert not ok[259:].any()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}},
     "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 2}},
     "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
])
def test_json_strings_never_hold_raw_control_characters(tiny, schema):
    """JSON forbids U+0000-U+001F inside strings; xgrammar 0.2.9 lets length-bounded strings
    have them, which grammar.py corrects."""
    import json

    compiler, tok = tiny
    g = compiler.matcher(StructuredOutput("json_schema", json.dumps(schema)))
    assert not g.advance(tok.encode('{"a": "'))
    ok = allowed(g, TINY_VOCAB)
    control = [tok.encode(chr(c))[0] for c in range(32)]
    assert not ok[control].any()
    assert ok[[tok.encode(c)[0] for c in "aZ0 ~"]].all()


@pytest.mark.parametrize("choices", [
    ["yes", "no"], ['say "hi"', "back\\slash", "two\nlines"], ["café", "naïve ☃", "😀"],
])
def test_choices_are_matched_literally(tiny, choices):
    compiler, tok = tiny
    so = StructuredOutput("choice", choices)
    for c in choices:
        g, seen = compiler.matcher(so), []
        for t in tok.encode(c):
            assert allowed(g, TINY_VOCAB)[t], (c, t)
            seen.append(t)
            assert not g.advance(seen)
        assert allowed(g, TINY_VOCAB).nonzero()[0].tolist() == [TINY_EOS]  # complete: only EOS
        assert g.advance(seen + [TINY_EOS]) and not g.rejected
    first = allowed(compiler.matcher(so), TINY_VOCAB)
    assert not first[tok.encode("Z")[0]]  # no choice starts with Z


def test_advance_is_incremental_and_idempotent(demo):
    tok = Tokenizer(DEMO_MODEL_DIR)
    g = demo.matcher(StructuredOutput("regex", "[a-z]+ [0-9]{2}"))
    ids = tok.encode("hello 42")
    g.advance(ids[:2])
    g.advance(ids[:2])  # the same tokens again: nothing new fed
    assert g.num_accepted == 2
    assert not g.advance(ids)
    assert allowed(g, 4096).nonzero()[0].tolist() == [0]
    assert g.advance(ids + [0]) and not g.rejected
    assert allowed(g, 4096).nonzero()[0].tolist() == [0]  # finished: only the stop token again


def test_a_rejected_token_finishes_the_grammar(tiny):
    compiler, tok = tiny
    g = compiler.matcher(StructuredOutput("regex", "[0-9]+"))
    assert g.advance(tok.encode("x")) and g.rejected and g.finished
    assert allowed(g, TINY_VOCAB).nonzero()[0].tolist() == [TINY_EOS]
