"""The host batch type: what a row derives from its request, and the sampling plan's layout of
logit rows (prompt-logprob targets, then the sample, row by row)."""

import numpy as np
import pytest

from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.request import Request
from mambaserve.engine.sampling_metadata import PREFIX, SamplingPlan
from mambaserve.engine.sampling_params import SamplingParams


def request(prompt, out=(), **params):
    r = Request("r", None, list(prompt), SamplingParams(**params), seed=5,
                max_total_len=len(prompt) + 8)
    r.output_token_ids = list(out)
    r.num_computed = len(prompt) + max(0, len(out) - 1) if out else 0
    r.state_slot, r.pages = 3, [4, 5]
    return r


def test_prefill_chunks_take_prompt_targets_and_only_the_last_samples():
    req = request([10, 11, 12, 13, 14], prompt_logprobs=2)
    first, last = Row(req, 0, 3), Row(req, 3, 2)
    assert first.prompt_targets == [11, 12, 13] and not first.samples
    assert first.logits_positions == [0, 1, 2] and first.token_ids == [10, 11, 12]
    assert last.prompt_targets == [14] and last.samples and last.logits_positions == [0, 1]
    assert (first.has_initial_state, last.has_initial_state) == (False, True)
    assert (last.context_len, last.state_slot, last.pages) == (3, 3, [4, 5])


def test_decode_rows_sample_and_have_no_prompt_targets():
    req = request([10, 11], out=[20, 21], prompt_logprobs=1)
    row = Row(req, 3, 1)
    assert row.token_ids == [21] and row.samples and row.prompt_targets == []
    assert row.logits_positions == [0]


def test_token_array_is_token_ids_and_a_view_of_the_prompt_inside_it():
    req = request([10, 11, 12, 13, 14], out=[20, 21])
    req.recompute_len = 7  # a resumed request: its prefill runs past the prompt
    rows = [Row(req, 0, 3), Row(req, 3, 2), Row(req, 3, 4), Row(req, 6, 1)]
    for row in rows:
        arr = row.token_array()
        assert arr.dtype == np.int64 and arr.tolist() == row.token_ids
    inside, across = rows[0].token_array(), rows[2].token_array()
    assert np.shares_memory(inside, req.prompt_array)  # no per-step conversion
    assert not np.shares_memory(across, req.prompt_array)
    assert req.prompt_array.tolist() == req.prompt_token_ids


def test_sampling_plan_lays_out_targets_then_samples_per_row():
    a = request([1, 2, 3, 4], prompt_logprobs=3, logprobs=1)
    b = request([5, 6], out=[7], logprobs=4, temperature=0.5, top_k=3)
    c = request([8, 9, 10])
    batch = Batch([Row(a, 0, 4), Row(c, 0, 2)], [Row(b, 2, 1)])
    plan = SamplingPlan.from_batch(batch)
    arr = {k[len(PREFIX):]: v for k, v in plan.arrays.items()}
    # a: targets at logit rows 0..2, sample at 3; c: no sample (chunk ends mid-prompt); b: 4
    assert plan.prompt_rows == [(0, 3)] and arr["prompt_logit_idx"].tolist() == [0, 1, 2]
    assert arr["prompt_targets"].tolist() == [2, 3, 4]
    assert plan.sample_rows == [0, 2] and arr["sample_logit_idx"].tolist() == [3, 4]
    assert plan.num_logprobs == 4 and plan.num_prompt_logprobs == 3
    assert arr["temperature"].tolist() == [1.0, 0.5] and arr["top_k"].tolist() == [0, 3]
    assert arr["step"].tolist() == [0, 1] and arr["seed"].tolist() == [5, 5]
    assert not plan.samples_lead  # a's prompt targets come first: the sampled rows are gathered


def test_a_decode_steps_samples_are_the_leading_logit_rows():
    rows = [Row(request([1, 2], out=[3]), 2, 1), Row(request([4], out=[5, 6]), 2, 1)]
    assert SamplingPlan.from_batch(Batch([], rows)).samples_lead
    # a chunk that ends mid-prompt has no logit row: the others still lead
    chunk = Row(request([8, 9, 10]), 0, 2)
    assert SamplingPlan.from_batch(Batch([chunk], rows)).samples_lead


def test_a_row_scheduled_before_its_token_was_read_back():
    """Overlap scheduling: the request's last sampled token is still on the device."""
    req = request([10, 11, 12], out=[20])
    req.inflight_tokens = 1  # sampled by the step in flight, not read back
    row = Row(req, 4, 1)
    assert row.input_on_device and row.samples and row.token_ids == [0]
    assert row.output_index == 2 and req.num_tokens == 5
    prev = Row(req, 3, 1)  # the row that fed token 20 (already on the host)
    assert not prev.input_on_device and prev.token_ids == [20] and not prev.samples
    resumed = Row(req, 0, 4)  # a recompute after a preemption: prompt + outputs, from the host
    assert resumed.token_ids == [10, 11, 12, 20] and not resumed.input_on_device
    with pytest.raises(ValueError, match="one-token row"):
        Row(req, 3, 2)
