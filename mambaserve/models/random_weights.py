"""Random weights at a model's real shapes, drawn directly in the target dtype on the target
device: the `load_format="dummy"` path of the loader and the preset checkpoint writer
(benchmarks at scale without a checkpoint to download). The distributions keep a forward
finite and the Mamba dynamics in their trained range: A in [-16, -1], softplus(dt_bias) in
[1e-3, 1e-1], unit norms and D, residual projections scaled by 1/sqrt(2 * layers)."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device,
                  gen: torch.Generator, num_layers: int) -> torch.Tensor:
    """A random value for our parameter `name` (a name of `model.named_parameters()`)."""
    def normal(std: float) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)

    if name.endswith(("norm.weight", "norm_weight", ".D")):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("A_log"):
        t = torch.empty(shape, dtype=torch.float32, device=device).uniform_(1, 16, generator=gen)
        return t.log().to(dtype)
    if name.endswith("dt_bias"):
        dt = torch.empty(shape, dtype=torch.float32, device=device).uniform_(
            math.log(1e-3), math.log(1e-1), generator=gen).exp()
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)  # inverse softplus
    if name.endswith(("conv_weight", "conv_bias")):
        return normal(0.1)
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts_down")):
        return normal(0.02 / math.sqrt(2 * num_layers))
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return normal(0.02)


@torch.no_grad()
def init_random_(model: torch.nn.Module, num_layers: int, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter of a materialized model in place (each in its own dtype)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(random_tensor(name, tuple(p.shape), p.dtype, device, gen, num_layers))
    return model
