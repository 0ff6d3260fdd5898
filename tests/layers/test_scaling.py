"""Folding a scale into a loaded layer (layers/scaling.py and the layers' `fold_scales`): the
folded weights are the weights times the scale, rounded once from float32, and the folded
layer computes what the unfolded one computed with its separate multiplies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mambaserve.layers.fp8_linear import Fp8Linear
from mambaserve.layers.mlp import GatedMLP
from mambaserve.layers.scaling import scale_, scale_linear_


def _linear(dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(24, 16, bias=bias).to(dtype)
    with torch.no_grad():
        if bias:
            lin.bias.normal_(0, 0.5)
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_and_input(dtype):
    """weight rows * out * in, bias * out, each value rounded once from float32."""
    lin = _linear(dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    rows = torch.linspace(0.3, 1.7, 16, dtype=torch.float64)
    scale_linear_(lin, rows, 1.25)
    factor = (rows * 1.25).float()[:, None]
    assert torch.equal(lin.weight, (w.float() * factor).to(dtype))
    assert torch.equal(lin.bias, (b.float() * rows.float()).to(dtype))
    assert lin.weight.dtype == dtype


def test_linear_folded_equals_unfolded_forward():
    lin = _linear()
    x = torch.randn(5, 24)
    want = lin(x * 0.8) * 1.3
    scale_linear_(lin, 1.3, 0.8)
    torch.testing.assert_close(lin(x), want, rtol=1e-6, atol=1e-6)


def test_ones_change_nothing():
    lin = _linear(torch.bfloat16)
    w = lin.weight.detach().clone()
    scale_linear_(lin, torch.ones(16, dtype=torch.float64), 1.0)
    assert torch.equal(lin.weight, w)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_linear_takes_the_scale_in_its_weight_scale(static):
    """The FP8 weight stays; the row scales take out * in, the static input scale is divided by
    in (the activation lands on the same FP8 grid), the bias takes out."""
    lin = _linear()
    fp8 = Fp8Linear.from_linear(lin)
    if static:
        fp8.input_scale = nn.Parameter(torch.tensor(0.02), requires_grad=False)
    q = fp8.weight.detach().clone()
    x = torch.randn(6, 24)
    want = fp8(x * 0.8) * 1.3
    scale_linear_(fp8, 1.3, 0.8)
    assert torch.equal(fp8.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(fp8(x), want, rtol=1e-5, atol=1e-5)
    if static:
        assert fp8.input_scale.item() == pytest.approx(0.02 / 0.8, rel=1e-6)


def test_folding_a_sharded_projection_is_refused():
    with pytest.raises(TypeError, match="fold before sharding"):
        scale_linear_(nn.Conv1d(2, 2, 1), 2.0)


def test_scale_rows_of_a_stack():
    t = torch.randn(3, 4, 5)
    scale_(t[1], 0.5)  # a view: writes through
    t2 = torch.randn(3, 4, 5)
    ref = t2.clone()
    scale_(t2, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert torch.equal(t2, ref * torch.tensor([1.0, 2.0, 3.0])[:, None, None])


@pytest.mark.parametrize("fp8", [False, True])
def test_gated_mlp(fp8):
    """gate_multiplier into the gate half (before silu: silu(W x m) = silu(m W x)),
    down_multiplier * the residual scale into down_proj; the multipliers are then 1."""
    torch.manual_seed(2)
    mlp = GatedMLP(32, 24, bias=True, gate_multiplier=0.7, down_multiplier=1.3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
    if fp8:
        mlp.to_fp8(static_input_scale=False, quantize=True)
    x = torch.randn(5, 32)
    want = mlp(x) * 0.6
    mlp.fold_scales(0.6)
    assert mlp.gate_multiplier == mlp.down_multiplier == 1.0
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    if not fp8:  # and silu really saw the scaled gate
        gate, up = F.linear(x, mlp.gate_up_weight.view(48, 32),
                            mlp.gate_up_bias.view(48)).split(24, dim=-1)
        torch.testing.assert_close(mlp.down_proj(F.silu(gate) * up), want, rtol=1e-5, atol=1e-5)
