"""Prefill / mixed-step CUDA graphs: buckets and packing on the host; the padded static-buffer
forward against the eager forward (logits and every live state and KV page, float32, two
families); engine outputs with the option on vs off (prefix caching, chunked prefill, overlap)
on the CPU (uncaptured); capture and replay on a GPU."""


import numpy as np
import pytest
import torch
from fake_cuda import install_fake_cuda
from family_checkpoints import MAKERS

from mambaserve import LLM, SamplingParams
from mambaserve.engine import prefill_graph
from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.prefill_bucket import PrefillBucket, pack_prefill_step
from mambaserve.engine.prefill_graph import (
    DENSE,
    PrefillGraphRunner,
    decode_buckets,
    token_buckets,
)
from mambaserve.metadata import build_metadata, plan_metadata

PS, SCRATCH = 4, 99


def test_buckets():
    assert token_buckets(256) == [16, 32, 64, 128, 256]
    assert token_buckets(24) == [16, 24] and token_buckets(16) == [16] and token_buckets(5) == [5]
    assert decode_buckets(0) == [0] and decode_buckets(1) == [0, 1]
    assert decode_buckets(64) == [0, 1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(40) == [0, 1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError):
        token_buckets(0)


def row(tokens, ctx, slot, init, pages, snaps=(), restore=-1, samples=True):
    """A row over a request of its own; samples=False: more tokens follow (a prefill chunk)."""
    r = Row.standalone(list(tokens) + ([7, 7] if not samples else []), ctx, slot, init, pages,
                       list(snaps), restore)
    return r if samples else Row(r.request, ctx, len(tokens), list(snaps), restore, init)


def test_pack_embeds_the_eager_plan_and_pads_it():
    b = PrefillBucket(tokens=16, decodes=2, rows=3, chunk_size=8, conv_kernel=4, max_pages=5,
                      snapshots=True)
    assert (b.chunks, b.chunks_per_row, b.num_snapshots, b.num_logits) == (7, 3, 4, 4)
    batch = Batch([row([11, 12, 13, 14, 15, 16], 5, 2, True, [3, 4, 5], snaps=[(8, 9)])],
                  [row([21], 6, 4, True, [6, 7])])
    host = plan_metadata(batch, chunk_size=8, conv_kernel=4, page_size=PS, scratch_page=SCRATCH)
    buf = pack_prefill_step(host, b, page_size=PS, scratch_page=SCRATCH)
    assert buf.dtype == np.uint8 and buf.size == b.nbytes
    p = b.host_views(buf)
    assert p["input_ids"].tolist() == [11, 12, 13, 14, 15, 16] + [0] * 10 + [21, 0]
    # padding positions stay in the first page (its page-table column 0: the scratch page)
    assert p["positions"].tolist() == [5, 6, 7, 8, 9, 10] + [i % PS for i in range(10)] + [6, 0]
    assert p["token_row"].tolist() == [0] * 6 + [2] * 10 + [3, 4]  # padding tokens: the last
    assert p["slot_mapping"][6:16].tolist() == [SCRATCH * PS + i % PS for i in range(10)]
    assert p["slot_mapping"][16:].tolist() == [7 * PS + 2, SCRATCH * PS]
    assert p["state_slots"].tolist() == [2, -1, -1, 4, -1]
    assert p["has_initial_state"].tolist() == [True, False, False]
    assert p["page_table"].tolist() == [[3, 4, 5, SCRATCH, SCRATCH]] + [[SCRATCH] * 5] * 2 + [
        [6, 7, SCRATCH, SCRATCH, SCRATCH], [SCRATCH] * 5]
    assert p["logits_idx"].tolist() == [5, 16, 0, 0]  # real rows in the eager order first
    # chunks: the real row's [5,8) and [8,11) (ids 0, 1), the empty padding row's one empty
    # chunk (2), the padding tokens in aligned chunks (3, 4); chunks past them are empty
    cti = p["chunk_token_idx"]
    assert [(c < 16).sum() for c in cti] == [3, 3, 0, 8, 2, 0, 0]
    assert cti[3, :8].tolist() == list(range(6, 14)) and cti[4, :2].tolist() == [14, 15]
    assert p["row_chunks"].tolist() == [[0, 1, 7], [2, 7, 7], [3, 4, 7]]
    assert p["row_num_chunks"].tolist() == [2, 1, 2]
    assert p["token_chunk_pos"].tolist() == [0, 1, 2, 8, 9, 10] + list(range(24, 32)) + [32, 33]
    # conv: extended stream = 3 rows x 3 saved inputs, then 16 tokens
    assert p["conv_window_idx"][0].tolist() == [0, 1, 2, 9]
    assert p["conv_window_idx"][6].tolist() == [6, 7, 8, 9 + 6]  # padding row from its window
    assert p["conv_state_idx"].tolist() == [[12, 13, 14], [3, 4, 5], [22, 23, 24]]
    assert p["snap_dst"].tolist() == [9, -1, -1, -1]
    assert p["chunk_snap_dst"].tolist() == [9, -1, -1, -1, -1, -1, -1]  # the scan's: chunk 0
    assert p["snap_conv_idx"][0].tolist() == [9, 10, 11]  # the inputs at positions 5, 6, 7
    assert p["decode_snap_dst"].tolist() == [-1, -1]


def test_pack_into_the_bucket_buffer_leaves_nothing_of_the_step_before():
    """reuse=True (the runner's packing) fills the bucket's own buffer: the same bytes as a
    fresh pack, whatever step was packed into it before (a larger one, with snapshots)."""
    b = PrefillBucket(tokens=16, decodes=2, rows=3, chunk_size=8, conv_kernel=4, max_pages=5,
                      snapshots=True)
    kw = dict(chunk_size=8, conv_kernel=4, page_size=PS, scratch_page=SCRATCH)
    big = plan_metadata(Batch([row(range(1, 15), 2, 1, True, [3, 4, 5, 6, 7], snaps=[(8, 9)]),
                               row([5], 0, 3, False, [8], restore=11)],
                              [row([21], 6, 4, True, [6, 7]), row([22], 1, 5, True, [2])]), **kw)
    small = plan_metadata(Batch([row([11, 12, 13], 0, 2, False, [3])], []), **kw)
    for host in (big, small, None):
        fresh = pack_prefill_step(host, b, page_size=PS, scratch_page=SCRATCH)
        pack_prefill_step(big, b, page_size=PS, scratch_page=SCRATCH, reuse=True)
        reused = pack_prefill_step(host, b, page_size=PS, scratch_page=SCRATCH, reuse=True)
        assert reused is b.scratch[0] and np.array_equal(reused, fresh)


def test_pack_refuses_what_does_not_fit():
    b = PrefillBucket(16, 0, 2, 8, 4, 2, False)
    for batch in (Batch([row(range(17), 0, 0, False, [0] * 5)], []),  # too many tokens
                  Batch([row([1], 0, 0, False, [0]), row([1], 0, 1, False, [1])], []),  # rows
                  Batch([], [row([1], 0, 0, True, [0])])):  # no prefill row
        host = plan_metadata(batch, chunk_size=8, conv_kernel=4, page_size=PS,
                             scratch_page=SCRATCH)
        with pytest.raises(ValueError, match="does not fit"):
            pack_prefill_step(host, b, page_size=PS, scratch_page=SCRATCH)
    host = plan_metadata(Batch([row([1, 2], 10, 0, True, [0, 1, 2])], []), chunk_size=8,
                         conv_kernel=4, page_size=PS, scratch_page=SCRATCH)
    with pytest.raises(ValueError, match="pages"):
        pack_prefill_step(host, b, page_size=PS, scratch_page=SCRATCH)


def test_metadata_views_are_the_bucket_shapes_in_one_buffer(tiny_ckpt):
    eng = LLM(tiny_ckpt, device="cpu", max_model_len=64, max_num_seqs=4, page_size=PS).engine
    graphs = PrefillGraphRunner(eng.model, eng.state_pool, eng.kv_pool, max_tokens=32,
                                max_decodes=4, max_model_len=64, snapshots=False, device="cpu")
    base = graphs.buf.untyped_storage().data_ptr()
    for key, b in graphs.buckets.items():
        meta = graphs.metas[key]
        assert (meta.num_tokens, meta.num_decodes, meta.num_prefills) == (
            b.num_tokens, b.decodes, b.rows)
        assert meta.prefill.num_chunks == b.chunks and meta.prefill.num_restores == 0
        assert meta.page_table.shape == (b.num_rows, 16) and meta.max_kv_len == 64
        assert meta.prefill.chunk_token_idx.shape == (b.chunks, 8)
        assert meta.logits_idx.shape == (b.num_logits,) and meta.num_decode_snapshots == 0
        for t in (meta.input_ids, meta.page_table, meta.prefill.has_initial_state,
                  meta.prefill.row_chunks, meta.decode_snap_dst):
            assert t.untyped_storage().data_ptr() == base
    # what a step packs on the host is what the bucket's device views read
    batch = SCENARIOS["mixed"]
    meta = graphs.load(batch)
    host = graphs.buckets[graphs.bucket_of(batch)].host_views(
        graphs.buf.numpy()[: graphs.buckets[graphs.bucket_of(batch)].nbytes])
    for name in ("input_ids", "positions", "state_slots", "page_table", "logits_idx"):
        assert getattr(meta, name).tolist() == host[name].tolist(), name
    assert meta.prefill.row_chunks.tolist() == host["row_chunks"].tolist()
    assert meta.prefill.has_initial_state.tolist() == host["has_initial_state"].tolist()


# ---- the padded forward against the eager one ----------------------------------------------
@pytest.fixture(scope="module")
def falcon_ckpt(tmp_path_factory):
    return MAKERS["FalconH1ForCausalLM"](tmp_path_factory.mktemp("falcon") / "ckpt", seed=0)


@pytest.fixture(scope="module", params=["nemotron_h", "falcon_h1"])
def engine(request, tiny_ckpt, falcon_ckpt):
    ckpt = tiny_ckpt if request.param == "nemotron_h" else falcon_ckpt
    return LLM(ckpt, device="cpu", max_model_len=64, max_num_seqs=4, page_size=PS,
               enable_prefix_caching=True).engine


def _ids(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pages(first, n):
    return list(range(first, first + n))


SCENARIOS = {
    "one short prompt": Batch([row(_ids(11, 0), 0, 0, False, _pages(0, 3))], []),
    "several short prompts": Batch([row(_ids(5, 1), 0, 0, False, _pages(0, 2)),
                                    row(_ids(9, 2), 0, 1, False, _pages(2, 3)),
                                    row(_ids(13, 3), 0, 2, False, _pages(5, 4))], []),
    # the uncached suffix of a hit: positions 16..25 over cached pages, the cached state restored
    # from snapshot slot 5 first, a snapshot at the chunk end 24
    "prefix-cache hit suffix": Batch([row(_ids(10, 4), 16, 0, True, _pages(0, 7),
                                          snaps=[(24, 6)], restore=5)], []),
    # a prefill chunk that does not sample yet, next to decode rows (one snapshots)
    "mixed": Batch([row(_ids(9, 5), 5, 0, True, _pages(0, 4), samples=False)],
                   [row([17], 7, 1, True, _pages(4, 2)), row([18], 12, 2, True, _pages(6, 4)),
                    row([19], 23, 3, True, _pages(10, 6), snaps=[(24, 7)])]),
    "four prefill rows + decodes": Batch(
        [row(_ids(3, 6), 0, 0, False, _pages(0, 1)), row(_ids(8, 7), 4, 1, True, _pages(1, 3)),
         row(_ids(2, 8), 9, 2, True, _pages(4, 3)), row(_ids(7, 9), 0, 3, False, _pages(7, 2))],
        [row([20], 3, 4, True, _pages(9, 1))]),
}


def _eager_forward(engine, batch, seed):
    """Random finite pools (initial states, cached KV, snapshot slots), the eager forward of
    `batch` over them; returns its logits and the pools it left, the pools put back as before."""
    sp, kv, model = engine.state_pool, engine.kv_pool, engine.model
    pools = (sp.conv_state, sp.ssm_state, kv.kv_cache)
    g = torch.Generator().manual_seed(seed)
    for t in pools:
        t.copy_(0.5 * torch.randn(t.shape, generator=g))
    start = [t.clone() for t in pools]
    cfg = model.cfg
    with torch.inference_mode():
        meta = build_metadata(batch, chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel,
                              page_size=PS, scratch_page=kv.scratch_page, device="cpu")
        eager = model(meta, *pools)
    eager_pools = [t.clone() for t in pools]
    for t, s in zip(pools, start):
        t.copy_(s)
    return eager, eager_pools


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_padded_forward_matches_eager(engine, name):
    batch = SCENARIOS[name]
    sp, kv, model = engine.state_pool, engine.kv_pool, engine.model
    eager, eager_pools = _eager_forward(engine, batch, seed=0)
    with torch.inference_mode():
        graphs = PrefillGraphRunner(model, sp, kv, max_tokens=32, max_decodes=4,
                                    max_model_len=64, snapshots=True, device="cpu")
        assert graphs.can_run(batch) and not graphs.graphs
        meta = graphs.load(batch)
        bucket = graphs.buckets[graphs.bucket_of(batch)]
        assert meta.num_tokens == bucket.num_tokens > batch.num_tokens  # really padded
        logits = graphs.replay()
    assert logits.shape == eager.shape
    torch.testing.assert_close(logits, eager, rtol=0, atol=1e-5)
    # every live slot and page (the scratch ones, last, excluded) as the eager forward left it
    # (float32 rounding of different batch shapes: the SSM states grow to ~20)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(sp.conv_state[:, :-1], eager_pools[0][:, :-1], **tol)
    torch.testing.assert_close(sp.ssm_state[:, :-1], eager_pools[1][:, :-1], **tol)
    torch.testing.assert_close(kv.kv_cache[:, :, :-1], eager_pools[2][:, :, :-1], **tol)


def test_routing(engine):
    graphs = PrefillGraphRunner(engine.model, engine.state_pool, engine.kv_pool, max_tokens=32,
                                max_decodes=4, max_model_len=64, snapshots=False, device="cpu")
    assert graphs.token_buckets == [16, 32] and graphs.decode_buckets == [0, 1, 2, 4]
    ok = row(_ids(11, 0), 0, 0, False, _pages(0, 3))
    assert graphs.can_run(Batch([ok], [row([1], 3, 1, True, [5])] * 4))
    assert graphs.bucket_of(Batch([ok], [row([1], 3, 1, True, [5])] * 3)) == (16, 4)
    assert not graphs.can_run(Batch([], [row([1], 3, 1, True, [5])]))  # decode-only
    assert not graphs.can_run(Batch([row(_ids(33, 1), 0, 0, False, _pages(0, 9))], []))
    assert not graphs.can_run(Batch([ok] * 5, []))  # more than 4 prefill rows
    assert not graphs.can_run(Batch([ok], [row([1], 3, 1, True, [5])] * 5))  # decodes
    assert not graphs.can_run(Batch([row(_ids(4, 2), 0, 0, False, _pages(0, 17))], []))
    snap = row(_ids(10, 4), 0, 0, False, _pages(0, 3), snaps=[(8, 6)])
    assert not graphs.can_run(Batch([snap], []))  # snapshots not captured
    lp = Row.standalone(_ids(4, 3), 0, 0, False, [0])
    lp.prompt_targets = [5, 6, 7]
    assert not graphs.can_run(Batch([lp], []))  # prompt logprobs run eagerly


def test_prefill_only_steps_have_their_own_bound(engine):
    """A lone prompt past max_tokens replays a prefill-only bucket up to max_solo_tokens; next
    to decode rows the same prefill part stays eager (those buckets stop at max_tokens)."""
    graphs = PrefillGraphRunner(engine.model, engine.state_pool, engine.kv_pool, max_tokens=32,
                                max_decodes=2, max_model_len=128, snapshots=False,
                                device="cpu", max_solo_tokens=64)
    assert graphs.token_buckets == [16, 32] and graphs.solo_buckets == [16, 32, 64]
    assert (64, 0) in graphs.buckets and (64, 1) not in graphs.buckets
    long = row(_ids(40, 5), 0, 0, False, _pages(0, 3))
    assert graphs.bucket_of(Batch([long], [])) == (64, 0) and graphs.can_run(Batch([long], []))
    assert not graphs.can_run(Batch([long], [row([1], 3, 1, True, [5])]))
    assert not graphs.can_run(Batch([row(_ids(65, 6), 0, 0, False, _pages(0, 5))], []))


def test_fresh_lone_prompts_replay_a_dense_attention_variant(engine, monkeypatch):
    """dense_solo: each prefill-only bucket of >= DENSE_MIN_TOKENS tokens gets a variant whose
    captured metadata makes the whole prefill part one fresh row for the attention (dense on a
    GPU); only a fresh lone prompt routes there, and its padded forward is eager's."""
    monkeypatch.setattr(prefill_graph, "DENSE_MIN_TOKENS", 32)
    sp, kv, model = engine.state_pool, engine.kv_pool, engine.model
    graphs = PrefillGraphRunner(model, sp, kv, max_tokens=16, max_decodes=2, max_model_len=64,
                                snapshots=True, device="cpu", max_solo_tokens=64,
                                dense_solo=True)
    assert sorted(k for k in graphs.buckets if k[-1] == DENSE) == [(32, 0, DENSE),
                                                                   (64, 0, DENSE)]
    assert graphs.buckets[32, 0, DENSE] is graphs.buckets[32, 0]
    assert graphs.metas[64, 0, DENSE].prefill.row_spans == ((0, 64, 0),)
    assert graphs.metas[64, 0].prefill.row_spans is None
    fresh = Batch([row(_ids(20, 3), 0, 0, False, _pages(0, 5))], [])
    assert graphs.bucket_of(fresh) == (32, 0, DENSE)
    assert graphs.bucket_of(Batch([row(_ids(10, 3), 0, 0, False, _pages(0, 3))], [])) == (16, 0)
    suffix = Batch([row(_ids(20, 4), 16, 0, True, _pages(0, 9), restore=5)], [])
    assert graphs.bucket_of(suffix) == (32, 0)  # a cached prefix: the paged kernels
    two = Batch([row(_ids(20, 5), 0, 0, False, _pages(0, 5)),
                 row(_ids(9, 6), 0, 1, False, _pages(5, 3))], [])
    assert graphs.bucket_of(two) == (32, 0)
    assert not any(k[-1] == DENSE for k in PrefillGraphRunner(
        model, sp, kv, max_tokens=16, max_decodes=2, max_model_len=64, snapshots=True,
        device="cpu", max_solo_tokens=64).buckets)  # float32 on a CPU: not dense-capable
    eager, _ = _eager_forward(engine, fresh, seed=2)
    with torch.inference_mode():
        assert graphs.load(fresh) is graphs.metas[32, 0, DENSE]
        logits = graphs.replay()
    torch.testing.assert_close(logits, eager, rtol=0, atol=1e-5)


@pytest.fixture
def heads_from_16(monkeypatch):
    """Heads for every prefill-only bucket (HEAD_MIN_TOKENS 0): these tests' buckets are small."""
    monkeypatch.setattr(prefill_graph, "HEAD_MIN_TOKENS", 0)


def test_heads_only_from_head_min_tokens(engine, monkeypatch):
    monkeypatch.setattr(prefill_graph, "HEAD_MIN_TOKENS", 32)
    graphs = PrefillGraphRunner(engine.model, engine.state_pool, engine.kv_pool, max_tokens=16,
                                max_decodes=2, max_model_len=128, snapshots=False,
                                device="cpu", max_solo_tokens=64)
    assert sorted(graphs.heads) == [(32, 0), (64, 0)]
    assert not graphs.start_head(Batch([row(_ids(11, 0), 0, 0, False, _pages(0, 3))], []))
    assert graphs.start_head(Batch([row(_ids(20, 0), 0, 0, False, _pages(0, 5))], []))


def test_prefill_only_steps_start_their_head_before_the_plan(engine, heads_from_16):
    """start_head: a prefill-only step's token ids (padding ids 0) into its bucket's input ids and
    the head run before the step is planned; the replay then runs only the rest, and the
    logits are eager's. Steps with decode rows run their bucket's whole forward."""
    sp, kv, model = engine.state_pool, engine.kv_pool, engine.model
    graphs = PrefillGraphRunner(model, sp, kv, max_tokens=32, max_decodes=4, max_model_len=64,
                                snapshots=True, device="cpu")
    assert sorted(graphs.heads) == [(16, 0), (32, 0)]
    for name in ("one short prompt", "several short prompts", "prefix-cache hit suffix"):
        batch = SCENARIOS[name]
        eager, _ = _eager_forward(engine, batch, seed=1)
        key = graphs.bucket_of(batch)
        graphs.buf.fill_(7)  # a step before left other bytes
        with torch.inference_mode():
            assert graphs.start_head(batch)
            ids = graphs.metas[key].input_ids.tolist()
            n = batch.num_prefill_tokens
            assert ids[:n] == [t for r in batch.prefills for t in r.token_ids]
            assert ids[n:] == [0] * (key[0] - n)
            started = graphs.heads[key[:2]]
            graphs.load(batch)
            logits = graphs.replay()
            assert graphs.heads[key[:2]] is started  # not run again
        torch.testing.assert_close(logits, eager, rtol=0, atol=1e-5)
    mixed = SCENARIOS["mixed"]
    eager, _ = _eager_forward(engine, mixed, seed=1)
    with torch.inference_mode():
        assert not graphs.start_head(mixed)
        graphs.load(mixed)
        torch.testing.assert_close(graphs.replay(), eager, rtol=0, atol=1e-5)
    off = PrefillGraphRunner(model, sp, kv, max_tokens=32, max_decodes=4, max_model_len=64,
                             snapshots=True, device="cpu", head_start=False)
    assert not off.heads and not off.start_head(SCENARIOS["one short prompt"])


def test_a_step_whose_head_was_not_started_runs_it_in_the_replay(engine, heads_from_16):
    """A prefill-only step loaded without start_head (or after another step's start) replays
    its bucket's head, then the rest: eager's logits."""
    sp, kv, model = engine.state_pool, engine.kv_pool, engine.model
    graphs = PrefillGraphRunner(model, sp, kv, max_tokens=32, max_decodes=4, max_model_len=64,
                                snapshots=True, device="cpu")
    one, several = SCENARIOS["one short prompt"], SCENARIOS["several short prompts"]
    eager, _ = _eager_forward(engine, several, seed=3)
    with torch.inference_mode():
        assert graphs.start_head(one)  # started for a step that is not the one replayed
        graphs.load(several)
        logits = graphs.replay()
    torch.testing.assert_close(logits, eager, rtol=0, atol=1e-5)


def test_capture_batches_touch_only_scratch_memory(engine):
    sp, kv = engine.state_pool, engine.kv_pool
    g = torch.Generator().manual_seed(1)
    for t in (sp.conv_state, sp.ssm_state, kv.kv_cache):
        t.copy_(torch.randn(t.shape, generator=g))
    before = [sp.conv_state[:, :-1].clone(), sp.ssm_state[:, :-1].clone(),
              kv.kv_cache[:, :, :-1].clone()]
    graphs = PrefillGraphRunner(engine.model, sp, kv, max_tokens=32, max_decodes=4,
                                max_model_len=64, snapshots=True, device="cpu")
    with torch.inference_mode():
        for key in graphs.buckets:  # what capture() runs before and inside each capture
            graphs._load_padding(key)
            graphs._forward(key)
            assert torch.isfinite(graphs.logits).all()
    assert torch.equal(before[0], sp.conv_state[:, :-1])
    assert torch.equal(before[1], sp.ssm_state[:, :-1])
    assert torch.equal(before[2], kv.kv_cache[:, :, :-1])


# ---- the engine with the option on vs off ----------------------------------------------------
def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]


PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=5, max_tokens=7, logprobs=1)]


def _tokens(llm, prompts):
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _record_loads(llm):
    seen, graphs = [], llm.engine.runner.prefill_graph_runner
    plan = graphs.plan  # the runner plans each graph step (then loads the plan)
    graphs.plan = lambda batch: (seen.append(batch), plan(batch))[1]
    return seen


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_engine_outputs_with_prefill_graphs_on_and_off(tiny_ckpt, prefix, overlap):
    """Chunked prefill (budget 24) and mixed steps, prefix caching with a second turn that hits,
    overlap scheduling: the same tokens with prefill graphs (uncaptured on a CPU) as without."""
    kw = {"max_model_len": 96, "max_num_seqs": 4, "chunked_prefill_size": 24, "device": "cpu",
          "enable_prefix_caching": prefix, "enforce_eager": False, "cuda_graph_max_bs": 4,
          "async_scheduling": overlap}
    off = LLM(tiny_ckpt, cuda_graph_max_prefill_tokens=0, **kw)
    on = LLM(tiny_ckpt, cuda_graph_max_prefill_tokens=256, **kw)
    assert off.engine.runner.prefill_graph_runner is None
    seen = _record_loads(on)
    prompts = _prompts()
    assert _tokens(on, prompts) == _tokens(off, prompts)
    assert any(b.decodes for b in seen) and any(not b.decodes for b in seen)
    assert any(len(b.prefills) > 1 for b in seen)
    if overlap:
        assert any(r.input_on_device for b in seen for r in b.decodes)
    if prefix:
        again = [p + [5] * 20 for p in prompts]
        assert _tokens(on, again) == _tokens(off, again)
        assert any(r.restore_from >= 0 for b in seen for r in b.prefills)
        assert any(r.snapshots for b in seen for r in b.rows)
        on.engine.check_integrity()


def test_engine_with_falcon_h1(falcon_ckpt):
    kw = {"max_model_len": 96, "max_num_seqs": 4, "chunked_prefill_size": 24, "device": "cpu",
          "enable_prefix_caching": True, "cuda_graph_max_bs": 4}
    eager = LLM(falcon_ckpt, **kw)
    on = LLM(falcon_ckpt, enforce_eager=False, cuda_graph_max_prefill_tokens=256, **kw)
    seen = _record_loads(on)
    prompts = _prompts()
    assert _tokens(on, prompts) == _tokens(eager, prompts) and seen


def test_capture_and_replay_plumbing_with_a_fake_cuda(tiny_ckpt, monkeypatch, heads_from_16):
    kw = {"max_model_len": 96, "max_num_seqs": 4, "chunked_prefill_size": 24, "device": "cpu"}
    eager = LLM(tiny_ckpt, **kw)
    llm = LLM(tiny_ckpt, enforce_eager=False, cuda_graph_max_bs=4,
              cuda_graph_max_prefill_tokens=256, **kw)
    graphs = llm.engine.runner.prefill_graph_runner
    order = install_fake_cuda(monkeypatch, graphs)
    graphs.capture_enabled = True
    graphs.capture()
    heads = [k for k in order if k[0] == "head"]
    order = [k for k in order if k[0] != "head"]
    assert sorted(order) == sorted(graphs.buckets) == sorted(graphs.graphs)
    sizes = [graphs.buckets[k].num_tokens for k in order]
    assert sizes == sorted(sizes, reverse=True)  # largest first
    # one head per prefill-only bucket (its dense variant shares it), captured before the rest
    assert sorted(k[1][:2] for k in heads) == sorted(graphs.head_graphs) == sorted(
        k for k in graphs.buckets if k[1] == 0)
    started, start_head = [], graphs.start_head
    monkeypatch.setattr(graphs, "start_head", lambda b: started.append(start_head(b)) or
                        started[-1])
    prompts = _prompts()
    assert _tokens(llm, prompts) == _tokens(eager, prompts)
    assert sum(g.replays for g in graphs.graphs.values()) > 0
    assert True in started  # the prompts' first steps (prefill-only) started their heads
    assert sum(g.replays for g in graphs.head_graphs.values()) > len(graphs.head_graphs)


def test_option_validated():
    with pytest.raises(ValueError, match="cuda_graph_max_prefill_tokens"):
        LLM("unused", cuda_graph_max_prefill_tokens=-1)


# ---- on a GPU: captured graphs against eager -------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("prefix", [False, True])
def test_prefill_graphs_match_eager_on_gpu(tiny_ckpt, falcon_ckpt, prefix, heads_from_16):
    """Captured prefill / mixed graphs (the default on CUDA) give eager's tokens, with and
    without prefix caching (a second turn hits), under overlap scheduling (the default); the
    prefill-only buckets with heads started before the planning."""
    for ckpt in (tiny_ckpt, falcon_ckpt):
        kw = {"device": "cuda", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8,
              "chunked_prefill_size": 32, "enable_prefix_caching": prefix,
              "memory_budget_bytes": 64 << 20, "cuda_graph_max_bs": 8,
              "cuda_graph_max_prefill_tokens": 256}
        eager = LLM(ckpt, enforce_eager=True, **kw)
        graph = LLM(ckpt, **kw)
        pg = graph.engine.runner.prefill_graph_runner
        assert sorted(pg.graphs) == sorted(pg.buckets) and pg.token_buckets == [16, 32]
        seen = _record_loads(graph)
        prompts = _prompts() + [p[:7] for p in _prompts()]
        assert _tokens(graph, prompts) == _tokens(eager, prompts)
        assert any(b.decodes for b in seen)
        if prefix:
            again = [p + [5] * 20 for p in prompts]
            assert _tokens(graph, again) == _tokens(eager, again)
            assert any(r.restore_from >= 0 for b in seen for r in b.prefills)
            graph.engine.check_integrity()


@gpu
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_replayed_graph_matches_eager_forward_on_gpu(tiny_ckpt, name, heads_from_16):
    """Each scenario's bucket captured, then replayed over the scenario (a prefill-only one with
    its head started first): the logits and every live state / page as the eager forward leaves
    them."""
    eng = LLM(tiny_ckpt, device="cuda", dtype="float32", max_model_len=64, max_num_seqs=4,
              page_size=PS, enable_prefix_caching=True, enforce_eager=True,
              memory_budget_bytes=64 << 20).engine
    batch = SCENARIOS[name]
    sp, kv, model = eng.state_pool, eng.kv_pool, eng.model
    pools = (sp.conv_state, sp.ssm_state, kv.kv_cache)
    graphs = PrefillGraphRunner(model, sp, kv, max_tokens=32, max_decodes=4, max_model_len=64,
                                snapshots=True, device=eng.device)
    graphs.capture()
    assert sorted(graphs.graphs) == sorted(graphs.buckets)
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in pools:
        t.copy_(0.5 * torch.randn(t.shape, generator=g, device="cuda"))
    start = [t.clone() for t in pools]
    cfg = model.cfg
    with torch.inference_mode():
        meta = build_metadata(batch, chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel,
                              page_size=PS, scratch_page=kv.scratch_page, device="cuda")
        eager = model(meta, *pools).clone()
        eager_pools = [t.clone() for t in pools]
        for t, s in zip(pools, start):
            t.copy_(s)
        assert graphs.can_run(batch)
        assert graphs.start_head(batch) == (not batch.decodes)
        graphs.load(batch)
        logits = graphs.replay().clone()
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sp.conv_state[:, :-1], eager_pools[0][:, :-1], rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(sp.ssm_state[:, :-1], eager_pools[1][:, :-1], rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(kv.kv_cache[:, :, :-1], eager_pools[2][:, :, :-1], rtol=1e-4,
                               atol=1e-4)


@gpu
def test_dense_variant_matches_eager_on_gpu(tiny_ckpt, falcon_ckpt):
    """A fresh lone prompt of 300 tokens in bf16 replays its 512-token bucket's dense variant
    (torch SDPA over the padded prefill part inside the graph): the logits and the KV pages as
    the eager forward (dense SDPA over the 300 tokens) leaves them."""
    for ckpt in (tiny_ckpt, falcon_ckpt):
        eng = LLM(ckpt, device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=2,
                  page_size=16, enforce_eager=True, memory_budget_bytes=256 << 20).engine
        sp, kv, model = eng.state_pool, eng.kv_pool, eng.model
        graphs = PrefillGraphRunner(model, sp, kv, max_tokens=256, max_decodes=1,
                                    max_model_len=512, snapshots=False, device=eng.device,
                                    max_solo_tokens=512)
        assert (512, 0, DENSE) in graphs.buckets  # bf16 attention on a GPU: dense-capable
        graphs.capture()
        batch = Batch([row(_ids(300, 7), 0, 0, False, _pages(0, 19))], [])
        assert graphs.bucket_of(batch) == (512, 0, DENSE)
        pools = (sp.conv_state, sp.ssm_state, kv.kv_cache)
        cfg = model.cfg
        with torch.inference_mode():
            meta = build_metadata(batch, chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel,
                                  page_size=16, scratch_page=kv.scratch_page, device="cuda")
            eager = model(meta, *pools).float().clone()
            eager_kv = kv.kv_cache[:, :, :19].clone()
            kv.kv_cache.zero_()
            graphs.load(batch)
            logits = graphs.replay().float().clone()
        scale = eager.abs().max().item()
        torch.testing.assert_close(logits, eager, rtol=0, atol=2e-2 * scale)
        torch.testing.assert_close(kv.kv_cache[:, :, :19], eager_kv, rtol=0, atol=0)
