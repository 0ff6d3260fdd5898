"""Runs one scheduled batch: host plan -> metadata upload -> forward -> sampler -> ONE read-back.

Between the metadata upload and the sampler nothing reads a device value; the only
device-to-host copy of a step is the packed result (sampled ids, their logprobs, top-k
alternatives, prompt logprobs) at the end of `execute`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool
from mambaserve.engine.scheduler import ScheduledBatch, ScheduledRow
from mambaserve.layers.sampler import SamplingBatch, compute_logprobs, sample
from mambaserve.metadata import BatchPlan, RowPlan, build_metadata


@dataclass
class RowResult:
    token_id: int | None = None  # sampled token (rows that reach the end of their tokens)
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # sampled token + top-k alternatives
    prompt_logprobs: list[dict[int, float]] | None = None  # one per prompt token of this chunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, state_pool: StatePool, kv_pool: KVPool,
                 device: torch.device) -> None:
        self.model, self.state_pool, self.kv_pool, self.device = model, state_pool, kv_pool, device
        cfg = model.cfg
        self.chunk_size, self.conv_kernel = cfg.chunk_size, cfg.conv_kernel
        self.on_forward = None  # test hook: called with (batch, meta) before the forward
        self.graph_runner = None  # engine/cuda_graph.CudaGraphRunner when graphs are enabled
        # labels the phases of a step for the sync audit (tools/sync_audit.py)
        self.section: Callable[[str], contextlib.AbstractContextManager] = \
            lambda label: contextlib.nullcontext()

    # ---- host planning ----------------------------------------------------------------------
    def _row_plan(self, row: ScheduledRow) -> tuple[RowPlan, list[int], list[int]]:
        """Returns the row plan, the prompt-logprob target token ids (for positions 0..k-1 of
        the row's logits) and whether the row's last logit is sampled."""
        req = row.request
        tokens = req.all_token_ids
        positions: list[int] = []
        targets: list[int] = []
        if req.params.prompt_logprobs is not None and not req.prefill_done:
            for i in range(row.num_tokens):
                nxt = row.start + i + 1
                if nxt < req.prompt_len:
                    positions.append(i)
                    targets.append(tokens[nxt])
        sample_pos = [row.num_tokens - 1] if row.samples else []
        plan = RowPlan(
            token_ids=tokens[row.start: row.start + row.num_tokens],
            context_len=row.start,
            state_slot=req.state_slot,
            has_initial_state=row.start > 0,
            pages=req.pages,
            logits_positions=positions + sample_pos,
            snapshots=row.snapshots,
            restore_from=row.restore_from,
        )
        return plan, targets, sample_pos

    # ---- execution ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[RowResult]:
        plans, prompt_targets, prompt_logit_idx, sample_logit_idx, sample_rows = [], [], [], [], []
        offset = 0
        for i, row in enumerate(batch.rows):
            plan, targets, sample_pos = self._row_plan(row)
            plans.append(plan)
            prompt_logit_idx.extend(range(offset, offset + len(targets)))
            prompt_targets.extend(targets)
            if sample_pos:
                sample_logit_idx.append(offset + len(targets))
                sample_rows.append(i)
            offset += len(plan.logits_positions)
        P = len(batch.prefills)
        plan = BatchPlan(plans[:P], plans[P:])
        if self.graph_runner is not None and self.graph_runner.can_run(plan, len(prompt_targets)):
            # decode-only batch: static buffers + captured graph (engine/cuda_graph.py)
            with self.section("forward"):
                meta, logits = self.graph_runner.run(plan, sample_rows)
            if self.on_forward is not None:
                self.on_forward(batch, meta)
            return self._finish(batch, meta, logits, sample_rows, prompt_targets, plans)
        meta = build_metadata(
            plan, chunk_size=self.chunk_size,
            conv_kernel=self.conv_kernel, page_size=self.kv_pool.page_size,
            scratch_page=self.kv_pool.scratch_page, device=self.device,
            extra={"prompt_targets": np.array(prompt_targets, dtype=np.int64),
                   "prompt_logit_idx": np.array(prompt_logit_idx, dtype=np.int64),
                   "sample_logit_idx": np.array(sample_logit_idx, dtype=np.int64)})
        if self.on_forward is not None:
            self.on_forward(batch, meta)
        with self.section("forward"):
            if meta.num_restores:  # prefix-cache hits: snapshot -> live slot, all layers
                self.state_pool.copy_slots(meta.cow_src, meta.cow_dst)
            logits = self.model(meta, self.state_pool.conv_state, self.state_pool.ssm_state,
                                self.kv_pool.kv_cache)
        return self._finish(batch, meta, logits, sample_rows, prompt_targets, plans)

    def _finish(self, batch: ScheduledBatch, meta, logits: torch.Tensor, sample_rows: list[int],
                prompt_targets: list[int], plans: list[RowPlan]) -> list[RowResult]:
        with self.section("sampler"):
            parts = self._sample(batch, meta, logits, sample_rows, prompt_targets)
        with self.section("readback"):
            # NOTE: the step's one device-to-host copy (a sync on CUDA).
            host = _as_numpy(torch.cat(parts).cpu()) if parts else np.zeros(0)
        k = max((batch.rows[i].request.params.logprobs or 0 for i in sample_rows), default=0)
        kp = self._prompt_k(batch)
        return self._unpack(batch, host, sample_rows, k, len(prompt_targets), kp, plans)

    @staticmethod
    def _prompt_k(batch: ScheduledBatch) -> int:
        return max((r.request.params.prompt_logprobs or 0 for r in batch.rows), default=0)

    def _sample(self, batch: ScheduledBatch, meta, logits: torch.Tensor, sample_rows: list[int],
                prompt_targets: list[int]) -> list[torch.Tensor]:
        """Sampled tokens and logprobs (and prompt logprobs), flattened as float64 tensors."""
        reqs = [batch.rows[i].request for i in sample_rows]
        parts: list[torch.Tensor] = []
        k = max((r.params.logprobs or 0 for r in reqs), default=0)
        if reqs:
            sb = SamplingBatch.from_lists(
                temperature=[float(r.params.temperature) for r in reqs],
                top_k=[r.params.top_k for r in reqs], top_p=[r.params.top_p for r in reqs],
                min_p=[r.params.min_p for r in reqs], seed=[r.seed for r in reqs],
                step=[len(r.output_token_ids) for r in reqs], num_logprobs=k, device=self.device)
            out = sample(logits.index_select(0, meta.extra["sample_logit_idx"]), sb)
            parts += [out.token_ids.double(), out.logprobs.double()]
            if k:
                parts += [out.topk_ids.double().flatten(), out.topk_logprobs.double().flatten()]
        kp = self._prompt_k(batch)
        Q = len(prompt_targets)
        if Q:
            lp, top_ids, top_lp = compute_logprobs(
                logits.index_select(0, meta.extra["prompt_logit_idx"]),
                meta.extra["prompt_targets"], kp)
            parts += [lp.double()]
            if kp:
                parts += [top_ids.double().flatten(), top_lp.double().flatten()]
        return parts

    def _unpack(self, batch: ScheduledBatch, host: np.ndarray, sample_rows: list[int], k: int,
                Q: int, kp: int, plans: list[RowPlan]) -> list[RowResult]:
        results = [RowResult() for _ in batch.rows]
        S, pos = len(sample_rows), 0

        def take(n: int) -> np.ndarray:
            nonlocal pos
            pos += n
            return host[pos - n: pos]

        ids, lps = take(S), take(S)
        top_ids, top_lps = (take(S * k).reshape(S, k), take(S * k).reshape(S, k)) if S and k \
            else (None, None)
        for j, i in enumerate(sample_rows):
            res, req = results[i], batch.rows[i].request
            res.token_id, res.logprob = int(ids[j]), float(lps[j])
            if req.params.logprobs is not None:
                d = {res.token_id: res.logprob}
                if top_ids is not None:  # logprobs=0 everywhere: only the sampled token
                    for t, v in zip(top_ids[j, : req.params.logprobs],
                                    top_lps[j, : req.params.logprobs]):
                        d.setdefault(int(t), float(v))
                res.top_logprobs = d
        if Q:
            q_lp = take(Q)
            q_ids, q_top = (take(Q * kp).reshape(Q, kp), take(Q * kp).reshape(Q, kp)) if kp \
                else (None, None)
            q = 0
            for i, row in enumerate(batch.rows):
                req = row.request
                n = len(plans[i].logits_positions) - (1 if i in sample_rows else 0)
                if req.params.prompt_logprobs is None or n == 0:
                    continue
                dicts = []
                for j in range(q, q + n):
                    target = req.prompt_token_ids[row.start + (j - q) + 1]
                    d = {target: float(q_lp[j])}
                    for t, v in zip(q_ids[j, : req.params.prompt_logprobs] if kp else [],
                                    q_top[j, : req.params.prompt_logprobs] if kp else []):
                        d.setdefault(int(t), float(v))
                    dicts.append(d)
                results[i].prompt_logprobs = dicts
                q += n
        return results


def _as_numpy(host: torch.Tensor) -> np.ndarray:
    """View of a tensor that is already on the host (no copy, no sync). The sync audit lists this
    call site as allowed: on a CPU run `.numpy()` looks like a read-back, but the read-back
    itself was the `.cpu()` just before."""
    return host.numpy()
