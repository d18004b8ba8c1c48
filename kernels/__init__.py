"""Triton kernels, installed as loraserve.kernels.

``add_lora_linear`` is the fused multi-LoRA op (see ``lora_ops`` for the
contract and CUDA-graph usage); ``LoRAMetadata`` / ``build_lora_metadata`` hold
the per-step token grouping it reads.
"""

from .lora_meta import LoRAMetadata, build_lora_metadata
from .lora_ops import add_lora_linear, launch_configs, workspace_numel

__all__ = [
    "LoRAMetadata", "add_lora_linear", "build_lora_metadata", "launch_configs", "workspace_numel",
]
