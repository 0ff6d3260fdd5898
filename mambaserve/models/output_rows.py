"""The forward's tail on the rows whose logits the step needs, and on no others.

Only the layers that keep state across steps (Mamba mixers, attention) mix tokens. After the last
of them, each block (MLP, MoE) computes every row on its own, and so does that last mixer's
output part (a Mamba mixer's gated norm and out_proj, the z part of its in_proj, which only the
gated norm reads, and its scan's output launches; attention's o_proj: the scan's states, the
K / V and the cache writes need every row). Of the final hidden states
the forward reads only the rows `meta.logits_idx` selects, so a step with fewer logits rows than
token rows (any prefill without prompt logprobs: one row per prompt, none for a prompt's middle
chunk) computes that tail on those rows alone, gathered once where it starts. At the
Nemotron-Nano-9B-v2 shapes a 2,048-token prompt skips its last MLP's, last out_proj's and last
z projection's products on 2,047 rows (0.95 TFLOP of its 32). The rows kept get the values the
full forward gives them, by the kernels of a step of that many rows.

The row counts are shapes, so the choice needs no device value (no host sync) and a captured graph
makes it once. Where every row is a logits row (decode steps) nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def output_rows(logits_idx: torch.Tensor, tokens: int) -> torch.Tensor | None:
    """`logits_idx` where it selects fewer rows than the step's `tokens`, else None (the tail
    keeps every row)."""
    return logits_idx if logits_idx.shape[0] < tokens else None


def tail_start(stateful: Sequence[bool], takes_rows: Sequence[bool]) -> int | None:
    """The block from which only the logits rows need computing, over a model's blocks in order:
    the last stateful one where its output part takes `out_rows` (a lone Mamba mixer or
    attention), else the block after it; None where no block follows such a last stateful block
    that takes no rows, or none keeps state (`stateful[i]`: block i mixes tokens;
    `takes_rows[i]`: its output part takes `out_rows`)."""
    last = max((i for i, s in enumerate(stateful) if s), default=None)
    if last is None:
        return None
    if takes_rows[last]:
        return last
    return last + 1 if last + 1 < len(stateful) else None


def narrow(h: torch.Tensor, pending: torch.Tensor | None,
           rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream and the output not yet added to it (if any) at `rows`."""
    return h.index_select(0, rows), None if pending is None else pending.index_select(0, rows)
