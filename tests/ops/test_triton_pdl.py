"""Programmatic dependent launch of the decode-path kernels (`ops/triton/_common.py`, on unless
MAMBASERVE_PDL=0): off on the CPU / interpreter whatever the switch; on a Hopper GPU a chain of
dependent launches (norm -> few-rows linear -> norm with residual -> the Mamba decode step's conv
step and state update, as the engine runs them) computes the same bits with it on as off, eagerly
and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.triton._common import _PDL_BUILD, PDL_ENV, pdl_launch
from mambaserve.ops.triton.conv1d_update import causal_conv1d_update_triton
from mambaserve.ops.triton.gemv import gemv_triton
from mambaserve.ops.triton.rmsnorm import _rms_norm_kernel, rms_norm_triton
from mambaserve.ops.triton.selective_state_update import selective_state_update_triton

require_interpreter(_rms_norm_kernel)


def _switch(monkeypatch, on: str) -> None:
    monkeypatch.setenv(PDL_ENV, on)
    pdl_launch.cache_clear()  # the switch is read once per process and device


@pytest.fixture(autouse=True)
def _reread_the_switch():
    yield
    pdl_launch.cache_clear()


def test_off_without_a_compiled_hopper_kernel(monkeypatch):
    for on in ("1", "yes", None):  # None: unset, the default (on)
        if on is None:
            monkeypatch.delenv(PDL_ENV, raising=False)
            pdl_launch.cache_clear()
        else:
            _switch(monkeypatch, on)
        assert pdl_launch(torch.device("cpu"), _rms_norm_kernel) == {"PDL": 0}
    _switch(monkeypatch, "0")
    assert pdl_launch(torch.device(DEV), _rms_norm_kernel) == {"PDL": 0}


def _chain(x, w_norm, w_lin, xbc_w, conv_state, ssm_state, dt, A, D, dt_bias, slots):
    h = rms_norm_triton(x, w_norm, 1e-5)
    y = gemv_triton(h, w_lin)
    out, s = rms_norm_triton(y[:, : x.shape[1]], w_norm, 1e-5, x)
    xc = causal_conv1d_update_triton(y[:, x.shape[1]:], xbc_w, None, conv_state, slots)
    H, P, N = ssm_state.shape[1:]
    xs, B, C = xc.split([H * P, 2 * N, 2 * N], dim=-1)
    ys = selective_state_update_triton(ssm_state, xs.reshape(-1, H, P), dt, A,
                                       B.reshape(-1, 2, N), C.reshape(-1, 2, N), D, dt_bias,
                                       (0.0, float("inf")), slots)
    return out, s, ys


@pytest.mark.skipif(DEV != "cuda" or torch.cuda.get_device_capability() < (9, 0)
                    or not _PDL_BUILD,
                    reason="programmatic dependent launch needs a Hopper GPU and a Triton with it")
def test_dependent_launches_compute_the_same_bits(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    H, P, N, G, Dm = 8, 16, 32, 2, 256
    conv_dim = H * P + 2 * G * N

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    x, w_norm = rnd(2, Dm), rnd(Dm)
    w_lin = rnd(Dm + conv_dim, Dm, scale=0.05)
    xbc_w = rnd(conv_dim, 4, scale=0.5)
    conv0, ssm0 = rnd(5, 3, conv_dim), rnd(5, H, P, N, dtype=torch.float32)
    dt, A = rnd(2, H), -torch.rand(H, device="cuda") - 0.1
    D, dt_bias = rnd(H, dtype=torch.float32), rnd(H, dtype=torch.float32)
    slots = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    results = {}
    for on in ("0", "1"):
        _switch(monkeypatch, on)
        if on != "0":
            assert pdl_launch(x.device, _rms_norm_kernel) == {"PDL": 1, "launch_pdl": True}
        conv, ssm = conv0.clone(), ssm0.clone()
        eager = _chain(x, w_norm, w_lin, xbc_w, conv, ssm, dt, A, D, dt_bias, slots)
        conv_g, ssm_g = conv0.clone(), ssm0.clone()
        _chain(x, w_norm, w_lin, xbc_w, conv_g.clone(), ssm_g.clone(), dt, A, D, dt_bias, slots)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _chain(x, w_norm, w_lin, xbc_w, conv_g, ssm_g, dt, A, D, dt_bias, slots)
        conv_g.copy_(conv0)
        ssm_g.copy_(ssm0)
        graph.replay()
        torch.cuda.synchronize()
        results[on] = (eager, (conv, ssm), static, (conv_g, ssm_g))
    for a, b in zip(torch.utils._pytree.tree_leaves(results["0"]),
                    torch.utils._pytree.tree_leaves(results["1"])):
        assert torch.equal(a, b)
    for a, b in zip(torch.utils._pytree.tree_leaves(results["1"][0]),
                    torch.utils._pytree.tree_leaves(results["1"][2])):
        assert torch.equal(a, b)  # the graph replays what the eager launches computed
