"""The one-launch FP8 linear for few rows (`mambaserve/ops/triton/fp8_gemv.py`) against
`fp8_linear_ref` (CPU interpreter without CUDA; compiled on a GPU of compute capability >= 8.9):
the e4m3 decode / encode helpers bit for bit against torch's float8_e4m3fn, the product within a
tight tolerance (the same quantized operands, float32 sums in another order), both inner
products (FMA, tensor cores), split K, the dispatch switch; on the GPU the 9B preset's shapes
and a CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

# isort: split
import triton
import triton.language as tl

from mambaserve.ops import dispatch, fp8_matmul
from mambaserve.ops.dispatch import FP8_GEMV_ENV, kernel_path
from mambaserve.ops.fp8_matmul import FP8_DTYPE, fp8_linear, fp8_linear_ref, quantize_weight_fp8
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.fp8_codec import e4m3_decode, e4m3_encode
from mambaserve.ops.triton.fp8_gemv import _fp8_gemv_kernel, fp8_gemv_triton, launch_plan
from mambaserve.ops.triton.gemv import column_counters

require_interpreter(_fp8_gemv_kernel)

FP8_GPU = DEV == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA device of compute capability >= 8.9")
cpu_only = pytest.mark.skipif(DEV != "cpu", reason="runs the kernel under the interpreter")


@triton.jit
def _codec_kernel(code_ptr, dec_ptr, val_ptr, enc_ptr, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    b = tl.load(code_ptr + offs, mask=m, other=0)
    v = tl.load(val_ptr + offs, mask=m, other=0.0)
    if HW:
        dec = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        enc = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        dec = e4m3_decode(b)
        enc = e4m3_encode(v)
    tl.store(dec_ptr + offs, dec, mask=m)
    tl.store(enc_ptr + offs, enc, mask=m)


def _float_sweep() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (the ties) and the float32 values next
    to them, a dense grid over +-448, the subnormal range, +-0, tiny values."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), mids,
                      torch.nextafter(mids, torch.tensor(1e9))])
    dense = torch.linspace(0, 448, 200_001)
    small = torch.linspace(0, 2.0 ** -5, 20_001)
    tiny = torch.tensor([1e-30, 1e-40, 2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 2.0 ** -149])
    pos = torch.cat([grid, near, dense, small, tiny]).clamp(max=448.0)
    return torch.cat([pos, -pos])


def _run_codec(hw: bool, codes: torch.Tensor, vals: torch.Tensor):
    n = vals.numel()
    codes = torch.cat([codes, torch.zeros(n - codes.numel(), dtype=torch.uint8)]).to(DEV)
    vals = vals.to(DEV)
    dec = torch.empty(n, device=DEV)
    enc = torch.empty(n, dtype=torch.uint8, device=DEV)
    block = 4096
    _codec_kernel[(triton.cdiv(n, block),)](codes, dec, vals, enc, n, HW=hw, BLOCK=block)
    return dec[:256].cpu(), enc.cpu()


@pytest.mark.parametrize("hw", [False] + ([True] if FP8_GPU else []))
def test_e4m3_decode_and_encode_are_bit_exact(hw):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = _float_sweep()
    dec, enc = _run_codec(hw, codes, vals)
    want_dec = codes.view(FP8_DTYPE).float()
    nan = want_dec.isnan()
    assert nan.sum() == 2 and torch.equal(dec.isnan(), nan)  # 0x7F and 0xFF
    assert torch.equal(dec[~nan].view(torch.int32), want_dec[~nan].view(torch.int32))  # -0.0 too
    want_enc = vals.to(FP8_DTYPE).view(torch.uint8)
    bad = (enc != want_enc).nonzero().flatten()
    assert bad.numel() == 0, [(vals[i].item(), enc[i].item(), want_enc[i].item()) for i in bad[:5]]


def _operands(M, K, N, seed, per_tensor=False, static=False, bias=True, zero_rows=(),
              dtype=torch.float32, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 1, M)[:, None]
    for r in zero_rows:
        x[r] = 0
    w = torch.randn(N, K, generator=g) * torch.linspace(0.01, 0.1, N)[:, None]
    wq, ws = quantize_weight_fp8(w, per_channel=not per_tensor)
    in_scale = (x.abs().amax() / 600.0).reshape(()) if static else None  # some saturate
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    to = lambda t: None if t is None else t.to(device)
    return x.to(device, dtype), wq.to(device), ws.to(device), to(in_scale), to(b)


def _abs_bound(x, wq, ws, in_scale):
    """sum_k |x_q s_x| |w_q s_w| per output: what float32 reordering can move, times eps."""
    q, s = fp8_matmul.quantize_fp8_ref(x.float(), in_scale)
    return (q.float() * s).abs() @ (wq.float() * ws.float().reshape(-1, 1)).abs().t()


def _check(got, x, wq, ws, in_scale, b, rel=1e-5):
    want = fp8_linear_ref(x.float(), wq, ws, in_scale, b)  # float32 out: no rounding yet
    assert got.shape == want.shape and got.dtype == x.dtype
    # fp32 sums in another order; plus the one rounding to x.dtype
    tol = rel * _abs_bound(x, wq, ws, in_scale) + want.abs() * (
        0 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps)
    err = (got.float() - want).abs()
    assert (err <= tol + 1e-30).all(), (err - tol).max().item()


CPU_CASES = [  # M, K, N: neither K nor N a multiple of any block
    (1, 200, 37), (2, 333, 50), (3, 129, 70), (4, 301, 19), (5, 250, 66), (8, 97, 33),
    (13, 160, 45), (16, 211, 80), (24, 150, 40), (32, 97, 21)]


@cpu_only
@pytest.mark.parametrize("M,K,N", CPU_CASES)
@pytest.mark.parametrize("static", [False, True])
def test_kernel_matches_the_reference(M, K, N, static):
    x, wq, ws, s_in, b = _operands(M, K, N, seed=M * K, static=static,
                                   zero_rows=[M // 2] if M > 1 else ())
    _check(fp8_gemv_triton(x, wq, ws, s_in, b), x, wq, ws, s_in, b)


@cpu_only
@pytest.mark.parametrize("knobs", [{"dot_min_m": 1}, {"dot_min_m": 99},
                                   {"split_k": 3, "block_k": 64},
                                   {"dot_min_m": 1, "split_k": 2, "block_k": 32},
                                   {"block_n": 4, "block_k": 64, "split_k": 5},
                                   {"dot_min_m": 99, "block_k": 64, "fold": 4},
                                   {"dot_min_m": 1, "promote_k": 32, "block_k": 64}])
@pytest.mark.parametrize("M", [1, 6, 24])
def test_both_inner_products_and_split_k(knobs, M):
    x, wq, ws, s_in, b = _operands(M, 300, 41, seed=7 + M)
    with tuning.override("fp8_gemv", **knobs):
        plan = launch_plan(M, 41, 300, x.device)
        if "split_k" in knobs:
            assert plan["split_k"] > 1
        got = fp8_gemv_triton(x, wq, ws, s_in, b)
        again = fp8_gemv_triton(x, wq, ws, s_in, b)
    _check(got, x, wq, ws, s_in, b)
    # split K: the parts added in one fixed order (the same bits on every run), and the
    # arrival counters left at zero for the next launch
    assert torch.equal(got, again)
    assert int(column_counters(x.device).abs().sum()) == 0


@cpu_only
@pytest.mark.parametrize("per_tensor", [False, True])
def test_scales_bias_and_dtypes(per_tensor):
    for dtype, bias in [(torch.float32, False), (torch.float16, True)]:
        x, wq, ws, s_in, b = _operands(3, 140, 24, seed=3, per_tensor=per_tensor, bias=bias,
                                       dtype=dtype)
        assert ws.dim() == (0 if per_tensor else 1)
        _check(fp8_gemv_triton(x, wq, ws, s_in, b), x, wq, ws, s_in, b)
    # strided rows, all-zero input
    x, wq, ws, s_in, b = _operands(4, 96, 20, seed=4)
    wide = torch.zeros(4, 128)
    wide[:, :96] = x
    _check(fp8_gemv_triton(wide[:, :96], wq, ws, None, b), x, wq, ws, None, b)
    zeros = torch.zeros(2, 96)
    assert torch.equal(fp8_gemv_triton(zeros, wq, ws, None, b), b.expand(2, -1))
    assert fp8_gemv_triton(torch.zeros(0, 96), wq, ws, None, b).shape == (0, 20)


@cpu_only
@pytest.mark.parametrize("knobs", [{"dot_min_m": 99}, {"dot_min_m": 1, "split_k": 2,
                                                      "block_k": 32}])
def test_prequantized_rows_match_the_reference(knobs):
    """x given as its e4m3 codes and per-row scales (the quantization launched before the
    kernel): the same product as quantizing inside."""
    x, wq, ws, _, b = _operands(5, 200, 33, seed=21, zero_rows=[2])
    q, s = fp8_matmul.quantize_fp8_ref(x)
    with tuning.override("fp8_gemv", **knobs):
        got = fp8_gemv_triton(q, wq, ws, bias=b, x_scale=s, out_dtype=x.dtype)
    assert got.dtype == x.dtype
    _check(got, x, wq, ws, None, b)
    with pytest.raises(AssertionError, match="need x_scale and out_dtype"):
        fp8_gemv_triton(q, wq, ws)


def test_launch_plan_rules():
    with tuning.override("fp8_gemv", max_m=64):
        p1 = launch_plan(1, 4480, 15680, "cpu")
        p64 = launch_plan(64, 4480, 15680, "cpu")
    assert not p1["use_dot"] and p1["block_m"] == 1 and p1["split_k"] == 1
    assert p64["use_dot"] and p64["block_m"] == 64 and p64["block_n"] == 64
    for p in (p1, p64):
        assert p["k_per_split"] % p["block_k"] == 0
        assert (p["split_k"] - 1) * p["k_per_split"] < 15680 <= p["split_k"] * p["k_per_split"]
    x, wq, ws, _, _ = _operands(33, 32, 16, seed=0)
    with pytest.raises(AssertionError, match="max_m"):
        fp8_gemv_triton(x, wq, ws)


def test_tensor_core_rules(monkeypatch):
    """The tensor-core launches on an H100's 132 SMs at the 9B shapes: 128-wide K steps in 4
    stages; K split until 1.5 waves of programs (the 70 column blocks of out_proj 4 ways, the 245
    of up_proj and 354 of in_proj not at all); the FMA launches of one row keep 2 waves and 3
    stages; `split_waves` and `num_stages` override."""
    from mambaserve.ops.triton import fp8_gemv

    monkeypatch.setattr(fp8_gemv, "num_sms", lambda device: 132)
    for M in (4, 8, 16, 17, 32):
        p = launch_plan(M, 4480, 10240, "cpu")
        assert p["use_dot"] and (p["block_k"], p["num_stages"], p["split_k"]) == (128, 4, 4)
        assert launch_plan(M, 15680, 4480, "cpu")["split_k"] == 1
        assert launch_plan(M, 22656, 4480, "cpu")["split_k"] == 1
    one = launch_plan(1, 4480, 10240, "cpu")
    assert not one["use_dot"] and one["num_stages"] == 3
    # 225 four-column blocks: under 2 waves (the FMA launch splits K), over 1.5 (it would not)
    assert launch_plan(1, 900, 10240, "cpu")["split_k"] == 2
    with tuning.override("fp8_gemv", split_waves=2, num_stages=3):
        p = launch_plan(16, 15680, 4480, "cpu")
        assert (p["split_k"], p["num_stages"]) == (2, 3)


def test_dispatch_is_on_by_default_and_bounded_by_max_m(monkeypatch):
    x = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=FP8_DTYPE)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "fp8_capable", lambda device: True)
    monkeypatch.setattr(tuning, "_cuda_capability", lambda index: (9, 0))
    monkeypatch.setenv(FP8_GEMV_ENV, "0")
    assert kernel_path("fp8_gemv", "cuda:0", x=x, weight=w) == "reference"  # switched off
    monkeypatch.delenv(FP8_GEMV_ENV, raising=False)
    assert kernel_path("fp8_gemv", "cpu", x=x, weight=w) == "reference"
    assert kernel_path("fp8_gemv", "cuda:0", x=x, weight=w) == "triton"  # 6 rows <= 32
    assert kernel_path("fp8_gemv", "cuda:0", x=x.float(), weight=w) == "reference"
    assert kernel_path("fp8_gemv", "cuda:0", x=torch.zeros(32, 64, dtype=torch.bfloat16),
                       weight=w) == "triton"
    big = torch.zeros(33, 64, dtype=torch.bfloat16)
    assert kernel_path("fp8_gemv", "cuda:0", x=big, weight=w) == "reference"
    with tuning.override("fp8_gemv", max_m=64):
        assert kernel_path("fp8_gemv", "cuda:0", x=big, weight=w) == "triton"
    with tuning.override("fp8_gemv", max_m=4):
        assert kernel_path("fp8_gemv", "cuda:0", x=x, weight=w) == "reference"
    monkeypatch.setattr(dispatch, "fp8_capable", lambda device: False)
    assert kernel_path("fp8_gemv", "cuda:0", x=x, weight=w) == "reference"


@cpu_only
def test_fp8_linear_routes_few_rows_to_the_kernel(monkeypatch):
    """The public op's branch, forced on CPU tensors (the interpreter runs the kernel): leading
    dimensions kept, the scaled_mm path never asked."""
    decided = []

    def decide(op, device, **inputs):
        decided.append(op)
        return "triton" if op == "fp8_gemv" else "reference"

    monkeypatch.setattr(fp8_matmul, "kernel_path", decide)
    x, wq, ws, s_in, b = _operands(6, 72, 24, seed=9, static=True)
    got = fp8_linear(x.reshape(2, 3, 72), wq, ws, s_in, b)
    assert decided == ["fp8_gemv"] and got.shape == (2, 3, 24)
    _check(got.reshape(6, 24), x, wq, ws, s_in, b)
    # dynamic scales: quantized by their own launch first (prequant), or inside the kernel
    for prequant, asked in [(True, ["fp8_gemv", "fp8_quant"]), (False, ["fp8_gemv"])]:
        decided.clear()
        with tuning.override("fp8_gemv", prequant=prequant):
            got = fp8_linear(x, wq, ws, None, b)
        assert decided == asked
        _check(got, x, wq, ws, None, b)


# ---- on a GPU with FP8 ------------------------------------------------------------------------
SHAPES_9B = [(4480, 22656), (10240, 4480), (4480, 15680), (15680, 4480)]


def _gpu_want(x, wq, ws, in_scale, b):
    """The reference's operands (`quantize_fp8_ref`: each element times the scale's reciprocal,
    as the kernel quantizes; dividing by the scale instead moved 67 codes of one 9B-shaped row
    by a step on an H100, and 2,700 outputs past the tolerance), float32 product and bias."""
    q, s = fp8_matmul.quantize_fp8_ref(x.float(), in_scale)
    xd, wd = q.float() * s, wq.float() * ws.float().reshape(-1, 1)
    want = xd @ wd.t() + (0 if b is None else b.float())
    return want, xd.abs() @ wd.abs().t()


def _gpu_check(got, x, wq, ws, in_scale, b, sum_rel=2e-5):
    want, absum = _gpu_want(x, wq, ws, in_scale, b)
    err = (got.float() - want).abs()
    # one bf16 rounding; float32 sums reordered (sum_rel: of the sum of |products|)
    tol = 2.0 ** -8 * want.abs() + sum_rel * absum
    assert (err <= tol).all(), (err - tol).max().item()


@gpu
@pytest.mark.parametrize("M", [1, 8, 16, 32])
@pytest.mark.parametrize("K,N", SHAPES_9B)
@pytest.mark.parametrize("static", [False, True])
def test_gpu_9b_shapes_match_the_reference(M, K, N, static):
    x, wq, ws, s_in, b = _operands(M, K, N, seed=M + K, static=static, bias=M == 8,
                                   zero_rows=[M - 1] if M > 1 else (), dtype=torch.bfloat16,
                                   device="cuda")
    _gpu_check(fp8_gemv_triton(x, wq, ws, s_in, b), x, wq, ws, s_in, b)


@gpu
@pytest.mark.parametrize("knobs", [{"dot_min_m": 1}, {"dot_min_m": 99}, {"split_k": 4},
                                   {"max_m": 64}, {"dot_min_m": 1, "promote_k": 32},
                                   {"prefetch_bytes": 0},
                                   {"prefetch_bytes": 4096, "split_k": 2}])
@pytest.mark.parametrize("M", [1, 8])
def test_gpu_knobs(knobs, M):
    M = 64 if knobs.get("max_m") == 64 else M
    x, wq, ws, s_in, b = _operands(M, 10240, 4480, seed=5, bias=True, dtype=torch.bfloat16,
                                   device="cuda")
    # native fp8 MMAs sum each instruction's 32 products in fewer bits than float32
    sum_rel = 2.0 ** -9 if knobs.get("promote_k") else 2e-5
    with tuning.override("fp8_gemv", **knobs):
        got = fp8_gemv_triton(x, wq, ws, s_in, b)
    _gpu_check(got, x, wq, ws, s_in, b, sum_rel)


@gpu
def test_gpu_through_fp8_linear_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv(FP8_GEMV_ENV, "1")
    x, wq, ws, _, _ = _operands(4, 4480, 15680, seed=11, bias=False, dtype=torch.bfloat16,
                                device="cuda")
    assert kernel_path("fp8_gemv", x.device, x=x, weight=wq) == "triton"
    out = fp8_linear(x, wq, ws)
    _gpu_check(out, x, wq, ws, None, None)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, wq, ws)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        static_out = fp8_linear(x, wq, ws)
    x.mul_(2)  # a dynamic scale doubles: the same codes, twice the output
    graph.replay()
    torch.testing.assert_close(static_out.float(), 2 * out.float(), rtol=0, atol=0)
