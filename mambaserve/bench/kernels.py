"""`mambaserve bench kernels`: the Triton kernels against their torch references and, when
present, the peer kernels (mamba_ssm's, vLLM's conv), at the Nemotron-Nano-9B-v2 layer shapes on
a CUDA GPU. docs/kernels.md has the measured numbers and how they were taken.

    PYTHONPATH=.peer/mamba_ssm-2.3.2.post1 mambaserve bench kernels --out kernels.json
    mambaserve bench kernels --only prefill --sweep   # launch-parameter variants too
    mambaserve bench kernels --dry                    # tiny CPU smoke run (Triton interpreter)

Cases (`--only`, comma-separated): decode (state update, conv update), norm (gated RMSNorm),
conv (varlen prefill conv), prefill (SSD chunked scan), attention (prefill attention), moe (the
sparse routed experts against a per-expert torch loop and the dense reference, at the MoE
presets' layer shapes: bench/kernels_moe.py). Each row
gives µs, a rate (TB/s over the bytes the kernel must move, or TFLOP/s over its matrix work),
the relative-norm error against the reference on the same inputs, and on our default kernel's
row `ours_over_peer` (our time / the peer's, < 1: ours faster). The JSON also holds the copy and
matmul ceilings measured in the same run and the software versions.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mambaserve.bench.kernels_harness import Harness

CASES = ("decode", "norm", "conv", "prefill", "attention", "moe")
PEER_IMPLS = ("mamba_ssm", "vllm")
# sizes per case: the real run's, the dry run's
SIZES = {
    "decode": ([1, 8, 64, 256], [1, 3]),
    "norm": ([1, 256, 2048, 8192], [3]),
    "conv": ([(8, 512), (1, 2048), (1, 8192)], [(2, 40), (5, 2)]),
    "prefill": ([(8, 512), (4, 2048), (1, 512), (1, 2048), (1, 8192)], [(2, 40), (1, 50)]),
    "attention": ([(8, 512), (8, 2048), (1, 8192)], [(2, 40), (1, 50)]),
    "moe": ([1, 8, 64, 512, 2048, 16384], [1, 20]),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=",".join(CASES),
                   help=f"comma-separated cases out of {', '.join(CASES)} (default: all)")
    p.add_argument("--sweep", action="store_true",
                   help="also time launch-parameter variants (and the SSD scan's launches)")
    p.add_argument("--out", default="kernels.json", help="results JSON (default: %(default)s)")
    p.add_argument("--dry", action="store_true",
                   help="tiny shapes on the CPU under the Triton interpreter: a smoke test")
    p.add_argument("--conv-peer", default=None, metavar="FILE",
                   help="vLLM's causal_conv1d.py (default: .peer/vllm_conv/ in the repo)")


def _use_interpreter() -> None:
    """Switch the Triton interpreter on; it must be on before the kernels are defined."""
    os.environ["TRITON_INTERPRET"] = "1"
    from mambaserve.ops.triton.activation import _relu2_kernel

    if type(_relu2_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("--dry: Triton was set up before TRITON_INTERPRET=1 could take effect")


def run(only: list[str], sweep: bool, out: str, dry: bool, conv_peer_file: str | None) -> dict:
    """Run the cases, write the JSON, print the table; returns the results."""
    from mambaserve.bench import kernels_decode, kernels_moe, kernels_peers, kernels_prefill

    unknown = sorted(set(only) - set(CASES))
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
    if dry:
        _use_interpreter()
    elif not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU (or --dry for the CPU smoke run)")
    import triton

    h = Harness(dry)
    res = h.results
    res["env"] = {"gpu": torch.cuda.get_device_name() if not dry else "cpu (dry run)",
                  "torch": torch.__version__, "triton": triton.__version__,
                  "cuda": torch.version.cuda}
    print(res["env"], flush=True)
    t0 = time.time()
    if not dry:
        h.ceilings()
    peer = kernels_peers.load_mamba_ssm() if {"decode", "norm", "prefill"} & set(only) else None
    res["peer"] = peer is not None
    conv_peer = None
    if {"decode", "conv"} & set(only):
        conv_peer = kernels_peers.load_vllm_conv(conv_peer_file or kernels_peers.CONV_PEER_FILE)
    res["conv_peer"] = conv_peer is not None

    def sizes(case):
        return SIZES[case][1 if dry else 0]

    try:
        if "decode" in only:
            kernels_decode.decode(h, sizes("decode"), sweep, peer, conv_peer)
        if "norm" in only:
            kernels_decode.norm(h, sizes("norm"), sweep, peer)
        if "conv" in only:
            kernels_prefill.conv_prefill(h, sizes("conv"), sweep, conv_peer)
        if "prefill" in only:
            kernels_prefill.ssd_prefill(h, sizes("prefill"), sweep, peer)
        if "attention" in only:
            kernels_prefill.attention_prefill(h, sizes("attention"), sweep)
        if "moe" in only:
            kernels_moe.moe(h, sizes("moe"), sweep)
    finally:
        res["wall_s"] = time.time() - t0
        add_peer_ratios(res["rows"])
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    print_table(res["rows"])
    return res


def _size(r: dict):
    return r.get("batch", r.get("tokens", r.get("shape")))


def add_peer_ratios(rows: list[dict]) -> None:
    """`ours_over_peer` = our default kernel's time / the peer's, on our row of each op and
    size."""
    peers = {(r["op"], _size(r)): r["us"] for r in rows if r["impl"] in PEER_IMPLS}
    for r in rows:
        p = peers.get((r["op"], _size(r)))
        if r["impl"] == "triton" and p:
            r["ours_over_peer"] = r["us"] / p


def print_table(rows: list[dict]) -> None:
    """The rows as a markdown table; a row timed only from a CUDA graph (the SSD's "cold L2"
    row: `device_us`, no host-timed `us`) shows that time, marked "(graph)"."""
    print("\n| op | impl | size | us | rate | rel_err | ours/peer |\n|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['TBps']:.2f} TB/s" if "TBps" in r else f"{r['TFLOPs']:.1f} TFLOP/s"
        err = r.get("rel_err")
        ratio = r.get("ours_over_peer")
        us = f"{r['us']:.1f}" if "us" in r else f"{r['device_us']:.1f} (graph)"
        print(f"| {r['op']} | {r['impl']} | {_size(r)} | {us} | {rate} | "
              f"{'' if err is None else f'{err:.1e}'} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} |")


def run_cli(a: argparse.Namespace) -> int:
    """`mambaserve bench kernels`; a bad setting is a ValueError (one line from the CLI)."""
    only = [c.strip() for c in a.only.split(",") if c.strip()]
    run(only, a.sweep, a.out, a.dry, a.conv_peer)
    return 0
