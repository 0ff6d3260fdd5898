"""Tests for mambaserve.tools.sync_audit: every sync kind is caught once, at its line."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from mambaserve.tools.sync_audit import (
    AllowedSync,
    SyncAudit,
    count_sync_events,
    profile_cuda_syncs,
)

MIXER = "layers.1.mixer (Mixer)"

# case method -> op the audit must report. Each method syncs once, on its "# SYNC" line.
SYNC_CASES = {
    "s_item": "_local_scalar_dense",
    "s_bool": "_local_scalar_dense",
    "s_int": "_local_scalar_dense",
    "s_float": "_local_scalar_dense",
    "s_if": "_local_scalar_dense",
    "s_list_index": "_local_scalar_dense",
    "s_tensor_index": "_local_scalar_dense",
    "s_arange": "_local_scalar_dense",
    "s_narrow_tensor": "_local_scalar_dense",
    "s_contains": "_local_scalar_dense",
    "s_nonzero": "nonzero",
    "s_where1": "nonzero",
    "s_argwhere": "nonzero",
    "s_mask_index": "index",
    "s_mask_setitem_tensor": "index_put_",
    "s_index_put": "index_put_",
    "s_masked_select": "masked_select",
    "s_unique": "_unique2",
    "s_unique_dim": "unique_dim",
    "s_unique_consecutive": "unique_consecutive",
    "s_repeat_interleave": "repeat_interleave",
    "s_repeat_interleave_0d": "repeat_interleave",
    "s_equal": "equal",
    "s_allclose": "allclose",
    "s_bincount": "bincount",
    "s_histc": "histc",
    "s_tolist": "tolist",
    "s_cpu": "cpu",
    "s_numpy": "numpy",
    "s_np_asarray": "numpy",
    "s_to_cpu": "to(cpu)",
    "s_to_device": "to(cpu)",
    "s_to_kwargs": "to(cpu)",
    "s_to_non_blocking": "to(cpu)",
    "s_to_other": "to(cpu)",
    "s_repr": "repr",
    "s_format": "format",
    "s_tensor_from_tensors": "tensor(from tensors)",
    "s_tensor_h2d": "tensor(h2d)",
    "s_new_tensor": "tensor(h2d)",
}
FREE_CASES = [
    "f_matmul", "f_index_select", "f_long_index", "f_repeat_interleave_output_size",
    "f_repeat_interleave_int", "f_nonzero_static", "f_where3", "f_to_dtype", "f_copy",
    "f_masked_fill", "f_mask_setitem_number", "f_host_ints", "f_histc_range", "f_slicing",
    "f_sdpa", "f_scan_ops", "f_empty_tensor_on_device", "f_tensor_split_host_indices",
]
CUDA_UNSUPPORTED = {"s_numpy", "s_np_asarray"}  # these raise on a CUDA tensor


class Mixer(nn.Module):
    """``forward`` runs the method named by ``case``; each ``s_*`` syncs exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.case = "f_matmul"

    def forward(self, x: torch.Tensor):
        return getattr(self, self.case)(x)

    def s_item(self, x):
        return x[0].item()  # SYNC s_item

    def s_bool(self, x):
        return bool(x[0] > 0)  # SYNC s_bool

    def s_int(self, x):
        return int(x[0])  # SYNC s_int

    def s_float(self, x):
        return float(x[0])  # SYNC s_float

    def s_if(self, x):
        if x.sum() > 0:  # SYNC s_if
            return x
        return -x

    def s_list_index(self, x):
        return [1, 2, 3][(x[0] * 0).long()]  # SYNC s_list_index

    def s_tensor_index(self, x):
        return x[(x[0] * 0).long()]  # SYNC s_tensor_index

    def s_arange(self, x):
        return torch.arange((x[0] * 0 + 3).long())  # SYNC s_arange

    def s_narrow_tensor(self, x):
        return x.narrow(0, (x[0] * 0 + 1).long(), 2)  # SYNC s_narrow_tensor

    def s_contains(self, x):
        return 0.5 in x  # SYNC s_contains

    def s_nonzero(self, x):
        return x.nonzero()  # SYNC s_nonzero

    def s_where1(self, x):
        return torch.where(x > 0)  # SYNC s_where1

    def s_argwhere(self, x):
        return torch.argwhere(x)  # SYNC s_argwhere

    def s_mask_index(self, x):
        return x[x > 0]  # SYNC s_mask_index

    def s_mask_setitem_tensor(self, x):
        x = x.clone()
        x[x > 0] = x.sum()  # SYNC s_mask_setitem_tensor
        return x

    def s_index_put(self, x):
        return x.clone().index_put_((x > 0,), x.new_zeros(()))  # SYNC s_index_put

    def s_masked_select(self, x):
        return torch.masked_select(x, x > 0)  # SYNC s_masked_select

    def s_unique(self, x):
        return torch.unique(x)  # SYNC s_unique

    def s_unique_dim(self, x):
        return torch.unique(x.view(2, 4), dim=0)  # SYNC s_unique_dim

    def s_unique_consecutive(self, x):
        return torch.unique_consecutive(x)  # SYNC s_unique_consecutive

    def s_repeat_interleave(self, x):
        return torch.repeat_interleave(x, (x > 0).long() + 1)  # SYNC s_repeat_interleave

    def s_repeat_interleave_0d(self, x):
        return x.repeat_interleave((x[0] * 0 + 2).long())  # SYNC s_repeat_interleave_0d

    def s_equal(self, x):
        return torch.equal(x, x + 1)  # SYNC s_equal

    def s_allclose(self, x):
        return torch.allclose(x, x + 1e-9)  # SYNC s_allclose

    def s_bincount(self, x):
        return torch.bincount((x > 0).long())  # SYNC s_bincount

    def s_histc(self, x):
        return torch.histc(x, bins=4)  # SYNC s_histc

    def s_tolist(self, x):
        return x.tolist()  # SYNC s_tolist

    def s_cpu(self, x):
        return x.cpu()  # SYNC s_cpu

    def s_numpy(self, x):
        return x.numpy()  # SYNC s_numpy

    def s_np_asarray(self, x):
        return np.asarray(x)  # SYNC s_np_asarray

    def s_to_cpu(self, x):
        return x.to("cpu")  # SYNC s_to_cpu

    def s_to_device(self, x):
        return x.to(torch.device("cpu"))  # SYNC s_to_device

    def s_to_kwargs(self, x):
        return x.to(device="cpu", dtype=torch.float64)  # SYNC s_to_kwargs

    def s_to_non_blocking(self, x):
        return x.to("cpu", non_blocking=True)  # SYNC s_to_non_blocking

    def s_to_other(self, x):
        return x.to(torch.empty((), dtype=torch.float64))  # SYNC s_to_other

    def s_repr(self, x):
        return repr(x)  # SYNC s_repr

    def s_format(self, x):
        return f"{x.sum():.3f}"  # SYNC s_format

    def s_tensor_from_tensors(self, x):
        return torch.tensor([x[0], x[1]])  # SYNC s_tensor_from_tensors

    def s_tensor_h2d(self, x):
        return torch.tensor([1, 2, 3], device=x.device)  # SYNC s_tensor_h2d

    def s_new_tensor(self, x):
        return x.new_tensor([1.0, 2.0])  # SYNC s_new_tensor

    def f_matmul(self, x):
        return x.view(2, 4) @ x.view(4, 2)

    def f_index_select(self, x):
        return x.index_select(0, torch.arange(3, device=x.device))

    def f_long_index(self, x):
        return x[torch.arange(3, device=x.device)]

    def f_repeat_interleave_output_size(self, x):
        return torch.repeat_interleave(x, torch.full_like(x, 2, dtype=torch.long), output_size=16)

    def f_repeat_interleave_int(self, x):
        return x.repeat_interleave(2)

    def f_nonzero_static(self, x):
        return torch.nonzero_static(x, size=8)

    def f_where3(self, x):
        return torch.where(x > 0, x, 0.0)

    def f_to_dtype(self, x):
        return x.to(torch.float16)

    def f_copy(self, x):
        return torch.empty_like(x).copy_(x)

    def f_masked_fill(self, x):
        return x.masked_fill(x > 0, 0.0)

    def f_mask_setitem_number(self, x):
        x = x.clone()
        x[x > 0] = 0.0  # CUDA turns this into masked_fill_: no sync
        return x

    def f_host_ints(self, x):
        n = sum([1, 2, 3]) + len(x) + x.shape[0]
        host = torch.tensor([1, 2, 3])  # stays on the host: no copy on any device
        return x * n, host.shape[0] + int(torch.Size([4]).numel())

    def f_histc_range(self, x):
        return torch.histc(x, bins=4, min=-1, max=1)

    def f_slicing(self, x):
        return x[1:3].reshape(x.shape[0] // 4, -1)[:, None]

    def f_sdpa(self, x):
        q = x.view(1, 1, 2, 4)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def f_scan_ops(self, x):
        y = x.cumsum(0).sort().values.topk(2).values
        return y.argmax(), torch.softmax(x, 0), F.softplus(x).exp()


    def f_empty_tensor_on_device(self, x):
        # transformers' DynamicLayer does this in the forward: no element, no copy, no sync.
        return torch.tensor([], device=x.device), x.new_tensor([[], []])


    def f_tensor_split_host_indices(self, x):
        # The indices must be a host tensor: reading them is no device sync (not even under
        # inference_mode, where torch's Python ref would call .tolist() on them).
        return torch.tensor_split(x, torch.tensor([2, 5]))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = Mixer()
        self.post_sync = False

    def forward(self, x):
        y = self.mixer(x)
        if self.post_sync:
            x.amax().item()  # SYNC block_post
        return y


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        return self.layers[1](x)


class Failing(nn.Module):
    def forward(self, x):
        raise ValueError("boom")


def _marker_line(name: str) -> int:
    with open(__file__) as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# SYNC {name}")]
    assert len(hits) == 1, (name, hits)
    return hits[0]


def _is_this_file(path: str) -> bool:
    return os.path.exists(path) and os.path.samefile(path, __file__)


@pytest.fixture
def toy() -> Toy:
    return Toy()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.tensor([0.5, -1.0, 2.0, -3.0, 0.5, 6.0, -7.0, 8.0])


# The engine runs forwards under inference_mode, where composite ops (item, is_nonzero,
# where(c), ...) reach the dispatch mode whole instead of decomposed: every case runs in all three.
GRAD_MODES = {
    "grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
}


def _run(toy: Toy, x: torch.Tensor, case: str, grad_mode: str = "grad", **audit_kwargs):
    toy.layers[1].mixer.case = case
    with GRAD_MODES[grad_mode](), SyncAudit(**audit_kwargs) as audit:
        toy(x)
    return audit


def test_marker_lines_are_unique_and_cover_every_case():
    methods = {m for m in dir(Mixer) if m.startswith(("s_", "f_"))}
    assert methods == set(SYNC_CASES) | set(FREE_CASES)
    lines = [_marker_line(case) for case in SYNC_CASES]
    assert len(set(lines)) == len(lines)


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("case", list(SYNC_CASES))
def test_each_sync_is_caught_once_at_its_line(toy, x, case, grad_mode):
    audit = _run(toy, x, case, grad_mode, root=toy)
    assert len(audit.events) == 1, audit.report()
    event = audit.events[0]
    assert event.op == SYNC_CASES[case]
    assert _is_this_file(event.file), event.file
    assert event.line == _marker_line(case)
    assert event.function == case
    assert event.module == MIXER
    assert event.section is None
    assert audit.allowed == []


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("case", FREE_CASES)
def test_non_syncing_code_counts_zero(toy, x, case, grad_mode):
    audit = _run(toy, x, case, grad_mode, root=toy)
    assert audit.events == [], audit.report()
    assert audit.count() == 0


def test_module_names_without_root_and_stack_unwinds(toy, x):
    toy.layers[1].post_sync = True
    audit = _run(toy, x, "s_item")
    assert [e.module for e in audit.events] == ["Mixer", "Block"]
    audit = _run(toy, x, "s_item", root=toy)
    assert [e.module for e in audit.events] == [MIXER, "layers.1 (Block)"]
    assert [e.line for e in audit.events] == [_marker_line("s_item"), _marker_line("block_post")]
    assert audit.by_module() == Counter({MIXER: 1, "layers.1 (Block)": 1})


def test_module_stack_survives_an_exception(x):
    failing = Failing()
    with SyncAudit(root=failing) as audit:
        with pytest.raises(ValueError):
            failing(x)
        x.sum().item()
    assert [e.module for e in audit.events] == [None]


def test_hooks_and_modes_are_removed_on_exit(toy, x):
    pre, post = len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)
    audit = _run(toy, x, "s_item")
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == (
        pre, post)
    x.sum().item()
    x.tolist()
    assert len(audit.events) == 1


def test_sections_label_and_count(toy, x):
    toy.layers[1].mixer.case = "s_nonzero"
    with SyncAudit(root=toy) as audit:
        with audit.section("forward"):
            toy(x)
            with audit.section("sampler"):
                x.argmax().item()
            x.tolist()
        x.max().item()
    assert [e.section for e in audit.events] == ["forward", "sampler", "forward", None]
    assert audit.count() == 4
    assert audit.count(section="forward") == 2
    assert audit.count(section="forward", op="nonzero") == 1
    assert audit.count(section="sampler", op="nonzero") == 0
    assert audit.count(op="_local_scalar_dense") == 2
    assert audit.by_section() == Counter({"forward": 2, "sampler": 1, None: 1})


def test_by_site_and_report(toy, x):
    toy.layers[1].mixer.case = "s_item"
    with SyncAudit(root=toy) as audit:
        toy(x)
        toy(x)
    (site, n), = audit.by_site().items()
    assert n == 2
    assert site.endswith(f"test_sync_audit.py:{_marker_line('s_item')} (s_item)")
    report = audit.report()
    assert "2 host sync(s)" in report
    row = next(line for line in report.splitlines() if MIXER in line)
    assert row.split()[:2] == ["2", "_local_scalar_dense"]
    assert f"test_sync_audit.py:{_marker_line('s_item')} (s_item)" in row


def test_allow_list_moves_matching_events(toy, x):
    rule = AllowedSync(file_suffix="tests/tools/test_sync_audit.py", function="s_item",
                       reason="test fixture")
    audit = _run(toy, x, "s_item", allow=[rule])
    assert audit.events == []
    assert [e.function for e in audit.allowed] == ["s_item"]
    assert "0 host sync(s), 1 allowed" in audit.report()
    # The same rule does not hide a sync in another function, nor one of another op.
    assert len(_run(toy, x, "s_bool", allow=[rule]).events) == 1
    other_op = AllowedSync(file_suffix="test_sync_audit.py", op="nonzero")
    assert len(_run(toy, x, "s_item", allow=[other_op]).events) == 1


def test_count_sync_events_classifies_profiler_names():
    counts = count_sync_events([
        "cudaStreamSynchronize", "Memcpy DtoH (Device -> Pageable)",
        "Memcpy HtoD (Pageable -> Device)", "aten::item", "aten::_local_scalar_dense",
        "cudaMemcpyAsync", "aten::mm", "cudaStreamSynchronize", "aten::nonzero_static",
        "Memcpy DtoH (Device -> Pinned)",
    ])
    assert counts.counts == {
        "cudaStreamSynchronize": 2, "Memcpy DtoH (Device -> Pageable)": 1, "aten::item": 1,
        "aten::_local_scalar_dense": 1, "Memcpy DtoH (Device -> Pinned)": 1,
    }
    assert (counts.total, counts.host_waits, counts.d2h_copies) == (6, 2, 2)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_profile_cuda_syncs_counts_host_side_events_of_fn_only():
    x = torch.arange(6.0)
    x.sum().item()
    got = profile_cuda_syncs(lambda: (x.max().item(), x.nonzero(), x.nonzero_static(size=3)))
    # On a CPU nothing waits: aten::item fires for host tensors too (see CudaSyncCounts).
    assert got.counts == {"aten::item": 1, "aten::_local_scalar_dense": 1, "aten::nonzero": 1}
    assert (got.host_waits, got.d2h_copies) == (0, 0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_profile_cuda_syncs_sees_item_not_matmul():
    x = torch.randn(256, 256, device="cuda")
    (x @ x).sum().item()  # warm up cuBLAS and the allocator
    torch.cuda.synchronize()
    assert profile_cuda_syncs(lambda: None).total == 0  # the profiler's own sync is left out
    synced = profile_cuda_syncs(lambda: (x @ x).sum().item())
    assert synced.counts.get("aten::item", 0) == 1
    assert synced.host_waits >= 1 and synced.d2h_copies == 1
    assert profile_cuda_syncs(lambda: x @ x).total == 0


@cuda
def test_cpu_verdicts_agree_with_cuda_profiler(toy, x):
    """On a GPU: what the audit flags really blocks or copies back, and nothing else does."""
    toy, x = toy.cuda(), x.cuda()
    disagree = {}
    for case in [c for c in SYNC_CASES if c not in CUDA_UNSUPPORTED] + FREE_CASES:
        toy.layers[1].mixer.case = case
        toy(x)  # warm up
        torch.cuda.synchronize()
        got = profile_cuda_syncs(toy, x)
        synced = got.host_waits + got.d2h_copies > 0
        audited = {m: [e.op for e in _run(toy, x, case, m).events] for m in GRAD_MODES}
        expected = [SYNC_CASES[case]] if case in SYNC_CASES else []
        if synced != (case in SYNC_CASES) or any(ops != expected for ops in audited.values()):
            disagree[case] = (got.counts, audited)
    assert disagree == {}


def test_syncs_are_caught_under_inference_mode():
    """The engine runs forwards under torch.inference_mode(), where `.item()` and `bool(t)`
    dispatch aten.item / aten.is_nonzero whole; the audit decomposes them like autograd does."""
    x = torch.randn(4)
    with torch.inference_mode(), SyncAudit() as audit:
        if x.abs().max() > 1e9:
            pass
        x.sum().item()
        int(x[0])
        torch.arange(3) + 1  # no sync
    assert [e.op for e in audit.events] == ["_local_scalar_dense"] * 3
