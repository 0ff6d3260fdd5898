"""The `mambaserve` command: generate, serve, eval, bench, audit-syncs (`mambaserve --help`).

Every mistake a user can make on the command line (a missing file, a bad flag value, a port out
of range, an optional package not installed) ends in one line, `<prog>: error: <problem>`, and
exit status 2 (1 for a run that failed its own check, e.g. audit-syncs finding a sync); the
checks that need no model run before it is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import socket
import sys
import time
from pathlib import Path

from mambaserve.config import EngineConfig

DESCRIPTION = ("A serving engine for hybrid Mamba2 language models (Nemotron-H and kin): "
               "generate text, serve an OpenAI-compatible HTTP API, evaluate perplexity and QA, "
               "benchmark, and audit host syncs. Without --model every command runs the "
               "embedded 6.6 M-parameter demo model (docs/demo_model.md).")

# optional packages -> the pip command that installs them (pyproject.toml's extras)
# (fastapi and uvicorn are in the default install; missing, the environment lost them)
INSTALL_HINTS = {"fastapi": "pip install fastapi uvicorn",
                 "uvicorn": "pip install fastapi uvicorn",
                 "httpx": 'pip install "mambaserve[bench]"',
                 "matplotlib": 'pip install "mambaserve[bench]"',
                 "transformers": 'pip install "mambaserve[hf]"'}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except for flags whose help already names the default and
    flags without one (None, or off for a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default == "":
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Defaults shown in every --help; a usage mistake is one line and exit status 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def missing_packages(*names: str) -> str | None:
    """None when every package in `names` is importable, else "<names> <is|are> not installed:
    <the pip command that installs them>"."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if not missing:
        return None
    hints = dict.fromkeys(INSTALL_HINTS.get(n, f"pip install {n}") for n in missing)
    return (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
            f"{' or '.join(hints)}")


def _add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")


def _engine_settings(a: argparse.Namespace) -> dict:
    """The EngineConfig flags of `a` as keyword arguments of LLM / serve."""
    return dataclasses.asdict(EngineConfig.from_cli(a))


def _check_generate(a: argparse.Namespace):
    """Everything `generate` can check without the model: the engine flags, the sampling flags,
    the checkpoint's config and every prompt's length against the context. -> SamplingParams."""
    from mambaserve.config import ModelConfig
    from mambaserve.default_model import default_model_path
    from mambaserve.engine.prompt import prompt_ids, validate_prompt_ids
    from mambaserve.engine.sampling_params import SamplingParams
    from mambaserve.engine.tokenizer import Tokenizer

    settings = _engine_settings(a)
    # the engine's --seed is also every prompt's sampling seed (the README's output is seed 0)
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens, seed=settings["seed"],
                            ignore_eos=a.ignore_eos)
    path = Path(a.model) if a.model is not None else default_model_path()
    cfg = ModelConfig.from_hf(path)
    context = settings["max_model_len"] or cfg.max_position_embeddings
    tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
    for i, prompt in enumerate(a.prompt, 1):
        _, ids = prompt_ids(prompt, tokenizer)
        validate_prompt_ids(ids, cfg.vocab_size, context)
        if len(ids) + a.max_tokens > context:
            raise ValueError(f"prompt {i} has {len(ids)} token{'s' * (len(ids) != 1)}: with "
                             f"--max-tokens {a.max_tokens} it needs {len(ids) + a.max_tokens}, "
                             f"over the context of {context} tokens (--max-model-len, default "
                             f"the checkpoint's max_position_embeddings)")
    return settings, params


def cmd_generate(a: argparse.Namespace) -> int:
    from mambaserve import LLM

    settings, params = _check_generate(a)
    t0 = time.perf_counter()
    llm = LLM(a.model, **settings)
    t1 = time.perf_counter()
    outs = llm.generate(list(a.prompt), params)
    t2 = time.perf_counter()
    for out in outs:
        print(f"{out.prompt}{out.outputs[0].text}")
        print("-" * 40)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[load {t1 - t0:.2f} s, generate {n} tokens in {t2 - t1:.2f} s]", file=sys.stderr)
    return 0


def _check_serve(a: argparse.Namespace) -> None:
    """What `serve` can check before loading the model: its packages, the engine flags, the
    port, and that the address can be bound."""
    problem = missing_packages("fastapi", "uvicorn")
    if problem:
        raise ValueError(problem)
    EngineConfig.from_cli(a)
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {a.port}")
    try:
        infos = socket.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {a.host!r} is not an address of this machine: {e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None


def _check_bench(a: argparse.Namespace) -> None:
    """The optional packages a bench command needs, before it starts."""
    need = []
    if a.bench_command == "serve":
        need = ["httpx"] + (["matplotlib"] if a.plot else [])  # --plot: matplotlib
    if getattr(a, "backend", None) == "hf":
        need.append("transformers")
    problem = missing_packages(*need)
    if problem:
        raise ValueError(problem)


def _check_outputs(a: argparse.Namespace) -> None:
    """--out / --plot files must go to an existing folder, and MAMBASERVE_TUNING must name known
    kernel knobs: found out before the run, not after."""
    for flag in ("out", "plot"):
        path = getattr(a, flag, None)
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"--{flag} {path}: the folder {Path(path).parent} does not exist")
    from mambaserve.ops.triton import tuning  # torch only, no Triton import

    tuning.env_values()


PREFLIGHT = {"serve": _check_serve, "bench": _check_bench}


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
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    api_key = a.api_key if a.api_key is not None else os.environ.get("MAMBASERVE_API_KEY")
    return serve(a.model_path or a.model, a.host, a.port, served_model_name=a.served_model_name,
                 max_waiting=None if a.max_waiting < 0 else a.max_waiting,
                 drain_timeout=a.drain_timeout, log_level=a.log_level, api_key=api_key or None,
                 allowed_origins=_csv(a.allowed_origins),
                 allowed_hosts=_csv(a.allowed_hosts) if a.allowed_hosts is not None else None,
                 max_body_bytes=max(1, int(a.max_body_mb * (1 << 20))),
                 timeout_keep_alive_s=a.timeout_keep_alive, timeout_header_s=a.timeout_header,
                 timeout_body_s=a.timeout_body, tool_call_parser=a.tool_call_parser,
                 reasoning_parser=a.reasoning_parser,
                 enable_prompt_tokens_details=a.enable_prompt_tokens_details,
                 trust_request_chat_template=a.trust_request_chat_template,
                 **_engine_settings(a))


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
    from mambaserve.server.reasoning_parsers import REASONING_PARSERS
    from mambaserve.server.tool_parsers import TOOL_PARSERS

    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format, read into tool_calls (vLLM's names; "
                        "nemotron_json: NemotronH, hermes / granite4: Granite 4.0); needed "
                        "for tool_choice auto (default: none)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice auto is on whenever "
                        "--tool-call-parser is given")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into reasoning_content (vLLM's names; "
                        "deepseek_r1: Nemotron-Nano-v2) (default: none)")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens, the prompt tokens "
                        "reused from the prefix cache (vLLM's flag; off: a cache hit tells a "
                        "client about other clients' prompts)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (vLLM's flag; off: a "
                        "request carrying one gets 400)")
    s.add_argument("--log-level", default="info", help="(default: %(default)s)")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench",
                       help="benchmarks: serve | one-batch | ab | profile | host | kernels")
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
    from mambaserve.bench import host_time

    hp = b_sub.add_parser("host", help="the host's time per step before the device starts on it "
                                       "(schedule, plan, upload)")
    host_time.add_args(hp)
    hp.set_defaults(func=host_time.run_cli)
    from mambaserve.bench import kernels

    kp = b_sub.add_parser("kernels", help="Triton kernels vs. the torch references and peer "
                                          "kernels (docs/kernels.md)")
    kernels.add_args(kp)
    kp.set_defaults(func=kernels.run_cli)


def build_parser() -> argparse.ArgumentParser:
    """The `mambaserve` parser with every subcommand (tests parse the documented commands with
    it)."""
    from mambaserve import __version__

    parser = _Parser(prog="mambaserve", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mambaserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for one or more prompts. --seed seeds the "
                                   "engine and is also every prompt's sampling seed.")
    g.add_argument("prompt", nargs="+", help="text to continue; several prompts run as one batch")
    _add_model_flag(g)
    EngineConfig.add_cli_args(g)
    g.add_argument("--max-tokens", type=int, default=64,
                   help="tokens generated per prompt at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.8,
                   help="0: greedy (default: %(default)s)")
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
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    pp = ev_sub.add_parser("perplexity", help="perplexity of a text file, windowed")
    pp.add_argument("file", help="UTF-8 text file")
    _add_model_flag(pp)
    EngineConfig.add_cli_args(pp)
    pp.add_argument("--window", type=int, default=512, help="tokens per non-overlapping window")
    pp.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    pp.add_argument("--out", default=None, help="also write the JSON result here")
    pp.set_defaults(func=lambda ns: __import__(
        "mambaserve.tools.eval", fromlist=["cli_perplexity"]).cli_perplexity(ns))
    qa = ev_sub.add_parser("qa", help="few-shot GSM8K-format QA accuracy (JSONL file)")
    qa.add_argument("file", help='JSONL, one {"question": ..., "answer": "... #### N"} per line')
    _add_model_flag(qa)
    EngineConfig.add_cli_args(qa)
    qa.add_argument("--shots", type=int, default=4, help="first N items as few-shot examples")
    qa.add_argument("--max-tokens", type=int, default=256, help="tokens generated per answer")
    qa.add_argument("--limit", type=int, default=None, help="score at most N questions")
    qa.add_argument("--out", default=None, help="also write the JSON result here")
    qa.set_defaults(func=lambda ns: __import__(
        "mambaserve.tools.eval", fromlist=["cli_qa"]).cli_qa(ns))

    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (argparse's own exits included)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mambaserve").setLevel(logging.INFO)  # pool sizes at start-up
    prog = " ".join(["mambaserve", args.command] + [
        getattr(args, k) for k in ("eval_command", "bench_command") if getattr(args, k, None)])
    try:
        _check_outputs(args)
        if args.command in PREFLIGHT:
            PREFLIGHT[args.command](args)
        return args.func(args)
    except ValueError as e:  # every check of the engine and the tools raises a ValueError
        return _fail(prog, str(e))
    except ImportError as e:
        name = (e.name or "").split(".")[0]
        return _fail(prog, f"{name or e} is not installed: "
                           f"{INSTALL_HINTS.get(name, f'pip install {name}')}")
    except OSError as e:  # a file that cannot be read or written
        return _fail(prog, f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    except _oom_error() as e:
        return _fail(prog, f"out of device memory ({str(e).splitlines()[0]}); lower "
                           f"--max-num-seqs, --max-model-len or --gpu-memory-utilization")
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", status=130)


def _oom_error() -> type[BaseException]:
    import torch

    return torch.OutOfMemoryError


def _fail(prog: str, message: str, status: int = 2) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
