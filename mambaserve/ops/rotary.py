"""Rotary position embedding (RoPE) for the attention layers of later model families.

`apply_rotary(q, k, positions, theta, rotary_dim, neox=True) -> (q_out, k_out)` rotates the first
`rotary_dim` channels of every head of q [T, H, D] and k [T, H_kv, D] by the angles
`positions[t] * inv_freq[i]`, `inv_freq[i] = 1 / theta ** (2i / rotary_dim)` (transformers'
default RoPE); channels past `rotary_dim` pass through unchanged.

* NeoX style (`neox=True`, transformers' `rotate_half`): channel i pairs with i + rotary_dim/2.
* GPT-J style (`neox=False`): channel 2i pairs with 2i + 1 (interleaved pairs).

Angles, cos/sin and the rotation are computed in float32 and rounded once to the input dtype
(transformers rounds cos/sin to the model dtype first, so bf16 results may differ by an ulp).
OUT-OF-PLACE: both the reference and the Triton kernel return new contiguous tensors and leave
q and k untouched.
"""

from __future__ import annotations

import torch

from mambaserve.ops.dispatch import kernel_path


def rotary_inv_freq(theta: float, rotary_dim: int, device) -> torch.Tensor:
    """[rotary_dim // 2] float32, computed exactly as transformers' default RoPE init."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (float(theta) ** exps)


def rotary_cos_sin(positions: torch.Tensor, theta: float,
                   rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles positions[t] * inv_freq[i]: two [T, rotary_dim // 2] float32
    tensors (the table both implementations rotate by)."""
    inv_freq = rotary_inv_freq(theta, rotary_dim, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float,
                 rotary_dim: int, neox: bool = True,
                 cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D]; k: [T, H_kv, D]; positions: [T] int64 absolute positions; rotary_dim even,
    <= D. Returns new (q, k) in their input dtypes. `cos_sin`: `rotary_cos_sin(positions, theta,
    rotary_dim)` computed once by the caller for every layer of a forward (the same values)."""
    if kernel_path("apply_rotary", q.device) == "triton":
        from mambaserve.ops.triton.rotary import apply_rotary_triton

        _check(q, k, positions, rotary_dim)
        cos, sin = cos_sin if cos_sin is not None else rotary_cos_sin(positions, theta,
                                                                       rotary_dim)
        return apply_rotary_triton(q, k, cos, sin, rotary_dim, neox)
    return apply_rotary_ref(q, k, positions, theta, rotary_dim, neox, cos_sin)


def _check(q, k, positions, rotary_dim):
    T, _, D = q.shape
    assert k.shape[0] == T and k.shape[2] == D and positions.shape == (T,), (
        q.shape, k.shape, positions.shape)
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= D, (rotary_dim, D)


def apply_rotary_ref(q, k, positions, theta, rotary_dim, neox=True, cos_sin=None):
    _check(q, k, positions, rotary_dim)
    cos, sin = cos_sin if cos_sin is not None else rotary_cos_sin(positions, theta, rotary_dim)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = rotary_dim // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        r = x[..., :rotary_dim].float()
        if neox:
            x1, x2 = r[..., :half], r[..., half:]
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rot = torch.cat([o1, o2], dim=-1) if neox else torch.stack([o1, o2], dim=-1).flatten(-2)
        return torch.cat([rot.to(x.dtype), x[..., rotary_dim:]], dim=-1)

    return rotate(q), rotate(k)
