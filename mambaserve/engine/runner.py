"""Runs one scheduled batch: plan (host) -> one upload -> forward -> sampler -> ONE read-back.

Between the upload and the sampler nothing reads a device value; the only device-to-host copy of
a step is the packed result (sampled ids, their logprobs, top-k alternatives, prompt logprobs) at
the end of `execute`. Decode-only batches that fit a captured bucket replay a CUDA graph
(engine/cuda_graph.py) instead of the eager forward; the sampling side is the same for both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool
from mambaserve.engine.batch import Batch, RowResult
from mambaserve.engine.penalty_state import PenaltyState
from mambaserve.engine.sampling_metadata import SamplingMetadata, SamplingPlan
from mambaserve.host_upload import upload
from mambaserve.layers.sampler import compute_logprobs, sample
from mambaserve.metadata import plan_metadata


class ModelRunner:
    def __init__(self, model: torch.nn.Module, state_pool: StatePool, kv_pool: KVPool,
                 device: torch.device) -> None:
        self.model, self.state_pool, self.kv_pool, self.device = model, state_pool, kv_pool, device
        cfg = model.cfg
        self.chunk_size, self.conv_kernel = cfg.chunk_size, cfg.conv_kernel
        self.on_forward = None  # test hook: called with (batch, meta) before the forward
        self.graph_runner = None  # engine/cuda_graph.CudaGraphRunner when graphs are enabled
        # per-request token counts for penalties (device rows allocated on first use)
        self.penalties = PenaltyState(cfg.vocab_size, device)
        # labels the phases of a step for the sync audit (tools/sync_audit.py)
        self.section: Callable[[str], contextlib.AbstractContextManager] = \
            lambda label: contextlib.nullcontext()

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[RowResult]:
        plan = SamplingPlan.from_batch(batch, self.penalties)
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(batch):
            # decode-only batch: static buffers + captured graph (engine/cuda_graph.py)
            sampling = SamplingMetadata.on_device(plan, upload(plan.arrays, self.device))
            meta = graphs.load(batch)
            if self.on_forward is not None:
                self.on_forward(batch, meta)
            with self.section("forward"):
                logits = graphs.replay(len(batch.decodes))
        else:
            host = plan_metadata(batch, chunk_size=self.chunk_size, conv_kernel=self.conv_kernel,
                                 page_size=self.kv_pool.page_size,
                                 scratch_page=self.kv_pool.scratch_page)
            tensors = upload({**host.arrays, **plan.arrays}, self.device)  # the one upload
            meta, sampling = host.on_device(tensors), SamplingMetadata.on_device(plan, tensors)
            if self.on_forward is not None:
                self.on_forward(batch, meta)
            with self.section("forward"):
                logits = self.model(meta, self.state_pool.conv_state, self.state_pool.ssm_state,
                                    self.kv_pool.kv_cache)
        with self.section("sampler"):
            parts = self._sample(sampling, logits)
        with self.section("readback"):
            # NOTE: the step's one device-to-host copy (a sync on CUDA).
            host_out = _as_numpy(torch.cat(parts).cpu()) if parts else np.zeros(0)
        return self._unpack(batch, plan, host_out)

    @staticmethod
    def _sample(sampling: SamplingMetadata, logits: torch.Tensor) -> list[torch.Tensor]:
        """Sampled tokens and logprobs (and prompt logprobs), flattened as float64 tensors."""
        plan, parts = sampling.plan, []
        if plan.sample_rows:
            out = sample(logits.index_select(0, sampling.sample_logit_idx), sampling.params)
            parts += [out.token_ids.double(), out.logprobs.double()]
            if plan.num_logprobs:
                parts += [out.topk_ids.double().flatten(), out.topk_logprobs.double().flatten()]
        if plan.prompt_rows:
            kp = plan.num_prompt_logprobs
            lp, top_ids, top_lp = compute_logprobs(
                logits.index_select(0, sampling.prompt_logit_idx), sampling.prompt_targets, kp)
            parts += [lp.double()]
            if kp:
                parts += [top_ids.double().flatten(), top_lp.double().flatten()]
        return parts

    @staticmethod
    def _unpack(batch: Batch, plan: SamplingPlan, host: np.ndarray) -> list[RowResult]:
        rows = batch.rows
        results = [RowResult() for _ in rows]
        pos = 0

        def take(n: int, k: int = 0) -> np.ndarray:
            nonlocal pos
            size = n * k if k else n
            pos += size
            out = host[pos - size: pos]
            return out.reshape(n, k) if k else out

        S, k = len(plan.sample_rows), plan.num_logprobs
        ids, lps = take(S), take(S)
        top_ids, top_lps = (take(S, k), take(S, k)) if S and k else (None, None)
        for j, i in enumerate(plan.sample_rows):
            res, want = results[i], rows[i].request.params.logprobs
            res.token_id, res.logprob = int(ids[j]), float(lps[j])
            if want is not None:
                res.top_logprobs = {res.token_id: res.logprob}
                if top_ids is not None:  # logprobs=0 everywhere: only the sampled token
                    _add_top(res.top_logprobs, top_ids[j, :want], top_lps[j, :want])
        Q, kp = plan.num_prompt_targets, plan.num_prompt_logprobs
        if Q:
            q_lp = take(Q)
            q_ids, q_top = (take(Q, kp), take(Q, kp)) if kp else (None, None)
            q = 0
            for i, n in plan.prompt_rows:
                row, want = rows[i], rows[i].request.params.prompt_logprobs
                dicts = []
                for j, target in enumerate(row.prompt_targets, start=q):
                    d = {target: float(q_lp[j])}
                    if q_ids is not None:
                        _add_top(d, q_ids[j, :want], q_top[j, :want])
                    dicts.append(d)
                results[i].prompt_logprobs = dicts
                q += n
        return results


def _add_top(d: dict[int, float], ids: np.ndarray, logprobs: np.ndarray) -> None:
    for t, v in zip(ids, logprobs):
        d.setdefault(int(t), float(v))


def _as_numpy(host: torch.Tensor) -> np.ndarray:
    """View of a tensor that is already on the host (no copy, no sync). The sync audit lists this
    call site as allowed: on a CPU run `.numpy()` looks like a read-back, but the read-back
    itself was the `.cpu()` just before."""
    return host.numpy()
