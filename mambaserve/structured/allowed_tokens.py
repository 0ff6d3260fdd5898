"""A fixed set of allowed tokens (vLLM's `allowed_token_ids`) as a token mask with the interface
of a request's grammar (`grammar.RequestGrammar`: `finished`, `advance`, `fill`), so it rides the
structured-output bitmask that the sampler applies on the device (layers/logits_processors.py).
The mask never depends on the tokens generated: the host need not see each token before the
next step (overlap scheduling keeps running ahead), and the request never ends because of it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mambaserve.layers.logits_processors import bitmask_words


class AllowedTokens:
    needs_host_tokens = False  # the mask is the same at every step

    def __init__(self, token_ids: Sequence[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the model's logits width: a bitmask row covers it
        words = np.zeros(bitmask_words(vocab_size), dtype=np.uint32)
        ids = np.unique(np.asarray(token_ids, dtype=np.int64))
        assert ids.size and 0 <= ids[0] and ids[-1] < vocab_size, (token_ids, vocab_size)
        np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
        self._row = words.view(np.int32)

    @property
    def finished(self) -> bool:
        return False

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        return False

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed tokens into `bitmask[row]` (int32 words, bit j of word i is token
        32 * i + j)."""
        bitmask[row] = self._row
