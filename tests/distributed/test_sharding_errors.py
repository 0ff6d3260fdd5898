"""Shapes that do not divide raise a ValueError naming the dimension (no processes needed:
sharding only slices, the collectives run in the forward)."""

from __future__ import annotations

import pytest
import torch

from mambaserve.config import ModelConfig
from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.sharding import shard_model
from mambaserve.models.loader import load_model


@pytest.mark.parametrize("tp, match", [
    (3, r"vocab_size \(320\) is not divisible by tensor_parallel_size \(3\)"),
    (16, r"mamba_num_heads \(8\) is not divisible by tensor_parallel_size \(16\)"),
    (4, r"n_groups \(2\) < tensor_parallel_size \(4\)"),
])
def test_indivisible_shapes_raise(tiny_ckpt, tp, match):
    model = load_model(tiny_ckpt, torch.float32, "cpu", ModelConfig.from_hf(tiny_ckpt))
    with pytest.raises(ValueError, match=match):
        shard_model(model, TPGroup(0, tp))


def test_tp1_leaves_the_model_unchanged(tiny_ckpt):
    model = load_model(tiny_ckpt, torch.float32, "cpu", ModelConfig.from_hf(tiny_ckpt))
    before = {n: p.clone() for n, p in model.named_parameters()}
    shard_model(model, TPGroup.single())
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
