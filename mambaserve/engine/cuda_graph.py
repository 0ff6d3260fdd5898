"""Decode CUDA graphs: the whole decode forward (every layer + lm_head, logits of every row)
captured once per batch-size bucket and replayed for decode-only batches.

Design (docs/cuda_graphs.md):
- ONE static int64 device buffer holds every index array of a decode forward at `max_bs` rows.
  Layout: per-row fields (input_ids, positions, token_row, state_slots, slot_mapping,
  decode_snap_dst, logits_idx), each `max_bs` long, then the page table
  `[max_bs, max_pages]` LAST, so that everything bucket `bs` reads is one contiguous prefix
  (`StaticLayout.prefix_len(bs)`): a replay's prefix rides in the step's one upload with the
  sampling arrays (engine/runner.py) and a device-to-device copy puts it in the static buffer;
  every decode row samples its one logit row, in batch order.
- The captured `ForwardMetadata` of bucket `bs` holds views SLICED `[:bs]` of the static buffer
  (never the whole max-size field, whose stale tail a kernel would see) and fixed host ints:
  num_decodes = bs, no prefill part, max_kv_len = max_model_len rounded up to whole pages (one
  graph serves every length; attention masks by each token's position).
- Padding rows (real batch size < bucket): state slot -1 (kernels skip it, references route it
  to the scratch slot), KV slot and page-table row -> the scratch page, position 0, token 0,
  snapshot destination -1. Decode rows sit at the FRONT of the static buffers, so a mixed batch
  (prefill rows first in the eager layout) must never reach this path: `pack_decode_batch`
  asserts it.
- Prefix-cache snapshots of decode rows run inside the graph with fixed shapes (-1 = none).
- Logits are copied inside the graph into one shared `[max_bs, vocab]` float32 buffer (not one
  output per graph), so the graphs' outputs cost one buffer, not one per bucket.
- Overlap scheduling: a row whose input token is still on the device packs a placeholder
  (`Row.token_ids`); the runner scatters the real token from its token buffer into the bucket's
  `input_ids` view after `load` and before `replay` (engine/runner.py `_feed`), on the stream
  that also orders this upload after the previous replay.

On a CPU (tests) the same static-buffer path runs without capture (`capture=False`): packing,
padding, slicing and the engine routing are exercised; only capture/replay needs a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mambaserve.engine.batch import Batch, Row
from mambaserve.host_upload import copy_into
from mambaserve.metadata import ForwardMetadata, fill_page_table
from mambaserve.ops.dispatch import kernel_path

logger = logging.getLogger("mambaserve")

ROW_FIELDS = ("input_ids", "positions", "token_row", "state_slots", "slot_mapping",
              "decode_snap_dst", "logits_idx")


def bucket_sizes(max_bs: int, step: int = 8) -> list[int]:
    """1, 2, 4, 8, then multiples of `step` above 8 up to max_bs (max_bs always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    if step < 1:
        raise ValueError(f"bucket step must be >= 1, got {step}")
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    b = step * (8 // step + 1)  # the first multiple of step above 8
    while b < max_bs:
        out.append(b)
        b += step
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


def choose_bucket(buckets: list[int], n: int) -> int:
    """Smallest bucket >= n."""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch size {n} exceeds the largest captured bucket {buckets[-1]}")


@dataclass(frozen=True)
class StaticLayout:
    """Offsets of the fields inside the static int64 buffer."""

    max_bs: int
    max_pages: int

    def offset(self, name: str) -> int:
        if name == "page_table":
            return len(ROW_FIELDS) * self.max_bs
        return ROW_FIELDS.index(name) * self.max_bs

    @property
    def total(self) -> int:
        return len(ROW_FIELDS) * self.max_bs + self.max_bs * self.max_pages

    def prefix_len(self, bs: int) -> int:
        """Length of the contiguous prefix that bucket `bs` reads (the page table is last)."""
        return len(ROW_FIELDS) * self.max_bs + bs * self.max_pages


def pack_decode_batch(batch: Batch, bs: int, layout: StaticLayout, *, page_size: int,
                      scratch_page: int) -> np.ndarray:
    """Host array of `layout.prefix_len(bs)` int64 with the real decode rows first and padding
    rows up to `bs`. Raises AssertionError for a batch with prefill rows (mixed batches run
    eagerly: their decode rows sit at the END of the eager layout, here at the FRONT)."""
    assert not batch.prefills, (
        f"CUDA-graph path got a batch with {len(batch.prefills)} prefill row(s): only decode-only "
        "batches may be replayed (num_decodes must equal the batch size)")
    n = len(batch.decodes)
    assert 0 < n <= bs <= layout.max_bs, f"batch of {n} rows does not fit bucket {bs}"
    mb, mp = layout.max_bs, layout.max_pages
    buf = np.zeros(layout.prefix_len(bs), dtype=np.int64)

    def field(name: str) -> np.ndarray:
        o = layout.offset(name)
        return buf[o: o + mb]

    scratch_slot = scratch_page * page_size
    ids, pos, row, slots = field("input_ids"), field("positions"), field("token_row"), \
        field("state_slots")
    smap, snap, lidx = field("slot_mapping"), field("decode_snap_dst"), field("logits_idx")
    table = buf[layout.offset("page_table"):].reshape(bs, mp)
    # padding rows: slot -1, scratch KV slot / page, position 0, token 0, snapshot -1
    slots[n:] = -1
    smap[n:] = scratch_slot
    snap[n:] = -1
    table[:] = scratch_page
    row[:] = np.arange(mb)
    lidx[:] = np.arange(mb)
    # the real rows: checked and gathered row by row as Python ints, written by a few numpy calls
    # (host time of every decode step)
    ids_l, pos_l, slot_l, smap_l, snap_l, pages = [], [], [], [], [], []
    for r in batch.decodes:
        req, p = r.request, r.start  # (Row.context_len)
        pg = req.pages
        if r.num_tokens != 1:
            raise ValueError("decode rows carry exactly one token")
        if len(pg) > mp:
            raise ValueError(f"row needs {len(pg)} pages, the graph holds {mp}")
        if r.restore_from >= 0:
            raise ValueError("a decode row cannot restore a snapshot")
        if len(r.snapshots) > 1 or any(s != p + 1 for s, _ in r.snapshots):
            raise ValueError("a decode row snapshots at most the position after its token")
        ids_l.append(r.token_ids[0])
        pos_l.append(p)
        slot_l.append(req.state_slot)
        q = p // page_size
        smap_l.append((pg[q] if q < len(pg) else scratch_page) * page_size + p % page_size)
        snap_l.append(r.snapshots[0][1] if r.snapshots else -1)
        pages.append(pg)
    ids[:n], pos[:n], slots[:n], smap[:n], snap[:n] = ids_l, pos_l, slot_l, smap_l, snap_l
    fill_page_table(table, pages)
    return buf


def graph_metadata(buf: torch.Tensor, layout: StaticLayout, bs: int, *, max_kv_len: int,
                   snapshots: bool) -> ForwardMetadata:
    """Metadata of bucket `bs`: views [:bs] of the static buffer, fixed host ints."""
    mb = layout.max_bs

    def view(name: str) -> torch.Tensor:
        o = layout.offset(name)
        return buf[o: o + mb][:bs]

    o = layout.offset("page_table")
    page_table = buf[o: o + mb * layout.max_pages].view(mb, layout.max_pages)[:bs]
    return ForwardMetadata(
        num_tokens=bs, num_decodes=bs, max_kv_len=max_kv_len,
        num_decode_snapshots=bs if snapshots else 0,
        **{name: view(name) for name in ROW_FIELDS}, page_table=page_table)


def attention_workspace_bytes(cfg, bs: int, max_kv_len: int) -> int:
    """Rough size of the reference paged attention's gathered K and V (float32, heads repeated)
    for one decode forward: the graph's max_kv_len is max_model_len, so this bounds which
    buckets are worth capturing while attention is the reference op."""
    if not cfg.attention_layer_ids:
        return 0
    return 2 * bs * max_kv_len * cfg.num_attention_heads * cfg.head_dim * 4


def capture_graph(forward: Callable[[], None], device: torch.device,
                  pool) -> torch.cuda.CUDAGraph:
    """Two warm-up runs of `forward` on a side stream (Triton compile / autotune, allocator),
    then its capture into a graph that allocates from `pool`."""
    side = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        forward()
    return g


class CudaGraphRunner:
    """Captures and replays decode forwards. `capture=False` (and always on a CPU) runs the same
    static-buffer forward eagerly: the host logic is then testable without a GPU."""

    def __init__(self, model: torch.nn.Module, state_pool, kv_pool, *, max_bs: int,
                 max_model_len: int, snapshots: bool, device: torch.device, step: int = 8,
                 capture: bool = True, max_workspace_bytes: int = 8 << 30) -> None:
        self.model, self.state_pool, self.kv_pool = model, state_pool, kv_pool
        self.device = torch.device(device)
        cfg = model.cfg
        self.page_size, self.scratch_page = kv_pool.page_size, kv_pool.scratch_page
        self.max_pages = -(-max_model_len // self.page_size)
        self.max_kv_len = self.max_pages * self.page_size
        self.snapshots = snapshots
        buckets = bucket_sizes(max_bs, step)
        # the reference attention gathers max_kv_len keys per token; the Triton kernel does not
        ref_attention = kernel_path("paged_attention", self.device) == "reference"
        kept = [b for b in buckets if not ref_attention
                or attention_workspace_bytes(cfg, b, self.max_kv_len) <= max_workspace_bytes]
        if len(kept) < len(buckets):
            logger.warning("CUDA graphs: buckets above %s skipped (reference attention over "
                           "max_model_len=%d would gather > %.1f GiB); larger batches run eagerly",
                           kept[-1] if kept else 0, max_model_len, max_workspace_bytes / 2**30)
        self.buckets = kept
        self.max_bs = kept[-1] if kept else 0
        self.layout = StaticLayout(max(self.max_bs, 1), self.max_pages)
        self.buf = torch.zeros(self.layout.total, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(max(self.max_bs, 1), cfg.vocab_size, dtype=torch.float32,
                                  device=self.device)
        self.metas = {b: graph_metadata(self.buf, self.layout, b, max_kv_len=self.max_kv_len,
                                        snapshots=snapshots) for b in self.buckets}
        self.capture_enabled = capture and self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' memory pool once captured

    # ---- routing ----------------------------------------------------------------------------
    def can_run(self, batch: Batch) -> bool:
        """Decode-only, fits a bucket, no prompt logprobs / restores, snapshots only if captured."""
        if batch.prefills or not batch.decodes or len(batch.decodes) > self.max_bs:
            return False
        for r in batch.decodes:
            if r.restore_from >= 0 or len(r.pages) > self.max_pages or r.num_tokens != 1:
                return False
            if r.prompt_targets or not r.samples:
                return False
            if r.snapshots and not self.snapshots:
                return False
        return True

    # ---- capture ----------------------------------------------------------------------------
    def _forward(self, bs: int) -> None:
        out = self.model(self.metas[bs], self.state_pool.conv_state, self.state_pool.ssm_state,
                         self.kv_pool.kv_cache)
        self.logits[:bs].copy_(out)

    def _load(self, batch: Batch, bs: int) -> None:
        """The step's one upload: the bucket's prefix of the static buffer."""
        copy_into(pack_decode_batch(batch, bs, self.layout, page_size=self.page_size,
                                    scratch_page=self.scratch_page), self.buf)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (largest first, one shared memory pool, `self.pool`, which the
        prefill graphs share). The capture batches are all padding rows: they touch only the
        scratch state slot and the scratch KV page."""
        if not self.capture_enabled:
            return
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):
            self._load(Batch([], [Row.standalone([0], 0, -1, True, [])]), bs)
            self.graphs[bs] = capture_graph(lambda b=bs: self._forward(b), self.device, self.pool)
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s (max_kv_len %d)",
                    self.buckets, self.max_kv_len)

    # ---- replay -----------------------------------------------------------------------------
    def pack(self, batch: Batch) -> np.ndarray:
        """A decode-only batch's bucket prefix of the static buffer, on the host (rows past the
        batch are padding; under tensor parallelism rank 0 packs it once and every rank loads it
        with `load_packed`)."""
        assert not batch.prefills and batch.decodes, (
            "CUDA-graph path needs a decode-only batch (num_decodes == batch size)")
        bs = choose_bucket(self.buckets, len(batch.decodes))
        return pack_decode_batch(batch, bs, self.layout, page_size=self.page_size,
                                 scratch_page=self.scratch_page)

    def load_packed(self, packed: np.ndarray, n: int, staged: torch.Tensor) -> ForwardMetadata:
        """Load `pack`'s array of an `n`-row batch, `staged` on the device (uploaded with the
        step's sampling arrays, engine/runner.py); returns its bucket's metadata."""
        bs = choose_bucket(self.buckets, n)
        assert packed.size == self.layout.prefix_len(bs), "packed for another bucket"
        self.buf[: staged.numel()].copy_(staged)  # device to device, after the upload
        return self.metas[bs]

    def replay(self, n: int) -> torch.Tensor:
        """Replay (or, uncaptured, run) the forward of the bucket holding `n` rows, after `load`;
        returns the logits of the n real rows [n, vocab], in batch order."""
        bs = choose_bucket(self.buckets, n)
        if bs in self.graphs:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.logits[:n]
