"""engine/penalty_state.py: per-request count rows handed out on first use, reset and marked
with the prompt on the device, taken back after the request finished, grown without losing
counts; the plan never reads the generated tokens (the device counts them)."""

from __future__ import annotations

import numpy as np
import torch

from mambaserve.engine.penalty_state import FIRST_ROWS, PREFIX, PenaltyState
from mambaserve.engine.request import Request, Status
from mambaserve.engine.sampling_params import SamplingParams

V = 32


def req(rid: str, prompt: list[int], **kw) -> Request:
    r = Request(rid, None, prompt, SamplingParams(**kw), 0, len(prompt) + 16)
    r.status = Status.RUNNING
    return r


def arrays(state: PenaltyState, reqs: list[Request]) -> dict[str, np.ndarray]:
    a = state.plan(reqs)
    return {k[len(PREFIX):]: v for k, v in a.items()}


def run_step(state: PenaltyState, reqs: list[Request], tokens: list[int]) -> None:
    """What the sampler does with the plan: reset new rows, mark prompts, count tokens."""
    a = state.plan(reqs)
    pen = state.on_device({k: torch.from_numpy(v) for k, v in a.items()})
    pen.prepare()
    pen.record(torch.tensor(tokens))


def test_no_rows_until_a_request_uses_penalties():
    s = PenaltyState(V, "cpu")
    assert s.plan([req("a", [1, 2])]) is None
    assert s.counts is None and s.capacity == 0


def test_rows_handed_out_once_reset_and_taken_back_after_finish():
    s = PenaltyState(V, "cpu")
    a, plain, b = req("a", [1, 2], presence_penalty=0.5), req("p", [3]), \
        req("b", [4, 4], repetition_penalty=1.2)
    x = arrays(s, [a, plain, b])
    assert x["slots"].tolist() == [1, 0, 2] and x["counted"].tolist() == [1, 0, 1]
    assert x["new_slots"].tolist() == [1, 2]
    assert x["prompt_slots"].tolist() == [1, 1, 2, 2] and x["prompt_ids"].tolist() == [1, 2, 4, 4]
    assert x["presence"].tolist() == [0.5, 0.0, 0.0]
    assert x["repetition"].tolist() == [1.0, 1.0, np.float32(1.2)]
    y = arrays(s, [b, a])  # the next step: same rows, nothing new
    assert y["slots"].tolist() == [2, 1] and y["new_slots"].size == 0 and y["prompt_ids"].size == 0
    a.status = Status.FINISHED
    c = req("c", [9], frequency_penalty=1.0)
    z = arrays(s, [b, c])
    assert z["slots"].tolist() == [2, 1] and z["new_slots"].tolist() == [1]  # a's row reused
    assert s.rows_in_use == 2


def test_counts_follow_the_sampled_tokens_and_survive_growth():
    s = PenaltyState(V, "cpu")
    first = [req(f"r{i}", [i], presence_penalty=1.0) for i in range(FIRST_ROWS)]
    run_step(s, first, [5] * FIRST_ROWS)
    run_step(s, first, list(range(FIRST_ROWS)))
    assert s.capacity == FIRST_ROWS
    more = req("more", [7, 8], frequency_penalty=0.5)
    run_step(s, first + [more], [6] * (FIRST_ROWS + 1))  # grows to twice the rows
    assert s.capacity == 2 * FIRST_ROWS
    for i in range(FIRST_ROWS):
        want = torch.zeros(V, dtype=torch.int32)
        for t in (5, i, 6):  # the three tokens request i sampled
            want[t] += 1
        assert torch.equal(s.counts[i + 1], want)
        assert s.prompt_seen[i + 1].nonzero().flatten().tolist() == [i]
    r = s.counts[FIRST_ROWS + 1]
    assert r[6] == 1 and int(r.sum()) == 1
    assert s.prompt_seen[FIRST_ROWS + 1].nonzero().flatten().tolist() == [7, 8]
    assert int(s.counts[0].sum()) == 0 and not s.prompt_seen[0].any()


def test_plan_does_not_read_generated_tokens():
    """Overlap scheduling plans a step before the last token is read back: the penalty arrays
    must be the same whether or not the host appended it."""
    s1, s2 = PenaltyState(V, "cpu"), PenaltyState(V, "cpu")
    a1, a2 = req("a", [1, 2], presence_penalty=0.3), req("a", [1, 2], presence_penalty=0.3)
    a2.output_token_ids = [5, 6, 7]
    for x, y in ((s1, a1), (s2, a2)):
        x.plan([y])
    p1, p2 = arrays(s1, [a1]), arrays(s2, [a2])
    assert p1.keys() == p2.keys()
    for k in p1:
        np.testing.assert_array_equal(p1[k], p2[k])
