"""Triton prefill conv snapshots vs. the reference (CPU interpreter without CUDA; compiled with
it), over metadata planned from real prefill rows: every destination slot gets the reference's
bits (saved inputs of rows with an initial state, zeros without one, the scratch slot's inputs
for a row of slot -1, new tokens; cast through x's dtype into the pool's), entries without a
destination (a prefill graph's padding) and slots without a snapshot are left alone, scratch
slot included."""

from __future__ import annotations

import pytest
import torch
from offline_ptx import compile_report
from triton_env import DEV, decide_as_cuda, require_interpreter  # before anything imports triton

from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.ops import state_snapshot
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.state_snapshot import (
    save_prefill_conv_snapshots,
    save_prefill_conv_snapshots_ref,
)
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.conv_snapshot import (
    _conv_snapshot_kernel,
    save_prefill_conv_snapshots_triton,
)

require_interpreter(_conv_snapshot_kernel)

L, K, PS = 4, 4, 4  # chunk size, conv width, page size
NUM_SLOTS = 20  # + the scratch slot (index NUM_SLOTS)
LIVE = [2, 0, -1, 1, 3]  # the prefill rows' state slots


def _rows() -> list[Row]:
    """Snapshot windows over all cases: early positions reach into the row's saved inputs."""
    first_page = [0]

    def row(n, ctx, slot, init, snaps):
        num_pages = -(-(ctx + n) // PS)
        pages = list(range(first_page[0], first_page[0] + num_pages))
        first_page[0] += num_pages
        return Row.standalone(list(range(3, 3 + n)), ctx, slot, init, pages, snapshots=snaps)

    return [
        row(6, 0, LIVE[0], False, [(4, 10), (6, 11)]),  # fresh: tokens only
        row(5, 2, LIVE[1], True, [(4, 12), (7, 13)]),  # saved input 2, then tokens
        row(1, 3, LIVE[2], True, [(4, 14)]),  # slot -1: the scratch slot's inputs 1, 2
        row(2, 5, LIVE[3], True, []),  # no snapshot
        row(2, 0, LIVE[4], False, [(2, 15)]),  # fresh: a zero, then its tokens
    ]


def _setup(x_dtype, pool_dtype, conv_dim, pad, gen):
    meta = build_metadata(Batch(_rows(), []), chunk_size=L, conv_kernel=K, page_size=PS,
                          scratch_page=99, device=DEV)
    pf = meta.prefill
    assert pf.num_snapshots == 6 and bool(pf.has_initial_state[1])
    assert (pf.snap_conv_idx < pf.num_rows * (K - 1)).any()  # some windows reach saved inputs
    # a prefill graph's padding entries: destination -1, any index
    idx = torch.cat([pf.snap_conv_idx, torch.randint(0, pf.num_tokens, (pad, K - 1),
                                                      generator=gen).to(DEV)])
    dst = torch.cat([pf.snap_dst, torch.full((pad,), -1, dtype=torch.int64, device=DEV)])
    # x: a column slice of a wider projection output (row stride != conv_dim)
    wide = torch.randn(pf.num_tokens, conv_dim + 11, generator=gen).to(DEV, x_dtype)
    x = wide[:, 5:5 + conv_dim]
    pool = torch.randn(NUM_SLOTS + 1, K - 1, conv_dim, generator=gen).to(DEV, pool_dtype)
    pool[LIVE[0]] = float("nan")  # a fresh row's reused slot: must read as zeros
    return x, pool, pf, idx, dst


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view (NaN-safe exact comparison)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16),
          (torch.float16, torch.float32), (torch.float32, torch.float16)]
if DEV == "cuda":
    DTYPES += [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("x_dtype,pool_dtype", DTYPES)
@pytest.mark.parametrize("conv_dim,block_d", [(40, 16), (40, 256), (16, 16)])
def test_matches_reference_on_every_real_slot(x_dtype, pool_dtype, conv_dim, block_d):
    gen = torch.Generator().manual_seed(conv_dim + block_d)
    x, pool, pf, idx, dst = _setup(x_dtype, pool_dtype, conv_dim, pad=5, gen=gen)
    before = pool.clone()
    ref = pool.clone()
    save_prefill_conv_snapshots_ref(x, ref, pf.state_slots, pf.has_initial_state, idx, dst)
    with tuning.override("conv_snapshot", block_d=block_d, num_warps=2):
        save_prefill_conv_snapshots_triton(x, pool, pf.state_slots, pf.has_initial_state, idx,
                                           dst)
    # the reference also wrote the padding entries into the scratch slot; the kernel did not
    assert torch.equal(_bits(pool[:-1]), _bits(ref[:-1]))
    assert torch.equal(_bits(pool[-1]), _bits(before[-1]))
    written = set(pf.snap_dst.tolist())
    assert written == {10, 11, 12, 13, 14, 15}
    for s in range(NUM_SLOTS + 1):
        if s not in written:
            assert torch.equal(_bits(pool[s]), _bits(before[s])), s


def test_windows_hold_the_expected_inputs():
    """Independent of the reference: the windows spelled out per row."""
    gen = torch.Generator().manual_seed(7)
    x, pool, pf, idx, dst = _setup(torch.float32, torch.float32, 24, pad=2, gen=gen)
    before = pool.clone()
    save_prefill_conv_snapshots_triton(x, pool, pf.state_slots, pf.has_initial_state, idx, dst)
    z = torch.zeros(24, device=DEV)
    x0, x1, x2, x4 = 0, 6, 11, 14  # first token of rows 0, 1, 2, 4
    expect = {
        10: [x[x0 + 1], x[x0 + 2], x[x0 + 3]],  # row 0 at 4
        11: [x[x0 + 3], x[x0 + 4], x[x0 + 5]],  # row 0 at 6 (its end)
        12: [before[LIVE[1], 2], x[x1], x[x1 + 1]],  # row 1 (context 2) at 4
        13: [x[x1 + 2], x[x1 + 3], x[x1 + 4]],  # row 1 at 7 (its end)
        14: [before[NUM_SLOTS, 1], before[NUM_SLOTS, 2], x[x2]],  # row 2, slot -1
        15: [z, x[x4], x[x4 + 1]],  # row 4 (fresh) at 2 (its end)
    }
    for slot, rows in expect.items():
        assert torch.equal(pool[slot], torch.stack(rows)), slot


def test_no_entries_is_a_no_op():
    gen = torch.Generator().manual_seed(3)
    x, pool, pf, idx, dst = _setup(torch.float32, torch.float32, 40, pad=0, gen=gen)
    before = pool.clone()
    save_prefill_conv_snapshots_triton(x, pool, pf.state_slots, pf.has_initial_state, idx[:0],
                                       dst[:0])
    assert torch.equal(_bits(pool), _bits(before))
    # only padding: nothing moves either
    save_prefill_conv_snapshots_triton(x, pool, pf.state_slots, pf.has_initial_state, idx,
                                       torch.full_like(dst, -1))
    assert torch.equal(_bits(pool), _bits(before))


def test_dispatch_through_the_public_op(monkeypatch):
    decided = decide_as_cuda(monkeypatch, state_snapshot)
    gen = torch.Generator().manual_seed(5)
    x, pool, pf, idx, dst = _setup(torch.float16, torch.float16, 40, pad=3, gen=gen)
    ref = pool.clone()
    save_prefill_conv_snapshots(x, pool, pf.state_slots, pf.has_initial_state, idx, dst)
    save_prefill_conv_snapshots_ref(x, ref, pf.state_slots, pf.has_initial_state, idx, dst)
    assert torch.equal(_bits(pool[:-1]), _bits(ref[:-1]))
    assert DEV == "cuda" or decided == ["triton"]


def test_dispatch_condition_and_cpu_reference():
    conv = torch.zeros(3, 2, 8)
    if kernel_path("causal_conv1d_update", "cuda") == "triton":  # Triton installed
        assert kernel_path("save_prefill_conv_snapshots", "cuda", x=torch.zeros(1, 8),
                           conv_state=conv) == "triton"
        assert kernel_path("save_prefill_conv_snapshots", "cuda",
                           x=torch.zeros(1, 8, dtype=torch.float64),
                           conv_state=conv) == "reference"
    # on the CPU the public op is the reference (padding entries land in the scratch slot)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(4, 2, 8, generator=gen)
    x = torch.randn(3, 8, generator=gen)
    slots, init = torch.tensor([1], dtype=torch.int32), torch.tensor([True])
    idx, dst = torch.tensor([[1, 2], [0, 0]]), torch.tensor([2, -1])
    a = pool.clone()
    save_prefill_conv_snapshots(x, pool, slots, init, idx, dst)
    save_prefill_conv_snapshots_ref(x, a, slots, init, idx, dst)
    assert torch.equal(pool, a)
    assert torch.equal(pool[2], torch.stack([a[1, 1], x[0]]))


def test_bad_block_rejected():
    gen = torch.Generator().manual_seed(4)
    x, pool, pf, idx, dst = _setup(torch.float32, torch.float32, 40, pad=0, gen=gen)
    with pytest.raises(AssertionError, match="power of two"):
        with tuning.override("conv_snapshot", block_d=48):
            save_prefill_conv_snapshots_triton(x, pool, pf.state_slots, pf.has_initial_state,
                                               idx, dst)


SM90_SCRIPT = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mambaserve.ops.triton.conv_snapshot import _conv_snapshot_kernel as k
ptrs = {"x_ptr": "*bf16", "state_ptr": "*bf16", "slot_ptr": "*i32", "init_ptr": "*i1",
        "idx_ptr": "*i64", "dst_ptr": "*i64"}
report = {}
for pdl in (0, 1):
    const = {"K1": 3, "BLOCK_D": 256, "PDL": pdl, "x_d": 1, "s_d": 1}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in k.arg_names}
    # as launched: pointers and the pool's / projection's sizes multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names)
             if n.endswith("_ptr") or n in ("Dm", "x_t", "s_slot", "s_k")}
    ptx = triton.compile(ASTSource(k, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "launch_pdl": bool(pdl)}).asm["ptx"]
    report[pdl] = {"griddep": len(re.findall(r"griddepcontrol", ptx)),
                   "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx)))}
print(json.dumps(report))
'''


def test_compiles_for_sm90_with_and_without_pdl():
    """Offline compile for a Hopper (no GPU needed): PDL adds the grid-dependency wait and
    launch; the stores write two bf16 channels per thread at once."""
    report = compile_report(SM90_SCRIPT, "the conv snapshot kernel")
    assert report["0"]["griddep"] == 0 and report["1"]["griddep"] == 2
    assert report["0"]["stores"] == report["1"]["stores"] == ["st.global.b32"]
