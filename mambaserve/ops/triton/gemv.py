"""Triton linear for few token rows (decode): y = x W^T (+ bias) for M <= the tuning entry's
`max_m` rows, bandwidth-bound on the weight, which is read from HBM exactly once.

Layout of the work: the grid is (blocks of BLOCK_N output columns) x (split_k parts of K). Each
program streams its weight tile [BLOCK_N, K part] in steps of BLOCK_K columns and the few x rows
(a few KiB, from L2). Two inner products (`use_dot`):
- CUDA-core FMAs: a [BLOCK_M, BLOCK_N, BLOCK_K] float32 accumulator takes one product per weight
  element and row in every step; it is summed over BLOCK_K once, after the loop (no reduction
  across threads inside the loop). One row accumulates in a [BLOCK_N, BLOCK_K] one, so the
  weight tile keeps the layout it was loaded in (the 3-D product's broadcast over rows made the
  sm_90 code read the tile back from shared memory one bf16 at a time, as in the FP8 kernel);
- tensor cores: `tl.dot` with the weight tile as the left operand ("swap AB": [BLOCK_N, BLOCK_K]
  x [BLOCK_K, BLOCK_M >= 16]), whose operand loads Triton's pipeliner stages `num_stages` deep.
Both accumulate in float32 and round once to the output dtype.

Split-K without a second launch: with split_k > 1 every program stores its float32 partial sums
to a scratch buffer, then increments its column block's arrival counter (acq_rel, GPU scope); the
program that arrives last adds the split_k partials in the fixed order 0, 1, ... (so the result
does not depend on the arrival order: deterministic), sets the counter back to 0, then adds the
bias, rounds and stores (`split_k_sum`, which the FP8 kernel shares). The counters (one int32
per column block) live in a per-device buffer that is zeroed once and left zeroed by every
launch; launches that use it must not run concurrently (the engine's forward runs on one
stream).

Two extras (constexpr, compiled out otherwise): an MLP activation applied to the x tile as it
is loaded (`act_gemv_triton`, the CUDA-core launch only), and an addend added to the rounded
result in the epilogue (`gemv_triton(..., add=)`), each with torch's roundings. And a float32
weight with 16-bit rows, out in float32 (`gemv_float32_triton`, the CUDA-core launch: NemotronH's
router, whose product transformers computes in float32).

Launch parameters: `tuning` entry "gemv" (`launch_plan` resolves its None knobs; its
`prefetch_bytes`, off, is the FP8 kernel's weight prefetch before the PDL wait). Under PDL
the next kernel of the stream is let in once a program's main loop has ended (`late_trigger`,
on), not right after the wait: its waiting programs would otherwise hold SM slots this
launch's later waves need (the down projection behind up with relu² in its epilogue). No host sync,
no value-dependent branch on the host: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import (
    await_previous,
    gdc_launch_dependents,
    gdc_wait,
    num_sms,
    pdl_launch,
    pow2,
    prefetch_rows_l2,
)
from mambaserve.ops.triton.activation import relu2_triton, silu_mul_triton

MAX_COLUMN_BLOCKS = 1 << 16  # arrival counters per device (N / block_n of any split launch)


# `ACT`: the activation a launch applies to its x rows as it loads them (0: none)
ACTIVATIONS = {"relu2": 1, "silu_mul": 2}


@triton.jit(do_not_specialize=["M", "split_k"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, add_ptr, M, N, K, stride_xm,
                 stride_wn, stride_ym, stride_am, k_per_split, split_k,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_DOT: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr,
                 HAS_ADD: tl.constexpr, OUT_ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                 LATE_TRIGGER: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PDL and PREFETCH_LINES > 0 and not USE_DOT:
        # the weight is no kernel's output: L2 may fetch it while the previous kernel runs
        prefetch_rows_l2(w_ptr, cols, col_ok, stride_wn, k_lo, k_hi, PREFETCH_LINES,
                         1024 // w_ptr.dtype.element_ty.primitive_bitwidth)
    if not LATE_TRIGGER:
        await_previous(PDL)
    elif PDL:  # the next kernel is scheduled once this one's loops end (tuning late_trigger)
        gdc_wait()
    w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:  # one row: no broadcast over rows (see the docstring)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:  # every step full: masks on the rows / columns only (vector loads along K)
            w = tl.load(w_tile + k0, mask=col_ok[:, None], other=0.0)
            x_ok = row_ok[:, None]
        else:
            k_ok = (k0 + ks) < k_hi
            w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x_ok = row_ok[:, None] & k_ok[None, :]
        xv = tl.load(x_tile + k0, mask=x_ok, other=0.0)
        if ACT == 1:  # squared in float32, one rounding (ops/activation.py)
            xv = _relu2_rounded(xv, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
        if ACT == 2:  # x holds [gate | up]; silu rounded, then the product rounded
            up = tl.load(x_tile + K + k0, mask=x_ok, other=0.0).to(tl.float32)
            g = xv.to(tl.float32)
            sg = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
            xv = (sg * up).to(x_ptr.dtype.element_ty)
        if USE_DOT:
            if IEEE:
                acc = tl.dot(w, tl.trans(xv), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(xv), acc)
        elif BLOCK_M == 1:  # xv [1, BLOCK_K] broadcast down the tile's columns
            acc2 += w.to(tl.float32) * xv.to(tl.float32)
        else:
            acc3 += w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :]
    if LATE_TRIGGER and PDL:
        gdc_launch_dependents()
    if USE_DOT:
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    elif BLOCK_M == 1:
        y = tl.sum(acc2, axis=1)[None, :]
    else:
        y = tl.sum(acc3, axis=2)
    out_mask = row_ok[:, None] & col_ok[None, :]
    out_offs = rows[:, None] * stride_ym + cols[None, :]
    add_offs = rows[:, None] * stride_am + cols[None, :]
    if not SPLIT:
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_ADD:  # rounded, then added as torch adds two tensors of the dtype
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(
                add_ptr + add_offs, mask=out_mask, other=0.0).to(tl.float32)
        if OUT_ACT == 1:
            y = _relu2_rounded(y, y_ptr.dtype.element_ty)
        tl.store(y_ptr + out_offs, y.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        last, total = split_k_sum(y, part_ptr, cnt_ptr, rows, cols, out_mask, pid_n, pid_k, M, N,
                                  split_k, BLOCK_M, BLOCK_N)
        if last:
            if HAS_BIAS:
                total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_ADD:
                total = total.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(
                    add_ptr + add_offs, mask=out_mask, other=0.0).to(tl.float32)
            if OUT_ACT == 1:
                total = _relu2_rounded(total, y_ptr.dtype.element_ty)
            tl.store(y_ptr + out_offs, total.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _relu2_rounded(y, dtype: tl.constexpr):
    """relu²(y rounded to dtype), squared in float32 (ops/activation.py's rounding; the caller's
    store rounds once more)."""
    yr = tl.maximum(y.to(dtype).to(tl.float32), 0.0)
    return yr * yr


@triton.jit
def split_k_sum(y, part_ptr, cnt_ptr, rows, cols, mask, pid_n, pid_k, M, N, split_k,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split K without a second launch (module docstring): store this program's float32 partial
    y [BLOCK_M, BLOCK_N] of column block pid_n, count its arrival; returns (whether it arrived
    last, the split_k partials summed in the order 0, 1, ... when it did, else zeros). The last
    one sets the block's counter back to 0."""
    part_offs = rows[:, None] * N + cols[None, :]
    tl.store(part_ptr + pid_k * M * N + part_offs, y, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the arrival is counted
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    last = arrived == split_k - 1
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if last:  # the last of the column block's parts: reduce in order
        for s in range(split_k):
            total += tl.load(part_ptr + s * M * N + part_offs, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    return last, total


COUNTERS: dict[torch.device, torch.Tensor] = {}


def column_counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters, zeroed once (every split launch leaves them at 0)."""
    buf = COUNTERS.get(device)
    if buf is None:
        buf = COUNTERS[device] = torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32,
                                              device=device)
    return buf


def split_scratch(plan: dict, y: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(column blocks, float32 partials [split_k, M, N], the arrival counters) of a launch
    writing y [M, N] with `plan`; without a split, y stands in for both buffers (unused)."""
    M, N = y.shape
    blocks = triton.cdiv(N, plan["block_n"])
    if plan["split_k"] == 1:
        return blocks, y, y
    assert blocks <= MAX_COLUMN_BLOCKS, f"{blocks} column blocks > {MAX_COLUMN_BLOCKS}"
    part = torch.empty((plan["split_k"], M, N), dtype=torch.float32, device=y.device)
    return blocks, part, column_counters(y.device)


def launch_plan(M: int, N: int, K: int, device, dot: bool = True) -> dict:
    """The launch of an [M, K] x [N, K]^T product on `device`: the tuning entry "gemv" with its
    None knobs resolved; `dot` False: CUDA-core FMAs whatever the rules say (operands of two
    dtypes, which tensor cores do not take). Rules (None), from `scripts/gemv_sweep.py` on an
    H200 (docs/kernels.md):
      use_dot: FMAs for one or two rows of a product with N <= 3 K (the out_proj / down shapes,
               where they beat cuBLAS by 10-30 %), tensor cores otherwise;
      block_n: with FMAs 8 when the 8-column blocks number >= 4 per SM, else 4; with tensor
               cores 64 for three or more rows of a product with N >= 3 K (the 9B's in_proj,
               up, lm_head at 8 rows: 3-7 % faster than 32 on an H100), else 32;
      block_k: with FMAs 2048 // (block_n * BLOCK_M) (the accumulator's size), at least 32;
               with tensor cores 128; at most pow2(K) either way;
      split_k: with FMAs 1 (more column blocks beat K splits); with tensor cores doubled from 1
               while the programs are fewer than 2 per SM, each part keeps at least 8 K steps,
               and split_k < 16."""
    cfg = tuning.config("gemv", device)
    sms = num_sms(torch.device(device))
    use_dot = cfg["use_dot"]
    if use_dot is None:
        use_dot = not (M <= 2 and N <= 3 * K)
    use_dot = use_dot and dot
    block_m = max(16, pow2(M)) if use_dot else pow2(M)
    block_n = cfg["block_n"]
    if block_n is None:
        if use_dot:
            block_n = 64 if M > 2 and N >= 3 * K else 32
        else:
            block_n = 8 if triton.cdiv(N, 8) >= 4 * sms else 4
    block_k = cfg["block_k"]
    if block_k is None:
        block_k = 128 if use_dot else max(32, 2048 // (block_n * block_m))
    block_k = min(block_k, max(16, pow2(K)))
    split_k = cfg["split_k"]
    blocks = triton.cdiv(N, block_n)
    if split_k is None:
        split_k = 1
        while (use_dot and blocks * split_k < 2 * sms and split_k < 16
               and triton.cdiv(K, block_k) >= 8 * split_k):
            split_k *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty part
    return {"use_dot": bool(use_dot), "block_m": block_m, "block_n": block_n,
            "block_k": block_k, "split_k": split_k, "k_per_split": k_per_split,
            "even_k": K % k_per_split == 0 and k_per_split % block_k == 0,
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
            "max_m": cfg["max_m"], "prefetch_lines": cfg["prefetch_bytes"] // 128,
            "late_trigger": bool(cfg["late_trigger"])}


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                add: torch.Tensor | None = None, out_act: str | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear`'s contract for x [M, K] (rows may be strided, last dim
    contiguous) with M <= the tuning entry's `max_m`, weight [N, K] (last dim contiguous) of
    x's dtype, bias [N] or None -> [M, N] in x.dtype, accumulated in float32. `add` [M, N] (x's
    dtype): added to the rounded product as torch adds two tensors (`linear(...) + add`).
    `out_act` "relu2": relu² of the rounded product in the epilogue, rounded as
    `ops/activation.py` rounds it (bit for bit `relu2(linear(...))`; not with `add`)."""
    assert out_act in (None, "relu2"), out_act
    assert out_act is None or add is None, "out_act and add are not taken together"
    return _launch(x, weight, bias, x.shape[1] if x.dim() == 2 else -1, add=add,
                   out_act=int(out_act is not None))


def gemv_float32_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x.float(), weight)` for x [M, K] of a 16-bit dtype (rows may be strided, last
    dim contiguous), M <= the tuning entry's `max_m`, and a float32 weight [N, K]: every product
    of x's value (exact in float32) by the weight's, summed in float32, out [M, N] float32. The
    CUDA-core launch (tensor cores take one dtype), x converted as it is loaded: one launch where
    the reference casts x, then runs cuBLAS's float32 GEMV (two launches at one row)."""
    assert x.dim() == 2 and weight.dtype == torch.float32, (x.shape, weight.dtype)
    plan = launch_plan(x.shape[0], weight.shape[0], x.shape[1], x.device, dot=False)
    return _launch(x, weight, None, x.shape[1], plan=plan, out_dtype=torch.float32)


def act_gemv_triton(x: torch.Tensor, act: str, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(act(x), weight, bias), act "relu2" (x [M, K]) or "silu_mul" (x [M, 2K] = [gate |
    up]), the activation rounded to x.dtype exactly as `ops/activation.py` rounds it: one launch
    that activates x as it loads it when the plan runs on CUDA cores; on tensor cores the
    activation's own kernel, then the plain launch (a tensor-core operand computed in registers
    leaves the operand pipeline: 2-4x slower on an H200, docs/kernels.md)."""
    assert act in ("relu2", "silu_mul"), act
    assert x.dim() == 2, x.shape
    K = x.shape[1] // 2 if act == "silu_mul" else x.shape[1]
    plan = launch_plan(x.shape[0], weight.shape[0], K, x.device)
    if plan["use_dot"]:
        return _launch(_two_launch_activation(x, act), weight, bias, K, plan=plan)
    return _launch(x, weight, bias, K, act=ACTIVATIONS[act], plan=plan)


def _two_launch_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    x = x.contiguous()
    return relu2_triton(x) if act == "relu2" else silu_mul_triton(x)


def _launch(x, weight, bias, K, act=0, add=None, plan=None, out_dtype=None, out_act=0):
    assert x.dim() == 2 and x.stride(-1) == 1, "the few-rows launches take [M, K] rows"
    assert weight.dim() == 2 and weight.stride(-1) == 1 and weight.shape[1] == K
    # one dtype, or a float32 weight on the CUDA-core launch (gemv_float32_triton)
    assert weight.dtype == x.dtype or (weight.dtype == torch.float32 and plan is not None
                                       and not plan["use_dot"]), (weight.dtype, x.dtype)
    M = x.shape[0]
    N = weight.shape[0]
    max_m = tuning.config("gemv", x.device)["max_m"]
    assert M <= max_m, f"gemv_triton takes at most max_m={max_m} rows, got {M}"
    if add is not None:
        assert add.shape == (M, N) and add.dtype == x.dtype and add.stride(-1) == 1, add.shape
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        y.zero_() if bias is None else y.copy_(bias.expand(M, N))
        if out_act:
            return relu2_triton(y)
        return y if add is None else y.add_(add)
    plan = plan or launch_plan(M, N, K, x.device)
    split = plan["split_k"]
    blocks, part, counters = split_scratch(plan, y)
    _gemv_kernel[(blocks, split)](
        x, weight, bias if bias is not None else y, y, part, counters,
        add if add is not None else y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        add.stride(0) if add is not None else 0, plan["k_per_split"], split,
        HAS_BIAS=bias is not None, SPLIT=split > 1, EVEN_K=plan["even_k"],
        USE_DOT=plan["use_dot"], IEEE=x.dtype == torch.float32, ACT=act,
        HAS_ADD=add is not None, OUT_ACT=out_act, BLOCK_M=plan["block_m"],
        BLOCK_N=plan["block_n"], BLOCK_K=plan["block_k"], NUM_STAGES=plan["num_stages"],
        PREFETCH_LINES=plan["prefetch_lines"], num_warps=plan["num_warps"],
        LATE_TRIGGER=plan["late_trigger"],
        **pdl_launch(x.device, _gemv_kernel))
    return y
