"""Triton sparse experts: the routed (token, expert) pairs sorted into one-expert blocks, then two
grouped GEMMs over the blocks. Same contract as `mambaserve.ops.moe_experts.moe_experts`.

1. `align_pairs` (no sync): the T*k pairs are sorted by expert (stable) and laid out
   in blocks of `block_m` rows, each expert's run padded to a multiple of `block_m`; padding rows
   hold the sentinel T*k. The layout's length is the host-known bound
   P_pad = round_up(T*k + min(E, T*k) * (block_m - 1), block_m), so the grids depend on T only
   (CUDA-graph friendly); `block_expert[b]` is block b's expert, or -1 for blocks past the used
   ones, which exit at once. Up to `ALIGN_KERNEL_MAX_PAIRS` pairs (decode, small prefills) one
   Triton launch (`_align_kernel`, a program per expert) builds the layout, above it a dozen
   torch ops (`align_pairs_torch`) do; both give the same layout.
2. `_moe_in_kernel`: per (block, column tile) program, the block's token rows of x (gathered)
   times its expert's w_in, with the activation fused (relu², or SwiGLU from the gate and up
   tiles of the same columns), into `inter` [P_pad, I] in block order.
3. `_moe_out_kernel`: the block's rows of `inter` times its expert's w_out, rounded to the model
   dtype, times the pair's routing weight (rounded to the model dtype too when the weight is in
   the model dtype), stored at the pair's index of `pair_out` [T*k, H] float32.
4. The k products of each token are summed (fixed order, so results do not depend on the batch).

Every intermediate rounding follows the reference (`moe_experts_ref`): the GEMM outputs rounded to
the model dtype before the activation, the activation computed in float32 and rounded once.
Launch parameters: `tuning` entry "moe_experts" (block_m None = from the pairs per expert).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the mean pairs per expert: small blocks waste little padding when few
    tokens reach each expert (decode), large ones reuse each weight tile over more rows."""
    per_expert = num_pairs / num_experts
    for block_m in (16, 32, 64):
        if per_expert <= block_m:
            return block_m
    return 128


def padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The host-known length of the block layout (see the module docstring)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


ALIGN_KERNEL_MAX_PAIRS = 8192


def align_pairs(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P_pad] int32: pair index t*k+j per row, sentinel T*k on padding rows (rows
    of blocks past the used ones are left unset: no kernel reads them); block_expert
    [P_pad / block_m] int32: the expert of each block, -1 past the used blocks). Fixed shapes
    and device ops only: no host sync."""
    num_pairs = topk_ids.numel()
    if num_pairs > ALIGN_KERNEL_MAX_PAIRS:
        return align_pairs_torch(topk_ids, num_experts, block_m)
    total = padded_pairs(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_pairs = torch.empty(total, dtype=torch.int32, device=dev)
    block_expert = torch.empty(total // block_m, dtype=torch.int32, device=dev)
    _align_kernel[(num_experts,)](
        topk_ids.reshape(-1).contiguous(), sorted_pairs, block_expert, num_pairs, total // block_m,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=256, num_warps=4)
    return sorted_pairs, block_expert


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_blocks,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Program e: every expert's pair count (so its padded start), then its own pairs in pair
    order, its padding rows, its blocks' expert ids; program 0 also marks the unused blocks."""
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    end = start + tl.sum(tl.where(experts == e, padded, 0), axis=0)
    done = 0
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        mine = (ids == e).to(tl.int32)
        dest = start + done + tl.cumsum(mine, axis=0) - 1
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=mine != 0)
        done += tl.sum(mine, axis=0)
    pad_rows = start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + pad_rows, tl.full((BLOCK_M,), 0, tl.int32) + num_pairs,
             mask=pad_rows < end)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + blocks, tl.full((CHUNK,), 0, tl.int32) + e,
                 mask=blocks < end // BLOCK_M)
    if e == 0:
        used = tl.sum(padded, axis=0) // BLOCK_M
        for b0 in range(used, num_blocks, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + blocks, tl.full((CHUNK,), -1, tl.int32),
                     mask=blocks < num_blocks)


def align_pairs_torch(topk_ids: torch.Tensor, num_experts: int,
                      block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` in torch ops (every row of sorted_pairs set)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - count_start[expert_of]
    total = padded_pairs(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((total,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[pad_start[expert_of] + rank] = order.to(torch.int32)
    block_first_row = torch.arange(0, total, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_first_row, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _program_block(block_expert_ptr, N, BLOCK_N: tl.constexpr):
    """(this program's block, its column tile, the block's expert: -1 = nothing to do)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    return pid_m, pid % num_n, tl.load(block_expert_ptr + pid_m)


@triton.jit
def _block_operands(sorted_ptr, w_ptr, e, pid_m, pid_n, num_pairs, stride_we, stride_wn, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The block's rows and their pair ids (valid: not padding), the tile's columns, and the
    pointers of expert e's first [BLOCK_K, BLOCK_N] weight tile (rows of w: output columns)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    b_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    return rows, pair, pair < num_pairs, offs_n, offs_n < N, offs_k, b_ptrs


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_in_kernel(x_ptr, w_ptr, inter_ptr, sorted_ptr, block_expert_ptr,
                   num_pairs, top_k, N, K,
                   stride_xt, stride_we, stride_wn, stride_im,
                   SWIGLU: tl.constexpr, DT: tl.constexpr, IP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, e = _program_block(block_expert_ptr, N, BLOCK_N)
    if e < 0:
        return
    rows, pair, valid, offs_n, n_ok, offs_k, b_ptrs = _block_operands(
        sorted_ptr, w_ptr, e, pid_m, pid_n, num_pairs, stride_we, stride_wn, N,
        BLOCK_M, BLOCK_N, BLOCK_K)
    tok = (pair // top_k).to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=IP)
        if SWIGLU:  # the up rows of the same columns sit N rows below the gate rows
            bu = tl.load(b_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, bu, acc=acc_up, input_precision=IP)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    h = acc.to(DT).to(tl.float32)
    if SWIGLU:
        silu = (h / (1.0 + tl.exp(-h))).to(DT).to(tl.float32)
        act = silu * acc_up.to(DT).to(tl.float32)
    else:
        r = tl.maximum(h, 0.0)
        act = r * r
    out_ptrs = inter_ptr + rows[:, None].to(tl.int64) * stride_im + offs_n[None, :]
    tl.store(out_ptrs, act.to(DT), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_out_kernel(inter_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weight_ptr,
                    num_pairs, N, K,
                    stride_im, stride_we, stride_wn, stride_ot,
                    ROUND_PRODUCT: tl.constexpr, DT: tl.constexpr, IP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, e = _program_block(block_expert_ptr, N, BLOCK_N)
    if e < 0:
        return
    rows, pair, valid, offs_n, n_ok, offs_k, b_ptrs = _block_operands(
        sorted_ptr, w_ptr, e, pid_m, pid_n, num_pairs, stride_we, stride_wn, N,
        BLOCK_M, BLOCK_N, BLOCK_K)
    a_ptrs = inter_ptr + rows[:, None].to(tl.int64) * stride_im + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=IP)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    w = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    prod = acc.to(DT).to(tl.float32) * w[:, None]
    if ROUND_PRODUCT:
        prod = prod.to(DT).to(tl.float32)
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, prod, mask=valid[:, None] & n_ok[None, :])


def moe_experts_triton(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       activation: str) -> torch.Tensor:
    """Same contract as `mambaserve.ops.moe_experts.moe_experts`."""
    T, H = x.shape
    E, I = w_out.shape[0], w_out.shape[-1]
    k = topk_ids.shape[1]
    swiglu = activation == "swiglu"
    assert w_in.shape == (E, 2 * I if swiglu else I, H) and w_out.shape == (E, H, I)
    assert x.dtype == w_in.dtype == w_out.dtype and x.dtype in _TL_DTYPES
    assert topk_weights.dtype in (torch.float32, x.dtype)
    x = x.contiguous()
    w_in, w_out = w_in.contiguous(), w_out.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    num_pairs = T * k
    if num_pairs == 0:
        return torch.zeros((T, H), dtype=torch.float32, device=x.device)
    cfg = tuning.config("moe_experts", x.device)
    block_m = cfg["block_m"] or default_block_m(num_pairs, E)
    sorted_pairs, block_expert = align_pairs(topk_ids, E, block_m)
    total = sorted_pairs.numel()
    inter = torch.empty((total, I), dtype=x.dtype, device=x.device)
    pair_out = torch.empty((num_pairs, H), dtype=torch.float32, device=x.device)
    dt = _TL_DTYPES[x.dtype]
    ip = "ieee" if x.dtype == torch.float32 else "tf32"
    blocks = total // block_m
    bn_in, bn_out = cfg["block_n_in"], cfg["block_n_out"]
    _moe_in_kernel[(blocks * triton.cdiv(I, bn_in),)](
        x, w_in, inter, sorted_pairs, block_expert, num_pairs, k, I, H,
        x.stride(0), w_in.stride(0), w_in.stride(1), inter.stride(0),
        SWIGLU=swiglu, DT=dt, IP=ip, BLOCK_M=block_m, BLOCK_N=bn_in,
        BLOCK_K=cfg["block_k_in"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _moe_out_kernel[(blocks * triton.cdiv(H, bn_out),)](
        inter, w_out, pair_out, sorted_pairs, block_expert, weights, num_pairs, H, I,
        inter.stride(0), w_out.stride(0), w_out.stride(1), pair_out.stride(0),
        ROUND_PRODUCT=weights.dtype != torch.float32, DT=dt, IP=ip, BLOCK_M=block_m,
        BLOCK_N=bn_out, BLOCK_K=cfg["block_k_out"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return pair_out.view(T, k, H).sum(1)
