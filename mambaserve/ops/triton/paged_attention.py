"""Triton write_kv and paged attention over the KV pool (same contracts as
`mambaserve.ops.paged_attention`).

write_kv: grid (T,). One program stores all H_kv heads of one new token's K and V at its flat
slot (`slot_mapping[t]` = page * page_size + offset), converting to the pool's dtype.

paged_attention: grid (T, H_kv). One program serves one query token and one KV head, i.e. all
H / H_kv query heads of that GQA group at once (padded to a 16-row tile for tl.dot), so each K/V
block is loaded once per group. It walks the token's row through the page table in blocks of
BLOCK_N key positions (each key's page is looked up individually, so any page size works) up to
and including `positions[t]` (a device value: the loop bound is read in the kernel, nothing is
read back on the host), with an online softmax in float32. QKᵀ and PV are tl.dots with float32
accumulation (float32 inputs use IEEE dots; P is cast to the cache dtype for PV). head_dim is
masked to the next power of two. Keys beyond positions[t] are masked at load, so stale or
non-finite data in unused slots never reaches the output. `max_kv_len` is not needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr, page_size, Hkv, Dh,
    k_t, k_h, k_d, v_t, v_h, v_d, c_kv, c_p, c_s, c_h, c_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // page_size
    off = slot % page_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h[:, None] < Hkv) & (offs_d[None, :] < Dh)
    dst = kv_ptr + page * c_p + off * c_s + offs_h[:, None] * c_h + offs_d[None, :] * c_d
    k = tl.load(k_ptr + t * k_t + offs_h[:, None] * k_h + offs_d[None, :] * k_d, mask=m)
    v = tl.load(v_ptr + t * v_t + offs_h[:, None] * v_h + offs_d[None, :] * v_d, mask=m)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=m)
    tl.store(dst + c_kv, v.to(kv_ptr.dtype.element_ty), mask=m)


def write_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Same contract as `mambaserve.ops.paged_attention.write_kv`."""
    _, _, page_size, Hkv, Dh = kv_cache.shape
    T = k.shape[0]
    assert k.shape == (T, Hkv, Dh) and v.shape == (T, Hkv, Dh), (k.shape, v.shape, kv_cache.shape)
    assert slot_mapping.shape == (T,), slot_mapping.shape
    if T == 0:
        return
    BLOCK_H = triton.next_power_of_2(Hkv)
    BLOCK_D = triton.next_power_of_2(Dh)
    num_warps = max(1, min(8, BLOCK_H * BLOCK_D // 512))
    _write_kv_kernel[(T,)](
        k, v, kv_cache, slot_mapping, page_size, Hkv, Dh,
        *k.stride(), *v.stride(), *kv_cache.stride(),
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=num_warps,
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, pt_ptr, row_ptr, pos_ptr, out_ptr, scale, page_size, Dh, REP,
    q_t, q_h, q_d, c_kv, c_p, c_s, c_h, c_d, pt_r, pt_p, o_t, o_h, o_d,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    r = tl.load(row_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md = offs_d < Dh
    mq = (offs_g[:, None] < REP) & md[None, :]
    heads = g * REP + offs_g
    q = tl.load(q_ptr + t * q_t + heads[:, None] * q_h + offs_d[None, :] * q_d, mask=mq, other=0.0)
    q = q.to(kv_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    pt_row = pt_ptr + r * pt_r
    head_off = g * c_h
    for start in range(0, pos + 1, BLOCK_N):
        j = start + offs_n
        mj = j <= pos
        page = tl.load(pt_row + (j // page_size) * pt_p, mask=mj, other=0).to(tl.int64)
        base = page * c_p + (j % page_size) * c_s + head_off
        mk = mj[:, None] & md[None, :]
        kp = kv_ptr + base[:, None] + offs_d[None, :] * c_d
        k = tl.load(kp, mask=mk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=IP) * scale  # [BLOCK_G, BLOCK_N] fp32
        s = tl.where(mj[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key `start` <= pos is visible
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kp + c_kv, mask=mk, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=IP)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * o_t + heads[:, None] * o_h + offs_d[None, :] * o_d,
             out.to(out_ptr.dtype.element_ty), mask=mq)


@triton.jit
def _paged_attention_tiled_kernel(
    q_ptr, kv_ptr, pt_ptr, row_ptr, pos_ptr, out_ptr, scale, page_size, Dh, REP, T, TPB,
    q_t, q_h, q_d, c_kv, c_p, c_s, c_h, c_d, pt_r, pt_p, o_t, o_h, o_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IP: tl.constexpr,
):
    """TPB consecutive tokens x the REP query heads of one KV head, flattened into BLOCK_M query
    rows (row m = token m // REP, head m % REP). The tile may span several batch rows: it makes
    one pass over the keys of each batch row present, updating only that row's queries."""
    g = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tl.program_id(0).to(tl.int64) * TPB + offs_m // REP
    act = (offs_m < TPB * REP) & (tok < T)
    heads = g * REP + offs_m % REP
    md = offs_d < Dh
    mq = act[:, None] & md[None, :]
    q = tl.load(q_ptr + tok[:, None] * q_t + heads[:, None] * q_h + offs_d[None, :] * q_d,
                mask=mq, other=0.0)
    q = q.to(kv_ptr.dtype.element_ty)
    rows = tl.load(row_ptr + tok, mask=act, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=act, other=-1).to(tl.int64)
    r_lo = tl.min(tl.where(act, rows, 1 << 62), axis=0)
    r_hi = tl.max(tl.where(act, rows, -1), axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    head_off = g * c_h
    for rr in range(r_lo, r_hi + 1):
        in_row = act & (rows == rr)
        end = tl.max(tl.where(in_row, pos, -1), axis=0) + 1
        pt_row = pt_ptr + rr * pt_r
        for start in range(0, end, BLOCK_N):
            j = start + offs_n
            mj = j < end
            page = tl.load(pt_row + (j // page_size) * pt_p, mask=mj, other=0).to(tl.int64)
            base = page * c_p + (j % page_size) * c_s + head_off
            mk = mj[:, None] & md[None, :]
            kp = kv_ptr + base[:, None] + offs_d[None, :] * c_d
            k = tl.load(kp, mask=mk, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=IP) * scale
            vis = in_row[:, None] & (j[None, :] <= pos[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows not seen yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(kp + c_kv, mask=mk, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=IP)
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * o_t + heads[:, None] * o_h + offs_d[None, :] * o_d,
             out.to(out_ptr.dtype.element_ty), mask=mq)


def paged_attention_triton(q, kv_cache, page_table, token_row, positions, max_kv_len, scale, *,
                           tiled: bool = False, block_m: int = 64, block_n: int | None = None,
                           num_warps: int | None = None):
    """Same contract as `mambaserve.ops.paged_attention.paged_attention` (`max_kv_len` unused:
    each token's loop stops at its own position).

    `tiled=True` selects the prefill-oriented kernel: one program per block of
    max(1, block_m // (H / H_kv)) consecutive tokens and one KV head, so a prefill row's K/V is
    read once per token block instead of once per token. Opt-in: the launcher has no host-side
    count of prefill tokens, and for decode tokens (one per row) the per-token kernel has more
    parallelism; untimed on a GPU so far."""
    T, H, Dh = q.shape
    _, _, page_size, Hkv, Dk = kv_cache.shape
    assert Dk == Dh and H % Hkv == 0, (q.shape, kv_cache.shape)
    assert token_row.shape == (T,) and positions.shape == (T,), (token_row.shape, positions.shape)
    out = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    rep = H // Hkv
    BLOCK_G = max(16, triton.next_power_of_2(rep))
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    BLOCK_N = block_n or max(16, min(64, triton.next_power_of_2(page_size)))
    IP = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    if tiled:
        BLOCK_M = max(16, triton.next_power_of_2(block_m), triton.next_power_of_2(rep))
        tpb = max(1, BLOCK_M // rep)
        if num_warps is None:
            num_warps = 4
        _paged_attention_tiled_kernel[(triton.cdiv(T, tpb), Hkv)](
            q, kv_cache, page_table, token_row, positions, out, float(scale), page_size, Dh, rep,
            T, tpb, *q.stride(), *kv_cache.stride(), *page_table.stride(), *out.stride(),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IP=IP, num_warps=num_warps,
        )
        return out
    if num_warps is None:
        num_warps = 4 if BLOCK_D * BLOCK_N >= 4096 else 2
    _paged_attention_kernel[(T, Hkv)](
        q, kv_cache, page_table, token_row, positions, out, float(scale), page_size, Dh, rep,
        *q.stride(), *kv_cache.stride(), *page_table.stride(), *out.stride(),
        BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IP=IP, num_warps=num_warps,
    )
    return out
