"""Fixed scenarios for the sync audit: every kind of forward the engine runs, with the host
syncs counted per forward, per layer kind and per engine step (`mambaserve audit-syncs`).

Scenario kinds (classified from each forward's batch):
  prefill       only prefill rows, none with an initial state
  continuation  a prefill row continuing from its state (chunked prefill / cache hit)
  mixed         prefill rows and decode rows in one forward
  decode        decode rows only
  prefix-hit    a row restores a cached snapshot before the first layer (prefix caching on)
  snapshot      a row saves a prefix-cache snapshot during the forward (prefix caching on)
A step's only sync should be the read-back of sampled tokens (section "readback").
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from mambaserve.engine.batch import Batch
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.engine.sampling_params import SamplingParams
from mambaserve.tools.sync_audit import (
    CPU_ONLY_ALLOWED,
    AllowedSync,
    SyncAudit,
    profile_cuda_syncs,
)

SCENARIOS = ("prefill", "continuation", "mixed", "decode")
CACHE_SCENARIOS = ("prefix-hit", "snapshot")
ENGINE_ALLOWED = [AllowedSync(
    "mambaserve/engine/runner.py", "_as_numpy",
    reason="numpy() of the tensor `.cpu()` just copied to the host: no device read on CUDA")]


@dataclass
class ScenarioResult:
    forwards: int = 0
    forward_syncs: int = 0  # inside the model forward
    sampler_syncs: int = 0
    step_syncs: int = 0  # everything in the step, readback included
    readback_syncs: int = 0
    expected_readbacks: int = 0  # forwards whose results the host needs (a row samples)
    by_layer_kind: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)
    # tensor parallelism: the other ranks' syncs in these forwards (they read nothing back)
    worker_syncs: Counter = field(default_factory=Counter)  # rank -> syncs in its steps

    @property
    def ok(self) -> bool:
        return self.forward_syncs == 0 and self.sampler_syncs == 0 and \
            self.step_syncs == self.readback_syncs == self.expected_readbacks and \
            not sum(self.worker_syncs.values())


def classify(batch: Batch) -> list[str]:
    """Every scenario a forward belongs to: its shape, plus the prefix-cache work it does."""
    if batch.prefills and batch.decodes:
        tags = ["mixed"]
    elif batch.decodes:
        tags = ["decode"]
    elif any(r.start > 0 and r.restore_from < 0 for r in batch.prefills):
        tags = ["continuation"]
    else:
        tags = ["prefill"]
    if any(r.restore_from >= 0 for r in batch.rows):
        tags.append("prefix-hit")
    if any(r.snapshots for r in batch.rows):
        tags.append("snapshot")
    return tags


_KIND = re.compile(r"\((\w+)\)$")


def layer_kind(module_label: str | None, model: torch.nn.Module) -> str:
    if module_label is None:
        return "outside modules"
    m = re.match(r"layers\.(\d+)", module_label)
    if m:
        return model.layers[int(m.group(1))].kind.value
    return module_label


def run_scenarios(engine: LLMEngine) -> dict[str, ScenarioResult]:
    """Drive a workload that produces every scenario kind; audit each step."""
    cached = engine.prefix_cache is not None
    results = {k: ScenarioResult() for k in SCENARIOS + (CACHE_SCENARIOS if cached else ())}
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()}

    budget = engine.config.chunked_prefill_size
    # b samples through the filters (the sampler's torch path), the others without (its one-op
    # path, ops/sample_rows.py): the steps after b finished take that one
    filtered = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=6,
                              ignore_eos=True, logprobs=2, seed=1)
    plain = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logprobs=2, seed=1)
    # (id, prompt, step at which it is added): b alone gives a pure prefill, then continuations;
    # a and c join while b decodes (mixed forwards); the tail is decode-only
    plan = [("b", prompt(2 * budget + 3), 0), ("a", prompt(max(2, budget // 2)), 3),
            ("c", prompt(3), 5)]
    if cached:  # after b finished: two requests extending b's prompt hit its snapshots
        long = plan[0][1]["prompt_token_ids"]
        plan += [("h1", {"prompt_token_ids": long + prompt(5)["prompt_token_ids"]}, 20),
                 ("h2", {"prompt_token_ids": long + prompt(9)["prompt_token_ids"]}, 21)]
    current: dict[str, str] = {}

    launched: list[list[str]] = []  # each launched forward's kinds, in launch order

    def on_forward(batch: Batch, meta) -> None:
        current["kinds"] = classify(batch)
        launched.append(current["kinds"])
        current["readback"] = any(r.samples or r.request.params.prompt_logprobs is not None
                                  for r in batch.rows)

    engine.runner.on_forward = on_forward
    allow = ENGINE_ALLOWED + CPU_ONLY_ALLOWED
    step = 0
    if engine.tp_workers is not None:  # every other rank audits the steps it runs
        engine.call_ranks("audit", None, True)
    try:
        last_add = max(at for _, _, at in plan)
        while step <= last_add or engine.has_unfinished_requests():
            for rid, p, at in plan:
                if at == step:
                    engine.add_request(rid, p, filtered if rid == "b" else plain)
            audit = SyncAudit(root=engine.model, allow=allow)
            with audit:
                engine.runner.section = audit.section
                engine.step()
            engine.runner.section = lambda label: contextlib.nullcontext()
            step += 1
            if "kinds" not in current:
                continue
            readback = int(current.pop("readback"))
            for kind in current.pop("kinds"):
                r = results[kind]
                r.forwards += 1
                r.expected_readbacks += readback
                r.forward_syncs += audit.count(section="forward")
                r.sampler_syncs += audit.count(section="sampler")
                r.readback_syncs += audit.count(section="readback")
                r.step_syncs += len(audit.events)
                for e in audit.events:
                    if e.section == "forward":
                        r.by_layer_kind[layer_kind(e.module, engine.model)] += 1
                    r.sites[f"[{e.section}] {e.op} at {e.site}"] += 1
    finally:
        engine.runner.on_forward = None
        if engine.tp_workers is not None:
            _add_worker_audits(results, launched, engine.call_ranks("audit", None, False))
    return results


def _add_worker_audits(results: dict[str, ScenarioResult], launched: list[list[str]],
                       per_rank: list) -> None:
    """The other ranks' audits (one entry per step they ran, in launch order) into the
    scenarios of rank 0's forwards."""
    for rank, steps in enumerate(per_rank[1:], 1):
        if len(steps) != len(launched):
            raise RuntimeError(f"rank {rank} audited {len(steps)} steps, rank 0 launched "
                               f"{len(launched)}")
        for kinds, audit in zip(launched, steps):
            for kind in kinds:
                results[kind].worker_syncs[rank] += audit["total"]
                for site in audit["sites"]:
                    results[kind].sites[f"(rank {rank}) {site}"] += 1


def format_report(results: dict[str, ScenarioResult]) -> str:
    header = (f"{'scenario':<14}{'forwards':>9}{'syncs/forward':>15}{'sampler':>9}"
              f"{'syncs/step':>12}{'expected':>10}  verdict")
    lines = [header]
    for name, r in results.items():
        if not r.forwards:
            lines.append(f"{name:<14}{0:>9}  (scenario did not occur)")
            continue
        lines.append(f"{name:<14}{r.forwards:>9}{r.forward_syncs / r.forwards:>15.2f}"
                     f"{r.sampler_syncs / r.forwards:>9.2f}{r.step_syncs / r.forwards:>12.2f}"
                     f"{r.expected_readbacks / r.forwards:>10.2f}  "
                     f"{'ok' if r.ok else 'SYNCS'}")
        for rank, n in sorted(r.worker_syncs.items()):
            lines.append(f"    rank {rank}: {n / r.forwards:.2f} syncs/forward")
        for kind, n in sorted(r.by_layer_kind.items()):
            lines.append(f"    forward syncs in {kind} layers: {n}")
        for site, n in r.sites.most_common():
            lines.append(f"    {n:>4} x {site}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    from mambaserve.config import EngineConfig
    from mambaserve.default_model import default_model_path

    flags = EngineConfig.from_cli(args)
    missing, bad = [], []
    for caching in (False, True):
        engine = LLMEngine(args.model or default_model_path(), replace(
            flags, chunked_prefill_size=min(flags.chunked_prefill_size, 64),
            enable_prefix_caching=caching))
        try:
            results = run_scenarios(engine)
            ranks = flags.tensor_parallel_size
            print(f"== prefix caching {'on' if caching else 'off'}"
                  f"{f', {ranks} tensor-parallel ranks' if ranks > 1 else ''} ==")
            print(format_report(results))
            if engine.device.type == "cuda":
                print(cuda_profile_report(engine))
        finally:
            engine.close()
        missing += [k for k, r in results.items() if not r.forwards]
        bad += [k for k, r in results.items() if r.forwards and not r.ok]
    if bad or missing:
        print(f"FAIL: syncs in {bad}; scenarios that did not occur: {missing}")
        return 1
    print("OK: zero host syncs inside every forward; one read-back per step"
          + (" (rank 0), none on the other ranks" if flags.tensor_parallel_size > 1 else ""))
    return 0


def cuda_profile_report(engine: LLMEngine) -> str:
    """On CUDA, count the profiler's host waits (cuda*Synchronize) and device-to-host copies in
    each engine step of one request: a step that samples should show exactly one of each (the
    token read-back), a step that does not, none."""
    engine.add_request("profile", {"prompt_token_ids": list(range(3, 40))},
                       SamplingParams(max_tokens=4, ignore_eos=True))
    lines, steps = [], 0
    sampled = {}
    engine.runner.on_forward = lambda batch, meta: sampled.__setitem__(
        "yes", any(r.samples for r in batch.rows))
    try:
        while engine.has_unfinished_requests():
            sampled.clear()
            c = profile_cuda_syncs(engine.step)
            steps += 1
            lines.append(f"    step {steps}: samples={bool(sampled.get('yes'))} "
                         f"host_waits={c.host_waits} d2h_copies={c.d2h_copies} {c.counts}")
    finally:
        engine.runner.on_forward = None
    return "CUDA profiler, one request step by step:\n" + "\n".join(lines)
