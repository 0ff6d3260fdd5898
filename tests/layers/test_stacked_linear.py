"""stacked_linear: one projection whose output is the parts' outputs side by side; None when a
part is not a plain nn.Linear or only some parts have a bias."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.layers.stacked_linear import stacked_linear


def test_outputs_are_the_parts_outputs():
    torch.manual_seed(0)
    for bias in (False, True):
        parts = [nn.Linear(8, n, bias=bias) for n in (5, 3, 3)]
        x = torch.randn(4, 8)
        want = torch.cat([p(x) for p in parts], dim=-1)
        both = stacked_linear(parts)
        assert type(both) is nn.Linear and (both.bias is not None) == bias
        torch.testing.assert_close(both(x), want, rtol=1e-6, atol=1e-6)


def test_refuses_what_it_cannot_stack():
    assert stacked_linear([nn.Linear(8, 4), nn.Sequential(nn.Linear(8, 4))]) is None
    assert stacked_linear([nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False)]) is None
