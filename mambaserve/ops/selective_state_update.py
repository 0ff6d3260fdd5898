"""Selective state update: one Mamba2 decode step per row, in place on the state pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.ops.conv1d import safe_slots
from mambaserve.ops.dispatch import kernel_path


def selective_state_update(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    state_slots: torch.Tensor,
    snap_dst: torch.Tensor | None = None,
) -> torch.Tensor:
    """state <- state * exp(dt A) + dt B x;  y = state · C + D x.

    ssm_state: [num_slots + 1, H, P, N] (last slot = scratch); x: [Bt, H, P]; dt: [Bt, H] raw;
    A, D, dt_bias: [H]; B, C: [Bt, G, N]; state_slots: [Bt] int32, negative = skip. `snap_dst`
    [Bt] (prefix caching's decode snapshots): the row's new state is also written to this slot
    (-1: none; the reference sends those to the scratch slot). Returns y [Bt, H, P] in x.dtype.
    """
    if kernel_path("selective_state_update", x.device) == "triton":
        from mambaserve.ops.triton.selective_state_update import selective_state_update_triton

        return selective_state_update_triton(ssm_state, x, dt, A, B, C, D, dt_bias, dt_limit,
                                             state_slots, snap_dst)
    return selective_state_update_ref(ssm_state, x, dt, A, B, C, D, dt_bias, dt_limit, state_slots,
                                      snap_dst)


def selective_state_update_ref(ssm_state, x, dt, A, B, C, D, dt_bias, dt_limit, state_slots,
                               snap_dst=None):
    H = x.shape[1]
    G = B.shape[1]
    slots = safe_slots(state_slots, ssm_state.shape[0])
    dt = F.softplus(dt.float() + dt_bias.float())
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])  # [Bt, H]
    Bh = B.float().repeat_interleave(H // G, dim=1, output_size=H)  # [Bt, H, N]
    Ch = C.float().repeat_interleave(H // G, dim=1, output_size=H)
    state = ssm_state.index_select(0, slots).float()  # [Bt, H, P, N]
    dA = torch.exp(dt * A.float())[..., None, None]
    state = state * dA + (dt[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
    if snap_dst is not None:
        ssm_state.index_copy_(0, safe_slots(snap_dst, ssm_state.shape[0]),
                              state.to(ssm_state.dtype))
    y = torch.einsum("bhpn,bhn->bhp", state, Ch) + D.float()[None, :, None] * x.float()
    return y.to(x.dtype)
