"""Piecewise CUDA graphs: the layers cut around attention, per token-count bucket.

On a CPU the pieces run as plain calls, in the order and through the static
buffers that the graphs use, padded to the bucket; so the cut, the buffers and
the padding are checked here against transformers+PEFT. On a GPU the same
steps replay captured graphs."""

from __future__ import annotations

import pytest
from moe_utils import make_moe_adapter, make_tiny_moe_model
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.worker.piecewise_graphs import PiecewiseGraphs, token_buckets

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_token_buckets_cover_every_count_with_little_padding():
    for limit in (16, 100, 128, 2048, 8192):
        sizes = token_buckets(limit)
        assert sizes == sorted(set(sizes)) and sizes[-1] == limit and sizes[0] <= 16
        for n in range(1, limit + 1):
            padded = next(s for s in sizes if s >= n)
            assert padded - n < 16 or (padded - n) / n <= 1 / 8


def _count_calls(obj, name: str) -> list:
    calls = []
    original = getattr(obj, name)

    def wrapper(inputs, *args):
        calls.append(len(inputs.input_ids))
        return original(inputs, *args)

    setattr(obj, name, wrapper)
    return calls


def _mixed_batch(llama_adapters, prompts):
    loras = [None] + [LoRARequest(n, i + 1, path)
                      for i, (n, path) in enumerate(llama_adapters.items())]
    return [(p, lora) for p in prompts for lora in loras[:3]]


def _check_against_peft(llm, llama_dir, batch) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], GREEDY,
                        [lora for _, lora in batch], use_tqdm=False)
    for (p, lora), out in zip(batch, outs, strict=True):
        want = hf_greedy(llama_dir, lora.lora_path if lora else None, p, MAX_TOKENS)
        assert out.outputs[0].token_ids == want, lora


def test_pieces_match_peft_on_mixed_steps(llama_dir, llama_adapters, prompts):
    """Prompts chunked under a small token budget, so that steps mix a prefill chunk
    with decodes of other adapters and the base, padded to a bucket."""
    # The pieces as plain calls: on the CPU, whatever the machine.
    llm = LLM(llama_dir, device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16,
              max_num_batched_tokens=40, max_num_seqs=16, enable_prefix_caching=False)
    runner = llm.engine.executor.driver
    runner.pieces = PiecewiseGraphs(runner.ctx, runner.max_num_tokens, capture=False)
    calls = _count_calls(runner.pieces, "run")
    _check_against_peft(llm, llama_dir, _mixed_batch(llama_adapters, prompts))
    # Pieces ran, for steps of several sizes, some of them padded.
    assert len(set(calls)) > 2
    assert any(runner.pieces.padded_size(n) > n for n in calls)


def test_pieces_of_a_moe_model_match_peft(tmp_path, prompts):
    """Qwen2-MoE (shared expert, routed experts): the MoE block and its expert LoRA
    run inside the pieces."""
    model_dir = make_tiny_moe_model(tmp_path / "moe", "qwen2_moe", seed=3)
    adapter = make_moe_adapter(model_dir, tmp_path / "a", r=4, alpha=8, seed=1)
    llm = LLM(model_dir, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8,
              max_num_batched_tokens=24, max_num_seqs=8, enable_prefix_caching=False)
    runner = llm.engine.executor.driver
    runner.pieces = PiecewiseGraphs(runner.ctx, runner.max_num_tokens, capture=False)
    calls = _count_calls(runner.pieces, "run")
    lora = LoRARequest("a", 1, adapter)
    _check_against_peft(llm, model_dir, [(p, x) for p in prompts[2:] for x in (None, lora)])
    assert calls


@pytest.mark.gpu
def test_piecewise_graphs_match_peft_on_the_gpu(llama_dir, llama_adapters, prompts):
    llm = LLM(llama_dir, enable_lora=True, max_loras=4, max_lora_rank=16, dtype="float32",
              max_num_batched_tokens=40, max_num_seqs=16, enable_prefix_caching=False,
              cudagraph_mode="FULL_AND_PIECEWISE", kv_cache_memory_bytes=1 << 28)
    runner = llm.engine.executor.driver
    assert runner.pieces is not None and runner.pieces.graphs
    calls = _count_calls(runner.pieces, "run")
    _check_against_peft(llm, llama_dir, _mixed_batch(llama_adapters, prompts))
    # Only steps with a prefill chunk reach the pieces here (decode steps replay
    # the decode graphs): they came in several sizes, padded to their buckets.
    assert len(set(calls)) >= 2
    assert any(runner.pieces.padded_size(n) > n for n in calls)


@pytest.mark.gpu
def test_piecewise_graphs_base_model_on_the_gpu(llama_dir, prompts):
    llm = LLM(llama_dir, dtype="float32", max_num_batched_tokens=40, max_num_seqs=16,
              enable_prefix_caching=False, cudagraph_mode="FULL_AND_PIECEWISE",
              kv_cache_memory_bytes=1 << 28)
    assert llm.engine.executor.driver.pieces.graphs
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, None, p, MAX_TOKENS)


def test_unknown_cudagraph_mode_is_refused(llama_dir):
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        LLM(llama_dir, cudagraph_mode="SOMETIMES")
