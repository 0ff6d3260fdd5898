"""The MoE kernels compiled for a Hopper (sm_90) on the host (no GPU: tests/ops/offline_ptx.py).
Every launch the experts' rules pick fits its shared memory, in each dtype, for decode-sized and
prefill-sized blocks, with the TMA descriptors where the rules take them and the pointer loads a
misaligned tensor falls back to (a float32 model once took the 16-bit prefill tiles and failed to
capture its prefill graphs on an H100: 311 KB asked for, 227 KB there). The routing kernel
compiles with IEEE divisions, the layout kernels of large batches within shared memory."""

from __future__ import annotations

import pytest
from offline_ptx import compile_report, skip_without_triton

skip_without_triton()

SMEM_LIMIT = 232448  # bytes per block, opt-in maximum of sm_90

SCRIPT = r'''
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.moe_experts import _moe_in_kernel, _moe_out_kernel, launch_params

TYPES = {"fp32": (tl.float32, 4), "fp16": (tl.float16, 2), "bf16": (tl.bfloat16, 2)}
INT_PTRS = ("sorted_ptr", "block_expert_ptr")

def shared(kernel, const, dt, out_dt, descs, warps, stages):
    sig = {}
    for n in kernel.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n in descs:
            sig[n] = descs[n]
        elif n.endswith("_ptr"):
            sig[n] = ("*i32" if n in INT_PTRS else "*fp32" if n == "weight_ptr"
                      else "*" + out_dt if n == "out_ptr" else "*" + dt)
        else:
            sig[n] = "i32"
    k = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return k.metadata.shared

report = {}
cfg = tuning.DEFAULT["moe_experts"]
for name, (tl_dt, size) in TYPES.items():
    for block_m in (16, 128):
        p = launch_params(cfg, block_m, size, tma_capable=True)
        for tma in sorted({p["tma"], False}):
            bn, bk = p["block_n_in"], p["block_k_in"]
            desc = {"w_desc": f"tensordesc<{name}[{bn},{bk}]>"} if tma else {}
            const = dict(SWIGLU=True, DT=tl_dt, IP="tf32", TMA=tma, BLOCK_M=block_m,
                         BLOCK_N=bn, BLOCK_K=bk, **({} if tma else {"w_desc": None}))
            report[f"in/{name}/{block_m}/{tma}"] = shared(
                _moe_in_kernel, const, name, name, desc, p["num_warps_in"], p["num_stages_in"])
            bn, bk = p["block_n_out"], p["block_k_out"]
            desc = ({"inter_desc": f"tensordesc<{name}[{block_m},{bk}]>",
                     "w_desc": f"tensordesc<{name}[{bn},{bk}]>"} if tma else {})
            const = dict(ROUND_PRODUCT=False, DT=tl_dt, IP="tf32", TMA=tma, BLOCK_M=block_m,
                         BLOCK_N=bn, BLOCK_K=bk,
                         **({} if tma else {"w_desc": None, "inter_desc": None}))
            report[f"out/{name}/{block_m}/{tma}"] = shared(
                _moe_out_kernel, const, name, "fp32", desc, p["num_warps_out"],
                p["num_stages_out"])
from mambaserve.ops.triton.moe_routing import _route_kernel
for sigmoid in (False, True):  # the routing kernel: libdevice's expf and IEEE divisions
    sig = {n: "*fp32" if n.endswith("_ptr") and n != "ids_ptr" else "*i64" if n == "ids_ptr"
           else "fp32" if n == "scale" else "i32" for n in _route_kernel.arg_names}
    const = dict(K=10, SIGMOID=sigmoid, NORMALIZE=sigmoid, OUT_DT=tl.bfloat16, HW_EXP=True,
                 BLOCK_E=128, BLOCK_K=16)
    for n in const:
        sig[n] = "constexpr"
    ptx = triton.compile(ASTSource(_route_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 1}).asm["ptx"]
    report[f"route/{sigmoid}"] = {"div_rn": "div.rn.f32" in ptx}
from mambaserve.ops.triton.moe_align import (_chunk_counts_kernel, _chunk_offsets_kernel,
                                              _chunk_scatter_kernel)
layout = {_chunk_counts_kernel: dict(BLOCK_E=128, CHUNK=1024, SUB=64),
          _chunk_offsets_kernel: dict(BLOCK_E=128, BLOCK_C=64, BLOCK_M=128),
          _chunk_scatter_kernel: dict(BLOCK_E=128, CHUNK=1024, SUB=64)}
for kernel, const in layout.items():  # the layout above 8192 pairs
    sig = {n: "constexpr" if n in const else "*i32" if n.endswith("_ptr") else "i32"
           for n in kernel.arg_names}
    k = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    report[f"layout/{kernel.fn.__name__}"] = k.metadata.shared
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def report():
    return compile_report(SCRIPT, "the MoE kernels")


def test_every_rule_launch_fits_in_shared_memory(report):
    report = {k: v for k, v in report.items() if not k.startswith(("route/", "layout/"))}
    too_big = {k: v for k, v in report.items() if v > SMEM_LIMIT}
    assert not too_big, too_big
    # 2 GEMMs x (float32: 2 block sizes; fp16 / bf16: the decode block, the prefill one by TMA
    # and by pointers)
    assert len(report) == 16
    assert report["in/bf16/128/True"] > report["in/bf16/16/False"]  # the prefill tiles pipeline


def test_routing_kernel_divides_exactly(report):
    """Both routers compile, and their divisions are IEEE (`div.rn`), as torch's."""
    assert report["route/False"]["div_rn"] and report["route/True"]["div_rn"]


def test_layout_kernels_compile_within_shared_memory(report):
    layout = {k: v for k, v in report.items() if k.startswith("layout/")}
    assert len(layout) == 3 and max(layout.values()) <= SMEM_LIMIT, layout
