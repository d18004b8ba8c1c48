"""POST /tokenize and /detokenize, as vLLM has them: the exact token ids the
server would use for a prompt or a chat, and text for token ids."""

from __future__ import annotations

from typing import Any

from loraserve.entrypoints.errors import bad_request
from loraserve.entrypoints.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from loraserve.entrypoints.serving_chat import OpenAIServingChat
from loraserve.entrypoints.serving_models import ServingModels


class OpenAIServingTokenization:
    def __init__(
        self, models: ServingModels, chat: OpenAIServingChat, tokenizer: Any, max_model_len: int
    ) -> None:
        self.models = models
        self.chat = chat
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        await self.models.resolve(request.model)  # 404 for an unknown name
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.")
        if request.messages is not None:
            chat = ChatCompletionRequest(
                messages=request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            _, ids = self.chat.render_prompt(chat)
        else:
            add_special = True if request.add_special_tokens is None else \
                request.add_special_tokens
            ids = self.tokenizer(request.prompt, add_special_tokens=add_special).input_ids
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        await self.models.resolve(request.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in request.tokens):
            raise bad_request(f"token ids must be in [0, {vocab}).", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
