"""Rank 0 -> every other rank, once per step: what to run next (a step's `ForwardInput`, a
control call, or stop), over a gloo process group of CPU tensors (also under NCCL: the step's
host arrays never touch a GPU on the way).

Wire format: every message starts with one broadcast of a fixed `FIRST_BYTES` uint8 buffer: a
16-byte header (op, payload length, both int64) and the payload's first bytes; a payload longer
than that follows in a second broadcast of exactly the rest (the receivers know its length from
the header). The payload is the message pickled (protocol 5; numpy arrays pickle as raw bytes).
A decode step's message (a few hundred bytes to a few KiB) is therefore ONE collective, a large
prefill's two. Measured on the 2-core CPU box (gloo over loopback, 2 ranks, 300 messages each,
`python -m mambaserve.distributed.step_broadcast`): this format, `broadcast_object_list` (a
size broadcast, then the payload: always two collectives) and a header-then-payload pair of
broadcasts; the numbers are in docs/tensor_parallel.md.

The receivers wait in `recv` for as long as rank 0 takes to send the next message (an idle
server sends nothing), so this group is made with a long timeout; a rank that dies closes its
sockets, and the peers' pending collective fails at once instead of waiting.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FIRST_BYTES = 16 << 10  # the first broadcast of every message
_HEADER = 16

STEP, CALL, STOP = 1, 2, 3  # ops: run a ForwardInput; run a named control call; leave the loop


class StepChannel:
    """The sending end (rank 0) and receiving end (others) of the per-step broadcast."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int,
                 first_bytes: int = FIRST_BYTES) -> None:
        if first_bytes <= _HEADER:
            raise ValueError(f"first_bytes must exceed the {_HEADER}-byte header")
        self.group, self.rank, self.first_bytes = group, rank, first_bytes
        self._first = torch.zeros(first_bytes, dtype=torch.uint8)
        self.messages = self.bytes_sent = 0

    def send(self, op: int, payload: Any = None) -> None:
        """Rank 0: broadcast one message."""
        assert self.rank == 0, "only rank 0 sends steps"
        data = pickle.dumps(payload, protocol=5)
        head = self.first_bytes - _HEADER
        first = np.zeros(self.first_bytes, dtype=np.uint8)
        first[:_HEADER].view(np.int64)[:] = (op, len(data))
        first[_HEADER: _HEADER + min(head, len(data))] = np.frombuffer(data[:head], np.uint8)
        dist.broadcast(torch.from_numpy(first), 0, group=self.group)
        if len(data) > head:
            rest = np.frombuffer(data, np.uint8, offset=head).copy()  # writable for torch
            dist.broadcast(torch.from_numpy(rest), 0, group=self.group)
        self.messages += 1
        self.bytes_sent += len(data)

    def recv(self) -> tuple[int, Any]:
        """Ranks > 0: wait for rank 0's next message; (op, payload)."""
        first = self._first
        dist.broadcast(first, 0, group=self.group)
        raw = first.numpy()
        op, size = (int(v) for v in raw[:_HEADER].view(np.int64))
        head = self.first_bytes - _HEADER
        data = raw[_HEADER: _HEADER + min(head, size)].tobytes()
        if size > head:
            rest = torch.empty(size - head, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)
            data += rest.numpy().tobytes()
        return op, pickle.loads(data)


def _bench_rank(tp, sizes: list[int], n: int) -> dict:
    """Per-message seconds of three ways to broadcast a pickled payload (gloo, CPU)."""
    import time

    group = dist.new_group(backend="gloo")
    out = {}
    for size in sizes:
        payload = {"a": np.arange(size // 8, dtype=np.int64)}
        ways = _ways(StepChannel(group, tp.tp_rank), payload, tp.tp_rank, group)
        for name, fn in ways.items():
            for _ in range(10):
                fn()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            dist.barrier(group=group)
            out[(name, size)] = (time.perf_counter() - t0) / n
    return out


def _ways(ch: StepChannel, payload: Any, rank: int, group) -> dict:
    return {
        "first-chunk (this module)": lambda: ch.send(STEP, payload) if rank == 0 else ch.recv(),
        "broadcast_object_list": lambda: dist.broadcast_object_list(
            [payload if rank == 0 else None], 0, group=group),
        "header + payload": lambda: _two_broadcasts(payload, rank, group),
    }


def _two_broadcasts(payload: Any, rank: int, group) -> Any:
    if rank == 0:
        data = np.frombuffer(pickle.dumps(payload, protocol=5), np.uint8).copy()
        dist.broadcast(torch.tensor([data.size], dtype=torch.int64), 0, group=group)
        dist.broadcast(torch.from_numpy(data), 0, group=group)
        return payload
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    buf = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=group)
    return pickle.loads(buf.numpy().tobytes())


if __name__ == "__main__":
    from mambaserve.distributed.spawn import run_on_ranks

    res = run_on_ranks(_bench_rank, 2, [1 << 10, 8 << 10, 64 << 10, 512 << 10], 300,
                       timeout_s=300)[0]
    for (name, size), sec in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{size >> 10:>5} KiB  {name:<28} {sec * 1e6:8.1f} us/message")
