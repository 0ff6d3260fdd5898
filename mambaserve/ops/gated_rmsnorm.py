"""The Mamba2 mixer's output gate: grouped gated RMSNorm (w * rmsnorm_per_group(y * silu(z)) and
its variants), and the gate without a norm (y * silu(z)).

`gated_rmsnorm` and `gated_silu` are the ops the mixer runs (their Triton kernels on CUDA, else
the references). `gated_rmsnorm` covers every family's variant: the weight multiplied after the
cast (NemotronH, Bamba, Granite, Mamba2) or in float32 before it (`weight_fp32`, Falcon-H1), and
the norm before the gate (`norm_before_gate`, Falcon-H1). `gated_rmsnorm_ref` is the torch
reference, and also the path of tensor parallelism with fewer norm groups than ranks, where one
group's channels lie on several ranks (`NormSpan`): each rank sums the squares of its channels
and an all-reduce completes the group's sum before the division.

`quantize=True` returns the output as `Fp8Rows` (ops/fp8_matmul.py: e4m3 codes and dynamic per-row
scales of the rounded output) for an FP8 out_proj of dynamic scales: on CUDA one launch per token
row normalizes all its groups and writes the FP8 row (rows of up to 16384 padded elements; wider
ones take the norm's launch, then a quantization launch). A batch of up to the tuning entry's
`fp8_unfused_rows` rows (decode) takes those two launches too: there the whole-row launch is one
SM's instruction issue per row, slower than the two (docs/kernels.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.fp8_matmul import Fp8Rows, quantize_rows


@dataclass(frozen=True)
class NormSpan:
    """This rank's channels are one part of norm group `index` (of `num_groups`), which has
    `group_size` channels over all the ranks sharing it; `all_reduce` sums a tensor over the
    tensor-parallel ranks, in place."""

    group_size: int
    index: int
    num_groups: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]


def gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                  eps: float, norm_before_gate: bool = False,
                  weight_fp32: bool = False, out: torch.Tensor | None = None,
                  quantize: bool = False):
    """y, z: [T, D]; weight: [D]; normalizes each group of `group_size` channels in float32.

    Default: w * rmsnorm(y * silu(z)), the weight multiply after the cast to y.dtype (as
    transformers does; the result in torch's promotion of the two dtypes). `weight_fp32`: the
    weight multiply in float32 before the one cast to y.dtype; `norm_before_gate`:
    w * rmsnorm(y) * silu(z), all in float32, one cast to y.dtype (`gated_rmsnorm_ref`).
    `out`: write the result into this [T, D] tensor (e.g. a column slice of a wider one) and
    return it. `quantize` (no `out`): the result as `Fp8Rows`.
    """
    args = (y, z, weight, group_size, eps, norm_before_gate, weight_fp32)
    if kernel_path("gated_rmsnorm", y.device) == "triton":
        from mambaserve.ops.triton.gated_rmsnorm import (
            fp8_row_launch,
            gated_rmsnorm_fp8_triton,
            gated_rmsnorm_triton,
        )

        if not quantize:
            return gated_rmsnorm_triton(*args, out)
        if kernel_path("fp8_quant", y.device) == "triton" and \
                fp8_row_launch(*y.shape, group_size, y.device):
            return Fp8Rows(*gated_rmsnorm_fp8_triton(*args))
        return quantize_rows(gated_rmsnorm_triton(*args))
    ref = gated_rmsnorm_ref(*args)
    return quantize_rows(ref) if quantize else _into(out, ref)


def gated_silu(y: torch.Tensor, z: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """y, z: [T, D] -> y * silu(z) in y.dtype, without a norm (Falcon-H1 with
    `mamba_rms_norm: false`): silu in z's dtype, the product in float32, one cast. `out` as
    `gated_rmsnorm`'s."""
    if kernel_path("gated_silu", y.device) == "triton":
        from mambaserve.ops.triton.gated_rmsnorm import gated_silu_triton

        return gated_silu_triton(y, z, out)
    return _into(out, gated_silu_ref(y, z))


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)


def gated_silu_ref(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The torch reference of `gated_silu` (transformers' FalconH1Mixer without its norm)."""
    return (y.float() * F.silu(z)).to(y.dtype)


def gated_rmsnorm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                      eps: float, norm_before_gate: bool = False, weight_fp32: bool = False,
                      span: NormSpan | None = None) -> torch.Tensor:
    """The torch reference, [T, D] in y.dtype. Default: w * rmsnorm(y * silu(z)) with the weight
    multiply after the cast (`gated_rmsnorm`'s contract). `weight_fp32`: the weight multiply in
    float32 before the one cast (Falcon-H1); `norm_before_gate`: w * rmsnorm(y) * silu(z), also
    weighted in float32. `span`: the D channels are part of one group spanning several ranks
    (then `group_size` is ignored; `span.group_size` is the whole group's)."""
    gate = F.silu(z.float())
    h = y.float() if norm_before_gate else y.float() * gate
    h = _normalize(h, group_size, eps, span)
    if not (weight_fp32 or norm_before_gate):
        return weight * h.to(y.dtype)
    h = weight.float() * h
    if norm_before_gate:
        h = h * gate
    return h.to(y.dtype)


def _normalize(h: torch.Tensor, group_size: int, eps: float,
               span: NormSpan | None) -> torch.Tensor:
    """h [T, D] float32 scaled by rsqrt(mean square of its group + eps)."""
    T, D = h.shape
    if span is None:
        g = h.view(T, D // group_size, group_size)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(T, D)
    # every rank writes its partial sum of squares in its group's column; the all-reduce adds
    # the partials of the ranks sharing each group (other columns are never read)
    sums = torch.zeros(T, span.num_groups, dtype=torch.float32, device=h.device)
    sums[:, span.index] = h.pow(2).sum(-1)
    span.all_reduce(sums)
    mean_square = sums[:, span.index:span.index + 1] / span.group_size
    return h * torch.rsqrt(mean_square + eps)
