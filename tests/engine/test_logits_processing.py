"""logit_bias and presence / frequency / repetition penalties through the engine (tiny checkpoint):
every sampled token of every step equals a plain PyTorch reference computed from that step's
raw logits and the request's tokens on the host (greedy and seeded, chunked prefill, mixed
batches, n > 1); a request's output is the same alone and in a batch; the decode-graph path
(its CPU stand-in) gives the same tokens as the eager path."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import mambaserve.engine.runner as runner_mod
from mambaserve import LLM, SamplingParams
from mambaserve.layers.sampler import GREEDY_EPS
from mambaserve.ops.sample_rows import gumbel_noise


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 320, (n,), generator=g).tolist()}
            for n in lengths]


class Recorder:
    """Per step: the sampled rows' requests, their output lengths before the step, and the raw
    logits the sampler got (runner's test hook + a wrapper around `sample`)."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        self.steps: list[dict] = []
        monkeypatch.setattr(llm.engine.runner, "on_forward", self.on_forward)
        orig = runner_mod.sample

        def wrapped(logits, params):
            self.steps[-1]["logits"] = logits.detach().clone()
            return orig(logits, params)

        monkeypatch.setattr(runner_mod, "sample", wrapped)

    def on_forward(self, batch, meta) -> None:
        rows = [row for row in batch.rows if row.samples]
        # the index of the token each row samples (under overlap scheduling the host has not
        # read the previous one yet, so len(output_token_ids) can be one short)
        self.steps.append({"reqs": [row.request for row in rows],
                           "pos": [row.output_index for row in rows]})


def reference_logits(raw: torch.Tensor, req, pos: int) -> torch.Tensor:
    """The processed logits of one row, written out token by token."""
    p = req.params
    x = raw.float().cpu().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    out = req.output_token_ids[:pos]
    rp = p.repetition_penalty
    for t in set(req.prompt_token_ids) | set(out):
        x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    for t, c in Counter(out).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def reference_token(raw: torch.Tensor, req, pos: int) -> int:
    x = reference_logits(raw, req, pos)
    t = req.params.temperature
    if t < GREEDY_EPS:
        return int(x.argmax())
    noise = gumbel_noise(torch.tensor([req.seed]), torch.tensor([pos]), x.numel())[0]
    return int((x / t + noise).argmax())


def check_against_reference(rec: Recorder) -> int:
    checked = 0
    for step in rec.steps:
        for j, (req, pos) in enumerate(zip(step["reqs"], step["pos"])):
            if pos < len(req.output_token_ids):
                assert req.output_token_ids[pos] == reference_token(step["logits"][j], req, pos), \
                    (req.request_id, pos)
                checked += 1
    return checked


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8,
                   logit_bias={40: 2.5, 41: -100}),
    SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True,
                   frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.7, seed=9, max_tokens=18, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, n=2,
                   presence_penalty=-1.0, repetition_penalty=0.8, logit_bias={7: 3.0}),
    SamplingParams(temperature=0, max_tokens=22, ignore_eos=True, frequency_penalty=2.0),
]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, chunked_prefill_size=16, max_num_seqs=4)


def test_every_token_matches_the_reference(llm, monkeypatch):
    rec = Recorder(llm, monkeypatch)
    outs = llm.generate(prompts([5, 30, 12, 9, 21]), PARAMS)
    assert llm.engine.stats["mixed_steps"] > 0 and llm.engine.stats["chunked_prefills"] > 0
    n_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert check_against_reference(rec) == n_tokens
    llm.engine.check_integrity()


def test_penalties_and_bias_change_the_output(llm):
    p = prompts([10], seed=3)
    plain = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    plain_ids = plain[0].outputs[0].token_ids
    assert max(Counter(plain_ids).values()) > 1  # the tiny model repeats itself...
    pen = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                         frequency_penalty=2.0, repetition_penalty=2.0))
    assert pen[0].outputs[0].token_ids != plain_ids  # ...which the penalties change
    forced = llm.generate(p, SamplingParams(temperature=0.8, seed=1, max_tokens=6,
                                            ignore_eos=True, logit_bias={77: 100.0}))
    assert forced[0].outputs[0].token_ids == [77] * 6
    banned = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                            logit_bias={plain_ids[0]: -100.0}))
    assert plain_ids[0] not in banned[0].outputs[0].token_ids


def test_batch_invariance(llm):
    target = prompts([13], seed=7)
    sp = SamplingParams(temperature=0.8, seed=21, max_tokens=20, ignore_eos=True,
                        frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={50: 1.5})
    alone = llm.generate(target, sp)[0].outputs[0].token_ids
    others = prompts([4, 25, 8], seed=8)
    mixed = llm.generate(others[:2] + target + others[2:],
                         PARAMS[:2] + [sp] + [PARAMS[4]])
    assert mixed[2].outputs[0].token_ids == alone


def test_graph_path_matches_eager(tiny_ckpt, llm):
    """Decode-only steps take the CUDA-graph static buffers (run uncaptured on a CPU); the
    sampler, with its penalties and bias, runs after the graph in both paths."""
    graphs = LLM(tiny_ckpt, chunked_prefill_size=16, max_num_seqs=4, enforce_eager=False)
    assert graphs.engine.runner.graph_runner is not None
    p = prompts([5, 30, 12, 9, 21])
    a = [o.outputs for o in llm.generate(p, PARAMS)]
    b = [o.outputs for o in graphs.generate(p, PARAMS)]
    assert [[c.token_ids for c in x] for x in a] == [[c.token_ids for c in x] for x in b]


def test_steps_with_mask_bias_and_penalties_are_sync_free(llm):
    """Through the engine: a step's forward and sampler sections make no host sync with every
    kind of logits processing in the batch (the read-back is the step's only one)."""
    import contextlib

    pytest.importorskip("xgrammar")
    from mambaserve.engine.sampling_params import StructuredOutput
    from mambaserve.tools.audit_scenarios import ENGINE_ALLOWED
    from mambaserve.tools.sync_audit import SyncAudit

    engine = llm.engine
    ps = prompts([6, 20, 9])
    engine.add_request("pen", ps[0], PARAMS[1])
    engine.add_request("bias", ps[1], PARAMS[0])
    engine.add_request("regex", ps[2], SamplingParams(
        temperature=0.5, seed=2, max_tokens=8, structured_output=StructuredOutput(
            "regex", "[a-z]{4,8}")))
    steps = 0
    try:
        while engine.has_unfinished_requests():
            audit = SyncAudit(root=engine.model, allow=ENGINE_ALLOWED)
            with audit:
                engine.runner.section = audit.section
                engine.step()
            steps += 1
            assert audit.count(section="forward") == 0, audit.report()
            assert audit.count(section="sampler") == 0, audit.report()
    finally:
        engine.runner.section = lambda label: contextlib.nullcontext()
    assert steps > 5
