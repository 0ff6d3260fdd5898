"""stacked_linear: one projection whose output is the parts' outputs side by side; summed_linear:
one projection of the parts' inputs side by side whose output is the sum of theirs. None when a
part is not a plain linear (nn.Linear or `Linear`), only some parts have a bias, or (summed) the
outputs differ in width."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.layers.linear import Linear, is_plain_linear
from mambaserve.layers.stacked_linear import stacked_linear, summed_linear


def test_outputs_are_the_parts_outputs():
    torch.manual_seed(0)
    for bias in (False, True):
        parts = [nn.Linear(8, 5, bias=bias), Linear(8, 3, bias=bias), Linear(8, 3, bias=bias)]
        x = torch.randn(4, 8)
        want = torch.cat([p(x) for p in parts], dim=-1)
        both = stacked_linear(parts)
        assert type(both) is Linear and (both.bias is not None) == bias
        torch.testing.assert_close(both(x), want, rtol=1e-6, atol=1e-6)


def test_refuses_what_it_cannot_stack():
    assert stacked_linear([nn.Linear(8, 4), nn.Sequential(nn.Linear(8, 4))]) is None
    assert stacked_linear([nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False)]) is None


def test_summed_output_is_the_parts_outputs_added():
    torch.manual_seed(2)
    for bias in (False, True):
        parts = [nn.Linear(5, 6, bias=bias), Linear(7, 6, bias=bias)]
        xa, xb = torch.randn(3, 5), torch.randn(3, 7)
        both = summed_linear(parts)
        assert type(both) is Linear and both.in_features == 12 and (both.bias is not None) == bias
        torch.testing.assert_close(both(torch.cat([xa, xb], dim=-1)),
                                   parts[0](xa) + parts[1](xb), rtol=1e-6, atol=1e-6)
    assert summed_linear([nn.Linear(5, 6), nn.Linear(5, 4)]) is None
    assert summed_linear([nn.Linear(5, 6), nn.Sequential(nn.Linear(5, 6))]) is None
    assert summed_linear([nn.Linear(5, 6, bias=False), nn.Linear(5, 6)]) is None


def test_linear_is_nn_linear_with_the_ops_forward():
    """`Linear` keeps nn.Linear's parameters and state-dict names; on the CPU its forward is
    F.linear exactly. FP8 / tensor-parallel replacements are not plain."""
    torch.manual_seed(1)
    a, b = nn.Linear(6, 4), Linear(6, 4)
    b.load_state_dict(a.state_dict())
    assert list(b.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 2, 6)
    assert torch.equal(a(x), b(x))
    assert is_plain_linear(a) and is_plain_linear(b)

    class Sub(nn.Linear):
        pass

    assert not is_plain_linear(Sub(2, 2)) and not is_plain_linear(nn.Identity())
