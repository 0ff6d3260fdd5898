"""Triton sparse experts: the routed (token, expert) pairs sorted into one-expert blocks, then two
grouped GEMMs over the blocks. Same contract as `mambaserve.ops.moe_experts.moe_experts`.

1. `align_pairs` (`moe_align.py`, no sync): the T*k pairs sorted by expert (stable) into blocks
   of `block_m` rows of one expert each, padded per expert; the layout's length is a host-known
   bound, so the grids depend on T only (CUDA-graph friendly); blocks past the used ones carry
   expert -1 and exit at once.
2. `_moe_in_kernel`: per (block, column tile) program, the block's token rows of x (gathered)
   times its expert's w_in, with the activation fused (relu², or SwiGLU from the gate and up
   tiles of the same columns), into `inter` [P_pad, I] in block order.
3. `_moe_out_kernel`: the block's rows of `inter` times its expert's w_out, rounded to the model
   dtype, times the pair's routing weight, stored at the pair's index of `pair_out` [T*k, H]:
   float32 for a float32 weight, the model dtype (the product rounded to it, as the reference
   rounds it) for a model-dtype weight, so half the bytes written and read back.
4. `_combine_kernel`: the k products of each token summed in float32 (in slot order, so results
   do not depend on the batch); with `add` (the shared expert's output), that sum rounded to
   add's dtype plus add, rounded: torch's `sum.to(add.dtype) + add` in one pass.

Blocks of 64 rows or more (prefill) load the weight tiles, and the out GEMM its rows of `inter`,
through TMA tensor descriptors on sm_90+ (`launch_params`): 1.3-1.6x the pointer loads' rate at
granite-4.0-h-small's shapes (docs/kernels.md). Decode blocks keep the pointer loads.

Every intermediate rounding follows the reference (`moe_experts_ref`): the GEMM outputs rounded to
the model dtype before the activation, the activation computed in float32 and rounded once.
Launch parameters: `tuning` entry "moe_experts" (block_m None = from the pairs per expert).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import hopper
from mambaserve.ops.triton.moe_align import align_pairs, default_block_m

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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


@triton.jit
def _weight_tile(w_desc, b_ptrs, e, row0, k0, k_ok, n_ok, stride_we, stride_wn,
                 TMA: tl.constexpr):
    """Expert e's [BLOCK_K, BLOCK_N] weight tile of rows row0.. at K offset k0: through the
    tensor descriptor of w viewed [E * rows, K] (TMA; rows past the tensor read 0, rows of the
    next expert or half only reach masked columns), else through the pointers (masked)."""
    if TMA:
        return w_desc.load([e * (stride_we // stride_wn) + row0, k0]).T
    else:
        return tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_in_kernel(x_ptr, w_ptr, w_desc, inter_ptr, sorted_ptr, block_expert_ptr,
                   num_pairs, top_k, N, K,
                   stride_xt, stride_we, stride_wn, stride_im,
                   SWIGLU: tl.constexpr, DT: tl.constexpr, IP: tl.constexpr, TMA: tl.constexpr,
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
        b = _weight_tile(w_desc, b_ptrs, e, pid_n * BLOCK_N, k0, k_ok, n_ok, stride_we,
                         stride_wn, TMA)
        acc = tl.dot(a, b, acc=acc, input_precision=IP)
        if SWIGLU:  # the up rows of the same columns sit N rows below the gate rows
            bu = _weight_tile(w_desc, b_ptrs + N * stride_wn, e, N + pid_n * BLOCK_N, k0, k_ok,
                              n_ok, stride_we, stride_wn, TMA)
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
def _moe_out_kernel(inter_ptr, inter_desc, w_ptr, w_desc, out_ptr, sorted_ptr, block_expert_ptr,
                    weight_ptr, num_pairs, N, K,
                    stride_im, stride_we, stride_wn, stride_ot,
                    ROUND_PRODUCT: tl.constexpr, DT: tl.constexpr, IP: tl.constexpr,
                    TMA: tl.constexpr,
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
        if TMA:  # the block's rows of inter are contiguous (padding rows only reach masked rows)
            a = inter_desc.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = _weight_tile(w_desc, b_ptrs, e, pid_n * BLOCK_N, k0, k_ok, n_ok, stride_we,
                         stride_wn, TMA)
        acc = tl.dot(a, b, acc=acc, input_precision=IP)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    w = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    prod = acc.to(DT).to(tl.float32) * w[:, None]
    if ROUND_PRODUCT:  # stored in the model dtype: the rounding is the store's
        prod = prod.to(DT)
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, prod, mask=valid[:, None] & n_ok[None, :])


LARGE_BLOCK_M = 64  # blocks of at least this many rows take the prefill launch rules


def launch_params(cfg, block_m: int, element_size: int, tma_capable: bool) -> dict:
    """The tuning entry's knobs with its None rules applied for blocks of `block_m` rows of
    `element_size`-byte operands. Small blocks (decode: a few rows per expert, bound by reading
    the weights) and float32 operands: 64-column tiles, 4 warps, 3 stages, pointer loads; steps
    of 128 along K for small blocks of 16-bit operands (64 otherwise: the large tiles' sweep, and
    float32's shared memory). Large blocks of 16-bit operands (prefill, bound by the tensor
    cores): 128-column in tiles with 8 warps, 256-column out tiles with 8 warps and 4 stages, and
    where `tma_capable` (sm_90+) the weight tiles (and the out GEMM's rows of inter) loaded by
    TMA (docs/kernels.md); float32 tiles that wide would not fit in shared memory."""
    large = block_m >= LARGE_BLOCK_M and element_size == 2
    decode_16bit = block_m < LARGE_BLOCK_M and element_size == 2
    rules = {"block_n_in": 128 if large else 64, "num_warps_in": 8 if large else 4,
             "block_n_out": 256 if large else 64, "num_warps_out": 8 if large else 4,
             "num_stages_out": 4 if large else 3, "tma": large and tma_capable,
             "block_k_in": 128 if decode_16bit else 64,
             "block_k_out": 128 if decode_16bit else 64, "block_m": block_m}
    return {name: rules[name] if value is None else value for name, value in cfg.items()}


def tma_compatible(t: torch.Tensor) -> bool:
    """A TMA descriptor's demands on a tensor viewed 2-D: a 16-byte aligned base and row pitch."""
    return t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A host TMA descriptor of t viewed [rows, last dim] (experts stacked), tiles of
    [block_rows, block_cols]."""
    return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), [block_rows, block_cols])


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(pair_ptr, add_ptr, out_ptr, T, H, top_k, stride_pt, stride_at, stride_ot,
                    ADD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token block, column block): out = sum_j pair[t k + j] (float32, j = 0, 1, ...);
    with ADD, rounded to add's dtype, plus add, rounded again."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (toks < T)[:, None] & (cols < H)[None, :]
    rows = toks.to(tl.int64) * top_k
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(top_k):
        p = pair_ptr + (rows + j)[:, None] * stride_pt + cols[None, :]
        acc += tl.load(p, mask=ok, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + toks.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    if ADD:
        a = tl.load(add_ptr + toks.to(tl.int64)[:, None] * stride_at + cols[None, :], mask=ok)
        r = acc.to(a.dtype).to(tl.float32) + a.to(tl.float32)
        tl.store(out_ptrs, r.to(a.dtype), mask=ok)
    else:
        tl.store(out_ptrs, acc, mask=ok)


def moe_experts_triton(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       activation: str, add: torch.Tensor | None = None) -> torch.Tensor:
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
        routed = torch.zeros((T, H), dtype=torch.float32, device=x.device)
        return routed if add is None else routed.to(add.dtype) + add
    cfg = tuning.config("moe_experts", x.device)
    block_m = cfg["block_m"] or default_block_m(num_pairs, E)
    sorted_pairs, block_expert = align_pairs(topk_ids, E, block_m)
    total = sorted_pairs.numel()
    inter = torch.empty((total, I), dtype=x.dtype, device=x.device)
    # a model-dtype weight gives a model-dtype product (rounded): stored as such, half the bytes
    round_product = weights.dtype != torch.float32
    pair_out = torch.empty((num_pairs, H), dtype=x.dtype if round_product else torch.float32,
                           device=x.device)
    dt = _TL_DTYPES[x.dtype]
    ip = "ieee" if x.dtype == torch.float32 else "tf32"
    blocks = total // block_m
    p = launch_params(cfg, block_m, x.element_size(),
                      x.device.type == "cuda" and hopper(x.device))
    tma = p["tma"] and all(tma_compatible(t) for t in (w_in, w_out, inter))
    bn_in, bk_in, bn_out, bk_out = p["block_n_in"], p["block_k_in"], p["block_n_out"], \
        p["block_k_out"]
    _moe_in_kernel[(blocks * triton.cdiv(I, bn_in),)](
        x, w_in, _descriptor(w_in, bn_in, bk_in) if tma else None, inter, sorted_pairs,
        block_expert, num_pairs, k, I, H,
        x.stride(0), w_in.stride(0), w_in.stride(1), inter.stride(0),
        SWIGLU=swiglu, DT=dt, IP=ip, TMA=tma, BLOCK_M=block_m, BLOCK_N=bn_in, BLOCK_K=bk_in,
        num_warps=p["num_warps_in"], num_stages=p["num_stages_in"])
    _moe_out_kernel[(blocks * triton.cdiv(H, bn_out),)](
        inter, _descriptor(inter, block_m, bk_out) if tma else None,
        w_out, _descriptor(w_out, bn_out, bk_out) if tma else None, pair_out, sorted_pairs,
        block_expert, weights, num_pairs, H, I,
        inter.stride(0), w_out.stride(0), w_out.stride(1), pair_out.stride(0),
        ROUND_PRODUCT=round_product, DT=dt, IP=ip, TMA=tma, BLOCK_M=block_m,
        BLOCK_N=bn_out, BLOCK_K=bk_out, num_warps=p["num_warps_out"],
        num_stages=p["num_stages_out"])
    out = torch.empty((T, H), dtype=torch.float32 if add is None else add.dtype, device=x.device)
    if add is not None:
        assert add.shape == (T, H) and add.stride(-1) == 1
    block_h = min(cfg["combine_block_h"], triton.next_power_of_2(H))
    block_t = max(1, cfg["combine_block"] // block_h)
    _combine_kernel[(triton.cdiv(T, block_t), triton.cdiv(H, block_h))](
        pair_out, add, out, T, H, k, pair_out.stride(0), 0 if add is None else add.stride(0),
        out.stride(0), ADD=add is not None, BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=cfg["combine_num_warps"])
    return out
