"""Tune the LoRA shrink/expand launch configs per shape class; write the JSON the kernels read.

    python -m benchmarks.kernels.tune_kernels --out loraserve/kernels/configs/NVIDIA_H200.json

Shape classes are (T bucket, K or total N, padded rank, slices) as in
``loraserve.kernels.lora_config``. For each class a coordinate descent starts
from the config in use (the table's, else the heuristic), or from the heuristic
or a larger tile with more warps where those are faster, and tries every value
of one parameter at a time (two rounds), timing CUDA-graph replays of a few
calls on rotating inputs, with tokens spread over 1 and over 32 adapters (the
objective is the sum). The shrink is tuned together with the starting expand
(its split-K sets the expand's work; at decode sizes the two run as one launch,
as the model runs them), then the expand with the chosen shrink; for the
gate/up class, then the expand fused into SiLU-and-multiply
(``silu_and_mul_lora``, the path the model runs) with the chosen shrink. Each
class also reports what its shrink alone takes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton.testing

from loraserve.kernels import lora_config as lc
from loraserve.kernels.lora_activation import launch_silu_and_mul
from loraserve.kernels.lora_expand import launch_expand
from loraserve.kernels.lora_meta import LoRAMetadata
from loraserve.kernels.lora_one_launch import launch_one
from loraserve.kernels.lora_ops import one_launch
from loraserve.kernels.lora_shrink import launch_shrink

SHRINK_CLASSES = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
TOKENS = [1, 16, 64, 256, 1024, 4096]
RANKS = [16, 64]
NUM_SLOTS = 32
# The table sections this script tunes (the dense one is tune_dense.py's).
LORA_KINDS = ["shrink", "expand", "silu"]
CALLS = 4

SHRINK_SPACE = {
    "FUSE_SLICES": [0, 1],
    "BLOCK_M": [16, 32, 64, 128],
    "BLOCK_K": [64, 128, 256],
    "SPLIT_K": [1, 2, 4, 8, 16, 32, 64],
    "num_warps": [2, 4, 8],
    "num_stages": [2, 3, 4, 5],
}
EXPAND_SPACE = {
    "BLOCK_M": [16, 32, 64, 128],
    "BLOCK_N": [32, 64, 128, 256],
    "N_ITERS": [1, 2, 4, 8],
    "num_warps": [2, 4, 8],
    "num_stages": [1, 2, 3, 4],
}


# Larger output tiles need more warps (registers), which a descent that moves one
# parameter at a time never reaches from a small tile: tried as starting points.
TILE_STARTS = [
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8},
    {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
]


class Case:
    """Inputs for one (shape, rank, T) point, with tokens over 1 or 32 adapters."""

    def __init__(self, k, widths, r, t, n_adapters):
        dt = torch.bfloat16
        self.t = t
        self.widths = widths
        # The merged gate/up layer runs its expand in the activation (run_silu);
        # the others run as add_lora_linear does, as one launch at decode sizes.
        self.may_run_one_launch = not (len(widths) == 2 and widths[0] == widths[1])
        self.offsets = [sum(widths[:i]) for i in range(len(widths))]
        n_total = sum(widths)
        per = (t * (k + n_total) + NUM_SLOTS * r * (len(widths) * k + n_total)) * 2
        self.n_sets = max(1, min(CALLS, (128 << 20) // per))
        self.sets = []
        for _ in range(self.n_sets):
            x = torch.randn(t, k, device="cuda").to(dt)
            y = torch.randn(t, n_total, device="cuda").to(dt)
            a = [(torch.randn(NUM_SLOTS, r, k, device="cuda") / 64).to(dt) for _ in widths]
            b = [(torch.randn(NUM_SLOTS, n, r, device="cuda") / 8).to(dt) for n in widths]
            self.sets.append((y, x, a, b))
        chosen = torch.randperm(NUM_SLOTS, device="cuda")[:n_adapters]
        slots = chosen[torch.randperm(t, device="cuda") % n_adapters].to(torch.int32)
        self.meta = LoRAMetadata(t, NUM_SLOTS, "cuda").update(slots)

    def run(self, scfg, ecfg):
        one = self.may_run_one_launch and one_launch(self.t, scfg, ecfg)
        for i in range(CALLS):
            y, x, a, b = self.sets[i % self.n_sets]
            if one:
                launch_one(y, x, a, b, self.offsets, self.meta, scfg, ecfg)
            else:
                ws = launch_shrink(x, a, self.meta, scfg)
                launch_expand(y, b, self.offsets, self.meta, ws, ecfg)

    def run_shrink(self, scfg, _):
        for i in range(CALLS):
            _, x, a, _ = self.sets[i % self.n_sets]
            launch_shrink(x, a, self.meta, scfg)

    def run_silu(self, scfg, fcfg):
        """The gate/up path of the model: shrink, then the fused activation."""
        for i in range(CALLS):
            y, x, a, b = self.sets[i % self.n_sets]
            out = y[:, : self.widths[0]]  # any [T, I] buffer will do
            ws = launch_shrink(x, a, self.meta, scfg)
            launch_silu_and_mul(y, out, b, self.meta, ws, fcfg)


def time_cfg(cases, scfg, ecfg, run=Case.run) -> float:
    total = 0.0
    for c in cases:
        try:
            run(c, scfg, ecfg)  # compiles; also grows the workspace outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(c, scfg, ecfg)
            ms = triton.testing.do_bench(graph.replay, warmup=2, rep=15, return_mode="median")
        except Exception as e:  # out of resources for this block shape, etc.
            print(f"  skip {scfg} {ecfg}: {type(e).__name__}", flush=True)
            torch.cuda.synchronize()
            return float("inf")
        total += ms * 1e3 / CALLS
    return total


def valid_shrink(cfg, t, k):
    return cfg["BLOCK_M"] <= max(16, lc.next_pow2(t)) and cfg["SPLIT_K"] * cfg["BLOCK_K"] <= max(
        k, cfg["BLOCK_K"]
    )


def valid_expand(cfg, t):
    return cfg["BLOCK_M"] <= max(16, lc.next_pow2(t))


def descend(start, space, evaluate, valid, rounds=2, also=()):
    """Coordinate descent from `start` (the config in use), or from the fastest of
    `also` (other starting points: the heuristic, joint moves one parameter at a
    time cannot make) where that is faster; returns (best, its time, start's time)."""
    cache: dict[tuple, float] = {}

    def score(cfg):
        key = tuple(sorted(cfg.items()))
        if key not in cache:
            cache[key] = evaluate(cfg) if valid(cfg) else float("inf")
        return cache[key]

    best = min([dict(start)] + [dict(start, **c) for c in also], key=score)
    best_t = score(best)
    for _ in range(rounds):
        improved = False
        for name, values in space.items():
            for v in values:
                cand = dict(best, **{name: v})
                s = score(cand)
                if s < best_t * 0.98:  # ignore noise-level wins
                    best, best_t, improved = cand, s, True
        if not improved:
            break
    return best, best_t, score(start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new classes")
    p.add_argument("--classes", nargs="+", choices=list(SHRINK_CLASSES),
                   default=list(SHRINK_CLASSES))
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--ranks", nargs="+", type=int, default=RANKS)
    p.add_argument("--kinds", nargs="+", choices=LORA_KINDS, default=LORA_KINDS,
                   help="what to tune (an untuned shrink stays at the config in use)")
    p.add_argument("--merge", action="store_true",
                   help="keep the entries already in --out that this run does not tune")
    args = p.parse_args()
    t_start = time.time()
    result = {**lc.device_record(), **{kind: {} for kind in lc.TABLE_KINDS}}
    if args.merge and Path(args.out).is_file():
        old = json.loads(Path(args.out).read_text())
        for kind in lc.TABLE_KINDS:
            result[kind].update(old.get(kind, {}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["elapsed_s"] = round(time.time() - t_start)
        out.write_text(json.dumps(result, indent=1, sort_keys=True))

    # An expand config is shared by every class of one N (o_proj and down_proj):
    # tune it once a run.
    done_expand: set[str] = set()
    # Rank 16 first: it carries the targets; rank 64 if the budget allows.
    for r in args.ranks:
        for k, widths in (SHRINK_CLASSES[c] for c in args.classes):
            for t in args.tokens:
                if time.time() - t_start > args.budget_s:
                    print("budget spent; stopping", flush=True)
                    save()
                    return 0
                ns = len(widths)
                n_total = sum(widths)
                adapters = [1] if t == 1 else [1, 32]
                cases = [Case(k, widths, r, t, n) for n in adapters]
                # Start from what the kernels use now (the table, else the heuristic).
                e0 = lc.expand_config(t, n_total, r)
                s0 = lc.shrink_config(t, k, r, ns)
                msg = f"R{r} K{k} N{n_total} T{t}:"
                sbest = s0
                if "shrink" in args.kinds:
                    sbest, st, s_def = descend(
                        s0,
                        SHRINK_SPACE,
                        lambda c, cases=cases, e0=e0: time_cfg(cases, c, e0),
                        lambda c, t=t, k=k: valid_shrink(c, t, k),
                        also=[lc.default_shrink_config(t, k, r, ns)],
                    )
                    result["shrink"][lc.shrink_key(t, k, r, ns)] = sbest
                    msg += f" shrink+expand {s_def:.1f} -> {st:.1f} us"
                # What the shrink alone takes (the rest is the expand), for the record.
                alone = time_cfg(cases, sbest, None, run=Case.run_shrink)
                msg += f" (shrink alone {alone:.1f} us)"
                ekey = lc.expand_key(t, n_total, r)
                if "expand" in args.kinds and ekey not in done_expand:
                    ebest, et, e_def = descend(
                        e0,
                        EXPAND_SPACE,
                        lambda c, cases=cases, sbest=sbest: time_cfg(cases, sbest, c),
                        lambda c, t=t: valid_expand(c, t),
                        also=[lc.default_expand_config(t, n_total, r), *TILE_STARTS],
                    )
                    result["expand"][ekey] = ebest
                    done_expand.add(ekey)
                    msg += f"; expand tuned {e_def:.1f} -> {et:.1f} us"
                if "silu" in args.kinds and ns == 2 and widths[0] == widths[1]:
                    fbest, ft, f_def = descend(
                        lc.silu_config(t, widths[0], r),
                        EXPAND_SPACE,
                        lambda c, cases=cases, sbest=sbest: time_cfg(
                            cases, sbest, c, run=Case.run_silu),
                        lambda c, t=t: valid_expand(c, t),
                        also=TILE_STARTS,
                    )
                    result["silu"][lc.silu_key(t, widths[0], r)] = fbest
                    msg += f"; fused activation {f_def:.1f} -> {ft:.1f} us"
                print(msg, sbest, flush=True)
                del cases
                save()
    save()
    print(f"done in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
