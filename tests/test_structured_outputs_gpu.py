"""Structured outputs on a GPU with CUDA graphs on: decode steps that hold grammar
rows still replay the graph, the masks (xgrammar's Triton kernel) apply after it,
outside the captured forward, the constraints hold, and the unconstrained rows of
the same steps keep transformers+PEFT's tokens."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.structured_output.params import StructuredOutputsParams as SO

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["name", "age"]}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
CHECKS = [
    (SO(json=SCHEMA, disable_any_whitespace=True),
     lambda t: set(json.loads(t)) == {"name", "age"}),
    (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    (SO(choice=CHOICES), lambda t: t in CHOICES),
    (SO(grammar='root ::= "(" [a-c] ("," [a-c]){0,2} ")"'),
     lambda t: re.fullmatch(r"\([a-c](,[a-c]){0,2}\)", t) is not None),
]


@pytest.fixture(autouse=True)
def _free_gpu():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grammar_masks_with_cuda_graphs(llama_dir, llama_adapters, prompts, dtype, monkeypatch):
    llm = LLM(llama_dir, device="cuda", dtype=dtype, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_num_seqs=32, kv_cache_memory_bytes=1 << 28)
    runner = llm.engine.executor.driver
    assert runner.graphs is not None
    replayed = {"graph": False, "masked_after_graph": 0}
    graph_run, sample = runner.graphs.run, runner.sampler.sample

    def run(inputs):
        replayed["graph"] = True
        return graph_run(inputs)

    def sample_after(logits, rows):
        # Grammar rows are sampled late (after their step is launched and the one
        # before it is read back), from the logits the graph computed.
        if any(r.token_mask is not None for r in rows):
            replayed["masked_after_graph"] += replayed["graph"]
            replayed["graph"] = False
        return sample(logits, rows)

    monkeypatch.setattr(runner.graphs, "run", run)
    monkeypatch.setattr(runner.sampler, "sample", sample_after)

    loras = [None, LoRARequest("r8", 1, llama_adapters["r8"]),
             LoRARequest("r16_qv", 2, llama_adapters["r16_qv"])]
    constrained = [(p, SamplingParams(temperature=0, max_tokens=48, structured_outputs=c),
                    lora, holds) for c, holds in CHECKS for p in prompts[:2] for lora in loras]
    free = [(prompts[3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora)
            for lora in loras]
    batch = [(p, params, lora) for p, params, lora, _ in constrained] + free
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in batch],
                        [params for _, params, _ in batch], [lora for _, _, lora in batch],
                        use_tqdm=False)
    outs = [o.outputs[0] for o in outs]
    for (_, _, _, holds), out in zip(constrained, outs, strict=False):
        assert out.finish_reason == "stop" and holds(out.text), out.text
    # Steps with grammar rows replayed the decode graph and were masked after it.
    assert replayed["masked_after_graph"] > 0
    if dtype == "float32":
        for (p, _, lora), out in zip(free, outs[len(constrained):], strict=True):
            assert out.token_ids == hf_greedy(llama_dir, lora.lora_path if lora else None,
                                              p, 12)
