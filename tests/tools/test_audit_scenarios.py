"""The engine's forwards perform zero host syncs; a step's only sync is the token read-back."""

import pytest
import torch

from mambaserve.cli import main
from mambaserve.config import EngineConfig
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.layers.mamba2_mixer import Mamba2Mixer
from mambaserve.tools.audit_scenarios import (
    CACHE_SCENARIOS,
    SCENARIOS,
    format_report,
    run_scenarios,
)


@pytest.fixture()
def engine(tiny_ckpt):
    # on the CPU: on a GPU the decode forwards replay a CUDA graph, which runs no Python forward
    # for an injected sync to sit in (and the sync would stop the graph's capture first)
    return LLMEngine(tiny_ckpt, EngineConfig(chunked_prefill_size=16, max_num_seqs=4,
                                             device="cpu"))


@pytest.mark.parametrize("caching", [False, True])
def test_every_scenario_is_sync_free(tiny_ckpt, caching):
    engine = LLMEngine(tiny_ckpt, EngineConfig(chunked_prefill_size=16, max_num_seqs=4,
                                               enable_prefix_caching=caching))
    results = run_scenarios(engine)
    report = format_report(results)
    assert set(results) == set(SCENARIOS + (CACHE_SCENARIOS if caching else ()))
    for name in results:
        r = results[name]
        assert r.forwards > 0, f"scenario {name} did not occur\n{report}"
        assert r.forward_syncs == 0, report
        assert r.sampler_syncs == 0, report
        # the only syncs of a step: one read-back, and only when a row produced a token
        assert r.step_syncs == r.readback_syncs == r.expected_readbacks, report
        assert r.readback_syncs <= r.forwards
    assert results["decode"].readback_syncs == results["decode"].forwards


def test_an_injected_sync_is_caught_and_attributed(engine, monkeypatch):
    original = Mamba2Mixer.forward

    def syncing_forward(self, x, meta, conv_state, ssm_state, **kw):
        if x.abs().max() > 1e9:  # a data-dependent branch: reads a device value  # SYNC-HERE
            pass
        return original(self, x, meta, conv_state, ssm_state, **kw)

    monkeypatch.setattr(Mamba2Mixer, "forward", syncing_forward)
    results = run_scenarios(engine)
    n_mamba = sum(1 for b in engine.model.layers if b.kind.value == "mamba")
    for name in SCENARIOS:
        r = results[name]
        assert r.forward_syncs == r.forwards * n_mamba
        assert r.by_layer_kind == {"mamba": r.forwards * n_mamba}
        assert not r.ok
        (site,) = [s for s in r.sites if "[forward]" in s]
        assert "test_audit_scenarios.py" in site and "syncing_forward" in site
        line = int(site.split(":")[-1].split()[0])
        source = open(__file__).read().splitlines()[line - 1]
        assert "SYNC-HERE" in source


def test_cli_audit_syncs(tiny_ckpt, capsys):
    assert main(["audit-syncs", "--model", str(tiny_ckpt), "--chunked-prefill-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "OK: zero host syncs inside every forward" in out
    for name in SCENARIOS:
        assert name in out


def test_cli_audit_syncs_takes_the_engine_flags(tiny_ckpt, capsys):
    # a budget too small for one state slot: the engine refuses it, so the flag reached it
    assert main(["audit-syncs", "--model", str(tiny_ckpt), "--memory-budget-gb", "1e-6"]) == 2
    assert "memory budget of 0.0 MiB is too small" in capsys.readouterr().err


def test_cli_audit_syncs_fails_on_a_sync(tiny_ckpt, capsys, monkeypatch):
    original = Mamba2Mixer.forward
    monkeypatch.setattr(Mamba2Mixer, "forward", lambda self, x, *a, **kw: (
        original(self, x, *a, **kw) if x.sum().item() is not None else None))
    # on the CPU: on a GPU the injected sync already stops the CUDA-graph capture at start-up
    assert main(["audit-syncs", "--model", str(tiny_ckpt), "--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_cuda_profile_is_gpu_only():
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU run of the CLI")
    from mambaserve.tools.audit_scenarios import cuda_profile_report  # noqa: F401
