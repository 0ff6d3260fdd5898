"""bench host: the narrowed presets keep their layers, the step clock, a CPU run through the
prefill graph, decode graph and eager paths, and the CLI."""

import json

import pytest
import torch

from mambaserve.bench.host_time import HostTimeConfig, StepClock, format_result, run_host_time
from mambaserve.bench.presets import PRESETS, narrow_config
from mambaserve.cli import main
from mambaserve.config import ModelConfig
from mambaserve.models.registry import model_class


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_narrow_config_keeps_the_layers_and_the_chunk_grid(name):
    wide, narrow = (ModelConfig.from_dict(c) for c in
                    (PRESETS[name], narrow_config(PRESETS[name])))
    assert narrow.layers == wide.layers
    assert (narrow.chunk_size, narrow.conv_kernel) == (wide.chunk_size, wide.conv_kernel)
    assert narrow.hidden_size == 64 and narrow.vocab_size == 512
    with torch.device("meta"):
        params = sum(p.numel() for p in model_class(narrow)(narrow).parameters())
    assert params < 20_000_000  # a CPU runs it


def test_step_clock_adds_up_a_phase_entered_twice():
    clock = StepClock()
    for _ in range(2):
        with clock.section("plan"):
            pass
    with clock.section("upload"):
        pass
    assert clock.start["plan"] <= clock.start["upload"]
    assert clock.seconds["plan"] > 0 and set(clock.seconds) == {"plan", "upload"}
    clock.reset()
    assert not clock.start and not clock.seconds


def _run(engine: dict) -> dict:
    c = HostTimeConfig(preset="tiny", device="cpu", dtype="float32", input_lens=[8, 80],
                       decode_batches=[2], repeats=2, warmup=1, engine=engine)
    return {r.scenario: r for r in run_host_time(c, log=lambda s: None)}


def test_cpu_run_times_each_path_and_its_phases():
    graphs = _run({"enforce_eager": False, "cuda_graph_max_prefill_tokens": 32,
                   "cuda_graph_max_solo_tokens": 64})
    assert graphs["prefill 8"].path == "prefill graph"
    assert graphs["prefill 80"].path == "eager"  # above the largest prefill-only bucket
    assert graphs["decode 2"].path == "decode graph"
    for r in graphs.values():
        us = r.us
        assert r.steps == 2 and min(us.values()) > 0
        assert us["prefix"] >= us["schedule"] + us["plan"] + us["upload"]
    eager = _run({"enforce_eager": True})
    assert {r.path for r in eager.values()} == {"eager"}


def test_start_is_the_heads_launch_where_a_head_starts(monkeypatch):
    """`start`: the forward's start (= prefix) for a step without a head; the end of the head's
    launch, before the planning, where a prefill-only step starts its head (engine/
    prefill_graph.py; on a CPU the head runs inside that launch)."""
    from mambaserve.engine import prefill_graph

    engine = {"enforce_eager": False, "cuda_graph_max_prefill_tokens": 32}
    plain = _run(engine)["prefill 8"].us  # bucket 16: below HEAD_MIN_TOKENS
    assert plain["start"] == plain["prefix"]
    monkeypatch.setattr(prefill_graph, "HEAD_MIN_TOKENS", 0)
    runs = _run(engine)
    early = runs["prefill 8"].us
    assert early["schedule"] < early["start"] < early["prefix"] - early["plan"]
    dec = runs["decode 2"].us
    assert dec["start"] == dec["prefix"]


def test_follow_up_turn_after_a_cached_history():
    """--cached-prefix-len: the timed step is a suffix after a history the cache serves whole
    (a restore, then the suffix through a prefill graph)."""
    c = HostTimeConfig(preset="tiny", device="cpu", dtype="float32", input_lens=[8],
                       decode_batches=[1], repeats=2, warmup=1, cached_prefix_len=64,
                       engine={"enforce_eager": False, "cuda_graph_max_prefill_tokens": 32})
    pre, dec = run_host_time(c, log=lambda s: None)
    assert (pre.scenario, pre.path, pre.cached_tokens) == ("prefill 8 after 64", "prefill graph",
                                                           64)
    assert "64 cached" in format_result(pre) and dec.cached_tokens == 0
    fresh = _run({"enforce_eager": False, "cuda_graph_max_prefill_tokens": 32})["prefill 8"]
    assert fresh.cached_tokens == 0


def test_new_lengths_leave_every_step_without_a_template(tiny_ckpt):
    """--new-lengths: each lone prompt has a length no step before it had, so none finds a
    template (and a fresh key seen once leaves none: engine/prefill_template.py); without it the
    scenario's prompts share one, kept from the length's second prompt on."""
    from mambaserve import LLM
    from mambaserve.bench.host_time import HostTimer, time_prefill

    eng = LLM(tiny_ckpt, device="cpu", max_model_len=96, max_num_seqs=2, enforce_eager=False,
              cuda_graph_max_prefill_tokens=32).engine
    templates = eng.runner.prefill_graph_runner.templates
    timer = HostTimer(eng)
    vocab = eng.model_config.vocab_size
    for new, n, held in ((True, 24, 0), (False, 20, 1)):
        c = HostTimeConfig(preset="tiny", input_lens=[n], repeats=3, warmup=1, new_lengths=new)
        r = time_prefill(timer, vocab, n, c)
        assert (r.path, r.steps) == ("prefill graph", 3)
        assert r.scenario == f"prefill {n}" + (" new lengths" if new else "")
        assert len(templates) == held  # 24, 23, 22, 21 once each; then 20 four times
    timer.close()


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="exactly one of --model"):
        HostTimeConfig().validate()
    with pytest.raises(ValueError, match="--narrow applies to a --preset"):
        HostTimeConfig(model="x", narrow=True).validate()
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        HostTimeConfig(preset="tiny", repeats=0).validate()
    with pytest.raises(ValueError, match="--cached-prefix-len must be >= 0"):
        HostTimeConfig(preset="tiny", cached_prefix_len=-1).validate()
    with pytest.raises(ValueError, match="--new-lengths needs every --input-len >= warmup"):
        HostTimeConfig(preset="tiny", input_lens=[8, 40], repeats=6, warmup=3,
                       new_lengths=True).validate()


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--preset", "nemotron-nano-9b-v2", "--narrow", "--device",
                 "cpu", "--dtype", "float32", "--input-len", "16", "--decode-batch", "1",
                 "--repeats", "1", "--warmup", "0", "--engine", "enforce_eager=true",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["scenario"] for r in rows] == ["prefill 16", "decode 1"]
    assert "prefix" in capsys.readouterr().out


def test_cprofile_lists_the_profiled_prefill_prefixes(capsys):
    """--cprofile N: the timed prefill steps' prefixes ran under cProfile, the forward not (on a
    CPU it would be nearly all of the profile); its two tables follow them."""
    assert main(["bench", "host", "--preset", "nemotron-nano-9b-v2", "--narrow", "--device",
                 "cpu", "--dtype", "float32", "--input-len", "16", "--decode-batch", "1",
                 "--repeats", "1", "--warmup", "0", "--engine", "enforce_eager=true",
                 "--cprofile", "400"]) == 0
    out = capsys.readouterr().out
    assert "Ordered by: internal time" in out and "Ordered by: cumulative time" in out
    assert "runner.py" in out and "plan_metadata" in out and "upload" in out
    assert "mamba2_mixer.py" not in out and "nemotron_h.py" not in out
