"""The modules a sharded model swaps in, Megatron style, and the slicing helpers the layers'
`shard` methods share. Column-parallel projections need no module of their own: a plain
`nn.Linear` over the rank's rows of the weight (`keep_rows`). Row-parallel projections sum the
ranks' partial products (`RowParallelLinear`); the embedding and the lm_head split the
vocabulary (`VocabParallelEmbedding`, `VocabParallelLMHead`), padded with zero rows to a multiple
of tp when tp does not divide it (`vocab_shard`); the padded logits are dropped after the
all-gather, so callers see exactly vocab_size columns."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve.distributed.group import TPGroup
from mambaserve.ops.linear import linear


def shard_range(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `total`; ValueError when it does not divide."""
    if total % tp.tp_size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size "
                         f"({tp.tp_size})")
    n = total // tp.tp_size
    return tp.tp_rank * n, (tp.tp_rank + 1) * n


def shard_or_replicate_range(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """[start, end) of the `total` units (KV heads, B/C groups) this rank uses: an equal share
    when tp divides `total`, else the one unit shared by tp / total consecutive ranks (when
    `total` divides tp); ValueError when neither divides the other."""
    if total % tp.tp_size == 0:
        return shard_range(total, tp, what)
    if tp.tp_size % total == 0:
        unit = tp.tp_rank // (tp.tp_size // total)
        return unit, unit + 1
    raise ValueError(f"{what} ({total}) and tensor_parallel_size ({tp.tp_size}): neither "
                     "divides the other")


def param_of(t: torch.Tensor) -> nn.Parameter:
    """A new parameter holding a copy of `t` (a slice of a loaded one)."""
    with torch.no_grad():
        return nn.Parameter(t.detach().clone(memory_format=torch.contiguous_format))


def keep_rows(linear: nn.Linear, idx: torch.Tensor) -> None:
    """Column parallelism: `linear` keeps only output features `idx` (weight rows and bias)."""
    linear.weight = param_of(linear.weight[idx])
    if linear.bias is not None:
        linear.bias = param_of(linear.bias[idx])
    linear.out_features = len(idx)


class RowParallelLinear(nn.Module):
    """The rank's input columns of a linear layer: partial products summed over the ranks
    (all-reduce), then the bias once. `reduce=False`: the output is this rank's partial sum, the
    bias added on rank 0 only, for a caller that adds other partials before one all-reduce (the
    MoE block)."""

    def __init__(self, linear: nn.Linear, start: int, end: int, tp: TPGroup,
                 reduce: bool = True) -> None:
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.weight = param_of(linear.weight[:, start:end])
        self.bias = None if linear.bias is None else param_of(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        if not self.reduce:
            return out + self.bias if self.bias is not None and self.tp.tp_rank == 0 else out
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


def vocab_shard(weight: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, int, int]:
    """(this rank's rows of a [vocab, hidden] matrix, padded with zero rows to ceil(vocab / tp),
    start, end): the vocabulary padded to a multiple of tp and split evenly; the rank holds the
    real ids [start, end) (end - start may be less than its rows, or 0)."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // tp.tp_size)
    start = min(tp.tp_rank * per_rank, vocab)
    end = min(start + per_rank, vocab)
    with torch.no_grad():
        rows = weight.new_zeros(per_rank, weight.shape[1])
        rows[:end - start] = weight[start:end]
    return rows, start, end


class VocabParallelEmbedding(nn.Module):
    """The rank's rows [start, end) of the embedding table (`vocab_shard`: zero rows pad the
    last ranks' tables); ids outside them look up zeros, and the all-reduce adds the one rank's
    row that holds each id."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = embedding.num_embeddings
        rows, self.start, self.end = vocab_shard(embedding.weight, tp)
        self.weight = param_of(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class VocabParallelLMHead(nn.Module):
    """The rank's vocabulary rows of the output projection (`vocab_shard`'s padded rows); the
    logits of every rank are gathered and the padding columns dropped, so each rank holds the
    full [n, vocab_size] logits (sampling stays rank-identical)."""

    def __init__(self, weight: torch.Tensor | nn.Parameter, tp: TPGroup, vocab_size: int) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.weight = weight if isinstance(weight, nn.Parameter) else param_of(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(linear(x, self.weight), dim=-1)
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., :self.vocab_size].contiguous()  # the padding ids' columns dropped
