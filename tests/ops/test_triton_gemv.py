"""The few-rows linear (`mambaserve/ops/triton/gemv.py`) against `torch.nn.functional.linear`
in float64 (CPU interpreter in float32 / float16; compiled on a GPU in bfloat16 too): both inner
products (FMA, tensor cores), split K reduced by the last arriving program (deterministic, the
counters left at zero), biases, strided rows, ragged K and N, the launch rules, the dispatch of
`ops.linear`; on the GPU the presets' shapes and a CUDA-graph replay. The MLP activations applied
as x is loaded, relu² of the product and an addend in the epilogue, and the squared-ReLU MLP's
choice between them, bit for bit against the two-launch path."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

# isort: split
import torch.nn.functional as F

import mambaserve.ops.linear as linear_ops
from mambaserve.ops.activation import relu2, relu2_ref, silu_mul, silu_mul_ref
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.linear import act_linear, linear, linear_float32, relu2_mlp
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.activation import relu2_triton, silu_mul_triton
from mambaserve.ops.triton.gemv import (
    COUNTERS,
    _gemv_kernel,
    act_gemv_triton,
    gemv_float32_triton,
    gemv_triton,
    launch_plan,
)

require_interpreter(_gemv_kernel)

gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")


def _case(M, N, K, dtype, bias=True, seed=0, row_stride=None):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(M, row_stride or K, generator=g).to(DEV, dtype)[:, :K]  # rows strided
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    return xs, w.to(DEV, dtype), None if b is None else b.to(DEV, dtype)


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _tol(dtype):  # one rounding of the output plus float32 sums in another order
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, N, K, knobs", [
    (1, 40, 96, {"use_dot": False, "block_k": 32}),                  # FMA, several K steps
    (2, 37, 200, {"use_dot": False, "block_n": 8, "block_k": 64}),   # ragged N and K
    (1, 64, 512, {"use_dot": False, "split_k": 4, "block_k": 32}),   # FMA, split K
    (3, 37, 200, {"use_dot": True, "block_k": 32}),                  # tensor cores, ragged
    (5, 33, 130, {"use_dot": True, "split_k": 3, "block_k": 16}),    # tensor cores, split K
    (8, 24, 48, {}),                                                 # the launch rules
    (1, 48, 16, {}),
    (4, 200, 48, {}),                          # the rules' 64-column blocks (wide), ragged N
])
def test_gemv_matches_linear(dtype, M, N, K, knobs):
    x, w, b = _case(M, N, K, dtype)
    for bias in (b, None):
        with tuning.override("gemv", **knobs):
            y = gemv_triton(x, w, bias)
        assert y.dtype == dtype and y.shape == (M, N)
        want = _ref(x, w, bias)
        err = (y.double() - want).abs().max().item()
        assert err <= _tol(dtype) * (1 + want.abs().max().item()), err


@pytest.mark.parametrize("use_dot", [False, True])
def test_split_k_is_deterministic_and_leaves_the_counters_at_zero(use_dot):
    x, w, b = _case(2, 50, 384, torch.float32, seed=3)
    with tuning.override("gemv", use_dot=use_dot, split_k=4, block_k=32):
        assert launch_plan(2, 50, 384, x.device)["split_k"] == 4
        y1 = gemv_triton(x, w, b)
        y2 = gemv_triton(x, w, b)
    with tuning.override("gemv", use_dot=use_dot, split_k=1, block_k=32):
        y0 = gemv_triton(x, w, b)
    assert torch.equal(y1, y2)  # the same order of the partial sums on every run
    assert (y1 - y0).abs().max().item() <= 1e-4  # only the summation order differs
    assert int(COUNTERS[x.device].abs().sum()) == 0


def test_strided_rows_and_empty_shapes():
    x, w, b = _case(3, 20, 64, torch.float32, row_stride=80)
    assert x.stride(0) == 80
    with tuning.override("gemv", block_k=16):
        y = gemv_triton(x, w, b)
    assert (y.double() - _ref(x, w, b)).abs().max().item() <= 1e-4
    assert gemv_triton(x[:0], w, b).shape == (0, 20)
    xe, we = torch.zeros(2, 0, device=DEV), torch.zeros(5, 0, device=DEV)
    assert torch.equal(gemv_triton(xe, we, None), torch.zeros(2, 5, device=DEV))
    be = torch.arange(5.0, device=DEV)
    assert torch.equal(gemv_triton(xe, we, be), be.expand(2, 5))


def test_too_many_rows_are_refused():
    x, w, _ = _case(9, 16, 32, torch.float32)
    with pytest.raises(AssertionError, match="at most max_m=8 rows, got 9"):
        gemv_triton(x, w)


def test_launch_rules():
    """FMAs for one or two rows when N <= 3 K, tensor cores else (64-column blocks from three
    rows of a wide product); split K only with tensor cores and only while the column blocks are
    too few (interpreter: one "SM")."""
    dev = torch.device("cpu")
    p = launch_plan(1, 4480, 15680, dev)
    assert not p["use_dot"] and p["split_k"] == 1 and p["block_k"] * p["block_n"] == 2048
    assert launch_plan(2, 4480, 4480, dev)["use_dot"] is False
    p = launch_plan(1, 22656, 4480, dev)
    assert p["use_dot"] and p["block_n"] == 32 and p["block_k"] == 128
    # three or more rows: 64 columns per block on the wide shapes, 32 on the others
    assert launch_plan(8, 22656, 4480, dev)["block_n"] == 64
    assert launch_plan(3, 15680, 4480, dev)["block_n"] == 64
    assert launch_plan(8, 4480, 15680, dev)["block_n"] == 32
    assert launch_plan(3, 100, 100, dev)["use_dot"]
    p = launch_plan(8, 64, 4096, dev)
    assert p["even_k"] and p["k_per_split"] * p["split_k"] == 4096
    assert not launch_plan(1, 64, 100, dev)["even_k"]


def test_linear_dispatch():
    """`ops.linear` takes the kernel only for few rows of a 16-bit model on CUDA; the CPU and
    float32 always run F.linear (the reference)."""
    w16 = torch.zeros(8, 4, dtype=torch.bfloat16)
    x16 = torch.zeros(3, 4, dtype=torch.bfloat16)
    want = "triton" if DEV == "cuda" else "reference"
    assert kernel_path("gemv", DEV, x=x16.to(DEV), weight=w16.to(DEV)) == want
    assert kernel_path("gemv", DEV, x=torch.zeros(9, 4, dtype=torch.bfloat16, device=DEV),
                       weight=w16.to(DEV)) == "reference"
    assert kernel_path("gemv", DEV, x=torch.zeros(1, 4, device=DEV),
                       weight=torch.zeros(8, 4, device=DEV)) == "reference"
    assert kernel_path("gemv", DEV, x=x16.to(DEV), weight=w16.t().to(DEV)[:, :4]) == "reference"
    x, w, b = _case(2, 12, 16, torch.float32)
    torch.testing.assert_close(linear(x.view(2, 1, 16), w, b), F.linear(x, w, b).view(2, 1, 12))


def _float32_ref(x, w):
    return F.linear(x.double(), w.double())


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("M, N, K, knobs", [
    (1, 37, 200, {}),                            # the rules: FMAs
    (3, 40, 96, {}),                             # three rows: FMAs although the rules say dots
    (8, 128, 300, {"block_k": 32}),              # max_m rows, ragged K, several K steps
    (2, 33, 64, {"use_dot": True}),              # tensor cores asked for: FMAs still
    (1, 64, 512, {"split_k": 4, "block_k": 32}),  # split K
])
def test_float32_weight_matches_linear(dtype, M, N, K, knobs):
    """16-bit rows times a float32 weight, out in float32: `F.linear(x.float(), w)` up to the
    float32 sums' order (each product is exact)."""
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV)
    with tuning.override("gemv", **knobs):
        assert not launch_plan(M, N, K, x.device, dot=False)["use_dot"]
        y = gemv_float32_triton(x, w)
        again = gemv_float32_triton(x, w)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    want = _float32_ref(x, w)
    bound = 2e-6 * (x.double().abs() @ w.double().abs().t())  # float32 sums, any order
    assert ((y.double() - want).abs() <= bound + 1e-30).all()
    assert torch.equal(y, again)
    counters = COUNTERS.get(x.device)  # made by the first split launch on the device
    assert counters is None or int(counters.abs().sum()) == 0


def test_linear_float32_dispatch_and_reference():
    """`ops.linear_float32` takes the kernel for few 16-bit rows and a plain float32 weight on
    CUDA; elsewhere (and the weight of another dtype) `F.linear(x.float(), w.float())`."""
    x16 = torch.zeros(3, 4, dtype=torch.bfloat16, device=DEV)
    w32 = torch.zeros(8, 4, device=DEV)
    want = "triton" if DEV == "cuda" else "reference"
    assert kernel_path("linear_float32", DEV, x=x16, weight=w32) == want
    for x, w in [(torch.zeros(9, 4, dtype=torch.bfloat16, device=DEV), w32),  # > max_m rows
                 (x16.float(), w32),                                           # float32 rows
                 (x16, w32.bfloat16()),                                        # a 16-bit weight
                 (x16, torch.zeros(4, 8, device=DEV).t())]:                    # not plain [N, K]
        assert kernel_path("linear_float32", DEV, x=x, weight=w) == "reference"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, generator=g).to(DEV, torch.float16)
    w = torch.randn(12, 16, generator=g).to(DEV)
    y = linear_float32(x, w)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 12)
    torch.testing.assert_close(y, F.linear(x.float(), w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(linear_float32(x, w.half()), F.linear(x.float(), w.half().float()))


def test_nemotron_router_through_the_kernel(monkeypatch):
    """NemotronH's router with its float32 product through the kernel (forced; the interpreter on
    a CPU) chooses the experts and weights the reference product does."""
    import types

    from mambaserve.layers.moe import TopkRouter
    from mambaserve.ops import linear as linear_mod

    cfg = types.SimpleNamespace(num_experts_per_tok=3, n_routed_experts=16, n_group=1,
                                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                hidden_size=96)
    router = TopkRouter(cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 96, generator=g) / 96 ** 0.5)
        router.e_score_correction_bias.copy_(torch.rand(16, generator=g) * 0.1)
    router.to(DEV)
    x = torch.randn(5, 96, generator=g).to(DEV, torch.float16)
    want_ids, want_w = router(x)
    asked = []

    def decide(op, device, **inputs):
        asked.append(op)
        return "triton" if op == "linear_float32" else kernel_path(op, device, **inputs)

    monkeypatch.setattr(linear_mod, "kernel_path", decide)
    ids, w = router(x)
    assert asked == ["linear_float32"]
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("M", [1, 8])
def test_float32_weight_at_the_router_shape_on_gpu(M):
    """Nemotron-3-Nano's router (128 experts, hidden 2688) in bf16, through the dispatch."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 2688, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(128, 2688, generator=g) / 2688 ** 0.5).to(DEV)
    y = linear_float32(x, w)
    bound = 2e-6 * (x.double().abs() @ w.double().abs().t())
    assert ((y.double() - _float32_ref(x, w)).abs() <= bound).all()


@gpu
@pytest.mark.parametrize("M", [1, 2, 4, 8])
@pytest.mark.parametrize("N, K", [(4480, 15680), (22656, 4480), (3072, 1536), (2048, 8192),
                                  (8728, 3072)])
def test_gemv_at_the_presets_shapes_on_gpu(M, N, K):
    x, w, b = _case(M, N, K, torch.bfloat16, seed=M)
    y = linear(x, w, b)  # the dispatch: the kernel at these row counts
    want = _ref(x, w, b)
    err = (y.double() - want).abs().max().item()
    assert err <= _tol(torch.bfloat16) * want.abs().max().item(), err
    assert torch.equal(y, linear(x, w, b))


@gpu
def test_gemv_replays_in_a_cuda_graph():
    x, w, b = _case(4, 2048, 8192, torch.bfloat16)  # tensor cores with split K on an H200
    assert launch_plan(4, 2048, 8192, x.device)["split_k"] > 1
    eager = gemv_triton(x, w, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv_triton(x, w, b)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert int(COUNTERS[x.device].abs().sum()) == 0


# the fused launches' shapes: every inner product and K split, ragged and even K
FUSED_CASES = [
    (1, 40, 96, {"use_dot": False, "block_k": 32}),
    (2, 37, 200, {"use_dot": False, "block_n": 8, "block_k": 64}),
    (1, 64, 512, {"use_dot": False, "split_k": 4, "block_k": 32}),
    (3, 37, 200, {"use_dot": True, "block_k": 32}),
    (5, 33, 130, {"use_dot": True, "split_k": 3, "block_k": 16}),
    (8, 64, 256, {"use_dot": True, "split_k": 2, "block_k": 32}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", ["relu2", "silu_mul"])
@pytest.mark.parametrize("M, N, K, knobs", FUSED_CASES)
def test_act_gemv_is_the_two_launch_path(dtype, act, M, N, K, knobs):
    """The activation rounded as its own kernel rounds it, then the same product: bit for bit
    the activation kernel followed by the plain launch, and close to torch's two ops."""
    g = torch.Generator().manual_seed(M * N)
    x = (2 * torch.randn(M, 2 * K if act == "silu_mul" else K, generator=g)).to(DEV, dtype)
    _, w, b = _case(M, N, K, dtype, seed=K)
    act_kernel = relu2_triton if act == "relu2" else silu_mul_triton
    with tuning.override("gemv", **knobs):
        y = act_gemv_triton(x, act, w, b)
        two = gemv_triton(act_kernel(x), w, b)
    assert torch.equal(y, two)
    want = _ref((relu2_ref if act == "relu2" else silu_mul_ref)(x.double()), w, b)
    err = (y.double() - want).abs().max().item()
    assert err <= 2 * _tol(dtype) * (1 + want.abs().max().item()), err


def test_fused_dispatch():
    """act_linear takes the kernel where `gemv` would take the activation's output; elsewhere
    it is the two public ops, bit for bit (here on the CPU: the reference)."""
    x16, w16 = (torch.zeros(3, 8, dtype=torch.bfloat16, device=DEV),
                torch.zeros(4, 8, dtype=torch.bfloat16, device=DEV))
    want = "triton" if DEV == "cuda" else "reference"
    assert kernel_path("act_linear", DEV, x=x16, act="relu2", weight=w16) == want
    assert kernel_path("act_linear", DEV, x=torch.zeros(3, 16, dtype=torch.bfloat16,
                                                        device=DEV),
                       act="silu_mul", weight=w16) == want
    assert kernel_path("act_linear", DEV, x=x16, act="silu_mul", weight=w16) == "reference"
    x, w, b = _case(3, 12, 16, torch.float32)
    # the public activations: on a GPU their Triton passes (silu's fast exp is not the reference's)
    assert torch.equal(act_linear(x, "relu2", w, b), linear(relu2(x), w, b))
    assert torch.equal(act_linear(x.repeat(1, 2), "silu_mul", w, b),
                       linear(silu_mul(x.repeat(1, 2)), w, b))
    add = torch.randn(3, 12, device=DEV)
    assert torch.equal(linear(x, w, b, add=add), F.linear(x, w, b) + add)
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        act_linear(x, "gelu", w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, N, K, knobs", FUSED_CASES)
def test_gemv_adds_like_torch(dtype, M, N, K, knobs):
    x, w, b = _case(M, N, K, dtype, seed=3)
    add = torch.randn(M, N, generator=torch.Generator().manual_seed(9)).to(DEV, dtype)
    with tuning.override("gemv", **knobs):
        assert torch.equal(gemv_triton(x, w, b, add), gemv_triton(x, w, b) + add)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, N, K, knobs", FUSED_CASES)
def test_relu2_in_the_epilogue_is_the_two_launch_path(dtype, M, N, K, knobs):
    """relu² of the rounded product (bias included), rounded as the activation's kernel rounds
    it: bit for bit the plain launch followed by that kernel, split K or not."""
    x, w, b = _case(M, N, K, dtype, seed=5)
    with tuning.override("gemv", **knobs):
        for bias in (b, None):
            assert torch.equal(gemv_triton(x, w, bias, out_act="relu2"),
                               relu2_triton(gemv_triton(x, w, bias)))


def test_linear_act_dispatch_and_refusals():
    """linear(..., act="relu2") is relu2(linear(...)) on the reference path too; a wrong act or
    act with add is a one-line ValueError."""
    x, w, b = _case(3, 12, 16, torch.float32)
    assert torch.equal(linear(x, w, b, act="relu2"), relu2(linear(x, w, b)))
    with pytest.raises(ValueError, match="act 'relu2' or None, got 'gelu'"):
        linear(x, w, b, act="gelu")
    with pytest.raises(ValueError, match="act or add, not both"):
        linear(x, w, b, add=torch.zeros(3, 12, device=DEV), act="relu2")


@pytest.mark.parametrize("M", [1, 2, 3, 8])
def test_relu2_mlp_places_the_activation_in_a_launch(monkeypatch, M):
    """The squared-ReLU MLP on the few-rows kernels (forced on the CPU): relu² in the down
    launch's loads at one or two rows (CUDA cores), in the up launch's epilogue from three (down
    on tensor cores); bit for bit the three launches either way."""
    calls = []

    def forced(op, device, **inputs):
        calls.append(op)
        return "triton"

    monkeypatch.setattr(linear_ops, "kernel_path", forced)
    x, w_up, b_up = _case(M, 48, 16, torch.float32, seed=M)  # down: N 16 <= 3 x K 48
    _, w_down, b_down = _case(M, 16, 48, torch.float32, seed=M + 1)
    y = relu2_mlp(x, w_up, b_up, w_down, b_down)
    assert ("act_linear" in calls) == (M <= 2)
    three = gemv_triton(relu2_triton(gemv_triton(x, w_up, b_up)), w_down, b_down)
    assert torch.equal(y, three)


@gpu
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("N, K", [(15680, 4480), (22656, 4480)])
def test_relu2_epilogue_at_the_presets_up_shapes_on_gpu(M, N, K):
    """The 9B's up projection (and a wider one): relu² in the epilogue, bit for bit the plain
    launch then the activation's kernel (tensor cores, split K at 8 rows)."""
    x, w, b = _case(M, N, K, torch.bfloat16, bias=False, seed=M)
    assert torch.equal(linear(x, w, act="relu2"), relu2_triton(linear(x, w)))


@gpu
@pytest.mark.parametrize("M", [1, 2, 8])
@pytest.mark.parametrize("N, K", [(4480, 15680), (3072, 12288), (2048, 8192), (3072, 3072)])
def test_fused_launches_at_the_presets_shapes_on_gpu(M, N, K):
    """The down / o_proj shapes: the activation in the launch (CUDA cores at one or two rows),
    or its own kernel first (tensor cores), bit for bit the two launches; the addend likewise."""
    x, w, b = _case(M, N, K, torch.bfloat16, seed=M)
    gu = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(act_linear(gu, "silu_mul", w, b), linear(silu_mul_triton(gu), w, b))
    assert torch.equal(act_linear(x, "relu2", w, b), linear(relu2_triton(x), w, b))
    add = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, b, add=add), linear(x, w, b) + add)
