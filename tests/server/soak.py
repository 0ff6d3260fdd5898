"""A soak of the HTTP server: many clients at once, each looping over a seeded mix of plain,
streamed and chat requests, streams dropped mid-way, non-streamed requests given up on,
parallel choices, and bad requests (malformed JSON, wrong types, lone surrogates, wrong
Content-Type, a body over the limit, an unknown model). Every answer is checked: a valid request
must get a 200 with its full output, a bad one a 4xx with OpenAI's error body; no 5xx, ever.

tests/server/test_soak.py runs it for 30 s in the suite. The longer run of docs/server.md:

    python tests/server/soak.py --duration 1800 --clients 32        # the demo model, on the CPU

starts the server in this process (so the pools and the engine's integrity can be checked at
the end), prints a JSON report and exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import httpx

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "To be, or not to be", "Now is the winter",
           "KING HENRY:", "Friends, Romans, countrymen", "The quality of mercy", "HAMLET:"]


def rss_mb() -> float:
    """This process' resident set size in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class ErrorLogs(logging.Handler):
    """Collects records at ERROR and above from the server's loggers (uvicorn's do not
    propagate to the root logger, so pytest's caplog would miss them)."""

    NAMES = ("mambaserve", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}"
                            + (" (with a traceback)" if record.exc_info else ""))

    def __enter__(self) -> ErrorLogs:
        for n in self.NAMES:
            logging.getLogger(n).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for n in self.NAMES:
            logging.getLogger(n).removeHandler(self)


def bad_requests(max_body_bytes: int) -> list[tuple[str, dict, bytes, set[int]]]:
    """(path, headers, body, acceptable statuses)."""
    j = {"content-type": "application/json"}
    c, ch = "/v1/completions", "/v1/chat/completions"
    return [
        (c, j, b'{"prompt": "x", "max_tokens": ', {400}),
        (c, j, b'[1, 2, 3]', {400}),
        (c, j, json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), {400}),
        (c, j, json.dumps({"prompt": "x", "temperature": -1}).encode(), {400}),
        (c, j, json.dumps({"prompt": {"text": "x"}}).encode(), {400}),
        (c, j, b'{"prompt": "ab\\ud800", "max_tokens": 2}', {400}),
        (c, j, b'{"model": "\\udfff", "prompt": "x"}', {404}),
        (c, j, json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), {404}),
        (c, j, json.dumps({"prompt": "x", "n": 10 ** 30}).encode(), {400}),
        (c, {"content-type": "text/plain"}, b'{"prompt": "x"}', {415}),
        (c, j, b'{"prompt": "' + b"y" * (max_body_bytes + 1) + b'"}', {413}),
        (ch, j, json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), {400}),
        (ch, j, json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
                           ).encode(), {400}),
        (ch, j, json.dumps({"messages": "hi", "stream": True}).encode(), {400}),
    ]


async def _client(i: int, url: str, deadline: float, seed: int, stats: dict,
                  failures: list[str], bad: list) -> None:
    rng = random.Random(seed * 1000 + i)
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        while time.monotonic() < deadline:
            kind = rng.choices(["plain", "stream", "chat", "n2", "disconnect", "give_up", "bad"],
                               [20, 20, 15, 5, 10, 10, 20])[0]
            stats["requests"][kind] += 1
            prompt = rng.choice(PROMPTS)
            max_tokens = rng.randint(1, 24)
            try:
                await _one(c, rng, kind, prompt, max_tokens, stats, failures, bad)
            except Exception as e:  # noqa: BLE001 - any surprise is a failure of the server
                failures.append(f"{kind}: {type(e).__name__}: {e}")


async def _one(c: httpx.AsyncClient, rng: random.Random, kind: str, prompt: str,
               max_tokens: int, stats: dict, failures: list[str], bad: list) -> None:
    status = stats["status"]
    if kind in ("plain", "n2"):
        n = 2 if kind == "n2" else 1
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                  "n": n, "temperature": 0.8,
                                                  "ignore_eos": True})
        status[r.status_code] += 1
        if r.status_code != 200:
            failures.append(f"{kind}: HTTP {r.status_code}: {r.text[:200]}")
            return
        body = r.json()
        if len(body["choices"]) != n or body["usage"]["completion_tokens"] != n * max_tokens:
            failures.append(f"{kind}: incomplete response {body}")
    elif kind in ("stream", "chat", "disconnect"):
        chat = kind == "chat"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"max_tokens": 200 if kind == "disconnect" else max_tokens, "stream": True,
                "ignore_eos": True}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat
                    else {"prompt": prompt})
        chunks, done, reason = 0, False, None
        async with c.stream("POST", path, json=body) as r:
            status[r.status_code] += 1
            if r.status_code != 200:
                failures.append(f"{kind}: HTTP {r.status_code}")
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        failures.append(f"{kind}: in-band error {obj['error']}")
                    for ch in obj.get("choices", []):
                        reason = ch.get("finish_reason") or reason
                    chunks += 1
                    if kind == "disconnect" and chunks == 3:
                        return  # leaving the block closes the connection mid-stream
        if not done or reason != "length":
            failures.append(f"{kind}: stream ended without [DONE] / finish_reason length "
                            f"({done}, {reason})")
    elif kind == "give_up":
        try:
            await c.post("/v1/completions", timeout=httpx.Timeout(60, read=rng.uniform(0.05, 0.5)),
                         json={"prompt": prompt, "max_tokens": 2000, "ignore_eos": True})
        except httpx.ReadTimeout:
            status["gave_up"] += 1
        else:
            failures.append("give_up: a 2000-token request finished before the client gave up")
    else:
        path, headers, raw, ok = rng.choice(bad)
        r = await c.post(path, content=raw, headers=headers)
        status[r.status_code] += 1
        if r.status_code not in ok:
            failures.append(f"bad: {raw[:60]!r} got HTTP {r.status_code}, wanted {ok}")
            return
        err = r.json().get("error", {})
        if set(err) != {"message", "type", "param", "code"}:
            failures.append(f"bad: not an OpenAI error body: {r.text[:200]}")


async def run_soak(url: str, duration_s: float, clients: int = 32, seed: int = 0,
                   max_body_bytes: int = 4 << 20, on_tick=None) -> dict:
    """Run the soak against `url`; -> {"requests": {kind: n}, "status": {code: n},
    "failures": [...], "duration_s": s, "rss_mb": [samples]}. `on_tick()` runs every few
    seconds (RSS sampling)."""
    stats = {"requests": collections.Counter(), "status": collections.Counter()}
    failures: list[str] = []
    bad = bad_requests(max_body_bytes)
    t0 = time.monotonic()
    deadline = t0 + duration_s
    samples = [rss_mb()]

    async def ticker() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
            samples.append(rss_mb())
            if on_tick is not None:
                on_tick()

    tick = asyncio.ensure_future(ticker())
    await asyncio.gather(*(_client(i, url, deadline, seed, stats, failures, bad)
                           for i in range(clients)))
    tick.cancel()
    samples.append(rss_mb())
    return {"duration_s": round(time.monotonic() - t0, 1),
            "requests": dict(stats["requests"]), "total": sum(stats["requests"].values()),
            "status": {str(k): v for k, v in sorted(stats["status"].items(), key=str)},
            "failures": failures, "rss_mb": samples}


def pools_idle(engine, timeout: float = 30.0) -> dict:
    """Wait for the engine to go idle; -> its pool state, and check_integrity() run."""
    deadline = time.monotonic() + timeout

    def read(e):
        return {"running": e.num_running, "waiting": e.num_waiting,
                "requests": len(e.unfinished_request_ids()),
                "free_slots": e.state_pool.num_free, "slots": e.state_pool.num_slots,
                "free_pages": e.kv_pool.num_free, "pages": e.kv_pool.num_pages}

    while True:
        p = engine.call_sync(read)
        p["idle"] = (p["running"] == 0 and p["waiting"] == 0 and p["requests"] == 0
                     and p["free_slots"] == p["slots"] and p["free_pages"] == p["pages"])
        if p["idle"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    engine.call_sync(lambda e: e.check_integrity())  # raises if the pools disagree
    p["integrity"] = "ok"
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from mambaserve.server import ServerThread, build_app

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app, engine = build_app(a.model, device="cpu", max_num_seqs=a.max_num_seqs)
    with ErrorLogs() as errors, ServerThread(app) as srv:
        rss0 = rss_mb()
        t0 = time.time()

        def tick():
            print(f"[{time.time() - t0:7.0f} s] RSS {rss_mb():.0f} MiB", file=sys.stderr,
                  flush=True)

        report = asyncio.run(run_soak(srv.url, a.duration, a.clients, a.seed, on_tick=tick))
        report["pools"] = pools_idle(engine)
        report["error_logs"] = errors.records[:20]
        report["rss_mb_start_end"] = [round(rss0), round(rss_mb())]
        report["rss_mb"] = [round(x) for x in report["rss_mb"][::12]]  # one a minute
        report["healthy_after"] = httpx.get(srv.url + "/health").status_code == 200
    report["model"] = a.model or "demo_model"
    report["clients"] = a.clients
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    ok = (not report["failures"] and not report["error_logs"] and report["pools"]["idle"]
          and report["healthy_after"])
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
