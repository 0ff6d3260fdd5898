"""vLLM's `bad_words`: words the generated text must not contain, as a token mask with the
interface of a request's grammar (`grammar.RequestGrammar`: `finished`, `advance`, `fill`), on
the structured-output bitmask that the sampler applies on the device
(layers/logits_processors.py).

A word is banned as the model would write it at the start of a text and after a space: the
token ids of `word.lstrip()` and of `" " + word.lstrip()`, both kept when they differ
(`bad_word_sequences`). A sequence of one token is never sampled. A longer sequence's last token
is masked at a step whose last generated tokens are the sequence's other tokens, so the
generated tokens never hold the whole sequence. Only generated tokens are matched: a sequence
that would begin in the prompt is not. Sequences of one token are a fixed mask; a longer one
depends on the request's last tokens, so its steps wait for them (`needs_host_tokens`: overlap
scheduling does not run such a request ahead).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mambaserve.layers.logits_processors import bitmask_words


def bad_word_sequences(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The distinct token id sequences of each word without and with a leading space."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


class BadWords:
    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the model's logits width: a bitmask row covers it
        row = np.full(bitmask_words(vocab_size), 0xFFFFFFFF, dtype=np.uint32)
        # longer sequences by the token before their last: a step looks up its last token only
        self._longer: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for seq in sequences:
            assert seq and all(0 <= t < vocab_size for t in seq), (seq, vocab_size)
            if len(seq) == 1:
                row[seq[0] // 32] &= ~np.uint32(1 << (seq[0] % 32))
            else:
                self._longer.setdefault(seq[-2], []).append((tuple(seq[:-1]), seq[-1]))
        self._row = row.view(np.int32)
        self.needs_host_tokens = bool(self._longer)
        self._output: Sequence[int] = ()

    @property
    def finished(self) -> bool:
        return False

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        self._output = output_token_ids
        return False

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed after the generated tokens last given to `advance` into
        `bitmask[row]` (int32 words, bit j of word i is token 32 * i + j)."""
        bitmask[row] = self._row
        out, words = self._output, bitmask[row].view(np.uint32)
        for prefix, last in self._longer.get(out[-1], ()) if len(out) else ():
            n = len(prefix)
            if len(out) >= n and tuple(out[len(out) - n:]) == prefix:
                words[last // 32] &= ~np.uint32(1 << (last % 32))
