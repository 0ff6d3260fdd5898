"""Prometheus metrics of the server, through prometheus-client (one registry per app).

Counters and histograms are fed by the AsyncEngine's observer hooks (engine thread) and by the
HTTP layer; the gauges (and the engine's step counters) are read from the engine's published
snapshot when /metrics is scraped. Every series carries the `model_name` label.

Like vLLM, this turns off prometheus-client's `*_created` series (process-wide): they double the
output and no dashboard of ours reads them.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from mambaserve.engine.async_engine import EngineSnapshot
from mambaserve.engine.outputs import RequestOutput

disable_created_metrics()

PREFIX = "mambaserve"
CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)
STEP_KINDS = ("prefill", "mixed", "decode")
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

EngineSource = Callable[[], tuple[EngineSnapshot, bool]]


class Metrics:
    """The observer given to AsyncEngine, plus HTTP counters; `render()` gives /metrics.
    `engine_source` (set by the app): returns (the engine's snapshot, whether it is up)."""

    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine_source: EngineSource | None = None
        p, r, m = PREFIX, self.registry, model_name

        self._finished = Counter(f"{p}_requests_finished_total",
                                 "Finished sequences (one per completion choice) by finish "
                                 "reason.", ["model_name", "finish_reason"], registry=r)
        self.finished = {k: self._finished.labels(m, k) for k in self.FINISH_REASONS}
        self.rejected = Counter(f"{p}_requests_rejected_total",
                                "Requests refused because the waiting queue was full (HTTP "
                                "429).", ["model_name"], registry=r).labels(m)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "Prompt tokens processed.",
                                     ["model_name"], registry=r).labels(m)
        self.generation_tokens = Counter(f"{p}_generation_tokens_total", "Tokens generated.",
                                         ["model_name"], registry=r).labels(m)
        self._http = Counter(f"{p}_http_requests_total", "HTTP responses by path and status.",
                             ["model_name", "path", "status"], registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds",
                             "Time from arrival to the last token of a finished request.",
                             ["model_name"], buckets=E2E_BUCKETS, registry=r).labels(m)
        step = Histogram(f"{p}_engine_step_seconds",
                         "Duration of an engine step (one forward, sampling and bookkeeping) by "
                         "kind: prefill-only, mixed, decode-only.", ["model_name", "kind"],
                         buckets=STEP_BUCKETS, registry=r)
        self.step = {k: step.labels(m, k) for k in STEP_KINDS}
        r.register(_EngineCollector(self))

    # ---- AsyncEngine observer hooks (engine thread) ---------------------------------------
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_prompt(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def on_tokens(self, n: int, gap_s: float) -> None:
        self.itl.observe(gap_s)

    def on_finished(self, out: RequestOutput, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        n = 0
        for c in out.outputs:
            reason = c.finish_reason if c.finish_reason in self.finished else "stop"
            self.finished[reason].inc()
            n += len(c.token_ids)
        self.generation_tokens.inc(n)

    def on_step(self, kind: str, seconds: float) -> None:
        self.step[kind].observe(seconds)

    def on_aborted(self, n_seqs: int) -> None:
        self.finished["abort"].inc(max(1, n_seqs))

    def on_rejected(self) -> None:
        self.rejected.inc()

    def on_error(self, n: int) -> None:
        self.finished["error"].inc(n)

    # ---- HTTP layer -------------------------------------------------------------------------
    def on_http(self, path: str, status: int) -> None:
        self._http.labels(self.model_name, path, str(status)).inc()

    # ---- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        """The registry in Prometheus' text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's gauges and step counters, read from its snapshot at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # collected at scrape time only (the snapshot may not exist yet)

    def collect(self):
        src = self.metrics.engine_source
        if src is None:
            return
        snap, alive = src()
        p, m = PREFIX, self.metrics.model_name

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{p}_{name}", help_, labels=["model_name"])
            g.add_metric([m], value)
            return g

        def counter(name: str, help_: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{p}_{name}", help_, labels=["model_name"])
            c.add_metric([m], value)
            return c

        used_slots = snap.state_slots_total - snap.state_slots_free
        used_pages = snap.kv_pages_total - snap.kv_pages_free
        yield gauge("num_requests_running", "Sequences running in the engine.", snap.running)
        yield gauge("num_requests_waiting", "Sequences waiting for admission.", snap.waiting)
        yield gauge("state_slots_total", "Mamba state slots in the pool.",
                    snap.state_slots_total)
        yield gauge("state_slots_used", "Mamba state slots in use (requests and cache).",
                    used_slots)
        yield gauge("state_slot_usage_ratio", "Fraction of Mamba state slots in use.",
                    used_slots / snap.state_slots_total if snap.state_slots_total else 0.0)
        yield gauge("kv_pages_total", "KV cache pages in the pool.", snap.kv_pages_total)
        yield gauge("kv_pages_used", "KV cache pages in use (requests and cache).", used_pages)
        yield gauge("kv_page_usage_ratio", "Fraction of KV cache pages in use.",
                    used_pages / snap.kv_pages_total if snap.kv_pages_total else 0.0)
        c = snap.cache
        yield gauge("prefix_cache_enabled", "1 when prefix caching is on.", 1 if c else 0)
        yield gauge("prefix_cache_token_hit_rate",
                    "Prompt tokens served from the prefix cache / prompt tokens looked up.",
                    c.get("token_hit_rate", 0.0))
        yield gauge("prefix_cache_request_hit_rate",
                    "Requests with a prefix-cache hit / requests looked up.",
                    c.get("request_hit_rate", 0.0))
        yield gauge("prefix_cache_snapshots", "Mamba state snapshots held by the cache.",
                    c.get("snapshots", 0))
        yield gauge("prefix_cache_snapshot_bytes", "Bytes of the cached state snapshots.",
                    c.get("snapshot_bytes", 0))
        yield counter("engine_steps_total", "Engine steps (forwards) run.", snap.steps)
        yield counter("engine_preemptions_total",
                      "Running sequences preempted for KV pages (recomputed later).",
                      snap.preemptions)
        yield counter("engine_device_busy_seconds_total",
                      "Device time of the engine's steps, from before each step's upload to "
                      "after its read-back (CUDA events; on a CPU the steps' wall time); its "
                      "rate is the device-busy fraction.", snap.device_busy_seconds)
        yield counter("engine_step_errors_total",
                      "Engine steps that raised (the requests in flight failed).",
                      snap.step_errors)
        yield gauge("engine_up", "1 while the engine loop runs and takes requests.",
                    1 if alive else 0)
