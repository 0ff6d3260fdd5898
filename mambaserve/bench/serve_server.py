"""What `bench serve` reads from the server besides its responses, and the ideal it compares to.

- `MetricsSampler` scrapes the server's Prometheus /metrics (mambaserve's, docs/server.md) every
  `interval` seconds during the run: the running and waiting sequences over time, and the change
  over the run of `mambaserve_engine_preemptions_total` and of
  `mambaserve_engine_device_busy_seconds_total` (device time of the engine's steps, from CUDA
  events), whose ratio to the run's wall time is the device-busy fraction, and the prefix
  cache's token hit rate at the end (cumulative since the server started). A server without
  these series (another engine) gives None for them, never an error.
- `ideal_throughput` is the output throughput the engine's own one-batch numbers allow for a
  closed-loop workload: C requests of I input and O output tokens cost C*I tokens of prefill at
  the one-batch prefill rate plus O - 1 decode steps at batch C (the prefill samples the first
  token), so ideal = C*O / (C*I / prefill_rate + (O - 1) * decode_step(C)). It reads the JSON
  that `mambaserve bench one-batch --out` writes (a list of results): the best prefill rate of
  its entries and the decode step of the entry at batch C (else the nearest batch size).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

PREEMPTIONS = "mambaserve_engine_preemptions_total"
BUSY = "mambaserve_engine_device_busy_seconds_total"
RUNNING = "mambaserve_num_requests_running"
WAITING = "mambaserve_num_requests_waiting"
HIT_RATE = "mambaserve_prefix_cache_token_hit_rate"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {series name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


class MetricsSampler:
    """Scrapes `url` (the server's /metrics) from `start()` until `stop()`."""

    def __init__(self, client, url: str, interval: float = 0.5) -> None:
        self.client, self.url, self.interval = client, url, interval
        self.samples: list[tuple[float, dict[str, float]]] = []  # (seconds since t0, metrics)
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def scrape(self) -> dict[str, float] | None:
        try:
            r = await self.client.get(self.url)
            if r.status_code != 200:
                return None
            return parse_metrics(r.text)
        except Exception:  # noqa: BLE001 - metrics are optional: a server without them is fine
            return None

    async def _sample(self) -> None:
        m = await self.scrape()
        if m is not None:
            self.samples.append((time.perf_counter() - self._t0, m))

    async def start(self, t0: float) -> None:
        self._t0 = t0
        await self._sample()

        async def loop() -> None:
            while True:
                await asyncio.sleep(self.interval)
                await self._sample()

        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._sample()

    def summary(self) -> dict:
        """Preemptions during the run, the device-busy fraction, and the running / waiting
        sequences over time (None where the server does not export them)."""
        first = self.samples[0] if self.samples else None
        last = self.samples[-1] if self.samples else None

        def delta(name: str) -> float | None:
            if first is None or name not in first[1] or name not in last[1]:
                return None
            return last[1][name] - first[1][name]

        busy = delta(BUSY)
        wall = last[0] - first[0] if first is not None else 0.0
        pre = delta(PREEMPTIONS)
        return {
            "preemptions": int(pre) if pre is not None else None,
            # the server's cumulative rate (since it started) at the end of the run
            "prefix_cache_token_hit_rate": last[1].get(HIT_RATE) if last is not None else None,
            "device_busy_s": busy,
            "device_busy_fraction": busy / wall if busy is not None and wall > 0 else None,
            "timeline": {"t_s": [t for t, _ in self.samples],
                         "running": [m.get(RUNNING) for _, m in self.samples],
                         "waiting": [m.get(WAITING) for _, m in self.samples]},
        }


def ideal_throughput(one_batch_json: str | Path, input_len: int, output_len: int,
                     concurrency: int) -> dict:
    """The ideal output tokens/s of the closed-loop workload (module docstring)."""
    try:
        entries = json.loads(Path(one_batch_json).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--ideal-from {one_batch_json}: cannot read a one-batch JSON: "
                         f"{e}") from None
    if isinstance(entries, dict):
        entries = [entries]
    ok = [e for e in entries if isinstance(e, dict) and not e.get("error")]
    prefill = [e for e in ok if e.get("prefill_tokens_per_s")]
    decode = [e for e in ok if e.get("decode_step_s") and e.get("decode_steps")]
    if not prefill or not decode:
        raise ValueError(f"--ideal-from {one_batch_json}: needs prefill and decode results "
                         "(`bench one-batch --output-len` > 1 measures decode steps)")
    best = max(prefill, key=lambda e: e["prefill_tokens_per_s"])
    step = min(decode, key=lambda e: (abs(e["batch_size"] - concurrency), -e["batch_size"]))
    rate, step_s = best["prefill_tokens_per_s"], step["decode_step_s"]
    c = concurrency
    seconds = c * input_len / rate + (output_len - 1) * step_s
    return {"source": str(one_batch_json), "prefill_tokens_per_s": rate,
            "prefill_entry": f"{best['batch_size']}x{best['input_len']}",
            "decode_step_s": step_s, "decode_batch_size": step["batch_size"],
            "concurrency": c, "output_throughput": c * output_len / seconds}
