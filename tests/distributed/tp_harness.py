"""What the engine-level tensor-parallel tests share: building an engine at a tp size, running
requests to the end (with an optional abort), seeded prompts, and the comparison of two runs'
outputs (tokens identical, logprobs and prompt logprobs within float32's rounding)."""

from __future__ import annotations

import torch

from mambaserve.config import EngineConfig
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.engine.sampling_params import SamplingParams

# a 24-token budget and 16 prefill tokens beside decodes: chunked prefills and mixed steps
BASE = {"dtype": "float32", "device": "cpu", "chunked_prefill_size": 24, "max_num_seqs": 4,
        "max_step_prefill_tokens": 16}


def make_engine(path, tp: int, **kw) -> LLMEngine:
    return LLMEngine(path, EngineConfig(**{**BASE, **kw, "tensor_parallel_size": tp}))


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
        abort: tuple[str, int] | None = None) -> dict:
    """Add the requests, step to the end (aborting `abort[0]` after `abort[1]` steps)."""
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        steps += 1
        if abort is not None and steps == abort[1]:
            assert engine.abort_request(abort[0])
    engine.check_integrity()
    return outs


def prompts(n: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (k,), generator=g).tolist() for k in lens[:n]]


def close(x: float, ref: float) -> bool:
    """Within 1e-5 + 1.3e-6 |ref| (torch.testing's float32 tolerance). The relative term matters
    for unlikely tokens: a prompt token at logprob -8.7 differed by 1.1e-5 between the ranks
    (tiny Bamba, n_groups 1), while the one-rank float32 forward itself is 1.1e-5 to 1.4e-5 from
    the float64 one on those logits and the two-rank forward no further (row-parallel sums are
    added in another order: rounding, not a sharding error, which would be far larger)."""
    return abs(x - ref) <= 1e-5 + 1.3e-6 * abs(ref)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid, oa in a.items():
        ob = b[rid]
        for ca, cb in zip(oa.outputs, ob.outputs, strict=True):
            assert ca.token_ids == cb.token_ids, rid
            if ca.logprobs is not None:
                for da, db in zip(ca.logprobs, cb.logprobs, strict=True):
                    assert da.keys() == db.keys()
                    for t in da:
                        assert close(da[t], db[t]), (rid, t, da[t], db[t])
        if oa.prompt_logprobs is not None:
            for da, db in zip(oa.prompt_logprobs[1:], ob.prompt_logprobs[1:], strict=True):
                assert da.keys() == db.keys()
                for t in da:
                    assert close(da[t], db[t]), (rid, t, da[t], db[t])
            # ranks over the whole vocabulary (rank 0 holds the gathered logits); two tokens
            # within rounding of each other could swap places, nothing more
            ra, rb = oa.prompt_logprob_ranks, ob.prompt_logprob_ranks
            assert len(ra) == len(oa.prompt_logprobs) and ra[0] is None and rb[0] is None
            assert all(abs(x - y) <= 1 for x, y in zip(ra[1:], rb[1:], strict=True)), (ra, rb)
