"""What a device slot costs, and --max-loras auto: the count is decided at start-up,
logged, used by the engine's scheduler and reported by the server."""

from __future__ import annotations

import pytest
import torch
from serve_utils import ServerProcess
from transformers import AutoConfig
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import LoRAConfig
from loraserve.lora.slot_memory import AUTO_CPU_LORAS, _stacks, bytes_per_slot


def test_a_slot_costs_one_rank_wide_a_and_b_per_projection(llama_dir):
    hf = AutoConfig.from_pretrained(llama_dir)
    r = 16
    h, i, v = hf.hidden_size, hf.intermediate_size, hf.vocab_size
    head_dim = h // hf.num_attention_heads
    q, kv = hf.num_attention_heads * head_dim, hf.num_key_value_heads * head_dim
    per_layer = (
        3 * r * h + r * (q + 2 * kv)  # qkv: an A per slice, one B over the three
        + r * q + h * r  # o
        + 2 * r * h + 2 * i * r  # gate/up
        + r * i + h * r  # down
    )
    embeddings = (v * r + h * r) + (r * h + v * r)  # embed_tokens and lm_head
    want = 4 * (hf.num_hidden_layers * per_layer + embeddings)  # fp32
    config = LoRAConfig(max_loras=1, max_lora_rank=r, lora_dtype=torch.float32)
    assert bytes_per_slot(hf, config, torch.float32) == want


def test_the_estimate_is_what_an_engine_allocates(llama_dir):
    llm = LLM(llama_dir, enable_lora=True, max_loras=3, max_lora_rank=8)
    wrappers = llm.engine.executor.driver.loras.wrappers
    allocated = sum(t.numel() * t.element_size() for w in wrappers.values() for t in _stacks(w))
    config = llm.engine.config.lora_config
    assert allocated == 3 * bytes_per_slot(AutoConfig.from_pretrained(llama_dir), config,
                                           torch.float32)


@pytest.mark.parametrize("max_cpu_loras,want", [(None, AUTO_CPU_LORAS), (4, 4)])
def test_auto_decides_the_slots_and_the_engine_schedules_with_them(
        llama_dir, llama_adapters, prompts, max_cpu_loras, want, caplog):
    with caplog.at_level("INFO", logger="loraserve.lora.slot_memory"):
        llm = LLM(llama_dir, enable_lora=True, max_loras="auto", max_lora_rank=16,
                  max_cpu_loras=max_cpu_loras)
    assert f"--max-loras auto: {want} device slots" in caplog.text
    config = llm.engine.config.lora_config
    assert (config.max_loras, config.auto_max_loras) == (want, False)
    assert config.max_cpu_loras == (max_cpu_loras or want)
    assert llm.engine.scheduler.max_loras == want
    assert llm.engine.executor.driver.loras.slots.num_slots == want
    names = list(llama_adapters)
    loras = [LoRARequest(n, k + 1, llama_adapters[n]) for k, n in enumerate(names)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] * len(loras), params, loras,
                        use_tqdm=False)
    for lora, out in zip(loras, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, lora.lora_path, prompts[0], 4)


def test_the_server_reports_the_slots_auto_decided(llama_dir, llama_adapters):
    with ServerProcess([llama_dir, "--enable-lora", "--max-loras", "auto",
                        "--lora-modules", f"a={llama_adapters['r8']}"]) as server:
        metrics = server.get("/metrics").text
        assert f'max_lora="{AUTO_CPU_LORAS}"' in metrics
        reply = server.post("/v1/completions", json={"model": "a", "prompt": "Hello",
                                                     "max_tokens": 2})
        assert reply.status_code == 200, reply.text
