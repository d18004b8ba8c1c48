"""The results of the serving benchmark: latency statistics, throughput, the
LoRA/base comparison of phases, and the tables printed at the end."""

from __future__ import annotations

import argparse
import math
import platform
import shlex
import statistics
from collections import Counter
from typing import Any

from benchmarks.results import command_words
from benchmarks.serve.load import RequestRecord, Target, adapter_weights


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 in milliseconds (None where there is nothing to measure)."""
    ms = [v * 1000.0 for v in values]
    return {
        "mean_ms": sum(ms) / len(ms) if ms else None,
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
    }


def machine() -> str:
    """The accelerator this client runs next to (the usual setup: same host)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()}"


def header(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    weights = adapter_weights(len(target.adapters), args.adapter_dist, args.zipf_s)
    return {
        "command": shlex.join(command_words()),
        "machine": machine(),
        "base_url": args.base_url,
        "base_model": target.base,
        "adapters": target.adapters,
        "adapter_probabilities": dict(zip(target.adapters, weights, strict=True)),
        "vocab_size": target.vocab_size,
        "settings": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                     for k, v in vars(args).items() if k not in ("api_key", "json")},
    }


def compare_phases(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """LoRA against base over the phases: the ratio of the medians of each
    kind's output throughput and ITL p99 (None without both kinds)."""
    def median_of(kind: str, value) -> float | None:
        values = [value(p) for p in phases if p["phase"] == kind]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {}
    for key, value in [("output_tok_per_s", lambda p: p["output_tok_per_s"]),
                       ("itl_p99_ms", lambda p: p["itl"]["p99_ms"]),
                       ("tpot_p50_ms", lambda p: p["tpot"]["p50_ms"]),
                       ("ttft_p50_ms", lambda p: p["ttft"]["p50_ms"])]:
        base, lora = median_of("base", value), median_of("lora", value)
        out[f"base_{key}"], out[f"lora_{key}"] = base, lora
        out[f"lora_over_base_{key}"] = lora / base if base and lora is not None else None
    return out


def build_results(records: list[RequestRecord], duration: float, adapters: list[str],
                  args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    return {
        "duration_s": duration,
        "num_requests": len(records),
        "completed": len(ok),
        "failures": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "output_len_mismatches": sum(r.output_tokens != r.max_tokens for r in ok),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        # Fewer chunks than tokens means the server merged tokens into one chunk
        # (loraserve sends none for a token that decodes to no text yet): ITL is
        # then a gap between chunks, not between tokens.
        "output_chunks": sum(r.num_chunks for r in ok),
        "request_throughput": len(ok) / duration,
        "output_tok_per_s": output_tokens / duration,
        "total_tok_per_s": (input_tokens + output_tokens) / duration,
        "ttft": summarize([r.ttft_s for r in ok]),
        "tpot": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": summarize([gap for r in ok for gap in r.itl_s]),
        "e2e": summarize([r.e2e_s for r in ok]),
        "model_counts": dict(Counter(r.model for r in records)),
        "requests": [r.to_json() for r in records],
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(results: dict[str, Any]) -> str:
    if "phases" in results:
        return format_phases(results)
    rows = [
        ("Machine", results["machine"]),
        ("Base model", results["base_model"]),
        ("Adapters", f"{len(results['adapters'])}"),
        ("Successful requests", f"{results['completed']}"),
        ("Failed requests", f"{results['failures']}"),
        ("Duration (s)", f"{results['duration_s']:.2f}"),
        ("Input tokens", f"{results['input_tokens']}"),
        ("Output tokens", f"{results['output_tokens']}"),
        ("Output chunks", f"{results['output_chunks']}"),
        ("Request throughput (req/s)", f"{results['request_throughput']:.2f}"),
        ("Output throughput (tok/s)", f"{results['output_tok_per_s']:.2f}"),
        ("Total throughput (tok/s)", f"{results['total_tok_per_s']:.2f}"),
    ]
    for key, label in [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")]:
        stats = results[key]
        rows += [(f"{label} mean (ms)", _ms(stats["mean_ms"])),
                 (f"{label} p50 (ms)", _ms(stats["p50_ms"])),
                 (f"{label} p99 (ms)", _ms(stats["p99_ms"]))]
    width = max(len(name) for name, _ in rows) + 2
    lines = ["=" * (width + 24), *(f"{name:<{width}}{value}" for name, value in rows),
             "=" * (width + 24)]
    if results["errors"]:
        lines += ["Errors:", *(f"  {e}" for e in results["errors"])]
    return "\n".join(lines)


def format_phases(results: dict[str, Any]) -> str:
    """A markdown table, one row a phase, and the LoRA/base summary lines."""
    lines = [f"Machine: {results['machine']}", f"Command: {results['command']}", "",
             "| phase | ok | output tok/s | TTFT p50 / p99 | TPOT p50 / p99 | ITL p50 / p99 |",
             "|---|---|---|---|---|---|"]
    for p in results["phases"]:
        lines.append(
            f"| {p['phase']} | {p['completed']}/{p['num_requests']} | "
            f"{p['output_tok_per_s']:.1f} | "
            + " | ".join(f"{_ms(p[k]['p50_ms'])} / {_ms(p[k]['p99_ms'])}"
                         for k in ("ttft", "tpot", "itl")) + " |")
    ratio = results["lora_over_base_output_tok_per_s"]
    itl = results["lora_over_base_itl_p99_ms"]
    lines += ["", f"Served LoRA/base: {'-' if ratio is None else f'{ratio:.3f}'}",
              f"ITL p99 LoRA/base: {'-' if itl is None else f'{itl:.3f}'}"]
    errors = sorted({e for p in results["phases"] for e in p["errors"]})
    if errors:
        lines += ["Errors:", *(f"  {e}" for e in errors[:10])]
    return "\n".join(lines)
