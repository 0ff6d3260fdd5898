"""Run one function on N local processes joined in a gloo (CPU) or NCCL process group, each
bounded by a deadline: a rank that hangs or dies makes `run_on_ranks` raise within `timeout_s`
instead of waiting forever. Used by the tests (the engine starts its ranks with launcher.py)."""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from mambaserve.distributed.group import destroy_tp, init_tp


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_method: str,
               backend: str, timeout_s: float, args: tuple, results: Any) -> None:
    try:
        group = init_tp(rank, world_size, init_method, backend, timeout_s)
        out = fn(group, *args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_tp()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                 timeout_s: float = 60.0) -> list[Any]:
    """`fn(group: TPGroup, *args)` on `world_size` spawned processes; their return values in
    rank order. `fn` must be importable by name (module level). Raises RuntimeError with the
    rank's traceback when one fails, TimeoutError when they do not all finish in `timeout_s`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, init_method, backend, timeout_s, args,
                                   results)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        outs: dict[int, Any] = {}
        try:
            while len(outs) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(outs))} did "
                                       f"not finish within {timeout_s:.0f} s")
                try:
                    rank, ok, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in outs and p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"rank {dead[0]} exited with code "
                                           f"{procs[dead[0]].exitcode} without a result")
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                outs[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outs[r] for r in range(world_size)]
