"""The tiled paged-attention kernel compiles for a Hopper (sm_90, bf16 pool) with and without its
key partitions (`SPLIT`), offline (tests/ops/offline_ptx.py): the split variant stores float32
partials (max, sum, accumulator) where the unsplit one stores the bf16 output."""

from __future__ import annotations

import pytest
from offline_ptx import compile_report, skip_without_triton

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
