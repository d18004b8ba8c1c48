"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import math

import msgspec

from loraserve.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's extra: the logprob of every prompt token after the first, its rank, and
    # the top prompt_logprobs alternatives at that position.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema, a regex, choices or a grammar.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a message that names the bad field."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (off) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got "
                f"{self.min_tokens}",
            ),
            (
                all(t >= 0 for t in self.stop_token_ids or ()),
                f"stop_token_ids must not be negative, got {self.stop_token_ids}",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                f"logprobs must be >= 0, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def uses_penalties(self) -> bool:
        """Repetition, frequency or presence penalties: they read the whole output."""
        return (self.repetition_penalty != 1.0 or bool(self.frequency_penalty)
                or bool(self.presence_penalty))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])
