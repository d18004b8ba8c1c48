"""Make the benchmark setup with no download: a Llama-3-8B-shaped model directory
(config.json + a tokenizer; weights come from `--load-format dummy`) and N random
rank-R PEFT adapters over all seven projections.

    python -m benchmarks.make_bench_setup --out /tmp/bench --num-adapters 32 --rank 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.synthetic import LLAMA3_8B, write_adapter, write_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-adapters", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=32)
    args = parser.parse_args()
    model_dir = write_model(args.out, args.num_layers)
    config = dict(LLAMA3_8B, num_hidden_layers=args.num_layers)
    # Drawn on the GPU when there is one: 32 adapters of 44M numbers each.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i in range(args.num_adapters):
        write_adapter(args.out / "adapters" / f"lora{i}", config, args.rank, seed=i,
                      base_model="llama3-8b-shape", dtype=torch.bfloat16, device=device)
    print(json.dumps({"model": str(model_dir), "adapters": str(args.out / "adapters")}))


if __name__ == "__main__":
    main()
