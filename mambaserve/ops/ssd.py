"""SSD (Mamba2 state-space duality) chunked scan over the flat multi-row prefill stream.

Chunks are cut at ABSOLUTE positions that are multiples of `chunk_size` (a row whose prefix ends
mid-chunk gets a short first chunk) and never hold tokens of two rows, so:
  * the state at the end of any chunk is the row's state at an aligned absolute position
    (what a prefix-cache snapshot stores: the scan writes it into the pool slot
    `chunk_snap_dst[chunk]` itself);
  * state passing restarts at each row's first chunk from its initial state (or zero).

Stages: dt = clamp(softplus(dt + dt_bias)); per chunk the cumulative sum of dt*A; the intra-chunk
(diagonal) output C·Bᵀ ∘ decay · (dt x); each chunk's end state from zero; sequential passing of
states across each row's chunks; the inter-chunk output C · S_prev · decay; plus D x.

The reference gathers tokens into a padded [num_chunks, chunk_size] grid with host-built indices
(`ForwardMetadata.chunk_token_idx`, `token_chunk_pos`), computes in float32, and passes states
with one loop over the host-known maximum number of chunks per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.ops.conv1d import safe_slots
from mambaserve.ops.dispatch import kernel_path


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_token_idx: torch.Tensor,
    token_chunk_pos: torch.Tensor,
    row_chunks: torch.Tensor,
    row_num_chunks: torch.Tensor,
    chunk_snap_dst: torch.Tensor | None = None,
    out_chunks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked scan of all prefill rows; writes each row's final state into its slot, and each
    chunk's end state into its prefix-cache snapshot slot chunk_snap_dst[chunk] (if >= 0).

    x:                 [T, H, P]  (model dtype)        dt: [T, H] raw (before bias/softplus)
    A:                 [H] float32 (negative)           B, C: [T, G, N]
    D, dt_bias:        [H]
    ssm_state:         [num_slots + 1, H, P, N] (float32 by default); last slot = scratch
    state_slots:       [R] int32 (negative = skip)      has_initial_state: [R] bool
    chunk_token_idx:   [num_chunks, chunk_size] int64 token index, padding = T (a zero row)
    token_chunk_pos:   [T] int64 flat position of each token in the chunk grid
    row_chunks:        [R, max_chunks_per_row] int64 chunk ids of each row, padding = num_chunks
    row_num_chunks:    [R] int64 number of chunks of each row (>= 1)
    chunk_snap_dst:    [num_chunks] int64 or None (no snapshots); -1: none (on CUDA nothing is
                       written; the reference sends it to the scratch slot)
    out_chunks:        [n] int64 chunk ids or None: y is read only at those chunks' tokens (the
                       caller's output rows); the Triton scan computes the output of those
                       chunks alone (entries may repeat), leaving y elsewhere undefined; the
                       reference computes every chunk. The states are the same either way.
    returns y [T, H, P] in x.dtype
    """
    chunk_size = chunk_token_idx.shape[1]
    if kernel_path("ssd_chunk_scan_varlen", x.device, chunk_size=chunk_size) == "triton":
        from mambaserve.ops.triton.ssd import ssd_chunk_scan_varlen_triton

        return ssd_chunk_scan_varlen_triton(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state,
                                            state_slots, has_initial_state, chunk_token_idx,
                                            token_chunk_pos, row_chunks, row_num_chunks,
                                            chunk_snap_dst, out_chunks)
    return ssd_chunk_scan_varlen_ref(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                                     has_initial_state, chunk_token_idx, token_chunk_pos,
                                     row_chunks, row_num_chunks, chunk_snap_dst)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a: [..., L] -> [..., L, L] with out[i, j] = sum_{j < k <= i} a[k] (−inf above diagonal)."""
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)
    below = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~below, 0)
    out = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~keep, -torch.inf)


def ssd_chunk_scan_varlen_ref(x, dt, A, B, C, D, dt_bias, dt_limit, ssm_state, state_slots,
                              has_initial_state, chunk_token_idx, token_chunk_pos, row_chunks,
                              row_num_chunks, chunk_snap_dst=None):
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    num_chunks, L = chunk_token_idx.shape
    R, max_cpr = row_chunks.shape

    dt = F.softplus(dt.float() + dt_bias.float())
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    xf = x.float()
    Bf = B.float().repeat_interleave(H // G, dim=1, output_size=H)  # [T, H, N]
    Cf = C.float().repeat_interleave(H // G, dim=1, output_size=H)

    def grid(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [num_chunks, L, ...], pad row = 0
        padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))], dim=0)
        return padded[chunk_token_idx]

    xc, dtc, Bc, Cc = grid(xf), grid(dt), grid(Bf), grid(Cf)  # dt of padding = 0
    dA = (dtc * A.float()).permute(0, 2, 1)  # [c, H, L]
    dA_cum = torch.cumsum(dA, dim=-1)
    xdt = xc * dtc[..., None]  # [c, L, H, P]

    # 1. intra-chunk output
    decay = torch.exp(_segsum(dA))  # [c, H, L, L]
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xdt)

    # 2. end state of each chunk started from zero
    decay_to_end = torch.exp(dA_cum[..., -1:] - dA_cum)  # [c, H, L]
    local_states = torch.einsum("clhn,chl,clhp->chpn", Bc, decay_to_end, xdt)
    chunk_decay = torch.exp(dA_cum[..., -1])  # [c, H]

    # 3. pass states along each row's chunks (all rows in parallel, host-known loop length)
    slots = safe_slots(state_slots, ssm_state.shape[0])
    init = ssm_state.index_select(0, slots).float()  # where: ignore garbage in fresh rows' slots
    init = torch.where(has_initial_state[:, None, None, None], init, 0.0)
    start_states = local_states.new_zeros((num_chunks + 1, H, P, N))
    end_states = local_states.new_zeros((num_chunks + 1, H, P, N))
    local_pad = torch.cat([local_states, local_states.new_zeros((1, H, P, N))])
    decay_pad = torch.cat([chunk_decay, chunk_decay.new_ones((1, H))])
    running = init
    for i in range(max_cpr):
        cid = row_chunks[:, i]
        start_states.index_copy_(0, cid, running)
        running = running * decay_pad[cid][..., None, None] + local_pad[cid]
        end_states.index_copy_(0, cid, running)
    start_states, end_states = start_states[:num_chunks], end_states[:num_chunks]

    # 4. inter-chunk output from each chunk's start state
    y = y + torch.einsum("clhn,chpn,chl->clhp", Cc, start_states, torch.exp(dA_cum))

    y_flat = y.reshape(num_chunks * L, H, P)[token_chunk_pos]  # [T, H, P]
    y_flat = y_flat + D.float()[None, :, None] * xf

    last_chunk = row_chunks.gather(1, (row_num_chunks - 1)[:, None]).squeeze(1)
    ssm_state.index_copy_(0, slots, end_states[last_chunk].to(ssm_state.dtype))
    if chunk_snap_dst is not None:  # snapshot slots are never live slots: the order is free
        ssm_state.index_copy_(0, safe_slots(chunk_snap_dst, ssm_state.shape[0]),
                              end_states.to(ssm_state.dtype))
    return y_flat.to(x.dtype)
