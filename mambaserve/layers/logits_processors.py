"""Per-row logits processing before sampling, on the device and sync-free: the structured-output
token mask, logit_bias, and presence / frequency / repetition penalties.

Each op leaves rows that do not use it bit-for-bit unchanged (an all-ones mask row, no bias
entry, neutral penalties 0 / 0 / 1 give back the same values), so a request's logits never
depend on the other rows of the batch. Every op is out of place: the caller's logits (the CUDA
graphs' static output buffer, the raw logits the reported logprobs come from) are never
written.

Order (vLLM's): token mask -> logit_bias -> repetition penalty -> frequency and presence
penalties; the sampler then applies temperature and the top-k / top-p / min-p filters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask covering `vocab_size` logits."""
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float, bitmask [B, ceil(V/32)] int32 where bit j of word i says whether
    token 32 * i + j is allowed -> logits with the disallowed tokens at -inf (new tensor).

    The bits are unpacked with shifts (an arithmetic shift keeps bit 31 readable through `& 1`),
    no data-dependent shapes."""
    b, v = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(b, -1)[:, :v].to(torch.bool)
    return logits.masked_fill(~allowed, NEG_INF)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """Add `values[i]` to logits[rows[i], token_ids[i]] (new tensor). rows, token_ids [N] int64,
    values [N] float32; each (row, token) pair appears at most once."""
    return logits.index_put((rows, token_ids), values.to(logits.dtype), accumulate=True)


@dataclass(frozen=True)
class PenaltyBatch:
    """One step's view of the per-request token counts kept on the device.

    `counts` [R, V] int32 (how often each token was generated) and `prompt_seen` [R, V] bool
    (the token occurs in the prompt) are per-request rows owned by
    `engine/penalty_state.PenaltyState`; row 0 is a scratch row that stays zero. This step's
    sampled row i reads row `slots[i]`; rows without penalties read the scratch row and have
    neutral parameters. New requests' rows are reset by `prepare`, and `record` counts the
    sampled tokens in place: the counts never come back to the host, so they do not depend on
    whether the host has read the last token yet.
    """

    counts: torch.Tensor  # [R, V] int32, updated in place
    prompt_seen: torch.Tensor  # [R, V] bool, updated in place
    slots: torch.Tensor  # [B] int64: each sampled row's counts row (0: scratch)
    counted: torch.Tensor  # [B] int32: 1 where the row's sampled token is counted, else 0
    presence: torch.Tensor  # [B] float32 (0 = off)
    frequency: torch.Tensor  # [B] float32 (0 = off)
    repetition: torch.Tensor  # [B] float32 (1 = off)
    new_slots: torch.Tensor  # [N] int64: rows handed to a request this step (reset first)
    prompt_slots: torch.Tensor  # [P] int64: with prompt_ids, the new rows' prompt tokens
    prompt_ids: torch.Tensor  # [P] int64

    def prepare(self) -> None:
        """Reset the rows handed out this step and mark their requests' prompt tokens."""
        if self.new_slots.numel():
            self.counts.index_fill_(0, self.new_slots, 0)
            self.prompt_seen.index_fill_(0, self.new_slots, False)
        if self.prompt_ids.numel():
            self.prompt_seen.index_put_((self.prompt_slots, self.prompt_ids),
                                        torch.ones_like(self.prompt_ids, dtype=torch.bool))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized logits [B, V] (new tensor); see `apply_penalties`."""
        return apply_penalties(logits, self.counts.index_select(0, self.slots),
                               self.prompt_seen.index_select(0, self.slots), self.presence,
                               self.frequency, self.repetition)

    def record(self, token_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens [B] in their requests' rows (in place)."""
        self.counts.index_put_((self.slots, token_ids.to(torch.int64)), self.counted,
                               accumulate=True)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32; counts [B, V] (generated-token counts), prompt_seen [B, V] bool;
    presence, frequency, repetition [B] float32 -> new logits:

    - repetition (transformers / vLLM): a token seen in the prompt or the output has its logit
      divided by the penalty when positive, multiplied by it otherwise;
    - frequency and presence (OpenAI): logit - frequency * count - presence * (count > 0),
      over the generated tokens only.
    """
    counts_f = counts.to(logits.dtype)
    generated = counts > 0
    rp = repetition.to(logits.dtype)[:, None]
    seen = prompt_seen | generated
    penalized = torch.where(logits > 0, logits / rp, logits * rp)
    out = torch.where(seen, penalized, logits)
    out = out - frequency.to(logits.dtype)[:, None] * counts_f
    return out - presence.to(logits.dtype)[:, None] * generated.to(logits.dtype)
