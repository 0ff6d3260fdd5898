"""Device time of a small op as the engine pays it: the op captured `calls_per_graph` times in
one CUDA graph, the graph replayed, best of several rounds. Launch gaps between graph nodes are
included (as in a decode step); host launch overhead is not.

    graph_time_us(lambda: x @ w.t())                   # microseconds per call
    graph_time_us(fns=[lambda w=w: x @ w.t() for w in copies])  # one call of each, in turn

`fns`: several callables captured one after the other in each round of the graph (e.g. the
same product over distinct weight copies whose bytes together exceed the L2 cache, so each
call reads its weight from HBM as in a real step); the time is per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def graph_time_us(fn: Callable[[], object] | None = None, *,
                  fns: Sequence[Callable[[], object]] | None = None, calls_per_graph: int = 10,
                  iters: int = 20, rounds: int = 5) -> float:
    """Microseconds per call (CUDA only). Pass one `fn` (captured `calls_per_graph` times) or a
    list `fns` (each captured once per round, rounds repeated to at least `calls_per_graph`)."""
    if (fn is None) == (fns is None):
        raise TypeError("graph_time_us takes fn or fns")
    seq = [fn] * calls_per_graph if fns is None else list(fns) * max(
        1, -(-calls_per_graph // len(fns)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles, cuBLAS workspaces) off the capture
        for f in seq[: max(3, len(fns or ()))]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in seq:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (iters * len(seq)))
    return best
