"""More adapters than device slots: which new adapters the slot-aware policy lets
in (starving ones, then slot-resident ones), the bound on how long a request is
passed over where vLLM's fcfs rule has none, and the tokens of a run full of
evictions and swaps against transformers+PEFT."""

from __future__ import annotations

import pytest
from test_scheduler import _finish_step, _req
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import SchedulerConfig
from loraserve.engine.kv_blocks import KVBlockManager
from loraserve.engine.scheduler import Scheduler


def _sched(policy: str, max_loras: int = 2, wait_steps: int = 4) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=1000)
    return Scheduler(config, KVBlockManager(4000, 4), max_loras, policy, wait_steps)


def _run_stream(policy: str, steps: int = 200) -> tuple[int | None, int]:
    """Adapters a and b get a new request every step (each wants 3 tokens), and
    one request for c waits from step 1, once a and b hold both slots: the step c
    starts at (None: never) and the most requests running at once."""
    sched = _sched(policy)
    ready = {"a", "b", "c"}
    started, widest = None, 0
    for step in range(steps):
        for name in ("a", "b"):
            req = _req(f"{name}{step}", name, prompt_len=4)
            req.sampling_params.max_tokens = 3
            sched.add_request(req)
        if step == 1:
            sched.add_request(_req("c", "c", prompt_len=4))
        out = sched.schedule(ready)
        if started is None and any(r.request_id == "c" for r, _ in out.scheduled):
            started = step
        widest = max(widest, len(sched.running))
        _finish_step(sched, out)
        for req in list(sched.running):
            if req.request_id != "c" and len(req.output_token_ids) >= 3:
                sched.finish(req)
    return started, widest


def test_fcfs_passes_a_request_over_for_as_long_as_other_adapters_have_work():
    started, _ = _run_stream("fcfs")
    assert started is None


def test_slot_aware_bounds_the_wait_and_keeps_the_batch_full():
    started, widest = _run_stream("slot-aware")
    # 4 steps passed over, then the drained adapter's requests (3 tokens, and one
    # step of prefill) end.
    assert started is not None and started <= 1 + 4 + 4 + 1
    # Meanwhile the adapter that kept its slot took every new request.
    assert widest >= 4


def test_a_drained_adapter_gets_its_slot_back_in_turn():
    """Neither a nor b waits for ever either: the adapters take turns."""
    sched = _sched("slot-aware", max_loras=1, wait_steps=2)
    ready = {"a", "b"}
    first_start = {}
    for step in range(60):
        for name in ("a", "b"):
            req = _req(f"{name}{step}", name)
            req.sampling_params.max_tokens = 2
            sched.add_request(req)
        out = sched.schedule(ready)
        for req, _ in out.scheduled:
            first_start.setdefault(req.request_id, step)
        _finish_step(sched, out)
        for req in list(sched.running):
            if len(req.output_token_ids) >= 2:
                sched.finish(req)
    waits = [first_start[r] - int(r[1:]) for r in first_start]
    assert {r[0] for r in first_start} == {"a", "b"}
    # Every request that started did so within a bounded wait, in both adapters.
    assert max(waits) <= 12


@pytest.mark.parametrize("policy,first", [("fcfs", "x"), ("slot-aware", "y")])
def test_an_adapter_still_in_a_slot_goes_before_one_that_needs_a_copy(policy, first):
    sched = _sched(policy, max_loras=2)
    for rid, name in (("a0", "a"), ("x0", "x"), ("y0", "y")):
        sched.add_request(_req(rid, name))
    out = sched.schedule({"a", "x", "y"}, slot_resident={"y"})
    assert [r.lora_name for r, _ in out.scheduled] == ["a", first]


def _mixed_run(llm, llama_dir, llama_adapters, prompts) -> None:
    """Each prompt with every adapter and the base, interleaved; every request's
    tokens are transformers+PEFT's."""
    names = list(llama_adapters)
    batch = [(p, n) for p in prompts[:3] for n in (*names, None, names[0], names[1])]
    loras = [LoRARequest(n, names.index(n) + 1, llama_adapters[n]) if n else None
             for _, n in batch]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params, loras,
                        use_tqdm=False)
    for (prompt, name), out in zip(batch, outs, strict=True):
        want = hf_greedy(llama_dir, llama_adapters[name] if name else None, prompt, 6)
        assert out.outputs[0].token_ids == want, name


def test_drained_adapters_and_slot_swaps_match_peft(llama_dir, llama_adapters, prompts):
    """Four adapters and the base on two slots, with a short wait bound: adapters
    are drained and swapped in and out of the slots mid-run."""
    llm = LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=4, max_lora_rank=16,
              lora_scheduling="slot-aware", max_lora_wait_steps=2, max_num_seqs=6)
    drained = []
    admission = llm.engine.scheduler.admission
    drain = admission._drain_for

    def counting(*args, **kwargs):
        before = set(admission.draining)
        drain(*args, **kwargs)
        drained.extend(admission.draining - before)

    admission._drain_for = counting
    _mixed_run(llm, llama_dir, llama_adapters, prompts)
    assert drained, "no adapter was drained: the run did not exercise the bound"


def test_cpu_cache_evictions_under_slot_aware_scheduling_match_peft(
        llama_dir, llama_adapters, prompts):
    """Two CPU cache places for four adapters: evicted adapters are read again in
    the background while the others run."""
    llm = LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
              lora_scheduling="slot-aware", max_lora_wait_steps=2, max_num_seqs=6)
    _mixed_run(llm, llama_dir, llama_adapters, prompts)
    # Some adapter left the CPU cache and was read again.
    assert sum(llm.engine.get_stats().lora_load_time_counts) > len(llama_adapters)
