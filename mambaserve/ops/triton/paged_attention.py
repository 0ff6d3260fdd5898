"""Triton write_kv and paged attention over the KV pool (same contracts as
`mambaserve.ops.paged_attention`).

write_kv: grid (T,). One program stores all H_kv heads of one new token's K and V at its flat
slot (`slot_mapping[t]` = page * page_size + offset), converting to the pool's dtype.

paged_attention: grid (T, H_kv). One program serves one query token and one KV head, i.e. all
H / H_kv query heads of that GQA group at once (padded to a 16-row tile for tl.dot), so each K/V
block is loaded once per group. It walks the token's row through the page table in blocks of
BLOCK_N key positions (each key's page is looked up individually, so any page size works) up to
and including `positions[t]` (a device value: the loop bound is read in the kernel, nothing is
read back on the host), with an online softmax in float32. QKᵀ and PV are tl.dots with float32
accumulation (float32 inputs use IEEE dots; P is cast to the cache dtype for PV). head_dim is
masked to the next power of two. Keys beyond positions[t] are masked at load, so stale or
non-finite data in unused slots never reaches the output.

Split-KV ("flash decoding") for small batches: when T * H_kv programs would leave the GPU idle,
the launcher adds a third grid dimension of `num_splits` key partitions, chosen on the host from
T, H_kv and `max_kv_len` (host ints; see `choose_num_splits`). Partition s of token t covers keys
[s*S, min((s+1)*S, positions[t]+1)), where the split size S = max(round_up(cdiv(positions[t]+1,
num_splits), BLOCK_N), min_split) is computed in the kernel from the token's own position: a loose
`max_kv_len` (the CUDA-graph max_model_len) still spreads a short context over several
partitions, and the partitions cover every key even if `max_kv_len` is too small. Each program
writes its partial max, sum and unnormalized fp32 accumulator to scratch; a combine kernel, grid
(T, H), merges the partitions with log-sum-exp rescaling (empty partitions: m = -inf, weight 0).

Launch parameters: `tuning` entries "paged_attention" (per-token kernel) and
"paged_attention_tiled" (tiled kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import await_previous, num_sms, pdl_launch


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr, page_size, Hkv, Dh,
    k_t, k_h, k_d, v_t, v_h, v_d, c_kv, c_p, c_s, c_h, c_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // page_size
    off = slot % page_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h[:, None] < Hkv) & (offs_d[None, :] < Dh)
    dst = kv_ptr + page * c_p + off * c_s + offs_h[:, None] * c_h + offs_d[None, :] * c_d
    k = tl.load(k_ptr + t * k_t + offs_h[:, None] * k_h + offs_d[None, :] * k_d, mask=m)
    v = tl.load(v_ptr + t * v_t + offs_h[:, None] * v_h + offs_d[None, :] * v_d, mask=m)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=m)
    tl.store(dst + c_kv, v.to(kv_ptr.dtype.element_ty), mask=m)


def write_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Same contract as `mambaserve.ops.paged_attention.write_kv`."""
    _, _, page_size, Hkv, Dh = kv_cache.shape
    T = k.shape[0]
    assert k.shape == (T, Hkv, Dh) and v.shape == (T, Hkv, Dh), (k.shape, v.shape, kv_cache.shape)
    assert slot_mapping.shape == (T,), slot_mapping.shape
    if T == 0:
        return
    BLOCK_H = triton.next_power_of_2(Hkv)
    BLOCK_D = triton.next_power_of_2(Dh)
    num_warps = max(1, min(8, BLOCK_H * BLOCK_D // 512))
    _write_kv_kernel[(T,)](
        k, v, kv_cache, slot_mapping, page_size, Hkv, Dh,
        *k.stride(), *v.stride(), *kv_cache.stride(),
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=num_warps,
        **pdl_launch(k.device, _write_kv_kernel),
    )


# sizes and strides that change with the batch are runtime ints: no recompile per batch shape
@triton.jit(do_not_specialize=["NS", "min_split", "pt_r", "ml_0", "ml_t", "ml_h", "a_t",
                               "a_h"])
def _paged_attention_kernel(
    q_ptr, kv_ptr, pt_ptr, row_ptr, pos_ptr, out_ptr, scale, page_size, Dh, REP,
    q_t, q_h, q_d, c_kv, c_p, c_s, c_h, c_d, pt_r, pt_p, o_t, o_h, o_d,
    ml_ptr, acc_ptr, NS, min_split, ml_0, ml_t, ml_h, ml_s, a_t, a_h, a_s, a_d,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IP: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """SPLIT=False: grid (T, H_kv), keys 0..pos, normalized output into out.

    SPLIT=True: grid (T, H_kv, NS). With n = pos + 1 keys and the token's split size
    S = max(round_up(cdiv(n, NS), BLOCK_N), min_split) (computed here from the device position,
    so the NS partitions always cover all n keys whatever host bound chose NS), partition s
    covers keys [s*S, min((s+1)*S, n)) and writes its max m (ml[0]), sum l (ml[1]) and
    unnormalized acc in fp32 for `_paged_attention_combine_kernel`. An empty partition
    (s*S >= n) writes m = -inf, l = 0, acc = 0."""
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    r = tl.load(row_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md = offs_d < Dh
    mq = (offs_g[:, None] < REP) & md[None, :]
    heads = g * REP + offs_g
    q = tl.load(q_ptr + t * q_t + heads[:, None] * q_h + offs_d[None, :] * q_d, mask=mq, other=0.0)
    q = q.to(kv_ptr.dtype.element_ty)

    if SPLIT:
        sp = tl.program_id(2).to(tl.int64)
        n = pos + 1
        S = tl.maximum((tl.cdiv(n, NS) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_split)
        lo = sp * S
        hi = tl.minimum(lo + S, n)
    else:
        lo = 0
        hi = pos + 1

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    pt_row = pt_ptr + r * pt_r
    head_off = g * c_h
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        mj = j < hi
        page = tl.load(pt_row + (j // page_size) * pt_p, mask=mj, other=0).to(tl.int64)
        base = page * c_p + (j % page_size) * c_s + head_off
        mk = mj[:, None] & md[None, :]
        kp = kv_ptr + base[:, None] + offs_d[None, :] * c_d
        k = tl.load(kp, mask=mk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=IP) * scale  # [BLOCK_G, BLOCK_N] fp32
        s = tl.where(mj[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key `start` < hi is visible
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kp + c_kv, mask=mk, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=IP)
        m_i = m_new
    if SPLIT:
        mg = offs_g < REP
        ml = ml_ptr + t * ml_t + heads * ml_h + sp * ml_s
        tl.store(ml, m_i, mask=mg)
        tl.store(ml + ml_0, l_i, mask=mg)
        tl.store(acc_ptr + t * a_t + heads[:, None] * a_h + sp * a_s + offs_d[None, :] * a_d,
                 acc, mask=mq)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + t * o_t + heads[:, None] * o_h + offs_d[None, :] * o_d,
                 out.to(out_ptr.dtype.element_ty), mask=mq)


@triton.jit(do_not_specialize=["NS", "ml_0", "ml_t", "ml_h", "a_t", "a_h"])
def _paged_attention_combine_kernel(
    ml_ptr, acc_ptr, out_ptr, NS, Dh,
    ml_0, ml_t, ml_h, ml_s, a_t, a_h, a_s, a_d, o_t, o_h, o_d,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (T, H): merges the NS partitions of one token and query head,
    out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s with M = max_s m_s. Empty partitions
    (m = -inf, l = 0) get weight 0 and their accumulators are not read (the tiled kernel does not
    write them); partition 0 always holds key 0, so M is finite."""
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms = offs_s < NS
    md = offs_d < Dh
    ml = ml_ptr + t * ml_t + h * ml_h + offs_s * ml_s
    m = tl.load(ml, mask=ms, other=float("-inf"))
    lsum = tl.load(ml + ml_0, mask=ms, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # only if pos < 0 (0/0 as unsplit)
    w = tl.exp(m - m_max)
    acc = tl.load(acc_ptr + t * a_t + h * a_h + offs_s[:, None] * a_s + offs_d[None, :] * a_d,
                  mask=ms[:, None] & md[None, :] & (lsum > 0)[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(lsum * w, axis=0)
    tl.store(out_ptr + t * o_t + h * o_h + offs_d * o_d, (num / den).to(out_ptr.dtype.element_ty),
             mask=md)


@triton.jit(do_not_specialize=["T", "TPB", "pt_r", "NS", "min_split", "ml_0", "ml_t", "ml_h",
                               "a_t", "a_h"])
def _paged_attention_tiled_kernel(
    q_ptr, kv_ptr, pt_ptr, row_ptr, pos_ptr, out_ptr, scale, page_size, Dh, REP, T, TPB,
    q_t, q_h, q_d, c_kv, c_p, c_s, c_h, c_d, pt_r, pt_p, o_t, o_h, o_d,
    ml_ptr, acc_ptr, NS, min_split, ml_0, ml_t, ml_h, ml_s, a_t, a_h, a_s, a_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IP: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """TPB consecutive tokens x the REP query heads of one KV head, flattened into BLOCK_M query
    rows (row m = token m // REP, head m % REP). The tile may span several batch rows: it makes
    one pass over the keys of each batch row present, updating only that row's queries.

    SPLIT=True: grid (token blocks, H_kv, NS); for each batch row of n = (its last token's
    position + 1) keys, partition s covers keys [s*S, min((s+1)*S, n)) with
    S = max(round_up(cdiv(n, NS), BLOCK_N), min_split), and the program writes each query row's
    max, sum and unnormalized accumulator for `_paged_attention_combine_kernel` (as the
    per-token kernel's split does; a query row with no visible key in the partition writes
    m = -inf, l = 0, acc = 0)."""
    g = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tl.program_id(0).to(tl.int64) * TPB + offs_m // REP
    act = (offs_m < TPB * REP) & (tok < T)
    heads = g * REP + offs_m % REP
    md = offs_d < Dh
    mq = act[:, None] & md[None, :]
    q = tl.load(q_ptr + tok[:, None] * q_t + heads[:, None] * q_h + offs_d[None, :] * q_d,
                mask=mq, other=0.0)
    q = q.to(kv_ptr.dtype.element_ty)
    rows = tl.load(row_ptr + tok, mask=act, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=act, other=-1).to(tl.int64)
    r_lo = tl.min(tl.where(act, rows, 1 << 62), axis=0)
    r_hi = tl.max(tl.where(act, rows, -1), axis=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    head_off = g * c_h
    sp = tl.program_id(2).to(tl.int64)
    for rr in range(r_lo, r_hi + 1):
        in_row = act & (rows == rr)
        end = tl.max(tl.where(in_row, pos, -1), axis=0) + 1
        if SPLIT:
            S = tl.maximum((tl.cdiv(end, NS) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_split)
            lo = sp * S
            hi = tl.minimum(lo + S, end)
        else:
            lo = 0
            hi = end
        pt_row = pt_ptr + rr * pt_r
        for start in range(lo, hi, BLOCK_N):
            j = start + offs_n
            mj = j < hi
            page = tl.load(pt_row + (j // page_size) * pt_p, mask=mj, other=0).to(tl.int64)
            base = page * c_p + (j % page_size) * c_s + head_off
            mk = mj[:, None] & md[None, :]
            kp = kv_ptr + base[:, None] + offs_d[None, :] * c_d
            k = tl.load(kp, mask=mk, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=IP) * scale
            vis = in_row[:, None] & (j[None, :] <= pos[:, None]) & mj[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows not seen yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(kp + c_kv, mask=mk, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=IP)
            m_i = m_new
    if SPLIT:
        ml = ml_ptr + tok * ml_t + heads * ml_h + sp * ml_s
        tl.store(ml, m_i, mask=act)
        tl.store(ml + ml_0, l_i, mask=act)
        # a query row that saw no key here leaves its accumulator unwritten (l = 0: the
        # combine reads none of it), so a short row's empty partitions cost no scratch traffic
        tl.store(acc_ptr + tok[:, None] * a_t + heads[:, None] * a_h + sp * a_s
                 + offs_d[None, :] * a_d, acc, mask=mq & (l_i > 0)[:, None])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * o_t + heads[:, None] * o_h + offs_d[None, :] * o_d,
                 out.to(out_ptr.dtype.element_ty), mask=mq)


_SMS_CPU = 132  # the H200's SMs; what the launchers assume off CUDA


def _sms(device: torch.device) -> int:
    """The device's SM count (`_common.num_sms`: cached, no sync); off CUDA the H200's, so the
    interpreter runs the split paths the GPU takes."""
    return num_sms(device) if device.type == "cuda" else _SMS_CPU


def choose_num_splits(T: int, Hkv: int, max_kv_len: int, target_programs: int,
                      min_split_keys: int) -> int:
    """Key partitions per (token, KV head) for the per-token kernel, from host ints only: 1 when
    T * H_kv programs already fill the GPU (>= target_programs), else enough partitions to reach
    target_programs, but no more than max_kv_len / min_split_keys."""
    progs = T * Hkv
    if progs >= target_programs:
        return 1
    return max(1, min(triton.cdiv(target_programs, progs),
                      triton.cdiv(max(1, max_kv_len), max(1, min_split_keys))))


def tiled_num_splits(programs: int, max_kv_len: int, sms: int, min_split_keys: int) -> int:
    """Key partitions of the tiled kernel, from host ints only: 1 unless its programs (token
    blocks x KV heads) fill at most half the SMs (a short prompt or a follow-up turn's suffix
    after a long cached prefix: a handful of programs would each walk the whole context), then
    as many as keep one wave (programs x partitions <= SMs; a default 8-warp program takes a
    whole SM), no more than max_kv_len / min_split_keys. One wave beat two per SM behind a
    prefix (H100, scripts/prefix_attention_sweep.py: 84.5 against 100.9 µs at 2048 + 128)."""
    if programs * 2 > sms:
        return 1
    return max(1, min(sms // programs, triton.cdiv(max(1, max_kv_len), max(1, min_split_keys))))


# The tiled kernel's default keys per step, whatever the page size (each key's page is looked
# up on its own): 16 / 32 / 64 swept in scripts/prefix_attention_sweep.py (docs/kernels.md)
TILED_BLOCK_N = 64


def tiled_num_warps(block_m: int, block_n: int, block_d: int) -> int:
    """The tiled kernel's default warps: 8 where 4 warps' registers spill (sm_90 ptxas: 128-row
    tiles at head_dim 128 with 16 keys and up, at head_dim 64 with 64 keys), else 4."""
    return 8 if block_m * (block_d + block_n) >= 128 * 128 else 4


def decode_block_n(head_dim: int) -> int:
    """The per-token kernel's default keys per step: a K/V tile of 4096 elements, 32 keys of
    head_dim 128, 64 of head_dim 64 (the best block_n at 64 decode tokens in
    scripts/decode_attention_sweep.py; fewer serial steps per program)."""
    return max(16, min(64, 4096 // max(16, triton.next_power_of_2(head_dim))))


def paged_attention_triton(q, kv_cache, page_table, token_row, positions, max_kv_len, scale, *,
                           tiled: bool = False, out: torch.Tensor | None = None):
    """Same contract as `mambaserve.ops.paged_attention.paged_attention`. Each token's keys stop
    at its own position; `max_kv_len` only sizes the split-KV grid (a smaller value than the
    real lengths costs speed, not correctness).

    `tiled=False`: the per-token kernel. Its `num_splits` knob is the number of key partitions
    per (token, KV head): None = the heuristic `choose_num_splits(T, H_kv, max_kv_len, ~2 x SMs,
    min_split_keys)`, 1 = the single-pass kernel. With > 1, a token's partition size is computed
    on the device from its position (at least `min_split_keys` rounded up to BLOCK_N under the
    heuristic, BLOCK_N when `num_splits` is set), then a combine kernel merges the partitions.
    Host ints only: no sync, CUDA-graph capturable.

    `tiled=True`: the prefill-oriented kernel, one program per block of
    max(1, block_m // (H / H_kv)) consecutive tokens and one KV head, so a prefill row's K/V is
    read once per token block instead of once per token. When those programs are few
    (`tiled_num_splits`; tuning `num_splits` overrides) each also takes one of `ns` key
    partitions (of at least `min_split_keys` keys), merged by the combine kernel. The public op
    sends prefill tokens here and decode tokens, one per row, to the per-token kernel, which has
    more parallelism for them.

    `out`: write into this [T, H, head_dim] tensor (any strides, e.g. a row slice of a mixed
    batch's output) instead of a new one; it is returned."""
    T, H, Dh = q.shape
    _, _, page_size, Hkv, Dk = kv_cache.shape
    assert Dk == Dh and H % Hkv == 0, (q.shape, kv_cache.shape)
    assert token_row.shape == (T,) and positions.shape == (T,), (token_row.shape, positions.shape)
    if out is None:
        out = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    assert out.shape == (T, H, Dh) and out.dtype == q.dtype, (out.shape, out.dtype, q.shape)
    if T == 0:
        return out
    rep = H // Hkv
    cfg = tuning.config("paged_attention_tiled" if tiled else "paged_attention", q.device)
    block_n, num_warps = cfg["block_n"], cfg["num_warps"]
    BLOCK_G = max(16, triton.next_power_of_2(rep))
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    IP = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    if tiled:
        BLOCK_N = block_n or TILED_BLOCK_N
        BLOCK_M = max(16, triton.next_power_of_2(cfg["block_m"]), triton.next_power_of_2(rep))
        if num_warps is None:
            num_warps = tiled_num_warps(BLOCK_M, BLOCK_N, BLOCK_D)
        tpb = max(1, BLOCK_M // rep)
        blocks = triton.cdiv(T, tpb)
        ns = tiled_num_splits(blocks * Hkv, int(max_kv_len), _sms(q.device),
                              cfg["min_split_keys"]) if cfg["num_splits"] is None \
            else int(cfg["num_splits"])
        assert ns >= 1, ns
        min_split = triton.cdiv(max(1, cfg["min_split_keys"]), BLOCK_N) * BLOCK_N
        # one pass (ns 1): the scratch arguments are unused
        ml, acc = (out, out) if ns == 1 else split_scratch(T, H, ns, Dh, q.device)
        strides = (0,) * 8 if ns == 1 else (*ml.stride(), *acc.stride())
        _paged_attention_tiled_kernel[(blocks, Hkv, ns)](
            q, kv_cache, page_table, token_row, positions, out, float(scale), page_size, Dh,
            rep, T, tpb, *q.stride(), *kv_cache.stride(), *page_table.stride(), *out.stride(),
            ml, acc, ns, min_split, *strides,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IP=IP, SPLIT=ns > 1,
            num_warps=num_warps,
        )
        if ns > 1:
            _combine(ml, acc, out, ns, Dh, q.device)
        return out
    BLOCK_N = block_n or decode_block_n(Dh)
    if num_warps is None:
        num_warps = 4 if BLOCK_D * BLOCK_N >= 4096 else 2
    num_splits, min_split_keys = cfg["num_splits"], cfg["min_split_keys"]
    if num_splits is None:
        ns = choose_num_splits(T, Hkv, int(max_kv_len), 2 * _sms(q.device),
                               min_split_keys)
        min_split = triton.cdiv(max(1, min_split_keys), BLOCK_N) * BLOCK_N
    else:
        ns = int(num_splits)
        assert ns >= 1, num_splits
        min_split = BLOCK_N
    if ns == 1:
        _paged_attention_kernel[(T, Hkv)](
            q, kv_cache, page_table, token_row, positions, out, float(scale), page_size, Dh, rep,
            *q.stride(), *kv_cache.stride(), *page_table.stride(), *out.stride(),
            out, out, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # scratch unused
            BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IP=IP, SPLIT=False,
            num_warps=num_warps, **pdl_launch(q.device, _paged_attention_kernel),
        )
        return out
    ml, acc = split_scratch(T, H, ns, Dh, q.device)
    _paged_attention_kernel[(T, Hkv, ns)](
        q, kv_cache, page_table, token_row, positions, out, float(scale), page_size, Dh, rep,
        *q.stride(), *kv_cache.stride(), *page_table.stride(), *out.stride(),
        ml, acc, ns, min_split, *ml.stride(), *acc.stride(),
        BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IP=IP, SPLIT=True,
        num_warps=num_warps, **pdl_launch(q.device, _paged_attention_kernel),
    )
    _combine(ml, acc, out, ns, Dh, q.device)
    return out


def split_scratch(T: int, H: int, ns: int, Dh: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The key partitions' scratch, uninitialized: partial max and sum [2, T, H, ns] and
    unnormalized accumulators [T, H, ns, Dh], float32."""
    return (torch.empty((2, T, H, ns), dtype=torch.float32, device=device),
            torch.empty((T, H, ns, Dh), dtype=torch.float32, device=device))


def _combine(ml: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, ns: int, Dh: int,
             device: torch.device) -> None:
    """The partitions' merge (`_paged_attention_combine_kernel`), grid (T, H)."""
    T, H = out.shape[:2]
    BLOCK_S = triton.next_power_of_2(ns)
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    _paged_attention_combine_kernel[(T, H)](
        ml, acc, out, ns, Dh, *ml.stride(), *acc.stride(), *out.stride(),
        BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, num_warps=max(1, min(4, BLOCK_S * BLOCK_D // 1024)),
        **pdl_launch(device, _paged_attention_combine_kernel),
    )
