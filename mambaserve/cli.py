"""Command line: `mambaserve generate | audit-syncs | ...` (see `mambaserve --help`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from mambaserve.config import EngineConfig


def _add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")


def _engine_settings(a: argparse.Namespace) -> dict:
    """The EngineConfig flags of `a` as keyword arguments of LLM / serve."""
    return dataclasses.asdict(EngineConfig.from_cli(a))


def cmd_generate(a: argparse.Namespace) -> int:
    from mambaserve import LLM, SamplingParams

    settings = _engine_settings(a)
    t0 = time.perf_counter()
    llm = LLM(a.model, **settings)
    t1 = time.perf_counter()
    # the engine's --seed is also every prompt's sampling seed (the README's output is seed 0)
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens, seed=settings["seed"],
                            ignore_eos=a.ignore_eos)
    outs = llm.generate(list(a.prompt), params)
    t2 = time.perf_counter()
    for out in outs:
        print(f"{out.prompt}{out.outputs[0].text}")
        print("-" * 40)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[load {t1 - t0:.2f} s, generate {n} tokens in {t2 - t1:.2f} s]", file=sys.stderr)
    return 0


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def cmd_serve(a: argparse.Namespace) -> int:
    import os

    from mambaserve.server.launcher import serve

    if a.model_path and a.model and a.model_path != a.model:
        raise ValueError(f"two models given: {a.model_path!r} and --model {a.model!r}")
    for flag, v, ok in (("--drain-timeout", a.drain_timeout, a.drain_timeout >= 0),
                        ("--max-body-mb", a.max_body_mb, a.max_body_mb > 0),
                        ("--timeout-keep-alive", a.timeout_keep_alive, a.timeout_keep_alive > 0),
                        ("--timeout-header", a.timeout_header, a.timeout_header > 0),
                        ("--timeout-body", a.timeout_body, a.timeout_body > 0)):
        if not ok:  # NaN fails too
            raise ValueError(f"{flag} must be {'>= 0' if flag == '--drain-timeout' else '> 0'} "
                             f"seconds{'' if flag != '--max-body-mb' else ' (MiB)'}, got {v}")
    api_key = a.api_key if a.api_key is not None else os.environ.get("MAMBASERVE_API_KEY")
    return serve(a.model_path or a.model, a.host, a.port, served_model_name=a.served_model_name,
                 max_waiting=None if a.max_waiting < 0 else a.max_waiting,
                 drain_timeout=a.drain_timeout, log_level=a.log_level, api_key=api_key or None,
                 allowed_origins=_csv(a.allowed_origins),
                 allowed_hosts=_csv(a.allowed_hosts) if a.allowed_hosts is not None else None,
                 max_body_bytes=max(1, int(a.max_body_mb * (1 << 20))),
                 timeout_keep_alive_s=a.timeout_keep_alive, timeout_header_s=a.timeout_header,
                 timeout_body_s=a.timeout_body, **_engine_settings(a))


def _server_commands(sub) -> None:
    """`mambaserve serve` (OpenAI-compatible HTTP server) and `mambaserve bench serve`."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)")
    s.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder (default: the embedded model)")
    _add_model_flag(s)
    EngineConfig.add_cli_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000,
                   help="0: any free port (default: %(default)s)")
    s.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the checkpoint folder's name)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="sequences that may wait for admission before requests get 429 "
                        "(-1: no limit) (default: %(default)s)")
    s.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds a SIGTERM lets requests in flight run before ending them with "
                        "finish_reason abort; 0: at once (default: %(default)s)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: the "
                        "MAMBASERVE_API_KEY environment variable, else no key)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated browser origins allowed to call the API (CORS), e.g. "
                        "http://localhost:3000, or *; requests from other origins get 403 "
                        "(default: none)")
    s.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                   help="comma-separated Host header names accepted (*.example.com, *); "
                        "default: on loopback connections only localhost names and IP "
                        "addresses, elsewhere any")
    s.add_argument("--max-body-mb", type=float, default=4.0,
                   help="largest request body in MiB; larger ones get 413 (default: %(default)s)")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    s.add_argument("--timeout-header", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers before it is "
                        "closed (default: %(default)s)")
    s.add_argument("--timeout-body", type=float, default=30.0,
                   help="seconds a request has to send its body before it gets 408 "
                        "(default: %(default)s)")
    s.add_argument("--log-level", default="info", help="(default: %(default)s)")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks: serve | one-batch | ab | profile | kernels")
    b_sub = b.add_subparsers(dest="bench_command", required=True)
    bs = b_sub.add_parser("serve", help="online serving benchmark against a running server")
    from mambaserve.bench.serve import add_args

    add_args(bs)
    bs.set_defaults(func=lambda ns: __import__(
        "mambaserve.bench.serve", fromlist=["run_cli"]).run_cli(ns))
    from mambaserve.bench import ab, one_batch

    ob = b_sub.add_parser("one-batch", help="one batch in-process: prefill MFU, decode bandwidth")
    one_batch.add_args(ob)
    ob.set_defaults(func=one_batch.run_cli)
    abp = b_sub.add_parser("ab", help="A/B of two engine settings: interleaved rounds, drift "
                                      "control (A vs A)")
    ab.add_args(abp)
    abp.set_defaults(func=ab.run_cli)
    from mambaserve.bench import profile

    pp = b_sub.add_parser("profile", help="where a prefill step's and a decode step's device "
                                          "time goes (torch.profiler, kernels by group)")
    profile.add_args(pp)
    pp.set_defaults(func=profile.run_cli)
    from mambaserve.bench import kernels

    kp = b_sub.add_parser("kernels", help="Triton kernels vs. the torch references and peer "
                                          "kernels (docs/kernels.md)")
    kernels.add_args(kp)
    kp.set_defaults(func=kernels.run_cli)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mambaserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for one or more prompts. --seed seeds the "
                                   "engine and is also every prompt's sampling seed.")
    g.add_argument("prompt", nargs="+")
    _add_model_flag(g)
    EngineConfig.add_cli_args(g)
    g.add_argument("--max-tokens", type=int, default=64,
                   help="tokens generated per prompt at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.8, help="(default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="0: no top-k cut (default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")
    g.set_defaults(func=cmd_generate)
    _server_commands(sub)

    a = sub.add_parser("audit-syncs", help="count host syncs per forward in fixed scenarios",
                       description="Count host syncs per forward in fixed scenarios, once with "
                                   "prefix caching off and once on (so --enable-prefix-caching "
                                   "changes nothing), the prefill chunk capped at 64 tokens.")
    _add_model_flag(a)
    EngineConfig.add_cli_args(a)
    a.set_defaults(func=lambda ns: __import__(
        "mambaserve.tools.audit_scenarios", fromlist=["run_cli"]).run_cli(ns))

    ev = sub.add_parser("eval", help="evaluate through the engine: perplexity | qa")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    pp = ev_sub.add_parser("perplexity", help="perplexity of a text file, windowed")
    pp.add_argument("file")
    _add_model_flag(pp)
    EngineConfig.add_cli_args(pp)
    pp.add_argument("--window", type=int, default=512, help="tokens per non-overlapping window")
    pp.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    pp.add_argument("--out", default=None, help="also write the JSON result here")
    pp.set_defaults(func=lambda ns: __import__(
        "mambaserve.tools.eval", fromlist=["cli_perplexity"]).cli_perplexity(ns))
    qa = ev_sub.add_parser("qa", help="few-shot GSM8K-format QA accuracy (JSONL file)")
    qa.add_argument("file")
    _add_model_flag(qa)
    EngineConfig.add_cli_args(qa)
    qa.add_argument("--shots", type=int, default=4, help="first N items as few-shot examples")
    qa.add_argument("--max-tokens", type=int, default=256)
    qa.add_argument("--limit", type=int, default=None, help="score at most N questions")
    qa.add_argument("--out", default=None, help="also write the JSON result here")
    qa.set_defaults(func=lambda ns: __import__(
        "mambaserve.tools.eval", fromlist=["cli_qa"]).cli_qa(ns))

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mambaserve").setLevel(logging.INFO)  # pool sizes at start-up
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
