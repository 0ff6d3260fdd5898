"""Kernels that take a size or row stride unspecialized (`do_not_specialize`: one compile for
every value) must still access memory in 16-byte vectors: `_common.divisibility` passes the
sizes' alignment as the `DIV` constexpr and `aligned` hands it to the compiler. Checked in the
PTX Triton generates for a Hopper (sm_90; compiled on the host in a subprocess without the
interpreter, no GPU needed). Without it the elementwise passes moved one bf16 element per load
and ran at ~1/3 of the copy ceiling on an H100 (docs/kernels.md). Also: the RMSNorm that writes
FP8 rows stores its codes in the layout of its loads, and the few-rows linears at one row read
their weight tiles from shared memory in whole words."""

from __future__ import annotations

import re

import pytest
from offline_ptx import compile_report, skip_without_triton

skip_without_triton()

SCRIPT = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mambaserve.ops.triton.activation import _relu2_kernel, _silu_mul_kernel
from mambaserve.ops.triton.fp8_quant import _quant_rows_kernel

def widths(kernel, const):
    names = kernel.arg_names
    sig = {n: "constexpr" if n in const else
           ("*fp32" if n in ("s_ptr", "in_scale_ptr") else "*u8" if n == "q_ptr" else "*bf16")
           if n.endswith("_ptr") else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")}
    k = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8})
    ptx = k.asm["ptx"]
    return {"loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
            "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx)))}

report = {}
for div in (1, 16):
    report[f"relu2/{div}"] = widths(_relu2_kernel, {"BLOCK": 4096, "DIV": div})
    report[f"silu_mul/{div}"] = widths(_silu_mul_kernel, {"BLOCK": 2048, "DIV": div})
    for one in (True, False):
        report[f"fp8_quant_{'one' if one else 'loop'}/{div}"] = widths(
            _quant_rows_kernel, dict(STATIC=False, ACT=1, ONE_TILE=one, HW_FP8=True,
                                     BLOCK=4096, DIV=div, PDL=0))
from mambaserve.ops.triton.rmsnorm import _rms_norm_kernel
names = _rms_norm_kernel.arg_names
for quant in (False, True):
    const = dict(HAS_RESIDUAL=True, ADD_NATIVE=False, QUANT=quant, HW_FP8=True, BLOCK_D=8192,
                 PDL=0, x_d=1, r_d=1, w_d=1)
    sig = {n: "constexpr" if n in const else "fp32" if n == "eps" else
           ("*u8" if n == "out_ptr" and quant else "*fp32" if n == "scale_ptr" else "*bf16")
           if n.endswith("_ptr") else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in ("D", "x_t", "r_t", "o_t", "s_t")}
    ptx = triton.compile(ASTSource(_rms_norm_kernel, sig, const, attrs),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    report[f"rms_norm/{'fp8' if quant else 'bf16'}"] = {
        "barriers": len(re.findall(r"bar\.sync", ptx)),
        "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx)))}
# the few-rows linears at one row, pipelined as launched: which shared-memory reads feed the FMAs
from mambaserve.ops.triton.fp8_gemv import _fp8_gemv_kernel
from mambaserve.ops.triton.gemv import _gemv_kernel
ONE_ROW = {
    "gemv": (_gemv_kernel, dict(HAS_BIAS=False, SPLIT=False, EVEN_K=True, USE_DOT=False,
                                IEEE=False, ACT=0, HAS_ADD=False, OUT_ACT=0, BLOCK_M=1,
                                BLOCK_N=8, BLOCK_K=256, NUM_STAGES=4, PREFETCH_LINES=0,
                                LATE_TRIGGER=False, PDL=0), "*bf16"),
    "fp8_gemv": (_fp8_gemv_kernel, dict(STATIC=False, PREQUANT=True, HAS_BIAS=False, SPLIT=False,
                                        EVEN_K=True, USE_DOT=False, HW_FP8=True, BLOCK_M=1,
                                        BLOCK_N=8, BLOCK_K=512, BLOCK_A=2048, NUM_STAGES=3,
                                        FOLD=1, PROMOTE_K=0, PDL=0), "*fp8e4nv"),
}
for name, (kernel, const, operand) in ONE_ROW.items():
    names = kernel.arg_names
    sig = {n: "constexpr" if n in const else
           ("*fp32" if n in ("ws_ptr", "in_scale_ptr", "part_ptr") else "*i32" if n == "cnt_ptr"
            else operand if n in ("x_ptr", "w_ptr") else "*bf16")
           if n.endswith("_ptr") else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in ("N", "K", "stride_xm", "stride_wn", "k_per_split")}
    ptx = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    report[f"one_row/{name}"] = sorted(set(re.findall(r"ld\.shared[.\w]*", ptx)))
# bf16 rows times a float32 weight (linear_float32: NemotronH's router), one row and eight
names = _gemv_kernel.arg_names
for rows, bk in ((1, 512), (8, 64)):
    const = dict(HAS_BIAS=False, SPLIT=True, EVEN_K=False, USE_DOT=False, IEEE=False, ACT=0,
                 HAS_ADD=False, OUT_ACT=0, BLOCK_M=rows, BLOCK_N=4, BLOCK_K=bk, NUM_STAGES=4,
                 PREFETCH_LINES=0, LATE_TRIGGER=False, PDL=0)
    sig = {n: "constexpr" if n in const else
           ("*bf16" if n == "x_ptr" else "*i32" if n == "cnt_ptr" else "*fp32")
           if n.endswith("_ptr") else "i32" for n in names}
    k = triton.compile(ASTSource(_gemv_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    report[f"float32_weight/{rows}"] = {
        "bf16_to_f32": len(re.findall(r"cvt\.f32\.bf16", k.asm["ptx"])) + len(
            re.findall(r"shl\.b32", k.asm["ptx"])),
        "fma": len(re.findall(r"fma\.rn\.f32", k.asm["ptx"])), "shared": k.metadata.shared}
print(json.dumps(report))
'''

KERNELS = ["relu2", "silu_mul", "fp8_quant_one", "fp8_quant_loop"]


@pytest.fixture(scope="module")
def widths():
    return compile_report(SCRIPT, "the activation and quantization kernels")


@pytest.mark.parametrize("kernel", KERNELS)
def test_aligned_sizes_give_16_byte_loads(widths, kernel):
    got = widths[f"{kernel}/16"]
    assert got["loads"] == ["ld.global.v4.b32"], got


@pytest.mark.parametrize("kernel", ["relu2", "silu_mul"])
def test_aligned_sizes_give_16_byte_stores(widths, kernel):
    assert widths[f"{kernel}/16"]["stores"] == ["st.global.v4.b32"], widths[f"{kernel}/16"]


@pytest.mark.parametrize("kernel", ["fp8_quant_one", "fp8_quant_loop"])
def test_aligned_fp8_rows_are_stored_16_bytes_at_a_time(widths, kernel):
    # the codes in 16-byte vectors; the row's one float32 scale is the only other store
    assert widths[f"{kernel}/16"]["stores"] == ["st.global.b32", "st.global.v4.b32"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_odd_sizes_fall_back_to_element_accesses(widths, kernel):
    # DIV 1 (a size no power of two divides) is what every launch compiled to before `DIV`:
    # the check above is not vacuous
    assert all(not re.search(r"\.v\d", w) for w in widths[f"{kernel}/1"]["loads"])


def test_fp8_rmsnorm_stores_codes_in_the_layout_of_its_loads(widths):
    # 8 codes per thread (v2.b32), as the bf16 loads and the residual's store hold 8 values:
    # unhinted, the byte store took 16 per thread and the whole row went through shared memory
    # between the two layouts (9 barriers); now only the amax adds a block reduction (+2, +1
    # before its shared memory is reused)
    plain, fp8 = widths["rms_norm/bf16"], widths["rms_norm/fp8"]
    assert fp8["stores"] == ["st.global.b32", "st.global.v2.b32", "st.global.v4.b32"], fp8
    assert fp8["barriers"] <= plain["barriers"] + 3, (plain, fp8)


@pytest.mark.parametrize("rows", [1, 8])
def test_float32_weight_launch_compiles_for_hopper(widths, rows):
    # linear_float32's launch (bf16 rows, a float32 weight, split K) builds for sm_90: its bf16
    # loads widened to float32 in registers (cvt, or the shift that widens a bf16), float32 FMAs,
    # the pipelined tiles within an SM's shared memory
    got = widths[f"float32_weight/{rows}"]
    assert got["bf16_to_f32"] > 0 and got["fma"] > 0 and got["shared"] <= 227 * 1024, got


@pytest.mark.parametrize("kernel", ["gemv", "fp8_gemv"])
def test_one_row_linears_read_the_weight_tile_in_words(widths, kernel):
    # one row accumulates [BLOCK_N, BLOCK_K] products in the weight tile's own layout: the 3-D
    # product's broadcast over rows read the pipelined tile back from shared memory one element
    # at a time (ld.shared.b16 / .b8) and ran slower (docs/kernels.md, "Few-rows linear")
    assert widths[f"one_row/{kernel}"] == ["ld.shared.b32"], widths[f"one_row/{kernel}"]
