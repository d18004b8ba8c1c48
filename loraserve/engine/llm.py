"""The offline API, with vLLM's names: LLM(...).generate(prompts, params, lora_request)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from loraserve.config import EngineConfig
from loraserve.engine.engine_core import EngineCore
from loraserve.engine.output_processor import OutputProcessor, RequestOutput
from loraserve.engine.tokenizer import eos_token_id, load_tokenizer
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams
from loraserve.worker.process import configure_torch_threads

PromptType = str | dict[str, Any]


class LLM:
    """Generate offline, in this process.

    >>> llm = LLM(model="path/to/model", enable_lora=True, max_loras=2)
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8),
    ...              lora_request=LoRARequest("sql", 1, "path/to/adapter"))
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        # The engine runs in this process and no API server shares its cores.
        configure_torch_threads(share_with_frontend=False)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config)
        self._eos = eos_token_id(self.tokenizer, self.config.model_config.hf_config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """``priority``: one per prompt, with the priority scheduling policy (lower
        values first)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        priorities = _per_prompt(list(priority) if priority is not None else 0, len(prompts),
                                 "priority")

        # A bad adapter fails here, before any request is queued, with its reason.
        for lora in {lr for lr in loras if lr is not None}:
            if not self.engine.lora_enabled:
                raise ValueError("a LoRA adapter was requested but LoRA is not enabled")
            if not self.engine.lora_ready(lora.lora_name) or lora.load_inplace:
                self.engine.add_lora(lora)

        processor = OutputProcessor(self.tokenizer)
        order: list[str] = []
        queued: list[str] = []
        try:
            for prompt, sp, lora, prio in zip(prompts, params, loras, priorities, strict=True):
                text, token_ids = self._tokenize(prompt)
                rid = str(next(self._ids))
                order.append(rid)
                for ecr in processor.add_request(rid, text, token_ids, sp, lora, self._eos,
                                                 prio):
                    self.engine.add_request(ecr)
                    queued.append(ecr.request_id)
        except Exception:
            # One bad prompt refuses the whole call; leave nothing behind in the engine.
            self.engine.abort_requests(queued)
            raise

        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        while processor.has_unfinished():
            step = self.engine.step()
            processed = processor.process_outputs(step.outputs, step.timestamp)
            if processed.reqs_to_abort:
                self.engine.abort_requests(processed.reqs_to_abort)
            for out in processed.request_outputs:
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in order]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    def add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> None:
        self.engine.add_lora(lora_request, pinned=pinned)

    def remove_lora(self, lora_name: str) -> bool:
        return self.engine.remove_lora(lora_name)

    def shutdown(self) -> None:
        """Stop the engine (and, with tensor parallelism, its worker processes)."""
        self.engine.shutdown()

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()


def _per_prompt(value, n: int, what: str) -> list:
    if value is None or not isinstance(value, list | tuple):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
    return list(value)
