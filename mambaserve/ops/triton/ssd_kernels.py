"""Device code of the Triton SSD (Mamba2) chunked scan: the four launches' kernels and their
helpers. `ssd.py` (`SsdScan`) resolves their launch parameters, allocates their buffers and
launches them in order; the algorithm, grids and buffers are described in docs/kernels.md ("SSD
chunked scan").
"""

from __future__ import annotations

import triton
import triton.language as tl

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
def _decay_weights(dt, cum, cum_last):
    """dt ∘ exp(cum[L-1] - cum): the state update's token weights."""
    return dt * tl.exp(cum_last - cum)


@triton.jit
def _chunk_weights(dtc_ptr, cum_ptr, ch, cum_last, offs_l):
    """The weights (`_decay_weights`) of chunk positions offs_l, loaded here."""
    return _decay_weights(tl.load(dtc_ptr + ch + offs_l), tl.load(cum_ptr + ch + offs_l), cum_last)


@triton.jit
def _chunk_decay(dtc_ptr, cum_ptr, ch, L: tl.constexpr):
    """A whole chunk's dt and cumsum(dt·A), and the cumsum's last entry (the state's decay over
    the chunk): launch S's weights, loaded a chunk ahead (PREFETCH)."""
    offs_l = tl.arange(0, L)
    return (tl.load(dtc_ptr + ch + offs_l), tl.load(cum_ptr + ch + offs_l),
            tl.load(cum_ptr + ch + L - 1))


@triton.jit
def _weighted(x, w):
    """x [columns, positions] times the positions' weights, in x's dtype (a dot operand)."""
    return (x.to(tl.float32) * w[None, :]).to(x.dtype)


@triton.jit
def _chunk_state_operands(x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, c, t0, clen, ch, cum_last, h,
                          g, l0, offs_p, offs_n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, cti_c,
                          BLOCK_L: tl.constexpr, CONTIG: tl.constexpr):
    """The dot operands of chunk positions [l0, l0 + BLOCK_L) for one state tile: x ∘ dt ∘
    exp(cum[L-1] - cum) [BLOCK_P, BLOCK_L] in x's dtype and B [BLOCK_L, BLOCK_N] (positions past
    the chunk's length read as 0); also the positions' token rows (relative to t0), which of them
    are in the chunk, and their weights, for a second tile's x (`_weighted_x`)."""
    offs_l = l0 + tl.arange(0, BLOCK_L)
    ml = offs_l < clen
    if CONTIG:  # clamped to the chunk: the offset tiles depend on the chunk, so they are not
        rows = tl.minimum(offs_l, clen - 1)  # hoisted out of the chunk loop and kept live
    else:
        rows = _chunk_rows(cti_ptr, c, cti_c, offs_l, t0, CONTIG)
    w = _chunk_weights(dtc_ptr, cum_ptr, ch, cum_last, offs_l)
    x = tl.load(x_ptr + t0 * x_t + h * x_h + rows[None, :] * x_t + offs_p[:, None] * x_p,
                mask=mp[:, None] & ml[None, :], other=0.0)
    Bm = tl.load(B_ptr + t0 * B_t + g * B_g + rows[:, None] * B_t + offs_n[None, :] * B_n,
                 mask=ml[:, None] & mn[None, :], other=0.0)
    # both tiles loaded before x is weighted: weighting first (`_weighted_x`) delays B's load
    # and spills registers in the snapshot variant (offline sm_90 compile)
    return _weighted(x, w), Bm.to(x_ptr.dtype.element_ty), rows, ml, w


@triton.jit
def _weighted_x(x_ptr, t0, h, rows, ml, w, offs_p, mp, x_t, x_h, x_p):
    """x ∘ w [columns offs_p of head h, chunk positions] in x's dtype: a state tile's dot
    operand."""
    x = tl.load(x_ptr + t0 * x_t + h * x_h + rows[None, :] * x_t + offs_p[:, None] * x_p,
                mask=mp[:, None] & ml[None, :], other=0.0)
    return _weighted(x, w)


@triton.jit
def _chunk_tile(ptr, t0, clen, col, offs_c, mc, t_stride, c_stride, L: tl.constexpr,
                ROWS_FIRST: tl.constexpr):
    """A whole chunk's tile as stored (contiguous chunks; positions past clen read 0): x as
    [columns, L] (ROWS_FIRST False) or B as [L, columns]; loaded a chunk ahead (PREFETCH)."""
    offs_l = tl.arange(0, L)
    ml = offs_l < clen
    rows = tl.minimum(offs_l, tl.maximum(clen - 1, 0))
    base = ptr + t0 * t_stride + col
    if ROWS_FIRST:
        return tl.load(base + rows[:, None] * t_stride + offs_c[None, :] * c_stride,
                       mask=ml[:, None] & mc[None, :], other=0.0)
    else:
        return tl.load(base + rows[None, :] * t_stride + offs_c[:, None] * c_stride,
                       mask=mc[:, None] & ml[None, :], other=0.0)


@triton.jit(do_not_specialize=["num_chunks", "rc_r"])
def _chunk_state_passing_kernel(
    x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, clen_ptr, st_ptr, src_ptr,
    ssm_ptr, slot_ptr, init_ptr, row_chunks_ptr, nchunks_ptr, snap_ptr,
    num_chunks, H, P, N, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n, cti_c, s_slot, s_h, s_p, s_n, rc_r,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, IP: tl.constexpr, CONTIG: tl.constexpr, SNAPS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Launch S (docs/kernels.md): walks one row's chunks in order for a [BLOCK_P, BLOCK_N]
    tile of one head's state, S = S_prev * exp(cum[L-1]) + (x ∘ dt ∘ exp(cum[L-1] - cum))ᵀ · B,
    keeping S in registers (float32); each chunk's end state is stored once in the state
    buffer's dtype (x's: the output launch's dot operand), and in the pool's dtype into the
    snapshot slot of a chunk that has one (SNAPS: snap_ptr holds each chunk's slot or -1).
    BLOCK_P2 > 0: a second tile of rows [BLOCK_P, BLOCK_P + BLOCK_P2) in the same program (a
    head_dim that is not a power of two), sharing each chunk's B tile and weights.
    PREFETCH (contiguous chunks, BLOCK_L = L): the next chunk's x and B tiles are loaded before
    this chunk's dot (and the ids of the chunk after it), so their latency overlaps its work."""
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
    if BLOCK_P2 > 0:
        offs_p2 = BLOCK_P + tl.arange(0, BLOCK_P2)
        mp2 = offs_p2 < P
        mpn2 = mp2[:, None] & mn[None, :]
        st_off2 = offs_p2[:, None] * N + offs_n[None, :]
        s_off2 = offs_p2[:, None] * s_p + offs_n[None, :] * s_n
        running2 = tl.load(s_base + s_off2, mask=mpn2 & use_init, other=0.0).to(tl.float32)
        tl.store(st_ptr + (init_id * H + h) * PN + st_off2, running2.to(st_dt),
                 mask=mpn2 & use_init)
    writer = (h == 0) & (tl.program_id(0) == 0)  # one program per row records the sources
    prev = tl.where(use_init, init_id, -1)
    nck = tl.load(nchunks_ptr + r)
    # the next chunk's id, first token and length are loaded one iteration ahead
    cid = tl.load(row_chunks_ptr + r * rc_r).to(tl.int64)
    t0 = tl.load(cti_ptr + cid * cti_c)
    clen = tl.load(clen_ptr + cid)
    # a graph bucket's empty padding row (one chunk without tokens, so that every row's first
    # chunk above is a real index) has nothing to pass: launch C reads neither that chunk's
    # source nor its end state, and the row's slot is the scratch one (-1)
    nck = tl.where((nck == 1) & (clen == 0), 0, nck)
    cdt = x_ptr.dtype.element_ty
    if PREFETCH:  # this chunk's tiles, and the next chunk's id, first token and length
        xr = _chunk_tile(x_ptr, t0, clen, h * x_h, offs_p, mp, x_t, x_p, L, False)
        if BLOCK_P2 > 0:
            xr2 = _chunk_tile(x_ptr, t0, clen, h * x_h, offs_p2, mp2, x_t, x_p, L, False)
        Br = _chunk_tile(B_ptr, t0, clen, g * B_g, offs_n, mn, B_t, B_n, L, True)
        if not SNAPS:  # (with snapshots their registers would spill more: loaded in the loop)
            dtr, cumr, cum_last = _chunk_decay(dtc_ptr, cum_ptr, (cid * H + h) * L, L)
        more = 1 < nck
        cid_n = tl.load(row_chunks_ptr + r * rc_r + 1, mask=more, other=0).to(tl.int64)
        t0_n = tl.load(cti_ptr + cid_n * cti_c, mask=more, other=0)
        clen_n = tl.load(clen_ptr + cid_n, mask=more, other=0)
    for i in range(nck):
        tl.store(src_ptr + cid, prev, mask=writer)
        ch = (cid * H + h) * L
        if not (PREFETCH and not SNAPS):  # else loaded an iteration ago, with the tiles
            cum_last = tl.load(cum_ptr + ch + L - 1)
        if SNAPS:  # the chunk's snapshot slot, loaded before the dot hides its latency
            dst = tl.load(snap_ptr + cid)
        if PREFETCH:  # the next chunk's tiles (none past the row: clen_n = 0), then this dot
            xn = _chunk_tile(x_ptr, t0_n, clen_n, h * x_h, offs_p, mp, x_t, x_p, L, False)
            if BLOCK_P2 > 0:
                xn2 = _chunk_tile(x_ptr, t0_n, clen_n, h * x_h, offs_p2, mp2, x_t, x_p, L, False)
            Bn = _chunk_tile(B_ptr, t0_n, clen_n, g * B_g, offs_n, mn, B_t, B_n, L, True)
            if not SNAPS:
                dtn, cumn, cum_last_n = _chunk_decay(dtc_ptr, cum_ptr, (cid_n * H + h) * L, L)
            more2 = i + 2 < nck
            cid_nn = tl.load(row_chunks_ptr + r * rc_r + i + 2, mask=more2, other=0).to(tl.int64)
            t0_nn = tl.load(cti_ptr + cid_nn * cti_c, mask=more2, other=0)
            clen_nn = tl.load(clen_ptr + cid_nn, mask=more2, other=0)
            if SNAPS:
                w = _chunk_weights(dtc_ptr, cum_ptr, ch, cum_last, tl.arange(0, L))
            else:
                w = _decay_weights(dtr, cumr, cum_last)
            Bm = Br.to(cdt)
            loc = tl.dot(_weighted(xr, w), Bm, input_precision=IP)
            if BLOCK_P2 > 0:
                loc2 = tl.dot(_weighted(xr2, w), Bm, input_precision=IP)
        elif BLOCK_L == L:  # the whole chunk in one dot, no loop
            xw, Bm, rows, ml, w = _chunk_state_operands(
                x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, cid, t0, clen, ch, cum_last, h, g, 0,
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
                    x_ptr, B_ptr, cti_ptr, dtc_ptr, cum_ptr, cid, t0, clen, ch, cum_last, h, g,
                    l0, offs_p, offs_n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, cti_c, BLOCK_L,
                    CONTIG)
                loc = tl.dot(xw, Bm, acc=loc, input_precision=IP)
                if BLOCK_P2 > 0:
                    loc2 = tl.dot(_weighted_x(x_ptr, t0, h, rows, ml, w, offs_p2, mp2, x_t, x_h,
                                              x_p), Bm, acc=loc2, input_precision=IP)
        if PREFETCH:  # the next chunk's ids were loaded an iteration ago
            nxt, t0_next, clen_next = cid_n, t0_n, clen_n
            cid_n, t0_n, clen_n = cid_nn, t0_nn, clen_nn
            xr, Br = xn, Bn
            if BLOCK_P2 > 0:
                xr2 = xn2
        else:
            more = i + 1 < nck
            nxt = tl.load(row_chunks_ptr + r * rc_r + i + 1, mask=more, other=0).to(tl.int64)
            t0_next = tl.load(cti_ptr + nxt * cti_c, mask=more, other=0)
            clen_next = tl.load(clen_ptr + nxt, mask=more, other=0)
        running = running * tl.exp(cum_last) + loc
        tl.store(st_ptr + (cid * H + h) * PN + st_off, running.to(st_dt), mask=mpn)
        if BLOCK_P2 > 0:
            running2 = running2 * tl.exp(cum_last) + loc2
            tl.store(st_ptr + (cid * H + h) * PN + st_off2, running2.to(st_dt), mask=mpn2)
        if PREFETCH and not SNAPS:  # the next chunk's dt and cumsum, loaded before its dot
            dtr, cumr, cum_last = dtn, cumn, cum_last_n
        if SNAPS:  # a prefix-cache snapshot at this chunk's end (a slot's heads are contiguous
            if dst >= 0:  # [P, N]: the state buffer's offsets, no tile of its own)
                tl.store(ssm_ptr + dst * s_slot + h * s_h + st_off,
                         running.to(ssm_ptr.dtype.element_ty), mask=mpn)
                if BLOCK_P2 > 0:
                    tl.store(ssm_ptr + dst * s_slot + h * s_h + st_off2,
                             running2.to(ssm_ptr.dtype.element_ty), mask=mpn2)
        prev = cid
        cid = nxt
        t0 = t0_next
        clen = clen_next
    tl.store(s_base + s_off, running.to(ssm_ptr.dtype.element_ty), mask=mpn & valid)
    if BLOCK_P2 > 0:
        tl.store(s_base + s_off2, running2.to(ssm_ptr.dtype.element_ty), mask=mpn2 & valid)


@triton.jit
def _grid_chunk(list_ptr, LISTED: tl.constexpr):
    """The grid's third index, or (LISTED) the chunk list's entry there (`SsdScan` out_chunks)."""
    if LISTED:
        return tl.load(list_ptr + tl.program_id(2)).to(tl.int64)
    return tl.program_id(2).to(tl.int64)


@triton.jit
def _chunk_cb_kernel(
    B_ptr, C_ptr, cti_ptr, clen_ptr, cb_ptr, list_ptr,
    G, N, B_t, B_g, B_n, C_t, C_g, C_n, cti_c,
    L: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, IP: tl.constexpr,
    CDT: tl.constexpr, CONTIG: tl.constexpr, LISTED: tl.constexpr,
):
    t = tl.program_id(0)  # lower-triangle tile t -> (i, j), j <= i
    i = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)  # guard the float rounding
    i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
    j = t - i * (i + 1) // 2
    g = tl.program_id(1)
    c = _grid_chunk(list_ptr, LISTED)
    clen = tl.load(clen_ptr + c)
    t0 = tl.load(cti_ptr + c * cti_c)  # beside the length, not after the branch on it
    if i * BLOCK < clen:  # tiles of padding rows are never read
        offs_m = i * BLOCK + tl.arange(0, BLOCK)
        offs_s = j * BLOCK + tl.arange(0, BLOCK)
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
def _scan_state_term(acc, Cm, s_base, offs_p, mp, offs_k, mk, N, cdt: tl.constexpr,
                     IP: tl.constexpr):
    """acc + C · S_start for the columns offs_p of the head's [P, N] start state."""
    S = tl.load(s_base + offs_p[None, :] * N + offs_k[:, None],
                mask=mk[:, None] & mp[None, :], other=0.0)  # [BLOCK_N, columns]
    return tl.dot(Cm.to(cdt), S.to(cdt), acc=acc, input_precision=IP)


@triton.jit
def _scan_store(acc, xb, yb, rows_m, mm, offs_p, mp, d, x_t, x_p, y_t, y_p):
    """y = acc + D x for the tile's rows and columns offs_p."""
    mo = mm[:, None] & mp[None, :]
    xm = tl.load(xb + rows_m[:, None] * x_t + offs_p[None, :] * x_p, mask=mo, other=0.0)
    acc += d * xm.to(tl.float32)
    tl.store(yb + rows_m[:, None] * y_t + offs_p[None, :] * y_p,
             acc.to(yb.dtype.element_ty), mask=mo)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, C_ptr, D_ptr, cti_ptr, dtc_ptr, cum_ptr, clen_ptr, cb_ptr, st_ptr, src_ptr, y_ptr,
    list_ptr, H, P, N, G, heads_per_group,
    x_t, x_h, x_p, C_t, C_g, C_n, y_t, y_h, y_p, cti_c,
    L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_P2: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, IP: tl.constexpr, CONTIG: tl.constexpr,
    ONE_N_BLOCK: tl.constexpr, LISTED: tl.constexpr,
):
    """Launch C (docs/kernels.md): one [BLOCK_M, BLOCK_P] output tile of one head and chunk.
    BLOCK_P2 > 0: a head_dim that is not a power of two (the 9B's 80 = 64 + 16) in one program
    of two column tiles, [0, BLOCK_P) and [BLOCK_P, BLOCK_P + BLOCK_P2), that share the C loads
    and each source block's scores, instead of one tile padded to the next power of two."""
    if BLOCK_P2 > 0:
        num_pb = 1
    else:
        num_pb = tl.cdiv(P, BLOCK_P)
    mb = tl.program_id(0) // num_pb  # the P blocks of one row tile run next to each other
    pb = tl.program_id(0) % num_pb
    h = tl.program_id(1)
    c = _grid_chunk(list_ptr, LISTED)
    g = h // heads_per_group
    cdt = x_ptr.dtype.element_ty
    clen = tl.load(clen_ptr + c)
    # the chunk's first token and start-state source, loaded beside its length rather than after
    # the branch on it (one L2 round trip fewer before the first dot)
    t0 = tl.load(cti_ptr + c * cti_c)
    src = tl.load(src_ptr + c)
    m0 = mb * BLOCK_M
    if m0 < clen:  # row tiles made only of padding store nothing
        ch = (c * H + h) * L
        xb = x_ptr + t0 * x_t + h * x_h
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        mm = offs_m < clen
        mp = offs_p < P
        rows_m = _chunk_rows(cti_ptr, c, cti_c, offs_m, t0, CONTIG)
        cum_m = tl.load(cum_ptr + ch + offs_m)
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        if BLOCK_P2 > 0:
            offs_p2 = BLOCK_P + tl.arange(0, BLOCK_P2)
            mp2 = offs_p2 < P
            acc2 = tl.zeros((BLOCK_M, BLOCK_P2), dtype=tl.float32)

        # inter-chunk: exp(cum[l]) * C[l] . S_start[p]; S_start is the previous chunk's end state,
        # the row's initial state (both in st_ptr), or zero (src < 0: skipped)
        if src >= 0:
            s_base = st_ptr + (src * H + h) * P * N
            Cb = C_ptr + t0 * C_t + g * C_g
            if ONE_N_BLOCK:  # one dot, no loop (a constexpr: a loop in a branch the launch
                offs_k = tl.arange(0, BLOCK_N)  # never takes still gets pipelined buffers)
                mk = offs_k < N
                Cm = tl.load(Cb + rows_m[:, None] * C_t + offs_k[None, :] * C_n,
                             mask=mm[:, None] & mk[None, :], other=0.0)
                acc = _scan_state_term(acc, Cm, s_base, offs_p, mp, offs_k, mk, N, cdt, IP)
                if BLOCK_P2 > 0:
                    acc2 = _scan_state_term(acc2, Cm, s_base, offs_p2, mp2, offs_k, mk, N, cdt,
                                            IP)
            else:
                for k0 in range(0, N, BLOCK_N):
                    offs_k = k0 + tl.arange(0, BLOCK_N)
                    mk = offs_k < N
                    Cm = tl.load(Cb + rows_m[:, None] * C_t + offs_k[None, :] * C_n,
                                 mask=mm[:, None] & mk[None, :], other=0.0)
                    acc = _scan_state_term(acc, Cm, s_base, offs_p, mp, offs_k, mk, N, cdt, IP)
                    if BLOCK_P2 > 0:
                        acc2 = _scan_state_term(acc2, Cm, s_base, offs_p2, mp2, offs_k, mk, N,
                                                cdt, IP)
            acc = acc * tl.exp(cum_m)[:, None]
            if BLOCK_P2 > 0:
                acc2 = acc2 * tl.exp(cum_m)[:, None]

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
            scores = tl.where(offs_s[None, :] <= offs_m[:, None], scores, 0.0).to(cdt)
            rows_s = _chunk_rows(cti_ptr, c, cti_c, offs_s, t0, CONTIG)
            ms = offs_s < clen
            xs = tl.load(xb + rows_s[:, None] * x_t + offs_p[None, :] * x_p,
                         mask=ms[:, None] & mp[None, :], other=0.0)
            acc = tl.dot(scores, xs.to(cdt), acc=acc, input_precision=IP)
            if BLOCK_P2 > 0:
                xs2 = tl.load(xb + rows_s[:, None] * x_t + offs_p2[None, :] * x_p,
                              mask=ms[:, None] & mp2[None, :], other=0.0)
                acc2 = tl.dot(scores, xs2.to(cdt), acc=acc2, input_precision=IP)

        d = tl.load(D_ptr + h).to(tl.float32)
        yb = y_ptr + t0 * y_t + h * y_h
        _scan_store(acc, xb, yb, rows_m, mm, offs_p, mp, d, x_t, x_p, y_t, y_p)
        if BLOCK_P2 > 0:
            _scan_store(acc2, xb, yb, rows_m, mm, offs_p2, mp2, d, x_t, x_p, y_t, y_p)
