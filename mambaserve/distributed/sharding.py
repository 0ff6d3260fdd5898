"""Shard a loaded model for tensor parallelism, in place: each Mamba2 mixer, attention, MLP and
MoE block keeps this rank's heads / channels (their `shard` methods), the embedding and the
lm_head their vocabulary rows (padded to a multiple of tp). Works on every model of the engine
(NemotronH's blocks and the shared hybrid decoder)."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.parallel_modules import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_shard,
)
from mambaserve.layers.attention import Attention
from mambaserve.layers.mamba2_mixer import Mamba2Mixer
from mambaserve.layers.mlp import MLP, GatedMLP
from mambaserve.layers.moe import MoE

SHARDED = (Mamba2Mixer, Attention, MLP, GatedMLP, MoE)


def _shardable(module: nn.Module) -> list[nn.Module]:
    """The outermost sharded layers under `module` (an MoE shards its own shared expert)."""
    if isinstance(module, SHARDED):
        return [module]
    return [m for child in module.children() for m in _shardable(child)]


def shard_model(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Shard `model` (weights loaded whole) for rank `tp.tp_rank` of `tp.tp_size`; a ValueError
    names the first dimension that does not divide. Returns `model`."""
    if tp.tp_size == 1:
        return model
    if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        raise ValueError("tensor parallelism with FP8 weights is not supported yet")
    for layer in model.layers:
        shard_layer(layer, tp)
    return shard_vocab(model, tp)


def shard_layer(layer: nn.Module, tp: TPGroup) -> None:
    """One decoder layer of a model (`model.layers[i]`), sharded in place: its mixers, MLP and
    MoE keep this rank's heads / channels."""
    for module in _shardable(layer):
        module.shard(tp)


def shard_vocab(model: nn.Module, tp: TPGroup) -> nn.Module:
    """The embedding and the lm_head of `model` swapped for their vocab-parallel shards (a tied
    head stays tied). Returns `model`."""
    embed_name = next(n for n, m in model.named_children() if isinstance(m, nn.Embedding))
    embedding = getattr(model, embed_name)
    tied = model.lm_head.weight is embedding.weight
    vocab = VocabParallelEmbedding(embedding, tp)
    setattr(model, embed_name, vocab)
    head = vocab.weight if tied else vocab_shard(model.lm_head.weight, tp)[0]
    model.lm_head = VocabParallelLMHead(head, tp, vocab.vocab_size)
    return model
