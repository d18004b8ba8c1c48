"""Which Hugging Face architectures we implement, and how to build them."""

from __future__ import annotations

from typing import Any

import torch

from loraserve.distributed.parallel_state import SINGLE, TensorParallel
from loraserve.model.llama import LlamaFamilyForCausalLM
from loraserve.model.moe import MoeForCausalLM
from loraserve.model.ops import TORCH_OPS, TorchOps

# Every listed family shares one decoder implementation; the differences
# (QKV bias, q/k norm, sliding window) are read from the config. The MoE
# families swap the dense MLP for a sparse MoE block (loraserve.model.moe).
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)


class UnsupportedModelError(ValueError):
    pass


def check_architecture(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"model architecture {archs or '(none given)'} is not supported; loraserve supports "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    ops: TorchOps = TORCH_OPS,
    tp: TensorParallel = SINGLE,
) -> LlamaFamilyForCausalLM:
    """The model for ``hf_config``, its layers computed by ``ops`` (the backend's),
    holding this rank's shard under tensor parallelism ``tp``."""
    arch = check_architecture(hf_config)
    family = MoeForCausalLM if arch in MOE_ARCHITECTURES else LlamaFamilyForCausalLM
    if family is MoeForCausalLM and tp.world_size > 1:
        raise ValueError(f"{arch}: tensor parallelism is not supported for MoE models")
    # Build straight on the device in the target dtype: no full-size fp32 copy.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = family(hf_config, max_model_len=max_model_len, ops=ops, tp=tp)
    finally:
        torch.set_default_dtype(previous)
    return model
