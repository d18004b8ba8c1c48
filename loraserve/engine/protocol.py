"""Messages between the front end (API server or offline LLM) and the engine core.

All are msgspec structs so that they cross the ZMQ sockets unchanged.
"""

from __future__ import annotations

import enum
import time

import msgspec

from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id (stop strings are found by the front end)
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # the request failed, for example its adapter did not load


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None
    arrival_time: float = msgspec.field(default_factory=time.time)
    # With --scheduling-policy priority: lower values are scheduled first (ties by
    # arrival), and are preempted last.
    priority: int = 0


class RequestTimes(msgspec.Struct, array_like=True, frozen=True):
    """When a request entered the engine's queue and when it was first scheduled, in
    the engine process's monotonic clock (comparable with EngineCoreOutputs.timestamp
    only)."""

    queued: float
    scheduled: float


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, array_like=True):
    """The new tokens of one request in one step."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: [(token_id, logprob), ...], the sampled token first, then the
    # top-k alternatives. Only when the request asked for logprobs.
    new_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that finished the request, if any.
    stop_reason: int | None = None
    # Why an ERROR happened, in words a client can act on.
    error: str | None = None
    num_prompt_tokens: int = 0
    # Only when the request asked for prompt logprobs: per prompt token this step's
    # chunk predicts, in prompt order (the first prompt token has none),
    # [(token_id, logprob, rank), ...]: the prompt token first, then the top-k
    # alternatives. A step may carry them without any new token.
    prompt_logprobs: list[list[tuple[int, float, int]]] | None = None
    # With the request's first new token, for the metrics of its phases.
    times: RequestTimes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Upper bounds (seconds) of the buckets of adapter load times, from the start of the
# disk read to the adapter being usable in the CPU cache. A small adapter on a local
# disk loads in tens of milliseconds; a large one from a network share takes seconds.
class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    # Adapter names resident in device slots and in the CPU cache.
    gpu_lora_adapters: list[str] = msgspec.field(default_factory=list)
    cpu_lora_adapters: list[str] = msgspec.field(default_factory=list)
    # Adapters that are never evicted.
    pinned_lora_adapters: list[str] = msgspec.field(default_factory=list)
    num_preemptions: int = 0
    # Every adapter load since the engine started, per bucket of
    # loraserve.lora.load_times' buckets plus one for longer loads, and their total time. Totals
    # rather than the loads since the last message: get_stats also answers utility
    # calls, and a total stays right however many messages carry it.
    lora_load_time_counts: list[int] = msgspec.field(default_factory=list)
    lora_load_time_sum_s: float = 0.0
    # Prefix caching totals since start-up: (prompt tokens looked up, tokens found).
    prefix_cache_tokens: tuple[int, int] = (0, 0)
    # Running totals: requests whose adapter was ready (in the CPU cache or a device
    # slot) when they arrived, and those whose adapter had to be read from disk.
    lora_cache_hits: int = 0
    lora_cache_misses: int = 0
    # Every launched step since start-up, per bucket of the distinct adapters it ran
    # (loraserve.engine.step_stats' buckets plus one above them), and their total.
    step_lora_adapter_counts: list[int] = msgspec.field(default_factory=list)
    step_lora_adapters_sum: int = 0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    # When the outputs were made, in the engine process's monotonic clock.
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    stats: SchedulerStats | None = None
