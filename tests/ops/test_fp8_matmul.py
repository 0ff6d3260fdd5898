"""The FP8 linear op (`mambaserve.ops.fp8_matmul`) against an explicit quantize -> dequantize ->
float32 matmul written here, element by element where it matters; the dispatch conditions; and,
on a CUDA device of compute capability >= 8.9, the fast path (Triton activation quantization +
torch._scaled_mm) against the reference at the 9B preset's shapes (skipped elsewhere)."""

import pytest
import torch

from mambaserve.ops import dispatch, fp8_matmul
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.fp8_matmul import (
    FP8_DTYPE,
    fp8_linear,
    fp8_linear_ref,
    quantize_fp8_ref,
    quantize_weight_fp8,
)

# every finite non-negative float8_e4m3fn value
E4M3 = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()


def nearest_e4m3(v: float) -> float:
    """Round-to-nearest-even onto the e4m3 grid, by search (no cast), saturating at 448."""
    a = min(abs(v), 448.0)
    i = int(torch.searchsorted(E4M3, torch.tensor(a)))
    if i == 0:
        r = E4M3[0].item()
    elif i >= len(E4M3):
        r = E4M3[-1].item()
    else:
        lo, hi = E4M3[i - 1].item(), E4M3[i].item()
        if a - lo < hi - a:
            r = lo
        elif hi - a < a - lo:
            r = hi
        else:  # tie: the even mantissa (even bit pattern)
            r = lo if (i - 1) % 2 == 0 else hi
    return r if v >= 0 else -r


def test_quantization_is_round_to_nearest_even_on_the_e4m3_grid():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g) * torch.tensor([[0.01], [1.0], [300.0]])
    x[1, 0] = 0.0
    q, s = quantize_fp8_ref(x)
    amax = x.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(s, amax / 448.0, rtol=0, atol=0)
    for i in range(3):
        for j in range(50):
            assert q[i, j].float().item() == nearest_e4m3((x[i, j] / s[i, 0]).item()), (i, j)
    # static scale: values beyond 448 * scale saturate
    qs, ss = quantize_fp8_ref(x, torch.tensor(0.1))
    assert torch.equal(ss, torch.full((3, 1), 0.1))
    assert qs.float().abs().max().item() == 448.0
    # a zero row gets a finite scale and zeros
    q0, s0 = quantize_fp8_ref(torch.zeros(2, 8))
    assert torch.isfinite(s0).all() and not q0.float().any()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_explicit_dequantized_matmul(static, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, 48, generator=g) * 3).to(dtype)
    w = torch.randn(32, 48, generator=g) * 0.05
    bias = torch.randn(32, generator=g).to(dtype)
    wq, ws = quantize_weight_fp8(w)
    in_scale = torch.tensor(0.02) if static else None
    got = fp8_linear(x, wq, ws, in_scale, bias)
    # explicit: each row's scale, each element rounded on the grid, dequantized, fp32 dot
    xf = x.float().reshape(-1, 48)
    want = torch.empty(xf.shape[0], 32)
    for r in range(xf.shape[0]):
        s = 0.02 if static else max(xf[r].abs().max().item(), 1e-12) / 448.0
        xd = torch.tensor([nearest_e4m3(v) for v in (xf[r] / s).tolist()]) * s
        wd = wq.float() * ws[:, None]
        want[r] = wd @ xd + bias.float()
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # the one rounding to bf16
    torch.testing.assert_close(got.float().reshape(-1, 32), want, rtol=tol, atol=tol)
    assert got.dtype == dtype and got.shape == (2, 5, 32)


def test_weight_quantization_per_channel_and_per_tensor():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 40, generator=g) * torch.linspace(0.01, 2, 16)[:, None]
    q, s = quantize_weight_fp8(w)
    torch.testing.assert_close(s, w.abs().amax(dim=1) / 448.0, rtol=0, atol=0)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((16,), 448.0))
    rel = ((q.float() * s[:, None] - w).abs() / w.abs().amax(dim=1, keepdim=True)).max()
    assert rel <= 2 ** -4 + 1e-6  # half an e4m3 step at the top binade, relative to the row max
    _, st = quantize_weight_fp8(w, per_channel=False)
    assert st.dim() == 0 and st == w.abs().max() / 448.0


def test_dispatch_conditions(monkeypatch):
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=FP8_DTYPE)
    for op in ("fp8_linear", "fp8_quant"):
        assert kernel_path(op, "cpu", x=x, weight=w) == "reference"
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "fp8_capable", lambda device: True)
    assert kernel_path("fp8_linear", "cuda", x=x, weight=w) == "triton"
    assert kernel_path("fp8_quant", "cuda") == "triton"
    assert kernel_path("fp8_linear", "cuda", x=x.float(), weight=w) == "reference"
    assert kernel_path("fp8_linear", "cuda", x=x[:, :40], weight=w[:, :40]) == "reference"
    assert kernel_path("fp8_linear", "cuda", x=x, weight=w[:24]) == "reference"
    monkeypatch.setattr(dispatch, "fp8_capable", lambda device: False)  # e.g. an A100
    assert kernel_path("fp8_linear", "cuda", x=x, weight=w) == "reference"
    assert kernel_path("fp8_quant", "cuda") == "reference"


# ---- the fast path, on a GPU with FP8 ----------------------------------------------------------
def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA device of compute capability >= 8.9")


@gpu
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("K", [4480, 20000])
def test_gpu_triton_quantization_matches_the_reference_bit_for_bit(static, K):
    from mambaserve.ops.triton.fp8_quant import quantize_fp8_triton

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(67, K + 64, device="cuda", generator=g, dtype=torch.bfloat16)
    x = x[:, :K]  # strided rows
    x[5] = 0
    scale = torch.tensor(0.01, device="cuda") if static else None
    q, s = quantize_fp8_triton(x, scale)
    qr, sr = quantize_fp8_ref(x, scale)
    torch.testing.assert_close(s, sr, rtol=2.0 ** -23, atol=0)
    # the elements bit for bit, given the scale: x times the scale's reciprocal (each an IEEE
    # operation, as the kernel's div_rn(1, scale) and product), clamped, rounded to nearest
    # even by the cast
    qs = (x.float() * s.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), qs.view(torch.uint8))
    assert (q.float() - qr.float()).abs().le(qr.float().abs() * 2.0 ** -3 + 2.0 ** -9).all()


# the 9B preset's quantized projections: (K, N) of Mamba in_proj / out_proj, MLP up / down
SHAPES_9B = [(4480, 22656), (10240, 4480), (4480, 15680), (15680, 4480)]


@gpu
@pytest.mark.parametrize("M", [1, 64, 2048])
@pytest.mark.parametrize("K,N", SHAPES_9B)
@pytest.mark.parametrize("static", [False, True])
def test_gpu_scaled_mm_matches_the_reference(M, K, N, static):
    g = torch.Generator(device="cuda").manual_seed(M + K)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.02
    wq, ws = quantize_weight_fp8(w)
    in_scale = (x.float().abs().amax() / 448.0).reshape(()) if static else None
    assert kernel_path("fp8_linear", x.device, x=x, weight=wq) == "triton"
    from mambaserve.ops.triton.fp8_quant import quantize_fp8_triton

    got = fp8_linear(x, wq, ws, in_scale)
    # the reference's math on the kernel's own quantized activations: its scale may differ from
    # the reference quantization's by one float32 ulp (the test above), which moves an element at
    # an e4m3 rounding boundary by a whole e4m3 step (~12 % of it) in one of 9M outputs
    q, s = quantize_fp8_triton(x, in_scale)
    want = ((q.float() * s) @ (wq.float() * ws.float().reshape(-1, 1)).t()).to(x.dtype)
    # same quantized operands; float32 accumulation in another order, one bf16 rounding each
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
    # and the whole op against the reference quantization, up to those boundary elements
    ref = fp8_linear_ref(x, wq, ws, in_scale).float()
    far = (got.float() - ref).abs() > 1e-2 * ref.abs().max().item() + 1e-2 * ref.abs()
    assert far.float().mean().item() < 1e-5, far.sum().item()


@gpu
def test_gpu_fp8_linear_in_a_cuda_graph():
    x = torch.randn(8, 4480, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_weight_fp8(torch.randn(4480 * 2, 4480, device="cuda") * 0.02)
    out = fp8_linear(x, wq, ws)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, wq, ws)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        static_out = fp8_linear(x, wq, ws)
    x.mul_(2)
    graph.replay()
    torch.testing.assert_close(static_out.float(), 2 * out.float(), rtol=2e-2, atol=1e-2)


def test_module_exports():
    assert set(fp8_matmul.__all__) >= {"fp8_linear", "fp8_linear_ref", "quantize_fp8"}
