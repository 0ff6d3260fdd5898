"""Pack host arrays into one buffer, pin it, copy it to the device once: the only way a step's
host-built data (forward metadata, sampling parameters, CUDA-graph inputs) reaches the device.

`upload(parts, device)` takes named numpy arrays of any fixed-size dtype (int64, int32, float32,
bool), lays them out in one byte buffer (each part 16-byte aligned), copies the buffer with ONE
host-to-device copy (from pinned memory on CUDA, non-blocking: no sync) and returns typed, shaped
views into it. On a CPU the host buffer itself is returned, viewed the same way.
`copy_into(host, dst)` is the same single copy into a buffer that already lives on the device
(the CUDA graphs' static inputs).
"""

from __future__ import annotations

import numpy as np
import torch

# 16, not 8: Triton specializes a pointer argument on 16-byte alignment, so with 8 a view's
# alignment would depend on the sizes of the parts before it (batch-dependent), and a kernel
# would compile again mid-serving for a batch shape whose views the warm-up saw aligned
# differently (seconds of device idle on the first such step).
_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


def _layout(parts: dict[str, np.ndarray]) -> tuple[dict[str, int], int]:
    offsets, end = {}, 0
    for name, a in parts.items():
        if a.dtype not in _TORCH_DTYPES:
            raise TypeError(f"upload part {name!r} has dtype {a.dtype}; supported: "
                            f"{', '.join(str(d) for d in _TORCH_DTYPES)}")
        offsets[name] = end
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def pack(parts: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """One uint8 host buffer holding every part, and each part's byte offset in it."""
    offsets, total = _layout(parts)
    buf = np.zeros(total, dtype=np.uint8)
    for name, a in parts.items():
        o = offsets[name]
        buf[o: o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buf, offsets


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)  # the one upload: no sync
    return host


def upload(parts: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every part on `device` after one copy, as a view of its dtype and shape."""
    buf, offsets = pack(parts)
    dev = _to_device(torch.from_numpy(buf), torch.device(device))
    out = {}
    for name, a in parts.items():
        o = offsets[name]
        out[name] = dev[o: o + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
    return out


def copy_into(host: np.ndarray, dst: torch.Tensor) -> None:
    """Copy a host array into the first `host.size` elements of a device buffer, once."""
    src = torch.from_numpy(np.ascontiguousarray(host))
    view = dst[: src.numel()]
    if dst.device.type == "cuda":
        view.copy_(src.pin_memory(), non_blocking=True)
    else:
        view.copy_(src)
