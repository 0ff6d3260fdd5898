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
import math
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from mambaserve.engine.batch import Batch
from mambaserve.engine.cuda_graph import attention_workspace_bytes, capture_graph
from mambaserve.engine.prefill_template import SoloTemplates, fresh_lone_prompt
from mambaserve.host_upload import copy_into, layout, views
from mambaserve.metadata import ForwardMetadata, HostMetadata, PrefillMetadata, plan_metadata
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.paged_attention import DENSE_MIN_TOKENS, dense_prefill_enabled
from mambaserve.ops.state_snapshot import restore_snapshots

logger = logging.getLogger("mambaserve")

MAX_PREFILL_ROWS = 4  # real prefill rows a graph holds (one more padding row)
MAX_MIXED_DECODES = 64  # decode rows next to a prefill part; larger mixed steps run eagerly
_I64, _BOOL = np.dtype(np.int64), np.dtype(np.bool_)
DENSE = "dense"  # the last element of a fresh lone prompt's dense-attention bucket key


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


@dataclass(frozen=True)
class PrefillBucket:
    """The fixed shapes of one prefill / mixed graph."""

    tokens: int  # prefill tokens, real + padding
    decodes: int  # decode rows, real + padding
    rows: int  # prefill rows: up to rows - 1 real ones, then padding rows
    chunk_size: int
    conv_kernel: int
    max_pages: int
    snapshots: bool  # prefix caching on: prefill and decode snapshots are captured

    @property
    def num_tokens(self) -> int:
        return self.tokens + self.decodes

    @property
    def num_rows(self) -> int:
        return self.rows + self.decodes

    @property
    def chunks(self) -> int:
        """A row of n tokens starting at offset s of a chunk spans ceil((s + n) / L) <= (n + 2L
        - 2) / L chunks; the padding rows add one chunk each, plus the padding tokens' chunks:
        at most tokens / L + 2 * rows - 1 in all."""
        return self.tokens // self.chunk_size + 2 * self.rows - 1

    @property
    def chunks_per_row(self) -> int:
        return (self.tokens + 2 * self.chunk_size - 2) // self.chunk_size

    @property
    def num_snapshots(self) -> int:
        """Prefill snapshots: each row takes at most one per chunk_size multiple it reaches
        (snapshot positions are multiples of the interval, itself a multiple of the chunk
        size), at most three (two for the tree, the latest)."""
        if not self.snapshots:
            return 0
        real = self.rows - 1
        return min(3 * real, real + self.tokens // self.chunk_size)

    @property
    def num_logits(self) -> int:
        return self.rows - 1 + self.decodes

    @cached_property
    def specs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The parts of the static buffer, in order (the page table, the largest, last)."""
        T, Tp, P, D, R = self.num_tokens, self.tokens, self.rows, self.decodes, self.num_rows
        K, S = self.conv_kernel, self.num_snapshots
        return {
            "input_ids": (_I64, (T,)), "positions": (_I64, (T,)), "token_row": (_I64, (T,)),
            "slot_mapping": (_I64, (T,)), "state_slots": (_I64, (R,)),
            "decode_snap_dst": (_I64, (D,)), "logits_idx": (_I64, (self.num_logits,)),
            "conv_window_idx": (_I64, (Tp, K)), "conv_state_idx": (_I64, (P, K - 1)),
            "chunk_token_idx": (_I64, (self.chunks, self.chunk_size)),
            "token_chunk_pos": (_I64, (Tp,)), "row_chunks": (_I64, (P, self.chunks_per_row)),
            "row_num_chunks": (_I64, (P,)), "snap_chunk": (_I64, (S,)),
            "snap_conv_idx": (_I64, (S, K - 1)), "snap_dst": (_I64, (S,)),
            "restore_src": (_I64, (P - 1,)), "restore_dst": (_I64, (P - 1,)),
            "has_initial_state": (_BOOL, (P,)), "page_table": (_I64, (R, self.max_pages)),
        }

    @cached_property
    def _layout(self) -> tuple[dict[str, int], int]:
        return layout(self.specs)

    @property
    def nbytes(self) -> int:
        return self._layout[1]

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Named, typed views of a host byte buffer in this bucket's layout."""
        offsets = self._layout[0]
        return {name: buf[offsets[name]: offsets[name] + dtype.itemsize * math.prod(shape)]
                .view(dtype).reshape(shape) for name, (dtype, shape) in self.specs.items()}

    @cached_property
    def scratch(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A host buffer of this bucket's own and its views, which `pack_prefill_step(...,
        reuse=True)` fills in place (the views are built once, not every step)."""
        buf = np.zeros(self.nbytes, np.uint8)
        return buf, self.host_views(buf)


def pack_prefill_step(host: HostMetadata | None, b: PrefillBucket, *, page_size: int,
                      scratch_page: int, reuse: bool = False) -> np.ndarray:
    """The bucket's host byte buffer (its one upload) for a step planned eagerly as `host`
    (None: all padding, for capture): the eager arrays embedded in the bucket's layout, padding
    around them (module docstring). `b.host_views(buf)` names its parts. `reuse`: fill the
    bucket's own buffer (`b.scratch`) and return it; it holds the step only until the next
    packing into this bucket (the runner copies it into the step's upload at once)."""
    z = HostMetadata(0, 0, 0, 0, 0, 0, 0, 0, 0, {}) if host is None else host
    Pr, Tr, Dr, Cr = z.num_prefills, z.num_prefill_tokens, z.num_decodes, z.num_chunks
    P, Tp, D, C, L, K1 = b.rows, b.tokens, b.decodes, b.chunks, b.chunk_size, b.conv_kernel - 1
    if not (Pr < P and Tr <= Tp and Dr <= D and Cr <= C and z.num_prefill_snapshots
            <= b.num_snapshots and (Pr or host is None)):
        raise ValueError(f"step of {Pr} prefill rows / {Tr} tokens, {Dr} decode rows, {Cr} "
                         f"chunks, {z.num_prefill_snapshots} snapshots does not fit {b}")
    a = z.arrays
    n_pad, pad_row = Tp - Tr, P - 1
    dec = slice(Tp, Tp + Dr)  # the real decode tokens / rows in the bucket
    ps, scratch = page_size, scratch_page

    def get(name: str, default_shape=(0,)) -> np.ndarray:
        return a[name] if name in a else np.zeros(default_shape, np.int64)

    def ext(e: np.ndarray) -> np.ndarray:  # an eager extended-stream index -> the bucket's
        return np.where(e < Pr * K1, e, e + (P - Pr) * K1)

    if reuse:
        buf, out = b.scratch
        buf.fill(0)
    else:
        buf = np.zeros(b.nbytes, np.uint8)
        out = b.host_views(buf)
    # ---- tokens: real prefill | padding prefill (from position 0) | real decode | padding ----
    pad_pos = np.arange(n_pad, dtype=np.int64)
    for name in ("input_ids", "positions", "slot_mapping", "token_row"):
        eager, o = get(name), out[name]
        o[:Tr], o[dec] = eager[:Tr], eager[Tr:]
    # positions within the first page: the padding row's attention reads page-table column 0
    # only (a position past max_model_len would index past its page-table row)
    out["positions"][Tr:Tp] = pad_pos % ps
    out["slot_mapping"][Tr:Tp] = scratch * ps + pad_pos % ps
    out["slot_mapping"][Tp + Dr:] = scratch * ps
    out["token_row"][Tr:Tp] = pad_row
    out["token_row"][Tp:] = P + np.arange(D)
    # ---- rows: real prefill | padding prefill | real decode | padding decode ------------------
    slots, table = out["state_slots"], out["page_table"]
    slots[:] = -1
    table[:] = scratch
    if host is not None:
        slots[:Pr], slots[P: P + Dr] = a["state_slots"][:Pr], a["state_slots"][Pr:]
        width = a["page_table"].shape[1]
        if width > b.max_pages:
            raise ValueError(f"a row needs {width} pages, the graph holds {b.max_pages}")
        table[:Pr, :width], table[P: P + Dr, :width] = a["page_table"][:Pr], a["page_table"][Pr:]
    out["decode_snap_dst"][:] = -1
    out["decode_snap_dst"][:Dr] = get("decode_snap_dst")
    li = get("logits_idx")
    out["logits_idx"][: len(li)] = np.where(li >= Tr, li + n_pad, li)
    # ---- prefill rows: conv windows, the SSD chunk grid, snapshots, restores -----------------
    out["has_initial_state"][:Pr] = a.get("has_initial_state", np.zeros(0, np.bool_))
    out["conv_window_idx"][:Tr] = ext(get("conv_window_idx", (0, K1 + 1)))
    u = pad_pos[:, None] + np.arange(K1 + 1)  # the padding row's windows
    out["conv_window_idx"][Tr:] = np.where(u < K1, pad_row * K1 + u, P * K1 + Tr + u - K1)
    out["conv_state_idx"][:Pr] = ext(get("conv_state_idx", (0, K1)))
    # padding rows keep their (scratch) window: u < K1 of their own saved inputs; the last
    # row's ends at n_pad, inside the padding tokens from u = K1 on
    pad_rows = np.arange(Pr, P, dtype=np.int64)[:, None]
    u = np.where(pad_rows == pad_row, n_pad, 0) + np.arange(K1)
    out["conv_state_idx"][Pr:] = np.where(u < K1, pad_rows * K1 + u, P * K1 + Tr + u - K1)
    cti, tcp = out["chunk_token_idx"], out["token_chunk_pos"]
    cti[:] = Tp
    eager_cti = get("chunk_token_idx", (0, L))
    cti[:Cr] = np.where(eager_cti == Tr, Tp, eager_cti)
    tcp[:Tr] = get("token_chunk_pos")
    rc, rnc = out["row_chunks"], out["row_num_chunks"]
    rc[:] = C
    eager_rc = get("row_chunks", (0, 0))
    rc[:Pr, : eager_rc.shape[1]] = np.where(eager_rc == Cr, C, eager_rc)
    rnc[:Pr] = get("row_num_chunks")
    # padding rows: one empty chunk each but the last, whose tokens fill aligned chunks
    empty = P - 1 - Pr
    rc[Pr:pad_row, 0] = np.arange(Cr, Cr + empty)
    rnc[Pr:pad_row] = 1
    c = Cr + empty  # the padding row's first chunk
    k = max(1, -(-n_pad // L))
    assert c + k <= C, (c + k, C)
    rc[pad_row, :k] = np.arange(c, c + k)
    rnc[pad_row] = k
    cti.reshape(-1)[c * L: c * L + n_pad] = np.arange(Tr, Tp)
    tcp[Tr:] = c * L + pad_pos
    Sr = len(get("snap_dst"))
    out["snap_chunk"][:Sr] = get("snap_chunk")  # padding: chunk 0 (always a real chunk)
    out["snap_conv_idx"][:Sr] = ext(get("snap_conv_idx", (0, K1)))
    out["snap_dst"][:] = -1
    out["snap_dst"][:Sr] = get("snap_dst")
    n_res = len(get("restore_src"))  # padding entries are never read (sliced to n_res)
    out["restore_src"][:n_res], out["restore_dst"][:n_res] = get("restore_src"), \
        get("restore_dst")
    return buf


def bucket_metadata(parts: dict[str, torch.Tensor], b: PrefillBucket, *,
                    max_kv_len: int, dense: bool = False) -> ForwardMetadata:
    """The captured metadata of bucket `b` over its views `parts` of the static buffer. No
    restore runs inside (num_restores = 0): the runner copies them before the replay. `dense`:
    the prefill part is one fresh row for the attention (a fresh lone prompt's variant: its
    real tokens, then the padding tokens no real token sees)."""
    t, P = parts, b.rows
    prefill = PrefillMetadata(
        num_rows=P, num_tokens=b.tokens, num_chunks=b.chunks, num_snapshots=b.num_snapshots,
        num_restores=0, state_slots=t["state_slots"][:P],
        row_spans=((0, b.tokens, 0),) if dense else None,
        restore_src=t["restore_src"][:0], restore_dst=t["restore_dst"][:0],
        **{n: t[n] for n in ("has_initial_state", "conv_window_idx", "conv_state_idx",
                             "chunk_token_idx", "token_chunk_pos", "row_chunks",
                             "row_num_chunks", "snap_chunk", "snap_conv_idx", "snap_dst")})
    return ForwardMetadata(
        num_tokens=b.num_tokens, num_decodes=b.decodes, max_kv_len=max_kv_len,
        num_decode_snapshots=b.decodes if b.snapshots else 0, prefill=prefill,
        **{n: t[n] for n in ("input_ids", "positions", "token_row", "state_slots", "page_table",
                             "slot_mapping", "logits_idx", "decode_snap_dst")})


class PrefillGraphRunner:
    """Captures and replays forwards of steps with a small prefill part. `capture=False` (and
    always on a CPU) runs the same static-buffer forwards eagerly."""

    def __init__(self, model: torch.nn.Module, state_pool, kv_pool, *, max_tokens: int,
                 max_decodes: int, max_model_len: int, snapshots: bool, device: torch.device,
                 max_prefill_rows: int = MAX_PREFILL_ROWS, capture: bool = True,
                 max_workspace_bytes: int = 8 << 30, max_solo_tokens: int | None = None,
                 dense_solo: bool | None = None) -> None:
        """max_tokens: the prefill part of a step with decode rows; max_solo_tokens (>=
        max_tokens, default max_tokens): that of a prefill-only step; dense_solo: the fresh lone
        prompts' dense-attention variants of the prefill-only buckets of >= DENSE_MIN_TOKENS
        tokens (None: where `dense_capable`)."""
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
        self.templates = SoloTemplates(self.page_size)  # fresh lone prompts' packed steps

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

    # ---- replay -----------------------------------------------------------------------------
    def load(self, batch: Batch) -> ForwardMetadata:
        """Plan the step, upload it into its bucket's static inputs (one copy), copy its
        prefix-cache restores; returns the bucket's metadata."""
        return self.load_planned(*self.plan(batch))

    def plan(self, batch: Batch) -> tuple[tuple, HostMetadata]:
        """The host side of `load`: the step's bucket and its eager metadata, or for a fresh lone
        prompt a template's stub carrying the packed bytes (engine/prefill_template.py); under
        tensor parallelism rank 0 plans once and every rank loads it with `load_planned`."""
        key = self.bucket_of(batch)
        b, ps, sp = self.buckets[key], self.page_size, self.scratch_page

        def pack_own(host: HostMetadata) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            packed = pack_prefill_step(host, b, page_size=ps, scratch_page=sp)  # its own buffer
            return packed, b.host_views(packed)

        return key, self.templates.plan(key, batch, lambda: plan_metadata(
            batch, chunk_size=self.chunk_size, conv_kernel=self.conv_kernel, page_size=ps,
            scratch_page=sp), pack_own)

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
        if key in self.graphs:
            self.graphs[key].replay()
        else:
            self._forward(key)
        return self.logits[:n]

    def _load_padding(self, key: tuple) -> None:
        """An all-padding step in bucket `key` (capture)."""
        copy_into(self.step_bytes(key, None), self.buf)

    def _forward(self, key: tuple) -> None:
        out = self.model(self.metas[key], self.state_pool.conv_state, self.state_pool.ssm_state,
                         self.kv_pool.kv_cache)
        self.logits[: out.shape[0]].copy_(out)

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
            self.graphs[key] = capture_graph(lambda k=key: self._forward(k), self.device, pool)
        torch.cuda.synchronize(self.device)
        used = free0 - torch.cuda.mem_get_info(self.device)[0]
        dense = sum(k[-1] == DENSE for k in self.graphs)
        logger.info("CUDA graphs captured for %d prefill / mixed steps in %.1f s (%.0f MiB): "
                    "prefill tokens %s x decode rows %s (prefill-only: up to %d tokens; %d "
                    "with dense attention for fresh lone prompts), up to %d prefill rows",
                    len(self.graphs), time.perf_counter() - t0, used / 2**20,
                    self.token_buckets, self.decode_buckets, self.solo_buckets[-1], dense,
                    self.max_prefill_rows)


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
