"""POST /v1/chat/completions: the tokenizer's chat template, then generation.

Templates render as transformers renders them, in a Jinja sandbox bounded in
output, values and time (chat_template.py), on a tokenizer thread: a template is
code. A request may bring its own template only when the server is started with
--trust-request-chat-template, and that one always renders on the thread for
large work, where a slow one holds up no small request."""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from loraserve import envs
from loraserve.entrypoints.beam_search import Beam
from loraserve.entrypoints.chat_template import ChatTemplateRenderer, TooLarge
from loraserve.entrypoints.errors import bad_request, engine_unavailable
from loraserve.entrypoints.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from loraserve.entrypoints.serving_common import (
    CHAT_FIELDS_NOT_SUPPORTED,
    LOGPROB_FLOOR,
    ModelLimits,
    OpenAIServing,
    TokenText,
    beam_search_params,
    build_sampling_params,
    check_not_supported,
    check_unsupported,
    final_outputs,
    finish_error,
    json_logprob,
    resolve_max_tokens,
    sse,
    sse_events,
    too_many_characters,
    top_entries,
    usage_options,
)
from loraserve.entrypoints.tool_calls import (
    ToolChoice,
    answer_parser,
    finish_reason,
    resolve_tool_choice,
    template_message,
    tool_constraint,
)

if TYPE_CHECKING:
    from loraserve.entrypoints.core_client import AsyncEngineClient
    from loraserve.entrypoints.request_tokenizer import RequestTokenizer
    from loraserve.entrypoints.serving_models import ServingModels
    from loraserve.entrypoints.structured_outputs import GrammarChecker
    from loraserve.entrypoints.tool_parsers import ToolParser

# apply_chat_template's inputs that chat_template_kwargs may also pass; its other
# parameters (tokenize, return_dict, padding ...) are the server's to set.
_TEMPLATE_INPUTS = frozenset({"tools", "documents"})


def _message_dict(message: Any, index: int) -> dict[str, Any]:
    """A chat message as the template expects it; content parts must be text."""
    data = message.model_dump(exclude_none=True)
    content = data.get("content")
    # As in OpenAI's API: only an assistant message that calls tools may go without
    # content; anywhere else the template would fail on it, or drop it unseen.
    if content is None and not (data.get("role") == "assistant"
                                and (data.get("tool_calls") or data.get("function_call"))):
        raise bad_request(
            f"messages[{index}].content is required for a {data.get('role')!r} message; "
            "only an assistant message with tool_calls may leave it null.",
            param=f"messages.[{index}].content",
        )
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"Only text content parts are supported, got type {part.get('type')!r}.",
                    param="messages",
                )
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    return template_message(data, index)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncEngineClient,
        models: ServingModels,
        tokenizer: RequestTokenizer,
        limits: ModelLimits,
        sampling_defaults: dict[str, Any] | None = None,
        trust_request_chat_template: bool = False,
        response_role: str = "assistant",
        scheduling_policy: str = "fcfs",
        grammar_checker: GrammarChecker | None = None,
        tool_parser: type[ToolParser] | None = None,
    ) -> None:
        super().__init__(engine, models, tokenizer, limits, sampling_defaults,
                         scheduling_policy, grammar_checker)
        self.trust_request_chat_template = trust_request_chat_template
        self.response_role = response_role
        # The parser of tool_choice "auto" (--enable-auto-tool-choice); None: refused.
        self.tool_parser = tool_parser
        # Longer output could not fit the context anyway.
        self.renderer = ChatTemplateRenderer(
            tokenizer.hf, tokenizer.max_chars(limits.max_model_len),
            float(envs.CHAT_TEMPLATE_TIMEOUT_S.get()))
        signature = inspect.signature(tokenizer.hf.apply_chat_template)
        self._reserved_kwargs = frozenset(
            name for name, p in signature.parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ) - _TEMPLATE_INPUTS

    def _template_and_kwargs(
        self, request: ChatCompletionRequest
    ) -> tuple[str | None, dict[str, Any]]:
        """The request's own template (None: the server's) and the template's extra
        variables; 400 for what the request may not set."""
        kwargs = dict(request.chat_template_kwargs or {})
        template = request.chat_template
        if "chat_template" in kwargs:
            template = template or kwargs["chat_template"]
            del kwargs["chat_template"]
        if template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "This server does not accept a chat template in the request; start it "
                "with --trust-request-chat-template to allow that.", param="chat_template",
            )
        if template is not None and not isinstance(template, str):
            raise bad_request("chat_template must be a string.", param="chat_template")
        reserved = sorted(self._reserved_kwargs & kwargs.keys())
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}.",
                              param="chat_template_kwargs")
        if request.tools:
            kwargs["tools"] = request.tools
        if request.documents:
            kwargs["documents"] = request.documents
        return template, kwargs

    async def render_prompt(
        self, request: ChatCompletionRequest, room: int = 1
    ) -> tuple[str, list[int]]:
        """Apply the chat template; the template itself adds any BOS token. A
        rendered prompt that certainly leaves fewer than `room` tokens of the
        context free is refused before it is tokenized."""
        if not request.messages:
            raise bad_request("messages must not be empty.", param="messages")
        template, kwargs = self._template_and_kwargs(request)
        hf = self.tokenizer.hf
        if template is None and not getattr(hf, "chat_template", None):
            raise bad_request("This model has no chat template; use /v1/completions.")
        messages = [_message_dict(m, i) for i, m in enumerate(request.messages)]
        # The server's template does work in proportion to its inputs; one from the
        # request may do any amount.
        size = math.inf if template is not None else \
            len(json.dumps([messages, kwargs], ensure_ascii=False, default=str))
        try:
            prompt = await self.tokenizer.run(
                size,
                self.renderer.render,
                messages,
                chat_template=template,
                add_generation_prompt=request.add_generation_prompt
                and not request.continue_final_message,
                continue_final_message=request.continue_final_message,
                **kwargs,
            )
        except TooLarge as exc:
            if template is None:  # the server's own template: the messages are too long
                raise too_many_characters(self.max_model_len, self.renderer.env.max_chars,
                                          "messages") from exc
            raise bad_request(f"Could not apply the chat template: {exc}", "messages") from exc
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
            raise bad_request(f"Could not apply the chat template: {exc}", "messages") from exc
        self.check_prompt(prompt, param="messages", room=room)
        ids = await self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
        if not ids:
            raise bad_request("The rendered prompt is empty.", param="messages")
        return prompt, ids

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        check_unsupported(request)
        check_not_supported(request, CHAT_FIELDS_NOT_SUPPORTED)
        self.check_priority(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", param="top_logprobs")
        choice = resolve_tool_choice(request, self.tool_parser is not None)
        if self.tool_parser is not None and choice.mode != "none":
            request = self.tool_parser(self.tokenizer.hf).adjust_request(request)
        constraint = await self.structured_outputs(request, tool_constraint(request, choice))
        lora = await self.models.resolve(request.model)
        prompt, ids = await self.render_prompt(request)
        if request.max_completion_tokens is not None:
            param, requested = "max_completion_tokens", request.max_completion_tokens
        else:
            param, requested = "max_tokens", request.max_tokens
        max_tokens = resolve_max_tokens(requested, len(ids), self.max_model_len, param)
        if requested is None and "max_new_tokens" in self.sampling_defaults:
            max_tokens = min(max_tokens, self.sampling_defaults["max_new_tokens"])
        top_k = (request.top_logprobs or 0) if request.logprobs else None
        params = build_sampling_params(request, max_tokens, top_k, self.limits.vocab_size,
                                       self.sampling_defaults, logprobs_field="top_logprobs",
                                       structured_outputs=constraint)
        if self.engine.is_dead:
            raise engine_unavailable()
        request_id = random_id("chatcmpl")
        model_name = request.model or self.models.base_model_name
        token_text = TokenText(self.tokenizer.hf, bool(request.return_tokens_as_token_ids))
        if request.use_beam_search:
            search = self.beam_search(request_id, ids,
                                      beam_search_params(request, max_tokens, top_k), lora,
                                      request.priority)
            if request.stream:
                return sse_events(self._beam_stream(request, request_id, model_name, len(ids),
                                                    search, token_text))
            return self._beam_response(request, request_id, model_name, len(ids),
                                       await search, token_text)
        await self.add_bad_words(params)
        stream = self.engine.generate(request_id, prompt, ids, params, lora, request.priority)
        if request.stream:
            return sse_events(self._stream(request, choice, request_id, model_name, len(ids),
                                           stream, token_text))
        return await self._full(request, choice, request_id, model_name, len(ids), stream,
                                token_text)

    def _role(self, request: ChatCompletionRequest) -> str:
        """vLLM's rule: the server's response role (--response-role) answers a
        generation prompt; without one the output continues the last message."""
        if request.add_generation_prompt or not request.messages:
            return self.response_role
        return request.messages[-1].role

    async def _full(
        self,
        request: ChatCompletionRequest,
        choice: ToolChoice,
        request_id: str,
        model_name: str,
        prompt_len: int,
        stream: AsyncIterator[Any],
        token_text: TokenText,
    ) -> ChatCompletionResponse:
        (outputs,) = await final_outputs([stream])
        choices = []
        for out in outputs:
            content, calls = self._tool_calls(request, choice, out.text)
            choices.append(ChatCompletionChoice(
                index=out.index,
                message=ChatResponseMessage(role=self._role(request), content=content,
                                            tool_calls=calls),
                logprobs=_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0,
                                   token_text) if request.logprobs else None,
                finish_reason=finish_reason(choice, bool(calls), out.finish_reason),
                stop_reason=out.stop_reason,
            ))
        completion_tokens = sum(len(out.token_ids) for out in outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=UsageInfo.of(prompt_len, completion_tokens),
        )

    def _beam_response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        prompt_len: int,
        beams: list[Beam],
        token_text: TokenText,
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionChoice(
                index=i,
                message=ChatResponseMessage(role=self._role(request), content=beam.text),
                logprobs=_logprobs(beam.token_ids, beam.logprobs, request.top_logprobs or 0,
                                   token_text) if request.logprobs else None,
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
            )
            for i, beam in enumerate(beams)
        ]
        return ChatCompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo.of(prompt_len, sum(len(b.token_ids) for b in beams)),
        )

    async def _beam_stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        prompt_len: int,
        search: Awaitable[list[Beam]],
        token_text: TokenText,
    ) -> AsyncIterator[str]:
        """As vLLM streams beam search: nothing until the search is done, then each
        beam's role chunk, and one chunk per beam with its whole text."""
        beams = await search
        response = self._beam_response(request, request_id, model_name, prompt_len, beams,
                                       token_text)
        include_usage, continuous_usage = usage_options(request)
        for choice in response.choices:
            yield _sse_chunk(request_id, response.created, model_name, [ChatStreamChoice(
                index=choice.index, delta=DeltaMessage(role=choice.message.role, content=""))])
        for choice, beam in zip(response.choices, beams, strict=True):
            usage = UsageInfo.of(prompt_len, len(beam.token_ids)) if continuous_usage else None
            yield _sse_chunk(request_id, response.created, model_name, [ChatStreamChoice(
                index=choice.index, delta=DeltaMessage(content=choice.message.content),
                logprobs=choice.logprobs, finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason)], usage)
        if include_usage:
            yield _sse_chunk(request_id, response.created, model_name, [], response.usage)

    def _tool_calls(self, request: ChatCompletionRequest, choice: ToolChoice,
                    text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's content and tool calls."""
        parser = answer_parser(choice, self.tool_parser, self.tokenizer.hf)
        if parser is None:
            return text, []
        found = parser.extract_tool_calls(text, request)
        if not found.tools_called:
            return found.content or text, []
        calls = found.tool_calls[:1] if request.parallel_tool_calls is False \
            else found.tool_calls
        # As vLLM: a constrained answer is all calls, its content empty, not null.
        return (found.content or "") if choice.constrained else found.content, calls

    async def _stream(
        self,
        request: ChatCompletionRequest,
        choice: ToolChoice,
        request_id: str,
        model_name: str,
        prompt_len: int,
        stream: AsyncIterator[Any],
        token_text: TokenText,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = usage_options(request)
        choice_tokens = [0] * request.n

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and continuous_usage and choices:
                # Per choice, as vLLM counts continuous usage.
                usage = UsageInfo.of(prompt_len, choice_tokens[choices[0].index])
            return _sse_chunk(request_id, created, model_name, choices, usage)

        # The first chunk of each choice carries the role, as OpenAI's does.
        for index in range(request.n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(
                role=self._role(request), content=""))])
        finished: set[int] = set()
        completion_tokens = 0
        # Per choice: what reads its tool calls (None: plain text), its text so far,
        # and whether it streamed a call.
        parsers = [answer_parser(choice, self.tool_parser, self.tokenizer.hf)
                   for _ in range(request.n)]
        texts = [""] * request.n
        token_ids: list[list[int]] = [[] for _ in range(request.n)]
        called = [False] * request.n
        async with aclosing(stream):
            async for output in stream:
                for out in output.outputs:
                    if out.index in finished:
                        continue
                    if out.finish_reason == "error":
                        raise finish_error([out])
                    completion_tokens += len(out.delta_token_ids)
                    choice_tokens[out.index] += len(out.delta_token_ids)
                    # One chunk per step that made tokens, as vLLM does, even when
                    # they give no text yet (half a character, a possible stop
                    # string): clients time tokens by chunks.
                    if not out.delta_text and not out.delta_token_ids and not out.finish_reason:
                        continue
                    i = out.index
                    parser = parsers[i]
                    if parser is None:
                        delta = DeltaMessage(content=out.delta_text)
                    else:
                        delta = _tool_delta(parser, request, texts[i], token_ids[i], out)
                        if delta is not None and delta.tool_calls:
                            called[i] = True
                        texts[i] += out.delta_text
                    logprobs = None
                    if request.logprobs:
                        logprobs = _logprobs(out.delta_token_ids, out.delta_logprobs,
                                             request.top_logprobs or 0, token_text)
                    if delta is None:
                        # A tool parser holding text back: as vLLM, no chunk.
                        if out.finish_reason is None and logprobs is None:
                            continue
                        delta = DeltaMessage()
                    if out.finish_reason is not None:
                        finished.add(i)
                    yield chunk([ChatStreamChoice(
                        index=i,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=finish_reason(choice, called[i], out.finish_reason,
                                                    streamed=True),
                        stop_reason=out.stop_reason,
                    )])
        if include_usage:
            yield chunk([], UsageInfo.of(prompt_len, completion_tokens))


def _sse_chunk(request_id: str, created: int, model_name: str,
               choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
    """One streamed chunk; usage only where given, deltas without their unset fields."""
    body = ChatCompletionChunk(
        id=request_id, created=created, model=model_name, choices=choices, usage=usage
    )
    data = body.model_dump()
    if usage is None:
        del data["usage"]
    for item, choice in zip(data["choices"], choices, strict=True):
        item["delta"] = choice.delta.model_dump(exclude_none=True)
    return sse(data)


def _tool_delta(parser: ToolParser, request: ChatCompletionRequest, previous_text: str,
                previous_ids: list[int], out: Any) -> DeltaMessage | None:
    """One streamed step of an answer that may hold tool calls, through its parser
    (and, on the last step, what the parser held back). `previous_ids` grows."""
    current_ids = previous_ids + list(out.delta_token_ids)
    current_text = previous_text + out.delta_text
    delta = parser.extract_tool_calls_streaming(
        previous_text, current_text, out.delta_text, list(previous_ids), current_ids,
        list(out.delta_token_ids), request)
    previous_ids[:] = current_ids
    if out.finish_reason is not None:
        delta = _merged(delta, parser.finish_streaming(current_text, request))
    if delta is not None and delta.tool_calls and request.parallel_tool_calls is False:
        # As vLLM: only the first call.
        delta.tool_calls = [call for call in delta.tool_calls if call.index == 0] or None
        if delta.content is None and not delta.tool_calls:
            return None
    return delta


def _merged(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    if first is None or second is None:
        return first or second
    content = (first.content or "") + (second.content or "")
    calls = (first.tool_calls or []) + (second.tool_calls or [])
    return DeltaMessage(role=first.role, content=content or None, tool_calls=calls or None)


def _logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, float]] | None,
    k: int,
    token_text: TokenText,
) -> ChatChoiceLogprobs:
    content = []
    for position, token_id in enumerate(token_ids):
        entry = logprobs[position] if logprobs and position < len(logprobs) else {}
        text = token_text(token_id)
        content.append(ChatTokenLogprob(
            token=text,
            logprob=json_logprob(entry.get(token_id, LOGPROB_FLOOR)),
            bytes=list(text.encode("utf-8")),
            top_logprobs=[
                TopLogprob(token=token_text(t), logprob=json_logprob(lp),
                           bytes=list(token_text(t).encode()))
                for t, lp in top_entries(entry, k)
            ],
        ))
    return ChatChoiceLogprobs(content=content)
