"""Structured output (`response_format`, vLLM's `guided_*`), `logit_bias` and the penalties
through a live server with the official openai client (tiny checkpoint: a random model over a
byte-level tokenizer), streamed and not; bad values are 400s naming the field."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from mambaserve import SamplingParams
from mambaserve.engine.sampling_params import StructuredOutput

VERDICT = {"type": "object", "properties": {
    "verdict": {"enum": ["guilty", "innocent"]},
    "years": {"type": "integer", "minimum": 0, "maximum": 30},
    "note": {"type": "string", "maxLength": 6}},
    "required": ["verdict", "years", "note"], "additionalProperties": False}
MSG = [{"role": "user", "content": "The verdict?"}]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def rf_schema(schema=VERDICT) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema,
                                                   "strict": True}}


def test_chat_json_schema_validates(server):
    r = server.client().chat.completions.create(
        model=server.model, messages=MSG, response_format=rf_schema(), n=4, seed=3,
        temperature=1.0, max_tokens=80)
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), VERDICT)


def test_chat_json_schema_stream_equals_non_stream(server):
    client = server.client()
    kw = {"model": server.model, "messages": MSG, "response_format": rf_schema(),
          "temperature": 0, "max_tokens": 80}
    full = client.chat.completions.create(**kw).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in
             client.chat.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(parts) == full
    jsonschema.validate(json.loads(full), VERDICT)


def test_completions_json_object(server):
    """The openai client has no response_format for legacy completions; vLLM takes it there."""
    tok = server.engine.tokenizer
    close = {str(tok.encode(c)[0]): 6 for c in '"}'}  # a random model: help strings end
    r = server.client().completions.create(
        model=server.model, prompt="ROMEO:", logit_bias=close, temperature=1.0, seed=5, n=3,
        max_tokens=64, extra_body={"response_format": {"type": "json_object"}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.text
        assert isinstance(json.loads(c.text), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"guided_grammar": 'root ::= "(" [a-c]{1,3} ")"'},
     lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
    ({"guided_json": VERDICT}, lambda t: jsonschema.validate(json.loads(t), VERDICT) or True),
    ({"guided_json": json.dumps(VERDICT)},
     lambda t: jsonschema.validate(json.loads(t), VERDICT) or True),
    # vLLM's current field (guided_* were removed from vLLM in 0.12)
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": r"[0-9]{3}", "disable_fallback": True}},
     lambda t: re.fullmatch(r"[0-9]{3}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "<" [a-c]{2} ">"'}},
     lambda t: re.fullmatch(r"<[a-c]{2}>", t)),
    ({"structured_outputs": {"json": VERDICT}},
     lambda t: jsonschema.validate(json.loads(t), VERDICT) or True),
    ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
])
@pytest.mark.parametrize("stream", [False, True])
def test_guided_extras(server, extra, check, stream):
    kw = {"model": server.model, "prompt": "ROMEO:", "temperature": 1.0, "seed": 11,
          "max_tokens": 80, "extra_body": extra}
    client = server.client()
    if stream:
        text = "".join(ch.choices[0].text for ch in client.completions.create(**kw, stream=True)
                       if ch.choices)
    else:
        r = client.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].text
    assert check(text), text


def test_server_output_equals_the_engine(server, offline):
    """The request fields reach the engine as the SamplingParams they name."""
    sp = SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True,
                        presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.4,
                        logit_bias={70: 3.0, 71: -100.0},
                        structured_output=StructuredOutput("regex", "[a-z ]+"))
    ref = offline.generate("To be", sp)[0].outputs[0].text
    r = server.client().completions.create(
        model=server.model, prompt="To be", temperature=0.9, seed=4, max_tokens=12,
        presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"70": 3, "71": -100},
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True, "guided_regex": "[a-z ]+"})
    assert r.choices[0].text == ref


def test_logit_bias_forces_a_token(server):
    tok = server.engine.tokenizer
    q = tok.encode("Q")[0]
    r = server.client().chat.completions.create(
        model=server.model, messages=MSG, logit_bias={str(q): 100}, temperature=1.0,
        max_tokens=5, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "QQQQQ"


BAD = [
    (CHAT, {"response_format": rf_schema({"type": "flying"})}, None,
     "invalid structured output json_schema"),
    (CMPL, {"guided_regex": "(unclosed"}, None, "invalid structured output regex"),
    (CMPL, {"guided_grammar": "root ::= nowhere"}, None, "invalid structured output grammar"),
    (CHAT, {"response_format": {"type": "yaml"}}, "response_format", "must be one of"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    (CMPL, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    (CMPL, {"response_format": "json"}, "response_format", "object"),
    (CMPL, {"guided_choice": []}, "guided_choice", "non-empty"),
    (CMPL, {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (CMPL, {"guided_regex": 5}, "guided_regex", "string"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one"),
    (CMPL, {"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "only one"),
    (CMPL, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, regex, choice, grammar, json_object, got regex, choice"),
    (CMPL, {"structured_outputs": {}}, "structured_outputs", "got none"),
    (CMPL, {"structured_outputs": "json"}, "structured_outputs", "object"),
    (CMPL, {"structured_outputs": {"json": "{not json"}}, "structured_outputs",
     "'structured_outputs.json' is not valid JSON"),
    (CMPL, {"structured_outputs": {"json_object": 1}}, "structured_outputs", "must be true"),
    (CMPL, {"structured_outputs": {"choice": ["a"], "structural_tag": "{}"}},
     "structured_outputs", "structural_tag' is not supported"),
    (CMPL, {"structured_outputs": {"regex": "(unclosed"}}, None,
     "invalid structured output regex"),
    (CMPL, {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    (CMPL, {"logit_bias": {"5": "high"}}, "logit_bias", "[-100, 100]"),
    (CMPL, {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    (CMPL, {"logit_bias": {"-3": 1}}, "logit_bias", "token ids"),
    (CMPL, {"logit_bias": {"320": 1}}, "logit_bias", "outside the vocabulary"),
    (CMPL, {"logit_bias": [1, 2]}, "logit_bias", "object"),
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    (CHAT, {"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    (CMPL, {"frequency_penalty": "x"}, "frequency_penalty", "number"),
    (CMPL, {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    (CMPL, {"repetition_penalty": 1e7}, "repetition_penalty", "repetition_penalty"),
]


@pytest.mark.parametrize("path, extra, param, words", BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_values_are_400(server, path, extra, param, words):
    body = {"prompt": "x"} if path == CMPL else {"messages": MSG}
    r = httpx.post(server.url + path, json={**body, "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "\n" not in err["message"]


def test_bad_schema_through_the_openai_client_then_healthy(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=server.model, messages=MSG, max_tokens=4,
            response_format=rf_schema({"type": "object", "properties": {"a": {"type": 7}}}))
    assert e.value.status_code == 400
    # ignore_eos: an unseeded sample's end token would depend on the requests before it
    r = server.client().completions.create(model=server.model, prompt="x", max_tokens=2,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    p = server.wait_idle()
    assert p["running"] == 0 and p["free_slots"] == p["slots"]
