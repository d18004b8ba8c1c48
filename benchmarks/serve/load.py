"""Load generation: one streamed completion timed from send to [DONE], and the
requests of a run sent at their times (when each goes, to which model, with which
prompt and lengths comes from benchmarks.workload; which carry a JSON schema from
benchmarks.serve.structured)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

try:
    import httpx
except ImportError:  # the GPU machine's image has the drop-in fork only
    import httpx2 as httpx

from benchmarks.serve.structured import RESPONSE_FORMAT


@dataclass
class RequestRecord:
    index: int
    model: str
    prompt_len: int
    max_tokens: int
    scheduled_s: float  # planned send time, from the start of the run
    start_s: float = 0.0  # actual send time, from the start of the run
    sent: bool = False  # False: never sent (the run stopped at --max-outstanding)
    success: bool = False
    error: str | None = None
    output_tokens: int = 0
    served_model: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    num_chunks: int = 0
    # A constrained request carries the JSON schema; it may end before max_tokens
    # (its JSON complete), so its output length is what the server counted.
    constrained: bool = False
    finish_reason: str | None = None
    output_text: str | None = None  # kept for constrained requests only
    valid_json: bool | None = None  # constrained: the answer is JSON that the schema accepts
    # Gaps between successive content chunks; kept out of the JSON (it can be large).
    itl_s: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["itl_s"]
        return data


@dataclass
class Target:
    """What every run of one invocation talks to."""

    url: str  # the completions endpoint
    headers: dict[str, str]
    base: str
    adapters: list[str]
    vocab_size: int


def payload(record: RequestRecord, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": record.model, "prompt": prompt, "max_tokens": record.max_tokens,
        "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if record.constrained:
        body["response_format"] = RESPONSE_FORMAT
    return body


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
    record.sent = True
    last = None
    usage_tokens = None
    done = False
    pieces: list[str] | None = [] if record.constrained else None
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
                    choice = chunk["choices"][0]
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                    if pieces is not None:
                        pieces.append(choice.get("text") or "")
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
    if pieces is not None:
        record.output_text = "".join(pieces)
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


async def send_requests(args: argparse.Namespace, target: Target, records: list[RequestRecord],
                        prompts: dict[int, list[int]], max_concurrency: int | None,
                        max_outstanding: int | None = None) -> None:
    """Send `records` at their scheduled times, at most max_concurrency at once.

    A request is outstanding from its scheduled time (waiting for a concurrency
    slot counts) to its end. Open-loop arrivals faster than the server serves
    would pile up for ever: once max_outstanding are outstanding when the next
    one is due, the run sends nothing more and marks the rest as not sent.
    """
    # No connection cap: httpx's default pool of 100 would queue requests inside
    # the client, and that wait would be counted as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # Each completion is bounded as a whole by --request-timeout in stream_completion.
    timeout = httpx.Timeout(max(args.request_timeout, 30.0))
    outstanding = 0
    stopped = False
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        run_start = time.perf_counter()

        async def one(record: RequestRecord) -> None:
            nonlocal outstanding, stopped
            delay = run_start + record.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if not stopped and max_outstanding is not None and outstanding >= max_outstanding:
                stopped = True
            if stopped:
                record.error = (f"not sent: {max_outstanding} requests were outstanding "
                                "(--max-outstanding)")
                return
            outstanding += 1
            body = payload(record, prompts[record.index])
            try:
                if semaphore is None:
                    await stream_completion(client, target.url, target.headers, body, record,
                                            run_start, args.request_timeout)
                    return
                async with semaphore:
                    await stream_completion(client, target.url, target.headers, body, record,
                                            run_start, args.request_timeout)
            finally:
                outstanding -= 1

        await asyncio.gather(*(one(r) for r in records))
