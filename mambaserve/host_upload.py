"""Pack host arrays into one buffer, copy it to the device once: the only way a step's host-built
data (forward metadata, sampling parameters, CUDA-graph inputs) reaches the device.

`upload(parts, device)` takes named numpy arrays of any fixed-size dtype (int64, int32, float32,
bool, uint8), lays them out in one byte buffer (each part 16-byte aligned), copies the buffer
with ONE host-to-device copy (on CUDA from a reused pinned staging buffer, `PinnedStaging`,
non-blocking: no sync) and returns typed, shaped views into it. On a CPU the host buffer itself
is returned, viewed the same way. `copy_into(host, dst)` is one copy, from the same staging
buffers, into a buffer that already lives on the device (a CUDA graph's capture inputs, a
prefill graph's token ids sent ahead for its head start); `views(buf, specs)` gives the typed
views of a byte buffer laid out as `pack` lays out parts of those dtypes and shapes (a prefill
graph's static buffer).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

# 16, not 8: Triton specializes a pointer argument on 16-byte alignment, so with 8 a view's
# alignment would depend on the sizes of the parts before it (batch-dependent), and a kernel
# would compile again mid-serving for a batch shape whose views the warm-up saw aligned
# differently (seconds of device idle on the first such step).
_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.uint8): torch.uint8}  # a graph's static bytes (engine/runner.py)


Spec = tuple[np.dtype, tuple[int, ...]]  # a part's dtype and shape
_Key = tuple[tuple[str, np.dtype, tuple[int, ...]], ...]  # (name, dtype, shape) of each part


@dataclass(frozen=True)
class _Layout:
    """Where each part of an upload lies in its byte buffer, and how `views` cuts it: per dtype,
    the sizes of one split of the buffer viewed as that dtype ([gap, part] pairs, then the tail)
    and the names and shapes of its parts, in order."""

    offsets: dict[str, int]
    total: int
    groups: tuple[tuple[torch.dtype, tuple[int, ...], tuple[tuple[str, tuple[int, ...]], ...]],
                  ...]


@functools.lru_cache(maxsize=512)
def _plan(key: _Key) -> _Layout:
    """The layout of parts of these names, dtypes and shapes (a step's upload has the same ones
    as many steps before it: computed once, host time before the step's first kernel)."""
    offsets, end = {}, 0
    by_dtype: dict[np.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, dtype, shape in key:
        if dtype not in _TORCH_DTYPES:
            raise TypeError(f"upload part {name!r} has dtype {dtype}; supported: "
                            f"{', '.join(str(d) for d in _TORCH_DTYPES)}")
        offsets[name] = end
        end += -(-dtype.itemsize * math.prod(shape) // _ALIGN) * _ALIGN
        by_dtype.setdefault(dtype, []).append((name, shape))
    groups = []
    for dtype, members in by_dtype.items():
        size, sizes, cursor = dtype.itemsize, [], 0
        for name, shape in members:  # in layout order
            first, n = offsets[name] // size, math.prod(shape)  # offsets: multiples of 16
            sizes += [first - cursor, n]
            cursor = first + n
        sizes.append(end // size - cursor)
        groups.append((_TORCH_DTYPES[dtype], tuple(sizes), tuple(members)))
    return _Layout(offsets, end, tuple(groups))


def _key(specs: dict[str, Spec]) -> _Key:
    return tuple((name, np.dtype(dtype), tuple(shape)) for name, (dtype, shape) in specs.items())


def layout(specs: dict[str, Spec]) -> tuple[dict[str, int], int]:
    """Byte offset of each part (in order, each 16-byte aligned) and the total size."""
    plan = _plan(_key(specs))
    return dict(plan.offsets), plan.total


def _fill(out: np.ndarray, parts: dict[str, np.ndarray], offsets: dict[str, int]) -> None:
    for name, a in parts.items():
        o = offsets[name]
        out[o: o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def pack(parts: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """One uint8 host buffer holding every part, and each part's byte offset in it."""
    plan = _plan(_parts_key(parts))
    return _pack(parts, plan), dict(plan.offsets)


def _parts_key(parts: dict[str, np.ndarray]) -> _Key:
    return tuple((name, a.dtype, a.shape) for name, a in parts.items())


def _pack(parts: dict[str, np.ndarray], plan: _Layout) -> np.ndarray:
    buf = np.zeros(max(plan.total, _ALIGN), dtype=np.uint8)  # never empty: views need a stride
    _fill(buf, parts, plan.offsets)
    return buf


def views(buf: torch.Tensor, specs: dict[str, Spec]) -> dict[str, torch.Tensor]:
    """Typed, shaped views of a uint8 buffer (host or device) laid out by `layout(specs)`."""
    return _views(buf, _plan(_key(specs)))


def _views(buf: torch.Tensor, plan: _Layout) -> dict[str, torch.Tensor]:
    """Per dtype one typed view of the buffer cut into every part of that dtype by one split (a
    handful of torch calls per step instead of three per part: they are host time before the
    step's first kernel)."""
    total = plan.total
    assert buf.dtype == torch.uint8 and buf.numel() >= total, (buf.dtype, buf.numel(), total)
    out: dict[str, torch.Tensor] = {}
    for dtype, sizes, members in plan.groups:
        pieces = torch.split_with_sizes(buf[:total].view(dtype), sizes)
        for i, (name, shape) in enumerate(members):
            piece = pieces[2 * i + 1]
            out[name] = piece if len(shape) == 1 else piece.view(shape)
    return {name: out[name] for name in plan.offsets}


class PinnedStaging:
    """Pinned host buffers reused in turn for uploads. A fresh pinned buffer per step
    (`pin_memory()`, torch's caching host allocator) stalled the host 2-6 ms in the first step
    of a new request on an H100 (docs/benchmarks.md, "Host time before a prefill's first
    kernel"); these buffers are allocated once (grown to the largest upload seen). A buffer is
    taken again only when the event recorded after its last copy has completed (`query`, never
    a wait); with every buffer still in flight a fresh one is used instead, so no upload waits."""

    def __init__(self, slots: int = 4, min_bytes: int = 1 << 16) -> None:
        self.min_bytes = min_bytes
        self.bufs: list[tuple[torch.Tensor, np.ndarray] | None] = [None] * slots
        self.events: list = [None] * slots  # torch.cuda.Event of each buffer's last copy
        self.next = 0
        self.lock = threading.Lock()  # the engine uploads from one thread; tests may not

    def copy(self, parts: dict[str, np.ndarray], offsets: dict[str, int], size: int,
             device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
        """`parts` laid out at `offsets` in `size` bytes, copied to `device` (non-blocking):
        into a new device tensor, or into `into` (uint8, `size` bytes), which is returned."""
        with self.lock:
            for _ in range(len(self.bufs)):
                i, self.next = self.next, (self.next + 1) % len(self.bufs)
                event = self.events[i]
                if event is not None and not event.query():
                    continue
                held = self.bufs[i]
                if held is None or held[1].size < size:
                    pinned = self._alloc(max(self.min_bytes, 1 << (size - 1).bit_length()))
                    held = self.bufs[i] = (pinned, pinned.numpy())
                _fill(held[1], parts, offsets)
                out = _to_device(held[0][:size], device, into)
                self.events[i] = event = event or self._event()
                self._record(event, device)
                return out
        pinned = self._alloc(size)  # every buffer still in flight: a fresh one
        _fill(pinned.numpy(), parts, offsets)
        return _to_device(pinned, device, into)

    # the CUDA calls, apart (tests/test_host_upload.py runs the buffer rules on a CPU)
    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _event(self):
        return torch.cuda.Event()

    def _record(self, event, device: torch.device) -> None:
        event.record(torch.cuda.current_stream(device))


def _to_device(src: torch.Tensor, device: torch.device, into: torch.Tensor | None
               ) -> torch.Tensor:
    # NOTE: the step's upload; non-blocking from pinned memory: no sync
    if into is None:
        return src.to(device, non_blocking=True)
    into.copy_(src, non_blocking=True)
    return into


_STAGING: dict[torch.device, PinnedStaging] = {}


def _staging(device: torch.device) -> tuple[PinnedStaging, torch.device]:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _STAGING.get(device) or _STAGING.setdefault(device, PinnedStaging()), device


def upload(parts: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every part on `device` after one copy, as a view of its dtype and shape (CUDA: from
    `PinnedStaging` buffers, without a sync)."""
    device = torch.device(device)
    plan = _plan(_parts_key(parts))
    if device.type != "cuda":
        return _views(torch.from_numpy(_pack(parts, plan)), plan)
    staging, device = _staging(device)
    return _views(staging.copy(parts, plan.offsets, max(plan.total, _ALIGN), device), plan)


def copy_into(host: np.ndarray, dst: torch.Tensor) -> None:
    """Copy a host array into the first `host.size` elements of a contiguous tensor of its
    dtype (a buffer a CUDA graph reads), once: on CUDA by one host-to-device copy from the
    pinned staging buffers (non-blocking, no sync; no device buffer of its own, no second
    copy)."""
    if _TORCH_DTYPES.get(host.dtype) != dst.dtype or not dst.is_contiguous() \
            or host.size > dst.numel():
        raise ValueError(f"cannot copy a {host.dtype} array of {host.size} elements into a "
                         f"{dst.dtype} tensor of {dst.numel()}")
    view = dst.reshape(-1)[: host.size]
    if dst.device.type != "cuda":
        view.copy_(torch.from_numpy(np.ascontiguousarray(host)).reshape(-1))
        return
    staging, device = _staging(dst.device)
    staging.copy({"x": host}, {"x": 0}, host.nbytes, device, into=view.view(torch.uint8))
