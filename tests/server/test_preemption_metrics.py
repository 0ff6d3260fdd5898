"""A server on a tiny memory budget with overlap scheduling: concurrent requests are preempted
and recomputed, every response equals the offline engine's, the pools end idle, and /metrics
counts the preemptions and the device-busy time."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from mambaserve import LLM, SamplingParams
from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool


def metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def test_preemptions_under_a_tiny_budget_are_exported_and_change_nothing(tiny_ckpt):
    httpx = pytest.importorskip("httpx")
    probe = LLM(tiny_ckpt, max_num_seqs=1).engine
    slot_b = StatePool.bytes_per_slot(probe.model_config, probe.dtype, probe.ssm_dtype)
    page_b = KVPool.bytes_per_page(probe.model_config, 16, probe.dtype)
    pytest.importorskip("fastapi")
    from mambaserve.server import ServerThread, build_app

    app, engine = build_app(tiny_ckpt, device="cpu", max_num_seqs=6, max_model_len=256,
                            chunked_prefill_size=32, async_scheduling=True,
                            memory_budget_bytes=6 * slot_b + 40 * page_b)
    thread = ServerThread(app).start()
    try:
        assert engine.call_sync(lambda e: (e.async_scheduling, e.kv_pool.num_pages)) == \
            (True, 40)
        prompts = [f"request {i}: " + "abcdefghij" * (2 + i % 4) for i in range(10)]

        def ask(p):
            body = {"prompt": p, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
            r = httpx.post(thread.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(10) as pool:
            texts = list(pool.map(ask, prompts))
        ref = LLM(tiny_ckpt, max_num_seqs=10).generate(
            prompts, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        assert texts == [o.outputs[0].text for o in ref]
        stats = engine.call_sync(lambda e: (e.check_integrity(), dict(e.stats))[1])
        assert engine.call_sync(lambda e: (e.state_pool.num_free, e.kv_pool.num_free)) == (6, 40)
        assert stats["preemptions"] > 0
        text = httpx.get(thread.url + "/metrics").text
        assert 0 < metric(text, "mambaserve_engine_preemptions_total") <= stats["preemptions"]
        assert 0 < metric(text, "mambaserve_engine_device_busy_seconds_total") <= \
            stats["device_busy_seconds"]
    finally:
        thread.stop()
