"""The commands shown in README.md and docs/*.md still work.

Every shell command of a fenced ```bash block, of an indented code block, or of an inline code
span that starts with `mambaserve ... --flag`, `python[3] scripts/...`, `python[3] -m pytest`
or `bash scripts/...` is checked:

* `mambaserve ...`: parsed by the real parser (a renamed or removed flag fails), the engine
  settings validated; the cheap ones also run on the CPU in-process (--help, --version,
  generate and eval with the demo model, with fewer tokens and smaller pools than written);
  the README's quick start runs exactly as written and must print the README's output;
* `python scripts/X.py ...`: the script exists and its argparse parser accepts the arguments;
* `python -m pytest PATHS`: the paths exist; `bash scripts/X.sh STAGE`: the script and stage exist;
* `pip install ...`: every extra named exists in pyproject.toml; `hf` / `huggingface-cli` /
  `curl`: network commands, not run; `lm_eval`: lm-evaluation-harness against a running
  server, not run; `torchrun ... -m mambaserve.cli CMD ...`: a multi-host launch, not run, its
  mambaserve command parsed and validated.

Python blocks compile; the ones that need neither a GPU, a server nor a download run. A
command of a kind this file does not know fails the test: teach it here or fix the doc.
Optional parts written in brackets (`[--seed S]`, `a|b`) are parsed as given (first choice).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

from mambaserve.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL_LANGS = {"bash", "sh", "shell"}
STARTS = ("mambaserve", "python", "python3", "bash", "pip", "hf", "huggingface-cli", "curl",
          "lm_eval", "torchrun")
INLINE = re.compile(r"`((?:mambaserve |python3? scripts/|python3? -m pytest|bash scripts/)"
                    r"[^`]*)`")
NETWORK = {"hf", "huggingface-cli", "curl", "lm_eval"}
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")


# ---- extraction --------------------------------------------------------------------------

def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def _commands(line: str) -> list[list[str]]:
    """argv lists of one shell line: comments dropped, split at && and ;, VAR=x prefixes and
    optional-part brackets removed."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as e:
        raise AssertionError(f"unparseable shell line {line!r}: {e}") from None
    cmds, cur = [], []
    for t in tokens + ["&&"]:
        if t in ("&&", ";", "||"):
            while cur and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cur[0]):
                cur.pop(0)
            if cur:
                cmds.append(cur)
            cur = []
            continue
        if not t.startswith("-") and "|" in t:
            t = t.split("|")[0]
        if t.startswith("["):  # "[--seed" of "[--seed S]"
            t = t[1:]
        if t.endswith("]") and "[" not in t:  # "S]"; not "mambaserve[bench]"
            t = t[:-1]
        if t.endswith("...") and t != "...":
            t = t[:-3]
        cur.append(t)
    return cmds


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every shell command in the docs, in order."""
    found = []
    for path in DOCS:
        text = path.read_text()
        name = path.relative_to(REPO).as_posix()
        for m in FENCE.finditer(text):
            if m.group(1) in SHELL_LANGS:
                for line in _logical_lines(m.group(2)):
                    found += [(name, argv) for argv in _commands(line)]
        rest = FENCE.sub("", text)
        for line in _logical_lines(rest):  # indented code blocks
            if line.startswith("    ") and line.split(maxsplit=1)[0] in STARTS:
                found += [(name, argv) for argv in _commands(line)]
        for m in INLINE.finditer(rest):
            span = " ".join(m.group(1).split())
            if span.startswith("mambaserve ") and " --" not in span and "--help" not in span:
                continue  # a bare command name in prose, not a command line
            found += [(name, argv) for argv in _commands(span)]
    return found


def python_blocks() -> list[tuple[str, str]]:
    return [(p.relative_to(REPO).as_posix(), m.group(2)) for p in DOCS
            for m in FENCE.finditer(p.read_text()) if m.group(1) == "python"]


COMMANDS = doc_commands()


# ---- checks --------------------------------------------------------------------------------

def _parse(argv: list[str]) -> argparse.Namespace | None:
    """The namespace of a mambaserve command line; None for --help / --version."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, err.getvalue().strip()
            return None


def _validate(args: argparse.Namespace) -> None:
    """The settings a command would check first, without running it."""
    from mambaserve.bench.one_batch import parse_settings
    from mambaserve.config import EngineConfig

    if hasattr(args, "dtype") and hasattr(args, "memory_budget_gb"):
        EngineConfig.from_cli(args)
    for flag in ("engine", "a", "b", "base"):
        if isinstance(getattr(args, flag, None), str):
            parse_settings(getattr(args, flag))
    if getattr(args, "preset", None):
        from mambaserve.bench.presets import preset_config

        preset_config(args.preset)


def _without_out(argv: list[str]) -> list[str]:
    if "--out" not in argv:
        return argv
    i = argv.index("--out")
    return argv[:i] + argv[i + 2:]


def _cheap_run(argv: list[str], tmp: Path) -> list[str] | None:
    """The argv to run on the CPU for a cheap documented command (bounded: fewer tokens, small
    pools, --out into tmp), else None."""
    args = _parse(argv)
    if args is None:
        return argv  # --help, --version
    if args.command not in ("generate", "eval") or args.model or args.device.startswith("cuda"):
        return None
    small = ["--memory-budget-gb", "0.05"]
    if args.command == "generate":
        return argv + small + ["--max-tokens", str(min(args.max_tokens, 12))]
    bounded = ["--max-tokens", "96", "--window", "48"] if args.eval_command == "perplexity" \
        else ["--limit", "1", "--max-tokens", "4"]
    return _without_out(argv) + small + bounded + ["--out", str(tmp / "out.json")]


def _pyproject_extras() -> set[str]:
    """The keys of [project.optional-dependencies] (read without tomllib: Python 3.10 has none)."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*=", section, re.M))


def _check_pip(argv: list[str]) -> None:
    extras = _pyproject_extras()
    for token in argv[2:]:
        m = re.fullmatch(r"(?:\.|mambaserve)\[([\w,-]+)\]", token)
        if m:
            for extra in m.group(1).split(","):
                assert extra in extras, f"pip extra [{extra}] is not in pyproject.toml"


class _Parsed(Exception):
    pass


def _check_script(script: Path, args: list[str], monkeypatch) -> None:
    """The script's own argparse parser accepts `args` (its main() stops right there)."""
    assert script.is_file(), f"{script} does not exist"
    if "ArgumentParser" not in script.read_text():
        return
    spec = importlib.util.spec_from_file_location(f"_doc_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, a=None, namespace=None):
        try:
            real(self, a, namespace)
        except SystemExit as e:
            if e.code:
                raise
        raise _Parsed  # parsed, or its --help printed

    err = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [str(script), *args])
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                module.main()
            except _Parsed:
                return
            except SystemExit:
                raise AssertionError(f"{script.name} {' '.join(args)}: "
                                     f"{err.getvalue().strip()}") from None
    raise AssertionError(f"{script.name}: main() returned without parsing its arguments")


def _check_other(argv: list[str], monkeypatch) -> None:
    head = argv[0]
    if head in NETWORK:
        return
    if head == "pip":
        _check_pip(argv)
        return
    if head == "torchrun":
        assert "mambaserve.cli" in argv, "torchrun runs -m mambaserve.cli in the docs"
        args = _parse(argv[argv.index("mambaserve.cli") + 1:])
        if args is not None:
            _validate(args)
        return
    if head in ("python", "python3") and argv[1:3] == ["-m", "pytest"]:
        for a in argv[3:]:
            if not a.startswith("-") and ("/" in a or a.endswith(".py")):
                assert (REPO / a.split("::")[0]).exists(), f"pytest path {a} does not exist"
        return
    if head in ("python", "python3") and argv[1].endswith(".py"):
        _check_script(REPO / argv[1], argv[2:], monkeypatch)
        return
    if head == "bash" and argv[1].startswith("scripts/"):
        script = REPO / argv[1]
        assert script.is_file(), f"{argv[1]} does not exist"
        text = script.read_text()
        for stage in argv[2:]:
            if not stage.isupper():  # STAGE is a placeholder
                assert re.search(rf"^stage_{re.escape(stage)}\(\)", text, re.M), f"no stage {stage}"
        return
    raise AssertionError(f"the docs test does not know the command {argv[0]!r}")


def test_the_docs_have_commands():
    """The extraction itself: a regex that stopped matching would make every check vacuous."""
    where = {w for w, _ in COMMANDS}
    assert {"README.md", "docs/demo_model.md", "docs/benchmarks.md", "docs/server.md"} <= where
    assert sum(argv[0] == "mambaserve" for _, argv in COMMANDS) >= 25
    assert ("README.md", ["mambaserve", "generate", "ROMEO:"]) in COMMANDS


def test_every_documented_command_parses_and_the_cheap_ones_run(tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.chdir(REPO)
    failures, ran = [], set()
    for where, argv in COMMANDS:
        try:
            if argv[0] != "mambaserve":
                _check_other(argv, monkeypatch)
                continue
            args = _parse(argv[1:])
            if args is not None and not any(PLACEHOLDER.fullmatch(t) for t in argv[1:]):
                _validate(args)  # values written as placeholders (PATH, NAME) only parse
            run = _cheap_run(argv[1:], tmp_path)
            if run is None or tuple(_without_out(run)) in ran:
                continue  # the same run with and without --out runs once
            ran.add(tuple(_without_out(run)))
            status = main(run)
            err = capsys.readouterr().err
            assert status == 0, err.strip().splitlines()[-1:]
        except (AssertionError, ValueError, OSError) as e:
            failures.append(f"{where}: {' '.join(argv)}\n    {e}")
    assert not failures, "\n".join(failures)
    assert len(ran) >= 6


def test_the_quick_start_prints_what_the_readme_shows(capsys):
    text = (REPO / "README.md").read_text()
    quick = text[text.index("## Quick start"):]
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(quick)][:2]
    assert blocks[0] == ("bash", 'pip install torch==2.13.0 . && mambaserve generate "ROMEO:"\n')
    assert blocks[1][0] == ""
    import torch

    on_cpu = ["--device", "cpu"] if torch.cuda.is_available() else []  # as the README says
    assert main(["generate", "ROMEO:", *on_cpu]) == 0
    shown = capsys.readouterr().out.split("-" * 40)[0]
    assert shown == blocks[1][1]


def test_python_blocks_compile_and_the_local_ones_run(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    ran = 0
    for where, src in python_blocks():
        code = compile(src, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        code_only = re.sub(r"#.*", "", src)  # "# or LLM(..., device='cuda')" is a comment
        if "from mambaserve import" in src and not re.search(
                r"cuda|path/to|models/|openai|ServerThread|await", code_only, re.I):
            exec(code, {"__name__": "__doc_block__"})
            ran += 1
    assert ran >= 1
    assert "ROMEO:" not in capsys.readouterr().err


def test_the_sync_audit_example_names_the_real_read_back():
    """docs/sync_audit.md's example names the step's one read-back by file, line and function:
    that line must still be it (else re-run `mambaserve audit-syncs` and paste its output)."""
    text = (REPO / "docs" / "sync_audit.md").read_text()
    sites = set(re.findall(
        r"\[readback\] to\(cpu\) at \.\.\./(mambaserve/[\w/]+\.py):(\d+) \((\w+)\)", text))
    assert sites
    for file, line, func in sites:
        source = (REPO / file).read_text()
        assert '.to("cpu", non_blocking=True)' in source.splitlines()[int(line) - 1], (file, line)
        enclosing = [n.name for n in ast.walk(ast.parse(source))
                     if isinstance(n, ast.FunctionDef) and n.lineno <= int(line) <= n.end_lineno]
        assert func in enclosing, (file, line, func, enclosing)


def test_the_readme_lists_the_supported_architectures_and_its_memory_arithmetic():
    import torch

    from mambaserve.bench.presets import param_count, preset_config
    from mambaserve.cache.kv_pool import KVPool
    from mambaserve.cache.state_pool import StatePool
    from mambaserve.config import ModelConfig
    from mambaserve.hf_configs import READERS

    text = " ".join((REPO / "README.md").read_text().split())
    listed = set(re.findall(r"`(\w+ForCausalLM)`", text.split("Other supported architectures")[1]
                            .split("##")[0]))
    assert listed == set(READERS)
    raw = preset_config("nemotron-nano-9b-v2")
    cfg = ModelConfig.from_dict(raw)
    n = param_count(raw)
    assert f"{n:,} parameters x 2 bytes (bf16)" in text
    assert f"| weights | {n * 2 / 2**30:.1f} GiB |" in text
    for ssm, shown in ((torch.float32, "| Mamba state per sequence | "),
                       (torch.bfloat16, "; ")):
        mib = StatePool.bytes_per_slot(cfg, torch.bfloat16, ssm) / 2**20
        assert f"{shown}{mib:.1f} MiB" in text, (ssm, mib)
    kib = KVPool.bytes_per_page(cfg, 16, torch.bfloat16) / 16 / 2**10
    assert f"| KV cache per token | {kib:.0f} KiB |" in text
    assert (len(cfg.mamba_layer_ids), len(cfg.attention_layer_ids)) == (27, 4)


def test_the_readme_is_a_complete_reference():
    """Every doc is linked from the README; every EngineConfig field and SamplingParams argument
    is in its Python API section; every command is in its command list."""
    import dataclasses

    from mambaserve import SamplingParams
    from mambaserve.config import EngineConfig

    text = (REPO / "README.md").read_text()
    for doc in (REPO / "docs").glob("*.md"):
        assert f"](docs/{doc.name})" in text, f"README does not link docs/{doc.name}"
    api = text.split("## Python API")[1].split("\n## ")[0]
    for f in dataclasses.fields(EngineConfig):
        assert f"{f.name}=" in api, f"README's Python API misses EngineConfig.{f.name}"
    for f in dataclasses.fields(SamplingParams):
        if f.init:
            assert f.name in api, f"README's Python API misses SamplingParams.{f.name}"
    listed = {argv[1] if argv[1] != "bench" else f"bench {argv[2]}" for where, argv in COMMANDS
              if where == "README.md" and argv[0] == "mambaserve" and argv[1:2] != ["--version"]
              and "--help" not in argv}
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in sub.choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    expected = {c for c in sub.choices if c != "bench"} | {f"bench {c}" for c in bench.choices}
    assert expected <= listed, f"README's command list misses {sorted(expected - listed)}"
