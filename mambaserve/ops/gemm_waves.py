"""Where a cuBLAS GEMM's last wave of output tiles runs mostly idle, the columns to split it at.

A GEMM of M x N outputs runs as tiles of about tile_m x tile_n, `sms` at a time (one wave). When
the tiles number a few full waves and a small tail, the tail's wave keeps most SMs idle for a
whole tile's time: the 9B's closing projections at 2,048 rows (N = 4,480: 16 x 35 tiles of 128 on
132 SMs, four waves and 32 tiles) would lose ~15 % that way, about the gap measured against the
wide projections (docs/benchmarks.md run 22). Splitting the output's columns into two
GEMMs, the first exactly the full waves and the second the rest, lets cuBLAS pick its kernel for
the narrow rest (a split-K one for few tiles and a long K) instead of a nearly empty wave.

    column_split(M, N, device) -> n1: the first GEMM's columns, 0 for one GEMM
    split_columns(M, N, sms, split_tail, tile_m, tile_n): the rule itself

A host computation on shapes (no sync); the rule's knobs are the tuning entry "gemm_waves"
(`split_tail` 0 turns it off, the default until it is timed); docs/kernels.md ("Closing
projections in two GEMMs") has the reasoning and how to time it.
"""

from __future__ import annotations

import functools

import torch

from mambaserve.ops.triton import tuning


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def column_split(M: int, N: int, device: torch.device) -> int:
    """`split_columns` with the device's SM count and the tuning entry's knobs; 0 off CUDA."""
    if device.type != "cuda":
        return 0
    k = tuning.config("gemm_waves", device)
    if not k["split_tail"]:
        return 0
    sms = _sms(device.index if device.index is not None else torch.cuda.current_device())
    return split_columns(M, N, sms, k["split_tail"], k["tile_m"], k["tile_n"])


def split_columns(M: int, N: int, sms: int, split_tail: float, tile_m: int, tile_n: int) -> int:
    """The first GEMM's columns (a multiple of tile_n) when the tiles' last wave holds at most
    split_tail of a wave's tiles, else 0 (also for less than one full wave)."""
    rows, cols = -(-M // tile_m), -(-N // tile_n)
    full = rows * cols // sms
    tail = rows * cols - full * sms
    if full == 0 or tail == 0 or tail > split_tail * sms:
        return 0
    n1 = full * sms // rows * tile_n
    return n1 if 0 < n1 < N else 0
