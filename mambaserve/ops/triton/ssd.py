"""Triton SSD (Mamba2) chunked scan over the flat multi-row prefill stream.

Same chunk plan as the reference (`mambaserve.ops.ssd`): chunks are cut at absolute multiples of
chunk_size, never span rows, and are described by host-built metadata (`chunk_token_idx`,
`row_chunks`, `row_num_chunks`). Three launches:

A. `_chunk_state_kernel`, grid (chunks, heads, cdiv(P, BLOCK_P)): gathers the chunk's tokens,
   dt = clamp(softplus(dt + dt_bias)), cumsum of dt*A, and the chunk's end state from zero,
   S_loc[p, n] = sum_l x[l, p] dt[l] exp(cum[L-1] - cum[l]) B[l, n]  (one tl.dot), written into
   the `chunk_end_states` buffer; the P-block-0 program also stores exp(cum[L-1]) per chunk/head.
B. `_state_passing_kernel`, grid (rows, heads, cdiv(P*N, BLOCK_S)): walks the row's chunks in
   order from the initial state (slot state if has_initial_state, else zero); writes each chunk's
   start state, turns the local end state into the true one in place, and stores the row's last
   end state into ssm_state[slot] (skipped for a negative slot).
C. `_chunk_scan_kernel`, grid (chunks, heads, cdiv(P, BLOCK_P)):
   y = (C Bᵀ ∘ exp(cum[l] - cum[s]) [s <= l] ∘ dt[s]) · x  +  exp(cum[l]) · C · S_startᵀ  +  D x
   with three tl.dots (operands in x.dtype, float32 accumulation; float32 inputs use IEEE dots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton._common import softplus_clamp


@triton.jit
def _chunk_dt(cti_ptr, dt_ptr, dt_bias_ptr, A_ptr, c, h, T, dt_lo, dt_hi, cti_c, dt_t, dt_h,
              L: tl.constexpr):
    """Token ids of chunk c, their mask, processed dt (0 on padding) and cumsum of dt*A."""
    offs_l = tl.arange(0, L)
    idx = tl.load(cti_ptr + c * cti_c + offs_l)
    ml = idx < T
    raw = tl.load(dt_ptr + idx * dt_t + h * dt_h, mask=ml, other=0.0).to(tl.float32)
    dt = softplus_clamp(raw + tl.load(dt_bias_ptr + h).to(tl.float32), dt_lo, dt_hi)
    dt = tl.where(ml, dt, 0.0)
    cum = tl.cumsum(dt * tl.load(A_ptr + h).to(tl.float32), axis=0)
    return idx, ml, dt, cum


@triton.jit
def _chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, dt_bias_ptr, cti_ptr, end_ptr, decay_ptr,
    T, H, P, N, heads_per_group, dt_lo, dt_hi,
    x_t, x_h, x_p, dt_t, dt_h, B_t, B_g, B_n, cti_c,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, IP: tl.constexpr,
):
    pb = tl.program_id(0)  # P-blocks of one (chunk, head) run next to each other (L2 reuse)
    h = tl.program_id(1)
    c = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    idx, ml, dt, cum = _chunk_dt(cti_ptr, dt_ptr, dt_bias_ptr, A_ptr, c, h, T, dt_lo, dt_hi,
                                 cti_c, dt_t, dt_h, L)
    last = tl.sum(tl.where(tl.arange(0, L) == L - 1, cum, 0.0), axis=0)
    w = dt * tl.exp(last - cum)  # [L]

    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    x = tl.load(x_ptr + idx[:, None] * x_t + h * x_h + offs_p[None, :] * x_p,
                mask=ml[:, None] & mp[None, :], other=0.0)
    Bm = tl.load(B_ptr + idx[:, None] * B_t + g * B_g + offs_n[None, :] * B_n,
                 mask=ml[:, None] & mn[None, :], other=0.0)
    xw = (x.to(tl.float32) * w[:, None]).to(x_ptr.dtype.element_ty)
    S = tl.dot(tl.trans(xw), Bm.to(x_ptr.dtype.element_ty), input_precision=IP)  # [BP, BN]
    base = (c * H + h) * P * N
    tl.store(end_ptr + base + offs_p[:, None] * N + offs_n[None, :], S,
             mask=mp[:, None] & mn[None, :])
    tl.store(decay_ptr + c * H + h, tl.exp(last), mask=pb == 0)


@triton.jit
def _state_passing_kernel(
    ssm_ptr, slot_ptr, init_ptr, row_chunks_ptr, nchunks_ptr, start_ptr, end_ptr, decay_ptr,
    H, P, N, s_slot, s_h, s_p, s_n, rc_r,
    BLOCK_S: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    sb = tl.program_id(2)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    valid = slot >= 0
    use_init = valid & (tl.load(init_ptr + r) != 0)
    slot = tl.maximum(slot, 0)
    offs = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    m = offs < P * N
    p = offs // N
    n = offs % N
    s_ptrs = ssm_ptr + slot * s_slot + h * s_h + p * s_p + n * s_n
    running = tl.load(s_ptrs, mask=m & use_init, other=0.0).to(tl.float32)
    nck = tl.load(nchunks_ptr + r)
    for i in range(nck):
        cid = tl.load(row_chunks_ptr + r * rc_r + i).to(tl.int64)
        base = (cid * H + h) * P * N + offs
        tl.store(start_ptr + base, running, mask=m)
        dec = tl.load(decay_ptr + cid * H + h)
        running = running * dec + tl.load(end_ptr + base, mask=m, other=0.0)
        tl.store(end_ptr + base, running, mask=m)
    tl.store(s_ptrs, running.to(ssm_ptr.dtype.element_ty), mask=m & valid)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, cti_ptr, start_ptr, y_ptr,
    T, H, P, N, heads_per_group, dt_lo, dt_hi,
    x_t, x_h, x_p, dt_t, dt_h, B_t, B_g, B_n, C_t, C_g, C_n, y_t, y_h, y_p, cti_c,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, IP: tl.constexpr,
):
    pb = tl.program_id(0)  # P-blocks of one (chunk, head) run next to each other (L2 reuse)
    h = tl.program_id(1)
    c = tl.program_id(2).to(tl.int64)
    g = h // heads_per_group
    idx, ml, dt, cum = _chunk_dt(cti_ptr, dt_ptr, dt_bias_ptr, A_ptr, c, h, T, dt_lo, dt_hi,
                                 cti_c, dt_t, dt_h, L)
    cdt = x_ptr.dtype.element_ty
    offs_l = tl.arange(0, L)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    mln = ml[:, None] & mn[None, :]
    Cm = tl.load(C_ptr + idx[:, None] * C_t + g * C_g + offs_n[None, :] * C_n, mask=mln,
                 other=0.0).to(cdt)
    Bm = tl.load(B_ptr + idx[:, None] * B_t + g * B_g + offs_n[None, :] * B_n, mask=mln,
                 other=0.0).to(cdt)
    x = tl.load(x_ptr + idx[:, None] * x_t + h * x_h + offs_p[None, :] * x_p,
                mask=ml[:, None] & mp[None, :], other=0.0)

    # inter-chunk: exp(cum[l]) * C[l] . S_start[p]
    S = tl.load(start_ptr + (c * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
                mask=mp[:, None] & mn[None, :], other=0.0)
    y = tl.dot(Cm, tl.trans(S.to(cdt)), input_precision=IP) * tl.exp(cum)[:, None]  # [L, BP]

    # intra-chunk: (C Bᵀ ∘ decay ∘ dt[s]) . x
    scores = tl.dot(Cm, tl.trans(Bm), input_precision=IP)  # [L, L]
    causal = offs_l[:, None] >= offs_l[None, :]
    seg = tl.where(causal, cum[:, None] - cum[None, :], float("-inf"))
    scores = scores * tl.exp(seg) * dt[None, :]
    y = tl.dot(scores.to(cdt), x.to(cdt), acc=y, input_precision=IP)

    y += tl.load(D_ptr + h).to(tl.float32) * x.to(tl.float32)
    tl.store(y_ptr + idx[:, None] * y_t + h * y_h + offs_p[None, :] * y_p,
             y.to(y_ptr.dtype.element_ty), mask=ml[:, None] & mp[None, :])


def _default_block_p(P: int) -> int:
    # H200 sweep at P=80 (docs/kernels.md): 32-wide P blocks with 4 warps were fastest for the scan
    return 16 if P <= 16 else 32


def ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                                 has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks,
                                 row_num_chunks, *, block_p_state: int | None = None,
                                 block_p_scan: int | None = None, block_s: int = 1024,
                                 num_warps_state: int = 4, num_warps_scan: int = 4,
                                 _stop_after: str | None = None):
    """Same contract as `mambaserve.ops.ssd.ssd_chunk_scan_varlen`.

    `_stop_after` ("state" or "passing") stops after that launch: for per-launch timing only.
    """
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
    for t in (state_slots, has_initial_state, chunk_token_idx, row_chunks, row_num_chunks):
        assert t.is_contiguous()
    dev = x.device
    y = torch.empty((T, H, P), dtype=x.dtype, device=dev)
    end_states = torch.empty((num_chunks, H, P, N), dtype=torch.float32, device=dev)
    if num_chunks == 0 or T == 0:
        return y, end_states
    start_states = torch.empty_like(end_states)
    chunk_decay = torch.empty((num_chunks, H), dtype=torch.float32, device=dev)
    BLOCK_N = triton.next_power_of_2(N)
    IP = "ieee" if x.dtype == torch.float32 else "tf32"
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    # chunk-state launch: 64-wide P blocks measured 1.28 ms total at 1x8192 vs 1.37 ms for 32
    bps = block_p_state or min(64, max(16, triton.next_power_of_2(P)))
    bpc = block_p_scan or _default_block_p(P)

    _chunk_state_kernel[(triton.cdiv(P, bps), H, num_chunks)](
        x, dt, A, B, dt_bias, chunk_token_idx, end_states, chunk_decay,
        T, H, P, N, H // G, lo, hi,
        *x.stride(), *dt.stride(), *B.stride(), chunk_token_idx.stride(0),
        L=L, BLOCK_P=bps, BLOCK_N=BLOCK_N, IP=IP, num_warps=num_warps_state,
    )
    if _stop_after == "state":
        return y, end_states
    _state_passing_kernel[(R, H, triton.cdiv(P * N, block_s))](
        ssm_state, state_slots, has_initial_state, row_chunks, row_num_chunks, start_states,
        end_states, chunk_decay, H, P, N, *ssm_state.stride(), row_chunks.stride(0),
        BLOCK_S=block_s, num_warps=4,
    )
    if _stop_after == "passing":
        return y, end_states
    _chunk_scan_kernel[(triton.cdiv(P, bpc), H, num_chunks)](
        x, dt, A, B, C, D, dt_bias, chunk_token_idx, start_states, y,
        T, H, P, N, H // G, lo, hi,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
        chunk_token_idx.stride(0),
        L=L, BLOCK_P=bpc, BLOCK_N=BLOCK_N, IP=IP, num_warps=num_warps_scan,
    )
    return y, end_states
