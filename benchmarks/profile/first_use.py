"""Which Triton kernels compile after start-up, on a request's path: an engine
made as ``loraserve serve`` makes it (LoRA on, 8 slots, 256 sequences), then
workloads like the serving benchmark's, each timed, with every compile that
happens during it (Triton's JIT hooks) and its seconds.

    python -m benchmarks.profile.first_use --model /tmp/bench/llama3-8b-shape \
        --load-format dummy --adapters /tmp/bench/adapters --json out.json

Run it with an empty Triton cache (TRITON_CACHE_DIR) to see what a fresh
machine pays.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from triton import knobs

from benchmarks.profile.timing import timed
from benchmarks.results import command, machine, write_results
from benchmarks.workload import adapter_requests, make_prompts
from loraserve import LLM, SamplingParams

compiles: list[dict] = []
_started: dict = {}


def _before(**kw) -> bool:
    _started[kw["key"]] = time.perf_counter()
    return False


def _after(**kw) -> None:
    start = _started.pop(kw["key"], None)
    text = str(kw.get("repr", kw["key"]))
    compiles.append({"kernel": text.split("[")[0],
                     "seconds": None if start is None else time.perf_counter() - start,
                     "repr": text[:400]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--adapters", type=Path, required=True)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    llm = LLM(args.model, load_format=args.load_format, enable_lora=True, max_loras=8,
              max_lora_rank=16, max_num_seqs=256)
    knobs.runtime.jit_cache_hook = _before
    knobs.runtime.jit_post_compile_hook = _after
    vocab = llm.config.model_config.hf_config.vocab_size
    loras = adapter_requests(args.adapters, 8)
    rng = random.Random(0)

    def prompts(num: int, length: int, ragged: bool = False) -> list[dict]:
        out = make_prompts(num, length, vocab, seed=num)
        if ragged:
            out = [{"prompt_token_ids": q["prompt_token_ids"][: rng.randrange(16, length)]}
                   for q in out]
        return out

    phases = [
        ("batch 1, base", prompts(1, 512), None),
        ("batch 1, LoRA", prompts(1, 512), [loras[0]]),
        ("batch 64, base", prompts(64, 512), None),
        ("batch 64, LoRA", prompts(64, 512), [loras[i % 8] for i in range(64)]),
        ("batch 64 again, base", prompts(64, 512), None),
        ("ragged 100, LoRA", prompts(100, 600, ragged=True), [loras[i % 8] for i in range(100)]),
        ("ragged 100 again, LoRA", prompts(100, 600, ragged=True),
         [loras[i % 8] for i in range(100)]),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    results = {"command": command(), "machine": machine(), "phases": []}
    for name, batch, per_prompt in phases:
        before = len(compiles)
        seconds = timed(llm, batch, params, per_prompt)
        new = compiles[before:]
        results["phases"].append({
            "phase": name, "seconds": seconds, "compiles": len(new),
            "compile_seconds": sum(c["seconds"] or 0 for c in new), "kernels": new,
        })
        print(name, round(results["phases"][-1]["seconds"], 2), "s,", len(new), "compiles",
              flush=True)
    write_results(results, args.json, indent=1)


if __name__ == "__main__":
    main()
