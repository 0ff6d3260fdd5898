"""Triton ssd_chunk_scan_varlen vs. the reference, on ragged batches built by build_metadata.

Without CUDA the kernels run under Triton's CPU interpreter (float32 / float16, small shapes);
float32 inputs use IEEE dots, so the tolerance is float32's. With CUDA the same cases run on the
GPU, plus Nemotron-Nano-9B-v2 layer shapes in bf16 (relative-norm error < 1e-2, no NaN), with
the default and a few other tuning knobs. The small cases cover several row tiles / source blocks /
CB tiles per chunk through the launcher's knobs, N and P split over blocks, one group and one group
per head, shuffled chunk ids, a token stream in shuffled order (gathering path) and a fresh row.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.ops.ssd import ssd_chunk_scan_varlen_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.ssd import ssd_chunk_scan_varlen_triton
from mambaserve.ops.triton.ssd_kernels import _chunk_scan_kernel

require_interpreter(_chunk_scan_kernel)


# float32: the interpreter's exp is numpy's; compiled kernels use the GPU's approximate exp, which
# moves an occasional element by ~2e-5
F32_TOL = 1e-5 if DEV == "cpu" else 5e-5


def _meta(rows, chunk_size):
    """rows: list of (num_tokens, context_len, slot, has_initial_state)."""
    plan = Batch(
        prefills=[Row.standalone(token_ids=[1] * n, context_len=ctx, state_slot=slot,
                          has_initial_state=init, pages=[0]) for n, ctx, slot, init in rows],
        decodes=[])
    return build_metadata(plan, chunk_size=chunk_size, conv_kernel=4, page_size=1 << 20,
                          scratch_page=0, device=DEV)


def _inputs(T, H, P, N, G, num_slots, dtype, gen, strided):
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEV)

    if strided:  # like the mixer: x, B, C are split views of the conv output
        buf = rnd(T, H * P + 2 * G * N).to(dtype)
        x = buf[:, : H * P].view(T, H, P)
        B = buf[:, H * P: H * P + G * N].view(T, G, N)
        C = buf[:, H * P + G * N:].view(T, G, N)
        dt = rnd(T, H + 5, scale=1.5).to(dtype)[:, 2: 2 + H]
    else:
        x, B, C = rnd(T, H, P).to(dtype), rnd(T, G, N).to(dtype), rnd(T, G, N).to(dtype)
        dt = rnd(T, H, scale=1.5).to(dtype)
    A = -(torch.rand(H, generator=gen) * 2 + 0.05).to(DEV)
    D = rnd(H)
    dt_bias = rnd(H, scale=0.5) - 1.0
    ssm_state = rnd(num_slots + 1, H, P, N)
    return x, dt, A, B, C, D, dt_bias, ssm_state


def _permute_chunks(meta, seed):
    """The same plan with the chunk ids shuffled: kernels must not assume a row's chunks are
    consecutive (only the order inside `row_chunks` counts)."""
    nc, L = meta.prefill.chunk_token_idx.shape
    perm = torch.randperm(nc, generator=torch.Generator().manual_seed(seed)).to(DEV)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(nc, device=DEV)
    inv_pad = torch.cat([inv, torch.tensor([nc], device=DEV)])
    cti = meta.prefill.chunk_token_idx[perm].contiguous()
    pos = meta.prefill.token_chunk_pos
    tcp = inv[pos // L] * L + pos % L
    return cti, tcp, inv_pad[meta.prefill.row_chunks].contiguous()


def _shuffle_tokens(meta, seed):
    """The same plan over a token stream in shuffled order: chunks are no longer consecutive runs
    of tokens (only the gathering path, contiguous_chunks=False, handles that)."""
    T = meta.num_prefill_tokens
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(seed)).to(DEV)  # t -> perm[t]
    perm_pad = torch.cat([perm, torch.tensor([T], device=DEV)])
    tcp = torch.empty_like(meta.prefill.token_chunk_pos)
    tcp[perm] = meta.prefill.token_chunk_pos
    return perm_pad[meta.prefill.chunk_token_idx].contiguous(), tcp, meta.prefill.row_chunks


def _run(rows, H, P, N, G, chunk_size, dtype, dt_limit=(0.0, float("inf")), strided=False,
         seed=0, permute=False, shuffle=False, contiguous_chunks=True, snapshots=True, **knobs):
    """Both implementations on one batch; `knobs`: the launcher's `tuning` entry "ssd".
    Returns (y, chunk end states, pool) of each and the pool before. `snapshots`: the end states
    of all chunks but the last are saved into slots of their own past the rows' (the last chunk
    has none, -1: the reference writes it to the scratch slot, the kernel nowhere); without,
    the end states returned are empty."""
    gen = torch.Generator().manual_seed(seed)
    meta = _meta(rows, chunk_size)
    T = meta.num_prefill_tokens
    num_slots = max(r[2] for r in rows) + 2
    nc = meta.prefill.num_chunks - 1 if snapshots else 0
    x, dt, A, B, C, D, dtb, st = _inputs(T, H, P, N, G, num_slots + nc, dtype, gen, strided)
    cti, tcp, rc = meta.prefill.chunk_token_idx, meta.prefill.token_chunk_pos, meta.prefill.row_chunks
    if permute:
        cti, tcp, rc = _permute_chunks(meta, seed)
    if shuffle:
        cti, tcp, rc = _shuffle_tokens(meta, seed)
    args = (meta.prefill.state_slots.to(torch.int32), meta.prefill.has_initial_state, cti, tcp, rc,
            meta.prefill.row_num_chunks)
    if snapshots:  # chunk c -> slot num_slots + c (chunk ids as the plan numbers them)
        args += (torch.tensor([*range(num_slots, num_slots + nc), -1], device=DEV),)
    st_ref, st_tri = st.clone(), st.clone()
    y_ref = ssd_chunk_scan_varlen_ref(x, dt, A, B, C, D, dtb, dt_limit, st_ref, *args)
    with tuning.override("ssd", **knobs):
        y = ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dtb, dt_limit, st_tri, *args,
                                         contiguous_chunks=contiguous_chunks)
    e, e_ref = st_tri[num_slots:num_slots + nc], st_ref[num_slots:num_slots + nc]
    assert y.dtype == x.dtype and not torch.isnan(y).any() and not torch.isnan(e).any()
    return (y, e, st_tri), (y_ref, e_ref, st_ref), st


def _close(got, ref, st0, tol):
    (y, e, st), (y_ref, e_ref, st_ref) = got, ref
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(e, e_ref, rtol=tol, atol=tol)
    # every real slot (skipped rows only wrote the scratch slot in the reference)
    torch.testing.assert_close(st[:-1], st_ref[:-1], rtol=tol, atol=tol)
    torch.testing.assert_close(st[-1], st0[-1])  # scratch slot untouched


# (num_tokens, context_len, slot, has_initial_state): ragged rows; prefixes ending inside a chunk
# (short first chunk); a row inside one chunk; rows with and without initial state; a padding row
ROWS = [(37, 0, 0, False), (5, 10, 3, True), (16, 16, 1, True), (29, 3, 2, True),
        (7, 0, -1, False)]


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "none"])
def test_ssd_fp32_ragged(snapshots, prefetch):
    # prefetch: launch S loads the next chunk's tiles (and, without snapshots, its dt and cumsum)
    # an iteration ahead
    got, ref, st0 = _run(ROWS, H=4, P=16, N=16, G=2, chunk_size=16, dtype=torch.float32,
                         snapshots=snapshots, prefetch_state=prefetch)
    _close(got, ref, st0, F32_TOL)


def test_ssd_fp32_remainders_strided_dtlimit():
    # P not a multiple of the P block, N not a power of two, one group, clamp on dt
    rows = [(40, 20, 1, True), (3, 0, 0, False)]
    got, ref, st0 = _run(rows, H=2, P=24, N=20, G=1, chunk_size=16, dtype=torch.float32,
                         dt_limit=(0.05, 0.8), strided=True, seed=1, block_p_state=16,
                         block_p_scan=16)
    _close(got, ref, st0, F32_TOL)


def test_ssd_fp16_chunk32():
    rows = [(70, 5, 0, True), (33, 0, 1, False)]
    got, ref, st0 = _run(rows, H=2, P=16, N=32, G=2, chunk_size=32, dtype=torch.float16, seed=2)
    _close(got, ref, st0, 2e-2)


# tuning knobs: several row tiles and source blocks per chunk (BLOCK_K below, equal to and above
# BLOCK_M), CB tiles smaller than the chunk and an N loop in the CB launch, N split over blocks in
# the state launch and over the inter-chunk dot in C, P not a multiple of the P blocks, token
# blocks smaller than the chunk in the state launch
KNOBS = {
    "defaults": {},
    "m16_k16_cb16": {"block_m_scan": 16, "block_k_scan": 16, "block_cb": 16, "block_l_state": 16},
    "m16_k32": {"block_m_scan": 16, "block_k_scan": 32, "block_p_scan": 16, "block_cb": 32},
    "m32_k16_nsplit": {"block_m_scan": 32, "block_k_scan": 16, "block_n_state": 16,
                       "block_n_scan": 16, "block_k_cb": 16, "block_p_state": 16},
    "wide_p": {"block_p_scan": 64, "block_p_state": 32, "block_l_state": 32, "num_warps_scan": 2,
               "num_stages_scan": 2},
    # head_dim 40 as two tiles of one program in S and C (32 + 16), token blocks in S
    "split_p": {"block_p_state": 32, "block_p2_state": 16, "block_l_state": 16,
                "block_p_scan": 32, "block_p2_scan": 16, "block_m_scan": 16},
    "one_p_tile": {"block_p_scan": 64, "block_p2_scan": 0},
    # launch S loading the next chunk's tiles before this chunk's dot, with and without the split
    "prefetch": {"prefetch_state": True},
    "prefetch_split": {"prefetch_state": True, "block_p_state": 32, "block_p2_state": 16},
}
# chunk 32: short first chunks (prefix ends mid-chunk) shorter than a 16-row tile, a row inside one
# chunk, rows of several chunks with and without initial state, a negative slot
ROWS32 = [(75, 0, 0, False), (9, 40, 3, True), (70, 20, 1, True), (20, 31, 2, False),
          (33, 5, -1, False), (64, 64, 4, True)]


@pytest.mark.parametrize("knobs", list(KNOBS.values()), ids=list(KNOBS))
def test_ssd_fp32_knobs(knobs):
    got, ref, st0 = _run(ROWS32, H=4, P=40, N=40, G=2, chunk_size=32, dtype=torch.float32,
                         strided=True, seed=4, **knobs)
    _close(got, ref, st0, F32_TOL)


@pytest.mark.parametrize("G", [1, 4], ids=["G1", "G=H"])
def test_ssd_fp32_groups_permuted_chunks(G):
    got, ref, st0 = _run(ROWS32, H=4, P=16, N=16, G=G, chunk_size=32, dtype=torch.float32,
                         seed=5 + G, permute=True, block_m_scan=16, block_cb=16)
    _close(got, ref, st0, F32_TOL)


@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "shuffled"])
def test_ssd_fp32_gathered_tokens(shuffle):
    # contiguous_chunks=False gathers every token through chunk_token_idx
    got, ref, st0 = _run(ROWS32, H=4, P=24, N=16, G=2, chunk_size=32, dtype=torch.float32,
                         strided=True, seed=9, shuffle=shuffle, contiguous_chunks=False,
                         block_m_scan=16, block_k_scan=16, block_l_state=16)
    _close(got, ref, st0, F32_TOL)


def test_ssd_fp16_split_tiles_gathered():
    # head_dim 40 in two tiles of one program in both launches (the 9B's layout), tokens gathered
    # through chunk_token_idx (no prefetch there), in half precision
    got, ref, st0 = _run(ROWS32, H=4, P=40, N=32, G=2, chunk_size=32, dtype=torch.float16,
                         strided=True, seed=10, shuffle=True, contiguous_chunks=False,
                         block_p_state=32, block_p2_state=16, block_n_state=16,
                         block_p_scan=32, block_p2_scan=16, block_m_scan=16)
    _close(got, ref, st0, 2e-2)


def test_ssd_fp32_single_fresh_row():
    # one row from zero (every chunk's start state comes from the previous chunk, or none)
    got, ref, st0 = _run([(100, 0, 0, False)], H=2, P=8, N=8, G=1, chunk_size=16,
                         dtype=torch.float32, seed=7)
    _close(got, ref, st0, F32_TOL)


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("start,n", [(0, 20), (0, 9), (13, 20)],
                         ids=["fresh", "fresh_one_chunk", "follow_up"])
def test_ssd_fp32_bucket_with_empty_padding_rows(start, n, prefetch):
    """A lone row in a prefill graph's bucket (engine/prefill_bucket.py) whose padding rows hold
    no token: each has one empty chunk, which launch S skips. The real row's outputs, its final
    state and its snapshot against the reference on the same layout; the scratch slot as the
    reference leaves it."""
    import numpy as np

    from mambaserve.engine.prefill_bucket import PrefillBucket, pack_prefill_step
    from mambaserve.metadata import plan_metadata

    L, H, P, N, G = 16, 2, 24, 16, 1
    end = start + n
    snap_pos = [p for p in range((start // L + 1) * L, end + 1, L) if p < end][:1]
    num_slots = 3
    rows = [Row.standalone([1] * n, start, 1, start > 0, [0],
                           snapshots=[(p, num_slots) for p in snap_pos])]
    host = plan_metadata(Batch(rows, []), chunk_size=L, conv_kernel=4, page_size=1 << 20,
                         scratch_page=0)
    bucket = PrefillBucket(tokens=n, decodes=0, rows=4, chunk_size=L, conv_kernel=4,
                           max_pages=1, snapshots=True)
    parts = {k: torch.from_numpy(np.ascontiguousarray(v)).to(DEV) for k, v in
             bucket.host_views(pack_prefill_step(host, bucket, page_size=1 << 20,
                                                 scratch_page=0)).items()}
    assert parts["row_num_chunks"][1:].tolist() == [1, 1, 1]  # the empty padding rows
    gen = torch.Generator().manual_seed(11 + start)
    x, dt, A, B, C, D, dtb, st = _inputs(n, H, P, N, G, num_slots + 1, torch.float32, gen, False)
    args = (parts["state_slots"][:4].to(torch.int32), parts["has_initial_state"],
            parts["chunk_token_idx"], parts["token_chunk_pos"], parts["row_chunks"],
            parts["row_num_chunks"], parts["chunk_snap_dst"])
    st_ref, st_tri = st.clone(), st.clone()
    y_ref = ssd_chunk_scan_varlen_ref(x, dt, A, B, C, D, dtb, (0.0, float("inf")), st_ref, *args)
    with tuning.override("ssd", prefetch_state=prefetch):
        y = ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dtb, (0.0, float("inf")), st_tri,
                                         *args)
    torch.testing.assert_close(y, y_ref, rtol=F32_TOL, atol=F32_TOL)
    torch.testing.assert_close(st_tri[:-1], st_ref[:-1], rtol=F32_TOL, atol=F32_TOL)
    torch.testing.assert_close(st_tri[-1], st[-1])  # the scratch slot untouched
    assert not torch.equal(st_tri[1], st[1])  # the row's final state was written
    if snap_pos:
        assert not torch.equal(st_tri[num_slots], st[num_slots])  # and its snapshot


def test_ssd_fp16_knobs_chunk64():
    rows = [(150, 3, 0, True), (40, 0, 1, False), (64, 100, 2, True)]
    got, ref, st0 = _run(rows, H=4, P=24, N=32, G=2, chunk_size=64, dtype=torch.float16,
                         seed=8, block_m_scan=32, block_k_scan=16, block_p_scan=16, block_cb=32)
    _close(got, ref, st0, 2e-2)


def test_split_p_rule():
    """Launch C's default column tiles: one power-of-two tile, or two in one program where that
    pads less (the 9B's head_dim 80 = 64 + 16, not 128)."""
    from mambaserve.ops.triton.ssd import _split_p

    assert _split_p(80) == (64, 16) and _split_p(40) == (32, 16) and _split_p(96) == (64, 32)
    assert _split_p(64) == (64, 0) and _split_p(8) == (16, 0) and _split_p(24) == (32, 0)
    assert _split_p(112) == (128, 0) and _split_p(200) == (128, 0)


@pytest.mark.parametrize("knobs", [{"block_p_state": 32, "block_p2_state": 4},
                                   {"block_p_scan": 16, "block_p2_scan": 16},
                                   {"block_p_scan": 64, "block_p2_scan": 16}],
                         ids=["too_small", "short", "first_covers"])
def test_ssd_bad_split_rejected(knobs):
    with pytest.raises(AssertionError, match="block_p"):
        _run([(20, 0, 0, False)], H=2, P=40, N=8, G=1, chunk_size=16, dtype=torch.float32,
             **knobs)


def test_ssd_bad_block_rejected():
    with pytest.raises(AssertionError, match="block_m_scan"):
        _run([(20, 0, 0, False)], H=2, P=8, N=8, G=1, chunk_size=16, dtype=torch.float32,
             block_m_scan=32)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


NEMO_ROWS = {
    "8x512": [(512, 0, i, False) for i in range(8)],
    "4x2048ish": [(2048, 0, 0, False), (2000, 100, 1, True), (1500, 64, 2, True),
                  (2500, 7, 3, False)],
    "1x8192": [(8192, 0, 0, False)],
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", list(NEMO_ROWS.values()), ids=list(NEMO_ROWS))
def test_ssd_nemotron9b_bf16_gpu(rows):
    got, ref, st0 = _run(rows, H=128, P=80, N=128, G=8, chunk_size=128, dtype=torch.bfloat16,
                         strided=True, seed=3)
    for a, b in zip(got[:2] + (got[2][:-1],), ref[:2] + (ref[2][:-1],)):
        assert _rel(a, b) < 1e-2, _rel(a, b)
    torch.testing.assert_close(got[2][-1], st0[-1])


GPU_KNOBS = {
    "m128_p16": {"block_m_scan": 128, "block_p_scan": 16, "block_k_scan": 32, "num_warps_scan": 8},
    "m32_p64": {"block_m_scan": 32, "block_p_scan": 64, "block_k_scan": 128, "block_cb": 128,
                "num_warps_cb": 8, "num_stages_scan": 3},
    "state_p32_n64_l64": {"block_p_state": 32, "block_n_state": 64, "block_l_state": 64,
                          "num_stages_state": 2},
    "gather": {"contiguous_chunks": False},
    "m128_p64_w8": {"block_m_scan": 128, "block_p_scan": 64, "num_warps_scan": 8,
                    "num_stages_scan": 1},
    "one_p_tile": {"block_p_scan": 128, "block_p2_scan": 0},
    "state_split_w8": {"block_p2_state": 16, "num_warps_state": 8},
    "state_prefetch_split_w8": {"block_p2_state": 16, "num_warps_state": 8, "prefetch_state": True},
    "one_tile_layouts": {"block_p2_state": 0, "block_n_state": 128, "prefetch_state": False,
                         "block_p2_scan": 0, "block_k_scan": 16},
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("knobs", list(GPU_KNOBS.values()), ids=list(GPU_KNOBS))
def test_ssd_nemotron9b_bf16_knobs_gpu(knobs):
    got, ref, st0 = _run(NEMO_ROWS["4x2048ish"], H=128, P=80, N=128, G=8, chunk_size=128,
                         dtype=torch.bfloat16, strided=True, seed=3, **knobs)
    for a, b in zip(got[:2] + (got[2][:-1],), ref[:2] + (ref[2][:-1],)):
        assert _rel(a, b) < 1e-2, _rel(a, b)
    torch.testing.assert_close(got[2][-1], st0[-1])


@pytest.mark.parametrize("listed", [[3, 0, 3], [5], []], ids=["repeated", "one", "none"])
def test_ssd_fp32_listed_chunks(listed):
    """out_chunks: launches CB and C run on the listed chunks alone (an entry may repeat; none
    at all); y at those chunks' tokens, the chunk end states and the pool are the full scan's,
    bit for bit."""
    L = 16
    meta = _meta(ROWS, L)
    T, pf = meta.num_prefill_tokens, meta.prefill
    assert pf.num_chunks > 5
    x, dt, A, B, C, D, dtb, st = _inputs(T, 4, 16, 16, 2, 6, torch.float32,
                                         torch.Generator().manual_seed(4), True)
    args = (pf.state_slots.to(torch.int32), pf.has_initial_state, pf.chunk_token_idx,
            pf.token_chunk_pos, pf.row_chunks, pf.row_num_chunks)
    st_full, st_listed = st.clone(), st.clone()
    y_full = ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dtb, (0.0, float("inf")), st_full,
                                          *args)
    out = torch.tensor(listed, dtype=torch.int64, device=DEV)
    y = ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dtb, (0.0, float("inf")), st_listed,
                                     *args, None, out)
    read = torch.isin(pf.token_chunk_pos // L, out)  # the listed chunks' tokens
    assert read.sum() == sum(int((pf.token_chunk_pos // L == c).sum()) for c in set(listed))
    assert torch.equal(y[read], y_full[read])
    assert torch.equal(st_listed, st_full)


def test_snapshots_need_contiguous_heads():
    """Launch S stores a snapshot with the state buffer's [P, N] offsets: a pool whose heads are
    laid out otherwise is refused with a clear message."""
    meta = _meta([(20, 0, 0, False)], 16)
    T, pf = meta.num_prefill_tokens, meta.prefill
    x, dt, A, B, C, D, dtb, st = _inputs(T, 2, 8, 8, 1, 3, torch.float32,
                                         torch.Generator().manual_seed(0), False)
    args = (pf.state_slots.to(torch.int32), pf.has_initial_state, pf.chunk_token_idx,
            pf.token_chunk_pos, pf.row_chunks, pf.row_num_chunks)
    snaps = torch.tensor([2, -1], device=DEV)
    with pytest.raises(AssertionError, match="contiguous"):
        ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dtb, (0.0, float("inf")),
                                     st.transpose(2, 3), *args, snaps)
    ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dtb, (0.0, float("inf")),
                                 st.transpose(2, 3), *args)  # no snapshots: any strides



STATE_SM90_SCRIPT = r'''
import json
from mambaserve.ops.triton.ssd_kernels import _chunk_scan_kernel, _chunk_state_passing_kernel
ptrs = {"x_ptr": "*bf16", "B_ptr": "*bf16", "C_ptr": "*bf16", "cti_ptr": "*i64",
        "dtc_ptr": "*fp32", "cum_ptr": "*fp32", "clen_ptr": "*i32", "st_ptr": "*bf16",
        "src_ptr": "*i64", "ssm_ptr": "*fp32", "slot_ptr": "*i32", "init_ptr": "*i1",
        "row_chunks_ptr": "*i64", "nchunks_ptr": "*i64", "snap_ptr": "*i64", "D_ptr": "*fp32",
        "cb_ptr": "*fp32", "y_ptr": "*bf16", "list_ptr": "*i64"}
# as the 9B shapes launch them: unit strides specialized, the others multiples of 16
div = ("x_t", "x_h", "B_t", "B_g", "C_t", "C_g", "y_t", "y_h", "cti_c", "s_slot", "s_h", "s_p",
       "H", "P", "N", "heads_per_group")


def compile_report(k, const, num_warps, num_stages):
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in k.arg_names}
    ptx, spills = sm90(k, sig, const, div, num_warps, num_stages)
    return {"spill_bytes": spills, "stores": len(re.findall(r"st\.global", ptx)),
            "to_bf16": len(re.findall(r"cvt\.rn\.bf16", ptx)),
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx))}


report = {}
# launch S at the 9B default (64 + 16 rows, 64-wide N tiles, prefetch) and the one-tile layout
for name, (p2, bn, pf) in {"split": (16, 64, 1), "one_tile": (0, 128, 0)}.items():
    for snaps in (0, 1):
        const = {"L": 128, "BLOCK_P": 64, "BLOCK_P2": p2, "BLOCK_N": bn, "BLOCK_L": 128,
                 "IP": "tf32", "CONTIG": 1, "SNAPS": snaps, "PREFETCH": pf, "x_p": 1, "B_n": 1,
                 "s_n": 1}
        report[f"state_{name}_{snaps}"] = compile_report(_chunk_state_passing_kernel, const, 4, 1)
# launch C at the 9B default: 64 + 16 columns, 32-token source blocks
const = {"L": 128, "BLOCK_M": 64, "BLOCK_P": 64, "BLOCK_P2": 16, "BLOCK_K": 32, "BLOCK_N": 128,
         "IP": "tf32", "CONTIG": 1, "ONE_N_BLOCK": 1, "LISTED": 0, "x_p": 1, "C_n": 1, "y_p": 1}
report["scan_split"] = compile_report(_chunk_scan_kernel, const, 4, 3)
report["scan_listed"] = compile_report(_chunk_scan_kernel, {**const, "LISTED": 1}, 4, 3)
print(json.dumps(report))
'''


def test_ssd_launches_compile_for_sm90():
    """Offline compile for a Hopper (no GPU needed) at the 9B shapes and default launch
    parameters: launch S (a second 16-row tile in the program, 64-wide N tiles, the next chunk's
    tiles prefetched) spills no register without snapshots and little with them (ptxas: 80 bytes
    of spill stores and 56 of loads per thread for the snapshot stores' registers; timed 3-12 %
    faster than the one-tile layout with snapshots all the same, docs/kernels.md run 19), rounds
    the chunk states to bf16 and adds the snapshot stores; the one-tile layout spills nothing;
    launch C's two column tiles spill nothing and use wgmma, on listed chunks too."""
    from offline_ptx import SM90, compile_report

    r = compile_report(SM90 + STATE_SM90_SCRIPT, "the SSD launches")
    assert r["state_split_0"]["spill_bytes"] == 0, r
    assert r["state_split_1"]["spill_bytes"] <= 160, r  # spill stores + loads, bytes per thread
    assert r["state_one_tile_0"]["spill_bytes"] == r["state_one_tile_1"]["spill_bytes"] == 0, r
    assert r["state_split_0"]["to_bf16"] > 0, r
    assert r["state_split_1"]["stores"] > r["state_split_0"]["stores"], r
    assert r["scan_split"]["spill_bytes"] == 0 and r["scan_split"]["wgmma"] > 0, r
    assert r["scan_listed"]["spill_bytes"] == 0 and r["scan_listed"]["wgmma"] > 0, r
