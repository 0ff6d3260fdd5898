"""Triton sampler (`mambaserve.ops.sample_rows` has the contract): a token per row, greedy or
Gumbel-max, and the raw-logit logprob of that token, in one launch.

Grid: (rows, cdiv(V, BLOCK_V)). Each program reads one block of its row's vocabulary once (the
raw logits, and the processed ones where they differ) and reduces it to its partial results:
the raw block's maximum m and sum of exp(x - m) (the logsumexp's parts), the processed block's
maximum and its first index (greedy), and the maximum and first index of proc / T + g (the
Gumbel noise g of the row's (seed, step) at every token id, hashed in the program with the
reference's 32-bit integer operations: `gumbel_noise`). The partials go to a scratch buffer;
then the program counts its arrival on its row's counter (acq_rel, GPU scope), and the row's
last program combines the partials in block order 0, 1, ... (deterministic: the result does not
depend on which program finishes last): the logsumexp, the first index of the largest value
(the lowest token id on ties, as torch's argmax), the row's token by its temperature, and the
logprob raw[token] - logsumexp. It resets the counter (the few-rows linear's counters, shared:
launches on one stream never overlap, and every launch leaves them at zero).

Rounding: proc / T is an IEEE division and the noise's logarithms are libdevice's `logf` on the
GPU (CUDA torch's `log`), so the scores are the reference's; the logsumexp's sum runs in another
order than torch's (float32, ~1e-7 relative).

`TARGETS` (`row_logprobs`): the rows' tokens are given (prompt-logprob targets, or the
sampled tokens whose top alternatives are asked for): only the logsumexp's parts are reduced,
and the last program writes raw[target] - logsumexp and the logsumexp itself.

Launch parameters: `tuning` entry "sample_rows". No host sync: every decision is on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.gemv import MAX_COLUMN_BLOCKS, column_counters

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 values (the reference's `_mix32`; products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _half(v, SHIFT: tl.constexpr):
    """32 bits of the int64 v, from bit SHIFT (0 or 32), as uint32."""
    return ((v >> SHIFT) & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def uniform_noise_block(seed, step, tok):
    """The reference's `uniform_noise` at token ids `tok` (int32) of the row (seed, step), int64
    scalars: float32 uniforms in (0, 1), bit for bit."""
    key = _mix32(_half(seed, 0) ^ 0x243F6A88)
    key = _mix32(key ^ _half(seed, 32))
    key = _mix32(key ^ _half(step, 0))
    key = _mix32(key ^ _half(step, 32) ^ 0x9E3779B9)
    h = _mix32(key ^ _mix32(tok.to(tl.uint32) ^ 0x85A308D3))
    return ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _log(x, HW_LOG: tl.constexpr):
    if HW_LOG:  # CUDA's logf, as CUDA torch's log
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def gumbel_noise_block(seed, step, tok, HW_LOG: tl.constexpr):
    """The reference's `gumbel_noise` at token ids `tok`: -log(-log(u))."""
    u = uniform_noise_block(seed, step, tok)
    return -_log(-_log(u, HW_LOG), HW_LOG)


@triton.jit
def _first_max(v, idx, BIG: tl.constexpr):
    """(max of v, the smallest idx where v is that max); a NaN counts as the largest value, as
    in torch's argmax (a NaN logit picks its token instead of no token)."""
    v = tl.where(v != v, float("inf"), v)
    top = tl.max(v, axis=0)
    return top, tl.min(tl.where(v == top, idx, BIG), axis=0)


@triton.jit
def _sample_rows_kernel(raw_ptr, proc_ptr, temp_ptr, seed_ptr, step_ptr, part_ptr, idx_ptr,
                        cnt_ptr, ids_ptr, lp_ptr, lse_ptr, V, stride_raw, stride_proc,
                        greedy_eps, num_blocks, HAS_PROC: tl.constexpr, ALL_GREEDY: tl.constexpr,
                        TARGETS: tl.constexpr, HW_LOG: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = offs < V
    raw_row = raw_ptr + row.to(tl.int64) * stride_raw
    x = tl.load(raw_row + offs, mask=ok, other=_NEG_INF).to(tl.float32)
    if HAS_PROC:
        p = tl.load(proc_ptr + row.to(tl.int64) * stride_proc + offs, mask=ok,
                    other=_NEG_INF).to(tl.float32)
    else:
        p = x
    mx = tl.max(x, axis=0)
    se = tl.sum(tl.exp(x - tl.where(mx == _NEG_INF, 0.0, mx)), axis=0)
    slot = row * num_blocks + blk
    tl.store(part_ptr + slot * 4 + 0, mx)
    tl.store(part_ptr + slot * 4 + 1, se)
    if not TARGETS:  # the token is chosen here (with TARGETS it is given)
        g_max, g_idx = _first_max(p, offs, 2147483647)
        if ALL_GREEDY:
            s_max = g_max
            s_idx = g_idx
        else:
            t = tl.load(temp_ptr + row)
            t = tl.where(t < greedy_eps, 1.0, t)
            score = tl.math.div_rn(p, tl.zeros_like(p) + t) + gumbel_noise_block(
                tl.load(seed_ptr + row), tl.load(step_ptr + row), offs, HW_LOG)
            s_max, s_idx = _first_max(tl.where(ok, score, _NEG_INF), offs, 2147483647)
        tl.store(part_ptr + slot * 4 + 2, g_max)
        tl.store(part_ptr + slot * 4 + 3, s_max)
        tl.store(idx_ptr + slot * 2 + 0, g_idx)
        tl.store(idx_ptr + slot * 2 + 1, s_idx)
    tl.debug_barrier()  # every partial stored before the arrival is counted
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == num_blocks - 1:  # the row's last program: combine in block order
        bs = tl.arange(0, BLOCK_S)
        bok = bs < num_blocks
        slots = row * num_blocks + bs
        mxs = tl.load(part_ptr + slots * 4 + 0, mask=bok, other=_NEG_INF, cache_modifier=".cg")
        ses = tl.load(part_ptr + slots * 4 + 1, mask=bok, other=0.0, cache_modifier=".cg")
        top = tl.max(mxs, axis=0)
        base = tl.where(top == _NEG_INF, 0.0, top)
        lse = top + tl.log(tl.sum(ses * tl.exp(mxs - base), axis=0))
        if TARGETS:  # ids_ptr holds the rows' given tokens
            tok = tl.load(ids_ptr + row).to(tl.int32)
        else:
            gms = tl.load(part_ptr + slots * 4 + 2, mask=bok, other=_NEG_INF,
                          cache_modifier=".cg")
            gis = tl.load(idx_ptr + slots * 2 + 0, mask=bok, other=2147483647,
                          cache_modifier=".cg")
            _, tok = _first_max(gms, gis, 2147483647)
            if not ALL_GREEDY:
                sms = tl.load(part_ptr + slots * 4 + 3, mask=bok, other=_NEG_INF,
                              cache_modifier=".cg")
                sis = tl.load(idx_ptr + slots * 2 + 1, mask=bok, other=2147483647,
                              cache_modifier=".cg")
                _, s_tok = _first_max(sms, sis, 2147483647)
                tok = tl.where(tl.load(temp_ptr + row) < greedy_eps, tok, s_tok)
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)  # never outside the row
        xv = tl.load(raw_row + tok).to(tl.float32)
        if not TARGETS:
            tl.store(ids_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, xv - lse)
        tl.store(lse_ptr + row, lse)
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")


def sample_rows_triton(raw: torch.Tensor, proc: torch.Tensor, temperature: torch.Tensor,
                       seed: torch.Tensor, step: torch.Tensor, all_greedy: bool,
                       greedy_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mambaserve.ops.sample_rows`'s contract (rows with temperature < greedy_eps greedy)."""
    assert proc.shape == raw.shape and proc.stride(-1) == 1, (proc.shape, raw.shape)
    ids = torch.empty(raw.shape[0], dtype=torch.int64, device=raw.device)
    return ids, *_launch(raw, proc, temperature, seed, step, ids, all_greedy, greedy_eps,
                         targets=False)


def row_logprobs_triton(raw: torch.Tensor, targets: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mambaserve.ops.row_logprobs`'s contract: (raw[n, targets[n]] - lse[n], lse[n])."""
    assert targets.shape == raw.shape[:1], (targets.shape, raw.shape)
    ids = targets.to(torch.int64).contiguous()
    return _launch(raw, raw, ids, ids, ids, ids, True, 0.0, targets=True)


def _launch(raw, proc, temperature, seed, step, ids, all_greedy, greedy_eps, targets):
    assert raw.dim() == 2 and raw.stride(-1) == 1, "the sampler's kernel takes [N, V] rows"
    B, V = raw.shape
    assert 0 < V < 2**31 - 1, V
    assert B <= MAX_COLUMN_BLOCKS, f"{B} rows > {MAX_COLUMN_BLOCKS}"
    lp = torch.empty(B, dtype=torch.float32, device=raw.device)
    lse = torch.empty(B, dtype=torch.float32, device=raw.device)
    if B == 0:
        return lp, lse
    cfg = tuning.config("sample_rows", raw.device)
    block_v = min(cfg["block_v"], triton.next_power_of_2(V))
    blocks = triton.cdiv(V, block_v)
    part = torch.empty((B, blocks, 4), dtype=torch.float32, device=raw.device)
    idx = torch.empty((B, blocks, 2), dtype=torch.int32, device=raw.device)
    _sample_rows_kernel[(B, blocks)](
        raw, proc, temperature, seed, step, part, idx, column_counters(raw.device), ids, lp, lse,
        V, raw.stride(0), proc.stride(0), float(greedy_eps), blocks,
        HAS_PROC=proc.data_ptr() != raw.data_ptr() or proc.dtype != raw.dtype,
        ALL_GREEDY=bool(all_greedy), TARGETS=targets, HW_LOG=raw.device.type == "cuda",
        BLOCK_V=block_v, BLOCK_S=triton.next_power_of_2(blocks), num_warps=cfg["num_warps"])
    return lp, lse
