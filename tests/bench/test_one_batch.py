"""bench one-batch: settings parsing, preset checkpoints through the real loader, a CPU smoke
run of both backends and the CLI."""

import json
import statistics

import pytest
import torch

from mambaserve.bench.one_batch import (
    OneBatchConfig,
    format_result,
    format_table,
    int_list,
    parse_settings,
    run_one_batch,
)
from mambaserve.bench.one_batch_backends import MambaserveBackend
from mambaserve.bench.presets import (
    PRESETS,
    checkpoint_name,
    param_count,
    preset_config,
    write_checkpoint,
)
from mambaserve.bench.roofline import (
    ModelCounts,
    copy_ceiling,
    decode_step_bytes,
    matmul_ceiling,
    prefill_flops,
)
from mambaserve.config import ModelConfig


def test_parse_settings_types_values_by_field():
    s = parse_settings("enforce_eager=false, mamba_ssm_dtype=bfloat16,cuda_graph_max_bs=32,"
                       "max_model_len=none,enable_prefix_caching=1,gpu_memory_utilization=0.5")
    assert s == {"enforce_eager": False, "mamba_ssm_dtype": "bfloat16", "cuda_graph_max_bs": 32,
                 "max_model_len": None, "enable_prefix_caching": True,
                 "gpu_memory_utilization": 0.5}
    assert parse_settings("") == {} and parse_settings(None) == {}
    assert parse_settings("max_model_len=64") == {"max_model_len": 64}
    # every optional number is typed from the field's annotation, none listed by hand
    assert parse_settings("cuda_graph_max_solo_tokens=512,quantization=fp8") == {
        "cuda_graph_max_solo_tokens": 512, "quantization": "fp8"}
    with pytest.raises(ValueError, match="takes a number"):
        parse_settings("cuda_graph_max_bs=many")
    with pytest.raises(ValueError, match="unknown engine setting"):
        parse_settings("no_such=1")
    with pytest.raises(ValueError, match="key=value"):
        parse_settings("enforce_eager")
    with pytest.raises(ValueError, match="true/false"):
        parse_settings("enforce_eager=maybe")


def test_nano_preset_shapes():
    cfg = preset_config("nemotron-nano-9b-v2")
    m = ModelConfig.from_dict(cfg)
    assert m.num_layers == 56 and len(m.mamba_layer_ids) == 27
    assert len(m.attention_layer_ids) == 4 and m.pattern.count("-") == 25
    assert (m.hidden_size, m.intermediate_size, m.vocab_size) == (4480, 15680, 131072)
    assert (m.num_attention_heads, m.num_kv_heads, m.head_dim) == (40, 8, 128)
    assert (m.mamba_num_heads, m.mamba_head_dim, m.ssm_state_size, m.n_groups) == (128, 80, 128, 8)
    assert (m.conv_kernel, m.chunk_size) == (4, 128)
    assert abs(param_count(cfg) - 8.89e9) < 0.01e9
    cfg["hidden_size"] = 1  # a copy: the preset itself is untouched
    assert PRESETS["nemotron-nano-9b-v2"]["hidden_size"] == 4480
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("nope")


def test_nemotron_h_47b_preset_shapes():
    cfg = preset_config("nemotron-h-47b")
    m = ModelConfig.from_dict(cfg)
    assert m.num_layers == 98 and len(m.pattern) == 98
    assert (len(m.mamba_layer_ids), len(m.attention_layer_ids), m.pattern.count("-")) == (45, 5, 48)
    assert list(m.attention_layer_ids) == [17, 38, 49, 60, 86]
    assert "M---MM---M" in m.pattern
    assert (m.mamba_num_heads * m.mamba_head_dim, m.ssm_state_size) == (2 * 8192, 256)
    assert 46.5e9 < param_count(cfg) < 48.5e9


def test_checkpoint_names():
    assert checkpoint_name("layers.0.mixer.conv_weight") == "backbone.layers.0.mixer.conv1d.weight"
    assert checkpoint_name("layers.3.mixer.norm_weight") == "backbone.layers.3.mixer.norm.weight"
    assert checkpoint_name("embeddings.weight") == "backbone.embeddings.weight"
    assert checkpoint_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("shard_bytes", [4 << 30, 60_000])
def test_preset_checkpoint_loads_through_the_loader(tmp_path, shard_bytes):
    from safetensors import safe_open

    from mambaserve.models.loader import load_model

    path = write_checkpoint(preset_config("tiny"), tmp_path / "ck", dtype=torch.bfloat16,
                            shard_bytes=shard_bytes)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert (len(files) == 1) == (shard_bytes > 1e6)
    assert (path / "model.safetensors.index.json").exists() == (len(files) > 1)
    with safe_open(str(path / files[0]), "pt") as f:
        keys = list(f.keys())
        assert all(k.startswith(("backbone.", "lm_head.")) for k in keys)
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hybrid_override_pattern"] == "M-M*-M-" and cfg["torch_dtype"] == "bfloat16"
    model = load_model(path, torch.bfloat16, "cpu")  # raises on missing / misshaped tensors
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    assert torch.isfinite(model.lm_head.weight.float()).all()


def test_ceilings_and_bytes():
    mm = matmul_ceiling(torch.device("cpu"), torch.float32, n=64)
    cp = copy_ceiling(torch.device("cpu"), nbytes=1 << 20)
    assert mm["flops"] > 0 and cp["bytes_per_s"] > 0
    m = ModelConfig.from_dict(preset_config("nemotron-nano-9b-v2"))
    b = decode_step_bytes(m, 17_776_454_656, 1, 0, torch.bfloat16, torch.float32)
    # weights + 2 x (27 layers x fp32 SSM state 128 x 80 x 128 + bf16 conv state)
    state = 27 * (128 * 80 * 128 * 4 + 3 * (128 * 80 + 2 * 8 * 128) * 2)
    assert b == 17_776_454_656 + 2 * state


@pytest.mark.parametrize("backend", ["mambaserve", "hf"])
def test_one_batch_tiny_on_cpu(backend, tmp_path):
    logs = []
    rs = run_one_batch(OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[24],
                                      output_len=5, backend=backend, dtype="float32",
                                      save_reload=str(tmp_path / "ck")), log=logs.append)
    assert (tmp_path / "ck" / "config.json").exists()  # --save-reload keeps the checkpoint
    assert list((tmp_path / "ck").glob("*.safetensors"))
    (r,) = rs
    assert r.prefill_s > 0 and r.prefill_tokens_per_s > 0 and 0 < r.prefill_mfu
    assert len(r.decode_steps) == 4 and r.decode_step_s > 0 and r.decode_tokens_per_s > 0
    assert r.decode_bandwidth_fraction > 0 and "CPU" in r.note and not r.error
    text = format_result(r)
    assert "MFU" in text and "GB/s" in text and "CPU" in logs[0]


def test_one_batch_sweep_with_dummy_weights():
    """Without --save-reload the preset is drawn on the device (no safetensors); a sweep
    gives one result per (input length, batch size), prefill-only when output_len is 1."""
    rs = run_one_batch(OneBatchConfig(preset="tiny", batch_sizes=[1, 3], input_lens=[8, 20],
                                      output_len=1, dtype="float32"), log=lambda *_: None)
    assert [(r.input_len, r.batch_size) for r in rs] == [(8, 1), (8, 3), (20, 1), (20, 3)]
    assert all(r.prefill_s > 0 and not r.decode_steps for r in rs)
    table = format_table(rs)
    assert table.count("\n") == 5 and "| mambaserve | 3 | 20 |" in table


def test_prefill_flops_counts_matmuls_attention_and_ssd():
    cfg = preset_config("nemotron-nano-9b-v2")
    counts = ModelCounts.of(cfg)
    assert counts.params == param_count(cfg)
    assert counts.embedding == counts.lm_head == 131072 * 4480
    assert counts.per_token == counts.params - 2 * 131072 * 4480
    m = ModelConfig.from_dict(cfg)
    one = prefill_flops(m, counts, 1, 128)  # exactly one SSD chunk per row
    attn = 4 * 4 * 40 * 128 * (128 * 129 / 2)
    ssd = 27 * (8 * 2 * 128 * 128 * 129 / 2 + 128 * (4 * 128 * 80 * 128 + 2 * 80 * 128 * 129 / 2))
    assert one == pytest.approx(2 * counts.per_token * 128 + 2 * counts.lm_head + attn + ssd)
    # linear in the batch; the attention term grows quadratically with the length
    assert prefill_flops(m, counts, 4, 128) == pytest.approx(4 * one)
    assert prefill_flops(m, counts, 1, 256) > 2 * one


@pytest.mark.parametrize("name,E,k,H,I,rows,layers", [
    ("nemotron-3-nano-30b-a3b", 128, 6, 2688, 1856, 1856, 23),
    ("granite-4.0-h-small", 72, 10, 4096, 768, 2 * 768, 40)])
def test_moe_presets_count_active_parameters(name, E, k, H, I, rows, layers):
    cfg = preset_config(name)
    counts = ModelCounts.of(cfg)
    m = ModelConfig.from_dict(cfg)
    experts = layers * E * (rows + I) * H
    assert counts.experts == experts
    dense = counts.params - counts.embedding - experts
    # one row reads its k experts per layer; 64 rows nearly every expert
    assert counts.decode_weights(m, 1) == pytest.approx(dense + experts * k / E)
    assert counts.decode_weights(m, 64) == pytest.approx(
        dense + experts * (1 - (1 - k / E) ** 64))
    assert counts.per_token == pytest.approx(
        counts.params - counts.embedding - counts.lm_head * (not m.tie_word_embeddings)
        - experts + experts * k / E)
    tiny = ModelCounts.of(preset_config("tiny"))  # no experts: every weight
    tiny_cfg = ModelConfig.from_dict(preset_config("tiny"))
    assert tiny.decode_weights(tiny_cfg, 8) == tiny.params - tiny.embedding


def test_int_list():
    assert int_list("1,8, 32") == [1, 8, 32] and int_list("4") == [4]
    with pytest.raises(ValueError, match="comma-separated"):
        int_list("1,x")


def test_one_batch_cli(tmp_path, capsys):
    from mambaserve.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "one-batch", "--preset", "tiny", "--batch-size", "2", "--input-len", "16",
               "--output-len", "3", "--device", "cpu", "--dtype", "float32", "--out", str(out),
               "--engine", "enforce_eager=false"])
    assert rc == 0
    assert "prefill:" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["batch_size"] == 2
    assert main(["bench", "one-batch", "--preset", "tiny", "--device", "cpu",
                 "--engine", "bogus=1"]) == 2
    assert main(["bench", "one-batch", "--preset", "tiny", "--device", "cpu",
                 "--batch-size", "two"]) == 2


def test_one_batch_plain_prompts_are_fresh_with_the_prefix_cache_on():
    """With prefix caching on, each shape's prompts are its own: a longer prompt does not begin
    with a shorter one measured before it (that would time a cache hit, not a fresh prompt)."""
    rs = run_one_batch(OneBatchConfig(preset="tiny", batch_sizes=[1, 2], input_lens=[32, 64],
                                      output_len=2, dtype="float32",
                                      engine={"enable_prefix_caching": True}),
                       log=lambda *_: None)
    assert [r.cached_tokens for r in rs] == [[0], [0, 0], [0], [0, 0]]


def test_one_batch_repeats_report_the_median_ttft_of_fresh_prompts():
    """--repeats R: R timed runs per shape, each on prompts of its own (with the prefix cache on
    none is a hit); TTFT is their median, every run is kept, and the decode steps are pooled."""
    rs = run_one_batch(OneBatchConfig(preset="tiny", batch_sizes=[1], input_lens=[32],
                                      output_len=3, dtype="float32", repeats=3,
                                      engine={"enable_prefix_caching": True}),
                       log=lambda *_: None)
    (r,) = rs
    assert len(r.prefill_runs) == 3 and r.prefill_s == statistics.median(r.prefill_runs)
    assert len(r.decode_steps) == 3 * 2 and r.cached_tokens == [0]
    assert "median of 3:" in format_result(r)
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        run_one_batch(OneBatchConfig(preset="tiny", repeats=0))


def test_one_batch_cached_prefix_times_the_suffix_of_a_cache_hit():
    """--cached-prefix-len P: each timed prompt starts with P tokens an untimed earlier request
    put into the prefix cache; the cache serves all P of them (P is a snapshot-block multiple)."""
    rs = run_one_batch(OneBatchConfig(preset="tiny", batch_sizes=[2], input_lens=[8],
                                      output_len=3, dtype="float32", cached_prefix_len=64),
                       log=lambda *_: None)
    (r,) = rs
    assert r.cached_prefix_len == 64 and r.cached_tokens == [64, 64]
    assert r.prefill_s > 0 and len(r.decode_steps) == 2 and not r.error
    assert "cached prefix of 64 (cache served 64..64 tokens)" in format_result(r)
    with pytest.raises(ValueError, match="mambaserve backend"):
        run_one_batch(OneBatchConfig(preset="tiny", backend="hf", cached_prefix_len=64))


def test_one_batch_temperature_makes_every_request_sample(monkeypatch):
    """--temperature T (--top-p P): every request of the run (warm-up included) samples at T
    (through the nucleus filter); the result records both; the HF peer decodes greedily only."""
    seen = []
    submit = MambaserveBackend._submit

    def spy(self, prompts, params):
        seen.append((params.temperature, params.top_p))
        return submit(self, prompts, params)

    monkeypatch.setattr(MambaserveBackend, "_submit", spy)
    (r,) = run_one_batch(OneBatchConfig(preset="tiny", batch_sizes=[1], input_lens=[16],
                                        output_len=3, dtype="float32", temperature=0.8,
                                        top_p=0.9),
                         log=lambda *_: None)
    assert seen and set(seen) == {(0.8, 0.9)}
    assert r.temperature == 0.8 and r.top_p == 0.9 and len(r.decode_steps) == 2 and not r.error
    assert "sampling at temperature 0.8, top_p 0.9" in format_result(r)
    with pytest.raises(ValueError, match="--temperature"):
        run_one_batch(OneBatchConfig(preset="tiny", backend="hf", temperature=0.5))
    with pytest.raises(ValueError, match="--top-p"):
        run_one_batch(OneBatchConfig(preset="tiny", top_p=0.5))


def test_one_batch_hf_backend_runs_the_family_class(tmp_path):
    """The HF peer builds the checkpoint's own transformers class (here Mamba2ForCausalLM)."""
    from mambaserve.bench.one_batch_backends import HFBackend

    cfg = preset_config("mamba-codestral-7b")
    cfg.update(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, n_groups=2,
               state_size=16, vocab_size=256, chunk_size=16)
    path = write_checkpoint(cfg, tmp_path / "m2", dtype=torch.float32)
    backend = HFBackend(path, OneBatchConfig(model=str(path), dtype="float32", device="cpu"),
                         "auto")
    assert backend.architecture == "Mamba2ForCausalLM"
    prefill, steps = backend.run(1, 12, 3, seed=0)
    assert prefill > 0 and len(steps) == 2
