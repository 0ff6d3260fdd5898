"""scripts/tp_check.py (the tensor-parallel exactness run of the GPU plan) on the CPU: the tiny
preset at two ranks (gloo) against one, float32 and bfloat16, its verdict and report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tp_check.py"


@pytest.fixture(scope="module")
def tp_check():
    spec = importlib.util.spec_from_file_location("tp_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_ranks_agree_with_one_on_the_tiny_preset(tp_check, tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBASERVE_TP_TIMEOUT_S", "60")
    out = tmp_path / "tp.json"
    rc = tp_check.main(["--preset", "tiny", "--tp", "2", "--device", "cpu", "--prompts", "3",
                        "--shared", "64", "--lens", "9,40,17", "--max-tokens", "5",
                        "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"]
    fp32 = report["compare"]["float32: tp2 vs tp1"]
    assert fp32["greedy_identical"] == fp32["of"] == 3 and fp32["max_abs_dlogprob"] <= 1e-4
    yard = report["compare"]["bfloat16 vs float32 at tp1 (yardstick)"]["max_abs_dlogprob"]
    assert 0 < yard  # bfloat16 really differs from float32, so the yardstick measures something
    assert all(r["cache_token_hit_rate"] > 0.3 for r in report["runs"].values())


def test_layers_needs_a_nemotron_h_pattern(tp_check):
    cfg = tp_check.truncated(tp_check.preset_config("nemotron-nano-9b-v2"), 6)
    assert cfg["num_hidden_layers"] == 6 and cfg["hybrid_override_pattern"] == "M-M-M-"
    with pytest.raises(ValueError, match="NemotronH"):
        tp_check.truncated(tp_check.preset_config("falcon-h1-7b"), 4)
