"""The e4m3 (float8_e4m3fn) codec in integer operations, for the FP8 kernels under the CPU
interpreter, where float8 conversions are not right: `e4m3_decode` (codes -> float32 values) and
`e4m3_encode` (float32 values within +-448 -> codes, round to nearest even). On the GPU the
kernels use the hardware conversions instead (their `HW_FP8` constexpr). Both are tested bit for
bit against torch's `float8_e4m3fn` (tests/ops/test_triton_fp8_gemv.py)."""

from __future__ import annotations

import triton
import triton.language as tl


# float8_e4m3fn: sign, 4-bit exponent of bias 7, 3-bit mantissa, no infinities
@triton.jit
def e4m3_decode(bits):
    """uint8 codes -> float32 values: subnormals m * 2^-9, normals (8 + m) * 2^(e - 10), 0x7F and
    0xFF NaN, 0x80 -0.0."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    nan = (b * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    mag = tl.where((e == 15) & (m == 7), nan, mag)
    signed = mag.to(tl.int32, bitcast=True) | ((b >> 7) << 31)  # -0.0 for 0x80 too
    return signed.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_encode(v):
    """float32 values with |v| <= 448 (after the clamp) -> uint8 codes, rounded to nearest even
    (NaN -> 0x7F). The significand (implicit bit included) is shifted right by 20 for the
    normal binades (2^-6 and up: code = (E + 6) * 8 + rounded (8 + m), a carry rolls into the
    exponent) and by 14 - E below (subnormals in steps of 2^-9)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    E = ((bits >> 23) & 255) - 127
    sig = (bits & 0x7FFFFF) | 0x800000
    normal = E >= -6
    sh = tl.where(normal, 20, tl.minimum(14 - E, 25))
    one = sig * 0 + 1
    keep = sig >> sh
    rem = sig & ((one << sh) - 1)
    half = one << (sh - 1)
    up = (rem > half) | ((rem == half) & ((keep & 1) == 1))
    code = tl.where(normal, (E + 6) * 8, 0) + keep + up.to(tl.int32)
    code = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 127, code)  # NaN
    return (code | (sign << 7)).to(tl.uint8)
