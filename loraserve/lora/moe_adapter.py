"""Read the experts' part of a PEFT adapter of a MoE model into per-expert A and B
(``ExpertsModuleLoRA``), with the scaling folded into B.

Two PEFT layouts exist:

- ``target_parameters`` (PEFT's LoRA on an ``nn.Parameter``, what PEFT makes for
  transformers 5's fused experts): one A/B pair per fused parameter, saved
  under the experts module, nested wrappers adding ``.base_layer``::

      ...mlp.experts[.base_layer].lora_A.weight   [E * r, K]
      ...mlp.experts[.base_layer].lora_B.weight   [N, E * r]

  Expert e's A is rows e*r .. e*r+r of lora_A, and its B the columns e, e+E,
  e+2E ... of lora_B (PEFT reshapes B to [N, r, E]). Which parameter a pair
  adapts follows from its shapes: gate_up_proj takes K = hidden and gives
  N = 2 * intermediate, down_proj the reverse widths.
- per-expert modules (adapters trained on transformers 4's per-expert
  ``nn.Linear`` layers): ``...experts.<e>.w1`` / ``w3`` / ``w2`` (Mixtral) or
  ``gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen-MoE), with separate gate and
  up adapters. Their gate and up pairs become one pair of the fused gate/up
  projection of rank r_gate + r_up (A stacked, B block-diagonal): the same update.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from loraserve.lora.errors import LoRAError, rank_too_large
from loraserve.lora.peft_config import PeftConfig

_FUSED_RE = re.compile(r"^(?P<experts>.+\.experts)(?:\.base_layer)*$")
_PER_EXPERT_RE = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")
_PARAMS = ("gate_up_proj", "down_proj")


@dataclass
class ExpertsModuleLoRA:
    """One adapter's weights for one experts layer, per projection (gate_up, down):
    A [E, r, K] and scaled B [E, N, r], or None where the adapter leaves the
    projection out."""

    lora_a: list[torch.Tensor | None]
    lora_b: list[torch.Tensor | None]

    @property
    def rank(self) -> int:
        return max((a.shape[1] for a in self.lora_a if a is not None), default=0)


@dataclass(frozen=True)
class ExpertsInfo:
    """An experts layer as adapters see it."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    # Checkpoint names of one expert's gate, up and down projections.
    projections: tuple[str, str, str]


def experts_path_of(source: str, experts: dict[str, ExpertsInfo]) -> str | None:
    """The experts layer an adapter module name belongs to, or None."""
    source = source.replace(".block_sparse_moe.", ".mlp.")
    for pattern in (_FUSED_RE, _PER_EXPERT_RE):
        match = pattern.match(source)
        if match is not None and match["experts"] in experts:
            return match["experts"]
    return None


def load_expert_loras(
    lora_name: str,
    config: PeftConfig,
    pairs: dict[str, dict[str, torch.Tensor]],
    experts: dict[str, ExpertsInfo],
    max_lora_rank: int,
    dtype: torch.dtype,
    target_modules: list[str] | None,
) -> dict[str, ExpertsModuleLoRA]:
    """Per experts layer, the adapter's weights; ``pairs`` maps each experts module
    name of the adapter to its {"A": tensor, "B": tensor}."""
    fused: dict[str, list] = {}
    per_expert: dict[str, dict[tuple[int, int], tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for source, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(lora_name,
                            f"module {source!r} lacks its lora_{'AB'[('A' in ab)]} tensor")
        path = experts_path_of(source, experts)
        info = experts[path]
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2:
            raise LoRAError(lora_name, f"module {source!r}: LoRA tensors must be 2-D")
        match = _PER_EXPERT_RE.match(source.replace(".block_sparse_moe.", ".mlp."))
        if match is None:
            which = _fused_param(lora_name, source, a, b, info)
            pair = fused.setdefault(path, [None, None])
            if pair[which] is not None:
                raise LoRAError(lora_name, f"two LoRA pairs adapt {path}.{_PARAMS[which]}")
            pair[which] = _split_fused(lora_name, config, source, path, which, a, b, info,
                                       max_lora_rank)
            continue
        expert, proj = int(match["expert"]), match["proj"]
        if proj not in info.projections or expert >= info.num_experts:
            raise LoRAError(lora_name, f"target module {source!r} does not exist in the model")
        which = info.projections.index(proj)
        _check_rank(lora_name, a.shape[0], max_lora_rank)
        in_f = info.intermediate_size if which == 2 else info.hidden_size
        out_f = info.hidden_size if which == 2 else info.intermediate_size
        if a.shape[1] != in_f or b.shape != (out_f, a.shape[0]):
            raise LoRAError(
                lora_name, f"module {source!r}: lora_A has shape {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the model wants ({a.shape[0]}, {in_f}) and "
                f"({out_f}, {a.shape[0]})")
        scaled = b.float() * config.scaling(source, a.shape[0])
        per_expert.setdefault(path, {})[expert, which] = (source, a.float(), scaled)

    out: dict[str, ExpertsModuleLoRA] = {}
    for path, (gate_up, down) in fused.items():
        out[path] = ExpertsModuleLoRA(
            [gate_up[0] if gate_up else None, down[0] if down else None],
            [gate_up[1] if gate_up else None, down[1] if down else None])
    for path, pieces in per_expert.items():
        if path in out:
            raise LoRAError(lora_name, f"{path} is adapted both per expert and as fused "
                            "parameters")
        out[path] = _merge_per_expert(lora_name, pieces, experts[path], max_lora_rank)
    for path, entry in out.items():
        for i, param in enumerate(_PARAMS):
            if target_modules is not None and not {"experts", param} & set(target_modules):
                entry.lora_a[i] = entry.lora_b[i] = None  # --lora-target-modules
        entry.lora_a = [_cast(lora_name, path, t, dtype) for t in entry.lora_a]
        entry.lora_b = [_cast(lora_name, path, t, dtype) for t in entry.lora_b]
    return {path: entry for path, entry in out.items() if entry.rank > 0}


def _fused_param(lora_name: str, source: str, a, b, info: ExpertsInfo) -> int:
    hidden, inter = info.hidden_size, info.intermediate_size
    widths = (a.shape[1], b.shape[0])
    if widths == (hidden, 2 * inter):
        return 0
    if widths == (inter, hidden):
        return 1
    raise LoRAError(
        lora_name, f"module {source!r}: lora_A has shape {tuple(a.shape)} and lora_B "
        f"{tuple(b.shape)}, which fit neither experts.gate_up_proj (in {hidden}, out "
        f"{2 * inter}) nor experts.down_proj (in {inter}, out {hidden})")


def _split_fused(lora_name, config, source, path, which, a, b, info, max_lora_rank):
    """PEFT's [E*r, K] and [N, E*r] as per-expert A [E, r, K] and scaled B [E, N, r]."""
    num_experts = info.num_experts
    if a.shape[0] % num_experts or b.shape[1] != a.shape[0]:
        raise LoRAError(
            lora_name, f"module {source!r}: lora_A has {a.shape[0]} rows and lora_B "
            f"{b.shape[1]} columns; both must be num_experts ({num_experts}) times the rank")
    rank = a.shape[0] // num_experts
    _check_rank(lora_name, rank, max_lora_rank)
    scale = config.scaling(f"{path}.{_PARAMS[which]}", rank)
    per_a = a.float().reshape(num_experts, rank, a.shape[1])
    per_b = b.float().reshape(b.shape[0], rank, num_experts).permute(2, 0, 1) * scale
    return per_a, per_b


def _merge_per_expert(lora_name, pieces, info: ExpertsInfo, max_lora_rank: int):
    """Per-expert gate, up and down pairs as fused-layout stacks (zero where an
    expert or projection is not adapted; gate and up share one rank budget)."""
    num_experts, hidden, inter = info.num_experts, info.hidden_size, info.intermediate_size

    def rank_of(expert: int, which: int) -> int:
        piece = pieces.get((expert, which))
        return piece[1].shape[0] if piece is not None else 0

    gate_up_rank = max(rank_of(e, 0) + rank_of(e, 1) for e in range(num_experts))
    down_rank = max(rank_of(e, 2) for e in range(num_experts))
    if gate_up_rank > max_lora_rank:
        raise LoRAError(
            lora_name, f"per-expert gate and up adapters of ranks adding up to {gate_up_rank} "
            f"become one fused gate/up adapter of that rank, greater than max_lora_rank "
            f"{max_lora_rank}; start the server with --max-lora-rank {gate_up_rank} or more")
    result = ExpertsModuleLoRA([None, None], [None, None])
    if gate_up_rank:
        a = torch.zeros(num_experts, gate_up_rank, hidden)
        b = torch.zeros(num_experts, 2 * inter, gate_up_rank)
        for e in range(num_experts):
            offset = 0
            for half in (0, 1):
                piece = pieces.get((e, half))
                if piece is None:
                    continue
                _, pa, pb = piece
                r = pa.shape[0]
                a[e, offset:offset + r] = pa
                b[e, half * inter:(half + 1) * inter, offset:offset + r] = pb
                offset += r
        result.lora_a[0], result.lora_b[0] = a, b
    if down_rank:
        a = torch.zeros(num_experts, down_rank, inter)
        b = torch.zeros(num_experts, hidden, down_rank)
        for e in range(num_experts):
            piece = pieces.get((e, 2))
            if piece is not None:
                r = piece[1].shape[0]
                a[e, :r], b[e, :, :r] = piece[1], piece[2]
        result.lora_a[1], result.lora_b[1] = a, b
    return result


def _check_rank(lora_name: str, rank: int, max_lora_rank: int) -> None:
    if rank > max_lora_rank:
        raise rank_too_large(lora_name, rank, max_lora_rank)


def _cast(lora_name: str, path: str, tensor: torch.Tensor | None, dtype: torch.dtype):
    if tensor is None:
        return None
    cast = tensor.to(dtype).contiguous()
    if not bool(torch.isfinite(cast).all()):
        raise LoRAError(lora_name, f"the LoRA weights of {path} overflow {dtype} (the lora "
                        "dtype) once scaled")
    return cast
