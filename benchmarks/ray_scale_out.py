"""Scale-out on Ray Serve: N engine replicas against one, on an adapter-heavy load.

Starts a local Ray cluster, then for each --replicas count runs `loraserve
serve-ray`'s application (the built-in SmolLM2-135M by default, on the CPU) with
--num-adapters random rank-R adapters and a per-replica bound of --max-cpu-loras,
and sends the same seeded workload to each: --num-requests completions, every one
to an adapter drawn uniformly, --concurrency in flight. It reports request and
token throughput, the throughput ratio to the first count, and the share of
requests that reached a replica already holding their adapter (the replica says
so in the x-loraserve-adapter-read header). Prints a markdown block.

    python -m benchmarks.ray_scale_out --replicas 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.synthetic import write_adapter

WORDS = ("river", "stone", "garden", "engine", "letter", "window", "market", "forest")


@dataclass
class RunResult:
    replicas: int
    wall_s: float
    requests: int
    output_tokens: int
    hits: int
    per_replica: dict[str, int]

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def workload(num_requests: int, num_adapters: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"a{rng.randrange(num_adapters)}",
             "Write about the " + " and the ".join(rng.sample(WORDS, 3)) + ".")
            for _ in range(num_requests)]


async def send_all(url: str, jobs: list[tuple[str, str]], concurrency: int,
                   output_len: int) -> tuple[float, list[httpx.Response]]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(model: str, prompt: str) -> httpx.Response:
            async with gate:
                response = await client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0.0, "ignore_eos": True})
            response.raise_for_status()
            return response

        start = time.perf_counter()
        replies = await asyncio.gather(*(one(m, p) for m, p in jobs))
        return time.perf_counter() - start, replies


def run_one(args: argparse.Namespace, replicas: int, model_argv: list[str], url: str,
            jobs: list[tuple[str, str]]) -> RunResult:
    from ray import serve

    from loraserve.cli_args import build_parser, build_server_settings, ray_options, validate_args
    from loraserve.ray.app import APP_NAME, build_application

    parsed = build_parser().parse_args([
        "serve-ray", *model_argv, "--num-replicas", str(replicas),
        "--replica-num-cpus", str(args.replica_num_cpus),
    ])
    validate_args(parsed)
    settings, tokenizer = build_server_settings(parsed)
    serve.run(build_application(settings, tokenizer, ray_options(parsed)), name=APP_NAME,
              route_prefix="/")
    try:
        # One base-model request per replica first: start-up is not part of the run.
        asyncio.run(send_all(url, [("base", "Hello")] * replicas, replicas, 2))
        wall, replies = asyncio.run(send_all(url, jobs, args.concurrency, args.output_len))
    finally:
        serve.delete(APP_NAME)
    return RunResult(
        replicas=replicas, wall_s=wall, requests=len(replies),
        output_tokens=sum(r.json()["usage"]["completion_tokens"] for r in replies),
        hits=sum(r.headers["x-loraserve-adapter-read"] == "0" for r in replies),
        per_replica=dict(Counter(r.headers["x-loraserve-replica"].rsplit("#", 1)[-1]
                                 for r in replies)),
    )


def report(args: argparse.Namespace, results: list[RunResult]) -> str:
    import ray

    first = results[0]
    lines = [
        f"### Ray Serve scale-out ({args.device})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}.",
        f"Command: `python -m benchmarks.ray_scale_out {shlex.join(sys.argv[1:])}`",
        f"Workload: {args.num_requests} completions to {args.num_adapters} rank-{args.rank} "
        f"adapters of {args.model} (uniform), {args.output_len} output tokens each, "
        f"{args.concurrency} in flight; per replica --max-loras {args.max_loras} "
        f"--max-cpu-loras {args.max_cpu_loras}, {args.replica_num_cpus} CPU"
        f"{', 1 GPU' if args.device == 'cuda' else ''}.",
        "",
        "| replicas | wall s | requests/s | output tokens/s | ratio to "
        f"{first.replicas} | adapter already held | requests per replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.replicas} | {r.wall_s:.1f} | {r.requests_per_s:.2f} | {r.tokens_per_s:.1f} "
            f"| {r.requests_per_s / first.requests_per_s:.2f} | {r.hits / r.requests:.0%} "
            f"| {', '.join(str(n) for n in sorted(r.per_replica.values(), reverse=True))} |"
        )
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per replica")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--replica-num-cpus", type=float, default=1.0)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--max-cpu-loras", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray
    from ray import serve

    from loraserve.config import EngineConfig

    os.environ.setdefault("LORASERVE_NO_PROGRESS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_path = EngineConfig.from_kwargs(model=args.model, device=args.device,
                                          load_format=args.load_format).model_config.model
    config = json.loads((Path(model_path) / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="loraserve-ray-bench-") as tmp:
        modules = []
        for i in range(args.num_adapters):
            write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i, base_model=args.model)
            modules.append(f"a{i}={tmp}/a{i}")
        model_argv = [args.model, "--device", args.device, "--load-format", args.load_format,
                      "--served-model-name", "base",
                      "--enable-lora", "--max-loras", str(args.max_loras),
                      "--max-cpu-loras", str(args.max_cpu_loras),
                      "--max-lora-rank", str(args.rank), "--lora-modules", *modules]
        jobs = workload(args.num_requests, args.num_adapters, args.seed)
        # Room for the largest count's replicas; the ingress and registry take none.
        ray.init(num_cpus=max(args.replicas) * args.replica_num_cpus,
                 include_dashboard=False, log_to_driver=False)
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            results = [run_one(args, n, model_argv, f"http://127.0.0.1:{port}", jobs)
                       for n in args.replicas]
        finally:
            serve.shutdown()
            ray.shutdown()
    print(report(args, results))


if __name__ == "__main__":
    main()
