"""Rotary position embeddings as the config says (default, linear, llama3, yarn...).

transformers computes the inverse frequencies for the scaled rope types; we use
its functions so that our positions match the reference model exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any) -> dict:
    # transformers 5 keeps everything in `rope_parameters`; 4.x splits it into
    # `rope_scaling` and `rope_theta`.
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def head_dim_of(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position up to max_model_len."""

    def __init__(self, hf_config: Any, max_model_len: int) -> None:
        super().__init__()
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        dim = int(head_dim_of(hf_config) * getattr(hf_config, "partial_rotary_factor", 1.0))
        if rope_type == "default":
            theta = params["rope_theta"]
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' depends on the sequence length; not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope_type {rope_type!r} is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        positions = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float().to(positions.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = dim
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def _apply(self, fn, recurse=True):
        # Keep the tables in fp32 when the model is cast to half precision.
        super()._apply(fn, recurse)
        self.cos = self.cos.float()
        self.sin = self.sin.float()
        return self

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated (rotate-half convention), in torch.
        The Triton attention backend rotates with kernels instead, from ``cos`` and
        ``sin`` (loraserve.worker.triton_attention)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    xf = x_rot.float()
    half = dim // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = (xf * cos + rotated * sin).to(x.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out
