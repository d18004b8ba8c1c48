"""The workload the benchmarks share: random token-id prompts and lengths,
adapter popularity (uniform or Zipf), request arrivals (all at once, Poisson or
fixed gaps), and for the offline benchmarks and profilers the adapters on disk
and the flags and engine of a run. The serving load generator imports it too,
so loraserve itself is imported only where an engine or request is made."""

from __future__ import annotations

import argparse
import itertools
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraserve import LLM, LoRARequest, SamplingParams


def make_prompts(num: int, input_len: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(input_len)]}
            for _ in range(num)]


def arrival_offsets(num: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    """Send time of each request, in seconds from the start of the run.

    An infinite rate sends everything at once. A Poisson process has exponential
    gaps of mean 1/rate; a fixed one has gaps of exactly 1/rate. The first request
    goes at 0 either way, so the run does not start with an idle gap.
    """
    if math.isinf(rate):
        return [0.0] * num
    offsets, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
        offsets.append(now)
    return offsets


def adapter_weights(num: int, dist: str, zipf_alpha: float) -> list[float]:
    """Probability of each adapter, by its rank in the list (the first is the most
    popular under Zipf: p_k proportional to 1 / k**alpha, over the num adapters)."""
    if num == 0:
        return []
    if dist == "uniform":
        raw = [1.0] * num
    else:
        raw = [1.0 / (k ** zipf_alpha) for k in range(1, num + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def pick_models(num: int, base: str, adapters: list[str], dist: str, zipf_alpha: float,
                base_fraction: float, rng: random.Random) -> list[str]:
    """The model name of each request: the base with probability base_fraction
    (always when there are no adapters), else an adapter drawn from the distribution."""
    weights = adapter_weights(len(adapters), dist, zipf_alpha)
    # Cumulative weights once: 1,024 adapters would otherwise be summed per draw.
    cumulative = list(itertools.accumulate(weights))
    models = []
    for _ in range(num):
        if not adapters or rng.random() < base_fraction:
            models.append(base)
        else:
            models.append(rng.choices(adapters, cum_weights=cumulative)[0])
    return models


def random_prompts(num: int, input_len: int, vocab_size: int,
                   rng: random.Random) -> list[list[int]]:
    """Random token ids, away from the ends of the vocabulary where tokenizers
    usually keep their special tokens (a tiny vocabulary keeps the whole range)."""
    margin = min(100, vocab_size // 4)
    low, high = margin, vocab_size - margin
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num)]


def draw_lengths(num: int, bounds: tuple[int, int], rng: random.Random) -> list[int]:
    low, high = bounds
    return [rng.randint(low, high) for _ in range(num)]


def adapter_names(root: Path, count: int) -> list[str]:
    """The first `count` adapter folders under root, in name order."""
    return sorted(d.name for d in root.iterdir() if d.is_dir())[:count]


def adapter_requests(root: Path, count: int) -> list[LoRARequest]:
    """A request for each of the first `count` adapters under root, ids from 1."""
    from loraserve import LoRARequest

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
    from loraserve import LLM

    return LLM(args.model, load_format=args.load_format, enable_lora=args.adapters is not None,
               max_loras=args.max_loras or args.num_adapters, max_lora_rank=args.max_lora_rank,
               max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               enforce_eager=args.enforce_eager, **kwargs)


def workload_requests(llm: LLM, args: argparse.Namespace) -> tuple[list[dict], SamplingParams]:
    """The prompts of add_workload_arguments' flags, and greedy sampling of exactly
    --output-len tokens."""
    from loraserve import SamplingParams

    vocab = llm.config.model_config.hf_config.vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab)
    return prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
