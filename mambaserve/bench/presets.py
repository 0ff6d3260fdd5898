"""Model presets for benchmarks: HF config.json dicts at real shapes, and a writer that saves an
HF-format checkpoint folder (config.json + safetensors with `backbone.*` names) with random
weights generated directly in the target dtype on the target device. Benchmarks then load it
through the normal loader, so the real load path runs at scale (docs: /work/shared/BENCHMARKING.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

NANO_9B_V2_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"

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
}

_REVERSE_RENAMES = {"mixer.conv_weight": "mixer.conv1d.weight",
                    "mixer.conv_bias": "mixer.conv1d.bias",
                    "mixer.norm_weight": "mixer.norm.weight",
                    "mixer.experts_up": "mixer.experts.up_proj",
                    "mixer.experts_down": "mixer.experts.down_proj"}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return json.loads(json.dumps(PRESETS[name]))


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
