"""Turns the last-position logits of each sequence into its next token.

Order as in vLLM: raw logprobs, penalties, min_tokens masking, then greedy rows
take the argmax and the others go through temperature, top-k, top-p and min-p
before a draw from their own generator (a per-request seed is reproducible
whatever else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: [(sampled id, logprob), (top-1 id, logprob), ...] or None.
    logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = logits.clone()
        for i, row in enumerate(rows):
            _apply_penalties(logits[i], row)
            _mask_stop_tokens(logits[i], row)

        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            token_ids[idx] = logits[idx].argmax(dim=-1)
        for i, row in enumerate(rows):
            if not row.params.greedy:
                token_ids[i] = self._draw(logits[i], row)

        sampled = token_ids.tolist()
        logprobs: list[list[tuple[int, float]] | None] = []
        for i, row in enumerate(rows):
            if raw_logprobs is None or row.params.logprobs is None:
                logprobs.append(None)
                continue
            entry = [(sampled[i], float(raw_logprobs[i, sampled[i]]))]
            if row.params.logprobs > 0:
                top = torch.topk(raw_logprobs[i], row.params.logprobs)
                entry += list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            logprobs.append(entry)
        return SamplerOutput(sampled, logprobs)

    def _draw(self, logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
        p = row.params
        logits = logits / p.temperature
        vocab = logits.shape[-1]
        if 0 < p.top_k < vocab:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # Drop a token when the tokens before it already reach top_p; keep the first.
            drop = probs.cumsum(-1) - probs > p.top_p
            drop[0] = False
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        gen = row.generator or self.generator
        # Gumbel-style draw: argmax(p / q), q ~ Exp(1), equals sampling from p.
        q = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / q).argmax()


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
            dtype=torch.long, device=logits.device,
        )
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and row.output_token_ids:
        counts = torch.bincount(
            torch.tensor(row.output_token_ids, device=logits.device), minlength=logits.shape[-1]
        )[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
            logits.dtype
        )


def _mask_stop_tokens(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return
    stop_ids = list(p.stop_token_ids or [])
    if row.eos_token_id is not None and not p.ignore_eos:
        stop_ids.append(row.eos_token_id)
    if stop_ids:
        logits[torch.tensor(stop_ids, device=logits.device)] = float("-inf")
