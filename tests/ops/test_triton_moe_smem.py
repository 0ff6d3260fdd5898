"""Every launch the MoE experts' rules pick fits a Hopper's shared memory. Compiled for sm_90 on
the host (no GPU: tests/ops/offline_ptx.py), in each dtype, for decode-sized and prefill-sized
blocks, with the TMA descriptors where the rules take them and the pointer loads a misaligned
tensor falls back to. A float32 model once took the 16-bit prefill tiles and failed to capture
its prefill graphs on an H100 (311 KB asked for, 227 KB there)."""

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
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def report():
    return compile_report(SCRIPT, "the MoE experts' launches")


def test_every_rule_launch_fits_in_shared_memory(report):
    too_big = {k: v for k, v in report.items() if v > SMEM_LIMIT}
    assert not too_big, too_big
    # 2 GEMMs x (float32: 2 block sizes; fp16 / bf16: the decode block, the prefill one by TMA
    # and by pointers)
    assert len(report) == 16
    assert report["in/bf16/128/True"] > report["in/bf16/16/False"]  # the prefill tiles pipeline
