"""Sparse mixture-of-experts MLPs (Mixtral, Qwen3-MoE, Qwen2-MoE) over the shared
Llama-family decoder.

A block routes each token to its top-k experts (softmax over the router's
logits, then top-k, renormalised where the family does), runs those experts'
SiLU MLPs and sums their outputs weighted by the routing weights. The experts'
weights are stored fused, as transformers 5 holds them: ``gate_up_proj``
[E, 2I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I]; checkpoints
with per-expert tensors (``experts.<e>.w1`` ... or ``experts.<e>.gate_proj`` ...)
load into their slices. The experts' computation runs through the ``ops`` the
model is built with: plain torch (``loraserve.model.moe_ops``) or, on a GPU,
the Triton grouped GEMM over experts.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.distributed.parallel_state import SINGLE, TensorParallel
from loraserve.model.linear import Linear
from loraserve.model.llama import MLP, LlamaFamilyForCausalLM
from loraserve.model.moe_ops import ExpertsLoRA
from loraserve.model.ops import TORCH_OPS, TorchOps

# The checkpoint names of each expert's gate, up and down projections, per family.
_EXPERT_PROJECTIONS = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
}
_PER_EXPERT_RE = re.compile(
    r"^(?P<prefix>.+\.)(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>[a-z0-9_]+)\.weight$"
)


def num_experts_of(cfg: Any) -> int:
    return int(getattr(cfg, "num_local_experts", None) or cfg.num_experts)


def expert_intermediate_size(cfg: Any) -> int:
    return int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def is_sparse_layer(cfg: Any, layer_idx: int) -> bool:
    """Qwen-MoE configs may keep some layers dense (``mlp_only_layers``,
    ``decoder_sparse_step``); Mixtral's layers are all sparse."""
    if layer_idx in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    return (layer_idx + 1) % int(getattr(cfg, "decoder_sparse_step", None) or 1) == 0


class TopKRouter(nn.Module):
    """The router (checkpoint name ``gate``): per token, the top-k experts and
    their weights, computed as transformers does."""

    def __init__(self, cfg: Any, ops: TorchOps) -> None:
        super().__init__()
        self.top_k = int(cfg.num_experts_per_tok)
        self.weight = nn.Parameter(torch.empty(num_experts_of(cfg), cfg.hidden_size))
        # Mixtral always renormalises the top-k weights; the Qwen families only
        # with norm_topk_prob, and they round the weights back to the logits' dtype.
        self.renormalize = cfg.model_type == "mixtral" or bool(
            getattr(cfg, "norm_topk_prob", False))
        self.weights_in_fp32 = cfg.model_type == "mixtral"
        self.ops = ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k], top-k expert ids [T, k])."""
        logits = self.ops.linear(x, self.weight, None)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_fp32:
            weights = weights.to(logits.dtype)
        return weights, ids


class Experts(nn.Module):
    """Every expert's SiLU MLP, fused: ``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]. A LoRA wrapper (``loraserve.lora.moe_layers``) replaces it when
    LoRA is on and passes the adapters' expert weights to the same op."""

    def __init__(self, cfg: Any, ops: TorchOps) -> None:
        super().__init__()
        num_experts, hidden = num_experts_of(cfg), cfg.hidden_size
        inter = expert_intermediate_size(cfg)
        self.num_experts = num_experts
        self.hidden_size = hidden
        self.intermediate_size = inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        lora: ExpertsLoRA | None = None,
    ) -> torch.Tensor:
        return self.ops.moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights,
                                    topk_ids, lora)


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) a shared expert scaled by a sigmoid gate."""

    def __init__(self, cfg: Any, ops: TorchOps) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        self.gate = TopKRouter(cfg, ops)
        self.experts = Experts(cfg, ops)
        shared = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
        self.shared_expert = MLP(cfg, ops, intermediate_size=shared) if shared else None
        self.shared_expert_gate = (
            Linear(cfg.hidden_size, 1, bias=False, ops=ops) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(LlamaFamilyForCausalLM):
    """Mixtral, Qwen3-MoE and Qwen2-MoE: the Llama-family decoder with sparse MoE
    MLPs. LoRA reaches attention (and dense or shared-expert MLPs) through the
    dense wrappers, and the experts' projections through ``ExpertsWithLoRA``."""

    @staticmethod
    def make_mlp(cfg: Any, layer_idx: int, ops: TorchOps, tp: TensorParallel) -> nn.Module:
        # MoE models run on one rank (config refuses tensor parallelism for them).
        if is_sparse_layer(cfg, layer_idx):
            return SparseMoeBlock(cfg, ops)
        return MLP(cfg, ops)

    def __init__(self, cfg: Any, max_model_len: int, ops: TorchOps = TORCH_OPS,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, max_model_len, ops, tp)
        self.expert_projections = _EXPERT_PROJECTIONS[cfg.model_type]
        self._dense_intermediate = _dense_intermediate_size(cfg)

    def slice_sizes(self, module_name: str) -> list[int]:
        if module_name == "gate_up_proj":
            return [self._dense_intermediate] * 2
        return super().slice_sizes(module_name)

    def expert_checkpoint_target(self, name: str) -> tuple[str, int, int, int] | None:
        """A per-expert checkpoint tensor's place in a fused expert parameter:
        (parameter, expert, first row, rows), or None for any other tensor."""
        match = _PER_EXPERT_RE.match(name)
        if match is None or match["proj"] not in self.expert_projections:
            return None
        inter = expert_intermediate_size(self.config)
        which = self.expert_projections.index(match["proj"])
        param = "down_proj" if which == 2 else "gate_up_proj"
        rows = self.config.hidden_size if which == 2 else inter
        start = inter if which == 1 else 0
        target = f"{match['prefix']}mlp.experts.{param}"
        return target, int(match["expert"]), start, rows

    def checkpoint_name(self, name: str) -> str:
        """Our name for a checkpoint tensor: Mixtral's checkpoints call the block
        ``block_sparse_moe`` where transformers 5 (and we) call it ``mlp``."""
        return name.replace(".block_sparse_moe.", ".mlp.")

    def expert_pieces(self, param_name: str) -> list[tuple[int, int]] | None:
        """The (expert, first row) pieces that per-expert tensors fill in a fused
        expert parameter; None for any other parameter."""
        leaf = param_name.rsplit(".", 1)[-1]
        if ".experts." not in param_name or leaf not in ("gate_up_proj", "down_proj"):
            return None
        starts = [0, expert_intermediate_size(self.config)] if leaf == "gate_up_proj" else [0]
        return [(e, s) for e in range(num_experts_of(self.config)) for s in starts]


def _dense_intermediate_size(cfg: Any) -> int:
    """The width of the model's dense gate/up projections: the dense layers' MLP
    or Qwen2-MoE's shared expert. One width per model, since our merged-module
    tables are keyed by module name."""
    shared = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
    dense_layers = [i for i in range(cfg.num_hidden_layers) if not is_sparse_layer(cfg, i)]
    if shared and dense_layers and shared != cfg.intermediate_size:
        raise ValueError(
            "a MoE model with both dense layers and a shared expert of another width "
            f"({cfg.intermediate_size} vs {shared}) is not supported")
    return shared or int(cfg.intermediate_size)
