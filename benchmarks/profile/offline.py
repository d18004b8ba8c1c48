"""Where the offline workload's LoRA overhead goes: the same requests on the base
model and spread over adapters, first timed, then once each under the torch
profiler, with the GPU time of every kernel summed by name and by kind. A
prefill-only pass (one output token) splits the overhead into prefill and decode.
For finding overhead, not for headline numbers (benchmarks/offline.py gives those).

    python -m benchmarks.profile.offline --model /tmp/bench/llama3-8b-shape \
        --load-format dummy --adapters /tmp/bench/adapters --out /tmp/profile_offline
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile.timing import sync, timed
from benchmarks.results import machine, write_results
from benchmarks.workload import make_prompts, mixed_adapters
from loraserve import LLM, SamplingParams

# Kernel kinds by name: the first pattern found in a kernel's name wins.
KINDS = (
    ("lora shrink", ("_lora_shrink",)),
    ("lora expand", ("_lora_expand",)),
    ("lora one launch", ("_lora_one_launch",)),
    ("silu+lora", ("_silu_and_mul_lora",)),
    ("lora metadata", ("sort", "searchsorted", "bitonic", "radix")),
    ("attention", ("attention", "attn")),
    ("gemm", ("_dense_kernel", "gemm", "nvjet", "xmma", "cutlass", "sm90_", "splitk", "splitK")),
)


def kind_of(name: str) -> str:
    for kind, patterns in KINDS:
        if any(p in name for p in patterns):
            return kind
    return "other"


def kernel_times(llm: LLM, prompts, params, loras) -> dict[str, float]:
    """GPU ms of each kernel name over one run."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, loras, use_tqdm=False)
        sync()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us() / 1e3
    return dict(totals)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--adapters", type=Path, required=True)
    p.add_argument("--num-adapters", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    llm = LLM(args.model, load_format=args.load_format, enable_lora=True,
              max_loras=args.num_adapters, max_lora_rank=16, max_num_seqs=256)
    vocab = llm.config.model_config.hf_config.vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab)
    cases = {"base": None,
             "lora": mixed_adapters(args.adapters, args.num_adapters, len(prompts))}
    phases = {
        "prefill": SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        "full": SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
    }
    for per_prompt in cases.values():  # warm-up: compiles, adapter loads
        llm.generate(prompts, phases["prefill"], per_prompt, use_tqdm=False)

    results: dict = {"machine": machine(), "seconds": {}, "kernel_ms_by_kind": {}}
    for phase, params in phases.items():
        for case, per_prompt in cases.items():
            # Alternate twice; keep the faster run of each.
            runs = [timed(llm, prompts, params, per_prompt) for _ in range(2)]
            results["seconds"][f"{phase} {case}"] = min(runs)
    for case, per_prompt in cases.items():
        totals = kernel_times(llm, prompts, phases["full"], per_prompt)
        by_kind: dict[str, float] = defaultdict(float)
        for name, ms in totals.items():
            by_kind[kind_of(name)] += ms
        results["kernel_ms_by_kind"][case] = dict(sorted(by_kind.items()))
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:40]
        (args.out / f"kernels_{case}.txt").write_text(
            "\n".join(f"{ms:10.1f} ms  {kind_of(n):16s} {n[:140]}" for n, ms in top))
    s = results["seconds"]
    results["lora_overhead_s"] = {
        phase: s[f"{phase} lora"] - s[f"{phase} base"] for phase in phases
    }
    write_results(results, args.out / "profile_offline.json")


if __name__ == "__main__":
    main()
