"""Tests for mambaserve.layers.sampler (CPU; one CUDA test runs only where a GPU is present)."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mambaserve.layers.sampler import SamplingBatch, apply_filters, compute_logprobs, sample
from mambaserve.ops.sample_rows import counter_hash, gumbel_noise, hash_to_uniform, uniform_noise

aten = torch.ops.aten


def make_batch(
    b: int,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seed=0,
    step=0,
    num_logprobs=0,
    device="cpu",
) -> SamplingBatch:
    """Batch of b rows; each argument is a scalar (broadcast) or a list of length b."""

    def lst(x):
        return list(x) if isinstance(x, (list, tuple, range, np.ndarray)) else [x] * b

    return SamplingBatch.from_lists(
        lst(temperature),
        [int(k) for k in lst(top_k)],
        lst(top_p),
        lst(min_p),
        [int(s) for s in lst(seed)],
        [int(s) for s in lst(step)],
        num_logprobs,
        device,
    )


def ref_keep(row: np.ndarray, k: int, p: float, min_p: float) -> np.ndarray:
    """Straightforward per-row reference of the top-k -> top-p -> min-p filter (float64)."""
    row = row.astype(np.float64)
    v = row.size
    keep = np.ones(v, dtype=bool)
    if 0 < k < v:
        kth = np.sort(row)[::-1][k - 1]
        keep &= row >= kth
    if p < 1.0:
        vals = np.sort(row[keep])[::-1]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        cum = np.cumsum(probs)
        n = min(int(np.searchsorted(cum, p)) + 1, vals.size)  # smallest prefix with cum >= p
        keep &= row >= vals[n - 1]
    if min_p > 0.0:
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        keep &= probs >= min_p * probs.max()
    return keep


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_and_ignores_filters():
    g = torch.Generator().manual_seed(0)
    b, v = 64, 97
    logits = torch.randn(b, v, generator=g) * 3
    logits[0, 5] = logits[0, 40] = logits[0].max() + 1.0  # tie: lowest index wins
    out = sample(logits, make_batch(b, temperature=0.0))
    assert torch.equal(out.token_ids, torch.argmax(logits, dim=-1))
    assert out.token_ids[0].item() == 5
    # Mixed batch: greedy rows (T=0 and T below eps) with aggressive filters, across many steps.
    temps = [0.0 if i % 3 == 0 else (1e-6 if i % 3 == 1 else 1.5) for i in range(b)]
    greedy = torch.tensor([t < 1e-5 for t in temps])
    for step in range(20):
        batch = make_batch(b, temperature=temps, top_k=3, top_p=0.4, min_p=0.2, seed=7, step=step)
        assert not batch.all_greedy and batch.need_filters
        ids = sample(logits, batch).token_ids
        assert torch.equal(ids[greedy], torch.argmax(logits, dim=-1)[greedy])
    # bf16 input: greedy on the upcast values.
    lb = logits.to(torch.bfloat16)
    assert torch.equal(
        sample(lb, make_batch(b, temperature=0.0)).token_ids, torch.argmax(lb.float(), dim=-1)
    )


# ----------------------------------------------------------------------------- filters


def test_filters_match_reference():
    g = torch.Generator().manual_seed(1)
    v = 50
    cases = [
        (k, p, m)
        for k in (0, -1, 1, 5, 17, v, v + 13)
        for p in (1.0, 0.95, 0.6, 0.2)
        for m in (0.0, 0.05, 0.3)
    ]
    b = len(cases)
    logits = torch.randn(b, v, generator=g) * 2.5
    out = apply_filters(
        logits,
        torch.tensor([c[0] for c in cases], dtype=torch.int32),
        torch.tensor([c[1] for c in cases], dtype=torch.float32),
        torch.tensor([c[2] for c in cases], dtype=torch.float32),
    )
    kept = ~torch.isneginf(out)
    for i, (k, p, m) in enumerate(cases):
        ref = ref_keep(logits[i].numpy(), k, p, m)
        assert np.array_equal(kept[i].numpy(), ref), (k, p, m)
        assert torch.equal(out[i][kept[i]], logits[i][kept[i]])  # kept values untouched
        if (k <= 0 or k >= v) and p >= 1.0 and m <= 0.0:
            assert bool(kept[i].all())  # no-op settings filter nothing
        if 0 < k < v:
            assert int(kept[i].sum()) <= k
    assert int(kept.sum()) < kept.numel() // 2  # the filters actually did something


def test_top_p_one_is_noop_despite_cumsum_rounding():
    """With a large vocab the float32 cumsum exceeds 1.0 before the tail; top_p=1 must keep all."""
    g = torch.Generator().manual_seed(2)
    v = 256000
    logits = torch.randn(4, v, generator=g) * 2
    srt = torch.sort(logits, dim=-1, descending=True).values
    probs = torch.softmax(srt, dim=-1)
    assert bool(((torch.cumsum(probs, -1) - probs) >= 1.0).any())  # the hazard is present
    out = apply_filters(logits, torch.zeros(4, dtype=torch.int32), torch.ones(4), torch.zeros(4))
    assert not bool(torch.isneginf(out).any())


def test_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    out = apply_filters(
        logits, torch.tensor([2], dtype=torch.int32), torch.tensor([1.0]), torch.tensor([0.0])
    )
    assert (~torch.isneginf(out)).tolist() == [[False, True, True, True, False]]


def test_sampled_tokens_respect_filters_after_temperature():
    """Top-p/min-p are computed after temperature: sampled set == reference kept set."""
    g = torch.Generator().manual_seed(2)
    v, n = 20, 4000
    base = torch.randn(v, generator=g) * 2
    for t, k, p, m in [
        (3.0, 0, 0.7, 0.0),
        (0.5, 0, 0.9, 0.0),
        (2.0, 8, 0.95, 0.2),
        (1.0, 0, 1.0, 0.1),
    ]:
        ref = ref_keep((base / t).numpy(), k, p, m)
        ids = sample(base.expand(n, v), make_batch(n, t, k, p, m, seed=3, step=range(n))).token_ids
        assert set(ids.tolist()) == set(np.flatnonzero(ref).tolist()), (t, k, p, m)


def test_sample_is_gumbel_max_of_the_filtered_scaled_logits():
    """Written out: greedy rows take argmax(logits) (filters ignored); the others argmax of
    filters(logits / T) + gumbel(seed, step); logprobs are the raw log-softmax at the token. A
    mixed batch with filters, and the same rows without them."""
    g = torch.Generator().manual_seed(11)
    b, v = 6, 257
    logits = torch.randn(b, v, generator=g) * 3
    temps = [0.0, 0.7, 1.3, 0.0, 2.0, 0.9]
    ks, ps = [0, 5, 0, 3, 40, 0], [1.0, 0.9, 0.8, 0.5, 1.0, 0.95]
    seeds, steps = [3, 5, 7, 11, 13, 17], [0, 1, 2, 3, 4, 2**40]
    for top_k, top_p in [(ks, ps), (0, 1.0)]:
        batch = make_batch(b, temps, top_k, top_p, 0.0, seed=seeds, step=steps)
        out = sample(logits, batch)
        greedy = torch.tensor(temps) < 1e-5
        scaled = logits / torch.where(greedy, 1.0, torch.tensor(temps))[:, None]
        kept = apply_filters(scaled, batch.top_k, batch.top_p, batch.min_p)
        noisy = kept + gumbel_noise(batch.seed, batch.step, v)
        want = torch.where(greedy, logits.argmax(-1), noisy.argmax(-1))
        assert torch.equal(out.token_ids, want)
        lp = torch.log_softmax(logits, -1).gather(1, want[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs, lp, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- distribution


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def test_sampled_distribution_matches_softmax():
    v, n, t = 8, 20000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, 0.8, -1.0, 0.2, 0.4])
    x = logits.expand(n, v)
    probs = torch.softmax(logits / t, dim=-1).numpy().astype(np.float64)
    # Vary the step within one request, and separately vary the seed at step 0.
    for seed, step in [(1234, range(n)), (range(10**6, 10**6 + n), 0)]:
        ids = sample(x, make_batch(n, temperature=t, seed=seed, step=step)).token_ids
        counts = np.bincount(ids.numpy(), minlength=v)
        assert chi2(counts, probs) < 30.0  # 7 dof: P(chi2 > 30) ~ 1e-4
        assert np.abs(counts / n - probs).max() < 0.015
    # Wrong temperature would be detected: T=1 probabilities are far off.
    assert chi2(counts, torch.softmax(logits, -1).numpy().astype(np.float64)) > 100
    # top_k=2: only the two largest logits appear, renormalised.
    ids = sample(x, make_batch(n, temperature=t, top_k=2, seed=99, step=range(n))).token_ids
    counts = np.bincount(ids.numpy(), minlength=v)
    assert set(np.flatnonzero(counts).tolist()) == {0, 4}
    p2 = np.zeros(v)
    p2[[0, 4]] = probs[[0, 4]] / probs[[0, 4]].sum()
    nz = p2 > 0
    assert chi2(counts[nz], p2[nz]) < 15.0  # 1 dof
    assert abs(counts[0] / n - p2[0]) < 0.015


# ----------------------------------------------------------------------------- reproducibility


def test_reproducible_and_batch_independent():
    g = torch.Generator().manual_seed(4)
    v, n = 300, 40
    logits = torch.randn(n, v, generator=g) * 2
    temps = (torch.rand(n, generator=g) * 1.5 + 0.3).tolist()
    top_k = [[0, 5, 50][i % 3] for i in range(n)]
    top_p = [[1.0, 0.9, 0.5, 0.99][i % 4] for i in range(n)]
    min_p = [[0.0, 0.01][i % 2] for i in range(n)]
    seeds = [int(s) for s in torch.randint(-(2**62), 2**62, (n,), generator=g)]
    steps = [int(s) for s in torch.randint(0, 5000, (n,), generator=g)]
    full = sample(logits, make_batch(n, temps, top_k, top_p, min_p, seeds, steps)).token_ids
    again = sample(logits, make_batch(n, temps, top_k, top_p, min_p, seeds, steps)).token_ids
    assert torch.equal(full, again)
    for i in range(n):
        alone = sample(
            logits[i : i + 1],
            make_batch(1, temps[i], top_k[i], top_p[i], min_p[i], seeds[i], steps[i]),
        ).token_ids
        assert alone.item() == full[i].item()
        # Row i at position pos among 7 random rows with other parameters.
        pos = (i * 3) % 8
        others = torch.randn(8, v, generator=g) * 4
        others[pos] = logits[i]
        lists = [
            [0.9] * 8,
            [7] * 8,
            [0.8] * 8,
            [0.0] * 8,
            torch.randint(0, 100, (8,), generator=g).tolist(),
            list(range(8)),
        ]
        for lst, val in zip(lists, (temps[i], top_k[i], top_p[i], min_p[i], seeds[i], steps[i])):
            lst[pos] = val
        mixed = sample(others, make_batch(8, *lists)).token_ids
        assert mixed[pos].item() == full[i].item()
    assert len(set(full.tolist())) > n // 2  # not a degenerate constant output


def test_different_seeds_give_different_streams():
    v, n = 1000, 300
    x = torch.zeros(n, v)  # uniform distribution
    a = sample(x, make_batch(n, seed=1, step=range(n))).token_ids
    b = sample(x, make_batch(n, seed=2, step=range(n))).token_ids
    c = sample(x, make_batch(n, seed=1 + 2**32, step=range(n))).token_ids  # high seed bits count
    assert (a == b).float().mean() < 0.02
    assert (a == c).float().mean() < 0.02
    assert len(set(a.tolist())) > 200


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_and_topk():
    g = torch.Generator().manual_seed(5)
    b, v, k = 16, 200, 5
    logits = torch.randn(b, v, generator=g) * 3
    out = sample(
        logits, make_batch(b, temperature=[0.0, 1.0] * 8, top_k=10, seed=3, num_logprobs=k)
    )
    ls = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.token_ids.dtype == torch.int64
    torch.testing.assert_close(out.logprobs, ls.gather(1, out.token_ids[:, None]).squeeze(1))
    ref_v, ref_i = torch.topk(ls, k, dim=-1)
    assert out.topk_ids.shape == (b, k) and torch.equal(out.topk_ids, ref_i)
    torch.testing.assert_close(out.topk_logprobs, ref_v)
    assert sample(logits, make_batch(b, seed=3)).topk_ids is None
    # Prompt-logprob helper, bf16 input, k > V clamps.
    tgt = torch.randint(0, v, (b,), generator=g)
    lp, ids, vals = compute_logprobs(logits.to(torch.bfloat16), tgt, v + 7)
    lsb = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    torch.testing.assert_close(lp, lsb.gather(1, tgt[:, None]).squeeze(1))
    assert ids.shape == (b, v) and vals.dtype == torch.float32
    torch.testing.assert_close(vals, lsb.gather(1, ids))
    assert bool((vals[:, 1:] <= vals[:, :-1]).all())
    assert compute_logprobs(logits, tgt, 0)[1:] == (None, None)


# ----------------------------------------------------------------------------- noise


def test_uniform_noise_sanity():
    b, v = 64, 65536
    seed = torch.tensor([12345] * (b // 2) + list(range(b // 2)), dtype=torch.int64)
    step = torch.tensor(list(range(b // 2)) + [0] * (b // 2), dtype=torch.int64)
    u = uniform_noise(seed, step, v)
    assert u.dtype == torch.float32 and u.shape == (b, v)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # The hash->uniform map at its extremes: strictly inside (0, 1), symmetric.
    ext = hash_to_uniform(torch.tensor([0, 511, 512, 2**31, 2**32 - 1], dtype=torch.int64))
    assert ext.tolist() == [2.0**-24, 2.0**-24, 3 * 2.0**-24, 0.5 + 2.0**-24, 1 - 2.0**-24]
    n = u.numel()
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.double().var()) - 1 / 12) < 1e-3
    counts = np.bincount((u.numpy() * 256).astype(np.int64).ravel(), minlength=256)
    assert chi2(counts, np.full(256, 1 / 256)) < 360  # 255 dof, ~5 sigma
    # No correlation between neighbouring tokens, nor between neighbouring steps / seeds.
    c = u.double() - 0.5
    for a, bb in [(c[:, 1:], c[:, :-1]), (c[1:], c[:-1])]:
        assert abs(float((a * bb).mean()) / (1 / 12)) < 5 / math.sqrt(a.numel())
    # Raw 32-bit hashes: a bijection over tokens within a row; across 4M nearby counters the
    # number of equal pairs matches the birthday expectation n^2 / 2^33 (a structured hash
    # would give far more, e.g. whole rows repeated).
    h = counter_hash(seed, step, v)
    assert bool((h >= 0).all()) and bool((h < 2**32).all())
    for row in h[:4]:
        assert row.unique().numel() == v
    dups = n - h.unique().numel()
    expect = n * n / 2**33
    assert abs(dups - expect) < 6 * math.sqrt(expect), (dups, expect)
    small = counter_hash(torch.arange(16).repeat_interleave(16), torch.arange(16).repeat(16), 256)
    assert small.unique().numel() >= 65536 - 4  # expected ~0.5 collisions
    gum = gumbel_noise(seed[:8], step[:8], v).double()
    assert abs(float(gum.mean()) - 0.5772156649) < 0.01
    assert abs(float(gum.var()) - math.pi**2 / 6) < 0.03


# ----------------------------------------------------------------------------- host syncs


class SyncRecorder(TorchDispatchMode):
    """Records ops that force a device->host sync or produce data-dependent shapes."""

    BANNED: ClassVar[set] = {
        aten._local_scalar_dense,
        aten.nonzero,
        aten.masked_select,
        aten.multinomial,
    }

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in self.BANNED:
            self.calls.append(str(func))
        if func.overloadpacket is aten.index and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        ):
            self.calls.append("bool-mask index")
        return func(*args, **kwargs)


def test_sample_has_no_host_syncs():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 10, generator=g)
    with SyncRecorder() as rec:  # positive control: the recorder sees the banned ops
        x[0, 0].item()
        x[x > 0]
        torch.nonzero(x)
    assert len(rec.calls) >= 3
    batches = [
        make_batch(4, temperature=0.0, num_logprobs=3),
        make_batch(
            4,
            temperature=[0.0, 0.7, 1.0, 2.0],
            top_k=[0, 3, 5, 0],
            top_p=[1, 0.8, 1, 0.5],
            min_p=[0, 0, 0.1, 0],
            seed=[1, 2, 3, 4],
            step=[0, 1, 2, 3],
            num_logprobs=2,
        ),
        make_batch(4, temperature=1.0, seed=5),
    ]
    for batch in batches:
        with SyncRecorder() as rec:
            out = sample(x, batch)
        assert rec.calls == [], rec.calls
        assert out.token_ids.shape == (4,)


def test_from_lists_roundtrip():
    b = make_batch(
        3,
        temperature=[0.0, 0.5, 1.0],
        top_k=[0, 4, -1],
        top_p=[1.0, 0.9, 1.0],
        min_p=[0.0, 0.0, 0.05],
        seed=[2**64 - 1, -5, 2**63 + 1],
        step=[0, 7, 2**40],
        num_logprobs=2,
    )
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int32
    assert b.seed.dtype == torch.int64 and b.step.dtype == torch.int64
    assert b.temperature.tolist() == [0.0, 0.5, 1.0] and b.top_k.tolist() == [0, 4, -1]
    torch.testing.assert_close(b.top_p, torch.tensor([1.0, 0.9, 1.0]))
    torch.testing.assert_close(b.min_p, torch.tensor([0.0, 0.0, 0.05]))
    assert b.seed.tolist() == [-1, -5, -(2**63) + 1] and b.step.tolist() == [0, 7, 2**40]
    assert b.num_logprobs == 2 and not b.all_greedy and b.need_filters
    plain = make_batch(2, temperature=[0.0, 0.0])
    assert plain.all_greedy and not plain.need_filters


# ----------------------------------------------------------------------------- CUDA only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_no_sync_and_graph_capture():
    g = torch.Generator().manual_seed(7)
    b, v = 64, 32000
    logits = torch.randn(b, v, generator=g) * 3
    args = {
        "temperature": [0.0, 0.8, 1.2, 1.0] * 16,
        "top_k": [0, 40, 0, 5] * 16,
        "top_p": [1.0, 0.9, 0.7, 1.0] * 16,
        "min_p": [0.0, 0.0, 0.05, 0.0] * 16,
        "seed": list(range(b)),
        "step": list(range(100, 100 + b)),
        "num_logprobs": 4,
    }
    cpu = sample(logits, make_batch(b, **args))
    bc = make_batch(b, **args, device="cuda")
    xc = logits.cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = sample(xc, bc)  # warm-up, and raises on any synchronizing op
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(
        counter_hash(bc.seed, bc.step, v).cpu(),
        counter_hash(torch.arange(b), torch.arange(100, 100 + b), v),
    )
    assert (eager.token_ids.cpu() == cpu.token_ids).float().mean() > 0.95
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample(xc, bc)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.token_ids, eager.token_ids)
    torch.testing.assert_close(out.logprobs, eager.logprobs)
