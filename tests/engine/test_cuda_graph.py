"""Decode CUDA graphs: host logic (buckets, packing, padding, slicing, routing) on the CPU; the
static-buffer path against eager decoding on the CPU (uncaptured); graph replay on a GPU."""

import pytest
import torch
from fake_cuda import install_fake_cuda

from mambaserve import LLM, SamplingParams
from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.cuda_graph import (
    ROW_FIELDS,
    StaticLayout,
    bucket_sizes,
    choose_bucket,
    graph_metadata,
    pack_decode_batch,
)

PS, SCRATCH = 4, 99


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    b = bucket_sizes(256, step=16)
    assert b[:6] == [1, 2, 4, 8, 16, 32] and b[-1] == 256 and all(x % 16 == 0 for x in b[4:])
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_choose_bucket():
    b = bucket_sizes(32)
    assert [choose_bucket(b, n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 24, 32]
    with pytest.raises(ValueError):
        choose_bucket(b, 33)


def decode_row(tok, ctx, slot, pages, snap=None):
    return Row.standalone([tok], ctx, slot, True, pages,
                          [(ctx + 1, snap)] if snap is not None else [])


def fields(buf, layout, bs):
    out = {n: buf[layout.offset(n): layout.offset(n) + layout.max_bs] for n in ROW_FIELDS}
    out["page_table"] = buf[layout.offset("page_table"):].reshape(bs, layout.max_pages)
    return out


def test_pack_pads_rows_to_the_bucket():
    layout = StaticLayout(max_bs=8, max_pages=3)
    plan = Batch([], [decode_row(7, 5, 2, [10, 11]), decode_row(9, 0, 4, [12], snap=6)])
    buf = pack_decode_batch(plan, 4, layout, page_size=PS, scratch_page=SCRATCH)
    assert buf.shape == (layout.prefix_len(4),) == (7 * 8 + 4 * 3,)
    f = fields(buf, layout, 4)
    assert f["input_ids"][:4].tolist() == [7, 9, 0, 0]
    assert f["positions"][:4].tolist() == [5, 0, 0, 0]
    assert f["state_slots"].tolist() == [2, 4] + [-1] * 6  # padding rows skip (-1)
    assert f["decode_snap_dst"].tolist() == [-1, 6] + [-1] * 6
    assert f["slot_mapping"][:4].tolist() == [11 * PS + 1, 12 * PS, SCRATCH * PS, SCRATCH * PS]
    assert f["page_table"].tolist() == [[10, 11, SCRATCH], [12, SCRATCH, SCRATCH],
                                        [SCRATCH] * 3, [SCRATCH] * 3]
    assert f["logits_idx"][:4].tolist() == [0, 1, 2, 3]
    assert f["token_row"][:4].tolist() == [0, 1, 2, 3]


def test_pack_refuses_mixed_batches():
    layout = StaticLayout(max_bs=4, max_pages=2)
    prefill = Row.standalone([1, 2, 3], 0, 0, False, [0])
    plan = Batch([prefill], [decode_row(7, 5, 2, [1, 2])])
    with pytest.raises(AssertionError, match="prefill row"):
        pack_decode_batch(plan, 2, layout, page_size=PS, scratch_page=SCRATCH)


def test_pack_refuses_rows_beyond_the_graph():
    layout = StaticLayout(max_bs=4, max_pages=1)
    plan = Batch([], [decode_row(7, 5, 2, [1, 2])])
    with pytest.raises(ValueError, match="pages"):
        pack_decode_batch(plan, 1, layout, page_size=PS, scratch_page=SCRATCH)


def test_metadata_views_are_sliced_to_the_bucket():
    layout = StaticLayout(max_bs=8, max_pages=3)
    buf = torch.zeros(layout.total, dtype=torch.int64)
    meta = graph_metadata(buf, layout, 2, max_kv_len=12, snapshots=True)
    for name in ("input_ids", "positions", "token_row", "state_slots", "slot_mapping",
                 "decode_snap_dst", "logits_idx"):
        t = getattr(meta, name)
        assert t.shape == (2,), name
        assert t.data_ptr() == buf.data_ptr() + 8 * layout.offset(name), name
    assert meta.page_table.shape == (2, 3)
    assert meta.page_table.data_ptr() == buf.data_ptr() + 8 * layout.offset("page_table")
    assert (meta.num_prefills, meta.num_decodes, meta.num_tokens) == (0, 2, 2)
    assert meta.prefill is None and meta.logits_idx.shape == (2,)
    assert meta.max_kv_len == 12 and meta.num_decode_snapshots == 2
    assert meta.decode_state_slots.shape == (2,)
    # the packed prefix lands where the views look
    plan = Batch([], [decode_row(7, 5, 2, [1, 2])])
    host = pack_decode_batch(plan, 2, layout, page_size=PS, scratch_page=SCRATCH)
    buf[: host.size] = torch.from_numpy(host)
    assert meta.input_ids.tolist() == [7, 0] and meta.state_slots.tolist() == [2, -1]
    assert meta.page_table.tolist() == [[1, 2, SCRATCH], [SCRATCH] * 3]
    no_snap = graph_metadata(buf, layout, 2, max_kv_len=12, snapshots=False)
    assert no_snap.num_decode_snapshots == 0


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 33)]


@pytest.mark.parametrize("prefix", [False, True])
def test_static_buffer_path_matches_eager_on_cpu(tiny_ckpt, prefix):
    """Same tokens through the graph runner's static, padded, sliced buffers (uncaptured on a
    CPU) as through eager metadata; the graph path really serves the decode steps."""
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    kw = {"max_model_len": 96, "max_num_seqs": 4, "chunked_prefill_size": 24, "device": "cpu",
              "enable_prefix_caching": prefix}
    eager = LLM(tiny_ckpt, **kw)  # the default on a CPU: eager
    graph = LLM(tiny_ckpt, enforce_eager=False, cuda_graph_max_bs=4, **kw)
    gr = graph.engine.runner.graph_runner
    assert eager.engine.runner.graph_runner is None and gr is not None
    assert gr.buckets == [1, 2, 4] and gr.max_kv_len == 96
    sizes = []
    load = gr.load_packed  # (the runner packs on the host, then loads: tensor parallelism)
    gr.load_packed = lambda packed, n, staged: (sizes.append(n), load(packed, n, staged))[1]
    prompts = _prompts()
    assert _generate(graph, prompts, params) == _generate(eager, prompts, params)
    assert sizes and 3 in sizes  # bucket 4 with one padding row was used
    if prefix:  # second turn over a cached prefix: snapshots and restores stay consistent
        again = [p + [5] * 20 for p in prompts]
        assert _generate(graph, again, params) == _generate(eager, again, params)
        graph.engine.check_integrity()


def test_mixed_batches_run_eagerly(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu", enforce_eager=False, cuda_graph_max_bs=4, max_model_len=96,
              max_num_seqs=4, chunked_prefill_size=24)
    gr = llm.engine.runner.graph_runner
    seen = []
    pack = gr.pack  # the host side of a graph step's load
    gr.pack = lambda batch: (seen.append(batch), pack(batch))[1]
    prompts = _prompts()
    _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert seen and all(not p.prefills for p in seen)
    assert llm.engine.stats["mixed_steps"] > 0  # mixed steps happened, none reached the graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefix", [False, True])
def test_cuda_graph_matches_eager_on_gpu(tiny_ckpt, prefix):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = {"device": "cuda", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8,
              "chunked_prefill_size": 32, "enable_prefix_caching": prefix,
              "memory_budget_bytes": 64 << 20}
    eager = LLM(tiny_ckpt, enforce_eager=True, **kw)
    graph = LLM(tiny_ckpt, cuda_graph_max_bs=8, **kw)  # the default on CUDA: graphs
    gr = graph.engine.runner.graph_runner
    assert eager.engine.runner.graph_runner is None and sorted(gr.graphs) == [1, 2, 4, 8]
    prompts = _prompts() + [p[:7] for p in _prompts()]
    assert _generate(graph, prompts, params) == _generate(eager, prompts, params)
    if prefix:
        again = [p + [5] * 20 for p in prompts]
        assert _generate(graph, again, params) == _generate(eager, again, params)
        graph.engine.check_integrity()


def _overlap_workload():
    prompts = _prompts() + [p[:7] for p in _prompts()]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=14, logprobs=1),
              SamplingParams(temperature=0.9, seed=8, max_tokens=10, n=2),
              SamplingParams(temperature=1.0, seed=5, max_tokens=20, stop=["a", "e"]),
              SamplingParams(temperature=1.0, seed=6, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    return [{"prompt_token_ids": p} for p in prompts], params


def _all_tokens(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def _count_device_fed_graph_rows(llm):
    gr, seen = llm.engine.runner.graph_runner, []
    pack = gr.pack  # the host side of a graph step's load
    gr.pack = lambda batch: (seen.append(sum(r.input_on_device for r in batch.rows)),
                             pack(batch))[1]
    return seen


@pytest.mark.parametrize("prefix", [False, True])
def test_static_buffer_path_under_overlap_matches_sync_on_cpu(tiny_ckpt, prefix):
    """Overlap scheduling through the graph runner's static buffers (uncaptured on a CPU): the
    decode rows' input tokens come from the device token buffer, scattered into the static
    input_ids, and the tokens equal the synchronous eager run."""
    kw = {"device": "cpu", "max_model_len": 96, "max_num_seqs": 4, "chunked_prefill_size": 24,
          "enable_prefix_caching": prefix}
    lag = LLM(tiny_ckpt, enforce_eager=False, cuda_graph_max_bs=4, async_scheduling=True, **kw)
    seen = _count_device_fed_graph_rows(lag)
    prompts, params = _overlap_workload()
    ref = _all_tokens(LLM(tiny_ckpt, enforce_eager=True, async_scheduling=False, **kw),
                      prompts, params)
    assert _all_tokens(lag, prompts, params) == ref
    assert sum(seen) > 10
    lag.engine.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefix", [False, True])
def test_overlap_with_cuda_graphs_matches_sync_on_gpu(tiny_ckpt, prefix):
    """On the GPU: graphs + overlap scheduling (the default) give the tokens of graphs without
    overlap, and of eager without overlap; graph replays took tokens from the device buffer."""
    kw = {"device": "cuda", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8,
          "chunked_prefill_size": 32, "enable_prefix_caching": prefix,
          "memory_budget_bytes": 64 << 20, "cuda_graph_max_bs": 8}
    lag = LLM(tiny_ckpt, **kw)
    assert lag.engine.async_scheduling and lag.engine.runner.graph_runner.graphs
    seen = _count_device_fed_graph_rows(lag)
    prompts, params = _overlap_workload()
    sync = _all_tokens(LLM(tiny_ckpt, async_scheduling=False, **kw), prompts, params)
    assert _all_tokens(lag, prompts, params) == sync
    assert sum(seen) > 10
    eager = LLM(tiny_ckpt, async_scheduling=False, enforce_eager=True, **kw)
    assert _all_tokens(eager, prompts, params) == sync
    lag.engine.check_integrity()


def test_capture_batches_touch_only_scratch_memory(tiny_ckpt):
    """Capture runs all-padding batches: live state slots and KV pages must not change."""
    llm = LLM(tiny_ckpt, device="cpu", enforce_eager=False, cuda_graph_max_bs=4, max_model_len=96,
              max_num_seqs=4, chunked_prefill_size=24, enable_prefix_caching=True)
    eng, gr = llm.engine, llm.engine.runner.graph_runner
    for i, p in enumerate(_prompts()):
        eng.add_request(f"r{i}", {"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        eng.step()
    sp, kv = eng.state_pool, eng.kv_pool
    before = (sp.conv_state[:, :-1].clone(), sp.ssm_state[:, :-1].clone(),
              kv.kv_cache[:, :, :-1].clone())
    for bs in gr.buckets:  # what capture() runs before and inside each capture
        gr._load(Batch([], [Row.standalone([0], 0, -1, True, [])]), bs)
        gr._forward(bs)
    assert torch.equal(before[0], sp.conv_state[:, :-1])
    assert torch.equal(before[1], sp.ssm_state[:, :-1])
    assert torch.equal(before[2], kv.kv_cache[:, :, :-1])


def test_capture_and_replay_plumbing_with_a_fake_cuda(tiny_ckpt, monkeypatch):
    kw = {"max_model_len": 96, "max_num_seqs": 4, "chunked_prefill_size": 24, "device": "cpu"}
    eager = LLM(tiny_ckpt, **kw)
    llm = LLM(tiny_ckpt, enforce_eager=False, cuda_graph_max_bs=4, **kw)
    gr = llm.engine.runner.graph_runner
    order = install_fake_cuda(monkeypatch, gr)
    gr.capture_enabled = True
    gr.capture()
    assert order == [4, 2, 1] and sorted(gr.graphs) == [1, 2, 4]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    prompts = _prompts()
    assert _generate(llm, prompts, params) == _generate(eager, prompts, params)
    assert gr.graphs[4].replays > 0  # 3 decode rows replayed the bucket of 4
