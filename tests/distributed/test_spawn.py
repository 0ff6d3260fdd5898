"""The bounded launcher and the group's collectives on 2 gloo ranks."""

from __future__ import annotations

import time

import pytest
import torch

from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.spawn import run_on_ranks


def _collectives(tp: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.full((2, 3), float(tp.tp_rank + 1))
    return tp.all_reduce(x.clone()), tp.all_gather(x[:, :1] * 10, dim=-1)


def _fails_on_rank_1(tp: TPGroup) -> None:
    if tp.tp_rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(0.5)


def _hangs_on_rank_1(tp: TPGroup) -> None:
    if tp.tp_rank == 1:
        time.sleep(600)
    tp.all_reduce(torch.ones(1))


def test_collectives_two_ranks():
    for reduced, gathered in run_on_ranks(_collectives, 2, timeout_s=60):
        assert torch.equal(reduced, torch.full((2, 3), 3.0))
        assert torch.equal(gathered, torch.tensor([[10.0, 20.0], [10.0, 20.0]]))


def test_single_rank_collectives_are_identity():
    tp = TPGroup.single()
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x


def test_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*rank one is broken"):
        run_on_ranks(_fails_on_rank_1, 2, timeout_s=60)


def test_hanging_rank_times_out():
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)):
        run_on_ranks(_hangs_on_rank_1, 2, timeout_s=8)
    assert time.monotonic() - t0 < 30
