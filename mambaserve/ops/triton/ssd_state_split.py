"""Device code of the SSD scan's launch S in two launches, for rows of many chunks.

The one-launch state passing (`ssd_kernels._chunk_state_passing_kernel`) walks a row's chunks in
order with the state in registers, so its time is the chain of one dot per chunk: a long row's
few programs (one per state tile and head) each wait on every chunk's loads and dot in turn. Here
the chunk-local terms come first, in parallel over chunks, and the chain that remains is a
multiply-add per element:

- `_chunk_local_state_kernel`, grid (state tiles, H, chunks): loc = (x ∘ dt ∘ exp(cum[L-1] -
  cum))ᵀ · B of one chunk, the same dot (operands, tile, order) as the one-launch kernel's,
  stored in float32 into a [chunks, H, P, N] buffer;
- `_state_chain_kernel`, grid (cdiv(P·N, BLOCK), H, rows): S = S · exp(cum[L-1]) + loc along the
  row's chunks for BLOCK elements of one head's state (each chunk's loc loaded two iterations
  ahead), with everything else the one-launch kernel does: the initial state (copied for launch
  C), each chunk's end state in the state buffer's dtype, the prefix-cache snapshots, the final
  state into the row's slot, and the chunks' start-state sources.

The end states equal the one-launch kernel's bit for bit (the same loc, the same multiply-add);
the price is loc's float32 write and read. `SsdScan.launch_state` chooses (tuning "ssd",
`state_split`); docs/kernels.md ("SSD chunked scan").
"""

from __future__ import annotations

import triton
import triton.language as tl

from mambaserve.ops.triton.ssd_kernels import _chunk_state_operands, _weighted_x


@triton.jit
def _chunk_local_state_kernel(
    x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, clen_ptr, loc_ptr,
    H, P, N, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n, cti_c,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, IP: tl.constexpr, CONTIG: tl.constexpr,
):
    num_nb = tl.cdiv(N, BLOCK_N)
    pb = tl.program_id(0) // num_nb
    nb = tl.program_id(0) % num_nb
    h = tl.program_id(1)
    c = tl.program_id(2).to(tl.int64)
    clen = tl.load(clen_ptr + c)
    if clen > 0:  # an empty chunk (a graph bucket's padding row) is never read
        g = h // heads_per_group
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mp = offs_p < P
        mn = offs_n < N
        PN = P * N
        t0 = tl.load(cti_ptr + c * cti_c)
        ch = (c * H + h) * L
        cum_last = tl.load(cum_ptr + ch + L - 1)
        if BLOCK_P2 > 0:
            offs_p2 = BLOCK_P + tl.arange(0, BLOCK_P2)
            mp2 = offs_p2 < P
        if BLOCK_L == L:
            xw, Bm, rows, ml, w = _chunk_state_operands(
                x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, c, t0, clen, ch, cum_last, h, g, 0,
                offs_p, offs_n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, cti_c, L, CONTIG)
            loc = tl.dot(xw, Bm, input_precision=IP)
            if BLOCK_P2 > 0:
                loc2 = tl.dot(_weighted_x(x_ptr, t0, h, rows, ml, w, offs_p2, mp2, x_t, x_h, x_p),
                              Bm, input_precision=IP)
        else:
            loc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
            if BLOCK_P2 > 0:
                loc2 = tl.zeros((BLOCK_P2, BLOCK_N), dtype=tl.float32)
            for l0 in range(0, clen, BLOCK_L):
                xw, Bm, rows, ml, w = _chunk_state_operands(
                    x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, c, t0, clen, ch, cum_last, h, g,
                    l0, offs_p, offs_n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, cti_c, BLOCK_L,
                    CONTIG)
                loc = tl.dot(xw, Bm, acc=loc, input_precision=IP)
                if BLOCK_P2 > 0:
                    loc2 = tl.dot(_weighted_x(x_ptr, t0, h, rows, ml, w, offs_p2, mp2, x_t, x_h,
                                              x_p), Bm, acc=loc2, input_precision=IP)
        base = loc_ptr + (c * H + h) * PN
        tl.store(base + offs_p[:, None] * N + offs_n[None, :], loc,
                 mask=mp[:, None] & mn[None, :])
        if BLOCK_P2 > 0:
            tl.store(base + offs_p2[:, None] * N + offs_n[None, :], loc2,
                     mask=mp2[:, None] & mn[None, :])


@triton.jit(do_not_specialize=["num_chunks", "rc_r"])
def _state_chain_kernel(
    loc_ptr, cum_ptr, clen_ptr, st_ptr, src_ptr, ssm_ptr, slot_ptr, init_ptr, row_chunks_ptr,
    nchunks_ptr, snap_ptr,
    num_chunks, H, N, PN, s_slot, s_h, s_p, s_n, rc_r,
    L: tl.constexpr, BLOCK: tl.constexpr, SNAPS: tl.constexpr,
):
    eb = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2)
    e = eb * BLOCK + tl.arange(0, BLOCK)  # flat [P, N] offsets of one head's state
    me = e < PN
    slot = tl.load(slot_ptr + r).to(tl.int64)
    valid = slot >= 0
    use_init = valid & (tl.load(init_ptr + r) != 0)
    slot = tl.maximum(slot, 0)
    s_base = ssm_ptr + slot * s_slot + h * s_h
    s_off = (e // N) * s_p + (e % N) * s_n
    running = tl.load(s_base + s_off, mask=me & use_init, other=0.0).to(tl.float32)
    # keep the initial state for the output launch: the slot is overwritten below
    init_id = num_chunks + r.to(tl.int64)
    st_dt = st_ptr.dtype.element_ty
    tl.store(st_ptr + (init_id * H + h) * PN + e, running.to(st_dt), mask=me & use_init)
    writer = (h == 0) & (eb == 0)  # one program per row records the sources
    prev = tl.where(use_init, init_id, -1)
    nck = tl.load(nchunks_ptr + r)
    cid = tl.load(row_chunks_ptr + r * rc_r).to(tl.int64)
    clen = tl.load(clen_ptr + cid)
    # a graph bucket's empty padding row has nothing to pass (as in the one-launch kernel)
    nck = tl.where((nck == 1) & (clen == 0), 0, nck)
    # the loc terms do not depend on the chain: each is loaded two chunks ahead
    loc = tl.load(loc_ptr + (cid * H + h) * PN + e, mask=me & (nck > 0), other=0.0)
    nxt = tl.load(row_chunks_ptr + r * rc_r + 1, mask=nck > 1, other=0).to(tl.int64)
    loc_next = tl.load(loc_ptr + (nxt * H + h) * PN + e, mask=me & (nck > 1), other=0.0)
    for i in range(nck):
        more2 = i + 2 < nck
        nxt2 = tl.load(row_chunks_ptr + r * rc_r + i + 2, mask=more2, other=0).to(tl.int64)
        loc_next2 = tl.load(loc_ptr + (nxt2 * H + h) * PN + e, mask=me & more2, other=0.0)
        tl.store(src_ptr + cid, prev, mask=writer)
        cum_last = tl.load(cum_ptr + (cid * H + h) * L + L - 1)
        if SNAPS:
            dst = tl.load(snap_ptr + cid)
        running = running * tl.exp(cum_last) + loc
        tl.store(st_ptr + (cid * H + h) * PN + e, running.to(st_dt), mask=me)
        if SNAPS:  # a prefix-cache snapshot at this chunk's end
            if dst >= 0:
                tl.store(ssm_ptr + dst * s_slot + h * s_h + e,
                         running.to(ssm_ptr.dtype.element_ty), mask=me)
        prev = cid
        cid = nxt
        nxt = nxt2
        loc = loc_next
        loc_next = loc_next2
    tl.store(s_base + s_off, running.to(ssm_ptr.dtype.element_ty), mask=me & valid)


def launch_state_split(scan, loc) -> None:
    """Launch S of `scan` (an `ssd.SsdScan`) as the two launches above; `loc`: a float32
    [chunks, H, P, N] buffer."""
    x, B, cti, ssm = scan.x, scan.B, scan.chunk_token_idx, scan.ssm_state
    H, P, N = scan.H, scan.P, scan.N
    num_pb = 1 if scan.bps2 else triton.cdiv(P, scan.bps)
    _chunk_local_state_kernel[(num_pb * triton.cdiv(N, scan.bns), H, scan.num_chunks)](
        x, B, cti, scan.dt_c, scan.cum, scan.clen, loc,
        H, P, N, H // scan.G,
        *x.stride(), *B.stride(), cti.stride(0),
        L=scan.L, BLOCK_P=scan.bps, BLOCK_P2=scan.bps2, BLOCK_N=scan.bns, BLOCK_L=scan.bls,
        IP=scan.ip, CONTIG=scan.contig, num_warps=scan.warps_state,
        num_stages=scan.stages_state,
    )
    snaps = scan.chunk_snap_dst
    _state_chain_kernel[(triton.cdiv(P * N, scan.block_chain), H, scan.R)](
        loc, scan.cum, scan.clen, scan.states, scan.chunk_src, ssm, scan.state_slots,
        scan.has_initial_state, scan.row_chunks, scan.row_num_chunks,
        snaps if snaps is not None else scan.row_num_chunks,
        scan.num_chunks, H, N, P * N, *ssm.stride(), scan.row_chunks.stride(0),
        L=scan.L, BLOCK=scan.block_chain, SNAPS=snaps is not None,
        num_warps=scan.warps_chain,
    )
