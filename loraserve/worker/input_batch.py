"""One step's work for the model runner, built by the engine core from the
scheduler's decisions."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.worker.sampler import SamplingRow

# Stands for a token sampled by the step in flight (async scheduling); the model
# runner fills it in on the device from that step's sampled ids.
PENDING_TOKEN = -1


@dataclass
class SeqInput:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]
    lora_name: str | None
    # Set when this chunk ends the known tokens, so the step samples a new token.
    sampling: SamplingRow | None
    # Set when the request wants prompt logprobs and this chunk predicts prompt tokens.
    prompt_logprobs: PromptLogprobsInput | None = None


@dataclass
class PromptLogprobsInput:
    num_top: int  # top-k alternatives per position
    first: int  # index in the chunk of the first position whose logits are read
    targets: list[int]  # the prompt token each of those positions predicts, in order


@dataclass
class StepInput:
    seqs: list[SeqInput]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def lora_names(self) -> set[str]:
        return {s.lora_name for s in self.seqs if s.lora_name is not None}
