"""The block layout of the routed pairs (`ops/triton/moe_align.py`) against its torch version:
the one-launch kernel (up to ALIGN_KERNEL_MAX_PAIRS pairs) and the three-launch chunked one
above it (CPU interpreter without CUDA; compiled with it)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.triton import moe_align
from mambaserve.ops.triton.moe_align import _align_kernel, align_pairs, align_pairs_torch

require_interpreter(_align_kernel)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("T,E,k", [(1, 128, 6), (3, 4, 4), (64, 8, 2), (120, 72, 10),
                                   (33, 16, 1), (2, 256, 8)])
def test_align_kernel_gives_the_torch_layout(T, E, k, block_m):
    g = torch.Generator().manual_seed(T + E)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    if T >= 3:
        ids[: T // 2, 0] = 1
    ids = ids.to(DEV)
    want_rows, want_blocks = align_pairs_torch(ids, E, block_m)
    got_rows, got_blocks = align_pairs(ids, E, block_m)
    assert torch.equal(got_blocks, want_blocks)
    used = (want_blocks >= 0).sum().item() * block_m  # rows past the used blocks are not set
    assert torch.equal(got_rows[:used], want_rows[:used])


@pytest.mark.parametrize("chunk", [16, 128])
@pytest.mark.parametrize("block_m", [16, 128])
@pytest.mark.parametrize("T,E,k", [(500, 72, 3), (90, 8, 2), (41, 128, 6)])
def test_chunked_layout_gives_the_torch_layout(monkeypatch, T, E, k, block_m, chunk):
    """The three-launch layout (above ALIGN_KERNEL_MAX_PAIRS pairs; forced here, with chunks
    small enough that there are more of them than one step of the offsets' loop) is the torch
    layout: stable, the same padding and block experts, a pile-up on one expert included."""
    monkeypatch.setattr(moe_align, "ALIGN_KERNEL_MAX_PAIRS", 0)
    monkeypatch.setattr(moe_align, "ALIGN_CHUNK", chunk)
    g = torch.Generator().manual_seed(T + E + k)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    ids[: T // 3, 0] = 1
    ids = ids.to(DEV)
    want_rows, want_blocks = align_pairs_torch(ids, E, block_m)
    got_rows, got_blocks = align_pairs(ids, E, block_m)
    assert torch.equal(got_blocks, want_blocks)
    used = (want_blocks >= 0).sum().item() * block_m
    assert torch.equal(got_rows[:used], want_rows[:used])
