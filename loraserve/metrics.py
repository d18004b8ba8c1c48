"""Prometheus metrics of the API server, all named `loraserve:...`.

Each server owns its own CollectorRegistry (no process-wide global), fed from two
places: per-request timings and token counts from the engine client, and the
scheduler's stats that the engine core sends with its outputs.

The LoRA metrics carry vLLM's names with our prefix (`vllm:lora_requests_info` is
`loraserve:lora_requests_info`, and so on), so that dashboards and LoRA-aware
routers written for vLLM read them unchanged.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from loraserve.engine.protocol import SchedulerStats
from loraserve.lora.load_times import LORA_LOAD_TIME_BUCKETS_S

PREFIX = "loraserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0,
)  # fmt: skip


class EngineTotalsHistogram(Collector):
    """A histogram counted in the engine process: the engine keeps the count per
    bucket and the sum, and sends them with its stats; the latest are rendered as
    they are. A value is thus never lost or counted twice, however many stats
    messages carry the same totals."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        registry.register(self)

    def set_totals(self, counts: Sequence[int], total: float) -> None:
        """Counts per bucket (not cumulative), the last one for values above every bound."""
        if len(counts) != len(self._counts):
            raise ValueError(
                f"{self.name}: {len(counts)} bucket counts for {len(self._counts)} buckets"
            )
        self._counts = list(counts)
        self._sum = total

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = list(itertools.accumulate(self._counts))
        buckets = [(floatToGoString(b), n) for b, n in zip(self.bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                    sum_value=self._sum)


class ServerMetrics:
    """The metrics of one served model."""

    def __init__(self, model_name: str, max_loras: int | None) -> None:
        """max_loras None: LoRA is off, and the LoRA metrics are not exported."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.max_loras = max_loras
        reg = self.registry

        def per_model(kind, name: str, doc: str, **kwargs):
            # One series of this model: the metric with its model_name label bound.
            return kind(PREFIX + name, doc, ["model_name"], registry=reg, **kwargs).labels(
                model_name
            )

        self.num_running = per_model(
            Gauge, "num_requests_running", "Number of requests in model execution batches."
        )
        self.num_waiting = per_model(
            Gauge, "num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = per_model(
            Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prompt_tokens = per_model(
            Counter, "prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = per_model(
            Counter, "generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Count of finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=reg,
        )
        self.num_preemptions = per_model(
            Counter, "num_preemptions", "Cumulative number of preemptions from the engine."
        )
        # In tokens, as vLLM counts them: a prompt's tokens looked up, and those found.
        self.prefix_cache_queries = per_model(
            Counter, "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = per_model(
            Counter, "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self._prefix_seen = (0, 0)
        self.ttft = per_model(
            Histogram, "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.", buckets=_LATENCY_BUCKETS,
        )
        self.itl = per_model(
            Histogram, "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", buckets=_ITL_BUCKETS,
        )
        self.e2e = per_model(
            Histogram, "e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.", buckets=_LATENCY_BUCKETS,
        )
        self._loaded: set[tuple[str, str, str]] = set()
        self._preemptions_seen = 0
        self.lora_info: Gauge | None = None
        self._info_labels: tuple[str, str, str] | None = None
        if max_loras is None:
            return
        # The value is the time of the update, so a LoRA-aware router takes the
        # series with the largest value as the current state.
        self.lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=reg,
        )
        # One series per adapter, at the fastest level that holds it: a router prefers
        # a replica where the adapter is on the device, then one where it is in CPU
        # memory, over one that must read it from disk.
        self.lora_loaded = Gauge(
            PREFIX + "lora_adapter_loaded",
            "1 while the LoRA adapter is loaded: level gpu while it holds a device slot, "
            "cpu while it is only in the CPU cache. Pinned adapters are never evicted.",
            ["adapter_name", "level", "pinned"], registry=reg,
        )
        self.num_gpu_loaded = Gauge(
            PREFIX + "num_gpu_loaded_lora_adapters",
            "Number of LoRA adapters in device slots.", registry=reg,
        )
        self.num_cpu_loaded = Gauge(
            PREFIX + "num_cpu_loaded_lora_adapters",
            "Number of LoRA adapters in the CPU cache.", registry=reg,
        )
        self.lora_load_time = EngineTotalsHistogram(
            PREFIX + "lora_adapter_load_seconds",
            "Histogram of LoRA adapter load time in seconds, from the start of the disk "
            "read to the adapter being usable in the CPU cache.",
            LORA_LOAD_TIME_BUCKETS_S, reg,
        )

    def record_stats(self, stats: SchedulerStats) -> None:
        """Take in the scheduler stats that came with one engine step."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions > self._preemptions_seen:
            self.num_preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = max(self._preemptions_seen, stats.num_preemptions)
        # The engine sends running totals; a reset of its counts starts them again.
        queries, hits = stats.prefix_cache_tokens
        seen_queries, seen_hits = self._prefix_seen
        if queries >= seen_queries and hits >= seen_hits:
            self.prefix_cache_queries.inc(queries - seen_queries)
            self.prefix_cache_hits.inc(hits - seen_hits)
        self._prefix_seen = (queries, hits)
        if self.lora_info is not None:
            self._record_lora(stats)

    def _record_lora(self, stats: SchedulerStats) -> None:
        labels = (str(self.max_loras), ",".join(stats.waiting_lora_adapters),
                  ",".join(stats.running_lora_adapters))
        # Only the current series: one kept for every adapter combination ever seen
        # would grow /metrics without bound as adapters come and go.
        if self._info_labels is not None and self._info_labels != labels:
            self.lora_info.remove(*self._info_labels)
        self.lora_info.labels(*labels).set(time.time())
        self._info_labels = labels
        on_gpu, pinned = set(stats.gpu_lora_adapters), set(stats.pinned_lora_adapters)
        loaded = {
            (name, "gpu" if name in on_gpu else "cpu", "true" if name in pinned else "false")
            for name in on_gpu.union(stats.cpu_lora_adapters)
        }
        # Removed, not set to 0: an adapter that left a level has no series there.
        for labels in self._loaded - loaded:
            self.lora_loaded.remove(*labels)
        for labels in loaded:
            self.lora_loaded.labels(*labels).set(1)
        self._loaded = loaded
        self.num_gpu_loaded.set(len(on_gpu))
        self.num_cpu_loaded.set(len(set(stats.cpu_lora_adapters)))
        if stats.lora_load_time_counts:
            self.lora_load_time.set_totals(stats.lora_load_time_counts,
                                           stats.lora_load_time_sum_s)

    def record_prompt_tokens(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def record_tokens(
        self, num_tokens: int, ttft_s: float | None, inter_token_s: float | None
    ) -> None:
        """New tokens of one request; ttft_s with its first tokens, else inter_token_s."""
        self.generation_tokens.inc(num_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if inter_token_s is not None:
            self.itl.observe(inter_token_s)

    def record_finished(self, finish_reasons: list[str], e2e_s: float) -> None:
        for reason in finish_reasons:
            self.request_success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
