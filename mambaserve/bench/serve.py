"""`mambaserve bench serve`: an online-serving benchmark client for an OpenAI-compatible server.

Sends random token-id prompts to /v1/completions (streamed, `ignore_eos`; greedy unless
`--temperature` / `--top-p` ask for sampling, seeded by `--seed`) with Poisson
arrivals at `--request-rate` (inf: all at once) under an optional `--max-concurrency`, and
measures request and token throughput, time to first token (TTFT), inter-token latency (ITL)
and end-to-end latency (E2EL). Token counts come from the server's per-chunk usage
(`stream_options.continuous_usage_stats`, which mambaserve and vLLM send); without it each
non-empty chunk counts as one token. `--dataset multiturn` runs chat sessions instead
(bench/serve_multiturn.py). From the server's /metrics it reports the preemptions and the
device-busy fraction of the run and the running batch size over time (bench/serve_server.py);
`--ideal-from` prints the ideal throughput that a `bench one-batch` JSON allows beside the
result; an `output_sha256` over the answers lets two runs' outputs be compared.

    mambaserve bench serve --base-url http://127.0.0.1:8000 --input-len 128 --output-len 64 \\
        --num-prompts 200 --request-rate 8 --max-concurrency 32 --out r.json --plot r.png
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from mambaserve.bench.serve_multiturn import make_conversations, run_conversation
from mambaserve.bench.serve_plot import plot
from mambaserve.bench.serve_server import MetricsSampler, ideal_throughput

DATASETS = ("random", "multiturn")


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of /v1/models
    dataset: str = "random"
    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    shared_prefix_len: int = 0  # leading tokens every prompt shares (prefix-cache workloads)
    vocab_size: int | None = None  # None: /v1/models' vocab_size
    seed: int = 0
    timeout_s: float = 600.0
    disable_tqdm: bool = False
    num_turns: int = 4  # multiturn: turns per conversation
    think_time_s: float = 1.0  # multiturn: mean pause between a conversation's turns
    ideal_from: str | None = None  # a `bench one-batch --out` JSON
    metrics_interval_s: float = 0.5  # how often /metrics is scraped during the run
    temperature: float = 0.0  # every request's (0: greedy)
    top_p: float = 1.0  # every request's nucleus filter (1: off)

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; one of {', '.join(DATASETS)}")
        if self.num_turns < 1 or self.think_time_s < 0 or self.metrics_interval_s <= 0:
            raise ValueError("num-turns must be >= 1, think-time >= 0, metrics-interval > 0")
        if self.input_len < 1 or self.output_len < 1 or self.num_prompts < 1:
            raise ValueError("input-len, output-len and num-prompts must be >= 1")
        if self.dataset == "random" and not 0 <= self.shared_prefix_len <= self.input_len:
            raise ValueError("shared-prefix-len must be in [0, input-len]")
        if self.shared_prefix_len < 0:
            raise ValueError("shared-prefix-len must be >= 0")
        if not self.request_rate > 0:
            raise ValueError("request-rate must be > 0 (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max-concurrency must be >= 1")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top-p in (0, 1], got "
                             f"{self.temperature} and {self.top_p}")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the benchmark began
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # arrival of each token, from start
    text: str = ""
    conversation: int = 0  # multiturn: which conversation and turn
    turn: int = 0


def make_prompts(cfg: BenchConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(cfg.seed)
    prefix = [rng.randrange(vocab_size) for _ in range(cfg.shared_prefix_len)]
    rest = cfg.input_len - cfg.shared_prefix_len
    return [prefix + [rng.randrange(vocab_size) for _ in range(rest)]
            for _ in range(cfg.num_prompts)]


def arrival_times(cfg: BenchConfig) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson process)."""
    if math.isinf(cfg.request_rate):
        return [0.0] * cfg.num_prompts
    rng = random.Random(cfg.seed + 1)
    t, out = 0.0, []
    for _ in range(cfg.num_prompts):
        out.append(t)
        t += rng.expovariate(cfg.request_rate)
    return out


async def _one(client, url: str, model: str, prompt: list[int], cfg: BenchConfig,
               t_bench: float) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len,
            "temperature": cfg.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if cfg.temperature > 0:  # sampled: seeded, so two runs' outputs compare (output_sha256)
        body |= {"top_p": cfg.top_p, "seed": cfg.seed}
    t0 = time.perf_counter()
    res.start = t0 - t_bench
    last, tokens = t0, 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))[:200]
                    return res
                usage = obj.get("usage")
                if obj.get("choices"):
                    res.text += obj["choices"][0].get("text") or ""
                    if usage and "completion_tokens" in usage:
                        now_tokens = usage["completion_tokens"]
                    else:
                        now_tokens = tokens + (1 if obj["choices"][0].get("text") else 0)
                    if now_tokens > tokens:
                        now = time.perf_counter()
                        k = now_tokens - tokens
                        if tokens == 0:
                            res.ttft = now - t0
                            res.itl += [(now - last) / k] * (k - 1) if k > 1 else []
                        else:
                            res.itl += [(now - last) / k] * k
                        res.token_times += [now - t_bench] * k
                        tokens, last = now_tokens, now
                elif usage:
                    tokens = max(tokens, usage.get("completion_tokens", 0))
        res.latency = time.perf_counter() - t0
        res.output_tokens = tokens
        res.ok = tokens > 0
        if not res.ok:
            res.error = "no tokens received"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _stats(xs: list[float], scale: float = 1000.0) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    import numpy as np

    a = np.asarray(xs, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "min": float(a.min()), "max": float(a.max())}


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float,
              model: str) -> dict:
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    bin_s = max(0.1, duration / 60) if duration > 0 else 0.1
    n_bins = max(1, math.ceil(duration / bin_s))
    tok_bins = [0] * n_bins
    done_bins = [0] * n_bins
    for r in ok:
        for t in r.token_times:
            tok_bins[min(n_bins - 1, int(t / bin_s))] += 1
        done_bins[min(n_bins - 1, int((r.start + r.latency) / bin_s))] += 1
    itl_bins: list[list[float]] = [[] for _ in range(n_bins)]
    for r in ok:
        for gap, t in zip(r.itl, r.token_times[1:]):
            itl_bins[min(n_bins - 1, int(t / bin_s))].append(gap)
    itl_median = [_stats(b)["median"] for b in itl_bins]
    itl_p99 = [_stats(b)["p99"] for b in itl_bins]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    digest = hashlib.sha256(json.dumps([r.text for r in results]).encode()).hexdigest()
    return {
        "config": asdict(cfg) | {"request_rate": str(cfg.request_rate), "model": model},
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": n_out / duration if duration else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats(tpot),
        "e2el_ms": _stats([r.latency for r in ok]),
        "timeline": {"bin_s": bin_s, "output_tokens_per_s": [c / bin_s for c in tok_bins],
                     "completed_per_s": [c / bin_s for c in done_bins],
                     "itl_median_ms": itl_median, "itl_p99_ms": itl_p99},
        "output_sha256": digest,  # over every request's text, in request order
    }


async def run_benchmark(cfg: BenchConfig) -> dict:
    try:
        import httpx
    except ImportError:
        raise ValueError('bench serve needs httpx: pip install "mambaserve[bench]"') from None
    from tqdm import tqdm

    cfg.validate()
    if cfg.ideal_from:  # a bad file is reported before any request is sent
        ideal_throughput(cfg.ideal_from, cfg.input_len, cfg.output_len,
                         cfg.max_concurrency or cfg.num_prompts)
    base = cfg.base_url.rstrip("/")
    limit = cfg.max_concurrency or cfg.num_prompts
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
                                 limits=limits) as client:
        model, vocab = cfg.model, cfg.vocab_size
        if model is None or vocab is None:
            try:
                r = await client.get(f"{base}/v1/models")
                r.raise_for_status()
                card = r.json()["data"][0]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise ValueError(f"no model list from {base}/v1/models (is `mambaserve serve` "
                                 f"running there? --base-url): {type(e).__name__}: {e}") from None
            model = model or card["id"]
            vocab = vocab or card.get("vocab_size")
        if not vocab:
            raise ValueError("the server does not report vocab_size: pass --vocab-size")
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        url = f"{base}/v1/completions"
        sampler = MetricsSampler(client, f"{base}/metrics", cfg.metrics_interval_s)
        t_bench = time.perf_counter()
        await sampler.start(t_bench)

        def send(prompt: list[int]):
            return _one(client, url, model, prompt, cfg, t_bench)

        async def wait_until(at: float) -> None:
            delay = at - (time.perf_counter() - t_bench)
            if delay > 0:
                await asyncio.sleep(delay)

        arrivals = arrival_times(cfg)
        if cfg.dataset == "multiturn":
            system, convs = make_conversations(
                cfg.num_prompts, cfg.num_turns, cfg.shared_prefix_len, cfg.input_len,
                cfg.output_len, int(vocab), cfg.seed)
            bar = tqdm(total=len(convs) * cfg.num_turns, desc="requests",
                       disable=cfg.disable_tqdm)

            async def counted(prompt: list[int]) -> RequestResult:
                res = await send(prompt)
                bar.update(1)
                return res

            async def session(i: int) -> list[RequestResult]:
                await wait_until(arrivals[i])
                if sem is None:
                    return await run_conversation(convs[i], system, cfg.think_time_s, cfg.seed,
                                                  counted)
                async with sem:
                    return await run_conversation(convs[i], system, cfg.think_time_s, cfg.seed,
                                                  counted)

            sessions = await asyncio.gather(*(session(i) for i in range(len(convs))))
            results = [r for conv in sessions for r in conv]
        else:
            prompts = make_prompts(cfg, int(vocab))
            bar = tqdm(total=cfg.num_prompts, desc="requests", disable=cfg.disable_tqdm)

            async def launch(i: int) -> RequestResult:
                await wait_until(arrivals[i])
                if sem is None:
                    res = await send(prompts[i])
                else:
                    async with sem:
                        res = await send(prompts[i])
                bar.update(1)
                return res

            results = await asyncio.gather(*(launch(i) for i in range(cfg.num_prompts)))
        duration = time.perf_counter() - t_bench
        await sampler.stop()
        bar.close()
    out = summarize(cfg, list(results), duration, model)
    out["server"] = sampler.summary()
    if cfg.ideal_from:
        c = cfg.max_concurrency or cfg.num_prompts
        out["ideal"] = ideal_throughput(cfg.ideal_from, cfg.input_len, cfg.output_len, c)
        out["ideal"]["fraction"] = out["output_throughput"] / out["ideal"]["output_throughput"]
    return out


def print_summary(res: dict, file=None) -> None:
    file = file or sys.stdout  # looked up per call: pytest swaps sys.stdout per test

    def row(name: str, v) -> None:
        print(f"{name:<34}{v:>14.2f}" if isinstance(v, float) else f"{name:<34}{v!s:>14}",
              file=file)

    print("=" * 20 + " serving benchmark " + "=" * 20, file=file)
    row("successful requests", res["completed"])
    row("failed requests", res["failed"])
    row("duration (s)", res["duration_s"])
    row("input tokens", res["total_input_tokens"])
    row("output tokens", res["total_output_tokens"])
    row("request throughput (req/s)", res["request_throughput"])
    row("output token throughput (tok/s)", res["output_throughput"])
    row("total token throughput (tok/s)", res["total_token_throughput"])
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"),
                      ("e2el_ms", "E2E latency")):
        s = res[key]
        for stat in ("mean", "median", "p99"):
            v = s[stat]
            row(f"{stat} {name} (ms)", v if v is not None else "-")
    srv = res.get("server") or {}
    row("server preemptions", srv.get("preemptions") if srv.get("preemptions") is not None
        else "-")
    hit = srv.get("prefix_cache_token_hit_rate")
    row("prefix-cache token hit rate (%)", 100 * hit if hit is not None else "-")
    frac = srv.get("device_busy_fraction")
    row("device busy (% of wall time)", 100 * frac if frac is not None else "-")
    ideal = res.get("ideal")
    if ideal:
        row("ideal output throughput (tok/s)", ideal["output_throughput"])
        row("output throughput / ideal (%)", 100 * ideal["fraction"])
        print(f"  (ideal: {ideal['concurrency']} x ({ideal['prefill_entry']} prefill at "
              f"{ideal['prefill_tokens_per_s']:,.0f} tok/s + decode steps of "
              f"{ideal['decode_step_s'] * 1e3:.2f} ms at batch {ideal['decode_batch_size']}), "
              f"from {ideal['source']})", file=file)
    for err, count in res["errors"].items():
        print(f"error x{count}: {err}", file=file)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--dataset", default="random", choices=list(DATASETS),
                   help="random: independent random token-id prompts; multiturn: chat sessions "
                        "resending their history after a shared system prompt of "
                        "--shared-prefix-len tokens (bench/serve_multiturn.py)")
    p.add_argument("--num-turns", type=int, default=4,
                   help="multiturn: turns per conversation (conversations: num-prompts // "
                        "num-turns) (default: %(default)s)")
    p.add_argument("--think-time", type=float, default=1.0,
                   help="multiturn: mean seconds between a conversation's turns, exponentially "
                        "distributed (default: %(default)s)")
    p.add_argument("--ideal-from", default=None, metavar="ONE_BATCH_JSON",
                   help="a `bench one-batch --out` JSON: print the ideal output throughput of "
                        "this workload at --max-concurrency beside the result")
    p.add_argument("--metrics-interval", type=float, default=0.5,
                   help="seconds between scrapes of the server's /metrics (default: "
                        "%(default)s)")
    p.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-prompts", type=int, default=100, help="requests sent")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit)")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="leading prompt tokens shared by every request (multiturn: the system "
                        "prompt, e.g. 2048)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn from [0, vocab-size) (default: from /v1/models)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts and arrival times (and the requests' sampling seed)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (0: greedy decoding)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="every request's top_p, with --temperature above 0 (1: no filter)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None,
                   help="write a PNG here: latency percentiles; throughput, running batch size "
                        "and ITL over time")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_cli(a: argparse.Namespace) -> int:
    """`mambaserve bench serve`; a bad setting, a missing package or an unreachable server is a
    ValueError (one line from the CLI), raised before any request is sent."""
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError('--plot needs matplotlib: pip install "mambaserve[bench]"') from None
    cfg = BenchConfig(base_url=a.base_url, model=a.model, dataset=a.dataset,
                      input_len=a.input_len, output_len=a.output_len, num_prompts=a.num_prompts,
                      request_rate=a.request_rate, max_concurrency=a.max_concurrency,
                      shared_prefix_len=a.shared_prefix_len, vocab_size=a.vocab_size,
                      seed=a.seed, timeout_s=a.timeout, disable_tqdm=a.disable_tqdm,
                      num_turns=a.num_turns, think_time_s=a.think_time,
                      ideal_from=a.ideal_from, metrics_interval_s=a.metrics_interval,
                      temperature=a.temperature, top_p=a.top_p)
    res = asyncio.run(run_benchmark(cfg))
    print_summary(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {a.out}")
    if a.plot and plot(res, a.plot):
        print(f"plot written to {a.plot}")
    return 0 if res["completed"] else 1
