"""structured/bad_words.py and `SamplingParams.bad_words` through the engine (tiny checkpoint,
byte-level tokenizer: one token per byte): the mask bits; a banned word's token sequences never
appear in the generated tokens, greedy output is unchanged up to the step that would complete
one, and overlap scheduling gives the synchronous tokens; bad words combine with
allowed_token_ids; bad values are one-line ValueErrors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mambaserve import LLM, SamplingParams
from mambaserve.layers.logits_processors import bitmask_words
from mambaserve.structured.allowed_tokens import AllowedTokens
from mambaserve.structured.bad_words import BadWords, bad_word_sequences
from mambaserve.structured.combined_mask import CombinedMask

VOCAB = 320


def _bits(row: np.ndarray) -> set[int]:
    words = row.view(np.uint32)
    return {t for t in range(VOCAB) if words[t // 32] >> np.uint32(t % 32) & np.uint32(1)}


def _filled(mask, out_tokens) -> set[int]:
    rows = np.zeros((2, bitmask_words(VOCAB)), dtype=np.int32)
    assert mask.advance(out_tokens) is False
    mask.fill(rows, 1)
    return _bits(rows[1])


def test_mask_bits():
    bw = BadWords([[40], [7, 8], [5, 7, 9]], VOCAB)
    everything = set(range(VOCAB))
    assert bw.needs_host_tokens and not bw.finished
    assert _filled(bw, []) == everything - {40}  # one-token words: always banned
    assert _filled(bw, [1, 2, 7]) == everything - {40, 8}  # after 7, not 8
    assert _filled(bw, [5, 7]) == everything - {40, 8, 9}  # after 5 7: not 9 (nor 8)
    assert _filled(bw, [7, 2]) == everything - {40}
    assert not BadWords([[3], [4]], VOCAB).needs_host_tokens  # a fixed mask
    both = CombinedMask([AllowedTokens([7, 8, 9, 40], VOCAB), bw])
    assert both.needs_host_tokens and not both.finished
    assert _filled(both, [3, 7]) == {7, 9}


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, chunked_prefill_size=16, max_num_seqs=4)


def test_sequences_without_and_with_a_leading_space(llm):
    tok = llm.engine.tokenizer
    a, b, sp = (tok.encode(c, add_special_tokens=False)[0] for c in ("a", "b", " "))
    assert bad_word_sequences(tok, ["ab", "  ab", "a"]) == [[a, b], [sp, a, b], [a], [sp, a]]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()}
            for n in lengths]


def _first_printable_pair(tok, outputs):
    """(output index, position k, the two-character word) of the first two consecutive
    generated tokens that are printable non-space ASCII characters."""
    for i, ids in enumerate(outputs):
        for k in range(len(ids) - 1):
            text = tok.decode(ids[k: k + 2])
            if len(text) == 2 and all(c.isascii() and c.isprintable() and c != " "
                                      for c in text):
                return i, k, text
    raise AssertionError("no printable pair in the greedy outputs")


def _holds(ids, seq) -> bool:
    n = len(seq)
    return any(list(ids[i: i + n]) == seq for i in range(len(ids) - n + 1))


def test_a_banned_word_is_never_generated(llm, tiny_ckpt):
    prompts = _prompts([5, 9, 14, 7], seed=2)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    tok = llm.engine.tokenizer
    i, k, word = _first_printable_pair(tok, alone)
    seqs = bad_word_sequences(tok, [word])
    assert seqs[0] == alone[i][k: k + 2]
    banned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[word])
    got = llm.generate(prompts[i:i + 1], banned)[0].outputs[0].token_ids
    assert not any(_holds(got, s) for s in seqs), (got, seqs)
    # greedy: the same tokens until the one that would complete the word's first occurrence
    first = next(j for j in range(len(alone[i]) - 1) if alone[i][j: j + 2] == seqs[0])
    assert got[: first + 1] == alone[i][: first + 1] and got[first + 1] != alone[i][first + 1]
    # overlap scheduling waits for each token of such a request: the same tokens
    overlap = LLM(tiny_ckpt, chunked_prefill_size=16, max_num_seqs=4, async_scheduling=True)
    both = overlap.generate([prompts[i], prompts[(i + 1) % 4]], [banned, free])
    assert both[0].outputs[0].token_ids == got
    assert both[1].outputs[0].token_ids == alone[(i + 1) % 4]  # its neighbour unchanged


def test_bad_words_combine_with_allowed_token_ids(llm):
    tok = llm.engine.tokenizer
    a, b = (tok.encode(c, add_special_tokens=False)[0] for c in ("a", "b"))
    sp = SamplingParams(temperature=1.0, seed=4, max_tokens=16, ignore_eos=True,
                        allowed_token_ids=[a, b], bad_words=["a"])
    assert llm.generate(_prompts([6]), sp)[0].outputs[0].token_ids == [b] * 16


@pytest.mark.parametrize("words", ["ab", [""], ["  "], ["a", 3]])
def test_bad_values_are_refused(words):
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        SamplingParams(bad_words=words)


@pytest.mark.parametrize("words", [["w"] * 1025, ["x" * 257]])
def test_too_many_or_too_long_words_are_refused(words):
    with pytest.raises(ValueError, match="at most 1024 words of at most 256 characters"):
        SamplingParams(bad_words=words)


def test_an_engine_without_a_tokenizer_refuses_bad_words(llm):
    tok, llm.engine.tokenizer = llm.engine.tokenizer, None
    try:
        with pytest.raises(ValueError, match="bad_words needs the model's tokenizer"):
            llm.engine.add_request("x", [5, 6], SamplingParams(bad_words=["a"]))
    finally:
        llm.engine.tokenizer = tok
    assert not llm.engine.has_unfinished_requests()
