"""BatchPlan (host) -> ForwardMetadata (device): everything a forward's layers need, built once.

All index arrays are computed here with numpy from scheduler state the host already owns, packed
into ONE int64 buffer and uploaded with ONE host-to-device copy (pinned memory on CUDA). Layers
receive the metadata explicitly; they never read a device value back (every size they need is a
host int on the metadata) and no device op has a data-dependent output shape.

Batch layout: prefill rows first (each a contiguous run of one request's new tokens), decode rows
last (one token each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RowPlan:
    """One row of a forward: a request's new tokens and where its state lives."""

    token_ids: list[int]  # the new tokens of this forward
    context_len: int  # tokens already processed (in the state / KV cache) before this forward
    state_slot: int  # live state slot (negative = padding row, skipped by the kernels)
    has_initial_state: bool  # continue from the slot's state (else start from zeros)
    pages: list[int]  # KV pages covering positions [0, context_len + len(token_ids))
    logits_positions: list[int] = field(default_factory=list)  # row-local token offsets
    # prefix cache: (absolute position, destination slot) of states to snapshot in this forward.
    # Prefill rows: positions are chunk ends inside the row; decode rows: at most one, the
    # position after the row's token.
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    restore_from: int = -1  # copy this slot's state into state_slot before the first layer

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class BatchPlan:
    prefills: list[RowPlan]
    decodes: list[RowPlan]

    @property
    def rows(self) -> list[RowPlan]:
        return self.prefills + self.decodes


@dataclass
class ForwardMetadata:
    # host ints
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_tokens: int
    num_chunks: int
    max_kv_len: int
    num_logits: int
    # device tensors (views into one uploaded buffer)
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each token
    token_row: torch.Tensor  # [T] row of each token
    state_slots: torch.Tensor  # [R] prefill rows then decode rows
    has_initial_state: torch.Tensor  # [P] bool
    conv_window_idx: torch.Tensor  # [Tp, K] into the extended conv stream
    conv_state_idx: torch.Tensor  # [P, K-1]
    chunk_token_idx: torch.Tensor  # [num_chunks, chunk_size], padding = Tp
    token_chunk_pos: torch.Tensor  # [Tp]
    row_chunks: torch.Tensor  # [P, max_chunks_per_row], padding = num_chunks
    row_num_chunks: torch.Tensor  # [P]
    page_table: torch.Tensor  # [R, max_pages], padding = scratch page
    slot_mapping: torch.Tensor  # [T] flat KV offset of each new token
    logits_idx: torch.Tensor  # [num_logits] token indices whose logits are computed
    # prefix-cache snapshots and restores (sizes are host ints: no data-dependent shapes)
    num_prefill_snapshots: int
    num_decode_snapshots: int
    num_restores: int
    snap_chunk: torch.Tensor  # [S] chunk whose end state is saved
    snap_conv_idx: torch.Tensor  # [S, K-1] into the extended conv stream
    snap_dst: torch.Tensor  # [S] destination slots
    decode_snap_dst: torch.Tensor  # [num_decodes] destination slot or -1 (none)
    cow_src: torch.Tensor  # [num_restores] cached snapshot slots
    cow_dst: torch.Tensor  # [num_restores] live slots they are copied into
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # caller's arrays, same upload

    @property
    def prefill_state_slots(self) -> torch.Tensor:
        return self.state_slots[: self.num_prefills]

    @property
    def decode_state_slots(self) -> torch.Tensor:
        return self.state_slots[self.num_prefills:]


def _row_chunks(context_len: int, n: int, chunk_size: int) -> list[tuple[int, int]]:
    """Split row-local offsets [0, n) at absolute multiples of chunk_size."""
    out, i = [], 0
    while i < n:
        pos = context_len + i
        end = min(n, i + chunk_size - pos % chunk_size)
        out.append((i, end))
        i = end
    return out


def build_metadata(plan: BatchPlan, *, chunk_size: int, conv_kernel: int, page_size: int,
                   scratch_page: int, device: torch.device | str,
                   extra: dict[str, np.ndarray] | None = None) -> ForwardMetadata:
    """`extra`: more int arrays of the caller (e.g. prompt-logprob targets) that should ride in
    the same single upload; they come back as `meta.extra[name]`."""
    rows = plan.rows
    P, R = len(plan.prefills), len(rows)
    K1 = conv_kernel - 1
    if R == 0:
        raise ValueError("empty batch plan")
    for r in plan.decodes:
        if r.num_tokens != 1:
            raise ValueError("decode rows carry exactly one token")

    lens = np.array([r.num_tokens for r in rows], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])
    T = int(starts[-1])
    Tp = int(starts[P])
    ctx = np.array([r.context_len for r in rows], dtype=np.int64)

    input_ids = np.fromiter((t for r in rows for t in r.token_ids), dtype=np.int64, count=T)
    token_row = np.repeat(np.arange(R, dtype=np.int64), lens)
    local = np.arange(T, dtype=np.int64) - starts[token_row]
    positions = ctx[token_row] + local

    # --- conv windows over the extended stream [P*(K-1) saved inputs | Tp new tokens] ---------
    def ext_index(row: np.ndarray, u: np.ndarray) -> np.ndarray:  # u = virtual offset in row
        return np.where(u < K1, row * K1 + u, P * K1 + starts[row] + u - K1)

    prow = token_row[:Tp]
    conv_window_idx = ext_index(prow[:, None], local[:Tp, None] + np.arange(conv_kernel)[None])
    prows = np.arange(P, dtype=np.int64)
    conv_state_idx = ext_index(prows[:, None], lens[:P, None] + np.arange(K1)[None])

    # --- SSD chunk plan ---------------------------------------------------------------------
    chunk_rows: list[list[int]] = []
    chunk_tokens: list[np.ndarray] = []
    for r in range(P):
        ids = []
        for a, b in _row_chunks(int(ctx[r]), int(lens[r]), chunk_size):
            ids.append(len(chunk_tokens))
            chunk_tokens.append(np.arange(starts[r] + a, starts[r] + b))
        chunk_rows.append(ids)
    C = len(chunk_tokens)
    chunk_token_idx = np.full((C, chunk_size), Tp, dtype=np.int64)
    token_chunk_pos = np.zeros(Tp, dtype=np.int64)
    for c, toks in enumerate(chunk_tokens):
        chunk_token_idx[c, : len(toks)] = toks
        token_chunk_pos[toks] = c * chunk_size + np.arange(len(toks))
    max_cpr = max((len(c) for c in chunk_rows), default=0)
    row_chunks = np.full((P, max_cpr), C, dtype=np.int64)
    for r, ids in enumerate(chunk_rows):
        row_chunks[r, : len(ids)] = ids
    row_num_chunks = np.array([len(c) for c in chunk_rows], dtype=np.int64)

    # --- attention pages ----------------------------------------------------------------------
    max_pages = max(1, max(len(r.pages) for r in rows))
    page_table = np.full((R, max_pages), scratch_page, dtype=np.int64)
    for i, r in enumerate(rows):
        page_table[i, : len(r.pages)] = r.pages
    slot_mapping = page_table[token_row, positions // page_size] * page_size + positions % page_size
    max_kv_len = int((ctx + lens).max())

    logits_idx = np.array([starts[i] + p for i, r in enumerate(rows) for p in r.logits_positions],
                          dtype=np.int64)

    # --- prefix-cache snapshots -----------------------------------------------------------------
    snap_chunk, snap_conv, snap_dst = [], [], []
    for r in range(P):
        row = plan.prefills[r]
        for pos, dst in row.snapshots:
            local_end = pos - int(ctx[r])
            ends = [int(starts[r]) + b for b in (e for _, e in
                    _row_chunks(int(ctx[r]), int(lens[r]), chunk_size))]
            if not 0 < local_end <= lens[r] or int(starts[r]) + local_end not in ends:
                raise ValueError(f"snapshot position {pos} is not a chunk end of its row")
            snap_chunk.append(chunk_rows[r][ends.index(int(starts[r]) + local_end)])
            snap_conv.append(ext_index(np.int64(r), local_end + np.arange(K1)))
            snap_dst.append(dst)
    decode_snap_dst = []
    for row in plan.decodes:
        if len(row.snapshots) > 1 or any(p != row.context_len + 1 for p, _ in row.snapshots):
            raise ValueError("a decode row snapshots at most the position after its token")
        decode_snap_dst.append(row.snapshots[0][1] if row.snapshots else -1)
    restores = [(r.restore_from, r.state_slot) for r in rows if r.restore_from >= 0]

    parts = {
        "input_ids": input_ids, "positions": positions, "token_row": token_row,
        "state_slots": np.array([r.state_slot for r in rows], dtype=np.int64),
        "has_initial_state": np.array([r.has_initial_state for r in plan.prefills], dtype=np.int64),
        "conv_window_idx": conv_window_idx, "conv_state_idx": conv_state_idx,
        "chunk_token_idx": chunk_token_idx, "token_chunk_pos": token_chunk_pos,
        "row_chunks": row_chunks, "row_num_chunks": row_num_chunks,
        "page_table": page_table, "slot_mapping": slot_mapping, "logits_idx": logits_idx,
        "snap_chunk": np.array(snap_chunk, dtype=np.int64),
        "snap_conv_idx": np.array(snap_conv, dtype=np.int64).reshape(len(snap_conv), K1),
        "snap_dst": np.array(snap_dst, dtype=np.int64),
        "decode_snap_dst": np.array(decode_snap_dst, dtype=np.int64),
        "cow_src": np.array([s for s, _ in restores], dtype=np.int64),
        "cow_dst": np.array([d for _, d in restores], dtype=np.int64),
    }
    extra = extra or {}
    tensors = _upload({**parts, **{f"extra.{k}": v for k, v in extra.items()}}, device)
    tensors["has_initial_state"] = tensors["has_initial_state"] > 0
    tensors["extra"] = {k: tensors.pop(f"extra.{k}") for k in extra}
    return ForwardMetadata(
        num_prefills=P, num_prefill_tokens=Tp, num_decodes=len(plan.decodes), num_tokens=T,
        num_chunks=C, max_kv_len=max_kv_len, num_logits=len(logits_idx),
        num_prefill_snapshots=len(snap_dst),
        num_decode_snapshots=sum(1 for d in decode_snap_dst if d >= 0),
        num_restores=len(restores), **tensors)


def _upload(parts: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Pack every array into one int64 buffer, copy it to the device once, return shaped views."""
    flat = np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in parts.values()])
    host = torch.from_numpy(flat)
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
        buf = host.to(device, non_blocking=True)
    else:
        buf = host
    out, offset = {}, 0
    for name, a in parts.items():
        out[name] = buf[offset: offset + a.size].view(a.shape)
        offset += a.size
    return out
