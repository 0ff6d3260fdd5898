"""Batch (host) -> ForwardMetadata (device): everything a forward's layers need, built once.

All index arrays are computed here with numpy from the scheduled `Batch` (engine/batch.py), packed
with any other host arrays of the step into ONE buffer and uploaded with ONE host-to-device copy
(`host_upload.upload`; pinned memory on CUDA). Layers receive the metadata explicitly; they never
read a device value back (every size they need is a host int on the metadata) and no device op
has a data-dependent output shape.

`ForwardMetadata` holds what every forward has (tokens, positions, state slots, KV pages, the
logit rows, decode-row snapshots); `PrefillMetadata`, present only when the batch has prefill
rows, holds the conv windows, the SSD chunk grid, prefill snapshots and prefix-cache restores.
Batch layout: prefill rows first, decode rows last (one token each).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from mambaserve.host_upload import upload

if TYPE_CHECKING:
    from mambaserve.engine.batch import Batch


@dataclass
class PrefillMetadata:
    """The prefill rows' part of a forward (rows [0, num_rows) of the batch)."""

    num_rows: int
    num_tokens: int  # the first num_tokens tokens of the batch
    num_chunks: int
    num_snapshots: int
    num_restores: int
    state_slots: torch.Tensor  # [P] (a view of ForwardMetadata.state_slots)
    has_initial_state: torch.Tensor  # [P] bool
    conv_window_idx: torch.Tensor  # [Tp, K] into the extended conv stream
    conv_state_idx: torch.Tensor  # [P, K-1]
    chunk_token_idx: torch.Tensor  # [num_chunks, chunk_size], padding = Tp
    token_chunk_pos: torch.Tensor  # [Tp]
    row_chunks: torch.Tensor  # [P, max_chunks_per_row], padding = num_chunks
    row_num_chunks: torch.Tensor  # [P]
    # prefix-cache snapshots (sizes are host ints: no data-dependent shapes)
    snap_conv_idx: torch.Tensor  # [S, K-1] into the extended conv stream
    snap_dst: torch.Tensor  # [S] destination slots
    chunk_snap_dst: torch.Tensor  # [num_chunks] the SSM snapshot slot of each chunk's end, or -1
    # prefix-cache restores, run before the first layer
    restore_src: torch.Tensor  # [num_restores] cached snapshot slots
    restore_dst: torch.Tensor  # [num_restores] live slots they are copied into
    # host: (first token, tokens, context_len) of each prefill row, for the attention's choice of
    # kernel per row (ops/paged_attention.py); None in a captured graph (one launch for all)
    row_spans: tuple[tuple[int, int, int], ...] | None = None


@dataclass
class ForwardMetadata:
    # host ints
    num_tokens: int
    num_decodes: int
    max_kv_len: int
    num_decode_snapshots: int
    # device tensors (views into one uploaded buffer)
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each token
    token_row: torch.Tensor  # [T] row of each token
    state_slots: torch.Tensor  # [R] prefill rows then decode rows
    page_table: torch.Tensor  # [R, max_pages], padding = scratch page
    slot_mapping: torch.Tensor  # [T] flat KV offset of each new token
    logits_idx: torch.Tensor  # token indices whose logits are computed
    decode_snap_dst: torch.Tensor  # [num_decodes] snapshot destination slot or -1 (none)
    prefill: PrefillMetadata | None = None  # None: a decode-only batch

    @property
    def num_prefills(self) -> int:
        return self.prefill.num_rows if self.prefill is not None else 0

    @property
    def num_prefill_tokens(self) -> int:
        return self.prefill.num_tokens if self.prefill is not None else 0

    @property
    def decode_state_slots(self) -> torch.Tensor:
        return self.state_slots[self.num_prefills:]


@dataclass
class HostMetadata:
    """A forward's metadata before the upload: host ints and the arrays `on_device` views."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_tokens: int
    num_chunks: int
    max_kv_len: int
    num_prefill_snapshots: int
    num_decode_snapshots: int
    num_restores: int
    arrays: dict[str, np.ndarray]  # names are ForwardMetadata / PrefillMetadata fields
    row_spans: tuple[tuple[int, int, int], ...] = ()  # PrefillMetadata.row_spans
    # a prefill graph's bucket bytes, already packed (engine/prefill_template.py): the step's
    # other arrays are then not kept
    packed: np.ndarray | None = None

    def on_device(self, tensors: dict[str, torch.Tensor]) -> ForwardMetadata:
        """The metadata over `tensors` (the uploaded arrays, possibly among other parts)."""
        t = tensors
        prefill = None
        if self.num_prefills:
            prefill = PrefillMetadata(
                num_rows=self.num_prefills, num_tokens=self.num_prefill_tokens,
                num_chunks=self.num_chunks, num_snapshots=self.num_prefill_snapshots,
                num_restores=self.num_restores,
                state_slots=t["state_slots"][: self.num_prefills], row_spans=self.row_spans,
                **{name: t[name] for name in _PREFILL_ARRAYS})
        return ForwardMetadata(
            num_tokens=self.num_tokens, num_decodes=self.num_decodes, max_kv_len=self.max_kv_len,
            num_decode_snapshots=self.num_decode_snapshots,
            **{name: t[name] for name in _COMMON_ARRAYS}, prefill=prefill)


_COMMON_ARRAYS = ("input_ids", "positions", "token_row", "state_slots", "page_table",
                  "slot_mapping", "logits_idx", "decode_snap_dst")
_PREFILL_ARRAYS = ("has_initial_state", "conv_window_idx", "conv_state_idx", "chunk_token_idx",
                   "token_chunk_pos", "row_chunks", "row_num_chunks",
                   "snap_conv_idx", "snap_dst", "chunk_snap_dst", "restore_src", "restore_dst")


def build_metadata(batch: Batch, *, chunk_size: int, conv_kernel: int, page_size: int,
                   scratch_page: int, device: torch.device | str) -> ForwardMetadata:
    """Plan and upload in one go (the runner plans first, to upload the sampling arrays in the
    same copy)."""
    host = plan_metadata(batch, chunk_size=chunk_size, conv_kernel=conv_kernel,
                         page_size=page_size, scratch_page=scratch_page)
    return host.on_device(upload(host.arrays, device))


def fill_page_table(table: np.ndarray, pages: list[list[int]]) -> None:
    """Row i of `table` starts with `pages[i]` (the rest of the row is left as it is): a row at a
    time for a few rows, every row in one masked write (row-major, as the pages are chained)
    for more; either way few numpy calls (host time of every step)."""
    if len(pages) <= 8:
        for i, pg in enumerate(pages):
            table[i, : len(pg)] = pg
        return
    counts = np.fromiter(map(len, pages), dtype=np.int64, count=len(pages))
    table[: len(pages)][np.arange(table.shape[1]) < counts[:, None]] = np.fromiter(
        itertools.chain.from_iterable(pages), dtype=np.int64, count=int(counts.sum()))


def plan_metadata(batch: Batch, *, chunk_size: int, conv_kernel: int, page_size: int,
                  scratch_page: int) -> HostMetadata:
    """Every index array of the forward, computed on the host with numpy. Per-row values are
    Python ints, per-token arrays take a few whole-array numpy calls: at batch 1 this is host
    time before the step's first kernel (`mambaserve bench host`)."""
    prefills, decodes = batch.prefills, batch.decodes
    rows = prefills + decodes
    P, R = len(prefills), len(rows)
    if R == 0:
        raise ValueError("empty batch")
    lens_l = [r.num_tokens for r in rows]
    if any(n != 1 for n in lens_l[P:]):
        raise ValueError("decode rows carry exactly one token")
    ctx_l = [r.start for r in rows]  # Row.context_len
    starts_l = [0, *itertools.accumulate(lens_l)]
    T, Tp = starts_l[-1], starts_l[P]

    # prefill rows: views of their prompts' arrays (copied once, here); decode rows: one id each
    decode_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in decodes),
                             dtype=np.int64, count=T - Tp)
    input_ids = np.concatenate([r.token_array() for r in prefills] + [decode_ids])
    local = np.arange(T, dtype=np.int64)
    if R == 1:
        token_row = np.zeros(T, dtype=np.int64)
        positions = local + ctx_l[0]
    else:
        token_row = np.repeat(np.arange(R, dtype=np.int64), lens_l)
        first = np.array(starts_l[:-1], dtype=np.int64)[token_row]
        positions = local + (np.array(ctx_l, dtype=np.int64)[token_row] - first)
        local -= first

    # --- attention pages ----------------------------------------------------------------------
    pages = [r.request.pages for r in rows]  # Row.pages
    max_pages = max(1, max(map(len, pages)))
    page_table = np.full((R, max_pages), scratch_page, dtype=np.int64)
    fill_page_table(page_table, pages)
    page_of, offset = np.divmod(positions, page_size)
    slot_mapping = page_table[token_row, page_of] * page_size + offset
    max_kv_len = max(c + n for c, n in zip(ctx_l, lens_l))

    logits_idx = np.array([starts_l[i] + p for i, r in enumerate(rows) for p in r.logits_positions],
                          dtype=np.int64)
    decode_snap_dst = []
    for row in decodes:
        if len(row.snapshots) > 1 or any(p != row.start + 1 for p, _ in row.snapshots):
            raise ValueError("a decode row snapshots at most the position after its token")
        if row.restore_from >= 0:
            raise ValueError("a decode row cannot restore a snapshot")
        decode_snap_dst.append(row.snapshots[0][1] if row.snapshots else -1)
    arrays = {
        "input_ids": input_ids, "positions": positions, "token_row": token_row,
        "state_slots": np.array([r.request.state_slot for r in rows], dtype=np.int64),
        "page_table": page_table, "slot_mapping": slot_mapping, "logits_idx": logits_idx,
        "decode_snap_dst": np.array(decode_snap_dst, dtype=np.int64),
    }
    num_chunks = num_snaps = num_restores = 0
    if P:
        prefill_arrays = _prefill_arrays(prefills, lens_l[:P], starts_l[: P + 1], ctx_l[:P],
                                         local[:Tp], token_row[:Tp], chunk_size, conv_kernel)
        arrays.update(prefill_arrays)
        num_chunks = len(prefill_arrays["chunk_token_idx"])
        num_snaps = len(prefill_arrays["snap_dst"])
        num_restores = len(prefill_arrays["restore_src"])
    return HostMetadata(
        num_prefills=P, num_prefill_tokens=Tp, num_decodes=len(decodes), num_tokens=T,
        num_chunks=num_chunks, max_kv_len=max_kv_len, num_prefill_snapshots=num_snaps,
        num_decode_snapshots=sum(1 for d in decode_snap_dst if d >= 0),
        num_restores=num_restores, arrays=arrays,
        row_spans=tuple(zip(starts_l[:P], lens_l[:P], ctx_l[:P])))


def _prefill_arrays(prefills: list, lens: list[int], starts: list[int], ctx: list[int],
                    local: np.ndarray, prow: np.ndarray, chunk_size: int,
                    conv_kernel: int) -> dict[str, np.ndarray]:
    """Conv windows, the SSD chunk grid, prefill snapshots and restores of the prefill rows
    (`lens`, `starts`, `ctx`: per row; `local`, `prow`: each prefill token's offset in its row
    and its row)."""
    P, Tp, K1, L = len(prefills), starts[-1], conv_kernel - 1, chunk_size

    # --- conv windows over the extended stream [P*(K-1) saved inputs | Tp new tokens] ---------
    # virtual offset u in row r: its saved inputs below K1 (r*K1 + u), else the new token at
    # starts[r] + u - K1 (P*K1 + starts[r] + u - K1)
    row_start = np.array(starts[:P], dtype=np.int64)

    def ext_index(r: np.ndarray | int, u: np.ndarray) -> np.ndarray:
        return np.where(u < K1, r * K1 + u, P * K1 + row_start[r] + u - K1)

    # token t's window is u = local + k, k < K: inside the new tokens (ext = P*K1 + t + k - K1)
    # but for the first K1 tokens of each row, whose windows start in the saved inputs
    taps = np.arange(conv_kernel, dtype=np.int64)
    conv_window_idx = (P * K1 - K1 + np.arange(Tp, dtype=np.int64))[:, None] + taps
    if P == 1:  # (a lone prompt: its head is its first tokens)
        head = min(K1, lens[0])
        conv_window_idx[:head] = ext_index(0, np.arange(head, dtype=np.int64)[:, None] + taps)
    else:
        head = np.flatnonzero(local < K1)
        conv_window_idx[head] = ext_index(prow[head, None], local[head, None] + taps)
    conv_state_idx = ext_index(np.arange(P)[:, None],
                               np.array(lens, dtype=np.int64)[:, None] + np.arange(K1))

    # --- SSD chunk plan: each row's tokens split at absolute multiples of chunk_size ----------
    # row r spans absolute chunks ctx // L .. (ctx + len - 1) // L; its first chunk starts at
    # its first token, the others at their absolute multiple of L
    num_l = [(c + n - 1) // L - c // L + 1 if n else 0 for c, n in zip(ctx, lens)]
    first_l = [0, *itertools.accumulate(num_l)]
    C = first_l[-1]
    if P == 1:
        k = (ctx[0] + local) // L - ctx[0] // L  # chunk of each token within its row
        chunk_of = k
        token_chunk_pos = k * L + local - np.where(k == 0, 0, k * L - ctx[0] % L)
    else:
        rctx = np.array(ctx, dtype=np.int64)[prow]
        k = (rctx + local) // L - rctx // L
        chunk_of = np.array(first_l[:-1], dtype=np.int64)[prow] + k
        token_chunk_pos = chunk_of * L + local - np.where(k == 0, 0, k * L - rctx % L)
    chunk_token_idx = np.full(C * L, Tp, dtype=np.int64)
    chunk_token_idx[token_chunk_pos] = np.arange(Tp, dtype=np.int64)
    chunk_token_idx = chunk_token_idx.reshape(C, L)
    row_num_chunks = np.array(num_l, dtype=np.int64)
    cols = np.arange(max(num_l, default=0), dtype=np.int64)
    row_chunks = np.where(cols < row_num_chunks[:, None],
                          np.array(first_l[:-1], dtype=np.int64)[:, None] + cols, C)

    # --- prefix-cache snapshots and restores ----------------------------------------------------
    snap_conv, snap_dst = [], []
    chunk_snap_dst = np.full(C, -1, dtype=np.int64)  # the scan's view: one entry per chunk
    for r, row in enumerate(prefills):
        for pos, dst in row.snapshots:
            # a snapshot sits at the end of one of the row's chunks: a multiple of L or the
            # row's last token
            local_end = pos - ctx[r]
            if not 0 < local_end <= lens[r] or (pos % L and local_end != lens[r]):
                raise ValueError(f"snapshot position {pos} is not a chunk end of its row")
            chunk_snap_dst[first_l[r] + (pos - 1) // L - ctx[r] // L] = dst
            snap_conv.append(ext_index(r, local_end + np.arange(K1)))
            snap_dst.append(dst)
    restores = [(r.restore_from, r.request.state_slot) for r in prefills if r.restore_from >= 0]
    return {
        "has_initial_state": np.array([bool(r.has_initial_state) for r in prefills],
                                      dtype=np.bool_),
        "conv_window_idx": conv_window_idx, "conv_state_idx": conv_state_idx,
        "chunk_token_idx": chunk_token_idx, "token_chunk_pos": token_chunk_pos,
        "row_chunks": row_chunks,
        "row_num_chunks": row_num_chunks,
        "snap_conv_idx": np.array(snap_conv, dtype=np.int64).reshape(len(snap_conv), K1),
        "snap_dst": np.array(snap_dst, dtype=np.int64),
        "chunk_snap_dst": chunk_snap_dst,
        "restore_src": np.array([s for s, _ in restores], dtype=np.int64),
        "restore_dst": np.array([d for _, d in restores], dtype=np.int64),
    }
