"""Triton sampler of rows without filters vs. the reference (the sampler's torch math; CPU
interpreter without CUDA, GPU with it): greedy and Gumbel-max tokens, the raw-logit logprob,
processed logits beside raw ones, ties, vocabularies that are not a multiple of the block, the
noise bit for bit, and the public op's dispatch."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, decide_as_cuda, require_interpreter  # before anything imports triton

import mambaserve.ops.sample_rows as op
from mambaserve.ops.sample_rows import (
    GREEDY_EPS,
    row_logprobs_ref,
    sample_rows_ref,
    uniform_noise,
)
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.sample_rows import (
    _sample_rows_kernel,
    row_logprobs_triton,
    sample_rows_triton,
)

require_interpreter(_sample_rows_kernel)

# the interpreter mishandles bf16, so bf16 runs only compiled
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _rows(B, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    raw = (3 * torch.randn(B, V, generator=gen)).to(DEV, dtype)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.0, 0.3][:B], device=DEV)
    seeds = torch.tensor([7, -3, 2**40 + 5, 11, 0, 2**62][:B], dtype=torch.int64, device=DEV)
    steps = torch.tensor([0, 4, 2**33 + 1, 9, 3, 100][:B], dtype=torch.int64, device=DEV)
    return raw, temperature, seeds, steps


def _check(raw, proc, temperature, seeds, steps, all_greedy):
    ids, lp, lse = sample_rows_triton(raw, proc, temperature, seeds, steps, all_greedy,
                                      GREEDY_EPS)
    ref_ids, ref_lp, ref_lse = sample_rows_ref(raw, proc, temperature, seeds, steps, all_greedy)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 777, 2048, 5000])
def test_greedy_and_sampled_rows(dtype, V):
    raw, temperature, seeds, steps = _rows(6, V, dtype)
    _check(raw, raw, temperature, seeds, steps, all_greedy=False)
    _check(raw, raw, torch.zeros_like(temperature), seeds, steps, all_greedy=True)


@pytest.mark.parametrize("block_v", [64, 256])
def test_blocks_combine_in_order(block_v):
    # many blocks per row, the row's maximum placed in several blocks: the first index wins
    raw, temperature, seeds, steps = _rows(4, 1000, torch.float32, seed=1)
    raw[0, [130, 700, 999]] = 50.0  # ties across blocks
    raw[1, [5, 6]] = 60.0  # a tie inside a block
    with tuning.override("sample_rows", block_v=block_v):
        ids = _check(raw, raw, torch.zeros(4, device=DEV), seeds, steps, all_greedy=True)
        assert ids[:2].tolist() == [130, 5]
        _check(raw, raw, temperature[:4], seeds, steps, all_greedy=False)


def test_processed_logits_pick_the_token_raw_ones_give_the_logprob():
    raw, temperature, seeds, steps = _rows(6, 3000, torch.float32, seed=2)
    proc = raw.clone()
    proc[:, ::3] = float("-inf")  # a token mask
    proc[:, 1] += 40.0  # a logit bias the greedy rows take
    ids = _check(raw, proc, temperature, seeds, steps, all_greedy=False)
    assert ids[0] == 1 and ids[4] == 1
    assert (ids % 3 != 0).all()
    _check(raw, proc.half(), temperature, seeds, steps, all_greedy=False)


def test_fully_masked_blocks_and_minus_infinity():
    raw, temperature, seeds, steps = _rows(3, 600, torch.float32, seed=3)
    raw[:, :256] = float("-inf")  # whole blocks without a finite logit
    with tuning.override("sample_rows", block_v=128):
        _check(raw, raw, temperature[:3], seeds, steps, all_greedy=False)


def test_a_nan_logit_is_the_largest_value_as_in_torch():
    # a broken model's NaN picks its token (torch's argmax) instead of an index past the row
    raw, temperature, seeds, steps = _rows(3, 600, torch.float32, seed=6)
    raw[0, 321] = float("nan")
    raw[1, [40, 500]] = float("nan")
    ids, lp, _ = sample_rows_triton(raw, raw, torch.zeros(3, device=DEV), seeds, steps, True,
                                 GREEDY_EPS)
    assert ids.tolist()[:2] == [321, 40] == torch.argmax(raw, dim=-1).tolist()[:2]
    assert torch.isnan(lp[:2]).all() and not torch.isnan(lp[2])
    ids, _, _ = sample_rows_triton(raw, raw, temperature[:3], seeds, steps, False, GREEDY_EPS)
    assert ((ids >= 0) & (ids < 600)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_of_given_tokens(dtype):
    # prompt-logprob targets: the target's raw logprob and the row's logsumexp, any target
    raw, _, _, _ = _rows(6, 3001, dtype, seed=8)
    raw[2, :1024] = float("-inf")  # a masked block
    targets = torch.tensor([0, 3000, 5, 17, 2048, 2047], device=DEV)
    with tuning.override("sample_rows", block_v=512):
        lp, lse = row_logprobs_triton(raw, targets)
    ref_lp, ref_lse = row_logprobs_ref(raw, targets)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    assert lp[2] == float("-inf")  # a masked token
    lp, lse = row_logprobs_triton(raw[:0], targets[:0])
    assert lp.shape == lse.shape == (0,)


def test_noise_is_the_references_bit_for_bit():
    # all-zero logits at temperature 1: the sampled token is the argmax of the noise itself
    V = 4099
    raw = torch.zeros(6, V, device=DEV)
    _, _, seeds, steps = _rows(6, V, torch.float32, seed=4)
    ones = torch.ones(6, device=DEV)
    ids, _, _ = sample_rows_triton(raw, raw, ones, seeds, steps, False, GREEDY_EPS)
    u = uniform_noise(seeds, steps, V)
    # -log(-log(u)) increases with u, and u is exact: the largest u's index is the token
    assert torch.equal(ids, torch.argmax(u, dim=-1))


def test_the_public_op_takes_the_kernel_on_cuda(monkeypatch):
    paths = decide_as_cuda(monkeypatch, op)
    raw, temperature, seeds, steps = _rows(6, 900, torch.float32, seed=5)
    ids, lp, _ = op.sample_rows(raw, raw, temperature, seeds, steps, all_greedy=False)
    ref_ids, ref_lp, _ = sample_rows_ref(raw, raw, temperature, seeds, steps, False)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    if DEV == "cpu":
        assert paths == ["triton"]


def test_the_engine_samples_through_the_kernel_as_through_the_reference(tiny_ckpt, monkeypatch):
    """A whole engine run (chunked prefill, mixed steps, decode) with the sampler's op on the
    kernel path gives the reference path's tokens and logprobs: greedy, sampled, filtered, with
    a logit bias and penalties, and with logprobs asked for."""
    from mambaserve.engine.llm import LLM
    from mambaserve.engine.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=3),
              SamplingParams(temperature=0.9, max_tokens=6, seed=3),
              SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=6, seed=5,
                             logprobs=1),
              SamplingParams(temperature=1.1, max_tokens=6, seed=7, logit_bias={9: 2.0},
                             presence_penalty=0.5, frequency_penalty=0.3)]

    def run():
        return LLM(tiny_ckpt, device="cpu", chunked_prefill_size=32).generate(prompts, params)

    def close(xs, ys):  # per-token {token id: logprob} dicts
        assert len(xs or []) == len(ys or [])
        for x, y in zip(xs or [], ys or []):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)

    ref = run()
    paths = decide_as_cuda(monkeypatch, op)
    got = run()
    if DEV == "cpu":
        assert paths and set(paths) == {"triton"}
    assert got[0].prompt_logprobs and len(got[0].prompt_logprobs) == len(prompts[0][
        "prompt_token_ids"])
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        close(a.outputs[0].logprobs, b.outputs[0].logprobs)
        close(a.prompt_logprobs, b.prompt_logprobs)
