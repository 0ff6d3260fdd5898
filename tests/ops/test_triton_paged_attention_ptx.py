"""The tiled paged-attention kernel compiles for a Hopper (sm_90, bf16 pool) with and without its
key partitions (`SPLIT`), offline (tests/ops/offline_ptx.py): the split variant stores float32
partials (max, sum, accumulator) where the unsplit one stores the bf16 output."""

from __future__ import annotations

import pytest
from offline_ptx import SM90, compile_report, skip_without_triton

skip_without_triton()

SCRIPT = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mambaserve.ops.triton.paged_attention import _paged_attention_tiled_kernel as k

def sig(names, const):
    out = {}
    for n in names:
        if n in const:
            out[n] = "constexpr"
        elif n == "kv_ptr" or n == "q_ptr" or n == "out_ptr":
            out[n] = "*bf16"
        elif n in ("ml_ptr", "acc_ptr"):
            out[n] = "*fp32"
        elif n.endswith("_ptr"):
            out[n] = "*i64"
        elif n == "scale":
            out[n] = "fp32"
        else:
            out[n] = "i32"
    return out

report = {}
for split in (False, True):
    const = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=128, IP="tf32", SPLIT=split)
    c = triton.compile(ASTSource(k, sig(k.arg_names, const), const),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = c.asm["ptx"]
    report[str(split)] = {"f32_stores": len(re.findall(r"st\.global(?:\.v\d)?\.b32", ptx)),
                          "b16_stores": len(re.findall(r"st\.global(?:\.v\d)?\.b16", ptx))}
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def stores():
    return compile_report(SCRIPT, "the tiled paged-attention kernel")


def test_both_variants_compile_and_store_what_they_should(stores):
    assert stores["False"]["f32_stores"] == 0 and stores["False"]["b16_stores"] > 0
    assert stores["True"]["f32_stores"] > 0 and stores["True"]["b16_stores"] == 0


SPILL_SCRIPT = r'''
import json
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.paged_attention import (_paged_attention_tiled_kernel as k,
                                                   TILED_BLOCK_N, tiled_num_warps)

ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "ml_ptr": "*fp32",
        "acc_ptr": "*fp32"}
# as the engine launches it: unit strides specialized, the others multiples of 16
unit = ("q_d", "c_d", "pt_p", "o_d", "ml_s", "a_d")
div = ("q_t", "q_h", "c_kv", "c_p", "c_s", "c_h", "o_t", "o_h", "a_t", "a_h", "a_s", "Dh")
block_m = tuning.DEFAULT["paged_attention_tiled"]["block_m"]
report = {}
for dh in (128, 64):
    nw = tiled_num_warps(block_m, TILED_BLOCK_N, dh)
    for split in (False, True):
        const = dict(BLOCK_M=block_m, BLOCK_N=TILED_BLOCK_N, BLOCK_D=dh, IP="tf32", SPLIT=split,
                     **{n: 1 for n in unit})
        sig = {n: "constexpr" if n in const else ptrs.get(n, "*i64" if n.endswith("_ptr")
                                                          else "fp32" if n == "scale" else "i32")
               for n in k.arg_names}
        ptx, spills = sm90(k, sig, const, div, nw)
        report[f"{dh}_{split}"] = {"spill_bytes": spills, "num_warps": nw,
                                   "wgmma": len(re.findall(r"wgmma\.mma_async", ptx))}
print(json.dumps(report))
'''


def test_default_launch_spills_no_register_on_sm90():
    """The tiled kernel at the launcher's default tile (128 query rows, `TILED_BLOCK_N` keys,
    `tiled_num_warps` warps), head_dim 128 and 64, with and without key partitions, compiled
    offline for sm_90 as the engine's launches specialize it: ptxas spills nothing and the dots
    run on wgmma. (The earlier default, 16 keys per step on 4 warps at head_dim 128, spilled
    148-264 bytes per thread.)"""
    report = compile_report(SM90 + SPILL_SCRIPT,
                            "the tiled paged-attention kernel's default launch")
    for key, r in report.items():
        assert r["spill_bytes"] == 0, (key, r)
        assert r["wgmma"] > 0, (key, r)
    assert report["128_False"]["num_warps"] == 8 and report["64_False"]["num_warps"] == 8
