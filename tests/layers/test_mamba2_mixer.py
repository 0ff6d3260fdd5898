"""Mamba2Mixer's cached decay rates A = -exp(A_log): computed once, recomputed whenever A_log
changes (in place, replaced, moved)."""

from __future__ import annotations

import torch

from mambaserve.bench.presets import preset_config
from mambaserve.config import ModelConfig
from mambaserve.layers.mamba2_mixer import Mamba2Mixer


def _mixer() -> Mamba2Mixer:
    m = Mamba2Mixer(ModelConfig.from_dict(preset_config("tiny")))
    with torch.no_grad():
        m.A_log.copy_(torch.linspace(-1.0, 2.0, m.num_heads))
    return m


def test_decay_rates_cached_until_a_log_changes():
    m = _mixer()
    a = m.decay_rates()
    assert torch.equal(a, -torch.exp(m.A_log.float()))
    assert m.decay_rates() is a  # no recompute while A_log is unchanged
    with torch.no_grad():
        m.A_log.add_(0.5)  # in place: the version counter moves
    b = m.decay_rates()
    assert b is not a and torch.equal(b, -torch.exp(m.A_log.float()))
    m.A_log = torch.nn.Parameter(m.A_log.detach()[:2].clone())  # replaced (as sharding does)
    c = m.decay_rates()
    assert c.shape == (2,) and torch.equal(c, -torch.exp(m.A_log.float()))
    m.to(torch.float64)  # moved / cast in place by the module
    assert m.decay_rates().dtype == torch.float32
    assert torch.equal(m.decay_rates(), -torch.exp(m.A_log.float()))


def test_decay_rates_from_inference_mode_serve_a_grad_tracking_forward():
    m = _mixer()
    with torch.inference_mode():
        a = m.decay_rates()
    assert not a.is_inference() and not a.requires_grad
    dt = torch.ones(m.num_heads, requires_grad=True)
    (dt * m.decay_rates()).sum().backward()  # usable outside inference mode
    assert torch.equal(dt.grad, a)
