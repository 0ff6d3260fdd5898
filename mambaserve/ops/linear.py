"""The linear product of every dense projection: y = x W^T (+ bias), `F.linear`'s contract.

    linear(x, weight, bias=None) -> [..., N] in x.dtype

Few token rows (decode: at most tuning "gemv" max_m rows) of a bfloat16 / float16 model on CUDA
run the Triton kernel of `ops/triton/gemv.py`, which reads the weight once at the copy ceiling
where cuBLAS's GEMV kernels do not (docs/kernels.md, "Few-rows linear"); everything else is
`torch.nn.functional.linear` (cuBLAS on a GPU), which is also the reference the kernel is tested
against. No path syncs or branches on tensor values.

A residual stream's add in the projection's epilogue, for every row count:

    linear_residual(x, weight, residual) -> residual + x W^T: on cuBLAS `residual.addmm_(x,
        W^T)`, in place, the residual added in the GEMM's epilogue (a block's `h = h + proj(...)`
        without a pass of its own: the norm after it reads h only); on the few-rows kernel its
        epilogue add into a new tensor (`linear(..., add=)`). The roundings are the library's:
        the CPU rounds the float32 sum once, cuBLAS's bfloat16 epilogue stays within the bound
        of the two torch ops (tests/ops/test_linear_residual.py). Callers use the returned
        tensor and drop `residual`, which may have been overwritten.

Four more forms for the same few rows (elsewhere the public ops they stand for):

    linear(x, weight, bias, add=t): linear(x, weight, bias) + t, added in the kernel's epilogue
        with torch's rounding (bit for bit the two ops);
    linear(x, weight, bias, act="relu2"): relu2(linear(x, weight, bias)), the activation of the
        rounded product in the kernel's epilogue, rounded as `ops/activation.py` rounds it (bit
        for bit the two ops);
    act_linear(x, act, weight, bias=None): linear(act(x), weight, bias), act "relu2" or
        "silu_mul" (an MLP's activation and its down projection): the activation applied to x
        as the kernel loads it, rounded as `ops/activation.py` rounds it, where the launch runs
        on CUDA cores (one or two rows of the out_proj / down shapes); on tensor cores it is
        the activation kernel and the plain launch (an activated operand stalls their pipeline);
    linear_float32(x, weight): F.linear(x.float(), weight) for a float32 weight (a router kept in
        float32): one CUDA-core launch converting x as it loads it, where the reference casts x
        and runs cuBLAS's float32 GEMV.

And a squared-ReLU MLP's two projections, `relu2_mlp(x, w_up, b_up, w_down, b_down)` =
linear(relu2(linear(x, w_up, b_up)), w_down, b_down): the activation where a few-rows launch
takes it without a pass of its own: in the down projection's launch as it loads its rows where
that launch runs on CUDA cores (`act_linear`), else in the up projection's epilogue (three or
more rows: the down launch on tensor cores would run the activation's kernel first).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mambaserve.ops.activation import relu2, silu_mul
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.triton import tuning


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           add: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """`add` (the output's shape and dtype): linear(x, weight, bias) + add, the sum rounded as
    torch rounds it (the kernel adds it in its epilogue: no launch of its own). `act` "relu2"
    (not with `add`): relu2(linear(x, weight, bias)), likewise in the epilogue."""
    if act is not None and act != "relu2":
        raise ValueError(f"linear takes act 'relu2' or None, got {act!r}")
    if act is not None and add is not None:
        raise ValueError("linear takes act or add, not both")
    if kernel_path("gemv", x.device, x=x, weight=weight) == "triton":
        from mambaserve.ops.triton.gemv import gemv_triton

        N = weight.shape[0]
        y = gemv_triton(_rows(x), weight, bias, None if add is None else _rows(add.expand(
            *x.shape[:-1], N)), out_act=act)
        return y.view(*x.shape[:-1], N)
    y = F.linear(x, weight, bias)
    if act is not None:
        return relu2(y)
    return y if add is None else y + add


def relu2_mlp(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None,
              w_down: torch.Tensor, b_down: torch.Tensor | None) -> torch.Tensor:
    """linear(relu2(linear(x, w_up, b_up)), w_down, b_down); see the module docstring for where
    the activation runs."""
    if kernel_path("gemv", x.device, x=x, weight=w_up) == "triton":
        from mambaserve.ops.triton.gemv import launch_plan

        rows = math.prod(x.shape[:-1])
        if launch_plan(rows, w_down.shape[0], w_down.shape[1], x.device)["use_dot"]:
            return linear(linear(x, w_up, b_up, act="relu2"), w_down, b_down)
    return act_linear(linear(x, w_up, b_up), "relu2", w_down, b_down)


def residual_in_projections(rows: int, device: torch.device) -> bool:
    """Whether a forward of `rows` token rows adds the residual stream in its blocks' closing
    projections (`linear_residual`): the steps the few-rows kernel does not take (more rows than
    tuning gemv.max_m), on every device. Decode-sized steps keep the add in the next norm's pass
    (their projections' activation is fused into the launch, which has no addend)."""
    return rows > tuning.config("gemv", device)["max_m"]


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x W^T (no bias), residual [..., N] in x.dtype; see the module docstring."""
    N = weight.shape[0]
    if residual.shape != (*x.shape[:-1], N) or residual.dtype != x.dtype:
        raise ValueError(f"residual must be {(*x.shape[:-1], N)} in {x.dtype}, got "
                         f"{tuple(residual.shape)} in {residual.dtype}")
    if kernel_path("gemv", x.device, x=x, weight=weight) == "triton":
        return linear(x, weight, None, add=residual)
    r2 = residual.contiguous().view(-1, N)  # a view: addmm_ writes the caller's tensor
    return r2.addmm_(_rows(x), weight.t()).view(residual.shape)


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times a weight [N, K] in float32: [..., N] float32, `F.linear(x.float(),
    weight.float())` (the module docstring; the kernel takes 16-bit x and a float32 weight)."""
    if kernel_path("linear_float32", x.device, x=x, weight=weight) == "triton":
        from mambaserve.ops.triton.gemv import gemv_float32_triton

        N = weight.shape[0]
        return gemv_float32_triton(_rows(x), weight).view(*x.shape[:-1], N)
    return F.linear(x.float(), weight.float())


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


_ACTIVATIONS = {"relu2": relu2, "silu_mul": silu_mul}


def act_linear(x: torch.Tensor, act: str, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] ([..., 2K] = [gate | up] for "silu_mul"); see the module docstring."""
    if act not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; known: {sorted(_ACTIVATIONS)}")
    if kernel_path("act_linear", x.device, x=x, act=act, weight=weight) == "triton":
        from mambaserve.ops.triton.gemv import act_gemv_triton

        return act_gemv_triton(_rows(x), act, weight, bias).view(*x.shape[:-1],
                                                                 weight.shape[0])
    return linear(_ACTIVATIONS[act](x), weight, bias)
