"""Offline throughput: N requests of fixed input/output length, base vs LoRA.

One process runs both, on the same engine settings:
the base model (no adapter) and the same requests spread over the adapters.

    python -m benchmarks.offline --model /tmp/bench/llama3-8b-shape --load-format dummy \
        --adapters /tmp/bench/adapters --num-adapters 32 --num-requests 256 \
        --input-len 512 --output-len 128 --json out.json

``--decode-rate`` also times the same requests for one output token each (their
prefill and first token) and reports the rate of the steps after it,
``decode_tok_per_s``: (output tokens - requests) / (full run - prefill run).
That is the rate of the decode steps alone, which the bandwidth roofline of a
decode step bounds; output_tok_per_s also pays for the prefill.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from pathlib import Path

from benchmarks.results import command, finish_report, machine
from benchmarks.workload import (
    add_workload_arguments,
    mixed_adapters,
    workload_engine,
    workload_requests,
)
from loraserve import LLM, SamplingParams


def timed_generate(llm: LLM, prompts, params, loras, **kwargs) -> tuple[list, float]:
    """The outputs of one ``generate`` and its wall-clock seconds."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, loras, **kwargs)
    return outs, time.perf_counter() - start


def run(llm: LLM, prompts, params, loras, decode_rate: bool = False) -> dict:
    # A warm-up outside the timing: the same prompts for two tokens each. It pays
    # the one-time costs: Triton compiles for every prefill shape of the workload
    # (on a fresh machine they took seconds inside the timed base run), and
    # loading each adapter from disk (a server loads its adapters before traffic).
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts, short, loras, use_tqdm=False)
    result = {}
    if decode_rate:
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        _, result["prefill_seconds"] = timed_generate(llm, prompts, first, loras,
                                                      use_tqdm=False)
    outs, elapsed = timed_generate(llm, prompts, params, loras)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result.update({"seconds": elapsed, "output_tokens": out_tokens,
                   "output_tok_per_s": out_tokens / elapsed,
                   "requests_per_s": len(outs) / elapsed})
    if decode_rate:
        result["decode_tok_per_s"] = (
            (out_tokens - len(outs)) / (elapsed - result["prefill_seconds"]))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_workload_arguments(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=1,
                   help="alternate this many base and LoRA runs; report the medians")
    p.add_argument("--decode-rate", action="store_true",
                   help="also time the prefill alone and report the decode steps' rate")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="keep the engine's prefix cache on: every run repeats the same "
                   "prompts, so from the second run on their prefills come from the cache")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    llm = workload_engine(args, device=args.device,
                          enable_prefix_caching=args.enable_prefix_caching)
    prompts, params = workload_requests(llm, args)

    results = {"command": command(), "machine": machine()}
    graphs = llm.engine.executor.driver.graphs
    if graphs is not None:
        results["graph_capture"] = {"seconds": graphs.capture_seconds,
                                    "bytes": graphs.capture_bytes, "graphs": len(graphs.graphs)}
    per_prompt = None
    if args.adapters is not None:
        per_prompt = mixed_adapters(args.adapters, args.num_adapters, len(prompts))
    # Base and LoRA runs alternate, so drifts of the machine's speed over the
    # process (clocks, neighbours) reach both; each reports its median run.
    runs: dict[str, list[dict]] = {"base": [], "lora": []}
    for _ in range(args.repeats):
        runs["base"].append(run(llm, prompts, params, None, args.decode_rate))
        print(json.dumps(runs["base"][-1]), flush=True)
        if per_prompt is not None:
            gc.collect()
            runs["lora"].append(run(llm, prompts, params, per_prompt, args.decode_rate))
            print(json.dumps(runs["lora"][-1]), flush=True)
    for name, done in runs.items():
        if done:
            results[name] = sorted(done, key=lambda r: r["output_tok_per_s"])[len(done) // 2]
            if args.repeats > 1:
                results[f"{name}_runs"] = done
    finish_report(results, args.json)


if __name__ == "__main__":
    main()
