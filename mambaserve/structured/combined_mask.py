"""Several token masks of one request (structured output or allowed tokens, and bad words) as
one, with their common interface (`finished`, `advance`, `fill`, `needs_host_tokens`): a token
is allowed when every mask allows it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class CombinedMask:
    def __init__(self, masks: Sequence) -> None:
        assert len({m.vocab_size for m in masks}) == 1, [m.vocab_size for m in masks]
        self.masks = list(masks)
        self.vocab_size = masks[0].vocab_size
        self.needs_host_tokens = any(m.needs_host_tokens for m in masks)

    @property
    def finished(self) -> bool:
        return any(m.finished for m in self.masks)

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        done = [m.advance(output_token_ids) for m in self.masks]  # every mask sees the tokens
        return any(done)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self.masks[0].fill(bitmask, row)
        other = np.empty((1, bitmask.shape[1]), dtype=bitmask.dtype)
        for m in self.masks[1:]:
            m.fill(other, 0)
            bitmask[row] &= other[0]
