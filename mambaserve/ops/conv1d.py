"""Causal depthwise conv1d over the Mamba2 `xBC` stream: varlen prefill and one-step decode.

Conv state layout: `conv_state[slot, K-1, conv_dim]` holds the last K-1 inputs of the row (oldest
first). The prefill reference works on an "extended" token stream: the K-1 saved inputs of every
prefill row (zeros for rows without an initial state) followed by the new tokens; host-built
gather indices (`ForwardMetadata.conv_window_idx`, `conv_state_idx`) pick each token's window and
each row's new state from it, so no device value is ever read back.

A negative slot means "skip this row": its state is read from and written to the pool's scratch
slot (the last one), which nothing else uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.ops.dispatch import kernel_path


def safe_slots(slots: torch.Tensor, num_slots_with_scratch: int) -> torch.Tensor:
    """Map negative slots to the scratch slot (the last index of the pool)."""
    return torch.where(slots < 0, num_slots_with_scratch - 1, slots).long()


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    conv_window_idx: torch.Tensor,
    conv_state_idx: torch.Tensor,
    activation: bool = True,
) -> torch.Tensor:
    """Varlen causal conv1d for prefill rows; updates `conv_state` in place.

    x:                 [T, conv_dim] prefill tokens of all rows, rows contiguous (may be a strided view)
    weight:            [conv_dim, K]; bias: [conv_dim] or None
    conv_state:        [num_slots + 1, K-1, conv_dim] (model dtype); last slot = scratch
    state_slots:       [num_prefills] int32, negative = skip
    has_initial_state: [num_prefills] bool
    conv_window_idx:   [T, K] int64 into the extended stream (P*(K-1) + T rows)
    conv_state_idx:    [num_prefills, K-1] int64 into the extended stream
    returns            [T, conv_dim] silu(conv(x)) (or the raw conv when activation=False)
    """
    if kernel_path("causal_conv1d_varlen", x.device, weight=weight) == "triton":
        from mambaserve.ops.triton.conv1d_varlen import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(x, weight, bias, conv_state, state_slots,
                                           has_initial_state, conv_window_idx, conv_state_idx,
                                           activation)
    return causal_conv1d_varlen_ref(x, weight, bias, conv_state, state_slots, has_initial_state,
                                    conv_window_idx, conv_state_idx, activation)


def extended_stream(x: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
                    has_initial_state: torch.Tensor) -> torch.Tensor:
    """[P*(K-1) + T, conv_dim]: each prefill row's saved K-1 inputs (zeros for rows without an
    initial state), then the new tokens. The host-built conv indices point into it."""
    slots = safe_slots(state_slots, conv_state.shape[0])
    init = conv_state.index_select(0, slots).to(x.dtype)  # [P, K-1, D]
    # where, not a multiply: a fresh row must not see NaN/inf left in a reused slot
    init = torch.where(has_initial_state[:, None, None], init, 0.0)
    return torch.cat([init.reshape(-1, x.shape[1]), x], dim=0)


def causal_conv1d_varlen_ref(x, weight, bias, conv_state, state_slots, has_initial_state,
                             conv_window_idx, conv_state_idx, activation=True):
    slots = safe_slots(state_slots, conv_state.shape[0])
    ext = extended_stream(x, conv_state, state_slots, has_initial_state)
    windows = ext[conv_window_idx]  # [T, K, D]
    out = torch.einsum("tkd,dk->td", windows.to(weight.dtype), weight)
    if bias is not None:
        out = out + bias
    new_state = ext[conv_state_idx]  # [P, K-1, D]
    conv_state.index_copy_(0, slots, new_state.to(conv_state.dtype))
    out = F.silu(out) if activation else out
    return out.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: bool = True,
    snap_dst: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step per row; shifts the row's window in `conv_state` in place.

    x: [B, conv_dim]; conv_state: [num_slots + 1, K-1, conv_dim]; state_slots: [B] int32 (negative =
    skip). `snap_dst` [B] (prefix caching's decode snapshots): the row's new window is also
    written to this slot (-1: none; the reference sends those to the scratch slot). Returns
    [B, conv_dim].
    """
    if kernel_path("causal_conv1d_update", x.device) == "triton":
        from mambaserve.ops.triton.conv1d_update import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, weight, bias, conv_state, state_slots, activation,
                                           snap_dst)
    return causal_conv1d_update_ref(x, weight, bias, conv_state, state_slots, activation,
                                    snap_dst)


def causal_conv1d_update_ref(x, weight, bias, conv_state, state_slots, activation=True,
                             snap_dst=None):
    slots = safe_slots(state_slots, conv_state.shape[0])
    window = torch.cat([conv_state.index_select(0, slots).to(x.dtype), x[:, None, :]], dim=1)
    out = torch.einsum("bkd,dk->bd", window.to(weight.dtype), weight)
    if bias is not None:
        out = out + bias
    conv_state.index_copy_(0, slots, window[:, 1:].to(conv_state.dtype))
    if snap_dst is not None:
        conv_state.index_copy_(0, safe_slots(snap_dst, conv_state.shape[0]),
                               window[:, 1:].to(conv_state.dtype))
    out = F.silu(out) if activation else out
    return out.to(x.dtype)
