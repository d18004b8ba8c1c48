"""The results of the serving benchmark: latency statistics, throughput, TPOT of
constrained and unconstrained requests apart, the LoRA/base and schema/plain
comparisons of phases, and the tables printed at the end."""

from __future__ import annotations

import argparse
import math
import platform
import shlex
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.results import command_words
from benchmarks.serve.load import RequestRecord, Target
from benchmarks.serve.structured import CHECKED_WITH
from benchmarks.workload import adapter_weights


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
    """Mean, p50, p99 and max in milliseconds (None where there is nothing to measure)."""
    ms = [v * 1000.0 for v in values]
    return {
        "mean_ms": sum(ms) / len(ms) if ms else None,
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else None,
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


def _setting(value: Any) -> Any:
    """A flag's value as JSON holds it (inf and paths as strings)."""
    if isinstance(value, float) and math.isinf(value) or isinstance(value, Path):
        return str(value)
    return value


def header(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    weights = adapter_weights(len(target.adapters), args.adapter_dist, args.zipf_alpha)
    return {
        "command": shlex.join(command_words()),
        "machine": machine(),
        "base_url": args.base_url,
        "base_model": target.base,
        "adapters": target.adapters,
        "adapter_probabilities": dict(zip(target.adapters, weights, strict=True)),
        "vocab_size": target.vocab_size,
        "settings": {k: _setting(v) for k, v in vars(args).items()
                     if k not in ("api_key", "json")},
    }


# The figures compared between kinds of phases: name, and how to read it from a run.
PHASE_FIGURES = [
    ("output_tok_per_s", lambda r: r["output_tok_per_s"]),
    ("ttft_p50_ms", lambda r: r["ttft"]["p50_ms"]),
    ("ttft_p99_ms", lambda r: r["ttft"]["p99_ms"]),
    ("ttft_max_ms", lambda r: r["ttft"]["max_ms"]),
    ("itl_p50_ms", lambda r: r["itl"]["p50_ms"]),
    ("itl_p99_ms", lambda r: r["itl"]["p99_ms"]),
    ("tpot_p50_ms", lambda r: r["tpot"]["p50_ms"]),
    ("tpot_p99_ms", lambda r: r["tpot"]["p99_ms"]),
    ("unconstrained_tpot_p50_ms", lambda r: r["unconstrained_tpot"]["p50_ms"]),
    ("unconstrained_tpot_p99_ms", lambda r: r["unconstrained_tpot"]["p99_ms"]),
    ("constrained_tpot_p50_ms", lambda r: r["constrained"]["tpot"]["p50_ms"]),
    ("constrained_tpot_p99_ms", lambda r: r["constrained"]["tpot"]["p99_ms"]),
    ("adapters_per_step", lambda r: (r["adapters_per_step"] or {}).get("mean")),
]
PHASE_KINDS = ("base", "lora", "plain", "schema")


def compare_phases(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over each kind's phases (None for a kind without
    phases), and LoRA against base: the ratio of the medians (None without both)."""
    def median_of(kind: str, value) -> float | None:
        values = [value(p) for p in phases if p["phase"] == kind]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {}
    for key, value in PHASE_FIGURES:
        for kind in PHASE_KINDS:
            out[f"{kind}_{key}"] = median_of(kind, value)
        base, lora = out[f"base_{key}"], out[f"lora_{key}"]
        out[f"lora_over_base_{key}"] = lora / base if base and lora is not None else None
    return out


# Schema phases against plain ones: (name, the schema phase's figure, the plain
# phase's figure it is divided by). A plain phase's requests are all unconstrained.
PLAIN_SCHEMA_RATIOS = [
    ("constrained_over_plain_tpot_p50", lambda r: r["constrained"]["tpot"]["p50_ms"],
     lambda r: r["tpot"]["p50_ms"]),
    ("constrained_over_plain_tpot_p99", lambda r: r["constrained"]["tpot"]["p99_ms"],
     lambda r: r["tpot"]["p99_ms"]),
    ("unconstrained_over_plain_tpot_p50", lambda r: r["unconstrained_tpot"]["p50_ms"],
     lambda r: r["tpot"]["p50_ms"]),
    ("unconstrained_over_plain_tpot_p99", lambda r: r["unconstrained_tpot"]["p99_ms"],
     lambda r: r["tpot"]["p99_ms"]),
]


def compare_plain_schema(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Schema phases against plain ones, pair by pair (the k-th plain phase with
    the k-th schema phase, so that each pair ran close in time): per pair, the
    TPOT of the schema phase's constrained requests and of its unconstrained ones
    over the plain phase's TPOT; and the median of each ratio over the pairs
    (None without a pair)."""
    plain = [i for i, p in enumerate(phases) if p["phase"] == "plain"]
    schema = [i for i, p in enumerate(phases) if p["phase"] == "schema"]
    pairs = []
    for i, j in zip(plain, schema, strict=False):
        pair: dict[str, Any] = {"plain": i, "schema": j}
        for key, mixed, alone in PLAIN_SCHEMA_RATIOS:
            num, den = mixed(phases[j]), alone(phases[i])
            pair[key] = num / den if num is not None and den else None
        pairs.append(pair)
    out: dict[str, Any] = {"plain_schema_pairs": pairs}
    for key, _, _ in PLAIN_SCHEMA_RATIOS:
        values = [p[key] for p in pairs if p[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def constrained_figures(records: list[RequestRecord]) -> dict[str, Any]:
    """The constrained requests of a run: how many, how many answered with JSON
    that the schema accepts, how many ended by themselves (their JSON complete)
    rather than at max_tokens, their output lengths and their TPOT."""
    ok = [r for r in records if r.constrained and r.success]
    return {
        "requests": sum(r.constrained for r in records),
        "completed": len(ok),
        "valid_json": sum(bool(r.valid_json) for r in ok),
        "checked_with": CHECKED_WITH,
        "ended_by_stop": sum(r.finish_reason == "stop" for r in ok),
        "output_tokens_mean": sum(r.output_tokens for r in ok) / len(ok) if ok else None,
        "tpot": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
    }


def build_results(records: list[RequestRecord], duration: float,
                  adapters_per_step: dict[str, float] | None) -> dict[str, Any]:
    """The figures of one run; adapters_per_step is the server's own count over
    the run (server_metrics.mean_over_run), None where it has none."""
    ok = [r for r in records if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    return {
        "duration_s": duration,
        "num_requests": len(records),
        "completed": len(ok),
        "failures": len(records) - len(ok),
        "not_sent": sum(not r.sent for r in records),
        "errors": sorted({r.error for r in records if r.error})[:10],
        # Constrained requests end when their JSON is complete: only the others
        # must run to max_tokens.
        "output_len_mismatches": sum(r.output_tokens != r.max_tokens for r in ok
                                     if not r.constrained),
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
        "unconstrained_tpot": summarize([r.tpot_s for r in ok
                                         if r.tpot_s is not None and not r.constrained]),
        "constrained": constrained_figures(records),
        "itl": summarize([gap for r in ok for gap in r.itl_s]),
        "e2e": summarize([r.e2e_s for r in ok]),
        "adapters_per_step": adapters_per_step,
        "model_counts": dict(Counter(r.model for r in records)),
        "requests": [r.to_json() for r in records],
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def adapters_per_step_text(figure: dict[str, float] | None) -> str:
    """The server's mean distinct adapters per step, or n/a where it exports none."""
    return "n/a" if figure is None else f"{figure['mean']:.2f} over {figure['steps']:.0f} steps"


def _p50_p99(stats: dict[str, float | None]) -> str:
    return f"{_ms(stats['p50_ms'])} / {_ms(stats['p99_ms'])}"


def constrained_text(figures: dict[str, Any]) -> str:
    """The constrained requests of a run in a line."""
    mean = figures["output_tokens_mean"]
    return (f"{figures['completed']}/{figures['requests']} ok, {figures['valid_json']} valid "
            f"JSON ({figures['checked_with']}), {figures['ended_by_stop']} ended by stop, "
            f"mean output {'-' if mean is None else f'{mean:.1f}'} tokens")


def format_table(results: dict[str, Any]) -> str:
    if "phases" in results:
        return format_phases(results)
    rows = [
        ("Machine", results["machine"]),
        ("Base model", results["base_model"]),
        ("Adapters", f"{len(results['adapters'])}"),
        ("Successful requests", f"{results['completed']}"),
        ("Failed requests", f"{results['failures']}"),
        ("Not sent (--max-outstanding)", f"{results['not_sent']}"),
        ("Duration (s)", f"{results['duration_s']:.2f}"),
        ("Input tokens", f"{results['input_tokens']}"),
        ("Output tokens", f"{results['output_tokens']}"),
        ("Output chunks", f"{results['output_chunks']}"),
        ("Request throughput (req/s)", f"{results['request_throughput']:.2f}"),
        ("Output throughput (tok/s)", f"{results['output_tok_per_s']:.2f}"),
        ("Total throughput (tok/s)", f"{results['total_tok_per_s']:.2f}"),
    ]
    stats = [("TTFT", results["ttft"]), ("TPOT", results["tpot"])]
    if results["constrained"]["requests"]:
        rows.append(("Constrained requests", constrained_text(results["constrained"])))
        stats += [("Unconstrained TPOT", results["unconstrained_tpot"]),
                  ("Constrained TPOT", results["constrained"]["tpot"])]
    for label, figures in [*stats, ("ITL", results["itl"]), ("E2E", results["e2e"])]:
        rows += [(f"{label} mean (ms)", _ms(figures["mean_ms"])),
                 (f"{label} p50 (ms)", _ms(figures["p50_ms"])),
                 (f"{label} p99 (ms)", _ms(figures["p99_ms"]))]
    rows += [("Longest wait, max TTFT (ms)", _ms(results["ttft"]["max_ms"])),
             ("Distinct adapters per step", adapters_per_step_text(
                 results["adapters_per_step"]))]
    width = max(len(name) for name, _ in rows) + 2
    lines = ["=" * (width + 24), *(f"{name:<{width}}{value}" for name, value in rows),
             "=" * (width + 24)]
    if results["errors"]:
        lines += ["Errors:", *(f"  {e}" for e in results["errors"])]
    return "\n".join(lines)


def _phase_row(name: str, p: dict[str, Any], structured: bool) -> str:
    cells = [name, f"{p['completed']}/{p['num_requests']}", f"{p['output_tok_per_s']:.1f}",
             *(_p50_p99(p[k]) for k in ("ttft", "tpot", "itl"))]
    if structured:
        c = p["constrained"]
        cells += [_p50_p99(p["unconstrained_tpot"]), _p50_p99(c["tpot"]), _valid_text([c])]
    cells += [_ms(p["ttft"]["max_ms"]), adapters_per_step_text(p["adapters_per_step"])]
    return "| " + " | ".join(cells) + " |"


def format_phases(results: dict[str, Any]) -> str:
    """A markdown table, one row a phase (warm-up phases first, in parentheses),
    with TPOT of constrained and unconstrained requests apart where a phase has
    constrained ones; then the summary lines: LoRA/base where there are base or
    LoRA phases, schema/plain where there are plain or schema phases."""
    phases, warmup = results["phases"], results.get("warmup", [])
    structured = any(p["constrained"]["requests"] for p in [*phases, *warmup])
    columns = ["phase", "ok", "output tok/s", "TTFT p50 / p99", "TPOT p50 / p99",
               "ITL p50 / p99"]
    if structured:
        columns += ["unconstrained TPOT p50 / p99", "constrained TPOT p50 / p99",
                    "valid JSON"]
    columns += ["max TTFT", "adapters per step"]
    lines = [f"Machine: {results['machine']}", f"Command: {results['command']}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += [_phase_row(f"({p['phase']} warm-up)", p, structured) for p in warmup]
    lines += [_phase_row(p["phase"], p, structured) for p in phases]
    lines.append("")
    kinds = {p["phase"] for p in phases}
    if kinds & {"base", "lora"}:
        lines += [f"Served LoRA/base: {_ratio(results['lora_over_base_output_tok_per_s'])}",
                  f"TTFT p99 LoRA/base: {_ratio(results['lora_over_base_ttft_p99_ms'])}",
                  f"ITL p99 LoRA/base: {_ratio(results['lora_over_base_itl_p99_ms'])}"]
    if kinds & {"plain", "schema"}:
        lines += plain_schema_lines(results)
    lines.append(f"Failed requests: {results['failures']}")
    errors = sorted({e for p in phases for e in p["errors"]})
    if errors:
        lines += ["Errors:", *(f"  {e}" for e in errors[:10])]
    return "\n".join(lines)


def plain_schema_lines(results: dict[str, Any]) -> list[str]:
    """The schema/plain summary: TPOT ratios (medians over the pairs) and the
    constrained answers that the schema accepts."""
    pairs = len(results["plain_schema_pairs"])
    over = f"(median over {pairs} plain/schema pair{'s' * (pairs != 1)})"
    schema = [p["constrained"] for p in results["phases"] if p["phase"] == "schema"]
    checked = schema[0]["checked_with"] if schema else "-"
    return [
        f"Constrained/plain TPOT: p50 {_ratio(results['constrained_over_plain_tpot_p50'])}, "
        f"p99 {_ratio(results['constrained_over_plain_tpot_p99'])} {over}",
        "Unconstrained-in-mixed/plain TPOT: "
        f"p50 {_ratio(results['unconstrained_over_plain_tpot_p50'])}, "
        f"p99 {_ratio(results['unconstrained_over_plain_tpot_p99'])} {over}",
        f"Valid JSON: {sum(c['valid_json'] for c in schema)}/"
        f"{sum(c['requests'] for c in schema)} constrained answers of the schema phases "
        f"({checked})",
    ]


RESULTS_HEADER = [
    "| run | model | output tok/s | LoRA/base | TTFT p50 / p99 ms | ITL p50 / p99 ms "
    "| longest wait ms | failed | adapters per step | unconstrained TPOT p50 / p99 ms "
    "| constrained TPOT p50 / p99 ms | valid JSON | TPOT p50 over plain: constrained "
    "/ unconstrained | notes | command |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


# Flags that only say where the figures go: left out of the command a row shows.
REPORTING_FLAGS = ("--json", "--results-md", "--label", "--notes", "--server-command")


def measurement_command(command: str) -> str:
    """The command without its reporting flags (and their values): what to run
    again to measure the same."""
    words, kept = shlex.split(command), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in REPORTING_FLAGS:
            skip = True
        elif not word.startswith(tuple(f"{flag}=" for flag in REPORTING_FLAGS)):
            kept.append(word)
    return shlex.join(kept)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _tpot_cells(unconstrained: tuple[float | None, float | None],
                constrained: tuple[float | None, float | None], valid: str,
                over_plain: str) -> str:
    return (f"{_ms(unconstrained[0])} / {_ms(unconstrained[1])} | "
            f"{_ms(constrained[0])} / {_ms(constrained[1])} | {valid} | {over_plain} |")


def _valid_text(figures: list[dict[str, Any]]) -> str:
    """k/n constrained answers that the schema accepts, or - without any."""
    requests = sum(c["requests"] for c in figures)
    return f"{sum(c['valid_json'] for c in figures)}/{requests}" if requests else "-"


def results_rows(results: dict[str, Any], label: str, notes: str = "",
                 server_command: str = "") -> list[str]:
    """Markdown rows of one invocation for a results file: one per kind of phase
    (the medians over that kind's phases), or one for a run without phases; each
    with the command that measures it (the JSON keeps the whole command line)."""
    command = f"`{measurement_command(results['command'])}`"
    if server_command:
        command = f"server: `{server_command}`; client: {command}"
    tail = f" {_cell(notes)} | {_cell(command)} |"
    if "phases" not in results:
        figure = results["adapters_per_step"]
        unconstrained, constrained = results["unconstrained_tpot"], results["constrained"]
        return [f"| {_cell(label)} | mixed | {results['output_tok_per_s']:.1f} | - | "
                f"{_ms(results['ttft']['p50_ms'])} / {_ms(results['ttft']['p99_ms'])} | "
                f"{_ms(results['itl']['p50_ms'])} / {_ms(results['itl']['p99_ms'])} | "
                f"{_ms(results['ttft']['max_ms'])} | {results['failures']} | "
                f"{'n/a' if figure is None else format(figure['mean'], '.2f')} | "
                + _tpot_cells((unconstrained["p50_ms"], unconstrained["p99_ms"]),
                              (constrained["tpot"]["p50_ms"], constrained["tpot"]["p99_ms"]),
                              _valid_text([constrained]), "-") + tail]
    rows = []
    for kind in PHASE_KINDS:
        phases = [p for p in results["phases"] if p["phase"] == kind]
        if not phases:
            continue
        tok = results[f"{kind}_output_tok_per_s"]
        per_step = results[f"{kind}_adapters_per_step"]
        ratio = _ratio(results["lora_over_base_output_tok_per_s"]) if kind == "lora" else "-"
        over_plain = "-"
        if kind == "schema":
            over_plain = (f"{_ratio(results['constrained_over_plain_tpot_p50'])} / "
                          f"{_ratio(results['unconstrained_over_plain_tpot_p50'])}")
        unconstrained, constrained = ((results[f"{kind}_{which}_tpot_p50_ms"],
                                       results[f"{kind}_{which}_tpot_p99_ms"])
                                      for which in ("unconstrained", "constrained"))
        rows.append(
            f"| {_cell(label)} | {kind} ×{len(phases)} | "
            f"{'-' if tok is None else f'{tok:.1f}'} | {ratio} | "
            f"{_ms(results[f'{kind}_ttft_p50_ms'])} / {_ms(results[f'{kind}_ttft_p99_ms'])} | "
            f"{_ms(results[f'{kind}_itl_p50_ms'])} / {_ms(results[f'{kind}_itl_p99_ms'])} | "
            f"{_ms(results[f'{kind}_ttft_max_ms'])} | "
            f"{sum(p['failures'] for p in phases)} | "
            f"{'n/a' if per_step is None else f'{per_step:.2f}'} | "
            + _tpot_cells(unconstrained, constrained,
                          _valid_text([p["constrained"] for p in phases]), over_plain)
            + tail)
    return rows


def append_results(path: Path, rows: list[str]) -> None:
    """Append rows to a markdown results file, with the table's header first when
    the file is new or empty."""
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a") as f:
        f.write("\n".join([*(RESULTS_HEADER if new else []), *rows]) + "\n")
