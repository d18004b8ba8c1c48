"""Greedy outputs equal transformers+PEFT token for token (fp32, CPU)."""

from __future__ import annotations

import pytest
from utils import hf_greedy, make_peft_adapter, make_tiny_model

from loraserve import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm: LLM, prompt_ids: list[list[int]], loras) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "arch,tie,rank,alpha,rslora",
    [
        ("llama", False, 8, 16, False),
        ("llama", True, 16, 7, False),
        ("qwen2", False, 64, 32, False),
        ("qwen3", True, 1, 2, False),
        ("mistral", False, 8, 8, True),
    ],
)
def test_families_match_peft(tmp_path, arch, tie, rank, alpha, rslora):
    model_dir = make_tiny_model(tmp_path / "m", arch, tie_word_embeddings=tie, seed=7)
    adapter = make_peft_adapter(model_dir, tmp_path / "a", r=rank, alpha=alpha,
                                use_rslora=rslora, seed=11)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)("The quick brown fox").input_ids
    llm = LLM(model_dir, enable_lora=True, max_lora_rank=64, max_loras=1)
    lora = LoRARequest("a", 1, adapter)
    base_out, lora_out = _generate(llm, [ids, ids], [None, lora])
    assert base_out == hf_greedy(model_dir, None, ids, MAX_TOKENS)
    assert lora_out == hf_greedy(model_dir, adapter, ids, MAX_TOKENS)
    assert lora_out != base_out  # the adapter really changes the output


def test_mixed_batch_matches_peft(llama_dir, llama_adapters, prompts):
    """One batch mixes several adapters (ranks 1, 8, 16, partial targets) and the base."""
    names = list(llama_adapters)
    llm = LLM(llama_dir, enable_lora=True, max_loras=4, max_lora_rank=16)
    loras = [None] + [LoRARequest(n, i + 1, llama_adapters[n]) for i, n in enumerate(names)]
    batch = [(p, lora) for p in prompts[:2] for lora in loras]
    outs = _generate(llm, [p for p, _ in batch], [lr for _, lr in batch])
    for (p, lora), got in zip(batch, outs, strict=True):
        want = hf_greedy(llama_dir, lora.lora_path if lora else None, p, MAX_TOKENS)
        assert got == want, lora


def test_rank_and_alpha_patterns_match_peft(tmp_path, llama_dir, prompts):
    adapter = make_peft_adapter(
        llama_dir, tmp_path / "pat", r=8, alpha=16,
        rank_pattern={"v_proj": 4, "model.layers.1.mlp.down_proj": 2},
        alpha_pattern={"q_proj": 3, "down_proj": 40}, seed=5,
    )
    llm = LLM(llama_dir, enable_lora=True, max_lora_rank=8)
    (got,) = _generate(llm, [prompts[0]], [LoRARequest("pat", 1, adapter)])
    assert got == hf_greedy(llama_dir, adapter, prompts[0], MAX_TOKENS)


def test_regex_target_modules_match_peft(tmp_path, llama_dir, prompts):
    adapter = make_peft_adapter(
        llama_dir, tmp_path / "re", r=8, alpha=8,
        target_modules=r".*layers\.1\.(self_attn\.(k|o)_proj|mlp\.up_proj)", seed=9,
    )
    llm = LLM(llama_dir, enable_lora=True, max_lora_rank=8)
    (got,) = _generate(llm, [prompts[1]], [LoRARequest("re", 1, adapter)])
    assert got == hf_greedy(llama_dir, adapter, prompts[1], MAX_TOKENS)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
            "rope_theta": 10000.0}
    model_dir = make_tiny_model(tmp_path / "m", "llama", rope_scaling=rope, seed=3)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(
        "Once upon a time there was a tiny model that learned to count: 1 2 3 4 5."
    ).input_ids
    llm = LLM(model_dir)
    (got,) = _generate(llm, [ids], None)
    assert got == hf_greedy(model_dir, None, ids, MAX_TOKENS)


def test_chunked_prefill_and_preemption_keep_outputs(llama_dir, llama_adapters, prompts):
    """A tiny token budget splits prompts into chunks, and a tiny KV cache forces
    preemption by recompute; neither may change a single token."""
    loras = [LoRARequest("r8", 1, llama_adapters["r8"]), None,
             LoRARequest("r16_qv", 2, llama_adapters["r16_qv"]), None]
    roomy = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)
    want = _generate(roomy, prompts, loras)
    tight = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16,
                max_num_batched_tokens=5, block_size=4, num_kv_blocks=12)
    got = _generate(tight, prompts, loras)
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0
    # Every layer's cache holds block 0, zeros that no sequence got (the GPU kernel
    # reads it for keys past an end), then the 12 blocks.
    for cache in tight.engine.executor.driver.kv_caches:
        assert cache.shape[1] == 13 and not cache[:, 0].any() and cache[:, 1:].any()
