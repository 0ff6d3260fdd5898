"""Paged attention over the KV pool: write new K/V into pages, then causal attention per token.

KV layout per attention layer: `kv_cache[2, num_pages + 1, page_size, H_kv, head_dim]` (index 0 =
K, 1 = V; the last page is scratch for padding tokens). A token at absolute position j of row r
lives at page `page_table[r, j // page_size]`, offset `j % page_size`; `slot_mapping[t]` is that
flat offset for each new token (host-built).

One function serves prefill, chunked prefill and decode: every query token t of row `token_row[t]`
at absolute position `positions[t]` attends to the row's cached keys at positions <= positions[t].
"""

from __future__ import annotations

import torch

from mambaserve.ops.dispatch import kernel_path


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
) -> torch.Tensor:
    """q: [T, H, head_dim]; page_table: [R, max_pages] int64; token_row, positions: [T] int64;
    max_kv_len: host int >= every row's length after this forward; num_prefill_tokens: host int,
    the first tokens that belong to prefill rows (the engine's batch layout: prefill tokens, then
    one token per decode row). Returns [T, H, head_dim]: `out` when given (any strides, e.g. a
    column slice of a wider buffer viewed as [T, H, head_dim]), filled.

    On CUDA the prefill tokens go to the tiled kernel (a block of consecutive tokens shares each
    K/V load: flash-attention style) and the decode tokens to the per-token kernel (one program
    per token and KV head, split over the keys when that is too few programs), each writing its
    rows of one output."""
    if kernel_path("paged_attention", q.device) == "triton":
        from mambaserve.ops.triton.paged_attention import paged_attention_triton

        Tp = num_prefill_tokens
        if Tp == 0:
            return paged_attention_triton(q, kv_cache, page_table, token_row, positions,
                                          max_kv_len, scale, out=out)
        if out is None:
            out = torch.empty_like(q)  # each kernel writes its own rows: no concatenation
        paged_attention_triton(q[:Tp], kv_cache, page_table, token_row[:Tp], positions[:Tp],
                               max_kv_len, scale, tiled=True, out=out[:Tp])
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
