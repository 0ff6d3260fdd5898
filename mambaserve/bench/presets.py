"""Model presets for benchmarks: HF config.json dicts at real shapes, and a writer that saves an
HF-format checkpoint folder (config.json + safetensors with `backbone.*` names) with random
weights generated directly in the target dtype on the target device. Benchmarks then load it
through the normal loader, so the real load path runs at scale (the figures: docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

NANO_9B_V2_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
NEMOTRON_H_47B_PATTERN = ("M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
                          "M-M---MM---M-M*-M-M-M-M-M-")

PRESETS: dict[str, dict] = {
    # NVIDIA-Nemotron-Nano-9B-v2 shapes (its config.json values; 8.89 B parameters)
    "nemotron-nano-9b-v2": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": NANO_9B_V2_PATTERN, "num_hidden_layers": 56,
        "hidden_size": 4480, "intermediate_size": 15680, "mlp_hidden_act": "relu2",
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "mamba_num_heads": 128, "mamba_head_dim": 80, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "chunk_size": 128, "vocab_size": 131072,
        "max_position_embeddings": 131072, "layer_norm_epsilon": 1e-5,
        "use_conv_bias": True, "use_bias": False, "mlp_bias": False, "attention_bias": False,
        "tie_word_embeddings": False, "time_step_min": 0.001, "time_step_max": 0.1,
        "time_step_limit": [0.0, {"__float__": "Infinity"}], "residual_in_fp32": False,
        "rescale_prenorm_residual": True, "mamba_hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 12, "pad_token_id": 0, "torch_dtype": "bfloat16",
    },
    # a few-MB model of the same family for CPU smoke tests
    "tiny": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M*-M-", "num_hidden_layers": 7,
        "hidden_size": 64, "intermediate_size": 128, "mlp_hidden_act": "relu2",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
        "conv_kernel": 4, "chunk_size": 16, "vocab_size": 512,
        "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5,
        "use_conv_bias": True, "use_bias": False, "mlp_bias": False, "attention_bias": False,
        "tie_word_embeddings": False, "time_step_min": 0.001, "time_step_max": 0.1,
        "time_step_limit": [0.0, {"__float__": "Infinity"}], "residual_in_fp32": False,
        "mamba_hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16",
    },
    # Falcon-H1-7B shapes: transformers' FalconH1 docs table (44 layers, hidden 3072, 12 / 2
    # attention heads of 128, 24 Mamba heads of 128, state 256) and NVIDIA Megatron-Bridge's
    # FalconH1ModelProvider7B (intermediate 12288, vocab 130048, mamba_rms_norm, rope_theta 1e11);
    # the 7B multipliers were not found: these are Falcon-H1-0.5B's (Megatron-Bridge test
    # config), so the multiplies are timed. Every layer runs attention and Mamba in parallel.
    "falcon-h1-7b": {
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
        "num_hidden_layers": 44, "hidden_size": 3072, "intermediate_size": 12288,
        "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
        "mamba_d_ssm": 3072, "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_state": 256,
        "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 128,
        "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_rms_norm": True,
        "mamba_norm_before_gate": False, "projectors_bias": False, "attention_bias": False,
        "mlp_bias": False, "vocab_size": 130048, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5, "rope_theta": 1e11, "tie_word_embeddings": False,
        "embedding_multiplier": 5.656854249492381, "lm_head_multiplier": 0.0390625,
        "key_multiplier": 0.39062499999999994, "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.9375, "ssm_in_multiplier": 1.25,
        "ssm_out_multiplier": 0.23570226039551587,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5,
                            0.3535533905932738],
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "bos_token_id": 1, "eos_token_id": 11, "pad_token_id": 0, "torch_dtype": "bfloat16",
    },
    # granite-4.0-h-micro shapes (dense Granite-4.0-H: a shared SwiGLU MLP, no routed experts),
    # from a public granite4-h test config: 40 layers, attention every 6th of the first 36,
    # hidden 2048, 32 / 8 heads, MLP 8192, 64 Mamba heads of 64, state 128, NoPE, tied
    # embeddings; the vocabulary of the granite-4.0 family (100352, as -tiny and -small: the
    # test config's 100096 left its pad_token_id 100256 outside the table). The MoE -small is
    # the preset "granite-4.0-h-small" below.
    "granite-4.0-h-micro": {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "num_hidden_layers": 40,
        "layer_types": (["mamba"] * 5 + ["attention"]) * 6 + ["mamba"] * 4,
        "hidden_size": 2048, "intermediate_size": 8192, "shared_intermediate_size": 8192,
        "num_local_experts": 0, "num_experts_per_tok": 0,
        "num_attention_heads": 32, "num_key_value_heads": 8,
        "mamba_n_heads": 64, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "attention_bias": False, "position_embedding_type": "nope",
        "vocab_size": 100352, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625, "tie_word_embeddings": True,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256,
        "torch_dtype": "bfloat16",
    },
    # NVIDIA-Nemotron-3-Nano-30B-A3B: the config.json published with the checkpoint
    # (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16); 52 layers: 23 Mamba2, 23 MoE ("E": 128 relu²
    # experts of 1856, top-6 by sigmoid scores with a correction bias, normalized, x2.5, plus a
    # shared expert of 3712), 6 attention; 31.6 B parameters, ~3.5 B active per token
    "nemotron-3-nano-30b-a3b": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_hidden_layers": 52, "hidden_size": 2688, "intermediate_size": 1856,
        "mlp_hidden_act": "relu2", "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_routed_experts": 128,
        "n_shared_experts": 1, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "chunk_size": 128, "vocab_size": 131072,
        "max_position_embeddings": 262144, "layer_norm_epsilon": 1e-5,
        "use_conv_bias": True, "use_bias": False, "mlp_bias": False, "attention_bias": False,
        "tie_word_embeddings": False, "time_step_min": 0.001, "time_step_max": 0.1,
        "time_step_floor": 0.0001, "residual_in_fp32": False, "rescale_prenorm_residual": True,
        "mamba_hidden_act": "silu", "rope_theta": 10000, "partial_rotary_factor": 1.0,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16",
    },
    # granite-4.0-h-small (32 B, ~9 B active): the fields quoted from
    # ibm-granite/granite-4.0-h-small's config.json in a public write-up (hidden 4096, 40 layers
    # of which 4 attention, 32 / 8 heads, 72 SwiGLU experts of 768, top-10, shared MLP 1536,
    # state 128, conv 4, expand 2, vocab 100352, tied embeddings). Not found published, taken
    # from granite-4.0-h-micro: Mamba heads (128 of 64 = expand x hidden), groups, chunk, the
    # multipliers, and the attention layers' positions (placed evenly here; the step's cost does
    # not depend on where they sit).
    "granite-4.0-h-small": {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "num_hidden_layers": 40,
        "layer_types": (["mamba"] * 9 + ["attention"]) * 4,
        "hidden_size": 4096, "intermediate_size": 768, "shared_intermediate_size": 1536,
        "num_local_experts": 72, "num_experts_per_tok": 10,
        "num_attention_heads": 32, "num_key_value_heads": 8,
        "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "attention_bias": False, "position_embedding_type": "nope",
        "vocab_size": 100352, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625, "tie_word_embeddings": True,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256,
        "torch_dtype": "bfloat16",
    },
    # mistralai/Mamba-Codestral-7B-v0.1 (its HF-converted config.json as embedded in a public
    # benchmark file, transformers 4.44): 64 Mamba2 layers, hidden 4096, 128 heads of 64,
    # state 128, 8 groups, no attention
    "mamba-codestral-7b": {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
        "num_hidden_layers": 64, "hidden_size": 4096, "num_heads": 128, "head_dim": 64,
        "state_size": 128, "n_groups": 8, "expand": 2, "conv_kernel": 4, "chunk_size": 256,
        "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
        "residual_in_fp32": True, "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
        "vocab_size": 32768, "tie_word_embeddings": False, "norm_before_gate": True,
        "rms_norm": True, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
}

_REVERSE_RENAMES = {"mixer.conv_weight": "mixer.conv1d.weight",
                    "mixer.conv_bias": "mixer.conv1d.bias",
                    "mixer.norm_weight": "mixer.norm.weight",
                    "mixer.experts_up": "mixer.experts.up_proj",
                    "mixer.experts_down": "mixer.experts.down_proj"}


# Nemotron-H-47B-Base-8K shapes (nvidia/Nemotron-H-47B-Base-8K's config.json as transcribed,
# pattern verbatim, in a public model-catalog source file): 98 layers (45 Mamba2, 48 MLP, 5
# attention), hidden 8192, MLP 30720, 64 / 8 heads of 128, 256 Mamba heads of 64, state 256, 8
# groups; the fields not transcribed there as the 9B's. ~47 B parameters: 94 GB of bf16 weights,
# the preset that does not fit one H200 comfortably (tensor parallelism).
PRESETS["nemotron-h-47b"] = {
    **PRESETS["nemotron-nano-9b-v2"],
    "hybrid_override_pattern": NEMOTRON_H_47B_PATTERN, "num_hidden_layers": 98,
    "hidden_size": 8192, "intermediate_size": 30720,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
    "mamba_num_heads": 256, "mamba_head_dim": 64, "ssm_state_size": 256, "n_groups": 8,
    "max_position_embeddings": 8192, "eos_token_id": 2,
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return json.loads(json.dumps(PRESETS[name]))


# the widths `narrow_config` sets (where a family's config has the key): heads x head size of the
# Mamba mixer = 2 x hidden, attention heads x head_dim = hidden, 8 heads over any group count of
# the presets (1 or 8)
_NARROW = {
    "hidden_size": 64, "intermediate_size": 128, "shared_intermediate_size": 128,
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128, "mamba_d_state": 16,
    "num_heads": 8, "state_size": 16, "vocab_size": 512,
}


def narrow_config(config: dict) -> dict:
    """The same layers (kinds, count, order), chunk size, conv kernel and multipliers at tiny
    widths: what the host's per-step work depends on, at a size a CPU runs (`bench host
    --narrow`). Routed experts are cut to at most 8 (top-k to at most 2); token ids beyond the
    narrow vocabulary become 0."""
    out = json.loads(json.dumps(config))
    for key, value in _NARROW.items():
        if key in out:
            out[key] = value
    for key in ("n_routed_experts", "num_local_experts"):
        if out.get(key):
            out[key] = min(out[key], 8)
    if out.get("num_experts_per_tok"):
        out["num_experts_per_tok"] = min(out["num_experts_per_tok"], 2)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(out.get(key), int) and out[key] >= out["vocab_size"]:
            out[key] = 0
    return out


def checkpoint_name(param: str) -> str:
    """Our parameter name -> the HF checkpoint name (inverse of checkpoint_name_to_param)."""
    for ours, theirs in _REVERSE_RENAMES.items():
        if param.endswith(ours):
            param = param[: -len(ours)] + theirs
            break
    return param if param.startswith("lm_head.") else "backbone." + param


def write_checkpoint(config: dict, path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu", seed: int = 0,
                     shard_bytes: int = 4 << 30) -> Path:
    """Save `config` with random weights as an HF checkpoint folder (sharded over
    `shard_bytes`, with model.safetensors.index.json when more than one shard). Weights are
    drawn in `dtype` on `device`, one tensor at a time; only one shard is held at once."""
    from safetensors.torch import save_file

    from mambaserve.config import ModelConfig
    from mambaserve.models.random_weights import random_tensor
    from mambaserve.models.registry import model_class

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in model_class(cfg)(cfg).named_parameters()]
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, files, weight_map = 0, [], {}

    def flush() -> None:
        name = f"shard-{len(files):05d}.safetensors"
        save_file(shards[-1], str(path / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shards[-1]})
        shards[-1] = {}

    for name, shape in shapes:
        t = random_tensor(name, shape, dtype, device, gen, cfg.num_layers)
        ck = checkpoint_name(name)
        if name.endswith("conv_weight"):
            t = t.reshape(shape[0], 1, shape[1])  # HF conv1d layout [D, 1, K]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][ck] = t.contiguous().cpu()
        size += nbytes
    if shards[-1]:
        flush()
    if len(files) == 1:
        (path / files[0]).rename(path / "model.safetensors")
    else:
        total = sum((path / f).stat().st_size for f in files)
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_config(config: dict, path: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save only config.json: a folder the engine loads with `load_format="dummy"` (random
    weights drawn on the device at start-up, no checkpoint on disk)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def materialize_preset(name: str, save_reload: str | None, *, dtype: torch.dtype,
                       device: str | torch.device, seed: int = 0):
    """The folder a benchmark loads a preset from: with `save_reload`, a full safetensors
    checkpoint written there (the load path at scale); otherwise a temporary folder holding only
    config.json, loaded with `load_format="dummy"`. Returns (path, load_format, tempdir or None:
    the caller cleans it up)."""
    import tempfile

    if save_reload:
        path = write_checkpoint(preset_config(name), save_reload, dtype=dtype, device=device,
                                seed=seed)
        return path, "auto", None
    tmp = tempfile.TemporaryDirectory(prefix="mambaserve-preset-")
    return write_config(preset_config(name), tmp.name, dtype=dtype), "dummy", tmp


def param_count(config: dict) -> int:
    from mambaserve.config import ModelConfig
    from mambaserve.models.registry import model_class

    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(cfg)(cfg).parameters())
