"""Triton kernels; import them from their modules.

``lora_ops.add_lora_linear`` is the fused multi-LoRA op (``lora_shrink`` and
``lora_expand`` its two halves, ``lora_meta`` the per-step token grouping it
reads, ``lora_activation`` the merged gate/up projection's update fused into its
activation); ``paged_attention`` is attention over the paged KV cache;
``dense_gemm``, ``fused_norm_rope``, ``activation`` and ``argmax`` serve the
base model's decode steps.

This file imports nothing, so that importing one kernel module costs no more
than that module and a CPU install without Triton can import the package.
"""

