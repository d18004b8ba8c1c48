"""Benchmark loraserve.kernels.paged_attention: decode over the paged KV cache (and one prefill).

Run on a CUDA machine:

    python -m benchmarks.kernels.attention --json out.json --md out.md [--sweep]

Decode points: batch 1, 32, 64, 256 at context 512 and 2048, Hq 32, Hk 8, head
dim 128, bf16, block size 16, each sequence's blocks scattered over the cache.
A timed call is a CUDA graph that runs the kernel once for each of L "layers",
each with its own cache, so that the K/V come from device memory rather than L2
(L is chosen so that all the layers together hold at least 512 MB); time per
call = replay time / L. GB/s counts the K and V bytes the batch must read. "%
copy" compares it with a device-to-device copy measured in the same run (bytes
read + written per second). ``--sweep`` also times other tilings and split
counts and reports the best of each point.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton.testing

from benchmarks.kernels.timing import copy_bandwidth, median_replay_ms
from benchmarks.results import command
from loraserve.kernels import paged_attention as pa
from loraserve.kernels.attention_tiling import MAX_SPLITS, choose_num_splits

HQ, HK, D, BS = 32, 8, 128, 16
BATCHES = [1, 32, 64, 256]
CONTEXTS = [512, 2048]
MIN_BYTES = 512 << 20
DTYPE = torch.bfloat16


def decode_setup(batch: int, ctx: int):
    blocks_per_seq = ctx // BS
    kv_bytes = 2 * batch * ctx * HK * D * DTYPE.itemsize
    layers = max(2, min(64, math.ceil(MIN_BYTES / kv_bytes)))
    num_blocks = batch * blocks_per_seq
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + ctx)
    caches = [_cache(num_blocks, g) for _ in range(layers)]
    bt = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32) + 1
    bt = bt.view(batch, blocks_per_seq).contiguous()
    q = torch.randn(batch, HQ, D, device="cuda", generator=g).to(DTYPE)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    ws = pa.make_workspace(HQ, D, "cuda")
    return caches, bt, q, out, qsl, seq_lens, ws, kv_bytes


def _cache(num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """A layer's cache as the engine lays it out: block 0 of zeros, in no table, then
    ``num_blocks`` blocks of random keys and values (ids 1 to num_blocks)."""
    cache = torch.randn(2, 1 + num_blocks, BS, HK, D, device="cuda", generator=g).to(DTYPE)
    cache[:, 0] = 0
    return cache


def bench_decode(batch: int, ctx: int, configs, splits_list) -> list[dict]:
    caches, bt, q, out, qsl, seq_lens, ws, kv_bytes = decode_setup(batch, ctx)
    scale = D**-0.5
    default_splits = choose_num_splits(batch, batch, HK, 1, HQ // HK, D, DTYPE, q.device)
    rows = []
    for cfg in configs:
        for splits in splits_list(default_splits):

            def fn(cfg=cfg, splits=splits):
                for cache in caches:
                    pa.paged_attention(
                        q,
                        cache,
                        out,
                        qsl,
                        seq_lens,
                        bt,
                        scale,
                        max_query_len=1,
                        workspace=ws,
                        num_splits=splits,
                        config=cfg,
                    )

            try:
                us = median_replay_ms(fn) * 1e3 / len(caches)
            except Exception as e:  # a tiling that does not fit: report, keep going
                print(f"  {cfg} splits={splits}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            rows.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "us": us,
                    "gbps": kv_bytes / (us * 1e-6) / 1e9,
                    "splits": splits,
                    "default_splits": default_splits,
                    "config": None if cfg is None else cfg.__dict__,
                    "layers": len(caches),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_prefill(num_seqs: int, seq_len: int, configs) -> list[dict]:
    """Whole-prompt prefill against torch SDPA (flash) on the same data, unpaged."""
    t = num_seqs * seq_len
    blocks = t // BS
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = _cache(blocks, g)
    bt = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32) + 1
    bt = bt.view(num_seqs, -1)
    q = torch.randn(t, HQ, D, device="cuda", generator=g).to(DTYPE)
    out = torch.empty_like(q)
    qsl = torch.arange(0, t + 1, seq_len, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    scale = D**-0.5

    # The same keys, gathered into contiguous [B, H, L, D] for SDPA.
    k = cache[0][bt.long()].reshape(num_seqs, seq_len, HK, D).transpose(1, 2)
    v = cache[1][bt.long()].reshape(num_seqs, seq_len, HK, D).transpose(1, 2)
    k = k.repeat_interleave(HQ // HK, dim=1).contiguous()
    v = v.repeat_interleave(HQ // HK, dim=1).contiguous()
    qs = q.view(num_seqs, seq_len, HQ, D).transpose(1, 2).contiguous()

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, k, v, is_causal=True)

    ms_sdpa = triton.testing.do_bench(sdpa, warmup=10, rep=100, return_mode="median")
    ref = sdpa().transpose(1, 2).reshape(t, HQ, D)
    flops = 2 * 2 * HQ * D * num_seqs * seq_len * seq_len / 2
    rows = []
    for cfg in configs:

        def ours(cfg=cfg):
            pa.paged_attention(
                q, cache, out, qsl, seq_lens, bt, scale, max_query_len=seq_len, config=cfg
            )

        try:
            ms = triton.testing.do_bench(ours, warmup=10, rep=100, return_mode="median")
        except Exception as e:  # a tiling that does not fit: report, keep going
            print(f"  prefill {cfg}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        rows.append({
            "num_seqs": num_seqs, "seq_len": seq_len, "us": ms * 1e3,
            "tflops": flops / ms / 1e9, "config": None if cfg is None else cfg.__dict__,
            "sdpa_us": ms_sdpa * 1e3, "sdpa_tflops": flops / ms_sdpa / 1e9,
            "max_abs_diff_vs_sdpa": (out.float() - ref.float()).abs().max().item(),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    ap.add_argument("--contexts", nargs="+", type=int, default=CONTEXTS)
    ap.add_argument("--splits", nargs="+", type=int,
                    help="with --sweep: the split counts to time (default: the policy's "
                         "half and double)")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()

    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{dev}; copy {bw / 1e9:.0f} GB/s (read+write)", flush=True)
    default = [None]
    if args.sweep:
        # 64/4/5, 64/4/7 and 32/4/8: the decode loop's K/V double- or triple-buffered
        # by Triton's pipeliner (one buffer below 5 stages).
        configs = default + [
            pa.AttentionConfig(1, bn, w, st)
            for bn, w, st in [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2),
                              (128, 4, 3), (64, 4, 5), (64, 4, 7), (32, 4, 8)]
        ]
    else:
        configs = default

    results = {"device": dev, "copy_gbps": bw / 1e9, "decode": [], "prefill": []}
    for batch in args.batches:
        for ctx in args.contexts:
            rows = bench_decode(batch, ctx, default, lambda s: [s])
            if args.sweep and args.splits:
                rows += bench_decode(batch, ctx, configs, lambda s: args.splits)
            elif args.sweep:
                rows += bench_decode(batch, ctx, configs[1:], lambda s: [s])
                rows += bench_decode(
                    batch,
                    ctx,
                    default,
                    lambda s: sorted({max(1, s // 2), min(MAX_SPLITS, s * 2)} - {s}),
                )
            results["decode"] += rows
            torch.cuda.empty_cache()
    prefill_configs = [None]
    if args.sweep:
        prefill_configs += [
            pa.AttentionConfig(bq, bn, w, st)
            for bq, bn, w, st in [(32, 128, 8, 2), (32, 64, 8, 3), (16, 64, 4, 2), (32, 64, 4, 2)]
        ]
    for n, length in [] if args.no_prefill else [(1, 4096), (4, 2048)]:
        results["prefill"] += bench_prefill(n, length, prefill_configs)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(results, bw, command(), args.batches, args.contexts))


def markdown(results: dict, bw: float, cmd: str, batches, contexts) -> str:
    lines = [
        f"Machine: {results['device']}; device-to-device copy {bw / 1e9:.0f} GB/s (read + write).",
        f"Command: `{cmd}`",
        "",
        "Decode, bf16, Hq 32 / Hk 8, head dim 128, block size 16, CUDA-graph replay, K/V",
        "from device memory (one cache per layer, >= 512 MB in all). GB/s = K+V bytes read /",
        "time.",
        "",
        "| batch | context | µs | GB/s | % copy | splits | best swept µs (tiling, splits) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for batch in batches:
        for ctx in contexts:
            pts = [r for r in results["decode"] if r["batch"] == batch and r["context"] == ctx]
            base = [r for r in pts if r["config"] is None and r["splits"] == r["default_splits"]]
            if not base:
                continue
            r = base[0]
            best = min(pts, key=lambda x: x["us"])
            best_s = f"{best['us']:.1f} ({best['config'] or 'default'}, {best['splits']})"
            lines.append(
                f"| {batch} | {ctx} | {r['us']:.1f} | {r['gbps']:.0f} | "
                f"{100 * r['gbps'] * 1e9 / bw:.0f}% | {r['splits']} | {best_s} |"
            )
    if results["prefill"]:
        lines += [
            "",
            "Prefill (whole prompts, causal), against torch SDPA on the same data unpaged:",
            "",
            "| seqs x len | µs | TFLOP/s | SDPA µs | SDPA TFLOP/s | max abs diff | best swept |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for p in results["prefill"]:
            if p["config"] is not None:
                continue
            best = min(
                (r for r in results["prefill"] if r["seq_len"] == p["seq_len"]),
                key=lambda r: r["us"],
            )
            lines.append(
                f"| {p['num_seqs']} x {p['seq_len']} | {p['us']:.0f} | {p['tflops']:.0f} | "
                f"{p['sdpa_us']:.0f} | {p['sdpa_tflops']:.0f} | {p['max_abs_diff_vs_sdpa']:.3f} | "
                f"{best['us']:.0f} ({best['config'] or 'default'}) |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
