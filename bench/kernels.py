# ruff: noqa: B023  (every timed closure runs before its loop variables move on)
"""Benchmark of mambaserve's Triton kernels against the torch references (and mamba_ssm, if present)
at the Nemotron-Nano-9B-v2 Mamba-layer shapes. Runs on a CUDA GPU.

    PYTHONPATH=.:.peer/mamba_ssm-2.3.2.post1 python3 bench/kernels.py --out results.json [--sweep]

Times are medians of CUDA-event timings (triton.testing.do_bench, return_mode="median", which also
flushes L2 before every call). Decode kernels report TB/s over the bytes they must move (fp32 state
read + written, inputs read, outputs written); the SSD scan reports TFLOP/s over the chunked
algorithm's matrix work (per chunk and head: 2L^2N for C·Bᵀ, 2L^2P for the intra-chunk output,
2LNP each for the chunk state and the inter-chunk output). The device-to-device copy bandwidth and
a bf16 matmul rate are measured in the same run as ceilings. mamba_ssm (the peer) is timed only
when it can be imported; the script says so when it cannot.

The convs' peer is vLLM's pure-Triton causal_conv1d (`causal_conv1d_fn` for the varlen prefill,
`causal_conv1d_update` for decode; mamba_ssm has no Triton conv), read from the git-ignored
`.peer/vllm_conv/causal_conv1d.py` (vllm-project/vllm,
vllm/model_executor/layers/mamba/ops/causal_conv1d.py, unmodified) by `load_conv_peer`, which
replaces its `vllm.*` imports at load time; without that file the conv rows time ours only. Rows
of our default kernel carry `ours_over_peer` (our time / the peer's, < 1 = we are faster).
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import re
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
CONV_PEER_FILE = os.path.join(ROOT, ".peer", "vllm_conv", "causal_conv1d.py")

H, P, N, G, K, L = 128, 80, 128, 8, 4, 128  # Nemotron-Nano-9B-v2 Mamba layer
D_INNER = H * P
CONV_DIM = D_INNER + 2 * G * N  # 12288
RESULTS: dict = {"rows": []}


DEV = "cuda"
DT = torch.bfloat16
DRY = False  # --dry: tiny shapes on the CPU under TRITON_INTERPRET=1, to smoke-test this script


def set_dry():
    global H, P, N, G, L, D_INNER, CONV_DIM, DEV, DRY, DT
    H, P, N, G, L, DT = 4, 16, 16, 2, 16, torch.float16  # the interpreter's bf16 dot is wrong
    D_INNER, CONV_DIM, DEV, DRY = H * P, H * P + 2 * G * N, "cpu", True


def bench(fn, rep=60):
    if DRY:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=15, rep=rep, return_mode="median")  # ms


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def row(**kw):
    RESULTS["rows"].append(kw)
    items = []
    for k, v in kw.items():
        items.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    print("  ".join(items), flush=True)


def ceilings():
    n = 1 << 30  # 1 GiB copied: 2 GiB moved
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    RESULTS["copy_TBps"] = 2 * n / ms / 1e9
    m = torch.randn(8192, 8192, device=DEV, dtype=DT)
    m2 = torch.randn(8192, 8192, device=DEV, dtype=DT)
    ms = bench(lambda: m @ m2)
    RESULTS["bf16_mm_TFLOPs"] = 2 * 8192 ** 3 / ms / 1e9
    print(f"ceilings: d2d copy {RESULTS['copy_TBps']:.2f} TB/s, "
          f"bf16 matmul {RESULTS['bf16_mm_TFLOPs']:.0f} TFLOP/s", flush=True)


def load_peer():
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn as p_norm
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as p_ssu
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as p_scan
        return {"ssu": p_ssu, "scan": p_scan, "norm": p_norm}
    except Exception as e:  # noqa: BLE001
        print(f"peer mamba_ssm not available ({type(e).__name__}: {e}); timing ours and the "
              "reference only", flush=True)
        return None


# what the peer file's `from vllm... import NAME` lines provide, as plain code
_VLLM_NAMES = {"tl": "import triton.language as tl", "triton": "import triton",
               "PAD_SLOT_ID": "PAD_SLOT_ID = -1"}


def load_conv_peer(path=CONV_PEER_FILE):
    """vLLM's Triton causal_conv1d module (a namespace with causal_conv1d_fn and
    causal_conv1d_update) from `path`, its vllm imports replaced; None (and a printed reason) when
    the file is absent or does not load."""
    if not os.path.exists(path):
        print(f"conv peer not available ({os.path.relpath(path, ROOT)} absent: save vllm-project/vllm's "
              "vllm/model_executor/layers/mamba/ops/causal_conv1d.py there); timing ours and the "
              "reference only", flush=True)
        return None
    try:
        with open(path) as f:
            src = f.read()
        out = []
        for line in src.splitlines():
            m = re.match(r"\s*from\s+vllm[\w.]*\s+import\s+\(?([\w\s,]+)\)?\s*$", line)
            if m:
                names = [n.strip() for n in m.group(1).split(",") if n.strip()]
                missing = [n for n in names if n not in _VLLM_NAMES]
                if missing:
                    raise ImportError(f"no stand-in for vllm names {missing} ({line.strip()!r})")
                indent = line[: len(line) - len(line.lstrip())]
                out.append(indent + "; ".join(_VLLM_NAMES[n] for n in names))
            elif re.match(r"\s*(import|from)\s+vllm\b", line):
                raise ImportError(f"unsupported vllm import {line.strip()!r}")
            else:
                out.append(line)  # one line for one: line numbers stay those of the file
        text = "\n".join(out) + "\n"
        # triton.jit reads each kernel's source through inspect/linecache: register the text
        fname = os.path.abspath(path) + " (vllm imports replaced)"
        linecache.cache[fname] = (len(text), None, text.splitlines(True), fname)
        ns = {"__name__": "vllm_causal_conv1d_peer", "__file__": fname}
        exec(compile(text, fname, "exec"), ns)  # noqa: S102  (the peer's own module text)
        return SimpleNamespace(fn=ns["causal_conv1d_fn"], update=ns["causal_conv1d_update"])
    except Exception as e:  # noqa: BLE001
        print(f"conv peer did not load ({type(e).__name__}: {e}); timing ours and the reference "
              "only", flush=True)
        return None


def conv_peer_metadata(seqlens, device):
    """The `metadata` causal_conv1d_fn accepts: its per-program (row, segment) tables for the
    usual BLOCK_M values, built here on the host once so the timed call does no host work (without
    it every call copies query_start_loc to the host)."""
    import numpy as np
    nums_dict = {}
    for bm in (4, 8, 16, 32, 64):
        nums = [-(-n // bm) for n in seqlens]
        mlist = np.repeat(np.arange(len(nums)), nums)
        offs = np.concatenate([np.arange(n) for n in nums]) if nums else np.zeros(0, np.int64)
        bp = torch.tensor(mlist, dtype=torch.int32, device=device)
        op = torch.tensor(offs, dtype=torch.int32, device=device)
        nums_dict[bm] = {"tot": int(sum(nums)), "mlist": bp, "mlist_len": len(mlist),
                         "offsetlist": op, "batch_ptr": bp, "token_chunk_offset_ptr": op}
    return SimpleNamespace(nums_dict=nums_dict, batch_ptr=nums_dict[8]["batch_ptr"],
                           token_chunk_offset_ptr=nums_dict[8]["token_chunk_offset_ptr"])


def decode(peer, batches, sweep, conv_peer=None):
    from mambaserve.ops.conv1d import causal_conv1d_update_ref
    from mambaserve.ops.selective_state_update import selective_state_update_ref
    from mambaserve.ops.triton.conv1d_update import causal_conv1d_update_triton
    from mambaserve.ops.triton.selective_state_update import selective_state_update_triton

    num_slots = 8 if DRY else 512
    g = torch.Generator(device=DEV).manual_seed(0)
    ssm = torch.randn(num_slots + 1, H, P, N, device=DEV, generator=g)
    conv = torch.randn(num_slots + 1, K - 1, CONV_DIM, device=DEV, dtype=DT,
                       generator=g)
    A = -torch.rand(H, device=DEV, generator=g) * 4 - 0.1
    D = torch.randn(H, device=DEV, generator=g)
    dt_bias = torch.randn(H, device=DEV, generator=g) * 0.5
    w = torch.randn(CONV_DIM, K, device=DEV, dtype=DT, generator=g) * 0.5
    cb = torch.randn(CONV_DIM, device=DEV, dtype=DT, generator=g)
    lim = (0.0, float("inf"))
    for Bt in batches:
        xbc = torch.randn(Bt, CONV_DIM, device=DEV, dtype=DT, generator=g)
        x = xbc[:, :D_INNER].view(Bt, H, P)
        Bm = xbc[:, D_INNER: D_INNER + G * N].view(Bt, G, N)
        Cm = xbc[:, D_INNER + G * N:].view(Bt, G, N)
        dt = torch.randn(Bt, H, device=DEV, dtype=DT, generator=g)
        slot_sets = [torch.randperm(num_slots, device=DEV, generator=g)[:Bt].to(torch.int32)
                     for _ in range(4 if DRY else 64)]
        it = [0]

        def nxt():
            it[0] = (it[0] + 1) % len(slot_sets)
            return slot_sets[it[0]]

        nbytes = Bt * H * P * N * 4 * 2 + Bt * (D_INNER + 2 * G * N + H) * 2 + Bt * D_INNER * 2
        # correctness on this shape against the reference
        s1, s2 = ssm.clone(), ssm.clone()
        sl = slot_sets[0]
        yr = selective_state_update_ref(s1, x, dt, A, Bm, Cm, D, dt_bias, lim, sl)
        yt = selective_state_update_triton(s2, x, dt, A, Bm, Cm, D, dt_bias, lim, sl)
        err = max(rel(yt, yr), rel(s2[sl.long()], s1[sl.long()]))
        del s1, s2
        variants = [("triton", {})]
        if sweep and Bt == 256:
            variants += [(f"triton bp{bp} w{nw}", {"block_p": bp, "num_warps": nw})
                         for bp, nw in ((8, 2), (32, 2))]
        for name, kw in variants:
            ms = bench(lambda: selective_state_update_triton(ssm, x, dt, A, Bm, Cm, D, dt_bias, lim,
                                                             nxt(), **kw))
            row(op="ssu", impl=name, batch=Bt, us=ms * 1e3, TBps=nbytes / ms / 1e9,
                rel_err=err if not kw else float("nan"))
        ms = bench(lambda: selective_state_update_ref(ssm, x, dt, A, Bm, Cm, D, dt_bias, lim, nxt()))
        row(op="ssu", impl="torch ref", batch=Bt, us=ms * 1e3, TBps=nbytes / ms / 1e9)
        if peer is not None:
            A3 = A[:, None, None].expand(H, P, N)
            dt3 = dt[:, :, None].expand(Bt, H, P)
            db2 = dt_bias[:, None].expand(H, P)
            D2 = D[:, None].expand(H, P)
            ms = bench(lambda: peer["ssu"](ssm, x, dt3, A3, Bm, Cm, D=D2, dt_bias=db2,
                                           dt_softplus=True, state_batch_indices=nxt()))
            row(op="ssu", impl="mamba_ssm", batch=Bt, us=ms * 1e3, TBps=nbytes / ms / 1e9)

        cbytes = Bt * ((K - 1) * CONV_DIM * 2 * 2 + CONV_DIM * 2 * 2)
        c1, c2 = conv.clone(), conv.clone()
        orf = causal_conv1d_update_ref(xbc, w, cb, c1, sl)
        ot = causal_conv1d_update_triton(xbc, w, cb, c2, sl)
        err = max(rel(ot, orf), rel(c2[sl.long()], c1[sl.long()]))
        del c1, c2
        ms = bench(lambda: causal_conv1d_update_triton(xbc, w, cb, conv, nxt()))
        row(op="conv_update", impl="triton", batch=Bt, us=ms * 1e3, TBps=cbytes / ms / 1e9,
            rel_err=err)
        ms = bench(lambda: causal_conv1d_update_ref(xbc, w, cb, conv, nxt()))
        row(op="conv_update", impl="torch ref", batch=Bt, us=ms * 1e3, TBps=cbytes / ms / 1e9)
        if conv_peer is not None:
            try:
                # the peer's state layout is [slot, dim, K-1] with dim contiguous: a transposed
                # view of ours (same memory)
                c1, c3 = conv.clone(), conv.clone()
                orf = causal_conv1d_update_ref(xbc, w, cb, c1, sl)
                op = conv_peer.update(xbc, c3.transpose(1, 2), w, cb, activation=True,
                                      conv_state_indices=sl)
                err = max(rel(op, orf), rel(c3[sl.long()], c1[sl.long()]))
                del c1, c3
                convp = conv.transpose(1, 2)
                ms = bench(lambda: conv_peer.update(xbc, convp, w, cb, activation=True,
                                                    conv_state_indices=nxt()))
                row(op="conv_update", impl="vllm", batch=Bt, us=ms * 1e3,
                    TBps=cbytes / ms / 1e9, rel_err=err)
            except Exception as e:  # noqa: BLE001
                print(f"vllm conv update {Bt} failed: {type(e).__name__}: {e}", flush=True)


def norm(peer, tokens):
    from mambaserve.ops.gated_rmsnorm import gated_rmsnorm_ref
    from mambaserve.ops.triton.gated_rmsnorm import gated_rmsnorm_triton

    for T in tokens:
        y = torch.randn(T, D_INNER, device=DEV, dtype=DT)
        z = torch.randn(T, 2 * D_INNER, device=DEV, dtype=DT)[:, :D_INNER]
        w = torch.randn(D_INNER, device=DEV, dtype=DT)
        nbytes = 3 * T * D_INNER * 2
        err = rel(gated_rmsnorm_triton(y, z, w, D_INNER // G, 1e-5),
                  gated_rmsnorm_ref(y, z, w, D_INNER // G, 1e-5))
        ms = bench(lambda: gated_rmsnorm_triton(y, z, w, D_INNER // G, 1e-5))
        row(op="gated_rmsnorm", impl="triton", tokens=T, us=ms * 1e3, TBps=nbytes / ms / 1e9,
            rel_err=err)
        ms = bench(lambda: gated_rmsnorm_ref(y, z, w, D_INNER // G, 1e-5))
        row(op="gated_rmsnorm", impl="torch ref", tokens=T, us=ms * 1e3, TBps=nbytes / ms / 1e9)
        if peer is not None:
            zc = z.contiguous()  # the peer wants a contiguous z
            ms = bench(lambda: peer["norm"](y, w, None, z=zc, eps=1e-5, group_size=D_INNER // G,
                                            norm_before_gate=False))
            row(op="gated_rmsnorm", impl="mamba_ssm", tokens=T, us=ms * 1e3,
                TBps=nbytes / ms / 1e9)


def prefill(peer, shapes, sweep):
    from mambaserve.engine.batch import Batch, Row
    from mambaserve.metadata import build_metadata
    from mambaserve.ops.ssd import ssd_chunk_scan_varlen_ref
    from mambaserve.ops.triton.ssd import ssd_chunk_scan_varlen_triton

    lim = (0.0, float("inf"))
    for nrows, seqlen in shapes:
        plan = Batch(prefills=[Row.standalone([1] * seqlen, 0, i, False, [0]) for i in range(nrows)],
                         decodes=[])
        meta = build_metadata(plan, chunk_size=L, conv_kernel=K, page_size=1 << 20,
                              scratch_page=0, device=DEV)
        T = meta.num_prefill_tokens
        g = torch.Generator(device=DEV).manual_seed(1)
        xbc = torch.randn(T, CONV_DIM, device=DEV, dtype=DT, generator=g)
        x = xbc[:, :D_INNER].view(T, H, P)
        Bm = xbc[:, D_INNER: D_INNER + G * N].view(T, G, N)
        Cm = xbc[:, D_INNER + G * N:].view(T, G, N)
        dt = torch.randn(T, H, device=DEV, dtype=DT, generator=g) - 1
        A = -torch.rand(H, device=DEV, generator=g) * 2 - 0.05
        D = torch.randn(H, device=DEV, generator=g)
        dt_bias = torch.randn(H, device=DEV, generator=g) * 0.5
        ssm = torch.randn(nrows + 1, H, P, N, device=DEV, generator=g)
        args = (meta.prefill.state_slots.to(torch.int32), meta.prefill.has_initial_state,
                meta.prefill.chunk_token_idx, meta.prefill.token_chunk_pos, meta.prefill.row_chunks, meta.prefill.row_num_chunks)
        nc = meta.prefill.num_chunks
        flops = nc * H * (2 * L * L * N + 2 * L * L * P + 4 * L * N * P)
        s1 = ssm.clone()
        yr, er = ssd_chunk_scan_varlen_ref(x, dt, A, Bm, Cm, D, dt_bias, lim, s1, *args)
        variants = [("triton", {})]
        if sweep:
            variants += [(f"state bp{bp} bn{bn} w{nw}",
                          {"block_p_state": bp, "block_n_state": bn, "num_warps_state": nw})
                         for bp, bn, nw in ((64, 128, 8), (128, 128, 8), (128, 64, 4))]
            variants += [(f"scan m{bm} bp{bp} k{bk} w{nw} s{ns}",
                          {"block_m_scan": bm, "block_p_scan": bp, "block_k_scan": bk,
                           "num_warps_scan": nw, "num_stages_scan": ns})
                         for bm, bp, bk, nw, ns in ((64, 128, 32, 4, 3), (64, 128, 64, 4, 2),
                                                    (32, 128, 32, 4, 2), (64, 128, 32, 8, 2),
                                                    (128, 128, 32, 4, 2), (64, 128, 16, 4, 3),
                                                    (32, 128, 32, 2, 2), (64, 128, 32, 4, 1))]
            variants += [("dt + state", {"_stop_after": "state"}),
                         ("dt + state + CB", {"_stop_after": "cb"})]
        for name, kw in variants:
            try:
                s2 = ssm.clone()
                yt, et = ssd_chunk_scan_varlen_triton(x, dt, A, Bm, Cm, D, dt_bias, lim, s2, *args,
                                                      **kw)
                err = (max(rel(yt, yr), rel(et, er), rel(s2, s1)) if "_stop_after" not in kw
                       else float("nan"))
                nan = bool(torch.isnan(yt).any() or torch.isnan(et).any())
                ms = bench(lambda: ssd_chunk_scan_varlen_triton(x, dt, A, Bm, Cm, D, dt_bias, lim,
                                                                s2, *args, **kw))
                row(op="ssd_scan", impl=name, shape=f"{nrows}x{seqlen}", us=ms * 1e3,
                    TFLOPs=flops / ms / 1e9, rel_err=err, nan=nan)
            except Exception as e:  # noqa: BLE001
                print(f"ssd {name} {nrows}x{seqlen} failed: {type(e).__name__}: {e}", flush=True)
        ms = bench(lambda: ssd_chunk_scan_varlen_ref(x, dt, A, Bm, Cm, D, dt_bias, lim, s1, *args),
                   rep=30)
        row(op="ssd_scan", impl="torch ref", shape=f"{nrows}x{seqlen}", us=ms * 1e3,
            TFLOPs=flops / ms / 1e9)
        if peer is not None:
            xb = x.reshape(nrows, seqlen, H, P)
            dtb = dt.reshape(nrows, seqlen, H)
            Bb = Bm.reshape(nrows, seqlen, G, N)
            Cb = Cm.reshape(nrows, seqlen, G, N)
            fn = lambda: peer["scan"](xb, dtb, A, Bb, Cb, L, D=D, dt_bias=dt_bias,
                                      dt_softplus=True, return_final_states=True)
            yp, _ = fn()  # autotune outside the timing
            ms = bench(fn)
            row(op="ssd_scan", impl="mamba_ssm", shape=f"{nrows}x{seqlen}", us=ms * 1e3,
                TFLOPs=flops / ms / 1e9, rel_err=rel(yp.reshape(T, H, P), yr))


# (block_t, block_d, num_warps, lookahead) of the conv prefill kernel, timed with --sweep
# (default 16, 512, 4, 4)
CONV_SWEEP = [(16, 512, 4, 0), (16, 512, 4, 2), (8, 512, 4, 4), (32, 512, 4, 4), (16, 256, 2, 4),
              (16, 1024, 8, 4)]


def conv_prefill(shapes, sweep=False, conv_peer=None):
    from mambaserve.engine.batch import Batch, Row
    from mambaserve.metadata import build_metadata
    from mambaserve.ops.conv1d import causal_conv1d_varlen_ref
    from mambaserve.ops.triton.conv1d_varlen import causal_conv1d_varlen_triton

    for nrows, seqlen in shapes:
        plan = Batch(prefills=[Row.standalone([1] * seqlen, 5, i, True, [0]) for i in range(nrows)],
                         decodes=[])
        meta = build_metadata(plan, chunk_size=L, conv_kernel=K, page_size=1 << 20,
                              scratch_page=0, device=DEV)
        T = meta.num_prefill_tokens
        # x: the xBC columns of the in_proj output [z | xBC | dt], a strided view as in the mixer
        zxbcdt = torch.randn(T, D_INNER + CONV_DIM + H, device=DEV, dtype=DT)
        x = zxbcdt[:, D_INNER: D_INNER + CONV_DIM]
        w = torch.randn(CONV_DIM, K, device=DEV, dtype=DT) * 0.5
        b = torch.randn(CONV_DIM, device=DEV, dtype=DT)
        st = torch.randn(nrows + 1, K - 1, CONV_DIM, device=DEV, dtype=DT)
        args = (meta.prefill.state_slots.to(torch.int32), meta.prefill.has_initial_state,
                meta.prefill.conv_window_idx, meta.prefill.conv_state_idx)
        s1 = st.clone()
        out_ref = causal_conv1d_varlen_ref(x, w, b, s1, *args)
        nbytes = 2 * T * CONV_DIM * 2
        shape = f"{nrows}x{seqlen}"
        variants = [("triton", x, {})]
        if sweep:
            variants += [("triton contiguous x", x.contiguous(), {})]
            variants += [(f"triton bt{bt} bd{bd} w{nw} la{la}", x,
                          {"block_t": bt, "block_d": bd, "num_warps": nw, "lookahead": la})
                         for bt, bd, nw, la in CONV_SWEEP]
            variants += [("triton runtime loop bt8 bd256", x,
                          {"block_t": 8, "block_d": 256, "unroll": False})]
        for name, xv, kw in variants:
            try:
                s2 = st.clone()
                err = max(rel(causal_conv1d_varlen_triton(xv, w, b, s2, *args, **kw), out_ref),
                          rel(s2[:-1], s1[:-1]))
                ms = bench(lambda: causal_conv1d_varlen_triton(xv, w, b, s2, *args, **kw))
                row(op="conv_varlen", impl=name, shape=shape, us=ms * 1e3,
                    TBps=nbytes / ms / 1e9, rel_err=err)
            except Exception as e:  # noqa: BLE001
                print(f"conv {name} {shape} failed: {type(e).__name__}: {e}", flush=True)
        ms = bench(lambda: causal_conv1d_varlen_ref(x, w, b, s1, *args))
        row(op="conv_varlen", impl="torch ref", shape=shape, us=ms * 1e3, TBps=nbytes / ms / 1e9)
        if conv_peer is not None:
            try:
                conv_prefill_peer(conv_peer, plan, meta, x, w, b, st, out_ref, s1, nbytes, shape)
            except Exception as e:  # noqa: BLE001
                note = " (its prefill kernel does not run under the interpreter)" if DRY else ""
                print(f"vllm conv prefill {shape} failed{note}: {type(e).__name__}: {e}",
                      flush=True)


def conv_prefill_peer(conv_peer, plan, meta, x, w, b, st, out_ref, s_ref, nbytes, shape):
    """vLLM's causal_conv1d_fn on the same inputs, in its layouts (built outside the timing):
    x as [dim, tokens] (the transposed view of our strided x: channels contiguous, as it wants),
    state [slot, dim, K-1] (a transposed view of a copy of ours), query_start_loc int32, the
    per-program tables precomputed (`metadata`)."""
    seqlens = [r.num_tokens for r in plan.prefills]
    qsl = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0).tolist()), dtype=torch.int32,
                       device=DEV)
    slots = meta.prefill.state_slots.to(torch.int32)
    init = meta.prefill.has_initial_state
    pmeta = conv_peer_metadata(seqlens, DEV)
    xp = x.t()
    sp = st.clone()
    spv = sp.transpose(1, 2)

    def call():
        return conv_peer.fn(xp, w, b, spv, qsl, cache_indices=slots, has_initial_state=init,
                            activation="silu", metadata=pmeta)

    outp = call().t()  # [tokens, dim]
    err = max(rel(outp, out_ref), rel(sp[:-1], s_ref[:-1]))
    if not err < 1e-2:
        print(f"vllm conv prefill {shape}: output differs from the reference (rel {err:.2e})",
              flush=True)
    ms = bench(call)
    row(op="conv_varlen", impl="vllm", shape=shape, us=ms * 1e3, TBps=nbytes / ms / 1e9,
        rel_err=err)


AH, AKV, AD, PAGE = 40, 8, 128, 16  # Nemotron-Nano-9B-v2 attention layer, engine page size


def attention_prefill(shapes, sweep=False):
    """Causal prefill attention over the paged KV pool (rows with no cache: keys = the row's own
    tokens): the per-token kernel the dispatch uses, the tiled kernel, and torch's SDPA on dense
    [rows, heads, L, D] tensors (flash attention on the GPU) as the peer. TFLOP/s over the
    causal work, 4·H·D·L(L+1)/2 per row."""
    from mambaserve.engine.batch import Batch, Row
    from mambaserve.metadata import build_metadata
    from mambaserve.ops.paged_attention import paged_attention_ref, write_kv
    from mambaserve.ops.triton.paged_attention import paged_attention_triton

    ah, akv, ad, page = (AH, AKV, AD, PAGE) if not DRY else (4, 2, 16, 4)
    for nrows, seqlen in shapes:
        pages_per_row = -(-seqlen // page)
        plan = Batch(prefills=[Row.standalone([1] * seqlen, 0, i, False,
                                           list(range(i * pages_per_row, (i + 1) * pages_per_row)))
                                   for i in range(nrows)], decodes=[])
        meta = build_metadata(plan, chunk_size=L, conv_kernel=K, page_size=page,
                              scratch_page=nrows * pages_per_row, device=DEV)
        T = meta.num_tokens
        g = torch.Generator(device=DEV).manual_seed(2)
        q = torch.randn(T, ah, ad, device=DEV, dtype=DT, generator=g)
        k = torch.randn(T, akv, ad, device=DEV, dtype=DT, generator=g)
        v = torch.randn(T, akv, ad, device=DEV, dtype=DT, generator=g)
        kv = torch.zeros(2, nrows * pages_per_row + 1, page, akv, ad, device=DEV, dtype=DT)
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
        variants = [("triton", {}), ("triton tiled", {"tiled": True})]
        if sweep:
            variants += [("triton tiled m128", {"tiled": True, "block_m": 128}),
                         ("triton tiled n128", {"tiled": True, "block_n": 128}),
                         ("triton tiled 8w", {"tiled": True, "num_warps": 8})]
        for impl, kw in variants:
            out = paged_attention_triton(*args, **kw)
            err = rel(out, ref if ref is not None else base)
            ms = bench(lambda: paged_attention_triton(*args, **kw))
            row(op="attention_prefill", impl=impl, shape=shape, us=ms * 1e3,
                TFLOPs=flops / ms / 1e9, rel_err=err)
        ms = bench(sdpa)
        row(op="attention_prefill", impl="torch sdpa", shape=shape, us=ms * 1e3,
            TFLOPs=flops / ms / 1e9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--sweep", action="store_true", help="also time block-size variants")
    ap.add_argument("--only", default="decode,norm,conv,prefill,attention")
    ap.add_argument("--dry", action="store_true", help="tiny CPU smoke run (interpreter)")
    args = ap.parse_args()
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"
        set_dry()
    import triton
    RESULTS["env"] = {"gpu": torch.cuda.get_device_name() if not DRY else "cpu (dry run)",
                      "torch": torch.__version__,
                      "triton": triton.__version__, "cuda": torch.version.cuda}
    print(RESULTS["env"], flush=True)
    t0 = time.time()
    if not DRY:
        ceilings()
    only = args.only.split(",")
    peer = load_peer() if {"decode", "norm", "prefill"} & set(only) else None
    RESULTS["peer"] = peer is not None
    conv_peer = load_conv_peer() if {"decode", "conv"} & set(only) else None
    RESULTS["conv_peer"] = conv_peer is not None
    try:
        if "decode" in only:
            decode(peer, [1, 3] if DRY else [1, 8, 64, 256], args.sweep, conv_peer)
        if "norm" in only:
            norm(peer, [3] if DRY else [1, 256, 8192])
        if "conv" in only:
            conv_prefill([(2, 40), (5, 2)] if DRY else [(8, 512), (1, 8192)], args.sweep,
                         conv_peer)
        if "prefill" in only:
            prefill(peer, [(2, 40), (1, 50)] if DRY else [(8, 512), (4, 2048), (1, 8192)],
                    args.sweep)
        if "attention" in only:
            attention_prefill([(2, 40), (1, 50)] if DRY else [(8, 512), (8, 2048), (1, 8192)],
                              args.sweep)
    finally:
        RESULTS["wall_s"] = time.time() - t0
        add_peer_ratios()
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print_table()


PEER_IMPLS = ("mamba_ssm", "vllm")


def _size(r):
    return r.get("batch", r.get("tokens", r.get("shape")))


def add_peer_ratios():
    """`ours_over_peer` = our default kernel's time / the peer's, on our row of each op and size."""
    peers = {(r["op"], _size(r)): r["us"] for r in RESULTS["rows"] if r["impl"] in PEER_IMPLS}
    for r in RESULTS["rows"]:
        p = peers.get((r["op"], _size(r)))
        if r["impl"] == "triton" and p:
            r["ours_over_peer"] = r["us"] / p


def print_table():
    print("\n| op | impl | size | us | rate | rel_err | ours/peer |\n|---|---|---|---|---|---|---|")
    for r in RESULTS["rows"]:
        rate = f"{r['TBps']:.2f} TB/s" if "TBps" in r else f"{r['TFLOPs']:.1f} TFLOP/s"
        err = r.get("rel_err")
        ratio = r.get("ours_over_peer")
        print(f"| {r['op']} | {r['impl']} | {_size(r)} | {r['us']:.1f} | {rate} | "
              f"{'' if err is None else f'{err:.1e}'} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} |")


if __name__ == "__main__":
    main()
