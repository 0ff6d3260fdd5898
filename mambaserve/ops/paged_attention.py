"""Paged attention over the KV pool: write new K/V into pages, then causal attention per token.

KV layout per attention layer: `kv_cache[2, num_pages + 1, page_size, H_kv, head_dim]` (index 0 =
K, 1 = V; the last page is scratch for padding tokens). A token at absolute position j of row r
lives at page `page_table[r, j // page_size]`, offset `j % page_size`; `slot_mapping[t]` is that
flat offset for each new token (host-built).

One function serves prefill, chunked prefill and decode: every query token t of row `token_row[t]`
at absolute position `positions[t]` attends to the row's cached keys at positions <= positions[t].

Prefill rows with no cached keys (the row starts at position 0 in this step, so its keys are
exactly the step's new K/V) of at least `DENSE_MIN_TOKENS` tokens may instead run as dense causal
attention over those K/V (`dense`): torch's scaled_dot_product_attention, flash attention on a
GPU, about 4x the tiled paged kernel on such rows (docs/kernels.md, "Prefill attention").
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mambaserve.ops.dispatch import kernel_path

# The shortest fresh prefill row that runs dense (shorter rows stay in the one paged launch of
# the step's other prefill tokens: a launch per short row costs more than it saves)
DENSE_MIN_TOKENS = 256
# The switch of the dense path: on unless this environment variable is "0" (for A/B runs)
DENSE_PREFILL_ENV = "MAMBASERVE_DENSE_PREFILL"


class DenseRows(NamedTuple):
    """What the dense path of `paged_attention` needs: the step's new keys and values
    [T, H_kv, head_dim] (as written to the pool) and the host spans (first token, tokens,
    context_len) of its prefill rows (`PrefillMetadata.row_spans`)."""

    k: torch.Tensor
    v: torch.Tensor
    row_spans: tuple[tuple[int, int, int], ...]


def flash_shaped(q: torch.Tensor) -> bool:
    """Queries SDPA serves with flash attention: 16-bit, head_dim a multiple of 8 up to 256. Its
    fallbacks for others (float32 above all) would hold [rows, H, L, L] scores."""
    return _flash_dims(q.dtype, q.shape[-1])


def _flash_dims(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 256


def dense_prefill_enabled(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether fresh prefill rows of queries of this dtype and head size may run dense: flash-
    shaped, and MAMBASERVE_DENSE_PREFILL not "0"."""
    return _flash_dims(dtype, head_dim) and os.environ.get(DENSE_PREFILL_ENV, "1") != "0"


def prefill_segments(row_spans: tuple[tuple[int, int, int], ...], num_prefill_tokens: int,
                     min_tokens: int) -> list[tuple[int, int, int]]:
    """The prefill tokens [0, num_prefill_tokens) cut into runs of consecutive rows, in order:
    (start, end, L) with L > 0 for a run of fresh rows of L tokens each (no cached keys, L >=
    min_tokens: dense attention as [rows, L] blocks), L = 0 for a run of every other row (the
    paged kernel, one launch). Host ints only."""
    out: list[tuple[int, int, int]] = []
    covered = 0
    for start, n, context in row_spans:
        if start != covered or n < 0:
            raise ValueError(f"prefill row spans are not consecutive at token {start}")
        covered = start + n
        if n == 0:
            continue
        L = n if context == 0 and n >= min_tokens else 0
        if out and out[-1][2] == L and out[-1][1] == start:
            out[-1] = (out[-1][0], start + n, L)
        else:
            out.append((start, start + n, L))
    if covered != num_prefill_tokens:
        raise ValueError(f"prefill row spans cover {covered} tokens, not {num_prefill_tokens}")
    return out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L: int,
                           scale: float, out: torch.Tensor) -> torch.Tensor:
    """Rows of L tokens each, every row attending causally to its own keys only: q [n L, H, D],
    k / v [n L, H_kv, D] -> written into out [n L, H, D] (any strides) and returned."""
    n = q.shape[0] // L
    qd, kd, vd = (t.reshape(n, L, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return out.view(n, L, q.shape[1], q.shape[2]).copy_(o.transpose(1, 2))


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, H_kv, head_dim]; slot_mapping: [T] int64 flat (page * page_size + offset)."""
    if kernel_path("write_kv", k.device) == "triton":
        from mambaserve.ops.triton.paged_attention import write_kv_triton

        return write_kv_triton(kv_cache, k, v, slot_mapping)
    _, num_pages, page_size, Hkv, Dh = kv_cache.shape
    flat = kv_cache.view(2, num_pages * page_size, Hkv, Dh)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_row: torch.Tensor,
    positions: torch.Tensor,
    max_kv_len: int,
    scale: float,
    num_prefill_tokens: int = 0,
    out: torch.Tensor | None = None,
    dense: DenseRows | None = None,
) -> torch.Tensor:
    """q: [T, H, head_dim]; page_table: [R, max_pages] int64; token_row, positions: [T] int64;
    max_kv_len: host int >= every row's length after this forward; num_prefill_tokens: host int,
    the first tokens that belong to prefill rows (the engine's batch layout: prefill tokens, then
    one token per decode row). Returns [T, H, head_dim]: `out` when given (any strides, e.g. a
    column slice of a wider buffer viewed as [T, H, head_dim]), filled.

    On CUDA the prefill tokens go to the tiled kernel (a block of consecutive tokens shares each
    K/V load: flash-attention style) and the decode tokens to the per-token kernel (one program
    per token and KV head, split over the keys when that is too few programs), each writing its
    rows of one output. With `dense` (`flash_shaped` q; unless MAMBASERVE_DENSE_PREFILL=0), fresh
    prefill rows of >= DENSE_MIN_TOKENS tokens run dense instead (`prefill_segments`; module
    docstring)."""
    if kernel_path("paged_attention", q.device) == "triton":
        from mambaserve.ops.triton.paged_attention import paged_attention_triton

        Tp = num_prefill_tokens
        if Tp == 0:
            return paged_attention_triton(q, kv_cache, page_table, token_row, positions,
                                          max_kv_len, scale, out=out)
        if out is None:
            out = torch.empty_like(q)  # each kernel writes its own rows: no concatenation
        segments = [(0, Tp, 0)]
        if dense is not None and dense_prefill_enabled(q.dtype, q.shape[-1]):
            segments = prefill_segments(dense.row_spans, Tp, DENSE_MIN_TOKENS)
        for a, b, L in segments:
            if L:
                dense_causal_attention(q[a:b], dense.k[a:b], dense.v[a:b], L, scale, out[a:b])
            else:
                paged_attention_triton(q[a:b], kv_cache, page_table, token_row[a:b],
                                       positions[a:b], max_kv_len, scale, tiled=True,
                                       out=out[a:b])
        if Tp < q.shape[0]:
            paged_attention_triton(q[Tp:], kv_cache, page_table, token_row[Tp:], positions[Tp:],
                                   max_kv_len, scale, out=out[Tp:])
        return out
    ref = paged_attention_ref(q, kv_cache, page_table, token_row, positions, max_kv_len, scale)
    return ref if out is None else out.copy_(ref)


def paged_attention_ref(q, kv_cache, page_table, token_row, positions, max_kv_len, scale):
    T, H, Dh = q.shape
    _, _, page_size, Hkv, _ = kv_cache.shape
    j = torch.arange(max_kv_len, device=q.device)  # key positions
    pages = page_table[:, j // page_size]  # [R, max_kv_len]
    flat_idx = pages * page_size + j % page_size
    kv_flat = kv_cache.view(2, -1, Hkv, Dh)
    tok_idx = flat_idx.index_select(0, token_row)  # [T, max_kv_len]
    k = kv_flat[0][tok_idx].float()  # [T, S, Hkv, Dh]
    v = kv_flat[1][tok_idx].float()
    rep = H // Hkv
    k = k.repeat_interleave(rep, dim=2, output_size=H)
    v = v.repeat_interleave(rep, dim=2, output_size=H)
    scores = torch.einsum("thd,tshd->ths", q.float(), k) * scale
    visible = j[None, :] <= positions[:, None]  # [T, S]
    scores = scores.masked_fill(~visible[:, None, :], -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("ths,tshd->thd", probs, v).to(q.dtype)
