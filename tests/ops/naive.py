"""Slow, obviously-correct references for the ops tests (token-by-token loops, float64), plus
small helpers to build random inputs and batch plans through the real `build_metadata`.

Nothing here imports mambaserve.ops: the references are written from the math only.
"""

from __future__ import annotations

import math
import zlib

import torch

from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# randomness and inputs
# --------------------------------------------------------------------------------------------

def gen(*key) -> torch.Generator:
    """A generator seeded from the test case's parameters (a fresh, reproducible seed per case)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def uniform(g: torch.Generator, lo: float, hi: float, *shape) -> torch.Tensor:
    return torch.empty(*shape).uniform_(lo, hi, generator=g)


def ssm_params(g: torch.Generator, T: int, H: int):
    """Realistic Mamba2 dt / A / D: dt_raw ~ N(0,1), dt_bias = softplus^-1(U(1e-3, 0.1)),
    A = -exp(U(log 1, log 16)), D ~ N(0,1). Returns (dt_raw [T,H], dt_bias [H], A [H], D [H])."""
    dt_raw = randn(g, T, H)
    dt_bias = torch.log(torch.expm1(uniform(g, 0.001, 0.1, H)))
    A = -torch.exp(uniform(g, 0.0, math.log(16.0), H))
    D = randn(g, H)
    return dt_raw, dt_bias, A, D


# --------------------------------------------------------------------------------------------
# batch plans
# --------------------------------------------------------------------------------------------

def row(n: int, ctx: int = 0, slot: int = 0, init: bool = False, pages: list[int] | None = None,
        page_size: int = 1024) -> Row:
    """A Row of n new tokens after ctx cached ones. Without explicit pages, consecutive page
    ids starting at 0 covering [0, ctx + n) (fine for ops that ignore the KV pool)."""
    if pages is None:
        pages = list(range(-(-(ctx + n) // page_size)))
    return Row.standalone(token_ids=list(range(100, 100 + n)), context_len=ctx, state_slot=slot,
                   has_initial_state=init, pages=pages)


def meta_for(prefills, decodes=(), *, chunk_size: int = 8, conv_kernel: int = 4,
             page_size: int = 1024, scratch_page: int = 10_000):
    return build_metadata(Batch(prefills=list(prefills), decodes=list(decodes)),
                          chunk_size=chunk_size, conv_kernel=conv_kernel, page_size=page_size,
                          scratch_page=scratch_page, device="cpu")


def row_spans(rows) -> list[tuple[int, int]]:
    """Flat token range [start, end) of each row, in batch order."""
    out, s = [], 0
    for r in rows:
        out.append((s, s + r.num_tokens))
        s += r.num_tokens
    return out


# --------------------------------------------------------------------------------------------
# SSM recurrence
# --------------------------------------------------------------------------------------------

def softplus64(v: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(v.to(F64)))


def naive_ssm_row(x, dt_raw, A, B, C, D, dt_bias, dt_limit, h0):
    """Sequential Mamba2 recurrence over one row, in float64.

    x [n,H,P], dt_raw [n,H], A/D/dt_bias [H], B/C [n,G,N], h0 [H,P,N] (initial state).
    Returns y [n,H,P] and states [n,H,P,N] (states[t] = state after token t).
    """
    n, H, P = x.shape
    G = B.shape[1]
    heads_per_group = H // G
    x, A, B, C, D, h = (t.to(F64) for t in (x, A, B, C, D, h0))
    dt = softplus64(dt_raw.to(F64) + dt_bias.to(F64)).clamp(dt_limit[0], dt_limit[1])
    ys, states = torch.zeros(n, H, P, dtype=F64), torch.zeros(n, H, P, h0.shape[-1], dtype=F64)
    h = h.clone()
    for t in range(n):
        for hd in range(H):
            grp = hd // heads_per_group
            h[hd] = (math.exp(dt[t, hd] * A[hd]) * h[hd]
                     + dt[t, hd] * torch.outer(x[t, hd], B[t, grp]))
            ys[t, hd] = h[hd] @ C[t, grp] + D[hd] * x[t, hd]
        states[t] = h
    return ys, states


# --------------------------------------------------------------------------------------------
# causal depthwise conv
# --------------------------------------------------------------------------------------------

def silu64(v: torch.Tensor) -> torch.Tensor:
    return v / (1.0 + torch.exp(-v))


def naive_conv_row(x, weight, bias, window0, activation: bool = True):
    """Causal depthwise conv over one row, in float64.

    x [n, D]; weight [D, K]; bias [D] or None; window0 [K-1, D] = the K-1 inputs preceding the
    row (oldest first; zeros for a fresh row). Returns (out [n, D], new window [K-1, D]).
    """
    n, Dm = x.shape
    K = weight.shape[1]
    stream = torch.cat([window0.to(F64), x.to(F64)], dim=0)  # [K-1+n, D]
    w = weight.to(F64)
    out = torch.zeros(n, Dm, dtype=F64)
    for t in range(n):
        acc = torch.zeros(Dm, dtype=F64) if bias is None else bias.to(F64).clone()
        for k in range(K):
            acc = acc + w[:, k] * stream[t + k]
        out[t] = silu64(acc) if activation else acc
    return out, stream[stream.shape[0] - (K - 1):]


# --------------------------------------------------------------------------------------------
# gated RMSNorm
# --------------------------------------------------------------------------------------------

def naive_gated_rmsnorm(y, z, weight, group_size: int, eps: float):
    """w * rmsnorm_per_group(y * silu(z)), float64, group by group."""
    y, z, w = y.to(F64), z.to(F64), weight.to(F64)
    h = y * silu64(z)
    out = torch.empty_like(h)
    for g0 in range(0, h.shape[1], group_size):
        grp = h[:, g0:g0 + group_size]
        rms = torch.sqrt((grp * grp).mean(dim=1, keepdim=True) + eps)
        out[:, g0:g0 + group_size] = grp / rms
    return out * w


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

def naive_causal_attention(q, k_all, v_all, positions, scale: float):
    """Attention of one row's query tokens over that row's full key/value sequence, float64.

    q [n, H, Dh]; k_all, v_all [S, Hkv, Dh] (positions 0..S-1 of the row); positions [n]
    absolute position of each query. Query head h reads kv head h // (H / Hkv).
    """
    n, H, Dh = q.shape
    Hkv = k_all.shape[1]
    rep = H // Hkv
    out = torch.zeros(n, H, Dh, dtype=F64)
    for i in range(n):
        p = int(positions[i])
        for hd in range(H):
            kh = hd // rep
            keys = k_all[: p + 1, kh].to(F64)  # [p+1, Dh]
            vals = v_all[: p + 1, kh].to(F64)
            s = (keys @ q[i, hd].to(F64)) * scale
            w = torch.exp(s - s.max())
            out[i, hd] = (w / w.sum()) @ vals
    return out
