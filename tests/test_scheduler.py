"""The scheduler: the max_loras rule, the order of skipped requests, chunked
prefill within the token budget, preemption when KV blocks run out, and the
priority policy (order and preemption as vLLM's)."""

from __future__ import annotations

import pytest

from loraserve.config import SchedulerConfig
from loraserve.engine.kv_blocks import KVBlockManager
from loraserve.engine.request import Request, RequestStatus
from loraserve.engine.scheduler import Scheduler
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams


def _req(rid: str, lora: str | None, prompt_len: int = 4, priority: int = 0,
         arrival: float = 0.0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        sampling_params=SamplingParams(max_tokens=100),
        eos_token_id=None,
        lora_request=LoRARequest(lora, abs(hash(lora)) % 1000 + 1, "/x") if lora else None,
        arrival_time=arrival,
        priority=priority,
    )


def _sched(max_loras=2, max_num_seqs=16, budget=1000, blocks=1000, block_size=4,
           policy="fcfs") -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=1000, policy=policy)
    return Scheduler(config, KVBlockManager(blocks, block_size), max_loras)


def _finish_step(sched: Scheduler, out) -> None:
    """What the engine does after a step: count computed tokens, append a token."""
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(1)


def test_never_more_adapters_than_max_loras_and_skipped_keep_order():
    sched = _sched(max_loras=2)
    reqs = [_req(f"r{i}", lora) for i, lora in enumerate(
        ["a", "b", "c", None, "a", "d", "b", "c", None, "e"])]
    for r in reqs:
        sched.add_request(r)
    ready = {"a", "b", "c", "d", "e"}
    out = sched.schedule(ready)
    scheduled = [r.request_id for r, _ in out.scheduled]
    # a, b fill the two adapter places; c, d, e wait; base requests and a/b go.
    assert scheduled == ["r0", "r1", "r3", "r4", "r6", "r8"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r5", "r7", "r9"]
    assert sched.running_loras() == {"a", "b"}
    _finish_step(sched, out)
    # While a and b run, the skipped ones stay at the front in their order.
    out = sched.schedule(ready)
    assert {r.lora_name for r, _ in out.scheduled} - {None} == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["r2", "r5", "r7", "r9"]
    # Finish everything that uses "a": one place frees, and c (first in line) takes it.
    for r in list(sched.running):
        if r.lora_name == "a":
            sched.finish(r)
    out = sched.schedule(ready)
    assert sched.running_loras() == {"b", "c"}
    assert [r.request_id for r in sched.waiting] == ["r5", "r9"]


def test_every_step_respects_max_loras():
    sched = _sched(max_loras=3, max_num_seqs=5)
    names = ["a", "b", "c", "d", "e", "f", None]
    for i in range(40):
        sched.add_request(_req(f"r{i}", names[(i * 5) % len(names)]))
    ready = set(names) - {None}
    for _ in range(200):
        out = sched.schedule(ready)
        assert len({r.lora_name for r, _ in out.scheduled} - {None}) <= 3
        assert len(sched.running_loras()) <= 3
        _finish_step(sched, out)
        for r in list(sched.running):
            if len(r.output_token_ids) >= 3:
                sched.finish(r)
        if not sched.has_requests():
            break
    assert not sched.has_requests(), "every request should finish"


def test_adapter_not_ready_is_skipped_and_reported_for_loading():
    sched = _sched(max_loras=2)
    sched.add_request(_req("slow", "cold"))
    sched.add_request(_req("base", None))
    out = sched.schedule(ready_loras=set())
    assert [r.request_id for r, _ in out.scheduled] == ["base"]
    assert [lr.lora_name for lr in out.loras_to_load] == ["cold"]
    assert [r.request_id for r in sched.waiting] == ["slow"]


def test_chunked_prefill_respects_token_budget():
    sched = _sched(budget=6)
    a, b = _req("a", None, prompt_len=10), _req("b", None, prompt_len=3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6)]
    _finish_step(sched, out)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 4), ("b", 2)]


def test_preemption_frees_blocks_and_requeues_at_front():
    # 4 blocks of 4 tokens: two 8-token prompts fill the cache exactly.
    sched = _sched(blocks=4, block_size=4)
    a, b = _req("a", None, prompt_len=8), _req("b", None, prompt_len=8)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    _finish_step(sched, out)
    out = sched.schedule()  # both need a 3rd block to decode: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.block_ids == [] and list(sched.waiting) == [b]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]


def _ids(reqs) -> list[str]:
    return [r.request_id if isinstance(r, Request) else r[0].request_id for r in reqs]


def test_priority_policy_starts_lower_values_first_ties_by_arrival():
    sched = _sched(max_num_seqs=2, policy="priority")
    for rid, priority, arrival in [("a", 3, 1.0), ("b", 1, 2.0), ("c", 2, 3.0), ("d", 1, 0.5),
                                   ("e", -5, 9.0), ("f", 1, 2.0)]:
        sched.add_request(_req(rid, None, priority=priority, arrival=arrival))
    # Saturated (two at a time): the queue is served by (priority, arrival), and
    # equal keys in the order they came.
    order = []
    while sched.has_requests():
        out = sched.schedule()
        order += [r.request_id for r, _ in out.scheduled if r.num_computed_tokens == 0]
        _finish_step(sched, out)
        for r in list(sched.running):
            sched.finish(r)
    assert order == ["e", "d", "b", "f", "c", "a"]
    # First come, first served ignores priorities.
    sched = _sched(max_num_seqs=1)
    for rid, priority in [("a", 3), ("b", 1)]:
        sched.add_request(_req(rid, None, priority=priority))
    assert _ids(sched.schedule().scheduled) == ["a"]


def test_priority_policy_refuses_nothing_and_fcfs_refuses_priorities():
    _sched(policy="priority").check_priority(7)
    _sched().check_priority(0)
    with pytest.raises(ValueError, match="priority"):
        _sched().check_priority(1)


def test_priority_preemption_takes_the_highest_value_and_gives_back_its_budget():
    # 6 blocks of 4 tokens; three 8-token prompts take 2 blocks each, and each
    # needs a 3rd block to decode: one must go. FCFS preempts the last started
    # (c); priority the highest value (a, started first and scheduled this step
    # already, which returns its token to the budget).
    for policy, victim, kept in (("fcfs", "c", ["a", "b"]), ("priority", "a", ["b", "c"])):
        sched = _sched(blocks=6, block_size=4, policy=policy)
        reqs = [_req("a", None, 8, priority=5, arrival=1.0),
                _req("b", None, 8, priority=0, arrival=2.0),
                _req("c", None, 8, priority=1, arrival=3.0)]
        for r in reqs:
            sched.add_request(r)
        # Admit all three (by priority: b, c, a), then let them decode.
        out = sched.schedule()
        assert len(out.scheduled) == 3
        _finish_step(sched, out)
        out = sched.schedule()
        assert _ids(out.preempted) == [victim], policy
        assert sorted(_ids(out.scheduled)) == kept, policy
        assert out.num_tokens == 2
        preempted = next(r for r in reqs if r.request_id == victim)
        assert preempted.status == RequestStatus.PREEMPTED and not preempted.block_ids
        assert list(sched.waiting) == [preempted]


def test_priority_preemption_order_under_pressure():
    """Requests of several priorities decode until blocks run short: they are
    preempted highest value first (latest arrival first among equals), and the
    lowest value is never preempted while another runs; FCFS preempts the last
    started first."""
    for policy, first_two in (("priority", ["p2-3", "p2-0"]), ("fcfs", ["p2-3", "p1-2"])):
        sched = _sched(blocks=8, block_size=4, policy=policy)
        for i, prio in enumerate([2, 0, 1, 2]):
            sched.add_request(_req(f"p{prio}-{i}", None, 4, priority=prio, arrival=float(i)))
        preempted = []
        for _ in range(12):
            out = sched.schedule()
            preempted += _ids(out.preempted)
            _finish_step(sched, out)
        assert preempted[:2] == first_two, (policy, preempted)
        if policy == "priority":
            assert "p0-1" not in preempted


def test_priority_policy_keeps_the_max_loras_rule_and_skipped_places():
    sched = _sched(max_loras=1, policy="priority")
    reqs = [_req("x1", "x", priority=0, arrival=1.0), _req("y1", "y", priority=0, arrival=2.0),
            _req("base", None, priority=1, arrival=3.0), _req("y2", "y", priority=2, arrival=0.0)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule({"x", "y"})
    # One adapter at a time: y's requests wait, in their priority places.
    assert _ids(out.scheduled) == ["x1", "base"]
    assert _ids(sched.waiting) == ["y1", "y2"]
    for r in list(sched.running):
        if r.lora_name == "x":
            sched.finish(r)
    out = sched.schedule({"x", "y"})
    assert _ids(out.scheduled) == ["base", "y1", "y2"]
