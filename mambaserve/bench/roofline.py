"""The roofline of the engine benchmarks: the device's ceilings, measured at start (FLOP/s of
a matmul in the benchmark's dtype, bytes/s of a device-to-device copy), and the model's work,
counted from its config (parameters by kind, prefill FLOPs, decode bytes per step).
`bench one-batch` divides the one by the other for MFU and the prefill / decode floors;
`bench profile` uses the ceilings and the counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


# ---- ceilings ------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): timings end here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, iters: int) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int | None = None) -> dict:
    """FLOP/s of an n^3 matmul (8192 on CUDA, 512 on a CPU), best of a few."""
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _best_time(lambda: torch.matmul(a, b), device, 10 if device.type == "cuda" else 3)
    return {"flops": 2 * n ** 3 / t, "n": n, "dtype": str(dtype).removeprefix("torch.")}


def copy_ceiling(device: torch.device, nbytes: int | None = None) -> dict:
    """Bytes/s (read + written) of a device-to-device copy (1 GiB on CUDA, 64 MiB on a CPU)."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), device, 10 if device.type == "cuda" else 3)
    return {"bytes_per_s": 2 * nbytes / t, "bytes": nbytes}


# ---- the model's work ----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts the figures need (from the model built on the meta device)."""

    params: int  # all parameters
    embedding: int  # the input embedding table (a gather, not a matmul)
    lm_head: int  # applied to one position per sequence in a prefill
    per_token: float  # parameters every token multiplies (MoE experts scaled by top-k / E)
    experts: int = 0  # routed expert parameters (all experts of all MoE layers)

    @staticmethod
    def of(config: dict) -> ModelCounts:
        from mambaserve.config import ModelConfig
        from mambaserve.models.registry import model_class

        cfg = ModelConfig.from_dict(config)
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
        total = emb = head = experts = 0
        per_token = 0.0
        for name, p in model.named_parameters(remove_duplicate=False):
            n = p.numel()
            total += n if name != "lm_head.weight" or not cfg.tie_word_embeddings else 0
            if name in ("embeddings.weight", "embed_tokens.weight"):
                emb += n
            elif name == "lm_head.weight":
                head += n
            elif "experts_" in name and cfg.n_routed_experts:
                per_token += n * cfg.num_experts_per_tok / cfg.n_routed_experts
                experts += n
            else:
                per_token += n
        return ModelCounts(total, emb, head, per_token, experts)

    def decode_weights(self, cfg, batch_size: int) -> float:
        """Weight parameters a decode step of `batch_size` rows must read: everything but the
        input embedding, with each MoE layer's routed experts counted by the expected size of
        the union the rows touch under uniform routing, E (1 - (1 - k/E)^B) experts (k for one
        row, nearly all of them at large batches)."""
        dense = self.params - self.embedding - self.experts
        if not self.experts:
            return float(dense)
        k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
        return dense + self.experts * (1.0 - (1.0 - k / E) ** batch_size)


def decode_weight_bytes(counts: ModelCounts, cfg, batch_size: int, dtype: torch.dtype,
                        fp8_params: int = 0) -> int:
    """Bytes of the weights a decode step reads: `decode_weights` at dtype's size, except the
    `fp8_params` stored as float8 (1 byte each; routed experts are never FP8, so the MoE union
    estimate applies to model-dtype weights only). FP8 scales (4 bytes per output row) are
    left out: under 0.1 % of the FP8 bytes at the 9B shapes."""
    return int((counts.decode_weights(cfg, batch_size) - fp8_params) * dtype.itemsize
               + fp8_params)


def prefill_flops(cfg, counts: ModelCounts, batch_size: int, input_len: int) -> float:
    """Model FLOPs of prefilling B prompts of L tokens, no cache: 2 per weight per token for
    every matmul weight, the lm_head on one position per sequence, causal attention scores and
    values (2 x 2 x heads x head_dim x L(L+1)/2 per attention layer), and the chunked SSD's
    matrix work per chunk of Q tokens (causal C·Bᵀ per group, chunk states and state-to-output
    per head, causal scores x inputs per head). Every row goes through every layer here: the
    engine computes the tail after the last token-mixing layer on the logits rows alone
    (models/output_rows.py), work this floor still counts (the targets were set on it)."""
    tokens = batch_size * input_len
    f = 2.0 * counts.per_token * tokens + 2.0 * counts.lm_head * batch_size
    causal = input_len * (input_len + 1) / 2
    f += len(cfg.attention_layer_ids) * batch_size * 4.0 * cfg.num_attention_heads * \
        cfg.head_dim * causal
    q, n, pdim = cfg.chunk_size, cfg.ssm_state_size, cfg.mamba_head_dim
    chunks = batch_size * -(-input_len // q)
    per_chunk = cfg.n_groups * 2.0 * n * q * (q + 1) / 2 + cfg.mamba_num_heads * (
        2.0 * q * pdim * n * 2 + 2.0 * pdim * q * (q + 1) / 2)
    return f + len(cfg.mamba_layer_ids) * chunks * per_chunk


def decode_step_bytes(cfg, weight_bytes: int, batch_size: int, context_len: int,
                      dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    """Bytes a decode step must move: every (non-embedding) weight once, each row's Mamba state
    read and written, each row's cached K/V read."""
    from mambaserve.cache.kv_pool import KVPool
    from mambaserve.cache.state_pool import StatePool

    state = StatePool.bytes_per_slot(cfg, dtype, ssm_dtype) * batch_size * 2
    kv_per_token = KVPool.bytes_per_page(cfg, 1, dtype)
    return weight_bytes + state + batch_size * context_len * kv_per_token
