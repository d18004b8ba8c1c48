"""Prometheus metrics of the API server, all named `loraserve:...`.

Each server owns its own CollectorRegistry (no process-wide global), fed from two
places: per-request timings and token counts from the engine client, and the
scheduler's stats that the engine core sends with its outputs.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from loraserve.engine.protocol import SchedulerStats

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
        self._resident: set[tuple[str, str]] = set()
        self._preemptions_seen = 0
        self.lora_info: Gauge | None = None
        self.lora_resident: Gauge | None = None
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
        self.lora_resident = Gauge(
            PREFIX + "lora_adapter_resident",
            "1 while the adapter is held at this level (gpu: a device slot, cpu: the "
            "CPU cache).",
            ["adapter", "level"], registry=reg,
        )

    def record_stats(self, stats: SchedulerStats) -> None:
        """Take in the scheduler stats that came with one engine step."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions > self._preemptions_seen:
            self.num_preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = max(self._preemptions_seen, stats.num_preemptions)
        if self.lora_info is not None:
            self._record_lora(stats)

    def _record_lora(self, stats: SchedulerStats) -> None:
        self.lora_info.labels(
            max_lora=str(self.max_loras),
            waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
            running_lora_adapters=",".join(stats.running_lora_adapters),
        ).set(time.time())
        resident = {(name, "gpu") for name in stats.gpu_lora_adapters}
        resident |= {(name, "cpu") for name in stats.cpu_lora_adapters}
        for adapter, level in self._resident - resident:
            self.lora_resident.remove(adapter, level)
        for adapter, level in resident:
            self.lora_resident.labels(adapter=adapter, level=level).set(1)
        self._resident = resident

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
