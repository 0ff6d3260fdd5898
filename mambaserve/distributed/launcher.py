"""Rank 0's side of tensor parallelism: start the other ranks, talk to them, notice when one
dies, and stop them.

Local launch (the default): the process that builds the engine is rank 0; ranks 1..N-1 are
spawned (torch.multiprocessing, "spawn" context, daemon) and meet it at a file:// rendezvous in
a private temporary folder. Under torchrun (RANK and WORLD_SIZE set, MASTER_ADDR / MASTER_PORT
for the env:// rendezvous), nothing is spawned: every process runs the same command, the one of
RANK 0 becomes the engine, and building the engine on any other rank runs that rank's worker
loop (distributed/worker.py) until rank 0 stops it, then exits the process.

A worker that dies (an exception, or killed) is seen two ways: its exit code (checked before
every step is sent: a non-blocking waitpid per worker) and the failure of the collective rank 0
is in (gloo: its sockets closed; NCCL: the collective timeout). `failure()` then names the rank,
its exit code and, for an exception, its traceback (the error queue).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from mambaserve.config import EngineConfig
from mambaserve.distributed.context import (
    TPContext,
    backend_for,
    collective_timeout_s,
    rank_device,
)
from mambaserve.distributed.group import destroy_tp
from mambaserve.distributed.step_broadcast import CALL, STEP, STOP
from mambaserve.distributed.worker import Fault, worker_main

logger = logging.getLogger("mambaserve")


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died or a collective between the ranks failed."""


def torchrun_rank() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when launched by torchrun (or its env), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


class TPWorkers:
    """The other ranks of a tensor-parallel engine, seen from rank 0."""

    def __init__(self, ctx: TPContext, procs: list, errors: Any, tmpdir: str | None) -> None:
        self.ctx, self.procs, self.errors, self.tmpdir = ctx, procs, errors, tmpdir
        self.failed: str | None = None
        self.closed = False

    @property
    def tp(self):
        return self.ctx.tp

    @classmethod
    def start(cls, model_path: str | Path, config: EngineConfig,
              fault: Fault | None = None) -> tuple[TPWorkers, torch.device]:
        """Start ranks 1..N-1 and join them as rank 0; (the workers, rank 0's device). Under
        torchrun on a rank other than 0, run that rank's worker loop and exit the process."""
        n = config.tensor_parallel_size
        timeout = collective_timeout_s()
        if torch.distributed.is_initialized():
            raise RuntimeError("a torch.distributed process group is already initialized in this "
                               "process (another tensor-parallel engine?): close it first; one "
                               "tensor-parallel engine per process")
        run = torchrun_rank()
        if run is not None:
            rank, world, local = run
            if world != n:
                raise ValueError(f"WORLD_SIZE={world} (torchrun) differs from "
                                 f"tensor_parallel_size={n}")
            if rank != 0:
                worker_main(rank, world, "env://", str(model_path), config, local_rank=local)
                raise SystemExit(0)
            device = rank_device(config.device, local)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return cls(TPContext.join(0, n, "env://", backend_for(device), timeout), [], None,
                       None), device
        device = rank_device(config.device, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        spawn = mp.get_context("spawn")
        errors = spawn.Queue()
        tmpdir = tempfile.mkdtemp(prefix="mambaserve-tp-")
        init = "file://" + os.path.join(tmpdir, "rendezvous")
        threads = max(1, torch.get_num_threads() // n) if device.type == "cpu" else None
        procs = [spawn.Process(target=worker_main, name=f"mambaserve-tp-rank{r}", daemon=True,
                               args=(r, n, init, str(model_path), config, errors, fault, threads))
                 for r in range(1, n)]
        for p in procs:
            p.start()
        workers = cls(None, procs, errors, tmpdir)  # type: ignore[arg-type]
        try:
            workers.ctx = TPContext.join(0, n, init, backend_for(device), timeout)
        except BaseException as e:
            reason = workers.failure(wait_s=2.0)
            workers.close()
            if reason:
                raise TPWorkerError(reason) from e
            raise
        return workers, device

    # ---- talking to the workers ------------------------------------------------------------
    def send_step(self, fwd) -> None:
        """Broadcast a step's ForwardInput (the runner's `send_step`)."""
        self.check()
        self.ctx.channel.send(STEP, fwd)

    def call(self, name: str, own: Any, *args: Any) -> list[Any]:
        """Ask every worker `name(*args)` (worker.Follower.call_<name>); the answers in rank
        order, `own` (rank 0's) first."""
        self.check()
        self.ctx.channel.send(CALL, (name, args))
        return self.ctx.gather(own)

    # ---- failures --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise TPWorkerError if a worker has exited (or an earlier failure was seen)."""
        if self.failed is None:
            self.failed = self._dead()
        if self.failed is not None:
            raise TPWorkerError(self.failed)

    def failure(self, wait_s: float = 5.0) -> str | None:
        """After a collective failed: which worker died and why, waiting up to `wait_s` for its
        exit to show; None if every worker is alive."""
        deadline = time.monotonic() + wait_s
        while self.failed is None:
            self.failed = self._dead()
            if self.failed is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return self.failed

    def _dead(self) -> str | None:
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
        if not dead:
            return None
        rank, code = dead[0]
        tracebacks = {}
        while self.errors is not None:
            try:
                r, tb = self.errors.get(timeout=0.5)
            except (queue.Empty, OSError, EOFError):
                break
            tracebacks[r] = tb
        text = f"tensor-parallel rank {rank} died (exit code {code})"
        if rank in tracebacks:
            text += f":\n{tracebacks[rank]}"
        return text + "; the engine cannot continue: close it and build a new one"

    # ---- stopping --------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (a stop message, then kill whatever is still alive after
        `timeout_s`), leave the process group, remove the rendezvous folder. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.ctx is not None and self.failed is None and self._dead() is None:
            try:
                self.ctx.channel.send(STOP)
            except Exception:  # noqa: BLE001 - a broken group: the kill below still runs
                logger.warning("tensor parallelism: the stop message failed; killing workers")
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if self.ctx is not None:  # (a failed start never joined: the group is not ours)
            destroy_tp()
        if self.errors is not None:
            self.errors.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
