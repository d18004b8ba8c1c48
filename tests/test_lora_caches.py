"""LRU behaviour of the CPU cache (max_cpu_loras) and the device slots (max_loras),
with the eviction order checked, pinning, and unload freeing memory."""

from __future__ import annotations

import pytest

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.lru import LRUCache


def test_lru_cache_evicts_oldest_first_and_respects_pins():
    cache: LRUCache[int] = LRUCache(3)
    for i, key in enumerate("abc"):
        assert cache.put(key, i) == []
    cache.get("a")  # a becomes the most recent: order b, c, a
    assert cache.put("d", 3) == [("b", 1)]
    cache.pin("c")
    assert cache.put("e", 4) == [("a", 0)]  # c is pinned, so a (next oldest) goes
    assert cache.keys() == ["c", "d", "e"]
    assert cache.put("f", 5, protected={"d"}) == [("e", 4)]
    assert cache.keys() == ["c", "d", "f"]


@pytest.fixture()
def engine_llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16)


def _use(llm: LLM, lora: LoRARequest, prompt: list[int]) -> None:
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2),
                 lora)


def test_eviction_order_of_both_caches(engine_llm, llama_adapters, prompts):
    manager = engine_llm.engine.executor.driver.loras
    reqs = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(llama_adapters.items())}
    names = list(reqs)  # r8, r16_qv, r1, r8_mlp
    for n in names[:3]:
        _use(engine_llm, reqs[n], prompts[0])
    assert manager.cpu_names() == names[:3]
    assert manager.slot_names() == names[1:3]  # two slots: the oldest (r8) left
    _use(engine_llm, reqs[names[1]], prompts[0])  # touch r16_qv
    _use(engine_llm, reqs[names[3]], prompts[0])
    # CPU: r8 was least recently used; slots: r1 was.
    assert manager.cpu_names() == [names[2], names[1], names[3]]
    assert manager.slot_names() == [names[1], names[3]]


def test_pinned_adapter_is_never_evicted(engine_llm, llama_adapters, prompts):
    manager = engine_llm.engine.executor.driver.loras
    reqs = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(llama_adapters.items())]
    engine_llm.engine.add_lora(reqs[0], pinned=True)
    for r in reqs[1:]:
        _use(engine_llm, r, prompts[0])
    _use(engine_llm, reqs[1], prompts[0])
    assert reqs[0].lora_name in manager.cpu_names()
    assert reqs[0].lora_name in manager.slot_names()


def test_adapter_that_can_never_get_a_slot_fails_at_once(engine_llm, llama_adapters, prompts):
    """Pinned adapters in every slot: a request for another adapter fails with the
    reason (it used to wait for ever), and the pinned ones and the base keep serving."""
    engine = engine_llm.engine
    reqs = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(llama_adapters.items())]
    engine.add_lora(reqs[0], pinned=True)
    engine.add_lora(reqs[1], pinned=True)
    assert set(engine.executor.driver.loras.slot_names()) == {reqs[0].lora_name, reqs[1].lora_name}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outputs = engine_llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params,
                                  [reqs[2], reqs[0], None, reqs[1]])
    failed = outputs[0].outputs[0]
    assert failed.finish_reason == "error"
    assert f"LoRA adapter {reqs[2].lora_name!r} cannot run" in failed.error
    assert "held by pinned adapters" in failed.error
    assert [len(o.outputs[0].token_ids) for o in outputs[1:]] == [2, 2, 2]
    assert not engine.scheduler.has_requests()


def test_unload_frees_cpu_tensors_and_zeroes_the_slot(engine_llm, llama_adapters, prompts):
    manager = engine_llm.engine.executor.driver.loras
    lora = LoRARequest("r8", 1, llama_adapters["r8"])
    _use(engine_llm, lora, prompts[0])
    slot = manager.slots.slot_of("r8")
    wrapper = manager.wrappers["model.layers.0.self_attn.qkv_proj"]
    assert wrapper.lora_a[0][slot].abs().sum() > 0
    assert engine_llm.remove_lora("r8")
    assert "r8" not in manager.cpu_names() and "r8" not in manager.slot_names()
    assert wrapper.lora_a[0][slot].abs().sum() == 0
    assert not engine_llm.remove_lora("r8")


def test_untargeted_module_slot_is_zeroed(engine_llm, llama_adapters, prompts):
    """An adapter that targets only q/v must not inherit the MLP weights of the
    adapter that held its slot before."""
    manager = engine_llm.engine.executor.driver.loras
    for i, n in enumerate(["r8", "r1", "r16_qv"]):
        _use(engine_llm, LoRARequest(n, i + 1, llama_adapters[n]), prompts[0])
    slot = manager.slots.slot_of("r16_qv")
    for path, wrapper in manager.wrappers.items():
        if path.endswith(("gate_up_proj", "down_proj", "o_proj")):
            assert all(a[slot].abs().sum() == 0 for a in wrapper.lora_a), path
