"""Lone prompts' packed prefill-graph steps from templates (engine/prefill_template.py): the
bytes a template gives a prompt are the bytes the full plan and packing give it, over random
fresh prompts and follow-up suffixes (starts, restores, pages, slots, lengths, chunked first
chunks, prefix-cache snapshots); steps of several rows or with decode rows are planned in
full."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mambaserve import LLM
from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.prefill_bucket import pack_prefill_step
from mambaserve.engine.prefill_graph import PrefillGraphRunner
from mambaserve.engine.prefill_template import solo_key
from mambaserve.engine.sampling_params import SamplingParams
from mambaserve.metadata import plan_metadata

PS = 4


@pytest.fixture(scope="module")
def graphs(tiny_ckpt):
    eng = LLM(tiny_ckpt, device="cpu", max_model_len=96, max_num_seqs=4, page_size=PS).engine
    return PrefillGraphRunner(eng.model, eng.state_pool, eng.kv_pool, max_tokens=32,
                              max_decodes=2, max_model_len=96, snapshots=True, device="cpu",
                              max_solo_tokens=64)


def _prompt(rng: random.Random, n: int, samples: bool, extra_pages: int,
            chunk: int = 0, start: int = 0, restore: bool = False) -> Row:
    """A prompt's row of n tokens after `start` cached ones (0: a fresh prompt's first row; else
    a follow-up suffix continuing its state, restored from a random snapshot slot when
    `restore`); `chunk` > 0: prefix-cache snapshots at a random choice of the row's chunk ends
    (absolute multiples of `chunk` inside the row, and its last token), random slots."""
    ids = [rng.randrange(3, 300) for _ in range(n)]
    pages = rng.sample(range(24), -(-(start + n) // PS) + extra_pages)
    end = start + n
    ends = sorted({*range((start // chunk + 1) * chunk, end + 1, chunk), end}) if chunk else []
    snaps = [(p, rng.randrange(8, 40)) for p in ends if rng.random() < 0.6]
    src = rng.randrange(40, 48) if restore else -1
    r = Row.standalone(ids + ([7, 7] if not samples else []), start, rng.randrange(4), start > 0,
                       pages, snapshots=snaps, restore_from=src)
    return r if samples else Row(r.request, start, n, snaps, src, start > 0)


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
                               extra_pages=rng.choice([0, 0, 1]),
                               chunk=rng.choice([0, graphs.chunk_size]))], [])
        assert graphs.can_run(batch)
        key, host = graphs.plan(batch)
        got = graphs.step_bytes(key, host).copy()
        used += host.packed is not None
        np.testing.assert_array_equal(got, _full_bytes(graphs, key, batch), err_msg=str(i))
        assert len(host.arrays["logits_idx"]) == len(batch.prefills[0].logits_positions)
    assert used > 80  # most steps came from a template


def test_follow_up_suffixes_take_templates_across_starts(graphs):
    """A follow-up turn's suffix: the same key at starts a whole number of chunks apart (with
    more or fewer pages than the template's prompt), with and without a restore."""
    rng, L = random.Random(2), graphs.chunk_size
    used = 0
    for i in range(160):
        n = rng.choice([1, 5, 16, 17, 31])
        start = rng.choice([0, 1, 3]) + L * rng.randrange(0, (80 - n) // L + 1)
        batch = Batch([_prompt(rng, n, samples=rng.random() < 0.8,
                               extra_pages=rng.choice([0, 0, 1]),
                               chunk=rng.choice([0, L]), start=start,
                               restore=start > 0 and rng.random() < 0.5)], [])
        assert graphs.can_run(batch)
        key, host = graphs.plan(batch)
        got = graphs.step_bytes(key, host).copy()
        used += host.packed is not None and start >= L
        np.testing.assert_array_equal(got, _full_bytes(graphs, key, batch), err_msg=str(i))
        assert host.num_restores == (batch.prefills[0].restore_from >= 0)
    assert used > 30  # suffixes at later starts reused templates made at earlier ones


def test_other_steps_are_planned_in_full(graphs):
    rng = random.Random(1)
    first = _prompt(rng, 10, True, 0)
    decode = Row.standalone([5], 6, 3, True, [20, 21])
    cont = Row.standalone(list(range(3, 13)), 6, 2, True, [10, 11, 12, 13])  # a suffix
    for batch in (Batch([first], [decode]), Batch([cont], [decode]),
                  Batch([first, _prompt(rng, 5, True, 0)], [])):
        key = graphs.bucket_of(batch)
        assert solo_key(key, batch, graphs.chunk_size) is None
        for _ in range(2):  # never a template, however often seen
            _, host = graphs.plan(batch)
            assert host.packed is None
            np.testing.assert_array_equal(graphs.step_bytes(key, host),
                                          _full_bytes(graphs, key, batch))


def test_lone_prompts_with_the_prefix_cache_through_templates(tiny_ckpt):
    """Lone prompts one after another (lengths repeat, so later ones take templates), prefix
    caching on: the same tokens as eager, and each prompt's snapshots, written through a
    template's patched destination slots, serve its follow-up turn (a hit, eager's tokens),
    whose suffix step also comes from a template once its key repeats."""
    kw = {"device": "cpu", "max_model_len": 96, "max_num_seqs": 2, "page_size": PS,
          "enable_prefix_caching": True}
    eager = LLM(tiny_ckpt, **kw)
    graph = LLM(tiny_ckpt, enforce_eager=False, cuda_graph_max_prefill_tokens=32, **kw)
    templates, used, suffixes = graph.engine.runner.prefill_graph_runner.templates, [], []
    plan = templates.plan

    def noted(*a):
        host = plan(*a)
        row = a[1].prefills[0]
        used.append(host.packed is not None and bool(row.snapshots))
        suffixes.append(host.packed is not None and row.start > 0)
        return host

    templates.plan = noted
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)

    def same(outs, i):  # tokens, and their logprobs (which see the restored state)
        (a,), (b,) = outs[0].outputs, outs[1].outputs
        assert a.token_ids == b.token_ids, i
        np.testing.assert_allclose([d[t] for d, t in zip(b.logprobs, b.token_ids)],
                                   [d[t] for d, t in zip(a.logprobs, a.token_ids)],
                                   rtol=0, atol=1e-4, err_msg=str(i))

    rng = random.Random(3)
    for i in range(6):
        p = [rng.randrange(3, 300) for _ in range((17, 24)[i % 2])]
        first = [llm.generate([{"prompt_token_ids": p}], params)[0] for llm in (eager, graph)]
        same(first, i)
        turn = p + first[0].outputs[0].token_ids + [rng.randrange(3, 300) for _ in range(5)]
        second = [llm.generate([{"prompt_token_ids": turn}], params)[0] for llm in (eager, graph)]
        same(second, i)
        assert second[1].num_cached_tokens >= 16, i  # the snapshot of the template step hit
    assert sum(used) >= 3  # templates with snapshots served the repeated lengths
    assert sum(suffixes) >= 2  # and the follow-up turns' suffixes
    graph.engine.check_integrity()


def test_a_fresh_key_is_kept_on_its_second_prompt(graphs):
    """A fresh prompt of a new key is packed in its bucket's scratch buffer and not kept; the
    key's second prompt is packed into a buffer of its own, kept as the key's template, which
    the third takes (the same bytes as the full packing each time)."""
    from mambaserve.engine.prefill_template import SoloTemplates

    rng = random.Random(5)
    graphs.templates, saved = SoloTemplates(PS, graphs.scratch_page, graphs.chunk_size), \
        graphs.templates
    try:
        packed = []
        for i in range(3):
            batch = Batch([_prompt(rng, 13, True, 0)], [])
            key, host = graphs.plan(batch)
            packed.append(host.packed)
            np.testing.assert_array_equal(graphs.step_bytes(key, host).copy(),
                                          _full_bytes(graphs, key, batch), err_msg=str(i))
            assert len(graphs.templates) == (0, 1, 1)[i]
        assert packed[0] is graphs.buckets[key].scratch[0]  # the first: the scratch buffer
        assert packed[1] is packed[2] and packed[1] is not packed[0]  # then the template's
    finally:
        graphs.templates = saved


def test_templates_stop_at_their_byte_budget(graphs):
    """Past the budget a new key is kept no more: a fresh prompt's or a suffix's bytes are still
    packed for it directly (the same bytes as the full packing), in the bucket's scratch buffer;
    known keys still hit."""
    from mambaserve.engine.prefill_template import SoloTemplates

    rng = random.Random(4)
    small = SoloTemplates(PS, graphs.scratch_page, graphs.chunk_size, max_bytes=1)
    graphs.templates, saved = small, graphs.templates
    try:
        for _ in range(2):  # a fresh key is kept on its second prompt
            _, host = graphs.plan(Batch([_prompt(rng, 16, True, 0)], []))
        assert host.packed is not None and small.nbytes > 0  # the first key fits
        held = small.nbytes
        other = Batch([_prompt(rng, 17, True, 0)], [])
        key, host = graphs.plan(other)
        assert host.packed is not None and len(small) == 1 and small.nbytes == held
        np.testing.assert_array_equal(graphs.step_bytes(key, host).copy(),
                                      _full_bytes(graphs, key, other))
        for _ in range(2):  # however often seen
            suffix = Batch([_prompt(rng, 5, True, 0, start=graphs.chunk_size)], [])
            key, host = graphs.plan(suffix)
            assert host.packed is graphs.buckets[key].scratch[0] and len(small) == 1
            np.testing.assert_array_equal(graphs.step_bytes(key, host).copy(),
                                          _full_bytes(graphs, key, suffix))
        again = Batch([_prompt(rng, 16, True, 0)], [])
        key, host = graphs.plan(again)
        assert host.packed is not None
        np.testing.assert_array_equal(graphs.step_bytes(key, host).copy(),
                                      _full_bytes(graphs, key, again))
    finally:
        graphs.templates = saved
