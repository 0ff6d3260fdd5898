"""Helpers shared by the kernels (imported only by kernel modules, never at package import)."""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper+): the device-side half and the launch option
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _PDL_BUILD = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # an older Triton: the kernels never take the PDL branch
    _PDL_BUILD = False
    gdc_launch_dependents = gdc_wait = None

# The switch of programmatic dependent launch for the decode-path kernels: on unless "0"
# (docs/kernels.md)
PDL_ENV = "MAMBASERVE_PDL"


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


def divisibility(*sizes: int) -> int:
    """The largest of 16, 8, 4, 2, 1 that divides every size: the `DIV` constexpr of a kernel
    that takes those sizes unspecialized (`do_not_specialize`, one compile for every value).
    Triton then knows nothing of their alignment, so the loads and stores they address or mask
    go one element at a time (~1/3 of the copy ceiling on an H100, docs/kernels.md); `aligned`
    gives the alignment back."""
    g = 0
    for n in sizes:
        g = math.gcd(g, n)
    return next(d for d in (16, 8, 4, 2, 1) if g % d == 0)


@triton.jit
def aligned(n, DIV: tl.constexpr):
    """n itself (DIV divides it, `divisibility`), known to the compiler as a multiple of DIV."""
    return (n // DIV) * DIV


@triton.jit
def softplus_clamp(v, lo, hi):
    """clamp(softplus(v), lo, hi) in float32; softplus as torch's (linear above 20)."""
    e = tl.exp(tl.minimum(v, 20.0))
    sp = tl.where(v > 20.0, v, tl.where(v < -15.0, e, tl.log(1.0 + e)))
    return tl.minimum(tl.maximum(sp, lo), hi)


def pdl_launch(device: torch.device, kernel) -> dict:
    """The launch keywords of `kernel` on `device`: programmatic dependent launch (the kernel's
    `PDL` constexpr and Triton's `launch_pdl`) when the GPU is a Hopper or newer, the Triton
    build has it, the kernel is compiled (not interpreted) and MAMBASERVE_PDL is not "0"; else
    PDL 0 (off). A kernel launched so may be scheduled while the previous kernel of the stream
    finishes: its programs wait in `await_previous` for that kernel's writes before touching
    memory (docs/kernels.md). The switch is read once per process and device
    (`pdl_launch.cache_clear()` reads it again)."""
    mode = _pdl_mode(device)
    if mode and type(kernel).__name__ != "InterpretedFunction":
        return {"PDL": mode, "launch_pdl": True}
    return {"PDL": 0}


@functools.cache
def _pdl_mode(device: torch.device) -> int:
    on = os.environ.get(PDL_ENV, "1") != "0"
    return int(on and _PDL_BUILD and device.type == "cuda" and hopper(device))


pdl_launch.cache_clear = _pdl_mode.cache_clear


@functools.cache
def hopper(device: torch.device) -> bool:
    """Whether the CUDA device is sm_90 or newer (TMA, wgmma, programmatic dependent launch)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx) >= (9, 0)


@triton.jit
def prefetch_rows_l2(w_ptr, rows, row_ok, stride, k_lo, k_hi, LINES: tl.constexpr,
                     LINE_ELEMS: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines (LINE_ELEMS elements each) of every weight row
    `rows` (where `row_ok`) in its K range [k_lo, k_hi): PTX `prefetch.global.L2`, one per line,
    fire-and-forget (no register written, nothing waited for). Compiled CUDA code only (inline
    PTX); for memory no kernel writes (the weights), so it may precede `await_previous`."""
    ks = k_lo + tl.arange(0, LINES) * LINE_ELEMS
    ptrs = w_ptr + rows[:, None].to(tl.int64) * stride + ks[None, :]
    ok = (row_ok[:, None] & (ks[None, :] < k_hi)).to(tl.int32)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def await_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the previous kernel of the stream has
    finished and its writes are visible (before this kernel touches memory that kernel may
    write: no read of an input it writes, no write of a buffer it reads), then let the next
    kernel be scheduled (its programs wait likewise). Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
