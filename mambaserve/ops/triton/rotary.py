"""Triton rotary embedding: rotates q and k by a given cos/sin table (OUT-OF-PLACE: returns new
contiguous q and k, inputs are not modified).

The caller (`mambaserve.ops.rotary.apply_rotary`) builds the [T, rotary_dim / 2] float32 cos/sin
table with torch, exactly as the reference does, so the angles are bit-identical and nothing
depends on how the GPU backend lowers tl.cos / tl.sin for angles of thousands of radians; any RoPE
variant that only changes the table runs the same kernel.
Grid: (tokens, q's head blocks + k's head blocks), one launch for both. One program rotates the
pairs of BLOCK_H heads of one token (NeoX: channel i with i + rotary_dim/2; GPT-J: 2i with 2i + 1) in
float32 and copies the channels past rotary_dim unchanged. Launch parameters: `tuning` entry
"rotary".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import await_previous, pdl_launch


@triton.jit
def _rotate_heads(x_ptr, out_ptr, c, s, t, hb, H, D, HALF, x_t, x_h, x_d, o_t, o_h, o_d, offs_i,
                  mi, NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Rotate head block `hb` (BLOCK_H heads) of token t of one tensor into out."""
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = offs_h < H
    if NEOX:
        d1 = offs_i
        d2 = offs_i + HALF
    else:
        d1 = 2 * offs_i
        d2 = 2 * offs_i + 1
    m = mh[:, None] & mi[None, :]
    xb = x_ptr + t * x_t + offs_h[:, None] * x_h
    ob = out_ptr + t * o_t + offs_h[:, None] * o_h
    x1 = tl.load(xb + d1[None, :] * x_d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + d2[None, :] * x_d, mask=m, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    tl.store(ob + d1[None, :] * o_d, o1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(ob + d2[None, :] * o_d, o2.to(out_ptr.dtype.element_ty), mask=m)
    if BLOCK_REST > 0:  # channels past rotary_dim: copied
        for d0 in range(2 * HALF, D, BLOCK_REST):
            offs_r = d0 + tl.arange(0, BLOCK_REST)
            mr = mh[:, None] & (offs_r < D)[None, :]
            xr = tl.load(xb + offs_r[None, :] * x_d, mask=mr)
            tl.store(ob + offs_r[None, :] * o_d, xr, mask=mr)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, HQ, HK, QB, D, HALF,
    q_t, q_h, q_d, k_t, k_h, k_d, qo_t, qo_h, qo_d, ko_t, ko_h, ko_d,
    NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (T, QB + cdiv(HK, BLOCK_H)): the first QB head blocks of a token are q's, the rest
    k's."""
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_i = tl.arange(0, BLOCK_HALF)
    mi = offs_i < HALF
    c = tl.load(cos_ptr + t * HALF + offs_i, mask=mi, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * HALF + offs_i, mask=mi, other=0.0)[None, :]
    if hb < QB:
        _rotate_heads(q_ptr, qo_ptr, c, s, t, hb, HQ, D, HALF, q_t, q_h, q_d, qo_t, qo_h, qo_d,
                      offs_i, mi, NEOX, BLOCK_H, BLOCK_REST)
    else:
        _rotate_heads(k_ptr, ko_ptr, c, s, t, hb - QB, HK, D, HALF, k_t, k_h, k_d, ko_t, ko_h,
                      ko_d, offs_i, mi, NEOX, BLOCK_H, BLOCK_REST)


def apply_rotary_triton(q, k, cos, sin, rotary_dim, neox=True):
    """q: [T, H, D]; k: [T, H_kv, D]; cos, sin: [T, rotary_dim / 2] float32 (the angles of each
    token's position); rotary_dim even, <= D. Returns new (q, k) in their input dtypes."""
    T, H, D = q.shape
    Hk = k.shape[1]
    half = rotary_dim // 2
    assert k.shape[0] == T and k.shape[2] == D, (q.shape, k.shape)
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= D, (rotary_dim, D)
    for t in (cos, sin):
        assert t.shape == (T, half) and t.dtype == torch.float32 and t.is_contiguous(), (
            t.shape, t.dtype, q.shape)
    qo = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, Hk, D), dtype=k.dtype, device=k.device)
    if T == 0 or (H == 0 and Hk == 0):
        return qo, ko
    block_h = tuning.config("rotary", q.device)["block_h"]
    BLOCK_H = block_h if block_h is not None else min(16, triton.next_power_of_2(max(H, Hk)))
    BLOCK_HALF = triton.next_power_of_2(half)
    rest = D - rotary_dim
    BLOCK_REST = min(triton.next_power_of_2(rest), 64) if rest > 0 else 0
    num_warps = max(1, min(4, BLOCK_H * BLOCK_HALF // 256))
    qb = triton.cdiv(H, BLOCK_H)
    _rotary_kernel[(T, qb + triton.cdiv(Hk, BLOCK_H))](
        q, k, qo, ko, cos, sin, H, Hk, qb, D, half, *q.stride(), *k.stride(), *qo.stride(),
        *ko.stride(), NEOX=bool(neox), BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF,
        BLOCK_REST=BLOCK_REST, num_warps=num_warps, **pdl_launch(q.device, _rotary_kernel),
    )
    return qo, ko
