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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

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


def decode(peer, batches, sweep):
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
    from mambaserve.metadata import BatchPlan, RowPlan, build_metadata
    from mambaserve.ops.ssd import ssd_chunk_scan_varlen_ref
    from mambaserve.ops.triton.ssd import ssd_chunk_scan_varlen_triton

    lim = (0.0, float("inf"))
    for nrows, seqlen in shapes:
        plan = BatchPlan(prefills=[RowPlan([1] * seqlen, 0, i, False, [0]) for i in range(nrows)],
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
        args = (meta.prefill_state_slots.to(torch.int32), meta.has_initial_state,
                meta.chunk_token_idx, meta.token_chunk_pos, meta.row_chunks, meta.row_num_chunks)
        nc = meta.num_chunks
        flops = nc * H * (2 * L * L * N + 2 * L * L * P + 4 * L * N * P)
        s1 = ssm.clone()
        yr, er = ssd_chunk_scan_varlen_ref(x, dt, A, Bm, Cm, D, dt_bias, lim, s1, *args)
        variants = [("triton", {})]
        if sweep and nrows < 8:
            variants += [(f"triton scan bp{bp} w{nw}", {"block_p_scan": bp, "num_warps_scan": nw})
                         for bp, nw in ((64, 4), (128, 8), (32, 2))]
            variants += [(f"triton state bp{bp}", {"block_p_state": bp}) for bp in (16, 64)]
            variants += [("A only (chunk state)", {"_stop_after": "state"}),
                         ("A+B (+state passing)", {"_stop_after": "passing"})]
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


def conv_prefill(shapes):
    from mambaserve.metadata import BatchPlan, RowPlan, build_metadata
    from mambaserve.ops.conv1d import causal_conv1d_varlen_ref
    from mambaserve.ops.triton.conv1d_varlen import causal_conv1d_varlen_triton

    for nrows, seqlen in shapes:
        plan = BatchPlan(prefills=[RowPlan([1] * seqlen, 5, i, True, [0]) for i in range(nrows)],
                         decodes=[])
        meta = build_metadata(plan, chunk_size=L, conv_kernel=K, page_size=1 << 20,
                              scratch_page=0, device=DEV)
        T = meta.num_prefill_tokens
        x = torch.randn(T, CONV_DIM, device=DEV, dtype=DT)
        w = torch.randn(CONV_DIM, K, device=DEV, dtype=DT) * 0.5
        b = torch.randn(CONV_DIM, device=DEV, dtype=DT)
        st = torch.randn(nrows + 1, K - 1, CONV_DIM, device=DEV, dtype=DT)
        args = (meta.prefill_state_slots.to(torch.int32), meta.has_initial_state,
                meta.conv_window_idx, meta.conv_state_idx)
        s1, s2 = st.clone(), st.clone()
        err = rel(causal_conv1d_varlen_triton(x, w, b, s2, *args),
                  causal_conv1d_varlen_ref(x, w, b, s1, *args))
        nbytes = 2 * T * CONV_DIM * 2
        ms = bench(lambda: causal_conv1d_varlen_triton(x, w, b, s2, *args))
        row(op="conv_varlen", impl="triton", shape=f"{nrows}x{seqlen}", us=ms * 1e3,
            TBps=nbytes / ms / 1e9, rel_err=err)
        ms = bench(lambda: causal_conv1d_varlen_ref(x, w, b, s1, *args))
        row(op="conv_varlen", impl="torch ref", shape=f"{nrows}x{seqlen}", us=ms * 1e3,
            TBps=nbytes / ms / 1e9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--sweep", action="store_true", help="also time block-size variants")
    ap.add_argument("--only", default="decode,norm,conv,prefill")
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
    peer = load_peer()
    RESULTS["peer"] = peer is not None
    only = args.only.split(",")
    try:
        if "decode" in only:
            decode(peer, [1, 3] if DRY else [1, 8, 64, 256], args.sweep)
        if "norm" in only:
            norm(peer, [3] if DRY else [1, 256, 8192])
        if "conv" in only:
            conv_prefill([(2, 40)] if DRY else [(8, 512), (1, 8192)])
        if "prefill" in only:
            prefill(peer, [(2, 40), (1, 50)] if DRY else [(8, 512), (4, 2048), (1, 8192)],
                    args.sweep)
    finally:
        RESULTS["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print_table()


def print_table():
    print("\n| op | impl | size | us | rate | rel_err |\n|---|---|---|---|---|---|")
    for r in RESULTS["rows"]:
        size = r.get("batch", r.get("tokens", r.get("shape")))
        rate = f"{r['TBps']:.2f} TB/s" if "TBps" in r else f"{r['TFLOPs']:.1f} TFLOP/s"
        err = r.get("rel_err")
        print(f"| {r['op']} | {r['impl']} | {size} | {r['us']:.1f} | {rate} | "
              f"{'' if err is None else f'{err:.1e}'} |")


if __name__ == "__main__":
    main()
