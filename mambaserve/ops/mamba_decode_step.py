"""A Mamba2 layer's decode step after in_proj: the causal conv step of xBC, then the selective
state update, both in place on the pools.

    conv_state_step(xBC, conv_weight, conv_bias, conv_state, ssm_state, dt, A, D, dt_bias,
                    dt_limit, state_slots, n_groups) -> y [Bt, H, P]

is `causal_conv1d_update` (silu) followed by `selective_state_update` on the conv output split
into x [Bt, H, P], B and C [Bt, G, N]. The two ops run in turn, each through its own dispatch
(Triton kernels on CUDA). The one Triton launch that does both
(`ops/triton/mamba_decode_step.py`) runs only with MAMBASERVE_FUSED_DECODE_STEP=1: on an H100 its
results differ from the two kernels' (ops/dispatch.py, docs/kernels.md).
"""

from __future__ import annotations

import torch

from mambaserve.ops.conv1d import causal_conv1d_update
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.selective_state_update import selective_state_update


def conv_state_step(xBC: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                    conv_state: torch.Tensor, ssm_state: torch.Tensor, dt: torch.Tensor,
                    A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                    dt_limit: tuple[float, float], state_slots: torch.Tensor,
                    n_groups: int) -> torch.Tensor:
    """xBC: [Bt, d_inner + 2 G N] (rows may be strided); conv_state: [slots + 1, K-1, conv_dim];
    ssm_state: [slots + 1, H, P, N]; dt: [Bt, H] raw; A, D, dt_bias: [H]; state_slots: [Bt]
    int32, negative = skip. Returns y [Bt, H, P] in xBC.dtype."""
    if kernel_path("conv_state_step", xBC.device) == "triton":
        from mambaserve.ops.triton.mamba_decode_step import conv_state_step_triton

        return conv_state_step_triton(xBC, conv_weight, conv_bias, conv_state, ssm_state, dt, A,
                                      D, dt_bias, dt_limit, state_slots, n_groups)
    return conv_state_step_ref(xBC, conv_weight, conv_bias, conv_state, ssm_state, dt, A, D,
                               dt_bias, dt_limit, state_slots, n_groups)


def conv_state_step_ref(xBC, conv_weight, conv_bias, conv_state, ssm_state, dt, A, D, dt_bias,
                        dt_limit, state_slots, n_groups):
    """The two ops in turn (each its own dispatch)."""
    Bt = xBC.shape[0]
    _, H, P, N = ssm_state.shape
    xc = causal_conv1d_update(xBC, conv_weight, conv_bias, conv_state, state_slots)
    xs, B, C = xc.split([H * P, n_groups * N, n_groups * N], dim=-1)
    return selective_state_update(ssm_state, xs.reshape(Bt, H, P), dt, A,
                                  B.reshape(Bt, n_groups, N), C.reshape(Bt, n_groups, N), D,
                                  dt_bias, dt_limit, state_slots)
