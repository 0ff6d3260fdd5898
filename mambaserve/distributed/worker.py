"""A tensor-parallel rank other than 0: it builds its shard of the model and its pools exactly as
rank 0 does (engine/rank_setup.py), then runs what rank 0 broadcasts, step after step, until
rank 0 says stop. It owns no scheduler, tokenizer or server: the host side of every step is
rank 0's (`ForwardInput`), uploaded here once and run through the same forward; the sampled
tokens come from rank 0's sampler through the model group (`ModelRunner.run_follower`).

Control calls (rank 0 asks, every rank answers in a gather): `memory_report`, and `audit`, which
turns a sync audit of every following step on or off (tools/sync_audit.py; off returns the
steps' counts). A failure is put on the error queue with its traceback before the process exits,
so rank 0 can say which rank died and why.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from mambaserve.config import EngineConfig, ModelConfig
from mambaserve.distributed.context import (
    TPContext,
    backend_for,
    collective_timeout_s,
    rank_device,
)
from mambaserve.distributed.group import destroy_tp
from mambaserve.distributed.step_broadcast import CALL, STEP, STOP
from mambaserve.engine.rank_setup import RankModel, build_rank
from mambaserve.tools.sync_audit import CPU_ONLY_ALLOWED, SyncAudit

# test hook: (rank, step, kind): at its step-th step that rank raises ("raise"), exits at once
# ("exit"), or makes one host sync its sync audit must report ("sync")
Fault = tuple[int, int, str]


def worker_main(rank: int, world_size: int, init_method: str, model_path: str,
                config: EngineConfig, errors: Any = None, fault: Fault | None = None,
                threads: int | None = None, local_rank: int | None = None) -> None:
    """The process of rank `rank` (spawned by launcher.py, or a torchrun rank > 0)."""
    try:
        if threads:
            torch.set_num_threads(threads)
        device = rank_device(config.device, rank if local_rank is None else local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ctx = TPContext.join(rank, world_size, init_method, backend_for(device),
                             collective_timeout_s())
        path = Path(model_path)
        model_config = ModelConfig.from_hf(path)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        rank_model = build_rank(path, config, model_config, device, max_model_len, ctx.tp,
                                ctx.agree)
        Follower(rank_model, ctx, fault).run()
    except BaseException:
        if errors is not None:
            errors.put((rank, traceback.format_exc()))
        raise
    finally:
        destroy_tp()


class Follower:
    """The step loop of a rank > 0."""

    def __init__(self, rank_model: RankModel, ctx: TPContext, fault: Fault | None = None) -> None:
        self.rm, self.ctx, self.fault = rank_model, ctx, fault
        self.steps = 0
        self.audits: list[dict] | None = None  # per-step sync counts while an audit is on

    def run(self) -> None:
        while True:
            op, payload = self.ctx.channel.recv()
            if op == STOP:
                return
            if op == STEP:
                self._step(payload)
            elif op == CALL:
                name, args = payload
                self.ctx.gather(getattr(self, "call_" + name)(*args))
            else:
                raise RuntimeError(f"unknown step-channel op {op}")

    def _step(self, fwd) -> None:
        self.steps += 1
        due = self.fault is not None and self.fault[:2] == (self.ctx.tp.tp_rank, self.steps)
        kind = self.fault[2] if due else None
        if kind == "exit":
            os._exit(3)
        if kind == "raise":
            raise RuntimeError(f"injected fault on rank {self.ctx.tp.tp_rank} at step "
                               f"{self.steps}")
        runner = self.rm.runner
        if self.audits is None:
            runner.run_follower(fwd)
            return
        audit = SyncAudit(root=self.rm.model, allow=CPU_ONLY_ALLOWED)
        with audit:
            runner.section = audit.section
            runner.run_follower(fwd)
            if kind == "sync":  # test hook: a sync this rank's audit must report
                with audit.section("forward"):
                    torch.zeros(1).item()
        runner.section = lambda label: contextlib.nullcontext()
        self.audits.append({"forward": audit.count(section="forward"),
                            "sampler": audit.count(section="sampler"),
                            "total": len(audit.events),
                            "sites": [f"[{e.section}] {e.op} at {e.site}"
                                      for e in audit.events]})

    def call_memory_report(self) -> dict:
        return self.rm.memory_report()

    def call_audit(self, on: bool) -> list[dict] | None:
        """on: audit every following step; off: stop, and return the steps' sync counts."""
        audits, self.audits = self.audits, ([] if on else None)
        return None if on else audits
