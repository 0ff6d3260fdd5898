"""`mambaserve bench kernels --dry`: the kernel benchmark's CPU smoke run (tiny shapes under the
Triton interpreter) through the CLI, on its two cheapest cases; and the peer loader's rewrite of
vLLM's imports."""

from __future__ import annotations

import json

import pytest
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.bench.kernels_peers import _replace_vllm_imports, load_vllm_conv
from mambaserve.cli import main
from mambaserve.ops.triton.activation import _relu2_kernel

require_interpreter(_relu2_kernel)


@pytest.mark.skipif(DEV != "cpu", reason="the dry run is the CPU smoke test")
def test_dry_run_through_the_cli(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    missing_peer = tmp_path / "absent.py"
    assert main(["bench", "kernels", "--dry", "--only", "decode,norm", "--out", str(out),
                 "--conv-peer", str(missing_peer)]) == 0
    res = json.loads(out.read_text())
    assert res["env"]["gpu"] == "cpu (dry run)" and res["conv_peer"] is False
    got = {(r["op"], r["impl"], r.get("batch", r.get("tokens"))) for r in res["rows"]}
    for op in ("ssu", "conv_update"):
        for impl in ("triton", "torch ref"):
            assert {(op, impl, 1), (op, impl, 3)} <= got
    assert {("gated_rmsnorm", "triton", 3), ("gated_rmsnorm", "torch ref", 3)} <= got
    # our kernels against the references on the timed inputs (fp16 on the CPU)
    errs = [r["rel_err"] for r in res["rows"] if r["impl"] == "triton"]
    assert len(errs) == 5 and all(e < 1e-2 for e in errs), errs
    printed = capsys.readouterr().out
    assert "conv peer not available" in printed and "| ssu | triton | 3 |" in printed


@pytest.mark.skipif(DEV != "cpu", reason="the dry run is the CPU smoke test")
def test_dry_moe_case(tmp_path):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--dry", "--only", "moe", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    got = {(r["op"], r["impl"], r["tokens"]) for r in rows}
    for op in ("moe dry-relu2", "moe dry-swiglu"):
        for impl in ("triton", "torch loop", "dense ref"):
            assert {(op, impl, 1), (op, impl, 20)} <= got
    for op in ("moe routing dry-relu2", "moe routing dry-swiglu"):
        for impl in ("triton", "torch"):
            assert {(op, impl, 1), (op, impl, 20)} <= got
    errs = [r["rel_err"] for r in rows if r["impl"] == "triton" and "rel_err" in r]
    assert len(errs) == 4 and all(e < 1e-2 for e in errs), errs


def test_unknown_case_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown case"):
        from mambaserve.bench.kernels import run

        run(["decode", "mlp"], False, str(tmp_path / "k.json"), True, None)


def test_vllm_imports_replaced_line_for_line(tmp_path):
    src = ("import torch\n"
           "from vllm.triton_utils import tl, triton\n"
           "    from vllm.attention.backends.utils import PAD_SLOT_ID\n"
           "x = 1\n")
    out = _replace_vllm_imports(src).splitlines()
    assert out == ["import torch", "import triton.language as tl; import triton",
                   "    PAD_SLOT_ID = -1", "x = 1"]
    with pytest.raises(ImportError, match="no stand-in"):
        _replace_vllm_imports("from vllm.platforms import current_platform\n")
    with pytest.raises(ImportError, match="unsupported"):
        _replace_vllm_imports("import vllm.envs as envs\n")
    bad = tmp_path / "causal_conv1d.py"
    bad.write_text("from vllm.platforms import current_platform\n")
    assert load_vllm_conv(bad) is None  # reported, not raised
