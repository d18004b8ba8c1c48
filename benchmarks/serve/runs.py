"""The runs of one invocation: what the server serves, the requests of each run
(or phase) planned from the seed, sent from one or more client processes, and
the results of all runs together."""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import random
import time
from typing import Any

from benchmarks.serve.load import (
    RequestRecord,
    Target,
    httpx,
    payload,
    send_requests,
    stream_completion,
)
from benchmarks.serve.report import build_results, compare_phases, compare_plain_schema, header
from benchmarks.serve.server_metrics import mean_over_run, scrape_step_adapters
from benchmarks.serve.structured import pick_constrained, valid_answer
from benchmarks.workload import arrival_offsets, draw_lengths, pick_models, random_prompts


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


def chosen_adapters(args: argparse.Namespace, base_url: str,
                    server_adapters: list[str]) -> list[str]:
    """The adapters of the run, most popular first: --adapter-names, or the names
    --adapter-pattern makes for 0..N-1, or the server's first N; each one served."""
    if args.adapter_pattern:
        adapters = [args.adapter_pattern.format(i, i=i) for i in range(args.num_adapters)]
    elif args.adapter_names:
        adapters = list(args.adapter_names)
    else:
        adapters = list(server_adapters)
    served = set(server_adapters)
    missing = [n for n in adapters if n not in served]
    if missing:
        shown = server_adapters if len(server_adapters) <= 20 else [*server_adapters[:20], "..."]
        raise SystemExit(f"adapters not served by {base_url}: {missing[:20]}"
                         f"{' ...' if len(missing) > 20 else ''}; it serves {shown}")
    if args.num_adapters is not None:
        if args.num_adapters > len(adapters):
            raise SystemExit(f"--num-adapters {args.num_adapters} but only "
                             f"{len(adapters)} adapters: {adapters}")
        adapters = adapters[:args.num_adapters]
    return adapters


async def discover(args: argparse.Namespace) -> Target:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        try:
            base, server_adapters, max_model_len = await discover_models(client, base_url,
                                                                         headers)
        except httpx.HTTPError as exc:
            raise SystemExit(f"cannot list the models of {base_url}: {exc}") from exc
        adapters = chosen_adapters(args, base_url, server_adapters)
        if args.phases and "lora" in args.phases and not adapters:
            raise SystemExit("--phases has a lora phase but the run has no adapters")
        longest = args.input_len[1] + args.output_len[1]
        if max_model_len and longest > max_model_len:
            raise SystemExit(f"input {args.input_len[1]} + output {args.output_len[1]} tokens "
                             f"exceed max_model_len {max_model_len}")
        vocab_size = args.vocab_size or await probe_vocab_size(client, base_url)
    return Target(f"{base_url}/v1/completions", headers, base, adapters, vocab_size)


def plan_run(args: argparse.Namespace, target: Target, phase: str | None,
             phase_tag: str) -> tuple[list[RequestRecord], dict[int, list[int]]]:
    """The requests of one run and their prompts. Separate random streams per
    purpose, so that changing one knob (say the rate) leaves the prompts and the
    model choices of a seed as they were. Every phase gets the same lengths and
    send times but prompts of its own (a prefix cache would serve repeats): its
    phase_tag (its place, or a warm-up's) seeds them."""
    seed, num = args.seed, args.num_requests
    base_fraction = {"base": 1.0, "lora": 0.0}.get(phase, args.base_fraction)
    # A plain phase sends no schema, a schema phase its fraction; base and LoRA
    # phases (and a run without phases) send the fraction too.
    fraction = 0.0 if phase == "plain" else args.structured_fraction
    models = pick_models(num, target.base, target.adapters, args.adapter_dist, args.zipf_alpha,
                         base_fraction, random.Random(f"{seed}-models"))
    input_lens = draw_lengths(num, args.input_len, random.Random(f"{seed}-input-lens"))
    output_lens = draw_lengths(num, args.output_len, random.Random(f"{seed}-output-lens"))
    prompt_rng = random.Random(f"{seed}-prompts" + (f"-{phase_tag}" if phase else ""))
    prompts = {i: random_prompts(1, n, target.vocab_size, prompt_rng)[0]
               for i, n in enumerate(input_lens)}
    offsets = arrival_offsets(num, args.request_rate, args.arrival,
                              random.Random(f"{seed}-arrivals"))
    constrained = pick_constrained(num, fraction, random.Random(f"{seed}-constrained"))
    records = [RequestRecord(i, models[i], input_lens[i], output_lens[i], offsets[i],
                             constrained=constrained[i])
               for i in range(num)]
    return records, prompts


def check_answers(records: list[RequestRecord]) -> None:
    """Mark each constrained request that succeeded with whether its answer is
    JSON that the schema accepts."""
    for record in records:
        if record.constrained and record.success:
            record.valid_json = valid_answer(record.output_text or "")


def _send_share(job: tuple) -> list[RequestRecord]:
    """One client process's share of a run (multiprocessing's entry point)."""
    args, target, records, prompts, max_concurrency, max_outstanding = job
    asyncio.run(send_requests(args, target, records, prompts, max_concurrency,
                              max_outstanding))
    return records


def _share_of(total: int | None, clients: int, k: int) -> int | None:
    return None if total is None else total // clients + (k < total % clients)


def run_requests(args: argparse.Namespace, target: Target, records: list[RequestRecord],
                 prompts: dict[int, list[int]]) -> tuple[list[RequestRecord], float]:
    """Run one planned run; (the records, filled in, and the run's wall time)."""
    clients = args.num_clients
    # Closed loop (infinite rate), every request is due at once: the bound is for
    # open-loop arrivals outrunning the server.
    bound = None if math.isinf(args.request_rate) else args.max_outstanding
    start = time.perf_counter()
    if clients == 1:
        asyncio.run(send_requests(args, target, records, prompts, args.max_concurrency,
                                  bound))
        return records, time.perf_counter() - start
    jobs = []
    for k in range(clients):
        share = records[k::clients]
        jobs.append((args, target, share, {r.index: prompts[r.index] for r in share},
                     _share_of(args.max_concurrency, clients, k),
                     _share_of(bound, clients, k)))
    # fork: the module may have been loaded from a path (tests), which spawn
    # could not import again; no client exists yet to be copied.
    with multiprocessing.get_context("fork").Pool(clients) as pool:
        shares = pool.map(_send_share, jobs)
    duration = time.perf_counter() - start
    return sorted((r for share in shares for r in share), key=lambda r: r.index), duration


def measured_run(args: argparse.Namespace, target: Target, phase: str | None,
                 phase_tag: str) -> dict[str, Any]:
    """One run's results, with the server's distinct adapters per step over it
    (its /metrics scraped before and after)."""
    planned = plan_run(args, target, phase, phase_tag)
    before = scrape_step_adapters(args.base_url, target.headers)
    records, duration = run_requests(args, target, *planned)
    check_answers(records)
    per_step = mean_over_run(before, scrape_step_adapters(args.base_url, target.headers))
    return build_results(records, duration, per_step)


def warm_up(args: argparse.Namespace, target: Target) -> None:
    """Untimed requests, one by one, one per model in turn; then, when the run
    sends constrained requests, one of them to the base model, so that the server
    compiles the schema's grammar before any timed request."""
    models = [target.base, *target.adapters]
    rng = random.Random(f"{args.seed}-warmup")
    requests = [RequestRecord(-1, models[i % len(models)], args.input_len[0],
                              args.output_len[0], 0.0) for i in range(args.warmup_requests)]
    if args.structured_fraction > 0:
        requests.append(RequestRecord(-1, target.base, args.input_len[0], args.output_len[1],
                                      0.0, constrained=True))

    async def run() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(max(args.request_timeout, 30.0))
                                     ) as client:
            for record in requests:
                prompt = random_prompts(1, record.prompt_len, target.vocab_size, rng)[0]
                await stream_completion(client, target.url, target.headers,
                                        payload(record, prompt), record, time.perf_counter(),
                                        args.request_timeout)
                if not record.success:
                    raise SystemExit(f"warm-up request to {record.model} failed: "
                                     f"{record.error}")

    asyncio.run(run())


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark; returns the results that --json writes. Warm-up
    phases run first and stay out of the figures and the failure count."""
    target = asyncio.run(discover(args))
    warm_up(args, target)
    warmup = [{"phase": phase, **measured_run(args, target, phase, f"warmup-{i}")}
              for i, phase in enumerate(args.warmup_phases or [])]
    if not args.phases:
        return {**header(args, target), **measured_run(args, target, None, "0"),
                **({"warmup": warmup} if warmup else {})}
    phases = [{"phase": phase, **measured_run(args, target, phase, str(i))}
              for i, phase in enumerate(args.phases)]
    return {**header(args, target), **compare_phases(phases), **compare_plain_schema(phases),
            "failures": sum(p["failures"] for p in phases), "phases": phases,
            "warmup": warmup}
