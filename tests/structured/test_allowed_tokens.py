"""structured/allowed_tokens.py and `SamplingParams.allowed_token_ids` through the engine (tiny
checkpoint): the mask row holds exactly the allowed ids; every generated token, greedy or
sampled, eager or with overlap scheduling, is one of them; where the unconstrained greedy token is
allowed it is the one picked; an unconstrained request beside a constrained one is unchanged;
bad values are one-line ValueErrors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mambaserve import LLM, SamplingParams
from mambaserve.engine.sampling_params import StructuredOutput
from mambaserve.layers.logits_processors import bitmask_words
from mambaserve.structured.allowed_tokens import AllowedTokens

TINY_VOCAB = 320


def _bits(row: np.ndarray, vocab: int) -> set[int]:
    words = row.view(np.uint32)
    return {t for t in range(vocab) if words[t // 32] >> np.uint32(t % 32) & np.uint32(1)}


@pytest.mark.parametrize("vocab", [320, 333, 4096])
def test_mask_row_holds_exactly_the_allowed_ids(vocab):
    ids = [0, 31, 32, 5, 5, vocab - 1]
    mask = np.full((3, bitmask_words(vocab)), -1, dtype=np.int32)
    a = AllowedTokens(ids, vocab)
    a.fill(mask, 1)
    assert _bits(mask[1], vocab) == set(ids)
    assert (mask[0] == -1).all() and (mask[2] == -1).all()  # other rows untouched
    assert not a.finished and a.advance([1, 2, 3]) is False and not a.finished


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()}
            for n in lengths]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, chunked_prefill_size=16, max_num_seqs=4)


ALLOWED = [7, 19, 40, 41, 250]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_generated_tokens_stay_in_the_set(llm, temperature):
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True, n=2,
                        allowed_token_ids=ALLOWED)
    outs = llm.generate(_prompts([5, 30, 9]), sp)
    for o in outs:
        for c in o.outputs:
            assert len(c.token_ids) == 12 and set(c.token_ids) <= set(ALLOWED), c.token_ids


def test_overlap_scheduling_keeps_the_mask(tiny_ckpt):
    overlap = LLM(tiny_ckpt, chunked_prefill_size=16, max_num_seqs=4, async_scheduling=True)
    assert overlap.engine.async_scheduling
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True,
                        allowed_token_ids=[11, 12])
    for o in overlap.generate(_prompts([4, 20]), sp):
        assert set(o.outputs[0].token_ids) <= {11, 12}


def test_allowed_greedy_token_is_kept_and_others_unchanged(llm):
    p = _prompts([6, 17], seed=4)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(p, free)]
    # the unconstrained first token allowed (with others): the constrained greedy run picks it
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                        allowed_token_ids=[alone[0][0], 3, 299])
    assert llm.generate(p[:1], sp)[0].outputs[0].token_ids == [alone[0][0]]
    # one allowed id: every token is it; the unconstrained request in the same batch is as alone
    one = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=[42])
    mixed = llm.generate(p, [one, free])
    assert mixed[0].outputs[0].token_ids == [42] * 6
    assert mixed[1].outputs[0].token_ids == alone[1]


@pytest.mark.parametrize("kw,match", [
    ({"allowed_token_ids": []}, "non-empty"),
    ({"allowed_token_ids": [1, -2]}, "integers >= 0"),
    ({"allowed_token_ids": [1, True]}, "integers >= 0"),
    ({"allowed_token_ids": [1], "structured_output": StructuredOutput("json_object")},
     "cannot be combined"),
])
def test_bad_values_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="allowed_token_ids token id 320 is outside"):
        llm.engine.add_request("x", [5, 6], SamplingParams(allowed_token_ids=[4, TINY_VOCAB]))
    assert not llm.engine.has_unfinished_requests()
