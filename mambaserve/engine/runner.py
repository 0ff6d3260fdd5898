"""Runs one scheduled batch: plan (host) -> one upload -> forward -> sampler -> ONE read-back.
A prefill-only step that replays a prefill graph starts its forward's head first
(engine/prefill_graph.py, "Head start": its token ids in a copy of their own, before the plan).

Between the upload and the sampler nothing reads a device value; the only device-to-host copy of
a step is the packed result (sampled ids, their logprobs, top-k alternatives, prompt logprobs).
Decode-only batches that fit a captured bucket replay a CUDA graph (engine/cuda_graph.py), and
steps with a small prefill part a prefill graph (engine/prefill_graph.py), instead of the eager
forward; the sampling side is the same for all.

A step is `launch(batch)` (everything up to queuing the read-back, which is non-blocking on CUDA
and completes an event) then `collect(handle)` (waits for that event, unpacks the `RowResult`s);
`execute` is both at once. Between the two the engine may launch the next step (overlap
scheduling): its decode rows whose input token is still on the device (`Row.input_on_device`)
read it from `token_buf`, which every step's sampler output is written into at the row's state
slot (a request's slot is its own while it runs). All of it is queued on one stream, so the next
step reads the buffer after this step wrote it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool
from mambaserve.distributed.group import TPGroup
from mambaserve.engine.batch import Batch, RowResult
from mambaserve.engine.penalty_state import PenaltyState
from mambaserve.engine.sampling_metadata import SamplingMetadata, SamplingPlan
from mambaserve.host_upload import upload
from mambaserve.layers.sampler import compute_logprobs, sample, token_ranks
from mambaserve.metadata import ForwardMetadata, HostMetadata, plan_metadata

FEED = "feed."  # names of the token-feed arrays inside a shared upload
STATIC = "graph.static"  # a CUDA graph's static inputs inside a shared upload


@dataclass
class StepHandle:
    """A launched step: its batch and plan, the read-back under way and its completion."""

    batch: Batch
    plan: SamplingPlan
    host_out: torch.Tensor | None  # packed results (pinned host memory on CUDA)
    done: torch.cuda.Event | None  # recorded after the read-back copy (CUDA)
    start: torch.cuda.Event | None = None  # timing events (CUDA): the step's device span,
    end: torch.cuda.Event | None = None  # from before its upload to after its read-back
    cpu_seconds: float = 0.0  # on a CPU the step ran inside launch: its duration


def feed_arrays(batch: Batch, decode_offset: int = 0) -> dict[str, np.ndarray]:
    """Where the rows whose token is on the device take it from: `dst` flat token indices in
    the batch (those of decode rows moved by `decode_offset`: a prefill graph's padding tokens
    sit before them), `src` their state slots (indices into the token buffer); and
    `sample_slot`, the state slot of each sampling row in order (where its sampled token is
    written)."""
    dst, src, offset = [], [], 0
    for i, row in enumerate(batch.rows):
        if row.input_on_device:
            moved = decode_offset if i >= len(batch.prefills) else 0
            dst.append(offset + row.num_tokens - 1 + moved)
            src.append(row.state_slot)
        offset += row.num_tokens
    slots = [r.state_slot for r in batch.rows if r.samples]
    return {FEED + "dst": np.array(dst, dtype=np.int64),
            FEED + "src": np.array(src, dtype=np.int64),
            FEED + "sample_slot": np.array(slots, dtype=np.int64)}


@dataclass
class ForwardInput:
    """The host side of one forward, all a rank needs to run it: rank 0 builds it once per step
    and, under tensor parallelism, broadcasts it to the other ranks
    (distributed/step_broadcast.py)."""

    host: HostMetadata | None  # eager forward: the metadata (its arrays ride in the upload)
    packed: np.ndarray | None  # CUDA-graph forward: the bucket's packed static inputs
    num_rows: int  # rows of the batch (a graph forward: its decode rows)
    feed: dict[str, np.ndarray]  # feed_arrays(batch)
    # a prefill / mixed-step graph forward (engine/prefill_graph.py): its bucket; `host` is then
    # the step's eager metadata, which the bucket's packing pads
    prefill_bucket: tuple[int, int] | None = None

    @property
    def num_sampled(self) -> int:
        return len(self.feed[FEED + "sample_slot"])


class ModelRunner:
    def __init__(self, model: torch.nn.Module, state_pool: StatePool, kv_pool: KVPool,
                 device: torch.device) -> None:
        self.model, self.state_pool, self.kv_pool, self.device = model, state_pool, kv_pool, device
        cfg = model.cfg
        self.chunk_size, self.conv_kernel = cfg.chunk_size, cfg.conv_kernel
        self.on_forward = None  # test hook: called with (batch, meta) before the forward
        # the last sampled token of each state slot (+ the scratch slot), for overlap scheduling
        self.token_buf = torch.zeros(state_pool.num_slots + 1, dtype=torch.int64, device=device)
        self.busy_seconds = 0.0  # device time of collected steps (CPU: their wall time)
        self.graph_runner = None  # engine/cuda_graph.CudaGraphRunner when graphs are enabled
        self.prefill_graph_runner = None  # engine/prefill_graph.PrefillGraphRunner, likewise
        self.head_started = False  # the last launched step started its forward's head first
        # tensor parallelism: this rank's group, and on rank 0 the step's broadcast to the others
        self.tp = TPGroup.single()
        self.send_step: Callable[[ForwardInput], None] | None = None
        # per-request token counts for penalties (device rows allocated on first use)
        self.penalties = PenaltyState(cfg.vocab_size, device)
        # labels the phases of a step ("head", "plan", "upload", "forward", "sampler",
        # "readback") for the sync audit (tools/sync_audit.py) and the host-time bench
        # (bench/host_time.py)
        self.section: Callable[[str], contextlib.AbstractContextManager] = \
            lambda label: contextlib.nullcontext()

    def execute(self, batch: Batch) -> list[RowResult]:
        """Run one step and return its results (launch + collect)."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: Batch) -> StepHandle:
        """Queue the step on the device: upload, forward, sampler, the read-back of its results
        (non-blocking on CUDA). The host does not wait for the device."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if self.prefill_graph_runner is not None:
            with self.section("head"):  # a prefill-only step's head runs while the host plans
                self.head_started = self.prefill_graph_runner.start_head(batch)
        with self.section("plan"):
            plan = SamplingPlan.from_batch(batch, self.penalties)
            fwd = self.plan_forward(batch)
        if self.send_step is not None:  # tensor parallelism: the other ranks run it too
            self.send_step(fwd)
        hook = None if self.on_forward is None else (lambda meta: self.on_forward(batch, meta))
        tensors, logits = self.forward(fwd, plan.arrays, hook)
        sampling = SamplingMetadata.on_device(plan, tensors)
        with self.section("sampler"):
            parts = self._sample(sampling, logits, tensors[FEED + "sample_slot"])
        host_out = done = None
        with self.section("readback"):
            if parts:
                # NOTE: the step's one device-to-host copy; non-blocking (into pinned memory) on
                # CUDA, completed by `done`, which `collect` waits for.
                host_out = torch.cat(parts).to("cpu", non_blocking=True)
        if cuda:
            end.record()  # after the read-back: its completion is the step's
            done = end
        return StepHandle(batch, plan, host_out, done, start, end,
                          0.0 if cuda else time.perf_counter() - t0)

    def plan_forward(self, batch: Batch) -> ForwardInput:
        """The host side of the step's forward: a CUDA-graph replay for a decode-only batch
        that fits a captured bucket, else the eager forward's metadata."""
        prefill_graphs = self.prefill_graph_runner
        if prefill_graphs is not None and prefill_graphs.can_run(batch):
            # small prefill part (+ decode rows): a padded bucket; its decode rows sit after
            # the bucket's prefill rows, so their fed tokens go there
            key, host = prefill_graphs.plan(batch)
            feed = feed_arrays(batch, prefill_graphs.decode_offset(batch))
            return ForwardInput(host, None, len(batch.rows), feed, prefill_bucket=key)
        feed = feed_arrays(batch)
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(batch):
            return ForwardInput(None, graphs.pack(batch), len(batch.decodes), feed)
        host = plan_metadata(batch, chunk_size=self.chunk_size, conv_kernel=self.conv_kernel,
                             page_size=self.kv_pool.page_size,
                             scratch_page=self.kv_pool.scratch_page)
        return ForwardInput(host, None, len(batch.rows), feed)

    def forward(self, fwd: ForwardInput, extra: dict[str, np.ndarray],
                hook: Callable[[ForwardMetadata], None] | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Upload (with the `extra` arrays: the sampling plan's), take the tokens still on the
        device from the token buffer, run the forward; returns the uploaded tensors and the
        logits. The same on every tensor-parallel rank."""
        # a graph's static inputs travel in the step's one upload and are copied into the
        # graph's buffer on the device (one host-to-device copy per step, not two)
        with self.section("upload"):
            if fwd.prefill_bucket is not None:  # small prefill part: its bucket's static inputs
                graphs = self.prefill_graph_runner
                static = graphs.step_bytes(fwd.prefill_bucket, fwd.host)
                tensors = upload({**extra, **fwd.feed, STATIC: static}, self.device)
                meta = graphs.load_planned(fwd.prefill_bucket, fwd.host, tensors[STATIC])
            elif fwd.packed is not None:  # decode-only batch: static buffers + captured graph
                tensors = upload({**extra, **fwd.feed, STATIC: fwd.packed}, self.device)
                meta = self.graph_runner.load_packed(fwd.packed, fwd.num_rows, tensors[STATIC])
            else:  # one upload
                tensors = upload({**fwd.host.arrays, **extra, **fwd.feed}, self.device)
                meta = fwd.host.on_device(tensors)
            self._feed(meta.input_ids, tensors)  # (a graph step: into its static input_ids)
        if hook is not None:
            hook(meta)
        with self.section("forward"):
            if fwd.prefill_bucket is not None:
                logits = self.prefill_graph_runner.replay()
            elif fwd.packed is not None:
                logits = self.graph_runner.replay(fwd.num_rows)
            else:
                logits = self.model(meta, self.state_pool.conv_state, self.state_pool.ssm_state,
                                    self.kv_pool.kv_cache)
        return tensors, logits

    @torch.inference_mode()
    def run_follower(self, fwd: ForwardInput) -> None:
        """A tensor-parallel rank other than 0 runs rank 0's step: the same upload and forward,
        then it receives the sampled tokens rank 0 broadcasts (the sampler runs on rank 0 only)
        into its token buffer. Nothing is read back."""
        tensors, _ = self.forward(fwd, {})
        if fwd.num_sampled:
            with self.section("sampler"):
                ids = torch.empty(fwd.num_sampled, dtype=torch.int64, device=self.device)
                self.tp.broadcast(ids, src=0)
                self.token_buf.index_copy_(0, tensors[FEED + "sample_slot"], ids)

    def collect(self, handle: StepHandle) -> list[RowResult]:
        """Wait for a launched step's read-back (the step's one sync) and unpack its results."""
        if handle.done is not None:
            handle.done.synchronize()
        self.busy_seconds += (handle.start.elapsed_time(handle.end) / 1e3
                              if handle.start is not None else handle.cpu_seconds)
        host = _as_numpy(handle.host_out) if handle.host_out is not None else np.zeros(0)
        return self._unpack(handle.batch, handle.plan, host)

    def _feed(self, input_ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Rows whose input token is still on the device take it from the token buffer."""
        dst = tensors[FEED + "dst"]
        if dst.numel():
            input_ids.index_copy_(0, dst, self.token_buf.index_select(0, tensors[FEED + "src"]))

    def _sample(self, sampling: SamplingMetadata, logits: torch.Tensor,
                sample_slots: torch.Tensor) -> list[torch.Tensor]:
        """Sampled tokens and logprobs (and prompt logprobs with their targets' vocabulary
        ranks), flattened as float64 tensors (exact for ids and ranks); the sampled tokens also
        go to the token buffer at their rows' state slots."""
        plan, parts = sampling.plan, []
        if plan.sample_rows:
            rows = logits[:len(plan.sample_rows)] if plan.samples_lead else \
                logits.index_select(0, sampling.sample_logit_idx)
            out = sample(rows, sampling.params)
            if self.tp.tp_size > 1:  # the other ranks' token buffers (run_follower)
                self.tp.broadcast(out.token_ids.contiguous(), src=0)
            self.token_buf.index_copy_(0, sample_slots, out.token_ids)
            parts += [out.token_ids.double(), out.logprobs.double()]
            if plan.num_logprobs:
                parts += [out.topk_ids.double().flatten(), out.topk_logprobs.double().flatten()]
        if plan.prompt_rows:
            kp = plan.num_prompt_logprobs
            rows = logits.index_select(0, sampling.prompt_logit_idx)
            lp, top_ids, top_lp = compute_logprobs(rows, sampling.prompt_targets, kp)
            parts += [lp.double(), token_ranks(rows, sampling.prompt_targets).double()]
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
            q_lp, q_rank = take(Q), take(Q)
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
                results[i].prompt_ranks = [int(r) for r in q_rank[q:q + n]]
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
