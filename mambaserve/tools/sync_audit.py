"""Host-sync auditor: prove that a forward never reads a device value back to the host.

The rule: between the per-forward metadata upload and the sampler, a forward never makes the
host wait for the GPU. On CUDA the host only *queues* kernels and runs ahead of the device, so
launch overhead hides behind real work. Whatever needs a device value on the host (``.item()``,
``if t:``, a data-dependent shape as in ``nonzero``, a blocking host<->device copy) stalls the
host until every queued kernel has run, and the GPU idles while the next ones are launched. One
sync per layer makes decoding launch-bound, and it breaks CUDA-graph capture.

``SyncAudit`` proves it on a CPU too, by flagging what *would* sync on CUDA, with two modes:

* a ``TorchDispatchMode`` for aten ops: ``_local_scalar_dense`` (reached by ``.item()``,
  ``bool``/``int``/``float``, ``if t:``, ``x[t0d]``, ``torch.arange(t)``, ``v in t``),
  ``nonzero`` (``torch.where(c)``, ``argwhere``; ``nonzero_static`` is fine), ``masked_select``,
  ``index``/``index_put_`` with a bool/uint8 index (``x[mask]``), the ``unique`` family,
  ``repeat_interleave`` without ``output_size``, ``equal``, ``allclose``, ``bincount``, and
  ``histc`` with ``min == max``.
* a ``TorchFunctionMode`` for calls that never reach the dispatcher on a CPU: ``tolist``,
  ``cpu``, ``numpy``/``__array__``, ``.to(<cpu>)`` (counted for a host tensor too, as it is a
  D2H copy on CUDA, ``non_blocking`` or not; so on a CPU run an upload ``t.to(device)`` in the
  forward is flagged as well), ``allclose`` (once), ``repr``/``format``,
  ``torch.tensor([t0, t1])`` (reads each element), and ``torch.tensor(data, device=d)`` /
  ``x.new_tensor(data)`` with elements (a blocking H2D copy calls ``cudaStreamSynchronize``;
  ``torch.tensor([], device=d)`` copies nothing and is not counted). Not counted either:
  ``x[mask] = <python number>``, which CUDA runs as ``masked_fill_`` with a host scalar.

Each flagged case blocked the host under the CUDA profiler on an H200, and none of the unflagged
ones did (see tests/tools/test_sync_audit.py). Each user-level call counts once: a re-entrancy
guard silences dispatch events under a function-level one. An event records the innermost frame
outside torch and outside this file (the line of *our* code to fix), the innermost
``nn.Module`` running (global forward hooks; names come from ``root``; ``m.forward(x)`` called
directly is invisible), and the innermost ``audit.section(label)``.

Reading the report: ``audit.report()`` has one row per (op, module, section, site), most
frequent first; ``audit.count(section="forward")`` must be 0. Accepted syncs go in
``allow=[AllowedSync(...)]`` and land in ``audit.allowed``. On a GPU, ``profile_cuda_syncs``
counts the real thing with the profiler.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from typing_extensions import Self

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS_FILES = {__file__, os.path.abspath(__file__)}
_aten = torch.ops.aten
_MASK_DTYPES = (torch.bool, torch.uint8)
_PY_NUMBERS = (bool, int, float, complex)

# Ops whose every call needs a device value on the host.
_ALWAYS_SYNC = {
    _aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten._unique,
    _aten._unique2, _aten.unique_dim, _aten.unique_consecutive, _aten.unique_dim_consecutive,
    _aten.equal, _aten.allclose, _aten.bincount,
    # Composite: reach the mode whole only where there is no C++ kernel (see _DispatchMode).
    _aten.item, _aten.is_nonzero,
}
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_INDEX_OPS = {_aten.index, _aten.index_put_, _aten.index_put, _aten._index_put_impl_}

# Function-level calls that would copy device memory to the host.
_T = torch.Tensor
_D2H_CALLS = {
    _T.tolist: "tolist", _T.cpu: "cpu", _T.numpy: "numpy", _T.__array__: "numpy",
    _T.__repr__: "repr", _T.__format__: "format", torch.allclose: "allclose",
    _T.allclose: "allclose",
}
_FACTORIES = {torch.tensor, torch.as_tensor, _T.new_tensor}


@dataclass(frozen=True)
class SyncEvent:
    """One host sync: the op, the line of our code behind it, the module and section."""

    op: str
    file: str
    line: int
    function: str
    module: str | None
    section: str | None

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"


@dataclass(frozen=True)
class AllowedSync:
    """An accepted sync: file path suffix, optionally function name and op; and why."""

    file_suffix: str
    function: str | None = None
    reason: str = ""
    op: str | None = None

    def matches(self, event: SyncEvent) -> bool:
        suffix_ok = event.file.replace(os.sep, "/").endswith(self.file_suffix.replace(os.sep, "/"))
        return suffix_ok and self.function in (None, event.function) and self.op in (None, event.op)


# Syncs that only a CPU run raises, from torch's own code. None found under torch 2.13: every
# op flagged here also blocked the host on CUDA (checked with the profiler on an H200).
CPU_ONLY_ALLOWED: list[AllowedSync] = []


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _has_mask(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices or ())


def _holds_tensor(data: Any) -> bool:
    nested = isinstance(data, (list, tuple)) and any(map(_holds_tensor, data))
    return nested or isinstance(data, torch.Tensor)


def _no_elements(data: Any) -> bool:  # [], [[], []]: nothing to copy, so no sync
    return isinstance(data, (list, tuple)) and all(map(_no_elements, data))


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    for target in (*args[1:], kwargs.get("device"), kwargs.get("other")):
        if isinstance(target, torch.Tensor):
            return target.device.type == "cpu"
        if isinstance(target, (str, torch.device)):
            return torch.device(target).type == "cpu"
    return False


def _is_masked_fill(args: tuple) -> bool:
    """``x[mask] = number``: CUDA dispatches it to ``masked_fill_``, which does not sync."""
    self, key, value = (*args, None, None)[:3]
    return (
        isinstance(value, _PY_NUMBERS) and isinstance(key, torch.Tensor)
        and key.dtype in _MASK_DTYPES and key.shape == self.shape[: key.dim()]
    )


def _function_op(func: Callable, args: tuple, kwargs: dict) -> str | None:
    """The op name of a function-level sync, "" to run silently, None to pass through."""
    op = _D2H_CALLS.get(func)
    if op is not None:
        return op
    if func is _T.to:
        return "to(cpu)" if _targets_cpu(args, kwargs) else None
    if func is _T.__setitem__:
        return "" if _is_masked_fill(args) else None
    if func in _FACTORIES:
        data = _arg(args, kwargs, 1 if func is _T.new_tensor else 0, "data")
        if isinstance(data, (list, tuple)) and _holds_tensor(data):
            return "tensor(from tensors)"
        explicit = func is _T.new_tensor or kwargs.get("device") is not None
        if explicit and not isinstance(data, torch.Tensor) and not _no_elements(data):
            return "tensor(h2d)"
    return None


def _dispatch_op(func: Any, args: tuple, kwargs: dict) -> str | None:
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if packet in _ALWAYS_SYNC:
        return name
    if packet in _INDEX_OPS:
        return name if _has_mask(_arg(args, kwargs, 1, "indices")) else None
    if packet is _aten.repeat_interleave and func is not _aten.repeat_interleave.self_int:
        return name if kwargs.get("output_size") is None else None
    if packet is _aten.histc:
        lo, hi = _arg(args, kwargs, 2, "min", 0), _arg(args, kwargs, 3, "max", 0)
        return name if lo == hi else None
    return None


def _caller() -> tuple[str, int, str]:
    """The innermost frame outside torch and outside this file."""
    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(_TORCH_DIR) and file not in _THIS_FILES:
            return file, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return "<unknown>", 0, "<unknown>"


class _AuditMode:
    def __init__(self, audit: SyncAudit) -> None:
        super().__init__()
        self.audit = audit


class _FunctionMode(_AuditMode, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = None if self.audit._busy else _function_op(func, args, kwargs)
        if op is None:
            return func(*args, **kwargs)
        if op:
            self.audit._record(op)
        self.audit._busy += 1  # one user-level call, one event: silence nested dispatch
        try:
            return func(*args, **kwargs)
        finally:
            self.audit._busy -= 1


class _DispatchMode(_AuditMode, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Under torch.inference_mode() composite ops arrive whole (item, is_nonzero, where(c),
        # argwhere, narrow(t), ...): run their C++ composite kernel under this mode, as autograd
        # would, so the syncing ops inside are seen and named the same in every grad mode. (Not
        # func.decompose: it prefers Python refs, which can read host tensors that C++ does not.)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
            with self:
                return func._op_dk(_COMPOSITE, *args, **kwargs)
        op = None if self.audit._busy else _dispatch_op(func, args, kwargs)
        if not op:
            return func(*args, **kwargs)
        self.audit._record(op)
        self.audit._busy += 1  # e.g. aten.item -> _local_scalar_dense: one event
        try:
            return func(*args, **kwargs)
        finally:
            self.audit._busy -= 1


class _State(threading.local):
    """Per-thread stacks: the modules whose forward is running, the open sections."""

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []
        self.sections: list[str] = []


class SyncAudit:
    """Context manager that records every (would-be) host sync while it is active."""

    def __init__(self, root: nn.Module | None = None, allow: Iterable[AllowedSync] = ()) -> None:
        self.allow = list(allow)
        self.events: list[SyncEvent] = []
        self.allowed: list[SyncEvent] = []
        self._names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        self._local = _State()
        self._busy = 0
        self._stack: ExitStack | None = None

    def __enter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("SyncAudit is not re-entrant")
        self._stack = stack = ExitStack()
        stack.callback(_nn_module.register_module_forward_pre_hook(self._pre_hook).remove)
        post = _nn_module.register_module_forward_hook(self._post_hook, always_call=True)
        stack.callback(post.remove)
        stack.enter_context(_FunctionMode(self))
        stack.enter_context(_DispatchMode(self))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack = None
        self._local.modules.clear()

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        self._local.modules.append(module)

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        modules = self._local.modules  # pop back to this module (always_call: also on raise)
        hits = [i for i, m in enumerate(modules) if m is module]
        del modules[hits[-1] if hits else len(modules):]

    def _module_label(self, module: nn.Module) -> str:
        name, cls = self._names.get(id(module)), type(module).__name__
        return f"{name} ({cls})" if name else cls

    def _record(self, op: str) -> None:
        file, line, function = _caller()
        modules, sections = self._local.modules, self._local.sections
        event = SyncEvent(
            op, file, line, function,
            self._module_label(modules[-1]) if modules else None,
            sections[-1] if sections else None,
        )
        allowed = any(rule.matches(event) for rule in self.allow)
        (self.allowed if allowed else self.events).append(event)

    @contextmanager
    def section(self, label: str) -> Iterator[None]:
        """Label the events recorded inside (the innermost label wins)."""
        sections = self._local.sections
        sections.append(label)
        try:
            yield
        finally:
            sections.pop()

    def count(self, section: str | None = None, op: str | None = None) -> int:
        """Events in ``section`` and of ``op``; None matches any."""
        return sum(section in (None, e.section) and op in (None, e.op) for e in self.events)

    def by_site(self) -> Counter[str]:
        return Counter(e.site for e in self.events)

    def by_module(self) -> Counter[str | None]:
        return Counter(e.module for e in self.events)

    def by_section(self) -> Counter[str | None]:
        return Counter(e.section for e in self.events)

    def report(self) -> str:
        lines = [f"SyncAudit: {len(self.events)} host sync(s), {len(self.allowed)} allowed"]
        for title, events in (("syncs", self.events), ("allowed", self.allowed)):
            if not events:
                continue
            rows = Counter((e.op, e.module or "-", e.section or "-", _short(e)) for e in events)
            lines.append(f"{title}:")
            lines.append(f"{'count':>6}  {'op':<22} {'module':<32} {'section':<10} site")
            for (op, module, section, site), n in rows.most_common():
                lines.append(f"{n:>6}  {op:<22} {module:<32} {section:<10} {site}")
        return "\n".join(lines)


def _short(event: SyncEvent) -> str:
    rel = os.path.relpath(event.file) if os.path.isabs(event.file) else event.file
    return f"{event.file if rel.startswith('..') else rel}:{event.line} ({event.function})"


# --- CUDA: count the real thing with the profiler --------------------------------------------

SYNC_EVENT_NAMES = (
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "aten::item", "aten::_local_scalar_dense", "aten::nonzero",
)
_DTOH_PREFIX = "Memcpy DtoH"  # "Memcpy DtoH (Device -> Pageable)", "... (Device -> Pinned)"
_RANGE = "sync_audit.profile_cuda_syncs"


@dataclass(frozen=True)
class CudaSyncCounts:
    """Profiler events tied to host syncs, per name and in total.

    ``host_waits`` (``cuda*Synchronize`` calls: the host blocked) plus ``d2h_copies`` is the
    number to watch; ``aten::item`` also fires for a host tensor, where nothing waits.
    """

    counts: dict[str, int]
    total: int
    host_waits: int
    d2h_copies: int


def count_sync_events(names: Iterable[str]) -> CudaSyncCounts:
    counts = Counter(n for n in names if n in SYNC_EVENT_NAMES or n.startswith(_DTOH_PREFIX))
    waits = sum(v for k, v in counts.items() if k.endswith("Synchronize"))
    copies = sum(v for k, v in counts.items() if k.startswith(_DTOH_PREFIX))
    return CudaSyncCounts(dict(counts), sum(counts.values()), waits, copies)


def profile_cuda_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CudaSyncCounts:
    """Run ``fn(*args, **kwargs)`` under the torch profiler and count its sync events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, acc_events=True) as prof, record_function(_RANGE):
        fn(*args, **kwargs)
    events = list(prof.events())
    spans = [e.time_range for e in events if e.name == _RANGE and e.device_type == DeviceType.CPU]
    # The profiler's own stop() calls cudaDeviceSynchronize: count host-side events inside
    # fn's span only, and device-side copies (asynchronous) wherever they landed.
    return count_sync_events(
        e.name for e in events
        if e.device_type != DeviceType.CPU or not spans
        or any(s.start <= e.time_range.start <= s.end for s in spans)
    )
