"""The offline workload the offline benchmarks and profilers share: random
token-id prompts, adapters spread over them, and the flags and engine of a run."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from loraserve import LLM, LoRARequest, SamplingParams


def make_prompts(num: int, input_len: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(input_len)]}
            for _ in range(num)]


def adapter_names(root: Path, count: int) -> list[str]:
    """The first `count` adapter folders under root, in name order."""
    return sorted(d.name for d in root.iterdir() if d.is_dir())[:count]


def adapter_requests(root: Path, count: int) -> list[LoRARequest]:
    """A request for each of the first `count` adapters under root, ids from 1."""
    return [LoRARequest(n, i + 1, str(root / n))
            for i, n in enumerate(adapter_names(root, count))]


def mixed_adapters(root: Path, count: int, num_prompts: int) -> list[LoRARequest]:
    """A request for each prompt, round-robin over the first `count` adapters under root."""
    loras = adapter_requests(root, count)
    return [loras[i % len(loras)] for i in range(num_prompts)]


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The model, adapters, workload and engine sizes of an offline run (offline.py
    and tensor_parallel.py)."""
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--adapters", type=Path, help="folder of PEFT adapter folders")
    p.add_argument("--num-adapters", type=int, default=32)
    p.add_argument("--max-loras", type=int, default=None)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")


def workload_engine(args: argparse.Namespace, **kwargs) -> LLM:
    """The engine of add_workload_arguments' flags (LoRA on when --adapters is
    given), with kwargs for the settings of one benchmark."""
    return LLM(args.model, load_format=args.load_format, enable_lora=args.adapters is not None,
               max_loras=args.max_loras or args.num_adapters, max_lora_rank=args.max_lora_rank,
               max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               enforce_eager=args.enforce_eager, **kwargs)


def workload_requests(llm: LLM, args: argparse.Namespace) -> tuple[list[dict], SamplingParams]:
    """The prompts of add_workload_arguments' flags, and greedy sampling of exactly
    --output-len tokens."""
    vocab = llm.config.model_config.hf_config.vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab)
    return prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
