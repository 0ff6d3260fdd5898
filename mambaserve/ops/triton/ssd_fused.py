"""Device code of the fused SSD launch (F): the chunk-state walk of launch S and the output tiles
of launches CB and C in one program per (head, row), which walks the row's chunks in order with
the head's whole [N, P] state in registers (float32). Per chunk: C·Bᵀ, the output rows (state
term, causal intra-chunk term, D x) and the state update, all from tiles loaded once: no chunk
end states are stored for another launch and no C·Bᵀ buffer is written or read. `ssd.py`
(`SsdScan`, tuning knob `fused`) launches it after launch 0 (dt); docs/kernels.md, "SSD chunked
scan", has the trade-off against the four-launch path.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fused_load_state(s_base, offs_n, offs_p, mn, mp, s_p, s_n, use_init):
    """The head's [N, columns] state tile from its pool slot (zeros without an initial state),
    float32."""
    return tl.load(s_base + offs_n[:, None] * s_n + offs_p[None, :] * s_p,
                   mask=mn[:, None] & mp[None, :] & use_init, other=0.0).to(tl.float32)


@triton.jit
def _fused_store_state(s_base, S, offs_n, offs_p, mn, mp, s_p, s_n, on):
    tl.store(s_base + offs_n[:, None] * s_n + offs_p[None, :] * s_p,
             S.to(s_base.dtype.element_ty), mask=mn[:, None] & mp[None, :] & on)


@triton.jit
def _fused_store_y(y_base, y, xm, d, rows, ml, offs_p, mp, y_t, y_p):
    """y + D x for one row block and column tile."""
    y += d * xm.to(tl.float32)
    tl.store(y_base + rows[:, None] * y_t + offs_p[None, :] * y_p, y.to(y_base.dtype.element_ty),
             mask=ml[:, None] & mp[None, :])


@triton.jit
def _fused_block(base, t_stride, c_stride, rows, ml, offs_c, mc, cdt: tl.constexpr):
    """A [positions, columns] tile of B or C (one group) or x (one head), in the dot dtype
    (positions past the chunk read 0)."""
    return tl.load(base + rows[:, None] * t_stride + offs_c[None, :] * c_stride,
                   mask=ml[:, None] & mc[None, :], other=0.0).to(cdt)


@triton.jit(do_not_specialize=["rc_r"])
def _chunk_fused_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, cti_ptr, dtc_ptr, cum_ptr, clen_ptr, y_ptr,
    ssm_ptr, slot_ptr, init_ptr, row_chunks_ptr, nchunks_ptr, snap_ptr,
    H, P, N, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n, C_t, C_g, C_n, y_t, y_h, y_p, cti_c,
    s_slot, s_h, s_p, s_n, rc_r,
    L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_P2: tl.constexpr, IP: tl.constexpr, SNAPS: tl.constexpr,
):
    """Launch F: head h of row r over the row's chunks (consecutive tokens each, `row_chunks`
    order), the state as [N, P] tiles in registers: from the row's slot when it has an initial
    state (else zero), into a chunk's snapshot slot at its end (SNAPS: snap_ptr holds each
    chunk's slot or -1), into the row's slot at the end (not for a negative slot). A chunk runs
    in blocks of BLOCK_M positions: each row block's output from the state at the chunk's start
    and from the source blocks up to it (C·Bᵀ of each block pair computed there), then the state
    update over the source blocks. BLOCK_P2 > 0: a second column tile [BLOCK_P, BLOCK_P +
    BLOCK_P2) (a head_dim that is not a power of two), sharing every C·Bᵀ block and decay."""
    h = tl.program_id(0)
    r = tl.program_id(1)
    g = h // heads_per_group
    cdt = x_ptr.dtype.element_ty
    NB: tl.constexpr = L // BLOCK_M
    offs_b = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    mn = offs_n < N
    mp = offs_p < P
    slot = tl.load(slot_ptr + r).to(tl.int64)
    valid = slot >= 0
    use_init = valid & (tl.load(init_ptr + r) != 0)
    s_base = ssm_ptr + tl.maximum(slot, 0) * s_slot + h * s_h
    S = _fused_load_state(s_base, offs_n, offs_p, mn, mp, s_p, s_n, use_init)
    if BLOCK_P2 > 0:
        offs_p2 = BLOCK_P + tl.arange(0, BLOCK_P2)
        mp2 = offs_p2 < P
        S2 = _fused_load_state(s_base, offs_n, offs_p2, mn, mp2, s_p, s_n, use_init)
    d = tl.load(D_ptr + h).to(tl.float32)
    for i in range(tl.load(nchunks_ptr + r)):
        cid = tl.load(row_chunks_ptr + r * rc_r + i).to(tl.int64)
        t0 = tl.load(cti_ptr + cid * cti_c)
        clen = tl.load(clen_ptr + cid)
        ch = (cid * H + h) * L
        cum_last = tl.load(cum_ptr + ch + L - 1)
        x_base = x_ptr + t0 * x_t + h * x_h
        y_base = y_ptr + t0 * y_t + h * y_h
        Cg = C_ptr + t0 * C_t + g * C_g
        Bg = B_ptr + t0 * B_t + g * B_g
        Sd = S.to(cdt)  # the chunk's start state as a dot operand
        if BLOCK_P2 > 0:
            Sd2 = S2.to(cdt)
        for rb in range(NB):
            offs_m = rb * BLOCK_M + offs_b
            mm = offs_m < clen
            rows_m = tl.minimum(offs_m, clen - 1)  # past the chunk: its last token, masked
            cum_m = tl.load(cum_ptr + ch + offs_m)
            Cm = _fused_block(Cg, C_t, C_n, rows_m, mm, offs_n, mn, cdt)
            decay_m = tl.exp(cum_m)[:, None]
            y = tl.dot(Cm, Sd, input_precision=IP) * decay_m
            if BLOCK_P2 > 0:
                y2 = tl.dot(Cm, Sd2, input_precision=IP) * decay_m
            for sb in range(rb + 1):
                offs_s = sb * BLOCK_M + offs_b
                ms = offs_s < clen
                rows_s = tl.minimum(offs_s, clen - 1)
                cum_s = tl.load(cum_ptr + ch + offs_s)
                dt_s = tl.load(dtc_ptr + ch + offs_s)
                Bs = _fused_block(Bg, B_t, B_n, rows_s, ms, offs_n, mn, cdt)
                cb = tl.dot(Cm, tl.trans(Bs), input_precision=IP)
                sc = cb * tl.exp(cum_m[:, None] - cum_s[None, :]) * dt_s[None, :]
                # sources after the row (the diagonal block's upper part) dropped, any inf too
                sc = tl.where(offs_s[None, :] <= offs_m[:, None], sc, 0.0)
                sc = sc.to(cdt)
                xs = _fused_block(x_base, x_t, x_p, rows_s, ms, offs_p, mp, cdt)
                y = tl.dot(sc, xs, acc=y, input_precision=IP)
                if BLOCK_P2 > 0:
                    xs2 = _fused_block(x_base, x_t, x_p, rows_s, ms, offs_p2, mp2, cdt)
                    y2 = tl.dot(sc, xs2, acc=y2, input_precision=IP)
            xm = _fused_block(x_base, x_t, x_p, rows_m, mm, offs_p, mp, cdt)
            _fused_store_y(y_base, y, xm, d, rows_m, mm, offs_p, mp, y_t, y_p)
            if BLOCK_P2 > 0:
                xm2 = _fused_block(x_base, x_t, x_p, rows_m, mm, offs_p2, mp2, cdt)
                _fused_store_y(y_base, y2, xm2, d, rows_m, mm, offs_p2, mp2, y_t, y_p)
        # the state past the chunk: S exp(cum_last) + Σ_s Bᵀ (x ∘ dt ∘ exp(cum_last - cum))
        chunk_decay = tl.exp(cum_last)
        S = S * chunk_decay
        if BLOCK_P2 > 0:
            S2 = S2 * chunk_decay
        for sb in range(NB):
            offs_s = sb * BLOCK_M + offs_b
            ms = offs_s < clen
            rows_s = tl.minimum(offs_s, clen - 1)
            w = tl.load(dtc_ptr + ch + offs_s) * tl.exp(cum_last - tl.load(cum_ptr + ch + offs_s))
            Bt = tl.trans(_fused_block(Bg, B_t, B_n, rows_s, ms, offs_n, mn, cdt))
            xs = _fused_block(x_base, x_t, x_p, rows_s, ms, offs_p, mp, cdt)
            S = tl.dot(Bt, (xs.to(tl.float32) * w[:, None]).to(cdt), acc=S, input_precision=IP)
            if BLOCK_P2 > 0:
                xs2 = _fused_block(x_base, x_t, x_p, rows_s, ms, offs_p2, mp2, cdt)
                S2 = tl.dot(Bt, (xs2.to(tl.float32) * w[:, None]).to(cdt), acc=S2,
                            input_precision=IP)
        if SNAPS:  # a prefix-cache snapshot at this chunk's end
            dst = tl.load(snap_ptr + cid)
            if dst >= 0:
                snap = ssm_ptr + dst * s_slot + h * s_h
                _fused_store_state(snap, S, offs_n, offs_p, mn, mp, s_p, s_n, True)
                if BLOCK_P2 > 0:
                    _fused_store_state(snap, S2, offs_n, offs_p2, mn, mp2, s_p, s_n, True)
    _fused_store_state(s_base, S, offs_n, offs_p, mn, mp, s_p, s_n, valid)
    if BLOCK_P2 > 0:
        _fused_store_state(s_base, S2, offs_n, offs_p2, mn, mp2, s_p, s_n, valid)
