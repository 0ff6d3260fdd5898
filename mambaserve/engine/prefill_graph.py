"""Prefill and mixed-step CUDA graphs: the whole forward of a step with a small prefill part (a
short prompt, the uncached suffix of a prefix-cache hit, a few short chunks next to decode rows)
captured once per bucket and replayed.

Design (docs/cuda_graphs.md, "Prefill and mixed steps"):
- A bucket fixes every host int that sizes a launch: `tokens` prefill tokens (16, 32, ... up to
  `cuda_graph_max_prefill_tokens`; prefill-only steps up to `max_solo_tokens`, twice that by
  default: a lone prompt of that size is bound by the host's launches when run eagerly),
  `decodes` decode rows (0, 1, 2, 4, ... up to a cap), and
  `rows` = max_prefill_rows + 1 prefill rows, the last always a padding row. From these follow
  the SSD chunk count and chunks per row, the snapshot count, the logit rows (`PrefillBucket`).
- A step is planned exactly as an eager step (`plan_metadata`), then embedded in its bucket
  (`pack_prefill_step`): the real prefill tokens and rows first, as in the eager layout, then
  the padding prefill rows (the last holds every padding token, at positions 0 .. page_size - 1
  over and over, with no initial state; the others hold no token and one empty chunk), then the
  real decode rows, then padding decode rows. Padding writes only the scratch state slot and
  the scratch KV page; its logits are never sampled. Eager indices move with the layout:
  tokens of decode rows by `tokens - real prefill tokens`, rows by `rows - real prefill rows`,
  the conv extended stream's token part by `(rows - real rows) * (K-1)`, the chunk / token
  padding values to the bucket's.
- Each bucket has its own layout of ONE static byte buffer (int64 and bool parts, the page table
  last); a step packs its bucket's parts on the host, the runner uploads them in the step's one
  host-to-device copy beside the sampling arrays, and the bucket's buffer takes them by one
  device-to-device copy; the captured metadata holds views of exactly the bucket's shapes
  (`host_upload.views`), never a max-size field.
- Prefix-cache restores (whole states of every Mamba layer) run eagerly before the replay, over
  views of the uploaded indices sliced to the step's real count: a fixed count would copy a
  whole state per padding entry. Prefill snapshots run inside the graph with a fixed count
  (destination -1 = none, the Triton slot copy skips it).
- Logits of the real logit rows come first, in the eager order, in a shared static buffer.
- Head start: a prefill-only step's tokens are all on the host before its planning, and the
  forward's head (models/forward_head.py: the embedding, the first layer's norm and in_proj)
  needs nothing else. So each prefill-only bucket of at least HEAD_MIN_TOKENS tokens is
  captured as two graphs, its head and the rest, and the runner replays the head before it
  plans the step (`start_head`: the bucket's token ids in one copy of their own): the device
  multiplies the first projection while the host plans, packs and uploads the step. The
  bucket's later full upload writes the same ids again. A step whose head was not started
  replays both graphs at once.
- A fresh lone prompt (one row from position 0, nothing decoding beside it) of a prefill-only
  bucket of at least DENSE_MIN_TOKENS tokens replays a variant of that bucket, key (tokens, 0,
  DENSE), whose attention runs dense (torch SDPA, flash attention) over the whole prefill part
  as one causal row: the real tokens come first and see only each other, the padding tokens
  after them are never read. Any other step of the bucket keeps the paged kernels. Captured
  when the model's attention is dense-capable (`dense_capable`: 16-bit, a flash head size).

On a CPU (tests) the same static-buffer path runs without capture (`capture=False`).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from mambaserve.engine.batch import Batch
from mambaserve.engine.cuda_graph import attention_workspace_bytes, capture_graph
from mambaserve.engine.prefill_bucket import PrefillBucket, bucket_metadata, pack_prefill_step
from mambaserve.engine.prefill_lone import pack_lone_row
from mambaserve.engine.prefill_template import SoloTemplates, fresh_lone_prompt
from mambaserve.host_upload import copy_into, views
from mambaserve.metadata import ForwardMetadata, HostMetadata, plan_metadata
from mambaserve.models.forward_head import ForwardHead
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.paged_attention import DENSE_MIN_TOKENS, dense_prefill_enabled
from mambaserve.ops.state_snapshot import restore_snapshots

logger = logging.getLogger("mambaserve")

MAX_PREFILL_ROWS = 4  # real prefill rows a graph holds (one more padding row)
MAX_MIXED_DECODES = 64  # decode rows next to a prefill part; larger mixed steps run eagerly
DENSE = "dense"  # the last element of a fresh lone prompt's dense-attention bucket key
# the smallest prefill-only bucket whose head starts before the step's planning: timed at 512
# tokens (0.45-0.5 ms off the TTFT on an H100, docs/benchmarks.md run 32); below 256 the head's
# in_proj reads its weight in ~45-70 us, about what starting it early costs the host, and those
# buckets (short prompts, follow-up suffixes) keep their one graph until
# scripts/head_start_ab.py times them
HEAD_MIN_TOKENS = 256


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """smallest, 2 x smallest, ... below max_tokens, then max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"cuda_graph_max_prefill_tokens must be >= 1 here, got {max_tokens}")
    out, b = [], smallest
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


def decode_buckets(max_decodes: int) -> list[int]:
    """0 (a prefill-only step), 1, 2, 4, ... below max_decodes, then max_decodes."""
    out, b = [0], 1
    while b < max_decodes:
        out.append(b)
        b *= 2
    return out + [max_decodes] if max_decodes > 0 else out


def smallest_at_least(buckets: list[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


class PrefillGraphRunner:
    """Captures and replays forwards of steps with a small prefill part. `capture=False` (and
    always on a CPU) runs the same static-buffer forwards eagerly."""

    def __init__(self, model: torch.nn.Module, state_pool, kv_pool, *, max_tokens: int,
                 max_decodes: int, max_model_len: int, snapshots: bool, device: torch.device,
                 max_prefill_rows: int = MAX_PREFILL_ROWS, capture: bool = True,
                 max_workspace_bytes: int = 8 << 30, max_solo_tokens: int | None = None,
                 dense_solo: bool | None = None, head_start: bool = True) -> None:
        """max_tokens: the prefill part of a step with decode rows; max_solo_tokens (>=
        max_tokens, default max_tokens): that of a prefill-only step; dense_solo: the fresh lone
        prompts' dense-attention variants of the prefill-only buckets of >= DENSE_MIN_TOKENS
        tokens (None: where `dense_capable`); head_start: prefill-only steps start their
        forward's head before they are planned, where the model has one (`model.has_head`)."""
        self.model, self.state_pool, self.kv_pool = model, state_pool, kv_pool
        self.device = torch.device(device)
        cfg = model.cfg
        self.chunk_size, self.conv_kernel = cfg.chunk_size, cfg.conv_kernel
        self.page_size, self.scratch_page = kv_pool.page_size, kv_pool.scratch_page
        self.max_pages = -(-max_model_len // self.page_size)
        self.max_kv_len = self.max_pages * self.page_size
        self.snapshots, self.max_prefill_rows = snapshots, max_prefill_rows
        self.token_buckets = token_buckets(max_tokens)  # steps with decode rows
        self.solo_buckets = token_buckets(max(max_tokens, max_solo_tokens or max_tokens))
        self.decode_buckets = decode_buckets(max_decodes)
        ref_attention = kernel_path("paged_attention", self.device) == "reference"
        self.buckets: dict[tuple[int, int], PrefillBucket] = {}
        for tokens in sorted(set(self.token_buckets) | set(self.solo_buckets)):
            for decodes in self.decode_buckets:
                if tokens not in (self.token_buckets if decodes else self.solo_buckets):
                    continue
                if ref_attention and attention_workspace_bytes(
                        cfg, tokens + decodes, self.max_kv_len) > max_workspace_bytes:
                    continue  # the reference attention would gather too much: eager
                self.buckets[tokens, decodes] = PrefillBucket(
                    tokens, decodes, max_prefill_rows + 1, self.chunk_size, self.conv_kernel,
                    self.max_pages, snapshots)
        if dense_solo is None:
            dense_solo = dense_capable(model, self.device)
        for tokens in self.solo_buckets if dense_solo else ():
            if tokens >= DENSE_MIN_TOKENS and (tokens, 0) in self.buckets:
                self.buckets[tokens, 0, DENSE] = self.buckets[tokens, 0]
        size = max((b.nbytes for b in self.buckets.values()), default=8)
        self.buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        self.parts = {k: views(self.buf, b.specs) for k, b in self.buckets.items()}
        self.metas = {k: bucket_metadata(self.parts[k], b, max_kv_len=self.max_kv_len,
                                         dense=k[-1] == DENSE)
                      for k, b in self.buckets.items()}
        self.logits = torch.zeros(max_prefill_rows + max(self.decode_buckets), cfg.vocab_size,
                                  dtype=torch.float32, device=self.device)
        self.capture_enabled = capture and self.device.type == "cuda"
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._loaded: tuple[tuple, int] | None = None  # (bucket key, real logit rows)
        # head start: the prefill-only buckets' heads (keyed (tokens, 0), shared by the dense
        # variant) and their outputs, which the rest of the forward reads; the bucket key whose
        # head runs ahead of the step being planned. `head_start` False later: the heads replay
        # back to back with the rest (scripts/head_start_ab.py's "off" arm)
        self.head_start = head_start and bool(getattr(model, "has_head", False))
        self.heads: dict[tuple, ForwardHead | None] = {
            k[:2]: None for k in self.buckets
            if self.head_start and k[1] == 0 and k[0] >= HEAD_MIN_TOKENS}
        self.head_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._started: tuple | None = None
        # lone prompts' packed steps (fresh prompts and follow-up suffixes)
        self.templates = SoloTemplates(self.page_size, self.scratch_page, self.chunk_size)

    # ---- routing ----------------------------------------------------------------------------
    def bucket_of(self, batch: Batch) -> tuple | None:
        """The key of the step's bucket: (tokens, decodes), or (tokens, 0, DENSE) for a fresh
        lone prompt where that variant exists; None when no bucket fits."""
        tokens = smallest_at_least(self.token_buckets if batch.decodes else self.solo_buckets,
                                   batch.num_prefill_tokens)
        decodes = smallest_at_least(self.decode_buckets, len(batch.decodes))
        key = (tokens, decodes)
        if key not in self.buckets:
            return None
        dense = (tokens, decodes, DENSE)
        return dense if dense in self.buckets and fresh_lone_prompt(batch) else key

    def can_run(self, batch: Batch) -> bool:
        """A prefill part of at most max_prefill_rows rows and the largest token bucket, decode
        rows within the cap, no prompt logprobs, pages within max_model_len, snapshots only when
        captured and no more than the bucket holds."""
        if not batch.prefills or len(batch.prefills) > self.max_prefill_rows:
            return False
        key = self.bucket_of(batch)
        if key is None:
            return False
        for r in batch.rows:
            if r.prompt_targets or len(r.pages) > self.max_pages:
                return False
            if r.snapshots and not self.snapshots:
                return False
        prefill_snapshots = sum(len(r.snapshots) for r in batch.prefills)
        return prefill_snapshots <= self.buckets[key].num_snapshots

    def decode_offset(self, batch: Batch) -> int:
        """How far the decode tokens move from the eager layout (after the padding tokens)."""
        return self.bucket_of(batch)[0] - batch.num_prefill_tokens

    # ---- head start -------------------------------------------------------------------------
    def start_head(self, batch: Batch) -> bool:
        """Before the step is planned: a prefill-only step of a bucket with a head gets its token
        ids into the bucket's input ids (one copy of their own) and its head replayed; False
        (nothing done) for any other step."""
        self._started = None
        if not (self.head_start and self.heads) or batch.decodes or not self.can_run(batch):
            return False
        key = self.bucket_of(batch)
        if key[:2] not in self.heads or any(r.input_on_device for r in batch.prefills):
            return False
        ids = np.zeros(key[0], dtype=np.int64)  # the padding tokens' ids are 0 (the packing's)
        ids[: batch.num_prefill_tokens] = np.concatenate([r.token_array()
                                                          for r in batch.prefills])
        copy_into(ids, self.parts[key]["input_ids"])
        self._run_head(key)
        self._started = key
        return True

    def _run_head(self, key: tuple) -> None:
        if key[:2] in self.head_graphs:
            self.head_graphs[key[:2]].replay()
        else:
            self._head_forward(key)

    def _head_forward(self, key: tuple) -> None:
        self.heads[key[:2]] = self.model.forward_head(self.metas[key].input_ids)

    # ---- replay -----------------------------------------------------------------------------
    def load(self, batch: Batch) -> ForwardMetadata:
        """Plan the step, upload it into its bucket's static inputs (one copy), copy its
        prefix-cache restores; returns the bucket's metadata."""
        return self.load_planned(*self.plan(batch))

    def plan(self, batch: Batch) -> tuple[tuple, HostMetadata]:
        """The host side of `load`: the step's bucket and its eager metadata, or for a lone prompt
        (fresh, or a follow-up turn's suffix) a template's stub carrying the packed bytes
        (engine/prefill_template.py; a prompt of a new length packed for it directly,
        engine/prefill_lone.py); under tensor parallelism rank 0 plans once and every rank
        loads it with `load_planned`."""
        key = self.bucket_of(batch)
        b, ps, sp = self.buckets[key], self.page_size, self.scratch_page

        def pack_lone(own: bool) -> tuple[HostMetadata, dict[str, np.ndarray]]:
            return pack_lone_row(batch.prefills[0], b, page_size=ps, scratch_page=sp,
                                 reuse=not own)

        return key, self.templates.plan(key, batch, lambda: plan_metadata(
            batch, chunk_size=self.chunk_size, conv_kernel=self.conv_kernel, page_size=ps,
            scratch_page=sp), pack_lone)

    def load_planned(self, key: tuple, host: HostMetadata,
                     staged: torch.Tensor | None = None) -> ForwardMetadata:
        """Load `plan`'s metadata into bucket `key` and copy its restores. `staged`: the bucket's
        bytes (`step_bytes`) already on the device, uploaded in the step's one copy with the
        sampling arrays (engine/runner.py); else they are copied here."""
        if staged is None:
            copy_into(self.step_bytes(key, host), self.buf)
        else:
            self.buf[: staged.numel()].copy_(staged)  # device to device, after the upload
        n = host.num_restores
        if n:  # whole states of every Mamba layer: the real count only, outside the graph
            parts = self.parts[key]
            restore_snapshots(self.state_pool.conv_state, self.state_pool.ssm_state,
                              parts["restore_src"][:n], parts["restore_dst"][:n])
        self._loaded = (key, len(host.arrays["logits_idx"]))
        return self.metas[key]

    def step_bytes(self, key: tuple, host: HostMetadata | None) -> np.ndarray:
        """The bytes of bucket `key`'s static buffer for the step planned as `host` (None: all
        padding, for capture); a template's stub (`prefill_template.py`) carries them."""
        if host is not None and host.packed is not None:
            return host.packed
        return pack_prefill_step(host, self.buckets[key], page_size=self.page_size,
                                 scratch_page=self.scratch_page, reuse=True)

    def replay(self) -> torch.Tensor:
        """Replay (or, uncaptured, run) the loaded bucket's forward; returns the logits of the
        step's real logit rows, in the eager order."""
        key, n = self._loaded
        started, self._started = self._started == key, None
        if key[:2] in self.heads and not started:  # the head now, the rest after it
            self._run_head(key)
        if key in self.graphs:
            self.graphs[key].replay()
        else:
            self._forward(key)
        return self.logits[:n]

    def _load_padding(self, key: tuple) -> None:
        """An all-padding step in bucket `key` (capture)."""
        copy_into(self.step_bytes(key, None), self.buf)

    def _forward(self, key: tuple) -> None:
        """The bucket's forward; where it has a head, the rest of it after the head's outputs."""
        out = self.model(self.metas[key], self.state_pool.conv_state, self.state_pool.ssm_state,
                         self.kv_pool.kv_cache, **self._head_kw(key))
        self.logits[: out.shape[0]].copy_(out)

    def _head_kw(self, key: tuple) -> dict:
        return {"head": self.heads[key[:2]]} if key[:2] in self.heads else {}

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into `pool` (the decode graphs' pool, shared) on
        all-padding steps, which touch only the scratch state slot and KV page; logs the count,
        the time and the device memory the graphs took."""
        if not self.capture_enabled:
            return
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        free0, t0 = torch.cuda.mem_get_info(self.device)[0], time.perf_counter()
        order = sorted(self.buckets, key=lambda k: (self.buckets[k].num_tokens, k), reverse=True)
        for key in order:
            self._load_padding(key)
            if key[:2] in self.heads and key[:2] not in self.head_graphs:
                # the head's outputs (kept: the rest reads them) hold real values before the
                # rest's warm-up runs on them
                self.head_graphs[key[:2]] = capture_graph(lambda k=key: self._head_forward(k),
                                                          self.device, pool)
                self.head_graphs[key[:2]].replay()
            self.graphs[key] = capture_graph(lambda k=key: self._forward(k), self.device, pool)
        torch.cuda.synchronize(self.device)
        used = free0 - torch.cuda.mem_get_info(self.device)[0]
        dense = sum(k[-1] == DENSE for k in self.graphs)
        logger.info("CUDA graphs captured for %d prefill / mixed steps in %.1f s (%.0f MiB): "
                    "prefill tokens %s x decode rows %s (prefill-only: up to %d tokens; %d "
                    "with dense attention for fresh lone prompts; %d with a head started "
                    "before planning), up to %d prefill rows",
                    len(self.graphs), time.perf_counter() - t0, used / 2**20,
                    self.token_buckets, self.decode_buckets, self.solo_buckets[-1], dense,
                    len(self.head_graphs), self.max_prefill_rows)


def dense_capable(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a fresh lone prompt's graph may run its attention dense: a CUDA device, attention
    layers, 16-bit weights, a head size flash attention serves, and the dense path not switched
    off (ops/paged_attention.py)."""
    cfg = model.cfg
    if device.type != "cuda" or not cfg.attention_layer_ids:
        return False
    emb = getattr(model, "embed_tokens", None) or getattr(model, "embeddings", None)
    dtype = (emb.weight if emb is not None else next(model.parameters())).dtype  # activations
    return dense_prefill_enabled(dtype, cfg.head_dim)
