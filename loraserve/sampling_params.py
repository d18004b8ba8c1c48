"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import msgspec

from loraserve.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# OpenAI's range for a logit bias; larger values are clamped to it, as vLLM does.
MAX_LOGIT_BIAS = 100.0


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
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias;
    # clamped to [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words that must not be generated. The front end tokenizes them into
    # bad_words_token_ids (see tokenize_bad_words), which is what the sampler reads.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Constrain the output to a JSON schema, a regex, choices or a grammar.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _clamped_bias(self.logit_bias)
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
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids must not be empty: nothing could be sampled",
            ),
            (
                all(word.strip() for word in self.bad_words or ()),
                "bad_words must not hold an empty or blank word",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for name, token_ids in self.token_id_fields():
            bad = next((t for t in token_ids if t < 0), None)
            if bad is not None:
                raise ValueError(f"{name} must not hold negative token ids, got {bad}")

    def token_id_fields(self) -> Iterator[tuple[str, list[int]]]:
        """(field, token ids) for every field that names token ids, so that a
        caller who knows the vocabulary can check them all."""
        yield "stop_token_ids", list(self.stop_token_ids or [])
        yield "logit_bias", list(self.logit_bias or {})
        yield "allowed_token_ids", list(self.allowed_token_ids or [])
        yield "bad_words", [t for word in self.bad_words_token_ids or () for t in word]

    @property
    def has_logit_controls(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: the sampler changes this
        request's logits (and only this request's) before it samples."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None \
            or bool(self.bad_words_token_ids)

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling reads the tokens generated so far: penalties, and bad
        words of more than one token (their last token is banned only after the
        others). Such a request needs its previous token back on the host first."""
        return self.uses_penalties or any(len(w) > 1 for w in self.bad_words_token_ids or ())

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


def _clamped_bias(bias: dict[Any, float]) -> dict[int, float]:
    """Token id keys as ints (JSON object keys arrive as strings) and biases within
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]."""
    clamped = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias keys must be token ids (integers), got {key!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r}")
        clamped[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
    return clamped


def tokenize_bad_words(bad_words: list[str], tokenizer: Any) -> list[list[int]]:
    """The token id sequences that stand for `bad_words`, as vLLM finds them: each
    word (leading spaces removed) as it is tokenized alone, and, where the tokenizer
    folds a leading space into the first token, the form with that space too (the
    word in the middle of a text)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        word = word.lstrip()
        alone = tokenizer.encode(word, add_special_tokens=False)
        sequences.append(alone)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        # A space that makes a token of its own ("_", "word") adds nothing new: the
        # word itself is banned already.
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return [s for s in sequences if s]
