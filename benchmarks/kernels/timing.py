"""Timing of kernels on the device: CUDA graphs replayed and timed with events
or triton's do_bench, and the device-to-device copy bandwidth that kernels'
GB/s are compared with."""

from __future__ import annotations

import statistics

import torch
import triton.testing

# A timed graph or eager function makes this many calls (over independent inputs).
CALLS_PER_TIMING = 8


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one run of fn, after a warm-up run on a side stream (which
    compiles kernels and sizes workspaces), as torch asks before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, rounds: int = 1, reps: int = 50) -> float:
    """ms of one replay of a captured graph: the median over ``rounds`` of ``reps``
    back-to-back replays (after one replay to warm up)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def median_replay_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of a graph that runs ``fn`` once, each replay timed
    alone with events (a few replays first)."""
    graph = capture_graph(fn)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def time_graph(fn, calls: int = CALLS_PER_TIMING) -> float:
    """Median µs of one call, from replays of a graph of fn, which makes `calls` calls."""
    graph = capture_graph(fn)
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
    del graph
    return ms * 1e3 / calls


def time_eager(fn) -> float:
    """Median µs of one call, from eager runs of fn, which makes CALLS_PER_TIMING calls."""
    fn()
    ms = triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
    return ms * 1e3 / CALLS_PER_TIMING
