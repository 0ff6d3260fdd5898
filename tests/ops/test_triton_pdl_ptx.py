"""What programmatic dependent launch lets a kernel do before `await_previous`, checked in the
PTX Triton generates for a Hopper (sm_90; compiled on the host, no GPU needed): no global load,
store, atomic or prefetch precedes `griddepcontrol.wait`, so nothing reads what the previous
kernel may still be writing; with the few-rows linears' weight prefetch on (tuning knob
`prefetch_bytes`), L2 prefetches of the weight rows, which no kernel writes, and nothing else.
The compile runs in a subprocess without the Triton interpreter."""

from __future__ import annotations

import pytest
from offline_ptx import compile_report, skip_without_triton

skip_without_triton()

SCRIPT = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mambaserve.ops.triton._common import _PDL_BUILD
from mambaserve.ops.triton.conv1d_update import _conv_update_kernel
from mambaserve.ops.triton.fp8_gemv import _fp8_gemv_kernel
from mambaserve.ops.triton.gemv import _gemv_kernel
from mambaserve.ops.triton.rmsnorm import _rms_norm_kernel
from mambaserve.ops.triton.selective_state_update import _ssu_kernel

if not _PDL_BUILD:
    print(json.dumps(None)); sys.exit(0)
F32 = ("part_ptr", "ssm_ptr", "state_ptr", "A_ptr", "D_ptr", "dt_bias_ptr", "ws_ptr",
       "in_scale_ptr", "scale_ptr")
I32 = ("cnt_ptr",)
FP8 = ("w_ptr", "x_ptr")

def sig(kern, const, fp8=False):
    out = {}
    for n in kern.arg_names:
        if n in const:
            out[n] = "constexpr"
        elif n.endswith("_ptr"):
            out[n] = ("*fp32" if n in F32 else "*i32" if n in I32 else "*i64" if n == "slot_ptr"
                      else "*fp8e4nv" if fp8 and n in FP8 else "*bf16")
        else:
            out[n] = "fp32" if n in ("eps", "dt_lo", "dt_hi") else "i32"
    return out

CASES = {
    "gemv": (_gemv_kernel, dict(HAS_BIAS=False, SPLIT=True, EVEN_K=True, USE_DOT=False,
                                IEEE=False, ACT=0, HAS_ADD=False, OUT_ACT=0, BLOCK_M=1,
                                BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3, PREFETCH_LINES=0,
                                LATE_TRIGGER=False), False),
    # relu² in the epilogue, the next kernel let in after the main loop (tuning late_trigger)
    "gemv_late": (_gemv_kernel, dict(HAS_BIAS=False, SPLIT=True, EVEN_K=True, USE_DOT=True,
                                     IEEE=False, ACT=0, HAS_ADD=False, OUT_ACT=1, BLOCK_M=16,
                                     BLOCK_N=64, BLOCK_K=128, NUM_STAGES=4, PREFETCH_LINES=0,
                                     LATE_TRIGGER=True), False),
    "fp8_gemv": (_fp8_gemv_kernel, dict(STATIC=False, PREQUANT=True, HAS_BIAS=False,
                                        SPLIT=True, EVEN_K=True, USE_DOT=True, HW_FP8=True,
                                        BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, BLOCK_A=1024,
                                        NUM_STAGES=3, FOLD=1, PROMOTE_K=0,
                                        PREFETCH_LINES=0), True),
    # with the L2 prefetch of the weight rows (tuning knob prefetch_bytes): only prefetches
    "gemv_prefetch": (_gemv_kernel, dict(HAS_BIAS=False, SPLIT=True, EVEN_K=True, USE_DOT=False,
                                         IEEE=False, ACT=0, HAS_ADD=False, OUT_ACT=0,
                                         BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3,
                                         PREFETCH_LINES=16, LATE_TRIGGER=False), False),
    "fp8_gemv_prefetch": (_fp8_gemv_kernel, dict(STATIC=False, PREQUANT=True, HAS_BIAS=False,
                                                 SPLIT=False, EVEN_K=True, USE_DOT=False,
                                                 HW_FP8=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
                                                 BLOCK_A=1024, NUM_STAGES=3, FOLD=1,
                                                 PROMOTE_K=0, PREFETCH_LINES=16), True),
    "conv1d_update": (_conv_update_kernel, dict(K=4, HAS_BIAS=True, SILU=True, BLOCK_D=256,
                                                     SHARED_LANES=False, SNAP=False),
                      False),
    "conv1d_update_snap": (_conv_update_kernel, dict(K=4, HAS_BIAS=True, SILU=True,
                                                     BLOCK_D=256, SHARED_LANES=False, SNAP=True),
                           False),
    "selective_state_update": (_ssu_kernel, dict(BLOCK_P=16, BLOCK_N=128, SHARED_LANES=False,
                                                 SNAP=False), False),
    "selective_state_update_snap": (_ssu_kernel, dict(BLOCK_P=16, BLOCK_N=128,
                                                      SHARED_LANES=False, SNAP=True), False),
    "rms_norm": (_rms_norm_kernel, dict(HAS_RESIDUAL=True, ADD_NATIVE=False, QUANT=False,
                                        HW_FP8=True, BLOCK_D=1024), False),
}
ATOMIC = re.compile(r"(^|[\s;])(atom|red)\.")  # not the "red." of "st.shared."
report = {}
for name, (kern, const, fp8) in CASES.items():
    c = dict(const, PDL=1)
    k = triton.compile(ASTSource(kern, sig(kern, c, fp8), c), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "launch_pdl": True})
    lines = k.asm["ptx"].splitlines()
    wait = next(i for i, l in enumerate(lines) if "griddepcontrol.wait" in l)
    before = [l.strip() for l in lines[:wait]]
    trigger = next((i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l),
                   len(lines))
    report[name] = {
        "loads": sum("ld.global" in l for l in before),
        "stores": sum("st.global" in l for l in before),
        "atomics": sum(bool(ATOMIC.search(l)) for l in before),
        "prefetches": sum("prefetch.global.L2" in l for l in before),
        "loads_before_trigger": sum("ld.global" in l or "cp.async" in l
                                    for l in lines[:trigger]),
    }
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def before_the_wait():
    report = compile_report(SCRIPT, "the PDL kernels")
    if report is None:
        pytest.skip("this Triton build has no programmatic dependent launch")
    return report


@pytest.mark.parametrize("kernel", ["gemv", "gemv_late", "fp8_gemv", "conv1d_update",
                                    "conv1d_update_snap",
                                    "selective_state_update", "selective_state_update_snap",
                                    "rms_norm"])
def test_no_memory_is_touched_before_the_wait(before_the_wait, kernel):
    report = dict(before_the_wait[kernel])
    report.pop("loads_before_trigger")
    assert report == {"loads": 0, "stores": 0, "atomics": 0, "prefetches": 0}


def test_the_late_trigger_comes_after_the_weight_loads(before_the_wait):
    """tuning gemv.late_trigger: the next kernel is let in after the main loop (its weight
    loads precede griddepcontrol.launch_dependents), else right after the wait."""
    assert before_the_wait["gemv"]["loads_before_trigger"] == 0
    assert before_the_wait["gemv_late"]["loads_before_trigger"] > 0


@pytest.mark.parametrize("kernel", ["gemv_prefetch", "fp8_gemv_prefetch"])
def test_the_weight_prefetch_is_all_that_precedes_the_wait(before_the_wait, kernel):
    # 8 rows x 16 lines over 128 threads: one prefetch each, kept though its result is unused
    report = dict(before_the_wait[kernel])
    report.pop("loads_before_trigger")
    assert report == {"loads": 0, "stores": 0, "atomics": 0, "prefetches": 1}
