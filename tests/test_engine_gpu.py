"""The engine on a GPU: Triton attention, LoRA kernels and CUDA graphs give the
same tokens as transformers+PEFT in fp32, and stay close in bf16."""

from __future__ import annotations

import gc

import pytest
import torch
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def _free_gpu():
    # Each test's engine holds its KV cache until collected; the next one sizes
    # its cache from what is free.
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _gen(llm, prompts, loras, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp32_on_gpu_matches_peft(llama_dir, llama_adapters, prompts, enforce_eager):
    names = list(llama_adapters)
    llm = LLM(llama_dir, device="cuda", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, enforce_eager=enforce_eager, max_num_seqs=16,
              kv_cache_memory_bytes=1 << 28)
    assert (llm.engine.executor.driver.graphs is None) == enforce_eager
    loras = [None] + [LoRARequest(n, i + 1, llama_adapters[n]) for i, n in enumerate(names)]
    batch = [(p, lora) for p in prompts for lora in loras]
    outs = _gen(llm, [p for p, _ in batch], [lr for _, lr in batch])
    for (p, lora), out in zip(batch, outs, strict=True):
        want = hf_greedy(llama_dir, lora.lora_path if lora else None, p, MAX_TOKENS)
        assert out.token_ids == want, lora


def test_bf16_stays_close_to_fp32_reference(llama_dir, llama_adapters, prompts):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoRARequest("r8", 1, llama_adapters["r8"])
    llm = LLM(llama_dir, device="cuda", dtype="bfloat16", enable_lora=True, max_loras=2,
              max_lora_rank=16, max_num_seqs=8, gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0)
    (out,) = _gen(llm, [prompts[2]], [lora], params)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, llama_adapters["r8"]).eval()
    ids = torch.tensor([prompts[2] + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].float(), -1)
    start = len(prompts[2]) - 1
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        # Our bf16 token must be (nearly) the reference's best, and its logprob close.
        assert abs(entry[token] - float(ref[start + i, token])) < 0.15
        assert float(ref[start + i].max() - ref[start + i, token]) < 0.15


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_prefix_caching_on_gpu_matches_peft(llama_dir, llama_adapters, prompts, enforce_eager):
    """Requests that share a 40-token prefix, for the base model and two adapters:
    the second pass starts from cached blocks (attention over a cached context in
    the first prefill) and must still give transformers+PEFT's tokens."""
    prefix = (prompts[3] * 8 + prompts[1] * 8)[:40]
    shared = [prefix + p for p in prompts[:3]]
    loras = [None, LoRARequest("r8", 1, llama_adapters["r8"]),
             LoRARequest("r16_qv", 2, llama_adapters["r16_qv"])]
    batch = [(p, lora) for p in shared for lora in loras]
    llm = LLM(llama_dir, device="cuda", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, enforce_eager=enforce_eager, max_num_seqs=16,
              kv_cache_memory_bytes=1 << 28, enable_prefix_caching=True)
    first = _gen(llm, [p for p, _ in batch], [lr for _, lr in batch])
    hits_before = llm.engine.kv.prefix_cache_stats.hits
    second = _gen(llm, [p for p, _ in batch], [lr for _, lr in batch])
    assert llm.engine.kv.prefix_cache_stats.hits > hits_before
    for (p, lora), a, b in zip(batch, first, second, strict=True):
        want = hf_greedy(llama_dir, lora.lora_path if lora else None, p, MAX_TOKENS)
        assert a.token_ids == want and b.token_ids == want, lora


def test_prompt_logprobs_on_gpu_match_transformers(llama_dir, llama_adapters, prompts):
    """Prompt logprobs come from eager prefill steps on the GPU too, chunked over
    several steps, next to a request that does not ask (which decodes in graphs)."""
    from test_prompt_logprobs import K, check_against, hf_prompt_logprobs

    long_prompt = (prompts[3] * 8 + prompts[1] * 8)[:45]
    r8 = LoRARequest("r8", 1, llama_adapters["r8"])
    llm = LLM(llama_dir, device="cuda", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, max_num_seqs=16, max_num_batched_tokens=16,
              kv_cache_memory_bytes=1 << 28)
    asks = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate([{"prompt_token_ids": long_prompt}] * 2 + [{"prompt_token_ids":
                        prompts[0]}], [asks, asks, GREEDY], [None, r8, None])
    check_against(hf_prompt_logprobs(llama_dir, None, long_prompt), long_prompt,
                  outs[0].prompt_logprobs)
    check_against(hf_prompt_logprobs(llama_dir, llama_adapters["r8"], long_prompt),
                  long_prompt, outs[1].prompt_logprobs)
    assert outs[2].outputs[0].token_ids == hf_greedy(llama_dir, None, prompts[0], MAX_TOKENS)
