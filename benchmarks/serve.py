"""Serving benchmark against a running `loraserve serve`.

Sends --num-requests streamed completions (random token-id prompts of --input-len,
exactly --output-len tokens each through ignore_eos) at a Poisson or fixed request
rate, each to the base model or to one of the server's adapters (uniform or Zipf),
and reports request and token throughput, TTFT, TPOT, ITL and end-to-end latency.

    loraserve serve /tmp/bench/llama3-8b-shape --load-format dummy --enable-lora \
        --max-loras 8 --lora-modules a0=/tmp/bench/adapters/a0 ...
    python benchmarks/serve.py http://127.0.0.1:8000 --num-requests 512 \
        --request-rate 8 --arrival fixed --num-adapters 64 --adapter-dist zipf \
        --input-len 512 --output-len 128 --json serve.json

Lengths may be ranges (``--input-len 128:1024`` draws each prompt's length
uniformly). ``--phases base,lora,base,lora`` runs the workload once per phase
in one invocation, each phase sending every request to the base model or to the
adapters, and reports the ratio of the LoRA phases' median output throughput to
the base phases' (``Served LoRA/base``): alternating phases on one server cancel
drift of the machine. ``--num-clients N`` splits each run over N client
processes (each with its share of --max-concurrency), so that the client's own
Python does not bound a fast server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import platform
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    import httpx
except ImportError:  # the GPU machine's image has the drop-in fork only
    import httpx2 as httpx

DEFAULT_URL = "http://127.0.0.1:8000"


# ---------------------------------------------------------------- workload


def arrival_offsets(num: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    """Send time of each request, in seconds from the start of the run.

    An infinite rate sends everything at once. A Poisson process has exponential
    gaps of mean 1/rate; a fixed one has gaps of exactly 1/rate. The first request
    goes at 0 either way, so the run does not start with an idle gap.
    """
    if math.isinf(rate):
        return [0.0] * num
    offsets, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
        offsets.append(now)
    return offsets


def adapter_weights(num: int, dist: str, zipf_s: float) -> list[float]:
    """Probability of each adapter, by its rank in the list (the first is the most
    popular under Zipf: p_k proportional to 1 / k**s)."""
    if num == 0:
        return []
    raw = [1.0] * num if dist == "uniform" else [1.0 / (k ** zipf_s) for k in range(1, num + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def pick_models(num: int, base: str, adapters: list[str], dist: str, zipf_s: float,
                base_fraction: float, rng: random.Random) -> list[str]:
    """The model name of each request: the base with probability base_fraction
    (always when there are no adapters), else an adapter drawn from the distribution."""
    weights = adapter_weights(len(adapters), dist, zipf_s)
    models = []
    for _ in range(num):
        if not adapters or rng.random() < base_fraction:
            models.append(base)
        else:
            models.append(rng.choices(adapters, weights=weights)[0])
    return models


def random_prompts(num: int, input_len: int, vocab_size: int,
                   rng: random.Random) -> list[list[int]]:
    """Random token ids, away from the ends of the vocabulary where tokenizers
    usually keep their special tokens (a tiny vocabulary keeps the whole range)."""
    margin = min(100, vocab_size // 4)
    low, high = margin, vocab_size - margin
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num)]


# ---------------------------------------------------------------- statistics


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


# ---------------------------------------------------------------- requests


@dataclass
class RequestRecord:
    index: int
    model: str
    prompt_len: int
    max_tokens: int
    scheduled_s: float  # planned send time, from the start of the run
    start_s: float = 0.0  # actual send time, from the start of the run
    success: bool = False
    error: str | None = None
    output_tokens: int = 0
    served_model: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    num_chunks: int = 0
    # Gaps between successive content chunks; kept out of the JSON (it can be large).
    itl_s: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["itl_s"]
        return data


async def stream_completion(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                            payload: dict[str, Any], record: RequestRecord, run_start: float,
                            timeout_s: float) -> None:
    """Send one streamed completion and fill record with its timings.

    TTFT runs to the first chunk with a choice in it; the usage chunk that ends
    the stream carries the token count, since the server folds tokens that
    decode to no text into the next chunk (so chunks can be fewer than tokens).
    """
    start = time.perf_counter()
    record.start_s = start - run_start
    last = None
    usage_tokens = None
    done = False
    try:
        # httpx's timeouts bound each read, not the whole request: bound it here.
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=payload, headers=headers) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {body[:300]}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = f"stream error: {chunk['error'].get('message')}"
                        return
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    if not chunk.get("choices"):
                        continue
                    record.served_model = chunk.get("model")
                    record.num_chunks += 1
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
    except TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
        return
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return
    record.e2e_s = time.perf_counter() - start
    if not done:
        record.error = "the stream ended before [DONE]"
        return
    if record.ttft_s is None:
        record.error = "the stream ended without output"
        return
    record.output_tokens = usage_tokens if usage_tokens is not None else record.num_chunks
    if record.output_tokens > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)
    record.success = True


# ---------------------------------------------------------------- server discovery


async def discover_models(client: httpx.AsyncClient, base_url: str,
                          headers: dict[str, str]) -> tuple[str, list[str], int | None]:
    """(base model name, adapter names in the server's order, max_model_len)."""
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    cards = response.json()["data"]
    bases = [c for c in cards if not c.get("parent")]
    if not bases:
        raise SystemExit(f"{base_url}/v1/models lists no base model")
    base_names = {c["id"] for c in bases}
    adapters = [c["id"] for c in cards if c.get("parent") in base_names]
    return bases[0]["id"], adapters, bases[0].get("max_model_len")


async def probe_vocab_size(client: httpx.AsyncClient, base_url: str) -> int:
    """The tokenizer's size, found by bisection on which ids /detokenize accepts
    (the server rejects ids outside [0, vocab) with a 400)."""

    async def valid(token_id: int) -> bool:
        response = await client.post(f"{base_url}/detokenize", json={"tokens": [token_id]})
        if response.status_code not in (200, 400):
            response.raise_for_status()
        return response.status_code == 200

    if not await valid(0):
        raise SystemExit("/detokenize rejects token id 0; pass --vocab-size")
    lo, hi = 0, 1 << 10  # lo is valid; grow hi until it is not
    while await valid(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            raise SystemExit("could not bound the vocabulary through /detokenize")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await valid(mid):
            lo = mid
        else:
            hi = mid
    return lo + 1


def machine() -> str:
    """The accelerator this client runs next to (the usual setup: same host)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()}"


# ---------------------------------------------------------------- the run


@dataclass
class Target:
    """What every run of one invocation talks to."""

    url: str  # the completions endpoint
    headers: dict[str, str]
    base: str
    adapters: list[str]
    vocab_size: int


async def discover(args: argparse.Namespace) -> Target:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        try:
            base, server_adapters, max_model_len = await discover_models(client, base_url,
                                                                         headers)
        except httpx.HTTPError as exc:
            raise SystemExit(f"cannot list the models of {base_url}: {exc}") from exc
        if args.adapter_names:
            missing = [n for n in args.adapter_names if n not in server_adapters]
            if missing:
                raise SystemExit(f"adapters not served by {base_url}: {missing}; "
                                 f"it serves {server_adapters}")
            adapters = list(args.adapter_names)
        else:
            adapters = list(server_adapters)
        if args.num_adapters is not None:
            if args.num_adapters > len(adapters):
                raise SystemExit(f"--num-adapters {args.num_adapters} but only "
                                 f"{len(adapters)} adapters: {adapters}")
            adapters = adapters[:args.num_adapters]
        if args.phases and "lora" in args.phases and not adapters:
            raise SystemExit("--phases has a lora phase but the run has no adapters")
        longest = args.input_len[1] + args.output_len[1]
        if max_model_len and longest > max_model_len:
            raise SystemExit(f"input {args.input_len[1]} + output {args.output_len[1]} tokens "
                             f"exceed max_model_len {max_model_len}")
        vocab_size = args.vocab_size or await probe_vocab_size(client, base_url)
    return Target(f"{base_url}/v1/completions", headers, base, adapters, vocab_size)


def payload(record: RequestRecord, prompt: list[int]) -> dict[str, Any]:
    return {
        "model": record.model, "prompt": prompt, "max_tokens": record.max_tokens,
        "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }


def draw_lengths(num: int, bounds: tuple[int, int], rng: random.Random) -> list[int]:
    low, high = bounds
    return [rng.randint(low, high) for _ in range(num)]


def plan_run(args: argparse.Namespace, target: Target, phase: str | None,
             phase_index: int) -> tuple[list[RequestRecord], dict[int, list[int]]]:
    """The requests of one run and their prompts. Separate random streams per
    purpose, so that changing one knob (say the rate) leaves the prompts and the
    model choices of a seed as they were. Every phase gets the same lengths and
    send times but prompts of its own (a prefix cache would serve repeats)."""
    seed, num = args.seed, args.num_requests
    base_fraction = {None: args.base_fraction, "base": 1.0, "lora": 0.0}[phase]
    models = pick_models(num, target.base, target.adapters, args.adapter_dist, args.zipf_s,
                         base_fraction, random.Random(f"{seed}-models"))
    input_lens = draw_lengths(num, args.input_len, random.Random(f"{seed}-input-lens"))
    output_lens = draw_lengths(num, args.output_len, random.Random(f"{seed}-output-lens"))
    prompt_rng = random.Random(f"{seed}-prompts" + (f"-{phase_index}" if phase else ""))
    prompts = {i: random_prompts(1, n, target.vocab_size, prompt_rng)[0]
               for i, n in enumerate(input_lens)}
    offsets = arrival_offsets(num, args.request_rate, args.arrival,
                              random.Random(f"{seed}-arrivals"))
    records = [RequestRecord(i, models[i], input_lens[i], output_lens[i], offsets[i])
               for i in range(num)]
    return records, prompts


async def send_requests(args: argparse.Namespace, target: Target, records: list[RequestRecord],
                        prompts: dict[int, list[int]], max_concurrency: int | None) -> None:
    """Send `records` at their scheduled times, at most max_concurrency at once."""
    # No connection cap: httpx's default pool of 100 would queue requests inside
    # the client, and that wait would be counted as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # Each completion is bounded as a whole by --request-timeout in stream_completion.
    timeout = httpx.Timeout(max(args.request_timeout, 30.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        run_start = time.perf_counter()

        async def one(record: RequestRecord) -> None:
            delay = run_start + record.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = payload(record, prompts[record.index])
            if semaphore is None:
                await stream_completion(client, target.url, target.headers, body, record,
                                        run_start, args.request_timeout)
                return
            async with semaphore:
                await stream_completion(client, target.url, target.headers, body, record,
                                        run_start, args.request_timeout)

        await asyncio.gather(*(one(r) for r in records))


def _send_share(job: tuple) -> list[RequestRecord]:
    """One client process's share of a run (multiprocessing's entry point)."""
    args, target, records, prompts, max_concurrency = job
    asyncio.run(send_requests(args, target, records, prompts, max_concurrency))
    return records


def run_requests(args: argparse.Namespace, target: Target, records: list[RequestRecord],
                 prompts: dict[int, list[int]]) -> tuple[list[RequestRecord], float]:
    """Run one planned run; (the records, filled in, and the run's wall time)."""
    clients = args.num_clients
    start = time.perf_counter()
    if clients == 1:
        asyncio.run(send_requests(args, target, records, prompts, args.max_concurrency))
        return records, time.perf_counter() - start
    cap = args.max_concurrency
    jobs = []
    for k in range(clients):
        share = records[k::clients]
        limit = None if cap is None else cap // clients + (k < cap % clients)
        jobs.append((args, target, share, {r.index: prompts[r.index] for r in share}, limit))
    # fork: the module may have been loaded from a path (tests), which spawn
    # could not import again; no client exists yet to be copied.
    with multiprocessing.get_context("fork").Pool(clients) as pool:
        shares = pool.map(_send_share, jobs)
    duration = time.perf_counter() - start
    return sorted((r for share in shares for r in share), key=lambda r: r.index), duration


def warm_up(args: argparse.Namespace, target: Target) -> None:
    """Untimed requests, one by one, one per model in turn."""
    models = [target.base, *target.adapters]
    rng = random.Random(f"{args.seed}-warmup")

    async def run() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(max(args.request_timeout, 30.0))
                                     ) as client:
            for i in range(args.warmup_requests):
                record = RequestRecord(-1, models[i % len(models)], args.input_len[0],
                                       args.output_len[0], 0.0)
                prompt = random_prompts(1, record.prompt_len, target.vocab_size, rng)[0]
                await stream_completion(client, target.url, target.headers,
                                        payload(record, prompt), record, time.perf_counter(),
                                        args.request_timeout)
                if not record.success:
                    raise SystemExit(f"warm-up request to {record.model} failed: "
                                     f"{record.error}")

    asyncio.run(run())


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark; returns the results that --json writes."""
    target = asyncio.run(discover(args))
    warm_up(args, target)
    if not args.phases:
        records, duration = run_requests(args, target, *plan_run(args, target, None, 0))
        results = build_results(records, duration, target.adapters, args)
        return {**header(args, target), **results}
    phases = []
    for i, phase in enumerate(args.phases):
        records, duration = run_requests(args, target, *plan_run(args, target, phase, i))
        phase_adapters = target.adapters if phase == "lora" else []
        phases.append({"phase": phase, **build_results(records, duration, phase_adapters,
                                                         args)})
    return {**header(args, target), **compare_phases(phases),
            "failures": sum(p["failures"] for p in phases), "phases": phases}


def header(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    weights = adapter_weights(len(target.adapters), args.adapter_dist, args.zipf_s)
    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
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


# ---------------------------------------------------------------- command line


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


def phase_list(value: str) -> list[str]:
    phases = [p.strip() for p in value.split(",") if p.strip()]
    if not phases or any(p not in ("base", "lora") for p in phases):
        raise argparse.ArgumentTypeError("--phases is a comma-separated list of base and lora")
    return phases


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base_url", nargs="?", default=DEFAULT_URL,
                   help=f"the server's address (default {DEFAULT_URL})")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--request-rate", type=rate, default=float("inf"),
                   help="requests per second, or inf to send all at once")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson",
                   help="gaps between requests: exponential (Poisson) or exactly 1/rate")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no cap)")
    p.add_argument("--num-adapters", type=int, default=None,
                   help="use the first N adapters (default: all of them)")
    p.add_argument("--adapter-names", nargs="+", default=None,
                   help="adapters to use, in popularity order (default: /v1/models)")
    p.add_argument("--adapter-dist", choices=["uniform", "zipf"], default="uniform")
    p.add_argument("--zipf-s", type=float, default=1.1, help="the Zipf exponent")
    p.add_argument("--base-fraction", type=float, default=0.0,
                   help="share of requests sent to the base model")
    p.add_argument("--input-len", type=lengths, default=(512, 512),
                   help="prompt tokens: N, or LO:HI drawn uniformly per request")
    p.add_argument("--output-len", type=lengths, default=(128, 128),
                   help="output tokens: N, or LO:HI drawn uniformly per request")
    p.add_argument("--phases", type=phase_list, default=None,
                   help="e.g. base,lora,base,lora: one run per phase, all to the base "
                        "model or all to the adapters, and the LoRA/base ratio")
    p.add_argument("--num-clients", type=int, default=1,
                   help="client processes, each with its share of --max-concurrency")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="for the random prompts (default: probed through /detokenize)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="untimed requests sent one by one before the run")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request counts as failed")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
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
    if not 0.0 <= args.base_fraction <= 1.0:
        p.error("--base-fraction must be in [0, 1]")
    if args.request_timeout <= 0:
        p.error("--request-timeout must be > 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run from the command line (argv None) or from a test; returns the results."""
    args = parse_args(argv)
    results = run_benchmark(args)
    if argv is not None:
        # Called from Python: record the arguments that were really used.
        results["command"] = shlex.join(["python", "benchmarks/serve.py", *argv])
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["failures"] == 0 else 1)
