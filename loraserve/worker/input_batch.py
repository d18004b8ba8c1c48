"""One step's work for the model runner, built by the engine core from the
scheduler's decisions; the flat inputs the runner makes of it; and what the step
gives back."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loraserve.lora.residency import LoRAResidency
from loraserve.worker.sampler import PromptLogprobsBatch, SampledBatch, SamplingRow

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
    # Whether the step samples for this sequence. Ranks other than 0 get the step
    # without its sampling rows (only rank 0 samples) and read this instead.
    samples: bool = False

    def __post_init__(self) -> None:
        self.samples = self.samples or self.sampling is not None


@dataclass
class PromptLogprobsInput:
    num_top: int  # top-k alternatives per position
    first: int  # index in the chunk of the first position whose logits are read
    targets: list[int]  # the prompt token each of those positions predicts, in order


@dataclass
class StepInput:
    seqs: list[SeqInput]
    # Adapters of running requests, scheduled this step or not: their device slots
    # must not go to another adapter while the requests run.
    running_loras: frozenset[str] = frozenset()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def lora_names(self) -> set[str]:
        return {s.lora_name for s in self.seqs if s.lora_name is not None}

    def for_other_ranks(self) -> StepInput:
        """The step as ranks other than 0 run it: no sampling rows (they hold each
        request's whole output and generator, and only rank 0 samples)."""
        seqs = [dataclasses.replace(s, sampling=None, samples=s.samples) for s in self.seqs]
        return StepInput(seqs, self.running_loras)


@dataclass
class StepOutput:
    sampled: SampledBatch | None  # None when no sequence samples this step
    # Prompt logprobs of the sequences that asked for them (None when none did).
    prompt_logprobs: PromptLogprobsBatch | None = None
    # The worker's adapters, when they changed since its last report.
    lora: LoRAResidency | None = None


@dataclass
class PreparedInputs:
    """A step flattened into the model's inputs, one entry per token or sequence."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    token_lora_slots: list[int]
    sample_indices: list[int]
    is_decode: bool  # one token per sequence, every sequence samples
    # Pending tokens (async scheduling): where each goes in input_ids, and its
    # row in the previous step's sampled ids, which are still on the device.
    pending_dst: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    # Prompt logprobs: the rows of the hidden states whose logits are read, the
    # prompt token each predicts, and per asking sequence its row count and top-k.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_counts: list[int] = field(default_factory=list)
    prompt_num_top: list[int] = field(default_factory=list)
