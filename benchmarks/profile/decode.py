"""Where a decode step's time goes: the GPU time of one graph replay, the host
time of each part of an engine step, and the top CUDA kernels of an eager
forward. For finding overhead, not for headline numbers.

    python -m benchmarks.profile.decode --model /tmp/bench/llama3-8b-shape \
        --load-format dummy --batch 32 --out /tmp/profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from benchmarks.kernels.timing import replay_ms
from benchmarks.results import machine, write_results
from benchmarks.workload import make_prompts
from loraserve import LLM, SamplingParams
from loraserve.engine.output_processor import OutputProcessor


def graph_replay_ms(llm: LLM, batch: int) -> float:
    graphs = llm.engine.executor.driver.graphs
    graph, _ = graphs.graphs[(graphs.padded_size(batch), graphs.cases[0])]
    return replay_ms(graph)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    llm = LLM(args.model, load_format=args.load_format, max_num_seqs=args.batch)
    engine = llm.engine
    results = {"machine": machine(), "batch": args.batch,
               "weight_dtype": str(next(engine.executor.driver.model.parameters()).dtype)}

    # Fill the batch and get past the prefill.
    vocab = llm.config.model_config.hf_config.vocab_size
    processor = OutputProcessor(llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 4, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(args.batch, 64, vocab)):
        for ecr in processor.add_request(str(i), None, prompt["prompt_token_ids"], params,
                                         None, None):
            engine.add_request(ecr)
    for _ in range(3):
        processor.process_outputs(engine.step().outputs)

    # Host-timed parts of a step.
    step_s = proc_s = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = engine.step()
        t1 = time.perf_counter()
        processor.process_outputs(out.outputs)
        step_s += t1 - t0
        proc_s += time.perf_counter() - t1
    results["engine_step_ms"] = 1e3 * step_s / args.steps
    results["output_processing_ms"] = 1e3 * proc_s / args.steps
    if engine.executor.driver.graphs is not None:
        # The graph's input buffers now hold the running batch (its real context
        # lengths), so replays time that step on the device alone.
        results["graph_replay_ms"] = graph_replay_ms(llm, args.batch)
        results["context_len"] = 64 + 3 + args.steps

    # Python hotspots of whole steps.
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        processor.process_outputs(engine.step().outputs)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    (args.out / "cprofile.txt").write_text(text.getvalue())

    # CUDA kernels of steps (graph replay kernels show when CUPTI traces graphs).
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    sort_key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with profile(activities=activities) as tprof:
        for _ in range(5):
            processor.process_outputs(engine.step().outputs)
    (args.out / "torch_profile.txt").write_text(
        tprof.key_averages().table(sort_by=sort_key, row_limit=40))

    # The same decode forward eagerly, to see every kernel.
    runner = engine.executor.driver
    graphs_saved, runner.graphs = runner.graphs, None
    with profile(activities=activities) as eprof:
        for _ in range(3):
            processor.process_outputs(engine.step().outputs)
    runner.graphs = graphs_saved
    (args.out / "eager_profile.txt").write_text(
        eprof.key_averages().table(sort_by=sort_key, row_limit=40))
    write_results(results, args.out / "profile.json")


if __name__ == "__main__":
    main()
