"""`--enable-log-requests`: one log line per request, with what it asks for but
never its text."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams

logger = logging.getLogger("loraserve.requests")

# The sampling fields a log line shows, when they differ from their defaults.
_SUMMARY_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                   "min_tokens", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logprobs", "ignore_eos")


def summarize_sampling(params: SamplingParams) -> str:
    defaults = SamplingParams()
    parts = [f"{name}={getattr(params, name)!r}" for name in _SUMMARY_FIELDS
             if getattr(params, name) != getattr(defaults, name)]
    if params.stop or params.stop_token_ids:
        parts.append(f"stops={len(params.stop or []) + len(params.stop_token_ids or [])}")
    # How many, never which: a bad word is request text.
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(params, name):
            parts.append(f"{name}={len(getattr(params, name))}")
    if params.structured_outputs is not None:
        # Which kind only: a schema or grammar can be long, and say what the text is.
        parts.append(f"structured_outputs={params.structured_outputs.kind}")
    return ", ".join(parts) or "defaults"


class RequestLoggingEngine:
    """Wraps the engine client for the serving classes: `generate` logs the request
    and hands on; everything else is the client's own."""

    def __init__(self, engine: Any, base_model_name: str) -> None:
        self._engine = engine
        self._base_model_name = base_model_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Any]:
        model = lora_request.lora_name if lora_request is not None else self._base_model_name
        logger.info("request %s: model %s, %d prompt tokens, sampling: %s%s", request_id,
                    model, len(prompt_token_ids), summarize_sampling(params),
                    f"; priority {priority}" if priority else "")
        return self._engine.generate(request_id, prompt, prompt_token_ids, params,
                                     lora_request, priority)
