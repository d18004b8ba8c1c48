"""Start-up cost of LoRA: engine start, CUDA graph capture time and graph memory,
for the base model and with LoRA on, each in a fresh process, first on an empty
Triton cache and then again on the cache that start filled.

    python -m benchmarks.startup --model /tmp/bench/llama3-8b-shape --load-format dummy \
        --max-loras 8 --max-num-seqs 256 --json startup.json
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import tempfile
import time
from pathlib import Path

from benchmarks.results import command, write_results


def measure(kwargs: dict, cache_dir: str, queue, profile_to: str | None) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    from loraserve.config import EngineConfig
    from loraserve.engine.engine_core import EngineCore

    profiler = cProfile.Profile() if profile_to else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    core = EngineCore(EngineConfig.from_kwargs(**kwargs))
    if profiler:
        profiler.disable()
        with open(profile_to, "w") as f:
            for order in ("tottime", "cumulative"):
                pstats.Stats(profiler, stream=f).sort_stats(order).print_stats(40)
    graphs, pieces = core.executor.driver.graphs, core.executor.driver.pieces
    queue.put({
        "engine_start_s": time.perf_counter() - start,
        "graphs": len(graphs.graphs) if graphs else 0,
        "capture_s": graphs.capture_seconds if graphs else None,
        "capture_bytes": graphs.capture_bytes if graphs else None,
        "piecewise_capture_s": pieces.capture_seconds if pieces else None,
        "piecewise_capture_bytes": pieces.capture_bytes if pieces else None,
        "kv_blocks": core.kv.num_blocks,
    })


def run_fresh(kwargs: dict, cache_dir: str, profile_to: str | None) -> dict:
    # A process per engine: each measures its own memory.
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(kwargs, cache_dir, queue, profile_to))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def cold_and_warm(kwargs: dict, name: str, profile_dir: Path | None) -> dict:
    """A first start on an empty Triton cache (it pays every kernel compile), then a
    second start on the cache the first one filled (a restart)."""
    cache_dir = tempfile.mkdtemp(prefix="triton-cache-")
    return {
        start: run_fresh(kwargs, cache_dir,
                         str(profile_dir / f"{name}_{start}.txt") if profile_dir else None)
        for start in ("cold", "warm")
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--specialize-active-lora", action="store_true")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    p.add_argument("--json", type=Path)
    p.add_argument("--profile-dir", type=Path,
                   help="write a cProfile summary of each engine start here")
    args = p.parse_args()
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    common = {"model": args.model, "load_format": args.load_format,
              "max_num_seqs": args.max_num_seqs, "cudagraph_mode": args.cudagraph_mode}
    lora = cold_and_warm({**common, "enable_lora": True, "max_loras": args.max_loras,
                          "max_lora_rank": args.max_lora_rank,
                          "specialize_active_lora": args.specialize_active_lora},
                         "lora", args.profile_dir)
    base = cold_and_warm(common, "base", args.profile_dir)
    results = {"command": command(), "base": base, "lora": lora}
    for start in ("cold", "warm"):
        if base[start]["capture_s"]:
            results[f"capture_lora_over_base_{start}"] = (
                lora[start]["capture_s"] / base[start]["capture_s"])
    write_results(results, args.json)


if __name__ == "__main__":
    main()
