"""MoE models on a GPU: the Triton grouped GEMM over experts and the MoE LoRA
kernels (with and without CUDA graphs) give transformers+PEFT's tokens in fp32."""

from __future__ import annotations

import gc

import pytest
import torch
from moe_utils import make_moe_adapter, make_tiny_moe_model
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def _free_gpu():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_moe_fp32_on_gpu_matches_peft(tmp_path, arch, enforce_eager):
    model_dir = make_tiny_moe_model(tmp_path / "m", arch, seed=3)
    adapters = {
        "attn_experts": make_moe_adapter(model_dir, tmp_path / "a1", r=4, alpha=8, seed=1),
        "down_only": make_moe_adapter(model_dir, tmp_path / "a2", r=8, alpha=4,
                                      target_modules=None,
                                      target_parameters=["experts.down_proj"], seed=2),
    }
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t).input_ids for t in ("The quick brown fox", "Hello world!")]
    llm = LLM(model_dir, device="cuda", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, enforce_eager=enforce_eager, max_num_seqs=8,
              kv_cache_memory_bytes=1 << 27)
    loras = [None] + [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())]
    batch = [(p, lora) for p in prompts for lora in loras]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], GREEDY,
                        [lr for _, lr in batch])
    for (p, lora), out in zip(batch, outs, strict=True):
        want = hf_greedy(model_dir, lora.lora_path if lora else None, p, MAX_TOKENS)
        assert out.outputs[0].token_ids == want, (arch, lora)
