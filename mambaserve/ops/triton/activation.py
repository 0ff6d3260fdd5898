"""Triton MLP activations, one pass each.

relu²: y = max(x, 0)² over a contiguous tensor (flat, BLOCK elements per program), squared in
float32 and rounded once to x.dtype (bit-identical to torch). Launch parameters: `tuning` entry
"relu2".

silu_mul: y = silu(gate) * up over rows of a contiguous [T, 2 I] gate / up tensor; grid (T,
cdiv(I, BLOCK)); silu in float32 rounded to the dtype, then the product in float32 rounded again
(torch's two roundings). Launch parameters: `tuning` entry "silu_mul"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import aligned, divisibility


@triton.jit(do_not_specialize=["n"])
def _relu2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, DIV: tl.constexpr):
    n = aligned(n, DIV)  # the mask changes at multiples of DIV: vector loads and stores
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.maximum(x, 0.0)
    tl.store(y_ptr + offs, (r * r).to(y_ptr.dtype.element_ty), mask=m)


def relu2_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as `mambaserve.ops.activation.relu2`, for a contiguous x."""
    assert x.is_contiguous(), "relu2_triton takes a contiguous tensor"
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        cfg = tuning.config("relu2", x.device)
        block = cfg["block"]
        _relu2_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, DIV=divisibility(n),
                                                 num_warps=cfg["num_warps"])
    return y


@triton.jit(do_not_specialize=["I", "row_in", "row_out"])
def _silu_mul_kernel(x_ptr, y_ptr, I, row_in, row_out, BLOCK: tl.constexpr, DIV: tl.constexpr):
    # rows start, and the mask changes, at multiples of DIV: vector loads and stores
    I = aligned(I, DIV)
    row_in = aligned(row_in, DIV)
    row_out = aligned(row_out, DIV)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(x_ptr + t * row_in + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * row_in + I + offs, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + t * row_out + offs, (s * u).to(y_ptr.dtype.element_ty), mask=m)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as `mambaserve.ops.activation.silu_mul`, for a contiguous gate_up."""
    assert gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0, gate_up.shape
    I = gate_up.shape[-1] // 2
    x = gate_up.view(-1, 2 * I)
    y = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    T = x.shape[0]
    if T and I:
        cfg = tuning.config("silu_mul", x.device)
        block = min(cfg["block"], triton.next_power_of_2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, block))](x, y, I, 2 * I, I, BLOCK=block,
                                                      DIV=divisibility(I, 2 * I),
                                                      num_warps=cfg["num_warps"])
    return y
