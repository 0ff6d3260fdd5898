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

# The switch of programmatic dependent launch for the decode-path kernels: "1" on (docs/kernels.md)
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
    `PDL` constexpr and Triton's `launch_pdl`) when MAMBASERVE_PDL is 1 or 2, the GPU is a Hopper
    or newer, the Triton build has it and the kernel is compiled (not interpreted); else PDL 0
    (off). A kernel launched so may be scheduled while the previous kernel of the stream
    finishes: its programs wait in `await_previous` for that kernel's writes. With 2, a kernel
    may first read what that kernel cannot be writing (`PDL_MODES`; docs/kernels.md). The switch is
    read once per process and device (`pdl_launch.cache_clear()` reads it again)."""
    mode = _pdl_mode(device)
    if mode and type(kernel).__name__ != "InterpretedFunction":
        return {"PDL": mode, "launch_pdl": True}
    return {"PDL": 0}


# MAMBASERVE_PDL: "1" the kernels wait first; "2" (PDL == 2 in a kernel) some first read what
# the previous kernel cannot be writing: constant operands (weights, prefetched into L2) or data
# last written two or more kernels back (a Mamba layer's state: every kernel before the previous
# one has finished once this one's programs run, since that one's programs waited for it)
PDL_MODES = {"1": 1, "2": 2}


@functools.cache
def _pdl_mode(device: torch.device) -> int:
    mode = PDL_MODES.get(os.environ.get(PDL_ENV, "0"), 0)
    return mode if _PDL_BUILD and device.type == "cuda" and _hopper(device) else 0


pdl_launch.cache_clear = _pdl_mode.cache_clear


@functools.cache
def _hopper(device: torch.device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx) >= (9, 0)


@triton.jit
def await_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the previous kernel of the stream has
    finished and its writes are visible (before this kernel touches memory that kernel may
    write: no read of an input it writes, no write of a buffer it reads), then let the next
    kernel be scheduled (its programs wait likewise). Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines of the addresses `ptrs` to be brought into L2 (PTX
    prefetch.global.L2): no registers written, no fault, nothing the program waits for. The
    addresses must lie in the tensor (callers clamp them)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_tile_l2(base, rows, n_rows, stride, k_lo, k_hi, LINES: tl.constexpr):
    """L2 prefetch of the elements [k_lo, k_hi) of the rows `rows` (those >= n_rows stand for
    the last row) of the row-major matrix at `base` (row stride `stride` elements): one address
    per 128-byte line, LINES lines of every row per step."""
    LINE: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth  # elements per line
    safe = tl.minimum(rows, n_rows - 1).to(tl.int64) * stride
    offs = tl.arange(0, LINES) * LINE
    for k0 in range(k_lo, k_hi, LINES * LINE):
        k = tl.minimum(k0 + offs, k_hi - 1)
        prefetch_l2(base + safe[:, None] + k[None, :])
