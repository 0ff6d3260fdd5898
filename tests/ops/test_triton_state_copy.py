"""Triton row copy (prefix-cache restores) vs. the reference (CPU interpreter without CUDA;
compiled with it): destinations get the rows' states bit for bit (cast to the pool's dtype),
entries without a destination (and padding with source -1) touch nothing, not even the scratch
slot. (Snapshots are written by the prefill scan, the conv step and the state update: their
tests.)"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, decide_as_cuda, require_interpreter  # before anything imports triton

from mambaserve.ops import state_snapshot
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.state_copy import _copy_rows_kernel, copy_rows_triton

require_interpreter(_copy_rows_kernel)

SRC = [3, 0, 5, -1, 2, 1]  # source rows; -1 = padding
DST = [7, -1, 6, -1, -1, 8]  # destination slots; -1 = none


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("block", [16, 64, 4096])
def test_copy_slots_matches_reference_on_real_slots(dtype, block):
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(10, 3, 7, generator=gen).to(DEV, dtype)  # 21 elements: partial blocks
    src = torch.tensor(SRC, dtype=torch.int32, device=DEV)
    dst = torch.tensor(DST, dtype=torch.int64, device=DEV)
    before = pool.clone()
    with tuning.override("state_copy", block=block, num_warps=2):
        copy_rows_triton(pool, src, pool, dst)
    expect = before.clone()
    for s, d in zip(SRC, DST):
        if s >= 0 and d >= 0:
            expect[d] = before[s]
    assert torch.equal(pool, expect)  # every other slot, scratch included, untouched


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_copy_rows_between_tensors_casts_and_skips(pool_dtype):
    """Rows of one tensor (float32) -> pool slots of another, cast; -1 destinations (a prefill
    graph's padding entries) move nothing."""
    gen = torch.Generator().manual_seed(4)
    states = torch.randn(5, 2, 3, 4, generator=gen).to(DEV)  # [chunks, H, P, N]
    pool = torch.randn(9, 2, 3, 4, generator=gen).to(DEV, pool_dtype)
    chunk = torch.tensor([0, 3, 0, 4], dtype=torch.int64, device=DEV)
    dst = torch.tensor([6, -1, -1, 2], dtype=torch.int64, device=DEV)
    before = pool.clone()
    with tuning.override("state_copy", block=16, num_warps=2):
        copy_rows_triton(states, chunk, pool, dst)
    expect = before.clone()
    expect[6], expect[2] = states[0].to(pool_dtype), states[4].to(pool_dtype)
    assert torch.equal(pool, expect)


def test_bad_pool_and_block_rejected():
    pool = torch.zeros(4, 3, 5, device=DEV)[:, :, :2]  # slots not contiguous
    idx = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(AssertionError, match="contiguous"):
        copy_rows_triton(pool, idx, pool, idx)
    with pytest.raises(AssertionError, match="power of two"):
        with tuning.override("state_copy", block=48):
            pool = torch.zeros(4, 8, device=DEV)
            copy_rows_triton(pool, idx, pool, idx)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_restore_snapshots_through_the_kernel(monkeypatch, pool_dtype):
    """Prefix-cache restores: every layer's snapshot slot copied into the live slot, as the
    reference does, bit for bit; no other slot (the sources included) changes."""
    decided = decide_as_cuda(monkeypatch, state_snapshot)
    gen = torch.Generator().manual_seed(7)
    conv = torch.randn(3, 9, 2, 11, generator=gen).to(DEV, pool_dtype)  # L=3, 8 slots + scratch
    ssm = torch.randn(3, 9, 2, 3, 5, generator=gen).to(DEV)
    src, dst = torch.tensor([6, 1], device=DEV), torch.tensor([0, 4], device=DEV)
    c_ref, s_ref = conv.clone(), ssm.clone()
    state_snapshot.restore_snapshots(conv, ssm, src, dst)
    state_snapshot.restore_snapshots_ref(c_ref, s_ref, src, dst)
    assert torch.equal(conv, c_ref) and torch.equal(ssm, s_ref)
    assert torch.equal(ssm[:, 0], ssm[:, 6]) and torch.equal(conv[:, 4], conv[:, 1])
    assert DEV == "cuda" or decided == ["triton"]
    strided = torch.zeros(3, 9, 11, 2).transpose(2, 3)
    assert kernel_path("restore_snapshots", "cuda", conv_state=strided,
                       ssm_state=ssm) == "reference"


def test_copy_rows_over_layers_skips_entries_without_a_destination():
    """`layers`: entry r copies row l * layer_rows + src[r] to l * layer_rows + dst[r] in every
    layer l; an entry of -1 moves nothing in any layer."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(4 * 5, 7, generator=gen).to(DEV)  # 4 layers x 5 rows
    src, dst = torch.tensor([3, 2, 0], device=DEV), torch.tensor([1, -1, 4], device=DEV)
    want = pool.clone().view(4, 5, 7)
    for s_, d_ in ((3, 1), (0, 4)):
        want[:, d_] = want[:, s_].clone()
    copy_rows_triton(pool, src, pool, dst, layers=4, layer_rows=5)
    assert torch.equal(pool.view(4, 5, 7), want)
