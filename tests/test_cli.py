"""The `mambaserve` command line: the engine flags reach the engine, --seed is also the sampling
seed (the README's quick-start output is that of seed 0), every usage mistake is one line and a
non-zero exit before any model is loaded, --version, help with defaults, device auto."""

from __future__ import annotations

import argparse
import ast
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mambaserve
from mambaserve import LLM, SamplingParams
from mambaserve.cli import main
from mambaserve.config import EngineConfig, resolve_device

BUDGET_GB = "0.03"  # small pools: allocating the default 1 GiB costs seconds
REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def _sampled(llm: LLM, seed: int) -> str:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=seed,
                            ignore_eos=True)
    return llm.generate(["ab"], params)[0].outputs[0].text


def test_generate_seed_is_the_sampling_seed(tiny_ckpt, capsys):
    llm = LLM(tiny_ckpt, memory_budget_bytes=int(float(BUDGET_GB) * 2**30))
    ref = {seed: _sampled(llm, seed) for seed in (0, 5)}
    assert ref[0] != ref[5]  # else this test could not tell the seeds apart
    for seed in (0, 5):
        argv = ["generate", "ab", "--model", str(tiny_ckpt), "--memory-budget-gb", BUDGET_GB,
                "--max-tokens", "8", "--ignore-eos"]
        assert main(argv + (["--seed", str(seed)] if seed else [])) == 0
        assert capsys.readouterr().out == f"ab{ref[seed]}\n{'-' * 40}\n"


# ---- mistakes: one line, non-zero exit, nothing loaded -------------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Any engine construction fails the test: the mistakes below must be found before."""
    from mambaserve.engine import llm_engine

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was reported")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", refuse)


def _one_line_error(capsys, argv: list[str], expected: str, status: int = 2) -> str:
    assert main(argv) == status
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err + captured.out
    assert err.endswith("\n") and err.count("\n") == 1, err  # exactly one line
    assert ": error: " in err and expected in err, err
    return err


@pytest.mark.parametrize("argv, expected", [
    # files
    (["eval", "perplexity", "/nonexistent.txt"], "/nonexistent.txt: no such file"),
    (["eval", "qa", "README.md"], "README.md:1: not JSON (Expecting value, column 1)"),
    (["eval", "qa", "tests/fixtures"], "tests/fixtures is a folder, not a file"),
    (["eval", "qa", "tests/fixtures/qa_small.jsonl", "--shots", "99"], "none left to score"),
    (["eval", "qa", "tests/fixtures/qa_small.jsonl", "--limit", "0"], "limit must be >= 1"),
    (["eval", "qa", "tests/fixtures/qa_small.jsonl", "--max-tokens", "0"],
     "max_tokens must be an integer >= 1"),
    (["eval", "perplexity", "tests/fixtures/heldout.txt", "--window", "1"],
     "--window must be >= 2 tokens, got 1"),
    (["eval", "perplexity", "tests/fixtures/heldout.txt", "--out", "/nonexistent/x.json"],
     "--out /nonexistent/x.json: the folder /nonexistent does not exist"),
    (["generate", "x", "--model", "/nonexistent"], "no config.json found at /nonexistent"),
    # ports and addresses
    (["serve", "--port", "99999"], "--port must be in 0..65535 (0: any free port), got 99999"),
    (["serve", "--port", "http"], "argument --port: invalid int value: 'http'"),
    # flag values: each flag's own message
    (["generate", "x", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["generate", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "x", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["generate", "x", "--max-tokens", "100000"],
     "prompt 1 has 1 token: with --max-tokens 100000 it needs 100001, over the context of "
     "2048 tokens"),
    (["generate", "x", "--dtype", "bogus"], "dtype must be auto, float32, bfloat16 or float16"),
    (["generate", "x", "--mamba-ssm-dtype", "bogus"],
     "mamba_ssm_dtype must be float32, bfloat16 or float16, got 'bogus'"),
    (["generate", "x", "--device", "tpu"], "device must be cpu or cuda[:N], or auto"),
    (["generate", "x", "--page-size", "0"], "page_size must be >= 1, got 0"),
    (["generate", "x", "--memory-budget-gb", "-1"], "--memory-budget-gb must be positive"),
    (["generate", "x", "--load-format", "bogus"], "argument --load-format: invalid choice"),
    (["serve", "--scheduling-policy", "lifo"],
     "argument --scheduling-policy: invalid choice: 'lifo'"),
    (["generate"], "the following arguments are required: prompt"),
    (["bogus"], "argument COMMAND: invalid choice: 'bogus'"),
    (["bench", "one-batch", "--preset", "nope"], "unknown preset 'nope'"),
    (["bench", "one-batch", "--model", "/nonexistent"], "--model /nonexistent: no config.json"),
    (["bench", "one-batch", "--preset", "tiny", "--batch-size", "1,x"],
     "expected comma-separated integers, got '1,x'"),
    (["bench", "ab", "--preset", "tiny", "--rounds", "0"], "rounds, num-prompts, input-len"),
    (["bench", "ab", "--preset", "tiny", "--a", "nosuch=1"], "unknown engine setting 'nosuch'"),
    (["bench", "profile", "--preset", "tiny", "--steps", "0"], "--steps must be >= 1"),
])
def test_a_mistake_is_one_line_before_the_model_loads(argv, expected, capsys, no_model_load,
                                                      monkeypatch):
    monkeypatch.chdir(REPO)
    _one_line_error(capsys, argv, expected)


def test_a_bad_tuning_environment_stops_the_command_before_the_model_loads(
        capsys, no_model_load, monkeypatch):
    from mambaserve.ops.triton import tuning

    monkeypatch.setenv(tuning.TUNING_ENV, "fp8_gemv.prefetch_byte=0")
    tuning.env_values.cache_clear()
    try:
        _one_line_error(capsys, ["bench", "one-batch", "--preset", "tiny"],
                        "MAMBASERVE_TUNING: kernel 'fp8_gemv' has no knob 'prefetch_byte'")
    finally:
        monkeypatch.delenv(tuning.TUNING_ENV)
        tuning.env_values.cache_clear()


def test_the_error_names_the_command(capsys, no_model_load):
    err = _one_line_error(capsys, ["eval", "perplexity", "/nonexistent.txt"], "no such file")
    assert err.startswith("mambaserve eval perplexity: error: ")
    err = _one_line_error(capsys, ["generate", "x", "--page-size", "0"], "page_size")
    assert err == "mambaserve generate: error: page_size must be >= 1, got 0\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu(capsys, tiny_ckpt):
    _one_line_error(capsys, ["generate", "x", "--model", str(tiny_ckpt), "--device", "cuda"],
                    "torch sees no CUDA device")
    _one_line_error(capsys, ["bench", "ab", "--preset", "tiny", "--device", "cuda"],
                    "--device cuda was asked for but torch sees no CUDA device")


def test_a_port_in_use(capsys, no_model_load):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_line_error(capsys, ["serve", "--port", str(port)],
                        f"cannot listen on 127.0.0.1:{port}: Address already in use")


@pytest.mark.parametrize("argv, missing, expected", [
    (["serve"], {"fastapi", "uvicorn"}, "fastapi and uvicorn are not installed: pip install"),
    (["bench", "serve"], {"httpx"}, 'httpx is not installed: pip install "mambaserve[bench]"'),
    (["bench", "serve", "--plot", "p.png"], {"matplotlib"},
     'matplotlib is not installed: pip install "mambaserve[bench]"'),
    (["bench", "one-batch", "--preset", "tiny", "--backend", "hf"], {"transformers"},
     'transformers is not installed: pip install "mambaserve[hf]"'),
])
def test_a_missing_optional_package_names_the_pip_command(argv, missing, expected, capsys,
                                                          monkeypatch, no_model_load, tmp_path):
    import importlib.util

    from mambaserve import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else real(name, *a))
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, argv, expected)


def test_an_unreachable_server_is_one_line(capsys):
    pytest.importorskip("httpx")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _one_line_error(capsys, ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}"],
                    f"no model list from http://127.0.0.1:{port}/v1/models")


def test_the_installed_command_prints_no_traceback():
    """The real entry point in a fresh process (logging set up, nothing caught by pytest)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-m", "mambaserve.cli", "eval", "qa", "README.md"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr == ("mambaserve eval qa: error: README.md:1: not JSON (Expecting value, "
                           "column 1); eval qa reads JSONL, one {\"question\": ..., \"answer\": "
                           "\"... #### N\"} per line\n")


# ---- --version, help, device -----------------------------------------------------------------

def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"mambaserve {mambaserve.__version__}\n"


def _help(capsys, *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_the_defaults(capsys):
    top = _help(capsys)
    assert "serving engine for hybrid Mamba2" in top and "--version" in top
    for cmd in ("generate", "serve", "bench", "audit-syncs", "eval"):
        assert cmd in top
    gen = _help(capsys, "generate")
    assert "0: greedy (default: 0.8)" in gen
    assert "tokens generated per prompt at most (default: 64)" in gen
    assert "auto: cuda when torch sees a CUDA device, else cpu (default: auto)" in gen
    assert "GiB for the state + KV pools" in gen
    assert "(default: None)" not in gen
    ob = _help(capsys, "bench", "one-batch")
    assert "(default: auto)" in ob and "warm-up runs on the same shapes (default: 1)" in ob
    assert "(default: )" not in ob
    assert "(default: 3)" in _help(capsys, "bench", "ab")
    assert "decode steps profiled after the prefill (default: 8)" in _help(capsys, "bench",
                                                                          "profile")
    assert "per-request timeout (s) (default: 600.0)" in _help(capsys, "bench", "serve")
    assert "tokens per non-overlapping window (default: 512)" in _help(capsys, "eval",
                                                                      "perplexity")
    assert "(default: 4)" in _help(capsys, "eval", "qa")


def test_device_auto_is_every_default():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig().device == "auto" and resolve_device("auto") == want
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    from mambaserve.bench import ab, one_batch, profile

    for add_args in (one_batch.add_args, ab.add_args, profile.add_args):
        p = argparse.ArgumentParser()
        add_args(p)
        assert p.parse_args(["--preset", "tiny"]).device == "auto"
    assert one_batch.OneBatchConfig().device == "auto" and ab.ABConfig().device == "auto"
    c = ab.ABConfig(preset="tiny")
    c.validate()
    assert c.device == want


def test_the_engine_resolves_auto(tiny_ckpt):
    llm = LLM(tiny_ckpt, memory_budget_bytes=int(float(BUDGET_GB) * 2**30))
    assert llm.engine.config.device == "auto"
    assert llm.engine.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_no_module_imports_the_cli():
    """cli.py is the top of the import graph: a tool importing it back (even inside a function)
    makes an import cycle."""
    root = Path(mambaserve.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "cli.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "mambaserve.cli" or n.startswith("mambaserve.cli.") for n in names):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []


def _subcommands(parser: argparse.ArgumentParser, prefix=()) -> list[tuple[str, ...]]:
    out = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _subcommands(sub, prefix + (name,))
    return out


def test_every_command_has_help_with_no_unexplained_defaults(capsys):
    from mambaserve.cli import build_parser

    commands = _subcommands(build_parser())
    assert ("bench", "one-batch") in commands and ("eval", "qa") in commands
    for cmd in commands:
        text = _help(capsys, *cmd)
        assert "usage: mambaserve" in text, cmd
        assert "(default: None)" not in text and "(default: )" not in text, cmd


def test_the_parser_and_offline_commands_need_no_web_stack():
    """Building the CLI (every subcommand's flags, the parser names of `serve`) imports neither
    fastapi nor uvicorn, so `generate`, `bench` and `audit-syncs` run where they are missing."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"
            "from mambaserve.cli import build_parser\n"
            "build_parser().parse_args(['audit-syncs', '--device', 'cpu'])\n"
            "import mambaserve.server as s\n"
            "try:\n    s.create_app\nexcept ImportError:\n    print('lazy')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lazy"
