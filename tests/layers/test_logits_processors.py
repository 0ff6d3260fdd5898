"""The sampler's logits processing (layers/logits_processors.py) against plain per-row references:
the structured-output token bitmask, logit_bias, repetition / frequency / presence penalties;
through `sample` for greedy and seeded rows; rows that use none of them are untouched; no host
syncs."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from mambaserve.layers.logits_processors import (
    PenaltyBatch,
    apply_logit_bias,
    apply_penalties,
    apply_token_bitmask,
    bitmask_words,
)
from mambaserve.layers.sampler import SamplingBatch, sample
from mambaserve.ops.sample_rows import gumbel_noise
from mambaserve.tools.sync_audit import SyncAudit

NEG = float("-inf")


def random_bitmask(rng: np.random.Generator, rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed [rows, W] int32, allowed [rows, vocab] bool); every row allows >= 1 token, and
    bit 31 (the sign bit) is set in some words."""
    allowed = rng.random((rows, vocab)) < 0.3
    allowed[:, rng.integers(0, vocab)] = True
    allowed[:, 31] = True
    words = bitmask_words(vocab)
    bits = np.zeros((rows, words * 32), dtype=np.uint8)
    bits[:, :vocab] = allowed
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # little-endian host
    return packed.reshape(rows, words), allowed


def ref_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    return np.where(allowed, logits, -np.inf)


def ref_penalize(row: np.ndarray, prompt: list[int], output: list[int], presence: float,
                 frequency: float, repetition: float) -> np.ndarray:
    """One row, token by token: transformers' repetition penalty, then OpenAI's penalties."""
    out = row.astype(np.float32).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / np.float32(repetition) if out[t] > 0 else out[t] * np.float32(repetition)
    for t, c in Counter(output).items():
        out[t] -= np.float32(frequency) * np.float32(c) + np.float32(presence)
    return out


@pytest.mark.parametrize("vocab", [32, 33, 320, 4096 + 7])
def test_token_bitmask_matches_unpacked_reference(vocab):
    rng = np.random.default_rng(vocab)
    packed, allowed = random_bitmask(rng, 5, vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    got = apply_token_bitmask(torch.from_numpy(logits), torch.from_numpy(packed)).numpy()
    np.testing.assert_array_equal(got, ref_mask(logits, allowed))
    full = np.full_like(packed, -1)  # all ones: untouched, bit for bit
    same = apply_token_bitmask(torch.from_numpy(logits), torch.from_numpy(full)).numpy()
    np.testing.assert_array_equal(same, logits)


def test_logit_bias_matches_reference_and_leaves_other_rows():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    bias = {0: {3: 5.0, 49: -100.0}, 2: {0: 100.0}}
    entries = [(r, t, v) for r, d in bias.items() for t, v in d.items()]
    rows, toks, vals = (torch.tensor(x) for x in zip(*entries))
    x = torch.from_numpy(logits)
    got = apply_logit_bias(x, rows, toks, vals.float()).numpy()
    want = logits.copy()
    for r, t, v in entries:
        want[r, t] += np.float32(v)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(x.numpy(), logits)  # out of place


def test_penalties_match_reference():
    rng = np.random.default_rng(2)
    V = 40
    logits = rng.standard_normal((4, V)).astype(np.float32) * 3
    prompts = [[1, 2, 3], [5, 5, 6], [], [7]]
    outputs = [[2, 2, 9, 10], [], [11, 11, 11], [7, 8]]
    params = [(0.5, 0.25, 1.3), (0.0, 0.0, 1.7), (-0.5, 1.5, 1.0), (0.0, 0.0, 1.0)]
    counts = np.zeros((4, V), dtype=np.int32)
    seen = np.zeros((4, V), dtype=bool)
    for i in range(4):
        for t in outputs[i]:
            counts[i, t] += 1
        seen[i, prompts[i]] = True
    pres, freq, rep = (torch.tensor(x, dtype=torch.float32) for x in zip(*params))
    got = apply_penalties(torch.from_numpy(logits), torch.from_numpy(counts),
                          torch.from_numpy(seen), pres, freq, rep).numpy()
    for i, (p, f, r) in enumerate(params):
        want = ref_penalize(logits[i], prompts[i], outputs[i], p, f, r)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])  # neutral parameters: untouched


def _penalty_batch(counts, seen, slots, presence, frequency, repetition, new_slots=(),
                   prompt_slots=(), prompt_ids=()) -> PenaltyBatch:
    i64 = lambda x: torch.tensor(list(x), dtype=torch.int64)
    f32 = lambda x: torch.tensor(list(x), dtype=torch.float32)
    return PenaltyBatch(counts=counts, prompt_seen=seen, slots=i64(slots),
                        counted=(i64(slots) > 0).to(torch.int32), presence=f32(presence),
                        frequency=f32(frequency), repetition=f32(repetition),
                        new_slots=i64(new_slots), prompt_slots=i64(prompt_slots),
                        prompt_ids=i64(prompt_ids))


def test_penalty_rows_reset_mark_prompt_and_count_on_the_device():
    V = 16
    counts = torch.full((4, V), 7, dtype=torch.int32)
    counts[0] = 0  # the scratch row
    seen = torch.ones(4, V, dtype=torch.bool)
    seen[0] = False
    pen = _penalty_batch(counts, seen, slots=[2, 0, 3], presence=[0.1, 0, 0.2],
                         frequency=[0, 0, 0], repetition=[1, 1, 1], new_slots=[2],
                         prompt_slots=[2, 2], prompt_ids=[4, 9])
    pen.prepare()
    assert counts[2].sum() == 0 and seen[2].nonzero().flatten().tolist() == [4, 9]
    assert (counts[3] == 7).all() and seen[3].all()  # rows not handed out now: kept
    pen.record(torch.tensor([5, 6, 5]))
    assert counts[2, 5] == 1 and counts[3, 5] == 8 and counts[0].sum() == 0  # scratch stays 0
    pen.record(torch.tensor([5, 6, 1]))
    assert counts[2, 5] == 2 and counts[3, 1] == 8


def _batch(rows: int, temperature, seed, step, *, bias=None, bitmask=None, penalties=None):
    b = SamplingBatch.from_lists(temperature, [0] * rows, [1.0] * rows, [0.0] * rows, seed, step,
                                 0, "cpu", logit_bias=bias, token_bitmask=bitmask)
    return dataclasses.replace(b, penalties=penalties) if penalties is not None else b


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_applies_mask_bias_penalties_like_the_reference(temperature):
    """Four rows: masked, biased, penalized, plain; greedy (argmax of the processed logits) or
    seeded (argmax of processed / T + the sampler's Gumbel noise) against the reference."""
    rng = np.random.default_rng(3)
    V, B = 70, 4
    logits = rng.standard_normal((B, V)).astype(np.float32) * 2
    packed, allowed = random_bitmask(rng, B, V)
    packed[1:] = -1  # only row 0 constrained
    bias = [None, {int(np.argmin(logits[1])): 100.0, 3: -5.0}, None, None]
    prompt, output = [1, 2, 3], [int(np.argmax(logits[2])), 4, 4]
    counts = torch.zeros(3, V, dtype=torch.int32)
    seen = torch.zeros(3, V, dtype=torch.bool)
    for t in output:
        counts[1, t] += 1
    pen = _penalty_batch(counts, seen, slots=[0, 0, 1, 0], presence=[0, 0, 0.7, 0],
                         frequency=[0, 0, 1.1, 0], repetition=[1, 1, 1.5, 1],
                         prompt_slots=[1] * 3, prompt_ids=prompt)
    seeds, steps = [11, 12, 13, 14], [0, 5, 3, 2]
    batch = _batch(B, [temperature] * B, seeds, steps, bias=bias, bitmask=packed, penalties=pen)
    x = torch.from_numpy(logits.copy())
    got = sample(x, batch).token_ids.tolist()
    np.testing.assert_array_equal(x.numpy(), logits)  # the caller's logits are not written

    ref = logits.copy()
    ref[0] = ref_mask(logits[0], allowed[0])
    for t, v in bias[1].items():
        ref[1, t] += np.float32(v)
    ref[2] = ref_penalize(logits[2], prompt, output, 0.7, 1.1, 1.5)
    ref_t = torch.from_numpy(ref)
    if temperature == 0.0:
        want = ref_t.argmax(-1).tolist()
    else:
        noise = gumbel_noise(torch.tensor(seeds), torch.tensor(steps), V)
        want = (ref_t / temperature + noise).argmax(-1).tolist()
    assert got == want
    assert allowed[0, got[0]]
    assert counts[1, got[2]] == output.count(got[2]) + 1  # counted on the device
    assert int(counts.sum()) == len(output) + 1  # only the penalized row was counted

    # the plain row is the same alone as in this batch (batch invariance)
    alone = sample(torch.from_numpy(logits[3:].copy()),
                   _batch(1, [temperature], seeds[3:], steps[3:])).token_ids.tolist()
    assert alone == got[3:]


def test_processing_is_sync_free():
    rng = np.random.default_rng(4)
    V, B = 64, 3
    packed, _ = random_bitmask(rng, B, V)
    counts = torch.zeros(3, V, dtype=torch.int32)
    seen = torch.zeros(3, V, dtype=torch.bool)
    pen = _penalty_batch(counts, seen, slots=[1, 2, 0], presence=[0.5, 0, 0],
                         frequency=[0, 0.5, 0], repetition=[1.2, 1, 1], new_slots=[1, 2],
                         prompt_slots=[1, 2], prompt_ids=[3, 4])
    batch = _batch(B, [0.0, 0.7, 1.0], [1, 2, 3], [0, 0, 0], bias=[{1: 2.0}, None, {5: -1.0}],
                   bitmask=packed, penalties=pen)
    logits = torch.from_numpy(rng.standard_normal((B, V)).astype(np.float32))
    with SyncAudit() as audit:
        sample(logits, batch)
    assert audit.count() == 0, audit.report()
