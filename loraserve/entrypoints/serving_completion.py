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
    UsageInfo,
    random_id,
)
from loraserve.entrypoints.serving_common import (
    MAX_SEQUENCES_PER_REQUEST,
    OpenAIServing,
    TokenText,
    build_sampling_params,
    check_token_ids,
    check_unsupported,
    chosen_and_top,
    context_length_exceeded,
    final_outputs,
    finish_error,
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
            if isinstance(item, str):
                self.check_prompt_text(item)
            else:
                check_token_ids(item, self.limits.vocab_size, "prompt")
                if len(item) >= self.max_model_len:
                    raise context_length_exceeded(self.max_model_len, len(item), "prompt")
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
        if request.suffix:
            raise bad_request("suffix is not supported by this server.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of must be unset or equal to n.", param="best_of")
        if request.echo and request.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported.", param="echo")
        response_format = getattr(request, "response_format", None)
        if response_format and response_format.get("type", "text") != "text":
            raise bad_request("Only response_format type 'text' is supported.",
                              param="response_format")
        lora = await self.models.resolve(request.model)
        prompts = await self._prompts(request)
        params = [
            build_sampling_params(
                request,
                resolve_max_tokens(request.max_tokens, len(ids), self.max_model_len),
                request.logprobs,
                self.limits.vocab_size,
                self.sampling_defaults,
            )
            for _, ids in prompts
        ]
        if self.engine.is_dead:
            raise engine_unavailable()
        request_id = random_id("cmpl")
        streams = [
            self.engine.generate(f"{request_id}-{i}", text, ids, p, lora)
            for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True))
        ]
        model_name = request.model or self.models.base_model_name
        token_text = TokenText(self.tokenizer.hf, bool(request.return_tokens_as_token_ids))
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
        for i, outputs in enumerate(await final_outputs(streams)):
            for out in outputs:
                prefix = (prompts[i][0] or "") if request.echo else ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _logprobs(out.token_ids, out.logprobs, request.logprobs,
                                         token_text, len(prefix))
                choices.append(CompletionChoice(
                    index=i * request.n + out.index,
                    text=prefix + out.text,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                ))
                completion_tokens += len(out.token_ids)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
        )

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
                    if index not in offsets:
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
                        logprobs = _logprobs(out.delta_token_ids, out.delta_logprobs,
                                             request.logprobs, token_text, offsets[index])
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
        result.token_logprobs.append(entry.get(token_id))
        result.top_logprobs.append({token_text(t): lp for t, lp in chosen_and_top(entry, k)})
        result.text_offset.append(offset)
        offset += len(text)
    return result
