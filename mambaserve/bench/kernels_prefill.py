# ruff: noqa: B023  (every timed closure runs before its loop variables move on)
"""The prefill cases of `mambaserve bench kernels`, on `rows x seqlen` batches planned by
build_metadata: the varlen conv (rows with initial state; TB/s over x read + out written), the
SSD chunked scan (rows from zero; TFLOP/s over the chunked algorithm's matrix work: per chunk
and head 2L²N for C·Bᵀ, 2L²P for the intra-chunk output, 2LNP each for the chunk state and the
inter-chunk output) and causal paged attention (rows without a cached prefix; TFLOP/s over the
causal work, 4·H·D·L(L+1)/2 per row, with torch SDPA on dense tensors as the peer).

x/B/C are split views of one xBC buffer, as in the mixer. The scan's row "triton, cold L2" runs
it over several input copies in turn, so that its inputs are not L2-resident, as in a model.
`--sweep` adds the launch-parameter variants below (through `tuning.override`) and, for the
scan, the cumulative time of its first launches (`SsdScan.launches`).
"""

from __future__ import annotations

import torch

from mambaserve.bench.kernels_harness import Harness, rel
from mambaserve.bench.kernels_peers import vllm_conv_metadata
from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.ops.triton import tuning

# (block_t, block_d, num_warps, lookahead) of the conv launch; the table has 16, 512, 4, 4
CONV_SWEEP = [(16, 512, 4, 0), (16, 512, 4, 2), (8, 512, 4, 4), (32, 512, 4, 4), (16, 256, 2, 4),
              (16, 1024, 8, 4), (16, 1024, 4, 4), (8, 256, 2, 4), (8, 1024, 8, 4), (8, 512, 4, 2),
              (8, 512, 2, 4), (4, 512, 4, 4)]
# launch S: (block_p_state, block_n_state, num_warps_state[, block_l_state, num_stages_state]),
# one row tile per program and no prefetch (the layout before the split default, below);
# the smaller blocks give one sequence's scan (a grid of heads x blocks) more programs; P blocks
# of 16 divide the 9B's head_dim of 80 (64 leaves a second block 3/4 empty); token blocks below
# the chunk (block_l) loop over the chunk in smaller dots, which num_stages > 1 lets the compiler
# pipeline (the next block's loads under this one's dot)
SSD_STATE_SWEEP = [(64, 128, 8), (128, 128, 8), (128, 64, 4), (64, 64, 4), (64, 32, 4),
                   (32, 64, 4), (32, 128, 4), (16, 128, 4), (16, 64, 4), (32, 128, 8),
                   (32, 128, 2), (16, 128, 2),
                   (64, 128, 4, 64, 2), (64, 128, 4, 64, 3), (64, 128, 4, 128, 2),
                   (64, 128, 8, 64, 2), (64, 128, 8, 64, 3), (64, 128, 4, 32, 3),
                   (32, 128, 4, 64, 2), (32, 128, 8, 64, 3), (128, 128, 8, 64, 2),
                   (64, 64, 4, 64, 2), (16, 128, 4, 64, 3)]
# launch C: (block_m_scan, block_p_scan, block_k_scan, num_warps_scan, num_stages_scan); P
# blocks below 128 split the 9B's head_dim of 80 over more programs (less padding, more
# programs re-reading the C·Bᵀ tiles)
SSD_SCAN_SWEEP = [(64, 128, 32, 4, 3), (64, 128, 64, 4, 2), (32, 128, 32, 4, 2),
                  (64, 128, 32, 8, 2), (128, 128, 32, 4, 2), (64, 128, 16, 4, 3),
                  (32, 128, 32, 2, 2), (64, 128, 32, 4, 1),
                  (64, 64, 16, 4, 3), (64, 32, 16, 4, 3), (64, 16, 16, 4, 3),
                  (128, 64, 16, 4, 3), (128, 32, 16, 8, 3), (32, 64, 16, 4, 3)]
# a head_dim that is not a power of two (the 9B's 80): the defaults run launch S with the rows
# past its 64-row tile as a second tile of the same program (64-wide N tiles, the next chunk's
# tiles loaded ahead) and launch C with two column tiles in one program (64 + 16, 32-token source
# blocks); these variants undo one choice at a time
SSD_SPLIT_SWEEP = [
    ("state second program", {"block_p2_state": 0, "block_n_state": None,
                              "prefetch_state": None}),
    ("state split no prefetch", {"prefetch_state": False}),
    ("state split bn128 w8", {"block_n_state": 128, "num_warps_state": 8}),
    ("scan one P tile", {"block_p2_scan": 0}),
    ("scan split k16", {"block_k_scan": 16}),
    ("scan split m128 w8", {"block_m_scan": 128, "num_warps_scan": 8}),
]
# tiled attention variants: (name, knobs); the table has 128-row tiles, BLOCK_N from the page
ATTN_SWEEP = [("triton tiled m64", {"block_m": 64}), ("triton tiled n128", {"block_n": 128}),
              ("triton tiled 8w", {"num_warps": 8})]


def _meta(h: Harness, nrows: int, seqlen: int, context: int, has_init: bool,
          page_size: int = 1 << 20, paged: bool = False):
    per_row = -(-(context + seqlen) // page_size)
    rows = [Row.standalone([1] * seqlen, context, i, has_init,
                           list(range(i * per_row, (i + 1) * per_row)) if paged else [0])
            for i in range(nrows)]
    return build_metadata(Batch(prefills=rows, decodes=[]), chunk_size=h.shapes.L,
                          conv_kernel=h.shapes.K, page_size=page_size,
                          scratch_page=nrows * per_row if paged else 0, device=h.device)


def conv_prefill(h: Harness, shapes: list[tuple[int, int]], sweep: bool, conv_peer) -> None:
    from mambaserve.ops.conv1d import causal_conv1d_varlen_ref
    from mambaserve.ops.triton.conv1d_varlen import causal_conv1d_varlen_triton

    s, dev, dt_ = h.shapes, h.device, h.dtype
    for nrows, seqlen in shapes:
        meta = _meta(h, nrows, seqlen, context=5, has_init=True)
        pm, T = meta.prefill, meta.num_prefill_tokens
        # x: the xBC columns of the in_proj output [z | xBC | dt], a strided view as in the mixer
        zxbcdt = torch.randn(T, s.d_inner + s.conv_dim + s.H, device=dev, dtype=dt_)
        x = zxbcdt[:, s.d_inner: s.d_inner + s.conv_dim]
        w = torch.randn(s.conv_dim, s.K, device=dev, dtype=dt_) * 0.5
        b = torch.randn(s.conv_dim, device=dev, dtype=dt_)
        st = torch.randn(nrows + 1, s.K - 1, s.conv_dim, device=dev, dtype=dt_)
        args = (pm.state_slots.to(torch.int32), pm.has_initial_state, pm.conv_window_idx,
                pm.conv_state_idx)
        s1 = st.clone()
        out_ref = causal_conv1d_varlen_ref(x, w, b, s1, *args)
        nbytes = 2 * T * s.conv_dim * 2
        shape = f"{nrows}x{seqlen}"
        variants = [("triton", x, {})]
        if sweep:
            variants += [("triton contiguous x", x.contiguous(), {})]
            variants += [(f"triton bt{bt} bd{bd} w{nw} la{la}", x,
                          {"block_t": bt, "block_d": bd, "num_warps": nw, "lookahead": la})
                         for bt, bd, nw, la in CONV_SWEEP]
            variants += [("triton runtime loop bt8 bd256", x,
                          {"block_t": 8, "block_d": 256, "unroll": False})]
        for name, xv, knobs in variants:
            try:
                s2 = st.clone()
                with tuning.override("conv1d_varlen", **knobs):
                    err = max(rel(causal_conv1d_varlen_triton(xv, w, b, s2, *args), out_ref),
                              rel(s2[:-1], s1[:-1]))
                    ms = h.time_ms(lambda: causal_conv1d_varlen_triton(xv, w, b, s2, *args))
                h.row(op="conv_varlen", impl=name, shape=shape, us=ms * 1e3,
                      TBps=nbytes / ms / 1e9, rel_err=err)
            except Exception as e:  # noqa: BLE001
                print(f"conv {name} {shape} failed: {type(e).__name__}: {e}", flush=True)
        ms = h.time_ms(lambda: causal_conv1d_varlen_ref(x, w, b, s1, *args))
        h.row(op="conv_varlen", impl="torch ref", shape=shape, us=ms * 1e3,
              TBps=nbytes / ms / 1e9)
        if conv_peer is not None:
            try:
                _conv_prefill_vllm(h, conv_peer, [seqlen] * nrows, pm, x, w, b, st, out_ref, s1,
                                   nbytes, shape)
            except Exception as e:  # noqa: BLE001
                note = " (its prefill kernel does not run under the interpreter)" if h.dry else ""
                print(f"vllm conv prefill {shape} failed{note}: {type(e).__name__}: {e}",
                      flush=True)


def _conv_prefill_vllm(h, conv_peer, seqlens, pm, x, w, b, st, out_ref, s_ref, nbytes, shape):
    """vLLM's causal_conv1d_fn on the same inputs, in its layouts (built outside the timing):
    x as [dim, tokens] (the transposed view of our strided x: channels contiguous, as it wants),
    state [slot, dim, K-1] (a transposed view of a copy of ours), query_start_loc int32, the
    per-program tables precomputed (`metadata`)."""
    qsl = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32,
                       device=h.device)
    slots = pm.state_slots.to(torch.int32)
    pmeta = vllm_conv_metadata(seqlens, h.device)
    xp = x.t()
    sp = st.clone()
    spv = sp.transpose(1, 2)

    def call():
        return conv_peer.fn(xp, w, b, spv, qsl, cache_indices=slots,
                            has_initial_state=pm.has_initial_state, activation="silu",
                            metadata=pmeta)

    outp = call().t()  # [tokens, dim]
    err = max(rel(outp, out_ref), rel(sp[:-1], s_ref[:-1]))
    if not err < 1e-2:
        print(f"vllm conv prefill {shape}: output differs from the reference (rel {err:.2e})",
              flush=True)
    ms = h.time_ms(call)
    h.row(op="conv_varlen", impl="vllm", shape=shape, us=ms * 1e3, TBps=nbytes / ms / 1e9,
          rel_err=err)


def ssd_prefill(h: Harness, shapes: list[tuple[int, int]], sweep: bool, peer: dict | None):
    from mambaserve.ops.ssd import ssd_chunk_scan_varlen_ref
    from mambaserve.ops.triton.ssd import SsdScan

    s, dev, dt_ = h.shapes, h.device, h.dtype
    H, P, N, G, L = s.H, s.P, s.N, s.G, s.L
    lim = (0.0, float("inf"))
    for nrows, seqlen in shapes:
        meta = _meta(h, nrows, seqlen, context=0, has_init=False)
        pm, T = meta.prefill, meta.num_prefill_tokens
        g = torch.Generator(device=dev).manual_seed(1)
        xbc = torch.randn(T, s.conv_dim, device=dev, dtype=dt_, generator=g)
        x, Bm, Cm = _scan_views(xbc, s)
        dt = torch.randn(T, H, device=dev, dtype=dt_, generator=g) - 1
        A = -torch.rand(H, device=dev, generator=g) * 2 - 0.05
        D = torch.randn(H, device=dev, generator=g)
        dt_bias = torch.randn(H, device=dev, generator=g) * 0.5
        # the rows' slots, two prefix-cache snapshot slots, the scratch slot
        ssm = torch.randn(nrows + 3, H, P, N, device=dev, generator=g)
        args = (pm.state_slots.to(torch.int32), pm.has_initial_state, pm.chunk_token_idx,
                pm.token_chunk_pos, pm.row_chunks, pm.row_num_chunks)
        # "+ 2 snapshots": the end states of row 0's 4th and 8th chunks (or its last) saved, as
        # a step with prefix caching on saves a few
        snaps = torch.full((pm.num_chunks,), -1, dtype=torch.int64, device=dev)
        snaps[min(3, pm.num_chunks - 1)], snaps[min(7, pm.num_chunks - 1)] = nrows, nrows + 1
        flops = pm.num_chunks * H * (2 * L * L * N + 2 * L * L * P + 4 * L * N * P)
        shape = f"{nrows}x{seqlen}"
        s1 = ssm.clone()
        yr = ssd_chunk_scan_varlen_ref(x, dt, A, Bm, Cm, D, dt_bias, lim, s1, *args, snaps)

        def first_launches(state, n, snapshots):  # a new scan (allocations included), its first
            scan = SsdScan(x, dt, A, Bm, Cm, D, dt_bias, lim, state, *args,  # n launches
                           snaps if snapshots else None)
            for _, launch in scan.launches[:n]:
                launch()
            return scan

        variants = [("triton", {}, 4), ("triton + 2 snapshots", {}, 4)]
        if sweep:
            for bp, bn, nw, *rest in SSD_STATE_SWEEP:
                bl, ns = rest or (None, 1)
                variants.append((f"state bp{bp} bn{bn} w{nw}" + (f" l{bl} s{ns}" if rest else ""),
                                 {"block_p_state": bp, "block_n_state": bn,
                                  "num_warps_state": nw, "block_l_state": bl,
                                  "num_stages_state": ns, "block_p2_state": 0,
                                  "prefetch_state": False}, 4))
            variants += [(f"scan m{bm} bp{bp} k{bk} w{nw} s{ns}",
                          {"block_m_scan": bm, "block_p_scan": bp, "block_k_scan": bk,
                           "num_warps_scan": nw, "num_stages_scan": ns}, 4)
                         for bm, bp, bk, nw, ns in SSD_SCAN_SWEEP]
            if s.P & (s.P - 1):  # the split variants apply to such a head_dim only
                variants += [(name, knobs, 4) for name, knobs in SSD_SPLIT_SWEEP]
            variants += [("dt + state", {}, 2), ("dt + state + CB", {}, 3)]
        for name, knobs, n in variants:
            try:
                with tuning.override("ssd", **knobs):
                    s2 = ssm.clone()
                    snapshots = "snapshots" in name
                    scan = first_launches(s2, n, snapshots)
                    yt = scan.y
                    k = nrows + 2 if snapshots else nrows  # the slots both wrote
                    err = max(rel(yt, yr), rel(s2[:k], s1[:k])) if n == 4 else float("nan")
                    nan = bool(torch.isnan(yt).any() or torch.isnan(s2).any()) if n == 4 else False
                    ms = h.time_ms(lambda: first_launches(s2, n, snapshots))
                    dev_us = h.device_us(lambda: [launch() for _, launch in scan.launches[:n]])
                h.row(op="ssd_scan", impl=name, shape=shape, us=ms * 1e3,
                      TFLOPs=flops / ms / 1e9, rel_err=err, nan=nan, device_us=dev_us)
            except Exception as e:  # noqa: BLE001
                print(f"ssd {name} {shape} failed: {type(e).__name__}: {e}", flush=True)
        _ssd_cold(h, shape, flops, xbc, dt, (A, D, dt_bias, lim), ssm, args, s)
        ms = h.time_ms(lambda: ssd_chunk_scan_varlen_ref(x, dt, A, Bm, Cm, D, dt_bias, lim, s1,
                                                         *args), rep=30)
        h.row(op="ssd_scan", impl="torch ref", shape=shape, us=ms * 1e3, TFLOPs=flops / ms / 1e9)
        if peer is not None:
            xb, dtb = x.reshape(nrows, seqlen, H, P), dt.reshape(nrows, seqlen, H)
            Bb, Cb = Bm.reshape(nrows, seqlen, G, N), Cm.reshape(nrows, seqlen, G, N)

            def fn():
                return peer["scan"](xb, dtb, A, Bb, Cb, L, D=D, dt_bias=dt_bias, dt_softplus=True,
                                    return_final_states=True)

            yp, _ = fn()  # autotune outside the timing
            ms = h.time_ms(fn)
            h.row(op="ssd_scan", impl="mamba_ssm", shape=shape, us=ms * 1e3,
                  TFLOPs=flops / ms / 1e9, rel_err=rel(yp.reshape(T, H, P), yr))


def _scan_views(xbc: torch.Tensor, s):
    """x [T, H, P], B and C [T, G, N]: the split views of one xBC buffer, as in the mixer."""
    d, gn = s.d_inner, s.G * s.N
    return (xbc[:, :d].view(-1, s.H, s.P), xbc[:, d: d + gn].view(-1, s.G, s.N),
            xbc[:, d + gn:].view(-1, s.G, s.N))


def _ssd_cold(h: Harness, shape: str, flops: int, xbc, dt, consts, ssm, args, s) -> None:
    """The row "triton, cold L2": the scan over enough copies of its inputs, run in turn in one
    graph, that each scan finds its x / B / C evicted from the L2 by the others', as in a model,
    where the conv before the scan and the projections after it move far more than the L2 holds
    (the "triton" row replays one scan whose inputs stay L2-resident at the small shapes);
    device µs per scan."""
    from mambaserve.ops.triton.ssd import SsdScan

    if h.dry or torch.device(h.device).type != "cuda":
        return
    l2 = torch.cuda.get_device_properties(h.device).L2_cache_size
    per_scan = xbc.numel() * xbc.element_size() * 2  # x / B / C read, y written
    copies = min(16, max(2, -(-4 * l2 // per_scan)))
    A, D, dt_bias, lim = consts
    scans = []
    for _ in range(copies):
        x, Bm, Cm = _scan_views(xbc.clone(), s)
        scans.append(SsdScan(x, dt.clone(), A, Bm, Cm, D, dt_bias, lim, ssm.clone(), *args, None))
    us = h.device_us(lambda: [launch() for scan in scans for _, launch in scan.launches])
    h.row(op="ssd_scan", impl="triton, cold L2", shape=shape, copies=copies,
          TFLOPs=flops * copies / us / 1e6, device_us=us / copies)


def attention_prefill(h: Harness, shapes: list[tuple[int, int]], sweep: bool) -> None:
    """The per-token kernel, the tiled kernel (what the public op uses for prefill tokens) and
    torch SDPA on dense [rows, heads, L, D] tensors (flash attention on the GPU)."""
    from mambaserve.ops.paged_attention import paged_attention_ref, write_kv
    from mambaserve.ops.triton.paged_attention import paged_attention_triton

    s, dev, dt_ = h.shapes, h.device, h.dtype
    ah, akv, ad, page = s.attn_heads, s.attn_kv_heads, s.attn_head_dim, s.page_size
    for nrows, seqlen in shapes:
        meta = _meta(h, nrows, seqlen, context=0, has_init=False, page_size=page, paged=True)
        T = meta.num_tokens
        g = torch.Generator(device=dev).manual_seed(2)
        q = torch.randn(T, ah, ad, device=dev, dtype=dt_, generator=g)
        k = torch.randn(T, akv, ad, device=dev, dtype=dt_, generator=g)
        v = torch.randn(T, akv, ad, device=dev, dtype=dt_, generator=g)
        num_pages = nrows * -(-seqlen // page)
        kv = torch.zeros(2, num_pages + 1, page, akv, ad, device=dev, dtype=dt_)
        write_kv(kv, k, v, meta.slot_mapping)
        args = (q, kv, meta.page_table, meta.token_row, meta.positions, meta.max_kv_len,
                ad ** -0.5)
        flops = nrows * 4.0 * ah * ad * seqlen * (seqlen + 1) / 2
        shape = f"{nrows}x{seqlen}"
        ref = paged_attention_ref(*args) if T * meta.max_kv_len <= 1 << 16 else None  # memory
        dense = [t.view(nrows, seqlen, -1, ad).transpose(1, 2) for t in (q, k, v)]

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(
                *dense, is_causal=True, scale=ad ** -0.5, enable_gqa=True)

        base = sdpa().transpose(1, 2).reshape(T, ah, ad)
        variants = [("triton", False, {}), ("triton tiled", True, {})]
        if sweep:
            variants += [(name, True, knobs) for name, knobs in ATTN_SWEEP]
        for impl, tiled, knobs in variants:
            with tuning.override("paged_attention_tiled" if tiled else "paged_attention",
                                 **knobs):
                out = paged_attention_triton(*args, tiled=tiled)
                err = rel(out, ref if ref is not None else base)
                ms = h.time_ms(lambda: paged_attention_triton(*args, tiled=tiled))
            h.row(op="attention_prefill", impl=impl, shape=shape, us=ms * 1e3,
                  TFLOPs=flops / ms / 1e9, rel_err=err)
        ms = h.time_ms(sdpa)
        h.row(op="attention_prefill", impl="torch sdpa", shape=shape, us=ms * 1e3,
              TFLOPs=flops / ms / 1e9)
