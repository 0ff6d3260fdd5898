"""One token per row from its logits and the raw-logit logprob of that token: the sampler's
last stage in one op (`layers/sampler.py` has the semantics and runs top-k / top-p / min-p
before it, on the rows it passes as `proc`).

    ids, logprobs, lse = sample_rows(raw, proc, temperature, seed, step, all_greedy)

- raw [B, V]: the model's logits (any float dtype); the reported logprob is
  raw[b, id] - logsumexp(raw[b]) in float32;
- proc [B, V]: the logits the token is drawn from (raw itself, or raw after the logits
  processors: token mask, logit bias, penalties; with filters, the scaled and filtered rows at
  temperature 1);
- a row with temperature < GREEDY_EPS takes argmax(proc[b]) (the lowest index on ties), any
  other argmax(proc[b] / T + g), g the Gumbel noise of the row's (seed, step) at each token id
  (`gumbel_noise`: a counter-based 32-bit hash, so a row's token depends on nothing but its own
  logits and parameters);
- all_greedy (a host flag: every row greedy) skips the noise;
- lse [B]: each row's logsumexp(raw[b]) (for the top alternatives' logprobs).

    logprobs, lse = row_logprobs(raw, targets)

gives the raw-logit logprob of given tokens (prompt-logprob targets, a sampled token whose top
alternatives are asked for) and each row's logsumexp, in float32, through the same kernel:
neither copies the logits to float32 on CUDA.

The reference is the sampler's torch math; on CUDA one Triton launch does it all
(`ops/triton/sample_rows.py`): every program reduces one block of a row's vocabulary, and the
last of a row's programs to finish combines their partial results in a fixed order.
"""

from __future__ import annotations

import torch

from mambaserve.ops.dispatch import kernel_path

GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
_M32 = 0xFFFFFFFF
# lowbias32 multipliers (Wellons); the second is stored minus 2**32 so that x * C for x < 2**32
# stays within int64 range (no signed overflow): the low 32 bits of the product are unchanged.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B - (1 << 32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 bijection on int64 tensors holding values in [0, 2**32); in place, returns x."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_C2).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    return x


def counter_hash(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Hash of (seed, step, token_id): seed, step [B] int64 -> [B, V] int64 in [0, 2**32).

    For a fixed (seed, step) the map token_id -> hash is a bijection (no duplicates in a row).
    """
    key = _mix32((seed & _M32) ^ 0x243F6A88)  # >> on int64 is arithmetic: mask after shifting
    key = _mix32(key ^ ((seed >> 32) & _M32))
    key = _mix32(key ^ (step & _M32))
    key = _mix32(key ^ ((step >> 32) & _M32) ^ 0x9E3779B9)
    tok = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    tok = _mix32(tok ^ 0x85A308D3)
    return _mix32(key[:, None] ^ tok[None, :])


def hash_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """Map int64 hashes in [0, 2**32) to float32 uniforms strictly inside (0, 1).

    Uses the top 23 bits k: u = (2k + 1) / 2**24, exactly representable in float32, so u is
    never 0 or 1 (it lies in [2**-24, 1 - 2**-24]) and its mean is exactly 1/2.
    """
    return ((h >> 9) * 2 + 1).to(torch.float32).mul_(2.0**-24)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms strictly inside (0, 1): [B] int64 seed/step -> [B, V] float32."""
    return hash_to_uniform(counter_hash(seed, step, vocab_size))


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)): [B] int64 seed/step -> [B, V] float32."""
    u = uniform_noise(seed, step, vocab_size)
    return u.log_().neg_().log_().neg_()


def sample_rows(raw: torch.Tensor, proc: torch.Tensor, temperature: torch.Tensor,
                seed: torch.Tensor, step: torch.Tensor, all_greedy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw, proc [B, V] (last dim contiguous); temperature [B] float32; seed, step [B] int64
    -> (token ids [B] int64, logprobs [B] float32, lse [B] float32) as the module docstring
    says."""
    if kernel_path("sample_rows", raw.device) == "triton":
        from mambaserve.ops.triton.sample_rows import sample_rows_triton

        return sample_rows_triton(raw, proc, temperature, seed, step, all_greedy, GREEDY_EPS)
    return sample_rows_ref(raw, proc, temperature, seed, step, all_greedy)


def sample_rows_ref(raw, proc, temperature, seed, step, all_greedy):
    p = proc.float()
    greedy_ids = torch.argmax(p, dim=-1)
    if all_greedy:
        ids = greedy_ids
    else:
        is_greedy = temperature < GREEDY_EPS
        temp = torch.where(is_greedy, 1.0, temperature)
        scaled = p / temp[:, None]
        scaled.add_(gumbel_noise(seed, step, p.shape[-1]))
        ids = torch.where(is_greedy, greedy_ids, torch.argmax(scaled, dim=-1))
    return ids, *row_logprobs_ref(raw, ids)


def row_logprobs(raw: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [N, V] (last dim contiguous), targets [N] int -> (raw[n, targets[n]] - lse[n] [N],
    lse [N] = logsumexp(raw[n])), float32."""
    if kernel_path("sample_rows", raw.device) == "triton":
        from mambaserve.ops.triton.sample_rows import row_logprobs_triton

        return row_logprobs_triton(raw, targets)
    return row_logprobs_ref(raw, targets)


def row_logprobs_ref(raw, targets):
    x = raw.float()
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(1, targets.to(torch.int64)[:, None]).squeeze(1) - lse, lse
