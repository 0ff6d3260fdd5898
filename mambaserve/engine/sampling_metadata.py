"""What the sampler needs for one step, built by the runner from the `Batch`: which logit rows
are sampled (and with which parameters), which are prompt-logprob targets, and how many top-k
alternatives to return. The host side (`SamplingPlan`) is computed once per step and also drives
the unpacking of the read-back; its arrays ride in the step's one upload.

Logit rows are laid out as the batch's rows' `logits_positions`: for each row in order, its
prompt-logprob targets, then its sampled position (if it samples).

Logits processing rides in the same arrays: the structured-output token bitmask of the sampled
rows (filled from each constrained request's grammar matcher after feeding it the tokens read
back so far; all ones for the other rows), the logit_bias entries, and the penalty rows
(`engine/penalty_state.py`). Each is present only when some sampled row uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mambaserve.engine.batch import Batch
from mambaserve.engine.penalty_state import PenaltyState
from mambaserve.engine.request import Request
from mambaserve.layers.logits_processors import bitmask_words
from mambaserve.layers.sampler import SamplingBatch

PREFIX = "sampling."  # names of this plan's arrays inside a shared upload


@dataclass
class SamplingPlan:
    sample_rows: list[int]  # batch rows that sample, in order
    num_logprobs: int  # top-k alternatives per sampled token (max over the sampled rows)
    prompt_rows: list[tuple[int, int]]  # (batch row, number of prompt-logprob targets)
    num_prompt_logprobs: int  # top-k alternatives per prompt target (max over those rows)
    arrays: dict[str, np.ndarray]  # uploaded; keys start with PREFIX
    penalties: PenaltyState | None = None  # set when some sampled row uses penalties
    # the sampled logit rows are rows 0, 1, ... in order (a decode step): the runner samples
    # from a view of the logits instead of gathering them
    samples_lead: bool = False

    @classmethod
    def from_batch(cls, batch: Batch, penalties: PenaltyState | None = None) -> SamplingPlan:
        """`penalties`: the runner's penalty rows (needed when a request uses penalties)."""
        sample_rows, sample_idx, prompt_rows, prompt_idx, targets = [], [], [], [], []
        offset = 0
        for i, row in enumerate(batch.rows):
            q = len(row.prompt_targets)
            if q:
                prompt_rows.append((i, q))
                prompt_idx.extend(range(offset, offset + q))
                targets.extend(row.prompt_targets)
            if row.samples:
                sample_rows.append(i)
                sample_idx.append(offset + q)
            offset += q + int(row.samples)
        rows = batch.rows
        reqs = [rows[i].request for i in sample_rows]
        params = SamplingBatch.host_arrays(
            temperature=[float(r.params.temperature) for r in reqs],
            top_k=[r.params.top_k for r in reqs], top_p=[r.params.top_p for r in reqs],
            min_p=[r.params.min_p for r in reqs], seed=[r.seed for r in reqs],
            step=[rows[i].output_index for i in sample_rows],  # noise index of the token
            logit_bias=[r.params.logit_bias for r in reqs], token_bitmask=_token_bitmask(reqs))
        pen = penalties.plan(reqs) if penalties is not None else None
        if pen is None and any(r.params.uses_penalties for r in reqs):
            raise ValueError("a request uses penalties but the plan has no PenaltyState")
        params.update(pen or {})
        arrays = {"sample_logit_idx": np.array(sample_idx, dtype=np.int64),
                  "prompt_logit_idx": np.array(prompt_idx, dtype=np.int64),
                  "prompt_targets": np.array(targets, dtype=np.int64), **params}
        return cls(
            sample_rows=sample_rows,
            num_logprobs=max((r.params.logprobs or 0 for r in reqs), default=0),
            prompt_rows=prompt_rows,
            num_prompt_logprobs=max((rows[i].request.params.prompt_logprobs or 0
                                     for i, _ in prompt_rows), default=0),
            arrays={PREFIX + k: v for k, v in arrays.items()},
            penalties=penalties if pen is not None else None,
            samples_lead=sample_idx == list(range(len(sample_idx))))

    @property
    def num_prompt_targets(self) -> int:
        return sum(q for _, q in self.prompt_rows)


@dataclass
class SamplingMetadata:
    plan: SamplingPlan
    sample_logit_idx: torch.Tensor  # [S] logit rows that are sampled
    prompt_logit_idx: torch.Tensor  # [Q] logit rows that are prompt-logprob targets
    prompt_targets: torch.Tensor  # [Q] the target token ids
    params: SamplingBatch  # per sampled row

    @classmethod
    def on_device(cls, plan: SamplingPlan, tensors: dict[str, torch.Tensor]) -> SamplingMetadata:
        """Over the uploaded plan arrays (`tensors` may hold other parts of the upload too)."""
        n = len(PREFIX)
        t = {k[n:]: v for k, v in tensors.items() if k.startswith(PREFIX)}
        a = {k[n:]: v for k, v in plan.arrays.items()}
        return cls(plan=plan, sample_logit_idx=t["sample_logit_idx"],
                   prompt_logit_idx=t["prompt_logit_idx"], prompt_targets=t["prompt_targets"],
                   params=SamplingBatch.from_tensors(
                       t, a, plan.num_logprobs,
                       plan.penalties.on_device(t) if plan.penalties is not None else None))


def _token_bitmask(reqs: list[Request]) -> np.ndarray | None:
    """[S, ceil(V/32)] int32 allowed-token bits of the sampled rows, all ones for rows without
    a grammar; None when no row has one. Each grammar first takes the tokens read back since
    its last step (the request's `needs_host_token_each_step`)."""
    constrained = [(j, r.grammar) for j, r in enumerate(reqs) if r.grammar is not None]
    if not constrained:
        return None
    words = bitmask_words(constrained[0][1].vocab_size)
    mask = np.full((len(reqs), words), -1, dtype=np.int32)
    for j, g in constrained:
        g.advance(reqs[j].output_token_ids)
        g.fill(mask, j)
    return mask
