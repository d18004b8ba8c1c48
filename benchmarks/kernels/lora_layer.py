"""What LoRA adds to one linear layer of the Llama-3-8B shape, on CUDA.

    python -m benchmarks.kernels.lora_layer --json lora_layer.json

For each layer class (merged QKV, o, merged gate/up, down) and token count T,
with rank-16 adapters in 32 slots and every token on one of them (mixed), it
times by CUDA graph replay (bf16):

  base    y = x @ W.T
  lora    y = x @ W.T, then add_lora_linear(y, ...)
  beside  what LinearWithLoRA does (TritonPunicaWrapper.linear): the shrink on a side
          stream beside x @ W.T, then the expand
  alone   add_lora_linear(y, ...) by itself

and reports each, with the LoRA overhead (lora - base). For the merged gate/up
layer it also times the layer with its activation:

  base     silu_and_mul(x @ W.T)
  unfused  x @ W.T, add_lora_linear, then silu_and_mul
  fused    silu_and_mul_lora(x @ W.T, ...) (the update added inside the activation)
  beside   the fused path with the shrink beside the GEMM, as the model runs it
           (TritonPunicaWrapper.linear_silu_and_mul)

Each timed call cycles through independent weight and activation sets, so
weights come from device memory as in a model.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.kernels.timing import time_graph
from benchmarks.kernels.tune_kernels import SHRINK_CLASSES as SHAPES  # Llama-3-8B: (K, slices)
from benchmarks.results import command_words
from loraserve.kernels.activation import silu_and_mul
from loraserve.kernels.lora_activation import silu_and_mul_lora
from loraserve.kernels.lora_ops import add_lora_linear
from loraserve.lora.punica_triton import TritonPunicaWrapper

TOKENS = [1, 32, 256, 1024, 4096, 8192]
NUM_SLOTS = 32
RANK = 16
# Rotated sets of weights and activations: a few times the 60 MB L2 of an H200.
ROTATE_BYTES = 600 << 20
MAX_SETS = 4


def make_sets(name: str, t: int, num_adapters: int):
    """Rotated (W, x, y, A, B) sets of one layer class, and the step's metadata."""
    k, widths = SHAPES[name]
    n = sum(widths)
    dt = torch.bfloat16
    per_set = 2 * (n * k + t * (k + n) + NUM_SLOTS * RANK * (len(widths) * k + n))
    n_sets = max(2, min(MAX_SETS, ROTATE_BYTES // per_set))
    gen = torch.Generator(device="cuda").manual_seed(t + len(name))
    sets = []
    for _ in range(n_sets):
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dt)
        x = torch.randn(t, k, device="cuda", generator=gen).to(dt)
        y = torch.empty(t, n, device="cuda", dtype=dt)
        a = [(torch.randn(NUM_SLOTS, RANK, k, device="cuda", generator=gen) / k**0.5).to(dt)
             for _ in widths]
        b = [(torch.randn(NUM_SLOTS, m, RANK, device="cuda", generator=gen) / 4).to(dt)
             for m in widths]
        sets.append((w, x, y, a, b))
    slots = (torch.arange(t, device="cuda") % num_adapters).to(torch.int32)
    slots = slots[torch.randperm(t, device="cuda", generator=gen)]
    # The model's wrapper holds the step's metadata (and the side stream).
    punica = TritonPunicaWrapper(t, NUM_SLOTS, torch.device("cuda"))
    punica.update_mapping(slots.tolist())
    return sets, slots, punica


def run_point(name: str, t: int, num_adapters: int) -> dict:
    sets, slots, punica = make_sets(name, t, num_adapters)
    meta = punica.meta

    def base():
        for w, x, y, _, _ in sets:
            torch.mm(x, w.t(), out=y)

    def alone():
        for _, x, y, a, b in sets:
            add_lora_linear(y, x, a, b, slots, meta)

    def lora():
        for w, x, y, a, b in sets:
            torch.mm(x, w.t(), out=y)
            add_lora_linear(y, x, a, b, slots, meta)

    def beside():
        for w, x, y, a, b in sets:
            punica.linear(lambda x, w=w, y=y: torch.mm(x, w.t(), out=y), x, a, b)

    row = {"layer": name, "T": t, "adapters": num_adapters}
    for label, fn in (("base", base), ("lora", lora), ("beside", beside), ("alone", alone)):
        row[f"{label}_us"] = time_graph(fn, len(sets))
    row["overhead_us"] = row["lora_us"] - row["base_us"]
    return row


def run_activation_point(t: int, num_adapters: int) -> dict:
    sets, slots, punica = make_sets("gate_up", t, num_adapters)
    meta = punica.meta

    def base():
        for w, x, y, _, _ in sets:
            torch.mm(x, w.t(), out=y)
            silu_and_mul(y)

    def unfused():
        for w, x, y, a, b in sets:
            torch.mm(x, w.t(), out=y)
            add_lora_linear(y, x, a, b, slots, meta)
            silu_and_mul(y)

    def fused():
        for w, x, y, a, b in sets:
            torch.mm(x, w.t(), out=y)
            silu_and_mul_lora(y, x, a, b, meta)

    def beside():
        for w, x, y, a, b in sets:
            punica.linear_silu_and_mul(lambda x, w=w, y=y: torch.mm(x, w.t(), out=y), x, a, b)

    row = {"layer": "gate_up+act", "T": t, "adapters": num_adapters}
    for label, fn in (("base", base), ("unfused", unfused), ("fused", fused),
                      ("beside", beside)):
        row[f"{label}_us"] = time_graph(fn, len(sets))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--classes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    rows = []
    print("| layer | T | base µs | with LoRA µs | LoRA overhead µs | shrink beside µs "
          "| add_lora_linear alone µs |")
    print("|---|---|---|---|---|---|---|")
    for name in args.classes:
        for t in args.tokens:
            r = run_point(name, t, min(args.adapters, t))
            rows.append(r)
            torch.cuda.empty_cache()
            cells = [r[f"{c}_us"] for c in ("base", "lora", "overhead", "beside", "alone")]
            print(f"| {name} | {t} | " + " | ".join(f"{v:.1f}" for v in cells) + " |",
                  flush=True)
    print("\n| gate_up + activation | T | base µs | LoRA unfused µs | LoRA fused µs "
          "| fused, shrink beside µs |")
    print("|---|---|---|---|---|---|")
    for t in args.tokens:
        r = run_activation_point(t, min(args.adapters, t))
        rows.append(r)
        torch.cuda.empty_cache()
        cells = [r[f"{c}_us"] for c in ("base", "unfused", "fused", "beside")]
        print("| gate_up+act | " + f"{t} | " + " | ".join(f"{v:.1f}" for v in cells) + " |",
              flush=True)
    result = {"command": " ".join(["python", *command_words()[1:]]),
              "device": torch.cuda.get_device_name(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
