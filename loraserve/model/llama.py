"""The Llama family (Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2, Qwen3) with
merged QKV and gate/up projections, over a paged KV cache.

The forward pass takes the batch as one flat run of tokens ([T]) and an
attention metadata object from the worker; it never loops over sequences
itself (the attention backend decides how to walk the paged cache). Norms,
linear layers and the activation run through the ``ops`` the model is built
with (``loraserve.model.ops``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loraserve.distributed.parallel_state import SINGLE, TensorParallel
from loraserve.model.linear import ColumnParallelLinear, Linear, RowParallelLinear
from loraserve.model.ops import TORCH_OPS, TorchOps
from loraserve.model.rope import RotaryEmbedding, head_dim_of


def _column(in_features: int, shards: list[tuple[int, int]], bias: bool, ops: TorchOps,
            tp: TensorParallel) -> Linear:
    """A merged projection split by output rows over the ranks (one rank: whole)."""
    if tp.world_size == 1:
        return Linear(in_features, sum(n for _, n in shards), bias=bias, ops=ops)
    return ColumnParallelLinear(in_features, shards, bias, tp, ops)


def _row(in_features: int, out_features: int, bias: bool, ops: TorchOps,
         tp: TensorParallel) -> Linear:
    """A projection split by input columns over the ranks (one rank: whole)."""
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias=bias, ops=ops)
    return RowParallelLinear(tp.shard(in_features), out_features, bias, tp, ops)


def kv_head_shard(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, count) of this rank: split when there are enough heads,
    else one head, replicated over the ranks whose query heads share it."""
    if num_kv_heads >= tp.world_size:
        return tp.shard(num_kv_heads)
    return tp.rank * num_kv_heads // tp.world_size, 1


def check_tensor_parallel(cfg: Any, world_size: int) -> None:
    """Raise ValueError unless the model's heads and MLP split over ``world_size``."""
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    problems = []
    if heads % world_size:
        problems.append(f"num_attention_heads {heads}")
    if kv % world_size and world_size % kv:
        problems.append(f"num_key_value_heads {kv} (nor is it a multiple of it)")
    for name in ("intermediate_size", "hidden_size"):
        if getattr(cfg, name) % world_size:
            problems.append(f"{name} {getattr(cfg, name)}")
    if problems:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         + ", ".join(problems))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(residual + x), residual + x)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, ops: TorchOps,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # This rank's heads (all of them on one rank).
        total_heads = cfg.num_attention_heads
        self.num_heads = total_heads // tp.world_size
        first_kv, self.num_kv_heads = kv_head_shard(
            getattr(cfg, "num_key_value_heads", None) or total_heads, tp)
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = (bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
                or bool(getattr(cfg, "qkv_bias", False)))
        kv_shard = (first_kv * self.head_dim, self.kv_size)
        self.qkv_proj = _column(
            cfg.hidden_size, [(tp.rank * self.q_size, self.q_size), kv_shard, kv_shard],
            bias, ops, tp)
        self.o_proj = _row(total_heads * self.head_dim, cfg.hidden_size, bool(
            getattr(cfg, "attention_bias", False)) and cfg.model_type not in ("qwen2", "qwen3"),
            ops, tp)
        self.qk_norm = cfg.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.sliding_window = _sliding_window(cfg, layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache, attn) -> torch.Tensor:
        return self.o_proj(self.attend(positions, *self.project_qkv(x), kv_cache, attn))

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of x, before the rotary."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return q, k, v

    def attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, kv_cache, attn) -> torch.Tensor:
        """The attention output [T, Hq * D], before o_proj; stores k and v in the cache."""
        # The backend rotates q and k (on a GPU with the KV cache write, one kernel).
        out = attn.forward(q, k, v, kv_cache, self.scale, self.sliding_window,
                           rotary=self.rotary, positions=positions)
        return out.reshape(-1, self.q_size)


def _sliding_window(cfg: Any, layer_idx: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    if cfg.model_type in ("qwen2", "qwen3", "qwen2_moe"):
        if not getattr(cfg, "use_sliding_window", False):
            return None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        return window if layer_idx >= getattr(cfg, "max_window_layers", 0) else None
    return window


class MLP(nn.Module):
    def __init__(self, cfg: Any, ops: TorchOps, tp: TensorParallel = SINGLE,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        # An explicit width: a MoE model's shared expert (loraserve.model.moe).
        inter = intermediate_size or cfg.intermediate_size
        # This rank's columns of the intermediate activation.
        shard = tp.shard(inter)
        self.intermediate_size = shard[1]
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = _column(cfg.hidden_size, [shard, shard], bias, ops, tp)
        self.down_proj = _row(inter, cfg.hidden_size, bias, ops, tp)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The projection and its activation as one step: on a GPU the decode GEMM's
        # epilogue applies it (Linear), and a LoRA wrapper adds its update inside
        # the activation (loraserve.lora.layers).
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


# Builds a layer's MLP: (config, layer index, ops, tensor parallelism) -> module of x.
MLPFactory = Callable[[Any, int, TorchOps, TensorParallel], nn.Module]


def dense_mlp(cfg: Any, layer_idx: int, ops: TorchOps, tp: TensorParallel) -> nn.Module:
    return MLP(cfg, ops, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, rotary: RotaryEmbedding, ops: TorchOps,
                 tp: TensorParallel = SINGLE, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, rotary, ops, tp)
        self.mlp = make_mlp(cfg, layer_idx, ops, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, attn):
        """Returns (this layer's output delta, the running residual stream); the
        next norm adds them, so add and norm fuse into one kernel on a GPU."""
        q, k, v, residual = self.before_attention(hidden, residual)
        return self.after_attention(self.self_attn.attend(positions, q, k, v, kv_cache, attn),
                                    residual)

    # The layer in the two parts around its attention, which piecewise CUDA graphs
    # capture apart (loraserve.worker.piecewise_graphs).

    def before_attention(self, hidden, residual):
        """(q, k, v, residual): the input norm and the QKV projection."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project_qkv(hidden), residual)

    def after_attention(self, attn_out, residual):
        """(output delta, residual): o_proj, the second norm and the MLP."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out),
                                                         residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, max_model_len: int, ops: TorchOps,
                 tp: TensorParallel = SINGLE, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        # Replicated on every rank under tensor parallelism (as is the lm_head).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg, max_model_len)
        # One rotary table shared by every layer; registered once here.
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, ops, tp, make_mlp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, input_ids, positions, kv_caches, attn) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn)
        return self.norm(hidden, residual)[0]


class LlamaFamilyForCausalLM(nn.Module):
    # Checkpoint projection name -> (our merged module, slice index).
    stacked_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Our linear modules that take LoRA, with the checkpoint names of their slices.
    lora_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "o_proj": ("o_proj",),
        "gate_up_proj": ("gate_proj", "up_proj"),
        "down_proj": ("down_proj",),
        "embed_tokens": ("embed_tokens",),
        "lm_head": ("lm_head",),
    }

    # Each layer's MLP; a MoE family (loraserve.model.moe) builds sparse blocks.
    make_mlp: MLPFactory = staticmethod(dense_mlp)

    def __init__(self, cfg: Any, max_model_len: int, ops: TorchOps = TORCH_OPS,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if tp.world_size > 1:
            check_tensor_parallel(cfg, tp.world_size)
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, max_model_len, ops, tp, type(self).make_mlp)
        attn = self.model.layers[0].self_attn
        # This rank's attention heads (the KV cache holds num_kv_heads of them).
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, ops=ops)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, attn) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def slice_sizes(self, module_name: str) -> list[int]:
        """Output widths of the slices of one of our LoRA-capable modules (this
        rank's share under tensor parallelism)."""
        attn = self.model.layers[0].self_attn
        inter = getattr(self.model.layers[0].mlp, "intermediate_size", None)
        return {
            "qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
            "o_proj": [self.config.hidden_size],
            "gate_up_proj": [inter, inter],
            "down_proj": [self.config.hidden_size],
            "embed_tokens": [self.config.hidden_size],
            "lm_head": [self.config.vocab_size],
        }[module_name]

    def full_slice_sizes(self, module_name: str) -> list[int]:
        """Output widths of a module's slices in the checkpoint (and in an
        adapter): the whole model's, whichever rank this is."""
        if self.tp.world_size == 1:
            return self.slice_sizes(module_name)
        cfg, head_dim = self.config, self.model.layers[0].self_attn.head_dim
        q = cfg.num_attention_heads * head_dim
        kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
        full = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
        return full.get(module_name) or self.slice_sizes(module_name)
