"""The kernel-dispatch rule (`mambaserve.ops.dispatch`): every public op decides through it, its
conditions pick the reference for the inputs the kernels do not take, it imports no Triton, and
each public op's Triton branch (forced on CPU tensors, run by the interpreter) matches the
reference."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

import mambaserve.ops as ops_pkg
from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.ops import (
    activation,
    conv1d,
    dispatch,
    gated_rmsnorm,
    paged_attention,
    rmsnorm,
    rotary,
    selective_state_update,
    ssd,
    state_snapshot,
)
from mambaserve.ops.dispatch import CONDITIONS, kernel_path
from mambaserve.ops.triton.activation import _relu2_kernel

require_interpreter(_relu2_kernel)

OPS_DIR = Path(ops_pkg.__file__).parent


def _calls_in(path: Path, name: str) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == name]


def test_every_op_decides_through_kernel_path():
    """Every op named in CONDITIONS is decided in some ops module by `kernel_path("<op>", ...)`,
    every such call names a known op, and no ops module but the dispatch asks Triton itself."""
    used = set()
    for path in sorted(OPS_DIR.glob("*.py")):
        if path.name == "dispatch.py":
            continue
        text = path.read_text()
        assert "triton_available" not in text, f"{path.name} decides on Triton by itself"
        for call in _calls_in(path, "kernel_path"):
            arg = call.args[0]
            assert isinstance(arg, ast.Constant) and arg.value in CONDITIONS, (path.name, arg)
            used.add(arg.value)
    assert used == set(CONDITIONS), set(CONDITIONS) ^ used


def test_non_cuda_devices_and_no_triton_run_the_reference(monkeypatch):
    for op in CONDITIONS:
        assert kernel_path(op, "cpu") == "reference"
        assert kernel_path(op, torch.device("meta")) == "reference"
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert kernel_path("paged_attention", "cuda") == "reference"
    assert kernel_path("relu2", "cuda:0", x=torch.zeros(3)) == "reference"


def test_conditions_on_a_cuda_device():
    """Evaluated with CPU tensors standing in for CUDA ones: only shapes and layouts are read."""
    assert kernel_path("paged_attention", "cuda") == "triton"
    assert kernel_path("selective_state_update", torch.device("cuda", 1)) == "triton"
    x = torch.zeros(4, 6)
    assert kernel_path("relu2", "cuda", x=x) == "triton"
    assert kernel_path("relu2", "cuda", x=x[:, :3]) == "reference"
    for L, path in [(8, "reference"), (16, "triton"), (24, "reference"), (32, "triton"),
                    (128, "triton"), (96, "reference")]:
        assert kernel_path("ssd_chunk_scan_varlen", "cuda", chunk_size=L) == path, L
    for K in range(1, 8):
        want = "triton" if 2 <= K <= 5 else "reference"
        assert kernel_path("causal_conv1d_varlen", "cuda", weight=torch.zeros(8, K)) == want


def test_bad_queries_raise():
    with pytest.raises(KeyError, match="unknown op"):
        kernel_path("flash_attention", "cuda")
    with pytest.raises(TypeError, match="chunk_size"):
        kernel_path("ssd_chunk_scan_varlen", "cuda")


def test_asking_imports_no_triton():
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys\n"
        "from mambaserve.ops.dispatch import kernel_path\n"
        "assert kernel_path('paged_attention', 'cuda') in ('triton', 'reference')\n"
        "assert kernel_path('paged_attention', 'cpu') == 'reference'\n"
        "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.')]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


# ---- each public op's Triton branch, reached through the dispatch ---------------------------
@pytest.fixture
def as_if_cuda(monkeypatch):
    """The ops decide as on a CUDA device (the real conditions on the real inputs); the
    launchers then run the CPU tensors under the interpreter. Records the decisions."""
    decided = []

    def decide(op, device, **inputs):
        path = kernel_path(op, "cuda", **inputs)
        decided.append((op, path))
        return path

    for mod in (activation, conv1d, gated_rmsnorm, paged_attention, rmsnorm, rotary,
                selective_state_update, ssd, state_snapshot):
        monkeypatch.setattr(mod, "kernel_path", decide)
    return decided


cpu_only = pytest.mark.skipif(DEV != "cpu", reason="forces the kernels on CPU tensors")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@cpu_only
def test_elementwise_and_norm_ops_through_the_kernels(as_if_cuda):
    g = _gen(0)
    x = torch.randn(5, 40, generator=g)
    r = torch.randn(5, 40, generator=g)
    w = 1 + 0.3 * torch.randn(40, generator=g)
    assert torch.equal(activation.relu2(x), activation.relu2_ref(x))
    assert torch.equal(activation.relu2(x[:, :7]), activation.relu2_ref(x[:, :7]))  # strided
    torch.testing.assert_close(rmsnorm.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_ref(x, w, 1e-5))
    out, s = rmsnorm.rms_norm(x, w, 1e-5, r)
    ref, ref_s = rmsnorm.rms_norm_ref(x, w, 1e-5, r)
    torch.testing.assert_close(out, ref)
    assert torch.equal(s, ref_s)
    for variant in [(False, False), (False, True), (True, True)]:  # Falcon-H1's: the last two
        torch.testing.assert_close(gated_rmsnorm.gated_rmsnorm(x, r, w, 20, 1e-5, *variant),
                                   gated_rmsnorm.gated_rmsnorm_ref(x, r, w, 20, 1e-5, *variant))
    torch.testing.assert_close(gated_rmsnorm.gated_silu(x, r), gated_rmsnorm.gated_silu_ref(x, r))
    assert as_if_cuda == [("relu2", "triton"), ("relu2", "reference"), ("rms_norm", "triton"),
                          ("rms_norm", "triton"), *[("gated_rmsnorm", "triton")] * 3,
                          ("gated_silu", "triton")]


@cpu_only
def test_rotary_through_the_kernel(as_if_cuda):
    g = _gen(1)
    pos = torch.tensor([0, 5, 900, 4095, 17])
    q, k = torch.randn(5, 4, 24, generator=g), torch.randn(5, 2, 24, generator=g)
    for neox in (True, False):
        got = rotary.apply_rotary(q, k, pos, 1e4, 16, neox)
        ref = rotary.apply_rotary_ref(q, k, pos, 1e4, 16, neox)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert as_if_cuda == [("apply_rotary", "triton")] * 2


@cpu_only
def test_decode_ops_through_the_kernels(as_if_cuda):
    g = _gen(2)
    H, P, N, G, K, Dm = 4, 8, 16, 2, 4, 48
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    ssm = torch.randn(5, H, P, N, generator=g)
    x, dt = torch.randn(3, H, P, generator=g), torch.randn(3, H, generator=g)
    B, C = torch.randn(3, G, N, generator=g), torch.randn(3, G, N, generator=g)
    A, D, dtb = -torch.rand(H, generator=g) - 0.1, torch.randn(H, generator=g), torch.zeros(H)
    s_ref = ssm.clone()
    y = selective_state_update.selective_state_update(ssm, x, dt, A, B, C, D, dtb,
                                                      (0.0, float("inf")), slots)
    y_ref = selective_state_update.selective_state_update_ref(s_ref, x, dt, A, B, C, D, dtb,
                                                              (0.0, float("inf")), slots)
    torch.testing.assert_close(y[slots >= 0], y_ref[slots >= 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm[:-1], s_ref[:-1], rtol=1e-5, atol=1e-5)

    conv = torch.randn(5, K - 1, Dm, generator=g)
    xc, w, b = torch.randn(3, Dm, generator=g), torch.randn(Dm, K, generator=g), torch.randn(Dm)
    c_ref = conv.clone()
    out = conv1d.causal_conv1d_update(xc, w, b, conv, slots)
    out_ref = conv1d.causal_conv1d_update_ref(xc, w, b, c_ref, slots)
    torch.testing.assert_close(out[slots >= 0], out_ref[slots >= 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[:-1], c_ref[:-1])

    # prefix caching's decode snapshots, written by the same two ops
    dst = torch.tensor([3, -1, -1])
    c_ref, s_ref = conv.clone(), ssm.clone()
    conv1d.causal_conv1d_update(xc, w, b, conv, slots, snap_dst=dst)
    conv1d.causal_conv1d_update_ref(xc, w, b, c_ref, slots, snap_dst=dst)
    selective_state_update.selective_state_update(ssm, x, dt, A, B, C, D, dtb,
                                                  (0.0, float("inf")), slots, dst)
    selective_state_update.selective_state_update_ref(s_ref, x, dt, A, B, C, D, dtb,
                                                      (0.0, float("inf")), slots, dst)
    torch.testing.assert_close(conv[:-1], c_ref[:-1])
    torch.testing.assert_close(ssm[:-1], s_ref[:-1], rtol=1e-5, atol=1e-5)
    assert torch.equal(ssm[3], ssm[2]) and torch.equal(conv[3], conv[2])  # slot 2's snapshot
    assert [op for op, path in as_if_cuda if path == "triton"] == [
        "selective_state_update", "causal_conv1d_update", "causal_conv1d_update",
        "selective_state_update"]


def _prefill_meta(rows, chunk_size, K, page_size=1 << 20, decodes=()):
    """rows / decodes: (num_tokens, context_len, slot, has_initial_state, pages)."""
    batch = Batch(prefills=[Row.standalone([1] * n, c, s, i, p) for n, c, s, i, p in rows],
                  decodes=[Row.standalone([1], c, s, True, p) for c, s, p in decodes])
    pages = [p for *_, p in rows] + [p for *_, p in decodes]
    scratch = max(max(p) for p in pages) + 1
    return build_metadata(batch, chunk_size=chunk_size, conv_kernel=K, page_size=page_size,
                          scratch_page=scratch, device="cpu")


@cpu_only
@pytest.mark.parametrize("chunk_size", [16, 8])  # 8: below the kernel's tiles, the reference
def test_prefill_ops_through_the_kernels(as_if_cuda, chunk_size):
    g = _gen(3)
    H, P, N, G, K = 2, 8, 16, 1, 4
    meta = _prefill_meta([(21, 0, 0, False, [0]), (9, 5, 1, True, [0])], chunk_size, K)
    pm, T = meta.prefill, meta.num_prefill_tokens
    slots = pm.state_slots.to(torch.int32)
    x, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    A, D, dtb = -torch.rand(H, generator=g) - 0.1, torch.randn(H, generator=g), torch.zeros(H)
    nc = pm.num_chunks - 1  # the end states of all chunks but the last saved into slots 2..
    ssm = torch.randn(3 + nc, H, P, N, generator=g)
    s_ref, before = ssm.clone(), ssm.clone()
    args = (slots, pm.has_initial_state, pm.chunk_token_idx, pm.token_chunk_pos, pm.row_chunks,
            pm.row_num_chunks, torch.tensor([*range(2, 2 + nc), -1]))
    lim = (0.0, float("inf"))
    y = ssd.ssd_chunk_scan_varlen(x, dt, A, B, C, D, dtb, lim, ssm, *args)
    y_ref = ssd.ssd_chunk_scan_varlen_ref(x, dt, A, B, C, D, dtb, lim, s_ref, *args)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm[:-1], s_ref[:-1], rtol=1e-5, atol=1e-5)
    assert all(not torch.equal(ssm[2 + c], before[2 + c]) for c in range(nc))  # all written

    Dm = 24
    xc, w = torch.randn(T, Dm, generator=g), torch.randn(Dm, K, generator=g)
    conv = torch.randn(3, K - 1, Dm, generator=g)
    c_ref = conv.clone()
    cargs = (slots, pm.has_initial_state, pm.conv_window_idx, pm.conv_state_idx)
    out = conv1d.causal_conv1d_varlen(xc, w, None, conv, *cargs)
    torch.testing.assert_close(out, conv1d.causal_conv1d_varlen_ref(xc, w, None, c_ref, *cargs),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv[:-1], c_ref[:-1])
    ssd_path = "triton" if chunk_size >= 16 else "reference"
    assert as_if_cuda == [("ssd_chunk_scan_varlen", ssd_path), ("causal_conv1d_varlen", "triton")]


@cpu_only
def test_attention_ops_through_the_kernels(as_if_cuda):
    """A mixed batch through the public op: prefill tokens to the tiled kernel, decode tokens to
    the per-token kernel, each writing its rows of one output."""
    g = _gen(4)
    page, H, Hkv, Dh = 4, 4, 2, 16
    meta = _prefill_meta([(7, 0, 0, False, [0, 1]), (3, 5, 1, True, [2, 3])], 8, 4,
                         page_size=page, decodes=[(9, 2, [4, 5, 6])])
    T = meta.num_tokens
    kv = torch.randn(2, 8, page, Hkv, Dh, generator=g)
    kv_ref = kv.clone()
    k, v = torch.randn(T, Hkv, Dh, generator=g), torch.randn(T, Hkv, Dh, generator=g)
    paged_attention.write_kv(kv, k, v, meta.slot_mapping)
    flat = kv_ref.view(2, -1, Hkv, Dh)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)
    assert torch.equal(kv, kv_ref)
    q = torch.randn(T, H, Dh, generator=g)
    args = (q, kv, meta.page_table, meta.token_row, meta.positions, meta.max_kv_len, 0.25)
    out = paged_attention.paged_attention(*args, num_prefill_tokens=meta.num_prefill_tokens)
    torch.testing.assert_close(out, paged_attention.paged_attention_ref(*args), rtol=1e-5,
                               atol=1e-5)
    assert as_if_cuda == [("write_kv", "triton"), ("paged_attention", "triton")]
