"""--scheduling-policy priority in the engine: a saturated engine starts waiting
requests by (priority, arrival), for the base model and adapters alike, and their
outputs stay those of transformers+PEFT; with fcfs a priority other than 0 is
refused, as vLLM refuses it."""

from __future__ import annotations

import pytest
from utils import hf_greedy

from loraserve import LLM, SamplingParams
from loraserve.engine.protocol import EngineCoreRequest
from loraserve.lora.request import LoRARequest

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=16, max_num_seqs=1,
               scheduling_policy="priority")


def test_a_saturated_engine_starts_requests_by_priority(llm, llama_dir, llama_adapters,
                                                        prompts):
    lora = LoRARequest("r8", 1, llama_adapters["r8"])
    llm.add_lora(lora)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # (id, prompt, adapter, priority, arrival): one running at a time, all queued
    # before the first step.
    cases = [("late-low", 0, None, 5, 1.0), ("lora-high", 1, lora, -1, 2.0),
             ("mid", 2, None, 2, 3.0), ("lora-tie", 3, lora, 2, 2.5),
             ("early-low", 1, None, 5, 0.5)]
    for rid, p, lr, priority, arrival in cases:
        llm.engine.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=prompts[p], sampling_params=params,
            eos_token_id=llm.tokenizer.eos_token_id, lora_request=lr, arrival_time=arrival,
            priority=priority))
    started: list[str] = []
    tokens: dict[str, list[int]] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step().outputs:
            if out.request_id not in tokens:
                started.append(out.request_id)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert started == ["lora-high", "lora-tie", "mid", "early-low", "late-low"]
    for rid, p, lr, _, _ in cases:
        adapter = llama_adapters["r8"] if lr is not None else None
        assert tokens[rid] == hf_greedy(llama_dir, adapter, prompts[p], MAX_TOKENS), rid


def test_generate_takes_a_priority_per_prompt(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                        SamplingParams(temperature=0, max_tokens=2), priority=[3, -3],
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)


def test_first_come_first_served_refuses_a_priority(llama_dir, prompts):
    fcfs = LLM(llama_dir)
    with pytest.raises(ValueError, match="priority"):
        fcfs.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2),
                      priority=[1], use_tqdm=False)
    (out,) = fcfs.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2),
                           priority=[0], use_tqdm=False)
    assert out.outputs[0].token_ids
