"""Per-request statistics that the front end gathers from the engine's outputs, for
the metrics: the latencies as the front end sees them (time to first token, the
gaps between tokens, end to end) and the phases of each request in the engine's
own clock (queued, prefill, decode), as vLLM defines them.

The engine core stamps its events with its own monotonic clock: when a request
entered its queue and was first scheduled (sent with the request's first token,
see protocol.RequestTimes) and when each step's tokens came out
(EngineCoreOutputs.timestamp). Intervals are only taken between two times of the
same clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.engine.protocol import RequestTimes


@dataclass(frozen=True)
class FinishedRequest:
    """One finished engine request (a child of an n > 1 request counts alone)."""

    finish_reason: str
    e2e_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None
    # Engine phases; None when the request never produced a token (it failed or
    # was refused before), as there is no prefill or decode to time then.
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None
    # decode_s over the tokens after the first (0 with a single token).
    mean_time_per_output_token_s: float | None = None


@dataclass
class IterationStats:
    """What one engine message (one step's outputs) adds to the metrics."""

    # The prompts of requests whose first token came in this message: vLLM counts a
    # prompt once its prefill is done.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequest] = field(default_factory=list)
    # Per finished request as the client sent it: (n, the most tokens any of its
    # sequences generated).
    finished_parents: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RequestTimeline:
    """The times of one engine request so far."""

    arrival: float  # front-end monotonic time the request was added
    num_prompt_tokens: int
    max_tokens: int | None
    num_generation_tokens: int = 0
    last_token_seen: float | None = None  # front-end time of its latest tokens
    engine_times: RequestTimes | None = None
    engine_first_token: float | None = None
    engine_last_token: float | None = None

    def add_tokens(self, num_tokens: int, times: RequestTimes | None,
                   engine_now: float | None, now: float, stats: IterationStats) -> None:
        """Tokens of one step, which the engine made at engine_now and the front end
        sees at now."""
        if num_tokens == 0:
            return
        if self.num_generation_tokens == 0:
            stats.num_prompt_tokens += self.num_prompt_tokens
            stats.time_to_first_token_s.append(now - self.arrival)
            self.engine_times = times
            self.engine_first_token = engine_now
        else:
            stats.inter_token_latency_s.append(now - self.last_token_seen)
        stats.num_generation_tokens += num_tokens
        self.num_generation_tokens += num_tokens
        self.last_token_seen = now
        self.engine_last_token = engine_now

    def finish(self, finish_reason: str, now: float) -> FinishedRequest:
        phases = {}
        times = self.engine_times
        first, last = self.engine_first_token, self.engine_last_token
        if times is not None and first is not None and last is not None:
            decode = last - first
            phases = {
                "queue_s": times.scheduled - times.queued,
                "prefill_s": first - times.scheduled,
                "decode_s": decode,
                "inference_s": last - times.scheduled,
                "mean_time_per_output_token_s": (
                    decode / (self.num_generation_tokens - 1)
                    if self.num_generation_tokens > 1 else 0.0),
            }
        return FinishedRequest(
            finish_reason=finish_reason, e2e_s=now - self.arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            max_tokens=self.max_tokens, **phases,
        )
