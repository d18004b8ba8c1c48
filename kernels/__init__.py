"""Triton kernels, installed as loraserve.kernels.

``add_lora_linear`` is the fused multi-LoRA op (see ``lora_ops`` for the
contract and CUDA-graph usage); ``LoRAMetadata`` / ``build_lora_metadata`` hold
the per-step token grouping it reads; ``lora_shrink`` and ``lora_expand`` are its
two halves. ``silu_and_mul_lora`` is the merged gate/up projection's LoRA
update fused into its activation.
"""

from .lora_activation import silu_and_mul_lora
from .lora_meta import LoRAMetadata, build_lora_metadata
from .lora_ops import add_lora_linear, launch_configs, lora_expand, lora_shrink, workspace_numel

__all__ = [
    "LoRAMetadata", "add_lora_linear", "build_lora_metadata", "launch_configs", "lora_expand",
    "lora_shrink", "silu_and_mul_lora", "workspace_numel",
]
