"""Fresh lone prompts' packed prefill-graph steps from templates (engine/prefill_template.py):
the bytes a template gives a prompt are the bytes the full plan and packing give it, over random
prompts, pages, slots and lengths (chunked first chunks too); other steps are planned in full."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mambaserve import LLM
from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.prefill_graph import PrefillGraphRunner, pack_prefill_step
from mambaserve.engine.prefill_template import solo_key
from mambaserve.metadata import plan_metadata

PS = 4


@pytest.fixture(scope="module")
def graphs(tiny_ckpt):
    eng = LLM(tiny_ckpt, device="cpu", max_model_len=96, max_num_seqs=4, page_size=PS).engine
    return PrefillGraphRunner(eng.model, eng.state_pool, eng.kv_pool, max_tokens=32,
                              max_decodes=2, max_model_len=96, snapshots=True, device="cpu",
                              max_solo_tokens=64)


def _prompt(rng: random.Random, n: int, samples: bool, extra_pages: int) -> Row:
    ids = [rng.randrange(3, 300) for _ in range(n)]
    pages = rng.sample(range(24), -(-n // PS) + extra_pages)
    r = Row.standalone(ids + ([7, 7] if not samples else []), 0, rng.randrange(4), False, pages)
    return r if samples else Row(r.request, 0, n, [], -1, False)


def _full_bytes(graphs, key, batch) -> np.ndarray:
    host = plan_metadata(batch, chunk_size=graphs.chunk_size, conv_kernel=graphs.conv_kernel,
                         page_size=PS, scratch_page=graphs.scratch_page)
    return pack_prefill_step(host, graphs.buckets[key], page_size=PS,
                             scratch_page=graphs.scratch_page)


def test_template_bytes_are_the_full_packing(graphs):
    rng = random.Random(0)
    used = 0
    for i in range(120):
        n = rng.choice([1, 3, 4, 16, 17, 31, 40, 64])
        batch = Batch([_prompt(rng, n, samples=rng.random() < 0.8,
                               extra_pages=rng.choice([0, 0, 1]))], [])
        assert graphs.can_run(batch)
        key, host = graphs.plan(batch)
        got = graphs.step_bytes(key, host).copy()
        used += host.packed is not None
        np.testing.assert_array_equal(got, _full_bytes(graphs, key, batch), err_msg=str(i))
        assert len(host.arrays["logits_idx"]) == len(batch.prefills[0].logits_positions)
    assert used > 80  # most steps came from a template


def test_other_steps_are_planned_in_full(graphs):
    rng = random.Random(1)
    first = _prompt(rng, 10, True, 0)
    decode = Row.standalone([5], 6, 3, True, [20, 21])
    cont = Row.standalone(list(range(3, 13)), 6, 2, True, [10, 11, 12, 13])  # a suffix
    snap = Row.standalone(list(range(3, 19)), 0, 1, False, [14, 15, 16, 17], snapshots=[(16, 5)])
    for batch in (Batch([first], [decode]), Batch([cont], []), Batch([snap], []),
                  Batch([first, _prompt(rng, 5, True, 0)], [])):
        key = graphs.bucket_of(batch)
        assert solo_key(key, batch) is None
        for _ in range(2):  # never a template, however often seen
            _, host = graphs.plan(batch)
            assert host.packed is None
            np.testing.assert_array_equal(graphs.step_bytes(key, host),
                                          _full_bytes(graphs, key, batch))
