"""Offline throughput at several tensor-parallel sizes, base vs LoRA.

Each size runs in its own process (an engine's GPU memory is only wholly given
back when its process ends), through offline.py's runs, and the report gives,
per size, base and LoRA output tokens/s, LoRA/base, and each size's throughput
over the first size's:

    python -m benchmarks.make_bench_setup --out /tmp/bench --num-adapters 32 --rank 16
    python -m benchmarks.tensor_parallel --model /tmp/bench/llama3-8b-shape \
        --load-format dummy --adapters /tmp/bench/adapters --sizes 1 2 \
        --num-requests 256 --input-len 512 --output-len 128 --json tp.json

Add ``--fully-sharded-loras`` to shard the adapters completely at sizes above 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.offline import run
from benchmarks.results import command, machine, write_results
from benchmarks.workload import (
    add_workload_arguments,
    mixed_adapters,
    workload_engine,
    workload_requests,
)


def one_size(args: argparse.Namespace) -> dict:
    """Base and LoRA runs at args.size ranks, in this process."""
    use_lora = args.adapters is not None
    llm = workload_engine(
        args, enable_prefix_caching=False, tensor_parallel_size=args.size,
        fully_sharded_loras=args.fully_sharded_loras and args.size > 1 and use_lora)
    prompts, params = workload_requests(llm, args)
    result = {"base": run(llm, prompts, params, None)}
    if use_lora:
        loras = mixed_adapters(args.adapters, args.num_adapters, len(prompts))
        result["lora"] = run(llm, prompts, params, loras)
        result["lora_over_base"] = (result["lora"]["output_tok_per_s"]
                                    / result["base"]["output_tok_per_s"])
    llm.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_workload_arguments(p)
    p.add_argument("--fully-sharded-loras", action="store_true")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)  # one size, in a child
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    if args.size is not None:
        args.json.write_text(json.dumps(one_size(args)))
        return
    results: dict = {"command": command(), "machine": machine()}
    child_args = list(sys.argv[1:])
    if "--json" in child_args:
        i = child_args.index("--json")
        del child_args[i:i + 2]
    if "--sizes" in child_args:
        i = child_args.index("--sizes")
        del child_args[i:i + 1 + len(args.sizes)]
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            out = Path(tmp) / f"tp{size}.json"
            subprocess.run([sys.executable, "-m", __spec__.name, *child_args,
                            "--size", str(size), "--json", str(out)], check=True)
            results[f"tp{size}"] = json.loads(out.read_text())
            print(json.dumps({f"tp{size}": results[f"tp{size}"]}), flush=True)
    first = results[f"tp{args.sizes[0]}"]
    for size in args.sizes[1:]:
        this = results[f"tp{size}"]
        for kind in ("base", "lora"):
            if kind in this:
                results[f"{kind}_tp{size}_over_tp{args.sizes[0]}"] = (
                    this[kind]["output_tok_per_s"] / first[kind]["output_tok_per_s"])
    write_results(results, args.json)


if __name__ == "__main__":
    main()
