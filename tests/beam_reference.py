"""Beam search as vLLM defines it, computed with the transformers(+PEFT) model in
fp32 on whole sequences (no cache, no engine): the reference the served beam
search must match, beam for beam, in order, with the same cumulative logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class RefBeam:
    token_ids: list[int]
    cum_logprob: float
    score: float
    finished: bool


class Reference:
    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_dir))
        self.model = model.eval()
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def next_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        key = tuple(token_ids)
        if key not in self._cache:
            logits = self.model(input_ids=torch.tensor([token_ids])).logits[0, -1]
            self._cache[key] = torch.log_softmax(logits.float(), dim=-1)
        return self._cache[key]

    def beam_search(
        self,
        prompt: list[int],
        width: int,
        n: int,
        max_tokens: int,
        eos: int,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        stop_token_ids: tuple[int, ...] = (),
        min_tokens: int = 0,
        early_stopping: bool = False,
    ) -> list[RefBeam]:
        ending = set(stop_token_ids) | ({eos} if not ignore_eos else set())
        uncounted = set(stop_token_ids) | {eos}

        def score(tokens: list[int], cum: float) -> float:
            sequence = prompt + tokens
            length = len(sequence) - (1 if sequence[-1] in uncounted else 0)
            return cum / length ** length_penalty

        live: list[tuple[list[int], float]] = [([], 0.0)]
        done: list[tuple[list[int], float]] = []
        for _ in range(max_tokens):
            candidates = []
            for tokens, cum in live:
                top = torch.topk(self.next_logprobs(prompt + tokens), 2 * width)
                for logprob, token in zip(top.values.tolist(), top.indices.tolist(),
                                          strict=True):
                    if token in ending:
                        if len(tokens) >= min_tokens:
                            kept = tokens + [token] if include_stop_str_in_output else tokens
                            done.append((kept, cum + logprob))
                        continue
                    candidates.append((tokens + [token], cum + logprob))
            candidates.sort(key=lambda c: c[1], reverse=True)
            live = candidates[:width]
            if early_stopping and len(done) >= width:
                live = []
                break
        pool = [RefBeam(t, c, score(t, c), True) for t, c in done]
        pool += [RefBeam(t, c, score(t, c), False) for t, c in live]
        pool.sort(key=lambda b: b.score, reverse=True)
        return pool[:n]
