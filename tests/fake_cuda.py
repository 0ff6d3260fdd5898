"""A stand-in for CUDA graph capture on a CPU: `install_fake_cuda(monkeypatch, runner)` replaces
torch.cuda's graph, stream and memory calls, and the runner's `_forward`, so that `capture()`
records each bucket's forward (and a prefill graph runner's heads) and a replay re-runs it on the
same static buffers and captured metadata (a real graph's semantics). Returns the list the
captured bucket keys (heads as ("head", key)) go to, in capture order. The decode and the
prefill / mixed-step graph tests share it."""

from __future__ import annotations

import contextlib

import torch


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: replay re-runs what was recorded during capture."""

    capturing = None

    def __init__(self):
        self.recorded, self.replays = None, 0

    def replay(self):
        self.replays += 1
        self.recorded()


class _FakeStream:
    def wait_stream(self, other):
        pass


@contextlib.contextmanager
def _fake_graph(g, pool=None):
    FakeGraph.capturing = g
    yield
    FakeGraph.capturing = None


def install_fake_cuda(monkeypatch, runner) -> list:
    order = []

    def recording(method, label):
        def run(key):
            g = FakeGraph.capturing
            if g is not None:
                order.append(key if label is None else (label, key))
                g.recorded = lambda: method(key)
            else:
                method(key)
        return run

    for name, value in {"graph_pool_handle": lambda: None,
                        "Stream": lambda d=None: _FakeStream(),
                        "synchronize": lambda d=None: None,
                        "current_stream": lambda d=None: _FakeStream(),
                        "stream": lambda s: contextlib.nullcontext(), "CUDAGraph": FakeGraph,
                        "graph": _fake_graph, "mem_get_info": lambda d=None: (1 << 30, 1 << 31),
                        }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(runner, "_forward", recording(runner._forward, None))
    if hasattr(runner, "_head_forward"):  # a prefill graph runner's heads: ("head", key)
        monkeypatch.setattr(runner, "_head_forward", recording(runner._head_forward, "head"))
    return order
