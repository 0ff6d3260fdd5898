"""Feed-forward blocks: the non-gated squared-ReLU MLP (NemotronH's `mlp` layers and shared
experts) and the gated SiLU MLP, SwiGLU (Falcon-H1, Bamba, Granite's shared MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.parallel_modules import (
    RowParallelLinear,
    keep_rows,
    param_of,
    shard_range,
)
from mambaserve.layers.fp8_linear import is_dynamic_fp8
from mambaserve.layers.linear import Linear, folds_residual, is_plain_linear, residual_projection
from mambaserve.layers.scaling import scale_, scale_linear_
from mambaserve.ops.activation import relu2, silu_mul  # one Triton pass each on CUDA
from mambaserve.ops.fp8_matmul import (
    FP8_DTYPE,
    Fp8Rows,
    fp8_linear,
    quantize_rows,
    quantize_weight_fp8,
)
from mambaserve.ops.linear import act_linear, linear, relu2_mlp


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def shard(self, tp: TPGroup, reduce: bool = True, what: str = "intermediate_size") -> None:
        """up_proj column-parallel, down_proj row-parallel (all-reduce; `reduce=False`: the
        output is this rank's partial sum, the caller all-reduces). `what` names the size in
        errors."""
        if tp.tp_size == 1:
            return
        i0, i1 = shard_range(self.up_proj.out_features, tp, what)
        keep_rows(self.up_proj, torch.arange(i0, i1))
        self.down_proj = RowParallelLinear(self.down_proj, i0, i1, tp, reduce)

    def fold_scales(self, out_scale: float = 1.0) -> None:
        """Once after loading: fold a scale of the output into down_proj (layers/scaling.py)."""
        scale_linear_(self.down_proj, out_scale)

    def takes_fp8_rows(self) -> bool:
        """up_proj is FP8 of dynamic scales: x may come as `Fp8Rows`."""
        return is_dynamic_fp8(self.up_proj)

    @property
    def folds_residual(self) -> bool:
        """`forward(x, residual)` is taken: down_proj is a plain projection without bias."""
        return folds_residual(self.down_proj)

    def forward(self, x: torch.Tensor | Fp8Rows,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(relu²(up(x))); `residual` (only where `folds_residual`): residual + that, added
        by down's launch."""
        u, d = self.up_proj, self.down_proj
        if residual is not None:
            return residual_projection(d, relu2(u(x)), residual)
        if is_plain_linear(d) and is_plain_linear(u):  # relu² in a launch for decode batches
            return relu2_mlp(x, u.weight, u.bias, d.weight, d.bias)
        up = u(x)
        if is_plain_linear(d):  # relu² in down's launch for decode-sized batches
            return act_linear(up, "relu2", d.weight, d.bias)
        if is_dynamic_fp8(d):  # relu² in the quantization's launch
            return d(quantize_rows(up, "relu2"))
        return d(relu2(up))


class GatedMLP(nn.Module):
    """down(silu(gate(x) * gate_multiplier) * up(x)) * down_multiplier (both multipliers 1 after
    `fold_scales` moved them into the weights).

    gate and up are one projection whose weight is stacked [2, I, hidden] (gate first), so one
    matmul computes both; checkpoints with separate gate_proj / up_proj tensors load into its
    two halves, fused ones ([2I, hidden], gate first) into the whole.

    FP8 (`to_fp8`): the stack is stored as float8_e4m3fn with `gate_up_weight_scale` [2, I]
    (one float32 scale per output row) and, with a static activation scale, `gate_up_input_scale`
    (one float32; two per-half checkpoint scales load as their maximum, the scale both halves'
    shared input is quantized with)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_weight = nn.Parameter(torch.empty(2, intermediate_size, hidden_size))
        self.gate_up_bias = nn.Parameter(torch.empty(2, intermediate_size)) if bias else None
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        self.register_parameter("gate_up_weight_scale", None)  # FP8 only (to_fp8)
        self.register_parameter("gate_up_input_scale", None)

    @torch.no_grad()
    def to_fp8(self, static_input_scale: bool, quantize: bool) -> None:
        """Store the gate|up stack in FP8: `quantize` converts the loaded weight (per-row
        scales, dynamic activation scales); otherwise the FP8 parameters are left for a
        checkpoint to fill (the input scale starts at 0: the loader keeps the maximum)."""
        w = self.gate_up_weight
        shape = tuple(w.shape[:2])
        if quantize:
            q, scale = quantize_weight_fp8(w.reshape(-1, w.shape[-1]), per_channel=True)
            q, scale = q.view(w.shape), scale.view(shape)
        else:
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            scale = torch.ones(shape, dtype=torch.float32, device=w.device)
        self.gate_up_weight = nn.Parameter(q, requires_grad=False)
        self.gate_up_weight_scale = nn.Parameter(scale, requires_grad=False)
        if static_input_scale:
            self.gate_up_input_scale = nn.Parameter(
                torch.zeros((), dtype=torch.float32, device=w.device), requires_grad=False)

    def shard(self, tp: TPGroup, reduce: bool = True, what: str = "intermediate_size") -> None:
        """gate and up column-parallel (the same rows of both halves), down_proj row-parallel
        (all-reduce; `reduce=False`: the output is this rank's partial sum, the caller
        all-reduces; down_multiplier is linear, so it applies to the partials)."""
        if tp.tp_size == 1:
            return
        i0, i1 = shard_range(self.intermediate_size, tp, what)
        self.gate_up_weight = param_of(self.gate_up_weight[:, i0:i1])
        if self.gate_up_bias is not None:
            self.gate_up_bias = param_of(self.gate_up_bias[:, i0:i1])
        self.down_proj = RowParallelLinear(self.down_proj, i0, i1, tp, reduce)
        self.intermediate_size = i1 - i0

    @torch.no_grad()
    def fold_scales(self, out_scale: float = 1.0) -> None:
        """Once after loading, before sharding: fold gate_multiplier into the gate half's rows
        (weight, or its FP8 scales, and bias: silu reads gate(x) * m either way) and
        down_multiplier times a scale of the output into down_proj (layers/scaling.py)."""
        if self.gate_multiplier != 1.0:
            gate_rows = self.gate_up_weight if self.gate_up_weight_scale is None \
                else self.gate_up_weight_scale
            scale_(gate_rows[0], self.gate_multiplier)
            if self.gate_up_bias is not None:
                scale_(self.gate_up_bias[0], self.gate_multiplier)
        scale_linear_(self.down_proj, self.down_multiplier * out_scale)
        self.gate_multiplier = self.down_multiplier = 1.0

    def takes_fp8_rows(self) -> bool:
        """The gate|up stack is FP8 of dynamic scales: x may come as `Fp8Rows`."""
        return self.gate_up_weight_scale is not None and self.gate_up_input_scale is None

    @property
    def folds_residual(self) -> bool:
        """`forward(x, residual)` is taken: down_proj is a plain projection without bias, and no
        multiplier is left unfolded."""
        return folds_residual(self.down_proj) and self.gate_multiplier == 1.0 \
            and self.down_multiplier == 1.0

    def forward(self, x: torch.Tensor | Fp8Rows,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual` (only where `folds_residual`): residual + the output, added by down's
        launch."""
        I = self.intermediate_size
        bias = None if self.gate_up_bias is None else self.gate_up_bias.view(2 * I)
        w = self.gate_up_weight.view(2 * I, -1)
        if self.gate_up_weight_scale is not None:
            gate_up = fp8_linear(x, w, self.gate_up_weight_scale.view(2 * I),
                                 self.gate_up_input_scale, bias)
        else:
            gate_up = linear(x, w, bias)
        d = self.down_proj
        if residual is not None:
            return residual_projection(d, silu_mul(gate_up), residual)
        if self.gate_multiplier != 1.0:  # unfolded (tests): the torch expression
            gate, up = gate_up.split(I, dim=-1)
            out = d(F.silu(gate * self.gate_multiplier) * up)
        elif is_plain_linear(d):  # silu(gate) * up in down's launch for decode-sized batches
            out = act_linear(gate_up, "silu_mul", d.weight, d.bias)
        elif is_dynamic_fp8(d):  # silu(gate) * up in the quantization's launch
            out = d(quantize_rows(gate_up, "silu_mul"))
        else:
            out = d(silu_mul(gate_up))  # one Triton pass on CUDA
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out
