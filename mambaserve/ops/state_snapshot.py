"""Prefix-cache snapshots written during the forward, per Mamba layer, into slots the scheduler
reserved. Fixed shapes only: destination -1 goes to the scratch slot (a CUDA-graph-safe no-op).

Prefill: the SSM state at a snapshot position is the end state of the chunk that ends there,
which the scan writes itself (`ssd_chunk_scan_varlen`'s chunk_snap_dst); the conv state
is the K-1 xBC inputs before that position, gathered from the extended stream BEFORE the conv
op overwrites the row's window (`save_prefill_conv_snapshots`).
Decode: the row's state after its token, written by the conv step and the state update
themselves (their `snap_dst`: ops/conv1d.py, ops/selective_state_update.py).
"""

from __future__ import annotations

import torch

from mambaserve.ops.conv1d import extended_stream, safe_slots
from mambaserve.ops.dispatch import kernel_path


def save_prefill_conv_snapshots(x: torch.Tensor, conv_state: torch.Tensor,
                                state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                                snap_conv_idx: torch.Tensor, snap_dst: torch.Tensor) -> None:
    """x: [Tp, conv_dim] xBC of the prefill rows; snap_conv_idx: [S, K-1]; snap_dst: [S]. On
    CUDA with Triton one launch gathers each snapshot's window itself and only entries with a
    destination (>= 0) move bytes; the reference builds the whole extended stream and sends the
    others to the scratch slot."""
    if kernel_path("save_prefill_conv_snapshots", conv_state.device, x=x,
                   conv_state=conv_state) == "triton":
        from mambaserve.ops.triton.conv_snapshot import save_prefill_conv_snapshots_triton

        save_prefill_conv_snapshots_triton(x, conv_state, state_slots, has_initial_state,
                                           snap_conv_idx, snap_dst)
        return
    save_prefill_conv_snapshots_ref(x, conv_state, state_slots, has_initial_state,
                                    snap_conv_idx, snap_dst)


def save_prefill_conv_snapshots_ref(x: torch.Tensor, conv_state: torch.Tensor,
                                    state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                                    snap_conv_idx: torch.Tensor, snap_dst: torch.Tensor) -> None:
    """Reference of `save_prefill_conv_snapshots`: the extended stream gathered, every entry
    copied, -1 to the scratch slot."""
    ext = extended_stream(x, conv_state, state_slots, has_initial_state)
    dst = safe_slots(snap_dst, conv_state.shape[0])
    conv_state.index_copy_(0, dst, ext[snap_conv_idx].to(conv_state.dtype))


def restore_snapshots(conv_state: torch.Tensor, ssm_state: torch.Tensor, src: torch.Tensor,
                      dst: torch.Tensor) -> None:
    """Prefix-cache hits: copy whole states (every Mamba layer) from cached snapshot slots `src`
    into live slots `dst`, before the first layer. conv_state: [L, slots + 1, K-1, conv_dim];
    ssm_state: [L, slots + 1, H, P, N]; src, dst: [R] (real slots, never -1; no slot in both).

    On CUDA with Triton (contiguous pools): one row-copy launch per pool over the (layer, slot)
    rows, with no temporary and no index arithmetic of its own (the kernel adds each layer's
    offset). The reference's index_select materializes every restored state first (~140 MB per
    row at the 9B shapes)."""
    if kernel_path("restore_snapshots", ssm_state.device, conv_state=conv_state,
                   ssm_state=ssm_state) == "triton":
        from mambaserve.ops.triton.state_copy import copy_rows_triton

        L, S = ssm_state.shape[:2]
        for pool in (conv_state, ssm_state):  # the kernel walks the layers itself
            flat = pool.view(L * S, -1)
            copy_rows_triton(flat, src, flat, dst, layers=L, layer_rows=S)
        return
    restore_snapshots_ref(conv_state, ssm_state, src, dst)


def restore_snapshots_ref(conv_state: torch.Tensor, ssm_state: torch.Tensor, src: torch.Tensor,
                          dst: torch.Tensor) -> None:
    """Reference of `restore_snapshots`."""
    conv_state.index_copy_(1, dst, conv_state.index_select(1, src))
    ssm_state.index_copy_(1, dst, ssm_state.index_select(1, src))
