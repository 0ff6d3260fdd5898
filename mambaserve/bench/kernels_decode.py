# ruff: noqa: B023  (every timed closure runs before its loop variables move on)
"""The decode-step cases of `mambaserve bench kernels`: the selective state update and the conv
update (batch = rows on random distinct slots of a 512-slot pool), and the gated RMSNorm.

Rates are TB/s over the bytes each kernel must move: fp32 SSM state read + written, x/B/C/dt
read, y written (state update); conv state read + written, x read, out written (conv update);
y and z read, out written (norm). Each case first checks our kernel against the reference on
the timed inputs (`rel_err`, relative-norm error).
"""

from __future__ import annotations

import torch

from mambaserve.bench.kernels_harness import Harness, rel
from mambaserve.ops.triton import tuning

# (block_p, num_warps) of the state update, timed at batch 256 with --sweep
SSU_SWEEP = [(8, 2), (32, 2)]


def decode(h: Harness, batches: list[int], sweep: bool, peer: dict | None, conv_peer) -> None:
    from mambaserve.ops.conv1d import causal_conv1d_update_ref
    from mambaserve.ops.selective_state_update import selective_state_update_ref
    from mambaserve.ops.triton.conv1d_update import causal_conv1d_update_triton
    from mambaserve.ops.triton.selective_state_update import selective_state_update_triton

    s, dev, dt_ = h.shapes, h.device, h.dtype
    H, P, N, G, K, D_IN, CD = s.H, s.P, s.N, s.G, s.K, s.d_inner, s.conv_dim
    num_slots = 8 if h.dry else 512
    g = torch.Generator(device=dev).manual_seed(0)
    ssm = torch.randn(num_slots + 1, H, P, N, device=dev, generator=g)
    conv = torch.randn(num_slots + 1, K - 1, CD, device=dev, dtype=dt_, generator=g)
    A = -torch.rand(H, device=dev, generator=g) * 4 - 0.1
    D = torch.randn(H, device=dev, generator=g)
    dt_bias = torch.randn(H, device=dev, generator=g) * 0.5
    w = torch.randn(CD, K, device=dev, dtype=dt_, generator=g) * 0.5
    cb = torch.randn(CD, device=dev, dtype=dt_, generator=g)
    lim = (0.0, float("inf"))
    for Bt in batches:
        xbc = torch.randn(Bt, CD, device=dev, dtype=dt_, generator=g)
        x = xbc[:, :D_IN].view(Bt, H, P)
        Bm = xbc[:, D_IN: D_IN + G * N].view(Bt, G, N)
        Cm = xbc[:, D_IN + G * N:].view(Bt, G, N)
        dt = torch.randn(Bt, H, device=dev, dtype=dt_, generator=g)
        # each timed call takes the next of these slot sets, so no call finds its state in L2
        slot_sets = [torch.randperm(num_slots, device=dev, generator=g)[:Bt].to(torch.int32)
                     for _ in range(4 if h.dry else 64)]
        it = [0]

        def nxt():
            it[0] = (it[0] + 1) % len(slot_sets)
            return slot_sets[it[0]]

        nbytes = Bt * H * P * N * 4 * 2 + Bt * (D_IN + 2 * G * N + H) * 2 + Bt * D_IN * 2
        s1, s2 = ssm.clone(), ssm.clone()
        sl = slot_sets[0]
        yr = selective_state_update_ref(s1, x, dt, A, Bm, Cm, D, dt_bias, lim, sl)
        yt = selective_state_update_triton(s2, x, dt, A, Bm, Cm, D, dt_bias, lim, sl)
        err = max(rel(yt, yr), rel(s2[sl.long()], s1[sl.long()]))
        del s1, s2
        variants = [("triton", {})]
        if sweep and Bt == 256:
            variants += [(f"triton bp{bp} w{nw}", {"block_p": bp, "num_warps": nw})
                         for bp, nw in SSU_SWEEP]
        for name, knobs in variants:
            with tuning.override("selective_state_update", **knobs):
                ms = h.time_ms(lambda: selective_state_update_triton(
                    ssm, x, dt, A, Bm, Cm, D, dt_bias, lim, nxt()))
            h.row(op="ssu", impl=name, batch=Bt, us=ms * 1e3, TBps=nbytes / ms / 1e9,
                  rel_err=err if not knobs else float("nan"))
        ms = h.time_ms(lambda: selective_state_update_ref(ssm, x, dt, A, Bm, Cm, D, dt_bias, lim,
                                                          nxt()))
        h.row(op="ssu", impl="torch ref", batch=Bt, us=ms * 1e3, TBps=nbytes / ms / 1e9)
        if peer is not None:
            A3 = A[:, None, None].expand(H, P, N)
            dt3 = dt[:, :, None].expand(Bt, H, P)
            db2 = dt_bias[:, None].expand(H, P)
            D2 = D[:, None].expand(H, P)
            ms = h.time_ms(lambda: peer["ssu"](ssm, x, dt3, A3, Bm, Cm, D=D2, dt_bias=db2,
                                               dt_softplus=True, state_batch_indices=nxt()))
            h.row(op="ssu", impl="mamba_ssm", batch=Bt, us=ms * 1e3, TBps=nbytes / ms / 1e9)

        cbytes = Bt * ((K - 1) * CD * 2 * 2 + CD * 2 * 2)
        c1, c2 = conv.clone(), conv.clone()
        orf = causal_conv1d_update_ref(xbc, w, cb, c1, sl)
        ot = causal_conv1d_update_triton(xbc, w, cb, c2, sl)
        err = max(rel(ot, orf), rel(c2[sl.long()], c1[sl.long()]))
        del c1, c2
        ms = h.time_ms(lambda: causal_conv1d_update_triton(xbc, w, cb, conv, nxt()))
        h.row(op="conv_update", impl="triton", batch=Bt, us=ms * 1e3, TBps=cbytes / ms / 1e9,
              rel_err=err)
        ms = h.time_ms(lambda: causal_conv1d_update_ref(xbc, w, cb, conv, nxt()))
        h.row(op="conv_update", impl="torch ref", batch=Bt, us=ms * 1e3, TBps=cbytes / ms / 1e9)
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
                ms = h.time_ms(lambda: conv_peer.update(xbc, convp, w, cb, activation=True,
                                                        conv_state_indices=nxt()))
                h.row(op="conv_update", impl="vllm", batch=Bt, us=ms * 1e3,
                      TBps=cbytes / ms / 1e9, rel_err=err)
            except Exception as e:  # noqa: BLE001
                print(f"vllm conv update {Bt} failed: {type(e).__name__}: {e}", flush=True)


# gated RMSNorm warps per (token, group) program (the default: BLOCK // 256, 8 at the 9B's group
# of 1,280 padded to 2,048): fewer warps, more programs resident per SM
NORM_SWEEP = [2, 4, 16]


def norm(h: Harness, tokens: list[int], sweep: bool, peer: dict | None) -> None:
    """Gated RMSNorm over tokens x d_inner in groups of d_inner / G (z a strided view); with
    `sweep` also at each NORM_SWEEP warp count."""
    from mambaserve.ops.gated_rmsnorm import gated_rmsnorm_ref
    from mambaserve.ops.triton.gated_rmsnorm import gated_rmsnorm_triton

    dev, dt_, D_IN = h.device, h.dtype, h.shapes.d_inner
    gs = D_IN // h.shapes.G
    for T in tokens:
        y = torch.randn(T, D_IN, device=dev, dtype=dt_)
        z = torch.randn(T, 2 * D_IN, device=dev, dtype=dt_)[:, :D_IN]
        w = torch.randn(D_IN, device=dev, dtype=dt_)
        nbytes = 3 * T * D_IN * 2
        ref = gated_rmsnorm_ref(y, z, w, gs, 1e-5)
        for name, knobs in [("triton", {})] + ([(f"triton w{nw}", {"num_warps": nw})
                                                for nw in NORM_SWEEP] if sweep else []):
            with tuning.override("gated_rmsnorm", **knobs):
                err = rel(gated_rmsnorm_triton(y, z, w, gs, 1e-5), ref)
                ms = h.time_ms(lambda: gated_rmsnorm_triton(y, z, w, gs, 1e-5))
            h.row(op="gated_rmsnorm", impl=name, tokens=T, us=ms * 1e3,
                  TBps=nbytes / ms / 1e9, rel_err=err)
        ms = h.time_ms(lambda: gated_rmsnorm_ref(y, z, w, gs, 1e-5))
        h.row(op="gated_rmsnorm", impl="torch ref", tokens=T, us=ms * 1e3,
              TBps=nbytes / ms / 1e9)
        if peer is not None:
            zc = z.contiguous()  # the peer wants a contiguous z
            ms = h.time_ms(lambda: peer["norm"](y, w, None, z=zc, eps=1e-5, group_size=gs,
                                                norm_before_gate=False))
            h.row(op="gated_rmsnorm", impl="mamba_ssm", tokens=T, us=ms * 1e3,
                  TBps=nbytes / ms / 1e9)
