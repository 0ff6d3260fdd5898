"""mambaserve.engine.prompt: the prompt checks the Python API and the server share."""

from __future__ import annotations

import pytest

from mambaserve.engine.prompt import (
    PromptError,
    prompt_cache_salt,
    prompt_ids,
    validate_prompt_ids,
)


class _Chars:
    """A stand-in tokenizer: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize("prompt, want", [
    ("ab", ("ab", [97, 98])),
    ("", ("", [])),  # refused later, by validate_prompt_ids
    ([1, 2], (None, [1, 2])),
    ((1, 2), (None, [1, 2])),
    ({"prompt_token_ids": (3,)}, (None, [3])),
    ({"prompt_token_ids": [3], "prompt": "c"}, ("c", [3])),
    ({"prompt": "ab", "cache_salt": "s"}, ("ab", [97, 98])),  # vLLM's TextPrompt
])
def test_prompt_shapes(prompt, want):
    assert prompt_ids(prompt, _Chars()) == want


@pytest.mark.parametrize("prompt, tokenizer, match", [
    ({"text": "x"}, _Chars(), "a dict prompt needs 'prompt_token_ids'"),
    ({"prompt": 5}, _Chars(), "a dict prompt needs 'prompt_token_ids' \\(or a string"),
    ({"prompt": "ab"}, None, "no tokenizer.json: pass prompt_token_ids"),
    ({"prompt_token_ids": "abc"}, _Chars(), "'prompt_token_ids' must be a list of token ids, "
                                            "got str"),
    ("ab", None, "no tokenizer.json: pass prompt_token_ids"),
    (42, _Chars(), "a prompt is a string, a list of token ids or .* got int"),
])
def test_bad_prompt_shapes(prompt, tokenizer, match):
    with pytest.raises(PromptError, match=match) as e:
        prompt_ids(prompt, tokenizer)
    assert e.value.code == "invalid_value" and isinstance(e.value, ValueError)


@pytest.mark.parametrize("prompt, salt", [
    ({"prompt_token_ids": [1], "cache_salt": "tenant-1"}, "tenant-1"),
    ({"prompt": "x", "cache_salt": " "}, " "),
    ({"prompt_token_ids": [1], "cache_salt": None}, None),
    ({"prompt_token_ids": [1]}, None),
    ("text", None),
    ([1, 2], None),
])
def test_cache_salt_of_a_prompt(prompt, salt):
    assert prompt_cache_salt(prompt) == salt


@pytest.mark.parametrize("salt, got", [("", "an empty string"), (7, "int"), (b"s", "bytes")])
def test_bad_cache_salt(salt, got):
    with pytest.raises(PromptError) as e:
        prompt_cache_salt({"prompt_token_ids": [1], "cache_salt": salt})
    assert str(e.value) == f"'cache_salt' must be a non-empty string, got {got}"
    assert e.value.code == "invalid_value"


@pytest.mark.parametrize("ids, code, message", [
    ([], "empty_prompt", "empty prompt: it must contain at least one token"),
    ([1] * 8, "context_length_exceeded", "prompt has 8 tokens; the model's limit (maximum "
     "context length) is 8 tokens including at least one output token"),
    ([1, 10], "invalid_value", "prompt token id 10 is outside the vocabulary [0, 10)"),
    ([-1], "invalid_value", "prompt token id -1 is outside the vocabulary [0, 10)"),
    ([2.0], "invalid_value", "prompt token id 2.0 is outside the vocabulary [0, 10)"),
    ([True], "invalid_value", "prompt token id True is outside the vocabulary [0, 10)"),
    # the first bad id of a long prompt, whatever kind (the all-int fast path must not pass it)
    ([3] * 5 + [7.0, 12], "invalid_value", "prompt token id 7.0 is outside the vocabulary "
     "[0, 10)"),
    ([3] * 5 + [False], "invalid_value", "prompt token id False is outside the vocabulary "
     "[0, 10)"),
])
def test_one_message_and_code_per_problem(ids, code, message):
    with pytest.raises(PromptError) as e:
        validate_prompt_ids(ids, vocab_size=10, max_model_len=8)
    assert (e.value.code, str(e.value)) == (code, message)


def test_valid_ids_pass():
    validate_prompt_ids([0, 9] + [5] * 5, vocab_size=10, max_model_len=8)  # 7 < 8: room for one


def test_truncated_keeps_the_last_tokens():
    from mambaserve.engine.prompt import truncated

    class Dec(_Chars):
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    ids = [97, 98, 99, 100]
    assert truncated("abcd", ids, None, 10, Dec()) == ("abcd", ids)  # off
    assert truncated("abcd", ids, 4, 10, Dec()) == ("abcd", ids)  # nothing dropped
    assert truncated("abcd", ids, 2, 10, Dec()) == ("cd", [99, 100])
    assert truncated("abcd", ids, -1, 4, Dec()) == ("bcd", [98, 99, 100])  # room for an output
    assert truncated(None, ids, 1, 10, None) == (None, [100])


def test_truncate_prompt_tokens_through_the_engine(tiny_llm):
    """The engine runs the prompt's last k tokens: the same output as that suffix given alone;
    -1 fits a prompt longer than the context; bad values are refused."""
    from mambaserve import SamplingParams

    eng = tiny_llm.engine
    ids = list(range(3, 60))
    sp = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    cut = tiny_llm.generate({"prompt_token_ids": ids},
                            SamplingParams(truncate_prompt_tokens=16, **sp))[0]
    alone = tiny_llm.generate({"prompt_token_ids": ids[-16:]}, SamplingParams(**sp))[0]
    assert cut.prompt_token_ids == ids[-16:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    assert cut.prompt == eng.tokenizer.decode(ids[-16:], skip_special_tokens=False)
    long = [5 + i % 200 for i in range(eng.max_model_len + 7)]
    with pytest.raises(ValueError, match="maximum context length"):
        tiny_llm.generate({"prompt_token_ids": long}, SamplingParams(**sp))
    out = tiny_llm.generate({"prompt_token_ids": long},
                            SamplingParams(truncate_prompt_tokens=-1, **dict(sp, max_tokens=1)))
    assert out[0].prompt_token_ids == long[-(eng.max_model_len - 1):]
    for k in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
            SamplingParams(truncate_prompt_tokens=k)
