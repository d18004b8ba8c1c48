"""Benchmark the MoE kernels against the torch path on Mixtral-8x7B layer shapes
(hidden 4096, expert intermediate 14336, 8 experts, top-2, bf16).

Run on a CUDA machine:

    python -m benchmarks.kernels.moe_lora [--tokens 16 64 256 1024] [--rank 16] [--adapters 4]

Three rows per token count, each the Triton op (``loraserve.kernels``) against
the torch path the CPU runs (``loraserve.model.moe_ops``):

- ``experts``: the experts of one MoE block, no adapter (grouped GEMM over
  experts vs a loop over experts);
- ``moe_lora gate_up``: the adapters' update on the experts' gate/up projection
  alone (shrink + expand over (slot, expert) groups, with its row grouping, vs a
  loop over experts and slots);
- ``experts + lora``: the whole block with every token on one of the adapters.

Times are medians of triton's do_bench (eager launches, L2 cleared between
runs). Prints a markdown table headed by the machine and the command line; each
row also gives the largest difference from the torch result, relative to its
largest value.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.results import command_words
from loraserve.model.moe_ops import ExpertsLoRA, add_expert_lora, torch_moe_experts

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
DEVICE = "cuda"


def torch_moe_lora(y, x, lora_a, lora_b, token_slots, topk_ids):
    """The torch path's update on one projection: per expert, per slot."""
    rows_of = topk_ids.flatten()
    slots = token_slots.repeat_interleave(TOP_K)
    for e in torch.unique(rows_of).tolist():
        rows = torch.nonzero(rows_of == e).flatten()
        part = y[rows]
        add_expert_lora(part, x[rows // TOP_K], slots[rows], lora_a, lora_b, e)
        y[rows] = part


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def triton_version() -> str:
    import triton

    return triton.__version__


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4, help="device slots in use")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    # Imported here, so that --help works where Triton is not installed.
    from loraserve.kernels.moe_experts import fused_moe_experts
    from loraserve.kernels.moe_lora import add_moe_lora, align_lora_rows

    dtype, dev = torch.bfloat16, DEVICE
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=dev) * std).to(dtype)

    w13 = rand(EXPERTS, 2 * INTER, HIDDEN)
    w2 = rand(EXPERTS, HIDDEN, INTER)
    slots, rank = args.adapters, args.rank
    a13, b13 = rand(slots, EXPERTS, rank, HIDDEN), rand(slots, EXPERTS, 2 * INTER, rank)
    a2, b2 = rand(slots, EXPERTS, rank, INTER), rand(slots, EXPERTS, HIDDEN, rank)

    print(f"MoE kernels, Mixtral-8x7B layer (H {HIDDEN}, I {INTER}, {EXPERTS} experts, "
          f"top-{TOP_K}), bf16, rank {rank}, {slots} adapters")
    print(f"machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton_version()}")
    print(f"command: python {' '.join(command_words()[1:])}\n")
    print("| tokens | op | torch ms | triton ms | speed-up | max rel. diff |")
    print("|---:|---|---:|---:|---:|---:|")
    for tokens in args.tokens:
        x = rand(tokens, HIDDEN, std=1.0)
        logits = torch.randn(tokens, EXPERTS, generator=gen, device=dev)
        weights, ids = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        token_slots = torch.arange(tokens, device=dev, dtype=torch.int32) % slots
        lora = ExpertsLoRA(token_slots, a13, b13, a2, b2)
        y0 = rand(tokens * TOP_K, 2 * INTER, std=1.0)

        def lora_triton(y=y0, x=x, ids=ids, slots_=token_slots):
            aligned = align_lora_rows(slots_, ids.flatten(), TOP_K, EXPERTS, slots)
            add_moe_lora(y, x, a13, b13, aligned, in_div=TOP_K)

        cases = [
            ("experts", lambda x=x, w=weights, i=ids: torch_moe_experts(x, w13, w2, w, i),
             lambda x=x, w=weights, i=ids: fused_moe_experts(x, w13, w2, w, i)),
            ("moe_lora gate_up",
             lambda y=y0, x=x, i=ids, s=token_slots: torch_moe_lora(y, x, a13, b13, s, i),
             lora_triton),
            ("experts + lora",
             lambda x=x, w=weights, i=ids, lo=lora: torch_moe_experts(x, w13, w2, w, i, lo),
             lambda x=x, w=weights, i=ids, lo=lora: fused_moe_experts(x, w13, w2, w, i, lo)),
        ]
        for name, ref, fast in cases:
            if name == "moe_lora gate_up":
                # From zeros: the update alone, which y's rounding would hide.
                want, got = torch.zeros_like(y0), torch.zeros_like(y0)
                torch_moe_lora(want, x, a13, b13, token_slots, ids)
                lora_triton(y=got)
                err = relative_error(got, want)
            else:
                err = relative_error(fast(), ref())
            ref_ms, fast_ms = bench(ref), bench(fast)
            print(f"| {tokens} | {name} | {ref_ms:.3f} | {fast_ms:.3f} | "
                  f"{ref_ms / fast_ms:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
