"""Prometheus metrics of the API server.

The names take the prefix `loraserve:` by default, and vLLM's `vllm:` with
--metrics-prefix vllm: then every metric that LoRA-aware routers (the Gateway API
Inference Extension's endpoint picker, llm-d's scheduler) and vLLM's Grafana
dashboards read has vLLM's exact name, type and labels, so that they work
unchanged. The prefix is the only difference: under either, a metric has the same
labels, buckets and meaning (vLLM's, where vLLM has the metric).

Each server owns its own CollectorRegistry (no process-wide global), fed from three
places: what the OutputProcessor counts in each engine message (tokens, latencies,
finished requests and their phases), the scheduler's stats that the engine core
sends with its outputs, and the cache configuration once the engine is up.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
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
from loraserve.engine.request_stats import FinishedRequest, IterationStats
from loraserve.engine.step_stats import STEP_LORA_ADAPTER_BUCKETS
from loraserve.lora.load_times import LORA_LOAD_TIME_BUCKETS_S

if TYPE_CHECKING:
    from loraserve.config import CacheConfig

# --metrics-prefix: its choices and the prefix of the names each gives.
METRICS_PREFIXES: dict[str, str] = {"loraserve": "loraserve:", "vllm": "vllm:"}
CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM labels each series with its engine core's index; a server here has one.
ENGINE_INDEX = "0"
# The finish reasons that request_success has a series for from the start (0 until
# one happens), as vLLM exports them.
FINISH_REASONS = ("stop", "length", "abort", "error")

# Bucket bounds: vLLM's, so that a dashboard's SLO thresholds (which must be bucket
# bounds) fall on one, and loraserve's finer ones besides.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# End to end, and each phase of a request in the engine.
_REQUEST_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.3, 0.5, 0.75, 0.8,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 80.0,
    120.0, 160.0, 240.0, 480.0, 640.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_TOKENS_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def token_count_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: the buckets of per-request token
    counts (vLLM's), up to the context length."""
    buckets: list[int] = []
    for scale in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10**scale
            if value > max_value:
                return buckets
            buckets.append(value)
    return buckets


def cache_config_labels(cache_config: CacheConfig, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of cache_config_info that loraserve has a value for: vLLM's names,
    the values written as vLLM writes them (Python's str())."""
    return {
        "block_size": str(cache_config.block_size),
        # The KV cache is kept in the model's dtype (vLLM's "auto").
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cache_config.enable_prefix_caching),
        "gpu_memory_utilization": str(cache_config.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(cache_config.kv_cache_memory_bytes),
        "num_gpu_blocks": str(num_gpu_blocks),
    }


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

    def __init__(self, model_name: str, max_loras: int | None, prefix: str = "loraserve",
                 max_model_len: int = 131072) -> None:
        """max_loras None: LoRA is off, and the LoRA metrics are not exported. prefix:
        a key of METRICS_PREFIXES. max_model_len bounds the token-count buckets."""
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {sorted(METRICS_PREFIXES)}, "
                             f"got {prefix!r}")
        self.prefix = METRICS_PREFIXES[prefix]
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.max_loras = max_loras
        reg = self.registry
        name = self.name
        # The process's own metrics (process_* and python_*: CPU, memory, file
        # descriptors, start time, the garbage collector), as vLLM's server has them.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            reg.register(collector)

        def per_model(kind, suffix: str, doc: str, **kwargs):
            # One series of this model: the metric with its model and engine bound.
            return kind(name(suffix), doc, ["model_name", "engine"], registry=reg,
                        **kwargs).labels(model_name, ENGINE_INDEX)

        # Scheduler state, from the engine's stats.
        self.num_running = per_model(
            Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = per_model(
            Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = per_model(
            Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = per_model(
            Counter, "num_preemptions", "Cumulative number of preemptions from the engine.")
        # In tokens, as vLLM counts them: a prompt's tokens looked up, and those found.
        self.prefix_cache_queries = per_model(
            Counter, "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = per_model(
            Counter, "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.")
        self._prefix_seen = (0, 0)
        self._preemptions_seen = 0

        # Tokens, counted as each step's outputs come.
        self.prompt_tokens = per_model(
            Counter, "prompt_tokens",
            "Number of prefill tokens processed: a prompt counts once its first token is out.")
        self.generation_tokens = per_model(
            Counter, "generation_tokens", "Number of generation tokens processed.")
        self.iteration_tokens = per_model(
            Histogram, "iteration_tokens_total",
            "Histogram of number of tokens per engine step: the generated tokens of the "
            "step plus the prompts whose first token it produced.",
            buckets=_ITERATION_TOKENS_BUCKETS)
        self.ttft = per_model(
            Histogram, "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.", buckets=_TTFT_BUCKETS)
        self.itl = per_model(
            Histogram, "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", buckets=_ITL_BUCKETS)
        # vLLM's older name of the same samples, which dashboards still query.
        self.time_per_output_token = per_model(
            Histogram, "time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the inter-token latency; "
            "the older name).", buckets=_ITL_BUCKETS)

        # Finished requests.
        self.request_success = Counter(
            name("request_success"), "Count of finished requests, by finish reason.",
            ["model_name", "engine", "finished_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, ENGINE_INDEX, reason)
        self.e2e = per_model(
            Histogram, "e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            buckets=_REQUEST_LATENCY_BUCKETS)
        self.queue_time = per_model(
            Histogram, "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request: from entering the "
            "engine's queue to being first scheduled.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.prefill_time = per_model(
            Histogram, "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request: from being first "
            "scheduled to the first token.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.decode_time = per_model(
            Histogram, "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request: from the first token to "
            "the last.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.inference_time = per_model(
            Histogram, "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request: from being first "
            "scheduled to the last token.", buckets=_REQUEST_LATENCY_BUCKETS)
        self.request_tpot = per_model(
            Histogram, "request_time_per_output_token_seconds",
            "Histogram of each request's mean time per output token after the first, "
            "in seconds.", buckets=_ITL_BUCKETS)
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = per_model(
            Histogram, "request_prompt_tokens",
            "Histogram of the number of prompt tokens of each finished request.",
            buckets=token_buckets)
        self.request_generation_tokens = per_model(
            Histogram, "request_generation_tokens",
            "Histogram of the number of tokens each finished request generated.",
            buckets=token_buckets)
        self.request_max_tokens = per_model(
            Histogram, "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.", buckets=token_buckets)
        self.request_n = per_model(
            Histogram, "request_params_n", "Histogram of the n request parameter.",
            buckets=_PARAMS_N_BUCKETS)
        self.request_max_generation_tokens = per_model(
            Histogram, "request_max_num_generation_tokens",
            "Histogram of the most tokens any sequence of a finished request generated.",
            buckets=token_buckets)
        self._cache_info: Gauge | None = None

        self._loaded: set[tuple[str, str, str]] = set()
        self.lora_info: Gauge | None = None
        self._info_labels: tuple[str, str, str] | None = None
        if max_loras is None:
            return
        # The value is the time of the update, so a LoRA-aware router takes the
        # series with the largest value as the current state.
        self.lora_info = Gauge(
            name("lora_requests_info"),
            "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=reg,
        )
        # There from the start: a router that finds no series takes the server for
        # one without LoRA.
        self._set_lora_info((), ())
        # One series per adapter, at the fastest level that holds it: a router prefers
        # a replica where the adapter is on the device, then one where it is in CPU
        # memory, over one that must read it from disk.
        self.lora_loaded = Gauge(
            name("lora_adapter_loaded"),
            "1 while the LoRA adapter is loaded: level gpu while it holds a device slot, "
            "cpu while it is only in the CPU cache. Pinned adapters are never evicted.",
            ["adapter_name", "level", "pinned"], registry=reg,
        )
        self.num_gpu_loaded = Gauge(
            name("num_gpu_loaded_lora_adapters"),
            "Number of LoRA adapters in device slots.", registry=reg,
        )
        self.num_cpu_loaded = Gauge(
            name("num_cpu_loaded_lora_adapters"),
            "Number of LoRA adapters in the CPU cache.", registry=reg,
        )
        # Counted when a request reaches the engine, from the engine's running totals.
        self.lora_cache_hits = Counter(
            name("lora_cache_hits"),
            "Requests whose LoRA adapter was in the CPU cache or a device slot when they "
            "arrived.", registry=reg,
        )
        self.lora_cache_misses = Counter(
            name("lora_cache_misses"),
            "Requests whose LoRA adapter had to be read from disk first.", registry=reg,
        )
        self._lora_cache_seen = (0, 0)
        self.lora_load_time = EngineTotalsHistogram(
            name("lora_adapter_load_seconds"),
            "Histogram of LoRA adapter load time in seconds, from the start of the disk "
            "read to the adapter being usable in the CPU cache.",
            LORA_LOAD_TIME_BUCKETS_S, reg,
        )
        self.step_lora_adapters = EngineTotalsHistogram(
            name("step_lora_adapters"),
            "Histogram of the number of distinct LoRA adapters in each model step the "
            "engine launched (0: the base model only).",
            STEP_LORA_ADAPTER_BUCKETS, reg,
        )

    def name(self, suffix: str) -> str:
        """The full name of a metric under this server's prefix."""
        return self.prefix + suffix

    def set_cache_config(self, labels: Mapping[str, str]) -> None:
        """Export cache_config_info: an info gauge (value 1) whose labels describe the
        KV cache (see cache_config_labels), once the engine has sized it."""
        if self._cache_info is not None:
            self.registry.unregister(self._cache_info)
        info = {**labels, "engine": ENGINE_INDEX}
        self._cache_info = Gauge(self.name("cache_config_info"),
                                 "Information of the KV cache configuration.", sorted(info),
                                 registry=self.registry)
        self._cache_info.labels(**info).set(1)

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

    def _set_lora_info(self, waiting: Sequence[str], running: Sequence[str]) -> None:
        labels = (str(self.max_loras), ",".join(waiting), ",".join(running))
        # Only the current series: one kept for every adapter combination ever seen
        # would grow /metrics without bound as adapters come and go.
        if self._info_labels is not None and self._info_labels != labels:
            self.lora_info.remove(*self._info_labels)
        self.lora_info.labels(*labels).set(time.time())
        self._info_labels = labels

    def _record_lora(self, stats: SchedulerStats) -> None:
        self._set_lora_info(stats.waiting_lora_adapters, stats.running_lora_adapters)
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
        hits, misses = stats.lora_cache_hits, stats.lora_cache_misses
        seen_hits, seen_misses = self._lora_cache_seen
        if hits >= seen_hits and misses >= seen_misses:
            self.lora_cache_hits.inc(hits - seen_hits)
            self.lora_cache_misses.inc(misses - seen_misses)
        self._lora_cache_seen = (hits, misses)
        if stats.lora_load_time_counts:
            self.lora_load_time.set_totals(stats.lora_load_time_counts,
                                           stats.lora_load_time_sum_s)
        if stats.step_lora_adapter_counts:
            self.step_lora_adapters.set_totals(stats.step_lora_adapter_counts,
                                               stats.step_lora_adapters_sum)

    def record_iteration(self, stats: IterationStats) -> None:
        """Take in what one engine message's outputs added (OutputProcessor)."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        num_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        for seconds in stats.time_to_first_token_s:
            self.ttft.observe(seconds)
        for seconds in stats.inter_token_latency_s:
            self.itl.observe(seconds)
            self.time_per_output_token.observe(seconds)
        for request in stats.finished_requests:
            self._record_finished(request)
        for n, most_tokens in stats.finished_parents:
            self.request_n.observe(n)
            self.request_max_generation_tokens.observe(most_tokens)

    def _record_finished(self, request: FinishedRequest) -> None:
        self.request_success.labels(self.model_name, ENGINE_INDEX, request.finish_reason).inc()
        self.e2e.observe(request.e2e_s)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        if request.max_tokens:
            self.request_max_tokens.observe(request.max_tokens)
        for histogram, seconds in ((self.queue_time, request.queue_s),
                                   (self.prefill_time, request.prefill_s),
                                   (self.decode_time, request.decode_s),
                                   (self.inference_time, request.inference_s),
                                   (self.request_tpot, request.mean_time_per_output_token_s)):
            if seconds is not None:
                histogram.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
