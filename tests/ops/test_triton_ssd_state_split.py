"""The SSD scan's launch S in two launches (mambaserve/ops/triton/ssd_state_split.py) against the
one-launch state passing, bit for bit, and against the reference (CPU interpreter without CUDA;
with it the same cases on the GPU and the 9B shapes in bf16)."""

from __future__ import annotations

import pytest
import test_triton_ssd as one_launch
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.ssd_state_split import _state_chain_kernel

require_interpreter(_state_chain_kernel)

SPLIT = {"state_split_chunks": 1}  # from rows of one chunk: always


def _both(rows, **kw):
    """(split, one-launch, reference) results of one batch (`test_triton_ssd._run`)."""
    split, ref, st0 = one_launch._run(rows, **kw, **SPLIT)
    fused, _, _ = one_launch._run(rows, **kw, state_split_chunks=0)
    return split, fused, ref, st0


def _same(split, fused):
    """y, the snapshots and the pool: the two layouts' bits (the same dot and multiply-add per
    element; on a GPU within an ulp of the state, which may move y by one of its own)."""
    for a, b in zip(split, fused):
        if DEV == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "none"])
def test_split_state_fp32_ragged(snapshots):
    split, fused, ref, st0 = _both(one_launch.ROWS, H=3, P=8, N=16, G=1, chunk_size=16,
                                   dtype=torch.float32, seed=1, snapshots=snapshots)
    _same(split, fused)
    one_launch._close(split, ref, st0, one_launch.F32_TOL)


@pytest.mark.parametrize("knobs", [
    {"block_p_state": 16, "block_p2_state": 16, "prefetch_state": True},
    {"block_p_state": 16, "block_p2_state": 0, "block_n_state": 16},
    {"block_l_state": 16, "block_state_chain": 64, "num_warps_chain": 2}],
    ids=["second_tile_prefetch", "tiles", "token_blocks_small_chain"])
def test_split_state_fp16_layouts(knobs):
    """The state tiles the local launch shares with the one-launch kernel: a second row tile,
    several P and N tiles, token blocks below the chunk (against the one-launch kernel's whole
    chunk in one dot with the prefetch); chain blocks smaller than a head's state."""
    rows = [(70, 0, 0, False), (45, 9, 1, True), (33, 64, 2, True)]
    split, fused, ref, st0 = _both(rows, H=2, P=24, N=32, G=2, chunk_size=32,
                                   dtype=torch.float16, seed=5, strided=True, **knobs)
    _same(split, fused)
    one_launch._close(split, ref, st0, 2e-2)


@pytest.mark.parametrize("how", ["permute", "shuffle"])
def test_split_state_fp32_permuted_and_gathered(how):
    kw = {"permute": True} if how == "permute" else {"shuffle": True, "contiguous_chunks": False}
    split, fused, ref, st0 = _both(one_launch.ROWS, H=2, P=8, N=8, G=2, chunk_size=16,
                                   dtype=torch.float32, seed=2, **kw)
    _same(split, fused)
    one_launch._close(split, ref, st0, one_launch.F32_TOL)


@pytest.mark.parametrize("start,n", [(0, 40), (13, 20)], ids=["fresh", "follow_up"])
def test_split_state_bucket_with_empty_padding_rows(start, n):
    """A lone row in a prefill graph's bucket: the chain skips the empty padding rows' chunks
    and leaves the scratch slot alone (test_triton_ssd's checks, launch S in two)."""
    with tuning.override("ssd", **SPLIT):
        one_launch.test_ssd_fp32_bucket_with_empty_padding_rows(start, n, False)


def test_split_rule():
    """`state_split_chunks`: two launches when the step's longest row (row_chunks' width) has
    that many chunks or more; 0 never."""
    from mambaserve.ops.triton.ssd import SsdScan

    meta = one_launch._meta([(40, 0, 0, False), (10, 0, 1, False)], 16)  # 3 + 1 chunks
    pf = meta.prefill
    x, dt, A, B, C, D, dtb, st = one_launch._inputs(meta.num_prefill_tokens, 2, 8, 8, 1, 3,
                                                    torch.float32, torch.Generator(), False)
    args = (x, dt, A, B, C, D, dtb, (0.0, float("inf")), st, pf.state_slots.to(torch.int32),
            pf.has_initial_state, pf.chunk_token_idx, pf.token_chunk_pos, pf.row_chunks,
            pf.row_num_chunks)
    assert meta.prefill.row_chunks.shape[1] == 3
    for chunks, want in ((0, False), (3, True), (4, False)):
        with tuning.override("ssd", state_split_chunks=chunks):
            scan = SsdScan(*args)
        assert scan.split_state is want and (scan.loc is not None) is want, chunks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", ["8x512", "4x2048ish", "1x8192"])
def test_split_state_nemotron9b_bf16_gpu(rows):
    split, fused, ref, st0 = _both(one_launch.NEMO_ROWS[rows], H=128, P=80, N=128, G=8,
                                   chunk_size=128, dtype=torch.bfloat16, strided=True, seed=3)
    # the end states and the pool to the float32 ulp, y within one of its own
    torch.testing.assert_close(split[1], fused[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(split[2], fused[2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(split[0].float(), fused[0].float(), rtol=1e-2, atol=1e-2)
    for a, b in zip(split[:2] + (split[2][:-1],), ref[:2] + (ref[2][:-1],)):
        assert one_launch._rel(a, b) < 1e-2, one_launch._rel(a, b)
    torch.testing.assert_close(split[2][-1], st0[-1])


SPLIT_SM90_SCRIPT = r'''
import json
from mambaserve.ops.triton.ssd_state_split import _chunk_local_state_kernel, _state_chain_kernel
ptrs = {"x_ptr": "*bf16", "B_ptr": "*bf16", "cti_ptr": "*i64", "dtc_ptr": "*fp32",
        "cum_ptr": "*fp32", "clen_ptr": "*i32", "loc_ptr": "*fp32", "st_ptr": "*bf16",
        "src_ptr": "*i64", "ssm_ptr": "*fp32", "slot_ptr": "*i32", "init_ptr": "*i1",
        "row_chunks_ptr": "*i64", "nchunks_ptr": "*i64", "snap_ptr": "*i64"}
div = ("x_t", "x_h", "B_t", "B_g", "cti_c", "s_slot", "s_h", "s_p", "H", "P", "N", "PN",
       "heads_per_group")
report = {}
for name, k, const, warps in (
        ("local", _chunk_local_state_kernel,
         {"L": 128, "BLOCK_P": 64, "BLOCK_P2": 16, "BLOCK_N": 64, "BLOCK_L": 128, "IP": "tf32",
          "CONTIG": 1, "x_p": 1, "B_n": 1}, 4),
        ("chain", _state_chain_kernel, {"L": 128, "BLOCK": 1024, "SNAPS": 1, "s_n": 1}, 4)):
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in k.arg_names}
    ptx, spills = sm90(k, sig, const, div, warps, 1)
    report[name] = {"spill_bytes": spills, "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                    "mma": len(re.findall(r"mma\.sync", ptx))}
print(json.dumps(report))
'''


def test_split_launches_compile_for_sm90():
    """Offline compile for a Hopper at the 9B shapes and default launch parameters: neither
    launch spills, and the local launch's dots run on tensor cores."""
    from offline_ptx import SM90, compile_report, skip_without_triton

    skip_without_triton()
    r = compile_report(SM90 + SPLIT_SM90_SCRIPT, "launch S in two")
    assert r["local"]["spill_bytes"] == 0 and r["chain"]["spill_bytes"] == 0, r
    assert r["local"]["wgmma"] + r["local"]["mma"] > 0, r
