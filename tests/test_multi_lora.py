"""Each prompt's output in a mixed batch equals its output alone, also when the
batch has more adapters than device slots (max_loras) or CPU cache entries."""

from __future__ import annotations

import pytest

from loraserve import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _run(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(llama_dir, llama_adapters, prompts):
    """Every (prompt, adapter) pair run by itself in a roomy engine."""
    llm = LLM(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=16)
    table = {}
    for name in [None, *llama_adapters]:
        lora = LoRARequest(name, 1, llama_adapters[name]) if name else None
        for i, p in enumerate(prompts):
            table[(i, name)] = _run(llm, [p], [lora])[0]
    return table


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(4, 4), (2, 2), (1, 1), (2, 3)])
def test_mixed_batch_equals_alone(llama_dir, llama_adapters, prompts, alone,
                                  max_loras, max_cpu_loras):
    names = list(llama_adapters)
    ids = {n: i + 1 for i, n in enumerate(names)}
    llm = LLM(llama_dir, enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
              max_lora_rank=16)
    # Interleave adapters so that consecutive requests need different slots.
    batch = [(i, name) for i in range(len(prompts)) for name in [None, *names]]
    loras = [LoRARequest(n, ids[n], llama_adapters[n]) if n else None for _, n in batch]
    got = _run(llm, [prompts[i] for i, _ in batch], loras)
    for (i, name), tokens in zip(batch, got, strict=True):
        assert tokens == alone[(i, name)], (i, name)
    assert len(llm.engine.executor.driver.loras.cpu_names()) <= max_cpu_loras
    assert len(llm.engine.executor.driver.loras.slot_names()) <= max_loras


def test_a_pinned_adapter_keeps_its_slot_and_the_others_share_the_rest(
        llama_dir, llama_adapters, prompts):
    """With max_loras 2 and one adapter pinned in a slot, two other adapters wait for
    the one slot left in turn instead of being admitted together (which found no
    free slot for the second)."""
    llm = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)
    names = ["r8", "r16_qv", "r8_mlp"]
    loras = {n: LoRARequest(n, i + 1, llama_adapters[n]) for i, n in enumerate(names)}
    llm.add_lora(loras["r8"], pinned=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, loras["r8"],
                         use_tqdm=False)
    assert first[0].outputs[0].finish_reason == "length"
    batch = [(p, loras[n]) for p in prompts[:2] for n in names[1:]]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params,
                        [lr for _, lr in batch], use_tqdm=False)
    alone = [llm.generate([{"prompt_token_ids": p}], params, lr, use_tqdm=False)[0]
             for p, lr in batch]
    for out, want in zip(outs, alone, strict=True):
        assert out.outputs[0].finish_reason == "length", out.outputs[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert "r8" in llm.engine.adapters.residency.pinned_slots
