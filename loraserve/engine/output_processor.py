"""Front-end side of the engine: fans a request with n > 1 out into child
requests, turns per-step token outputs into text (incremental detokenization),
finds stop strings, gathers children back into one RequestOutput, and counts what
each step's outputs add to the metrics (request_stats.IterationStats).

The API server and the offline LLM both use it, so both behave the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from loraserve.engine.detokenizer import IncrementalDetokenizer
from loraserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from loraserve.engine.request_stats import IterationStats, RequestTimeline
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams, tokenize_bad_words


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    delta_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Logprob:
    """A token's logprob at a prompt position, its rank there (1: the most likely)
    and its text."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    lora_request: LoRARequest | None = None
    # With SamplingParams.prompt_logprobs, as vLLM gives them: None for the first
    # prompt token, then per prompt token {token_id: Logprob}, the prompt token
    # first, then the top-k alternatives.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    stats: IterationStats = field(default_factory=IterationStats)


class _ChildState:
    """Detokenization state of one sequence."""

    def __init__(self, parent: _ParentState, index: int, params: SamplingParams,
                 timeline: RequestTimeline, eos_token_id: int | None = None) -> None:
        self.parent = parent
        self.timeline = timeline
        self.eos_token_id = eos_token_id
        self.out = CompletionOutput(index=index)
        if params.logprobs is not None:
            self.out.logprobs = []
            self.out.cumulative_logprob = 0.0
        self.params = params
        self.stops = params.stop_strings
        self.sent_chars = 0  # text already handed out as deltas
        self.detokenizer: IncrementalDetokenizer | None = None


class _ParentState:
    def __init__(self, request_id, prompt, prompt_token_ids, lora_request) -> None:
        self.output = RequestOutput(request_id, prompt, list(prompt_token_ids), [], False,
                                    lora_request)
        self.children: list[_ChildState] = []
        self.child_ids: list[str] = []


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._children: dict[str, _ChildState] = {}
        self._parents: dict[str, _ParentState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        eos_token_id: int | None = None,
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.bad_words and params.bad_words_token_ids is None:
            # The engine has no tokenizer: the bad words reach it as token ids.
            params = msgspec.structs.replace(
                params, bad_words_token_ids=tokenize_bad_words(params.bad_words, self.tokenizer))
        parent = _ParentState(request_id, prompt, prompt_token_ids, lora_request)
        if params.prompt_logprobs is not None:
            parent.output.prompt_logprobs = [None]
        self._parents[request_id] = parent
        requests = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            child_params = params
            if params.n > 1:
                # Each child samples on its own; a seed stays reproducible per child.
                # The prompt, the same for all, has its logprobs computed once.
                seed = None if params.seed is None else params.seed + i
                child_params = msgspec.structs.replace(
                    params, n=1, seed=seed,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            timeline = RequestTimeline(time.monotonic(), len(prompt_token_ids),
                                       child_params.max_tokens)
            child = _ChildState(parent, i, child_params, timeline, eos_token_id)
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, child_params.skip_special_tokens
            )
            parent.children.append(child)
            parent.child_ids.append(child_id)
            parent.output.outputs.append(child.out)
            self._children[child_id] = child
            requests.append(EngineCoreRequest(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=child_params,
                eos_token_id=eos_token_id,
                lora_request=lora_request,
                priority=priority,
            ))
        return requests

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.child_ids) if parent is not None else []

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the child ids to abort in the engine."""
        return self._forget(request_id)

    def _forget(self, request_id: str) -> list[str]:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for cid in parent.child_ids:
            del self._children[cid]
        return parent.child_ids

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        engine_timestamp: float | None = None) -> ProcessedOutputs:
        """One engine message's outputs; engine_timestamp is when the engine made them
        (EngineCoreOutputs.timestamp), without which the engine phases go untimed."""
        result = ProcessedOutputs()
        now = time.monotonic()
        touched: dict[str, _ParentState] = {}
        for eco in outputs:
            child = self._children.get(eco.request_id)
            if child is None or child.out.finished:
                continue  # aborted meanwhile, or already stopped by a stop string
            parent = child.parent
            if eco.prompt_logprobs is not None and parent.output.prompt_logprobs is not None:
                parent.output.prompt_logprobs.extend(
                    self._prompt_logprobs(eco.prompt_logprobs))
            if not eco.new_token_ids and eco.finish_reason is None:
                # Prompt logprobs of a prefill chunk: they are reported with the
                # first token, so that a consumer sees them whole.
                continue
            if parent.output.request_id not in touched:
                # Deltas are per call: clear them in every child of a parent that
                # reports now (only those; the others are not read).
                touched[parent.output.request_id] = parent
                for c in parent.children:
                    c.out.delta_text = ""
                    c.out.delta_token_ids = []
                    c.out.delta_logprobs = None
            child.timeline.add_tokens(len(eco.new_token_ids), eco.times, engine_timestamp,
                                      now, result.stats)
            if self._update_child(child, eco):
                result.reqs_to_abort.append(eco.request_id)
            if child.out.finished:
                result.stats.finished_requests.append(
                    child.timeline.finish(child.out.finish_reason, now))
        for rid, parent in touched.items():
            parent.output.finished = all(c.out.finished for c in parent.children)
            result.request_outputs.append(parent.output)
            if parent.output.finished:
                result.stats.finished_parents.append(
                    (len(parent.children), max(len(c.out.token_ids) for c in parent.children)))
                self._forget(rid)
        return result

    def _prompt_logprobs(
        self, positions: list[list[tuple[int, float, int]]]
    ) -> list[dict[int, Logprob]]:
        result = []
        for entries in positions:
            position: dict[int, Logprob] = {}
            for token_id, logprob, rank in entries:
                # The prompt token may be among the top-k too: keep its first entry.
                if token_id not in position:
                    position[token_id] = Logprob(logprob, rank,
                                                 self.tokenizer.decode([token_id]))
            result.append(position)
        return result

    def _update_child(self, child: _ChildState, eco: EngineCoreOutput) -> bool:
        """Apply one step's tokens. True when a stop string ended it (abort in engine)."""
        out = child.out
        out.token_ids.extend(eco.new_token_ids)
        out.delta_token_ids = list(eco.new_token_ids)
        if eco.new_logprobs is not None and out.logprobs is not None:
            delta = [dict(entry) for entry in eco.new_logprobs]
            out.logprobs.extend(delta)
            out.delta_logprobs = delta
            out.cumulative_logprob += sum(entry[0][1] for entry in eco.new_logprobs)

        text_ids = eco.new_token_ids
        if _ended_by_stop_token(child, eco):
            # As vLLM: the token that ended the request is not part of its text
            # (which matters when special tokens are kept, as tool parsers ask).
            text_ids = text_ids[:-1]
        text = child.detokenizer.add(text_ids, final=eco.finish_reason is not None)
        stopped_by_string = False
        if eco.finish_reason != FinishReason.ERROR:
            hit = _find_stop(text, child.stops, len(out.text))
            if hit is not None:
                stop, pos = hit
                text = text[: pos + len(stop)] if child.params.include_stop_str_in_output \
                    else text[:pos]
                out.finish_reason = FinishReason.STOP.value
                out.stop_reason = stop
                stopped_by_string = eco.finish_reason is None
        if out.finish_reason is None and eco.finish_reason is not None:
            out.finish_reason = eco.finish_reason.value
            out.stop_reason = eco.stop_reason
            out.error = eco.error
        out.text = text
        # While running, hold back an incomplete UTF-8 character and anything that
        # could still grow into a stop string, so streamed deltas never need undoing.
        visible = len(text)
        if not out.finished:
            while visible and text[visible - 1] == "\ufffd":
                visible -= 1
            if child.stops:
                visible = max(child.sent_chars, visible - (max(map(len, child.stops)) - 1))
        visible = max(visible, child.sent_chars)
        out.delta_text = text[child.sent_chars:visible]
        child.sent_chars = visible
        return stopped_by_string


def _ended_by_stop_token(child: _ChildState, eco: EngineCoreOutput) -> bool:
    """The step's last token is the EOS or stop token id that ended the request, and
    its text is not asked for (include_stop_str_in_output)."""
    if eco.finish_reason != FinishReason.STOP or not eco.new_token_ids \
            or child.params.include_stop_str_in_output:
        return False
    return eco.stop_reason is not None or eco.new_token_ids[-1] == child.eos_token_id


def _find_stop(text: str, stops: list[str], old_len: int) -> tuple[str, int] | None:
    best = None
    for stop in stops:
        # Only new text can hold a new match (plus an overlap with the old tail).
        pos = text.find(stop, max(0, old_len - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[1]):
            best = (stop, pos)
    return best
