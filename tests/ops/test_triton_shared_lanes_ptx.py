"""Kernels that read values and then overwrite them in place, when a tile has fewer elements than
the program has threads: each value is then held (and loaded) by several warps and stored by one,
and warps are not in step, so a barrier must separate the loads from the first store
(docs/kernels.md, "Known limits"). Checked in the PTX Triton generates for a Hopper (sm_90,
compiled on the host in a subprocess, no GPU needed): the barrier is there when the launch asks
for it, and a full-size tile compiles without it."""

from __future__ import annotations

import pytest
from offline_ptx import compile_report, skip_without_triton

skip_without_triton()

SCRIPT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mambaserve.ops.triton.conv1d_update import _conv_update_kernel
from mambaserve.ops.triton.selective_state_update import _ssu_kernel

F32 = ("state_ptr", "A_ptr", "D_ptr", "dt_bias_ptr")

def sig(kern, const):
    out = {}
    for n in kern.arg_names:
        if n in const:
            out[n] = "constexpr"
        elif n.endswith("_ptr"):
            out[n] = "*fp32" if n in F32 else "*i32" if n == "slot_ptr" else "*bf16"
        else:
            out[n] = "fp32" if n in ("dt_lo", "dt_hi") else "i32"
    return out

def report(kern, const, num_warps):
    k = triton.compile(ASTSource(kern, sig(kern, const), const),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    lines = [l.strip() for l in k.asm["ptx"].splitlines()]
    first_store = next(i for i, l in enumerate(lines) if "st.global" in l)
    first_load = next(i for i, l in enumerate(lines) if "ld.global" in l)
    bars = [i for i, l in enumerate(lines) if l.startswith(("bar.sync", "barrier.sync"))]
    # a barrier after loads and before any store: the loads it follows are done in every warp
    return {"barriers": len(bars),
            "barrier_between": any(first_load < i < first_store for i in bars)}

out = {}
for shared in (True, False):
    out[f"ssu_{shared}"] = report(_ssu_kernel, dict(BLOCK_P=1, BLOCK_N=16, SHARED_LANES=shared,
                                                    SNAP=False, PDL=0), 2)
for shared in (True, False):
    out[f"conv_{shared}"] = report(_conv_update_kernel, dict(K=4, HAS_BIAS=False, SILU=True,
                                                             BLOCK_D=32, SHARED_LANES=shared,
                                                             SNAP=False, PDL=0), 4)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ptx():
    return compile_report(SCRIPT, "the in-place decode kernels")


def test_state_update_barrier_only_when_its_tile_shares_lanes(ptx):
    assert ptx["ssu_True"]["barrier_between"]
    assert ptx["ssu_True"]["barriers"] == ptx["ssu_False"]["barriers"] + 1


def test_conv_step_reads_its_window_before_shifting_it_when_lanes_are_shared(ptx):
    # 32 channels in 128 threads: every value in four warps
    assert ptx["conv_True"]["barrier_between"]
    assert ptx["conv_True"]["barriers"] == ptx["conv_False"]["barriers"] + 1
