"""POST /tokenize and /detokenize, as vLLM has them: the exact token ids the
server would use for a prompt or a chat, and text for token ids."""

from __future__ import annotations

from loraserve.entrypoints.errors import bad_request
from loraserve.entrypoints.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from loraserve.entrypoints.request_tokenizer import RequestTokenizer
from loraserve.entrypoints.serving_chat import OpenAIServingChat
from loraserve.entrypoints.serving_common import (
    ModelLimits,
    check_prompt_size,
    check_token_ids,
)
from loraserve.entrypoints.serving_models import ServingModels


class OpenAIServingTokenization:
    def __init__(
        self, models: ServingModels, chat: OpenAIServingChat, tokenizer: RequestTokenizer,
        limits: ModelLimits,
    ) -> None:
        self.models = models
        self.chat = chat
        self.tokenizer = tokenizer
        self.limits = limits

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        await self.models.resolve(request.model)  # 404 for an unknown name
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.")
        if request.messages is not None:
            chat = ChatCompletionRequest(
                messages=request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            # Only counted: it may fill the whole context.
            _, ids = await self.chat.render_prompt(chat, room=0)
        else:
            add_special = True if request.add_special_tokens is None else \
                request.add_special_tokens
            self._check(request.prompt, "prompt")
            ids = await self.tokenizer.encode(request.prompt, add_special_tokens=add_special)
        return TokenizeResponse(count=len(ids), max_model_len=self.limits.max_model_len,
                                tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        await self.models.resolve(request.model)
        # Ids the model can produce, and ids of tokens added past its embedding.
        known = max(self.limits.vocab_size, len(self.tokenizer.hf))
        self._check(request.tokens, "tokens")
        check_token_ids(request.tokens, known, "tokens")
        return DetokenizeResponse(prompt=await self.tokenizer.decode(request.tokens))

    def _check(self, prompt: str | list[int], param: str) -> None:
        # As every endpoint checks a prompt, with no room needed for an output.
        check_prompt_size(self.tokenizer, self.limits.max_model_len, prompt, param, room=0)
