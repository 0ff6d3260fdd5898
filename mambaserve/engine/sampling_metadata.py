"""What the sampler needs for one step, built by the runner from the `Batch`: which logit rows
are sampled (and with which parameters), which are prompt-logprob targets, and how many top-k
alternatives to return. The host side (`SamplingPlan`) is computed once per step and also drives
the unpacking of the read-back; its arrays ride in the step's one upload.

Logit rows are laid out as the batch's rows' `logits_positions`: for each row in order, its
prompt-logprob targets, then its sampled position (if it samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mambaserve.engine.batch import Batch
from mambaserve.layers.sampler import SamplingBatch

PREFIX = "sampling."  # names of this plan's arrays inside a shared upload


@dataclass
class SamplingPlan:
    sample_rows: list[int]  # batch rows that sample, in order
    num_logprobs: int  # top-k alternatives per sampled token (max over the sampled rows)
    prompt_rows: list[tuple[int, int]]  # (batch row, number of prompt-logprob targets)
    num_prompt_logprobs: int  # top-k alternatives per prompt target (max over those rows)
    arrays: dict[str, np.ndarray]  # uploaded; keys start with PREFIX

    @classmethod
    def from_batch(cls, batch: Batch) -> SamplingPlan:
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
            step=[rows[i].output_index for i in sample_rows])  # noise index of the token
        arrays = {"sample_logit_idx": np.array(sample_idx, dtype=np.int64),
                  "prompt_logit_idx": np.array(prompt_idx, dtype=np.int64),
                  "prompt_targets": np.array(targets, dtype=np.int64), **params}
        return cls(
            sample_rows=sample_rows,
            num_logprobs=max((r.params.logprobs or 0 for r in reqs), default=0),
            prompt_rows=prompt_rows,
            num_prompt_logprobs=max((rows[i].request.params.prompt_logprobs or 0
                                     for i, _ in prompt_rows), default=0),
            arrays={PREFIX + k: v for k, v in arrays.items()})

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
                   params=SamplingBatch.from_tensors(t, a, plan.num_logprobs))
