"""Triton MoE routing: a token's k experts and their weights from its router logits, one
program per token. Same contracts as `mambaserve.ops.moe_routing` (softmax_topk, sigmoid_topk).

The program loads the token's E logits into registers (E <= `MAX_EXPERTS`), takes the largest k
by k rounds of a maximum over the experts not taken yet (the lowest index among equals; NaN
counts as the largest, as in torch's topk), and writes the ids in
that (descending) order with their weights: a softmax over the k logits, or the k sigmoid scores
(normalized by their sum, times the scale). Exponentials are libdevice's expf on the GPU and
divisions IEEE (`div_rn`), as torch's kernels compute them.
Launch parameters: `tuning` entry "moe_routing".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mambaserve.ops.triton import tuning

MAX_EXPERTS = 1024
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _exp(x, HW_EXP: tl.constexpr):
    if HW_EXP:  # CUDA's expf, as torch's sigmoid and softmax on CUDA
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, T, E, stride_l, scale,
                  K: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
                  OUT_DT: tl.constexpr, HW_EXP: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    v = tl.load(logits_ptr + t.to(tl.int64) * stride_l + e, mask=ok, other=0.0).to(tl.float32)
    if SIGMOID:
        val = tl.math.div_rn(tl.full((BLOCK_E,), 1.0, tl.float32), 1.0 + _exp(-v, HW_EXP))
        choice = val + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    else:
        val = v
        choice = v
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN counts as the largest
    free = ok  # experts not taken yet: every round picks a distinct valid one
    slots = tl.arange(0, BLOCK_K)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    top_v = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(K):
        m = tl.max(tl.where(free, choice, float("-inf")), axis=0)
        i = tl.min(tl.where(free & (choice == m), e, BLOCK_E), axis=0)
        top_i = tl.where(slots == j, i, top_i)
        top_v = tl.where(slots == j, tl.sum(tl.where(e == i, val, 0.0), axis=0), top_v)
        free = free & (e != i)
    used = slots < K
    if SIGMOID:
        w = top_v
        if NORMALIZE:
            w = tl.math.div_rn(w, tl.sum(tl.where(used, w, 0.0), axis=0) + 1e-20)
        w = w * scale
    else:
        ex = tl.where(used, _exp(top_v - tl.max(tl.where(used, top_v, float("-inf")), axis=0),
                                 HW_EXP), 0.0)
        w = tl.math.div_rn(ex, tl.sum(ex, axis=0))
    out = t.to(tl.int64) * K + slots
    tl.store(ids_ptr + out, top_i.to(tl.int64), mask=used)
    tl.store(w_ptr + out, w.to(OUT_DT), mask=used)


def route_topk_triton(logits: torch.Tensor, k: int, dtype: torch.dtype,
                      bias: torch.Tensor | None = None, normalize: bool = False,
                      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk (bias None) or sigmoid_topk (bias given) of `mambaserve.ops.moe_routing`."""
    T, E = logits.shape
    assert E <= MAX_EXPERTS and logits.stride(-1) == 1 and dtype in _TL_DTYPES
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((T, k), dtype=dtype, device=logits.device)
    if T == 0:
        return ids, weights
    sigmoid = bias is not None
    _route_kernel[(T,)](
        logits, bias.contiguous() if sigmoid else logits, ids, weights, T, E, logits.stride(0),
        float(scale), K=k, SIGMOID=sigmoid, NORMALIZE=bool(normalize), OUT_DT=_TL_DTYPES[dtype],
        HW_EXP=logits.device.type == "cuda", BLOCK_E=max(triton.next_power_of_2(E), 16),
        BLOCK_K=max(triton.next_power_of_2(k), 2),
        num_warps=tuning.config("moe_routing", logits.device)["num_warps"])
    return ids, weights
