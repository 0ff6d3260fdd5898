"""Triton FP8 linear for few token rows (decode): y = quant(x) W^T in ONE launch, activation
quantization included, for M <= the tuning entry's `max_m` rows.

The math is `mambaserve.ops.fp8_matmul.fp8_linear_ref`'s exactly, on the same quantized
operands: each row's scale is max(amax|x_row|, 1e-12) / 448 (IEEE division, `div_rn`) or the
static input scale; q = clamp(x * (1 / scale), -448, 448) (the reciprocal `div_rn` once per row)
rounded to nearest even onto e4m3; the
products q * w (exact in float32) are summed in float32 (in another order than the reference's
matmul), the sum times x_scale[m] * w_scale[n], plus the bias in float32, rounded once to
x.dtype.

Layout of the work: the grid is (blocks of BLOCK_N output columns) x (split_k parts of K). Every
program reads its weight tile [BLOCK_N, K part] once (the bytes that matter: the weight is read
from HBM exactly once) and the few x rows (a few KiB, from L2). With a dynamic scale every
program recomputes the rows' amax over the whole K itself, so no quantization launch runs
first. Two inner products, by M (`dot_min_m`): below it CUDA-core FMAs on the weight tile
converted to float32 (one FMA per weight byte and row into a [BLOCK_M, BLOCK_N, BLOCK_K]
accumulator, summed over BLOCK_K once after the loop; for one row a [BLOCK_N, BLOCK_K] one, so
the weight tile keeps the layout it was loaded in: the 3-D product's broadcast over rows made the
sm_90 code read the tile back from shared memory one byte at a time), from it tensor cores
(`tl.dot` with the weight tile as the left operand, "swap AB": [BLOCK_N, BLOCK_K] x [BLOCK_K,
BLOCK_M >= 16], float8 operands, float32 accumulation; `promote_k` 0: `max_num_imprecise_acc=0`, every product exact,
which Triton does by upcasting both tiles to fp16 for Ampere-style MMAs (a conversion per weight
byte, as the FMA path); `promote_k` 32: native e4m3 wgmma instructions, whose internal sum of 32
products keeps fewer bits than float32 (~14, DeepSeek-V3 report section 3.3.2), each added to
the float32 accumulator).
With split_k > 1 each part writes float32 partial sums (already scaled) and counts its arrival
on its column block's counter; the part that arrives last adds the parts in the fixed order 0, 1,
... (deterministic), adds the bias, rounds, stores and sets the counter back to 0: no second
launch (the bf16 few-rows linear's scheme and counters, `ops/triton/gemv.py`).

The e4m3 conversions: on the GPU the hardware ones (the weight loaded as float8e4nv, fed to
`tl.dot` or converted `.to(float32)`; `.to(float8e4nv)`, round to nearest even, for the
activation); under the CPU
interpreter, where float8 decoding is not right, `e4m3_decode` / `e4m3_encode`, the same
bits done with integer operations (`ops/triton/fp8_codec.py`; the `HW_FP8` constexpr picks).

Under programmatic dependent launch the CUDA-core launch's programs first ask L2 for the first
`prefetch_bytes` of their weight rows (`_common.prefetch_rows_l2`), then wait for the previous
kernel: the weight is no kernel's output, and its stream starts while that kernel runs.

Launch parameters: `tuning` entry "fp8_gemv". No host sync, no value-dependent branch: CUDA-graph
capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import (
    await_previous,
    num_sms,
    pdl_launch,
    pow2,
    prefetch_rows_l2,
)
from mambaserve.ops.triton.fp8_codec import e4m3_decode, e4m3_encode
from mambaserve.ops.triton.gemv import split_k_sum, split_scratch


@triton.jit
def _quantize(x, scale, HW_FP8: tl.constexpr):
    """x float32 [BM, BK], scale [BM, 1] -> the e4m3 values: float8e4nv on the GPU, their exact
    float32 values under the interpreter."""
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    if HW_FP8:
        out = q.to(tl.float8e4nv)
    else:
        out = e4m3_decode(e4m3_encode(q))
    return out


@triton.jit
def _weight(w, HW_FP8: tl.constexpr):
    """A loaded float8e4nv weight tile as it is (GPU: the load feeds the dot directly) / the
    float32 values of its codes (interpreter)."""
    if HW_FP8:
        out = w
    else:
        out = e4m3_decode(w.to(tl.uint8, bitcast=True))
    return out


@triton.jit(do_not_specialize=["M", "stride_ws", "split_k"])
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, in_scale_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
                     M, N, K, stride_xm, stride_wn, stride_ws, stride_om, k_per_split, split_k,
                     STATIC: tl.constexpr, PREQUANT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
                     HW_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_A: tl.constexpr,
                     NUM_STAGES: tl.constexpr, FOLD: tl.constexpr, PROMOTE_K: tl.constexpr,
                     PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PDL and PREFETCH_LINES > 0 and not USE_DOT:
        # the weight is no kernel's output: L2 may fetch it while the previous kernel runs
        prefetch_rows_l2(w_ptr, cols, col_ok, stride_wn, k_lo, k_hi, PREFETCH_LINES,
                         128)
    await_previous(PDL)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    # the rows' scales: every program computes them (x is small and sits in L2)
    if PREQUANT:  # x holds the e4m3 codes already, in_scale_ptr one scale per row
        sx = tl.load(in_scale_ptr + rows, mask=row_ok, other=1.0).to(tl.float32)
    elif STATIC:
        sx = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(in_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_A):
            ka = k0 + tl.arange(0, BLOCK_A)
            v = tl.load(x_rows + ka[None, :], mask=row_ok[:, None] & (ka[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        sx = tl.math.div_rn(tl.maximum(tl.max(amax, axis=1), 1e-12),
                            tl.full([BLOCK_M], 448.0, dtype=tl.float32))
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    ks = tl.arange(0, BLOCK_K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1 and FOLD == 1:  # one row: no broadcast over rows (see the docstring)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:  # one product per weight element and row, summed over BLOCK_K after the loop
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + ks
        if EVEN_K:  # every step full: masks on rows / columns only (vector loads along K)
            wb = tl.load(w_rows + kk[None, :], mask=col_ok[:, None], other=0.0)
            xv = tl.load(x_rows + kk[None, :], mask=row_ok[:, None], other=0.0)
        else:
            k_ok = kk < k_hi
            wb = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            xv = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if PREQUANT:
            q = _weight(xv, HW_FP8)
        else:
            q = _quantize(xv.to(tl.float32), sx[:, None], HW_FP8)
        w = _weight(wb, HW_FP8)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(q), acc, max_num_imprecise_acc=PROMOTE_K)
        elif BLOCK_M == 1 and FOLD == 1:
            acc2 += w.to(tl.float32) * q.to(tl.float32)
        else:
            prod = w.to(tl.float32)[None, :, :] * q.to(tl.float32)[:, None, :]
            if FOLD > 1:  # FOLD neighbouring products summed first: a smaller accumulator
                prod = tl.sum(tl.reshape(prod, [BLOCK_M, BLOCK_N, BLOCK_K // FOLD, FOLD]), axis=3)
            acc3 += prod
    if USE_DOT:
        acc = tl.trans(acc)
    elif BLOCK_M == 1 and FOLD == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        acc = tl.sum(acc3, axis=2)
    w_scale = tl.load(ws_ptr + cols * stride_ws, mask=col_ok, other=0.0).to(tl.float32)
    y = acc * sx[:, None] * w_scale[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * stride_om + cols[None, :]
    if SPLIT:
        last, total = split_k_sum(y, part_ptr, cnt_ptr, rows, cols, out_mask, pid_n, pid_k, M, N,
                                  split_k, BLOCK_M, BLOCK_N)
        if last:
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


_INTERPRETED = isinstance(_fp8_gemv_kernel, InterpretedFunction)


def launch_plan(M: int, N: int, K: int, device) -> dict:
    """The launch of an [M, K] x [N, K]^T product on `device`: the tuning entry "fp8_gemv" with
    its None knobs resolved. Rules (None):
      block_n: 64 with tensor cores; with FMAs 8 when the 8-column blocks number >= 4 per SM,
               else 4 (the bf16 kernel's rule, `ops/triton/gemv.py`);
      block_k: 128 with tensor cores; with FMAs 4096 // (block_n * BLOCK_M) (the float32
               accumulator's size), at least 32, at most pow2(K);
      num_stages: 4 with tensor cores, 3 with FMAs;
      split_k: doubled from 1 while the programs are fewer than `split_waves` per SM (None: 1.5
               with tensor cores, 2 with FMAs), each part keeps at least 2 K steps, and
               split_k < 16.
    The tensor-core rules come from `scripts/fp8_gemv_sweep.py --candidates rows` at the 9B
    shapes (H100, 16 and 32 rows; docs/kernels.md, "FP8 linear for few rows"): 128-wide K steps
    in 4 stages read the wide in_proj 10-15 % faster than 256-wide ones in 3; 1.5 waves keep the
    245 column blocks of up_proj whole (split in 2: ~30 % slower) while the 70 of out_proj /
    down_proj still split 4 ways (2 ways: 10-15 % slower)."""
    cfg = tuning.config("fp8_gemv", device)
    use_dot = M >= cfg["dot_min_m"]
    block_m = max(16, pow2(M)) if use_dot else pow2(M)
    sms = num_sms(torch.device(device))
    block_n = cfg["block_n"]
    if block_n is None:
        block_n = 64 if use_dot else (8 if triton.cdiv(N, 8) >= 4 * sms else 4)
    block_k = cfg["block_k"]
    if block_k is None:
        block_k = 128 if use_dot else max(32, min(4096 // (block_n * block_m), pow2(K)))
    num_stages = cfg["num_stages"]
    if num_stages is None:
        num_stages = 4 if use_dot else 3
    split_k = cfg["split_k"]
    if split_k is None:
        waves = cfg["split_waves"]
        if waves is None:
            waves = 1.5 if use_dot else 2
        split_k, blocks = 1, triton.cdiv(N, block_n)
        while (blocks * split_k < waves * sms and split_k < 16
               and triton.cdiv(K, block_k) >= 4 * split_k):
            split_k *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty part
    return {"use_dot": use_dot, "block_m": block_m, "block_n": block_n, "block_k": block_k,
            "split_k": split_k, "k_per_split": k_per_split, "block_a": max(64, 2048 // block_m),
            "even_k": K % k_per_split == 0 and k_per_split % block_k == 0,
            "num_warps": cfg["num_warps"], "num_stages": num_stages, "max_m": cfg["max_m"],
            "fold": min(cfg["fold"], block_k), "promote_k": cfg["promote_k"],
            "prefetch_lines": cfg["prefetch_bytes"] // 128}


def prequantize(device) -> bool:
    """Whether `fp8_linear` quantizes dynamic-scale rows in a launch of their own before this
    kernel (tuning knob "prequant") instead of inside it."""
    return bool(tuning.config("fp8_gemv", device)["prequant"])


def fp8_gemv_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_linear`'s contract for x [M, K] (rows may be strided, last dim contiguous) with M <=
    the tuning entry's `max_m` (the launch holds every row in registers): weight [N, K]
    float8_e4m3fn (last dim contiguous), weight_scale [N] or one element float32, input_scale
    None (dynamic per row) or one element, bias [N] or None -> [M, N] in x.dtype.

    Pre-quantized rows: x float8_e4m3fn (the activation quantization already done, e.g. by
    `quantize_fp8`) with `x_scale` its per-row float32 scales ([M] or [M, 1]) and `out_dtype`
    the output dtype; `input_scale` is then unused."""
    assert x.dim() == 2 and x.stride(-1) == 1, "fp8_gemv_triton takes [M, K] rows"
    assert weight.dim() == 2 and weight.stride(-1) == 1 and weight.shape[1] == x.shape[1]
    assert weight.dtype == torch.float8_e4m3fn
    prequant = x.dtype == torch.float8_e4m3fn
    assert not prequant or (x_scale is not None and out_dtype is not None), \
        "pre-quantized rows need x_scale and out_dtype"
    M, K = x.shape
    N = weight.shape[0]
    plan = launch_plan(M, N, K, x.device)
    assert M <= plan["max_m"], f"fp8_gemv_triton takes at most max_m={plan['max_m']} rows, got {M}"
    assert weight_scale.numel() in (1, N), "weight_scale: one per output row, or one"
    y = torch.empty((M, N), dtype=out_dtype if prequant else x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    static = input_scale is not None and not prequant
    if prequant:
        input_scale = x_scale.reshape(-1)
    split = plan["split_k"]
    blocks, part, counters = split_scratch(plan, y)
    ws = weight_scale.reshape(-1)
    _fp8_gemv_kernel[(blocks, split)](
        x, weight, ws, input_scale if static or prequant else ws,
        bias if bias is not None else ws, y, part, counters, M, N, K, x.stride(0),
        weight.stride(0), 0 if ws.numel() == 1 else ws.stride(0), N, plan["k_per_split"], split,
        STATIC=static, PREQUANT=prequant, HAS_BIAS=bias is not None, SPLIT=split > 1,
        EVEN_K=plan["even_k"], USE_DOT=plan["use_dot"],
        HW_FP8=x.device.type == "cuda" and not _INTERPRETED, BLOCK_M=plan["block_m"],
        BLOCK_N=plan["block_n"], BLOCK_K=plan["block_k"], BLOCK_A=plan["block_a"],
        NUM_STAGES=plan["num_stages"], FOLD=plan["fold"], PROMOTE_K=plan["promote_k"],
        PREFETCH_LINES=plan["prefetch_lines"], num_warps=plan["num_warps"],
        **pdl_launch(x.device, _fp8_gemv_kernel))
    return y
