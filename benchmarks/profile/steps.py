"""Where a served step's time goes: one model runner, driven step by step with
the shapes continuous serving produces, base against LoRA.

A server under continuous load mostly runs *mixed* steps: the decodes of the
running requests plus a prefill chunk of a newly arrived one. This builds such
steps directly (B decoding sequences at context --context, plus one prefill
chunk of C tokens) and times each kind of step three ways:

- host: how long ``ModelRunner.launch`` takes to return (the CPU's share: input
  preparation, Python, kernel launches);
- wall: launch plus the wait for its sampled tokens (what one step costs when
  nothing overlaps it);
- device: the summed kernel time of one profiled step, by kind of kernel.

When host is close to wall, the step is launch-bound: the device waits on the
CPU, and LoRA's extra launches cost their host time in full.

    python -m benchmarks.profile.steps --model /tmp/bench/llama3-8b-shape \
        --load-format dummy --adapters /tmp/bench/adapters --json steps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile.timing import sync
from benchmarks.results import command_words, machine
from benchmarks.workload import adapter_requests
from loraserve.config import EngineConfig
from loraserve.sampling_params import SamplingParams
from loraserve.worker.input_batch import SeqInput, StepInput
from loraserve.worker.model_runner import ModelRunner
from loraserve.worker.sampler import SamplingRow

KERNEL_KINDS = (
    ("lora", ("lora",)),
    ("attention", ("attn", "rotary", "kv_cache")),
    ("gemm", ("gemm", "matmul", "nvjet", "cutlass", "sm90", "dense")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def make_step(runner: ModelRunner, num_decodes: int, chunk: int, context: int,
              adapters: list[str | None]) -> StepInput:
    """num_decodes sequences decoding at `context`, and (if chunk) one more whose
    prompt's first `chunk` tokens are computed; sequence i uses adapters[i % len]."""
    bs = runner.block_size
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    seqs, next_block = [], 1

    def blocks(n: int) -> list[int]:
        nonlocal next_block
        count = -(-n // bs)
        ids = [(next_block + i) % (runner.num_kv_blocks - 1) + 1 for i in range(count)]
        next_block += count
        return ids

    for i in range(num_decodes):
        row = SamplingRow(params, [1] * context, [1], None, None)
        seqs.append(SeqInput(f"d{i}", [7], context, blocks(context + 1),
                             adapters[i % len(adapters)], row))
    if chunk:
        row = SamplingRow(params, [1] * chunk, [], None, None)
        seqs.append(SeqInput("p", [5] * chunk, 0, blocks(chunk),
                             adapters[num_decodes % len(adapters)], row))
    return StepInput(seqs)


def time_step(runner: ModelRunner, step: StepInput, iters: int) -> dict[str, float]:
    for _ in range(3):
        batch = runner.execute(step).sampled
        batch.token_ids.cpu()
    host, wall = [], []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        batch = runner.execute(step).sampled
        launched = time.perf_counter()
        batch.token_ids.cpu()
        done = time.perf_counter()
        host.append((launched - start) * 1e3)
        wall.append((done - start) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        batch = runner.execute(step).sampled
        batch.token_ids.cpu()
    by_kind: dict[str, float] = defaultdict(float)
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0:
            by_kind[kernel_kind(e.name)] += e.time_range.elapsed_us() / 1e3
            launches += 1
    return {
        "host_ms": statistics.median(host), "wall_ms": statistics.median(wall),
        "device_ms": sum(by_kind.values()), "kernels": launches,
        **{f"{k}_ms": v for k, v in sorted(by_kind.items())},
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--adapters", required=True, help="folder of PEFT adapter folders")
    p.add_argument("--num-adapters", type=int, default=32)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--decodes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 128, 512])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE",
                   help="FULL_AND_PIECEWISE: mixed steps replay piecewise graphs")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    config = EngineConfig.from_kwargs(
        model=args.model, load_format=args.load_format, enable_lora=True,
        max_loras=args.num_adapters, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.num_adapters, max_num_seqs=256, max_num_batched_tokens=2048,
        enforce_eager=args.enforce_eager, cudagraph_mode=args.cudagraph_mode,
        enable_prefix_caching=False,
    )
    runner = ModelRunner(config)
    loras = adapter_requests(Path(args.adapters), args.num_adapters)
    names = [lora.lora_name for lora in loras]
    for lora in loras:
        runner.loras.add(lora)

    rows = []
    for decodes in args.decodes:
        for chunk in args.chunks:
            for model, adapters in (("base", [None]), ("LoRA", names)):
                step = make_step(runner, decodes, chunk, args.context, adapters)
                result = time_step(runner, step, args.iters)
                rows.append({"decodes": decodes, "chunk": chunk, "model": model, **result})
                print(json.dumps(rows[-1]), file=sys.stderr)

    kinds = sorted({k for r in rows for k in r if k.endswith("_ms")} - {
        "host_ms", "wall_ms", "device_ms"})
    lines = [f"Machine: {machine()}", "Command: python " + " ".join(command_words()[1:]), "",
             "| decodes | chunk | model | host ms | wall ms | device ms | kernels | "
             + " | ".join(k.removesuffix("_ms") for k in kinds) + " |",
             "|---" * (7 + len(kinds)) + "|"]
    for r in rows:
        lines.append(
            f"| {r['decodes']} | {r['chunk']} | {r['model']} | {r['host_ms']:.2f} | "
            f"{r['wall_ms']:.2f} | {r['device_ms']:.2f} | {r['kernels']} | "
            + " | ".join(f"{r.get(k, 0.0):.2f}" for k in kinds) + " |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return {"rows": rows}


if __name__ == "__main__":
    main()
