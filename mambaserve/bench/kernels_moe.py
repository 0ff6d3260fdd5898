# ruff: noqa: B023  (every timed closure runs before its loop variables move on)
"""The `moe` case of `mambaserve bench kernels`: the routed experts of one MoE layer at the
published shapes of NVIDIA-Nemotron-3-Nano-30B-A3B (128 relu² experts, top-6, hidden 2688,
expert 1856) and granite-4.0-h-small (72 SwiGLU experts, top-10, hidden 4096, expert 768), for
token counts from decode to prefill. Routing is uniform at random (k distinct experts per token).

Impls: our sparse Triton path ("triton"), the per-expert gather loop a user would write
("torch loop", one host sync per expert), and the dense reference the CPU runs ("dense ref",
every expert over every token; only up to 2048 tokens). Rates: TB/s over the bytes of the expert
weights the routing touches (their union) plus the activations in and out, for up to 64 tokens;
TFLOP/s over the routed (active) matrix work above that.

Also the router's last stage (logits to k experts and weights, `ops/moe_routing.py`): the
kernel ("triton") against the routers' torch math ("torch"), op "moe routing NAME" (TB/s over
the logits read and the ids and weights written: a launch-bound op, its time is what counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve.bench.kernels_harness import Harness, rel


@dataclass(frozen=True)
class MoeShape:
    name: str
    E: int
    k: int
    H: int
    I: int
    activation: str


SHAPES = [MoeShape("nemotron-3-nano-30b-a3b", 128, 6, 2688, 1856, "relu2"),
          MoeShape("granite-4.0-h-small", 72, 10, 4096, 768, "swiglu")]
DRY_SHAPES = [MoeShape("dry-relu2", 16, 4, 64, 32, "relu2"),
              MoeShape("dry-swiglu", 8, 2, 32, 48, "swiglu")]
# --sweep: launch-parameter variants of our kernel (tuning entry "moe_experts"), every size
SWEEP = [dict(block_n_in=64, block_n_out=64, num_warps_in=4, num_warps_out=4, num_stages_out=3,
              block_k_in=128, block_k_out=128, tma=False),  # the decode rules at every size
         dict(tma=False),  # the prefill tiles through pointer loads
         dict(block_m=128, block_n_in=128, block_n_out=256, num_warps_in=8, num_warps_out=8,
              num_stages_out=4, tma=True),  # the prefill rules at every size
         dict(num_stages_in=4, num_stages_out=3)]
DENSE_MAX_TOKENS = 2048
BANDWIDTH_MAX_TOKENS = 64


def routing(h: Harness, s: MoeShape, T: int, g: torch.Generator) -> None:
    """The router's last stage of shape s at T tokens: Granite's softmax over the top k from
    model-dtype logits, NemotronH's sigmoid scores + bias from float32 ones."""
    from mambaserve.ops.moe_routing import sigmoid_topk_ref, softmax_topk_ref
    from mambaserve.ops.triton.moe_routing import route_topk_triton

    if s.activation == "swiglu":
        logits = torch.randn(T, s.E, device=h.device, dtype=h.dtype, generator=g)
        impls = [("triton", lambda: route_topk_triton(logits, s.k, h.dtype)),
                 ("torch", lambda: softmax_topk_ref(logits, s.k, h.dtype))]
    else:
        logits = torch.randn(T, s.E, device=h.device, generator=g)
        bias = torch.randn(s.E, device=h.device, generator=g) * 0.1
        impls = [("triton", lambda: route_topk_triton(logits, s.k, torch.float32, bias=bias,
                                                      normalize=True, scale=2.5)),
                 ("torch", lambda: sigmoid_topk_ref(logits, bias, s.k, True, 2.5))]
    weight_dtype = h.dtype if s.activation == "swiglu" else torch.float32
    nbytes = (logits.numel() * logits.element_size()
              + T * s.k * (8 + torch.finfo(weight_dtype).bits // 8))
    for impl, fn in impls:
        ms = h.time_ms(fn, rep=30)
        h.row(op=f"moe routing {s.name}", impl=impl, tokens=T, us=ms * 1e3,
              TBps=nbytes / ms / 1e9)


def moe(h: Harness, token_counts: list[int], sweep: bool = False) -> None:
    from mambaserve.ops.moe_experts import moe_experts_loop, moe_experts_ref
    from mambaserve.ops.triton import tuning
    from mambaserve.ops.triton.moe_experts import moe_experts_triton

    dev, dt = h.device, h.dtype
    for s in (DRY_SHAPES if h.dry else SHAPES):
        g = torch.Generator(device=dev).manual_seed(0)
        in_rows = 2 * s.I if s.activation == "swiglu" else s.I
        w_in = torch.randn(s.E, in_rows, s.H, device=dev, dtype=dt, generator=g) / s.H ** 0.5
        w_out = torch.randn(s.E, s.H, s.I, device=dev, dtype=dt, generator=g) / s.I ** 0.5
        # NemotronH's router gives float32 weights, Granite's model-dtype ones
        wdt = torch.float32 if s.activation == "relu2" else dt
        expert_bytes = (in_rows + s.I) * s.H * w_in.element_size()
        for T in token_counts:
            routing(h, s, T, g)
            x = torch.randn(T, s.H, device=dev, dtype=dt, generator=g)
            ids = torch.rand(T, s.E, device=dev, generator=g).argsort(dim=1)[:, : s.k]
            w = torch.rand(T, s.k, device=dev, generator=g).softmax(-1).to(wdt)
            args = (x, w_in, w_out, ids, w, s.activation)
            ref = moe_experts_loop(*args)
            err = rel(moe_experts_triton(*args), ref)
            touched = int(torch.unique(ids).numel())
            nbytes = touched * expert_bytes + T * s.H * (x.element_size() + 4)
            flops = 2.0 * T * s.k * (in_rows + s.I) * s.H
            impls = [("triton", lambda: moe_experts_triton(*args), err),
                     ("torch loop", lambda: moe_experts_loop(*args), None)]
            if T <= DENSE_MAX_TOKENS:
                impls.append(("dense ref", lambda: moe_experts_ref(*args), None))
            for knobs in SWEEP if sweep else []:
                def variant(knobs=knobs):
                    with tuning.override("moe_experts", **knobs):
                        return moe_experts_triton(*args)
                name = "triton " + ",".join(f"{k}={v}" for k, v in knobs.items())
                impls.append((name, variant, rel(variant(), ref)))
            for impl, fn, e in impls:
                ms = h.time_ms(fn, rep=30)
                rate = ({"TBps": nbytes / ms / 1e9} if T <= BANDWIDTH_MAX_TOKENS
                        else {"TFLOPs": flops / ms / 1e9})
                h.row(op=f"moe {s.name}", impl=impl, tokens=T, us=ms * 1e3, **rate,
                      experts_touched=touched, **({} if e is None else {"rel_err": e}))
