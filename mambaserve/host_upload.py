"""Pack host arrays into one buffer, pin it, copy it to the device once: the only way a step's
host-built data (forward metadata, sampling parameters, CUDA-graph inputs) reaches the device.

`upload(parts, device)` takes named numpy arrays of any fixed-size dtype (int64, int32, float32,
bool), lays them out in one byte buffer (each part 16-byte aligned), copies the buffer with ONE
host-to-device copy (from pinned memory on CUDA, non-blocking: no sync) and returns typed, shaped
views into it. On a CPU the host buffer itself is returned, viewed the same way.
`copy_into(host, dst)` is the same single copy into a buffer that already lives on the device
(the CUDA graphs' static inputs); `views(buf, specs)` gives the typed views of a byte buffer laid
out as `pack` lays out parts of those dtypes and shapes (a prefill graph's static buffer).
"""

from __future__ import annotations

import math

import numpy as np
import torch

# 16, not 8: Triton specializes a pointer argument on 16-byte alignment, so with 8 a view's
# alignment would depend on the sizes of the parts before it (batch-dependent), and a kernel
# would compile again mid-serving for a batch shape whose views the warm-up saw aligned
# differently (seconds of device idle on the first such step).
_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


Spec = tuple[np.dtype, tuple[int, ...]]  # a part's dtype and shape


def layout(specs: dict[str, Spec]) -> tuple[dict[str, int], int]:
    """Byte offset of each part (in order, each 8-byte aligned) and the total size."""
    offsets, end = {}, 0
    for name, (dtype, shape) in specs.items():
        dtype = np.dtype(dtype)
        if dtype not in _TORCH_DTYPES:
            raise TypeError(f"upload part {name!r} has dtype {dtype}; supported: "
                            f"{', '.join(str(d) for d in _TORCH_DTYPES)}")
        offsets[name] = end
        end += -(-dtype.itemsize * math.prod(shape) // _ALIGN) * _ALIGN
    return offsets, end


def _specs(parts: dict[str, np.ndarray]) -> dict[str, Spec]:
    return {name: (a.dtype, a.shape) for name, a in parts.items()}


def pack(parts: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """One uint8 host buffer holding every part, and each part's byte offset in it."""
    offsets, total = layout(_specs(parts))
    buf = np.zeros(max(total, _ALIGN), dtype=np.uint8)  # never empty: views need a stride
    for name, a in parts.items():
        o = offsets[name]
        buf[o: o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buf, offsets


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)  # the one upload: no sync
    return host


def views(buf: torch.Tensor, specs: dict[str, Spec]) -> dict[str, torch.Tensor]:
    """Typed, shaped views of a uint8 buffer (host or device) laid out by `layout(specs)`."""
    offsets, total = layout(specs)
    assert buf.dtype == torch.uint8 and buf.numel() >= total, (buf.dtype, buf.numel(), total)
    out = {}
    for name, (dtype, shape) in specs.items():
        dtype, o = np.dtype(dtype), offsets[name]
        n = dtype.itemsize * math.prod(shape)
        out[name] = buf[o: o + n].view(_TORCH_DTYPES[dtype]).view(tuple(shape))
    return out


def upload(parts: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every part on `device` after one copy, as a view of its dtype and shape."""
    buf, _ = pack(parts)
    return views(_to_device(torch.from_numpy(buf), torch.device(device)), _specs(parts))


def copy_into(host: np.ndarray, dst: torch.Tensor) -> None:
    """Copy a host array into the first `host.size` elements of a device buffer, once."""
    src = torch.from_numpy(np.ascontiguousarray(host))
    view = dst[: src.numel()]
    if dst.device.type == "cuda":
        view.copy_(src.pin_memory(), non_blocking=True)
    else:
        view.copy_(src)
