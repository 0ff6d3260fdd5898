"""Which implementation a public op of `mambaserve.ops` runs: its Triton kernel or its torch
reference. Every such decision is made here, by one rule:

    the kernel runs when the device is CUDA, Triton is importable, and the op's own condition on
    its inputs (the table `CONDITIONS` below; most ops have none) holds;

everything else runs the reference. Checking the rule imports nothing from Triton (a spec lookup
only), so the engine may ask it on any machine:

    kernel_path("paged_attention", device)            # -> "triton" | "reference"
    kernel_path("relu2", x.device, x=x)                # ops with a condition take its inputs

The public ops call `kernel_path` with their inputs; the launchers under `mambaserve.ops.triton`
assert what they require instead of falling back themselves.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from mambaserve.ops.triton import triton_available, tuning

KernelPath = Literal["triton", "reference"]


def _tileable_chunk(chunk_size: int) -> bool:
    return chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0


def fp8_capable(device: torch.device) -> bool:
    """CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell): FP8 tensor cores and the
    float8 conversions the FP8 kernels use."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _fp8_gemm_ok(device: torch.device, x: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch._scaled_mm: FP8 tensor cores, K and N multiples of 16, row-wise scales with bf16 out
    return (fp8_capable(device) and x.dtype == torch.bfloat16
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


# The switch of the FP8 kernel for few rows (`ops/triton/fp8_gemv.py`): on unless this
# environment variable is "0" (then decode batches take the scaled_mm path; docs/quantization.md).
FP8_GEMV_ENV = "MAMBASERVE_FP8_GEMV"


def fp8_gemv_enabled() -> bool:
    return os.environ.get(FP8_GEMV_ENV, "1") != "0"


def _fp8_gemv_ok(device: torch.device, x: torch.Tensor, weight: torch.Tensor) -> bool:
    # switched on, float8 conversions, bf16 activations, at most the tuning entry's max_m rows
    if not fp8_gemv_enabled() or x.dtype != torch.bfloat16 or weight.stride(-1) != 1:
        return False
    rows = math.prod(x.shape[:-1])
    return fp8_capable(device) and rows <= tuning.config("fp8_gemv", device)["max_m"]


def _few_rows_ok(x: torch.Tensor, weight: torch.Tensor, weight_dtype: torch.dtype) -> bool:
    # 16-bit activations, a plain [N, K] weight of `weight_dtype`, 1 to tuning gemv.max_m rows
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != weight_dtype:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1 or x.shape[-1] != weight.shape[1]:
        return False
    rows = math.prod(x.shape[:-1])
    return 1 <= rows <= tuning.config("gemv", x.device)["max_m"]


def _gemv_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _few_rows_ok(x, weight, x.dtype)  # the activations' dtype


def _gemv_float32_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _few_rows_ok(x, weight, torch.float32)  # a float32 weight (linear_float32)


def _act_gemv_ok(x: torch.Tensor, act: str, weight: torch.Tensor) -> bool:
    # the few-rows linear's condition on the activation's output (silu_mul halves the width)
    if act == "silu_mul" and x.shape[-1] % 2:
        return False
    k = x.shape[-1] // 2 if act == "silu_mul" else x.shape[-1]
    return _gemv_ok(x[..., :k], weight)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Condition:
    """What an op's kernel needs of its inputs beyond a CUDA device: `check` is called with the
    named inputs `needs` (keyword arguments of `kernel_path`, plus "device": the device asked
    about); `otherwise` says what runs the reference."""

    needs: tuple[str, ...]
    check: Callable[..., bool]
    otherwise: str


# The public ops (names as in mambaserve.ops) and their kernels' conditions; an op with None
# takes every input on a CUDA device.
CONDITIONS: dict[str, Condition | None] = {
    "selective_state_update": None,
    "causal_conv1d_update": None,
    # the kernel holds the conv window in named registers
    "causal_conv1d_varlen": Condition(
        ("weight",), lambda weight: 2 <= weight.shape[1] <= 5,
        "conv widths (weight.shape[1]) outside 2..5"),
    # the kernel tiles a chunk in power-of-two blocks of at least 16 tokens
    "ssd_chunk_scan_varlen": Condition(
        ("chunk_size",), _tileable_chunk,
        "chunk sizes that are not a power of two >= 16"),
    "gated_rmsnorm": None,
    "gated_silu": None,
    "rms_norm": None,
    # one flat pass over the elements
    "relu2": Condition(("x",), lambda x: x.is_contiguous(), "non-contiguous inputs"),
    "silu_mul": Condition(("gate_up",), lambda gate_up: gate_up.is_contiguous(),
                          "non-contiguous inputs"),
    "apply_rotary": None,
    "sample_rows": None,
    "write_kv": None,
    "moe_experts": None,
    "moe_routing": None,
    "paged_attention": None,
    # few token rows of a 16-bit model (decode projections): the bandwidth-bound kernel
    "gemv": Condition(("x", "weight"), _gemv_ok,
                      "float32 models, more rows than tuning gemv.max_m and weights that are "
                      "not a plain [N, K] matrix of the activations' dtype"),
    # the same kernel with an MLP activation applied to x as it loads it
    "act_linear": Condition(("x", "act", "weight"), _act_gemv_ok, "what `gemv` refuses"),
    # the same kernel's CUDA-core launch: 16-bit rows times a float32 weight (a float32 router)
    "linear_float32": Condition(("x", "weight"), _gemv_float32_ok,
                                "float32 activations, weights that are not a plain float32 "
                                "[N, K] matrix and more rows than tuning gemv.max_m"),
    # FP8: Triton's float8e4nv conversion and cuBLASLt's FP8 GEMM need compute capability 8.9
    "fp8_quant": Condition(("device",), lambda device: fp8_capable(device),
                           "devices of compute capability < 8.9"),
    "fp8_linear": Condition(("device", "x", "weight"), _fp8_gemm_ok,
                            "devices of compute capability < 8.9, non-bfloat16 activations and "
                            "K or N not a multiple of 16"),
    # few token rows (decode): the bandwidth-bound FP8 kernel; on unless switched off
    "fp8_gemv": Condition(("device", "x", "weight"), _fp8_gemv_ok,
                          f"{FP8_GEMV_ENV}=0, devices of compute capability "
                          "< 8.9, non-bfloat16 activations and more rows than tuning "
                          "fp8_gemv.max_m"),
    # the copy kernel moves each (layer, slot) row of the pools as one flat run of elements
    "restore_snapshots": Condition(
        ("conv_state", "ssm_state"),
        lambda conv_state, ssm_state: conv_state.is_contiguous() and ssm_state.is_contiguous()
        and conv_state.shape[:2] == ssm_state.shape[:2],
        "pools that are not contiguous"),
    # the kernel gathers from the extended stream itself and casts as the reference does; it
    # reads any strides and is checked bit for bit in these dtypes
    "save_prefill_conv_snapshots": Condition(
        ("x", "conv_state"),
        lambda x, conv_state: x.dtype in _FLOATS and conv_state.dtype in _FLOATS,
        "inputs or pools other than float32 / float16 / bfloat16"),
}


def kernel_path(op: str, device: torch.device | str, **inputs) -> KernelPath:
    """"triton" when the public op `op` runs its Triton kernel on `device` with these inputs,
    else "reference". Ops with a condition need its inputs as keywords (`CONDITIONS[op].needs`)
    whenever the device could run the kernel. Imports no Triton module."""
    if op not in CONDITIONS:
        raise KeyError(f"unknown op {op!r}; known: {sorted(CONDITIONS)}")
    if torch.device(device).type != "cuda" or not triton_available():
        return "reference"
    cond = CONDITIONS[op]
    if cond is None:
        return "triton"
    inputs = {"device": torch.device(device), **inputs}
    missing = [n for n in cond.needs if n not in inputs]
    if missing:
        raise TypeError(f"kernel_path({op!r}) needs the input(s) {missing} to decide")
    return "triton" if cond.check(**{n: inputs[n] for n in cond.needs}) else "reference"


__all__ = ["CONDITIONS", "FP8_GEMV_ENV", "Condition", "KernelPath", "fp8_gemv_enabled",
           "kernel_path"]
