"""Shapes that cannot be sharded raise a ValueError naming the dimension (no processes needed:
sharding only slices, the collectives run in the forward); shapes that can, even when tp does
not divide them (the vocabulary, n_groups < tp), shard without error."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoint import make_tiny_checkpoint

from mambaserve.config import ModelConfig
from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.sharding import shard_model
from mambaserve.models.loader import load_model


def _load(path):
    return load_model(path, torch.float32, "cpu", ModelConfig.from_hf(path))


@pytest.mark.parametrize("tp, match", [
    (3, r"mamba_num_heads \(8\) is not divisible by tensor_parallel_size \(3\)"),
    (16, r"mamba_num_heads \(8\) is not divisible by tensor_parallel_size \(16\)"),
    (8, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(8\)"),
])
def test_indivisible_shapes_raise(tiny_ckpt, tp, match):
    with pytest.raises(ValueError, match=match):
        shard_model(_load(tiny_ckpt), TPGroup(0, tp))


@pytest.mark.parametrize("overrides, tp, match", [
    # 3 groups on 2 ranks: neither divides the other
    ({"mamba_num_heads": 12, "n_groups": 3, "layers": ["linear_attention"]}, 2,
     r"n_groups \(3\) and tensor_parallel_size \(2\): neither divides the other"),
    ({"moe_intermediate_size": 34, "layers": ["moe"]}, 4,
     r"moe_intermediate_size \(34\) is not divisible by tensor_parallel_size \(4\)"),
    ({"moe_shared_expert_intermediate_size": 50, "layers": ["moe"]}, 4,
     r"moe_shared_expert_intermediate_size \(50\) is not divisible by tensor_parallel_size"),
    ({"intermediate_size": 90, "layers": ["mlp"]}, 4,
     r"intermediate_size \(90\) is not divisible by tensor_parallel_size \(4\)"),
])
def test_indivisible_layer_shapes_raise(tmp_path, overrides, tp, match):
    path = make_tiny_checkpoint(tmp_path / "ck", **overrides)
    with pytest.raises(ValueError, match=match):
        shard_model(_load(path), TPGroup(1, tp))


def test_groups_fewer_than_ranks_and_odd_vocab_shard(tmp_path):
    """n_groups 1 on 4 ranks (norm group spanning them, B / C replicated), vocab 317 padded to
    320: rank 3 holds ids 240..316 and 3 zero rows."""
    path = make_tiny_checkpoint(tmp_path / "ck", n_groups=1, vocab_size=317)
    model = _load(path)
    whole = model.embeddings.weight.detach().clone()
    shard_model(model, TPGroup(3, 4))
    mixer = model.layers[0].mixer
    assert (mixer.num_heads, mixer.n_groups, mixer.d_inner) == (2, 1, 32)
    assert mixer.norm_span.group_size == 128 and mixer.norm_span.index == 0
    emb = model.embeddings
    assert (emb.start, emb.end, emb.weight.shape[0]) == (240, 317, 80)
    assert torch.equal(emb.weight[:77], whole[240:]) and not emb.weight[77:].any()
    assert model.lm_head.weight.shape == (80, 64) and model.lm_head.vocab_size == 317


def test_tp1_leaves_the_model_unchanged(tiny_ckpt):
    model = _load(tiny_ckpt)
    before = {n: p.clone() for n, p in model.named_parameters()}
    shard_model(model, TPGroup.single())
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
