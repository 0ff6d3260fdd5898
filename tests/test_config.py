import argparse
import dataclasses
import json
import math

import pytest

from mambaserve.config import EngineConfig, LayerKind, ModelConfig

BASE = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 100,
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8,
    "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
}


def write(tmp_path, **kw):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **kw}))
    return tmp_path


def test_hybrid_override_pattern(tmp_path):
    cfg = ModelConfig.from_hf(write(tmp_path, hybrid_override_pattern="M-M*E"))
    assert cfg.layer_kinds == (LayerKind.MAMBA, LayerKind.MLP, LayerKind.MAMBA,
                               LayerKind.ATTENTION, LayerKind.MOE)
    assert cfg.mamba_layer_ids == [0, 2] and cfg.attention_layer_ids == [3]
    assert cfg.pattern == "M-M*E"


def test_layers_block_type_and_infinity_encoding(tmp_path):
    cfg = ModelConfig.from_hf(write(
        tmp_path, layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
        time_step_limit=[0.0, {"__float__": "Infinity"}], time_step_min=0.002))
    assert cfg.pattern == "M-*E"
    assert cfg.time_step_limit == (0.0, math.inf)
    assert cfg.prefill_dt_limit == (0.002, math.inf)
    assert cfg.conv_dim == 4 * 8 + 2 * 2 * 8


def test_legacy_names(tmp_path):
    raw = {k: v for k, v in BASE.items() if k not in ("n_groups", "conv_kernel", "chunk_size")}
    (tmp_path / "config.json").write_text(json.dumps(
        {**raw, "hybrid_override_pattern": "M*", "mamba_n_groups": 4, "mamba_d_conv": 3,
         "mamba_chunk_size": 32}))
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size) == (4, 3, 32)


def test_unsupported_architecture_names_supported(tmp_path):
    with pytest.raises(ValueError, match="supported: NemotronHForCausalLM"):
        ModelConfig.from_hf(write(tmp_path, architectures=["LlamaForCausalLM"],
                                  model_type="llama", hybrid_override_pattern="*"))


@pytest.mark.parametrize("bad, match", [
    ({"hybrid_override_pattern": "MX"}, "unknown character 'X'"),
    ({"layers_block_type": ["mamba", "conv"]}, "unknown layer type 'conv'"),
    ({}, "neither hybrid_override_pattern nor layers_block_type"),
    ({"hybrid_override_pattern": "M", "mamba_num_heads": 5}, "multiple of n_groups"),
])
def test_bad_configs(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(write(tmp_path, **bad))


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed config.json"):
        ModelConfig.from_hf(tmp_path)


# ---- EngineConfig on the command line -----------------------------------------------------------

def _cli(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli(parser.parse_args(list(argv)))


def test_cli_defaults_are_the_field_defaults():
    assert _cli() == EngineConfig()


def test_every_engine_field_has_a_flag():
    argv = ["--dtype", "bf16", "--device", "cuda:1", "--max-num-seqs", "7",
            "--chunked-prefill-size", "96", "--max-model-len", "300", "--page-size", "32",
            "--memory-budget-gb", "0.5", "--gpu-memory-utilization", "0.5",
            "--mamba-ssm-dtype", "bfloat16", "--enable-prefix-caching",
            "--mamba-snapshot-interval", "64", "--seed", "9", "--enforce-eager",
            "--cuda-graph-max-bs", "8", "--cuda-graph-max-prefill-tokens", "64",
            "--cuda-graph-max-solo-tokens", "128",
            "--load-format", "dummy", "--async-scheduling",
            "--max-step-prefill-tokens", "128", "--quantization", "fp8",
            "--quantization-exclude", "lm_head,*.o_proj", "--tensor-parallel-size", "2",
            "--steady-step-prefill-tokens", "32", "--scheduling-policy", "priority"]
    want = EngineConfig(dtype="bf16", device="cuda:1", max_num_seqs=7, chunked_prefill_size=96,
                        max_model_len=300, page_size=32, memory_budget_bytes=2**29,
                        gpu_memory_utilization=0.5, mamba_ssm_dtype="bfloat16",
                        enable_prefix_caching=True, mamba_snapshot_interval=64, seed=9,
                        enforce_eager=True, cuda_graph_max_bs=8,
                        cuda_graph_max_prefill_tokens=64, cuda_graph_max_solo_tokens=128,
                        load_format="dummy",
                        async_scheduling=True, max_step_prefill_tokens=128,
                        quantization="fp8", quantization_exclude="lm_head,*.o_proj",
                        tensor_parallel_size=2, steady_step_prefill_tokens=32,
                        scheduling_policy="priority")
    # every field differs from its default, so a field without a flag would fail the equality
    default = EngineConfig()
    same = [f.name for f in dataclasses.fields(EngineConfig)
            if getattr(want, f.name) == getattr(default, f.name)]
    assert same == []
    assert _cli(*argv) == want
    assert _cli("--no-enforce-eager").enforce_eager is False
    assert _cli("--no-async-scheduling").async_scheduling is False


def test_cli_help_shows_the_defaults_and_the_budget_unit():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    text = " ".join(parser.format_help().split())
    assert "tokens per KV page (default: 16)" in text
    assert "(default: 0.85)" in text and "(default: 2048)" in text
    assert "GiB for the state + KV pools" in text and "bytes" not in text


@pytest.mark.parametrize("argv, match", [
    (["--memory-budget-gb", "0"], "--memory-budget-gb must be positive, got 0.0"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
    (["--page-size", "0"], "page_size must be >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (["--max-model-len", "1"], "max_model_len must be >= 2"),
    (["--device", "tpu"], "device must be cpu or cuda"),
    (["--cuda-graph-max-prefill-tokens", "-1"],
     r"cuda_graph_max_prefill_tokens must be >= 0 \(0 = off\), got -1"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be an integer >= 1, got 0"),
    (["--steady-step-prefill-tokens", "0"], "steady_step_prefill_tokens must be >= 1, got 0"),
])
def test_bad_engine_flags_are_one_line_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        _cli(*argv)


def test_from_cli_needs_the_engine_flags():
    with pytest.raises(ValueError, match="no --dtype: build the parser with EngineConfig"):
        EngineConfig.from_cli(argparse.Namespace(model=None))
