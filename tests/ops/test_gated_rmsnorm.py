"""gated_rmsnorm (every variant) and gated_silu vs float64 formulas (tests/ops/naive.py); the
reference's norm over a group that spans tensor-parallel ranks (`NormSpan`) vs the whole
group's."""

from __future__ import annotations

import pytest
import torch
from naive import gen, naive_gated_rmsnorm, randn

from mambaserve.ops.gated_rmsnorm import NormSpan, gated_rmsnorm, gated_rmsnorm_ref, gated_silu

TOL = {"rtol": 1e-5, "atol": 1e-5}
DIM = 24


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("group_size", [1, 3, 8, 12, 24])
def test_matches_formula(group_size, eps):
    g = gen("grms", group_size, eps)
    T = 7
    y, z = randn(g, T, DIM, scale=2.0), randn(g, T, DIM, scale=2.0)
    w = 1.0 + randn(g, DIM, scale=0.3)
    out = gated_rmsnorm(y, z, w, group_size, eps)
    assert out.shape == (T, DIM) and out.dtype == torch.float32
    torch.testing.assert_close(out, naive_gated_rmsnorm(y, z, w, group_size, eps).float(), **TOL)


def test_groups_are_independent_and_scale_invariant():
    """Scaling one group's input rescales nothing (rms norm), and changing one group leaves the
    other groups' outputs bit-identical."""
    g = gen("grms-groups")
    gs, T = 8, 5
    y, z, w = randn(g, T, DIM), randn(g, T, DIM), randn(g, DIM)
    base = gated_rmsnorm(y, z, w, gs, 1e-9)
    y2 = y.clone()
    y2[:, gs:2 * gs] *= 37.0
    out = gated_rmsnorm(y2, z, w, gs, 1e-9)
    assert torch.equal(out[:, :gs], base[:, :gs]) and torch.equal(out[:, 2 * gs:], base[:, 2 * gs:])
    # rms(37 h) = 37 rms(h); a tiny eps (1e-9) keeps its share of the result far below 1e-5
    torch.testing.assert_close(out[:, gs:2 * gs], base[:, gs:2 * gs], **TOL)
    # and the group really is normalized: mean square of out / w is 1 (up to eps)
    h = out[:, gs:2 * gs] / w[gs:2 * gs]
    torch.testing.assert_close(h.pow(2).mean(-1), torch.ones(T), **TOL)


def test_all_zero_group_gives_zeros_not_nan():
    g = gen("grms-zero")
    y, z, w = randn(g, 3, DIM), randn(g, 3, DIM), randn(g, DIM)
    y[1, 8:16] = 0.0
    out = gated_rmsnorm(y, z, w, 8, 1e-5)
    assert torch.equal(out[1, 8:16], torch.zeros(8))
    torch.testing.assert_close(out, naive_gated_rmsnorm(y, z, w, 8, 1e-5).float(), **TOL)


def test_bf16_keeps_dtype():
    """In the model y, z and the weight share the model dtype; the result keeps it and is the
    float32 normalization rounded once to bf16, then multiplied by the weight in bf16."""
    g = gen("grms-bf16")
    y, z = randn(g, 4, DIM).bfloat16(), randn(g, 4, DIM).bfloat16()
    w = (1.0 + randn(g, DIM, scale=0.3)).bfloat16()
    out = gated_rmsnorm(y, z, w, 12, 1e-5)
    assert out.dtype == torch.bfloat16
    # reference: normalize in float64 with unit weight, round to bf16, multiply in bf16
    ref = w * naive_gated_rmsnorm(y, z, torch.ones(DIM), 12, 1e-5).bfloat16()
    # bf16 has 8 mantissa bits: one rounding of the f32-vs-f64 result may flip the last bit
    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=1e-2)


# the channels of 2 groups split over 4 simulated ranks; each rank's call gets an all-reduce that
# sums what the 4 ranks' calls put in (captured in a first pass); every variant of the reference
SPAN_T, SPAN_D, GROUPS, RANKS = 5, 64, 2, 4


@pytest.mark.parametrize("variant", [{}, {"weight_fp32": True}, {"norm_before_gate": True}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_span_equals_whole_group(variant, dtype):
    g = torch.Generator().manual_seed(0)
    y, z = (torch.randn(SPAN_T, SPAN_D, generator=g).to(dtype) for _ in range(2))
    w = (0.5 + torch.rand(SPAN_D, generator=g)).to(dtype)
    whole = gated_rmsnorm_ref(y, z, w, SPAN_D // GROUPS, 1e-5, **variant)
    part = SPAN_D // RANKS

    def run(r, all_reduce):
        cols = slice(r * part, (r + 1) * part)
        span = NormSpan(SPAN_D // GROUPS, r // (RANKS // GROUPS), GROUPS, all_reduce)
        return gated_rmsnorm_ref(y[:, cols], z[:, cols], w[cols], part, 1e-5, span=span,
                                 **variant)

    sent = []
    for r in range(RANKS):  # pass 1: what each rank contributes to the all-reduce
        run(r, lambda t: sent.append(t.clone()) or t)
    total = torch.stack(sent).sum(0)
    out = torch.cat([run(r, lambda t: t.copy_(total)) for r in range(RANKS)], dim=-1)
    assert out.dtype == dtype
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), whole.float(), rtol=tol, atol=1e-6 + tol)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_falcon_variants_match_formula(norm_before_gate):
    """Falcon-H1's variants through the public op: w * rmsnorm(y * silu(z)) or
    w * rmsnorm(y) * silu(z), weight multiplied in float32, against float64 group by group."""
    g = gen("grms-falcon", norm_before_gate)
    y, z = randn(g, 6, DIM, scale=2.0), randn(g, 6, DIM, scale=2.0)
    w = 1.0 + randn(g, DIM, scale=0.3)
    out = gated_rmsnorm(y, z, w, 8, 1e-5, norm_before_gate=norm_before_gate, weight_fp32=True)
    y64, z64, w64 = y.double(), z.double(), w.double()
    silu = z64 * torch.sigmoid(z64)
    h = (y64 if norm_before_gate else y64 * silu).view(6, DIM // 8, 8)
    h = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(6, DIM) * w64
    want = h * silu if norm_before_gate else h
    torch.testing.assert_close(out, want.float(), **TOL)


def test_gated_silu_is_y_times_silu_z():
    g = gen("gsilu")
    y, z = randn(g, 5, DIM, scale=2.0), randn(g, 5, DIM, scale=2.0)
    want = y.double() * z.double() * torch.sigmoid(z.double())
    torch.testing.assert_close(gated_silu(y, z), want.float(), **TOL)
    yb, zb = y.bfloat16(), z.bfloat16()
    assert gated_silu(yb, zb).dtype == torch.bfloat16
