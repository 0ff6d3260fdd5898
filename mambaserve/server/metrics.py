"""Prometheus metrics of the server, in the text exposition format (written by hand: no extra
dependency). Counters and histograms are fed by the AsyncEngine's observer hooks (engine thread)
and by the HTTP layer; gauges come from the engine's published snapshot."""

from __future__ import annotations

import math
import threading
from collections import defaultdict

from mambaserve.engine.async_engine import EngineSnapshot
from mambaserve.engine.outputs import RequestOutput

PREFIX = "mambaserve"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)
STEP_KINDS = ("prefill", "mixed", "decode")
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            lines.append(f'{name}_bucket{{le="{_num(b)}"}} {acc}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {_num(self.sum)}")
        lines.append(f"{name}_count {self.count}")
        return lines


class Metrics:
    """The observer given to AsyncEngine, plus HTTP counters; `render()` gives /metrics."""

    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.finished = dict.fromkeys(self.FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rejected = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.step = {k: Histogram(STEP_BUCKETS) for k in STEP_KINDS}
        self.http: dict[tuple[str, int], int] = defaultdict(int)

    # ---- AsyncEngine observer hooks (engine thread) ---------------------------------------
    def on_first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def on_prompt(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def on_tokens(self, n: int, gap_s: float) -> None:
        with self._lock:
            self.itl.observe(gap_s)

    def on_finished(self, out: RequestOutput, e2e_s: float) -> None:
        with self._lock:
            self.e2e.observe(e2e_s)
            for c in out.outputs:
                reason = c.finish_reason if c.finish_reason in self.finished else "stop"
                self.finished[reason] += 1
                self.generation_tokens += len(c.token_ids)

    def on_step(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.step[kind].observe(seconds)

    def on_aborted(self, n_seqs: int) -> None:
        with self._lock:
            self.finished["abort"] += max(1, n_seqs)

    def on_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def on_error(self, n: int) -> None:
        with self._lock:
            self.finished["error"] += n

    # ---- HTTP layer -------------------------------------------------------------------------
    def on_http(self, path: str, status: int) -> None:
        with self._lock:
            self.http[(path, status)] += 1

    # ---- exposition -------------------------------------------------------------------------
    def render(self, snap: EngineSnapshot, engine_alive: bool) -> str:
        p = PREFIX
        m = f'model_name="{_esc(self.model_name)}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {p}_{name} {help_}")
            out.append(f"# TYPE {p}_{name} {kind}")
            for labels, v in samples:
                lab = f"{{{m}{',' + labels if labels else ''}}}"
                out.append(f"{p}_{name}{lab} {_num(v)}")

        with self._lock:
            metric("requests_finished_total", "counter",
                   "Finished sequences (one per completion choice) by finish reason.",
                   [(f'finish_reason="{r}"', v) for r, v in self.finished.items()])
            metric("requests_rejected_total", "counter",
                   "Requests refused because the waiting queue was full (HTTP 429).",
                   [("", self.rejected)])
            metric("prompt_tokens_total", "counter", "Prompt tokens processed.",
                   [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   [("", self.generation_tokens)])
            metric("http_requests_total", "counter", "HTTP responses by path and status.",
                   [(f'path="{_esc(path)}",status="{st}"', v)
                    for (path, st), v in sorted(self.http.items())])
            for name, h, help_ in (
                    ("time_to_first_token_seconds", self.ttft,
                     "Time from arrival to the first generated token."),
                    ("inter_token_latency_seconds", self.itl,
                     "Time between consecutive generated tokens of a request."),
                    ("e2e_request_latency_seconds", self.e2e,
                     "Time from arrival to the last token of a finished request.")):
                lines = h.render(f"{p}_{name}", help_)
                out += [_label(line, m) for line in lines]
            for i, kind in enumerate(STEP_KINDS):  # one histogram family, labelled by kind
                lines = self.step[kind].render(
                    f"{p}_engine_step_seconds",
                    "Duration of an engine step (one forward, sampling and bookkeeping) by "
                    "kind: prefill-only, mixed, decode-only.")
                out += [_label(line, f'{m},kind="{kind}"') for line in lines
                        if i == 0 or not line.startswith("#")]
        used_slots = snap.state_slots_total - snap.state_slots_free
        used_pages = snap.kv_pages_total - snap.kv_pages_free
        metric("num_requests_running", "gauge", "Sequences running in the engine.",
               [("", snap.running)])
        metric("num_requests_waiting", "gauge", "Sequences waiting for admission.",
               [("", snap.waiting)])
        metric("state_slots_total", "gauge", "Mamba state slots in the pool.",
               [("", snap.state_slots_total)])
        metric("state_slots_used", "gauge", "Mamba state slots in use (requests and cache).",
               [("", used_slots)])
        metric("state_slot_usage_ratio", "gauge", "Fraction of Mamba state slots in use.",
               [("", used_slots / snap.state_slots_total if snap.state_slots_total else 0.0)])
        metric("kv_pages_total", "gauge", "KV cache pages in the pool.",
               [("", snap.kv_pages_total)])
        metric("kv_pages_used", "gauge", "KV cache pages in use (requests and cache).",
               [("", used_pages)])
        metric("kv_page_usage_ratio", "gauge", "Fraction of KV cache pages in use.",
               [("", used_pages / snap.kv_pages_total if snap.kv_pages_total else 0.0)])
        c = snap.cache
        metric("prefix_cache_enabled", "gauge", "1 when prefix caching is on.",
               [("", 1 if c else 0)])
        metric("prefix_cache_token_hit_rate", "gauge",
               "Prompt tokens served from the prefix cache / prompt tokens looked up.",
               [("", c.get("token_hit_rate", 0.0))])
        metric("prefix_cache_request_hit_rate", "gauge",
               "Requests with a prefix-cache hit / requests looked up.",
               [("", c.get("request_hit_rate", 0.0))])
        metric("prefix_cache_snapshots", "gauge", "Mamba state snapshots held by the cache.",
               [("", c.get("snapshots", 0))])
        metric("prefix_cache_snapshot_bytes", "gauge", "Bytes of the cached state snapshots.",
               [("", c.get("snapshot_bytes", 0))])
        metric("engine_steps_total", "counter", "Engine steps (forwards) run.",
               [("", snap.steps)])
        metric("engine_step_errors_total", "counter",
               "Engine steps that raised (the requests in flight failed).",
               [("", snap.step_errors)])
        metric("engine_up", "gauge", "1 while the engine loop runs and takes requests.",
               [("", 1 if engine_alive else 0)])
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label(line: str, labels: str) -> str:
    """Add labels to a histogram sample line (comments pass through)."""
    if line.startswith("#"):
        return line
    name, value = line.rsplit(" ", 1)
    if "{" in name:
        return name.replace("{", "{" + labels + ",", 1) + " " + value
    return f"{name}{{{labels}}} {value}"
