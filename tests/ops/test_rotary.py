"""Rotary embedding reference vs. an independent float64 complex-number formulation, and vs.
transformers' NeoX-style `apply_rotary_pos_emb` (rotate_half)."""

from __future__ import annotations

import pytest
import torch

from mambaserve.ops.rotary import apply_rotary, apply_rotary_ref


def naive_rotary(x, positions, theta, rotary_dim, neox):
    """float64: pairs as complex numbers multiplied by exp(i * pos * theta^(-2j/rotary_dim))."""
    x = x.double()
    half = rotary_dim // 2
    j = torch.arange(half, dtype=torch.float64)
    ang = positions.double()[:, None] * theta ** (-2 * j / rotary_dim)  # [T, half]
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]
    out = x.clone()
    if neox:
        z = torch.complex(x[..., :half], x[..., half:rotary_dim]) * rot
        out[..., :half], out[..., half:rotary_dim] = z.real, z.imag
    else:
        z = torch.complex(x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]) * rot
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = z.real, z.imag
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("D,rotary_dim", [(16, 16), (64, 32), (80, 80), (24, 8)])
def test_ref_matches_naive(neox, D, rotary_dim):
    g = torch.Generator().manual_seed(D + rotary_dim + neox)
    T, H, Hkv = 9, 4, 2
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    pos = torch.tensor([0, 1, 2, 7, 100, 513, 2047, 4000, 3])
    q0, k0 = q.clone(), k.clone()
    qo, ko = apply_rotary(q, k, pos, 10000.0, rotary_dim, neox)
    assert torch.equal(q, q0) and torch.equal(k, k0), "out-of-place: inputs untouched"
    torch.testing.assert_close(qo.double(), naive_rotary(q, pos, 10000.0, rotary_dim, neox),
                               rtol=0, atol=3e-3)  # float32 angles of ~4000 rad: ~5e-4 rad off
    torch.testing.assert_close(ko.double(), naive_rotary(k, pos, 10000.0, rotary_dim, neox),
                               rtol=0, atol=3e-3)
    assert torch.equal(qo[0], q[0]) and torch.equal(qo[..., rotary_dim:], q[..., rotary_dim:])


def test_neox_matches_transformers():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator().manual_seed(0)
    T, H, Hkv, D, theta = 11, 4, 2, 32, 500000.0
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    pos = torch.arange(5, 5 + T) * 37
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    freqs = pos.float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    # transformers' layout: [B, heads, T, D] with cos/sin [B, T, D]
    qh, kh = llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        emb.cos()[None], emb.sin()[None])
    qo, ko = apply_rotary_ref(q, k, pos, theta, D, True)
    torch.testing.assert_close(qo, qh[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko, kh[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_dtype_preserved_and_norm():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 2, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(5, 1, 16, generator=g).to(torch.bfloat16)
    qo, ko = apply_rotary(q, k, torch.arange(5), 10000.0, 16, False)
    assert qo.dtype == ko.dtype == torch.bfloat16 and qo.shape == q.shape
    torch.testing.assert_close(qo.float().norm(dim=-1), q.float().norm(dim=-1), rtol=2e-2,
                               atol=2e-2)


def test_rejects_bad_rotary_dim():
    q = torch.zeros(2, 1, 8)
    with pytest.raises(AssertionError):
        apply_rotary(q, q, torch.arange(2), 10000.0, 7)
    with pytest.raises(AssertionError):
        apply_rotary(q, q, torch.arange(2), 10000.0, 10)
