"""Tune the decode GEMM (loraserve.kernels.dense_gemm) against cuBLAS, per layer shape.

Run on a CUDA machine:

    python -m benchmarks.kernels.tune_dense --out loraserve/kernels/configs/NVIDIA_H200.json \
        --merge --tokens 32 16 64 --md dense.md

For each linear layer of the Llama-3-8B shape (qkv, o, gate/up, down, lm_head)
and each batch size, it times a set of launch configs and torch's
``F.linear`` (cuBLAS) the same way: a CUDA graph that runs the layer once on
each of L copies of its weight, L chosen so that the copies hold at least 1 GB
(the weights stream from device memory, not L2, and the launches follow one
another as in a decode step); time per layer = replay time / L. The best config
goes to the table's "dense" section, or ``{"CUBLAS": 1}`` where none beats
cuBLAS (the Linear layer then keeps F.linear); the report ends with a whole decode step's
worth of GEMMs (32 layers and the LM head) for each, ours against cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.kernels.timing import copy_bandwidth, median_replay_ms
from loraserve.kernels import dense_gemm
from loraserve.kernels import lora_config as lc

# (name, N, K) of the Llama-3-8B shape, and how many of each a decode step runs.
SHAPES = [
    ("qkv", 6144, 4096, 32),
    ("o", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 1),
]
MIN_BYTES = 1 << 30
# Shared memory a program may use (an H100/H200 SM has 228 KB).
SMEM_LIMIT = 200 * 1024
DTYPE = torch.bfloat16


def candidates(m: int, n: int, k: int) -> list[dict]:
    block_m = lc.token_block(m)
    base_split = lc.default_dense_config(m, n, k)["SPLIT_K"]
    out = []
    for block_n, block_k, stages in itertools.product((32, 64, 128), (64, 128, 256), (3, 4, 5)):
        if stages * (block_n + block_m) * block_k * 2 > SMEM_LIMIT:
            continue
        tiles = math.ceil(n / block_n)
        # The heuristic's split for this tile count, and its neighbours.
        split0 = max(1, base_split * 64 // block_n)
        for split in sorted({max(1, split0 // 2), split0, split0 * 2}):
            if split > 32 or k < split * block_k or tiles * split < 66:
                continue
            out.append({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
                        "num_warps": 8 if block_n * block_k >= 128 * 256 else 4,
                        "num_stages": stages})

    # Nearest the heuristic first: the budget may end before the list does.
    def distance(c):
        return (abs(math.log2(c["BLOCK_N"] / 64)) + abs(math.log2(c["BLOCK_K"] / 128))
                + abs(c["num_stages"] - 4) + abs(math.log2(c["SPLIT_K"] * c["BLOCK_N"] / 64
                                                          / base_split)))

    return sorted(out, key=distance)


def time_layer(fn_of_weight, weights) -> float:
    """Median µs of one layer call, from replays of a graph over every weight copy."""
    ms = median_replay_ms(lambda: [fn_of_weight(w) for w in weights], reps=15)
    return ms * 1e3 / len(weights)


def tune_shape(name, n, k, m, budget_end, first=None):
    copies = max(1, math.ceil(MIN_BYTES / (n * k * 2)))
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    weights = [(torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(DTYPE)
               for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", generator=g).to(DTYPE)
    ref = F.linear(x.float(), weights[0].float())
    cublas = time_layer(lambda w: F.linear(x, w), weights)
    best = None
    tried = 0
    for cfg in ([first] if first else []) + candidates(m, n, k):
        if time.time() > budget_end:
            break
        y = dense_gemm.dense_linear(x, weights[0], config=cfg)
        err = (y.float() - ref).abs().max().item()
        if err > 0.05 * ref.abs().max().item():
            raise AssertionError(f"{name} M={m} {cfg}: max error {err}")
        us = time_layer(lambda w, cfg=cfg: dense_gemm.dense_linear(x, w, config=cfg), weights)
        tried += 1
        if best is None or us < best[0]:
            best = (us, cfg)
    default = lc.default_dense_config(m, n, k)
    default_us = time_layer(lambda w: dense_gemm.dense_linear(x, w, config=default), weights)
    del weights
    torch.cuda.empty_cache()
    return {"name": name, "M": m, "N": n, "K": k, "cublas_us": cublas, "default_us": default_us,
            "best_us": best[0] if best else None, "best": best[1] if best else None,
            "tried": tried, "bytes": n * k * 2}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="config table to write the dense section of")
    p.add_argument("--merge", action="store_true", help="keep the table's other entries")
    p.add_argument("--tokens", nargs="+", type=int, default=[32, 16, 64])
    p.add_argument("--budget-s", type=float, default=240)
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args()
    start = time.time()
    out = Path(args.out)
    table = json.loads(out.read_text()) if args.merge and out.is_file() else {}
    for key, value in lc.device_record().items():
        table.setdefault(key, value)
    dense = table.setdefault("dense", {})
    copy_bw = copy_bandwidth()
    rows = []
    # The first batch size gets most of the budget; the others share the rest.
    for i, m in enumerate(args.tokens):
        share = 0.6 if i == 0 else 0.4 / max(1, len(args.tokens) - 1)
        end = time.time() + share * (args.budget_s - (time.time() - start))
        for j, (name, n, k, _) in enumerate(SHAPES):
            shape_end = time.time() + (end - time.time()) / (len(SHAPES) - j)
            # The best config of the first batch size is the first tried at the others.
            first = next((r["best"] for r in rows if r["name"] == name), None)
            row = tune_shape(name, n, k, m, shape_end, first)
            rows.append(row)
            if row["best"] is not None and row["best_us"] < row["cublas_us"]:
                dense[lc.dense_key(m, n, k)] = row["best"]
            else:
                dense[lc.dense_key(m, n, k)] = {"CUBLAS": 1}
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(table, indent=1, sort_keys=True))
    lines = [f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + written)", "",
             "| layer | M | cuBLAS µs | default µs | best µs | best/cuBLAS | best TB/s | config |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        best = r["best_us"] or float("nan")
        lines.append(
            f"| {r['name']} | {r['M']} | {r['cublas_us']:.1f} | {r['default_us']:.1f} | "
            f"{best:.1f} | {best / r['cublas_us']:.3f} | {r['bytes'] / best / 1e6:.2f} | "
            f"{r['best']} |")
    lines += ["", "A decode step's GEMMs (32 layers + LM head), ms:", "",
              "| M | cuBLAS | ours (best of each; cuBLAS where it wins) | weights TB/s ours |",
              "|---|---|---|---|"]
    counts = {name: c for name, _, _, c in SHAPES}
    for m in args.tokens:
        sel = [r for r in rows if r["M"] == m]
        cub = sum(r["cublas_us"] * counts[r["name"]] for r in sel) / 1e3
        ours = sum(min(r["cublas_us"], r["best_us"] or math.inf) * counts[r["name"]]
                   for r in sel) / 1e3
        total_bytes = sum(r["bytes"] * counts[r["name"]] for r in sel)
        lines.append(f"| {m} | {cub:.3f} | {ours:.3f} | {total_bytes / ours / 1e9:.2f} |")
    report = "\n".join(lines)
    print(report)
    if args.md:
        Path(args.md).write_text(report + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw": copy_bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
