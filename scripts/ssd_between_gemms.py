"""The SSD chunked scan at one Nemotron-Nano-9B-v2 Mamba-layer shape timed alone and between the
layer's GEMMs (in_proj, out_proj, the MLP's up and down), each pattern captured in a CUDA graph
and replayed under the torch profiler: the scan's launches per call in both settings, and the
SM clock and power the driver reports while each runs (GPU machine, repo root):

    python3 scripts/ssd_between_gemms.py 1x2048

The question it answers (docs/kernels.md, "SSD chunked scan"): the engine's profile times the
scan slower than `mambaserve bench kernels`, which runs it alone; under sustained GEMMs an H100
sits at its power cap with lower SM clocks, and the scan's launches that are bound by the SM's
issue rate slow down with them.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

H, N, G = 128, 128, 8  # the 9B's Mamba heads, state size, groups (as in ssd_once.py)
HIDDEN, MLP = 4480, 15680
REPS = 8  # patterns per graph


def _clocks(stop: threading.Event, out: list[tuple[int, float]]) -> None:
    """Poll nvidia-smi's SM clock (MHz) and power draw (W) until `stop` is set."""
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    while not stop.is_set():
        try:
            line = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout
            mhz, watts = line.strip().splitlines()[0].split(",")
            out.append((int(mhz), float(watts)))
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return
        time.sleep(0.02)


def _graph(fns, reps: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, cuBLAS workspaces) off the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    return g


def main(shape: str) -> None:
    from ssd_once import D_INNER, scan_inputs  # this folder's script: the same inputs
    from torch.profiler import ProfilerActivity, profile

    from mambaserve.ops.triton.ssd import SsdScan

    inputs = scan_inputs(shape)
    scan = SsdScan(*inputs)
    T = inputs[0].shape[0]
    gen = torch.Generator(device="cuda").manual_seed(2)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    a, y, u = rnd(T, HIDDEN, scale=0.1), rnd(T, D_INNER), rnd(T, MLP)
    w_in = rnd(2 * D_INNER + 2 * G * N + H, HIDDEN, scale=0.02)  # [z | xBC | dt]
    w_out, w_up, w_down = (rnd(HIDDEN, D_INNER, scale=0.02), rnd(MLP, HIDDEN, scale=0.02),
                           rnd(HIDDEN, MLP, scale=0.02))

    def gemms():
        F.linear(a, w_in)
        F.linear(y, w_out)
        F.linear(a, w_up)
        F.linear(u, w_down)

    for name, fns in (("alone", [scan.run]), ("between GEMMs", [gemms, scan.run])):
        g = _graph(fns, REPS)
        g.replay()
        torch.cuda.synchronize()
        stop, samples = threading.Event(), []
        poll = threading.Thread(target=_clocks, args=(stop, samples), daemon=True)
        poll.start()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
        stop.set()
        poll.join()
        per_kernel: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type.name == "CUDA" and ev.name.startswith("_chunk"):
                per_kernel.setdefault(ev.name, []).append(ev.device_time)
        total = sum(sum(v) / len(v) for v in per_kernel.values())
        launches = ", ".join(f"{k} {sum(v) / len(v):.1f}" for k, v in sorted(per_kernel.items()))
        clock = (f"SM clock {min(m for m, _ in samples)}-{max(m for m, _ in samples)} MHz, "
                 f"power up to {max(w for _, w in samples):.0f} W" if samples else "no clocks")
        print(f"{shape} scan {name}: {total:.1f} µs per call ({launches}); {clock}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "1x2048")
