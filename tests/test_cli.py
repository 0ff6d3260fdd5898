"""`mambaserve generate`: the engine flags reach the engine, and --seed is also the sampling
seed (the README's quick-start output is that of seed 0)."""

from __future__ import annotations

import ast
from pathlib import Path

import mambaserve
from mambaserve import LLM, SamplingParams
from mambaserve.cli import main

BUDGET_GB = "0.03"  # small pools: allocating the default 1 GiB costs seconds


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


def test_a_bad_engine_flag_is_a_one_line_error(tiny_ckpt, capsys):
    assert main(["generate", "x", "--model", str(tiny_ckpt), "--page-size", "0"]) == 2
    assert capsys.readouterr().err == "error: page_size must be >= 1, got 0\n"


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
