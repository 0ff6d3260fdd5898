"""Helpers shared by the kernels (imported only by kernel modules, never at package import)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SM count (1 for the CPU interpreter: no occupancy to fill); a host query,
    cached per device."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(idx).multi_processor_count


def pow2(n: int) -> int:
    """The next power of two of max(1, n)."""
    return triton.next_power_of_2(max(1, n))


@triton.jit
def softplus_clamp(v, lo, hi):
    """clamp(softplus(v), lo, hi) in float32; softplus as torch's (linear above 20)."""
    e = tl.exp(tl.minimum(v, 20.0))
    sp = tl.where(v > 20.0, v, tl.where(v < -15.0, e, tl.log(1.0 + e)))
    return tl.minimum(tl.maximum(sp, lo), hi)
