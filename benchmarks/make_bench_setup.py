"""Make the benchmark setup with no download: a Llama-3-8B-shaped model directory
(config.json + a tokenizer; weights come from `--load-format dummy`) and N random
rank-R PEFT adapters named lora0 .. lora{N-1}, over all seven projections or the
ones --target-modules names.

    python -m benchmarks.make_bench_setup --out /tmp/bench --num-adapters 32 --rank 16

Many adapters quickly: `--distinct K` draws K weight files and hard-links the
others to them (adapter i shares adapter i mod K's files), which is what a
throughput run needs (the server loads each name as its own adapter); the
default draws every adapter's weights, as a correctness test needs.

    python -m benchmarks.make_bench_setup --out /tmp/bench/many \\
        --base-model /tmp/bench/llama3-8b-shape --num-adapters 1024 --distinct 8 \\
        --rank 8 --target-modules attention

Beside the adapters it writes what registers them all with a server:
OUT/lora_modules.txt, one `name=path` a line (the words of `--lora-modules`),
and OUT/lora_modules.json, a `loraserve serve --config` file whose `lora-modules`
list holds one {"name": ..., "path": ...} object per adapter:

    loraserve serve /tmp/bench/llama3-8b-shape --load-format dummy --enable-lora \\
        --max-cpu-loras 128 --config /tmp/bench/many/lora_modules.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.synthetic import (
    ATTENTION,
    LLAMA3_8B,
    TOKENIZERS,
    projection_shapes,
    write_adapter,
    write_model,
)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TARGET_GROUPS = {
    "all": tuple(projection_shapes(LLAMA3_8B)),
    "attention": ATTENTION,
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def distinct_count(value: str) -> int | None:
    """K (at least 1), or all (None: every adapter its own weights)."""
    if value == "all":
        return None
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError("--distinct is a count >= 1, or all")
    return count


def target_modules(names: list[str]) -> tuple[str, ...]:
    """The projections named, with the groups all, attention and mlp expanded,
    in the model's order."""
    chosen = {m for name in names for m in TARGET_GROUPS.get(name, (name,))}
    return tuple(m for m in TARGET_GROUPS["all"] if m in chosen)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.make_bench_setup",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--num-adapters", type=int, default=32)
    p.add_argument("--distinct", type=distinct_count, default=None, metavar="K|all",
                   help="distinct weight files, the other adapters hard links to them "
                        "(default all: every adapter its own weights)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--target-modules", nargs="+", default=["all"],
                   choices=[*TARGET_GROUPS, *TARGET_GROUPS["all"]],
                   help="projections the adapters cover (default all seven)")
    p.add_argument("--num-layers", type=int, default=32,
                   help="layers of the Llama-3-8B-shaped model written")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="words",
                   help="the model's made-up tokenizer: one word a token (words), or "
                        "byte-level (bytes), which can write JSON for structured outputs")
    p.add_argument("--base-model", type=Path, default=None,
                   help="a model folder to make adapters for (its config.json) instead of "
                        "writing the Llama-3-8B-shaped one")
    p.add_argument("--prefix", default="lora", help="adapter names: PREFIX0 .. PREFIX{N-1}")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0, help="adapter k is drawn from seed + k")
    args = p.parse_args(argv)
    if args.num_adapters < 0:
        p.error("--num-adapters must be at least 0")
    if args.rank < 1:
        p.error("--rank must be at least 1")
    if args.base_model is not None and not (args.base_model / "config.json").is_file():
        p.error(f"--base-model {args.base_model} has no config.json")
    return args


def link_adapter(source: Path, path: Path) -> None:
    """path's files as hard links to source's (replacing what was there)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        (path / name).unlink(missing_ok=True)
        os.link(source / name, path / name)


def write_adapters(root: Path, config: dict, args: argparse.Namespace,
                   base_model: str) -> list[tuple[str, Path]]:
    """The adapters (name, folder): the first K drawn, the rest linked to them."""
    distinct = args.num_adapters if args.distinct is None else min(args.distinct,
                                                                   args.num_adapters)
    # Drawn on the GPU when there is one: 32 rank-16 adapters of 44M numbers each.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    targets = target_modules(args.target_modules)
    dtype = getattr(torch, args.dtype)
    adapters = []
    for i in range(args.num_adapters):
        name = f"{args.prefix}{i}"
        path = (root / name).absolute()
        if i < distinct:
            # A file left by an earlier run may be a hard link: writing through it
            # would change the adapter it shares its inode with.
            for file in ADAPTER_FILES:
                (path / file).unlink(missing_ok=True)
            write_adapter(path, config, args.rank, seed=args.seed + i, base_model=base_model,
                          dtype=dtype, device=device, targets=targets)
        else:
            link_adapter(adapters[i % distinct][1], path)
        adapters.append((name, path))
    return adapters


def write_registration(out: Path, adapters: list[tuple[str, Path]]) -> tuple[Path, Path]:
    """OUT/lora_modules.txt (name=path lines) and OUT/lora_modules.json (a
    `loraserve serve --config` file registering every adapter)."""
    words = out / "lora_modules.txt"
    words.write_text("".join(f"{name}={path}\n" for name, path in adapters))
    config = out / "lora_modules.json"
    # One adapter a line: a JSON document that is also the YAML --config reads.
    entries = ",\n".join(json.dumps({"name": name, "path": str(path)})
                         for name, path in adapters)
    config.write_text(f'{{"lora-modules": [\n{entries}\n]}}\n')
    return words, config


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.base_model is None:
        model_dir = write_model(args.out, args.num_layers, args.tokenizer)
        base_model = "llama3-8b-shape"
    else:
        model_dir = args.base_model
        base_model = str(model_dir.absolute())
    config = json.loads((model_dir / "config.json").read_text())
    adapters = write_adapters(args.out / "adapters", config, args, base_model)
    words, serve_config = write_registration(args.out, adapters)
    summary = {"model": str(model_dir), "adapters": str(args.out / "adapters"),
               "num_adapters": len(adapters),
               "distinct": len(adapters) if args.distinct is None else min(args.distinct,
                                                                           len(adapters)),
               "lora_modules": str(words), "config": str(serve_config)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
