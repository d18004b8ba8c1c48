r"""Serving benchmark against a running `loraserve serve`.

Sends --num-requests streamed completions (random token-id prompts of --input-len,
exactly --output-len tokens each through ignore_eos), each to the base model or to
one of --num-adapters adapters (uniform, or Zipf with exponent --zipf-alpha: the
k-th adapter drawn with probability proportional to 1/k**alpha). Requests go
closed-loop (at most --max-concurrency in flight, all due at once) or open-loop
at --request-rate per second (Poisson: exponential gaps from the seed; or fixed
gaps); an open-loop run stops sending once --max-outstanding requests are
outstanding, so an overloaded server ends the run rather than queueing for ever.
It reports throughput, TTFT (p50, p99 and the longest wait), TPOT, ITL,
end-to-end latency, failed requests, and the mean number of distinct adapters
per engine step from the server's own /metrics (histogram
loraserve:step_lora_adapters, scraped before and after each run; n/a where the
server has none).

    python -m benchmarks.make_bench_setup --out /tmp/bench --num-adapters 1024 \
        --distinct 8 --rank 8 --target-modules attention
    loraserve serve /tmp/bench/llama3-8b-shape --load-format dummy --enable-lora \
        --max-loras 64 --max-cpu-loras 128 --config /tmp/bench/lora_modules.json
    python -m benchmarks.serve http://127.0.0.1:8000 --num-requests 512 \
        --request-rate 16 --num-adapters 1024 --adapter-pattern 'lora{}' \
        --adapter-dist zipf --zipf-alpha 1 --input-len 128:1024 --output-len 64:256 \
        --phases base,lora,base,lora --warmup-phases lora --json serve.json

Lengths may be ranges (``--input-len 128:1024`` draws each prompt's length
uniformly). ``--phases base,lora,base,lora`` runs the workload once per phase
in one invocation, each phase sending every request to the base model or to the
adapters, and reports the ratio of the LoRA phases' median output throughput to
the base phases' (``Served LoRA/base``): alternating phases on one server cancel
drift of the machine; ``--warmup-phases`` runs untimed phases first (the first
phase on a fresh server pays for first-use work). ``--num-clients N`` splits each run over N client
processes (each with its share of --max-concurrency), so that the client's own
Python does not bound a fast server.

``--structured-fraction F`` sends that fraction of the requests (drawn from the
seed, spread evenly over the run) with a JSON schema (``response_format``
json_schema; benchmarks/serve/structured.py holds the schema). They keep
``ignore_eos`` but end when their JSON is complete, so their TPOT is over their
own output tokens. Every run then reports TPOT of constrained and unconstrained
requests apart and how many constrained answers are JSON that the schema
accepts (checked with jsonschema where installed, else only parsed as JSON); an
untimed constrained request first has the server compile the schema's grammar.
``--phases plain,schema,plain,schema`` alternates phases without schemas and
phases with --structured-fraction of them, at the same load, and reports
``Constrained/plain TPOT`` (the constrained requests' TPOT p50 and p99 over the
plain phase's) and ``Unconstrained-in-mixed/plain TPOT`` (the unconstrained
requests' of the schema phase over the plain phase's), each the median over the
pairs (the k-th plain phase with the k-th schema phase). The model's tokenizer
must be able to spell JSON (``make_bench_setup --tokenizer bytes`` writes one for
the Llama-3-8B shape); a server with random weights needs
``--structured-outputs-config '{"disable_any_whitespace": true}'``, or its JSON
may be whitespace up to max_tokens.

``--results-md FILE --label NAME`` appends the run's figures to a markdown table
with its command (and --server-command, the server's).

load.py generates the load, runs.py finds what the server serves and runs the
phases, structured.py picks the constrained requests and checks their answers,
server_metrics.py reads the server's /metrics, report.py computes and prints the
results.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from benchmarks.serve.report import append_results, format_table, results_rows
from benchmarks.serve.runs import run_benchmark

DEFAULT_URL = "http://127.0.0.1:8000"


def rate(value: str) -> float:
    parsed = float(value)  # accepts "inf"
    if not parsed > 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (or inf)")
    return parsed


def lengths(value: str) -> tuple[int, int]:
    """N, or LO:HI for lengths drawn uniformly from [LO, HI]."""
    low, _, high = value.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError("a length is N or LO:HI with 1 <= LO <= HI")
    return bounds


PHASES = ("base", "lora", "plain", "schema")


def phase_list(value: str) -> list[str]:
    phases = [p.strip() for p in value.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        raise argparse.ArgumentTypeError(
            "--phases is a comma-separated list of base, lora, plain and schema")
    return phases


def fraction(value: str) -> float:
    parsed = float(value)
    if not 0.0 <= parsed <= 1.0:
        raise argparse.ArgumentTypeError("a fraction is in [0, 1]")
    return parsed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base_url", nargs="?", default=DEFAULT_URL,
                   help=f"the server's address (default {DEFAULT_URL})")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--request-rate", type=rate, default=float("inf"),
                   help="open-loop arrivals per second; inf (the default) sends all at "
                        "once, closed-loop under --max-concurrency")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson",
                   help="gaps between requests: exponential (Poisson) or exactly 1/rate")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no cap)")
    p.add_argument("--max-outstanding", type=int, default=1024,
                   help="open loop (a finite --request-rate): stop sending once this "
                        "many requests are due and unfinished (the rest count as failed, "
                        "not sent)")
    p.add_argument("--num-adapters", type=int, default=None,
                   help="use N adapters (default: all the server serves)")
    p.add_argument("--adapter-pattern", default=None,
                   help="the adapters' names, {} standing for 0..N-1 (e.g. 'lora{}', "
                        "as make_bench_setup names them; needs --num-adapters); "
                        "default: the server's first N from /v1/models")
    p.add_argument("--adapter-names", nargs="+", default=None,
                   help="adapters to use, in popularity order (default: /v1/models)")
    p.add_argument("--adapter-dist", choices=["uniform", "zipf"], default="uniform",
                   help="adapter popularity: uniform, or Zipf over the adapters' order")
    p.add_argument("--zipf-alpha", "--zipf-s", dest="zipf_alpha", type=float, default=1.0,
                   help="the Zipf exponent alpha (default 1.0)")
    p.add_argument("--base-fraction", type=float, default=0.0,
                   help="share of requests sent to the base model")
    p.add_argument("--input-len", type=lengths, default=(512, 512),
                   help="prompt tokens: N, or LO:HI drawn uniformly per request")
    p.add_argument("--output-len", type=lengths, default=(128, 128),
                   help="output tokens: N, or LO:HI drawn uniformly per request")
    p.add_argument("--structured-fraction", type=fraction, default=0.0,
                   help="share of requests sent with a JSON schema (response_format), "
                        "drawn from the seed and spread evenly over the run (default 0)")
    p.add_argument("--phases", type=phase_list, default=None,
                   help="e.g. base,lora,base,lora: one run per phase, all to the base "
                        "model or all to the adapters, and the LoRA/base ratio; or "
                        "plain,schema,plain,schema: no request with a schema, then "
                        "--structured-fraction of them, and the schema/plain TPOT ratios")
    p.add_argument("--num-clients", type=int, default=1,
                   help="client processes, each with its share of --max-concurrency")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="for the random prompts (default: probed through /detokenize)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="untimed requests sent one by one before the run")
    p.add_argument("--warmup-phases", type=phase_list, default=None,
                   help="e.g. lora, base,lora or schema: whole phases run before the "
                        "timed ones and left out of the figures")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request counts as failed")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--results-md", type=Path, default=None,
                   help="append the figures as markdown rows (header when the file is new)")
    p.add_argument("--label", default="", help="the run's name in --results-md")
    p.add_argument("--notes", default="", help="free text for the row in --results-md")
    p.add_argument("--server-command", default="",
                   help="the server's command, recorded in --results-md")
    args = p.parse_args(argv)
    if args.num_requests < 1:
        p.error("--num-requests must be at least 1")
    if args.num_clients < 1:
        p.error("--num-clients must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < args.num_clients:
        p.error("--max-concurrency must be at least --num-clients")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    if args.num_adapters is not None and args.num_adapters < 0:
        p.error("--num-adapters must be at least 0")
    if args.adapter_pattern is not None:
        if args.num_adapters is None or args.adapter_names:
            p.error("--adapter-pattern needs --num-adapters and no --adapter-names")
        if "{" not in args.adapter_pattern:
            p.error("--adapter-pattern needs {} where the number goes, e.g. 'lora{}'")
    if args.max_outstanding < args.num_clients:
        p.error("--max-outstanding must be at least --num-clients")
    if args.zipf_alpha < 0:
        p.error("--zipf-alpha must be >= 0")
    if not 0.0 <= args.base_fraction <= 1.0:
        p.error("--base-fraction must be in [0, 1]")
    if args.request_timeout <= 0:
        p.error("--request-timeout must be > 0")
    if "schema" in (args.phases or []) + (args.warmup_phases or []) and \
            args.structured_fraction == 0:
        p.error("a schema phase needs --structured-fraction above 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run from the command line (argv None) or from a test; returns the results."""
    args = parse_args(argv)
    results = run_benchmark(args)
    if argv is not None:
        # Called from Python: record the arguments that were really used.
        results["command"] = shlex.join(["python", "-m", "benchmarks.serve", *argv])
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.results_md:
        append_results(args.results_md, results_rows(results, args.label or "-", args.notes,
                                                     args.server_command))
    return results
