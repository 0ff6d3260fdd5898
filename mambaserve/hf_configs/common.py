"""Helpers the family readers share: key lookup with fallbacks, transformers' float encoding."""

from __future__ import annotations

import math
from typing import Any


def decode_float(value: Any) -> float:
    """transformers writes non-finite floats as {"__float__": "Infinity"}; JSON has no inf."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def getter(raw: dict[str, Any]):
    """get(*names, default=None): the first of `names` present in `raw` and not null."""
    def get(*names: str, default: Any = None) -> Any:
        for n in names:
            if n in raw and raw[n] is not None:
                return raw[n]
        return default
    return get


def eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def time_step_limit(raw: dict[str, Any]) -> tuple[float, float]:
    limit = getter(raw)("time_step_limit", "mamba_dt_limit", default=[0.0, math.inf])
    return (decode_float(limit[0]), decode_float(limit[1]))


def token_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """eos / bos / pad ids and the checkpoint dtype, read the same way for every family."""
    get = getter(raw)
    return {"eos_token_ids": eos_ids(raw), "bos_token_id": get("bos_token_id"),
            "pad_token_id": get("pad_token_id"),
            "torch_dtype": str(get("dtype", "torch_dtype", default="float32"))}


def rope_theta(raw: dict[str, Any], default: float = 10000.0) -> float:
    """transformers 5 keeps it in rope_parameters; hub configs write a top-level rope_theta."""
    params = raw.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    scaling = raw.get("rope_scaling")
    if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        raise ValueError(f"unsupported RoPE type {rope_type!r} / rope_scaling {scaling!r}: only "
                         "the default rotary embedding is implemented")
    return float(params.get("rope_theta", raw.get("rope_theta", default)))


def mamba_fields(raw: dict[str, Any], d_inner: int, d_inner_name: str) -> dict[str, Any]:
    """The Mamba2 mixer's sizes under the `mamba_*` keys Falcon-H1, Bamba and GraniteMoeHybrid
    share (their class defaults for missing keys), with transformers' dt clamps for them:
    `time_step_limit` in multi-token forwards, none in one-token steps, no time_step_min floor.
    `d_inner` is the mixer's inner size, named `d_inner_name` in errors."""
    get = getter(raw)
    heads = int(get("mamba_n_heads", default=128))
    head_dim = get("mamba_d_head", default="auto")
    head_dim = d_inner // heads if head_dim == "auto" else int(head_dim)
    if heads * head_dim != d_inner:
        raise ValueError(f"mamba_n_heads * mamba_d_head = {heads * head_dim} differs from "
                         f"{d_inner_name} = {d_inner}")
    limit = time_step_limit(raw)
    return dict(
        mamba_num_heads=heads, mamba_head_dim=head_dim,
        ssm_state_size=int(get("mamba_d_state", default=256)),
        n_groups=int(get("mamba_n_groups", default=1)),
        conv_kernel=int(get("mamba_d_conv", default=4)),
        chunk_size=int(get("mamba_chunk_size", default=256)),
        use_conv_bias=bool(get("mamba_conv_bias", default=True)),
        time_step_min=0.0, time_step_limit=limit,
        prefill_dt_limit=limit, decode_dt_limit=(0.0, math.inf),
    )
