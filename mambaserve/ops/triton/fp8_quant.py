"""Triton FP8 activation quantization: each row of x [M, K] scaled to float8_e4m3fn in one
launch, with its scale written on the device (no host sync), optionally after an MLP activation.

Dynamic: scale = max(amax(|row|), 1e-12) / 448, computed in the kernel; static: the one given
scale for every row. Each element is v * (1 / scale) (the reciprocal an IEEE division, `div_rn`,
once per row; the scale's division too), clamped to +-448, rounded to nearest even onto e4m3: the
same bits as the torch reference (`mambaserve.ops.fp8_matmul.quantize_fp8_ref`).

`ACT`: the row quantized is first act(x), rounded to x.dtype as `ops/activation.py` rounds it
(1: relu², x [M, K]; 2: silu(gate) * up, x [M, 2K] = [gate | up]): the MLP's down projection
input quantized by the activation's own pass instead of a pass each.

Grid (M,), one program per row. A row of up to tuning "fp8_quant" `max_tile` elements is loaded
once and held in registers (amax, then codes from the same values); a wider row is walked twice
in `max_tile` steps (amax, then codes). Codes are written through a uint8 view: on the GPU the
hardware conversion, under the interpreter the integer codec (`ops/triton/fp8_codec.py`).
Launch parameters: `tuning` entry "fp8_quant".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import aligned, await_previous, divisibility, pdl_launch, pow2
from mambaserve.ops.triton.fp8_codec import e4m3_encode

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)
ACTIVATIONS = {None: 0, "relu2": 1, "silu_mul": 2}


@triton.jit
def activated(x_row, offs, m, K, ACT: tl.constexpr):
    """float32 values of act(x) at `offs` of one row, rounded to x's dtype where the activation
    rounds (0 where masked)."""
    v = tl.load(x_row + offs, mask=m, other=0.0)
    if ACT == 1:  # relu² squared in float32, one rounding
        r = tl.maximum(v.to(tl.float32), 0.0)
        v = (r * r).to(x_row.dtype.element_ty)
    if ACT == 2:  # silu(gate) rounded, then the product rounded
        g = v.to(tl.float32)
        u = tl.load(x_row + K + offs, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(x_row.dtype.element_ty).to(tl.float32)
        v = (s * u).to(x_row.dtype.element_ty)
    return v.to(tl.float32)


@triton.jit
def row_scale(v):
    """The dynamic scale of the float32 values v (one row, masked lanes 0)."""
    return tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), MIN_AMAX), FP8_MAX)


@triton.jit
def e4m3_codes(v, scale, HW_FP8: tl.constexpr):
    """uint8 e4m3 codes of clamp(v * (1 / scale), +-448), rounded to nearest even (one scalar
    scale)."""
    q = v * tl.math.div_rn(scale * 0.0 + 1.0, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if HW_FP8:
        codes = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        codes = e4m3_encode(q)
    return codes


@triton.jit(do_not_specialize=["K", "stride_x"])
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, stride_x, STATIC: tl.constexpr,
                       ACT: tl.constexpr, ONE_TILE: tl.constexpr, HW_FP8: tl.constexpr,
                       BLOCK: tl.constexpr, DIV: tl.constexpr, PDL: tl.constexpr):
    await_previous(PDL)
    K = aligned(K, DIV)  # rows start, and the mask changes, at multiples of DIV: vector access
    stride_x = aligned(stride_x, DIV)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * K
    if ONE_TILE:
        offs = tl.arange(0, BLOCK)
        m = offs < K
        v = activated(x_row, offs, m, K, ACT)
        if STATIC:
            scale = tl.load(in_scale_ptr).to(tl.float32)
        else:
            scale = row_scale(v)
        tl.store(s_ptr + row, scale)
        tl.store(q_row + offs, e4m3_codes(v, scale, HW_FP8), mask=m)
    else:
        if STATIC:
            scale = tl.load(in_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k in range(0, K, BLOCK):
                offs = k + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(activated(x_row, offs, offs < K, K, ACT)))
            scale = row_scale(amax)
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            m = offs < K
            v = activated(x_row, offs, m, K, ACT)
            tl.store(q_row + offs, e4m3_codes(v, scale, HW_FP8), mask=m)


_INTERPRETED = isinstance(_quant_rows_kernel, InterpretedFunction)


def launch_plan(K: int, device) -> dict:
    """Tile and warps for rows of K (activated) elements. Rules (None): num_warps
    min(32, max(4, tile // 512)) (16 elements per thread at most, from 2,048 on)."""
    cfg = tuning.config("fp8_quant", device)
    tile = min(pow2(K), cfg["max_tile"])
    num_warps = cfg["num_warps"] or min(32, max(4, tile // 512))
    return {"block": tile, "one_tile": tile >= K, "num_warps": num_warps}


def quantize_fp8_triton(x: torch.Tensor, input_scale: torch.Tensor | None,
                        act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided, last dim contiguous; [M, 2K] for act "silu_mul") ->
    (xq [M, K] float8_e4m3fn row-major, scale [M, 1] float32) of act(x) (`act` None, "relu2"
    or "silu_mul"); `input_scale` a one-element float32 tensor (static) or None (dynamic per
    row)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "quantize_fp8_triton takes [M, K] rows"
    assert act in ACTIVATIONS, act
    M, K = x.shape[0], x.shape[1] // 2 if act == "silu_mul" else x.shape[1]
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M and K:
        plan = launch_plan(K, x.device)
        static = input_scale is not None
        _quant_rows_kernel[(M,)](
            x, q.view(torch.uint8), s, input_scale if static else s, K, x.stride(0),
            STATIC=static, ACT=ACTIVATIONS[act], ONE_TILE=plan["one_tile"],
            HW_FP8=x.device.type == "cuda" and not _INTERPRETED, BLOCK=plan["block"],
            DIV=divisibility(K, x.stride(0)), num_warps=plan["num_warps"],
            **pdl_launch(x.device, _quant_rows_kernel))
    return q, s
