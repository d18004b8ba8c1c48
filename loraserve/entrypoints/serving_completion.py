"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from loraserve.entrypoints.errors import bad_request, engine_unavailable
from loraserve.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    UsageInfo,
    random_id,
)
from loraserve.entrypoints.serving_common import (
    MAX_SEQUENCES_PER_REQUEST,
    OpenAIServing,
    TokenText,
    beam_search_params,
    build_sampling_params,
    check_token_ids,
    check_unsupported,
    chosen_and_top,
    final_request_outputs,
    finish_error,
    gather_or_cancel,
    json_logprob,
    merge_streams,
    resolve_max_tokens,
    sse,
    sse_events,
    usage_options,
)


class OpenAIServingCompletion(OpenAIServing):
    async def _prompts(
        self, request: CompletionRequest
    ) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) for each prompt of the request."""
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty.", param="prompt")
        if len(items) * request.n > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(
                f"A request makes at most {MAX_SEQUENCES_PER_REQUEST} sequences; "
                f"{len(items)} prompts with n={request.n} make {len(items) * request.n}.",
                param="prompt",
            )
        # Every prompt is checked before any is tokenized: a bad one fails fast.
        for item in items:
            self.check_prompt(item)
            if not isinstance(item, str):
                check_token_ids(item, self.limits.vocab_size, "prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                text: str | None = item
                ids = await self.tokenizer.encode(item, request.add_special_tokens)
            else:
                ids = list(item)
                text = await self.tokenizer.decode(ids) if ids else ""
            if not ids:
                raise bad_request("prompt must not be empty.", param="prompt")
            prompts.append((text, ids))
        return prompts

    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        check_unsupported(request)
        self.check_priority(request)
        if request.suffix:
            raise bad_request("suffix is not supported by this server.", param="suffix")
        if request.use_beam_search and request.stream:
            raise bad_request("Streaming is not currently supported with beam search.",
                              param="stream")
        if request.use_beam_search and request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs is not supported with use_beam_search.",
                              param="echo")
        if request.stream and request.prompt_logprobs is not None:
            # As vLLM: a streamed answer has no place for them.
            raise bad_request("prompt_logprobs are not available when stream is true.",
                              param="prompt_logprobs")
        lora = await self.models.resolve(request.model)
        constraint = await self.structured_outputs(request)
        prompts = await self._prompts(request)
        params = [
            build_sampling_params(
                request,
                resolve_max_tokens(request.max_tokens, len(ids), self.max_model_len),
                request.logprobs,
                self.limits.vocab_size,
                self.sampling_defaults,
                _engine_prompt_logprobs(request),
                structured_outputs=constraint,
            )
            for _, ids in prompts
        ]
        if self.engine.is_dead:
            raise engine_unavailable()
        request_id = random_id("cmpl")
        model_name = request.model or self.models.base_model_name
        token_text = TokenText(self.tokenizer.hf, bool(request.return_tokens_as_token_ids))
        if request.use_beam_search:
            return await self._beam_search(request, request_id, model_name, prompts, lora,
                                           [p.max_tokens for p in params], token_text)
        await self.add_bad_words(params[0])
        for p in params[1:]:
            p.bad_words_token_ids = params[0].bad_words_token_ids
        streams = [
            self.engine.generate(f"{request_id}-{i}", text, ids, p, lora, request.priority)
            for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True))
        ]
        if request.stream:
            return sse_events(
                self._stream(request, request_id, model_name, prompts, streams, token_text)
            )
        return await self._full(request, request_id, model_name, prompts, streams, token_text)

    async def _full(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[tuple[str | None, list[int]]],
        streams: list[AsyncIterator[Any]],
        token_text: TokenText,
    ) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        for i, final in enumerate(await final_request_outputs(streams)):
            shown_prompt_logprobs = None
            if request.prompt_logprobs is not None:
                shown_prompt_logprobs = _prompt_logprobs(
                    final.prompt_logprobs, request.prompt_logprobs, token_text)
            for out in final.outputs:
                prefix = (prompts[i][0] or "") if request.echo else ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(out.token_ids, out.logprobs, request.logprobs,
                                         token_text, len(prefix))
                    if request.echo:
                        logprobs = _echoed(prompts[i][1], final.prompt_logprobs,
                                           request.logprobs, token_text, logprobs)
                choices.append(CompletionChoice(
                    index=i * request.n + out.index,
                    text=prefix + out.text,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    prompt_logprobs=shown_prompt_logprobs,
                ))
                completion_tokens += len(out.token_ids)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
        )

    async def _beam_search(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[tuple[str | None, list[int]]],
        lora: Any,
        max_tokens: list[int],
        token_text: TokenText,
    ) -> CompletionResponse:
        """Each prompt's best n beams as its n choices, best first."""
        searches = [
            self.beam_search(f"{request_id}-{i}", ids,
                             beam_search_params(request, limit, request.logprobs), lora,
                             request.priority)
            for i, ((_, ids), limit) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        choices = []
        completion_tokens = 0
        for i, beams in enumerate(await gather_or_cancel(searches)):
            prefix = (prompts[i][0] or "") if request.echo else ""
            for j, beam in enumerate(beams):
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(beam.token_ids, beam.logprobs, request.logprobs,
                                         token_text, len(prefix))
                choices.append(CompletionChoice(
                    index=i * request.n + j, text=prefix + beam.text, logprobs=logprobs,
                    finish_reason=beam.finish_reason, stop_reason=beam.stop_reason,
                ))
                completion_tokens += len(beam.token_ids)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(id=request_id, model=model_name, choices=choices,
                                  usage=UsageInfo.of(prompt_tokens, completion_tokens))

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompts: list[tuple[str | None, list[int]]],
        streams: list[AsyncIterator[Any]],
        token_text: TokenText,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = usage_options(request)
        offsets: dict[int, int] = {}
        finished: set[int] = set()
        completion_tokens = 0
        choice_tokens: dict[int, int] = {}
        async with aclosing(merge_streams(streams)) as merged:
            async for i, output in merged:
                for out in output.outputs:
                    index = i * request.n + out.index
                    if index in finished:
                        continue
                    if out.finish_reason == "error":
                        raise finish_error([out])
                    text = out.delta_text
                    first_chunk = index not in offsets
                    if first_chunk:
                        offsets[index] = 0
                        if request.echo:
                            text = (prompts[i][0] or "") + text
                    completion_tokens += len(out.delta_token_ids)
                    choice_tokens[index] = choice_tokens.get(index, 0) + len(out.delta_token_ids)
                    # One chunk per step that made tokens, as vLLM does, even when
                    # they give no text yet (half a character, a possible stop
                    # string): clients time tokens by chunks.
                    if not text and not out.delta_token_ids and out.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        start = len(text) - len(out.delta_text)  # the echoed prompt
                        logprobs = _logprobs(out.delta_token_ids, out.delta_logprobs,
                                             request.logprobs, token_text,
                                             offsets[index] + start)
                        if request.echo and first_chunk:
                            # The prompt's tokens all come back before the first
                            # generated one (see OutputProcessor).
                            logprobs = _echoed(prompts[i][1], output.prompt_logprobs,
                                               request.logprobs, token_text, logprobs)
                    offsets[index] += len(text)
                    if out.finish_reason is not None:
                        finished.add(index)
                    choice = CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                    # Continuous usage counts this choice's prompt and tokens so far,
                    # as vLLM does.
                    usage = UsageInfo.of(len(prompts[i][1]), choice_tokens[index]).model_dump() \
                        if continuous_usage else None
                    yield sse(_chunk(request_id, created, model_name, [choice.model_dump()],
                                     usage))
        if include_usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            usage = UsageInfo.of(prompt_tokens, completion_tokens)
            yield sse(_chunk(request_id, created, model_name, [], usage.model_dump()))


def _chunk(request_id: str, created: int, model: str, choices: list, usage: Any = None) -> dict:
    chunk = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def _logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
    k: int,
    token_text: TokenText,
    offset: int,
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for position, token_id in enumerate(token_ids):
        entry = logprobs[position] if logprobs and position < len(logprobs) else {}
        text = token_text(token_id)
        result.tokens.append(text)
        chosen = entry.get(token_id)
        result.token_logprobs.append(json_logprob(chosen) if chosen is not None else None)
        result.top_logprobs.append({token_text(t): json_logprob(lp)
                                    for t, lp in chosen_and_top(entry, k)})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _engine_prompt_logprobs(request: CompletionRequest) -> int | None:
    """The prompt logprobs the engine computes: those asked, and those echo with
    logprobs lists for the prompt's tokens."""
    wanted = [k for k in (request.prompt_logprobs,
                          request.logprobs if request.echo else None) if k is not None]
    return max(wanted) if wanted else None


def _top_of(position: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The prompt token (first) and the k most likely: the engine may have
    computed more alternatives than this answer shows."""
    entries = list(position.items())
    return entries[:1] + [(t, lp) for t, lp in entries[1:] if lp.rank <= k]


def _prompt_logprobs(
    positions: list[dict[int, Any] | None] | None, k: int, token_text: TokenText
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: keyed by token id (as a string), with the token's text."""
    return [
        None if position is None else {
            str(token_id): PromptLogprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                                         decoded_token=token_text(token_id))
            for token_id, lp in _top_of(position, k)
        }
        for position in positions or [None]
    ]


def _echoed(
    prompt_ids: list[int],
    positions: list[dict[int, Any] | None] | None,
    k: int,
    token_text: TokenText,
    generated: CompletionLogprobs,
) -> CompletionLogprobs:
    """The echoed prompt's tokens first (the first has no logprob: nothing precedes
    it), their offsets from the start of the text, then the generated ones."""
    result = CompletionLogprobs()
    offset = 0
    for token_id, position in zip(prompt_ids, positions or [], strict=True):
        text = token_text(token_id)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(json_logprob(position[token_id].logprob))
        result.top_logprobs.append(
            {token_text(t): json_logprob(lp.logprob) for t, lp in _top_of(position, k)})
    result.tokens += generated.tokens
    result.token_logprobs += generated.token_logprobs
    result.top_logprobs += generated.top_logprobs
    result.text_offset += generated.text_offset
    return result
