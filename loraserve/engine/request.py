"""A request's state inside the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraserve.engine.protocol import EngineCoreRequest, FinishReason, RequestTimes
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams
from loraserve.worker.input_batch import PENDING_TOKEN

if TYPE_CHECKING:
    from loraserve.structured_output.request_grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    lora_request: LoRARequest | None
    arrival_time: float
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Sampled tokens still on their way back from the device (async scheduling):
    # they count in num_tokens, and the next step reads them on the device.
    num_pending: int = 0
    # Prefix caching (engine/kv_blocks.py): the hashes of the request's full blocks
    # so far, kept through preemption, and how many of block_ids are in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Prompt logprobs: the prompt positions whose logprobs are already on their way
    # (a recomputation after preemption does not send them again).
    num_prompt_logprobs_sent: int = 0
    # For the metrics: when the request entered the engine's queue and when the
    # scheduler first gave it a place in a step (this process's monotonic clock).
    queued_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    # Steps this request waited with its adapter ready but no place for it among
    # the max_loras running adapters (engine/lora_admission.py).
    slot_waits: int = 0
    # Structured outputs: the request's grammar (compile, then matcher), if any.
    grammar: RequestGrammar | None = None

    @classmethod
    def from_engine_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            lora_request=req.lora_request,
            arrival_time=req.arrival_time,
            priority=req.priority,
        )

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    def first_token_times(self) -> RequestTimes | None:
        """The queue and schedule times, once: with the request's first output token."""
        if len(self.output_token_ids) != 1 or self.scheduled_time is None:
            return None
        return RequestTimes(self.queued_time, self.scheduled_time)

    def max_tokens_left(self, max_model_len: int) -> int:
        """The most tokens this request may still generate."""
        limit = max_model_len - len(self.prompt_token_ids)
        if self.sampling_params.max_tokens is not None:
            limit = min(limit, self.sampling_params.max_tokens)
        return max(0, limit - len(self.output_token_ids) - self.num_pending)

    @property
    def waiting_for_grammar(self) -> bool:
        """Its grammar is still compiling: it cannot be scheduled yet."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    def at_length_limit(self, num_output: int, max_model_len: int) -> bool:
        """Whether `num_output` output tokens reach max_tokens or max_model_len."""
        max_tokens = self.sampling_params.max_tokens
        return ((max_tokens is not None and num_output >= max_tokens)
                or len(self.prompt_token_ids) + num_output >= max_model_len)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end); a pending token reads as PENDING_TOKEN."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        # Slice each list rather than join them: a decode step asks for one token.
        known = self.prompt_token_ids[start:] if start < prompt_len else []
        known += self.output_token_ids[max(0, start - prompt_len):end - prompt_len]
        return known + [PENDING_TOKEN] * (end - start - len(known))
