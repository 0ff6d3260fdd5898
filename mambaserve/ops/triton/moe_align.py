"""The block layout of the routed (token, expert) pairs for the sparse MoE GEMMs
(`moe_experts.py`): the T*k pairs sorted by expert (stable: pair order within an expert) and laid
out in blocks of `block_m` rows, each expert's run padded to a multiple of `block_m`; padding
rows hold the sentinel T*k. The layout's length is the host-known bound
P_pad = round_up(T*k + min(E, T*k) * (block_m - 1), block_m), so the grids depend on T only
(CUDA-graph friendly); `block_expert[b]` is block b's expert, or -1 for blocks past the used
ones. No host sync.

- Up to `ALIGN_KERNEL_MAX_PAIRS` pairs (decode, small prefills): one launch (`_align_kernel`, a
  program per expert, each scanning every pair).
- Above: a stable counting sort in three launches over chunks of `ALIGN_CHUNK` pairs
  (`_chunk_counts_kernel`: each chunk's pairs per expert; `_chunk_offsets_kernel`, a program
  per expert: its padded start, each chunk's first row for it, its padding rows and blocks;
  `_chunk_scatter_kernel`: each pair to its row).
- `align_pairs_torch`: the same layout by torch sort / scan ops, the reference of the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the mean pairs per expert: small blocks waste little padding when few
    tokens reach each expert (decode), large ones reuse each weight tile over more rows."""
    per_expert = num_pairs / num_experts
    for block_m in (16, 32, 64):
        if per_expert <= block_m:
            return block_m
    return 128


def padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The host-known length of the block layout (see the module docstring)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


ALIGN_KERNEL_MAX_PAIRS = 8192
ALIGN_CHUNK = 1024  # pairs per program of the three-launch layout


def align_pairs(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P_pad] int32: pair index t*k+j per row, sentinel T*k on padding rows (rows
    of blocks past the used ones are left unset: no kernel reads them); block_expert
    [P_pad / block_m] int32: the expert of each block, -1 past the used blocks). Fixed shapes
    and device ops only: no host sync."""
    num_pairs = topk_ids.numel()
    total = padded_pairs(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    sorted_pairs = torch.empty(total, dtype=torch.int32, device=dev)
    block_expert = torch.empty(total // block_m, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    if num_pairs <= ALIGN_KERNEL_MAX_PAIRS:
        _align_kernel[(num_experts,)](
            ids, sorted_pairs, block_expert, num_pairs, total // block_m,
            BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=256, num_warps=4)
        return sorted_pairs, block_expert
    chunks = triton.cdiv(num_pairs, ALIGN_CHUNK)
    counts = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
    offsets = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
    # pairs per step: a [sub, BLOCK_E] match matrix; powers of two, so sub divides the chunk
    sub = min(ALIGN_CHUNK, max(16, min(64, 8192 // block_e)))
    _chunk_counts_kernel[(chunks,)](ids, counts, num_pairs, BLOCK_E=block_e, CHUNK=ALIGN_CHUNK,
                                    SUB=sub, num_warps=4)
    _chunk_offsets_kernel[(num_experts,)](
        counts, offsets, sorted_pairs, block_expert, num_pairs, chunks, total // block_m,
        BLOCK_E=block_e, BLOCK_C=64, BLOCK_M=block_m, num_warps=4)
    _chunk_scatter_kernel[(chunks,)](ids, offsets, sorted_pairs, num_pairs, BLOCK_E=block_e,
                                     CHUNK=ALIGN_CHUNK, SUB=sub, num_warps=4)
    return sorted_pairs, block_expert


@triton.jit
def _write_blocks(sorted_ptr, block_expert_ptr, e, start, count, end, used, num_pairs,
                  num_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Expert e's run is rows [start, end) with `count` pairs: the sentinel on its padding rows,
    e on its blocks; expert 0 also marks the blocks from `used` on -1."""
    pad_rows = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + pad_rows, tl.full((BLOCK_M,), 0, tl.int32) + num_pairs,
             mask=pad_rows < end)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + blocks, tl.full((CHUNK,), 0, tl.int32) + e,
                 mask=blocks < end // BLOCK_M)
    if e == 0:
        for b0 in range(used, num_blocks, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + blocks, tl.full((CHUNK,), -1, tl.int32),
                     mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_blocks,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program e: every expert's pair count (so its padded start), then its own pairs in pair
    order, its padding rows, its blocks' expert ids; program 0 also marks the unused blocks."""
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    end = start + tl.sum(tl.where(experts == e, padded, 0), axis=0)
    done = 0
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        mine = (ids == e).to(tl.int32)
        dest = start + done + tl.cumsum(mine, axis=0) - 1
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=mine != 0)
        done += tl.sum(mine, axis=0)
    _write_blocks(sorted_ptr, block_expert_ptr, e, start, count, end,
                  tl.sum(padded, axis=0) // BLOCK_M, num_pairs, num_blocks, BLOCK_M, CHUNK)


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_counts_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK_E: tl.constexpr,
                         CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Program c: how many of chunk c's pairs each expert has, counts[c, :]."""
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * BLOCK_E + experts, counts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_blocks"])
def _chunk_offsets_kernel(counts_ptr, offsets_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                          num_chunks, num_blocks, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_M: tl.constexpr):
    """Program e: every expert's total (so e's padded start), the row of e's first pair in each
    chunk, offsets[c, e] (its start plus e's pairs in the chunks before), its padding rows and
    blocks (and, program 0, the unused blocks)."""
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    chunks = tl.arange(0, BLOCK_C)
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cc = c0 + chunks
        tile = tl.load(counts_ptr + cc[:, None] * BLOCK_E + experts[None, :],
                       mask=(cc < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == e, totals, 0), axis=0)
    end = start + tl.sum(tl.where(experts == e, padded, 0), axis=0)
    run = start
    for c0 in range(0, num_chunks, BLOCK_C):
        cc = c0 + chunks
        col = tl.load(counts_ptr + cc * BLOCK_E + e, mask=cc < num_chunks, other=0)
        tl.store(offsets_ptr + cc * BLOCK_E + e, run + tl.cumsum(col, axis=0) - col,
                 mask=cc < num_chunks)
        run += tl.sum(col, axis=0)
    _write_blocks(sorted_ptr, block_expert_ptr, e, start, count, end,
                  tl.sum(padded, axis=0) // BLOCK_M, num_pairs, num_blocks, BLOCK_M, 256)


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_scatter_kernel(ids_ptr, offsets_ptr, sorted_ptr, num_pairs, BLOCK_E: tl.constexpr,
                          CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Program c: each of chunk c's pairs to its row, offsets[c, e] plus the pairs of expert e
    before it in the chunk (in pair order: the sort is stable)."""
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    base = tl.load(offsets_ptr + c * BLOCK_E + experts)
    for s0 in range(0, CHUNK, SUB):
        offs = c * CHUNK + s0 + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        match = (ids[:, None] == experts[None, :]).to(tl.int32)
        rows = tl.where(match != 0, tl.cumsum(match, axis=0) - 1 + base[None, :], 0)
        tl.store(sorted_ptr + tl.sum(rows, axis=1), offs.to(tl.int32), mask=offs < num_pairs)
        base += tl.sum(match, axis=0)


def align_pairs_torch(topk_ids: torch.Tensor, num_experts: int,
                      block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` in torch ops (every row of sorted_pairs set)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - count_start[expert_of]
    total = padded_pairs(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((total,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[pad_start[expert_of] + rank] = order.to(torch.int32)
    block_first_row = torch.arange(0, total, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert
