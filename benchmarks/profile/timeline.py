"""Where the wall time of the batch-32 decode run goes (the run of
``benchmarks/offline.py --decode-rate``: 32 requests, input 64, output 512): one run
under the torch profiler (CUDA activity), split into the host time before the
first and after the last device work, the prefill step, the decode steps, and
the device's idle gaps between them, by the names of the work on either side.

    python -m benchmarks.profile.timeline --model /tmp/bench/llama3-8b-shape \
        --load-format dummy --json out.json

A step ends with the copy of its tokens to the host (``Memcpy DtoH``), so the
last ``output - 1`` of those copies bound the decode steps. Unprofiled runs
before and after give the wall time without the profiler's cost.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile.timing import timed
from benchmarks.results import command, machine, write_results
from benchmarks.workload import make_prompts
from loraserve import LLM, SamplingParams


def device_events(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every device activity, in start order."""
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0:
            spans.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(spans)


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:60]


def gaps(spans: list[tuple[float, float, str]], lo: float, hi: float) -> tuple[float, dict]:
    """Device-idle µs within [lo, hi], in all and by (work before, work after)."""
    idle, by_pair = 0.0, defaultdict(lambda: [0.0, 0])
    end, last = None, None
    for a, b, name in spans:
        if b <= lo or a >= hi:
            continue
        if end is not None and a > end:
            pair = by_pair[f"{short(last)} -> {short(name)}"]
            pair[0] += a - end
            pair[1] += 1
            idle += a - end
        if end is None or b > end:
            end, last = b, name
    top = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:12]
    return idle, {k: {"us": round(v[0], 1), "count": v[1]} for k, v in top}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    llm = LLM(args.model, load_format=args.load_format, max_num_seqs=args.batch)
    vocab = llm.config.model_config.hf_config.vocab_size
    prompts = make_prompts(args.batch, args.input_len, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    before = timed(llm, prompts, params, None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        profiled = time.perf_counter() - start
    after = timed(llm, prompts, params, None)

    spans = device_events(prof)
    first, last = spans[0][0], max(b for _, b, _ in spans)
    to_host = [b for _, b, name in spans if "DtoH" in name]
    decode_steps = args.output_len - 1
    prefill_end = to_host[-decode_steps - 1]
    decode_end = to_host[-1]
    prefill_idle, prefill_gaps = gaps(spans, first, prefill_end)
    decode_idle, decode_gaps = gaps(spans, prefill_end, decode_end)
    ends = to_host[-decode_steps - 1:]
    periods = sorted(b - a for a, b in zip(ends[:-1], ends[1:], strict=True))
    results = {
        "command": command(),
        "machine": machine(),
        "wall_s": {"unprofiled_before": before, "profiled": profiled,
                   "unprofiled_after": after},
        "device_to_host_copies": len(to_host),
        "ms": {
            "host_before_first_device_work_and_after_last": profiled * 1e3
            - (last - first) / 1e3,
            "prefill_step_first_work_to_its_token_copy": (prefill_end - first) / 1e3,
            "decode_steps": (decode_end - prefill_end) / 1e3,
            "after_last_token_copy": (last - decode_end) / 1e3,
        },
        "decode_step_us": {"mean": (decode_end - prefill_end) / decode_steps,
                           "p50": periods[len(periods) // 2], "min": periods[0],
                           "max": periods[-1]},
        "decode_idle_us_per_step": decode_idle / decode_steps,
        "decode_gaps_by_neighbours": decode_gaps,
        "prefill_idle_ms": prefill_idle / 1e3,
        "prefill_gaps_by_neighbours": prefill_gaps,
        "slowest_steps_us": periods[-8:],
    }
    write_results(results, args.json)


if __name__ == "__main__":
    main()
