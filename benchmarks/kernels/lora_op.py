"""Benchmark loraserve.kernels.add_lora_linear against a torch gather + bmm reference.

Run on a CUDA machine:

    python -m benchmarks.kernels.lora_op --json out.json --md out.md

Every point is timed two ways: replaying a CUDA graph, and eagerly. A timed
call cycles through several independent sets of (x, y, A, B) so that the
inputs come from device memory rather than L2 (as in a model, where each
layer has its own weights), and triton's do_bench clears L2 before each
measurement. The metadata (tokens grouped by slot) is built once per step in
the engine, so it is outside the timed region; its own cost is reported
separately.

Bytes that must move: x once, the A and B of the adapters used, y read and
written. GB/s is that over the median time, and "% copy" compares it with a
device-to-device copy measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import triton

from benchmarks.kernels.timing import (
    CALLS_PER_TIMING,
    copy_bandwidth,
    time_eager,
    time_graph,
)
from loraserve.kernels.lora_meta import LoRAMetadata
from loraserve.kernels.lora_ops import add_lora_linear
from loraserve.kernels.lora_shrink import workspace_numel

SHAPES = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o 4096->4096": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
TOKENS = [1, 16, 64, 256, 1024, 4096]
RANKS = [8, 16, 64]
ADAPTERS = [1, 8, 32]
NUM_SLOTS = 32
# Targets (graph replay, bf16, rank 16): the best public Triton LoRA kernels.
TARGETS = {
    ("qkv", 1): {1: 13.0, 64: 13.0, 1024: 50.0, 4096: 195.0},
    ("qkv", 32): {1: 17.5, 64: 130.0, 1024: 224.0, 4096: 714.0},
    ("o 4096->4096", 32): {1: 7.8, 64: 22.0, 1024: 37.0, 4096: 120.0},
}
# Total size of the rotated input sets: a few times the 60 MB L2 of an H200.
ROTATE_BYTES = 256 << 20


def torch_reference(y, x, lora_a, lora_b, idx):
    """Gather each token's A/B, then two batched matmuls per slice (all tokens have a slot)."""
    off = 0
    for a, b in zip(lora_a, lora_b, strict=True):
        n = b.shape[1]
        xa = torch.bmm(x.unsqueeze(1), a[idx].transpose(1, 2))
        y[:, off : off + n] += torch.bmm(xa, b[idx].transpose(1, 2)).squeeze(1)
        off += n


def run_point(shape, k, widths, r, n_adapters, t, copy_bw, with_ref=True):
    dtype = torch.bfloat16
    n_total = sum(widths)
    ns = len(widths)
    elem = 2
    weights = NUM_SLOTS * (ns * r * k + n_total * r) * elem
    acts = t * (k + n_total) * elem
    n_sets = max(1, min(CALLS_PER_TIMING, ROTATE_BYTES // (weights + acts)))
    gen = torch.Generator(device="cuda").manual_seed(t * 7 + r + n_adapters)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(t, k, device="cuda", generator=gen).to(dtype)
        y = torch.randn(t, n_total, device="cuda", generator=gen).to(dtype)
        a = [
            (torch.randn(NUM_SLOTS, r, k, device="cuda", generator=gen) / 64).to(dtype)
            for _ in widths
        ]
        b = [
            (torch.randn(NUM_SLOTS, n, r, device="cuda", generator=gen) / 8).to(dtype)
            for n in widths
        ]
        sets.append((y, x, a, b))
    # Tokens spread round-robin over n_adapters distinct slots, in random order.
    chosen = torch.randperm(NUM_SLOTS, generator=gen, device="cuda")[:n_adapters]
    order = torch.randperm(t, generator=gen, device="cuda")
    slots = chosen[torch.arange(t, device="cuda") % n_adapters][order].to(torch.int32)
    used = min(n_adapters, t)
    idx = slots.long()

    meta = LoRAMetadata(max_tokens=t, num_slots=NUM_SLOTS, device="cuda")
    meta.update(slots)
    meta.ensure_workspace(workspace_numel(t, k, r, ns))

    def ours():
        for i in range(CALLS_PER_TIMING):
            y, x, a, b = sets[i % n_sets]
            add_lora_linear(y, x, a, b, slots, meta)

    def ref():
        for i in range(CALLS_PER_TIMING):
            y, x, a, b = sets[i % n_sets]
            torch_reference(y, x, a, b, idx)

    # Correctness spot check against the reference before timing.
    y, x, a, b = sets[0]
    y1, y2 = y.clone(), y.clone()
    add_lora_linear(y1, x, a, b, slots, meta)
    torch_reference(y2, x, a, b, idx)
    upd = (y2.float() - y.float()).norm().clamp(min=1e-6)
    rel_err = ((y1.float() - y2.float()).norm() / upd).item()

    row = {
        "shape": shape,
        "K": k,
        "N": widths,
        "R": r,
        "adapters": n_adapters,
        "T": t,
        "rel_err_vs_torch": rel_err,
    }
    row["ours_graph_us"] = time_graph(ours)
    row["ours_eager_us"] = time_eager(ours)
    if with_ref:
        row["torch_graph_us"] = time_graph(ref)
        row["torch_eager_us"] = time_eager(ref)
    nbytes = (t * k + used * (ns * r * k + n_total * r) + 2 * t * n_total) * elem
    row["bytes"] = nbytes
    row["GBps"] = nbytes / (row["ours_graph_us"] * 1e-6) / 1e9
    row["copy_frac"] = nbytes / (row["ours_graph_us"] * 1e-6) / copy_bw
    target = TARGETS.get((shape, n_adapters), {}).get(t) if r == 16 else None
    if target is not None:
        row["target_us"] = target
        row["speedup_vs_target"] = target / row["ours_graph_us"]
    return row


def metadata_cost(t: int) -> dict:
    slots = torch.randint(-1, NUM_SLOTS, (t,), dtype=torch.int32, device="cuda")
    meta = LoRAMetadata(max_tokens=t, num_slots=NUM_SLOTS, device="cuda")

    def fn():
        for _ in range(CALLS_PER_TIMING):
            meta.update(slots)

    return {"T": t, "graph_us": time_graph(fn), "eager_us": time_eager(fn)}


def fmt_table(rows, copy_bw):
    lines = [
        "| shape | R | adapters | T | ours graph µs | ours eager µs | torch graph µs "
        "| torch eager µs | GB/s | % copy | target µs | speedup vs target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in rows:
        tgt = w.get("target_us")
        sp = w.get("speedup_vs_target", 0.0)
        lines.append(
            f"| {w['shape']} | {w['R']} | {w['adapters']} | {w['T']} "
            f"| {w['ours_graph_us']:.1f} | {w['ours_eager_us']:.1f} "
            f"| {w.get('torch_graph_us', float('nan')):.1f} "
            f"| {w.get('torch_eager_us', float('nan')):.1f} "
            f"| {w['GBps']:.0f} | {100 * w['copy_frac']:.0f}% "
            f"| {'' if tgt is None else f'{tgt:g}'} "
            f"| {'' if tgt is None else f'{sp:.2f}x'} |"
        )
    return "\n".join(lines)


def summary(rows, copy_bw):
    sp = [w["speedup_vs_target"] for w in rows if "speedup_vs_target" in w]
    big = [w["copy_frac"] for w in rows if w["T"] >= 1024]
    big16 = [w["copy_frac"] for w in rows if w["T"] >= 1024 and w["R"] == 16]
    vs_torch = [w["torch_graph_us"] / w["ours_graph_us"] for w in rows if "torch_graph_us" in w]
    out = [
        f"- copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s",
        f"- targets: {len(sp)} points, all beaten: {all(s > 1 for s in sp)}, "
        f"geomean speedup {math.exp(statistics.fmean(math.log(s) for s in sp)):.2f}x, "
        f"min {min(sp):.2f}x"
        if sp
        else "- no target points",
    ]
    if big:
        out.append(
            f"- T >= 1024: fraction of copy bandwidth min {100 * min(big):.0f}%, "
            f"median {100 * statistics.median(big):.0f}% (rank 16 only: min "
            f"{100 * min(big16):.0f}%, median {100 * statistics.median(big16):.0f}%)"
        )
    if vs_torch:
        out.append(
            f"- vs torch gather+bmm (graph): geomean "
            f"{math.exp(statistics.fmean(math.log(s) for s in vs_torch)):.1f}x faster"
        )
    worst = max(w["rel_err_vs_torch"] for w in rows)
    out.append(f"- largest relative error of the update vs torch: {worst:.2e}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write all rows here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--quick", action="store_true", help="rank 16 only, no torch reference")
    p.add_argument("--no-ref", action="store_true", help="skip the torch reference")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    ranks = [16] if args.quick else RANKS
    rows = []
    t0 = time.time()
    for shape, (k, widths) in SHAPES.items():
        for r in ranks:
            for n in ADAPTERS:
                for t in TOKENS:
                    if n > 1 and t == 1 and n != 32:
                        continue  # one token uses one adapter: same as n=1/32
                    w = run_point(
                        shape, k, widths, r, n, t, copy_bw, with_ref=not (args.quick or args.no_ref)
                    )
                    rows.append(w)
                    print(
                        f"{shape:13s} R{r:<3d} A{n:<3d} T{t:<5d} ours {w['ours_graph_us']:8.1f}us "
                        f"graph {w['ours_eager_us']:8.1f}us eager "
                        f"torch {w.get('torch_graph_us', float('nan')):9.1f}us "
                        f"{100 * w['copy_frac']:5.1f}% copy"
                        + (
                            f"  target {w['target_us']:g} ({w['speedup_vs_target']:.2f}x)"
                            if "target_us" in w
                            else ""
                        ),
                        flush=True,
                    )
    meta_rows = [metadata_cost(t) for t in TOKENS]
    table = fmt_table(rows, copy_bw)
    summ = summary(rows, copy_bw)
    meta_txt = "\n".join(
        f"- metadata update (sort by slot), T={m['T']}: {m['graph_us']:.1f} µs graph, "
        f"{m['eager_us']:.1f} µs eager"
        for m in meta_rows
    )
    print(summ)
    print(meta_txt)
    print(f"elapsed {time.time() - t0:.0f}s")
    if args.md:
        with open(args.md, "w") as f:
            f.write(
                f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"triton {triton.__version__}\n\n{summ}\n{meta_txt}\n\n{table}\n"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": copy_bw, "rows": rows, "metadata": meta_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
