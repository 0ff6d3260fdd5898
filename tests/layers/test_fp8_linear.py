"""Fp8Linear and GatedMLP's FP8 stack against the explicit quantize -> dequantize -> float32
matmul of the weights they were built from."""

import torch
from torch import nn

from mambaserve.layers.fp8_linear import Fp8Linear, swap_to_fp8
from mambaserve.layers.mlp import GatedMLP


def explicit(x, w, x_scale=None):
    """Per-row weight scale, per-token (or static) activation scale, each rounded by the cast."""
    ws = w.float().abs().amax(dim=1, keepdim=True) / 448.0
    wd = (w.float() / ws).clamp(-448, 448).to(torch.float8_e4m3fn).float() * ws
    xs = x.float().abs().amax(dim=-1, keepdim=True) / 448.0 if x_scale is None else x_scale
    xd = (x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn).float() * xs
    return xd @ wd.t()


def test_from_linear():
    torch.manual_seed(0)
    lin = nn.Linear(48, 40, bias=True)
    fp8 = Fp8Linear.from_linear(lin)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.input_scale is None
    assert fp8.weight_scale.shape == (40,)
    x = torch.randn(7, 48)
    torch.testing.assert_close(fp8(x), explicit(x, lin.weight) + lin.bias, rtol=1e-5, atol=1e-5)


def test_swap_leaves_an_unfilled_module_of_the_same_shape():
    model = nn.Sequential(nn.Linear(16, 32, bias=False))
    layer = swap_to_fp8(model, "0", static_input_scale=True)
    assert model[0] is layer and layer.weight.shape == (32, 16)
    assert layer.input_scale is not None and layer.input_scale.dim() == 0
    names = {n for n, _ in model.named_parameters()}
    assert names == {"0.weight", "0.weight_scale", "0.input_scale"}


def test_gated_mlp_to_fp8():
    torch.manual_seed(1)
    mlp = GatedMLP(32, 24, gate_multiplier=0.7, down_multiplier=1.3)
    with torch.no_grad():
        mlp.gate_up_weight.normal_(0, 0.2)
    w = mlp.gate_up_weight.detach().clone().view(48, 32)
    down = mlp.down_proj.weight.detach().clone()
    mlp.to_fp8(static_input_scale=False, quantize=True)
    x = torch.randn(5, 32)
    gate, up = explicit(x, w).split(24, dim=-1)
    want = (torch.nn.functional.silu(gate * 0.7) * up) @ down.t() * 1.3
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    assert mlp.gate_up_weight.dtype == torch.float8_e4m3fn
    assert mlp.gate_up_weight_scale.shape == (2, 24)
