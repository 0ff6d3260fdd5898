"""Structured output through the engine on the demo model (float32, CPU): 50 seeded requests per
kind (json_object, three JSON schemas, a regex, a choice, an EBNF grammar), all in one batch,
each output parsed and validated independently (json + jsonschema, re.fullmatch, membership);
a constrained request's tokens are the same alone as in that batch; greedy constrained output
equals a reference that runs transformers' model and applies the same grammar's mask in plain
PyTorch; a bad spec is refused before anything is queued."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from mambaserve import LLM, SamplingParams
from mambaserve.default_model import DEMO_MODEL_DIR
from mambaserve.engine.sampling_params import StructuredOutput

N = 50
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["king", "queen", "fool", "soldier"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
SCENE = {"type": "object", "properties": {
    "play": {"type": "string", "enum": ["Hamlet", "Macbeth", "King Lear"]},
    "act": {"type": "integer", "minimum": 1, "maximum": 5},
    "tragic": {"type": "boolean"},
    "speakers": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 10},
                 "minItems": 1, "maxItems": 3},
    "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]}},
    "required": ["play", "act", "tragic", "speakers", "note"]}
CUES = {"type": "array", "items": {"type": "object", "properties": {
    "line": {"type": "integer", "minimum": 1, "maximum": 999},
    "exit": {"type": "boolean"}}, "required": ["line", "exit"]},
    "minItems": 1, "maxItems": 3}
REGEX = r"[A-Z][a-z]{2,8} (of|the) [A-Z][a-z]{2,8}"
CHOICES = ["Romeo", "Juliet", "Mercutio", "Tybalt"]
GRAMMAR = ('root ::= greeting ", " name "!"\n'
           'greeting ::= "Hail" | "Good morrow"\n'
           'name ::= [A-Z] [a-z]{1,8}')
GRAMMAR_AS_REGEX = r"(Hail|Good morrow), [A-Z][a-z]{1,8}!"
# the demo model writes Shakespeare, where '"' and '}' are rare: for any-JSON-object output the
# requests bias those two tokens up so that strings and objects close (logit_bias + structured)
QUOTE, BRACE = 5, 96


def _json(schema):
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema)
    return check


def _json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


KINDS = {
    "json_object": (StructuredOutput("json_object"), _json_object),
    "json_schema_person": (StructuredOutput("json_schema", json.dumps(PERSON)), _json(PERSON)),
    "json_schema_scene": (StructuredOutput("json_schema", json.dumps(SCENE)), _json(SCENE)),
    "json_schema_cues": (StructuredOutput("json_schema", json.dumps(CUES)), _json(CUES)),
    "regex": (StructuredOutput("regex", REGEX), lambda t: re.fullmatch(REGEX, t) or 1 / 0),
    "choice": (StructuredOutput("choice", CHOICES), lambda t: CHOICES.index(t)),
    "grammar": (StructuredOutput("grammar", GRAMMAR),
                lambda t: re.fullmatch(GRAMMAR_AS_REGEX, t) or 1 / 0),
}
PROMPTS = ["ROMEO:", "JULIET:\nO", "Enter HAMLET.", "KING LEAR. Speak", "FOOL:"]


def params_for(kind: str, i: int, **kw) -> SamplingParams:
    bias = {QUOTE: 7.0, BRACE: 7.0} if kind == "json_object" else None
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=200,
                          structured_output=KINDS[kind][0], logit_bias=bias, **kw)


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(None, dtype="float32", max_num_seqs=N * len(KINDS))


@pytest.fixture(scope="module")
def batch_run(demo_llm):
    prompts, params, kinds = [], [], []
    for kind in KINDS:
        for i in range(N):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(params_for(kind, i))
            kinds.append(kind)
    outs = demo_llm.generate(prompts, params)
    demo_llm.engine.check_integrity()
    return kinds, prompts, outs


@pytest.mark.parametrize("kind", list(KINDS))
def test_fifty_seeded_requests_parse_and_validate(batch_run, kind):
    kinds, _, outs = batch_run
    texts = []
    for k, o in zip(kinds, outs):
        if k != kind:
            continue
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == 0, (c.text, c.finish_reason)
        KINDS[kind][1](c.text)  # raises if it does not parse / validate
        texts.append(c.text)
    assert len(texts) == N
    assert len(set(texts)) > (1 if kind == "choice" else N // 5)  # seeds give varied outputs


def test_same_tokens_alone_as_in_the_batch(demo_llm, batch_run):
    kinds, prompts, outs = batch_run
    for kind, i in (("json_schema_scene", 3), ("regex", 7), ("json_object", 11)):
        j = kinds.index(kind) + i
        alone = demo_llm.generate(prompts[j], params_for(kind, i))[0].outputs[0]
        assert alone.token_ids == outs[j].outputs[0].token_ids


def test_ignore_eos_and_min_tokens_still_end_with_the_grammar(demo_llm):
    out = demo_llm.generate("ROMEO:", params_for("choice", 0, ignore_eos=True, min_tokens=50))
    c = out[0].outputs[0]
    assert c.text in CHOICES and c.finish_reason == "stop" and c.token_ids[-1] == 0


@pytest.fixture(scope="module")
def demo_hf():
    from transformers import NemotronHForCausalLM

    return NemotronHForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def reference_greedy(hf, compiler, so, prompt_ids, max_tokens) -> list[int]:
    """transformers' logits, the grammar's mask unpacked with numpy, argmax: token by token."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile(so))
    vocab = compiler.vocab_size
    ids, out = list(prompt_ids), []
    mask = np.zeros((1, -(-vocab // 32)), dtype=np.int32)
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(mask, 0)
        ok = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
        t = int(torch.where(torch.from_numpy(ok), logits, float("-inf")).argmax())
        out.append(t)
        ids.append(t)
        assert matcher.accept_token(t)
        if matcher.is_terminated():
            break
    return out


@pytest.mark.parametrize("kind, prompt", [("json_schema_person", "ROMEO:"),
                                          ("regex", "Enter HAMLET."),
                                          ("grammar", "FOOL:")])
def test_greedy_constrained_equals_the_plain_pytorch_reference(demo_llm, demo_hf, kind, prompt):
    so = KINDS[kind][0]
    sp = SamplingParams(temperature=0, max_tokens=80, structured_output=so)
    got = demo_llm.generate(prompt, sp)[0].outputs[0]
    ids = demo_llm.get_tokenizer().encode(prompt)
    want = reference_greedy(demo_hf, demo_llm.engine.grammars, so, ids, 80)
    assert got.token_ids == want
    assert got.finish_reason == "stop"
    KINDS[kind][1](got.text)


@pytest.mark.parametrize("so", [StructuredOutput("json_schema", '{"type": "flying"}'),
                                StructuredOutput("regex", "(unclosed"),
                                StructuredOutput("grammar", "root ::= nowhere")])
def test_bad_spec_is_refused_before_anything_is_queued(demo_llm, so):
    with pytest.raises(ValueError, match=f"invalid structured output {so.kind}"):
        demo_llm.generate("ROMEO:", SamplingParams(structured_output=so))
    assert not demo_llm.engine.has_unfinished_requests()
