"""What completions and chat completions share: their engine and model handles,
request checks, sampling parameters, logprob formatting, SSE framing and merging
of several streams."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraserve.entrypoints.beam_search import Beam, BeamSearchParams, beam_search
from loraserve.entrypoints.core_client import EngineDeadError
from loraserve.entrypoints.errors import APIError, bad_request, engine_unavailable
from loraserve.entrypoints.protocol import SamplingFields
from loraserve.entrypoints.structured_outputs import (
    Constraint,
    GrammarChecker,
    request_constraint,
)
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams, tokenize_bad_words
from loraserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from loraserve.entrypoints.core_client import AsyncEngineClient
    from loraserve.entrypoints.request_tokenizer import RequestTokenizer
    from loraserve.entrypoints.serving_models import ServingModels

# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
# Sequences one request may ask for: n per prompt, and n times the prompts of a
# completions request. Each one is scheduled, detokenized and answered on its own.
MAX_N = 128
MAX_SEQUENCES_PER_REQUEST = 1024
# Every stop string is searched for in every new piece of text of every sequence
# (on the event loop), every stop token id in every sampled token (in the engine).
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
# Every bad word is matched against every request's output at every step (on the
# engine's host thread): vLLM's bounds.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 1024
# Sampling fields beam search has no use for that would change the answer: a
# request that sets them with use_beam_search is refused (vLLM ignores them).
_NOT_WITH_BEAM_SEARCH = ("logit_bias", "allowed_token_ids", "bad_words", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "prompt_logprobs")


@dataclass(frozen=True)
class ModelLimits:
    """What a request's tokens must fit: the context length and the model's
    vocabulary (hf_config.vocab_size, the rows of its embedding, which may differ
    from len(tokenizer))."""

    max_model_len: int
    vocab_size: int


class OpenAIServing:
    """Base of the completion and chat handlers."""

    def __init__(
        self,
        engine: AsyncEngineClient,
        models: ServingModels,
        tokenizer: RequestTokenizer,
        limits: ModelLimits,
        sampling_defaults: dict[str, Any] | None = None,
        scheduling_policy: str = "fcfs",
        grammar_checker: GrammarChecker | None = None,
    ) -> None:
        self.sampling_defaults = sampling_defaults or {}
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.limits = limits
        self.scheduling_policy = scheduling_policy
        if grammar_checker is None:
            from loraserve.config import StructuredOutputsConfig

            grammar_checker = GrammarChecker(StructuredOutputsConfig())
        self.grammar_checker = grammar_checker

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def check_prompt(self, prompt: str | Sequence[int], param: str = "prompt",
                     room: int = 1) -> None:
        check_prompt_size(self.tokenizer, self.max_model_len, prompt, param, room)

    def check_priority(self, request: SamplingFields) -> None:
        """As vLLM: a priority other than 0 needs the priority scheduling policy."""
        if request.priority != 0 and self.scheduling_policy != "priority":
            raise bad_request(
                f"priority is not supported by this server (got {request.priority}): it "
                "schedules first come, first served; start it with --scheduling-policy "
                "priority to schedule by priority.", param="priority")

    async def add_bad_words(self, params: SamplingParams) -> None:
        """Tokenize the request's bad words (on a tokenizer thread) into
        params.bad_words_token_ids, which is what the engine reads."""
        if not params.bad_words:
            return
        size = sum(map(len, params.bad_words))
        ids = await self.tokenizer.run(size, tokenize_bad_words, params.bad_words,
                                       self.tokenizer.hf)
        if sum(map(len, ids)) > MAX_BAD_WORD_TOKENS:
            raise bad_request(f"bad_words may make at most {MAX_BAD_WORD_TOKENS} tokens in "
                              f"all, got {sum(map(len, ids))}.", param="bad_words")
        check_token_ids((t for word in ids for t in word), self.limits.vocab_size, "bad_words")
        params.bad_words_token_ids = ids

    async def beam_search(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: BeamSearchParams,
        lora: LoRARequest | None,
        priority: int = 0,
    ) -> list[Beam]:
        """The best beams for one prompt (see beam_search.py), each step's beams
        run as engine requests for one token and its most likely alternatives."""
        steps = itertools.count()

        async def step(sequences: list[list[int]], num_logprobs: int):
            step_id = f"{request_id}-beam{next(steps)}"
            # A beam width beyond half the vocabulary ranks every token.
            one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                       logprobs=min(num_logprobs, self.limits.vocab_size))
            streams = [self.engine.generate(f"{step_id}-{i}", None, ids, one_token, lora,
                                            priority)
                       for i, ids in enumerate(sequences)]
            finals = await final_request_outputs(streams)
            return [sorted(final.outputs[0].logprobs[0].items(), key=lambda item: -item[1])
                    for final in finals]

        return await beam_search(step, prompt_ids, params, self.engine.eos_token_id,
                                 self.tokenizer.hf)
    async def structured_outputs(self, request: SamplingFields,
                                 extra: Constraint | None = None
                                 ) -> StructuredOutputsParams | None:
        """The request's output constraint (None: none), checked to compile: a 400
        naming the problem otherwise. `extra`: one the endpoint adds (tools)."""
        config = self.grammar_checker.config
        constraint = request_constraint(request, config.backend, extra)
        if constraint is None:
            return None
        # Building a grammar takes time in proportion to the constraint.
        await self.tokenizer.run(len(constraint.params.spec), self.grammar_checker.check,
                                 constraint)
        return constraint.params


def check_prompt_size(
    tokenizer: RequestTokenizer,
    max_model_len: int,
    prompt: str | Sequence[int],
    param: str,
    room: int = 1,
) -> None:
    """400 at once for a prompt (a text, or token ids) that certainly has more than
    `max_model_len - room` tokens, before anyone spends the time and memory to
    tokenize or detokenize it. Every endpoint checks what it is given here.

    room: the tokens the request must leave free to generate (none for /tokenize
    and /detokenize, which only count and convert)."""
    allowed = max_model_len - room
    if not isinstance(prompt, str):
        if len(prompt) > allowed:
            raise context_length_exceeded(max_model_len, len(prompt), param)
        return
    at_least = tokenizer.min_tokens(prompt)
    if at_least > allowed:
        raise context_length_exceeded(max_model_len, at_least, param, exact=False)
    most = tokenizer.max_chars(allowed)
    if len(prompt) > most:
        raise too_many_characters(max_model_len, most, param, len(prompt))


def too_many_characters(
    max_model_len: int, most: int, param: str, length: int | None = None
) -> APIError:
    """The 400 for a prompt longer than the `most` characters that the server
    tokenizes for its context (length: the prompt's, where known)."""
    has = "is longer than" if length is None else f"is {length} characters long, more than"
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt {has} the {most} characters this server tokenizes for that context. "
        "Please reduce the length of the input.",
        param=param,
    )


# Fields of vLLM's CompletionRequest and ChatCompletionRequest that loraserve does
# not implement, with the value that means "not used". A request that sets one to
# anything else gets a 400 naming it rather than an answer that ignores it.
# (docs/vllm-compatibility.md lists them.)
_UNSET = object()
VLLM_FIELDS_NOT_SUPPORTED: dict[str, Any] = {
    "truncate_prompt_tokens": None,
    "spaces_between_special_tokens": True,
    "logits_processors": None,
    "structural_tag": None,
    "request_id": None,
    "return_token_ids": False,
    "cache_salt": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "prompt_embeds": None,
    "mm_processor_kwargs": None,
}
CHAT_FIELDS_NOT_SUPPORTED: dict[str, Any] = {
    "prompt_logprobs": None,
    "echo": False,
    "reasoning_effort": None,
}
_WHY_NOT_SUPPORTED = {
    "prompt_logprobs": "loraserve returns prompt logprobs on /v1/completions only",
}


def check_not_supported(request: SamplingFields, fields: dict[str, Any]) -> None:
    """400 naming the first of `fields` that the request sets to a value that
    would change the answer."""
    for name, unused in fields.items():
        value = getattr(request, name, _UNSET)
        if value is _UNSET or value is None or value == unused:
            continue
        if isinstance(value, list | dict) and not value:
            continue
        why = _WHY_NOT_SUPPORTED.get(name)
        shown = repr(value)
        if len(shown) > 80:  # a whole JSON schema would bury the message
            shown = shown[:77] + "..."
        raise bad_request(
            f"{name} is not supported by this server (got {shown})"
            + (f": {why}." if why else "."), param=name,
        )


def check_unsupported(request: SamplingFields) -> None:
    check_not_supported(request, VLLM_FIELDS_NOT_SUPPORTED)
    if request.n < 1:
        raise bad_request(f"n must be at least 1, got {request.n}.", param="n")
    if request.n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {request.n}.", param="n")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options can only be set when stream is true.",
                          param="stream_options")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}.",
                          param="stop")
    if len(request.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
        raise bad_request(
            f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got "
            f"{len(request.stop_token_ids)}.", param="stop_token_ids",
        )
    if len(request.bad_words or []) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words takes at most {MAX_BAD_WORDS} words, got "
                          f"{len(request.bad_words)}.", param="bad_words")
    check_beam_search(request)


def check_beam_search(request: SamplingFields) -> None:
    """best_of, and what use_beam_search can be combined with."""
    best_of = request.best_of
    if not request.use_beam_search:
        if best_of is not None and best_of != request.n:
            raise bad_request("best_of must be unset or equal to n unless use_beam_search "
                              f"is true (got best_of={best_of}, n={request.n}).",
                              param="best_of")
        return
    if best_of is not None and not request.n <= best_of <= MAX_N:
        raise bad_request(f"With use_beam_search, best_of (the beam width) must be between n "
                          f"({request.n}) and {MAX_N}, got {best_of}.", param="best_of")
    unused = SamplingParams()
    for name in _NOT_WITH_BEAM_SEARCH:
        value = getattr(request, name, None)
        if value is None or value == getattr(unused, name) or value in ([], {}):
            continue
        raise bad_request(f"{name} is not supported with use_beam_search: beam search "
                          "ranks beams by the model's own logprobs.", param=name)


def beam_search_params(request: SamplingFields, max_tokens: int,
                       logprobs: int | None) -> BeamSearchParams:
    """The beam search a request asks for (with use_beam_search)."""
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return BeamSearchParams(
        beam_width=request.best_of or request.n,
        n=request.n,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
        length_penalty=request.length_penalty,
        early_stopping=request.early_stopping,
        min_tokens=min(request.min_tokens, max_tokens),
        stop=tuple(stops),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        logprobs=logprobs,
    )


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """400 naming the field and the first id that is not in the model's vocabulary."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"{param} contains token id {token_id}, which is not in the model's "
                f"vocabulary [0, {vocab_size}).", param=param,
            )


def context_length_exceeded(
    max_model_len: int, prompt_len: int, param: str, exact: bool = True
) -> APIError:
    has = f"has {prompt_len}" if exact else f"has at least {prompt_len}"
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt {has} tokens. Please reduce the length of the input.",
        param=param,
    )


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, param: str = "max_tokens"
) -> int:
    """The number of tokens to generate; 400 when the prompt and output do not fit."""
    if prompt_len >= max_model_len:
        raise context_length_exceeded(
            max_model_len, prompt_len,
            "messages" if param == "max_completion_tokens" else "prompt",
        )
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}.", param=param)
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the input, "
            f"{requested} in the completion). Please reduce the length of the input or "
            "completion.",
            param=param,
        )
    return requested


# Sampling fields that a model's generation_config.json may set, as vLLM reads them
# with --generation-config auto: they replace the OpenAI defaults, not the request.
_GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                             "max_new_tokens")


def load_sampling_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults from `<model_dir>/generation_config.json`, if any."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in _GENERATION_CONFIG_FIELDS if config.get(k) is not None}


def build_sampling_params(
    request: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    defaults: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
    logprobs_field: str = "logprobs",
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams from an OpenAI request; invalid values become a 400.

    A field the request leaves unset takes the model's default (`defaults`), then
    OpenAI's. logprobs_field: the request field that `logprobs` came from (chat's
    `top_logprobs`), which an error about it names."""
    defaults = defaults or {}
    check_token_ids(request.stop_token_ids or [], vocab_size, "stop_token_ids")

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, fallback)

    for name, value in ((logprobs_field, logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value < 0:
            raise bad_request(f"{name} must be >= 0, got {value}.", param=name)
        if value is not None and value > MAX_LOGPROBS:
            raise bad_request(f"{name} must be at most {MAX_LOGPROBS}, got {value}.",
                              param=name)
    fields: dict[str, Any] = {
        "n": request.n,
        "temperature": pick("temperature", 1.0),
        "top_p": pick("top_p", 1.0),
        "top_k": pick("top_k", 0),
        "min_p": pick("min_p", 0.0),
        "seed": request.seed,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "repetition_penalty": pick("repetition_penalty", 1.0),
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "logit_bias": request.logit_bias or None,
        "allowed_token_ids": request.allowed_token_ids,
        "bad_words": request.bad_words or None,
        "structured_outputs": structured_outputs,
    }
    check_token_ids(request.allowed_token_ids or [], vocab_size, "allowed_token_ids")
    try:
        params = SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        # SamplingParams' messages start with the field they are about.
        name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param=name if name in fields else None) from exc
    check_token_ids(params.logit_bias or {}, vocab_size, "logit_bias")
    return params


class TokenText:
    """Decodes single tokens for logprob listings, as text or as `token_id:N`."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


# What a logprob that JSON cannot carry goes out as, vLLM's floor: -inf (a token
# with no chance) and NaN (non-finite logits, from a broken model or adapter) read
# as "no chance" to a client, where json.dumps would write an invalid NaN or
# Infinity and the non-streamed response would fail with a 500.
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob as JSON may carry it: in [LOGPROB_FLOOR, 0], NaN as the floor
    (a logprob is never above 0, so the upper bound only catches +inf)."""
    if math.isnan(logprob):
        return LOGPROB_FLOOR
    return min(max(logprob, LOGPROB_FLOOR), 0.0)


def top_entries(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely (token_id, logprob) pairs, most likely first."""
    return sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:k]


def chosen_and_top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The sampled token and then the k most likely, at most k + 1 pairs: what
    OpenAI's completions API (and vLLM) list as a position's top_logprobs. The
    engine puts the sampled token first in `logprobs`, then the top k."""
    return list(logprobs.items())[:k + 1]


def usage_options(request: SamplingFields) -> tuple[bool, bool]:
    """(usage in a last chunk, usage in every chunk) of a streamed request. As in
    vLLM, continuous_usage_stats only counts together with include_usage."""
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    return include_usage, include_usage and bool(options.continuous_usage_stats)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: APIError) -> str:
    return sse(error.body())


def finish_error(outputs: list[Any]) -> APIError | None:
    """A 400 for the first choice that the engine failed (for example its adapter
    did not load), with the engine's reason."""
    for output in outputs:
        if output.finish_reason == "error":
            return bad_request(output.error or "The request failed in the engine.")
    return None


async def final_outputs(streams: list[AsyncIterator[Any]]) -> list[list[Any]]:
    """Run the streams of a non-streamed request to the end: each one's sequences,
    in index order. A sequence the engine failed raises its 400, a dead engine 503."""
    return [final.outputs for final in await final_request_outputs(streams)]


async def final_request_outputs(streams: list[AsyncIterator[Any]]) -> list[Any]:
    """final_outputs, as each stream's last RequestOutput (sequences in index order)."""
    finals: dict[int, Any] = {}
    try:
        async for index, output in merge_streams(streams):
            finals[index] = output
    except EngineDeadError as exc:
        raise engine_unavailable() from exc
    results = []
    for i in range(len(streams)):
        outputs = sorted(finals[i].outputs, key=lambda o: o.index)
        error = finish_error(outputs)
        if error is not None:
            raise error
        results.append(replace(finals[i], outputs=outputs))
    return results


async def gather_or_cancel(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await all, in order; the first to raise cancels the others (aborting their
    engine requests) and its error is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A streamed response: the events, then [DONE]. An error raised on the way (a
    failed sequence, a dead engine) ends the stream with an error event first."""
    try:
        async with aclosing(events) as inner:
            async for event in inner:
                yield event
    except EngineDeadError:
        yield sse_error(engine_unavailable())
    except APIError as exc:
        yield sse_error(exc)
    yield SSE_DONE


async def merge_streams(
    streams: list[AsyncIterator[Any]],
) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (stream index, item), in arrival order.

    Closing the merged iterator (a client went away) cancels every stream, which
    aborts their requests in the engine.
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
            await queue.put((index, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
