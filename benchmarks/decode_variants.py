"""One decode step (batch 32, or ``--batch``), timed as a CUDA graph replay, for
variants of the decode path (switches and table entries) side by side in one
process, on the same running batch; and where a step's time goes, kernel by
kernel.

    python benchmarks/decode_variants.py --model /tmp/bench/llama3-8b-shape \
        --load-format dummy --context 320 --json out.json --md out.md

The engine runs real steps until the batch's sequences hold ``--context``
tokens. Then, per variant, its environment and table patches are applied, a
decode graph of the batch is captured on the engine's static inputs (that running
batch) and replayed: the median of several timed rounds. Every variant's
logits are compared with the first's (greedy tokens, max difference), so a
variant that computes something else shows.

The timeline: a profiler trace of replays of the first and of the ``--trace``
variants. With PDL kernels overlap, so a kernel is charged the time from the
end of the kernel before it to its own end (the step's critical path), summed
by kernel name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from loraserve.kernels import dense_gemm, lora_config
from loraserve.kernels import paged_attention as pa
from offline import machine, make_prompts

from kernels import replay_ms  # benchmarks/kernels.py
from loraserve import LLM, SamplingParams
from loraserve.engine.output_processor import OutputProcessor
from loraserve.worker import cuda_graphs


def _cfg(block_n, block_k, split, warps=4, stages=4) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": warps,
            "num_stages": stages}


NO_FUSE = {"LORASERVE_FUSE_SILU": "0"}
GATE_UP_SILU = "T32_N28672_K4096_SILU"
DOWN, O_PROJ, QKV = "T32_N4096_K14336", "T32_N4096_K4096", "T32_N6144_K4096"


def _values_masked(attention):
    # Decode attention as if block 0 of the cache did not hold zeros.
    def call(*args, **kwargs):
        return attention(*args, **{**kwargs, "block0_zeros": False})
    return call


def _attention(block_n: int, warps: int, stages: int):
    # Decode attention with this tiling (one query per tile).
    def pick(max_query_len, group, head_dim, dtype, pairs_per_sm=0.0):
        return pa.AttentionConfig(1, block_n, warps, stages)
    return pick


# Two splits of the keys at batch 32 (the policy sees more SMs than pairs).
TWO_SPLITS = {(pa, "MAX_SPLITS"): 2, (pa, "_num_sms"): lambda device: 512}
# Decode attention's key addresses as before the twelfth session: per-key division
# and modulo, int64 offsets.
OLD_ADDRESSING = {(pa, "DECODE_ALIGNED_KEYS"): False,
                  (pa, "offsets_fit_int32"): lambda cache: False}
V_MASKED = {(pa, "paged_attention"): _values_masked(pa.paged_attention)}

# name -> (environment, {dense table key: entry}, {(module, attribute): value}):
# the switches, and configs tried against the defaults (benchmarks/RESULTS.md).
VARIANTS = {
    "default": ({}, {}, {}),
    # The default again, later in the same run: the spread of a replay.
    "default_again": ({}, {}, {}),
    "no_fused_silu": (NO_FUSE, {}, {}),
    "no_pdl": ({"LORASERVE_PDL": "0"}, {}, {}),
    "no_fused_rotary": ({"LORASERVE_FUSE_ROTARY": "0"}, {}, {}),
    # Stage counts at which Triton's pipeliner double- or triple-buffers the decode
    # loop's K/V (sm_90, Triton 3.6; at 2-4 stages it keeps one buffer).
    "attn_64_5": ({}, {}, {(pa, "pick_config"): _attention(64, 4, 5)}),
    "attn_64_7": ({}, {}, {(pa, "pick_config"): _attention(64, 4, 7)}),
    "attn_32_8": ({}, {}, {(pa, "pick_config"): _attention(32, 4, 8)}),
    # Decode attention's split cap before the eleventh session; 128-key tiles also
    # below a pair per SM.
    "attn_32_splits": ({}, {}, {(pa, "MAX_SPLITS"): 32}),
    "attn_128_3": ({}, {}, {(pa, "pick_config"): _attention(128, 4, 3)}),
    "attn_64_3": ({}, {}, {(pa, "pick_config"): _attention(64, 4, 3)}),
    "attn_seqs_adjacent": ({}, {}, {(pa, "DECODE_HEADS_ADJACENT"): False}),
    "attn_128_w8": ({}, {}, {(pa, "pick_config"): _attention(128, 8, 3)}),
    "attn_2_splits": ({}, {}, TWO_SPLITS),
    "attn_64_2": ({}, {}, {(pa, "pick_config"): _attention(64, 4, 2)}),
    "attn_32_4": ({}, {}, {(pa, "pick_config"): _attention(32, 4, 4)}),
    "attn_32_w2_4": ({}, {}, {(pa, "pick_config"): _attention(32, 2, 4)}),
    "attn_64_w2_3": ({}, {}, {(pa, "pick_config"): _attention(64, 2, 3)}),
    "attn_128_2": ({}, {}, {(pa, "pick_config"): _attention(128, 4, 2)}),
    "attn_64_3_2_splits": ({}, {}, {**TWO_SPLITS, (pa, "pick_config"): _attention(64, 4, 3)}),
    # Decode attention's key addresses as before the twelfth session: per key
    # division and modulo (unaligned tiles), int64 offsets, or both.
    "attn_unaligned": ({}, {}, {(pa, "DECODE_ALIGNED_KEYS"): False}),
    "attn_offsets_64": ({}, {}, {(pa, "offsets_fit_int32"): lambda cache: False}),
    "attn_untrimmed": ({}, {}, {(pa, "DECODE_LOOP_TRIM"): False}),
    "attn_v_masked": ({}, {}, V_MASKED),
    "attn_old_addressing": ({}, {}, OLD_ADDRESSING),
    "attn_128_3_2_splits": ({}, {}, {**TWO_SPLITS, (pa, "pick_config"): _attention(128, 4, 3)}),
    # The eleventh session's batch-32 decode attention, but for K loaded unmasked.
    "attn_eleventh": ({}, {}, {**OLD_ADDRESSING, **V_MASKED, (pa, "DECODE_LOOP_TRIM"): False,
                               (pa, "pick_config"): _attention(128, 4, 3)}),
    "prefetch_cols_0": ({}, {}, {(dense_gemm, "PREFETCH_COLUMNS"): 0}),
    "prefetch_cols_512": ({}, {}, {(dense_gemm, "PREFETCH_COLUMNS"): 512}),
    "silu_bk128_s5": ({}, {GATE_UP_SILU: _cfg(128, 128, 1, stages=5)}, {}),
    "down_bn64": ({}, {DOWN: _cfg(64, 128, 4)}, {}),
    "o_bn64_s3": ({}, {O_PROJ: _cfg(64, 128, 4, stages=3)}, {}),
    "qkv_ours": ({}, {QKV: _cfg(64, 128, 2)}, {}),
    "qkv_ours_bn32": ({}, {QKV: _cfg(32, 128, 1)}, {}),
    "qkv_ours_s4": ({}, {QKV: _cfg(64, 128, 4)}, {}),
    "down_bn64_s3": ({}, {DOWN: _cfg(64, 128, 3)}, {}),
    "down_bn32_k256": ({}, {DOWN: _cfg(32, 256, 1, stages=3)}, {}),
    "down_bn32_s6": ({}, {DOWN: _cfg(32, 128, 1, stages=6)}, {}),
    "down_bn64_x2": ({}, {DOWN: _cfg(64, 128, 2)}, {}),
    "down_st5": ({}, {DOWN: _cfg(128, 128, 4, stages=5)}, {}),
    "o_bn32_s6": ({}, {O_PROJ: _cfg(32, 128, 1, stages=6)}, {}),
    "o_bn64_x2": ({}, {O_PROJ: _cfg(64, 128, 2)}, {}),
    "o_bn32_k256": ({}, {O_PROJ: _cfg(32, 256, 1, stages=3)}, {}),
    "silu_k64_s8": ({}, {GATE_UP_SILU: _cfg(128, 64, 1, stages=8)}, {}),
    "silu_w8": ({}, {GATE_UP_SILU: _cfg(128, 128, 1, warps=8)}, {}),
    "silu_pf256": ({}, {GATE_UP_SILU: {**_cfg(128, 128, 1), "PREFETCH": 256}}, {}),
    "silu_pf512": ({}, {GATE_UP_SILU: {**_cfg(128, 128, 1), "PREFETCH": 512}}, {}),
    "down_pf0": ({}, {DOWN: {**_cfg(128, 128, 4), "PREFETCH": 0}}, {}),
    "o_pf512": ({}, {O_PROJ: {**_cfg(64, 128, 4), "PREFETCH": 512}}, {}),
    "torch_argmax": ({}, {}, {(cuda_graphs, "argmax"):
                              lambda logits, out: torch.argmax(logits, dim=-1, out=out)}),
}


@contextmanager
def variant(env: dict, table: dict, attrs: dict):
    saved_env = {k: os.environ.get(k) for k in env}
    dense = lora_config._tuned_table().setdefault("dense", {})
    saved_table = {k: dense.get(k) for k in table}
    saved_attrs = {key: getattr(*key) for key in attrs}
    os.environ.update(env)
    for key, entry in table.items():
        dense[key] = entry
    for (module, name), value in attrs.items():
        setattr(module, name, value)
    lora_config.dense_tuned.cache_clear()
    lora_config.dense_config.cache_clear()
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in saved_table.items():
            if v is None:
                dense.pop(k, None)
            else:
                dense[k] = v
        for (module, name), value in saved_attrs.items():
            setattr(module, name, value)
        lora_config.dense_tuned.cache_clear()
        lora_config.dense_config.cache_clear()


def capture_step(graphs, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    case = graphs.cases[0]
    graphs._forward(batch, case)  # compiles this variant's kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=graphs.pool):
        logits = graphs._forward(batch, case)
    return graph, logits


def short_name(name: str) -> str:
    name = re.sub(r"<.*|\(.*", "", name)
    return name.removeprefix("void ")[:40]


def timeline(graph: torch.cuda.CUDAGraph, reps: int = 3) -> dict:
    """Critical-path time per kernel name over ``reps`` replays, µs per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, short_name(e.name))
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
    )
    charged: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    last_end, prev = None, "step start"
    for start, end, name in kernels:
        if last_end is None:
            last_end = start
        # The kernel before tells apart launches of one kernel (the GEMM after the
        # norm is gate/up, after the GEMM down...). A gap before a kernel is
        # charged to it too: the step waited for it.
        label = f"{name} after {prev}"
        charged[label] += max(0.0, end - last_end)
        counts[label] += 1
        last_end, prev = max(last_end, end), name
    total = sum(charged.values())
    return {
        "per_step_us": total / reps,
        "kernels": {n: {"us_per_step": charged[n] / reps, "launches_per_step": counts[n] / reps}
                    for n in sorted(charged, key=charged.get, reverse=True)},
    }


def engine_loop(llm: LLM, steps: int, traced: dict) -> dict:
    """Real engine steps (the engine's own graphs, default switches): wall time a
    step against a replay of its graph, and the device work a step does outside
    the graph (input copies, sampling), from a profile of a few steps."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from loraserve.worker import sampler

    engine = llm.engine
    processor = _processor(llm)
    graph_kernels = {k.split(" after ")[0] for t in traced.values() for k in t["kernels"]}
    # Time the host spends waiting for the device (reading a step's tokens back):
    # near 0 means the host loop, not the device, sets the pace.
    blocked = [0.0]
    real_to_host = sampler.SampledBatch.to_host

    def timed_to_host(self):
        t0 = time.perf_counter()
        if self.ready is not None:
            self.ready.synchronize()
        blocked[0] += time.perf_counter() - t0
        return real_to_host(self)

    sampler.SampledBatch.to_host = timed_to_host
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        processor.process_outputs(engine.step().outputs)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    sampler.SampledBatch.to_host = real_to_host
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps // 2):
        processor.process_outputs(engine.step().outputs)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    profiled = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            processor.process_outputs(engine.step().outputs)
        torch.cuda.synchronize()
    outside: dict[str, float] = defaultdict(float)
    busy = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= 0:
            continue
        busy.append((e.time_range.start, e.time_range.end))
        name = short_name(e.name)
        if name not in graph_kernels:
            outside[name] += (e.time_range.end - e.time_range.start) / profiled
    busy.sort()
    union, span_end = 0.0, None
    for a, b in busy:
        if span_end is None or a > span_end:
            union += b - a
            span_end = b
        elif b > span_end:
            union += b - span_end
            span_end = b
    window = (busy[-1][1] - busy[0][0]) if busy else 0.0
    return {
        "wall_ms_per_step": wall_ms,
        "host_blocked_ms_per_step": blocked[0] * 1e3 / steps,
        "host_profile": text.getvalue().splitlines()[:60],
        "device_busy_fraction": union / window if window else None,
        "outside_graph_us_per_step": dict(sorted(outside.items(), key=lambda kv: -kv[1])[:15]),
    }


def _processor(llm: LLM) -> OutputProcessor:
    if not hasattr(llm, "_bench_processor"):
        llm._bench_processor = OutputProcessor(llm.tokenizer)
    return llm._bench_processor


def fill_batch(llm: LLM, batch: int, context: int) -> None:
    engine = llm.engine
    vocab = llm.config.model_config.hf_config.vocab_size
    processor = _processor(llm)
    params = SamplingParams(temperature=0.0, max_tokens=4 * context, ignore_eos=True)
    prompt_len = 64
    for i, prompt in enumerate(make_prompts(batch, prompt_len, vocab)):
        for ecr in processor.add_request(str(i), None, prompt["prompt_token_ids"], params,
                                         None, None):
            engine.add_request(ecr)
    for _ in range(context - prompt_len):
        processor.process_outputs(engine.step().outputs)
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--trace", nargs="*", default=["no_fused_silu"])
    p.add_argument("--loop-steps", type=int, default=100,
                   help="then time this many real engine steps against the replay")
    p.add_argument("--json", type=Path)
    p.add_argument("--md", type=Path)
    args = p.parse_args()

    llm = LLM(args.model, load_format=args.load_format, max_num_seqs=args.batch)
    fill_batch(llm, args.batch, args.context)
    graphs = llm.engine.runner.graphs
    results = {"machine": machine(), "batch": args.batch, "context": args.context, "variants": {}}
    first_logits = None
    traced = {}
    # A replay feeds the tokens it samples to the next one (graphs.sampled): every
    # variant's logits are taken from the batch's real inputs, put back first.
    real_inputs = graphs.step_inputs.clone()
    for name in args.variants:
        env, table, attrs = VARIANTS[name]
        with variant(env, table, attrs):
            graph, logits = capture_step(graphs, args.batch)
            ms = replay_ms(graph, rounds=7, reps=20)
            graphs.step_inputs.copy_(real_inputs)
            graph.replay()
            out = logits.float()
            if first_logits is None:
                first_logits = out.clone()
            row = {
                "step_ms": ms,
                "tok_per_s": args.batch / ms * 1e3,
                "same_greedy_tokens": int((out.argmax(-1) == first_logits.argmax(-1)).sum()),
                "max_abs_logit_diff": float((out - first_logits).abs().max()),
            }
            if name == args.variants[0] or name in args.trace:
                traced[name] = timeline(graph)
            del graph
        results["variants"][name] = row
        print(name, json.dumps(row), flush=True)
    results["timelines"] = traced
    graphs.step_inputs.copy_(real_inputs)
    if args.loop_steps:
        results["engine_loop"] = engine_loop(llm, args.loop_steps, traced)
        print(json.dumps(results["engine_loop"], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.md:
        args.md.write_text(to_markdown(results))
    print(to_markdown(results))


def to_markdown(results: dict) -> str:
    lines = [f"Batch {results['batch']}, context {results['context']}, {results['machine']}",
             "", "| variant | step ms | tok/s | same tokens | max logit diff |",
             "|---|---|---|---|---|"]
    for name, r in results["variants"].items():
        lines.append(f"| {name} | {r['step_ms']:.3f} | {r['tok_per_s']:.0f} | "
                     f"{r['same_greedy_tokens']}/{results['batch']} | "
                     f"{r['max_abs_logit_diff']:.3g} |")
    for name, t in results["timelines"].items():
        lines += ["", f"Timeline of `{name}`: {t['per_step_us']:.0f} µs a step (critical path)",
                  "", "| kernel | µs a step | launches |", "|---|---|---|"]
        for k, v in list(t["kernels"].items())[:24]:
            lines.append(f"| {k} | {v['us_per_step']:.0f} | {v['launches_per_step']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
