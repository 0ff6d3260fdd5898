"""vLLM's priority scheduling (`EngineConfig.scheduling_policy="priority"`): the waiting queue
in (priority, arrival) order, the running request with the largest (priority, arrival)
preempted when KV pages run out (with outputs unchanged), a preempted request requeued at its
key's place; under "fcfs" a priority other than 0 is refused and nothing is queued."""

import pytest
from test_preemption import REF, tiny_pools, toks

from mambaserve import LLM, SamplingParams
from mambaserve.config import EngineConfig
from mambaserve.engine.request import Request
from mambaserve.engine.request_queue import FCFSQueue, PriorityQueue

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def req(rid: str, priority: int, arrival: int) -> Request:
    return Request(rid, None, [1], SamplingParams(), 0, 2, arrival=arrival, priority=priority)


def test_priority_queue_orders_by_priority_then_arrival_and_requeues_by_key():
    q = PriorityQueue()
    for r in [req("a", 5, 0), req("b", 0, 1), req("c", 5, 2), req("d", -2, 3), req("e", 0, 4)]:
        q.add(r)
    assert ids(q) == ["d", "b", "e", "a", "c"] and q[0].request_id == "d" and len(q) == 5
    assert q.popleft().request_id == "d"
    q.remove(q[1])  # e
    assert ids(q) == ["b", "a", "c"]
    # a preempted request goes back to its key's place, not to the front
    q.requeue(req("p", 3, 0))
    assert ids(q) == ["b", "p", "a", "c"]
    fifo = FCFSQueue()
    fifo.add(req("a", 0, 0))
    fifo.requeue(req("p", 0, 5))  # under fcfs: to the front
    assert ids(fifo) == ["p", "a"]


def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_num_seqs=1, scheduling_policy="priority", **REF)
    eng = llm.engine
    eng.add_request("first", {"prompt_token_ids": toks(8, 0)}, LONG, priority=9)
    eng.step()  # admitted alone: a later request of higher priority does not preempt it
    for rid, prio in [("b", 5), ("c", -1), ("d", 5), ("e", 0), ("f", -1)]:
        eng.add_request(rid, {"prompt_token_ids": toks(8, ord(rid))},
                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        priority=prio)
    assert ids(eng.scheduler.waiting) == ["c", "f", "e", "b", "d"]
    assert ids(eng.scheduler.running) == ["first"] and eng.scheduler.num_preemptions == 0
    eng.abort_request("first")
    eng.abort_request("e")  # finish() takes a waiting request out of the ordered queue
    assert ids(eng.scheduler.waiting) == ["c", "f", "b", "d"]
    admitted = []
    while eng.has_unfinished_requests():
        eng.step()
        admitted += [r.request_id for r in eng.scheduler.running if r.request_id not in admitted]
    assert admitted == ["c", "f", "b", "d"]


def test_fcfs_admits_in_arrival_order(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_num_seqs=1, **REF)
    eng = llm.engine
    for rid in "bcde":
        eng.add_request(rid, {"prompt_token_ids": toks(8, ord(rid))}, LONG)
    eng.step()
    assert ids(eng.scheduler.running) == ["b"] and ids(eng.scheduler.waiting) == ["c", "d", "e"]


WORKLOAD = [("lo", 5, 24, 11), ("mid", 1, 30, 12), ("hi", 0, 30, 13)]  # id, priority, len, seed


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def unconstrained(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_num_seqs=3, **REF)
    return {rid: out.outputs[0].token_ids for (rid, *_), out in zip(WORKLOAD, llm.generate(
        [{"prompt_token_ids": toks(n, s)} for _, _, n, s in WORKLOAD],
        [params(s) for *_, s in WORKLOAD]))}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_memory_pressure_preempts_the_lowest_priority(tiny_ckpt, unconstrained, policy, overlap):
    """"lo" is admitted first and "mid" / "hi" a step later: under fcfs the newest running
    request is preempted, under priority "lo" (the largest (priority, arrival)) although it is
    the oldest, walked first: its row of that step was already planned when "hi" ran out of
    pages (the row is dropped). Every output equals an unconstrained run's."""
    llm = tiny_pools(tiny_ckpt, slots=3, pages=12, max_num_seqs=3, scheduling_policy=policy,
                     async_scheduling=overlap)
    eng = llm.engine
    prio = {rid: (p if policy == "priority" else 0) for rid, p, _, _ in WORKLOAD}
    for k, (rid, _, n, seed) in enumerate(WORKLOAD):
        eng.add_request(rid, {"prompt_token_ids": toks(n, seed)}, params(seed),
                        priority=prio[rid])
        if k == 0:
            eng.step()
    done = {}
    while not eng.scheduler.num_preemptions:
        for out in eng.step():
            done[out.request_id] = out
        eng.check_integrity()
    victim = "lo" if policy == "priority" else "hi"  # fcfs: "hi" was admitted after "mid"
    assert ids(eng.scheduler.waiting) == [victim]
    assert eng.scheduler.waiting[0].num_preemptions == 1
    assert sorted(ids(eng.scheduler.running)) == sorted({"lo", "mid", "hi"} - {victim})
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
        eng.check_integrity()
    assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == unconstrained
    assert (eng.state_pool.num_free, eng.kv_pool.num_free) == (3, 12)


def test_preempted_request_waits_behind_higher_priorities_only(tiny_ckpt):
    """Under priority a preempted request returns to its key's place: behind a request of
    higher priority that arrived after it, ahead of one of lower priority."""
    llm = tiny_pools(tiny_ckpt, slots=2, pages=8, max_num_seqs=2, scheduling_policy="priority")
    eng = llm.engine
    p = SamplingParams(temperature=1.0, seed=4, max_tokens=60, ignore_eos=True)
    eng.add_request("old", {"prompt_token_ids": toks(30, 5)}, p, priority=0)
    eng.add_request("low", {"prompt_token_ids": toks(30, 6)}, p, priority=2)
    eng.add_request("urgent", {"prompt_token_ids": toks(5, 7)}, p, priority=1)
    eng.add_request("lowest", {"prompt_token_ids": toks(5, 8)}, p, priority=3)
    while not eng.scheduler.num_preemptions:
        eng.step()
        eng.check_integrity()
    assert ids(eng.scheduler.running) == ["old"]
    assert ids(eng.scheduler.waiting) == ["urgent", "low", "lowest"]


def test_priority_reaches_every_completion_and_the_python_api(tiny_ckpt):
    llm = LLM(tiny_ckpt, scheduling_policy="priority", **REF)
    eng = llm.engine
    eng.add_request("x", {"prompt_token_ids": toks(8, 1)}, SamplingParams(n=3, max_tokens=2),
                    priority=-7)
    assert [r.priority for r in eng.scheduler.waiting] == [-7, -7, -7]  # n > 1: inherited
    eng.abort_request("x")
    prompts = [{"prompt_token_ids": toks(8, i)} for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, greedy, priority=[3, -1, 0])
    ref = LLM(tiny_ckpt, **REF).generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    with pytest.raises(ValueError, match=r"one integer per prompt \(3 prompts\), got 2 values"):
        llm.generate(prompts, greedy, priority=[1, 2])
    with pytest.raises(ValueError, match="priority must be an integer, got '1'"):
        llm.generate(prompts, greedy, priority=[0, "1", 0])
    assert not eng.has_unfinished_requests()


def test_fcfs_refuses_a_priority_and_queues_nothing(tiny_ckpt):
    llm = LLM(tiny_ckpt, **REF)
    eng = llm.engine
    prompt = {"prompt_token_ids": toks(8, 1)}
    with pytest.raises(ValueError, match="^got priority 3 but priority scheduling is not "
                                         "enabled: start the engine with scheduling_policy="):
        eng.add_request("x", prompt, SamplingParams(max_tokens=2), priority=3)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate([prompt, prompt], SamplingParams(max_tokens=2), priority=[0, -1])
    for bad in (True, 1.0, "0", None):
        with pytest.raises(ValueError, match="priority must be an integer"):
            eng.add_request("y", prompt, SamplingParams(max_tokens=2), priority=bad)
    assert not eng.has_unfinished_requests() and eng.unfinished_request_ids() == []
    out = llm.generate([prompt], SamplingParams(max_tokens=2), priority=[0])  # 0 is fine
    assert len(out[0].outputs[0].token_ids) == 2


def test_scheduling_policy_is_validated():
    with pytest.raises(ValueError, match="^scheduling_policy must be fcfs or priority, got "
                                         "'lifo'$"):
        EngineConfig(scheduling_policy="lifo").validate()
