"""Triton relu²: y = max(x, 0)² in one pass over a contiguous tensor (flat, BLOCK elements per
program), squared in float32 and rounded once to x.dtype (bit-identical to torch). Launch
parameters: `tuning` entry "relu2"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning


@triton.jit(do_not_specialize=["n"])
def _relu2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
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
        _relu2_kernel[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, num_warps=cfg["num_warps"])
    return y
