"""Automatic prefix caching: a request starts from the cached KV blocks of its
longest cached prefix, never across adapters, and no output token changes for it
(against the engine without it, and against transformers+PEFT)."""

from __future__ import annotations

import pytest
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import SchedulerConfig
from loraserve.engine.kv_blocks import KVBlockManager
from loraserve.engine.request import Request
from loraserve.engine.scheduler import Scheduler

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# ---- the block manager and the scheduler ---------------------------------------------


def _req(rid: str, prompt: list[int], lora: str | None = None) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=100), eos_token_id=None,
        lora_request=LoRARequest(lora, 1, f"/adapters/{lora}") if lora else None,
        arrival_time=0.0,
    )


def _sched(blocks: int = 100, block_size: int = 4, budget: int = 1000,
           caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget,
                             max_model_len=1000)
    return Scheduler(config, KVBlockManager(blocks, block_size, caching), max_loras=4)


def _step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule and do what the engine does after a launch: count the computed tokens,
    cache the full blocks, and give each sampling request its next token."""
    out = sched.schedule({"A", "B"})
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        sched.kv.cache_computed_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(7)
    return [(r.request_id, n) for r, n in out.scheduled]


def _run_alone(sched: Scheduler, req: Request) -> list[int]:
    sched.add_request(req)
    _step(sched)
    blocks = list(req.block_ids)
    sched.finish(req)
    return blocks


def test_second_request_with_the_same_prompt_reuses_its_blocks():
    sched = _sched()
    prompt = list(range(10, 30))  # 20 tokens: 5 full blocks of 4
    first = _run_alone(sched, _req("a", prompt))
    b = _req("b", prompt)
    sched.add_request(b)
    # 4 blocks come from the cache; the 5th is computed again, since the step
    # that computes the last prompt token is the one that samples.
    assert _step(sched) == [("b", 4)]
    assert b.block_ids[:4] == first[:4]
    assert sched.kv.prefix_cache_stats.queries == 40
    assert sched.kv.prefix_cache_stats.hits == 16


def test_only_the_shared_full_blocks_are_reused():
    sched = _sched()
    first = _run_alone(sched, _req("a", list(range(10, 30))))
    b = _req("b", list(range(10, 19)) + [99] * 11)  # the 3rd block differs
    sched.add_request(b)
    assert _step(sched) == [("b", 12)]
    assert b.block_ids[:2] == first[:2] and first[2] not in b.block_ids


def test_caching_off_reuses_nothing():
    sched = _sched(caching=False)
    _run_alone(sched, _req("a", list(range(20))))
    sched.add_request(_req("b", list(range(20))))
    assert _step(sched) == [("b", 20)]
    assert sched.kv.prefix_cache_stats.queries == 0


@pytest.mark.parametrize("first, second", [(None, "A"), ("A", None), ("A", "B")])
def test_blocks_are_never_shared_across_adapters(first, second):
    sched = _sched()
    prompt = list(range(20))
    blocks = _run_alone(sched, _req("a", prompt, first))
    sched.add_request(b := _req("b", prompt, second))
    assert _step(sched) == [("b", 20)]
    assert not set(blocks) & set(b.block_ids)


def test_same_adapter_name_with_another_path_is_another_adapter():
    sched = _sched()
    _run_alone(sched, _req("a", list(range(20)), "A"))
    b = _req("b", list(range(20)), "A")
    b.lora_request = LoRARequest("A", 1, "/elsewhere/A")
    sched.add_request(b)
    assert _step(sched) == [("b", 20)]


def test_running_requests_share_blocks_and_preemption_releases_them():
    sched = _sched(blocks=9, block_size=4)
    prompt = list(range(16))  # 4 full blocks
    a = _req("a", prompt)
    sched.add_request(a)
    _step(sched)
    b = _req("b", prompt)
    sched.add_request(b)
    # b takes a's first 3 blocks and computes its last 4 prompt tokens itself.
    assert _step(sched) == [("a", 1), ("b", 4)]
    shared = a.block_ids[:3]
    assert b.block_ids[:3] == shared and b.block_ids[3] != a.block_ids[3]
    free_before = sched.kv.pool.num_free
    sched._preempt(sched.running.pop())  # b, as the scheduler does under pressure
    # Only b's own block is free again; the shared ones are still a's.
    assert sched.kv.pool.num_free == free_before + 1
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert not set(shared) & set(sched.kv.pool._free)
    # Readmitted, b finds its whole prompt and first token but the last in a's blocks.
    assert _step(sched) == [("a", 1), ("b", 1)]
    assert b.block_ids[:4] == a.block_ids[:4]
    sched.finish(a)
    sched.finish(b)
    assert sched.kv.pool.num_free == 9 and sched.kv.usage() == 0.0


def test_freed_blocks_stay_cached_until_needed_least_recent_first():
    sched = _sched(blocks=6, block_size=4)
    _run_alone(sched, _req("a", list(range(12))))  # 3 blocks, 2 cacheable full ones
    _run_alone(sched, _req("b", list(range(100, 112))))
    # 6 blocks: the third request needs 4 and must evict: never a block in use,
    # and the blocks without content go first, then the least recently freed.
    c = _req("c", list(range(200, 216)))
    sched.add_request(c)
    _step(sched)
    sched.finish(c)
    d = _req("d", list(range(100, 112)))  # b's prefix, freed after a's
    sched.add_request(d)
    assert _step(sched) == [("d", 4)]
    sched.finish(d)
    e = _req("e", list(range(12)))  # a's blocks were evicted for c
    sched.add_request(e)
    assert _step(sched) == [("e", 12)]


def test_abort_of_a_request_holding_cached_blocks_releases_them():
    sched = _sched(blocks=8)
    a = _req("a", list(range(20)))
    sched.add_request(a)
    _step(sched)
    b = _req("b", list(range(20)))
    sched.add_request(b)
    _step(sched)
    sched.finish(b)  # aborted while running on a's blocks
    sched.finish(a)
    assert sched.kv.pool.num_free == 8
    assert all(count == 0 for count in sched.kv.pool._ref)


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt():
    class WithPromptLogprobs(SamplingParams, kw_only=True):
        prompt_logprobs: int | None = None

    sched = _sched()
    _run_alone(sched, _req("a", list(range(20))))
    b = _req("b", list(range(20)))
    b.sampling_params = WithPromptLogprobs(max_tokens=100, prompt_logprobs=1)
    sched.add_request(b)
    assert _step(sched) == [("b", 20)]


# ---- the engine: outputs --------------------------------------------------------------


def _generate(llm: LLM, prompts: list[list[int]], loras) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, loras,
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def shared_prefix_prompts(prompts) -> list[list[int]]:
    """Prompts that share a 21-token prefix (5 blocks of 4) and differ after it."""
    prefix = (prompts[3] + prompts[1])[:21]
    return [prefix + p for p in prompts[:3]] + [prefix + prompts[0][:2]]


@pytest.fixture(scope="module")
def mixed(llama_adapters):
    a = LoRARequest("A", 1, llama_adapters["r8"])
    b = LoRARequest("B", 2, llama_adapters["r16_qv"])
    return {"A": a, "B": b}


def _llm(llama_dir, caching: bool, **kwargs) -> LLM:
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4,
               enable_prefix_caching=caching, **kwargs)


def test_outputs_with_caching_equal_without_and_transformers(
        llama_dir, llama_adapters, shared_prefix_prompts, mixed):
    prompts = shared_prefix_prompts
    # Base, A and B on the same prefixes, in one batch and then again in a second.
    names = [None, "A", "B", None, "A", "B", "A", None]
    batch = [(prompts[i % len(prompts)], n) for i, n in enumerate(names)]
    loras = [mixed[n] if n else None for _, n in batch]
    ids = [p for p, _ in batch]

    plain = _llm(llama_dir, caching=False)
    want = _generate(plain, ids, loras)
    cached = _llm(llama_dir, caching=True)
    first = _generate(cached, ids, loras)
    stats = cached.engine.kv.prefix_cache_stats
    hits_first = stats.hits
    second = _generate(cached, ids, loras)
    assert first == want and second == want
    # The second pass finds every request's prefix: all but the last block's worth.
    assert stats.hits - hits_first >= sum((len(p) - 1) // 4 * 4 for p in ids)

    paths = {"A": llama_adapters["r8"], "B": llama_adapters["r16_qv"], None: None}
    for (prompt, name), tokens in list(zip(batch, second, strict=True))[:4]:
        assert tokens == hf_greedy(llama_dir, paths[name], prompt, MAX_TOKENS), name


def test_a_prefix_computed_with_one_adapter_is_not_found_with_another(
        llama_dir, shared_prefix_prompts, mixed):
    llm = _llm(llama_dir, caching=True)
    prompt = shared_prefix_prompts[0]
    stats = llm.engine.kv.prefix_cache_stats
    _generate(llm, [prompt], [mixed["A"]])
    for lora in (None, mixed["B"]):
        before = stats.hits
        _generate(llm, [prompt], [lora])
        assert stats.hits == before
    before = stats.hits
    _generate(llm, [prompt], [mixed["A"]])
    assert stats.hits - before == (len(prompt) - 1) // 4 * 4


def test_block_pressure_with_preemption_keeps_outputs(
        llama_dir, shared_prefix_prompts, mixed):
    ids = shared_prefix_prompts * 2
    loras = [None, mixed["A"], mixed["B"], None, mixed["A"], None, mixed["B"], mixed["A"]]
    want = _generate(_llm(llama_dir, caching=False), ids, loras)
    tight = _llm(llama_dir, caching=True, num_kv_blocks=24, max_num_batched_tokens=12)
    got = _generate(tight, ids, loras)
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.prefix_cache_stats.hits > 0
    assert tight.engine.kv.usage() == 0.0
