"""Triton SSD (Mamba2) chunked scan over the flat multi-row prefill stream.

Same chunk plan as the reference (`mambaserve.ops.ssd`): chunks cut at absolute multiples of
chunk_size, never spanning rows, described by host-built metadata. Four launches in order: dt and
its cumulative sum per chunk (0), state passing along each row's chunks (S), C·Bᵀ per chunk and
group (CB), and the output tiles (C). `SsdScan` holds one scan's buffers and its launches as
separate methods (a benchmark can time a prefix of them); `ssd_chunk_scan_varlen_triton` runs
them all. The algorithm, grids, buffers and measurements are in docs/kernels.md ("SSD chunked
scan"); launch parameters are the `tuning` entry "ssd".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import softplus_clamp


@triton.jit(do_not_specialize=["T"])
def _chunk_dt_kernel(
    cti_ptr, dt_ptr, dt_bias_ptr, A_ptr, dtc_ptr, cum_ptr, clen_ptr,
    T, H, dt_lo, dt_hi, cti_c, dt_t, dt_h,
    L: tl.constexpr, BLOCK_H: tl.constexpr,
):
    hb = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    offs_l = tl.arange(0, L)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = offs_h < H
    idx = tl.load(cti_ptr + c * cti_c + offs_l)
    ml = idx < T
    raw = tl.load(dt_ptr + idx[:, None] * dt_t + offs_h[None, :] * dt_h,
                  mask=ml[:, None] & mh[None, :], other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    dt = softplus_clamp(raw + bias[None, :], dt_lo, dt_hi)
    dt = tl.where(ml[:, None], dt, 0.0)  # [L, BLOCK_H]
    cum = tl.cumsum(dt * a[None, :], axis=0)
    off = (c * H + offs_h[None, :]) * L + offs_l[:, None]
    tl.store(dtc_ptr + off, dt, mask=mh[None, :])
    tl.store(cum_ptr + off, cum, mask=mh[None, :])
    tl.store(clen_ptr + c, tl.sum(ml.to(tl.int32), axis=0), mask=hb == 0)


@triton.jit
def _chunk_rows(cti_ptr, c, cti_c, offs, t0, CONTIG: tl.constexpr):
    """Token index of chunk positions `offs`, relative to the chunk's first token t0. CONTIG: the
    chunk's tokens are consecutive in the stream (build_metadata's plans), so no gather."""
    if CONTIG:
        rows = offs
    else:
        rows = tl.load(cti_ptr + c * cti_c + offs) - t0
    return rows


@triton.jit
def _chunk_state_operands(x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, c, t0, clen, ch, cum_last, h,
                          g, l0, offs_p, offs_n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, cti_c,
                          BLOCK_L: tl.constexpr, CONTIG: tl.constexpr):
    """The dot operands of chunk positions [l0, l0 + BLOCK_L) for one state tile: x ∘ dt ∘
    exp(cum[L-1] - cum) [BLOCK_P, BLOCK_L] in x's dtype and B [BLOCK_L, BLOCK_N] (positions past
    the chunk's length read as 0)."""
    offs_l = l0 + tl.arange(0, BLOCK_L)
    ml = offs_l < clen
    if CONTIG:  # clamped to the chunk: the offset tiles depend on the chunk, so they are not
        rows = tl.minimum(offs_l, clen - 1)  # hoisted out of the chunk loop and kept live
    else:
        rows = _chunk_rows(cti_ptr, c, cti_c, offs_l, t0, CONTIG)
    w = tl.load(dtc_ptr + ch + offs_l) * tl.exp(cum_last - tl.load(cum_ptr + ch + offs_l))
    x = tl.load(x_ptr + t0 * x_t + h * x_h + rows[None, :] * x_t + offs_p[:, None] * x_p,
                mask=mp[:, None] & ml[None, :], other=0.0)
    Bm = tl.load(B_ptr + t0 * B_t + g * B_g + rows[:, None] * B_t + offs_n[None, :] * B_n,
                 mask=ml[:, None] & mn[None, :], other=0.0)
    cdt = x_ptr.dtype.element_ty
    return (x.to(tl.float32) * w[None, :]).to(cdt), Bm.to(cdt)


@triton.jit(do_not_specialize=["num_chunks", "rc_r"])
def _chunk_state_passing_kernel(
    x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, clen_ptr, st_ptr, src_ptr,
    ssm_ptr, slot_ptr, init_ptr, row_chunks_ptr, nchunks_ptr, snap_ptr,
    num_chunks, H, P, N, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n, cti_c, s_slot, s_h, s_p, s_n, rc_r,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    IP: tl.constexpr, CONTIG: tl.constexpr, SNAPS: tl.constexpr,
):
    """Launch S (docs/kernels.md): walks one row's chunks in order for a [BLOCK_P, BLOCK_N]
    tile of one head's state, S = S_prev * exp(cum[L-1]) + (x ∘ dt ∘ exp(cum[L-1] - cum))ᵀ · B,
    keeping S in registers (float32); each chunk's end state is stored once in the state
    buffer's dtype (x's: the output launch's dot operand), and in the pool's dtype into the
    snapshot slot of a chunk that has one (SNAPS: snap_ptr holds each chunk's slot or -1)."""
    num_nb = tl.cdiv(N, BLOCK_N)
    pb = tl.program_id(0) // num_nb
    nb = tl.program_id(0) % num_nb
    h = tl.program_id(1)
    r = tl.program_id(2)
    g = h // heads_per_group
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    mpn = mp[:, None] & mn[None, :]
    PN = P * N
    st_off = offs_p[:, None] * N + offs_n[None, :]
    slot = tl.load(slot_ptr + r).to(tl.int64)
    valid = slot >= 0
    use_init = valid & (tl.load(init_ptr + r) != 0)
    slot = tl.maximum(slot, 0)
    s_base = ssm_ptr + slot * s_slot + h * s_h
    s_off = offs_p[:, None] * s_p + offs_n[None, :] * s_n
    running = tl.load(s_base + s_off, mask=mpn & use_init, other=0.0).to(tl.float32)
    # keep the initial state for the output launch: the slot is overwritten below
    init_id = num_chunks + r.to(tl.int64)
    st_dt = st_ptr.dtype.element_ty
    tl.store(st_ptr + (init_id * H + h) * PN + st_off, running.to(st_dt), mask=mpn & use_init)
    writer = (h == 0) & (tl.program_id(0) == 0)  # one program per row records the sources
    prev = tl.where(use_init, init_id, -1)
    nck = tl.load(nchunks_ptr + r)
    # the next chunk's id, first token and length are loaded one iteration ahead
    cid = tl.load(row_chunks_ptr + r * rc_r).to(tl.int64)
    t0 = tl.load(cti_ptr + cid * cti_c)
    clen = tl.load(clen_ptr + cid)
    for i in range(nck):
        tl.store(src_ptr + cid, prev, mask=writer)
        ch = (cid * H + h) * L
        cum_last = tl.load(cum_ptr + ch + L - 1)
        if SNAPS:  # the chunk's snapshot slot, loaded before the dot hides its latency
            dst = tl.load(snap_ptr + cid)
        if BLOCK_L == L:  # the whole chunk in one dot, no loop
            xw, Bm = _chunk_state_operands(x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, cid, t0, clen,
                                           ch, cum_last, h, g, 0, offs_p, offs_n, mp, mn, x_t,
                                           x_h, x_p, B_t, B_g, B_n, cti_c, L, CONTIG)
            loc = tl.dot(xw, Bm, input_precision=IP)
        else:
            loc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
            for l0 in range(0, clen, BLOCK_L):
                xw, Bm = _chunk_state_operands(x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, cid, t0,
                                               clen, ch, cum_last, h, g, l0, offs_p, offs_n, mp,
                                               mn, x_t, x_h, x_p, B_t, B_g, B_n, cti_c, BLOCK_L,
                                               CONTIG)
                loc = tl.dot(xw, Bm, acc=loc, input_precision=IP)
        more = i + 1 < nck
        nxt = tl.load(row_chunks_ptr + r * rc_r + i + 1, mask=more, other=0).to(tl.int64)
        t0_n = tl.load(cti_ptr + nxt * cti_c, mask=more, other=0)
        clen_n = tl.load(clen_ptr + nxt, mask=more, other=0)
        running = running * tl.exp(cum_last) + loc
        tl.store(st_ptr + (cid * H + h) * PN + st_off, running.to(st_dt), mask=mpn)
        if SNAPS:  # a prefix-cache snapshot at this chunk's end (a slot's heads are contiguous
            if dst >= 0:  # [P, N]: the state buffer's offsets, no tile of its own)
                tl.store(ssm_ptr + dst * s_slot + h * s_h + st_off,
                         running.to(ssm_ptr.dtype.element_ty), mask=mpn)
        prev = cid
        cid = nxt
        t0 = t0_n
        clen = clen_n
    tl.store(s_base + s_off, running.to(ssm_ptr.dtype.element_ty), mask=mpn & valid)


@triton.jit
def _chunk_cb_kernel(
    B_ptr, C_ptr, cti_ptr, clen_ptr, cb_ptr,
    G, N, B_t, B_g, B_n, C_t, C_g, C_n, cti_c,
    L: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, IP: tl.constexpr,
    CDT: tl.constexpr, CONTIG: tl.constexpr,
):
    t = tl.program_id(0)  # lower-triangle tile t -> (i, j), j <= i
    i = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)  # guard the float rounding
    i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
    j = t - i * (i + 1) // 2
    g = tl.program_id(1)
    c = tl.program_id(2).to(tl.int64)
    clen = tl.load(clen_ptr + c)
    if i * BLOCK < clen:  # tiles of padding rows are never read
        offs_m = i * BLOCK + tl.arange(0, BLOCK)
        offs_s = j * BLOCK + tl.arange(0, BLOCK)
        t0 = tl.load(cti_ptr + c * cti_c)
        rows_m = _chunk_rows(cti_ptr, c, cti_c, offs_m, t0, CONTIG)
        rows_s = _chunk_rows(cti_ptr, c, cti_c, offs_s, t0, CONTIG)
        Cb = C_ptr + t0 * C_t + g * C_g
        Bb = B_ptr + t0 * B_t + g * B_g
        mm = offs_m < clen
        ms = offs_s < clen
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, N, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < N
            Cm = tl.load(Cb + rows_m[:, None] * C_t + offs_k[None, :] * C_n,
                         mask=mm[:, None] & mk[None, :], other=0.0)
            Bt = tl.load(Bb + rows_s[None, :] * B_t + offs_k[:, None] * B_n,
                         mask=mk[:, None] & ms[None, :], other=0.0)  # [BLOCK_K, BLOCK]
            acc = tl.dot(Cm.to(CDT), Bt.to(CDT), acc=acc, input_precision=IP)
        tl.store(cb_ptr + ((c * G + g) * L + offs_m[:, None]) * L + offs_s[None, :], acc)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, C_ptr, D_ptr, cti_ptr, dtc_ptr, cum_ptr, clen_ptr, cb_ptr, st_ptr, src_ptr, y_ptr,
    H, P, N, G, heads_per_group,
    x_t, x_h, x_p, C_t, C_g, C_n, y_t, y_h, y_p, cti_c,
    L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, IP: tl.constexpr, CONTIG: tl.constexpr, ONE_N_BLOCK: tl.constexpr,
):
    num_pb = tl.cdiv(P, BLOCK_P)
    mb = tl.program_id(0) // num_pb  # the P blocks of one row tile run next to each other
    pb = tl.program_id(0) % num_pb
    h = tl.program_id(1)
    c = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    cdt = x_ptr.dtype.element_ty
    clen = tl.load(clen_ptr + c)
    m0 = mb * BLOCK_M
    if m0 < clen:  # row tiles made only of padding store nothing
        ch = (c * H + h) * L
        t0 = tl.load(cti_ptr + c * cti_c)
        xb = x_ptr + t0 * x_t + h * x_h
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        mm = offs_m < clen
        mp = offs_p < P
        rows_m = _chunk_rows(cti_ptr, c, cti_c, offs_m, t0, CONTIG)
        cum_m = tl.load(cum_ptr + ch + offs_m)
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)

        # inter-chunk: exp(cum[l]) * C[l] . S_start[p]; S_start is the previous chunk's end state,
        # the row's initial state (both in st_ptr), or zero (src < 0: skipped)
        src = tl.load(src_ptr + c)
        if src >= 0:
            s_base = st_ptr + (src * H + h) * P * N
            Cb = C_ptr + t0 * C_t + g * C_g
            if ONE_N_BLOCK:  # one dot, no loop (a constexpr: a loop in a branch the launch
                offs_k = tl.arange(0, BLOCK_N)  # never takes still gets pipelined buffers)
                mk = offs_k < N
                Cm = tl.load(Cb + rows_m[:, None] * C_t + offs_k[None, :] * C_n,
                             mask=mm[:, None] & mk[None, :], other=0.0)
                S = tl.load(s_base + offs_p[None, :] * N + offs_k[:, None],
                            mask=mk[:, None] & mp[None, :], other=0.0)  # [BLOCK_N, BLOCK_P]
                acc = tl.dot(Cm.to(cdt), S.to(cdt), acc=acc, input_precision=IP)
            else:
                for k0 in range(0, N, BLOCK_N):
                    offs_k = k0 + tl.arange(0, BLOCK_N)
                    mk = offs_k < N
                    Cm = tl.load(Cb + rows_m[:, None] * C_t + offs_k[None, :] * C_n,
                                 mask=mm[:, None] & mk[None, :], other=0.0)
                    S = tl.load(s_base + offs_p[None, :] * N + offs_k[:, None],
                                mask=mk[:, None] & mp[None, :], other=0.0)
                    acc = tl.dot(Cm.to(cdt), S.to(cdt), acc=acc, input_precision=IP)
            acc = acc * tl.exp(cum_m)[:, None]

        # intra-chunk: (CB ∘ exp(cum[l] - cum[s]) [s <= l] ∘ dt[s]) . x over source blocks up to
        # the tile's last row, in one loop with unmasked CB loads: CB entries the CB launch never
        # wrote (above the diagonal tiles, rows of padding) are uninitialized, and the select
        # after the product drops them (and any inf of exp above the diagonal) for s > l; padding
        # rows are never stored, and sources past the chunk's length have dt = 0 and masked x.
        # (A variant with the blocks wholly below the tile in a second, unmasked loop was slower.)
        cb_base = cb_ptr + (c * G + g) * L * L
        hi = tl.minimum(m0 + BLOCK_M, clen)
        for s0 in range(0, hi, BLOCK_K):
            offs_s = s0 + tl.arange(0, BLOCK_K)
            cb = tl.load(cb_base + offs_m[:, None] * L + offs_s[None, :])
            cum_s = tl.load(cum_ptr + ch + offs_s)
            dt_s = tl.load(dtc_ptr + ch + offs_s)
            scores = cb * tl.exp(cum_m[:, None] - cum_s[None, :]) * dt_s[None, :]
            scores = tl.where(offs_s[None, :] <= offs_m[:, None], scores, 0.0)
            rows_s = _chunk_rows(cti_ptr, c, cti_c, offs_s, t0, CONTIG)
            xs = tl.load(xb + rows_s[:, None] * x_t + offs_p[None, :] * x_p,
                         mask=(offs_s < clen)[:, None] & mp[None, :], other=0.0)
            acc = tl.dot(scores.to(cdt), xs.to(cdt), acc=acc, input_precision=IP)

        mo = mm[:, None] & mp[None, :]
        xm = tl.load(xb + rows_m[:, None] * x_t + offs_p[None, :] * x_p, mask=mo, other=0.0)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm.to(tl.float32)
        yb = y_ptr + t0 * y_t + h * y_h
        tl.store(yb + rows_m[:, None] * y_t + offs_p[None, :] * y_p,
                 acc.to(y_ptr.dtype.element_ty), mask=mo)


def _pow2_at_most(v: int, hi: int) -> int:
    return min(hi, max(16, triton.next_power_of_2(v)))


def _check_block(name: str, v: int, hi: int | None = None):
    assert v >= 16 and v & (v - 1) == 0, f"{name} must be a power of two >= 16, got {v}"
    assert hi is None or v <= hi, f"{name} must be <= {hi}, got {v}"


class SsdScan:
    """One chunked scan: its inputs checked, launch parameters resolved (`tuning` entry "ssd",
    None knobs from the shapes) and buffers allocated on construction; `launches` are the four
    launches in the order they must run, and `run()` makes them all.

    Arguments as `mambaserve.ops.ssd.ssd_chunk_scan_varlen`, plus `contiguous_chunks`: True
    (default) assumes each chunk's tokens are consecutive in the stream (true of every
    build_metadata plan) and addresses them from the chunk's first token; False gathers each
    token through chunk_token_idx (any plan).
    """

    def __init__(self, x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                 has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks, row_num_chunks,
                 chunk_snap_dst=None, *, contiguous_chunks: bool = True):
        T, H, P = x.shape
        G, N = B.shape[1], B.shape[2]
        num_chunks, L = chunk_token_idx.shape
        R = row_chunks.shape[0]
        assert dt.shape == (T, H) and B.shape == (T, G, N) and C.shape == (T, G, N)
        assert A.shape == (H,) and D.shape == (H,) and dt_bias.shape == (H,)
        assert A.is_contiguous() and D.is_contiguous() and dt_bias.is_contiguous()
        assert H % G == 0, "heads must split evenly over groups"
        assert ssm_state.shape[1:] == (H, P, N), (ssm_state.shape, x.shape, B.shape)
        assert state_slots.shape == (R,) and has_initial_state.shape == (R,)
        assert row_num_chunks.shape == (R,) and token_chunk_pos.shape == (T,)
        assert L >= 16 and L & (L - 1) == 0, "chunk_size must be a power of two >= 16"
        if chunk_snap_dst is not None:
            assert chunk_snap_dst.shape == (num_chunks,), "chunk_snap_dst: one entry per chunk"
            assert ssm_state[0, 0].is_contiguous(), "snapshots need each head's [P, N] contiguous"
        for t in (state_slots, has_initial_state, chunk_token_idx, row_chunks, row_num_chunks,
                  chunk_snap_dst):
            assert t is None or t.is_contiguous()
        self.chunk_snap_dst = chunk_snap_dst
        self.x, self.dt, self.A, self.B, self.C, self.D = x, dt, A, B, C, D
        self.dt_bias, self.ssm_state, self.state_slots = dt_bias, ssm_state, state_slots
        self.has_initial_state, self.chunk_token_idx = has_initial_state, chunk_token_idx
        self.row_chunks, self.row_num_chunks = row_chunks, row_num_chunks
        self.contig = bool(contiguous_chunks)
        self.T, self.H, self.P, self.N, self.G, self.L, self.R = T, H, P, N, G, L, R
        self.num_chunks = num_chunks
        self.dt_lo, self.dt_hi = float(dt_limit[0]), float(dt_limit[1])

        k = tuning.config("ssd", x.device)
        self.bh = k["block_h_dt"] or min(32, triton.next_power_of_2(H))
        self.warps_dt = k["num_warps_dt"]
        self.bps = k["block_p_state"]
        self.bns = k["block_n_state"] or _pow2_at_most(N, 128)
        self.bls = k["block_l_state"] or L
        self.warps_state, self.stages_state = k["num_warps_state"], k["num_stages_state"]
        self.bcb = k["block_cb"] or min(L, 64)
        self.bkcb = k["block_k_cb"] or _pow2_at_most(N, 128)
        self.warps_cb = k["num_warps_cb"]
        self.bm = k["block_m_scan"] or min(L, 64)
        self.bpc = k["block_p_scan"] or _pow2_at_most(P, 128)
        self.bk = k["block_k_scan"]
        self.bnc = k["block_n_scan"] or _pow2_at_most(N, 128)
        self.warps_scan, self.stages_scan = k["num_warps_scan"], k["num_stages_scan"]
        for name, v, hi in (("block_p_state", self.bps, None), ("block_n_state", self.bns, None),
                            ("block_l_state", self.bls, L), ("block_cb", self.bcb, L),
                            ("block_k_cb", self.bkcb, None), ("block_m_scan", self.bm, L),
                            ("block_p_scan", self.bpc, None), ("block_k_scan", self.bk, L),
                            ("block_n_scan", self.bnc, None)):
            _check_block(name, v, hi)
        self.ip = "ieee" if x.dtype == torch.float32 else "tf32"
        self.cdt = tl.float32 if x.dtype == torch.float32 else (
            tl.float16 if x.dtype == torch.float16 else tl.bfloat16)

        dev = x.device
        self.y = torch.empty((T, H, P), dtype=x.dtype, device=dev)
        # chunk end states, then one initial state per row (written by S for rows that use one),
        # in x's dtype: launch C uses them only as dot operands of that dtype, so rounding them
        # when they are stored changes no output and halves their bytes for 16-bit x
        self.states = torch.empty((num_chunks + R, H, P, N), dtype=x.dtype, device=dev)
        self.empty = num_chunks == 0 or T == 0
        if self.empty:
            return
        f32 = {"dtype": torch.float32, "device": dev}
        self.dt_c = torch.empty((num_chunks, H, L), **f32)
        self.cum = torch.empty((num_chunks, H, L), **f32)
        self.clen = torch.empty((num_chunks,), dtype=torch.int32, device=dev)
        self.chunk_src = torch.empty((num_chunks,), dtype=torch.int64, device=dev)
        self.cb = torch.empty((num_chunks, G, L, L), **f32)

    @property
    def launches(self) -> tuple[tuple[str, object], ...]:
        """(name, launch) pairs in the order they must run; none for an empty batch."""
        if self.empty:
            return ()
        return (("dt", self.launch_dt), ("state", self.launch_state), ("cb", self.launch_cb),
                ("scan", self.launch_scan))

    def run(self) -> torch.Tensor:
        """Every launch in order; returns y."""
        for _, launch in self.launches:
            launch()
        return self.y

    def launch_dt(self) -> None:
        """0: dt = clamp(softplus(dt + dt_bias)) and cum = cumsum(dt A) per chunk, chunk lengths."""
        cti, dt = self.chunk_token_idx, self.dt
        _chunk_dt_kernel[(triton.cdiv(self.H, self.bh), self.num_chunks)](
            cti, dt, self.dt_bias, self.A, self.dt_c, self.cum, self.clen,
            self.T, self.H, self.dt_lo, self.dt_hi, cti.stride(0), *dt.stride(),
            L=self.L, BLOCK_H=self.bh, num_warps=self.warps_dt,
        )

    def launch_state(self) -> None:
        """S: every chunk's end state, each row's final state into its slot, the snapshots."""
        x, B, cti, ssm = self.x, self.B, self.chunk_token_idx, self.ssm_state
        P, N = self.P, self.N
        _chunk_state_passing_kernel[(triton.cdiv(P, self.bps) * triton.cdiv(N, self.bns),
                                     self.H, self.R)](
            x, B, cti, self.dt_c, self.cum, self.clen, self.states, self.chunk_src,
            ssm, self.state_slots, self.has_initial_state, self.row_chunks, self.row_num_chunks,
            self.chunk_snap_dst if self.chunk_snap_dst is not None else self.row_num_chunks,
            self.num_chunks, self.H, P, N, self.H // self.G,
            *x.stride(), *B.stride(), cti.stride(0), *ssm.stride(), self.row_chunks.stride(0),
            L=self.L, BLOCK_P=self.bps, BLOCK_N=self.bns, BLOCK_L=self.bls, IP=self.ip,
            CONTIG=self.contig, SNAPS=self.chunk_snap_dst is not None,
            num_warps=self.warps_state, num_stages=self.stages_state,
        )

    def launch_cb(self) -> None:
        """CB: C·Bᵀ per chunk and group (lower-triangle tiles)."""
        B, C, cti = self.B, self.C, self.chunk_token_idx
        nb = self.L // self.bcb
        _chunk_cb_kernel[(nb * (nb + 1) // 2, self.G, self.num_chunks)](
            B, C, cti, self.clen, self.cb,
            self.G, self.N, *B.stride(), *C.stride(), cti.stride(0),
            L=self.L, BLOCK=self.bcb, BLOCK_K=self.bkcb, IP=self.ip, CDT=self.cdt,
            CONTIG=self.contig, num_warps=self.warps_cb,
        )

    def launch_scan(self) -> None:
        """C: the output tiles, y = inter-chunk + intra-chunk terms + D x."""
        x, C, y, cti = self.x, self.C, self.y, self.chunk_token_idx
        _chunk_scan_kernel[(triton.cdiv(self.L, self.bm) * triton.cdiv(self.P, self.bpc), self.H,
                            self.num_chunks)](
            x, C, self.D, cti, self.dt_c, self.cum, self.clen, self.cb, self.states,
            self.chunk_src, y,
            self.H, self.P, self.N, self.G, self.H // self.G,
            *x.stride(), *C.stride(), *y.stride(), cti.stride(0),
            L=self.L, BLOCK_M=self.bm, BLOCK_P=self.bpc, BLOCK_K=self.bk, BLOCK_N=self.bnc,
            IP=self.ip, CONTIG=self.contig, ONE_N_BLOCK=self.bnc >= self.N,
            num_warps=self.warps_scan, num_stages=self.stages_scan,
        )


def ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                                 has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks,
                                 row_num_chunks, chunk_snap_dst=None, *,
                                 contiguous_chunks: bool = True):
    """Same contract as `mambaserve.ops.ssd.ssd_chunk_scan_varlen` (`contiguous_chunks`: see
    `SsdScan`)."""
    return SsdScan(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                   has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks, row_num_chunks,
                   chunk_snap_dst, contiguous_chunks=contiguous_chunks).run()
