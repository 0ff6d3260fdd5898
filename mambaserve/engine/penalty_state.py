"""The per-request token counts behind presence / frequency / repetition penalties: a row of
device tensors per request that uses penalties, handed out on the host, kept on the device.

`counts` [R, V] int32 holds how often each token was generated, `prompt_seen` [R, V] bool which
tokens the prompt holds. Nothing is allocated until a request uses penalties; then 8 rows
(plus the scratch row 0), doubled when more requests with penalties run at once (the old rows
are copied on the device, in stream order: no sync). A request gets its row at its first
sampled step (the step that also resets the row and marks its prompt tokens, through the step's
one upload), and gives it back at the first plan after it finished. The sampler counts each
sampled token into its row on the device (`PenaltyBatch.record`), so the counts never wait for
the host: a plan that runs ahead of the last read-back (overlap scheduling) sees the same
counts.
"""

from __future__ import annotations

import numpy as np
import torch

from mambaserve.engine.request import Request
from mambaserve.layers.logits_processors import PenaltyBatch

PREFIX = "penalty."  # names of this state's arrays inside the sampling plan's arrays
FIRST_ROWS = 8


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.counts: torch.Tensor | None = None  # [1 + capacity, V] int32; row 0 is scratch
        self.prompt_seen: torch.Tensor | None = None  # [1 + capacity, V] bool
        self._owner: dict[int, Request] = {}  # row -> request holding it
        self._row_of: dict[int, int] = {}  # id(request) -> row (the request is kept alive above)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0] - 1

    @property
    def rows_in_use(self) -> int:
        return len(self._owner)

    def _release_finished(self) -> None:
        for row, req in list(self._owner.items()):
            if req.finished:
                del self._owner[row], self._row_of[id(req)]
                self._free.append(row)

    def _grow(self) -> None:
        old = self.capacity
        new = max(FIRST_ROWS, 2 * old)
        counts = torch.zeros(new + 1, self.vocab_size, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new + 1, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.counts is not None:
            counts[: old + 1].copy_(self.counts)
            seen[: old + 1].copy_(self.prompt_seen)
        self.counts, self.prompt_seen = counts, seen
        self._free.extend(range(new, old, -1))  # pop() hands out the lowest row first

    def plan(self, reqs: list[Request]) -> dict[str, np.ndarray] | None:
        """The step's penalty arrays for the sampled rows' requests (None when none of them uses
        penalties): each row's counts row and parameters, and the rows handed out now with
        their requests' prompt tokens. Rows of finished requests are taken back first."""
        if not any(r.params.uses_penalties for r in reqs):
            return None
        self._release_finished()
        slots = np.zeros(len(reqs), dtype=np.int64)
        new_slots, prompt_slots, prompt_ids = [], [], []
        for i, r in enumerate(reqs):
            if not r.params.uses_penalties:
                continue
            row = self._row_of.get(id(r))
            if row is None:
                if not self._free:
                    self._grow()
                row = self._free.pop()
                self._owner[row], self._row_of[id(r)] = r, row
                new_slots.append(row)
                prompt_slots.extend([row] * r.prompt_len)
                prompt_ids.extend(r.prompt_token_ids)
            slots[i] = row
        p = [r.params for r in reqs]
        arrays = {
            "slots": slots, "counted": (slots > 0).astype(np.int32),
            "presence": np.array([x.presence_penalty for x in p], dtype=np.float32),
            "frequency": np.array([x.frequency_penalty for x in p], dtype=np.float32),
            "repetition": np.array([x.repetition_penalty for x in p], dtype=np.float32),
            "new_slots": np.array(new_slots, dtype=np.int64),
            "prompt_slots": np.array(prompt_slots, dtype=np.int64),
            "prompt_ids": np.array(prompt_ids, dtype=np.int64)}
        return {PREFIX + k: v for k, v in arrays.items()}

    def on_device(self, tensors: dict[str, torch.Tensor]) -> PenaltyBatch:
        """The step's `PenaltyBatch` over the uploaded `plan` arrays (keys without the
        sampling plan's own prefix)."""
        n = len(PREFIX)
        t = {k[n:]: v for k, v in tensors.items() if k.startswith(PREFIX)}
        return PenaltyBatch(counts=self.counts, prompt_seen=self.prompt_seen, **t)
