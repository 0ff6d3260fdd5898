"""Device helpers shared by the kernels (imported only by kernel modules, never at package import)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus_clamp(v, lo, hi):
    """clamp(softplus(v), lo, hi) in float32; softplus as torch's (linear above 20)."""
    e = tl.exp(tl.minimum(v, 20.0))
    sp = tl.where(v > 20.0, v, tl.where(v < -15.0, e, tl.log(1.0 + e)))
    return tl.minimum(tl.maximum(sp, lo), hi)
