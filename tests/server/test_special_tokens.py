"""BOS handling with a tokenizer whose config asks for one (add_bos_token): a completion's text
prompt gets it, a chat's rendered template does not (the template writes its special tokens
itself); vLLM's `add_special_tokens` turns either default around; /tokenize of the messages
counts what the chat endpoint runs; `LLM.chat` adds no second BOS either."""

from __future__ import annotations

import json
import shutil

import pytest

from mambaserve.engine.tokenizer import Tokenizer
from mambaserve.server.protocol import parse_chat, parse_completion
from mambaserve.server.tokenize import tokenize

MSG = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def bos_tokenizer(tiny_ckpt, tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("bos_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_ckpt / name, path / name)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    tok = Tokenizer(path)
    assert tok.add_bos and tok.bos_token_id is not None
    return tok


def test_completion_prompts_get_the_bos(bos_tokenizer):
    bos = bos_tokenizer.bos_token_id
    ids = parse_completion({"prompt": "hi"}, bos_tokenizer, 320, 256).prompts[0].token_ids
    assert ids[0] == bos and ids[1:] == bos_tokenizer.encode("hi", add_special_tokens=False)
    off = parse_completion({"prompt": "hi", "add_special_tokens": False}, bos_tokenizer, 320,
                           256).prompts[0].token_ids
    assert off == ids[1:]


def test_chat_prompts_get_only_the_template_bos(bos_tokenizer):
    bos = bos_tokenizer.bos_token_id
    ids = parse_chat({"messages": MSG}, bos_tokenizer, 320, 256).prompts[0].token_ids
    assert ids[0] == bos and ids[1] != bos  # the template's <s>, not a second one
    assert ids == tokenize({"messages": MSG}, bos_tokenizer, 320, 256)["tokens"]
    both = parse_chat({"messages": MSG, "add_special_tokens": True}, bos_tokenizer, 320,
                      256).prompts[0].token_ids
    assert both == [bos] + ids


def test_llm_chat_adds_no_second_bos(tiny_llm):
    tok = tiny_llm.engine.tokenizer
    add_bos = tok.add_bos
    tok.add_bos = True  # as a checkpoint whose tokenizer config asks for a BOS
    try:
        from mambaserve import SamplingParams

        out = tiny_llm.chat(MSG, SamplingParams(max_tokens=1))[0]
    finally:
        tok.add_bos = add_bos
    assert out.prompt_token_ids[0] == tok.bos_token_id != out.prompt_token_ids[1]
